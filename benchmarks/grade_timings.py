"""How long `python -m course_grader` takes: one student's 8 notebooks in one command, and a class of 20.

    python benchmarks/grade_timings.py submission --all --reps 9     # every graded notebook (00-11 and 13)
    python benchmarks/grade_timings.py submission --reps 9 --quiet-load 1.5 --out /tmp/grade_00_07
                                     # the 8 notebooks of 00-07 only, 9 repetitions
    python benchmarks/grade_timings.py class --reps 3 --quiet-load 1.5 --out /tmp/grade_class   # 20 students

**submission**: the 8 notebooks of one submission (00 to 07) graded by one command, as Gradescope's
run_autograder grades them: `python -m course_grader 00_....ipynb ... 07_....ipynb --json results.json`,
which grades up to one notebook per core at a time. Two submissions, interleaved (each repetition grades both,
in alternating order, so a change in the machine's load spreads over both): the complete, correct one
(the solutions in notebooks/) and the empty one (the student copies in assignments/, every check "not done
yet"). Every run must score right (72/72 and 0/72); the script exits with 1 when one does not. Where the time
goes is read from results.json's extra_data (the grader's own timings per notebook: starting the sandbox,
running the cells, each exercise's checks, stopping).

**class**: 20 synthetic students in one command, `python -m course_grader --class DIR --out grades/`:
each student's folder holds all 8 notebooks, student i's notebook k the solution when (i + k) % 3 != 0 and
the empty student copy otherwise (so about two thirds done, every notebook both ways across the class). The
run must show its progress (one line per notebook), write one results file per student and grades.csv, and
every student's total must be the sum of the points of their solved notebooks.

Wall time of the whole command (a fresh Python each time). With --quiet-load L the script first waits, polling
every minute for up to --wait minutes, until the 1-minute load average is below L, then runs anyway; the load
before every run is recorded with it. Reported: median, min..max and spread ((max - min) / median) of the
repetitions. submission writes benchmarks/results/grade_timings.{json,md} (or --out STEM): the figures
README.md quotes are `submission --all`'s, and the earlier runs it quotes are the last section of that file.
class prints its report, and writes STEM.{json,md} with --out STEM.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from course_lib import bench

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
STUDENTS = int(os.environ.get("GRADE_TIMINGS_STUDENTS", 20))     # fewer only to try the script out


PATTERN = "0[0-7]_*.ipynb"     # the 8 notebooks of 00-07; --all: every notebook that has a student copy


def notebooks(folder: str) -> list[pathlib.Path]:
    """The graded notebooks (00 to 07, or with --all every one in assignments/) of notebooks/ (solutions) or
    assignments/ (student copies)."""
    names = sorted(p.name for p in (ROOT / "assignments").glob(PATTERN))
    return [ROOT / folder / name for name in names]


def points(path: pathlib.Path) -> float:
    from course_lib.exercises import registry

    return sum(e.points for e in registry.all_exercises() if e.notebook == path.stem)


def load1() -> float:
    return round(os.getloadavg()[0], 2)


def wait_for_quiet(limit: float | None, minutes: float) -> dict:
    """Poll the 1-minute load average every minute until it is below `limit` (or `minutes` have passed)."""
    if limit is None:
        return {"limit": None, "waited_s": 0, "quiet": None, "load": load1()}
    started = time.monotonic()
    while load1() >= limit and time.monotonic() - started < minutes * 60:
        print(f"load {load1()} >= {limit}: waiting ({(time.monotonic() - started) / 60:.0f} of {minutes:g} min)",
              flush=True)
        time.sleep(60)
    return {"limit": limit, "waited_s": round(time.monotonic() - started), "quiet": load1() < limit, "load": load1()}


def summary(values) -> dict:
    values = list(values)
    median = statistics.median(values)
    return {"median": round(median, 3), "min": round(min(values), 3), "max": round(max(values), 3),
            "spread": round((max(values) - min(values)) / median, 3) if median else 0.0, "n": len(values)}


def grade(args, cwd) -> tuple[float, subprocess.CompletedProcess]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "course_grader", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd)
    return time.perf_counter() - started, done


# --------------------------------------------------------------------------------------------------
# One submission, 8 notebooks, one command
# --------------------------------------------------------------------------------------------------


def run_submission(kind: str) -> dict:
    paths = notebooks("notebooks" if kind == "correct" else "assignments")
    with tempfile.TemporaryDirectory() as folder:
        out = pathlib.Path(folder) / "results.json"
        load = load1()
        seconds, done = grade([*paths, "--json", out], folder)
        results = json.loads(out.read_text()) if out.exists() else None
    run = {"kind": kind, "seconds": round(seconds, 3), "load_before": load, "exit": done.returncode,
           "isolation": next((line.split(":")[0] for line in done.stderr.splitlines() if line.startswith("grading ")),
                             "")}
    if results is None:
        return run | {"score": None, "error": done.stderr[-2000:]}
    run.update(score=results["score"], max_score=round(sum(t["max_score"] for t in results["tests"]), 2),
               notes=[t["output"] for t in results["tests"] if t["name"].endswith(": notebook run")],
               notebooks=results["extra_data"]["notebooks"])
    return run


def scored_right(run: dict, possible: float) -> bool:
    if run["exit"] != 0 or run.get("score") is None or run["notes"] or run["max_score"] != possible:
        return False
    return run["score"] == (possible if run["kind"] == "correct" else 0)


def where_the_time_goes(runs: list) -> list[dict]:
    """Per notebook, the median over the runs of the grader's own timings."""
    rows = []
    for name in runs[0]["notebooks"]:
        these = [run["notebooks"][name] for run in runs]
        rows.append({"notebook": name,
                     "seconds": statistics.median(t["seconds"] for t in these),
                     "sandbox start": statistics.median(t["sandbox start"] for t in these),
                     "cells": statistics.median(t["cells"] for t in these),
                     "checks": statistics.median(sum(t["checks"].values()) for t in these),
                     "stop": statistics.median(t["stop"] for t in these),
                     "slowest check": max(these[0]["checks"], key=lambda k: statistics.median(t["checks"][k]
                                                                                           for t in these))})
    return rows


