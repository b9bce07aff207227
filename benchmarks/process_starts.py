"""What a fresh Python costs before it does any work: the processes the test command starts by the hundred.

    python benchmarks/process_starts.py --reps 9          # writes benchmarks/results/process_starts.{json,md}

Each variant is one fresh interpreter (this one's `sys.executable`) running a few lines; what is measured is
its CPU time, user + system, as the kernel reports it for the ended child (`os.wait4`), so another process
beside it moves the figure little (its wall time is printed too, and moves a lot). The variants, one repetition
each in a rotated order per round, so that the machine's load spreads over all of them:

    python            nothing: the interpreter's own start
    import torch      what every rank started by spawn, every torchrun worker and every kernel pays first
    course_lib        `import course_lib` (it imports torch)
    sandbox kernel    what the grader's sandbox kernel imports before it answers: every exercise and IPython's shell
    judge             what the grader's judge loads before any submission runs (`course_grader.batch.preload`)
    first DDP wrap    a one-rank gloo group and DistributedDataParallel around a small model: DDP (and
                      torch.optim) import torch._dynamo on first use, which a forked rank pays for unless its
                      parent imported it

Reported: median and min..max of the CPU seconds, and the median wall seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

VARIANTS = {
    "python": "pass",
    "import torch": "import torch",
    "course_lib": "import course_lib",
    "sandbox kernel": ("from course_lib.exercises import registry\nregistry.all_exercises()\n"
                       "from IPython.core.interactiveshell import InteractiveShell\n"
                       "InteractiveShell.instance(colors='NoColor')"),
    "judge": "from course_grader import batch\nbatch.preload()",
    "first DDP wrap": ("import os, torch, torch.distributed as dist\n"
                       "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(29000 + os.getpid() % 2000))\n"
                       "dist.init_process_group('gloo', rank=0, world_size=1)\n"
                       "torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))\n"
                       "dist.destroy_process_group()"),
}


def measure(code: str) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one fresh interpreter running `code`."""
    with tempfile.TemporaryFile() as errors:       # a file, not a pipe: a child that writes much cannot block
        start = time.perf_counter()
        child = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=errors)
        _, status, usage = os.wait4(child.pid, 0)    # reaped here, with its rusage
        wall = time.perf_counter() - start
        child.returncode = os.waitstatus_to_exitcode(status)
        if child.returncode != 0:
            errors.seek(0)
            said = errors.read().decode(errors="replace")[-2000:]
            raise SystemExit(f"the variant failed ({child.returncode}):\n{code}\n{said}")
    return usage.ru_utime + usage.ru_stime, wall


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--out", default=str(RESULTS / "process_starts"), help="STEM: writes STEM.json, STEM.md")
    args = parser.parse_args(argv)
    names = list(VARIANTS)
    cpu = {name: [] for name in names}
    wall = {name: [] for name in names}
    load_before = os.getloadavg()[0]
    for rep in range(args.reps):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            seconds, elapsed = measure(VARIANTS[name])
            cpu[name].append(seconds)
            wall[name].append(elapsed)
        print(f"repetition {rep + 1}/{args.reps} done", flush=True)
    load_after = os.getloadavg()[0]
    rows = {name: {"cpu_median": statistics.median(cpu[name]), "cpu_min": min(cpu[name]), "cpu_max": max(cpu[name]),
                   "wall_median": statistics.median(wall[name]), "cpu": cpu[name], "wall": wall[name]}
            for name in names}
    import torch

    meta = {"reps": args.reps, "python": sys.version.split()[0], "torch": torch.__version__, "cores": os.cpu_count(),
            "load_before": load_before, "load_after": load_after, "date": time.strftime("%Y-%m-%d")}
    lines = ["# A fresh Python's cost before it works (benchmarks/process_starts.py)", "",
             f"CPU seconds (user + system) of one fresh interpreter, this machine ({meta['cores']} cores, Python "
             f"{meta['python']}, torch {meta['torch']}), {args.reps} repetitions, variants interleaved; load "
             f"average {load_before:.1f} before, {load_after:.1f} after. {meta['date']}.", "",
             "| variant | CPU s, median (min..max) | wall s, median |", "| --- | --- | --- |"]
    for name in names:
        row = rows[name]
        lines.append(f"| {name} | {row['cpu_median']:.2f} ({row['cpu_min']:.2f}..{row['cpu_max']:.2f}) | "
                     f"{row['wall_median']:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    pathlib.Path(args.out + ".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    pathlib.Path(args.out + ".md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
