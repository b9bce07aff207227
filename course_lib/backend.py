"""course_lib's own torch.distributed backend: gloo carries the data, layers above it see every call.

    dist.init_process_group("course_lib", ...)   # what launch(fn, G, network=...) and the exercise checks do

torch lets a library add a backend of its own (`torch.distributed.Backend.register_backend`, the seam
torch's fake and threaded process groups use). This one is a `ProcessGroup` written in Python: each of
its operations passes through the *layers* this process has installed, outermost first, and then runs on
an ordinary gloo process group underneath. torch sends every call through the process group, so one path
sees them all: ``dist.send / recv / isend / irecv``, ``batch_isend_irecv``, the collectives and the object
collectives built on them, functional collectives, a group's own methods, and DistributedDataParallel's
reducer, which calls the process group from C++. Nothing in ``torch.distributed`` is replaced: inside a
rank ``dist.all_reduce is dist.distributed_c10d.all_reduce``, as anywhere.

The layers course_lib installs (outermost first):

* the exercises' tracer (`course_lib.exercises.tracing.Tracer`, while a check runs one case): what each
  message carried, the calls an exercise forbids;
* the modeled clock (`course_lib.modeled_clock`, under ``launch(..., network=...)``): what each call costs.

A layer is an object with any of these methods; a method it lacks passes the call on unchanged::

    send(group, tensor, dst, tag, proceed) -> Work      dst: a rank of `group`; proceed(tensor, dst, tag)
    recv(group, tensor, src, tag, proceed) -> Work      src: None for any source; proceed(tensor, src, tag)
    collective(group, call, proceed) -> Work            call: a `Collective`; proceed() runs it
    new_group(group, ranks, proceed)                    before a subgroup is made (every rank; its members alone with
                                                        use_local_synchronization=True); ranks: global

`group` is the `ProcessGroup` the call came through (`group.global_ranks[r]` is group rank r's rank in
the world). A returned Work is this module's `Work` or a subclass: torch hands it to the caller as it is.

`recording(rank, world_size, ...)` makes a process group that moves nothing, apart from the process's own
(a launched rank's included), so a function can run on each rank in turn in this very process, to read what it
sends (`course_lib.recording.record_schedule` is built on it).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import threading
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from course_lib.runtime import not_a_rank

__all__ = ["NAME", "ProcessGroup", "Work", "Collective", "install", "remove", "layers", "active", "caller",
           "init_process_group", "recording"]

NAME = "course_lib"
_C10D_FILE = os.path.abspath(distributed_c10d.__file__)


# --------------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------------

_layers: tuple = ()          # outermost first; replaced whole, so a call in flight keeps the tuple it started with
_lock = threading.Lock()


def install(layer, outermost: bool = False) -> None:
    """Add `layer` below the ones installed so far (or above them all, with `outermost`)."""
    global _layers
    with _lock:
        _layers = (layer, *_layers) if outermost else (*_layers, layer)


def remove(layer) -> None:
    """Take `layer` out (a no-op if it is not installed)."""
    global _layers
    with _lock:
        _layers = tuple(other for other in _layers if other is not layer)


def layers() -> tuple:
    return _layers


def active() -> bool:
    """True when this process's default process group is course_lib's (so installed layers see its calls)."""
    return dist.is_available() and dist.is_initialized() and isinstance(distributed_c10d._get_default_group(),
                                                                         ProcessGroup)


@dataclass(frozen=True)
class Collective:
    """A collective call as a layer sees it.

    Attributes:
        kind: 'all_reduce', 'broadcast', 'reduce', 'all_gather', 'reduce_scatter', 'all_to_all', 'gather',
            'scatter' or 'barrier'.
        nbytes: the bytes that define its cost: the tensor for all_reduce, broadcast and reduce; the whole
            buffer (every rank's piece) for the others.
        root: the root's rank in the group (broadcast, reduce, gather, scatter), else None.
        element_size: bytes per element.
    """

    kind: str
    nbytes: int
    root: int | None = None
    element_size: int = 4


def caller() -> str:
    """The torch.distributed function the program called to get here: the outermost one on the stack
    (``all_gather_object``, not the ``all_gather`` inside it), or '' when none is (DDP's reducer, a group's
    own method)."""
    frame, name = sys._getframe(1), ""
    while frame is not None:
        code = frame.f_code
        if code.co_filename == _C10D_FILE and not code.co_name.startswith("_") and code.co_name != "wrapper":
            name = code.co_name
        frame = frame.f_back
    return name


# --------------------------------------------------------------------------------------------------
# Work
# --------------------------------------------------------------------------------------------------


class Work(dist.Work):
    """The handle of an operation: waits for the Work under it (gloo's, or a lower layer's).

    Layers subclass it to do something before or after (the clock waits for modeled time first)."""

    def __init__(self, under=None):
        super().__init__()
        self.under = under

    def wait(self, timeout=None) -> bool:
        if self.under is None:
            return True
        return self.under.wait() if timeout is None else self.under.wait(timeout)

    def is_completed(self) -> bool:
        return True if self.under is None else self.under.is_completed()

    def is_success(self) -> bool:
        return True if self.under is None else self.under.is_success()

    def exception(self):
        return None if self.under is None else self.under.exception()

    def get_future(self):
        if self.under is None:
            future = torch.futures.Future()
            future.set_result([])
            return future
        return self.under.get_future()

    def _source_rank(self) -> int:
        return self.under._source_rank()

    def source_rank(self) -> int:
        return self._source_rank()

    def result(self):
        return [] if self.under is None else self.under.result()

    def synchronize(self) -> None:
        if self.under is not None:
            self.under.synchronize()


# --------------------------------------------------------------------------------------------------
# The process group
# --------------------------------------------------------------------------------------------------


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _element_size(tensors) -> int:
    return tensors[0].element_size() if tensors else 1


def _flat(lists) -> list:
    return [t for inner in lists for t in inner]


def _options(opts, kind: str):
    """torch's options object for a call made without one (a group's method called as ``group.allreduce([t])``)."""
    return opts if opts is not None else getattr(torch._C._distributed_c10d, kind)()



class ProcessGroup(dist.ProcessGroup):
    """torch.distributed's process group, run through the installed layers onto `under` (a gloo group).

    Made by torch (`init_process_group("course_lib")`, `new_group`), not by hand."""

    def __init__(self, rank: int, size: int, under, global_ranks, name: str, store, default: bool = True):
        super().__init__(rank, size)
        self.under = under
        self.global_ranks = tuple(global_ranks)
        self.store = store
        self._name = name
        # the same number on every member: 0 for the default group, else from the subgroup's name (the clock
        # matches collectives per group with it)
        self.code = 0 if default else zlib.crc32(str(name).encode()) + 1

    # -- what torch asks of any group ---------------------------------------------------------------

    def getBackendName(self) -> str:
        return NAME

    def _set_group_name(self, name) -> None:
        self._name = name

    @property
    def group_name(self) -> str:
        return self._name

    def __repr__(self) -> str:
        return f"course_lib.backend.ProcessGroup(rank={self.rank()}, size={self.size()}, ranks={list(self.global_ranks)})"

    # -- point to point -------------------------------------------------------------------------------

    def send(self, tensors, dst, tag):
        (tensor,) = tensors
        self._check_peer(dst, "dst")
        return _send(_layers, 0, self, tensor, dst, tag)

    def recv(self, tensors, src, tag):
        (tensor,) = tensors
        self._check_peer(src, "src")
        return _recv(_layers, 0, self, tensor, src, tag)

    def _check_peer(self, peer, name) -> None:
        """A peer outside the group is refused here, plainly, before gloo turns it into a crash (SIGSEGV) or a hang."""
        problem = not_a_rank(name, peer, self.size())
        if problem is None:
            return
        call = caller() or ("send" if name == "dst" else "recv")
        verb = "tried to send to" if name == "dst" else "tried to receive from"
        raise ValueError(f"{call}: rank {self.rank()} {verb} rank {peer}, which does not exist: {problem}")

    def recv_anysource(self, tensors, tag):
        (tensor,) = tensors
        return _recv(_layers, 0, self, tensor, None, tag)

    # -- collectives ----------------------------------------------------------------------------------

    def _run(self, call: Collective, run):
        return _collective(_layers, 0, self, call, run)

    def allreduce(self, tensors, opts=None):
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
        opts = _options(opts, "AllreduceOptions")
        return self._run(Collective("all_reduce", _nbytes(tensors), None, _element_size(tensors)),
                         lambda: self.under.allreduce(tensors, opts))

    def allreduce_coalesced(self, tensors, opts=None):
        opts = _options(opts, "AllreduceCoalescedOptions")
        return self._run(Collective("all_reduce", _nbytes(tensors), None, _element_size(tensors)),
                         lambda: self.under.allreduce_coalesced(tensors, opts))

    def broadcast(self, tensors, opts=None):
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
        opts = _options(opts, "BroadcastOptions")
        return self._run(Collective("broadcast", _nbytes(tensors), opts.rootRank, _element_size(tensors)),
                         lambda: self.under.broadcast(tensors, opts))

    def reduce(self, tensors, opts=None):
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
        opts = _options(opts, "ReduceOptions")
        return self._run(Collective("reduce", _nbytes(tensors), opts.rootRank, _element_size(tensors)),
                         lambda: self.under.reduce(tensors, opts))

    def allgather(self, output_tensors, input_tensors, opts=None):
        opts = _options(opts, "AllgatherOptions")
        return self._run(Collective("all_gather", _nbytes(_flat(output_tensors)), None, _element_size(input_tensors)),
                         lambda: self.under.allgather(output_tensors, input_tensors, opts))

    def _allgather_base(self, output, input, opts=None):
        opts = _options(opts, "AllgatherOptions")
        return self._run(Collective("all_gather", _nbytes([output]), None, output.element_size()),
                         lambda: self.under._allgather_base(output, input, opts))

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        opts = _options(opts, "AllgatherOptions")
        return self._run(Collective("all_gather", _nbytes(_flat(output_lists)), None, _element_size(input_list)),
                         lambda: self.under.allgather_coalesced(output_lists, input_list, opts))

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self._allgather_base(o, i, opts) for o, i in zip(outputs, inputs)]
        return _All(works)

    def gather(self, output_tensors, input_tensors, opts=None):
        opts = _options(opts, "GatherOptions")
        nbytes = _nbytes(input_tensors) * self.size()
        return self._run(Collective("gather", nbytes, opts.rootRank, _element_size(input_tensors)),
                         lambda: self.under.gather(output_tensors, input_tensors, opts))

    def scatter(self, output_tensors, input_tensors, opts=None):
        opts = _options(opts, "ScatterOptions")
        nbytes = _nbytes(output_tensors) * self.size()
        return self._run(Collective("scatter", nbytes, opts.rootRank, _element_size(output_tensors)),
                         lambda: self.under.scatter(output_tensors, input_tensors, opts))

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        opts = _options(opts, "ReduceScatterOptions")
        return self._run(Collective("reduce_scatter", _nbytes(_flat(input_tensors)), None,
                                    _element_size(output_tensors)),
                         lambda: self.under.reduce_scatter(output_tensors, input_tensors, opts))

    def _reduce_scatter_base(self, output, input, opts=None):
        opts = _options(opts, "ReduceScatterOptions")
        return self._run(Collective("reduce_scatter", _nbytes([input]), None, input.element_size()),
                         lambda: self.under._reduce_scatter_base(output, input, opts))

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs)]
        return _All(works)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        opts = _options(opts, "AllToAllOptions")
        return self._run(Collective("all_to_all", _nbytes([input]), None, input.element_size()),
                         lambda: self.under.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts))

    def alltoall(self, output_tensors, input_tensors, opts=None):
        opts = _options(opts, "AllToAllOptions")
        return self._run(Collective("all_to_all", _nbytes(input_tensors), None, _element_size(input_tensors)),
                         lambda: self.under.alltoall(output_tensors, input_tensors, opts))

    def barrier(self, opts=None):
        opts = _options(opts, "BarrierOptions")
        return self._run(Collective("barrier", 0), lambda: self.under.barrier(opts))

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        work = self._run(Collective("barrier", 0), lambda: None)
        work.wait()
        return self.under.monitored_barrier(timeout, wait_all_ranks)

    # -- subgroups ------------------------------------------------------------------------------------

    def new_group(self, ranks, timeout=None, pg_options=None, group_name=None, group_desc=None):
        """torch's `new_group` hands the making of a subgroup to the default group (every rank calls it)."""
        ranks = list(range(self.size())) if ranks is None else list(ranks)
        _new_group(_layers, 0, self, ranks)
        me = self.global_ranks[self.rank()]
        if me not in ranks:
            return None
        store = dist.PrefixStore(f"{group_name}/", self.store)
        under = self.under.new_subgroup(store, ranks.index(me), len(ranks), timeout) \
            if isinstance(self.under, _Nowhere) else _gloo(store, ranks.index(me), len(ranks), timeout)
        return ProcessGroup(ranks.index(me), len(ranks), under, ranks, group_name, store, default=False)


