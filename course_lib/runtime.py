"""What runs inside a rank beside the algorithms: its clock, what it is blocked in, its queued async work, and
the cross-rank agreement that starts every collective.

The algorithms (`p2p`, `collectives`, `allreduce`, `fast_allreduce`) call into this module at two places only:
a collective starts with `prepare(...)`, and a blocking p2p call tells `set_blocked(...)` what it waits for.
Everything a learner benefits from without reading it lives here, in four parts:

1. **The clock** (`clock`, `compute`, ...: `course_lib.clock()`). This machine's `time.perf_counter()`, or,
   under ``launch(fn, G, network=net)``, the rank's modeled clock: `course_lib.modeled_clock` sets `_state`,
   and every function here asks that state instead. The modeled clock sits above the algorithms (a layer of
   the rank's process group, `course_lib.backend`); this module imports none of it.
2. **The blocked-call slot.** The launcher gives each rank a small shared file. Before every call that can
   block, p2p writes one line into it ("recv(src=1, shape=(4,), dtype=float32)") and clears it afterwards;
   a launch that times out reads every rank's line and says who waited for whom. A second line holds the
   rank's progress (`course_lib.progress`). Outside a launched rank every call here is a no-op.
3. **Queued async collectives** (`drain`). `course_lib._work` runs ``async_op=True`` collectives on a worker
   thread; a synchronous call first waits for the ones queued before it, so every rank runs its collectives
   in the order it called them.
4. **Agree before communicating** (`prepare`, `agree`). gloo cannot tell a learner "rank 2 passed 5 elements
   and rank 0 passed 4": a longer message than the receive buffer aborts the receiving process, a shorter
   one silently fills only part of it, and a rank that raised early leaves its partners waiting forever. So
   before an algorithm sends anything, each rank shares a few integers describing its call (is my input
   valid, how many elements, which dtype, which root, which op) with every other rank, and every rank raises
   the same clear error if they disagree. This guard is not part of the algorithms being taught: it shares
   one small int64 tensor with the built-in collectives (`_share`) and is not counted by
   `course_lib.traffic`. `unchecked()` switches it off (the benchmarks do, so they time only the algorithm);
   a rank's own bad argument is still reported.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import threading
import time
import zlib

import torch
import torch.distributed as dist

from course_lib import ops

__all__ = ["clock", "now", "compute", "catch_up", "active", "current_network", "untimed", "idle", "wake",
           "has_slot", "set_blocked", "clear_blocked", "set_progress", "drain",
           "MismatchError", "agree", "prepare", "unchecked", "checking", "is_checking", "dtype_code",
           "metadata_device", "name_code", "not_a_rank"]


# --------------------------------------------------------------------------------------------------
# 1. The clock a rank reads
# --------------------------------------------------------------------------------------------------
#
# Outside a modeled launch `clock()` is `time.perf_counter()` and `compute(s)` sleeps.

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


# --------------------------------------------------------------------------------------------------
# 2. What this rank is blocked in, readable by the launcher from outside the process
# --------------------------------------------------------------------------------------------------

SLOT_BYTES = 512       # the blocked-call line
PROGRESS_BYTES = 256   # the progress line, right after it
_FILE_BYTES = SLOT_BYTES + PROGRESS_BYTES

_slot: mmap.mmap | None = None     # this rank's mapped slot file, while a launch runs it


def create_slot_file(path: str) -> None:
    """Make the zero-filled file a rank will map (called by the launcher, before the rank starts)."""
    with open(path, "wb") as f:
        f.write(b"\0" * _FILE_BYTES)


def attach(path: str) -> None:
    """Map this rank's slot file; from now on `set_blocked` writes into it."""
    global _slot
    fd = os.open(path, os.O_RDWR)
    try:
        _slot = mmap.mmap(fd, _FILE_BYTES)
    finally:
        os.close(fd)


def detach() -> None:
    global _slot
    if _slot is not None:
        _slot.close()
        _slot = None


def has_slot() -> bool:
    """True inside a rank that the launcher started (it reads the slot)."""
    return _slot is not None


def set_blocked(description: str) -> None:
    """Record the call this rank is about to block in (a no-op when not under the launcher)."""
    if _slot is None:
        return
    data = description.encode("utf-8", "replace")[: SLOT_BYTES - 1]
    _slot[: len(data) + 1] = data + b"\0"


