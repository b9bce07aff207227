"""Grading many notebooks at once: in parallel up to the cores, with progress, one user per student when root.

    submissions = collect_class("submissions/")         # submissions/<student>/**/*.ipynb, one per student
    grades = grade_submissions(submissions, jobs=8, progress=sys.stderr)

Every notebook is a task. Up to `jobs` run at a time (by default one per core: a notebook's checks keep a
core busy). As root, each student being graded gets a sandbox user of their own for as long as any of their
notebooks runs (their notebooks run in parallel under that user; another student's never do), and when the
student's last notebook is done, whatever that user still runs is killed. Without namespaces (isolation
'users') students are graded one at a time, and everything the user owns is removed before the next.

Files are taken as given: a folder is walked without following links, and a link, a device, a pipe or a
socket among the notebooks is refused with a note (never opened). What each notebook is graded on comes from
`assign.plan_submission`: the submission's assignment, one copy per exercise.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from course_grader import assign, judge
from course_grader.notebook import NotebookError, exercises_of_number, safe_name
from course_grader.sandbox import (IsolationError, Limits, checkouts, choose_isolation,
                                      default_user, exposed_to, readable_solutions, release_users, running_as_root,
                                      sandbox_users, sweep_user)

__all__ = ["Submission", "SubmissionGrade", "collect_class", "collect_nbgrader", "collect_files", "grade_submissions",
           "default_jobs"]


@dataclass
class Submission:
    """One student's notebooks, or `problem` when there is nothing to grade (a student folder without one).

    notebooks: the files to grade (refused ones, links and devices, included: they are planned, never opened).
    notes: what the collection refused or left out, for the learner.
    """

    name: str
    notebooks: list
    problem: str = ""
    notes: list = field(default_factory=list)
    root: pathlib.Path | None = None


@dataclass
class SubmissionGrade:
    name: str
    notebooks: list = field(default_factory=list)      # NotebookGrade per notebook (and one per missing exercise)
    problem: str = ""
    notes: list = field(default_factory=list)          # about the submission as a whole
    assignments: list = field(default_factory=list)    # what it was graded against

    @property
    def max_score(self) -> float:
        return round(sum(g.max_score for g in self.notebooks), 2)

    @property
    def score(self) -> float:
        """The notebooks' points, never more than the total possible."""
        return min(round(sum(g.score for g in self.notebooks), 2), self.max_score)

    @property
    def status(self) -> str:
        """'graded' when every notebook was read and graded; else what went wrong first."""
        if self.problem:
            return "missing"
        bad = [g.status for g in self.notebooks if g.status not in ("graded", "skipped")]
        return bad[0] if bad else "graded"


