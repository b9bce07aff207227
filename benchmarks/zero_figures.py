"""Memory, bytes and time per step of plain data parallelism and ZeRO-1, -2, -3, measured.

    python benchmarks/zero_figures.py [--world-size 4] [--network 1GbE] [--reps 2] [--steps 3] [--hidden 64]
                                      [--depth 8] [--batch 16] [--note "..."] [--tag 512wide]

Two launches of --world-size ranks: memory and bytes on this machine, time on the modeled clock. The model is toy.make_mlp(hidden, depth) on the spiral data (the
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
`zero_sharded.expected_bytes_sent`. Time, on the modeled clock of --network (a preset such as 1GbE, 10GbE, ib_ndr, or 'BANDWIDTH, LATENCY';
`course_lib.Network`): compute costs nothing on it, so a step's time is its messages' time. Each
repetition trains every variant for --steps steps in an order shuffled anew (the same on every rank);
a variant's step time is how much later the last rank finished the last step than the step before it
(each rank's clock at the end, minus its step times). Beside it, the model: the sum of the step's
collectives by the link's equations, a the latency and B the bandwidth, n a layer's elements:

    ring all-reduce of n elements         2(G-1) (a + 4 ceil(n/G) / B)     (Network.predict('ring'))
    reduce-scatter or all-gather of n     (G-1) (a + 4 ceil(n/G) / B)      (pieces of ceil(n/G))

    plain DP         one ring all-reduce of the gradient and the loss sum and count (N + 2 elements)
    ZeRO-1 (flat)    a reduce-scatter of pieces of ceil(N/G) + 2, an all-gather of pieces of ceil(N/G)
    stage 0          the loss sum and count (a ring of 2), then one ring all-reduce per layer
    ZeRO-1, ZeRO-2   the ring of 2, then a reduce-scatter and an all-gather per layer
    ZeRO-3           the ring of 2, then two all-gathers and a reduce-scatter per layer

The modeled clock reads the same in every repetition (the spread is 0; the repetitions show it).
ZeRO-3 prefetch is measured for memory and bytes only: it sends ZeRO-3's messages in another order,
and what it buys, an all-gather hidden behind compute, has nothing to hide behind on a clock where
compute is free. --network none times on this machine's clock instead (the old behaviour: at least 9
repetitions of --steps + 1 steps, the first dropped, argument checks off; noisy, load-dependent).

Writes benchmarks/results/zero_figures.{json,md} (or --out STEM): one run per key, `<G>ranks` or `<G>ranks_<tag>`
with --tag, each under "runs" in the JSON and a section of the .md; a run replaces the one with its key and keeps the
others (the load average is recorded before and after: it moves the memory and bytes run's wall time, never the
modeled times).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import pathlib
import random
import statistics
import time

import torch
import torch.nn.functional as F

import keyed_results  # benchmarks/keyed_results.py: the one results file, a run per key

import course_lib
from course_lib import bench, training
from course_lib.network import Network
from course_lib.training import memory, toy, zero, zero_sharded

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
VARIANTS = {"plain DP": None, "ZeRO-1 (flat)": "flat", "stage 0": dict(stage=0), "ZeRO-1": dict(stage=1),
            "ZeRO-2": dict(stage=2), "ZeRO-3": dict(stage=3), "ZeRO-3 prefetch": dict(stage=3, prefetch=True)}
STAGE_OF = {"stage 0": (0, False), "ZeRO-1": (1, False), "ZeRO-2": (2, False), "ZeRO-3": (3, False),
            "ZeRO-3 prefetch": (3, True)}
MODELED = [name for name in VARIANTS if name != "ZeRO-3 prefetch"]      # timed on the modeled clock


def _build(name, options, census=None):
    model = toy.make_mlp(hidden=options["hidden"], depth=options["depth"], seed=0)
    spec = VARIANTS[name]
    if spec is None:
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)
    if spec == "flat":
        return model, zero.ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    return model, zero_sharded.ShardedDataParallel(model, torch.optim.Adam, census=census, lr=1e-3, **spec)


def measure(rank, world_size, options):
    """Memory (the census) and bytes per step: deterministic, one pass, this machine's clock (untimed)."""
    torch.set_num_threads(1)
    data = toy.make_spirals(world_size * options["batch"] * (options["steps"] + 1), seed=1)
    out = {"memory": {}, "bytes": {}}
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
    for name in ("plain DP", "ZeRO-1 (flat)"):
        model, optimizer = _build(name, options)
        log = training.train_data_parallel(model, optimizer, data, F.cross_entropy, batch_size=options["batch"],
                                           max_steps=1)
        out["bytes"][name] = log.bytes_sent
    return out


def step_seconds(runs) -> float:
    """How much later the last rank finished the last step than the step before, from every rank's
    (clock at the end, step times): steps follow one another with nothing in between."""
    ends = [[end - sum(times[k + 1:]) for k in range(len(times))] for end, times in runs]
    last = [max(rank_ends[k] for rank_ends in ends) for k in range(len(ends[0]))]
    return last[-1] - last[-2]


