"""How many planted bugs the exercise checks catch, and how long checks and full grades take.

    python benchmarks/exercise_catch_rate.py                      # checks only
    python benchmarks/exercise_catch_rate.py --grade --repeat 3   # and course_grader on notebooks 04, 05
    python benchmarks/exercise_catch_rate.py --out benchmarks/results/exercise_catch_rate.txt
    python benchmarks/exercise_catch_rate.py --part 2 --append --out benchmarks/results/exercise_catch_rate.txt

Every entry of tests/planted_bugs.py (notebooks 00-07; with --part 2, tests/planted_bugs_part2.py: 08-11 and the
capstone) goes through `course_grader.check(name, fn)` (the public check with the grader's cases), i.e.
every hidden case on G = 1..8 ranks, with the default time limits. A bug is *caught* when it loses points;
its feedback *names it* when the first problem reported contains the phrase the catalogue expects. A
correct solution must get full marks. The machine's load average is printed with the figures: the
times depend on it (2 cores shared with other work), the counts do not. The results file holds both
parts, one after the other (the two commands above).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import planted_bugs  # noqa: E402
import planted_bugs_part2  # noqa: E402

import course_grader as grade  # noqa: E402


def _first_problem(result) -> str:
    first = next((c for c in result.cases if not c.passed), None)
    return first.problems[0].message if first is not None else "\n".join(result.feedback)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grade", action="store_true", help="also time course_grader on notebooks 04 and 05")
    parser.add_argument("--repeat", type=int, default=1, help="grades per notebook (median and spread)")
    parser.add_argument("--out", help="also write the report to this file")
    parser.add_argument("--append", action="store_true", help="add the report at the end of --out, after a blank line")
    parser.add_argument("--part", type=int, choices=(1, 2), default=1,
                        help="1: the catalogue of notebooks 00-07; 2: that of 08-11 and the capstone")
    parser.add_argument("--only", help="only the entries of this exercise")
    args = parser.parse_args(argv)
    catalogue = planted_bugs if args.part == 1 else planted_bugs_part2
    correct = [e for e in catalogue.CORRECT if args.only in (None, e.exercise)]
    bugs = [e for e in catalogue.BUGS if args.only in (None, e.exercise)]
    covers = "notebooks 00-07" if args.part == 1 else "notebooks 08-11 and the capstone"
    lines = [f"part {args.part}: {catalogue.__name__}.py ({covers})",
             f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (times move with it)"]

    def say(text=""):
        print(text, flush=True)
        lines.append(text)

    say("\ncorrect solutions (must get full marks), hidden cases included:")
    wrong, times = [], []
    for entry in correct:
        started = time.perf_counter()
        result = grade.check(entry.exercise, entry.fn)
        times.append(time.perf_counter() - started)
        if not result.passed:
            wrong.append(entry.name)
        say(f"  {'full ' if result.passed else 'LOST '} {entry.exercise:20} {entry.name:26} "
            f"{result.score:g}/{result.max_score:g}  {times[-1]:5.1f} s")
    say("\nplanted bugs (must lose points; the first problem should name the mistake):")
    caught, named, bug_times = 0, 0, []
    for entry in bugs:
        started = time.perf_counter()
        result = grade.check(entry.exercise, entry.fn)
        bug_times.append(time.perf_counter() - started)
        lost = result.score < result.max_score
        names = entry.expect in _first_problem(result)
        caught += lost
        named += lost and names
        say(f"  {'caught' if lost else 'MISSED'} {'named' if names else 'vague'} {entry.exercise:20} "
            f"{entry.name:28} {result.score:g}/{result.max_score:g}  {bug_times[-1]:5.1f} s")
    say(f"\ncatch rate: {caught}/{len(bugs)} = {caught / len(bugs):.1%} of planted bugs lose points")
    say(f"named: {named}/{len(bugs)} report the expected first problem")
    say(f"correct solutions with full marks: {len(correct) - len(wrong)}/{len(correct)}"
        + (f" (lost points: {', '.join(wrong)})" if wrong else ""))
    every = times + bug_times
    say(f"check time with hidden cases: median {statistics.median(every):.1f} s, min {min(every):.1f} s, "
        f"max {max(every):.1f} s over {len(every)} checks (the slowest are deadlocks and endless loops)")
    if args.grade and args.part == 1:
        say(f"\npython -m course_grader, {args.repeat} run(s) per notebook (load average now "
            f"{os.getloadavg()[0]:.1f}):")
        for folder in ("assignments", "notebooks"):
            for name in ("04_ring_scatter_reduce.ipynb", "05_ring_all_gather.ipynb"):
                runs, scores = [], set()
                for _ in range(args.repeat):
                    result = grade.grade_notebook(ROOT / folder / name)
                    runs.append(result.seconds)
                    scores.add(f"{result.score:g}/{result.max_score:g}")
                spread = f" (min {min(runs):.1f}, max {max(runs):.1f})" if len(runs) > 1 else ""
                say(f"  {folder}/{name}: {', '.join(sorted(scores))} points, median {statistics.median(runs):.1f} s{spread}")
    if args.out:
        with open(args.out, "a" if args.append else "w") as f:
            f.write(("\n" if args.append else "") + "\n".join(lines) + "\n")
    return 0 if caught / len(bugs) >= 0.95 and not wrong else 1


if __name__ == "__main__":
    sys.exit(main())