def who(data: dict) -> str:
    runs = data.get("runs") or [{}]
    isolation = runs[0].get("isolation") or ""
    if isolation:          # what the grader said it did: "grading with namespaces", "grading without namespaces ..."
        return f" Graded as {'root' if data['root'] else 'an ordinary user'}, {isolation.split(' (')[0]}."
    return (" Graded as root, as on Gradescope: every sandbox ran as an unprivileged user." if data["root"] else
            " Graded without root: the sandboxes ran as the grader's own user.")


def submission_markdown(data: dict) -> str:
    names = data.get("notebooks") or [f"0{k}" for k in range(8)]
    count, span = len(names), f"{names[0][:2]}-{names[-1][:2]}"
    reps, machine = data["reps"], data["machine"]
    lines = [
        f"# How long grading one student's {count} notebooks takes: `python -m course_grader`, one command",
        "",
        f"`python benchmarks/grade_timings.py submission{' --all' if data.get('all') else ''} --reps {reps}"
        + (f" --quiet-load {data['quiet']['limit']:g}`" if data["quiet"]["limit"] else "`")
        + f": the {count} notebooks {span} of one submission in one command (`--json results.json`, up to one notebook per "
        f"core at a time), the complete correct submission (notebooks/) and the empty one (assignments/), "
        f"{reps} interleaved repetitions each; wall time of the whole command, a fresh Python each time.",
        "",
        f"Machine: {machine['cpus']} CPUs ({machine['cpu_model']}), torch {machine['torch']}, Python "
        f"{machine['python']}, {machine['date']}. 1-minute load average before each run: median "
        f"{data['load_before']['median']:g} ({data['load_before']['min']:g}..{data['load_before']['max']:g}); "
        + ("waited " + f"{data['quiet']['waited_s'] // 60} min for a load below {data['quiet']['limit']:g}"
           + (" and got it" if data["quiet"]["quiet"] else ", then ran anyway (other work on the machine)")
           if data["quiet"]["limit"] else "did not wait for a quiet machine") + "."
        + who(data) + (f" Note: {data['note']}" if data["note"] else ""),
        "",
        "| submission | score | seconds, median (min..max) | spread |",
        "| --- | --- | --- | --- |",
    ]
    for kind, row in data["totals"].items():
        lines.append(f"| {kind} | {row['score']:g}/{row['max_score']:g} | {row['median']:.1f} ({row['min']:.1f}.."
                     f"{row['max']:.1f}) | {row['spread']:.0%} |")
    correct = data["totals"]["correct"]
    lines += ["", f"Target: under 60 s for the complete submission on this 2-core machine: "
                  f"{'met' if correct['max'] < 60 else 'met by the median' if correct['median'] < 60 else 'NOT met'} "
                  f"(median {correct['median']:.1f} s, slowest run {correct['max']:.1f} s).", ""]
    lines += ["Where the time goes, complete submission (the grader's own timings per notebook, median of the "
              "runs; the notebooks run two at a time, so their sum is about twice the wall time):", "",
              "| notebook | seconds | sandbox start | cells | checks | stop | slowest check |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    rows = data["where"]["correct"]
    for row in rows:
        lines.append(f"| {row['notebook']} | {row['seconds']:.1f} | {row['sandbox start']:.1f} | {row['cells']:.1f} | "
                     f"{row['checks']:.1f} | {row['stop']:.2f} | {row['slowest check']} |")
    total = {k: sum(r[k] for r in rows) for k in ("seconds", "sandbox start", "cells", "checks", "stop")}
    lines.append(f"| all {count} | {total['seconds']:.1f} | {total['sandbox start']:.1f} | {total['cells']:.1f} | "
                 f"{total['checks']:.1f} | {total['stop']:.2f} | |")
    jobs = machine["cpus_usable"]
    lines += ["", f"Of the notebooks' {total['seconds']:.0f} s, starting the {count} sandboxes (a Python that imports torch, "
                  f"IPython and the exercises) takes {total['sandbox start'] / total['seconds']:.0%}, running the cells "
                  f"the answers need {total['cells'] / total['seconds']:.0%}, the checks with the hidden cases "
                  f"{total['checks'] / total['seconds']:.0%}. On {jobs} cores those {total['seconds']:.0f} s are "
                  f"{total['seconds'] / jobs:.0f} s of wall time; the rest of the command's {correct['median']:.0f} s "
                  "is starting the grader, importing what the judge needs before any submission runs, and the end of "
                  "the run, when fewer notebooks than cores are left.", ""]
    possible = f"{correct['max_score']:g}"
    lines += [f"Every run scored right ({possible}/{possible} complete, 0/{possible} empty) and exited 0." if not data["wrong"] else
              "Runs that did NOT score right:\n\n" + "\n".join(f"- {w}" for w in data["wrong"])]
    return "\n".join(lines) + "\n"


def submission(args) -> int:
    possible = sum(points(p) for p in notebooks("notebooks"))
    quiet = wait_for_quiet(args.quiet_load, args.wait)
    machine = bench.machine_description()
    runs = []
    for rep in range(args.reps):
        for kind in (("correct", "empty") if rep % 2 == 0 else ("empty", "correct")):
            run = run_submission(kind)
            run["rep"] = rep
            runs.append(run)
            print(f"rep {rep}  {kind:8} {run['seconds']:6.1f} s  {run.get('score')}/{run.get('max_score')}  "
                  f"load {run['load_before']}", flush=True)
    wrong = [f"{r['kind']} (rep {r['rep']}): {r.get('score')}/{r.get('max_score')}, exit {r['exit']} "
             f"{r.get('error', '')}{r.get('notes', '')}" for r in runs if not scored_right(r, possible)]
    totals, where = {}, {}
    for kind in ("correct", "empty"):
        these = [r for r in runs if r["kind"] == kind]
        totals[kind] = {**summary(r["seconds"] for r in these), "score": these[0].get("score") or 0,
                        "max_score": possible}
        good = [r for r in these if "notebooks" in r]
        where[kind] = where_the_time_goes(good) if good else []
    data = {"machine": machine, "reps": args.reps, "note": args.note, "quiet": quiet, "root": os.geteuid() == 0,
            "load_before": summary(r["load_before"] for r in runs), "load_after": load1(),
            "totals": totals, "where": where, "wrong": wrong, "runs": runs, "all": args.all,
            "notebooks": [p.name for p in notebooks("notebooks")]}
    out = pathlib.Path(args.out or RESULTS / "grade_timings")
    out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    text = submission_markdown(data)
    out.with_suffix(".md").write_text(text)
    print(text)
    return 1 if wrong else 0


# --------------------------------------------------------------------------------------------------
# A class of 20 in one command
# --------------------------------------------------------------------------------------------------


def make_class(folder: pathlib.Path) -> dict:
    """20 student folders of 8 notebooks each (see the module docstring); {student: expected score}."""
    solutions, copies = notebooks("notebooks"), notebooks("assignments")
    expected = {}
    for i in range(STUDENTS):
        student = folder / f"student{i:02d}"
        student.mkdir(parents=True)
        expected[student.name] = 0.0
        for k, (solution, copy) in enumerate(zip(solutions, copies)):
            done = (i + k) % 3 != 0
            shutil.copy(solution if done else copy, student / solution.name)
            expected[student.name] += points(solution) if done else 0
    return expected


def run_class(jobs) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        folder = pathlib.Path(folder)
        expected = make_class(folder / "class")
        load = load1()
        seconds, done = grade(["--class", folder / "class", "--out", folder / "grades"]
                              + (["--jobs", str(jobs)] if jobs else []), folder)
        progress = [line for line in done.stderr.splitlines() if line.startswith("[")]
        files = sorted(p.name for p in (folder / "grades").glob("*.json"))
        rows = list(csv.DictReader((folder / "grades" / "grades.csv").open())) if (folder / "grades" /
                                                                                  "grades.csv").exists() else []
    problems = []
    if done.returncode != 0:
        problems.append(f"exit {done.returncode}: {done.stderr[-1000:]}")
    if len(progress) != 8 * STUDENTS or not progress[-1].startswith(f"[{8 * STUDENTS}/{8 * STUDENTS}]"):
        problems.append(f"{len(progress)} progress lines")
    if files != sorted(f"{name}.json" for name in expected):
        problems.append(f"results files: {files}")
    scores = {row["submission"]: float(row["score"]) for row in rows}
    if scores != expected:
        problems.append(f"scores {scores} instead of {expected}")
    return {"seconds": round(seconds, 3), "load_before": load, "exit": done.returncode, "progress_lines": len(progress),
            "first_progress": progress[:2], "results_files": len(files), "csv_rows": len(rows), "problems": problems}


def class_markdown(data: dict) -> str:
    reps, machine, total = data["reps"], data["machine"], data["total"]
    per_student = total["median"] / STUDENTS
    lines = [
        f"# How long grading a class takes: {STUDENTS} students' 8 notebooks in one command",
        "",
        f"`python benchmarks/grade_timings.py class --reps {reps}"
        + (f" --quiet-load {data['quiet']['limit']:g}`" if data["quiet"]["limit"] else "`")
        + f": `python -m course_grader --class DIR --out grades/` on {STUDENTS} synthetic students, each with all 8 "
        "notebooks 00-07 (student i's notebook k solved when (i + k) % 3 != 0, else the empty student copy: "
        f"{data['notebooks_solved']} of {8 * STUDENTS} notebooks solved), up to one notebook per core at a time. "
        f"{reps} repetitions (a class run takes minutes; fewer than the 9 of the one-student benchmark).",
        "",
        f"Machine: {machine['cpus']} CPUs ({machine['cpu_model']}), torch {machine['torch']}, Python "
        f"{machine['python']}, {machine['date']}. 1-minute load average before each run: "
        + ", ".join(f"{run['load_before']:g}" for run in data["runs"]) + "; "
        + ("waited " + f"{data['quiet']['waited_s'] // 60} min for a load below {data['quiet']['limit']:g}"
           + (" and got it" if data["quiet"]["quiet"] else ", then ran anyway (other work on the machine)")
           if data["quiet"]["limit"] else "did not wait for a quiet machine") + "."
        + who(data) + (f" Note: {data['note']}" if data["note"] else ""),
        "",
        f"- wall time of the command: median {total['median']:.0f} s ({total['min']:.0f}..{total['max']:.0f}), "
        f"spread {total['spread']:.0%}, over {reps} runs",
        f"- per student: {per_student:.1f} s; a class of 200 at this rate: about {200 * per_student / 60:.0f} min "
        "(extrapolated, not measured)",
        f"- every run printed {8 * STUDENTS} progress lines (one per notebook, with the time left), wrote "
        f"{STUDENTS} results files and grades.csv with {STUDENTS} rows, and every student's total was the sum of "
        "their solved notebooks' points" if not data["problems"] else "- PROBLEMS: " + "; ".join(data["problems"]),
        "",
        "The first progress lines of the last run:",
        "",
        "```",
        *data["runs"][-1]["first_progress"],
        "```",
    ]
    return "\n".join(lines) + "\n"


def klass(args) -> int:
    quiet = wait_for_quiet(args.quiet_load, args.wait)
    machine = bench.machine_description()
    solved = sum((i + k) % 3 != 0 for i in range(STUDENTS) for k in range(8))
    runs = []
    for rep in range(args.reps):
        run = run_class(args.jobs)
        run["rep"] = rep
        runs.append(run)
        print(f"rep {rep}  {run['seconds']:6.1f} s  load {run['load_before']}  {run['problems'] or 'ok'}", flush=True)
    problems = [f"rep {r['rep']}: {p}" for r in runs for p in r["problems"]]
    data = {"machine": machine, "reps": args.reps, "note": args.note, "quiet": quiet, "root": os.geteuid() == 0,
            "students": STUDENTS,
            "notebooks_solved": solved, "total": summary(r["seconds"] for r in runs), "load_after": load1(),
            "problems": problems, "runs": runs}
    text = class_markdown(data)
    if args.out:
        out = pathlib.Path(args.out)
        out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
        out.with_suffix(".md").write_text(text)
    print(text)
    return 1 if problems else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("submission", "class"))
    parser.add_argument("--reps", type=int, default=None, help="repetitions (9 for submission, 3 for class)")
    parser.add_argument("--quiet-load", type=float, default=None,
                        help="first wait until the 1-minute load average is below this")
    parser.add_argument("--wait", type=float, default=20, help="minutes to wait for that at most (20)")
    parser.add_argument("--jobs", type=int, default=None, help="class: notebooks at once (the grader's default)")
    parser.add_argument("--note", default="", help="a line on the conditions, written with the results")
    parser.add_argument("--out", default=None, help="path without suffix")
    parser.add_argument("--all", action="store_true", help="every graded notebook (each with a student copy: 00-11 and 13), not only 00-07")
    args = parser.parse_args(argv)
    global PATTERN
    if args.all:
        PATTERN = "[0-9][0-9]_*.ipynb"
    if args.what == "submission":
        args.reps = args.reps or 9
        return submission(args)
    args.reps = args.reps or 3
    return klass(args)


if __name__ == "__main__":
    sys.exit(main())