def clear_blocked() -> None:
    """The rank is no longer inside a blocking call."""
    if _slot is not None:
        _slot[0:1] = b"\0"


def read_slot_file(path: str) -> str:
    """The line a rank last wrote, or '' when it was not inside a blocking call."""
    try:
        with open(path, "rb") as f:
            raw = f.read(SLOT_BYTES)
    except OSError:
        return ""
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


def set_progress(text: str) -> None:
    """Record how far this rank's own loop has got, e.g. "epoch 3/10" ('' clears it; no-op outside a launch)."""
    if _slot is None:
        return
    data = text.encode("utf-8", "replace")[: PROGRESS_BYTES - 1]
    _slot[SLOT_BYTES: SLOT_BYTES + len(data) + 1] = data + b"\0"


def read_progress(path: str) -> str:
    """The progress line a rank last set, or ''."""
    try:
        with open(path, "rb") as f:
            f.seek(SLOT_BYTES)
            raw = f.read(PROGRESS_BYTES)
    except OSError:
        return ""
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


# --------------------------------------------------------------------------------------------------
# 3. Queued async collectives
# --------------------------------------------------------------------------------------------------

_newest_async = None       # the newest Work `_work.submit` queued: when it is done, all are
_async_worker = None       # the thread that runs them (it never waits for its own queue)


def drain() -> None:
    """Wait until every async collective this rank queued has finished (errors stay with their Work).

    `prepare` calls it first, so a synchronous call runs after the async ones queued before it. A no-op on
    the worker thread itself, which runs the queue in order anyway.
    """
    newest = _newest_async
    if newest is None or threading.current_thread() is _async_worker:
        return
    newest._wait_done()


# --------------------------------------------------------------------------------------------------
# 4. Agree before communicating
# --------------------------------------------------------------------------------------------------


def not_a_rank(name: str, peer, world_size: int) -> str | None:
    """Why `peer` (the argument `name`: dst, src) is not a rank of a group of `world_size` ranks, or None when it is."""
    if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < world_size:
        return f"{name}={peer!r} is not a rank of this group; the ranks are 0..{world_size - 1} (world_size={world_size})."
    return None


class _PerThread(threading.local):
    """Whether the cross-rank check runs, per thread: an async collective runs on the rank's worker
    thread with the setting its caller had when it queued it (see `checking`), whatever the caller
    does next. (A class attribute as the default: reading it costs no exception.)"""

    enabled = True


_checking = _PerThread()

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]


class MismatchError(ValueError):
    """The ranks called the same collective with arguments that do not fit together."""


def is_checking() -> bool:
    """Is the cross-rank agreement on in this thread? (It is unless `unchecked()` turned it off.)"""
    return _checking.enabled


@contextlib.contextmanager
def checking(enabled: bool):
    """Turn the cross-rank agreement on or off in this thread inside the block."""
    saved, _checking.enabled = is_checking(), enabled
    try:
        yield
    finally:
        _checking.enabled = saved


def unchecked():
    """Skip the cross-rank agreement inside the block (benchmarks); local checks still run."""
    return checking(False)


def dtype_code(dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)


def _dtype_name(code: int) -> str:
    return str(_DTYPES[code]) if 0 <= code < len(_DTYPES) else "another dtype"


def metadata_device(tensor=None) -> torch.device:
    """Where the small metadata tensor must live: NCCL only moves GPU tensors."""
    if isinstance(tensor, torch.Tensor):
        return tensor.device
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _by_value(values) -> str:
    groups: dict = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    parts = []
    for value, ranks in groups.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        parts.append(f"{who}: {value}")
    return "; ".join(parts)


# The functions that agree before they communicate. A rank that meets a call code it does not know
# still reports a mismatch, only less readably.
KNOWN_CALLS = ("broadcast", "scatter", "gather", "all_gather", "all_to_all", "reduce", "all_reduce",
               "reduce_scatter", "allreduce.naive", "allreduce.parameter_server", "allreduce.ring",
               "allreduce.ring_scatter_reduce", "allreduce.ring_all_gather",
               "allreduce.ring_pipelined", "allreduce.ring_bidirectional", "allreduce.halving_doubling",
               "allreduce.recursive_doubling", "allreduce.tree")


