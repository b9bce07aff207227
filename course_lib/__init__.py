"""course_lib: data-parallel training's communication, written by hand so it can be read.

    launch(fn, world_size)      run fn(rank, world_size) on N local ranks (processes)
    p2p                         send / recv / isend / irecv, counted and traced
    traffic                     record() what a rank sent and received
    collectives                 broadcast, scatter, gather, all_gather, all_to_all, reduce,
                                all_reduce, reduce_scatter from p2p messages
    allreduce                   naive, parameter_server, ring (+ its two phases)
    progress(iterable)          a live progress line for a long loop in a notebook (or in a rank)
    Network(bandwidth, latency) a modeled network under every message: launch(fn, G, network=...)
    clock(), compute(seconds)   a rank's clock (modeled time under a modeled network) and modeled compute
    check_torch()               one line if this PyTorch is older than the notebooks need (every setup cell)
"""

from course_lib import allreduce, collectives, ops, p2p, traffic
from course_lib.runtime import MismatchError, unchecked
from course_lib.launch import (
    LaunchError,
    LaunchTimeoutError,
    RankFailedError,
    device,
    launch,
    resolve_backend,
    under_torchrun,
)
from course_lib.runtime import clock, compute
from course_lib.versions import check_torch

# Loaded on first use, so that `import course_lib` brings in only what a plain ring needs: the network model
# (and its simulator), the live progress line, torchrun's entry point.
_LAZY = {"network": ("course_lib.network", None), "Network": ("course_lib.network", "Network"),
         "Cluster": ("course_lib.network", "Cluster"), "progress": ("course_lib.live", "progress"),
         "run_torchrun": ("course_lib.torchrun", "run_torchrun")}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'course_lib' has no attribute {name!r}")
    import importlib

    module_name, attribute = _LAZY[name]
    value = importlib.import_module(module_name)
    if attribute is not None:
        value = getattr(value, attribute)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0.dev0"

__all__ = [
    "launch", "device", "run_torchrun", "under_torchrun", "resolve_backend",
    "LaunchError", "RankFailedError", "LaunchTimeoutError", "MismatchError", "unchecked",
    "p2p", "traffic", "collectives", "allreduce", "ops", "progress", "Network", "Cluster", "network", "clock",
    "compute", "check_torch",
]
