"""Large all-reduces on this machine: time, and the work behind the time. Several launches, pooled.

    python benchmarks/large_allreduce_work.py                        # 5 launches x 21 repetitions
    python benchmarks/large_allreduce_work.py --launches 2 --reps 5 --out /tmp/look   # a quick look

Issue 10 asks whether `ring_pipelined` beats gloo's built-in all-reduce at 16 and 64 MiB on 4 ranks.
At these sizes one launch's median ratio moves by 5-10% from launch to launch on this 2-core machine,
as much as the difference being asked about, so this script measures only the large sizes, with
more repetitions, in several launches, and pools them:

* every launch is `bench.run(..., one_launch=True, cpu=True)`: 4 gloo ranks, each repetition runs
  every variant once in a freshly shuffled order, a repetition's time is the slowest rank's;
* each call also records its CPU time over all ranks (every thread, kernel time included) and the
  machine's idle share (`bench.measure_in_rank`, cpu=True);
* the launches are pooled by concatenating each variant's repetitions (every launch has the same
  number for every variant, so the pairs stay pairs): the pooled paired ratio is the median over all
  repetitions of t_variant / t_builtin in the same repetition, and each launch's own median is listed
  beside it.

Why CPU time: four ranks share two cores, so a call cannot take less than (CPU time of all ranks) /
2 cores. If two variants cost the same CPU time, the one that leaves fewer cores idle (ranks waiting
for each other) finishes first; if one costs more, no schedule can hide it. The CPU columns say which
of the two a difference comes from.

Writes benchmarks/results/large_allreduce_work.{json,md} (or --out STEM): pooled, with the targets and
each launch's median ratio; the JSON keeps every repetition of every launch, in launch order. With
--launch-out STEM every launch is also written on its own, to STEM_launch{K}.{json,md} (outside the
results folder, which keeps one file per benchmark).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import sys

from course_lib import bench
from fast_allreduce_figures import check_targets, target_summary, targets_markdown  # same targets, same report

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
VARIANTS = ("ring", "ring_pipelined", "halving_doubling", "tree", "builtin")
SIZES = ("16MiB", "64MiB")


def pool(launches: list[bench.Results]) -> bench.Results:
    """One Result per (world size, size, variant) holding every launch's repetitions, in launch order."""
    pooled = bench.Results()
    for first in launches[0]:
        same = [launch.get(first.variant, first.world_size, first.nbytes) for launch in launches]
        pooled.append(bench.Result(
            variant=first.variant, world_size=first.world_size, nbytes=first.nbytes, numel=first.numel,
            dtype=first.dtype, backend=first.backend, correct=all(r.correct for r in same),
            times=[t for r in same for t in r.times], cpu_seconds=[c for r in same for c in r.cpu_seconds],
            idle_ticks=[i for r in same for i in r.idle_ticks], total_ticks=[t for r in same for t in r.total_ticks]))
    return pooled


def launch_medians(launches: list[bench.Results], reference: str = "builtin") -> list[dict]:
    """Every launch's median paired ratio against `reference`, per (size, variant)."""
    rows = []
    for r in launches[0]:
        if r.variant == reference:
            continue
        medians = [bench.spread(launch.ratios(r.variant, reference, r.world_size, r.nbytes))["median"]
                   for launch in launches]
        rows.append(dict(variant=r.variant, world_size=r.world_size, nbytes=r.nbytes, medians=medians))
    return rows


