"""Memory, bytes and time per step of plain data parallelism and ZeRO-1, -2, -3, measured.

    python benchmarks/zero_figures.py [--world-size 4] [--reps 11] [--steps 4] [--hidden 64] [--depth 8]
                                      [--batch 16] [--note "..."]

One launch of --world-size ranks. The model is toy.make_mlp(hidden, depth) on the spiral data (the
course's model, made deeper so that a layer is a small part of it), Adam, float32. Variants:

    plain DP            train_data_parallel with torch.optim.Adam, one ring all-reduce after backward
    ZeRO-1 (flat)       zero.ShardedOptimizer, notebook 11's ZeRO-1 on one flat vector
    stage 0 .. ZeRO-3   zero_sharded.ShardedDataParallel(stage=0..3), layer by layer
    ZeRO-3 prefetch     stage 3 with the next layer's all-gather started early

Memory (the census, `training.memory.MemoryCensus`, deterministic: one measured step after a warm-up
step, every rank): bytes of parameters, gradients and optimizer state held when the optimizer steps
and at the peak of the step, against the Playbook's formula (`memory.model_state_bytes`, fp32 Adam:
4 + 4 + 8 bytes a parameter, each divided by G where the stage shards it) and against the schedule's
own count (`memory.schedule_bytes`). Bytes sent per step: from every rank's traffic recording, against
`zero_sharded.expected_bytes_sent`. Time: --reps repetitions, each training every variant for
--steps + 1 steps from the same start in an order shuffled anew each repetition (the same on every
rank); per repetition and variant the mean step time of the last --steps steps, slowest rank; median
and spread over the repetitions and the paired ratio to plain DP. Cross-rank argument checks off
(course_lib.unchecked()), as in course_lib.bench.

Writes benchmarks/results/zero_figures_<G>ranks.json and .md. Not a test: the times depend on the
machine and on what else runs on it (the load average is recorded before and after).
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
from course_lib import bench, training
from course_lib.training import memory, toy, zero, zero_sharded

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
VARIANTS = {"plain DP": None, "ZeRO-1 (flat)": "flat", "stage 0": dict(stage=0), "ZeRO-1": dict(stage=1),
            "ZeRO-2": dict(stage=2), "ZeRO-3": dict(stage=3), "ZeRO-3 prefetch": dict(stage=3, prefetch=True)}
STAGE_OF = {"stage 0": (0, False), "ZeRO-1": (1, False), "ZeRO-2": (2, False), "ZeRO-3": (3, False),
            "ZeRO-3 prefetch": (3, True)}


def _build(name, options, census=None):
    model = toy.make_mlp(hidden=options["hidden"], depth=options["depth"], seed=0)
    spec = VARIANTS[name]
    if spec is None:
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)
    if spec == "flat":
        return model, zero.ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    return model, zero_sharded.ShardedDataParallel(model, torch.optim.Adam, census=census, lr=1e-3, **spec)


def measure(rank, world_size, options):
    torch.set_num_threads(1)
    data = toy.make_spirals(world_size * options["batch"] * (options["steps"] + 1), seed=1)
    out = {"memory": {}, "bytes": {}, "times": {name: [] for name in VARIANTS}}
    # Memory and bytes: deterministic, one pass.
    for name in STAGE_OF:
        census = memory.MemoryCensus()
        model, sharded = _build(name, options, census)
        training.train_data_parallel(model, sharded, data, F.cross_entropy, batch_size=options["batch"], max_steps=1)
        census.reset()
        log = training.train_data_parallel(model, sharded, data, F.cross_entropy, batch_size=options["batch"],
                                           max_steps=1)
        at = census.at("after optimizer step")
        out["memory"][name] = {"at_step": {"params": at.params, "grads": at.grads, "optimizer": at.optimizer},
                               "peak": {k: census.peak[k] for k in memory.KINDS}, "peak_total": census.peak["total"],
                               "units": [u.numel for u in sharded.units]}
        out["bytes"][name] = log.bytes_sent
    shuffle = random.Random(0)
    with course_lib.unchecked():
        for rep in range(options["reps"] + 1):                         # repetition 0 warms up and is dropped
            order = list(VARIANTS)
            shuffle.shuffle(order)
            for name in order:
                model, optimizer = _build(name, options)
                log = training.train_data_parallel(model, optimizer, data, F.cross_entropy,
                                                   batch_size=options["batch"], max_steps=options["steps"] + 1)
                if rep > 0:
                    out["times"][name].append(statistics.fmean(log.step_times[1:]))
                if rep == 0:
                    out["bytes"].setdefault(name, log.bytes_sent // (options["steps"] + 1))
    return out


def analyse(per_rank, options):
    g = options["world_size"]
    units = per_rank[0]["memory"]["stage 0"]["units"]
    psi = sum(units)
    memory_rows = {}
    for name, (stage, prefetch) in STAGE_OF.items():
        formula = memory.model_state_bytes(psi, g, stage)
        rows = []
        for rank, out in enumerate(per_rank):
            measured = out["memory"][name]
            schedule = memory.schedule_bytes(units, g, stage, rank=rank, prefetch=prefetch)
            rows.append({"rank": rank, **measured, "schedule": schedule,
                         "ratio_to_formula": {k: measured["at_step"][k] / formula[k] for k in memory.KINDS},
                         "peak_equals_schedule": all(measured["peak"][k] == schedule["peak"][k] for k in memory.KINDS),
                         "at_step_equals_schedule": all(measured["at_step"][k] == schedule["at_step"][k]
                                                        for k in memory.KINDS)})
        memory_rows[name] = {"formula": formula, "ranks": rows}
    bytes_rows = {}
    for name, (stage, _) in STAGE_OF.items():
        sent = [out["bytes"][name] for out in per_rank]
        expected = [zero_sharded.expected_bytes_sent(units, g, stage, rank=r) for r in range(g)]
        bytes_rows[name] = {"sent": sent, "expected": expected, "equal": sent == expected}
    for name in ("plain DP", "ZeRO-1 (flat)"):
        bytes_rows[name] = {"sent": [out["bytes"][name] for out in per_rank]}
    reps = options["reps"]
    slowest = {name: [max(out["times"][name][i] for out in per_rank) for i in range(reps)] for name in VARIANTS}
    times = {name: {**bench.spread(values), "values": values} for name, values in slowest.items()}
    ratios = {name: {**bench.spread([a / b for a, b in zip(slowest[name], slowest["plain DP"])])}
              for name in VARIANTS if name != "plain DP"}
    return {"parameters": psi, "layers": units, "memory": memory_rows, "bytes": bytes_rows, "times": times,
            "ratios_to_plain": ratios}


def markdown(result) -> str:
    o, m = result["options"], result["machine"]
    kib = lambda b: f"{b / 1024:.1f}"  # noqa: E731
    lines = [
        f"# ZeRO stages on {o['world_size']} ranks: memory, bytes and time per step, measured",
        "",
        f"`python benchmarks/zero_figures.py --world-size {o['world_size']}` — toy.make_mlp(hidden={o['hidden']}, "
        f"depth={o['depth']}): {result['parameters']:,} parameters in layers of {result['layers']}; Adam, float32; "
        f"batch {o['batch']} per rank. Machine: {m['cpus']} CPUs, torch {m['torch']}, Python {m['python']}, "
        f"{m['date']}. Load average (1, 5, 15 min) before: {result['load_before']}, after: {result['load_after']}"
        + (f". Note: {o['note']}" if o.get("note") else "") + ".",
        "",
        "## Memory per rank (KiB), rank 0, measured by the census",
        "",
        "When the optimizer steps (what the Playbook's formula counts) and at the peak of the step; the formula is "
        "4 + 4 + 8 bytes a parameter, each divided by G where the stage shards it. Every rank's census equals "
        "`memory.schedule_bytes` exactly: " + ("yes" if all(r["peak_equals_schedule"] and r["at_step_equals_schedule"]
                                                           for v in result["memory"].values() for r in v["ranks"])
                                               else "NO") + ".",
        "",
        "| stage | params at step | grads at step | optimizer at step | formula (params / grads / optimizer) "
        "| measured / formula | peak params | peak grads | peak total |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, row in result["memory"].items():
        r0, f = row["ranks"][0], row["formula"]
        ratio = " / ".join(f"{r0['ratio_to_formula'][k]:.3f}" for k in memory.KINDS)
        worst = max(abs(r["ratio_to_formula"][k] - 1) for r in row["ranks"] for k in memory.KINDS)
        lines.append(f"| {name} | {kib(r0['at_step']['params'])} | {kib(r0['at_step']['grads'])} | "
                     f"{kib(r0['at_step']['optimizer'])} | {kib(f['params'])} / {kib(f['grads'])} / "
                     f"{kib(f['optimizer'])} | {ratio} (every rank within {100 * worst:.1f}%) | "
                     f"{kib(r0['peak']['params'])} | {kib(r0['peak']['grads'])} | {kib(r0['peak_total'])} |")
    lines += ["", "## Bytes sent per step, rank 0 (every rank: recording == formula?)", "",
              "| variant | bytes per step | equals `expected_bytes_sent` on every rank |", "| --- | --- | --- |"]
    for name, row in result["bytes"].items():
        equal = {True: "yes", False: "NO"}.get(row.get("equal"), "-")
        lines.append(f"| {name} | {row['sent'][0]:,} | {equal} |")
    lines += ["", f"## Time per step (ms), slowest rank, {o['reps']} interleaved repetitions of {o['steps']} steps",
              "", "| variant | median (min..max) | paired ratio to plain DP, median (min..max) |", "| --- | --- | --- |"]
    for name, t in result["times"].items():
        r = result["ratios_to_plain"].get(name)
        ratio = f"{r['median']:.2f} ({r['min']:.2f}..{r['max']:.2f})" if r else "1"
        lines.append(f"| {name} | {1e3 * t['median']:.1f} ({1e3 * t['min']:.1f}..{1e3 * t['max']:.1f}) | {ratio} |")
    lines.append("")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--note", default="", help="free text stored with the results (e.g. what else ran)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    if args.reps < 9:
        parser.error("--reps must be at least 9: a median of fewer runs on a shared machine means little")
    options = {"world_size": args.world_size, "reps": args.reps, "steps": args.steps, "hidden": args.hidden,
               "depth": args.depth, "batch": args.batch, "note": args.note}
    load_before = [round(x, 2) for x in os.getloadavg()]
    started = time.perf_counter()
    per_rank = course_lib.launch(measure, args.world_size, args=(options,), backend="gloo", timeout=3000)
    result = {"options": options, "machine": bench.machine_description(), "load_before": load_before,
              "load_after": [round(x, 2) for x in os.getloadavg()], "seconds": round(time.perf_counter() - started, 1),
              **analyse(per_rank, options)}
    print(markdown(result))
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        stem = RESULTS / f"zero_figures_{args.world_size}ranks"
        stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        stem.with_suffix(".md").write_text(markdown(result))
        print(f"wrote {stem}.json and .md")
    return result


if __name__ == "__main__":
    main()
