"""Run one SPMD function on N local ranks, from a notebook cell or a script.

    results = launch(fn, world_size=4)      # fn(rank, world_size) runs in 4 processes

Every rank is a real process with its own `torch.distributed` process group, exactly as under
`torchrun`; `launch` only saves you from opening four terminals. What it adds for learning:

* output: what each rank prints is collected and shown grouped by rank, "[rank 0] ..." first,
  the same on every run (live output from four processes would interleave at random);
* errors: an exception on any rank stops every rank within a fraction of a second and is raised
  here as `RankFailedError`, naming the rank and carrying its traceback. A rank killed by a signal
  (gloo aborts a process whose receive buffer is too small) is reported the same way, with the
  signal and the last lines it wrote to stderr;
* deadlocks: after `timeout` seconds `LaunchTimeoutError` says, for every rank, which send or recv
  it was blocked in, so the cycle of waiting ranks can be read off;
* cleanup: no child process, store file or socket outlives the call, whatever happened.

Under `torchrun` the same function runs unchanged: see `run_torchrun`.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from multiprocessing import connection as mp_connection
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from course_lib import _rankstate, _work
from course_lib import _maestro
from course_lib import backend as _backend
from course_lib import modeled_clock as _clock
from course_lib import network as _network
from course_lib.live import LaunchStatus

DEFAULT_TIMEOUT = 20.0
# The process group's own timeout is a little longer than the launcher's watchdog, so that on a
# deadlock the watchdog fires first and can report every rank's state before anyone raises.
_GROUP_TIMEOUT_GRACE = 10.0
_STDERR_TAIL_LINES = 20
_FINISHED = "finished"  # status line of a rank that returned and waits for the others
# What `launch` shows of each rank's stdout and of its stderr. A rank that prints inside a loop over
# a million elements would otherwise pour megabytes into the notebook (and could freeze the browser).
MAX_OUTPUT_CHARS = 20_000

__all__ = [
    "launch",
    "device",
    "run_torchrun",
    "under_torchrun",
    "resolve_backend",
    "LaunchError",
    "RankFailedError",
    "LaunchTimeoutError",
    "NothingReturned",
]


class LaunchError(RuntimeError):
    """Base class of everything `launch` raises about the ranks it ran."""


class RankFailedError(LaunchError):
    """A rank raised an exception or died; the other ranks were stopped.

    Attributes:
        rank: the rank that failed first.
        exc_type: name of the exception class it raised ('' if it died without one).
        rank_traceback: that rank's formatted traceback ('' if it died without one).
        exitcode: the process exit code; negative means killed by signal ``-exitcode``.
        stderr_tail: the last lines the rank wrote to stderr.
    """

    def __init__(self, message, *, rank, exc_type="", rank_traceback="", exitcode=None, stderr_tail=""):
        super().__init__(message)
        self.rank = rank
        self.exc_type = exc_type
        self.rank_traceback = rank_traceback
        self.exitcode = exitcode
        self.stderr_tail = stderr_tail


class LaunchTimeoutError(LaunchError, TimeoutError):
    """The ranks did not finish within `timeout` seconds.

    Attributes:
        blocked: dict rank -> what that rank was doing when time ran out, e.g.
            "recv(src=1, shape=(4,), dtype=torch.float32)".
    """

    def __init__(self, message, *, blocked):
        super().__init__(message)
        self.blocked = blocked


class NothingReturned(list):
    """What `launch` returns when `fn` returned None on every rank: the list of Nones, with a hint.

    Printed or shown later it says how to get values back. Shown as the value of the very notebook
    cell that called `launch` (a cell run for what the ranks print) it shows nothing, so such cells
    stay as quiet as a function call that returns None.
    """

    HINT = "fn returned None on every rank: end it with `return <value>` to get values back"

    def __init__(self, world_size: int):
        super().__init__([None] * world_size)
        self._cell = _notebook_cell()

    def __repr__(self) -> str:
        return f"{list.__repr__(self)}  # {self.HINT}"

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(repr(self))

    def _ipython_display_(self) -> None:
        if self._cell is None or self._cell != _notebook_cell():
            print(repr(self))


def _notebook_cell():
    """The execution count of the notebook cell running now, or None outside IPython."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    return getattr(shell, "execution_count", None)


# --------------------------------------------------------------------------------------------------
# Choosing a backend and a start method
# --------------------------------------------------------------------------------------------------


def _visible_gpu_count() -> int:
    # device_count() asks NVML when it can, so it does not initialise CUDA in this process
    # (which would make later forks unsafe).
    try:
        return torch.cuda.device_count()
    except Exception:  # a broken driver counts as no GPU
        return 0