def default_jobs() -> int:
    """The cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def _is_notebook_name(name: str) -> bool:
    return name.endswith(".ipynb")


def _notebooks_below(folder: pathlib.Path) -> tuple[list, list]:
    """(the notebooks below `folder`, notes on what was refused), walking without following any link. A link or
    a non-regular file named *.ipynb is kept in the list (it is refused when graded, with a note); a link to a
    folder is not entered, and noted."""
    found, notes = [], []
    for top, folders, files in os.walk(folder, followlinks=False):
        top = pathlib.Path(top)
        folders.sort()
        for name in list(folders):
            path = top / name
            if name == ".ipynb_checkpoints" or name.startswith("."):
                folders.remove(name)
            elif path.is_symlink():
                folders.remove(name)
                notes.append(f"{safe_name(path.relative_to(folder))} is a symbolic link to a folder: not followed "
                             "(submit the notebooks themselves)")
        for name in sorted(files):
            if _is_notebook_name(name):
                found.append(top / name)
    return found, notes


def collect_files(paths, name: str = "submission") -> Submission:
    """The given files (or the notebooks in the given folders) as one submission."""
    notebooks, notes = [], []
    for path in map(pathlib.Path, paths):
        if path.is_dir() and not path.is_symlink():
            found, refused = _notebooks_below(path)
            notebooks += found
            notes += refused
        else:
            notebooks.append(path)
    root = None
    folders = [p for p in map(pathlib.Path, paths) if p.is_dir() and not p.is_symlink()]
    if len(folders) == 1 and len(list(paths)) == 1:
        root = folders[0]
    return Submission(name, notebooks, "" if notebooks else "no notebook to grade", notes, root)


def collect_class(folder) -> list[Submission]:
    """One submission per student: every folder in `folder` (its notebooks, at any depth), and every notebook
    lying directly in `folder` (named after the file). A student folder that is a link is refused, not entered."""
    folder = pathlib.Path(folder)
    submissions = []
    for entry in sorted(folder.iterdir()):
        if entry.name.startswith("."):
            continue
        if entry.is_symlink():
            if _is_notebook_name(entry.name):
                submissions.append(Submission(entry.stem, [entry], root=folder))
            else:
                submissions.append(Submission(entry.name, [], f"{safe_name(entry.name)} is a symbolic link: not "
                                                               "followed (each student's folder must be a folder)"))
        elif entry.is_dir():
            notebooks, notes = _notebooks_below(entry)
            submissions.append(Submission(entry.name, notebooks, "" if notebooks else f"no notebook in {entry}", notes,
                                          entry))
        elif _is_notebook_name(entry.name):
            submissions.append(Submission(entry.stem, [entry], root=folder))
    return submissions


def collect_nbgrader(course, assignment: str) -> list[Submission]:
    """nbgrader's layout: `course`/submitted/<student>/<assignment>/*.ipynb, one submission per student."""
    root = pathlib.Path(course) / "submitted"
    submissions = []
    for student in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        folder = student / assignment
        if student.is_symlink() or folder.is_symlink():
            submissions.append(Submission(student.name, [], f"{safe_name(folder)} is a symbolic link: not followed"))
            continue
        notebooks, notes = _notebooks_below(folder) if folder.is_dir() else ([], [])
        submissions.append(Submission(student.name, notebooks, "" if notebooks else f"no notebook in {folder}", notes,
                                      folder))
    return submissions


def refuse_exposure(user, submissions, extra=()) -> None:
    """Isolation 'users': the sandbox user must not be able to reach the instructor's checkout at all (not enter
    its folder: its .git holds every solved notebook, and git reads them for anyone who can name them), any other
    git repository of the course or solved notebook of the course anywhere on the machine, or any submission.
    Tried for real, as that user (`sandbox.exposed_to`).

    Raises:
        IsolationError: it could, with the paths and what to do.
    """
    from course_grader.sandbox import course_repositories, private_parts

    paths = [p for s in submissions for p in s.notebooks if not p.is_symlink()]
    paths += [s.root for s in submissions if s.root is not None]
    paths += list(extra)
    closed, repositories = [], []
    for repository in [*checkouts(), *(pathlib.Path(r) for r in course_repositories())]:
        if repository in repositories:
            continue
        repositories.append(repository)
        enter, files = private_parts(repository)
        closed += enter
        paths += files
    paths += readable_solutions()             # a solved notebook of the course anywhere on the machine
    entered = exposed_to(user, closed, enter=True)
    exposed = entered + [p for p in exposed_to(user, paths) if p not in entered]
    if not exposed:
        return
    shown = ", ".join(safe_name(p) for p in exposed[:3]) + (f" and {len(exposed) - 3} more" if len(exposed) > 3
                                                            else "")
    open_repositories = [r for r in repositories if any(pathlib.Path(p) == r or pathlib.Path(p).is_relative_to(r)
                                                        for p in exposed)]
    advice = []
    if open_repositories:
        advice.append(
            f"make the whole checkout private: chmod 700 {' '.join(safe_name(r) for r in open_repositories)} "
            "(closing notebooks/ and tests/ is not enough: the editable install's finder in site-packages names the "
            "checkout, and `git show HEAD:notebooks/...` reads every solved notebook from its .git; the grader "
            "reads course_lib through a copy of its own, so nothing needs the checkout open)")
    if any(not any(pathlib.Path(p) == r or pathlib.Path(p).is_relative_to(r) for r in repositories) for p in exposed):
        advice.append("make the submissions' folder and any solved notebook private too (chmod 700 on the folders "
                      "that hold them)")
    advice_text = "; ".join(advice)
    raise IsolationError(
        f"without namespaces the submissions run as the user {user.name}, which could read {shown}. "
        + advice_text[:1].upper() + advice_text[1:]
        + ". Or grade where namespaces are available (as root on Linux, or in a container with CAP_SYS_ADMIN)")


