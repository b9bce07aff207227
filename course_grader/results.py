"""What grading writes: the table for the terminal, Gradescope's results.json, and the class's CSV.

Gradescope's results.json (https://gradescope-autograders.readthedocs.io/en/latest/specs/) gets one test per
rubric line, so Gradescope shows them one by one:

    {"score": 62.5, "execution_time": 41, "output": "...", "tests": [
        {"name": "04_ring_scatter_reduce: ring_scatter_reduce: returned", "score": 0, "max_score": 2,
         "status": "failed", "output": "MISSED: returns the index of that chunk ...\\nwhy: G=2, N=8, ...",
         "visibility": "visible"}, ...]}

The first line of each exercise also carries the exercise's whole report (first problem, cases). A notebook
with notes (a cell that raised, one that ran too long) gets one more test of 0 points holding them.

The CSV has one row per submission and one column per exercise. A cell that a spreadsheet would read as a
formula (one starting with =, +, -, @, a tab or a carriage return: a student's folder named "=HYPERLINK(...)")
is written with a leading apostrophe, as OWASP's guidance on CSV injection says, so it opens as text.
"""

from __future__ import annotations

import csv
import io
import json
import os
import pathlib
import tempfile

from course_lib.exercises.report import format_points

from course_grader.notebook import safe_name, visible

__all__ = ["results_json", "submission_json", "table", "write_csv", "write_atomically", "exercise_columns",
           "csv_cell"]

_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def csv_cell(value) -> str:
    """A CSV cell that no spreadsheet reads as a formula, its control characters written as escapes."""
    text = visible(value, lines=False)
    return "'" + text if text.startswith(_FORMULA_STARTS) else text


def _label(path) -> str:
    return safe_name(pathlib.Path(path).stem)


def _line_tests(label: str, test: dict) -> list[dict]:
    lines = [line for line in test.get("lines", []) if line.get("tested", True) and line["max_points"] > 0]
    tests = []
    for position, line in enumerate(lines):
        output = ("met: " if line["met"] else "MISSED: ") + line["text"]
        if not line["met"] and line.get("evidence"):
            output += f"\nwhy: {line['evidence']}"
        if position == 0:
            output += "\n\n" + test["output"]
        tests.append({"name": f"{label}: {test['name']}: {line['key']}", "score": line["points"],
                      "max_score": line["max_points"], "status": "passed" if line["met"] else "failed",
                      "output": output, "visibility": "visible"})
    return tests


def submission_json(submission, *, seconds: float | None = None) -> dict:
    """results.json for a `batch.SubmissionGrade`: its notebooks' tests and the notes on the submission's files."""
    return results_json(submission.notebooks, seconds=seconds, notes=submission.notes)


def results_json(grades, *, seconds: float | None = None, notes=()) -> dict:
    """Gradescope's results.json for one submission (its notebooks' `NotebookGrade`s): one test per rubric line.
    `score` is never more than the total possible."""
    tests = []
    if notes:
        tests.append({"name": "submission: files", "score": 0, "max_score": 0, "status": "passed",
                      "output": "\n".join(notes), "visibility": "visible"})
    for grade in grades:
        label = _label(grade.path)
        for test in grade.tests:
            tests += _line_tests(label, test)
        if grade.notes:
            tests.append({"name": f"{label}: notebook run", "score": 0, "max_score": 0, "status": "passed",
                          "output": "\n".join(grade.notes), "visibility": "visible"})
    possible = round(sum(g.max_score for g in grades), 2)
    total = min(round(sum(g.score for g in grades), 2), possible)
    problems = [f"{safe_name(pathlib.Path(g.path).name)}: {g.notes[-1]}" for g in grades
                if g.status not in ("graded", "skipped") and g.notes]
    result = {"score": total, "output": f"{format_points(total)} of {format_points(possible)} points."
              + ("\n" + "\n".join(problems) if problems else ""), "tests": tests,
              "extra_data": {"notebooks": {safe_name(pathlib.Path(g.path).name): {"seconds": round(g.seconds, 3),
                                                                                   **g.timings} for g in grades}}}
    if seconds is not None:
        result["execution_time"] = round(seconds)
    result["output"] = visible(result["output"])
    for test in tests:            # what a submission produced, shown by Gradescope and read by instructors
        test["name"], test["output"] = visible(test["name"], lines=False), visible(test["output"])
    return result


def table(grades, verbose: bool = False, label_of=None, notes=()) -> str:
    """The terminal's table: one row per exercise (missed rubric lines named), notes, and the total."""
    label_of = label_of or (lambda grade: safe_name(pathlib.Path(grade.path).name))
    rows = [("(submission)", "", "", note) for note in notes]
    for grade in grades:
        label = label_of(grade)
        for test in grade.tests:
            first = test["output"].splitlines()[0]
            status = first.split(", ", 1)[1] if ", " in first else first
            missed = [line["key"] for line in test.get("lines", []) if not line["met"] and line.get("tested", True)]
            if missed and test["score"] > 0:
                status += f"; missed: {', '.join(missed)}"
            rows.append((label, test["name"], f"{format_points(test['score'])}/{format_points(test['max_score'])}",
                         status))
            if verbose and "\n" in test["output"]:
                rows += [("", "", "", "  " + line) for line in test["output"].splitlines()[1:]]
        for note in grade.notes:
            rows.append((label, "(notebook)", "", note))
        if verbose:
            rows += [(label, "(grader)", "", info) for info in grade.info]
    possible = sum(g.max_score for g in grades)
    total = min(sum(g.score for g in grades), possible)
    rows.append(("total", "", f"{format_points(total)}/{format_points(possible)}", ""))
    rows = [tuple(visible(cell, lines=False) for cell in row) for row in rows]
    widths = [max(len(r[i]) for r in rows + [("submission", "exercise", "points", "")]) for i in range(3)]
    lines = [f"{'submission':<{widths[0]}}  {'exercise':<{widths[1]}}  {'points':>{widths[2]}}  result"]
    for row in rows:     # (escaped above: a cell's error can neither erase a row nor print one of its own)
        lines.append(f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]:>{widths[2]}}  {row[3]}".rstrip())
    return "\n".join(lines)


def exercise_columns(submission_grades) -> list[str]:
    """The exercises any submission was graded on, in course order."""
    from course_lib.exercises import registry

    graded = {test["name"] for s in submission_grades for g in s.notebooks for test in g.tests}
    return [e.name for e in registry.all_exercises() if e.name in graded]


def write_csv(path, submission_grades) -> None:
    """One row per submission: name, total, possible, status, then one column per exercise (its points)."""
    columns = exercise_columns(submission_grades)
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["submission", "score", "max_score", "status", *columns])
    for submission in submission_grades:
        scores = {test["name"]: test["score"] for g in submission.notebooks for test in g.tests}
        row = [submission.name, format_points(submission.score), format_points(submission.max_score),
               submission.status, *(format_points(scores[c]) if c in scores else "" for c in columns)]
        writer.writerow([csv_cell(cell) for cell in row])
    write_atomically(path, buffer.getvalue())


def write_atomically(path, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same folder, replaced into place: a reader never
    sees half a file, and a link or file put at `path` beforehand is replaced, never followed."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "w") as f:
            f.write(text)
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise


def dump_json(path, value) -> None:
    write_atomically(path, json.dumps(value, indent=2) + "\n")
