"""A plain DistributedDataParallel training step on a modeled cluster: its modeled step time and this machine's
wall time for the launch.

    python benchmarks/ddp_modeled.py              # 9 launches of 64 ranks (8 nodes of 8 H100s), quiet machine

Each rank builds a 4-layer MLP (512 wide), wraps it in torch's own DistributedDataParallel (1 MiB buckets) and runs
three training steps (DDP's first backward is one bucket of everything, its second forward shares the rebuilt
buckets' order from rank 0; the third is a step as every later one). Compute
costs the FLOPs torch's FlopCounterMode counts, at an H100's dense BF16 peak, for 65,536 samples per GPU (16 rows
are computed, each counted 4,096 times); the buckets' all-reduces take what NCCL would run for them
(`course_lib.nccl`). Printed: the third step's modeled time on the slowest rank, and the launch's wall time,
median and range over the repetitions; results in benchmarks/results/ddp_modeled.json, one entry per cluster
size (``--nodes 16 --repetitions 3``: 128 ranks, whose launch notebook 13 reads instead of running it).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import course_lib  # noqa: E402
from course_lib.network import Network  # noqa: E402
from course_lib.training.modeled_compute import flop_compute  # noqa: E402

H100_BF16 = 989e12          # FLOP/s, H100 SXM dense BF16 (datasheet)
SAMPLES, COMPUTED = 65536, 16


def step(rank, world_size):
    torch.manual_seed(0)
    layers = []
    for i in range(4):
        layers += [torch.nn.Linear(512, 512), torch.nn.ReLU()]
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers, torch.nn.Linear(512, 10)),
                                                      bucket_cap_mb=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(COMPUTED, 512, generator=torch.Generator().manual_seed(rank))
    times = []
    for _ in range(3):
        start = course_lib.clock()
        with flop_compute(H100_BF16, scale=SAMPLES / COMPUTED):
            loss = model(x).square().mean()
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(course_lib.clock() - start)
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repetitions", type=int, default=9)
    parser.add_argument("--nodes", type=int, default=8)
    args = parser.parse_args(argv)
    cluster = Network.cluster(args.nodes, 8, "nvlink4", "ib_ndr")
    g = cluster.world_size
    walls, steps = [], []
    for repetition in range(args.repetitions):
        started = time.perf_counter()
        per_rank = course_lib.launch(step, g, network=cluster, timeout=600)
        walls.append(time.perf_counter() - started)
        steps.append(max(times[2] for times in per_rank))
        print(f"[{repetition + 1}/{args.repetitions}] {g} ranks: modeled step {steps[-1] * 1e6:.1f} us, "
              f"wall {walls[-1]:.1f} s", flush=True)
    summary = {"ranks": g, "cluster": cluster.describe(), "machine": platform.processor() or platform.machine(),
               "cpus": os.cpu_count(), "load_average": os.getloadavg(), "wall_s": walls, "modeled_step_s": steps,
               "wall_median_s": statistics.median(walls), "modeled_step_median_s": statistics.median(steps)}
    print(f"{g} ranks, DDP training step: modeled {summary['modeled_step_median_s'] * 1e6:.1f} us "
          f"(all repetitions {min(steps) * 1e6:.1f}..{max(steps) * 1e6:.1f}); launch wall time median "
          f"{summary['wall_median_s']:.1f} s ({min(walls):.1f}..{max(walls):.1f})")
    out = ROOT / "benchmarks" / "results" / "ddp_modeled.json"
    runs = json.loads(out.read_text()).get("runs", {}) if out.exists() else {}
    runs[str(g)] = summary                     # one entry per cluster size: 64 ranks by default, --nodes 16 for 128
    out.write_text(json.dumps({"runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