def time_steps(rank, world_size, options):
    """Per repetition and variant: (this rank's clock after training, its step times)."""
    torch.set_num_threads(1)
    modeled = options["network"] is not None
    steps = options["steps"] if modeled else options["steps"] + 1
    data = toy.make_spirals(world_size * options["batch"] * steps, seed=1)
    names = MODELED if modeled else list(VARIANTS)
    out = {name: [] for name in names}
    shuffle = random.Random(0)
    checks = contextlib.nullcontext() if modeled else course_lib.unchecked()    # checks are free on the modeled clock
    with checks:
        for rep in range(options["reps"] + (0 if modeled else 1)):           # this machine: repetition 0 warms up
            order = list(names)
            shuffle.shuffle(order)
            for name in order:
                model, optimizer = _build(name, options)
                log = training.train_data_parallel(model, optimizer, data, F.cross_entropy,
                                                   batch_size=options["batch"], max_steps=steps)
                if modeled:
                    out[name].append((course_lib.clock(), log.step_times))
                elif rep > 0:
                    out[name].append(statistics.fmean(log.step_times[1:]))
    return out


def model_seconds(name, units, network, world_size) -> float:
    """The sum of a step's collectives on `network` (see the module docstring)."""
    g = world_size
    if g == 1:
        return 0.0
    ring = lambda n: network.predict("ring", 4 * n, g)                                      # noqa: E731
    pieces = lambda n, extra=0: (g - 1) * (network.latency + 4 * (math.ceil(n / g) + extra) / network.bandwidth)  # noqa: E731
    total = sum(units)
    if name == "plain DP":
        return ring(total + 2)
    if name == "ZeRO-1 (flat)":
        return pieces(total, extra=2) + pieces(total)
    calls = {"stage 0": None, "ZeRO-1": 2, "ZeRO-2": 2, "ZeRO-3": 3}[name]
    if calls is None:
        return ring(2) + sum(ring(n) for n in units)
    return ring(2) + sum(calls * pieces(n) for n in units)


def analyse(per_rank, times_per_rank, options):
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
    timed = list(times_per_rank[0])
    if options["network"] is not None:
        network = Network.parse(options["network"])
        per_rep = {name: [step_seconds([out[name][i] for out in times_per_rank]) for i in range(reps)] for name in timed}
        models = {name: model_seconds(name, units, network, g) for name in timed}
    else:
        per_rep = {name: [max(out[name][i] for out in times_per_rank) for i in range(reps)] for name in timed}
        models = {}
    times = {name: {**bench.spread(values), "values": values, "model": models.get(name),
                    "ratio_to_model": (values[0] / models[name] if models.get(name) else None)}
             for name, values in per_rep.items()}
    ratios = {name: {**bench.spread([a / b for a, b in zip(per_rep[name], per_rep["plain DP"])])}
              for name in timed if name != "plain DP"}
    return {"parameters": psi, "layers": units, "memory": memory_rows, "bytes": bytes_rows, "times": times,
            "ratios_to_plain": ratios}


def key_of(world_size, tag="") -> str:
    """A run's key in the results: `<G>ranks`, `<G>ranks_<tag>` with --tag."""
    return f"{world_size}ranks" + (f"_{tag}" if tag else "")


def command(key, o) -> str:
    """The command that makes the run under `key` (--reps, --steps and --batch where they are not the defaults)."""
    tag = key.partition("ranks")[2].lstrip("_")
    default_reps = 2 if o.get("network") else 11
    return (f"python benchmarks/zero_figures.py --world-size {o['world_size']} "
            f"--network '{o.get('network') or 'none'}' --hidden {o['hidden']} --depth {o['depth']}"
            + (f" --reps {o['reps']}" if o["reps"] != default_reps else "")
            + (f" --steps {o['steps']}" if o["steps"] != 3 else "")
            + (f" --batch {o['batch']}" if o["batch"] != 16 else "")
            + (f" --tag {tag}" if tag else ""))


def markdown(runs) -> str:
    """The results file: one section per run, in the order of their world sizes, then keys."""
    lines = ["# ZeRO stages: memory, bytes and time per step, measured", "",
             "One section per run of `python benchmarks/zero_figures.py`, named by its key under \"runs\" in "
             "zero_figures.json: `<G>ranks`, `<G>ranks_<tag>` for `--tag <tag>` (`512wide`: toy.make_mlp(hidden=512, "
             "depth=2)). A run replaces the section with its key and keeps the others."]
    for key in sorted(runs, key=lambda k: (runs[k]["options"]["world_size"], k)):
        lines += [""] + section(key, runs[key])
    return "\n".join(lines) + "\n"


