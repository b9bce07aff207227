"""What do course_lib.p2p's wrappers cost over torch.distributed's own send/recv?

    python benchmarks/p2p_overhead.py

Two ranks ping-pong a small tensor many times with dist.send/recv, with p2p.send/recv and no
recording active, and with a recording active. Prints the median round-trip time of each, in
microseconds, and the wrappers' overhead relative to the raw calls. The wrappers check their
arguments and tell the launcher which call they are in; with no recording that is all they add.
"""

import statistics
import time

import torch
import torch.distributed as dist

import course_lib
from course_lib import p2p, traffic

ROUND_TRIPS = 2000
REPEATS = 5


def ping_pong(rank, send, recv, tensor):
    peer = 1 - rank
    for _ in range(ROUND_TRIPS):
        if rank == 0:
            send(tensor, peer)
            recv(tensor, peer)
        else:
            recv(tensor, peer)
            send(tensor, peer)


def measure(rank, world_size):
    tensor = torch.zeros(16)
    variants = {
        "torch.distributed": lambda: ping_pong(rank, dist.send, dist.recv, tensor),
        "course_lib.p2p": lambda: ping_pong(rank, p2p.send, p2p.recv, tensor),
    }

    def recorded():
        with traffic.record():
            ping_pong(rank, p2p.send, p2p.recv, tensor)

    variants["course_lib.p2p, recording"] = recorded
    times = {name: [] for name in variants}
    for _ in range(REPEATS):
        for name, run in variants.items():  # interleaved, so drift hits every variant alike
            dist.barrier()
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) / ROUND_TRIPS)
    return {name: statistics.median(values) for name, values in times.items()}


if __name__ == "__main__":
    result = course_lib.launch(measure, world_size=2, timeout=300)[0]
    raw = result["torch.distributed"]
    for name, seconds in result.items():
        print(f"{name:28s} {seconds * 1e6:8.1f} us per round trip   ({seconds / raw:5.2f}x raw)")
