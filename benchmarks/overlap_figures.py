"""Time per training step with and without overlapping the gradient all-reduce with backward.

    python benchmarks/overlap_figures.py [--world-size 2] [--reps 11] [--steps 8] [--width 1024]
                                         [--depth 4] [--batch 128] [--bucket-mb 4] [--allreduce ring]
                                         [--network "100 MB/s, 1 ms"] [--compute-ms 2,25]

The model is a stack of wide Linear layers (width x width weights) trained on random data with a
small per-rank batch: its gradient is large for the compute it takes, so the all-reduce is a large
part of the step (the script measures and reports how large). Three ways to average the gradients
run interleaved in one launch, every repetition running each once, so machine noise hits all three:

    one all-reduce      today's trainer: backward, then one all-reduce of every gradient
    buckets, after      gradients cut into --bucket-mb buckets, all-reduced one by one after backward
    buckets, overlap    the same buckets, each all-reduced on a communication thread as soon as its
                        gradients are ready, while backward goes on (train_data_parallel(overlap=True))

"buckets, after" separates what bucketing alone changes (smaller messages) from what overlap adds.
For each repetition and variant: the mean step time over --steps steps (the first step of each run
is dropped as warm-up), slowest rank. Reported: median and spread (min, max) over the repetitions,
the all-reduce's share of the step in the one-all-reduce variant, the communication left exposed
after backward, and one step's bucket timeline from the overlap run. Cross-rank argument checks are
off (course_lib.unchecked()), as in course_lib.bench, so only the algorithms are timed.

With --network every message takes the time of a modeled link (course_lib.network): compute is this
machine's, communication the link's, which is what overlap needs to be seen on a machine whose ranks
share two cores. The report then also gives max(compute, communication), the least a step can take
when the two overlap perfectly (compute = the one-all-reduce step minus its all-reduce).

With --compute-ms F,B every layer with parameters is followed by a training.ComputeDelay: its forward
takes F ms and its backward B ms (an accelerator's compute: on the modeled clock it moves the rank's clock,
without --network it sleeps, the CPU free meanwhile). With --network too, both compute and communication are
modeled and the step is the schedule, not this machine's two cores: what overlap buys where compute and
communication use different hardware, the same in every repetition. On the modeled clock a step is read
as the time from one step's end to the next on the slowest rank (the ranks leave the broadcast of the
initial parameters at different moments, so one rank's own step total includes waiting for the others).

Writes benchmarks/results/overlap_figures.{json,md} (or --out STEM): one run per key, `<G>ranks[_network][_compute]`
(with --network, --compute-ms), under "runs" in the JSON (every number, the machine, the load average before and after)
and a section of the .md (a short table); a run replaces the one with its key and keeps the others. Not a test: the
figures depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import keyed_results  # benchmarks/keyed_results.py: the one results file, a run per key

import course_lib
from course_lib import bench, training

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
VARIANTS = {
    "one all-reduce": {},
    "buckets, after": {"overlap": False},
    "buckets, overlap": {"overlap": True},
}
DEFAULTS = {"reps": 11, "steps": 8, "width": 1024, "depth": 4, "input_width": None, "batch": 128, "bucket_mb": 4.0,
            "allreduce": "ring", "network": None, "compute_ms": None}   # main's: a section's command names the others


def make_model(width: int, depth: int, classes: int = 10, seed: int = 0, input_width: int | None = None) -> nn.Sequential:
    """`depth` Linear + ReLU layers (the first from `input_width` features, default `width`, the rest
    width x width) and a Linear(width, classes) head."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        for index in range(depth):
            layers += [nn.Linear(input_width or width if index == 0 else width, width), nn.ReLU()]
        layers.append(nn.Linear(width, classes))
        return nn.Sequential(*layers)