class _All(Work):
    """One Work for several (a coalesced call made of one call per tensor)."""

    def __init__(self, works):
        super().__init__(None)
        self.works = works

    def wait(self, timeout=None) -> bool:
        for work in self.works:
            work.wait() if timeout is None else work.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)

    def is_success(self) -> bool:
        return all(work.is_success() for work in self.works)

    def exception(self):
        return next((e for e in (work.exception() for work in self.works) if e is not None), None)

    def get_future(self):
        return torch.futures.collect_all([work.get_future() for work in self.works])


def _send(layers, index, group, tensor, dst, tag):
    if index == len(layers):
        return Work(group.under.send([tensor], dst, tag))
    method = getattr(layers[index], "send", None)
    if method is None:
        return _send(layers, index + 1, group, tensor, dst, tag)
    return method(group, tensor, dst, tag, lambda t, d, g: _send(layers, index + 1, group, t, d, g))


def _recv(layers, index, group, tensor, src, tag):
    if index == len(layers):
        under = group.under
        return Work(under.recv_anysource([tensor], tag) if src is None else under.recv([tensor], src, tag))
    method = getattr(layers[index], "recv", None)
    if method is None:
        return _recv(layers, index + 1, group, tensor, src, tag)
    return method(group, tensor, src, tag, lambda t, s, g: _recv(layers, index + 1, group, t, s, g))


