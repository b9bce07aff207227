"""What keeping torch's sends alive costs a rank on the modeled clock: one list scanned on every send, or a thread.

    python benchmarks/modeled_sends.py                    # 8 ranks: 50 and 150 rings; 4 ranks: 150 rings; 9 reps
    python benchmarks/modeled_sends.py --cases 8:50 --reps 9

Under `launch(..., network=...)` a send's modeled wait returns at the model's time, without waiting for torch, so the
rank must keep torch's handle (gloo loses a send whose handle is dropped before its receive is posted) and the copy
it reads until torch has sent it (`modeled_clock._RankState.keep_send`). Until 2026-11-28 every send scanned a list
of all the rank's earlier ones and kept those whose `is_completed()` was False; under gloo that stays False until
someone waits, so the list held every send of the launch and each send cost time in proportion to the sends before
it. Now a thread of the rank waits on torch's sends in order and lets each go once sent.

Each case is a number of ranks G and of course_lib ring all-reduces of 64 float32 in one launch under a modeled
network (ib_ndr), the two ways in launches that take turns (their order alternates between repetitions). Per
launch: the slowest rank's time for the rings (`time.perf_counter`, this machine's clock), and the CPU time of all
ranks together (`time.process_time` of every rank's process, all its threads: what a busy machine, or CI, pays).
Printed and written: median and spread (min..max) over repetitions, and the ratio list / thread per repetition.
The rings' modeled times are the same both ways (checked): only this machine's cost changes.
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
from course_lib import allreduce, modeled_clock  # noqa: E402

WAYS = ("list", "thread")


def _keep_in_a_list(self, work, copy) -> None:
    """The way before 2026-11-28 (kept here to time it): every send scans the list of the rank's earlier ones."""
    with self.lock:
        self.sends = [(w, t) for w, t in self.sends if not w.is_completed()]
        self.sends.append((work, copy))


def rings(rank, world_size, count, way):
    """`count` ring all-reduces of 64 floats: (seconds, CPU seconds of this process, modeled seconds)."""
    if way == "list":
        modeled_clock._state.sends = []
        modeled_clock._RankState.keep_send = _keep_in_a_list    # this rank's process only (a fork of its own)
    tensor = torch.randn(64, generator=torch.Generator().manual_seed(rank))
    dist.barrier()
    start, cpu, modeled = time.perf_counter(), time.process_time(), course_lib.clock()
    for _ in range(count):
        allreduce.ring(tensor)
    return time.perf_counter() - start, time.process_time() - cpu, course_lib.clock() - modeled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="8:50,8:150,4:150", help="G:rings, comma-separated")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--network", default="ib_ndr")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "modeled_sends"))
    args = parser.parse_args()
    cases = [tuple(int(x) for x in case.split(":")) for case in args.cases.split(",")]
    results = []
    for world_size, count in cases:
        runs = {way: [] for way in WAYS}
        for rep in range(args.reps):
            for way in (WAYS if rep % 2 == 0 else WAYS[::-1]):
                out = course_lib.launch(rings, world_size, args=(count, way), network=args.network, timeout=600)
                runs[way].append((max(o[0] for o in out), sum(o[1] for o in out), out[0][2]))
        modeled = {round(r[2], 12) for way in WAYS for r in runs[way]}
        assert len(modeled) == 1, modeled                       # the same modeled time, every launch, both ways
        row = {"world_size": world_size, "rings": count, "sends_per_rank": 2 * (world_size - 1) * count,
               "modeled_ms_per_ring": 1e3 * modeled.pop() / count}
        for way in WAYS:
            for index, what in ((0, "wall"), (1, "cpu")):
                values = [1e3 * r[index] / count for r in runs[way]]
                row[f"{way}_{what}_ms_per_ring"] = {"median": statistics.median(values), "min": min(values),
                                                    "max": max(values)}
        for index, what in ((0, "wall"), (1, "cpu")):
            ratios = [a[index] / b[index] for a, b in zip(runs["list"], runs["thread"])]
            row[f"ratio_{what}"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
        results.append(row)
        print(json.dumps(row))
    lines = [f"# Keeping torch's sends alive on the modeled clock ({args.network}): a list or a thread",
             "", f"`python benchmarks/modeled_sends.py --cases {args.cases} --reps {args.reps}`; ms per ring "
             "all-reduce of 64 float32, median (min..max) over repetitions; wall: the slowest rank, this machine's "
             "clock; CPU: all ranks' processes together; ratio: list / thread per repetition.", "",
             "| ranks | rings | sends per rank | wall: list | wall: thread | wall ratio | CPU: list | CPU: thread "
             "| CPU ratio |", "| --- | --- | --- | ---: | ---: | --- | ---: | ---: | --- |"]

    def cell(d):
        return f"{d['median']:.2f} ({d['min']:.2f}..{d['max']:.2f})"

    for row in results:
        lines.append(f"| {row['world_size']} | {row['rings']} | {row['sends_per_rank']} | "
                     f"{cell(row['list_wall_ms_per_ring'])} | {cell(row['thread_wall_ms_per_ring'])} | "
                     f"{cell(row['ratio_wall'])} | {cell(row['list_cpu_ms_per_ring'])} | "
                     f"{cell(row['thread_cpu_ms_per_ring'])} | {cell(row['ratio_cpu'])} |")
    same = ", ".join(f"{r['world_size']} ranks {r['modeled_ms_per_ring'] * 1e3:.2f} us" for r in results)
    lines += ["", f"Every launch read the same modeled time per ring, both ways ({same})."]
    with open(args.out + ".json", "w") as f:
        json.dump({"network": args.network, "reps": args.reps, "results": results}, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
