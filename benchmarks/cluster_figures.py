"""All-reduces and training on modeled H100 clusters (nodes of 8 on NVSwitch, InfiniBand NDR between them) at 8,
64 and 128 GPUs, with more sizes than notebook 13 shows, and what a launch of that many ranks costs this machine.

    python benchmarks/cluster_figures.py                       # writes benchmarks/results/cluster_figures.{md,json}
    python benchmarks/cluster_figures.py --quick --out /tmp/c  # no 128-rank launches

1. **All-reduces** (the modeled clock, replayed): at 8, 64 and 128 GPUs, 8 KiB, 1 MiB and 64 MiB per rank, one
   InfiniBand port per GPU and one per node: a single ring in rank order (course_lib.allreduce.ring), torch's
   dist.all_reduce (`torch_collectives.collective_time`: what `course_lib.nccl` says NCCL runs, algorithm/protocol shown)
   and notebook 13's hierarchical all-reduce (tests/planted_bugs_hierarchical.hier_notebook, its schedule recorded
   with `hierarchical.record_schedule` and replayed), with each time's bus bandwidth.
2. **Launches read the replays**: 64 and 128 ranks launched on the modeled cluster, the three all-reduces at 1 MiB
   (the single ring at 64 only), each rank timing with course_lib.clock(); asserted equal to the replays (1e-9).
3. **Training with course_lib's trainer** (make_mlp 4 x 512, buckets of 1 MiB overlapped with backward, torch's
   all-reduce, compute at 989 TFLOP/s for 131,072 samples per GPU): one step launched at 8, 64 and 128 ranks,
   against the bucket schedule's model of the step (asserted within 1e-6), with the scaling efficiency. Notebook 13
   trains with torch's own DistributedDataParallel instead: `benchmarks/ddp_modeled.py`.
4. **What a launch costs this machine** (its own clock, with the load average beside it): an empty function at 8,
   64 and 128 ranks, and one hierarchical all-reduce of 8 KiB (a message count known in advance), so the cost per
   modeled message is the difference over the count.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import course_lib  # noqa: E402
import planted_bugs_hierarchical as pb  # noqa: E402
from course_lib import allreduce, torch_collectives, training  # noqa: E402
from course_lib.exercises import hierarchical  # noqa: E402
from course_lib.network import Network  # noqa: E402
from course_lib.simulation import replay  # noqa: E402
from course_lib.training.buckets import plan_buckets  # noqa: E402
from course_lib.training.modeled_compute import model_flops, with_flops_compute  # noqa: E402

K = 8
KiB, MiB = 1024, 2 ** 20
PEAK = 989e12
B_PER_GPU = 131072
SIZES = (8 * KiB, MiB, 64 * MiB)


def cluster(nodes, nics="per_gpu"):
    return Network.cluster(nodes, K, "nvlink4", "ib_ndr", nics=nics)


def bus_bandwidth(nbytes, seconds, world_size):
    return nbytes / seconds * 2 * (world_size - 1) / world_size


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


# --------------------------------------------------------------------------------------------------
# 1. All-reduces, replayed
# --------------------------------------------------------------------------------------------------


def allreduce_table(world_sizes):
    rows = []
    for G in world_sizes:
        for nics in ("per_gpu", "per_node"):
            net = cluster(G // K, nics)
            for n in SIZES:
                flat = replay(hierarchical.record_schedule(allreduce.ring, G, n // 4), net).seconds
                mine = replay(hierarchical.record_schedule(pb.hier_notebook, G, n // 4, K), net).seconds
                theirs, algorithm = torch_collectives.collective_time(net, "all_reduce", n, range(G), with_algorithm=True)
                assert math.isclose(flat, net.predict("ring", n, G), rel_tol=1e-9)
                assert math.isclose(mine, net.predict("hierarchical", n, G), rel_tol=1e-9)
                rows.append({"G": G, "nics": nics, "bytes": n, "flat_ring": flat, "torch": theirs,
                             "torch_algorithm": algorithm, "hierarchical": mine,
                             "busbw_flat": bus_bandwidth(n, flat, G), "busbw_hierarchical": bus_bandwidth(n, mine, G)})
                print(f"  {G:>4} {nics:<8} {n // KiB:>6} KiB  flat {flat * 1e6:9.1f} us  torch {theirs * 1e6:9.1f} us "
                      f"({algorithm})  hierarchical {mine * 1e6:8.1f} us", flush=True)
    return rows


# --------------------------------------------------------------------------------------------------
# 2. Launches
# --------------------------------------------------------------------------------------------------


def _time_calls(rank, world_size, nbytes, names):
    calls = {"flat ring": allreduce.ring, "torch": lambda t: dist.all_reduce(t),
             "hierarchical": lambda t: pb.hier_notebook(t, K)}
    out = {}
    for name in names:
        tensor = torch.full((nbytes // 4,), float(rank + 1))
        dist.barrier()
        start = course_lib.clock()
        calls[name](tensor)
        out[name] = course_lib.clock() - start
        assert torch.all(tensor == world_size * (world_size + 1) / 2)
    return out


def launched_allreduces(world_sizes):
    rows = []
    for G in world_sizes:
        net = cluster(G // K)
        names = ("flat ring", "torch", "hierarchical") if G <= 64 else ("torch", "hierarchical")
        start = time.perf_counter()
        per_rank = course_lib.launch(_time_calls, G, args=(MiB, names), network=net, timeout=1800)
        wall = time.perf_counter() - start
        for name in names:
            got = max(r[name] for r in per_rank)
            model = {"flat ring": lambda: net.predict("ring", MiB, G),
                     "torch": lambda: torch_collectives.collective_time(net, "all_reduce", MiB, range(G)),
                     "hierarchical": lambda: net.predict("hierarchical", MiB, G)}[name]()
            assert math.isclose(got, model, rel_tol=1e-9), (G, name, got, model)
            rows.append({"G": G, "name": name, "launched": got, "replayed": model, "wall_s": wall, "load": load()})
        print(f"  {G} ranks launched ({', '.join(names)} at 1 MiB): equal to the replays; {wall:.1f} s wall, "
              f"load {load()}", flush=True)
    return rows


# --------------------------------------------------------------------------------------------------
# 3. Training
# --------------------------------------------------------------------------------------------------


def course_model():
    return training.make_mlp(in_features=2, hidden=512, out_features=3, depth=4, seed=0)


def _train(rank, world_size, samples):
    model = with_flops_compute(course_model(), samples, PEAK)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    log = training.train_data_parallel(model, optimizer, training.make_spirals(4096, seed=0), F.cross_entropy,
                                       batch_size=4, max_steps=1, allreduce=lambda t, op="sum": dist.all_reduce(t),
                                       bucket_mb=1.0, overlap=True)
    return log.timeline[-1].total


@functools.lru_cache(maxsize=None)
def _bucket_seconds(G, nbytes):
    return torch_collectives.collective_time(cluster(G // K), "all_reduce", nbytes, range(G))


def modeled_step(G, samples):
    """The notebook's model of one step: buckets ready as backward reaches them, all-reduced one after another."""
    base = course_model()
    flops = model_flops(base, samples)
    fwd = sum(f for _, f, _ in flops) / PEAK
    bwd = [b / PEAK for _, _, b in flops]
    layer_of = [i for i, (index, _, _) in enumerate(flops) for _ in base[index].parameters()]
    ready_after = [sum(bwd[j:]) for j in range(len(bwd))]
    free = 0.0
    for bucket in plan_buckets(list(base.parameters()), MiB):
        free = max(ready_after[layer_of[min(bucket.params)]], free) + _bucket_seconds(G, bucket.nbytes)
    return fwd + max(sum(bwd), free), fwd + sum(bwd)


