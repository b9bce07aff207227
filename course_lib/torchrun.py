"""The same SPMD function under torchrun: `run_torchrun(fn)` runs this process's rank of it.

    torchrun --nproc-per-node 4 examples/ring_allreduce_torchrun.py

torchrun starts one process per rank and sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous
address; `run_torchrun` initialises the process group from them, calls `fn` and returns every rank's
result, as `launch` does. `launch` itself, called inside torchrun, hands over to it.
"""

from __future__ import annotations

import datetime
import os
import shutil
import tempfile

import torch
import torch.distributed as dist

from course_lib import _work
from course_lib.launch_platform import DEFAULT_TIMEOUT, _modeled_backend, resolve_backend, under_torchrun

__all__ = ["under_torchrun", "run_torchrun", "end_torchrun_network"]


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
    if network is not None:        # loaded only for a modeled network; importing the clock registers the backend
        from course_lib import modeled_clock
        from course_lib.network import Network

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
            modeled = _torchrun_network(Network.parse(network), rank, world_size)
        result = fn(rank, world_size, *args, **kwargs)
        _work.finish()
        if modeled is not None:
            modeled_clock.deactivate()
        everyone = [None] * world_size
        dist.all_gather_object(everyone, result)
        return everyone
    finally:
        if modeled is not None:
            modeled_clock.deactivate()
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
    from course_lib import _maestro, modeled_clock

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
    modeled_clock.activate(network, path, rank, world_size)
    return (network, maestro)


def end_torchrun_network(modeled) -> None:
    """After every rank has left the modeled clock (a collective since): rank 0 stops the coordinator."""
    from course_lib import modeled_clock

    network, maestro = modeled
    if maestro is not None:
        modeled_clock.record_launch(network, maestro)
        maestro.stop()
        shutil.rmtree(os.path.dirname(maestro.path), ignore_errors=True)