def _collective(layers, index, group, call, run):
    if index == len(layers):
        return Work(run())
    method = getattr(layers[index], "collective", None)
    if method is None:
        return _collective(layers, index + 1, group, call, run)
    return method(group, call, lambda: _collective(layers, index + 1, group, call, run))


def _new_group(layers, index, group, ranks):
    if index == len(layers):
        return
    method = getattr(layers[index], "new_group", None)
    if method is None:
        _new_group(layers, index + 1, group, ranks)
        return
    method(group, ranks, lambda: _new_group(layers, index + 1, group, ranks))


# --------------------------------------------------------------------------------------------------
# What carries the data
# --------------------------------------------------------------------------------------------------


def _gloo(store, rank: int, size: int, timeout):
    """A gloo process group on `store` (its sockets on GLOO_SOCKET_IFNAME's interface, as torch's own)."""
    if not isinstance(timeout, datetime.timedelta):
        timeout = distributed_c10d.default_pg_timeout
    return distributed_c10d.ProcessGroupGloo(store, rank, size, timeout)


class _Nowhere:
    """Under a recording (`recording`): every message is done at once and moves nothing; collectives refuse."""

    def __init__(self, refusal: str):
        self.refusal = refusal

    def send(self, tensors, dst, tag):
        return None

    def recv(self, tensors, src, tag):
        return None

    def recv_anysource(self, tensors, tag):
        raise RuntimeError(f"{self.refusal}: a receive from any source cannot be recorded; name the sender")

    def barrier(self, opts=None):
        opts = _options(opts, "BarrierOptions")
        return None

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        return None

    def new_subgroup(self, store, rank, size, timeout):
        return self

    def __getattr__(self, name):
        def refuse(*args, **kwargs):
            raise RuntimeError(f"{self.refusal}; the function called torch.distributed.{caller() or name}")
        return refuse


