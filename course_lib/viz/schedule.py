"""Any all-reduce's schedule, read from its recordings: who sends to whom at every step.

Notebooks 04 and 05 replay the ring chunk by chunk (`stepper`). The faster variants of notebook 11
move pieces that are not chunks (segments, halves, whole tensors), so this module draws what every
algorithm has in common instead: one column per step, one row per rank, one arrow per
(sender, receiver) pair in that step, as thick as the elements it carried::

    recordings = course_lib.launch(fn, 4)            # fn returns a traffic.Recording per rank
    rows = viz.schedule(recordings)                   # the data: [Transfer(phase, step, src, dst, ...)]
    viz.draw_schedule(recordings, title="tree")       # the picture

Only sends are read (every message is recorded twice, once by each end); a step is a (phase, step)
label as `course_lib.traffic` records it, in the order the phases first appear over all ranks'
recordings (not rank 0's alone: in halving_doubling on 6 ranks, rank 0 only folds and unfolds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from course_lib.viz.buffers import _new_figure, _style, rank_color, rank_name

__all__ = ["Transfer", "schedule", "schedule_columns", "draw_schedule"]


@dataclass(frozen=True)
class Transfer:
    """Everything `src` sent to `dst` in one step of one phase.

    Attributes:
        phase, step: the labels the algorithm gave the messages.
        src, dst: sender and receiver.
        messages: how many messages (more than 1 when a chunk travels in segments).
        elements: how many elements they carried together.
    """

    phase: str
    step: int
    src: int
    dst: int
    messages: int
    elements: int


def _rank_of(recording, index: int) -> int:
    return index if recording.rank is None else recording.rank


def schedule_columns(recordings: Sequence) -> list[tuple[str, int]]:
    """The (phase, step) labels of a run in order: each phase after the one before it on any rank, steps ascending."""
    phases: list[str] = []
    steps: dict[str, set] = {}
    for recording in recordings:
        previous = None   # a phase first seen on this rank goes right after the rank's previous phase
        for event in recording.events:
            if event.phase is None or event.step is None:
                continue
            if event.phase not in steps:
                phases.insert(phases.index(previous) + 1 if previous is not None else 0, event.phase)
                steps[event.phase] = set()
            steps[event.phase].add(event.step)
            previous = event.phase
    return [(name, step) for name in phases for step in sorted(steps[name])]


def schedule(recordings: Sequence) -> list[Transfer]:
    """Every (phase, step, sender, receiver) of a run with its message and element counts.

    Args:
        recordings: one `traffic.Recording` per rank (index = rank), e.g. as returned by `launch`.

    Returns:
        Transfers ordered by step (as `schedule_columns`), then sender, then receiver.

    Raises:
        ValueError: if a send has no phase or step label (the picture needs both).
    """
    totals: dict = {}
    for index, recording in enumerate(recordings):
        src = _rank_of(recording, index)
        for event in recording.sends:
            if event.phase is None or event.step is None:
                raise ValueError(f"rank {src} sent a message with no phase or step label; label the algorithm's "
                                 "messages with traffic.phase(...) and traffic.steps(...) to draw its schedule.")
            key = (event.phase, event.step, src, event.peer)
            messages, elements = totals.get(key, (0, 0))
            totals[key] = (messages + 1, elements + event.numel)
    order = {column: i for i, column in enumerate(schedule_columns(recordings))}
    return [Transfer(phase, step, src, dst, messages, elements)
            for (phase, step, src, dst), (messages, elements) in sorted(
                totals.items(), key=lambda item: (order[item[0][:2]], item[0][2], item[0][3]))]


def draw_schedule(recordings: Sequence, *, title: str | None = None, ax=None):
    """One column per step, one row per rank, an arrow from sender to receiver for every transfer.

    Arrow width grows with the elements carried (relative to the largest transfer of the run); a
    label "x3" says a transfer was 3 messages (segments). Phases are named above their columns.

    Args:
        recordings: one `traffic.Recording` per rank, as for `schedule`.
        title: a title over the picture.
        ax: draw into this matplotlib Axes instead of a new figure.

    Returns:
        The matplotlib Figure.
    """
    transfers = schedule(recordings)
    columns = schedule_columns(recordings)
    world_size = len(recordings)
    with _style():
        if ax is None:
            fig, axes = _new_figure(max(3.0, 0.9 * len(columns) + 1.2), 0.45 * world_size + 1.2, title=title)
            ax = axes[0][0]
        else:
            fig = ax.figure
        largest = max((t.elements for t in transfers), default=1) or 1
        index = {column: i for i, column in enumerate(columns)}
        for rank in range(world_size):
            ax.axhline(rank, color=rank_color(rank), lw=0.8, alpha=0.6, zorder=0)
        for t in transfers:
            x = index[t.phase, t.step]
            width = 0.6 + 2.4 * t.elements / largest
            ax.annotate("", xy=(x + 0.85, t.dst), xytext=(x + 0.15, t.src),
                        arrowprops=dict(arrowstyle="-|>", lw=width, color=rank_color(t.src), shrinkA=0, shrinkB=2))
            if t.messages > 1:
                ax.text(x + 0.5, (t.src + t.dst) / 2, f"x{t.messages}", fontsize=7, ha="center", va="bottom")
        start = 0
        for name in dict.fromkeys(phase for phase, _ in columns):   # phases in order, each once
            count = sum(1 for phase, _ in columns if phase == name)
            ax.axvline(start, color="gray", lw=0.6, ls=":")
            ax.text(start + count / 2, -0.8, name, ha="center", va="bottom", fontsize=8)
            start += count
        ax.set_xlim(0, max(len(columns), 1))
        ax.set_ylim(world_size - 0.5, -1.0)
        ax.set_yticks(range(world_size), [f"rank {r} ({rank_name(r)})" for r in range(world_size)])
        ax.set_xticks([i + 0.5 for i in range(len(columns))], [str(step) for _, step in columns])
        ax.set_xlabel("step")
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        if title:
            ax.set_title(title, pad=14)
        if len(fig.axes) == 1:
            fig.tight_layout()   # room for the rank labels and the step axis
    return fig
