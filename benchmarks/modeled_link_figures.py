"""Time per step of the ZeRO stages and of the gradient compressors on a modeled link (course_lib.Network).

    python benchmarks/modeled_link_figures.py [--world-size 4] [--network "1 MB/s, 100 us"] [--reps 9]
                                              [--steps 3] [--note "..."]

On this machine the ranks' messages go through loopback at several GB/s and their time is set by the
CPU (benchmarks/zero_figures.py, compression_figures.py). Under a `course_lib.Network` every
point-to-point message also pays for a link of the given bandwidth B and latency, so the bytes show on
the clock. The default link is slow (1 MB/s) on purpose: the models are small (35 KB and 69 KB of
gradient), and a link is only modeled faithfully where it is slower than this machine's own cost per
message (the model can only add time). 17,283 parameters on 1 MB/s take as long per byte as 17 million
on 1 GB/s.

Variants, one launch, every repetition running each for 2 warm-up steps and --steps measured steps, in
an order shuffled anew each repetition (the same on every rank):

    ZeRO:         plain DP (train_data_parallel, one ring all-reduce), stage 0, ZeRO-1, ZeRO-2, ZeRO-3,
                  ZeRO-3 prefetch, on toy.make_mlp(hidden=64, depth=3) with Adam
    compression:  none (ring), bf16, PowerSGD r=2 (compressing from step 2), top-k 1% with error feedback,
                  on toy.make_mlp(hidden=128, depth=2) with SGD

Per variant: the mean measured step time (slowest rank) per repetition, median and spread; the bytes
the busiest rank sends per step (its traffic recording); the bandwidth floor, those bytes / B, below
which no step can go on a switch (a rank's outgoing side carries them one after another); and the
paired ratio to the group's baseline (plain DP, none). The share of messages that arrived later than
the model allows (this machine was slower than the link) is reported from `network.last_launch()`.
Argument checks off (course_lib.unchecked()), as in course_lib.bench.

Writes benchmarks/results/modeled_link_figures_<G>ranks.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import time

import torch
import torch.nn.functional as F

import course_lib
from course_lib import bench, network, training
from course_lib.training import compression, toy, zero_sharded

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
ZERO = {"plain DP": None, "stage 0": dict(stage=0), "ZeRO-1": dict(stage=1), "ZeRO-2": dict(stage=2),
        "ZeRO-3": dict(stage=3), "ZeRO-3 prefetch": dict(stage=3, prefetch=True)}
COMPRESSION = ("none", "bf16", "PowerSGD r=2", "top-k 1%")
WARMUP = 2          # PowerSGD compresses from step 2 on


def _zero_run(name, data, steps):
    model = toy.make_mlp(hidden=64, depth=3, seed=0)
    spec = ZERO[name]
    optimizer = (torch.optim.Adam(model.parameters(), lr=1e-3) if spec is None else
                 zero_sharded.ShardedDataParallel(model, torch.optim.Adam, lr=1e-3, **spec))
    return training.train_data_parallel(model, optimizer, data, F.cross_entropy, batch_size=8, max_steps=steps)


def _compression_run(name, data, steps):
    model = toy.make_mlp(hidden=128, depth=2, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    hook, state = {"none": (None, None),
                   "bf16": (compression.low_precision_hook, compression.LowPrecisionState()),
                   "PowerSGD r=2": (compression.powersgd_hook,
                                    compression.PowerSGDState(matrix_approximation_rank=2, start_powerSGD_iter=2)),
                   "top-k 1%": (compression.topk_hook, compression.TopKState(density=0.01))}[name]
    return training.train_data_parallel(model, optimizer, data, F.cross_entropy, batch_size=8, epochs=100,
                                        max_steps=steps, comm_hook=hook, comm_hook_state=state)


def measure(rank, world_size, options):
    torch.set_num_threads(1)
    data = toy.make_spirals(600, seed=1)
    runs = {**{name: ("zero", _zero_run) for name in ZERO}, **{name: ("compression", _compression_run)
                                                                for name in COMPRESSION}}
    times = {name: [] for name in runs}
    sent = {}
    shuffle = random.Random(0)
    with course_lib.unchecked():
        for rep in range(options["reps"] + 1):                    # repetition 0 warms up and is dropped
            order = list(runs)
            shuffle.shuffle(order)
            for name in order:
                log = runs[name][1](name, data, WARMUP + options["steps"])
                if rep > 0:
                    times[name].append(statistics.fmean(log.step_times[WARMUP:]))
                else:     # log.bytes_sent: the steps' own messages (not the broadcast before them)
                    sent[name] = {"last_step_bucket": log.timeline[-1].buckets[0].bytes_sent,
                                  "per_step": log.bytes_sent / len(log.timeline)}
    return {"times": times, "sent": sent}


def analyse(per_rank, options, net):
    g, reps = options["world_size"], options["reps"]
    out = {}
    for group, baseline, names in (("zero", "plain DP", list(ZERO)), ("compression", "none", list(COMPRESSION))):
        slowest = {name: [max(r["times"][name][i] for r in per_rank) for i in range(reps)] for name in names}
        rows = {}
        for name in names:
            if group == "zero":     # the whole step's traffic (ZeRO gathers in forward too), per step
                busiest = max(r["sent"][name]["per_step"] for r in per_rank)
            else:                   # the hook's bytes in a compressing step (+ the two-number all-reduce: tiny)
                busiest = max(r["sent"][name]["last_step_bucket"] for r in per_rank)
            floor = busiest / net.bandwidth
            median = statistics.median(slowest[name])
            rows[name] = {"time": {**bench.spread(slowest[name]), "values": slowest[name]},
                          "busiest_bytes_per_step": busiest, "bandwidth_floor": floor,
                          "time_over_floor": median / floor if floor else None,
                          "ratio_to_baseline": bench.spread([a / b for a, b in zip(slowest[name], slowest[baseline])])}
        out[group] = rows
    return out


def markdown(result) -> str:
    o, m = result["options"], result["machine"]
    late = result["late"]
    lines = [
        f"# ZeRO stages and gradient compression on a modeled link, {o['world_size']} ranks",
        "",
        f"`python benchmarks/modeled_link_figures.py --world-size {o['world_size']} --network \"{o['network']}\"` — "
        f"link: {result['network']}; {o['reps']} interleaved repetitions of {WARMUP} warm-up and {o['steps']} "
        f"measured steps; slowest rank. Machine: {m['cpus']} CPUs, torch {m['torch']}, {m['date']}. Load average "
        f"before: {result['load_before']}, after: {result['load_after']}. Messages later than the model allows "
        f"(this machine slower than the link): {late['late']} of {late['messages']} ({100 * late['share']:.1f}%)"
        + (f". Note: {o['note']}" if o.get("note") else "") + ".",
        "",
        "The floor is the busiest rank's bytes per step divided by the bandwidth: on a switch a rank's outgoing "
        "side carries them one after another, so no step is shorter.",
        "",
    ]
    for group, title, baseline in (("zero", "ZeRO stages (toy.make_mlp(hidden=64, depth=3), Adam)", "plain DP"),
                                   ("compression", "Gradient compression (toy.make_mlp(hidden=128, depth=2), SGD)",
                                    "none")):
        lines += [f"## {title}", "",
                  f"| variant | bytes per step, busiest rank | floor ms | step ms, median (min..max) | step / floor "
                  f"| paired ratio to {baseline}, median (min..max) |", "| --- | --- | --- | --- | --- | --- |"]
        for name, row in result[group].items():
            t, r = row["time"], row["ratio_to_baseline"]
            lines.append(f"| {name} | {row['busiest_bytes_per_step']:,.0f} | {1e3 * row['bandwidth_floor']:.1f} | "
                         f"{1e3 * t['median']:.1f} ({1e3 * t['min']:.1f}..{1e3 * t['max']:.1f}) | "
                         f"{row['time_over_floor']:.2f} | {r['median']:.2f} ({r['min']:.2f}..{r['max']:.2f}) |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--network", default="1 MB/s, 100 us")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--note", default="")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    if args.reps < 9:
        parser.error("--reps must be at least 9: a median of fewer runs on a shared machine means little")
    net = course_lib.Network.parse(args.network)
    options = {"world_size": args.world_size, "network": args.network, "reps": args.reps, "steps": args.steps,
               "note": args.note}
    load_before = [round(x, 2) for x in os.getloadavg()]
    started = time.perf_counter()
    per_rank = course_lib.launch(measure, args.world_size, args=(options,), backend="gloo", timeout=3000, network=net)
    stats = network.last_launch()
    result = {"options": options, "network": net.describe(), "machine": bench.machine_description(),
              "load_before": load_before, "load_after": [round(x, 2) for x in os.getloadavg()],
              "seconds": round(time.perf_counter() - started, 1),
              "late": {"messages": stats.messages, "late": stats.late, "share": stats.late_share},
              **analyse(per_rank, options, net)}
    print(markdown(result))
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        stem = RESULTS / f"modeled_link_figures_{args.world_size}ranks"
        stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        stem.with_suffix(".md").write_text(markdown(result))
        print(f"wrote {stem}.json and .md")
    return result


if __name__ == "__main__":
    main()
