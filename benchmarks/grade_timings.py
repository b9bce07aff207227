"""How long `python -m course_lib.grade` takes on every student notebook and every solution notebook.

    python benchmarks/grade_timings.py                 # 3 repetitions
    python benchmarks/grade_timings.py --reps 9 --note "quiet machine"

Every notebook that has exercises is graded as an instructor would grade it: one command per notebook, a
fresh Python process, a fresh kernel that runs the notebook top to bottom, then every exercise checked with
the hidden cases. Both versions of each notebook are timed: the student copy in assignments/ (the checks stop
at "not done yet") and the solution in notebooks/ (every hidden case runs). The runs are interleaved: each
repetition grades every notebook once, in a rotated order, so a change in the machine's load spreads over all
of them instead of landing on one. Every run must also score right (0 for a student copy, full marks for a
solution); the script exits with 1 when one does not.

Writes benchmarks/results/grade_timings.json (every run) and .md (median, min..max and spread per notebook,
and the total a whole class's grade takes). The machine's load average is recorded with them: on a shared
2-core machine the times depend on it, the scores do not.
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

from course_lib import bench

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def notebooks() -> list[pathlib.Path]:
    """Every student copy and its solution: assignments/NN_x.ipynb and notebooks/NN_x.ipynb."""
    students = sorted((ROOT / "assignments").glob("[0-9][0-9]_*.ipynb"))
    return [path for student in students for path in (student, ROOT / "notebooks" / student.name)]


def grade_once(path: pathlib.Path) -> dict:
    """Run the grading command on one notebook; its wall time and what it scored."""
    with tempfile.TemporaryDirectory() as folder:
        out = pathlib.Path(folder) / "results.json"
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "course_lib.grade", str(path), "--json", str(out)],
                              capture_output=True, text=True, cwd=folder)
        seconds = time.perf_counter() - started
        if done.returncode != 0 or not out.exists():
            return {"seconds": seconds, "score": None, "max_score": None, "error": done.stderr[-2000:]}
        tests = json.loads(out.read_text())["tests"]
    return {"seconds": seconds, "score": sum(t["score"] for t in tests), "max_score": sum(t["max_score"] for t in tests),
            "notes": [t["output"] for t in tests if t["name"].endswith(": notebook run")]}


def scored_right(kind: str, run: dict) -> bool:
    if run["score"] is None or run["notes"] or not run["max_score"]:
        return False
    return run["score"] == (0 if kind == "student" else run["max_score"])


def summary(seconds: list[float]) -> dict:
    median = statistics.median(seconds)
    return {"median": median, "min": min(seconds), "max": max(seconds),
            "spread": (max(seconds) - min(seconds)) / median if median else 0.0}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3, help="repetitions per notebook (3)")
    parser.add_argument("--note", default="", help="a line on the conditions, written with the results")
    parser.add_argument("--out", default=str(RESULTS / "grade_timings"), help="path without suffix")
    args = parser.parse_args(argv)

    paths = notebooks()
    load_before = os.getloadavg()
    runs = {str(p.relative_to(ROOT)): [] for p in paths}
    for rep in range(args.reps):
        order = paths[rep % len(paths):] + paths[:rep % len(paths)]    # rotated: no notebook always goes first
        for path in order:
            key = str(path.relative_to(ROOT))
            run = grade_once(path)
            run.update(rep=rep, load=os.getloadavg()[0])
            runs[key].append(run)
            print(f"rep {rep}  {key:45} {run['seconds']:6.1f} s  {run['score']}/{run['max_score']}", flush=True)
    load_after = os.getloadavg()

    rows, wrong = [], []
    for key, these in runs.items():
        kind = "student" if key.startswith("assignments/") else "solution"
        wrong += [f"{key} (rep {r['rep']}): {r['score']}/{r['max_score']} {r.get('error', '')}{r.get('notes', '')}"
                  for r in these if not scored_right(kind, r)]
        rows.append({"notebook": key, "kind": kind, **summary([r["seconds"] for r in these]),
                     "score": these[0]["score"], "max_score": these[0]["max_score"]})
    totals = {kind: summary([sum(r["seconds"] for key, these in runs.items() for r in these if r["rep"] == rep
                                 and key.startswith("assignments/" if kind == "student" else "notebooks/"))
                             for rep in range(args.reps)])
              for kind in ("student", "solution")}

    machine = {**bench.machine_description(), "load_before": [round(x, 2) for x in load_before],
               "load_after": [round(x, 2) for x in load_after], "note": args.note}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"machine": machine, "reps": args.reps, "rows": rows,
                                                    "totals": totals, "wrong": wrong, "runs": runs}, indent=1) + "\n")
    lines = [
        "# How long grading takes: `python -m course_lib.grade`, one notebook per command",
        "",
        f"`python benchmarks/grade_timings.py --reps {args.reps}`: every student copy (assignments/) and every "
        f"solution (notebooks/), {args.reps} interleaved repetitions; wall time of the whole command (a fresh "
        "Python, a fresh kernel running the notebook, then every exercise checked with the hidden cases).",
        "",
        f"Machine: {machine['cpus']} CPUs, torch {machine['torch']}, Python {machine['python']}, "
        f"{machine['date']}. Load average (1, 5, 15 min) before: {machine['load_before']}, after: "
        f"{machine['load_after']}." + (f" Note: {args.note}" if args.note else ""),
        "",
        "| notebook | version | score | seconds, median (min..max) | spread |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        lines.append(f"| {pathlib.Path(row['notebook']).name} | {row['kind']} | {row['score']:g}/{row['max_score']:g} | "
                     f"{row['median']:.1f} ({row['min']:.1f}..{row['max']:.1f}) | {row['spread']:.0%} |")
    lines += ["", "A whole set, one command per notebook, run after run (median (min..max) of the repetitions' sums):", ""]
    for kind, total in totals.items():
        count = sum(1 for row in rows if row["kind"] == kind)
        lines.append(f"- all {count} {kind} notebooks: {total['median']:.0f} s ({total['min']:.0f}..{total['max']:.0f})")
    lines += ["", "Every run scored right (student 0, solution full marks)." if not wrong else
              "Runs that did NOT score right:\n\n" + "\n".join(f"- {w}" for w in wrong)]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[6:]))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
