"""Gradient compression on the course's model: bytes per step, loss after training, time per step, measured.

    python benchmarks/compression_figures.py [--world-size 4] [--steps 200] [--seeds 3] [--network 1GbE]
                                             [--time-hidden 128,512] [--hidden 128] [--depth 2] [--batch 8]
                                             [--lr 0.05] [--note "..."]

One launch of --world-size ranks. The model is toy.make_mlp(hidden, depth) on 600 spiral points (the
course's MLP and data, 128 hidden units wide so that its square layer dominates, as in notebook 12),
SGD with momentum 0.9, --batch samples per rank per step, trained by the hand-made trainer with each
gradient averager as its DDP communication hook:

    none            the trainer's ring all-reduce (fp32)
    bf16            compression.low_precision_hook, summed in fp32
    PowerSGD ρ=2    compression.powersgd_hook, approximation rank ρ = 2, error feedback (starts at step 2, as
                    PyTorch's allows)
    PowerSGD no EF  the same without error feedback
    top-k EF        compression.topk_hook, 1% density, error feedback
    top-k no EF     the same without

Per --seeds data seed (deterministic: course_lib's collectives sum in a fixed order): the loss of the
whole data set after --steps steps, each variant's ratio to the uncompressed run's, the loss curve,
and every rank's bytes per step from its traffic recording against the hook's formula. PowerSGD is
also run against PyTorch's own powerSGD_hook, both inside DDP on the same model and data: the sizes
they all-reduce each step, and the largest gap between their parameters and between their losses.
These run on this machine's clock, untimed (their results do not depend on time).

Time, on the modeled clock of --network (a preset such as 1GbE, 10GbE, ib_ndr, or 'BANDWIDTH, LATENCY';
`course_lib.Network`), in a second launch: every variant trains 4 steps (PowerSGD compresses from step 3)
of toy.make_mlp(hidden=h, depth) for each h in --time-hidden, --reps times in a shuffled order; a step's
time is how much later the last rank finished step 4 than step 3. Compute costs nothing on this clock
(the compressors' own work included), so a step's time is its messages'. Beside it the model, a the
latency and B the bandwidth, N the gradient's elements: the loss sum and count (a ring all-reduce of 2
elements; uncompressed training carries them in its one ring all-reduce of N + 2), then

    none      ring all-reduce of N + 2               2(G-1) (a + 4 ceil((N+2)/G) / B)   (Network.predict)
    bf16      all-to-all + all-gather, 16 bits        2 (G-1) (a + 2 ceil(N/G) / B)
    PowerSGD  ring all-reduces of U, sum n rho, sum m rho elements
    top-k     all-gather of 2k numbers                (G-1) (a + 8k / B),  k = ceil(density N)

The repetitions read the same (the spread is 0). --network none times on this machine's clock instead.

Writes benchmarks/results/compression_figures.{json,md} (or --out STEM): one run per world size, under "runs" in the
JSON (key `<G>ranks`) and a section of the .md; a run replaces the one with its key and keeps the others.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import random
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import keyed_results  # benchmarks/keyed_results.py: the one results file, a run per key

import course_lib
from course_lib import bench, training
from course_lib.network import Network
from course_lib.training import compression, toy

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
VARIANTS = ("none", "bf16", "PowerSGD ρ=2", "PowerSGD no EF", "top-k EF", "top-k no EF")
TIME_STEPS = 4             # PowerSGD all-reduces uncompressed in steps 1 and 2 and compresses from step 3


def hook_of(name, options):
    """(hook, state) of a variant; (None, None) for the plain ring all-reduce."""
    rank = options["rank"]
    return {"none": (None, None),
            "bf16": (compression.low_precision_hook, compression.LowPrecisionState()),
            "PowerSGD ρ=2": (compression.powersgd_hook,
                             compression.PowerSGDState(matrix_approximation_rank=rank, start_powerSGD_iter=2)),
            "PowerSGD no EF": (compression.powersgd_hook,
                               compression.PowerSGDState(matrix_approximation_rank=rank, start_powerSGD_iter=2,
                                                         use_error_feedback=False)),
            "top-k EF": (compression.topk_hook, compression.TopKState(density=options["density"])),
            "top-k no EF": (compression.topk_hook, compression.TopKState(density=options["density"],
                                                                        use_error_feedback=False))}[name]


def train(name, options, data, steps, seed=0, hidden=None):
    model = toy.make_mlp(hidden=hidden or options["hidden"], depth=options["depth"], seed=seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=options["lr"], momentum=0.9)
    hook, state = hook_of(name, options)
    log = training.train_data_parallel(model, optimizer, data, F.cross_entropy, batch_size=options["batch"],
                                       epochs=10_000, max_steps=steps, comm_hook=hook, comm_hook_state=state)
    with torch.no_grad():
        final = F.cross_entropy(model(data[0]), data[1]).item()
    return model, log, final


def _ddp_powersgd(which, options, data, rank, world_size):
    model = toy.make_mlp(hidden=options["hidden"], depth=options["depth"], seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=options["lr"], momentum=0.9)
    if which == "torch":
        state = torch_powersgd.PowerSGDState(None, matrix_approximation_rank=options["rank"], start_powerSGD_iter=2)
        hook = torch_powersgd.powerSGD_hook
    else:
        state = compression.PowerSGDState(matrix_approximation_rank=options["rank"], start_powerSGD_iter=2)
        hook = compression.powersgd_hook
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(state, hook)
    dataset = TensorDataset(*data)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    sizes, losses, params = [], [], []
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        sizes.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        epoch = 0
        while len(losses) < options["ddp_steps"]:
            sampler.set_epoch(epoch)
            for x, y in DataLoader(dataset, batch_size=options["batch"], sampler=sampler):
                if len(losses) >= options["ddp_steps"]:
                    break
                optimizer.zero_grad()
                loss = F.cross_entropy(ddp(x), y)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
                params.append(training.flat_parameters(model))
            epoch += 1
    finally:
        dist.all_reduce = original
    return {"sizes": sizes, "losses": losses, "params": params,
            "sent": list(getattr(state, "sent", []))}


def measure(rank, world_size, options):
    torch.set_num_threads(1)
    out = {"seeds": {}}
    for seed in range(options["seeds"]):
        data = toy.make_spirals(600, seed=1 + seed)
        runs = {}
        for name in VARIANTS:
            _, log, final = train(name, options, data, options["steps"], seed=seed)
            runs[name] = {"final_loss": final, "losses": log.losses,
                          "bytes_per_step": [t.buckets[0].bytes_sent for t in log.timeline]}
        out["seeds"][seed] = runs
    data = toy.make_spirals(600, seed=1)
    theirs = _ddp_powersgd("torch", options, data, rank, world_size)
    ours = _ddp_powersgd("ours", options, data, rank, world_size)
    out["against_pytorch"] = {
        "torch_sizes": theirs["sizes"], "our_sent": ours["sent"],
        "max_param_gap": max((a - b).abs().max().item() for a, b in zip(theirs["params"], ours["params"])),
        "max_loss_gap": max(abs(a - b) for a, b in zip(theirs["losses"], ours["losses"])),
        "losses_torch": theirs["losses"], "losses_ours": ours["losses"]}
    return out


def step_seconds(runs) -> float:
    """How much later the last rank finished the last step than the step before, from every rank's
    (clock at the end, step times): steps follow one another with nothing in between."""
    ends = [[end - sum(times[k + 1:]) for k in range(len(times))] for end, times in runs]
    last = [max(rank_ends[k] for rank_ends in ends) for k in range(len(ends[0]))]
    return last[-1] - last[-2]


def time_steps(rank, world_size, options):
    """Per width, variant and repetition: this rank's (clock after training, step times) on the modeled clock,
    or (this machine's clock) its mean step time over steps 4 to 4 + --time-steps."""
    torch.set_num_threads(1)
    modeled = options["network"] is not None
    steps = TIME_STEPS if modeled else options["time_steps"] + 3
    data = toy.make_spirals(600, seed=1)
    out = {}
    shuffle = random.Random(0)
    for hidden in options["time_hidden"]:
        for rep in range(options["reps"] + (0 if modeled else 1)):
            order = list(VARIANTS)
            shuffle.shuffle(order)
            for name in order:
                _, log, _ = train(name, options, data, steps, hidden=hidden)
                if modeled:
                    out.setdefault(f"{hidden}|{name}", []).append((course_lib.clock(), log.step_times))
                elif rep > 0:
                    out.setdefault(f"{hidden}|{name}", []).append(statistics.fmean(log.step_times[3:]))
    return out


def model_seconds(name, shapes, options, network, world_size) -> float:
    """The sum of one step's collectives on `network` (see the module docstring)."""
    g = world_size
    if g == 1:
        return 0.0
    a, b = network.latency, network.bandwidth
    ring = lambda n: network.predict("ring", 4 * n, g)                                       # noqa: E731
    numel = sum(math.prod(s) for s in shapes)
    if name == "none":
        return ring(numel + 2)
    if name == "bf16":
        return ring(2) + 2 * (g - 1) * (a + 2 * math.ceil(numel / g) / b)
    if name.startswith("top-k"):
        k = math.ceil(options["density"] * numel)
        return ring(2) + (g - 1) * (a + 8 * k / b)
    sizes = compression.powersgd_sizes(shapes, options["rank"])
    return ring(2) + sum(ring(sizes[key]) for key in ("uncompressed", "p", "q"))


def analyse_times(times_per_rank, options):
    """{hidden: {variant: spread of the step time, model, ratio to the model and to 'none'}}."""
    g = options["world_size"]
    network = Network.parse(options["network"]) if options["network"] is not None else None
    out = {}
    for hidden in options["time_hidden"]:
        shapes = [tuple(p.shape) for p in toy.make_mlp(hidden=hidden, depth=options["depth"]).parameters()][::-1]
        rows = {}
        for name in VARIANTS:
            runs = [out_r[f"{hidden}|{name}"] for out_r in times_per_rank]
            if network is not None:
                values = [step_seconds([run[i] for run in runs]) for i in range(options["reps"])]
                model = model_seconds(name, shapes, options, network, g)
            else:
                values = [max(run[i] for run in runs) for i in range(options["reps"])]
                model = None
            rows[name] = {**bench.spread(values), "values": values, "model": model,
                          "ratio_to_model": values[0] / model if model else None}
        for name in VARIANTS:
            rows[name]["ratio_to_none"] = rows[name]["median"] / rows["none"]["median"]
        out[str(hidden)] = {"parameters": sum(math.prod(s) for s in shapes), "variants": rows}
    return out


def analyse(per_rank, options):
    g = options["world_size"]
    shapes = [tuple(p.shape) for p in toy.make_mlp(hidden=options["hidden"], depth=options["depth"]).parameters()][::-1]
    numel = sum(torch.Size(s).numel() for s in shapes)
    formulas = {"none": [compression.ring_bytes(numel + 0, g, r) for r in range(g)],
                "bf16": [compression.low_precision_bytes(numel, g)] * g,
                "PowerSGD ρ=2": [compression.powersgd_bytes(shapes, options["rank"], g, r) for r in range(g)],
                "PowerSGD no EF": [compression.powersgd_bytes(shapes, options["rank"], g, r) for r in range(g)],
                "top-k EF": [compression.topk_bytes(numel, options["density"], g)] * g,
                "top-k no EF": [compression.topk_bytes(numel, options["density"], g)] * g}
    # The uncompressed trainer's one all-reduce carries the loss sum and sample count too: N + 2 elements.
    formulas["none"] = [compression.ring_bytes(numel + 2, g, r) for r in range(g)]
    variants = {}
    for name in VARIANTS:
        per_seed = [per_rank[0]["seeds"][s][name]["final_loss"] / per_rank[0]["seeds"][s]["none"]["final_loss"]
                    for s in range(options["seeds"])]
        last = [per_rank[r]["seeds"][0][name]["bytes_per_step"][-1] for r in range(g)]
        variants[name] = {
            "final_loss": [per_rank[0]["seeds"][s][name]["final_loss"] for s in range(options["seeds"])],
            "ratio_to_uncompressed": per_seed,
            "bytes_per_step_rank0": last[0],
            "bytes_equal_formula_every_rank": last == formulas[name],
            "share_of_uncompressed": last[0] / formulas["none"][0]}
    against = per_rank[0]["against_pytorch"]
    sizes = compression.powersgd_sizes(shapes, options["rank"])
    per_step = [sizes["uncompressed"], sizes["p"], sizes["q"]]
    torch_steps = against["torch_sizes"][2:]
    against_summary = {
        "torch_allreduce_sizes_per_step": per_step,
        "torch_sizes_match_formula": torch_steps == per_step * (len(torch_steps) // 3)
        and against["torch_sizes"][:2] == [numel, numel],
        "our_sizes_match": all([s["uncompressed"], s["p"], s["q"]] == per_step for s in against["our_sent"]),
        "max_param_gap": max(r["against_pytorch"]["max_param_gap"] for r in per_rank),
        "max_loss_gap": max(r["against_pytorch"]["max_loss_gap"] for r in per_rank),
        "steps": len(against["losses_torch"])}
    return {"parameters": numel, "shapes": shapes, "variants": variants, "against_pytorch": against_summary,
            "curves_seed0": {name: per_rank[0]["seeds"][0][name]["losses"] for name in VARIANTS}}


DEFAULTS = {"steps": 200, "seeds": 3, "time_hidden": [128, 512], "time_steps": 4, "ddp_steps": 60, "hidden": 128,
            "depth": 2, "batch": 8, "lr": 0.05, "rank": 2, "density": 0.01}   # main's; a command names the others


def command(o) -> str:
    """The command that makes a run of options `o` (every option that is not the default)."""
    flags = "".join(f" --{name.replace('_', '-')} {','.join(map(str, value)) if isinstance(value, list) else value}"
                    for name, value in ((n, o[n]) for n in DEFAULTS) if value != DEFAULTS[name])
    default_reps = 2 if o.get("network") else 9
    return (f"python benchmarks/compression_figures.py --world-size {o['world_size']} --network "
            f"'{o.get('network') or 'none'}'" + (f" --reps {o['reps']}" if o["reps"] != default_reps else "") + flags)


def markdown(runs) -> str:
    """The results file: one section per run, in the order of their world sizes."""
    lines = ["# Gradient compression: bytes, loss and time, measured", "",
             "One section per run of `python benchmarks/compression_figures.py`, named by its key under \"runs\" in "
             "compression_figures.json: `<G>ranks`. A run replaces the section with its key and keeps the others."]
    for key in sorted(runs, key=lambda k: runs[k]["options"]["world_size"]):
        lines += [""] + section(key, runs[key])
    return "\n".join(lines) + "\n"


def section(key, result) -> list:
    o, m = result["options"], result["machine"]
    lines = [
        f"## {key}: gradient compression on {o['world_size']} ranks",
        "",
        f"`{command(o)}` — toy.make_mlp(hidden={o['hidden']}, "
        f"depth={o['depth']}), {result['parameters']:,} parameters, 600 spiral points, SGD (lr {o['lr']}, momentum 0.9), "
        f"batch {o['batch']} per rank, {o['steps']} steps, {o['seeds']} data seeds; PowerSGD approximation rank ρ = {o['rank']} compressing from step 3 (start_powerSGD_iter=2), "
        f"top-k density {o['density']}. Machine: {m['cpus']} CPUs, torch {m['torch']}, {m['date']}. Load average before: "
        f"{result['load_before']}, after: {result['load_after']}" + (f". Note: {o['note']}" if o.get("note") else "") + ".",
        "",
        "| variant | bytes per step, rank 0 | share of uncompressed | recording == formula (every rank) "
        "| loss after training / uncompressed, per seed |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, v in result["variants"].items():
        ratios = ", ".join(f"{r:.3f}" for r in v["ratio_to_uncompressed"])
        lines.append(f"| {name} | {v['bytes_per_step_rank0']:,} | {v['share_of_uncompressed']:.3f} | "
                     f"{'yes' if v['bytes_equal_formula_every_rank'] else 'NO'} | {ratios} |")
    a = result["against_pytorch"]
    lines += ["", f"PowerSGD against PyTorch's powerSGD_hook, both in DDP, {a['steps']} steps: all-reduce sizes per "
                  f"step {a['torch_allreduce_sizes_per_step']} (uncompressed, Y = XQ, Z = XᵀY) for both: "
                  f"{'yes' if a['torch_sizes_match_formula'] and a['our_sizes_match'] else 'NO'}; largest parameter gap "
                  f"{a['max_param_gap']:.2e}, largest loss gap {a['max_loss_gap']:.2e}.", ""]
    clock = (f"the modeled clock of {result['network']}" if o.get("network") else "this machine's clock (slowest rank)")
    for hidden, block in result["times"].items():
        lines += [f"### Time per step (ms), toy.make_mlp(hidden={hidden}, depth={o['depth']}): {block['parameters']:,} "
                  f"parameters, on {clock}", ""]
        if o.get("network"):
            lines += [f"{o['reps']} repetitions of {TIME_STEPS} steps; the time of step {TIME_STEPS} (how much later the "
                      "last rank finished it than the step before). Compute, the compressors' included, costs nothing "
                      "on this clock; the model is the sum of the step's collectives (the script's docstring).", "",
                      "| variant | measured, median (min..max) | model | measured / model | ratio to none |",
                      "| --- | --- | --- | --- | --- |"]
            for name, t in block["variants"].items():
                lines.append(f"| {name} | {1e3 * t['median']:.4f} ({1e3 * t['min']:.4f}..{1e3 * t['max']:.4f}) | "
                             f"{1e3 * t['model']:.4f} | {t['ratio_to_model']:.6f} | {t['ratio_to_none']:.3f} |")
        else:
            lines += ["| variant | median (min..max) | ratio to none (medians) |", "| --- | --- | --- |"]
            for name, t in block["variants"].items():
                lines.append(f"| {name} | {1e3 * t['median']:.1f} ({1e3 * t['min']:.1f}..{1e3 * t['max']:.1f}) | "
                             f"{t['ratio_to_none']:.2f} |")
        lines.append("")
    while lines[-1] == "":
        lines.pop()
    return lines


def write(key, result, out) -> None:
    """This run into OUT.json (under "runs", its key) and OUT.md, beside the runs already there with other keys."""
    keyed_results.write_run(out, key, result, markdown)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    parser.add_argument("--seeds", type=int, default=DEFAULTS["seeds"])
    parser.add_argument("--network", default="1GbE",
                        help="the modeled link the steps are timed on (a preset, or 'BANDWIDTH, LATENCY'); "
                             "'none': this machine's clock")
    parser.add_argument("--time-hidden", default=",".join(map(str, DEFAULTS["time_hidden"])),
                        help="widths of the models timed, comma-separated")
    parser.add_argument("--reps", type=int, default=None,
                        help="repetitions of the timing (default 2 on the modeled clock, 9 on this machine's)")
    parser.add_argument("--time-steps", type=int, default=DEFAULTS["time_steps"])
    parser.add_argument("--ddp-steps", type=int, default=DEFAULTS["ddp_steps"])
    parser.add_argument("--hidden", type=int, default=DEFAULTS["hidden"])
    parser.add_argument("--depth", type=int, default=DEFAULTS["depth"])
    parser.add_argument("--batch", type=int, default=DEFAULTS["batch"])
    parser.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    parser.add_argument("--rank", type=int, default=DEFAULTS["rank"])
    parser.add_argument("--density", type=float, default=DEFAULTS["density"])
    parser.add_argument("--note", default="")
    parser.add_argument("--out", default=None,
                        help="the results' stem (default benchmarks/results/compression_figures)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    network = None if args.network.strip().lower() == "none" else Network.parse(args.network)
    reps = args.reps if args.reps is not None else (2 if network is not None else 9)
    if network is None and reps < 9:
        parser.error("--reps must be at least 9 on this machine's clock: a median of fewer runs on a shared machine "
                     "means little")
    options = {k: getattr(args, k) for k in ("world_size", "steps", "seeds", "time_steps", "ddp_steps",
                                             "hidden", "depth", "batch", "lr", "rank", "density", "note")}
    options.update(reps=reps, network=None if network is None else args.network,
                   time_hidden=[int(h) for h in args.time_hidden.split(",") if h.strip()])
    load_before = [round(x, 2) for x in os.getloadavg()]
    started = time.perf_counter()
    per_rank = course_lib.launch(measure, args.world_size, args=(options,), backend="gloo", timeout=3000)
    times_per_rank = course_lib.launch(time_steps, args.world_size, args=(options,), backend="gloo", timeout=3000,
                                       network=network)
    result = {"options": options, "machine": bench.machine_description(), "load_before": load_before,
              "load_after": [round(x, 2) for x in os.getloadavg()], "seconds": round(time.perf_counter() - started, 1),
              "network": None if network is None else network.describe(),
              **analyse(per_rank, options), "times": analyse_times(times_per_rank, options)}
    key = f"{args.world_size}ranks"
    print("\n".join(section(key, result)))
    if not args.no_write:
        out = args.out or str(RESULTS / "compression_figures")
        write(key, result, out)
        print(f"wrote {key} into {out}.json and .md")
    return result


if __name__ == "__main__":
    main()