def name_code(name: str) -> int:
    """A name as a non-negative int32, so ranks can compare names inside an integer metadata row."""
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


_CALL_NAMES = {name_code(name): name for name in KNOWN_CALLS}


def _row_width(world_size: int) -> int:
    # Every rank sends a row of the same length, whichever function it is in, so that ranks which
    # disagree about the function itself still meet in one exchange and can say so.
    # [problem flag, call code, fields...]; all_to_all has the most fields: dtype + 2 sizes per rank.
    return 2 + max(4, 1 + 2 * world_size)


def agree(call: str, fields: dict, same: tuple = (), problem: Exception | None = None,
          device: torch.device | None = None, describe: dict | None = None) -> list[dict]:
    """Share `fields` (name -> int) with every rank and check the ones named in `same` agree.

    Every rank also shares which function it is in, so ranks that call different collectives at the
    same point stop with an error instead of reading each other's messages.

    Args:
        call: the collective's name, for messages (one of KNOWN_CALLS).
        fields: this rank's description of its call, e.g. {"numel": 12, "dtype": 0, "root": 0}.
        same: names of fields that must be equal on every rank.
        problem: an exception this rank found in its own arguments; it is raised here, and every
            other rank raises too instead of waiting for this one.
        device: where to put the metadata tensor (default: `metadata_device()`, a GPU under NCCL).
        describe: optional name -> function(int) -> str to print a field's values readably.

    Returns:
        Every rank's fields, index = rank (empty when the check is switched off).
    """
    if not is_checking():
        if problem is not None:
            raise problem
        return []
    names = list(fields)
    world_size = dist.get_world_size()
    values = [1 if problem is not None else 0, name_code(call)] + [int(fields[n]) for n in names]
    if len(values) > _row_width(world_size):
        raise ValueError(f"{call}: too many fields to agree on ({len(names)})")
    values += [0] * (_row_width(world_size) - len(values))
    row = torch.tensor(values, dtype=torch.int64, device=device or metadata_device())
    if has_slot():  # so a launch that times out here can say which call never came
        set_blocked(f"{call}'s argument check (every rank's arguments, shared with built-in collectives), "
                               f"which waits until every rank has called {call}")
    try:
        with untimed():  # on a modeled clock the check costs nothing: it is not the algorithm being timed
            rows = _share(row, world_size).tolist()
    finally:
        clear_blocked()
    if problem is not None:
        raise problem
    calls = [r[1] for r in rows]
    if len(set(calls)) > 1:
        shown = [_CALL_NAMES.get(code, f"another function (code {code})") for code in calls]
        raise MismatchError(f"the ranks called different functions at the same point: {_by_value(shown)}. "
                            "Every rank must make the same collective calls, in the same order.")
    failed = [rank for rank, r in enumerate(rows) if r[0] != 0]
    if failed:
        raise MismatchError(f"{call}: rank(s) {failed} passed invalid arguments (see their own error for what); "
                            "every rank stops here instead of waiting for them.")
    table = [dict(zip(names, r[2:])) for r in rows]
    describe = {"dtype": _dtype_name, **(describe or {})}
    for name in same:
        column = [r[name] for r in table]
        if len(set(column)) > 1:
            shown = [describe.get(name, str)(v) for v in column]
            raise MismatchError(f"{call}: the ranks disagree about {name}: {_by_value(shown)}. "
                                f"Every rank must call {call} with the same {name}.")
    return table


def _share(row: torch.Tensor, world_size: int) -> torch.Tensor:
    """Every rank's `row`, on every rank: a (world_size, len(row)) table, index = rank.

    From 3 ranks on, rank 0 gathers the rows and broadcasts the table: 2 (G - 1) messages in all, where gloo's
    ring `all_gather` sends G (G - 1). This check runs before every collective, small ones included, so it
    should cost little beside what it guards: it takes the way with fewer messages, and with 2 ranks, where
    both send 2, the one call rather than two. Both ways, measured: benchmarks/results/argument_check.md.
    """
    if world_size <= 2:
        return _all_gather_rows(row, world_size)
    return _gather_and_broadcast_rows(row, world_size)


def _empty_table(row: torch.Tensor, world_size: int) -> torch.Tensor:
    return torch.empty((world_size, row.numel()), dtype=row.dtype, device=row.device)


