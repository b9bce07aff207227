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

import base64
import html
import json
import textwrap
from dataclasses import dataclass, field

from course_lib.viz.buffers import (_new_figure, _style, draw_cells, figure_svg, provenance_label, rank_name)

__all__ = ["Message", "ChunkHistory", "chunk_history", "ring_histories", "messages_text", "position_title",
           "position_labels", "draw_step", "draw_steps", "Stepper"]

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


def position_title(history: ChunkHistory, k: int) -> str:
    """What the picture after k steps shows: 'start' (k = 0), else 'after <name of step k - 1>'.

    Steps are numbered from 0 as the ring code and the traffic labels number them, so position k
    (k steps done) is "after step k - 1": the picture's title, the stepper's slider and its caption
    all use this text.
    """
    return "start" if k == 0 else f"after {history.step_names[k - 1]}"


def position_labels(history: ChunkHistory) -> list[str]:
    """The stepper's slider labels, one per position: 'start', 'after step 0', 'after step 1', ...

    When every step belongs to one phase its name is left out ('after step 1'; the picture's title
    says 'after scatter_reduce step 1'); a history of several phases keeps it ('after all_gather step 0').
    """
    phases = {name.rsplit(" step ", 1)[0] for name in history.step_names}
    if len(phases) == 1:
        return ["start"] + [f"after step {name.rsplit(' step ', 1)[1]}" for name in history.step_names]
    return [position_title(history, k) for k in range(history.steps + 1)]


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
    ax.set_title(position_title(history, k), fontsize=fontsize + 1, pad=6)