def make_data(samples: int, width: int, classes: int = 10, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(samples, width, generator=generator), torch.randint(0, classes, (samples,), generator=generator)


def _summary(timelines, done=None) -> dict:
    """Means over the measured steps of one run (the first step dropped) on one rank; with `done` (the rank's clock
    when training returned) also every step's end on that clock ("ends")."""
    kept = timelines[1:]
    mean = lambda values: statistics.fmean(values)  # noqa: E731
    totals = [t.total for t in timelines]
    ends = None if done is None else [done - sum(totals[s + 1:]) for s in range(len(totals))]
    return {"ends": ends, "step": mean([t.total for t in kept]), "forward": mean([t.forward for t in kept]),
            "backward": mean([t.backward for t in kept]), "communication": mean([t.communication for t in kept]),
            "exposed_communication": mean([t.exposed_communication for t in kept]),
            "optimizer": mean([t.optimizer for t in kept])}


def build_model(options) -> nn.Sequential:
    model = make_model(options["width"], options["depth"], input_width=options.get("input_width"))
    if options.get("compute_ms"):
        forward_ms, backward_ms = options["compute_ms"]
        model = training.with_compute_delays(model, forward_ms / 1e3, backward_ms / 1e3)
    return model


def measure(rank, world_size, options):
    """In each rank: every repetition trains each variant for options['steps'] steps from the same start."""
    data = make_data(options["samples"], options.get("input_width") or options["width"])
    runs = {name: [] for name in VARIANTS}
    example = None
    with course_lib.unchecked():
        for rep in range(options["reps"] + 1):            # repetition 0 warms up and is dropped
            for name, extra in VARIANTS.items():
                model = build_model(options)
                optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
                buckets = {} if not extra else {"bucket_mb": options["bucket_mb"], **extra}
                log = training.train_data_parallel(model, optimizer, data, F.cross_entropy,
                                                   batch_size=options["batch"], max_steps=options["steps"] + 1,
                                                   seed=rep, allreduce=options["allreduce"], **buckets)
                if rep > 0:
                    runs[name].append(_summary(log.timeline, course_lib.clock() if options["network"] else None))
                if rep == options["reps"] and name == "buckets, overlap":
                    example = dataclasses.asdict(log.timeline[-1])
    return {"runs": runs, "example_step": example}


def _spread(values) -> dict:
    """bench.spread's median, quartiles and range, with the values themselves kept for the JSON."""
    return {**bench.spread(values), "values": list(values)}


def analyse(per_rank: list, options: dict) -> dict:
    """Slowest rank per repetition, then median and spread over the repetitions."""
    reps = options["reps"]
    if options.get("network"):     # the modeled clock: a step is the slowest rank's time from one step's end to the next
        for name in VARIANTS:
            for i in range(reps):
                ends = [max(r["runs"][name][i]["ends"][s] for r in per_rank)
                        for s in range(len(per_rank[0]["runs"][name][i]["ends"]))]
                period = statistics.fmean(b - a for a, b in zip(ends, ends[1:]))
                for r in per_rank:
                    r["runs"][name][i]["step"] = period
    for r in per_rank:
        for name in VARIANTS:
            for run in r["runs"][name]:
                run.pop("ends", None)
    figures = {}
    for name in VARIANTS:
        slowest = [max(per_rank, key=lambda r: r["runs"][name][i]["step"])["runs"][name][i] for i in range(reps)]
        figures[name] = {key: _spread([run[key] for run in slowest]) for key in slowest[0]}
        figures[name]["communication_share"] = _spread([run["communication"] / run["step"] for run in slowest])
    # Per repetition, the ratio of step times (paired: both ran within seconds of each other).
    paired = {}
    for other in ("one all-reduce", "buckets, after"):
        ratios = [max(r["runs"]["buckets, overlap"][i]["step"] for r in per_rank) /
                  max(r["runs"][other][i]["step"] for r in per_rank) for i in range(reps)]
        paired[f"buckets, overlap / {other}"] = _spread(ratios)
    # The perfect-overlap bound, per repetition, from the one-all-reduce run's slowest rank.
    plain = [max(per_rank, key=lambda r: r["runs"]["one all-reduce"][i]["step"])["runs"]["one all-reduce"][i]
             for i in range(reps)]
    overlapped = [max(r["runs"]["buckets, overlap"][i]["step"] for r in per_rank) for i in range(reps)]
    compute = [run["step"] - run["communication"] for run in plain]
    communication = [run["communication"] for run in plain]
    best = [max(c, m) for c, m in zip(compute, communication)]
    bound = {"compute": _spread(compute), "communication": _spread(communication), "max": _spread(best),
             "communication_share": _spread([m / run["step"] for m, run in zip(communication, plain)]),
             "overlap_over_max": _spread([o / b for o, b in zip(overlapped, best)])}
    return {"variants": figures, "paired_ratios": paired, "overlap_bound": bound}


def key_of(options: dict) -> str:
    """A run's key in the results: `<G>ranks`, `_network` with --network, `_compute` with --compute-ms."""
    return (f"{options['world_size']}ranks" + ("_network" if options.get("network") else "")
            + ("_compute" if options.get("compute_ms") else ""))


def write(result: dict, out: str | None = None) -> tuple[pathlib.Path, pathlib.Path]:
    """This run into OUT.json (under "runs", its key) and OUT.md, beside the runs already there with other keys
    (OUT: benchmarks/results/overlap_figures unless given)."""
    out = out or str(RESULTS / "overlap_figures")
    return keyed_results.write_run(out, key_of(result["options"]), result, markdown)


def command(o: dict) -> str:
    """The command that makes a run of options `o` (--world-size, and every option that is not the default)."""
    def value(name):
        v = o.get(name)
        if name == "compute_ms":
            return ",".join(f"{x:g}" for x in v)
        return f"'{v}'" if name == "network" else f"{v:g}" if isinstance(v, float) else str(v)

    return (f"python benchmarks/overlap_figures.py --world-size {o['world_size']}"
            + "".join(f" --{name.replace('_', '-')} {value(name)}" for name in DEFAULTS
                      if o.get(name) != DEFAULTS[name]))


def markdown(runs: dict) -> str:
    """The results file: one section per run, in the order of their world sizes, then keys."""
    lines = ["# Overlapping the gradient all-reduce with backward: measured", "",
             "One section per run of `python benchmarks/overlap_figures.py`, named by its key under \"runs\" in "
             "overlap_figures.json: `<G>ranks`, `_network` with --network (the modeled link), `_compute` with "
             "--compute-ms (modeled compute). A run replaces the section with its key and keeps the others."]
    for key in sorted(runs, key=lambda k: (runs[k]["options"]["world_size"], k)):
        lines += [""] + section(key, runs[key])
    return "\n".join(lines) + "\n"


def section(key: str, result: dict) -> list:
    o, m = result["options"], result["machine"]
    ms = lambda s: f"{1e3 * s:.1f}"  # noqa: E731
    lines = [
        f"## {key}: {o['world_size']} ranks, "
        + (f"modeled network {o['network']}" if o.get("network") else "this machine's clock")
        + (", modeled compute" if o.get("compute_ms") else ""),
        "",
        f"`{command(o)}` — {o['world_size']} ranks (gloo), model {o['depth']} x "
        f"Linear({o['width']}, {o['width']})" + (f" (the first from {o['input_width']} inputs)" if o.get("input_width") else "")
        + f" + head = {result['parameters']:,} parameters "
        f"({result['gradient_mib']:.1f} MiB of gradient), batch {o['batch']} per rank, buckets of {o['bucket_mb']} MiB "
        f"({result['buckets']} buckets), all-reduce `{o['allreduce']}`; {o['reps']} interleaved repetitions of "
        f"{o['steps']} steps each; slowest rank per repetition."
        + (f" Modeled network: {o['network']}: every message takes that link's time on the modeled clock "
           "(course_lib.clock()), which every time here reads; a step is the slowest rank's time from one step's end "
           "to the next." if o.get("network") else " This machine's clock.")
        + (f" Modeled compute: every layer with parameters takes {o['compute_ms'][0]:g} ms forward and "
           f"{o['compute_ms'][1]:g} ms backward (training.ComputeDelay"
           + (", on the modeled clock)." if o.get("network") else ", sleeping).") if o.get("compute_ms") else ""),
        "",
        f"Machine: {m['cpus']} CPUs, torch {m['torch']}, Python {m['python']}, {m['date']}. "
        f"Load average (1, 5, 15 min) before: {result['load_before']}, after: {result['load_after']}"
        + (f". Note: {o['note']}" if o.get("note") else "") + ".",
        "",
        "| variant | step ms, median (min..max) | backward ms | all-reduce ms | exposed after backward ms "
        "| all-reduce share of step |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, f in result["variants"].items():
        s = f["step"]
        lines.append(f"| {name} | {ms(s['median'])} ({ms(s['min'])}..{ms(s['max'])}) | "
                     f"{ms(f['backward']['median'])} | {ms(f['communication']['median'])} | "
                     f"{ms(f['exposed_communication']['median'])} | {f['communication_share']['median']:.2f} |")
    lines += ["", "Paired ratios of step time (same repetition), median (min..max):", ""]
    for name, r in result["paired_ratios"].items():
        lines.append(f"- {name}: {r['median']:.3f} ({r['min']:.3f}..{r['max']:.3f})")
    bound = result.get("overlap_bound")
    if bound:
        lines += ["", "The bound overlap aims at, per repetition from the one-all-reduce run: compute = its step minus "
                      "its all-reduce; max(compute, communication) is the step if the two overlapped perfectly.", "",
                  f"- compute {ms(bound['compute']['median'])} ms, communication {ms(bound['communication']['median'])} ms "
                  f"(communication share of the step {bound['communication_share']['median']:.2f})",
                  f"- max(compute, communication) {ms(bound['max']['median'])} ms",
                  f"- buckets, overlap / max(compute, communication): {bound['overlap_over_max']['median']:.3f} "
                  f"({bound['overlap_over_max']['min']:.3f}..{bound['overlap_over_max']['max']:.3f})"]
    return lines


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--reps", type=int, default=DEFAULTS["reps"])
    parser.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    parser.add_argument("--width", type=int, default=DEFAULTS["width"])
    parser.add_argument("--depth", type=int, default=DEFAULTS["depth"])
    parser.add_argument("--input-width", type=int, default=DEFAULTS["input_width"],
                        help="features of the input (the first layer's in-width; default --width): a small first "
                             "layer makes the last bucket, the one backward finishes with, small")
    parser.add_argument("--batch", type=int, default=DEFAULTS["batch"])
    parser.add_argument("--bucket-mb", type=float, default=DEFAULTS["bucket_mb"])
    parser.add_argument("--allreduce", default=DEFAULTS["allreduce"])
    parser.add_argument("--network", default=DEFAULTS["network"],
                        help="a modeled link, e.g. '100 MB/s, 1 ms' (course_lib.network)")
    parser.add_argument("--compute-ms", default=DEFAULTS["compute_ms"],
                        help="modeled compute 'F,B': each layer with parameters takes F ms forward, B ms backward")
    parser.add_argument("--note", default="", help="free text stored with the results (e.g. what else ran)")
    parser.add_argument("--out", default=None, help="the results' stem (default benchmarks/results/overlap_figures)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    if args.reps < 9:
        parser.error("--reps must be at least 9: a median of fewer runs on a shared machine means little")
    options = {"world_size": args.world_size, "reps": args.reps, "steps": args.steps, "width": args.width,
               "depth": args.depth, "batch": args.batch, "bucket_mb": args.bucket_mb, "allreduce": args.allreduce,
               "samples": args.world_size * args.batch * (args.steps + 1), "note": args.note, "network": args.network,
               "compute_ms": [float(x) for x in args.compute_ms.split(",")] if args.compute_ms else None,
               "input_width": args.input_width}
    if options["compute_ms"] is not None and len(options["compute_ms"]) != 2:
        parser.error("--compute-ms takes two numbers, forward and backward milliseconds per layer: e.g. 2,25")
    model = build_model(options)
    params = list(model.parameters())
    load_before = [round(x, 2) for x in os.getloadavg()]
    started = time.perf_counter()
    per_rank = course_lib.launch(measure, args.world_size, args=(options,), backend="gloo", timeout=1800,
                                 network=args.network)
    result = {
        "options": options,
        "machine": bench.machine_description(),
        "load_before": load_before,
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "seconds": round(time.perf_counter() - started, 1),
        "parameters": sum(p.numel() for p in params),
        "gradient_mib": sum(p.numel() * p.element_size() for p in params) / 2**20,
        "buckets": len(training.plan_buckets(params, args.bucket_mb * 2**20)),
        **analyse(per_rank, options),
        "example_step_rank0": per_rank[0]["example_step"],
    }
    print("\n".join(section(key_of(options), result)))
    if not args.no_write:
        paths = write(result, args.out)
        print(f"written ({key_of(options)}):", *paths)
    return result


if __name__ == "__main__":
    main()