def _all_gather_rows(row: torch.Tensor, world_size: int) -> torch.Tensor:
    table = _empty_table(row, world_size)
    dist.all_gather(list(table.unbind(0)), row)                         # views: all_gather writes into the table
    return table


def _gather_and_broadcast_rows(row: torch.Tensor, world_size: int) -> torch.Tensor:
    table = _empty_table(row, world_size)
    dist.gather(row, list(table.unbind(0)) if dist.get_rank() == 0 else None, dst=0)
    dist.broadcast(table, src=0)
    return table


NO_OP = object()  # what `prepare` gets from a collective that takes no reduce op


def prepare(call: str, tensor, op=NO_OP, root=None, local=None, same=("numel", "dtype", "op", "root"),
            root_name=None):
    """Wait for queued async collectives, check one rank's arguments, agree on them with every other
    rank, and return the op's name.

    Args:
        call: the function's name, for messages ('all_reduce', 'allreduce.ring', ...).
        tensor: the tensor this rank passed (checked to be one).
        op: the reduce op; leave it out for collectives without one (an op of None is an error:
            it would otherwise only fail halfway through the algorithm, or not at all on one rank).
        root: src/dst for rooted collectives, or None.
        local: optional function raising TypeError/ValueError (or NotImplementedError) for further
            local problems.
        same: the fields that must agree across ranks.
        root_name: the root argument's name ('src', 'dst') when the call must have one: then a root
            of None is an error too (a receive from "anyone" would wait forever).

    Raises:
        TypeError / ValueError / NotImplementedError on the rank whose own argument is wrong;
        MismatchError on every other rank (and on every rank when the ranks disagree with each other).
    """
    drain()  # this call runs after the async collectives this rank queued before it
    problem = None
    try:
        try:
            op = None if op is NO_OP else ops.normalize(op)
        except ValueError as exc:
            raise ValueError(f"{call}: {exc}") from None
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{call} expects a torch.Tensor, got {type(tensor).__name__}. "
                            "Wrap your data first, e.g. torch.tensor(values).")
        why = op and ops.check_dtype(op, tensor.dtype)
        if why:
            raise TypeError(f"{call}: {why}")
        world_size = dist.get_world_size()
        if root is None and root_name is not None:
            raise ValueError(f"{call}: {root_name}=None, but {call} needs to know which rank "
                             f"{'holds the data' if root_name == 'src' else 'receives the result'}: pass "
                             f"{root_name}=<a rank from 0 to {world_size - 1}>, e.g. {call}(tensor, {root_name}=0). "
                             f"(torch.distributed.{call} refuses a missing {root_name} too.)")
        if root is not None and not isinstance(root, int) and hasattr(root, "__index__"):  # numpy.int64, ...
            raise ValueError(f"{call}: {root_name or 'root'}={root!r} is a {type(root).__name__}; pass the rank as a "
                             f"Python int, e.g. {root_name or 'root'}=int(...).")
        if root is not None and (isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < world_size):
            named = f"{root_name}={root!r}: " if root_name else ""
            raise ValueError(f"{call}: {named}rank {root!r} is not in the group; the ranks are 0..{world_size - 1} "
                             f"(world_size={world_size}).")
        if local is not None:
            local()
    except (TypeError, ValueError, NotImplementedError) as exc:
        problem = exc
    is_tensor = isinstance(tensor, torch.Tensor)
    fields = {"numel": tensor.numel() if is_tensor else -1,
              "dtype": dtype_code(tensor.dtype) if is_tensor else -1,
              "op": ops.OPS.index(op) if op in ops.OPS else -1,
              "root": root if isinstance(root, int) and problem is None else -1}
    agree(call, fields, same=same, problem=problem, device=metadata_device(tensor if is_tensor else None),
          describe={"op": lambda i: ops.OPS[i] if 0 <= i < len(ops.OPS) else "none", "numel": str})
    return op


def _forget_after_fork() -> None:
    """A forked child is on no modeled clock and has no async worker (the slot stays: it is the rank's)."""
    global _state, _newest_async, _async_worker
    _state = None
    _local.__dict__.clear()
    _newest_async, _async_worker = None, None
    ops.charge_reduction = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
