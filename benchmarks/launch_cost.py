"""What a 4-rank `course_lib.launch` costs: wall time per launch and the memory of the ranks.

    python benchmarks/launch_cost.py                 # in this process and inside a Jupyter kernel
    python benchmarks/launch_cost.py --no-kernel     # in this process only
    python benchmarks/launch_cost.py --launches 30 --world-size 8

Printed figures:

* launch time: median / min / max over `--launches` calls of `launch(fn, world_size)` with a trivial
  `fn`, and with `fn` doing a ring all-reduce of 1M floats (what a lesson cell typically does);
* memory, measured inside every rank with `resource.getrusage(RUSAGE_SELF).ru_maxrss` (peak resident
  set). A forked rank shares the parent's pages until it writes to them, and RSS counts shared pages in
  full in every process, so the sum over ranks is an upper bound. The fair share, PSS from
  /proc/self/smaps_rollup (each shared page divided among the processes sharing it), is printed next
  to it, and the parent's own RSS, so the total a 2 GB Binder session must hold can be read off.

Run "inside a Jupyter kernel" (the default, needs nbclient) executes the same measurement in a fresh
ipykernel with matplotlib imported, which is what a learner's notebook forks from.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

import torch

import course_lib
from course_lib import allreduce


def _pss_kib() -> int | None:
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _rss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def trivial(rank, world_size):
    return rank


def ring_of_a_million(rank, world_size):
    t = torch.randn(1_000_000, generator=torch.Generator().manual_seed(rank))
    allreduce.ring(t)
    return _rss_kib(), _pss_kib()


def measure(world_size: int = 4, launches: int = 20) -> dict:
    """Launch times (seconds) and the ranks' memory (KiB), measured in the calling process."""
    course_lib.launch(trivial, world_size, backend="gloo")  # first launch: imports, page faults
    timings = {}
    for name, fn in (("trivial", trivial), ("ring 1M floats", ring_of_a_million)):
        times = []
        for _ in range(launches):
            start = time.perf_counter()
            out = course_lib.launch(fn, world_size, backend="gloo")
            times.append(time.perf_counter() - start)
        timings[name] = times
    memory = out  # from the last ring launch: [(maxrss, pss) per rank]
    return {"world_size": world_size, "launches": launches, "times": timings,
            "rank_maxrss_kib": [m[0] for m in memory], "rank_pss_kib": [m[1] for m in memory],
            "parent_maxrss_kib": _rss_kib(), "parent_pss_kib": _pss_kib(),
            "load_average": os.getloadavg()[0], "cpus": os.cpu_count()}


def _report(where: str, result: dict) -> None:
    print(f"\n== {where}: {result['world_size']} ranks, {result['launches']} launches each, "
          f"{result['cpus']} CPUs, load average {result['load_average']:.2f}")
    for name, times in result["times"].items():
        print(f"  launch ({name:>14}): median {statistics.median(times):.3f} s, min {min(times):.3f} s, "
              f"max {max(times):.3f} s")
    mib = 1024
    maxrss, pss = result["rank_maxrss_kib"], result["rank_pss_kib"]
    print(f"  ranks' peak RSS (ru_maxrss): {[round(m / mib) for m in maxrss]} MiB, sum {sum(maxrss) / mib:.0f} MiB "
          "(upper bound: shared pages counted in every rank)")
    if all(p is not None for p in pss):
        print(f"  ranks' PSS at the end:       {[round(p / mib) for p in pss]} MiB, sum {sum(pss) / mib:.0f} MiB")
    parent_pss = result["parent_pss_kib"]
    print(f"  parent peak RSS {result['parent_maxrss_kib'] / mib:.0f} MiB"
          + (f", PSS {parent_pss / mib:.0f} MiB" if parent_pss else ""))
    if all(p is not None for p in pss) and parent_pss:
        print(f"  => parent + ranks, fair share (PSS): {(parent_pss + sum(pss)) / mib:.0f} MiB; "
              f"worst case (RSS): {(result['parent_maxrss_kib'] + sum(maxrss)) / mib:.0f} MiB")


def _in_kernel(world_size: int, launches: int) -> dict:
    import nbformat
    from nbclient import NotebookClient

    source = (f"import sys, json; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
              "import matplotlib.pyplot as plt, launch_cost\n"
              f"print(json.dumps(launch_cost.measure({world_size}, {launches})))")
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)])
    NotebookClient(notebook, timeout=600, kernel_name="python3").execute()
    text = "".join(o.get("text", "") for o in notebook.cells[0].outputs if o.get("name") == "stdout")
    return json.loads(text.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--launches", type=int, default=20)
    parser.add_argument("--no-kernel", action="store_true", help="skip the measurement inside a Jupyter kernel")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    results = {"script": measure(args.world_size, args.launches)}
    _report("in this Python process", results["script"])
    if not args.no_kernel:
        results["kernel"] = _in_kernel(args.world_size, args.launches)
        _report("inside a Jupyter kernel (what a notebook cell forks from)", results["kernel"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
