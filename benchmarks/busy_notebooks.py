"""The notebooks that read this machine's clock, run on a busy machine: do their asserts still hold?

    python benchmarks/busy_notebooks.py                          # 01,06,08,09,10,11; 5 reps; WORLD_SIZE 2,3,4,8
    python benchmarks/busy_notebooks.py --notebooks 10 --reps 1 --out /tmp/quick

A learner's laptop or Colab is rarely quiet, so a lesson's assert on `time.perf_counter()` must hold with other
work beside it. This script starts `--busy` processes that spin on a core each (two by default, as many as this
machine's cores), then runs each notebook `--reps` times at every world size, interleaved (repetition by
repetition, notebook by notebook), and counts failures:

- WORLD_SIZE 4 (the size the notebooks are stored at): every cell, the exercise checks included, in a fresh kernel,
  as a learner runs it; outputs are not compared with the stored ones (the clock's numbers differ from run to run),
  only errors count.
- WORLD_SIZE 2, 3 and 8: the cells tests/test_notebook_world_sizes.py runs at those sizes (those that read
  WORLD_SIZE, and what they need), one kernel for the three.

The default notebooks are those whose cells time something on this machine's clock: `time.perf_counter()` in 01,
08 and 09, and `course_lib.bench` without a modeled network in 06, 10 and 11. Writes
benchmarks/results/busy_notebooks.{json,md}: per notebook and size, runs, failures, the failing cell's error, and
the load average while they ran.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import nbclient  # noqa: E402
import nbformat  # noqa: E402
import test_notebook_world_sizes as world_sizes  # noqa: E402  (its cell planner: the same cells CI runs)

OTHER_SIZES = (2, 3, 8)


def _notebook(prefix: str) -> pathlib.Path:
    matches = sorted((ROOT / "notebooks").glob(f"{prefix}_*.ipynb"))
    if not matches:
        raise SystemExit(f"no notebook notebooks/{prefix}_*.ipynb")
    return matches[0]


def _error_line(exc: BaseException) -> str:
    """The last line of the failing cell's traceback that names an exception (nbclient prints the whole cell)."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    named = [line for line in lines if "Error" in line or "Exception" in line]
    return (named or lines or [type(exc).__name__])[-1][:300]


def _run_whole(path: pathlib.Path) -> tuple:
    """Every cell at the stored WORLD_SIZE, in a fresh kernel. Returns (failed cell index or None, error)."""
    notebook = nbformat.read(path, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    running = []
    client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}},
                                     on_cell_start=lambda cell, cell_index: running.append(cell_index))
    try:
        world_sizes.execute_notebook(client)
    except Exception as exc:  # noqa: BLE001 - a cell's error, a timeout, a dead kernel: each is a failure here
        return (running[-1] if running else None), _error_line(exc)
    return None, ""


def _run_other_sizes(path: pathlib.Path) -> dict:
    """{size: error or ""} for WORLD_SIZE 2, 3, 8, as the world-size test runs them (a failure ends its size only)."""
    planned = world_sizes._planned_cells(path)
    outcome, remaining = {size: "" for size in OTHER_SIZES}, list(OTHER_SIZES)
    while remaining:
        failed = world_sizes._run_in_one_kernel(planned, remaining)
        if failed is None:
            break
        position, _in_reset, error = failed
        outcome[remaining[position]] = _error_line(error)
        remaining = remaining[position + 1:]
    return outcome


def _spinners(count: int) -> list:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def _write(args, paths, sizes, runs, loads, started) -> int:
    """Write the results so far (after every repetition, so a stopped run keeps what it ran); returns failures."""
    failures = sum(bool(e) for sizes_ in runs.values() for errors in sizes_.values() for e in errors)
    result = {
        "notebooks": [p.stem for p in paths], "reps": args.reps,
        "reps_done": min(len(e) for per in runs.values() for e in per.values()), "busy_processes": args.busy,
        "cores": os.cpu_count(), "world_sizes": sizes, "failures": failures,
        "load_average_1min": {"median": statistics.median(loads), "min": min(loads), "max": max(loads)},
        "wall_s": round(time.perf_counter() - started, 1),
        "runs": {name: {str(size): errors for size, errors in per.items()} for name, per in runs.items()},
    }
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# Notebooks on a busy machine: {args.busy} spinning processes on {os.cpu_count()} cores",
             "", f"`python benchmarks/busy_notebooks.py --notebooks {args.notebooks} --reps {args.reps} --busy {args.busy}`: {result['reps_done']} of {args.reps} runs "
             "per notebook and world size, interleaved; "
             f"1-minute load average median {result['load_average_1min']['median']:.1f} "
             f"({result['load_average_1min']['min']:.1f}..{result['load_average_1min']['max']:.1f}); "
             f"{result['wall_s'] / 60:.0f} min in all.", "",
             "| notebook | " + " | ".join(f"WORLD_SIZE {s}" for s in sizes) + " |",
             "| --- |" + " --- |" * len(sizes)]
    for name, per in runs.items():
        cells = [f"{sum(not e for e in per[s])}/{len(per[s])} passed" for s in sizes]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    errors = [(name, s, e) for name, per in runs.items() for s in sizes for e in per[s] if e]
    lines += ["", f"Failures: {failures}."] + [f"- {name} at WORLD_SIZE {s}: {e}" for name, s, e in errors]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--notebooks", default="01,06,08,09,10,11", help="notebook numbers, comma-separated")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--busy", type=int, default=2, help="processes spinning beside the notebooks")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "busy_notebooks"))
    args = parser.parse_args(argv)
    if args.reps < 1 or args.busy < 0:
        raise SystemExit("--reps must be at least 1 and --busy at least 0")
    paths = [_notebook(p.strip()) for p in args.notebooks.split(",") if p.strip()]
    sizes = sorted((4,) + OTHER_SIZES)
    runs = {p.stem: {size: [] for size in sizes} for p in paths}
    loads, started = [], time.perf_counter()
    spinners = _spinners(args.busy)
    try:
        for rep in range(args.reps):
            for path in paths:
                begun = time.perf_counter()
                cell, error = _run_whole(path)
                runs[path.stem][4].append(f"cell {cell}: {error}" if error else "")
                for size, error in _run_other_sizes(path).items():
                    runs[path.stem][size].append(error)
                loads.append(os.getloadavg()[0])
                failed = sum(bool(r[-1]) for r in runs[path.stem].values())
                print(f"rep {rep + 1}/{args.reps} {path.stem}: {time.perf_counter() - begun:.0f} s, "
                      f"load {loads[-1]:.1f}, {failed} of {len(sizes)} sizes failed", flush=True)
            _write(args, paths, sizes, runs, loads, started)
    finally:
        for spinner in spinners:
            spinner.kill()
    return 1 if any(e for per in runs.values() for errors in per.values() for e in errors) else 0


if __name__ == "__main__":
    sys.exit(main())
