"""Which exercises a submission is graded on: the assignment each notebook is for, and one copy per exercise.

    plan = plan_submission(paths, assignment=None)   # one NotebookPlan per file: the exercises it is graded on
    resolve_assignment("04")                         # -> ["04_ring_scatter_reduce"]

The rules, each stated in the feedback where it applies:

1. **A notebook's assignment** comes from its nbgrader metadata (the grade_id of its solution and check cells,
   which the course's notebooks and their student copies carry: `cell_assignments`), when that names one
   assignment or agrees with the file name; else from the number its file name starts with (04_...); else from
   the exercises its cells check.
2. **The submission's assignments** are the one given (`--assignment`, for a class or on Gradescope), or else
   those of its notebooks. Their exercises are what the submission is graded on; the total possible is theirs,
   whatever the submission holds, and the score never exceeds it.
3. **One copy per exercise.** An exercise found in more than one notebook (old/04_....ipynb beside
   04_....ipynb, 04_...-Copy1.ipynb) is graded once, in the copy this rule picks: a notebook of the exercise's own
   assignment; then one the grader could read; then one named as the course names it (04_ring_scatter_reduce.ipynb);
   then the one nearest the top of the submission; then the first by name. The other copies are not run for it.
4. **Other assignments' exercises** (notebook 00's pass_token checked in a 04 submission) are reported in the
   feedback and score nothing.
"""

from __future__ import annotations

import os
import pathlib
import re
from dataclasses import dataclass, field

from course_grader.notebook import NotebookError, exercises_in, exercises_of_number, read_file, safe_name
from course_grader.reading import read_notebook

__all__ = ["ASSIGNMENT_CELLS", "cell_assignments", "NotebookPlan", "SubmissionPlan", "plan_submission", "plan_notebook",
           "resolve_assignment", "assignments", "RULE"]

# The nbgrader grade_id of the course's cells that are not named after an exercise (a solution cell is named as its
# exercise, its check cell "check_" and the name: `cell_assignments` adds those from the registry), and the
# notebook each belongs to. tests/test_grade_assign.py keeps the whole map equal to notebooks/ and assignments/.
ASSIGNMENT_CELLS = {
    "batches_questions": "01_why_data_parallelism", "check_batches_questions": "01_why_data_parallelism",
    "traffic_questions": "03_naive_and_master_allreduce", "check_traffic_questions": "03_naive_and_master_allreduce",
    "ring_scatter_reduce_from_04": "05_ring_all_gather",
    "ring_cost_questions": "06_ring_cost", "check_ring_cost_questions": "06_ring_cost",
    "ring_from_05": "07_data_parallel_training",
    "ring_for_hook": "09_model_parallelism_and_ddp",
}


def cell_assignments() -> dict:
    """{nbgrader grade_id: the course notebook it belongs to}, for every solution and check cell of the course."""
    from course_lib.exercises import registry

    cells = {}
    for exercise in registry.all_exercises():
        cells[exercise.name] = cells["check_" + exercise.name] = exercise.notebook
    return {**cells, **ASSIGNMENT_CELLS}


RULE = ("one copy of each exercise is graded: a notebook of the exercise's own assignment, then one the grader "
        "could read, then one named as the course names it, then the one nearest the top of the submission, then "
        "the first by name")


def assignments() -> list[str]:
    """The course's assignments (the notebooks with exercises), in order."""
    from course_lib.exercises import registry

    found = []
    for exercise in registry.all_exercises():
        if exercise.notebook not in found:
            found.append(exercise.notebook)
    return found


def exercises_of(assignment: str) -> list[str]:
    from course_lib.exercises import registry

    return [e.name for e in registry.all_exercises() if e.notebook == assignment]


def resolve_assignment(text: str) -> list[str]:
    """The assignments `text` names: a number ('04', '4'), a notebook's name ('04_ring_scatter_reduce', with or
    without '.ipynb'), or several of them separated by commas.

    Raises:
        ValueError: a name that is none of the course's assignments (the message lists them).
    """
    known = assignments()
    chosen = []
    for part in [p.strip() for p in str(text).split(",") if p.strip()]:
        stem = part[:-len(".ipynb")] if part.endswith(".ipynb") else part
        match = [a for a in known if a == stem or (stem.isdigit() and a[:2] == f"{int(stem):02d}")]
        if not match:
            raise ValueError(f"{part!r} is not one of the course's assignments: {', '.join(known)} (a number "
                             "such as 04 is enough)")
        chosen += [m for m in match if m not in chosen]
    if not chosen:
        raise ValueError("no assignment given: name one, e.g. --assignment 04")
    return chosen


def _from_file_name(name: str) -> str | None:
    number = re.match(r"(\d\d)_", pathlib.Path(name).name)
    if not number:
        return None
    return next((a for a in assignments() if a[:2] == number.group(1)), None)


def _from_metadata(notebook) -> dict:
    """{assignment: how many of the notebook's cells carry its nbgrader grade_ids}."""
    counts: dict = {}
    known = cell_assignments()
    for cell in notebook.get("cells", []):
        metadata = cell.get("metadata") if isinstance(cell, dict) else None
        nbgrader = metadata.get("nbgrader") if isinstance(metadata, dict) else None
        grade_id = nbgrader.get("grade_id") if isinstance(nbgrader, dict) else None
        if isinstance(grade_id, str) and grade_id in known:
            counts[known[grade_id]] = counts.get(known[grade_id], 0) + 1
    return counts


