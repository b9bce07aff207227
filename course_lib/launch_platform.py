"""Where `launch` adapts to the machine: which backend, which start method, what a rank does to its process.

    resolve_backend("auto", 4)     # "nccl" with a GPU per rank, else "gloo"
    device()                       # inside a rank: its GPU under NCCL, else the CPU

The choices a learner's machine forces on a launch live here, away from the launcher itself
(`course_lib.launch`): NCCL or gloo, fork or spawn (a kernel that touched the GPU cannot fork), GPUs
hidden from gloo ranks, Linux's SCHED_BATCH for ranks that outnumber the cores, a rank that dies with
its launcher. Each says once, on stderr, when it chose for the learner.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = 20.0        # seconds before launch declares its ranks stuck
BACKEND_NAME = "course_lib"   # course_lib's own torch.distributed backend (`course_lib.backend.NAME`)

__all__ = ["resolve_backend", "device", "under_torchrun"]


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
    if backend not in ("auto", "gloo", "nccl", BACKEND_NAME):
        raise ValueError(f"backend must be 'auto', 'gloo', 'nccl' or {BACKEND_NAME!r} (gloo through course_lib's "
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


def _modeled_backend(backend: str) -> str:
    """The modeled clock runs its ranks on gloo, through course_lib's backend (`course_lib.backend`), whose layers
    time every call: the data moves on this machine's CPU, the time is the model's."""
    if backend not in ("auto", "gloo", BACKEND_NAME):
        raise ValueError(f"backend={backend!r} with a modeled network: the modeled clock runs the ranks on gloo (the "
                         "time is the model's, whatever carries the data). Leave backend='auto' or say 'gloo'.")
    return BACKEND_NAME


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


def device() -> torch.device:
    """The device this rank's tensors belong on: its GPU under NCCL, else the CPU.

    Use it inside `fn` so the same code runs with gloo on a laptop and with NCCL on GPUs::

        x = torch.randn(1000, device=course_lib.device())
    """
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def under_torchrun() -> bool:
    """True inside a process started by torchrun (it sets RANK, WORLD_SIZE, LOCAL_RANK, ...)."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))
