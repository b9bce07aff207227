"""What course_lib's cross-rank argument check costs, and what it cost before: on the machine's own clock.

    python benchmarks/argument_check.py                       # 2, 3, 4 and 8 ranks, 11 repetitions
    python benchmarks/argument_check.py --world-sizes 4 --reps 9 --calls 100

Every collective and all-reduce variant of course_lib starts with `_checks.agree`: each rank shares a row of a
few integers (which function, how many elements, which dtype, op and root) and every rank checks that they agree.
Until 2026-11-27 the rows went round in gloo's `all_gather`, a ring: G (G - 1) messages. Now rank 0 gathers them
and broadcasts the table (`_checks._share`): 2 (G - 1). This script times `agree` itself both ways, and a checked
`allreduce.parameter_server` of 64 float32 (a training loop's loss sum: two numbers), with each exchange, in one
launch per world size. Within every repetition the variants take turns (their order alternates), each timed over
`--calls` calls after a barrier; a repetition keeps the slowest rank's time per call. Printed and written: the
median over repetitions and the spread (min..max), and per repetition the ratio before / now.

The clock is this machine's (`time.perf_counter`), not the modeled network's, on which the check costs nothing:
what is measured is this machine's cost per message (gloo on loopback, several ranks sharing 2 cores), the cost
that CI and a learner's notebook pay.
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import course_lib  # noqa: E402
from course_lib import _checks, allreduce  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = {"numel": 64, "dtype": 0, "op": 0, "root": -1}


def _share_by_all_gather(row: torch.Tensor, world_size: int) -> torch.Tensor:
    """The exchange as it was: gloo's all_gather of every rank's row."""
    rows = [torch.empty_like(row) for _ in range(world_size)]
    dist.all_gather(rows, row)
    return torch.stack(rows)


EXCHANGES = {"before (all_gather)": _share_by_all_gather, "now (gather + broadcast)": _checks._share}


def _time(fn, calls: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def measure(rank, world_size, reps, calls):
    """{(what, exchange): [seconds per call, one per repetition]} on this rank."""
    tensor = torch.randn(64)
    what = {"agree": lambda: _checks.agree("all_reduce", FIELDS, same=("numel", "dtype", "op")),
            "parameter_server, 64 floats, checked": lambda: allreduce.parameter_server(tensor)}
    times = {(w, e): [] for w in what for e in EXCHANGES}
    original = _checks._share
    try:
        for rep in range(reps):
            order = list(EXCHANGES) if rep % 2 == 0 else list(EXCHANGES)[::-1]
            for exchange in order:
                _checks._share = EXCHANGES[exchange]
                for name, fn in what.items():
                    times[name, exchange].append(_time(fn, calls))
    finally:
        _checks._share = original
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3, 4, 8])
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "argument_check"),
                        help="writes OUT.md and OUT.json ('' for neither)")
    args = parser.parse_args(argv)
    if args.reps < 1 or args.calls < 1 or min(args.world_sizes) < 2:
        parser.error("--reps and --calls must be 1 or more, every world size 2 or more")
    load_before = os.getloadavg()
    rows, raw = [], {}
    for world_size in args.world_sizes:
        per_rank = course_lib.launch(measure, world_size, args=(args.reps, args.calls), timeout=600)
        slowest = {key: [max(r[key][i] for r in per_rank) for i in range(args.reps)] for key in per_rank[0]}
        raw[world_size] = {f"{w} | {e}": v for (w, e), v in slowest.items()}
        for what in dict.fromkeys(w for w, _ in slowest):
            before, now = slowest[what, "before (all_gather)"], slowest[what, "now (gather + broadcast)"]
            ratios = [b / n for b, n in zip(before, now)]
            rows.append((world_size, what, before, now, ratios))
    load_after = os.getloadavg()
    ms = lambda xs: f"{1e3 * statistics.median(xs):.3f} ({1e3 * min(xs):.3f}..{1e3 * max(xs):.3f})"
    lines = [f"# The cross-rank argument check: before (gloo all_gather) and now (gather + broadcast), "
             f"this machine's clock",
             "",
             f"Command: `python benchmarks/argument_check.py {' '.join(argv if argv is not None else sys.argv[1:])}`."
             f" Machine: {os.cpu_count()} CPUs, torch {torch.__version__}, gloo; load average before "
             f"{load_before[0]:.2f}, after {load_after[0]:.2f}. {args.reps} repetitions of {args.calls} calls, the "
             "variants taking turns in every repetition; the slowest rank per repetition. Medians (min..max).",
             "",
             "| ranks | call | before, ms per call | now, ms per call | before / now |",
             "| --- | --- | --- | --- | --- |"]
    for world_size, what, before, now, ratios in rows:
        lines.append(f"| {world_size} | {what} | {ms(before)} | {ms(now)} | {statistics.median(ratios):.2f} "
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