_under = threading.local()


def _create(common, options):
    """The creator torch calls for `init_process_group("course_lib")` (extended API: `common` has the store,
    the group rank and size, the timeout and the group's name)."""
    refusal = getattr(_under, "recording", None)
    under = _Nowhere(refusal) if refusal else _gloo(common.store, common.group_rank, common.group_size,
                                                    common.timeout)
    global_ranks = list(common.global_ranks_in_group) or list(range(common.group_size))
    return ProcessGroup(common.group_rank, common.group_size, under, global_ranks, common.group_id, common.store)


def _register() -> None:
    if NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu"])


_register()


def init_process_group(rank: int, world_size: int, timeout: datetime.timedelta, init_method: str | None = None,
                       store=None) -> None:
    """`torch.distributed.init_process_group` with this backend (gloo underneath)."""
    dist.init_process_group(NAME, init_method=init_method, store=store, rank=rank, world_size=world_size,
                            timeout=timeout)


class _WorldApart(distributed_c10d._World):
    """torch.distributed's bookkeeping of process groups (its `_World`), kept apart from this process's own.

    torch keeps the maps of its groups in module globals that every `_World` shares; this one keeps maps of its
    own, so a recording neither sees nor changes the groups of the rank it runs in. Its groups are numbered on
    from `_FIRST_APART_NAME`, where no group of the process's own is: torch registers every group by its name,
    process-wide, and refuses a second group of the same name."""

    def __init__(self):
        super().__init__()
        self._pg_map, self._pg_names, self._pg_group_ranks, self._pg_backend_config = {}, {}, {}, {}
        self._tags_to_pg, self._pg_to_tag = {}, {}

    pg_map = property(lambda self: self._pg_map)
    pg_names = property(lambda self: self._pg_names)
    pg_group_ranks = property(lambda self: self._pg_group_ranks)
    pg_backend_config = property(lambda self: self._pg_backend_config)
    tags_to_pg = property(lambda self: self._tags_to_pg)
    pg_to_tag = property(lambda self: self._pg_to_tag)

    @property
    def group_count(self) -> int:
        return _apart_names["next"]

    @group_count.setter
    def group_count(self, value: int) -> None:
        _apart_names["next"] = value          # one count for every apart world: a nested recording's names differ too


