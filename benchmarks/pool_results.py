"""Pool the paired ratios of several launches of one benchmark into one figure per variant and size.

    python benchmarks/fast_allreduce_figures.py --reps 11 --out /tmp/run2     # and /tmp/run3: more launches
    python benchmarks/pool_results.py benchmarks/results/fast_allreduce_figures.json /tmp/run2.json /tmp/run3.json

It prints the table (--out also writes it to a file). The pooled table README.md quotes for small sizes
is the last section of benchmarks/results/fast_allreduce_figures.md, and the pooled launches of the
segment sweep the last of benchmarks/results/ring_segment_size.md: the results folder keeps one file
per benchmark, so a pooled table goes into that benchmark's file, and the extra launches stay outside.

One launch of 11 repetitions still carries that launch's conditions (what else ran, how the ranks
landed on the cores): on this 2-core machine the same schedule reads 10-15% apart between launches.
Pooling the per-repetition ratios (variant / reference, same repetition) of several launches gives a
median that no single launch decides, with the spread over all of them and each launch's own median.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from course_lib.bench import format_bytes, spread


def pooled(paths: list[pathlib.Path]) -> list[dict]:
    """One row per (world size, bytes, variant): every launch's paired ratios together."""
    rows: dict[tuple, dict] = {}
    for path in paths:
        data = json.loads(path.read_text())
        for result in data["results"]:
            if not result.get("paired_ratios"):
                continue                                       # the reference itself
            key = (int(result["world_size"]), int(result["nbytes"]), result["variant"])
            row = rows.setdefault(key, {"ratios": [], "launch_medians": []})
            row["ratios"] += list(result["paired_ratios"])
            row["launch_medians"].append(spread(result["paired_ratios"])["median"])
    return [{"world_size": g, "nbytes": n, "variant": v, **spread(row["ratios"]),
             "launch_medians": row["launch_medians"]} for (g, n, v), row in sorted(rows.items())]


def markdown(rows: list[dict], paths: list[pathlib.Path], reference: str) -> str:
    lines = [f"# Pooled paired ratios: time / {reference}'s time, same repetition", "",
             "Launches: " + ", ".join(f"`{p}`" for p in paths), "",
             "| ranks | size | variant | pooled median | IQR | min..max | repetitions | each launch's median |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['world_size']} | {format_bytes(r['nbytes'])} | {r['variant']} | {r['median']:.3f} | "
                     f"{r['q1']:.2f}..{r['q3']:.2f} | {r['min']:.2f}..{r['max']:.2f} | {r['n']} | "
                     + ", ".join(f"{m:.3f}" for m in r["launch_medians"]) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=pathlib.Path, help="JSON files written by the benchmarks")
    parser.add_argument("--out", type=pathlib.Path, help="write the markdown table here too")
    args = parser.parse_args(argv)
    reference = json.loads(args.results[0].read_text())["meta"].get("reference", "the reference")
    text = markdown(pooled(args.results), args.results, reference)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
