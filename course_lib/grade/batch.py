"""Grading many notebooks at once: in parallel up to the cores, with progress, one user per student when root.

    submissions = collect_class("submissions/")         # submissions/<student>/**/*.ipynb, one per student
    grades = grade_submissions(submissions, jobs=8, progress=sys.stderr)

Every notebook is a task. Up to `jobs` run at a time (by default one per core: a notebook's checks keep a
core busy). As root, each student being graded gets a sandbox user of their own for as long as any of their
notebooks runs (their notebooks run in parallel under that user; another student's never do), and when the
student's last notebook is done, whatever that user still runs is killed.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import stat
import tempfile
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from course_lib.grade import judge
from course_lib.grade.sandbox import DEFAULT_USER, release_users, running_as_root, sandbox_users, sweep_user

__all__ = ["Submission", "SubmissionGrade", "collect_class", "collect_nbgrader", "collect_files", "grade_submissions",
           "default_jobs"]


@dataclass
class Submission:
    """One student's notebooks, or `problem` when there is nothing to grade (a student folder without one)."""

    name: str
    notebooks: list
    problem: str = ""


@dataclass
class SubmissionGrade:
    name: str
    notebooks: list = field(default_factory=list)      # NotebookGrade per notebook
    problem: str = ""

    @property
    def score(self) -> float:
        return round(sum(g.score for g in self.notebooks), 2)

    @property
    def max_score(self) -> float:
        return round(sum(g.max_score for g in self.notebooks), 2)

    @property
    def status(self) -> str:
        """'graded' when every notebook was read and graded; else what went wrong first."""
        if self.problem:
            return "missing"
        bad = [g.status for g in self.notebooks if g.status != "graded"]
        return bad[0] if bad else "graded"


def default_jobs() -> int:
    """The cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def _notebooks_below(folder: pathlib.Path) -> list:
    return sorted(p for p in folder.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts and p.is_file())


def collect_files(paths, name: str = "submission") -> Submission:
    """The given files (or the notebooks in the given folders) as one submission."""
    notebooks = []
    for path in map(pathlib.Path, paths):
        notebooks += _notebooks_below(path) if path.is_dir() else [path]
    return Submission(name, notebooks, "" if notebooks else "no notebook to grade")


def collect_class(folder) -> list[Submission]:
    """One submission per student: every folder in `folder` (its notebooks, at any depth), and every notebook
    lying directly in `folder` (named after the file)."""
    folder = pathlib.Path(folder)
    submissions = []
    for entry in sorted(folder.iterdir()):
        if entry.is_dir() and not entry.name.startswith("."):
            notebooks = _notebooks_below(entry)
            submissions.append(Submission(entry.name, notebooks, "" if notebooks else f"no notebook in {entry}"))
        elif entry.suffix == ".ipynb":
            submissions.append(Submission(entry.stem, [entry]))
    return submissions


def collect_nbgrader(course, assignment: str) -> list[Submission]:
    """nbgrader's layout: `course`/submitted/<student>/<assignment>/*.ipynb, one submission per student."""
    root = pathlib.Path(course) / "submitted"
    submissions = []
    for student in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        folder = student / assignment
        notebooks = _notebooks_below(folder) if folder.is_dir() else []
        submissions.append(Submission(student.name, notebooks,
                                      "" if notebooks else f"no notebook in {folder}"))
    return submissions


def _others_can_read(path: pathlib.Path) -> bool:
    try:
        return bool(path.stat().st_mode & stat.S_IROTH)
    except OSError:
        return False


def warn_about_exposure(submissions, stream) -> None:
    """As root, say so when other users (the sandbox's among them) can read the submissions: a submission
    could then read another student's notebook while it runs."""
    exposed = [p for s in submissions for p in s.notebooks if _others_can_read(p)]
    if exposed:
        print(f"note: {len(exposed)} submitted notebook(s) can be read by every user, the sandbox users included (for "
              f"example {exposed[0]}); make them private (chmod -R o-rwx) so no submission can read another's.",
              file=stream)


