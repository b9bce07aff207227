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

Under `torchrun` the same function runs unchanged: see `run_torchrun` (`course_lib.torchrun`).

Beside this module: `course_lib.launch_platform` (backend, start method, what a rank does to its process),
`course_lib.launch_files` (the files a rank leaves for the launcher, the errors), `course_lib.launch_diagnosis`
(the failure and timeout reports, loaded when a launch fails).
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
from multiprocessing import connection as mp_connection
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.distributed as dist

from course_lib import runtime, _work
from course_lib.launch_files import (_FINISHED, LaunchError, LaunchTimeoutError, RankFailedError, _RankFiles,
                                     _read_result, _stop_all)
from course_lib.launch_platform import (BACKEND_NAME, DEFAULT_TIMEOUT, _die_with_parent, _hide_gpus,
                                        _loopback_interface, _modeled_backend, _schedule_as_batch, _start_method,
                                        device, resolve_backend, under_torchrun)

if TYPE_CHECKING:
    from course_lib.network import Network

# The process group's own timeout is a little longer than the launcher's watchdog, so that on a
# deadlock the watchdog fires first and can report every rank's state before anyone raises.
_GROUP_TIMEOUT_GRACE = 10.0
# What `launch` shows of each rank's stdout and of its stderr. A rank that prints inside a loop over
# a million elements would otherwise pour megabytes into the notebook (and could freeze the browser).
MAX_OUTPUT_CHARS = 20_000

__all__ = [
    "launch",
    "device",
    "under_torchrun",
    "resolve_backend",
    "LaunchError",
    "RankFailedError",
    "LaunchTimeoutError",
    "NothingReturned",
]


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
# Inside a rank
# --------------------------------------------------------------------------------------------------


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
    runtime.attach(files.status)

    fn, args, kwargs = payload if isinstance(payload, tuple) else _cloudpickle_loads(payload)
    exitcode = 0
    clock = None
    try:
        torch.set_num_threads(threads)
        if backend == BACKEND_NAME:    # importing course_lib's backend registers it with torch (a spawned rank
            from course_lib import backend as _registers  # noqa: F401 - has imported nothing else that would)
        on_gloo = backend in ("gloo", BACKEND_NAME)
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
            from course_lib import modeled_clock as clock     # loaded only under a modeled network

            clock.activate(network, files.network, rank, world_size)
        result = fn(rank, world_size, *args, **kwargs)
        _work.finish()  # async collectives still running would race the result (and the barrier below)
        if clock is not None:
            clock.deactivate()  # this rank's clock stops here; the barrier below is the launcher's, not fn's
        runtime.set_blocked(_FINISHED)
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
        if clock is not None:
            clock.deactivate()
        runtime.detach()
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
    network: "Network | str | None" = None,
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
        from course_lib.torchrun import run_torchrun

        return run_torchrun(fn, args=args, kwargs=kwargs, backend=backend, timeout=timeout)

    if network is not None:      # the network model and its simulator load only when a launch asks for them
        from course_lib import _maestro, modeled_clock
        from course_lib.network import Network

        network = Network.parse(network)
    auto = backend == "auto"
    backend = _modeled_backend(backend) if network is not None else resolve_backend(backend, world_size)
    hide_gpus = auto and backend in ("gloo", BACKEND_NAME)  # see `backend` above; harmless where there is no GPU
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
            runtime.create_slot_file(_RankFiles(workdir, rank).status)
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
        from course_lib.live import LaunchStatus

        with LaunchStatus(world_size, lambda r: _RankFiles(workdir, r).status, lambda r: _RankFiles(workdir, r).stdout):
            if method == "spawn":
                _wait_for_spawned_ranks(processes, workdir)
            outcome = _supervise(processes, workdir, timeout)
        _relay_output(workdir, world_size, prefix_output)
        if maestro is not None:
            modeled_clock.record_launch(network, maestro)
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
            return _timed_out(processes, workdir, timeout)
        for sentinel in mp_connection.wait(list(running), timeout=min(remaining, 0.5)):
            rank = running.pop(sentinel)
            processes[rank].join()
            if processes[rank].exitcode != 0:
                return _failed(processes, workdir, first_seen=rank)
    results = []
    for rank in range(len(processes)):
        record = _read_result(workdir, rank)
        if record is None or record[0] != "ok":  # exit code 0 without a result cannot happen
            return _failed(processes, workdir, first_seen=rank)
        results.append(record[1])
    return results


def _failed(processes, workdir, first_seen):
    from course_lib import launch_diagnosis   # loaded only when a launch fails: a clean launch never needs it

    return launch_diagnosis.failure_error(processes, workdir, first_seen=first_seen)


def _timed_out(processes, workdir, timeout):
    from course_lib import launch_diagnosis

    return launch_diagnosis.timeout_error(processes, workdir, timeout)


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

