"""What course_lib's cross-rank argument check costs, exchanged both ways, on this machine's own clock.

    python benchmarks/argument_check.py                       # 2, 3, 4 and 8 ranks, 11 repetitions
    python benchmarks/argument_check.py --world-sizes 4 --reps 9 --calls 100 --network ''

Every collective and all-reduce variant of course_lib starts with `runtime.agree`: each rank shares a row of a
few integers (which function, how many elements, which dtype, op and root) and every rank checks that they agree.
Until 2026-11-27 the rows went round in gloo's `all_gather`, a ring: G (G - 1) messages. Now, from 3 ranks on,
rank 0 gathers them and broadcasts the table: 2 (G - 1) messages (`runtime._share`; with 2 ranks it keeps the
one all_gather: as many messages, in one call). This script times `agree` itself both ways, and a checked
`allreduce.parameter_server` of 64 float32 (as small as a training loop's loss sum), in one launch per world
size, and again in a launch under a modeled network (`--network`, default ib_ndr), where every built-in
collective also makes a round trip to the simulation (two calls, two round trips). Within every repetition the
two ways take turns (their order alternates), each timed over `--calls` calls after a barrier, after one
warm-up round; a repetition keeps the slowest rank's time per call. Printed and written: the median over
repetitions and the spread (min..max), and the median and spread of the per-repetition ratio all_gather /
gather + broadcast (above 1: gather + broadcast is faster).

The clock is this machine's (`time.perf_counter`), also under the modeled network, on whose own clock the
check costs nothing: what is measured is this machine's cost per message (gloo on loopback, several ranks
sharing 2 cores), the cost that CI and a learner's notebook pay.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import course_lib  # noqa: E402
from course_lib import allreduce, runtime  # noqa: E402
FIELDS = {"numel": 64, "dtype": 0, "op": 0, "root": -1}


EXCHANGES = {"all_gather": runtime._all_gather_rows, "gather + broadcast": runtime._gather_and_broadcast_rows}


def _time(fn, calls: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def measure(rank, world_size, reps, calls):
    """{(what, exchange): [seconds per call, one per repetition]} on this rank."""
    tensor = torch.randn(64)
    what = {"agree": lambda: runtime.agree("all_reduce", FIELDS, same=("numel", "dtype", "op")),
            "parameter_server, 64 floats, checked": lambda: allreduce.parameter_server(tensor)}
    times = {(w, e): [] for w in what for e in EXCHANGES}
    original = runtime._share
    try:
        for exchange in EXCHANGES:                     # a warm-up round, not kept: connections, first allocations
            runtime._share = EXCHANGES[exchange]
            for fn in what.values():
                _time(fn, max(1, calls // 10))
        for rep in range(reps):
            order = list(EXCHANGES) if rep % 2 == 0 else list(EXCHANGES)[::-1]
            for exchange in order:
                runtime._share = EXCHANGES[exchange]
                for name, fn in what.items():
                    times[name, exchange].append(_time(fn, calls))
    finally:
        runtime._share = original
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3, 4, 8])
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--network", default="ib_ndr", help="a Network preset for the second launch ('' for none)")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "argument_check"),
                        help="writes OUT.md and OUT.json ('' for neither)")
    args = parser.parse_args(argv)
    if args.reps < 1 or args.calls < 1 or min(args.world_sizes) < 2:
        parser.error("--reps and --calls must be 1 or more, every world size 2 or more")
    load_before = os.getloadavg()
    rows, raw = [], {}
    networks = [None] + ([course_lib.Network.preset(args.network)] if args.network else [])
    for world_size in args.world_sizes:
        for network in networks:
            launched = "plain" if network is None else f"modeled {args.network}"
            per_rank = course_lib.launch(measure, world_size, args=(args.reps, args.calls), timeout=600,
                                         network=network)
            slowest = {key: [max(r[key][i] for r in per_rank) for i in range(args.reps)] for key in per_rank[0]}
            raw[f"{world_size} {launched}"] = {f"{w} | {e}": v for (w, e), v in slowest.items()}
            for what in dict.fromkeys(w for w, _ in slowest):
                ring, gathered = slowest[what, "all_gather"], slowest[what, "gather + broadcast"]
                ratios = [r / g for r, g in zip(ring, gathered)]
                rows.append((world_size, launched, what, ring, gathered, ratios))
    load_after = os.getloadavg()
    ms = lambda xs: f"{1e3 * statistics.median(xs):.3f} ({1e3 * min(xs):.3f}..{1e3 * max(xs):.3f})"
    lines = [f"# The cross-rank argument check: gloo's all_gather (as before) or gather + broadcast (now from 3 "
             f"ranks on), this machine's clock",
             "",
             f"Command: `{' '.join(['python benchmarks/argument_check.py', *(argv if argv is not None else sys.argv[1:])])}`."
             f" Machine: {os.cpu_count()} CPUs, torch {torch.__version__}, gloo; load average before "
             f"{load_before[0]:.2f}, after {load_after[0]:.2f}. {args.reps} repetitions of {args.calls} calls, the "
             "variants taking turns in every repetition; the slowest rank per repetition. Medians (min..max).",
             "",
             "| ranks | launch | call | all_gather, ms per call | gather + broadcast, ms per call | all_gather / gather + broadcast |",
             "| --- | --- | --- | --- | --- | --- |"]
    for world_size, launched, what, ring, gathered, ratios in rows:
        lines.append(f"| {world_size} | {launched} | {what} | {ms(ring)} | {ms(gathered)} | {statistics.median(ratios):.2f} "
                     f"({min(ratios):.2f}..{max(ratios):.2f}) |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out + ".md", "w") as f:
            f.write(text)
        with open(args.out + ".json", "w") as f:
            json.dump({"reps": args.reps, "calls": args.calls, "load_average": [load_before[0], load_after[0]],
                       "cpus": os.cpu_count(), "torch": torch.__version__, "seconds_per_call": raw}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
