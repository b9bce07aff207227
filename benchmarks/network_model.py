"""The modeled network (course_lib.network) on its own clock, measured against its own predictions.

    python benchmarks/network_model.py                  # every part, 5 repetitions
    python benchmarks/network_model.py --parts latency --reps 3 --out /tmp/quick   # a quick look, not a figure

Every part times course_lib's all-reduces with `course_lib.bench` (variants interleaved in one launch,
order shuffled anew each repetition, a repetition's time the slowest rank's) under a modeled link, read on
the ranks' modeled clocks (`course_lib.clock()`). The ratio reported is time / the link's prediction
(`Network.predict`), per repetition; on the modeled clock it is 1 in every repetition, under any load
(issue 16's targets, 0.85 to 1.5 on the clock that slept, became 1e-6). Argument checks are off (the
algorithm alone, as bench times it), except in the part that measures what they add.

    part        link     ranks   size     variants                      target
    bandwidth   10GbE    4       8 MiB    ring, naive, parameter_server  every repetition within 1e-6 of the model
    latency     ib_ndr   4       4 KiB    ring, tree                     every repetition within 1e-6
    scaling     10GbE    2 and 8 8 MiB    ring, parameter_server         G 2 -> 8: ring < 2.2x, PS > 5x, each equal
                                                                         to the model's growth within 1e-6
    busbw       ib_ndr   4       64 MiB   ring, ring_pipelined,          the fastest's busbw >= 0.9 x the link's
                                          halving_doubling               bandwidth
    checks      ib_ndr   4       4 KiB    ring, argument checks on       reported: what course_lib's cross-rank check
                                                                         (a built-in all_gather, timed) adds
    overhead    ib_ndr   4       4 KiB,   ring                           reported: this machine's wall time per
                                 1 MiB                                   call, modeled launch / plain launch

Writes benchmarks/results/network_model.{json,md} (or --out STEM): the targets, measured, then every part's
own tables (bench's); the JSON holds the targets and every part's records, raw times included. A run of only
some parts writes STEM_<parts>.{json,md} instead (a look, not the figures). Overlap with backward on a modeled
link is measured by
`benchmarks/overlap_figures.py --network ...`; the modeled clock under two busy processes, 64 ranks and
torch's own all_reduce by `benchmarks/modeled_clock.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

import torch
import torch.distributed as dist

import course_lib
from course_lib import allreduce, bench
from course_lib.network import Network

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
BANDWIDTH = Network.preset("10GbE")
LATENCY = Network.preset("ib_ndr")
BUSBW = Network.preset("ib_ndr")
PARTS = ("bandwidth", "latency", "scaling", "busbw", "checks", "overhead")
EXACT = 1e-6          # on the modeled clock a time is the model's to rounding


def _ratio_row(result: bench.Result) -> dict:
    ratios = [t / result.predicted for t in result.times]
    spread = bench.spread(ratios)
    return dict(target=f"{result.variant}, G={result.world_size}, {bench.format_bytes(result.nbytes)}: time / model "
                       f"within {EXACT:g} of 1, every repetition", measured=spread,
                met=max(abs(x - 1) for x in ratios) <= EXACT)


def model_part(name, network, world_sizes, size, variants, reps, parts, arg_checks=False):
    """Run one part; its records (JSON) and bench's tables (markdown) go into `parts[name]`."""
    results = bench.run(sizes=[size], world_sizes=world_sizes, variants=variants, reps=reps, network=network,
                        arg_checks=arg_checks, progress=True)
    note = "argument checks on, as in a learner's call" if arg_checks else "argument checks off: the algorithm alone"
    meta = {"reference": None, "command": " ".join(sys.argv), "note": note}
    title = f"All-reduce on a modeled link ({network.describe()}): modeled clock"
    parts[name] = (json.loads(results.to_json(meta=meta)), results.to_markdown(None, title=title, meta=meta))
    return results, [_ratio_row(r) for r in results]


def part_section(name: str, text: str) -> str:
    """A part's markdown, one heading level down, under a heading that names the part."""
    lines = text.rstrip("\n").split("\n")
    out = []
    for line in lines:
        if line.startswith("# "):
            out.append(f"## Part {name}: {line[2:]}")
        elif line.startswith("#"):
            out.append("#" + line)
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def scaling_rows(results: bench.Results) -> list[dict]:
    rows = []
    for variant, test, limit in (("ring", lambda x: x < 2.2, "< 2.2"), ("parameter_server", lambda x: x > 5, "> 5")):
        small, large = results.get(variant, 2, "8MiB"), results.get(variant, 8, "8MiB")
        # G=2 and G=8 ran in different launches: no pairing; the ratio of medians, and of the quartiles' extremes
        growth = large.median / small.median
        model = large.predicted / small.predicted
        spread = dict(median=growth, q1=large.quartiles[0] / small.quartiles[1], q3=large.quartiles[1] / small.quartiles[0],
                      min=large.min / small.max, max=large.max / small.min, n=min(len(small.times), len(large.times)))
        rows.append(dict(target=f"{variant}: time at G=8 / time at G=2, 8 MiB, {limit} (model {model:.3f})",
                         measured=spread, met=test(growth) and abs(growth / model - 1) <= EXACT))
    return rows


def busbw_rows(results: bench.Results, network: Network) -> list[dict]:
    fastest = min(results, key=lambda r: r.median)
    shares = [bench.busbw(bench.algbw(fastest.nbytes, t), fastest.world_size) * 1e9 / network.bandwidth
              for t in fastest.times]
    spread = bench.spread(shares)
    return [dict(target=f"fastest at 64 MiB ({fastest.variant}): busbw / link bandwidth >= 0.9", measured=spread,
                 met=spread["median"] >= 0.9)]


