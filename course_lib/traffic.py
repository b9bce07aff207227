"""Count and trace every message a rank sends or receives through `course_lib.p2p`.

Inside a rank::

    with traffic.record() as rec:
        allreduce.ring(grad)
    rec.bytes_sent, rec.messages_sent       # totals for this rank
    rec.events[0]                           # Event(kind='send', peer=1, numel=3, nbytes=12,
                                            #       phase='scatter_reduce', step=0, chunk=2)

A recording is plain data (picklable), so `fn` can return it through `launch` and the notebook can
draw the whole run from the ranks' recordings. The algorithms label their messages with
`phase(...)` and `steps(...)`; the chunk index is passed to the p2p call itself.

With no recording active the p2p wrappers skip all of this: the only cost is one `if`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

from course_lib import runtime

__all__ = ["Event", "Recording", "record", "phase", "steps", "at_step", "current_labels", "step_counts"]


@dataclass(frozen=True)
class Event:
    """One message as seen by the rank that recorded it.

    Attributes:
        kind: 'send' or 'recv'.
        peer: the other rank.
        numel: number of elements in the message.
        nbytes: numel * element size.
        phase: label of the algorithm phase ('scatter_reduce', 'all_gather', 'reduce', ...) or None.
        step: index of the step within the phase, from 0, or None.
        chunk: index of the chunk that moved, or None when the message is not a chunk.
        dtype: the tensor's dtype, as a string ('torch.float32').
    """

    kind: str
    peer: int
    numel: int
    nbytes: int
    phase: str | None = None
    step: int | None = None
    chunk: int | None = None
    dtype: str = ""


@dataclass
class Recording:
    """The messages one rank sent and received while the recording was active."""

    rank: int | None = None
    world_size: int | None = None
    events: list[Event] = field(default_factory=list)

    def _of(self, kind):
        return [e for e in self.events if e.kind == kind]

    @property
    def sends(self) -> list[Event]:
        return self._of("send")

    @property
    def recvs(self) -> list[Event]:
        return self._of("recv")

    @property
    def messages_sent(self) -> int:
        return len(self.sends)

    @property
    def messages_received(self) -> int:
        return len(self.recvs)

    @property
    def elements_sent(self) -> int:
        return sum(e.numel for e in self.sends)

    @property
    def elements_received(self) -> int:
        return sum(e.numel for e in self.recvs)

    @property
    def bytes_sent(self) -> int:
        return sum(e.nbytes for e in self.sends)

    @property
    def bytes_received(self) -> int:
        return sum(e.nbytes for e in self.recvs)

    def in_phase(self, name: str) -> list[Event]:
        """The events labelled with phase `name`, in order."""
        return [e for e in self.events if e.phase == name]

    def summary(self) -> str:
        return (f"rank {self.rank}: sent {self.messages_sent} messages / {self.bytes_sent} bytes, "
                f"received {self.messages_received} messages / {self.bytes_received} bytes")


# The recordings now open on this rank (nested recordings all see every event) and the labels that
# the algorithm code has set. Module globals are right here: one rank is one process.
_active: list[Recording] = []
_labels: dict = {"phase": None, "step": None}


@contextlib.contextmanager
def record() -> Iterator[Recording]:
    """Record every p2p message of this rank inside the `with` block.

    An async collective (``async_op=True``) is recorded when it was called inside the block: the
    block waits for queued async collectives when it opens and when it closes.

    Yields:
        A `Recording`; it keeps filling until the block ends.
    """
    import torch.distributed as dist

    runtime.drain()
    rec = Recording()
    if dist.is_available() and dist.is_initialized():
        rec.rank, rec.world_size = dist.get_rank(), dist.get_world_size()
    _active.append(rec)
    try:
        yield rec
    finally:
        runtime.drain()
        # By identity: recordings compare equal by content (they are dataclasses), so
        # `_active.remove(rec)` could drop an enclosing recording that saw the same events.
        _active[:] = [other for other in _active if other is not rec]


def is_recording() -> bool:
    return bool(_active)


def current_labels() -> dict:
    """The phase and step labels the next message will carry."""
    return dict(_labels)


@contextlib.contextmanager
def phase(name: str):
    """Label the messages inside the block as belonging to algorithm phase `name`."""
    saved = dict(_labels)
    _labels["phase"], _labels["step"] = name, None
    try:
        yield
    finally:
        _labels.update(saved)


def steps(count: int) -> Iterator[int]:
    """``range(count)`` that also labels the messages of each iteration with its step index."""
    saved = _labels["step"]
    try:
        for step in range(count):
            _labels["step"] = step
            yield step
    finally:
        _labels["step"] = saved


@contextlib.contextmanager
def at_step(step: int):
    """Label the messages inside the block with step `step`, whatever step the loop around is in.

    A pipelined algorithm sends a piece on as soon as it is ready, which is often while it is still
    receiving the rest of the current step: the piece belongs to the *next* step, and says so.
    """
    saved = _labels["step"]
    _labels["step"] = step
    try:
        yield
    finally:
        _labels["step"] = saved


def step_counts(recordings) -> dict:
    """{phase: number of distinct steps} over the recordings of all ranks of one run.

    A step is a round of messages that must follow the previous round; a rank that sits one round
    out (a leaf of a tree) still waits for it, so the steps are counted over every rank together.
    """
    seen: dict = {}
    for rec in recordings:
        for event in rec.events:
            if event.phase is not None and event.step is not None:
                seen.setdefault(event.phase, set()).add(event.step)
    return {name: len(steps_) for name, steps_ in seen.items()}


def log(kind: str, peer: int, tensor, chunk: int | None) -> None:
    """Append one event to every active recording (called by course_lib.p2p)."""
    numel = tensor.numel()
    event = Event(kind=kind, peer=peer, numel=numel, nbytes=numel * tensor.element_size(),
                  phase=_labels["phase"], step=_labels["step"], chunk=chunk, dtype=str(tensor.dtype))
    for rec in _active:
        rec.events.append(event)
