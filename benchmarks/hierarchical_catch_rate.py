"""How many of notebook 13's planted bugs the hierarchical_allreduce check catches, with every hidden case.

    python benchmarks/hierarchical_catch_rate.py --out benchmarks/results/hierarchical_catch_rate.txt

Every entry of tests/planted_bugs_hierarchical.py goes through `course_grader.check(name, fn)` (the public check
with the grader's cases): every hidden case on G = 1..8 ranks (node sizes that divide G and some that leave a smaller last node, tagged and
random data, uneven lengths, the timed cases on two modeled clusters), as the grader runs it. A bug is *caught*
when it loses points; its feedback *names it* when the first problem reported contains the phrase the catalogue
expects (which the quick test checks on a few world sizes; here the first failing case may be another one). A
correct solution must get full marks. The load average is printed: the times move with it, the counts do not.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import planted_bugs_hierarchical as catalogue  # noqa: E402

import course_grader  # noqa: E402
from exercise_catch_rate import _first_problem  # noqa: E402  (the other catalogues' script, beside this one)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the report to this file")
    args = parser.parse_args(argv)
    lines = [f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (times move with it)"]

    def say(text=""):
        print(text, flush=True)
        lines.append(text)

    say("\ncorrect solutions (must get full marks), hidden cases included:")
    wrong = []
    for entry in catalogue.CORRECT:
        started = time.perf_counter()
        result = course_grader.check(entry.exercise, entry.fn)
        say(f"  {entry.name:<28} {result.score:g}/{result.max_score:g}  {time.perf_counter() - started:5.1f} s")
        if result.score != result.max_score:
            wrong.append(entry.name)
    say("\nplanted bugs, hidden cases included: points, the lines missed, whether the first problem names the bug")
    caught = named = 0
    for entry in catalogue.BUGS:
        started = time.perf_counter()
        result = course_grader.check(entry.exercise, entry.fn)
        missed = sorted(line.key for line in result.lines if line.tested and not line.met)
        first = _first_problem(result)
        caught += result.score < result.max_score
        named += entry.expect in first
        say(f"  {entry.name:<28} {result.score:g}/{result.max_score:g}  missed {', '.join(missed) or 'nothing'}  "
            f"{'named' if entry.expect in first else 'NOT NAMED'}  {time.perf_counter() - started:5.1f} s")
        say(f"      first problem: {first[:220]}")
    say(f"\ncaught {caught} of {len(catalogue.BUGS)} planted bugs; the first problem names {named} of them; "
        f"correct solutions not at full marks: {wrong or 'none'}")
    if args.out:
        pathlib.Path(args.out).write_text("\n".join(lines) + "\n")
    return 0 if caught == len(catalogue.BUGS) and not wrong else 1


if __name__ == "__main__":
    sys.exit(main())
