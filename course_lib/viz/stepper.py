"""Step through a recorded ring run: which ranks' contributions every chunk holds after each step.

Nothing here knows the ring's schedule. `chunk_history` replays the messages the ranks recorded
(`course_lib.traffic` events: phase, step, peer, chunk) on a starting state:

    state after step s = state before step s, where for every message of step s
        sender p -> receiver q, chunk c:   q's chunk c  <-  q's chunk c  +  p's chunk c   (reducing phase)
                                           q's chunk c  <-                   p's chunk c   (copying phase)

using p's chunk as it was when the step began. If the ring sends the wrong chunk, the pictures
show the wrong chunk; `decode_chunks` on the real tensor values then tells you whether the
replay and the numbers agree.

    rs, ag = viz.ring_histories(recordings)     # recordings of allreduce.ring on every rank
    print(viz.messages_text(rs))                # who sent which partial sum to whom, step by step
    viz.draw_steps(rs)                          # static: one small table per step
    viz.Stepper(rs)                             # interactive: a slider and a play button
"""

from __future__ import annotations

import io
import textwrap
from dataclasses import dataclass, field

from course_lib.viz.buffers import (_new_figure, _style, draw_cells, provenance_label, rank_name)

__all__ = ["Message", "ChunkHistory", "chunk_history", "ring_histories", "messages_text", "draw_step",
           "draw_steps", "Stepper"]

# Which phases add what arrives to what is there, and which overwrite.
REDUCING_PHASES = {"scatter_reduce", "reduce_scatter", "reduce"}
COPYING_PHASES = {"all_gather", "broadcast", "gather", "scatter"}


@dataclass(frozen=True)
class Message:
    """One chunk moving from one rank to another in one step, and what it carried."""

    step: int
    src: int
    dst: int
    chunk: int
    numel: int
    carries: frozenset  # the ranks whose contributions the sent chunk held

    def describe(self, world_size: int | None = None) -> str:
        return (f"rank {self.src} ({rank_name(self.src)}) -> rank {self.dst} ({rank_name(self.dst)}): "
                f"chunk {self.chunk} holding {provenance_label(self.carries, world_size)}, {self.numel} element(s)")


@dataclass
class ChunkHistory:
    """Every rank's chunks before and after each step of one or more phases.

    Attributes:
        world_size: G.
        states: states[k][r][c] is the set of ranks whose contributions rank r's chunk c holds
            after k steps; states[0] is the starting state.
        messages: messages[s] lists the messages of step s (0-based).
        step_names: a title for each step, e.g. 'scatter_reduce step 0'.
    """

    world_size: int
    states: list
    messages: list
    step_names: list = field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.messages)

    @property
    def final(self) -> list:
        return self.states[-1]

    def received(self, step: int) -> set:
        """(rank, chunk) cells that step `step` wrote into."""
        return {(m.dst, m.chunk) for m in self.messages[step]}

    def sent(self, step: int) -> set:
        return {(m.src, m.chunk) for m in self.messages[step]}

    def complete(self, k: int | None = None) -> dict:
        """{rank: [chunks holding every rank's contribution]} after k steps (default: at the end)."""
        state = self.states[-1 if k is None else k]
        everyone = frozenset(range(self.world_size))
        return {r: [c for c, ranks in enumerate(row) if ranks == everyone] for r, row in enumerate(state)}

    def then(self, other: "ChunkHistory") -> "ChunkHistory":
        """This history followed by `other`, which must start where this one ends."""
        if other.states[0] != self.states[-1]:
            raise ValueError("the second history does not start from the state the first one ends in")
        return ChunkHistory(self.world_size, self.states + other.states[1:], self.messages + other.messages,
                            self.step_names + other.step_names)


def _rank_of(recording, index):
    return index if recording.rank is None else recording.rank