def training_rows(world_sizes):
    rows = []
    for G in world_sizes:
        start = time.perf_counter()
        per_rank = course_lib.launch(_train, G, args=(B_PER_GPU,), network=cluster(G // K), timeout=3600)
        wall = time.perf_counter() - start
        got = max(per_rank)
        model, compute = modeled_step(G, B_PER_GPU)
        assert abs(got / model - 1) < 1e-6, (G, got, model)
        rows.append({"G": G, "step": got, "model": model, "compute": compute, "efficiency": compute / got,
                     "model_efficiency": compute / model, "global_batch": G * B_PER_GPU, "wall_s": wall,
                     "load": load()})
        print(f"  {G:>4} GPUs: step {got * 1e6:.1f} us (model {model * 1e6:.1f} us), efficiency "
              f"{100 * compute / got:.1f}%; launch {wall:.1f} s wall, load {load()}", flush=True)
    return rows


# --------------------------------------------------------------------------------------------------
# 4. What a launch costs
# --------------------------------------------------------------------------------------------------


def _empty(rank, world_size):
    return None


def _one_hierarchical(rank, world_size):
    pb.hier_notebook(torch.ones(2048), K)


def launch_costs(world_sizes):
    rows = []
    for G in world_sizes:
        net = cluster(G // K)
        start = time.perf_counter()
        course_lib.launch(_empty, G, network=net, timeout=1800)
        empty = time.perf_counter() - start
        start = time.perf_counter()
        course_lib.launch(_one_hierarchical, G, network=net, timeout=1800)
        one = time.perf_counter() - start
        messages = sum(1 for events in hierarchical.record_schedule(pb.hier_notebook, G, 2048, K)
                       for e in events if e[0] in ("send", "isend"))
        rows.append({"G": G, "empty_launch_s": empty, "one_allreduce_s": one, "messages": messages,
                     "ms_per_message": 1e3 * (one - empty) / messages, "load": load()})
        print(f"  {G:>4} ranks: empty launch {empty:.1f} s, with one hierarchical all-reduce ({messages} messages) "
              f"{one:.1f} s: {1e3 * (one - empty) / messages:.2f} ms per message; load {load()}", flush=True)
    return rows


# --------------------------------------------------------------------------------------------------


def write(out, results):
    out = pathlib.Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    intra, inter = Network.preset("nvlink4"), Network.preset("ib_ndr")
    lines = ["# A cluster on the modeled clock: all-reduces and training at 8, 64 and 128 GPUs", "",
             f"`python benchmarks/cluster_figures.py`; {results['machine']}. H100 nodes of 8 on NVSwitch "
             f"({intra.describe()}), InfiniBand NDR between nodes ({inter.describe()}). Times are the modeled "
             "clock's (the same on every run); wall times and load are this machine's.", "",
             "## All-reduces (replayed schedules; torch = collective_time, what course_lib.nccl says NCCL runs)", "",
             "| GPUs | ports | size | flat ring | torch | hierarchical | flat / hierarchical | busbw flat | busbw hier. |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results["allreduces"]:
        lines.append(f"| {r['G']} | {r['nics']} | {r['bytes'] // KiB} KiB | {r['flat_ring'] * 1e6:.1f} us | "
                     f"{r['torch'] * 1e6:.1f} us ({r['torch_algorithm']}) | {r['hierarchical'] * 1e6:.1f} us | "
                     f"{r['flat_ring'] / r['hierarchical']:.2f} | {r['busbw_flat'] / 1e9:.1f} GB/s | "
                     f"{r['busbw_hierarchical'] / 1e9:.1f} GB/s |")
    lines += ["", "## Launched on the modeled cluster (1 MiB per rank): equal to the replays (1e-9)", "",
              "| GPUs | all-reduce | launched | replayed | launch wall | load |", "| ---: | --- | ---: | ---: | ---: | --- |"]
    for r in results["launched"]:
        lines.append(f"| {r['G']} | {r['name']} | {r['launched'] * 1e6:.2f} us | {r['replayed'] * 1e6:.2f} us | "
                     f"{r['wall_s']:.1f} s | {r['load']} |")
    lines += ["", f"## Training one step (b = {B_PER_GPU:,} samples per GPU at {PEAK / 1e12:.0f} TFLOP/s, buckets of "
              "1 MiB, torch's all-reduce)", "",
              "| GPUs | step (launched) | model | efficiency | model's | global batch | launch wall | load |",
              "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in results["training"]:
        lines.append(f"| {r['G']} | {r['step'] * 1e6:.1f} us | {r['model'] * 1e6:.1f} us | "
                     f"{100 * r['efficiency']:.1f}% | {100 * r['model_efficiency']:.1f}% | {r['global_batch']:,} | "
                     f"{r['wall_s']:.1f} s | {r['load']} |")
    lines += ["", "## What a launch costs this machine (its own clock)", "",
              "| ranks | empty launch | + one hierarchical all-reduce of 8 KiB | modeled messages | per message | load |",
              "| ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in results["launch_costs"]:
        lines.append(f"| {r['G']} | {r['empty_launch_s']:.1f} s | {r['one_allreduce_s']:.1f} s | {r['messages']} | "
                     f"{r['ms_per_message']:.2f} ms | {r['load']} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.md')} and .json")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="no 128-rank launches")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cluster_figures"))
    args = parser.parse_args(argv)
    big = (64,) if args.quick else (64, 128)
    torch.set_num_threads(1)
    results = {"machine": f"{os.cpu_count()} CPUs, load at start {load()}"}
    print("1. all-reduces, replayed", flush=True)
    results["allreduces"] = allreduce_table((8, 64, 128))
    print("2. launched", flush=True)
    results["launched"] = launched_allreduces(big)
    print("3. training", flush=True)
    results["training"] = training_rows((8,) + big)
    print("4. launch costs", flush=True)
    results["launch_costs"] = launch_costs((8,) + big)
    write(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
