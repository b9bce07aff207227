"""torch.distributed's built-in collectives on a modeled network: what NCCL would run, timed on an idle network.

`collective_time(network, kind, nbytes, members)` is the time a modeled launch charges for
``dist.all_reduce`` and the other built-in collectives (a launch's `Simulator` calls it as its
`collective_cost`). all_reduce, broadcast, reduce, all_gather and reduce_scatter take what
`course_lib.nccl` says NCCL would run; the others, which NCCL builds from point-to-point messages, are
timed as those messages (`course_lib.schedules`), replayed by `course_lib.simulation`.
"""

from __future__ import annotations

import os
import sys
import time

from course_lib import nccl
from course_lib.schedules import schedule
from course_lib.simulation import replay

__all__ = ["collective_time", "COLLECTIVES", "PROGRESS_AFTER"]

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep      # course_lib/

COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "gather",
               "scatter", "barrier")


# torch's built-in collectives that NCCL runs as collectives take what `course_lib.nccl` says NCCL would run (its
# tuner's choice of algorithm and protocol, simulated message by message); the others NCCL builds from point-to-point
# messages, timed here as those messages.
_NCCL = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter")
_SCHEDULES = {"all_to_all": "pairwise", "gather": "direct_gather", "scatter": "direct_scatter"}

_cache: dict = {}


PROGRESS_AFTER = 3.0     # seconds of simulation in a row of direct calls after which collective_time says how far it is
_progress = {"calls": 0, "seconds": 0.0, "shown": 0.0, "last": 0.0}


_OUTSIDE: dict = {}      # a code file's name -> whether it lies outside course_lib (asked on every collective)


def _called_from_outside() -> bool:
    """True when the caller of collective_time is not course_lib itself (a learner's loop, not a launch's clock)."""
    frame = sys._getframe(2)
    if frame is None:
        return False
    name = frame.f_code.co_filename
    if name not in _OUTSIDE:
        _OUTSIDE[name] = not os.path.abspath(name).startswith(_PACKAGE)
    return _OUTSIDE[name]


def _show_progress(kind, nbytes, group, started) -> None:
    """A line on stderr every PROGRESS_AFTER seconds while direct calls keep simulating: a search over sizes on
    256 ranks (a call each of several seconds) otherwise shows nothing for minutes."""
    now = time.monotonic()
    state = _progress
    if started - state["last"] > 30:           # a new search
        state.update(calls=0, seconds=0.0, shown=0.0)
    state["calls"] += 1
    state["seconds"] += now - started
    state["last"] = now
    if state["seconds"] >= PROGRESS_AFTER and state["seconds"] - state["shown"] >= PROGRESS_AFTER:
        state["shown"] = state["seconds"]
        print(f"collective_time: {state['calls']} call{'s' if state['calls'] > 1 else ''} so far, "
              f"{state['seconds']:.0f} s of simulation (the last: {kind} of {nbytes:,} bytes on {group} ranks, "
              f"{now - started:.1f} s; NCCL's choice is simulated message by message, and a call repeated with the "
              "same arguments is cached)", file=sys.stderr, flush=True)


def collective_time(network, kind: str, nbytes: int, members, root: int | None = None,
                    with_algorithm: bool = False, element_size: int = 4):
    """Seconds a built-in collective takes on an idle `network` over global ranks `members` (in group order).

    See `_collective_time`. Called from outside course_lib (a notebook's own loop), a run of calls that simulates
    for more than PROGRESS_AFTER seconds prints how far it is on stderr, every PROGRESS_AFTER seconds.
    """
    if not _called_from_outside():
        return _collective_time(network, kind, nbytes, members, root, with_algorithm, element_size)
    started = time.monotonic()
    members = tuple(members)
    try:
        return _collective_time(network, kind, nbytes, members, root, with_algorithm, element_size)
    finally:
        _show_progress(kind, nbytes, len(members), started)


def _collective_time(network, kind: str, nbytes: int, members, root: int | None = None,
                     with_algorithm: bool = False, element_size: int = 4):
    """Seconds a built-in collective takes on an idle `network` over global ranks `members` (in group order).

    `nbytes`: the tensor's bytes for all_reduce, broadcast and reduce; the whole buffer (G pieces) for
    all_gather, reduce_scatter, all_to_all, gather and scatter; pieces are cut in whole elements of `element_size`
    bytes. A barrier costs nothing: the clocks only line up. all_reduce, broadcast, reduce, all_gather and
    reduce_scatter take NCCL's choice (`course_lib.nccl.collective`); the others their point-to-point schedule.
    With `with_algorithm=True`, returns (seconds, what ran: 'ring/LL128', 'nvls/Simple', 'pairwise', ...).
    """
    members = tuple(members)
    if kind == "barrier" or len(members) <= 1:
        return (0.0, "none") if with_algorithm else 0.0
    if kind not in _NCCL and kind not in _SCHEDULES:
        raise ValueError(f"no model for the collective {kind!r}; known: {', '.join(COLLECTIVES)}")
    group_root = members.index(root) if root in members else 0
    if kind in _NCCL:
        choice = nccl.collective(network, kind, nbytes, members, root=group_root, element_size=element_size)
        best = (choice.seconds, f"{choice.algorithm}/{choice.protocol}")
    else:
        key = (network, kind, int(nbytes), members, root, element_size)
        best = _cache.get(key)
        if best is None:
            events = schedule(_SCHEDULES[kind], int(nbytes), len(members), root=group_root, element_size=element_size)
            best = _cache[key] = (replay(events, _Placed(network, members)).seconds, _SCHEDULES[kind])
            if len(_cache) > 4096:
                _cache.clear()
    return best if with_algorithm else best[0]


class _Placed:
    """A group's ranks 0..k-1 placed on the global ranks `members` of `network` (same links, same sides)."""

    def __init__(self, network, members):
        self.network, self.members = network, members

    def route(self, src, dst):
        return self.network.route(self.members[src], self.members[dst])