def chunk_history(recordings, phase: str, start=None, combine: bool | None = None) -> ChunkHistory:
    """Replay the messages of `phase` from every rank's recording.

    Args:
        recordings: one `traffic.Recording` per rank (index = rank), as returned by `launch`.
        phase: the phase label to replay, e.g. 'scatter_reduce' or 'all_gather'.
        start: start[r][c], the ranks whose data rank r's chunk c holds before the phase.
            Default: every rank holds only its own data in each of G chunks.
        combine: True if a received chunk is added to the receiver's copy, False if it replaces
            it. Default: decided by the phase name (reducing: scatter_reduce, reduce_scatter, reduce).

    Returns:
        A `ChunkHistory` with one state per step.

    Raises:
        ValueError: if a received message has no matching send in the sender's recording (same
            step and chunk), i.e. the recordings do not describe one consistent run.
    """
    world_size = len(recordings)
    if combine is None:
        if phase not in REDUCING_PHASES | COPYING_PHASES:
            raise ValueError(f"say whether phase {phase!r} adds or copies what it receives: pass combine=True/False")
        combine = phase in REDUCING_PHASES
    if start is None:
        start = [[frozenset({r}) for _ in range(world_size)] for r in range(world_size)]
    state = [[frozenset(cell) for cell in row] for row in start]

    sends, recvs = set(), []
    for index, recording in enumerate(recordings):
        rank = _rank_of(recording, index)
        for event in recording.in_phase(phase):
            if event.step is None or event.chunk is None:
                raise ValueError(f"rank {rank}'s {event.kind} in phase {phase!r} has no step or chunk label; "
                                 "the replay needs both (pass chunk= to the p2p call, loop with traffic.steps).")
            if event.kind == "send":
                sends.add((event.step, rank, event.peer, event.chunk))
            else:
                recvs.append(Message(event.step, event.peer, rank, event.chunk, event.numel, frozenset()))
    steps = 1 + max((m.step for m in recvs), default=-1)

    states, messages = [state], []
    for step in range(steps):
        before = states[-1]
        after = [list(row) for row in before]
        this_step = []
        for m in sorted((m for m in recvs if m.step == step), key=lambda m: m.src):
            if (step, m.src, m.dst, m.chunk) not in sends:
                raise ValueError(f"phase {phase!r} step {step}: rank {m.dst} received chunk {m.chunk} from rank "
                                 f"{m.src}, but rank {m.src} recorded no such send.")
            carried = before[m.src][m.chunk]
            after[m.dst][m.chunk] = (after[m.dst][m.chunk] | carried) if combine else carried
            this_step.append(Message(step, m.src, m.dst, m.chunk, m.numel, carried))
        states.append(after)
        messages.append(this_step)
    return ChunkHistory(world_size, states, messages, [f"{phase} step {s}" for s in range(steps)])


def ring_histories(recordings) -> tuple[ChunkHistory, ChunkHistory]:
    """The ring's two phases replayed from recordings of `allreduce.ring` (or of its two phases).

    Returns:
        (scatter_reduce history, all_gather history); the second starts where the first ends.
    """
    scatter_reduce = chunk_history(recordings, "scatter_reduce")
    all_gather = chunk_history(recordings, "all_gather", start=scatter_reduce.final)
    return scatter_reduce, all_gather


