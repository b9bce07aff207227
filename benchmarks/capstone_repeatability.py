"""How repeatable the capstone's score is, and how its replayed clock compares with a run on the modeled clock.

    python benchmarks/capstone_repeatability.py --runs 9 --out benchmarks/results/capstone_repeatability

1. Repeatability: `exercises.check("beat_the_ring", fn)` on the same code `--runs` times (every visible case:
   G = 1..8 small tensors, and the timed grid: both links, G = 4, 4 KiB to 16 MiB), for a tuned solution
   (the model picks its own schedule), thresholds worked out by hand, and the plain ring. Recorded: the points,
   and the mean score over the timed cases (best of the course's four / yours), run by run; the spread is (max - min) / mean.
2. The clock: the course's ring, recursive doubling and halving-doubling run under
   ``course_lib.launch(..., network=link)`` on both links (G = 4, `--reps` times each), timed by every rank with
   `course_lib.clock()` (the modeled clock; the slowest rank's time counts), beside the replay of their recorded
   schedule, which is what the capstone scores: one simulation, so the two agree to rounding. Beside them, the
   wall time this machine took to run each call (its copies over loopback, Python), which the modeled clock
   leaves out.

The machine's load average is recorded: the wall times move with it, the modeled ones do not.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

import course_lib  # noqa: E402
import planted_bugs_part2 as pb  # noqa: E402
from course_lib import allreduce, exercises, fast_allreduce  # noqa: E402
from course_lib.exercises import capstone  # noqa: E402
from course_lib.exercises.tracing import Tracer  # noqa: E402

SOLUTIONS = {"tuned (model picks)": pb.beat_tuned_by_prediction, "thresholds by hand": pb.beat_size_thresholds,
             "plain ring": pb.beat_ring_only}
ALGORITHMS = {"ring": allreduce.ring, "recursive_doubling": fast_allreduce.recursive_doubling,
              "halving_doubling": fast_allreduce.halving_doubling}
CLOCK_SIZES = (4 * 1024, 1024 * 1024, 16 * 1024 * 1024)


def _mean_score(result) -> float:
    scores = [c.records[0]["timing"][3] for c in result.cases
              if c.case.data == "timed" and c.records and "timing" in c.records[0]]
    return statistics.mean(scores) if scores else 0.0


def _timed_run(rank, world_size, name, numel, reps):
    """(modeled seconds, wall seconds) of `reps` runs of one algorithm under the launch's modeled network."""
    torch.set_num_threads(1)
    tensor = torch.ones(numel)
    times = []
    for _ in range(reps):
        torch.distributed.barrier()       # free on the modeled clock: the ranks' clocks line up
        started, wall = course_lib.clock(), time.monotonic()
        ALGORITHMS[name](tensor)
        times.append((course_lib.clock() - started, time.monotonic() - wall))
    return times


def _events(rank, world_size, name, numel):
    tensor = torch.ones(numel)
    with Tracer(forbidden_modules=(), keep_data=False, landing=False) as tracer:
        ALGORITHMS[name](tensor)
    return list(tracer.events)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", help="write OUT.json and OUT.md")
    args = parser.parse_args(argv)
    report = {"load_average_start": os.getloadavg()[0], "cores": os.cpu_count(), "runs": args.runs, "solutions": {}}
    lines = [f"# The capstone's repeatability and clock", "",
             f"Load average at start {report['load_average_start']:.1f} on {os.cpu_count()} cores.", "",
             f"## Repeatability: the same code checked {args.runs} times", "",
             "| solution | points, run by run | mean score over the timed cases | spread | check time (median) |",
             "| --- | --- | --- | --- | --- |"]
    for label, fn in SOLUTIONS.items():
        points, means, seconds = [], [], []
        for _ in range(args.runs):
            started = time.perf_counter()
            result = exercises.check("beat_the_ring", fn)
            seconds.append(time.perf_counter() - started)
            points.append(result.score)
            means.append(_mean_score(result))
            print(f"{label}: {result.score:g}/{result.max_score:g}, mean score {means[-1]:.4f}, {seconds[-1]:.1f} s",
                  flush=True)
        spread = (max(means) - min(means)) / statistics.mean(means)
        report["solutions"][label] = {"points": points, "mean_scores": means, "spread": spread, "seconds": seconds}
        lines.append(f"| {label} | {', '.join(f'{p:g}' for p in points)} | {statistics.mean(means):.1%} | "
                     f"{spread:.2%} | {statistics.median(seconds):.1f} s |")
    lines += ["", f"## The clock: replay against `course_lib.clock()` under `course_lib.launch(..., network=link)`, G = 4",
              "", f"Every repetition ({args.reps} per row) is listed in the JSON; the table gives the largest and smallest "
              "modeled time over them, divided by the replay, and the median wall time of a call.", "",
              "| link | algorithm | size | replay (= Network.predict) | modeled clock / replay, min..max | "
              "this machine's wall time, median |",
              "| --- | --- | --- | --- | --- | --- |"]
    report["clock"] = []
    for link in capstone.LINKS:
        for name in ALGORITHMS:
            for nbytes in CLOCK_SIZES:
                numel = nbytes // 4
                replayed = capstone.replay(course_lib.launch(_events, 4, args=(name, numel)), link).seconds
                ranks = course_lib.launch(_timed_run, 4, args=(name, numel, args.reps), network=link)
                modeled = [max(rank[i][0] for rank in ranks) for i in range(args.reps)]
                wall = statistics.median(max(rank[i][1] for rank in ranks) for i in range(args.reps))
                report["clock"].append({"link": link.name, "algorithm": name, "bytes": nbytes, "replay": replayed,
                                        "modeled": modeled, "wall": wall})
                lines.append(f"| {link.name} | {name} | {capstone.size_name(nbytes)} | {replayed * 1e6:.3f} us | "
                             f"{min(modeled) / replayed:.9f}..{max(modeled) / replayed:.9f} | {wall * 1e3:.1f} ms |")
                print(lines[-1], flush=True)
    report["load_average_end"] = os.getloadavg()[0]
    lines += ["", f"Load average at the end {report['load_average_end']:.1f}."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        pathlib.Path(args.out + ".json").write_text(json.dumps(report, indent=1))
        pathlib.Path(args.out + ".md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