def preload() -> None:
    """Import everything the judge will use before any submission runs: a module imported later would be read from
    disk after a submission could have changed it (without root, the sandbox runs as the judge's user)."""
    from IPython.core import inputtransformer2  # noqa: F401 - the cell plan's translation of IPython syntax

    from course_lib.exercises import registry
    from course_lib.grade import cells, channel, notebook, results, sandbox  # noqa: F401
    from course_lib.training import data_parallel, toy  # noqa: F401 - average_gradients' oracle
    from course_lib.viz import traffic_plots  # noqa: F401 - the traffic questions' formulas

    for exercise in registry.all_exercises():
        if exercise.kind == "function":
            first = exercise.cases(hidden=True)[0]
            exercise.oracle(first, exercise.inputs(first))
        else:
            exercise.rubric


def grade_submissions(submissions, *, jobs: int | None = None, weights: dict | None = None, timeout: float = 900.0,
                      cell_timeout: float = 300.0, progress=None, user_base: str = DEFAULT_USER) -> list:
    """Grade every notebook of every submission, `jobs` at a time; returns one `SubmissionGrade` per submission.

    Args:
        jobs: notebooks graded at once (default: one per core).
        weights: a rubric file's {exercise: {line: points}}.
        timeout, cell_timeout: seconds for one notebook, and for one of its cells.
        progress: a stream for one line per notebook done (with the time left), or None.
        user_base: as root, the sandbox users' name (user_base, user_base1, ...); made when missing.

    Example::

        >>> grades = grade_submissions(collect_class("submissions"), progress=sys.stderr)
        [ 1/16] alice/00_hello_ranks.ipynb: 5/5 in 9.8 s (about 2 min left)
    """
    jobs = jobs or default_jobs()
    preload()
    grades = [SubmissionGrade(s.name, [None] * len(s.notebooks), s.problem) for s in submissions]
    tasks = deque((i, j) for i, s in enumerate(submissions) for j in range(len(s.notebooks)))
    remaining = {i: len(s.notebooks) for i, s in enumerate(submissions)}
    total, done, started = len(tasks), 0, time.monotonic()
    root_mode = running_as_root()
    users = sandbox_users(min(jobs, max(1, len(submissions))), user_base) if root_mode else []
    free, bound = list(users), {}
    workroot = pathlib.Path(tempfile.mkdtemp(prefix="course_lib-grading-"))
    os.chmod(workroot, 0o711)      # a sandbox may enter its own folder here, not list the others
    try:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            running = {}
            while tasks or running:
                while tasks and len(running) < jobs:
                    student, index = tasks[0]
                    if root_mode and student not in bound:
                        if not free:
                            break
                        bound[student] = free.pop(0)
                    tasks.popleft()
                    future = pool.submit(judge.grade_notebook, submissions[student].notebooks[index],
                                         user=bound.get(student), workroot=workroot, timeout=timeout,
                                         cell_timeout=cell_timeout, weights=weights)
                    running[future] = (student, index)
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in finished:
                    student, index = running.pop(future)
                    grades[student].notebooks[index] = future.result()
                    remaining[student] -= 1
                    done += 1
                    if remaining[student] == 0 and student in bound:
                        user = bound.pop(student)
                        sweep_user(user)
                        free.append(user)
                    if progress is not None:
                        _report(progress, done, total, submissions[student], grades[student].notebooks[index], started)
    finally:
        for user in bound.values():
            sweep_user(user)
        release_users(users)
        shutil.rmtree(workroot, ignore_errors=True)
    return grades


def _report(stream, done, total, submission, grade, started) -> None:
    elapsed = time.monotonic() - started
    left = elapsed / done * (total - done)
    eta = f"about {left / 60:.0f} min left" if left >= 90 else f"about {left:.0f} s left" if done < total else "done"
    name = pathlib.Path(grade.path).name
    print(f"[{done:>{len(str(total))}}/{total}] {submission.name}/{name}: {judge.describe(grade)} in "
          f"{grade.seconds:.1f} s ({eta})", file=stream, flush=True)