def messages_text(history: ChunkHistory, step: int | None = None) -> str:
    """Every step's messages (or only step `step`'s) as plain text, one line per message, and what
    each receiver holds afterwards."""
    lines = []
    for index, (name, messages) in enumerate(zip(history.step_names, history.messages)):
        if step is not None and index != step:
            continue
        lines.append(f"{name}:")
        after = history.states[index + 1]
        for m in messages:
            carried = provenance_label(m.carries, history.world_size)
            now = provenance_label(after[m.dst][m.chunk], history.world_size)
            lines.append(f"  rank {m.src} ({rank_name(m.src)}) -> rank {m.dst} ({rank_name(m.dst)}): "
                         f"chunk {m.chunk} holding {carried:<9}  rank {m.dst}'s chunk {m.chunk} is now {now}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Pictures
# --------------------------------------------------------------------------------------------------

_CELL_WIDTH = 0.78  # the rest of each column, on the left, carries the arrows


def _draw_arrows(ax, messages, rows):
    """An arrow for each message, in the left margin of the chunk's column, from sender row to receiver row."""
    x_offset = (1.0 - _CELL_WIDTH) / 2
    style = dict(arrowstyle="-|>", color="black", linewidth=1.3, mutation_scale=9, shrinkA=0, shrinkB=0)
    for m in messages:
        x = m.chunk + x_offset
        if m.dst == m.src + 1:  # the usual ring step: one row down
            ax.annotate("", xy=(x, m.dst + 0.35), xytext=(x, m.src + 0.65), arrowprops=style)
        else:  # round the ring (or any longer jump): leave the sender downwards/upwards, enter the receiver
            below, above = rows + 0.4, -0.4
            leave, enter = (below, above) if m.dst < m.src else (above, below)
            ax.annotate("", xy=(x, leave), xytext=(x, m.src + 0.5), arrowprops=dict(style, linestyle=":"))
            ax.annotate("", xy=(x, m.dst + 0.5), xytext=(x, enter), arrowprops=dict(style, linestyle=":"))


_KEY = ("arrows: this step's messages (dotted: round the end of the ring)  ·  dashed: chunk sent  ·  "
        "thick: chunk that received  ·  bold: holds every rank's contribution")


def _draw_state(ax, history, k, fontsize, column_labels, row_labels=None):
    """Rank rows x chunk columns after k steps, with the arrows and outlines of step k - 1."""
    G = history.world_size
    messages = history.messages[k - 1] if k > 0 else []
    draw_cells(ax, history.states[k], G, outlined=history.received(k - 1) if k > 0 else (),
               dashed=history.sent(k - 1) if k > 0 else (), cell_width=_CELL_WIDTH, fontsize=fontsize,
               column_labels=column_labels, row_labels=row_labels)
    rows = len(history.states[k])
    _draw_arrows(ax, messages, rows)
    ax.set_ylim(rows + 0.55, -0.55)
    ax.set_title("start" if k == 0 else f"after {history.step_names[k - 1]}", fontsize=fontsize + 1, pad=4)


def draw_step(history: ChunkHistory, k: int, *, column_labels=None, ax=None):
    """One table: every rank's chunks after k steps (k = 0: the start).

    The step's messages are arrows from the sending row to the receiving row in the chunk's column
    (dotted when they go round the end of the ring); sent chunks have a dashed outline, chunks that
    just received something a thick one. Labels in bold hold every rank's contribution.

    Returns:
        The matplotlib Figure.
    """
    if not 0 <= k <= history.steps:
        raise ValueError(f"k must be between 0 and {history.steps} (the number of steps), got {k}")
    G = history.world_size
    labels = column_labels if column_labels is not None else [f"chunk {c}" for c in range(G)]
    own_figure = ax is None
    with _style():
        if own_figure:
            fig, axes = _new_figure(1.2 + 0.85 * G, 1.0 + 0.5 * G)
            ax = axes[0][0]
        _draw_state(ax, history, k, 8.0, labels)
        if own_figure:
            ax.figure.tight_layout()
        return ax.figure


def draw_steps(history: ChunkHistory, *, include_start: bool = False, columns: int | None = None,
               title: str | None = None):
    """The static version of the stepper: one small table per step, in a grid.

    Renders anywhere a PNG does (GitHub, nbviewer, a PDF), with no widget frontend.

    Args:
        history: from `chunk_history` or `ring_histories`.
        include_start: add a first panel with the state before any step.
        columns: panels per row (default: up to 4, fewer for large world sizes).
        title: a title over the grid.

    Returns:
        The matplotlib Figure; it has one Axes per panel (history.steps of them, +1 with the start).
    """
    G = history.world_size
    ks = list(range(0 if include_start else 1, history.steps + 1))
    columns = columns or max(1, min(len(ks), 4 if G <= 5 else 3))
    rows = -(-len(ks) // columns)
    panel_w, panel_h = max(2.3, 0.3 + 0.58 * G), 0.8 + 0.38 * G
    first_w = panel_w + 0.5
    width = first_w + panel_w * (columns - 1)
    key = textwrap.wrap(_KEY, width=int(width * 15))      # about 15 characters per inch at 7 points
    key_h = 0.14 * len(key) + 0.1
    with _style():
        fig, axes = _new_figure(width, panel_h * rows + key_h + (0.4 if title else 0), rows, columns, title=title,
                                gridspec_kw={"width_ratios": [first_w] + [panel_w] * (columns - 1)})
        for index, ax in enumerate(axes.flat):
            if index < len(ks):
                row_labels = [f"{r} · {rank_name(r)}" for r in range(G)] if index % columns == 0 else [""] * G
                _draw_state(ax, history, ks[index], 6.5 if G > 4 else 7.5,
                            [f"chunk {c}" if G <= 4 else f"{c}" for c in range(G)], row_labels)
            else:
                fig.delaxes(ax)
        if title:
            fig.suptitle(title, fontsize=11, x=0.01, ha="left")
        fig.text(0.01, 0.01, "\n".join(key), fontsize=7, ha="left", va="bottom")
        fig.tight_layout(rect=(0, key_h / fig.get_figheight(), 1, 1))
        return fig


# --------------------------------------------------------------------------------------------------
# The interactive stepper
# --------------------------------------------------------------------------------------------------


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=80)
    return buffer.getvalue()


class Stepper:
    """A play button and a slider over the steps of a `ChunkHistory`, drawing `draw_step` for each.

    Needs ipywidgets and a running kernel; where widgets do not render (GitHub, nbval, a PDF),
    show `draw_steps(history)` next to it. Each step's picture is drawn the first time it is
    shown and kept.

    Args:
        history: what to step through.
        choices, load: optional. A dropdown over `choices` (e.g. world sizes); picking one calls
            `load(choice)`, which must return a new ChunkHistory, and the stepper starts over on it.
        choice_label: the dropdown's description.
        interval_ms: the play button's speed.

    Example::

        viz.Stepper(rs)                                            # in a notebook cell
        viz.Stepper(rs, choices=[2, 3, 4], load=run_ring_and_replay)
    """

    def __init__(self, history: ChunkHistory, *, choices=None, load=None, choice_label: str = "world size",
                 interval_ms: int = 1200):
        import ipywidgets as widgets

        self.history = history
        self._pictures: dict[int, bytes] = {}
        self.play = widgets.Play(min=0, max=history.steps, step=1, interval=interval_ms, description="play")
        self.slider = widgets.IntSlider(min=0, max=history.steps, step=1, description="step")
        widgets.jslink((self.play, "value"), (self.slider, "value"))
        self.image = widgets.Image(format="png")
        self.caption = widgets.HTML()
        controls = [self.play, self.slider]
        self.chooser = None
        if choices is not None:
            if load is None:
                raise ValueError("Stepper: choices= needs load=, the function that makes a history for a choice")
            self._load = load
            choices = list(choices)
            start = history.world_size if history.world_size in choices else None
            self.chooser = widgets.Dropdown(options=choices, value=start, description=choice_label)
            self.chooser.observe(self._on_choice, names="value")
            controls.insert(0, self.chooser)
        self.slider.observe(lambda change: self.show(change["new"]), names="value")
        self.widget = widgets.VBox([widgets.HBox(controls), self.image, self.caption])
        self.show(0)

    def show(self, k: int) -> None:
        """Draw the state after k steps."""
        if k not in self._pictures:
            self._pictures[k] = _png(draw_step(self.history, k))
        self.image.value = self._pictures[k]
        h = self.history
        if k == 0:
            lines = ["Before the first step. Press play or drag the slider."]
        else:
            lines = [f"<b>{h.step_names[k - 1]}</b>"] + [m.describe(h.world_size) for m in h.messages[k - 1]]
        self.caption.value = "<br>".join(lines)

    def set_history(self, history: ChunkHistory) -> None:
        """Step through `history` from now on, starting at step 0."""
        self.history, self._pictures = history, {}
        self.slider.value = 0
        self.play.max = self.slider.max = history.steps
        self.show(0)

    def _on_choice(self, change):
        if change["new"] is not None:
            self.caption.value = f"running for {self.chooser.description} = {change['new']} ..."
            self.set_history(self._load(change["new"]))

    def _repr_mimebundle_(self, **kwargs):
        # The widget view for live notebooks; a short, stable text where widgets do not render
        # (and for nbval, which compares text/plain: the widget's own repr would include the PNG bytes).
        bundle = self.widget._repr_mimebundle_(**kwargs)
        bundle = dict(bundle) if bundle else {}
        steps = self.history.steps
        bundle["text/plain"] = (f"Stepper over {steps} step{'' if steps == 1 else 's'} "
                                f"({self.history.world_size} ranks); run the notebook to use the slider.")
        return bundle
