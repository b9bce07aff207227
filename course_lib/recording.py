"""What an algorithm sends, read from its own code: every rank's point-to-point calls, recorded without a launch.

    events = record_schedule(allreduce.ring, 8, 1_000_000)     # the ring's calls on 8 ranks, 1M floats each
    simulation.replay(events, Network.preset("10GbE")).seconds

Each rank runs `fn` in this process, one after the other, in a process group of course_lib's backend that
moves nothing (`backend.recording`); a layer logs every send, receive and wait in the form
`simulation.replay` times. `Network.predict` times every course all-reduce this way (by name or as the
function, a learner's own variant too), and notebook 13's hierarchical check and capstone record their
schedules with it.

It runs anywhere, inside a launched rank too (a learner's tuner calls `link.predict` there): the rank's own
process group, layers, modeled clock, traffic recordings and blocked-call slot are set aside while it records
and put back after, untouched (`_apart_from_the_rank`, `backend.recording`).
"""

from __future__ import annotations

import contextlib

import torch

from course_lib import backend, ops, p2p, runtime, traffic
from course_lib.runtime import unchecked

__all__ = ["record_schedule"]


class _Recorder:
    """A layer of course_lib's backend that logs one rank's point-to-point calls in the form `simulation.replay`
    reads; under `backend.recording` nothing moves (a receive leaves its buffer as it is)."""

    def __init__(self):
        self.events = []

    def _log(self, op, tensor, peer, tag):
        self.events.append((op, int(peer), tensor.numel() * tensor.element_size(), int(tag or 0)))
        return len(self.events) - 1

    def send(self, group, tensor, dst, tag, proceed):
        called = backend.caller()
        index = self._log("send" if called == "send" else "isend", tensor, group.global_ranks[dst], tag)
        return _Logged(proceed(tensor, dst, tag), self, None if called == "send" else index)

    def recv(self, group, tensor, src, tag, proceed):
        if src is None:
            raise RuntimeError("record_schedule: a receive from any source cannot be replayed: name the sender")
        called = backend.caller()
        index = self._log("recv" if called == "recv" else "irecv", tensor, group.global_ranks[src], tag)
        return _Logged(proceed(tensor, src, tag), self, None if called == "recv" else index)


class _Logged(backend.Work):
    """What a recorded isend / irecv returns: its first wait() is logged as ('wait', index)."""

    def __init__(self, under, recorder, index):
        super().__init__(under)
        self._recorder, self._index = recorder, index

    def wait(self, timeout=None):
        if self._index is not None:
            self._recorder.events.append(("wait", self._index))
            self._index = None
        return True

    def is_completed(self):
        self.wait()
        return True

    def _source_rank(self):
        return -1


def record_schedule(fn, world_size: int, numel: int, *args, device: str = "meta", dtype=torch.float32) -> list:
    """Every rank's point-to-point calls when `fn(tensor, *args)` runs on `world_size` ranks with `numel` elements
    of `dtype` each, recorded in this process, rank after rank, without launching anything: each rank runs in a
    process group of course_lib's backend that moves nothing (`course_lib.backend.recording`), whose layer logs
    every send and receive. The tensors are torch's 'meta' tensors (a shape and no data: 64 MiB costs nothing),
    or empty CPU tensors when the function mixes in CPU tensors of its own (it is then run again that way).

    Returns the schedule in the form `simulation.replay(events_by_rank, network)` times. Only for functions whose
    messages do not depend on the values they receive, as an all-reduce's do not; the values computed are
    meaningless (a receive leaves its buffer untouched). A built-in collective, or a receive from any source,
    raises RuntimeError. Inside a launched rank it leaves the rank as it found it (see the module docstring);
    call it there between the rank's own calls, on its main thread.
    """
    refusal = "record_schedule times point-to-point messages only"
    events_by_rank = []
    with _apart_from_the_rank():
        for rank in range(world_size):
            for where in ((device, "cpu") if device != "cpu" else ("cpu",)):
                recorder = _Recorder()
                try:
                    with backend.recording(rank, world_size, refusal), unchecked():
                        p2p._world_cache.clear()      # by the group's id, which the next rank's group may reuse
                        backend.install(recorder, outermost=True)      # it leaves with the recording's layers
                        fn(torch.empty(numel, dtype=dtype, device=where), *args)
                except (RuntimeError, NotImplementedError) as exc:
                    if isinstance(exc, NotImplementedError) or where == "cpu" or "record_schedule" in str(exc):
                        raise
                    continue          # a CPU tensor of the function's own met a meta one: once more on the CPU
                events_by_rank.append(recorder.events)
                break
    return events_by_rank


@contextlib.contextmanager
def _apart_from_the_rank():
    """What this process keeps for the rank it runs (if it runs one) beside its process group, set aside for the
    block and put back after it: the rank's modeled clock and the reductions' charge on it, its traffic recordings
    and their labels, its blocked-call slot and p2p's cache of its group. A recording inside a rank must leave the
    rank as it found it: its clock, counts and slot describe the rank's own calls, never the recorded ones.

    The rank's queued async collectives finish first: they run on torch's default group, which the recording
    sets aside for the process (`backend.recording`)."""
    runtime.drain()
    saved = (runtime._state, runtime._slot, ops.charge_reduction, list(traffic._active), dict(traffic._labels),
             dict(p2p._world_cache))
    runtime._state = runtime._slot = ops.charge_reduction = None
    traffic._active.clear()
    traffic._labels.update(phase=None, step=None)
    try:
        yield
    finally:
        runtime._state, runtime._slot, ops.charge_reduction, active, labels, cache = saved
        traffic._active[:] = active
        traffic._labels.update(labels)
        p2p._world_cache.clear()
        p2p._world_cache.update(cache)