def draw_step(history: ChunkHistory, k: int, *, column_labels=None, ax=None):
    """One table: every rank's chunks after k steps (k = 0: the start; k: after step k - 1).

    The step's messages are arrows from the sending row to the receiving row in the chunk's column
    (dotted when they go round the end of the ring); sent chunks have a dashed outline, chunks that
    just received something a thick one. Labels in bold hold every rank's contribution. The title
    is `position_title(history, k)`.

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
            fig, axes = _new_figure(1.3 + 0.95 * G, 1.1 + 0.55 * G)
            ax = axes[0][0]
        _draw_state(ax, history, k, 10.0, labels)
        if own_figure:
            ax.figure.tight_layout()
        return ax.figure


# About the width a notebook gives an output (in inches at the 80 dpi the figures use): wider
# figures are shrunk to fit, and their text with them.
_NOTEBOOK_WIDTH = 11.0  # 880 pixels


def draw_steps(history: ChunkHistory, *, include_start: bool = False, columns: int | None = None,
               title: str | None = None):
    """The static version of the stepper: one table per step, in a grid.

    Renders anywhere a PNG does (GitHub, nbviewer, a PDF), with no widget frontend. Panels are
    titled like the stepper's pictures ("after scatter_reduce step 0"), and sized so that a
    notebook shows their text at about the size of its own.

    Args:
        history: from `chunk_history` or `ring_histories`.
        include_start: add a first panel with the state before any step.
        columns: panels per row (default: as many as fit the width of a notebook, at most 4).
        title: a title over the grid.

    Returns:
        The matplotlib Figure; it has one Axes per panel (history.steps of them, +1 with the start).
    """
    G = history.world_size
    ks = list(range(0 if include_start else 1, history.steps + 1))
    fontsize = 10.0 if G <= 4 else 9.0
    panel_w = 0.35 + (0.75 if G <= 4 else 0.58) * G
    panel_h = 0.95 + 0.5 * G
    first_w = panel_w + 0.75                                    # room for the row labels
    if columns is None:
        columns = max(1, min(len(ks), 4, 1 + int((_NOTEBOOK_WIDTH - first_w) // panel_w)))
    rows = -(-len(ks) // columns)
    width = first_w + panel_w * (columns - 1)
    key = textwrap.wrap(_KEY, width=int(width * 15))      # about 15 characters per inch at 8.5 points
    key_h = 0.17 * len(key) + 0.1
    with _style():
        fig, axes = _new_figure(width, panel_h * rows + key_h + (0.45 if title else 0), rows, columns, title=title,
                                gridspec_kw={"width_ratios": [first_w] + [panel_w] * (columns - 1)})
        for index, ax in enumerate(axes.flat):
            if index < len(ks):
                row_labels = [f"{r} · {rank_name(r)}" for r in range(G)] if index % columns == 0 else [""] * G
                _draw_state(ax, history, ks[index], fontsize,
                            [f"chunk {c}" if G <= 4 else f"{c}" for c in range(G)], row_labels)
            else:
                fig.delaxes(ax)
        if title:
            fig.suptitle(title, fontsize=12, x=0.01, ha="left")
        fig.text(0.01, 0.01, "\n".join(key), fontsize=8.5, ha="left", va="bottom")
        fig.tight_layout(rect=(0, key_h / fig.get_figheight(), 1, 1))
        return fig


# --------------------------------------------------------------------------------------------------
# The interactive stepper
# --------------------------------------------------------------------------------------------------


def _caption_html(history: ChunkHistory, k: int) -> str:
    if k == 0:
        return "<b>start</b>: every rank holds only what it started with. Press play or drag the slider."
    lines = [f"<b>{html.escape(position_title(history, k))}</b>: the messages of this step"]
    lines += [html.escape(m.describe(history.world_size)) for m in history.messages[k - 1]]
    return "<br>".join(lines)


# Links the static stepper's play button and slider to its pictures: every picture is already in
# the page, the script only shows one at a time. Runs where a page runs scripts (the book, nbviewer,
# a trusted notebook); elsewhere the first picture and a note stay.
_STATIC_SCRIPT = """(function (root) {
  var labels = JSON.parse(root.getAttribute("data-labels"));
  var range = root.querySelector("input"), button = root.querySelector("button");
  var readout = root.querySelector("output"), timer = null;
  function show(k) {
    range.value = k;
    readout.textContent = labels[k];
    root.querySelectorAll("[data-position]").forEach(function (element) {
      element.hidden = Number(element.getAttribute("data-position")) !== k;
    });
  }
  function stop() { clearInterval(timer); timer = null; button.textContent = "play"; }
  range.addEventListener("input", function () { stop(); show(Number(range.value)); });
  button.addEventListener("click", function () {
    if (timer !== null) { stop(); return; }
    if (Number(range.value) === labels.length - 1) { show(0); }
    button.textContent = "pause";
    timer = setInterval(function () {
      var next = Number(range.value) + 1;
      if (next < labels.length) { show(next); }
      if (next >= labels.length - 1) { stop(); }
    }, Number(root.getAttribute("data-interval")));
  });
  root.querySelector(".course-lib-stepper-controls").hidden = false;
  root.querySelector(".course-lib-stepper-note").hidden = true;
})(document.currentScript.parentElement);"""


class Stepper:
    """A play button and a slider over the steps of a `ChunkHistory`, drawing `draw_step` for each.

    Positions: 0 is the start, position k shows the state after step k - 1 (steps count from 0, as
    in the ring code). The slider's readout says so ("start", "after step 0", ...) and the picture's
    title and the caption use the same words (`position_labels`, `position_title`).

    Pictures are SVG, so they stay sharp at any width and on high-density screens. Needs
    ipywidgets and a running kernel to move; where widgets do not render, the output also carries a
    static HTML version: the same pictures, pre-rendered, with a play button and a slider linked by
    a few lines of JavaScript (the book built by tools/build_book.py shows that one). Each step's
    picture is drawn the first time it is needed and kept.

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
        self.interval_ms = interval_ms
        self._pictures: dict[int, bytes] = {}
        self.play = widgets.Play(min=0, max=history.steps, step=1, interval=interval_ms, description="play")
        self.slider = widgets.SelectionSlider(options=self._options(), description="show",
                                              layout=widgets.Layout(width="30em"),
                                              style={"description_width": "initial"})
        widgets.jslink((self.play, "value"), (self.slider, "index"))
        # At its own size (a flex box would stretch it to the full width), shrunk when the page is narrower.
        self.image = widgets.Image(format="svg+xml", layout=widgets.Layout(max_width="100%", align_self="flex-start"))
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
        self.slider.observe(lambda change: self.show(change["new"]), names="index")
        self.widget = widgets.VBox([widgets.HBox(controls), self.image, self.caption])
        self.show(0)

    def _options(self):
        return list(zip(position_labels(self.history), range(self.history.steps + 1)))

    def picture(self, k: int) -> bytes:
        """The SVG of position k (drawn once, then kept)."""
        if k not in self._pictures:
            self._pictures[k] = figure_svg(draw_step(self.history, k))
        return self._pictures[k]

    def show(self, k: int) -> None:
        """Show position k: the state after k steps."""
        self.image.value = self.picture(k)
        self.caption.value = _caption_html(self.history, k)

    def set_history(self, history: ChunkHistory) -> None:
        """Step through `history` from now on, from its start."""
        self.history, self._pictures = history, {}
        self.play.value = 0
        self.play.max = history.steps
        self.slider.options = self._options()    # back to index 0, which shows the new start
        self.show(0)

    def _on_choice(self, change):
        if change["new"] is not None:
            self.caption.value = f"running for {self.chooser.description} = {change['new']} ..."
            self.set_history(self._load(change["new"]))

    def static_html(self) -> str:
        """The stepper as a self-contained HTML fragment: every position's picture pre-rendered, one
        shown at a time by a play button and a slider (a few lines of inline JavaScript). Identical
        on every run for the same history, so it can live in a stored notebook output."""
        labels = position_labels(self.history)
        last = len(labels) - 1
        pictures, captions = [], []
        for k, label in enumerate(labels):
            hidden = "" if k == 0 else " hidden"
            data = base64.b64encode(self.picture(k)).decode("ascii")
            pictures.append(f'<img data-position="{k}"{hidden} src="data:image/svg+xml;base64,{data}" '
                            f'alt="{html.escape(position_title(self.history, k))}" style="max-width:100%">')
            captions.append(f'<div data-position="{k}"{hidden}>{_caption_html(self.history, k)}</div>')
        return (
            f'<div class="course-lib-stepper" data-labels="{html.escape(json.dumps(labels))}" '
            f'data-interval="{int(self.interval_ms)}">\n'
            f'<div class="course-lib-stepper-controls" hidden><button type="button">play</button> '
            f'<input type="range" min="0" max="{last}" step="1" value="0" aria-label="position"> '
            f'<output>{html.escape(labels[0])}</output></div>\n'
            + "\n".join(pictures) + "\n" + "\n".join(captions) + "\n"
            f'<div class="course-lib-stepper-note"><i>A stepper over {last} steps: run the notebook to move '
            f'it (the table of every step is above).</i></div>\n'
            f"<script>\n{_STATIC_SCRIPT}\n</script>\n</div>"
        )

    def _repr_mimebundle_(self, **kwargs):
        # The widget view for live notebooks; the static HTML stepper for pages without a kernel; a
        # short, stable text for nbval, which compares text/plain (the widget's own repr would
        # include the picture's bytes).
        if hasattr(self.widget, "_repr_mimebundle_"):
            bundle = dict(self.widget._repr_mimebundle_(**kwargs) or {})
        else:  # ipywidgets 7 (Colab's) has no bundle method: the same view reference it would display
            bundle = {"application/vnd.jupyter.widget-view+json":
                      {"version_major": 2, "version_minor": 0, "model_id": self.widget.model_id}}
        steps = self.history.steps
        bundle["text/html"] = self.static_html()
        bundle["text/plain"] = (f"Stepper over {steps} step{'' if steps == 1 else 's'} "
                                f"({self.history.world_size} ranks); run the notebook to use the slider.")
        return bundle