def checks_rows(results: bench.Results) -> list[dict]:
    rows = []
    for r in results:
        spread = bench.spread([t / r.predicted for t in r.times])
        rows.append(dict(target=f"{r.variant}, G={r.world_size}, {bench.format_bytes(r.nbytes)}, argument checks on: "
                                f"time / model (reported: {round(1e6 * (r.median - r.predicted), 6) + 0.0:.2f} us added)",
                         measured=spread, met=None))
    return rows


def _ring_times(rank, world_size, sizes, reps):
    times = {}
    for nbytes in sizes:
        tensor = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(rank))
        samples = []
        for rep in range(reps + 1):  # the first call warms up
            dist.barrier()
            start = time.perf_counter()
            allreduce.ring(tensor)
            if rep:
                samples.append(time.perf_counter() - start)
        times[nbytes] = samples
    return times


def overhead_part(launches: int, reps: int, parts: dict) -> list[dict]:
    """Plain launches and launches on ib_ndr, alternating; one median per launch of this machine's wall time per call
    (time.perf_counter inside the ranks: what the modeled clock's bookkeeping costs this machine, not modeled time)."""
    sizes = [4096, 1 << 20]
    medians = {(kind, n): [] for kind in ("plain", "modeled") for n in sizes}
    for i in range(launches):
        for kind in (("plain", "modeled") if i % 2 == 0 else ("modeled", "plain")):
            network = None if kind == "plain" else LATENCY
            per_rank = course_lib.launch(_ring_times, 4, args=(sizes, reps), network=network, timeout=300)
            for n in sizes:
                slowest = [max(r[n][k] for r in per_rank) for k in range(reps)]
                medians[(kind, n)].append(statistics.median(slowest))
        print(f"[overhead {i + 1}/{launches}]", file=sys.stderr, flush=True)
    rows = []
    for n in sizes:
        ratios = [u / p for u, p in zip(medians[("modeled", n)], medians[("plain", n)])]
        spread = bench.spread(ratios)
        rows.append(dict(target=f"ring, G=4, {bench.format_bytes(n)}: this machine's wall time per call, ib_ndr launch / "
                                f"plain launch (reported)", measured=spread, met=None))
    parts["overhead"] = ({"meta": bench.machine_description(), "launches": launches, "reps_per_launch": reps,
                          "medians_s": {f"{k} {n}": v for (k, n), v in medians.items()}}, None)
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    lines = ["# The modeled network on its own clock, against its own predictions (issues 16 and 25)", "",
             f"Machine: {meta['cpus']} CPU(s) ({meta['cpu_model']}), torch {meta['torch']}, Python {meta['python']}, "
             f"{meta['date']}. Load average before: {meta['load_before']}, after: {meta['load_after']}.", "",
             f"Command: `{meta['command']}`. Times: the modeled clock (`course_lib.clock()`), the slowest rank per "
             "repetition, argument checks off unless the row says on; ratios are per repetition (time / the model's "
             "prediction), their median and spread. The overhead rows are this machine's wall clock, whose load is "
             "given above.", "",
             "| target | median (IQR; min..max) | n | met |", "| --- | --- | --- | --- |"]
    for row in rows:
        m = row["measured"]
        lines.append(f"| {row['target']} | {m['median']:.3f} ({m['q1']:.3f}..{m['q3']:.3f}; {m['min']:.3f}..{m['max']:.3f})"
                     f" | {m['n']} | {'-' if row['met'] is None else 'yes' if row['met'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, from {','.join(PARTS)}")
    parser.add_argument("--out", default=str(RESULTS / "network_model"), help="stem of the files written")
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from {PARTS}")
    meta = {**bench.machine_description(), "command": "python benchmarks/network_model.py " + " ".join(argv or sys.argv[1:]),
            "load_before": [round(x, 2) for x in os.getloadavg()]}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    rows, tables = [], {}
    if "bandwidth" in parts:
        rows += model_part("bandwidth", BANDWIDTH, [4], "8MiB", ["ring", "naive", "parameter_server"], args.reps,
                           tables)[1]
    if "latency" in parts:
        rows += model_part("latency", LATENCY, [4], "4KiB", ["ring", "tree"], args.reps, tables)[1]
    if "scaling" in parts:
        results, ratio_rows = model_part("scaling", BANDWIDTH, [2, 8], "8MiB", ["ring", "parameter_server"],
                                         args.reps, tables)
        rows += ratio_rows + scaling_rows(results)
    if "busbw" in parts:
        results, ratio_rows = model_part("busbw", BUSBW, [4], "64MiB", ["ring", "ring_pipelined", "halving_doubling"],
                                         args.reps, tables)
        rows += ratio_rows + busbw_rows(results, BUSBW)
    if "checks" in parts:
        results, _ = model_part("checks", LATENCY, [4], "4KiB", ["ring"], args.reps, tables, arg_checks=True)
        rows += checks_rows(results)
    if "overhead" in parts:
        rows += overhead_part(max(args.reps, 9), 15, tables)
    meta["load_after"] = [round(x, 2) for x in os.getloadavg()]
    text = markdown(rows, meta)
    print(text)
    text += "".join("\n" + part_section(name, table) for name, (_doc, table) in tables.items() if table)
    suffix = "" if set(parts) == set(PARTS) else "_" + "_".join(parts)
    with open(f"{args.out}{suffix}.json", "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "targets": rows, "parts": {name: doc for name, (doc, _table) in tables.items()}},
                  f, indent=1)
    with open(f"{args.out}{suffix}.md", "w", encoding="utf-8") as f:
        f.write(text)
    return 0 if all(row["met"] is not False for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