def preload() -> None:
    """Import everything the judge will use before any submission runs: a module imported later would be read from
    disk after a submission could have changed it (without root, the sandbox runs as the judge's user)."""
    from course_lib.exercises import registry
    from course_grader import channel, notebook, reading, results, sandbox  # noqa: F401 (cells: reading's child)
    from course_grader.hidden_cases import grader_cases
    from course_lib.training import data_parallel, toy  # noqa: F401 - average_gradients' oracle
    from course_lib.viz import traffic_plots  # noqa: F401 - the traffic questions' formulas

    for exercise in registry.all_exercises():
        if exercise.kind == "function":
            first = grader_cases(exercise)[0]
            exercise.oracle(first, exercise.inputs(first))
        else:
            exercise.rubric


def _missing_grade(name: str, weights) -> judge.NotebookGrade:
    from course_lib.exercises import registry

    exercise = registry.get(name)
    text = (f"no notebook of this submission has {name} (an exercise of {exercise.notebook}): submit "
            f"{exercise.notebook}.ipynb with it")
    grade = judge.NotebookGrade(f"{exercise.notebook}.ipynb", status="graded")
    grade.tests = [judge._zero(exercise, text, (weights or {}).get(name)).to_dict()]
    return grade


def grade_submissions(submissions, *, jobs: int | None = None, weights: dict | None = None, timeout: float = 900.0,
                      cell_timeout: float = 300.0, progress=None, user_base: str | None = None,
                      isolation: str | None = None, limits: Limits | None = None, assignment: list | None = None,
                      protect=()) -> list:
    """Grade every notebook of every submission, `jobs` at a time; returns one `SubmissionGrade` per submission.

    Args:
        jobs: notebooks graded at once (default: one per core).
        weights: a rubric file's {exercise: {line: points}}.
        timeout, cell_timeout: seconds for one notebook, and for one of its cells.
        progress: a stream for one line per notebook done (with the time left), or None.
        user_base: as root, the sandbox users' name (user_base, user_base1, ...; default `sandbox.default_user`);
            made when missing.
        isolation: 'namespaces', 'users', 'none', or None / 'auto' (`sandbox.choose_isolation`).
        limits: each sandbox's memory, disk and processes (`sandbox.Limits`).
        assignment: the assignments every submission is for (`assign.resolve_assignment`); None: each
            submission's notebooks say.
        protect: more paths the sandbox must not read (isolation 'users' checks them; e.g. Gradescope's source).

    Raises:
        IsolationError: isolation 'users' and the sandbox user could read the checkout or a submission.

    Example::

        >>> grades = grade_submissions(collect_class("submissions"), progress=sys.stderr)
        [ 1/16] alice/00_hello_ranks.ipynb: 5/5 in 9.8 s (about 2 min left)
    """
    jobs = jobs or default_jobs()
    isolation = choose_isolation(isolation)
    limits = limits or Limits()
    plans = [_plan(s, assignment) for s in submissions]
    grades = [SubmissionGrade(s.name, [None] * len(s.notebooks), s.problem, list(s.notes), plan.assignments)
              for s, plan in zip(submissions, plans)]
    tasks = deque()
    for i, (submission, plan) in enumerate(zip(submissions, plans)):
        for j, notebook in enumerate(plan.notebooks):
            if notebook.grade or notebook.error is not None and not notebook.found:
                tasks.append((i, j))
            else:
                skipped = judge.NotebookGrade(str(notebook.path), status="skipped" if notebook.found else "graded")
                skipped.notes = list(notebook.notes) or ["no exercises found in this notebook"]
                if notebook.error is not None:
                    skipped.status = notebook.error.kind
                    skipped.notes.insert(0, str(notebook.error))
                grades[i].notebooks[j] = skipped
    remaining = {i: sum(1 for t in tasks if t[0] == i) for i in range(len(submissions))}
    total, done, started = len(tasks), 0, time.monotonic()
    root_mode = running_as_root() and isolation != "none"
    one_at_a_time = isolation == "users"         # no other submission may run beside one (its ports, its files)
    user_base = user_base or default_user()
    users = sandbox_users(1 if one_at_a_time else min(jobs, max(1, len(submissions))), user_base) if root_mode else []
    free, bound = list(users), {}
    workroot = judge.make_workroot(judge.WORK_PREFIXES[1])
    try:
        if one_at_a_time:
            refuse_exposure(users[0], submissions, protect)
        preload()
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            running = {}
            try:
                while tasks or running:
                    while tasks and len(running) < jobs:
                        student, index = tasks[0]
                        if root_mode and student not in bound:
                            if not free:
                                break
                            bound[student] = free.pop(0)
                        tasks.popleft()
                        plan = plans[student].notebooks[index]
                        future = pool.submit(judge.grade_notebook, plan.path, user=bound.get(student),
                                             workroot=workroot, timeout=timeout, cell_timeout=cell_timeout,
                                             weights=weights, isolation=isolation, limits=limits,
                                             exercises=plan.grade, notes=plan.notes)
                        running[future] = (student, index)
                    finished, _ = wait(running, return_when=FIRST_COMPLETED)
                    for future in finished:
                        student, index = running.pop(future)
                        grades[student].notebooks[index] = _result(future, plans[student].notebooks[index], weights)
                        remaining[student] -= 1
                        done += 1
                        if remaining[student] == 0 and student in bound:
                            user = bound.pop(student)
                            sweep_user(user, files=one_at_a_time)
                            free.append(user)
                        if progress is not None:
                            _report(progress, done, total, submissions[student], grades[student].notebooks[index],
                                    started)
            except BaseException:
                # Stopped from outside (SIGTERM, Ctrl-C): no sandbox starts and no cell runs after this, and the
                # sandboxes' processes are killed, so the notebooks running now end at once, not at their timeout.
                judge.STOP.set()
                for user in users:
                    sweep_user(user)
                raise
    finally:
        for user in bound.values():
            sweep_user(user, files=one_at_a_time)
        release_users(users)
        shutil.rmtree(workroot, ignore_errors=True)
    for grade, plan in zip(grades, plans):
        grade.notebooks += [_missing_grade(name, weights) for name in plan.missing]
    return grades


