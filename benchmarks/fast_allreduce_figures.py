"""Can we beat the ring? The faster all-reduces against the ring and gloo's built-in, measured.

    python benchmarks/fast_allreduce_figures.py                    # 4 ranks, 4 KiB .. 64 MiB, 9 reps
    python benchmarks/fast_allreduce_figures.py --reps 3 --out /tmp/quick   # a quick look, not a figure

Variants ring, ring_pipelined, ring_bidirectional, halving_doubling, tree (course_lib) and builtin
(torch.distributed.all_reduce on gloo) are timed in ONE launch of 4 gloo ranks: for every size,
every repetition runs each variant once, in an order shuffled anew in every repetition
(`course_lib.bench.measure_in_rank`), and a repetition's time is the slowest rank's. Reported per
size and variant: median, interquartile range, min..max, and the paired ratio against the built-in
(and against the ring for the targets below): t_variant / t_reference in the same repetition, whose
median cancels load that hits both.

Issue 10's targets (4 ranks, gloo, same launch), checked at the end of the markdown file:

    ring_pipelined <= 1.0x builtin at 16 MiB and <= 0.9x at 64 MiB, and not slower than ring at either
    at 4 KiB the faster of halving_doubling and tree <= 0.85x ring

Also fits each variant's alpha-beta model (course_lib.cost) to the medians and gives the crossover
sizes between the small-message and large-message variants, and (in a separate launch, after the
timing, because a stopwatch around every addition slows it) how much of the plain ring's time goes
into adding: overlapping the adding with the transfers, which is all ring_pipelined changes, can win
back at most that share.

Writes benchmarks/results/fast_allreduce_figures.{json,md} (or --out STEM) with the machine's
description and the load average before and after. On a shared machine the ratios move by 15% or
more: quote a figure only from a run on a quiet machine, with its spread. One launch still carries
its own conditions: the figures README.md quotes pool three launches (benchmarks/pool_results.py),
in the pooled section at the end of benchmarks/results/fast_allreduce_figures.md; run the further
launches with --out /tmp/... so that the results folder keeps one file per benchmark.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import sys
import time

import torch
import torch.distributed as dist

import course_lib
from course_lib import allreduce, bench, cost, ops

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
VARIANTS = ("ring", "ring_pipelined", "ring_bidirectional", "halving_doubling", "tree", "builtin")
SIZES = ("4KiB", "64KiB", "1MiB", "4MiB", "16MiB", "64MiB")

# (what, variant, reference, size, at most): median paired ratio variant / reference
TARGETS = (("ring_pipelined vs builtin at 16 MiB", "ring_pipelined", "builtin", "16MiB", 1.0),
           ("ring_pipelined vs builtin at 64 MiB", "ring_pipelined", "builtin", "64MiB", 0.9),
           ("ring_pipelined vs ring at 16 MiB", "ring_pipelined", "ring", "16MiB", 1.0),
           ("ring_pipelined vs ring at 64 MiB", "ring_pipelined", "ring", "64MiB", 1.0),
           ("faster of halving_doubling, tree vs ring at 4 KiB", ("halving_doubling", "tree"), "ring", "4KiB", 0.85))


def check_targets(results: bench.Results, world_size: int) -> list[dict]:
    """Each target's measured median paired ratio, its IQR, and whether it is met."""
    rows = []
    for what, variant, reference, size, limit in TARGETS:
        nbytes = bench.parse_bytes(size)
        if not results.where(reference, world_size, nbytes):
            continue
        candidates = variant if isinstance(variant, tuple) else (variant,)
        candidates = [v for v in candidates if results.where(v, world_size, nbytes)]
        if not candidates:
            continue
        # "The faster of": the one with the smaller median time; then its paired ratio.
        chosen = min(candidates, key=lambda v: results.get(v, world_size, nbytes).median)
        paired = bench.spread(results.ratios(chosen, reference, world_size, nbytes))
        rows.append(dict(target=what, variant=chosen, reference=reference, nbytes=nbytes, limit=limit,
                         ratio=paired, met=paired["median"] <= limit))
    return rows


def targets_markdown(targets: list[dict]) -> list[str]:
    """`check_targets`' rows as a markdown table (lines), the repetitions behind each ratio included."""
    lines = ["| target | variant | ratio median (IQR; min..max) | repetitions | at most | met |",
             "| --- | --- | --- | --- | --- | --- |"]
    for t in targets:
        r = t["ratio"]
        lines.append(f"| {t['target']} | {t['variant']} | {r['median']:.3f} ({r['q1']:.2f}..{r['q3']:.2f}; "
                     f"{r['min']:.2f}..{r['max']:.2f}) | {r['n']} | {t['limit']} | {'yes' if t['met'] else 'no'} |")
    return lines


def target_summary(t: dict) -> str:
    """One `check_targets` row as a line for the terminal."""
    r = t["ratio"]
    return (f"{t['target']}: {r['median']:.3f} (IQR {r['q1']:.2f}..{r['q3']:.2f}, {r['n']} repetitions), "
            f"target <= {t['limit']}: {'met' if t['met'] else 'NOT met'}")


def crossovers(fits: dict, world_size: int) -> list[dict]:
    """Where the small-message variants hand over to the large-message ones, from the fitted models."""
    pairs = [("tree", "ring"), ("halving_doubling", "ring"), ("tree", "halving_doubling"),
             ("tree", "ring_pipelined"), ("halving_doubling", "ring_pipelined"), ("ring", "ring_pipelined")]
    return [dict(a=a, b=b, bytes=cost.crossover_bytes(fits[a], fits[b], world_size))
            for a, b in pairs if a in fits and b in fits]