def assignment_of(notebook, filename: str) -> tuple[str | None, str]:
    """(the assignment a notebook is for, how that was decided): see rule 1."""
    from course_lib.exercises import registry

    by_name = _from_file_name(filename)
    counts = _from_metadata(notebook) if notebook is not None else {}
    if counts:
        if by_name in counts:
            return by_name, "its file name and nbgrader metadata"
        best = max(counts.values())
        leaders = sorted(a for a, n in counts.items() if n == best)
        if len(leaders) == 1:
            return leaders[0], "its nbgrader metadata"
    if by_name:
        return by_name, "its file name"
    if notebook is not None:
        checked = [registry.get(n).notebook for n in exercises_in(notebook, "")]
        if checked:
            return max(sorted(set(checked)), key=checked.count), "the exercises its cells check"
    return None, "nothing in it names an assignment"


@dataclass
class NotebookPlan:
    """One submitted file and what it is graded on.

    Attributes:
        path: the file.
        assignment: the assignment it is for (rule 1), or None; how: how that was decided.
        found: the exercises it has (checked in its cells, or those of its assignment).
        grade: the exercises it is graded on (rules 2-4); empty: it is not run at all.
        notes: for the learner: exercises in it that are graded elsewhere or belong to another assignment.
        error: why it cannot be read, if it cannot (a link, not a notebook, too large...).
    """

    path: pathlib.Path
    assignment: str | None = None
    how: str = ""
    found: list = field(default_factory=list)
    grade: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    error: NotebookError | None = None


@dataclass
class SubmissionPlan:
    notebooks: list                                   # NotebookPlan per file, in the order given
    assignments: list                                 # the assignments graded
    missing: list = field(default_factory=list)       # exercises of those assignments that no notebook has


def plan_notebook(notebook, filename: str) -> tuple[str | None, list, list]:
    """For one notebook alone: (its assignment, the exercises it is graded on, notes on the others it has)."""
    assignment, _ = assignment_of(notebook, filename)
    found = _found(notebook, filename, assignment)
    own = [n for n in found if assignment is None or n in exercises_of(assignment)]
    notes = [_foreign_note(n, [assignment] if assignment else []) for n in found if n not in own]
    return assignment, own, notes


def _found(notebook, filename, assignment) -> list:
    found = exercises_in(notebook, filename) if notebook is not None else exercises_of_number(filename)
    if assignment:
        found += [n for n in exercises_of(assignment) if n not in found]
    return found


def _foreign_note(name: str, graded: list) -> str:
    from course_lib.exercises import registry

    owner = registry.get(name).notebook
    what = f"this submission's assignment{'s' if len(graded) > 1 else ''} ({', '.join(graded)})" if graded else \
        "an assignment of this submission"
    return f"{name} is an exercise of {owner}, not of {what}: it was not graded and scores nothing here"


def plan_submission(paths, assignment: list | None = None, root=None) -> SubmissionPlan:
    """Read every file of one submission and decide what each is graded on (see the module's rules).

    Args:
        paths: the submission's files (refused ones included: they are planned, never followed).
        assignment: the assignments the submission is for (`resolve_assignment`), or None: its notebooks'.
        root: the submission's top folder (for "nearest the top"); by default the files' common folder.
    """
    from course_lib.exercises import registry

    paths = [pathlib.Path(p) for p in paths]
    plans = []
    for path in paths:
        plan = NotebookPlan(path)
        try:
            notebook = read_notebook(path, read_file(path))
        except NotebookError as exc:
            plan.error, notebook = exc, None
        plan.assignment, plan.how = assignment_of(notebook, path.name)
        plan.found = _found(notebook, path.name, plan.assignment) if plan.error is None else \
            [n for n in exercises_of_number(path.name)]
        plans.append(plan)
    graded = list(assignment) if assignment else []
    if not assignment:
        for plan in plans:
            if plan.assignment and plan.assignment not in graded:
                graded.append(plan.assignment)
        order = assignments()
        graded.sort(key=lambda a: order.index(a) if a in order else len(order))
    wanted = [n for a in graded for n in exercises_of(a)]
    if root is None:
        try:
            root = pathlib.Path(os.path.commonpath([str(p.parent) for p in paths])) if paths else pathlib.Path(".")
        except ValueError:
            root = pathlib.Path(".")

    def depth(plan):
        try:
            return len(plan.path.relative_to(root).parts)
        except ValueError:
            return len(plan.path.parts)

    missing = []
    also: dict = {}          # chosen notebook's index -> {names}, and (other, chosen) -> {names}: one note each
    for name in wanted:
        candidates = [p for p in plans if name in p.found]
        if not candidates:
            missing.append(name)
            continue
        owner = registry.get(name).notebook
        candidates.sort(key=lambda p: (p.assignment != owner, p.error is not None, p.path.name != owner + ".ipynb",
                                       depth(p), str(p.path)))
        chosen, others = candidates[0], candidates[1:]
        chosen.grade.append(name)
        for other in others:
            also.setdefault((plans.index(chosen), plans.index(other)), []).append(name)
    for (chosen, other), names in also.items():
        listed = ", ".join(names)
        plans[chosen].notes.append(f"{listed}: also in {safe_name(_relative(plans[other].path, root))}; graded in this "
                                   f"notebook only ({RULE})")
        plans[other].notes.append(f"{listed}: graded in {safe_name(_relative(plans[chosen].path, root))}, not in "
                                  f"this copy ({RULE})")
    for plan in plans:
        for name in plan.found:
            if name not in wanted:
                plan.notes.append(_foreign_note(name, graded))
    return SubmissionPlan(plans, graded, missing)


def _relative(path: pathlib.Path, root) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return path.name