def section(key, result) -> list:
    o, m = result["options"], result["machine"]
    kib = lambda b: f"{b / 1024:.1f}"  # noqa: E731
    lines = [
        f"## {key}: ZeRO stages on {o['world_size']} ranks, toy.make_mlp(hidden={o['hidden']}, depth={o['depth']})",
        "",
        f"`{command(key, o)}` — toy.make_mlp(hidden={o['hidden']}, "
        f"depth={o['depth']}): {result['parameters']:,} parameters in layers of {result['layers']}; Adam, float32; "
        f"batch {o['batch']} per rank. Machine: {m['cpus']} CPUs, torch {m['torch']}, Python {m['python']}, "
        f"{m['date']}. Load average (1, 5, 15 min) before: {result['load_before']}, after: {result['load_after']}"
        + (f". Note: {o['note']}" if o.get("note") else "") + ".",
        "",
        "### Memory per rank (KiB), rank 0, measured by the census",
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
    lines += ["", "### Bytes sent per step, rank 0 (every rank: recording == formula?)", "",
              "| variant | bytes per step | equals `expected_bytes_sent` on every rank |", "| --- | --- | --- |"]
    for name, row in result["bytes"].items():
        equal = {True: "yes", False: "NO"}.get(row.get("equal"), "-")
        lines.append(f"| {name} | {row['sent'][0]:,} | {equal} |")
    if o.get("network"):
        lines += ["", f"### Time per step (ms) on the modeled clock: {result['network']}",
                  "", f"{o['reps']} repetitions of {o['steps']} steps, in a shuffled order; a step's time is how much "
                  "later the last rank finished the last step than the one before. Compute costs nothing on this "
                  "clock; the model is the sum of the step's collectives (the script's docstring). ZeRO-3 prefetch is "
                  "not timed (its gain is overlap with compute, which is free here).", "",
                  "| variant | measured, median (min..max) | model | measured / model | ratio to plain DP |",
                  "| --- | --- | --- | --- | --- |"]
        for name, t in result["times"].items():
            r = result["ratios_to_plain"].get(name)
            ratio = f"{r['median']:.3f}" if r else "1"
            lines.append(f"| {name} | {1e3 * t['median']:.4f} ({1e3 * t['min']:.4f}..{1e3 * t['max']:.4f}) | "
                         f"{1e3 * t['model']:.4f} | {t['ratio_to_model']:.6f} | {ratio} |")
    else:
        lines += ["", f"### Time per step (ms) on this machine's clock, slowest rank, {o['reps']} interleaved repetitions "
                  f"of {o['steps']} steps", "",
                  "| variant | median (min..max) | paired ratio to plain DP, median (min..max) |", "| --- | --- | --- |"]
        for name, t in result["times"].items():
            r = result["ratios_to_plain"].get(name)
            ratio = f"{r['median']:.2f} ({r['min']:.2f}..{r['max']:.2f})" if r else "1"
            lines.append(f"| {name} | {1e3 * t['median']:.1f} ({1e3 * t['min']:.1f}..{1e3 * t['max']:.1f}) | {ratio} |")
    return lines


def write(key, result, out) -> None:
    """This run into OUT.json (under "runs", its key) and OUT.md, beside the runs already there with other keys."""
    keyed_results.write_run(out, key, result, markdown)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--network", default="1GbE",
                        help="the modeled link the steps are timed on (a preset, or 'BANDWIDTH, LATENCY'); "
                             "'none': this machine's clock")
    parser.add_argument("--reps", type=int, default=None,
                        help="repetitions (default 2 on the modeled clock, where they read the same; 11 on this machine's)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--note", default="", help="free text stored with the results (e.g. what else ran)")
    parser.add_argument("--tag", default="", help="appended to the run's key in the results: <G>ranks_<tag>")
    parser.add_argument("--out", default=None, help="the results' stem (default benchmarks/results/zero_figures)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    network = None if args.network.strip().lower() == "none" else Network.parse(args.network)
    reps = args.reps if args.reps is not None else (2 if network is not None else 11)
    if network is None and reps < 9:
        parser.error("--reps must be at least 9 on this machine's clock: a median of fewer runs on a shared machine "
                     "means little")
    if network is not None and (reps < 1 or args.steps < 2):
        parser.error("the modeled clock needs --reps >= 1 and --steps >= 2 (a step's time is read between two steps)")
    options = {"world_size": args.world_size, "reps": reps, "steps": args.steps, "hidden": args.hidden,
               "depth": args.depth, "batch": args.batch, "note": args.note,
               "network": None if network is None else args.network}
    load_before = [round(x, 2) for x in os.getloadavg()]
    started = time.perf_counter()
    per_rank = course_lib.launch(measure, args.world_size, args=(options,), backend="gloo", timeout=3000)
    times_per_rank = course_lib.launch(time_steps, args.world_size, args=(options,), backend="gloo", timeout=3000,
                                       network=network)
    result = {"options": options, "machine": bench.machine_description(), "load_before": load_before,
              "load_after": [round(x, 2) for x in os.getloadavg()], "seconds": round(time.perf_counter() - started, 1),
              "network": None if network is None else network.describe(),
              **analyse(per_rank, times_per_rank, options)}
    key = key_of(args.world_size, args.tag)
    print("\n".join(section(key, result)))
    if not args.no_write:
        out = args.out or str(RESULTS / "zero_figures")
        write(key, result, out)
        print(f"wrote {key} into {out}.json and .md")
    return result


if __name__ == "__main__":
    main()
