"""Wall time of notebooks under strict nbval, before and after a change, interleaved (issue 25's closing note).

    python benchmarks/notebook_times.py --before 8ebc429 --notebooks 06,08,10,11,12 --reps 9
    python benchmarks/notebook_times.py --notebooks 13 --reps 3 --out /tmp/quick      # the working tree only

For every repetition, every notebook runs once from a git worktree of the `--before` commit (with that
commit's course_lib first on PYTHONPATH) and once from this working tree, one after the other, so load
from anything else on the machine falls on both alike. Each run is the test command on one notebook
(`python -m pytest -n 0 -q <notebook>`, strict nbval as the README's test command runs it), timed on this
machine's clock from start to exit; a run that fails is recorded as failed. Writes
benchmarks/results/notebook_times.{json,md}.
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


def _notebook(folder: pathlib.Path, prefix: str) -> pathlib.Path:
    matches = sorted((folder / "notebooks").glob(f"{prefix}_*.ipynb"))
    if not matches:
        raise SystemExit(f"no notebook {prefix}_*.ipynb in {folder}")
    return matches[0]


def _time(folder: pathlib.Path, notebook: pathlib.Path) -> tuple:
    env = dict(os.environ, PYTHONPATH=str(folder) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    started = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-q",
                          str(notebook.relative_to(folder))], cwd=folder, env=env, capture_output=True, text=True)
    return time.perf_counter() - started, run.returncode == 0, run.stdout[-2000:]


def _tree_state() -> str:
    """'the working tree at <commit>', and whether it had uncommitted changes to tracked files."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    dirty = git("status", "--porcelain", "--untracked-files=no")
    return f"the working tree at {git('rev-parse', '--short', 'HEAD')}" + (" with uncommitted changes" if dirty else "")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default=None, help="a commit to compare with (default: none)")
    parser.add_argument("--notebooks", default="06,08,10,11,12", help="notebook numbers, comma-separated")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "notebook_times"))
    args = parser.parse_args(argv)
    prefixes = [p.strip() for p in args.notebooks.split(",") if p.strip()]
    trees = {"after": ROOT}
    worktree = None
    if args.before:
        worktree = pathlib.Path(tempfile.mkdtemp(prefix="course_lib-before-")) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(worktree), args.before], cwd=ROOT, check=True,
                       capture_output=True)
        trees = {"before": worktree, "after": ROOT}
    times = {key: {p: [] for p in prefixes} for key in trees}
    failures = {key: {p: 0 for p in prefixes} for key in trees}
    load_before = os.getloadavg()
    after = _tree_state()  # read first: a commit made during an hour-long run is not what was timed
    try:
        for rep in range(args.reps):
            for prefix in prefixes:
                for key, folder in trees.items():
                    seconds, ok, tail = _time(folder, _notebook(folder, prefix))
                    times[key][prefix].append(seconds)
                    failures[key][prefix] += not ok
                    print(f"rep {rep + 1}/{args.reps} {prefix} {key}: {seconds:.1f} s{'' if ok else ' FAILED'}",
                          file=sys.stderr, flush=True)
                    if not ok:
                        print(tail, file=sys.stderr)
    finally:
        if worktree is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT, capture_output=True)
    load_after = os.getloadavg()
    at_the_end = _tree_state()
    if at_the_end != after:
        after += f" at the start ({at_the_end} at the end: it changed during the run)"
    out = pathlib.Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"before": args.before, "times": times, "failures": failures,
                                                    "after": after, "reps": args.reps, "load_before": load_before,
                                                    "load_after": load_after}, indent=1))
    lines = [f"# Notebooks under strict nbval (one notebook per pytest run), {args.reps} repetitions, interleaved", "",
             f"Seconds on this machine's clock, median (min..max). Before: commit {args.before or '-'}; after: "
             f"{after}. Load average before {load_before[0]:.1f}, after {load_after[0]:.1f}.", "",
             "| notebook | " + " | ".join(trees) + " |", "| --- |" + " --- |" * len(trees)]
    for prefix in prefixes:
        cells = []
        for key in trees:
            values = times[key][prefix]
            failed = failures[key][prefix]
            cells.append(f"{statistics.median(values):.1f} ({min(values):.1f}..{max(values):.1f})"
                         + (f", {failed} failed" if failed else ""))
        lines.append(f"| {_notebook(ROOT, prefix).stem} | " + " | ".join(cells) + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