def _plan(submission: Submission, assignment) -> assign.SubmissionPlan:
    """What each of the submission's notebooks is graded on; a failure here (whatever its files hold) fails this
    submission alone: each file is then graded 0 with the reason."""
    try:
        return assign.plan_submission(submission.notebooks, assignment, root=submission.root)
    except Exception as exc:  # noqa: BLE001 - one submission's files must not stop the class
        reason = NotebookError("failed", f"the grader could not plan this submission ({type(exc).__name__}: "
                                         f"{str(exc)[:200]}); it was graded 0")
        names = [n for a in assignment or [] for n in assign.exercises_of(a)]
        notebooks = [assign.NotebookPlan(path, error=reason, found=names or exercises_of_number(path.name))
                     for path in submission.notebooks]
        return assign.SubmissionPlan(notebooks, list(assignment or []))


def _result(future, plan, weights) -> judge.NotebookGrade:
    """The notebook's grade, or 0 with the reason when grading it raised (that notebook alone)."""
    try:
        return future.result()
    except Exception as exc:  # noqa: BLE001 - one notebook must not stop the class
        grade = judge.NotebookGrade(str(plan.path), status="failed")
        grade.notes.append(f"the grader failed on this notebook: {type(exc).__name__}: {str(exc)[:300]}")
        grade.tests = judge.zero_tests(plan.grade, grade.notes[-1], weights)
        return grade


def _report(stream, done, total, submission, grade, started) -> None:
    elapsed = time.monotonic() - started
    left = elapsed / done * (total - done)
    eta = f"about {left / 60:.0f} min left" if left >= 90 else f"about {left:.0f} s left" if done < total else "done"
    name = safe_name(pathlib.Path(grade.path).name)
    print(f"[{done:>{len(str(total))}}/{total}] {safe_name(submission.name)}/{name}: {judge.describe(grade)} in "
          f"{grade.seconds:.1f} s ({eta})", file=stream, flush=True)
