"""Did async_op and the aliasing fixes slow down the synchronous collectives? Old code against new, paired.

    python benchmarks/sync_path_overhead.py                          # 4 ranks, 1 KiB, base acd904d
    python benchmarks/sync_path_overhead.py --world-size 2 --reps 15 --json /tmp/sync_path_G2.json

The library as it was before issue 12 (git commit --base, default acd904d) is unpacked into a
temporary directory as the package `course_lib_base` and imported beside `course_lib`, so both run
in the same launch on the same process group. Every collective and all-reduce variant is timed in
both versions, taking turns within every repetition (background load hits both alike); a
repetition times `--calls` calls after a barrier and keeps the slowest rank's time per call. Small
tensors (default 256 float32 = 1 KiB) make the calls latency-bound, where Python overhead shows most.
Like course_lib.bench, the calls run under `unchecked()` (no cross-rank argument check); one
all_reduce is also timed with the check on.

Printed per operation: the median over repetitions of (new time / old time in the same repetition)
and the spread of that ratio (min..max), with the median times in microseconds; then each version's
best repetition (the least disturbed by other processes on a shared machine).

The figures docs/architecture.md quotes (one rank and two) are in benchmarks/results/sync_path_overhead.md;
sync_path_overhead.json holds those two runs' --json documents, under "runs".
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

import torch
import torch.distributed as dist

import course_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def unpack_base(commit: str, into: str) -> None:
    """Write the package at `commit` into `into`/course_lib_base, its imports renamed."""
    blob = subprocess.run(["git", "archive", commit, "course_lib"], cwd=ROOT, check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(blob)) as archive:
        archive.extractall(into, filter="data")
    os.rename(os.path.join(into, "course_lib"), os.path.join(into, "course_lib_base"))
    for folder, _, names in os.walk(os.path.join(into, "course_lib_base")):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path) as f:
                    text = f.read()
                with open(path, "w") as f:
                    f.write(re.sub(r"\bcourse_lib\b", "course_lib_base", text))


def operations(lib, rank, world_size, numel):
    """name -> function running one call of that operation of `lib` (inputs prepared once)."""
    c, a = lib.collectives, lib.allreduce
    x = torch.randn(numel)
    piece = torch.randn(max(1, numel // world_size))
    pieces = [piece.clone() for _ in range(world_size)]
    slots = [torch.empty_like(piece) for _ in range(world_size)]
    out = torch.empty_like(piece)
    return {
        "broadcast": lambda: c.broadcast(x, src=0),
        "scatter": lambda: c.scatter(out, pieces if rank == 0 else None, src=0),
        "gather": lambda: c.gather(piece, slots if rank == 0 else None, dst=0),
        "all_gather": lambda: c.all_gather(slots, piece),
        "all_to_all": lambda: c.all_to_all(slots, pieces),
        "reduce": lambda: c.reduce(x, dst=0),
        "all_reduce": lambda: c.all_reduce(x),
        "reduce_scatter": lambda: c.reduce_scatter(out, pieces),
        "allreduce.ring": lambda: a.ring(x),
        "allreduce.naive": lambda: a.naive(x),
        "allreduce.parameter_server": lambda: a.parameter_server(x),
    }


def measure(rank, world_size, base_dir, numel, calls, reps):
    sys.path.insert(0, base_dir)
    import course_lib_base

    # Both versions write the launcher's status line before every blocking call, as they would alone.
    course_lib_base._rankstate._slot = course_lib.runtime._slot
    libs = {"old": course_lib_base, "new": course_lib}
    variants = {}
    for version, lib in libs.items():
        for name, run in operations(lib, rank, world_size, numel).items():
            variants[(name, version)] = (run, lib.unchecked)
        variants[("all_reduce, checked", version)] = (operations(lib, rank, world_size, numel)["all_reduce"],
                                                     contextlib.nullcontext)
    times = {key: [] for key in variants}
    for rep in range(reps + 1):  # the first repetition warms up
        for key, (run, context) in variants.items():
            dist.barrier()
            with context():
                start = time.perf_counter()
                for _ in range(calls):
                    run()
                elapsed = torch.tensor([(time.perf_counter() - start) / calls], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time
            if rep:
                times[key].append(elapsed.item())
    return {f"{name} | {version}": values for (name, version), values in times.items()}


def summarize(times: dict) -> list[dict]:
    names = sorted({key.split(" | ")[0] for key in times}, key=lambda n: list(times).index(f"{n} | old"))
    rows = []
    for name in names:
        old, new = times[f"{name} | old"], times[f"{name} | new"]
        ratios = [n / o for n, o in zip(new, old)]
        rows.append(dict(operation=name, old_us=statistics.median(old) * 1e6, new_us=statistics.median(new) * 1e6,
                         ratio_median=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios),
                         old_best_us=min(old) * 1e6, new_best_us=min(new) * 1e6))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="acd904d", help="git commit of the old version")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--numel", type=int, default=256)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--json", metavar="PATH", help="also write the settings, every time and the summary here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as base_dir:
        unpack_base(args.base, base_dir)
        times = course_lib.launch(measure, args.world_size, args=(base_dir, args.numel, args.calls, args.reps),
                                  backend="gloo", timeout=1800)[0]
    rows = summarize(times)
    print(f"{args.world_size} ranks, {args.numel} float32, {args.calls} calls per repetition, {args.reps} repetitions; "
          f"old = {args.base}; load average {os.getloadavg()[0]:.1f}")
    print(f"{'operation':28s} {'old us':>8s} {'new us':>8s}   new/old median (min..max)   best: old us  new us")
    for r in rows:
        print(f"{r['operation']:28s} {r['old_us']:8.1f} {r['new_us']:8.1f}   {r['ratio_median']:.3f} "
              f"({r['ratio_min']:.2f}..{r['ratio_max']:.2f})".ljust(70) + f"{r['old_best_us']:8.1f} {r['new_best_us']:8.1f}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(settings=vars(args), load_average=os.getloadavg(), summary=rows, times=times), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