_FIRST_APART_NAME = 1 << 30
_apart_names = {"next": _FIRST_APART_NAME}


@contextlib.contextmanager
def _apart():
    """torch's world of process groups and this process's layers, set aside for the block and put back after it.

    torch's world (`distributed_c10d._world`) is swapped for a `_WorldApart`, as torch's own threaded process
    group swaps it (torch.testing._internal.distributed.multi_threaded_pg); what initialising a group there
    changes beside it (torch's exception hook, its record of the default backend) is put back, and the apart
    groups leave torch's registry of names. Both are the process's, not a thread's: the block belongs between
    this process's own calls, on the thread that makes them."""
    global _layers
    saved_world, saved_layers, saved_hook = distributed_c10d._world, _layers, sys.excepthook
    saved_backend = distributed_c10d._backend, distributed_c10d._default_pg_init_method
    world = distributed_c10d._world = _WorldApart()
    with _lock:
        _layers = ()
    try:
        yield
    finally:
        for name in world.pg_names.values():
            distributed_c10d._unregister_process_group(name)
        distributed_c10d._world = saved_world
        with _lock:
            _layers = saved_layers
        sys.excepthook = saved_hook
        distributed_c10d._backend, distributed_c10d._default_pg_init_method = saved_backend


@contextlib.contextmanager
def recording(rank: int, world_size: int, refusal: str):
    """A default process group of `world_size` in this process, as rank `rank`, that moves nothing: every send
    and receive completes at once (a receive leaves its buffer as it is), and a collective raises
    RuntimeError(`refusal` + the call). Layers installed inside the block see every call, as in a launch.

    For reading what a function sends without launching it (its messages must not depend on the values it
    receives, as an all-reduce's do not). It works inside a launched rank too: the group lives in a world of
    torch's bookkeeping of its own, and the layers the process had installed are set aside, so the rank's own
    groups and layers are as they were after the block, and saw nothing of it (`_apart`)."""
    with _apart():
        _under.recording = refusal
        try:
            dist.init_process_group(NAME, store=dist.HashStore(), rank=rank, world_size=world_size)
        finally:
            _under.recording = None
        yield