def _reduction_share_rank(rank, world_size, sizes, variant, reps):
    """Per size: median over reps of (seconds inside ops.combine_) / (seconds of the whole call), this rank."""
    spent = [0.0]
    combine = ops.combine_

    def timed_combine(accumulator, incoming, op):
        start = time.perf_counter()
        try:
            return combine(accumulator, incoming, op)
        finally:
            spent[0] += time.perf_counter() - start

    ops.combine_ = timed_combine  # this rank's process only
    shares = {}
    for nbytes in sizes:
        source = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(rank))
        rows = []
        for rep in range(reps + 1):
            work = source.clone()
            dist.barrier()
            spent[0], start = 0.0, time.perf_counter()
            with course_lib.unchecked():
                allreduce.get(variant)(work)
            if rep:  # the first is a warm-up
                rows.append(spent[0] / (time.perf_counter() - start))
        shares[nbytes] = bench.spread(rows)["median"]
    return shares


def reduction_share(world_size, sizes, variant="ring", reps=5) -> dict:
    """{nbytes: share of the call's time spent adding}, the largest share over the ranks."""
    per_rank = course_lib.launch(_reduction_share_rank, world_size, backend="gloo", timeout=600,
                                 args=(sizes, variant, reps))
    return {n: max(shares[n] for shares in per_rank) for n in sizes}


def _markdown_extra(targets, fits, world_size, cross, shares) -> str:
    lines = ["", "## Issue 10's targets (median paired ratio, same repetition)", "", *targets_markdown(targets)]
    lines += ["", f"## Alpha-beta fits to the medians ({world_size} ranks; course_lib.cost)", "",
              "| variant | model | alpha | 1/beta | median abs. rel. error |", "| --- | --- | --- | --- | --- |"]
    for name, f in fits.items():
        lines.append(f"| {name} | {cost.model_for(f.model).formula} | {f.alpha * 1e6:.1f} us | "
                     f"{f.bandwidth / 1e9:.3g} GB/s | {100 * f.median_relative_error:.0f}% |")
    lines += ["", "Crossover sizes from the fitted models (bytes per rank where the two take the same time):", ""]
    for c in cross:
        shown = "never" if c["bytes"] == float("inf") else bench.format_bytes(int(c["bytes"]))
        lines.append(f"- {c['a']} / {c['b']}: {shown}")
    if shares:
        lines += ["", "Share of the plain ring's time spent adding (ops.combine_, busiest rank, median; a "
                      "separate launch after the timing): the most that overlapping adding with transfer can win.", ""]
        lines += [f"- {bench.format_bytes(n)}: {100 * share:.1f}%" for n, share in shares.items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--sizes", default=",".join(SIZES))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--note", default="", help="recorded in the results, e.g. 'shared machine, exploratory'")
    parser.add_argument("--out", default=str(RESULTS / "fast_allreduce_figures"))
    parser.add_argument("--no-share", action="store_true", help="skip measuring the ring's share of time spent adding")
    args = parser.parse_args(argv)
    if args.reps < 9:
        print(f"note: {args.reps} repetitions: fine for a look, too few for a figure to quote (>= 9)", file=sys.stderr)
    before = bench.machine_description()["loadavg"]
    results = bench.run(args.sizes.split(","), world_sizes=[args.world_size], variants=args.variants.split(","),
                        reps=args.reps, warmup=args.warmup, backend="gloo", one_launch=True, progress=True)
    after = bench.machine_description()["loadavg"]
    print(results.table("builtin"))
    targets = check_targets(results, args.world_size)
    fits = cost.fit_all(results, [v for v in args.variants.split(",") if v != "builtin"],
                        world_size=args.world_size)
    cross = crossovers(fits, args.world_size)
    large = [n for n in (bench.parse_bytes(x) for x in args.sizes.split(",")) if n >= 2**20]
    shares = reduction_share(args.world_size, large) if large and not args.no_share else {}
    for n, share in shares.items():
        print(f"ring at {bench.format_bytes(n)}: {100 * share:.1f}% of the time is spent adding")
    for t in targets:
        print(target_summary(t))
    meta = {"command": "python benchmarks/fast_allreduce_figures.py " + shlex.join(sys.argv[1:] if argv is None else argv),
            "reps": args.reps, "warmup": args.warmup, "loadavg_before": before, "loadavg_after": after,
            "note": args.note or ("fewer than 9 repetitions: exploratory" if args.reps < 9 else "")}
    json_path, md_path = results.save(args.out, "builtin", title="Can we beat the ring? All-reduce variants, measured",
                                      meta=meta)
    # The targets, fits and crossovers go into both files too.
    document = json.loads(pathlib.Path(json_path).read_text())
    document["targets"] = targets
    document["fits"] = {name: {"model": f.model, "alpha_s": f.alpha, "beta_s_per_byte": f.beta,
                               "median_relative_error": f.median_relative_error} for name, f in fits.items()}
    document["crossovers"] = [{**c, "bytes": None if c["bytes"] == float("inf") else c["bytes"]} for c in cross]
    document["ring_reduction_share"] = {str(n): share for n, share in shares.items()}
    pathlib.Path(json_path).write_text(json.dumps(document, indent=1) + "\n")
    with open(md_path, "a", encoding="utf-8") as f:
        f.write(_markdown_extra(targets, fits, args.world_size, cross, shares))
    print("wrote", json_path, md_path, file=sys.stderr)
    return 0 if all(r.correct for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