def resolve_backend(backend: str, world_size: int, gpus_per_node: int | None = None) -> str:
    """Turn "auto" into "gloo" or "nccl" and check the choice can work.

    "auto" picks NCCL when there is a GPU for every rank, else gloo on the CPU. Asking for NCCL
    with fewer GPUs than ranks is an error: NCCL needs one GPU per rank.
    """
    if backend not in ("auto", "gloo", "nccl", _backend.NAME):
        raise ValueError(f"backend must be 'auto', 'gloo', 'nccl' or {_backend.NAME!r} (gloo through course_lib's "
                         f"layers), not {backend!r}")
    gpus = _visible_gpu_count()
    need = world_size if gpus_per_node is None else gpus_per_node
    if backend == "auto":
        if gpus >= need and gpus > 0 and dist.is_nccl_available():
            return "nccl"
        if gpus > 0:  # a Colab GPU with 4 ranks: say why the GPU sits idle
            _notice_once(
                "gloo-fallback",
                f"backend 'auto' runs the {need} ranks on the CPU with gloo: {gpus} GPU(s) visible, and NCCL "
                "needs one GPU per rank (two ranks on one GPU fail with 'Duplicate GPU detected').",
            )
        return "gloo"
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise ValueError(
                "backend='nccl' was asked for, but this PyTorch build has no NCCL (a CPU-only build?). "
                "Use backend='gloo' to run the ranks on the CPU."
            )
        if gpus < need:
            raise ValueError(
                f"backend='nccl' needs one GPU per rank: {need} ranks on this machine but {gpus} GPU(s) visible. "
                f"Use backend='gloo' (runs on the CPU), or a world_size of at most {gpus}, "
                "or spread the ranks over several machines with torchrun."
            )
    return backend


_NOTICES_GIVEN: set = set()


def _notice_once(key: str, text: str) -> None:
    """Print one line about a choice launch made for the learner, the first time only (per process)."""
    if key not in _NOTICES_GIVEN:
        _NOTICES_GIVEN.add(key)
        print(f"course_lib: {text}", file=sys.stderr, flush=True)


def _autograd_device_threads() -> list[str]:
    """Names of autograd's per-device worker threads running in this process (Linux only, else []).

    On a PyTorch build with GPUs, the first backward() starts one thread per device, named
    "pt_autograd_<device>" (c10::setThreadName in torch/csrc/autograd/engine.cpp). A forked child
    inherits the engine's state but not those threads, and its own backward() then fails with
    "Unable to handle autograd's threading in combination with fork-based multiprocessing".
    """
    names = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return names
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended while we looked
            continue
        if name.startswith("pt_autograd_"):
            names.append(name)
    return sorted(names)


def _why_not_fork() -> tuple[str, str] | None:
    """(what, why) forking this process would break the ranks, or None if fork is safe."""
    if torch.cuda.is_initialized():
        return "cuda", ("CUDA is already initialised in this process (a cell used the GPU), "
                        "and a forked rank cannot use it")
    threads = _autograd_device_threads()
    if threads:
        return "autograd", (f"autograd's GPU threads ({', '.join(threads)}) run in this process since a backward() "
                            "here, and a forked rank's backward() would fail")
    return None


def _start_method() -> str:
    # fork is fast (no new interpreter, no torch import) and carries functions defined in a notebook.
    # It is not offered on Windows and macOS, and it breaks the ranks once this process has touched
    # the GPU (_why_not_fork); there we spawn fresh interpreters and ship the function with
    # cloudpickle instead. The learner is told once why their launches got slower.
    if not sys.platform.startswith("linux"):
        return "spawn"
    reason = _why_not_fork()
    if reason is None:
        return "fork"
    what, why = reason
    _notice_once(f"spawn-{what}", f"launch starts the ranks with spawn, not fork: {why}.")
    return "spawn"


def _loopback_interface() -> str | None:
    for name in ("lo", "lo0"):
        if os.path.exists(f"/sys/class/net/{name}") or (name == "lo0" and sys.platform == "darwin"):
            return name
    return None


# --------------------------------------------------------------------------------------------------
# Inside a rank
# --------------------------------------------------------------------------------------------------


@dataclass
class _RankFiles:
    """Paths one rank uses to talk back to the launcher: every one lives in the launch's temp dir."""

    workdir: str
    rank: int

    def path(self, kind: str) -> str:
        return os.path.join(self.workdir, f"{kind}.{self.rank}")

    @property
    def stdout(self):
        return self.path("stdout")

    @property
    def stderr(self):
        return self.path("stderr")

    @property
    def result(self):
        return self.path("result")

    @property
    def status(self):
        return self.path("status")

    @property
    def network(self):
        return os.path.join(self.workdir, "clock.sock")  # the modeled clock's coordinator listens here (one per launch)

    @property
    def stack(self):
        return self.path("stack")


class _CpuPickler(pickle.Pickler):
    """Pickles return values; CUDA tensors come back as CPU tensors.

    Unpickling a CUDA tensor in the notebook would initialise CUDA there, and after that the
    launcher could no longer fork. A CPU copy is what a learner wants to plot or compare anyway.
    """

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
            return obj.detach().cpu().__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        return NotImplemented