def _markdown_extra(targets, per_launch, cpu_floor) -> str:
    lines = ["", "## Each launch's median ratio to builtin (same repetition)", "",
             "| size | variant | " + " | ".join(f"launch {k + 1}" for k in range(len(per_launch[0]["medians"])))
             + " |", "| --- | --- |" + " --- |" * len(per_launch[0]["medians"])]
    for row in per_launch:
        lines.append(f"| {bench.format_bytes(row['nbytes'])} | {row['variant']} | "
                     + " | ".join(f"{m:.3f}" for m in row["medians"]) + " |")
    lines += ["", "## The CPU floor: CPU time of all ranks / cores, against the measured median", "",
              "| size | variant | CPU per call / cores | median time | time / floor |", "| --- | --- | --- | --- | --- |"]
    for row in cpu_floor:
        lines.append(f"| {bench.format_bytes(row['nbytes'])} | {row['variant']} | {row['floor_s'] * 1e3:.2f} ms | "
                     f"{row['median_s'] * 1e3:.2f} ms | {row['median_s'] / row['floor_s']:.2f} |")
    lines += ["", "## Issue 10's targets, pooled (median paired ratio, same repetition)", "", *targets_markdown(targets)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--sizes", default=",".join(SIZES))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--launches", type=int, default=5)
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--note", default="", help="recorded in the results, e.g. 'nothing else running'")
    parser.add_argument("--out", default=str(RESULTS / "large_allreduce_work"))
    parser.add_argument("--launch-out", metavar="STEM", default=None,
                        help="also write every launch on its own, to STEM_launch{K}.{json,md}")
    args = parser.parse_args(argv)
    if args.reps * args.launches < 9:
        print("note: fewer than 9 repetitions in all: a look, not a figure to quote", file=sys.stderr)
    variants = args.variants.split(",")
    if "builtin" not in variants:
        raise SystemExit("--variants must include builtin: every ratio is against it")
    command = "python benchmarks/large_allreduce_work.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    launches, loads = [], [bench.machine_description()["loadavg"]]
    for k in range(args.launches):
        results = bench.run(args.sizes.split(","), world_sizes=[args.world_size], variants=variants, reps=args.reps,
                            warmup=args.warmup, backend="gloo", one_launch=True, cpu=True)
        loads.append(bench.machine_description()["loadavg"])
        print(f"launch {k + 1}/{args.launches}, load average after: {loads[-1]}", file=sys.stderr)
        print(results.table("builtin"), file=sys.stderr)
        if args.launch_out:
            results.save(f"{args.launch_out}_launch{k + 1}", "builtin",
                         title=f"Large all-reduces, launch {k + 1} of {args.launches}",
                         meta={"command": command, "reps": args.reps, "warmup": args.warmup, "note": args.note,
                               "loadavg_before": loads[-2], "loadavg_after": loads[-1]})
        launches.append(results)

    pooled = pool(launches)
    print(pooled.table("builtin"))
    targets = check_targets(pooled, args.world_size)
    per_launch = launch_medians(launches)
    cores = bench.machine_description()["cpus_usable"]
    cpu_floor = [dict(variant=r.variant, nbytes=r.nbytes, floor_s=r.cpu_median / cores, median_s=r.median)
                 for r in pooled]
    for t in targets:
        print(target_summary(t))
    meta = {"command": command, "reps": args.reps, "launches": args.launches, "warmup": args.warmup,
            "note": args.note, "loadavg_before": loads[0], "loadavg_after": loads[-1], "loadavg_per_launch": loads[1:],
            "pooled": "each variant's repetitions of all launches, in launch order"}
    json_path, md_path = pooled.save(args.out, "builtin", meta=meta,
                                     title=f"Large all-reduces: {args.launches} launches x {args.reps} repetitions, pooled")
    document = json.loads(pathlib.Path(json_path).read_text())
    document.update(targets=targets, launch_medians=per_launch, cpu_floor=cpu_floor)
    pathlib.Path(json_path).write_text(json.dumps(document, indent=1) + "\n")
    with open(md_path, "a", encoding="utf-8") as f:
        f.write(_markdown_extra(targets, per_launch, cpu_floor))
    print("wrote", json_path, md_path, file=sys.stderr)
    return 0 if all(r.correct for r in pooled) else 1


if __name__ == "__main__":
    sys.exit(main())
