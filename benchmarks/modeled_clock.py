"""The modeled clock measured against Network.predict, with two busy processes beside it the whole time (issue 25).

    python benchmarks/modeled_clock.py                    # 9 repetitions, writes benchmarks/results/modeled_clock.{md,json}
    python benchmarks/modeled_clock.py --reps 2 --out /tmp/quick     # a quick look, not a figure

Two processes that spin in a loop are started first and killed last, so both of this machine's cores are
busy the whole time: the modeled clock must not notice. Every row times one schedule on the ranks'
modeled clocks (`course_lib.clock()` inside the ranks, the slowest rank's time per repetition) and divides
by the model's prediction:

    row                                  network           ranks   size     target
    course_lib's ring                    nvlink4, ib_ndr   4, 8    16 MiB   every repetition in [0.98, 1.05]
    course_lib's tree                    nvlink4, ib_ndr   4, 8    4 KiB    every repetition in [0.98, 1.05]
    a learner's raw isend/irecv ring     nvlink4, ib_ndr   4, 8    16 MiB   every repetition in [0.98, 1.05]
    torch.distributed.all_reduce         ib_ndr            8       16 MiB   in [0.9, 1.2] of the model's ring
    course_lib's ring                    ib_ndr            64      1 MiB    in [0.98, 1.05]; launch under 60 s wall
    the same schedule, 3 launches        ib_ndr            8       16 MiB   spread under 1%

In each launch the cases take turns within every repetition, in an order shuffled anew per repetition (the
same on every rank). The wall time of each launch is this machine's (reported, not a target, except the
64-rank launch's).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import course_lib
from course_lib import allreduce, fast_allreduce
from course_lib.network import Network

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
MiB, KiB = 2 ** 20, 2 ** 10


def raw_ring(tensor: torch.Tensor) -> None:
    """A learner's ring all-reduce with torch.distributed's own isend / irecv (as notebook 05 asks for)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    chunks = list(torch.tensor_split(tensor, size))
    incoming = torch.empty_like(chunks[0])
    for phase in ("reduce", "gather"):
        for step in range(size - 1):
            send = (rank - step) % size if phase == "reduce" else (rank + 1 - step) % size
            recv = (rank - step - 1) % size if phase == "reduce" else (rank - step) % size
            buffer = incoming[: chunks[recv].numel()]
            requests = [dist.isend(chunks[send].contiguous(), (rank + 1) % size), dist.irecv(buffer, (rank - 1) % size)]
            for request in requests:
                request.wait()
            if phase == "reduce":
                chunks[recv] += buffer
            else:
                chunks[recv].copy_(buffer)


CALLS = {"ring": allreduce.ring, "tree": fast_allreduce.tree, "raw_ring": raw_ring, "builtin": dist.all_reduce}


def time_cases(rank, world_size, cases, reps):
    """{case: [seconds per repetition]} on this rank's modeled clock; cases shuffled anew every repetition."""
    times = {case: [] for case in cases}
    for rep in range(reps):
        order = list(cases)
        random.Random(rep).shuffle(order)
        for name, nbytes in order:
            call = dist.all_reduce if name == "builtin" else CALLS[name]
            tensor = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(rank))
            dist.barrier()
            start = course_lib.clock()
            call(tensor)
            times[(name, nbytes)].append(course_lib.clock() - start)
    return times


def measure(network, world_size, cases, reps):
    wall = time.perf_counter()
    per_rank = course_lib.launch(time_cases, world_size, args=(cases, reps), network=network, timeout=600)
    wall = time.perf_counter() - wall
    slowest = {case: [max(r[case][i] for r in per_rank) for i in range(reps)] for case in cases}
    return slowest, wall


def summary(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--out", default=str(RESULTS / "modeled_clock"))
    args = parser.parse_args(argv)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    rows, walls, started = [], {}, time.perf_counter()
    try:
        for name in ("nvlink4", "ib_ndr"):
            net = Network.preset(name)
            for world_size in (4, 8):
                cases = [("ring", 16 * MiB), ("tree", 4 * KiB), ("raw_ring", 16 * MiB)]
                if name == "ib_ndr" and world_size == 8:
                    cases.append(("builtin", 16 * MiB))
                slowest, wall = measure(net, world_size, cases, args.reps)
                walls[f"{name}, {world_size} ranks"] = wall
                for (case, nbytes), times in slowest.items():
                    model = "ring" if case in ("raw_ring", "builtin") else case
                    low, high = (0.9, 1.2) if case == "builtin" else (0.98, 1.05)
                    ratios = [t / net.predict(model, nbytes, world_size) for t in times]
                    rows.append(dict(row=f"{case}, {name}, G={world_size}, {nbytes // KiB} KiB", model=model,
                                     ratio=summary(ratios), target=[low, high],
                                     met=all(low <= r <= high for r in ratios)))
                print(f"{name} G={world_size}: done in {wall:.1f} s", file=sys.stderr, flush=True)
        net = Network.preset("ib_ndr")
        ratios, sixty_four = [], []
        for _ in range(args.reps):
            slowest, wall = measure(net, 64, [("ring", MiB)], 1)
            ratios.append(slowest[("ring", MiB)][0] / net.predict("ring", MiB, 64))
            sixty_four.append(wall)
        rows.append(dict(row="ring, ib_ndr, G=64, 1024 KiB (one launch per repetition)", model="ring",
                         ratio=summary(ratios), target=[0.98, 1.05],
                         met=all(0.98 <= r <= 1.05 for r in ratios) and max(sixty_four) < 60))
        walls["ib_ndr, 64 ranks (per launch)"] = summary(sixty_four)
        print("64 ranks: done", file=sys.stderr, flush=True)
        launches = [measure(net, 8, [("ring", 16 * MiB)], 1)[0][("ring", 16 * MiB)][0] for _ in range(3)]
        spread = (max(launches) - min(launches)) / statistics.median(launches)
        rows.append(dict(row="the same schedule (ring, ib_ndr, G=8, 16 MiB), 3 launches: (max - min) / median",
                         model="-", ratio={"median": spread, "min": spread, "max": spread, "n": 3},
                         target=[0.0, 0.01], met=spread < 0.01, seconds=launches))
    finally:
        for process in busy:
            process.kill()
            process.wait()
    load = os.getloadavg()
    record = {"rows": rows, "walls": walls, "reps": args.reps, "load_average_after": load,
              "busy_processes": 2, "seconds": time.perf_counter() - started, "torch": torch.__version__}
    out = pathlib.Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(record, indent=1, default=str))
    lines = [f"# The modeled clock against Network.predict, two busy processes beside it ({args.reps} repetitions)", "",
             "Ratio = time on the ranks' modeled clocks (slowest rank) / the model's prediction. "
             f"Load average at the end: {load[0]:.1f}, {load[1]:.1f}, {load[2]:.1f}.", "",
             "| row | median | min | max | target | met |", "| --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        r = row["ratio"]
        lines.append(f"| {row['row']} | {r['median']:.6f} | {r['min']:.6f} | {r['max']:.6f} | "
                     f"[{row['target'][0]}, {row['target'][1]}] | {'yes' if row['met'] else 'NO'} |")
    lines += ["", "Wall time of each launch on this machine (seconds; this machine's clock, with the busy processes):", ""]
    for key, value in walls.items():
        text = (f"median {value['median']:.1f}, {value['min']:.1f}..{value['max']:.1f} over {value['n']}"
                if isinstance(value, dict) else f"{value:.1f}")
        lines.append(f"- {key}: {text}")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(row["met"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