def _write_atomically(path: str, payload: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(payload)
    os.replace(tmp, path)


def _redirect_output(files: _RankFiles):
    """Send this rank's stdout/stderr (Python and C level) to its own files, line-buffered."""
    for fd, path in ((1, files.stdout), (2, files.stderr)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)


def _die_with_parent() -> None:
    """Ask Linux to kill this rank if the launching process dies (kernel restart, kill -9)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except Exception:
        return
    # A spawned rank gets here only after importing torch (seconds): if the launcher died in the
    # meantime (a kernel restart), the signal above will never come, so leave now.
    import multiprocessing

    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:
        os._exit(1)


def _schedule_as_batch() -> None:
    """Run this rank, and every thread it starts from now on, under Linux's SCHED_BATCH policy.

    A gloo message wakes two threads: the receiver's gloo loop thread reads the socket and wakes the rank
    waiting on it. Under the default policy each woken thread preempts whatever runs on its core at once, so
    with more ranks than cores (8 ranks on a laptop's 2) a ring step is a string of context switches and
    cross-core wake-ups, most of the time spent in the kernel. SCHED_BATCH tells the scheduler the thread is
    not interactive: a woken thread waits for the running one to block or use up its slice, and the sender
    usually runs on to its own receive first. A rank keeps its share of the CPU. So where ranks outnumber the cores
    and block in turn, as course_lib's do, a message costs fewer switches, less wall time and less CPU time. The
    price is paid beside programs that never block: a woken rank waits for their slice to end instead of
    preempting them, so the ranks use less CPU but can take longer on the wall clock; the course's timing lessons
    read the modeled clock, which no policy moves. Both ways measured, on a quiet machine and beside busy
    processes: benchmarks/results/rank_scheduling.md (benchmarks/rank_scheduling.py). The policy is per thread
    and inherited: it is set on every thread the rank has (a spawned rank's interpreter may have started some)
    before the process group starts gloo's. Linux only; elsewhere, or where the call is refused, the rank runs
    as before.
    """
    if not hasattr(os, "SCHED_BATCH"):
        return
    for thread in os.listdir("/proc/self/task"):
        try:
            os.sched_setscheduler(int(thread), os.SCHED_BATCH, os.sched_param(0))
        except OSError:     # a thread that has just ended, or a system that refuses: that thread runs as before
            pass


def _hide_gpus() -> None:
    """Make this rank see no GPU (launch's `backend`: the ranks "auto" puts on gloo).

    CUDA reads CUDA_VISIBLE_DEVICES once, when it starts; setting it here is early enough for a spawned
    rank and for a forked one whose parent never started CUDA. But a parent that only asked
    ``torch.cuda.is_available()`` (a common first cell) has its device count cached inside torch, and a
    forked rank inherits that cache: with PYTORCH_NVML_BASED_CUDA_CHECK=1, ``is_available()`` counts the
    devices again through NVML, which reads CUDA_VISIBLE_DEVICES every time, and finds none.
    """
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"


def _rank_main(rank, world_size, workdir, payload, backend, timeout, threads, network=None, hide_gpus=False):
    """Entry point of every launched rank (runs in the child process)."""
    if hide_gpus:
        _hide_gpus()
    files = _RankFiles(workdir, rank)
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher handles Ctrl-C / kernel interrupt
    _redirect_output(files)
    faulthandler.enable(file=sys.stderr)  # a fatal signal (gloo's abort) still prints a Python stack
    stack_file = open(files.stack, "w")
    if hasattr(faulthandler, "register"):  # every thread: an async collective runs on a second one
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    _rankstate.attach(files.status)

    fn, args, kwargs = payload if isinstance(payload, tuple) else _cloudpickle_loads(payload)
    exitcode = 0
    try:
        torch.set_num_threads(threads)
        on_gloo = backend in ("gloo", _backend.NAME)
        if on_gloo:  # CPU ranks; NCCL's are left as torch starts them
            _schedule_as_batch()
        if on_gloo and "GLOO_SOCKET_IFNAME" not in os.environ:
            iface = _loopback_interface()
            if iface:
                os.environ["GLOO_SOCKET_IFNAME"] = iface
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method="file://" + os.path.join(workdir, "store"),
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout + _GROUP_TIMEOUT_GRACE),
        )
        if backend == "nccl":
            connect_every_pair(rank, world_size)
        if network is not None:
            _clock.activate(network, files.network, rank, world_size)
        result = fn(rank, world_size, *args, **kwargs)
        _work.finish()  # async collectives still running would race the result (and the barrier below)
        _clock.deactivate()  # this rank's clock stops here; the barrier below is the launcher's, not fn's
        _rankstate.set_blocked(_FINISHED)
        _write_result(files, ("ok", result))
        # Nobody tears down its sockets while a neighbour may still be reading from them.
        dist.barrier()
    except BaseException as exc:  # noqa: BLE001 - report everything, including SystemExit
        exitcode = 1
        # Start the traceback at the learner's function: the launcher's own frame is noise.
        tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
        text = "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__))
        record = ("error", type(exc).__name__, str(exc), text, time.time())
        _write_result(files, record)
    finally:
        _clock.deactivate()
        _rankstate.detach()
        if dist.is_initialized() and exitcode == 0:
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(exitcode)


def connect_every_pair(rank: int, world_size: int, group=None) -> None:
    """Open the point-to-point connection of every pair of ranks once, in one order that cannot deadlock.

    PyTorch's NCCL backend builds a communicator for two ranks on their first send or receive, and building it blocks
    the caller until the peer makes its own first call to this rank (pytorch/pytorch#113281). A ring whose ranks all
    send to the right first then waits for ever at its first step. Here the pairs (i, j), i < j, are taken in
    lexicographic order, i sending one number to j: the first pair in that order not yet done always has both of its
    ranks waiting on it, so every pair gets done. `launch` calls it under NCCL before `fn` runs; under gloo, whose
    pairs connect when the group starts, it is only a few small messages.
    """
    token = torch.zeros(1, device=device())
    for i in range(world_size):
        for j in range(i + 1, world_size):
            if rank == i:
                dist.send(token, j, group=group)
            elif rank == j:
                dist.recv(token, i, group=group)


def _write_result(files: _RankFiles, record) -> None:
    import io

    buffer = io.BytesIO()
    try:
        _CpuPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(record)
    except Exception as exc:
        if record[0] != "ok":
            raise
        raise TypeError(
            f"rank {files.rank} returned a value that cannot be sent back to the caller "
            f"({type(exc).__name__}: {exc}). Return plain numbers, lists, dicts or tensors."
        ) from exc
    _write_atomically(files.result, buffer.getvalue())


def _cloudpickle_loads(blob: bytes):
    import cloudpickle

    return cloudpickle.loads(blob)


def _cloudpickle_dumps(obj) -> bytes:
    try:
        import cloudpickle
    except ImportError as exc:  # pragma: no cover - cloudpickle is a dependency
        raise ImportError("launch needs cloudpickle to start ranks with 'spawn': pip install cloudpickle") from exc
    return cloudpickle.dumps(obj)


# --------------------------------------------------------------------------------------------------
# The launcher
# --------------------------------------------------------------------------------------------------


def _check_launch_arguments(fn, world_size, args, kwargs, timeout):
    if not callable(fn):
        raise TypeError(f"launch needs a function fn(rank, world_size, ...), got {type(fn).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1, got {world_size!r}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple of extra positional arguments, got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict, got {type(kwargs).__name__}")
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")


def launch(
    fn: Callable[..., Any],
    world_size: int = 4,
    args: Sequence[Any] = (),
    kwargs: dict | None = None,
    backend: str = "auto",
    timeout: float = DEFAULT_TIMEOUT,
    prefix_output: bool = True,
    start_method: str | None = None,
    network: "_network.Network | str | None" = None,
) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on `world_size` local ranks and return their results.

    Each rank is a separate process with the default `torch.distributed` process group already
    initialised, so inside `fn` you may call `torch.distributed` or `course_lib` directly.

    Args:
        fn: the SPMD function. A function defined in a notebook cell, a closure or a lambda works.
        world_size: number of ranks (processes) to start.
        args, kwargs: extra arguments passed to `fn` on every rank.
        backend: "gloo" (CPU), "nccl" (one GPU per rank) or "auto": NCCL when there are at least
            `world_size` GPUs, else gloo. Ranks that "auto" puts on gloo (4 ranks on Colab's one GPU, or
            any modeled network) see no GPU: their tensors live on the CPU, and torch code that asks
            ``torch.cuda.is_available()`` takes its CPU path (PyTorch's PowerSGD hook would otherwise call
            ``torch.cuda.synchronize`` on a CPU tensor's device and fail). Say backend="gloo" to keep the
            GPUs visible to gloo ranks.
        timeout: seconds before the launch is declared stuck; then `LaunchTimeoutError` lists what
            every rank was blocked in. A spawned rank's start (a new interpreter importing torch) is
            not counted, up to _SPAWN_STARTUP_LIMIT seconds.
        prefix_output: start every line a rank printed with "[rank r] ".
        start_method: "fork" or "spawn"; None picks fork on Linux (fast, carries notebook functions)
            unless this process has touched the GPU (CUDA initialised, or autograd's GPU threads started
            by a backward()), else spawn (the function travels by cloudpickle) and says so once.
        network: a `course_lib.Network` (or a preset's name, "100 MB/s, 200 us", or a
            `Network.cluster(...)`): every rank then keeps a modeled clock (`course_lib.clock()`), on
            which every message of `fn` takes the time that network would take and torch's built-in
            collectives the time of NCCL's schedule (see `course_lib.network`). The ranks run on gloo.
            None: no model; `course_lib.clock()` is this machine's clock.

    Returns:
        A list of the ranks' return values, index = rank. CUDA tensors come back as CPU tensors.
        When every rank returned None, a `NothingReturned` list whose printout says so.

    Raises:
        RankFailedError: a rank raised an exception or was killed by a signal.
        LaunchTimeoutError: the ranks did not all finish within `timeout` seconds.

    Example::

        >>> def hello(rank, world_size):
        ...     print(f"hello from rank {rank} of {world_size}")
        ...     return rank * 10
        >>> launch(hello, world_size=2)
        [rank 0] hello from rank 0 of 2
        [rank 1] hello from rank 1 of 2
        [0, 10]
    """
    kwargs = {} if kwargs is None else kwargs
    _check_launch_arguments(fn, world_size, args, kwargs, timeout)
    if under_torchrun():
        env_world = int(os.environ["WORLD_SIZE"])
        if env_world != world_size:
            raise ValueError(
                f"launch(world_size={world_size}) was called inside torchrun, which started WORLD_SIZE={env_world} "
                f"ranks. Under torchrun the ranks already exist: call run_torchrun(fn) (or pass world_size={env_world})."
            )
        return run_torchrun(fn, args=args, kwargs=kwargs, backend=backend, timeout=timeout)

    network = None if network is None else _network.Network.parse(network)
    auto = backend == "auto"
    backend = _modeled_backend(backend) if network is not None else resolve_backend(backend, world_size)
    hide_gpus = auto and backend in ("gloo", _backend.NAME)  # see `backend` above; harmless where there is no GPU
    if network is not None and network.world_size is not None and world_size > network.world_size:
        raise ValueError(f"world_size={world_size} does not fit the modeled cluster of {network.world_size} ranks "
                         f"({network.describe()}): use at most {network.world_size} ranks or a larger cluster")
    if start_method not in (None, "fork", "spawn"):
        raise ValueError(f"start_method must be None, 'fork' or 'spawn', not {start_method!r}")
    method = start_method or _start_method()
    payload = (fn, tuple(args), kwargs) if method == "fork" else _cloudpickle_dumps((fn, tuple(args), kwargs))
    threads = _intra_op_threads(method, world_size)
    workdir = tempfile.mkdtemp(prefix="course_lib-launch-")
    processes = []
    maestro = None
    try:
        for rank in range(world_size):
            _rankstate.create_slot_file(_RankFiles(workdir, rank).status)
        if network is not None:  # listening before any rank starts; its thread starts after the forks
            maestro = _maestro.Maestro(network, world_size, _RankFiles(workdir, 0).network)
        context = __import__("multiprocessing").get_context(method)
        with warnings.catch_warnings():
            # Python 3.12+ warns when forking a multi-threaded process (a Jupyter kernel is one).
            # The child only runs this module's code, which takes none of the parent's locks.
            warnings.filterwarnings("ignore", message=r".*multi-threaded.*fork", category=DeprecationWarning)
            for rank in range(world_size):
                process = context.Process(
                    target=_rank_main,
                    args=(rank, world_size, workdir, payload, backend, float(timeout), threads, network, hide_gpus),
                    name=f"course_lib-rank-{rank}",
                )
                process.start()
                processes.append(process)
        if maestro is not None:
            maestro.start()
        # In a notebook, a launch that runs longer than a couple of seconds shows each rank's status live.
        with LaunchStatus(world_size, lambda r: _RankFiles(workdir, r).status, lambda r: _RankFiles(workdir, r).stdout):
            if method == "spawn":
                _wait_for_spawned_ranks(processes, workdir)
            outcome = _supervise(processes, workdir, timeout)
        _relay_output(workdir, world_size, prefix_output)
        if maestro is not None:
            _clock.record_launch(network, maestro)
            if isinstance(outcome, LaunchTimeoutError) and maestro.describe():
                outcome = LaunchTimeoutError(f"{outcome}\n{maestro.describe()}", blocked=outcome.blocked)
        if isinstance(outcome, LaunchError):
            raise outcome
        if all(value is None for value in outcome):
            return NothingReturned(world_size)
        return outcome
    finally:
        _stop_all(processes)
        if maestro is not None:
            maestro.stop()
        for process in processes:
            process.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _modeled_backend(backend: str) -> str:
    """The modeled clock runs its ranks on gloo, through course_lib's backend (`course_lib.backend`), whose layers
    time every call: the data moves on this machine's CPU, the time is the model's."""
    if backend not in ("auto", "gloo", _backend.NAME):
        raise ValueError(f"backend={backend!r} with a modeled network: the modeled clock runs the ranks on gloo (the "
                         "time is the model's, whatever carries the data). Leave backend='auto' or say 'gloo'.")
    return _backend.NAME


def _intra_op_threads(method: str, world_size: int) -> int:
    """torch's intra-op threads per rank.

    A forked rank gets one. GNU OpenMP does not survive a fork: once this process has run a sizeable
    torch op (its OpenMP pool exists), a forked child that starts a parallel region of its own waits
    forever for threads it did not inherit. With one thread torch never opens such a region. A spawned
    rank is a fresh interpreter and shares the cores: 4 ranks on 2 cores get one thread each.
    """
    if method == "fork":
        return 1
    return max(1, (os.cpu_count() or 1) // world_size)


_SPAWN_STARTUP_LIMIT = 120.0


def _wait_for_spawned_ranks(processes, workdir, limit: float = _SPAWN_STARTUP_LIMIT) -> None:
    """Let spawned ranks start before the `timeout` clock runs: that clock is for the learner's `fn`.

    A spawned rank is a new interpreter that imports torch before anything else: a second on a laptop,
    tens of seconds for four ranks on Colab's two cores with its CUDA build. A rank has started once it
    has created its stdout file. Returns when all have, when a rank has exited (`_supervise` reports
    it), or after `limit` seconds.
    """
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if all(os.path.exists(_RankFiles(workdir, rank).stdout) for rank in range(len(processes))):
            return
        if any(process.exitcode is not None for process in processes):
            return
        time.sleep(0.05)


def _supervise(processes, workdir, timeout):
    """Wait for every rank; return the results, or the LaunchError to raise."""
    deadline = time.monotonic() + timeout
    running = {p.sentinel: rank for rank, p in enumerate(processes)}
    while running:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return _timeout_error(processes, workdir, timeout)
        for sentinel in mp_connection.wait(list(running), timeout=min(remaining, 0.5)):
            rank = running.pop(sentinel)
            processes[rank].join()
            if processes[rank].exitcode != 0:
                return _failure_error(processes, workdir, first_seen=rank)
    results = []
    for rank in range(len(processes)):
        record = _read_result(workdir, rank)
        if record is None or record[0] != "ok":  # exit code 0 without a result cannot happen
            return _failure_error(processes, workdir, first_seen=rank)
        results.append(record[1])
    return results


def _read_result(workdir, rank):
    path = _RankFiles(workdir, rank).result
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


def _stderr_tail(workdir, rank, lines=_STDERR_TAIL_LINES) -> str:
    """The rank's last stderr lines, without the frames a forked child inherits from the launcher."""
    try:
        with open(_RankFiles(workdir, rank).stderr, encoding="utf-8", errors="replace") as f:
            text = f.readlines()
    except OSError:
        return ""
    return "".join(_without_inherited_frames(text)[-lines:])


def _without_inherited_frames(lines: list[str]) -> list[str]:
    """Drop the stack frames a forked rank inherited from the caller (faulthandler prints them).

    faulthandler lists the innermost frame first; everything from the launcher's `_rank_main`
    frame down is the caller's own stack (a notebook kernel's or pytest's), not the rank's story,
    and it would push gloo's actual reason out of the tail.
    """
    kept, skipping = [], False
    for line in lines:
        if line.lstrip().startswith("File ") and "in _rank_main" in line:
            skipping = True
        elif skipping and not line.lstrip().startswith("File "):
            skipping = False
        if not skipping and not line.startswith("Extension modules:"):
            kept.append(line)
    return kept


def _death_time(workdir, rank, first_seen) -> float:
    """When a rank that left no report (killed by a signal, or exited) failed, as far as can be told: the last time
    it wrote to stderr, if it wrote anything (gloo's abort writes its reason as it dies, before its sockets close
    and its partners' calls fail with reports of their own); else first, if its exit was seen first, or last."""
    try:
        info = os.stat(_RankFiles(workdir, rank).stderr)
        if info.st_size > 0:
            return info.st_mtime
    except OSError:
        pass
    return 0.0 if rank == first_seen else float("inf")


def _failure_error(processes, workdir, first_seen):
    """Stop everyone, then describe the rank that failed first (by its own clock)."""
    time.sleep(0.05)  # let a rank that failed at the same moment finish writing its report
    _stop_all(processes)
    failures = []  # (when, rank, record)
    for rank, process in enumerate(processes):
        record = _read_result(workdir, rank)
        if record is not None and record[0] == "error":
            failures.append((record[4], rank, record))
        elif rank == first_seen or (process.exitcode not in (0, None, -signal.SIGKILL)):
            failures.append((_death_time(workdir, rank, first_seen), rank, None))
    failures.sort(key=lambda item: (item[0], item[1]))
    _, rank, record = failures[0]
    world = len(processes)
    same = [r for _, r, rec in failures[1:] if rec is not None and record is not None and rec[1:3] == record[1:3]]
    later = [r for _, r, _ in failures[1:] if r not in same]
    also = ""
    if same:
        also += f"\nRank(s) {sorted(same)} raised the same error."
    if later:
        also += f"\nRank(s) {sorted(later)} failed afterwards, probably as a consequence."
    if record is not None:
        _, exc_type, message, rank_tb, _ = record
        text = (
            f"rank {rank} of {world} raised {exc_type}: {message}\n\n"
            f"--- traceback of rank {rank} ---\n{rank_tb.rstrip()}\n---{also}\nThe other ranks were stopped."
        )
        return RankFailedError(text, rank=rank, exc_type=exc_type, rank_traceback=rank_tb,
                               exitcode=processes[rank].exitcode, stderr_tail=_stderr_tail(workdir, rank))
    exitcode = processes[rank].exitcode
    tail = _stderr_tail(workdir, rank)
    if exitcode is not None and exitcode < 0:
        how = f"was killed by signal {signal.Signals(-exitcode).name}"
        if -exitcode == signal.SIGABRT:
            how += (" (an abort: gloo does this when a message is longer than the receive buffer, "
                    "i.e. the ranks disagree about a tensor's size)")
    else:
        how = f"exited with code {exitcode} without raising a Python exception"
    text = (f"rank {rank} of {world} {how}.\n\n--- last lines rank {rank} wrote to stderr ---\n"
            f"{tail.rstrip() or '(nothing)'}\n---{also}\nThe other ranks were stopped.")
    return RankFailedError(text, rank=rank, exitcode=exitcode, stderr_tail=tail)


def _timeout_error(processes, workdir, timeout):
    """Read what every rank is blocked in, stop them, and explain."""
    blocked = {}
    for rank, process in enumerate(processes):
        if process.exitcode is not None:
            blocked[rank] = "finished"
            continue
        what = _rankstate.read_slot_file(_RankFiles(workdir, rank).status)
        if what == _FINISHED:
            blocked[rank] = "finished: returned from fn and waits for the other ranks"
            continue
        blocked[rank] = f"blocked in {what}" if what else "running Python code, not inside a course_lib send/recv"
        if hasattr(signal, "SIGUSR1"):
            try:
                os.kill(process.pid, signal.SIGUSR1)  # faulthandler dumps its Python stack
            except OSError:
                pass
    time.sleep(0.2)
    stacks = {}
    for rank in blocked:
        if blocked[rank].startswith("finished"):
            continue
        main_thread = _main_thread(_read_stacks(_RankFiles(workdir, rank).stack))
        frame = _user_frames(main_thread)
        stacks[rank] = f"at {frame}" if frame else ""
        if any(f.endswith(" in finish") and f"{os.sep}_work.py" in f for f in main_thread):
            stacks[rank] = "fn has returned; the rank waits for its unfinished async collectives"
            if not blocked[rank].startswith("blocked in"):
                blocked[rank], stacks[rank] = "fn has returned and waits for its unfinished async collectives", ""
        collective = _torch_collective(main_thread)
        if collective and not blocked[rank].startswith("blocked in"):
            blocked[rank] = f"blocked in {collective}, torch's own collective (not a course_lib send/recv)"
    _stop_all(processes)
    lines = [f"the ranks did not finish within {timeout:g} s. What each rank was doing:"]
    for rank, what in blocked.items():
        where = f"   ({stacks[rank]})" if stacks.get(rank) else ""
        lines.append(f"  rank {rank}: {what}{where}")
    lines.append(_diagnose(blocked))
    return LaunchTimeoutError("\n".join(lines), blocked=blocked)


def _diagnose(blocked: dict) -> str:
    """One sentence on what the ranks' states suggest."""
    import re

    finished = {rank for rank, what in blocked.items() if what.startswith("finished")}
    receiving = {rank: what for rank, what in blocked.items()
                 if what.startswith(("blocked in recv", "blocked in irecv.wait"))}
    orphans = [(rank, int(m.group(1))) for rank, what in receiving.items()
               if (m := re.search(r"src=(\d+)", what)) and int(m.group(1)) in finished]
    if orphans:
        rank, src = orphans[0]
        return (f"Rank {rank} waits for a message from rank {src}, which has already returned: a recv with no "
                "matching send. Check that both sides make the same number of calls, with matching peers.")
    in_torch = {rank: m.group(1) for rank, what in blocked.items()
                if (m := re.match(r"blocked in (torch\.distributed\.\w+)", what))}
    if in_torch:
        names = sorted(set(in_torch.values()))
        return (f"Rank(s) {sorted(in_torch)} wait inside {' / '.join(names)}: a torch.distributed collective returns "
                "only when every rank has called it, in the same order, with tensors of the same size and dtype. "
                "torch does not check that, so a rank that called something else, returned early, or passed a tensor "
                "of another size leaves the others waiting. If every rank did call it and the work is only slow, "
                "give launch a longer `timeout=` (seconds).")
    if receiving and len(receiving) == len(blocked) - len(finished):
        return ("Every running rank is waiting to receive, so nobody sends: a deadlock. "
                "Make one side send first, or post the send with isend before the recv.")
    return ("A rank that waits for a message no rank sends will wait forever: check that every recv has a "
            "matching send (same peer, same size), or raise `timeout` if the work is just slow.")


def _read_stacks(stack_path) -> list[list[str]]:
    """Every thread's Python stack from the rank's faulthandler dump: its 'File ...' lines, innermost first."""
    try:
        with open(stack_path, encoding="utf-8", errors="replace") as f:
            lines = [line.strip() for line in f]
    except OSError:
        return []
    stacks: list[list[str]] = []
    for line in lines:
        if line.startswith(("Thread 0x", "Current thread 0x", "Stack (most recent")):
            stacks.append([])
        elif line.startswith("File ") and stacks:
            stacks[-1].append(line)
    return stacks


def _main_thread(stacks: list[list[str]]) -> list[str]:
    """The stack of the thread running the learner's function (not course_lib's async worker)."""
    for frames in stacks:
        if any(frame.endswith(" in _rank_main") for frame in frames):
            return frames
    return stacks[0] if stacks else []


def _inside_torch(frame: str) -> bool:
    return ("site-packages" in frame and f"{os.sep}torch{os.sep}" in frame) or "torch/distributed/" in frame


def _torch_collective(frames: list[str]) -> str:
    """'torch.distributed.all_reduce' when the innermost frames are inside that torch collective, else ''.

    The name is the outermost public function of distributed_c10d.py the rank is in (the one its
    code called: all_gather_object, not the all_gather inside it).
    """
    names = []
    for frame in frames:  # innermost first
        if not _inside_torch(frame):
            break
        if "distributed_c10d.py" in frame:
            name = frame.rsplit(" in ", 1)[-1]
            if not name.startswith("_"):
                names.append(name)
    return f"torch.distributed.{names[-1]}" if names else ""


def _user_frames(frames: list[str]) -> str:
    """The innermost frame of the rank's code that is not inside course_lib, torch or threading."""
    import threading

    # faulthandler lists the innermost frame first; from the launcher's own _rank_main outwards the
    # frames are the launcher's and, after a fork, the caller's: never the rank's code.
    for frame in frames:
        if frame.endswith(" in _rank_main"):
            break
        if ("site-packages/torch" in frame or os.sep + "course_lib" + os.sep in frame
                or f'"{threading.__file__}"' in frame):  # Work.wait() waits on a threading.Event
            continue
        return frame.replace('File "', "").replace('", line ', ":")
    return ""


def _stop_all(processes) -> None:
    for process in processes:
        if process.exitcode is None:
            try:
                process.kill()
            except (OSError, ValueError):
                pass
    for process in processes:
        process.join(timeout=5)


def _relay_output(workdir, world_size, prefix_output) -> None:
    """Print every rank's captured stdout (then stderr), grouped and ordered by rank."""
    for stream_name, stream in (("stdout", sys.stdout), ("stderr", sys.stderr)):
        chunks = []
        for rank in range(world_size):
            path = _RankFiles(workdir, rank).path(stream_name)
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    text = f.read(MAX_OUTPUT_CHARS)
                    cut = bool(f.read(1))
                size = os.path.getsize(path)
            except OSError:
                continue
            if not text:
                continue
            if cut:
                text = text[:text.rfind("\n") + 1] or text
                text += (f"... rank {rank} wrote {size:,} bytes to {stream_name} in all; only the first "
                         f"{MAX_OUTPUT_CHARS:,} characters are shown (course_lib.launch.MAX_OUTPUT_CHARS).\n")
            if prefix_output:
                text = "".join(f"[rank {rank}] {line}" for line in text.splitlines(keepends=True))
            chunks.append(text if text.endswith("\n") else text + "\n")
        if chunks:
            stream.write("".join(chunks))
            stream.flush()


def device() -> torch.device:
    """The device this rank's tensors belong on: its GPU under NCCL, else the CPU.

    Use it inside `fn` so the same code runs with gloo on a laptop and with NCCL on GPUs::

        x = torch.randn(1000, device=course_lib.device())
    """
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# --------------------------------------------------------------------------------------------------
# torchrun
# --------------------------------------------------------------------------------------------------


def under_torchrun() -> bool:
    """True inside a process started by torchrun (it sets RANK, WORLD_SIZE, LOCAL_RANK, ...)."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


def run_torchrun(fn, args=(), kwargs=None, backend="auto", timeout=DEFAULT_TIMEOUT * 3, network=None):
    """Run this process's rank of ``fn(rank, world_size, *args, **kwargs)`` under torchrun.

    torchrun has already started one process per rank and set RANK, WORLD_SIZE, LOCAL_RANK and the
    rendezvous address; this initialises the process group from them, calls `fn`, and returns the
    list of every rank's result (gathered to every rank), like `launch`. Printing is not captured:
    use torchrun's own ``--tee`` / ``--local-ranks-filter`` options.

    Example (examples/ring_allreduce_torchrun.py)::

        torchrun --nproc-per-node 4 examples/ring_allreduce_torchrun.py

    `network` models a link under every point-to-point message, as in `launch`; the ranks must then all
    run on one machine (they share its clock and a table of message start times).
    """
    kwargs = {} if kwargs is None else kwargs
    if not under_torchrun():
        raise RuntimeError("run_torchrun must run inside a process started by torchrun; use launch() otherwise.")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    if network is not None:
        backend = _modeled_backend(backend)
    else:
        backend = resolve_backend(backend, world_size, gpus_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    modeled = None
    try:
        if network is not None:
            modeled = _torchrun_network(_network.Network.parse(network), rank, world_size)
        result = fn(rank, world_size, *args, **kwargs)
        _work.finish()
        if modeled is not None:
            _clock.deactivate()
        everyone = [None] * world_size
        dist.all_gather_object(everyone, result)
        return everyone
    finally:
        if modeled is not None:
            _clock.deactivate()
            end_torchrun_network(modeled)
        if owns_group:
            dist.destroy_process_group()


def _torchrun_network(network, rank: int, world_size: int):
    """Rank 0 runs the modeled clock's coordinator and tells the others where it listens; all join it.
    Returns what `end_torchrun_network` needs (rank 0: the coordinator and its folder)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if local != world_size:
        raise ValueError(
            f"a modeled network needs every rank on one machine (they talk to one coordinator through a Unix "
            f"socket), but torchrun runs {local} of the {world_size} ranks here. Use --nnodes 1, or run without "
            "network=.")
    if network.world_size is not None and world_size > network.world_size:
        raise ValueError(f"torchrun started {world_size} ranks; the modeled cluster has {network.world_size}")
    store = dist.distributed_c10d._get_default_store()
    key = "course_lib/clock_socket"
    maestro = None
    if rank == 0:
        folder = tempfile.mkdtemp(prefix="course_lib-clock-")
        maestro = _maestro.Maestro(network, world_size, os.path.join(folder, "clock.sock"))
        maestro.start()
        store.set(key, maestro.path)
    path = store.get(key).decode()
    dist.barrier()  # the coordinator listens before anyone joins
    _clock.activate(network, path, rank, world_size)
    return (network, maestro)


def end_torchrun_network(modeled) -> None:
    """After every rank has left the modeled clock (a collective since): rank 0 stops the coordinator."""
    network, maestro = modeled
    if maestro is not None:
        _clock.record_launch(network, maestro)
        maestro.stop()
        shutil.rmtree(os.path.dirname(maestro.path), ignore_errors=True)
