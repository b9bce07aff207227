"""How many ranks fit where: launch time and memory per rank at 8 to 128 ranks on the modeled clock (issue 25).

    python benchmarks/many_ranks.py                   # 9 launches per size, writes benchmarks/results/many_ranks.{md,json}
    python benchmarks/many_ranks.py --sizes 8,64 --reps 2 --out /tmp/quick

Each launch runs course_lib's ring all-reduce of 1 MiB per rank on InfiniBand NDR (`Network.preset("ib_ndr")`)
and checks its modeled time against `Network.predict`. Memory is PSS (proportional set size, Linux's
/proc/<pid>/smaps_rollup): pages shared by the forked ranks and the launcher are divided among them, so
the ranks' PSS and the launcher's add up to what the launch occupies. Each rank reads its own PSS after
the all-reduce; the launcher reads its own after the launch (the coordinator of the modeled clock lives
in it). Wall time is this machine's clock, from the call to launch() to its return.

What fits where (the README quotes the table): Colab gives a notebook about 12 GB, mybinder.org 1 to 2 GB.
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

import course_lib
from course_lib import allreduce
from course_lib.network import Network

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
MiB = 2 ** 20


def pss_mib(pid="self") -> float:
    """Proportional set size of a process in MiB (0 if the kernel does not report it)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def ring_and_memory(rank, world_size, nbytes):
    tensor = torch.ones(nbytes // 4)
    start = course_lib.clock()
    allreduce.ring(tensor)
    seconds = course_lib.clock() - start
    assert torch.all(tensor == world_size)
    return seconds, pss_mib()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="8,32,64,128")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--out", default=str(RESULTS / "many_ranks"))
    args = parser.parse_args(argv)
    net = Network.preset("ib_ndr")
    rows = []
    for world_size in [int(g) for g in args.sizes.split(",")]:
        walls, per_rank, totals, launcher, ratios = [], [], [], [], []
        for _ in range(args.reps):
            started = time.perf_counter()
            results = course_lib.launch(ring_and_memory, world_size, args=(MiB,), network=net, timeout=600)
            walls.append(time.perf_counter() - started)
            launcher.append(pss_mib())
            pss = [p for _s, p in results]
            per_rank.append(statistics.median(pss))
            totals.append(sum(pss) + launcher[-1])
            ratios.append(max(s for s, _p in results) / net.predict("ring", MiB, world_size))
        row = {"ranks": world_size, "wall_s": walls, "rank_pss_mib": per_rank, "total_pss_mib": totals,
               "launcher_pss_mib": launcher, "time_over_model": ratios}
        rows.append(row)
        print(f"{world_size} ranks: wall median {statistics.median(walls):.1f} s, a rank {statistics.median(per_rank):.0f} "
              f"MiB, all {statistics.median(totals):.0f} MiB", file=sys.stderr, flush=True)
    load = os.getloadavg()
    out = pathlib.Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"rows": rows, "reps": args.reps, "load_average_after": load,
                                                    "cpus": os.cpu_count(), "torch": torch.__version__}, indent=1))

    def cell(values, digits=1):
        return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}..{max(values):.{digits}f})"

    lines = [f"# Many ranks on this {os.cpu_count()}-core machine: ring all-reduce of 1 MiB per rank on ib_ndr, "
             f"{args.reps} launches per size", "",
             f"Medians (range). Memory is PSS in MiB. Load average at the end: {load[0]:.1f}.", "",
             "| ranks | launch wall (s) | PSS of a rank | PSS of the launch, all ranks + launcher | modeled time / predict |",
             "| --- | --- | --- | --- | --- |"]
    for row in rows:
        lines.append(f"| {row['ranks']} | {cell(row['wall_s'])} | {cell(row['rank_pss_mib'], 0)} | "
                     f"{cell(row['total_pss_mib'], 0)} | {cell(row['time_over_model'], 6)} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
