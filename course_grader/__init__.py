"""Grading submitted notebooks so that a submission cannot forge its grade.

    python -m course_grader submissions/alice/*.ipynb --json results.json    (see `cli` for every mode)

    from course_grader import grade_notebook, grade_submissions, collect_class
    grade = grade_notebook("alice/04_ring_scatter_reduce.ipynb")       # a NotebookGrade: tests, notes, score

    from course_grader import check
    check("ring", ring)              # course_lib's exercises.check with the grader's cases, the hidden ones included

The submission's cells and the learner's functions run in a sandbox (`sandbox`, `kernel`): processes of their
own below a warden that holds them to their limits and lets nothing outlive the grading; with namespaces (root on
Linux, or a user namespace) they see nothing of the host but Python, the packages and course_lib, read-only, and a
private temporary area; without them, as a user of their own, one student at a time, everything that user owns
removed after. The judge (`judge`) never runs the submission's code: it asks the sandbox for data only (values,
the ranks' records), computes the cases, the inputs, the oracle and every point itself, and writes the results
after the sandbox is gone. The hidden cases are here, not in course_lib (`hidden_cases`); `check` runs them in
the caller's own process, as course_lib's check does (for an instructor's own runs, not for grading), and so do the
check cells of notebooks/, with `grader_cases`, under nbgrader's autograde only (NBGRADER_EXECUTION=autograde). What a
submission is graded on (its assignment, one copy per exercise) is decided from its files alone (`assign`). What
it still trusts, and why: docs/architecture.md.

Modules: cli (the command), batch (many notebooks in parallel), assign (what each notebook is graded on), judge
(one notebook), hidden_cases (every function exercise's grader cases, and `check`), cells (which cells the
answers need), notebook (reading one safely), sandbox / kernel / channel / _warden (the sandbox), results (table,
results.json, CSV), gradescope (the autograder zip).
"""

from __future__ import annotations

__all__ = ["grade_notebook", "grade_submissions", "collect_class", "collect_nbgrader", "collect_files", "exercises_in",
           "NotebookGrade", "main", "check", "grader_cases"]


def __getattr__(name):
    # Lazy: the sandbox's kernel imports this package too, and needs none of the judge's modules.
    if name in ("grade_notebook", "NotebookGrade"):
        from course_grader import judge
        return getattr(judge, name)
    if name in ("grade_submissions", "collect_class", "collect_nbgrader", "collect_files"):
        from course_grader import batch
        return getattr(batch, name)
    if name in ("check", "grader_cases"):
        from course_grader import hidden_cases
        return getattr(hidden_cases, name)
    if name == "exercises_in":
        from course_grader.notebook import exercises_in
        return exercises_in
    if name == "main":
        from course_grader.cli import main
        return main
    raise AttributeError(f"module 'course_grader' has no attribute {name!r}")
