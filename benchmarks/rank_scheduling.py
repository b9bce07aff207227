"""What Linux's scheduling policy for a launch's ranks costs: the default policy or SCHED_BATCH.

    python benchmarks/rank_scheduling.py                  # 2, 4 and 8 ranks; rings and training; 9 reps
    python benchmarks/rank_scheduling.py --sizes 8 --reps 9
    python benchmarks/rank_scheduling.py --busy 2 --sizes 4,8   # two busy processes take both cores throughout

Since 2026-11-28 `course_lib.launch` runs every gloo rank under SCHED_BATCH (`launch._schedule_as_batch`). A gloo
message wakes the receiver's gloo loop thread and then the rank waiting on it; under the default policy each woken
thread preempts whatever runs on its core at once, and with more ranks than cores a ring step becomes a string of
context switches. Under SCHED_BATCH a woken thread waits until the running one blocks or uses up its slice.

The "default" way is rebuilt inside the rank: before its work, the rank puts every thread it has (its own, gloo's,
torch's) back under SCHED_OTHER, the policy it had before; threads it starts later inherit that. Each case runs the two
ways in launches that take turns (their order alternates between repetitions), on this machine's clock (no modeled
network). Two workloads:

* rings: 200 course_lib ring all-reduces of 64 float32 (latency-bound: every step is a message);
* training: 30 training steps of `train_data_parallel` on the course's MLP (128 hidden units, 2 layers, batch 8 per
  rank, the gradients' all-reduce by the parameter server, as notebook 12's curves).

Per launch: the slowest rank's time (`time.perf_counter`) and the CPU time of all ranks together (`time.process_time`
of each rank's process, all its threads: what a busy machine, or CI, pays). Printed and written: median and spread
(min..max) over repetitions, and the ratio default / batch per repetition. `--busy N` starts N processes that
spin on the CPU for the whole run (as other programs, or CI's other test worker, would). Writes
benchmarks/results/rank_scheduling.{json,md} (or --out STEM): one run per N, each a section of the file; a run
replaces the one with the same N and keeps the others.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import course_lib  # noqa: E402
from course_lib import allreduce, training  # noqa: E402
from course_lib.training import toy  # noqa: E402

WAYS = ("default", "batch")
RINGS, STEPS = 200, 30


def _every_thread_back_to_the_default_policy() -> None:
    for thread in os.listdir("/proc/self/task"):
        os.sched_setscheduler(int(thread), os.SCHED_OTHER, os.sched_param(0))


def _work(rank, world_size, workload, way):
    """(seconds, CPU seconds of this rank's process) for one workload, after the policy of `way` is in place."""
    if way == "default":
        _every_thread_back_to_the_default_policy()
    assert os.sched_getscheduler(0) == (os.SCHED_OTHER if way == "default" else os.SCHED_BATCH)
    if workload == "rings":
        tensor = torch.randn(64, generator=torch.Generator().manual_seed(rank))
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(RINGS):
            allreduce.ring(tensor)
    else:
        data = toy.make_spirals(600, seed=1)
        model = toy.make_mlp(hidden=128, depth=2, seed=0)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        training.train_data_parallel(model, optimizer, data, F.cross_entropy, batch_size=8, epochs=10,
                                     max_steps=STEPS, allreduce="parameter_server")
    return time.perf_counter() - start, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2,4,8", help="world sizes, comma-separated")
    parser.add_argument("--workloads", default="rings,training")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--busy", type=int, default=0, help="busy processes beside the launches")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = args.out or os.path.join(ROOT, "benchmarks", "results", "rank_scheduling")
    if not hasattr(os, "SCHED_BATCH"):
        sys.exit("SCHED_BATCH is Linux's: nothing to compare on this system")
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        results = _measure(args)
    finally:
        for process in busy:
            process.kill()
            process.wait()
    _write(args, results, out)


def _measure(args) -> list:
    results = []
    for workload in args.workloads.split(","):
        per = RINGS if workload == "rings" else STEPS
        for world_size in (int(g) for g in args.sizes.split(",")):
            runs = {way: [] for way in WAYS}
            for rep in range(args.reps):
                for way in (WAYS if rep % 2 == 0 else WAYS[::-1]):
                    out = course_lib.launch(_work, world_size, args=(workload, way), backend="gloo", timeout=600)
                    runs[way].append((max(o[0] for o in out), sum(o[1] for o in out)))
            row = {"workload": workload, "world_size": world_size, "per": per, "cores": os.cpu_count()}
            for way in WAYS:
                for index, what in ((0, "wall"), (1, "cpu")):
                    values = [1e3 * r[index] / per for r in runs[way]]
                    row[f"{way}_{what}_ms"] = {"median": statistics.median(values), "min": min(values),
                                               "max": max(values)}
            for index, what in ((0, "wall"), (1, "cpu")):
                ratios = [a[index] / b[index] for a, b in zip(runs["default"], runs["batch"])]
                row[f"ratio_{what}"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
            results.append(row)
            print(json.dumps(row), flush=True)
    return results


def _write(args, results, out) -> None:
    """This run into OUT.json and OUT.md, beside the runs already there with another --busy (one section each)."""
    run = {"reps": args.reps, "busy": args.busy, "sizes": args.sizes, "workloads": args.workloads,
           "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "results": results}
    runs = sorted([r for r in _runs(out + ".json") if r["busy"] != args.busy] + [run], key=lambda r: r["busy"])
    with open(out + ".json", "w") as f:
        json.dump({"runs": runs}, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(markdown(runs))
    print("\n".join(_section(run)))


def _runs(path) -> list:
    """The runs written before (a file of one run without "runs" is that run)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        document = json.load(f)
    return document["runs"] if "runs" in document else [document]


def markdown(runs) -> str:
    lines = ["# A launch's ranks under the default scheduling policy or SCHED_BATCH", "",
             "One section per run of `python benchmarks/rank_scheduling.py` (`--busy N`: N busy processes beside the "
             "launches throughout). ms per ring all-reduce of 64 float32 (rings) or per training step (training), median "
             "(min..max) over repetitions; wall: the slowest rank, this machine's clock; CPU: all ranks' processes "
             "together; ratio: default / batch per repetition."]
    for run in runs:
        lines += [""] + _section(run)
    return "\n".join(lines) + "\n"


def _section(run) -> list:
    busy = run["busy"]
    lines = [f"## {f'{busy} busy processes beside the launches' if busy else 'Nothing else running'}", "",
             f"`python benchmarks/rank_scheduling.py --sizes {run.get('sizes', '?')} --workloads "
             f"{run.get('workloads', '?')} --reps {run['reps']}{f' --busy {busy}' if busy else ''}` on "
             f"{run.get('cores', '?')} cores, {run.get('date', 'date not recorded')}.", "",
             "| workload | ranks | wall: default | wall: batch | wall ratio | CPU: default | CPU: batch | CPU ratio |",
             "| --- | --- | ---: | ---: | --- | ---: | ---: | --- |"]

    def cell(d):
        return f"{d['median']:.2f} ({d['min']:.2f}..{d['max']:.2f})"

    for row in run["results"]:
        lines.append(f"| {row['workload']} | {row['world_size']} | {cell(row['default_wall_ms'])} | "
                     f"{cell(row['batch_wall_ms'])} | {cell(row['ratio_wall'])} | {cell(row['default_cpu_ms'])} | "
                     f"{cell(row['batch_cpu_ms'])} | {cell(row['ratio_cpu'])} |")
    return lines


if __name__ == "__main__":
    main()
