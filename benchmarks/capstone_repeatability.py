"""How repeatable the capstone's score is, and how its replayed clock compares with a real modeled-link run.

    python benchmarks/capstone_repeatability.py --runs 9 --out benchmarks/results/capstone_repeatability

1. Repeatability: `exercises.check("beat_the_ring", fn)` on the same code `--runs` times (every visible case:
   G = 1..8 small tensors, and the timed grid: both links, G = 4 and 8, 4 KiB to 64 MiB), for a tuned solution
   (the alpha-beta model picks its own schedule) and the plain ring. Recorded: the points, and the mean score
   over the timed cases (best known / yours), run by run; the spread is (max - min) / mean.
2. The clock: the course's ring, recursive doubling and halving-doubling run under
   ``course_lib.launch(..., network=link)`` on both links (G = 4, `--reps` times each), their wall time (median)
   beside the replay of their recorded schedule, which is what the capstone scores. The wall time adds this
   machine's own costs (copies over loopback, adding chunks, Python), so it is the replay plus something.

The machine's load average is recorded: the real runs move with it, the replay does not.
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
    """Wall time of `reps` runs of one algorithm under the launch's modeled network, and one recorded schedule."""
    torch.set_num_threads(1)
    tensor = torch.ones(numel)
    times = []
    for _ in range(reps):
        torch.distributed.barrier()
        started = time.monotonic()
        ALGORITHMS[name](tensor)
        torch.distributed.barrier()       # the last rank's end
        times.append(time.monotonic() - started)
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
    lines += ["", f"## The clock: replay against a real run over `course_lib.launch(..., network=link)`, G = 4", "",
              "| link | algorithm | size | replay (= Network.predict) | real modeled-link run, median | real / replay |",
              "| --- | --- | --- | --- | --- | --- |"]
    report["clock"] = []
    for link in capstone.LINKS:
        for name in ALGORITHMS:
            for nbytes in CLOCK_SIZES:
                numel = nbytes // 4
                replayed = capstone.replay(course_lib.launch(_events, 4, args=(name, numel)), link).seconds
                walls = course_lib.launch(_timed_run, 4, args=(name, numel, args.reps), network=link)
                wall = statistics.median(max(rank[i] for rank in walls) for i in range(args.reps))
                report["clock"].append({"link": link.name, "algorithm": name, "bytes": nbytes, "replay": replayed,
                                        "wall": wall})
                lines.append(f"| {link.name} | {name} | {capstone.size_name(nbytes)} | {replayed * 1e3:.3f} ms | "
                             f"{wall * 1e3:.3f} ms | {wall / replayed:.3f} |")
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
