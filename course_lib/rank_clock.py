"""The clock a rank reads (`course_lib.clock()`): modeled time under a modeled network, this machine's otherwise.

    t0 = course_lib.clock()
    allreduce.ring(grad)
    elapsed = course_lib.clock() - t0        # the link's time under launch(..., network=net)

Outside a modeled launch `clock()` is `time.perf_counter()` and `compute(s)` sleeps. Under
``launch(fn, G, network=net)`` `course_lib.modeled_clock` puts the rank on a modeled clock (it sets `_state`
below) and every function here asks that state instead. This module imports nothing of course_lib, so the
algorithms' bottom layers can read the clock without loading the simulator: the modeled clock sits above
them, as a layer of the rank's process group.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time

__all__ = ["clock", "now", "compute", "reduction", "catch_up", "active", "current_network", "untimed", "idle",
           "wake"]

_state = None              # the rank's modeled clock (`modeled_clock._RankState`) while one is active
_local = threading.local()  # per thread: the modeled link, and whether its collectives are untimed


def clock() -> float:
    """Seconds on this thread's clock: modeled time since the launch began under a modeled network,
    `time.perf_counter()` otherwise (then only differences mean anything)."""
    state = _state
    return time.perf_counter() if state is None else state.now()


now = clock


def compute(seconds: float) -> None:
    """Spend `seconds` of compute: on the modeled clock it moves this thread's clock on (and costs no real
    time); otherwise it sleeps, as a rank waiting for its accelerator would."""
    if not (isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and seconds >= 0
            and math.isfinite(seconds)):
        raise ValueError(f"compute(seconds) takes a number of seconds >= 0, got {seconds!r}")
    state = _state
    if state is not None:
        state.compute(seconds)
    elif seconds > 0:
        time.sleep(seconds)


def reduction(nbytes: int) -> None:
    """A reduction of two `nbytes` tensors into one: free, unless the modeled network has a
    `memory_bandwidth`, which then charges 3 nbytes / memory_bandwidth of compute (read two, write one),
    as a GPU's reduction kernel is bound by its memory. Called by `ops.combine_`."""
    state = _state
    speed = None if state is None else getattr(state.network, "memory_bandwidth", None)
    if speed:
        compute(3 * nbytes / speed)


def catch_up(moment: float) -> None:
    """This thread's clock becomes at least `moment` (a time another thread read with `now()`): the work it
    takes over could not start before then. A no-op outside a modeled launch."""
    state = _state
    if state is not None:
        state.catch_up(moment)


def active() -> bool:
    """True inside a rank of a launch under a modeled network."""
    return _state is not None


def current_network():
    """The `Network` (or `Cluster`) this rank's clock models, or None."""
    state = _state
    return None if state is None else state.network


@contextlib.contextmanager
def untimed():
    """torch.distributed collectives inside cost nothing on the modeled clock (the clocks only line up):
    for course_lib's own bookkeeping, such as its cross-rank argument check, which is not part of the
    algorithm being timed."""
    previous = getattr(_local, "untimed", False)
    _local.untimed = True
    try:
        yield
    finally:
        _local.untimed = previous


def idle(condition: threading.Condition, predicate, timeout: float = 0.05) -> None:
    """``condition.wait_for(predicate)`` for a thread that waits for another thread of its rank.

    Call it with `condition` held, as `wait_for`. Under a modeled clock the thread tells the simulation
    that it waits (so the simulation goes on without it) until the thread that makes `predicate` true
    calls `wake(this thread)` with `condition` held. Afterwards the waiter calls `catch_up(t)` with the time
    the giver left with the work."""
    state = _state
    if state is None:
        condition.wait_for(predicate)
    else:
        state.idle(condition, predicate, timeout)


def wake(thread: threading.Thread | None) -> None:
    """Tell the simulation that `thread` (of this rank) has work now, at this thread's clock. Call it with the
    condition `thread` waits on (`idle`) held, after making its predicate true."""
    state = _state
    if state is not None and thread is not None:
        state.wake(thread)


def _forget_after_fork() -> None:
    global _state
    _state = None
    _local.__dict__.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
