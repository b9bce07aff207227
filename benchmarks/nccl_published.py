"""The modeled NCCL against published nccl-tests figures: predicted / published for every row of the table.

    python benchmarks/nccl_published.py    # prints the rows and the summary; writes them to
                                           # benchmarks/results/nccl_published.{json,md}

The table is `benchmarks/data/nccl_tests_published.csv`: one row per published nccl-tests output line (or a
figure a source states), with its configuration, its source (an issue, a README, a page), and the model's
configuration for it (`intra`, `inter`, `nics`: presets of `course_lib.network.PRESETS`; "2x roce200" is two such
cards per GPU, as OCI's 16 x 200G per node of 8). Rows are "in" the model's scope (NVLink nodes; InfiniBand or RoCE
with GPUDirect RDMA between them) or "out" with the reason (EFA, TCPXO, SHARP, no message size, ...); the targets
are held on the rows in scope. Rows are in two sets by source, fixed before the model was compared with any of
them ("dev" and "held-out", from a hash of the source's name): nothing is fitted, and both sets are reported.

What is compared: for messages of 64 MiB and more, bus bandwidth (nccl-tests' busbw: S/t times 2(G-1)/G for an
all-reduce, (G-1)/G for an all-gather); for 1 MiB and less, the time (nccl-tests' time column; where a source
gives only busbw, the time it implies). The model is `course_lib.nccl.collective`: NCCL's tuner picks the
algorithm and protocol (NCCL_ALGO as the source set it), and the simulation times its messages on the links.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from course_lib import nccl  # noqa: E402
from course_lib.network import Network  # noqa: E402

TABLE = ROOT / "benchmarks" / "data" / "nccl_tests_published.csv"
RESULTS = ROOT / "benchmarks" / "results"
LARGE, SMALL = 64 << 20, 1 << 20
TARGETS = {"large median": (0.9, 1.1), "large band": (0.8, 1.25, 0.85), "small band": (0.6, 1.67, 0.80)}


def link(name: str) -> Network:
    """A preset, or 'Nx preset': N such cards per GPU, as one card of N times the bandwidth."""
    count, _, preset = name.partition("x ")
    if not preset:
        return Network.preset(name)
    base = Network.preset(preset)
    return Network(base.bandwidth * int(count), base.latency, base.topology, f"{count}x {preset}", kind=base.kind,
                   wire=base.wire * int(count))


def network_of(row: dict):
    nodes, per_node = int(row["nodes"]), int(row["gpus_per_node"])
    if nodes == 1:
        return Network.cluster(1, per_node, link(row["intra"]), "ib_ndr")
    nics = row["nics"] if row["nics"] in ("per_gpu", "per_node") else int(row["nics"])
    return Network.cluster(nodes, per_node, link(row["intra"]), link(row["inter"]), nics=nics)


def published_time(row: dict, world_size: int) -> float | None:
    """Seconds: the time column, or the time a busbw-only row implies."""
    if row["time_us"]:
        return float(row["time_us"]) * 1e-6
    busbw = float(row["busbw_GBps"] or 0)
    if not busbw:
        return None
    factor = nccl.BUSBW_FACTORS[row["collective"]](world_size)
    return int(row["bytes"]) * factor / (busbw * 1e9)


def evaluate(row: dict) -> dict | None:
    """The model's figures for one row (None for rows without a size or a configuration). An out-of-scope row with
    a configuration is run on its proxy (the nearest links the model has), to say how far off it is."""
    if not row["bytes"] or not row["nodes"] or not row["intra"] or (int(row["nodes"]) > 1 and not row["inter"]):
        return None
    if int(row["nodes"]) * int(row["gpus_per_node"]) > 256:
        return None
    net = network_of(row)
    g = net.world_size
    nbytes = int(row["bytes"])
    previous = os.environ.pop("NCCL_ALGO", None)
    if row["nccl_algo"]:
        os.environ["NCCL_ALGO"] = row["nccl_algo"]
    try:
        started = time.perf_counter()
        choice = nccl.collective(net, row["collective"], nbytes, range(g))
        took = time.perf_counter() - started
    finally:
        os.environ.pop("NCCL_ALGO", None)
        if previous is not None:
            os.environ["NCCL_ALGO"] = previous
    out = {"source": row["source"], "set": row["set"], "scope": row["scope"], "gpus": g, "nodes": int(row["nodes"]),
           "collective": row["collective"], "bytes": nbytes, "algorithm": choice.algorithm,
           "protocol": choice.protocol, "channels": choice.channels, "seconds": choice.seconds,
           "busbw": nccl.bus_bandwidth(row["collective"], nbytes, g, choice.seconds) / 1e9, "wall_s": took}
    if nbytes >= LARGE and row["busbw_GBps"]:
        out["published_busbw"] = float(row["busbw_GBps"])
        out["ratio"] = out["busbw"] / out["published_busbw"]
        out["compared"] = "busbw"
    elif nbytes <= SMALL:
        seconds = published_time(row, g)
        if seconds:
            out["published_seconds"] = seconds
            out["ratio"] = choice.seconds / seconds
            out["compared"] = "time" if row["time_us"] else "time (from busbw)"
    return out


def summary(results: list) -> dict:
    def stats(rows, band=None):
        ratios = [r["ratio"] for r in rows]
        if not ratios:
            return {"rows": 0}
        low, high = band or (0, float("inf"))
        return {"rows": len(ratios), "sources": len({r["source"] for r in rows}), "median": statistics.median(ratios),
                "min": min(ratios), "max": max(ratios),
                "within": sum(low <= x <= high for x in ratios) / len(ratios)}

    out = {}
    for subset in ("dev", "held-out", "all"):
        rows = [r for r in results if "ratio" in r and r["scope"] == "in" and subset in ("all", r["set"])]
        large = [r for r in rows if r["compared"] == "busbw"]
        small = [r for r in rows if r["compared"].startswith("time")]
        out[subset] = {"large": stats(large, TARGETS["large band"][:2]), "small": stats(small, TARGETS["small band"][:2])}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-write", action="store_true",
                        help="print only; do not write benchmarks/results/nccl_published.{json,md}")
    args = parser.parse_args(argv)
    rows = list(csv.DictReader(open(TABLE)))
    results, skipped = [], []
    started = time.perf_counter()
    print(f"{'source':<22} {'set':<8} {'GPUs':>5} {'collective':<10} {'bytes':>12} {'NCCL (model)':<17} "
          f"{'published':>12} {'model':>12} {'ratio':>6}")
    for row in sorted(rows, key=lambda r: r["scope"] != "in"):
        result = evaluate(row)
        if result is None or "ratio" not in result:
            skipped.append(row)
            continue
        results.append(result)
        if result["compared"] == "busbw":
            published, modeled = f"{result['published_busbw']:.1f} GB/s", f"{result['busbw']:.1f} GB/s"
        else:
            published, modeled = f"{result['published_seconds'] * 1e6:.1f} us", f"{result['seconds'] * 1e6:.1f} us"
        result["published_text"], result["model_text"] = published, modeled
        print(f"{result['source']:<22} {result['set'] if row['scope'] == 'in' else 'out':<8} {result['gpus']:>5} "
              f"{result['collective']:<10} {result['bytes']:>12} {result['algorithm'] + '/' + result['protocol']:<17} "
              f"{published:>12} {modeled:>12} {result['ratio']:>6.2f}", flush=True)
    report = summary(results)
    lines = []
    for subset, parts in report.items():
        large, small = parts["large"], parts["small"]
        lines.append(f"{subset:>8}: >= 64 MiB busbw model/published: median {large.get('median', float('nan')):.3f} "
                     f"({large['rows']} rows, {large.get('sources', 0)} sources, {100 * large.get('within', 0):.0f}% "
                     f"within [0.8, 1.25], range {large.get('min', 0):.2f}..{large.get('max', 0):.2f}); <= 1 MiB time: "
                     f"median {small.get('median', float('nan')):.3f} ({small['rows']} rows, {small.get('sources', 0)} "
                     f"sources, {100 * small.get('within', 0):.0f}% within [0.6, 1.67], range "
                     f"{small.get('min', 0):.2f}..{small.get('max', 0):.2f})")
    print("\n".join(lines))
    print(f"{len(skipped)} rows out of scope or without a comparable figure; {time.perf_counter() - started:.0f} s")
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        with open(RESULTS / "nccl_published.json", "w") as f:
            json.dump({"rows": results, "summary": report,
                       "not_compared": [{"source": r["source"], "bytes": r["bytes"], "scope": r["scope"]}
                                        for r in skipped]}, f, indent=1)
        (RESULTS / "nccl_published.md").write_text(markdown(results, report, lines, skipped))
    return 0


def markdown(results, report, lines, skipped) -> str:
    """The results file: the summary, every row compared, and the rows out of scope with their reasons."""
    out = ["# The modeled NCCL against published nccl-tests figures", "",
           "`python benchmarks/nccl_published.py` on `benchmarks/data/nccl_tests_published.csv` (its sources: "
           "`benchmarks/data/nccl_tests_published_sources.md`). Ratio = model / published: bus bandwidth for 64 MiB "
           "and more, time for 1 MiB and less. The model is deterministic: one evaluation per row.", "",
           "## Summary (rows in scope)", "", "```", *lines, "```", "",
           "## Rows in scope", "",
           "| source | set | GPUs | collective | bytes | NCCL (model's choice) | published | model | ratio |",
           "| --- | --- | ---: | --- | ---: | --- | ---: | ---: | ---: |"]
    for r in results:
        if r["scope"] == "in":
            out.append(f"| {r['source']} | {r['set']} | {r['gpus']} | {r['collective']} | {r['bytes']} | "
                       f"{r['algorithm']}/{r['protocol']} | {r['published_text']} | {r['model_text']} | {r['ratio']:.2f} |")
    out += ["", "## Rows out of the model's scope, on the nearest links it has (a proxy)", "",
            "| source | GPUs | bytes | why out of scope | published | model (proxy) | ratio |",
            "| --- | ---: | ---: | --- | ---: | ---: | ---: |"]
    for r in results:
        if r["scope"] != "in":
            out.append(f"| {r['source']} | {r['gpus']} | {r['bytes']} | {r['scope'][5:]} | {r['published_text']} | "
                       f"{r['model_text']} | {r['ratio']:.2f} |")
    out += ["", "## Rows not compared", "", "| source | bytes | why |", "| --- | ---: | --- |"]
    for r in skipped:
        out.append(f"| {r['source']} | {r['bytes'] or '-'} | {r['scope'][5:] if r['scope'] != 'in' else 'no comparable figure'} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
