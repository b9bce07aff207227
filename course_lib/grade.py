"""Grade submitted notebooks: run each in a fresh kernel, then check every exercise with the hidden cases.

    python -m course_lib.grade SUBMISSION.ipynb [MORE.ipynb ...] [--json results.json] [--verbose]

For every notebook:

1. it is executed top to bottom in a fresh Jupyter kernel (nbclient), in its own folder. A cell that
   raises does not stop the run (later exercises still count); a cell that runs longer than
   ``--cell-timeout`` is interrupted; a kernel that dies is restarted and the notebook run again without
   the cell that killed it; the whole run stops at ``--timeout``. So a notebook that crashes half-way
   keeps the points of the exercises it completed.
2. in that same kernel, every exercise the notebook has (found from its ``exercises.check("name", ...)``
   calls, and from the notebook's number, e.g. 04) is checked with ``hidden=True``: the learner's function
   or answer is looked up by name. One exercise's failure never costs another's points.
3. a table and the total are printed; ``--json PATH`` writes Gradescope's results.json
   (``{"score": ..., "tests": [{"name", "score", "max_score", "output"}, ...]}``).

The exit status is 0 when every notebook could be graded (whatever the score), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
import time
from dataclasses import dataclass, field

__all__ = ["grade_notebook", "grade_namespace", "exercises_in", "NotebookGrade", "main"]

_MARK = "COURSE_LIB_GRADE "
_CHECK_CALL = re.compile(r"""exercises\s*\.\s*check\s*\(\s*["']([A-Za-z0-9_]+)["']""")


@dataclass
class NotebookGrade:
    """What one submission got: one dict per exercise (name, score, max_score, output), and notes on
    the run (cells that raised or timed out)."""

    path: str
    tests: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def score(self) -> float:
        return round(sum(t["score"] for t in self.tests), 2)

    @property
    def max_score(self) -> float:
        return round(sum(t["max_score"] for t in self.tests), 2)


def exercises_in(notebook, filename: str = "") -> list[str]:
    """The exercises a notebook has: those its cells check, then those of its number (04_... -> '04')."""
    from course_lib.exercises import registry

    names = []
    for cell in notebook.cells:
        if cell.cell_type == "code":
            names += [n for n in _CHECK_CALL.findall(cell.source) if n not in names]
    number = re.match(r"(\d\d)_", pathlib.Path(filename).name)
    if number:
        names += [e.name for e in registry.all_exercises()
                  if e.notebook.startswith(number.group(1)) and e.name not in names]
    known = {e.name for e in registry.all_exercises()}
    return [n for n in names if n in known]


def grade_namespace(namespace: dict, names, hidden: bool = True) -> list[dict]:
    """Check exercises `names` against the answers found in `namespace` (a notebook's globals)."""
    from course_lib import exercises
    from course_lib.exercises import registry
    from course_lib.exercises.report import format_points

    results = []
    for name in names:
        exercise = registry.get(name)
        answer = namespace.get(exercise.answer_name)
        head = f"{name}: 0/{format_points(exercise.points)} points, "
        if exercise.answer_name not in namespace:
            results.append({"name": name, "score": 0.0, "max_score": float(exercise.points),
                            "output": head + f"{exercise.answer_name} is not defined in the notebook (did the cell "
                                             "that defines it run without an error?)."})
            continue
        try:
            result = exercises.check(name, answer, hidden=hidden)
        except Exception as exc:  # noqa: BLE001 - one exercise never costs another its points
            results.append({"name": name, "score": 0.0, "max_score": float(exercise.points),
                            "output": head + f"the check could not run it: {type(exc).__name__}: {exc}"})
            continue
        results.append(result.to_dict())
    return results


def _grading_source(names) -> str:
    return ("import json as _course_lib_json\n"
            "from course_lib.grade import grade_namespace as _course_lib_grade\n"
            f"print({_MARK!r} + _course_lib_json.dumps(_course_lib_grade(globals(), {list(names)!r})))\n")


def _error_text(outputs) -> str | None:
    for output in outputs:
        if output.get("output_type") == "error":
            return f"{output.get('ename', 'error')}: {output.get('evalue', '')}"[:300]
    return None


def _run(notebook, folder, names, skip, cell_timeout, deadline, notes):
    """Execute `notebook` (minus the cells in `skip`) and grade it in the same kernel.

    Returns the list of results, or ('dead', index) if the kernel died in cell `index`.
    """
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    client = NotebookClient(notebook, timeout=cell_timeout, kernel_name="python3", allow_errors=True,
                            interrupt_on_timeout=True, record_timing=False,
                            error_on_timeout={"ename": "CellTimeoutError",
                                              "evalue": f"the cell ran longer than {cell_timeout:g} s and was interrupted",
                                              "traceback": []},
                            resources={"metadata": {"path": str(folder)}})
    client.reset_execution_trackers()
    with client.setup_kernel():
        for index, cell in enumerate(notebook.cells):
            if cell.cell_type != "code" or index in skip:
                continue
            if time.monotonic() > deadline:
                notes.append(f"the notebook ran out of time at cell {index}; the cells after it did not run")
                break
            try:
                client.execute_cell(cell, index)
            except DeadKernelError:
                return ("dead", index)
            error = _error_text(cell.get("outputs", []))
            if error and error.startswith(("KeyboardInterrupt", "CellTimeoutError")):
                notes.append(f"cell {index} ran longer than {cell_timeout:g} s and was interrupted")
            elif error:
                notes.append(f"cell {index} raised {error}")
        grading = nbformat.v4.new_code_cell(_grading_source(names))
        notebook.cells.append(grading)
        # The checks have their own time limits (about a minute each at worst).
        client.timeout = max(cell_timeout, 90 * max(1, len(names)))
        try:
            client.execute_cell(grading, len(notebook.cells) - 1)
        except DeadKernelError:
            return ("dead", None)
        finally:
            notebook.cells.pop()
    for output in grading.get("outputs", []):
        if output.get("output_type") == "stream" and _MARK in output.get("text", ""):
            line = next(l for l in output["text"].splitlines() if l.startswith(_MARK))
            return json.loads(line[len(_MARK):])
    raise RuntimeError("the grading cell printed no results: " + (_error_text(grading.get("outputs", [])) or "no output"))


def grade_notebook(path, *, timeout: float = 900.0, cell_timeout: float = 300.0) -> NotebookGrade:
    """Execute the notebook at `path` in a fresh kernel and grade every exercise it has (hidden cases)."""
    import nbformat

    from course_lib.exercises import registry

    path = pathlib.Path(path)
    start = time.monotonic()
    grade = NotebookGrade(str(path))
    try:
        source = nbformat.read(path, as_version=4)
    except Exception as exc:  # noqa: BLE001 - not a notebook at all
        grade.notes.append(f"could not read the notebook: {type(exc).__name__}: {exc}")
        return grade
    names = exercises_in(source, path.name)
    if not names:
        grade.notes.append("no exercises found in this notebook")
        return grade
    skip: set = set()
    while True:
        notes: list = []
        outcome = _run(nbformat.from_dict(json.loads(json.dumps(source))), path.parent.resolve(), names, skip,
                       cell_timeout, start + timeout, notes)
        if isinstance(outcome, tuple) and outcome[0] == "dead" and outcome[1] is not None \
                and time.monotonic() < start + timeout:
            skip.add(outcome[1])
            grade.notes.append(f"the kernel died in cell {outcome[1]}; it was run again without that cell")
            continue
        if isinstance(outcome, tuple):
            notes.append("the kernel died while grading")
            outcome = [{"name": n, "score": 0.0, "max_score": float(registry.get(n).points),
                        "output": f"{n}: not graded, the kernel died"} for n in names]
        grade.notes += notes
        grade.tests = outcome
        break
    grade.seconds = time.monotonic() - start
    return grade


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------


def _table(grades, verbose: bool) -> str:
    from course_lib.exercises.report import format_points

    rows = []
    for grade in grades:
        label = pathlib.Path(grade.path).name
        for test in grade.tests:
            first = test["output"].splitlines()[0]
            status = first.split(", ", 1)[1] if ", " in first else first
            rows.append((label, test["name"], f"{format_points(test['score'])}/{format_points(test['max_score'])}",
                         status))
            if verbose and "\n" in test["output"]:
                rows += [("", "", "", "  " + line) for line in test["output"].splitlines()[1:]]
        for note in grade.notes:
            rows.append((label, "(notebook)", "", note))
    total = sum(g.score for g in grades)
    possible = sum(g.max_score for g in grades)
    rows.append(("total", "", f"{format_points(total)}/{format_points(possible)}", ""))
    widths = [max(len(r[i]) for r in rows + [("submission", "exercise", "points", "")]) for i in range(3)]
    lines = [f"{'submission':<{widths[0]}}  {'exercise':<{widths[1]}}  {'points':>{widths[2]}}  result"]
    for row in rows:
        lines.append(f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]:>{widths[2]}}  {row[3]}".rstrip())
    return "\n".join(lines)


def results_json(grades) -> dict:
    """Gradescope's results.json: the total and one test per exercise (and per notebook note)."""
    tests = []
    for grade in grades:
        label = pathlib.Path(grade.path).stem
        for test in grade.tests:
            tests.append({"name": f"{label}: {test['name']}", "score": test["score"], "max_score": test["max_score"],
                          "output": test["output"]})
        if grade.notes:
            tests.append({"name": f"{label}: notebook run", "score": 0, "max_score": 0,
                          "output": "\n".join(grade.notes)})
    return {"score": round(sum(g.score for g in grades), 2), "tests": tests}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.grade", description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="+", help="submitted .ipynb files")
    parser.add_argument("--json", metavar="PATH", help="write Gradescope's results.json here")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for running one notebook (900)")
    parser.add_argument("--cell-timeout", type=float, default=300.0, help="seconds for one cell (300)")
    parser.add_argument("--verbose", action="store_true", help="print every exercise's full feedback")
    args = parser.parse_args(argv)
    missing = [p for p in args.notebooks if not pathlib.Path(p).is_file()]
    if missing:
        parser.error(f"no such file: {', '.join(missing)}")
    grades = []
    for path in args.notebooks:
        print(f"grading {path} ...", file=sys.stderr, flush=True)
        grades.append(grade_notebook(path, timeout=args.timeout, cell_timeout=args.cell_timeout))
    print(_table(grades, args.verbose))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results_json(grades), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
