"""The judge: grades one notebook without ever running its code here.

`grade_notebook` reads the notebook as data, decides which of its cells the answers need (`cells.py`), and
has a sandbox (`sandbox.py`, `kernel.py`) run those cells. Then, for every exercise, it asks the sandbox
for data only: a question's answer as a value (or, for a formula written as a function, its values on a
grid of G and N), a function exercise's batches of cases as the ranks' records. The cases, every rank's
input, the oracle, the judging and the points are all computed here, from that data; nothing the
submission's processes send is executed, and nothing they send can reach a score except as data that is
checked against the judge's own oracle.

Failures cost what they touch: a cell that raises is noted and the notebook runs on; a cell that runs too
long is interrupted; a cell that kills its process, or reaches one of the sandbox's limits (memory, disk,
processes: the warden stops the whole sandbox), is left out and the notebook run again without it, with a note
that says which; an answer whose check does the same scores 0 and the sandbox is started again for the next
exercise; the notebook's own time limit ends it.
"""

from __future__ import annotations

import dataclasses
import keyword
import os
import pathlib
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from fractions import Fraction

from course_lib.exercises import QUESTION_NOT_DONE, registry, runner
from course_lib.exercises.report import Result, format_points
from course_grader import assign, reading
from course_grader.hidden_cases import grader_cases
from course_grader.notebook import NotebookError, code_cells, exercises_of_number, read_file
from course_grader.reading import read_notebook
from course_grader.sandbox import (Limits, Sandbox, SandboxDied, SandboxError, SandboxStartError, SandboxTimeout,
                                      SandboxUser, choose_isolation, default_user, human, limit_words, release_users,
                                      running_as_root, sandbox_users, sweep_user)

__all__ = ["NotebookGrade", "grade_notebook", "GRADING_BUDGET"]

STOP = threading.Event()  # set when the grader is stopped from outside: no sandbox starts, no cell runs after it
WORK_PREFIXES = ("course_lib-grade-", "course_lib-grading-")   # the judge's work folders in the temporary folder
OWNER_FILE = "judge.pid"  # in each: the judge process that made it (a later run removes it when that one is gone)
GRADING_BUDGET = 300.0    # seconds one exercise's hidden cases may take in all (the learner's check has 45)
_VALUE_TIMEOUT = 60.0     # seconds a question's answer may take to compute (a formula on the whole grid)
_CELL_NOTES = 20          # notes on cells that raised, at most (then how many more)


@dataclass
class NotebookGrade:
    """What one notebook got.

    Attributes:
        path: the notebook's file.
        status: 'graded', or 'unreadable' (not a notebook) / 'unrunnable' (the grader could not run it).
        tests: one dict per exercise: name, score, max_score, output (the report) and lines (the rubric lines).
        notes: for the learner: cells that raised, ran too long or killed the process; processes left running.
        info: for the instructor: which cells ran and why.
        seconds: how long grading it took; timings: where that time went (starting sandboxes, running cells,
            each exercise's checks, stopping), in seconds.
    """

    path: str
    status: str = "graded"
    tests: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    info: list = field(default_factory=list)
    seconds: float = 0.0
    timings: dict = field(default_factory=dict)

    @property
    def score(self) -> float:
        return round(sum(t["score"] for t in self.tests), 2)

    @property
    def max_score(self) -> float:
        return round(sum(t["max_score"] for t in self.tests), 2)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"score": self.score, "max_score": self.max_score}


# --------------------------------------------------------------------------------------------------
# Answers rebuilt from data
# --------------------------------------------------------------------------------------------------


def _stand_in(type_name: str, text: str):
    """An object that prints like the learner's answer (a type the judge does not rebuild) and is nothing else."""
    name = type_name if isinstance(type_name, str) and type_name.isidentifier() and not keyword.iskeyword(type_name) \
        else "object"
    return type(name, (), {"__repr__": lambda self: str(text)[:300]})()


def _fraction(value):
    if (isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
            and value[1] != 0):
        return Fraction(value[0], value[1])
    return None


def _answer(value, depth=0):
    """A question's answer from the sandbox's data: text, numbers and tuples of them, or a stand-in."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict) and depth < 3:
        if value.get("ellipsis") is True:
            return Ellipsis
        if "fraction" in value:
            return _fraction(value["fraction"])
        if isinstance(value.get("sequence"), list):
            return tuple(_answer(v, depth + 1) for v in value["sequence"][:100])
        if "other" in value:
            return _stand_in(value.get("other"), value.get("repr", ""))
    return _stand_in("object", "something the grader does not read")


def _learner_error(type_name: str, message: str) -> Exception:
    name = type_name if isinstance(type_name, str) and type_name.isidentifier() else "Exception"
    return type(name, (Exception,), {})(str(message)[:300])


def _table_function(grid, values):
    """A function of (G, N) that answers with the learner's values on the grid (and raises their errors)."""
    table = {}
    for point, value in zip(grid, values):
        if isinstance(value, int) and not isinstance(value, bool):
            table[point] = value
        elif isinstance(value, float) or value is None:
            table[point] = value
        elif isinstance(value, dict) and "fraction" in value:
            table[point] = _fraction(value["fraction"])
        elif isinstance(value, dict) and isinstance(value.get("error"), list) and len(value["error"]) == 2:
            table[point] = _learner_error(*value["error"])
        else:
            table[point] = _stand_in("object", "not a number")

    def answer(G, N):
        value = table[(int(G), int(N))]
        if isinstance(value, Exception):
            raise value
        return value
    return answer


# --------------------------------------------------------------------------------------------------
# One notebook
# --------------------------------------------------------------------------------------------------


class _NotGradable(Exception):
    """The answer cannot be checked at all: the Result to give instead."""

    def __init__(self, result):
        super().__init__(result.feedback[0])
        self.result = result


def _zero(exercise, text: str, weights) -> Result:
    result = Result.not_done(exercise, text, weights)
    result.status = "failed"
    return result


def zero_tests(names, why: str, weights: dict | None) -> list:
    """0 for each exercise of `names` (a name or an Exercise), "not graded: " and the reason: a notebook graded
    with nothing."""
    exercises = [registry.get(name) if isinstance(name, str) else name for name in names]
    return [_zero(e, f"not graded: {why}", (weights or {}).get(e.name)).to_dict() for e in exercises]


class _Session:
    """One notebook's sandbox: started on first use, the cells the answers need run, started again after a cell
    killed it (and the plan made again without that cell: what it would have bound now comes from elsewhere)."""

    def __init__(self, path, cells, answer_names, workdir, log_path, user, cell_timeout, deadline, grade,
                 isolation="none", limits=None, notebook=None):
        self.path, self.cells, self.answer_names = path, cells, answer_names
        self.workdir, self.log_path, self.user = workdir, log_path, user
        self.cell_timeout, self.deadline, self.grade = cell_timeout, deadline, grade
        self.isolation, self.limits, self.notebook = isolation, limits or Limits(), notebook
        self.box: Sandbox | None = None
        self.skip: set = set()            # positions (in `cells`) of cells that killed the kernel
        self.left_running = 0
        self.run_notes: list = []
        self.raised = 0                   # cells that raised, noted or not
        self.limit_hit: str | None = None # the last limit the sandbox reached
        self.log_tail = ""                # the end of what the sandbox's kernel printed itself (for the instructor)
        self.timings = {"sandbox start": 0.0, "cells": 0.0, "stop": 0.0, "plan": 0.0}
        started = time.monotonic()
        self.plan, self.why = self._plan()
        self.timings["plan"] = time.monotonic() - started

    def _plan(self):
        kept = [i for i in range(len(self.cells)) if i not in self.skip]
        plan, why = reading.plan([self.cells[i][1] for i in kept], self.answer_names,
                                 positions=[self.cells[i][0] for i in kept])
        return [kept[i] for i in plan], why

    def describe_plan(self) -> str:
        numbers = ", ".join(str(self.cells[i][0]) for i in self.plan) or "none"
        return self.why or f"ran {len(self.plan)} of {len(self.cells)} code cells, those the answers need: {numbers}"

    def _left(self) -> float:
        return self.deadline - time.monotonic()

    def sandbox(self) -> Sandbox:
        """A sandbox in which the planned cells have run (all but those that killed it)."""
        while self.box is None:
            if STOP.is_set():
                raise SandboxTimeout("grading was stopped")
            if self._left() <= 0:
                raise SandboxTimeout("the notebook ran out of time")
            started = time.monotonic()
            try:
                self.box = self._start()
            except SandboxStartError as exc:
                # Once more: a sandbox can fail to start for a passing reason (the machine out of memory killed
                # its kernel first); one whose installation is broken fails again, and that is reported.
                self.grade.info.append(f"the sandbox did not start the first time ({exc}); it was started again")
                self.box = self._start()
            ready = time.monotonic()
            self.run_notes = []
            died_in = self._run_cells()
            self.timings["sandbox start"] += ready - started
            self.timings["cells"] += time.monotonic() - ready
            if died_in is not None:
                hit, why = self.box.limit_hit, self.box.why_ended()
                self.stop()
                self.skip.add(died_in)
                self.plan, self.why = self._plan()
                number = self.cells[died_in][0]
                self.grade.notes.append(
                    f"cell {number} reached the sandbox's {limit_words(hit)} and was stopped; the notebook was run "
                    "again without that cell" if hit else
                    f"the kernel died in cell {number}" + (f" ({why})" if why != "the kernel ended" else "")
                    + "; it was run again without that cell")
        self.grade.notes += self.run_notes
        self.run_notes = []
        return self.box

    def _start(self) -> Sandbox:
        return Sandbox.start(self.workdir, self.log_path, self.user, isolation=self.isolation, limits=self.limits,
                             notebook=self.notebook, startup_timeout=min(120, max(1, self._left())))

    def _run_cells(self):
        """Run the planned cells; the position (in `cells`) of the cell that killed the kernel, or None."""
        for position in self.plan:
            position_in_notebook, source = self.cells[position]
            left = self._left()
            if STOP.is_set():
                return None
            if left <= 0:
                self.run_notes.append(f"the notebook ran out of time at cell {position_in_notebook}; "
                                      "the cells after it did not run")
                return None
            try:
                reply = self.box.request({"op": "cell", "source": source}, timeout=min(self.cell_timeout, left))
            except SandboxTimeout:
                self.box.interrupt()
                try:
                    reply = self.box.await_reply(10)
                except (SandboxTimeout, SandboxDied, SandboxError):
                    return position
                self.run_notes.append(f"cell {position_in_notebook} ran longer than {self.cell_timeout:g} s and was "
                                      "interrupted")
                continue
            except (SandboxDied, SandboxError):
                return position
            if self.box.check_limits():
                return position
            if isinstance(reply, dict) and reply.get("status") == "error":
                error = str(reply.get("error", ""))[:300]
                if not error.startswith("KeyboardInterrupt"):
                    self.raised += 1
                    if self.raised <= _CELL_NOTES:
                        self.run_notes.append(f"cell {position_in_notebook} raised {error}" + self._memory_words(error))
        return None

    def _memory_words(self, error: str) -> str:
        """Where no cgroup holds the memory, a process's own limit refuses a large allocation: say which."""
        if any(words in error for words in ("MemoryError", "can't allocate memory", "Cannot allocate memory")):
            return f" (the sandbox's memory limit is {human(self.limits.memory)})"
        return ""

    def stop(self) -> None:
        if self.box is not None:
            started = time.monotonic()
            self.left_running += max(0, self.box.stop())
            tail = self.box.log_tail(600)
            if tail:
                self.log_tail = tail
            if self.box.limit_hit and self.isolation == "users" and self.user is not None:
                # Without namespaces what it wrote outside its folder (the disk it filled) lies in the shared
                # folders until the student's sweep: remove it now, so the notebook can run again without it.
                sweep_user(self.user, files=True, processes=False, skip=[str(pathlib.Path(self.workdir).parent)])
                _empty_folder(self.workdir, keep=(pathlib.Path(self.path).name,), user=self.user)
            self.limit_hit = self.box.limit_hit or self.limit_hit
            self.box = None
            self.timings["stop"] += time.monotonic() - started


def _check_question(box, exercise, weights) -> Result:
    formula = exercise.answer_kind == "formula"
    grid = exercise.grid() if formula else []
    reply = box.request({"op": "value", "name": exercise.answer_name, "formula": formula, "grid": grid},
                        timeout=_VALUE_TIMEOUT)
    kind = reply.get("kind") if isinstance(reply, dict) else None
    if kind == "missing":
        raise _NotGradable(_zero(exercise, f"{exercise.answer_name} is not defined in the notebook (did the cell that "
                                           "defines it run without an error?).", weights))
    if kind == "not_done":
        return Result.not_done(exercise, QUESTION_NOT_DONE, weights)
    if kind == "error":
        return Result.of_question(exercise, False, f"your answer raised {str(reply.get('error'))[:300]}", (), weights)
    if kind == "table" and isinstance(reply.get("values"), list) and len(reply["values"]) == len(grid):
        answer = _table_function(grid, reply["values"])
    elif kind == "value":
        answer = _answer(reply.get("value"))
    else:
        raise SandboxError("the sandbox's answer is not one the protocol allows")
    try:
        right, message, met = exercise.assess(answer)
    except NotImplementedError:
        return Result.not_done(exercise, QUESTION_NOT_DONE, weights)
    return Result.of_question(exercise, right, message, met, weights)


def _int_keys(table) -> dict:
    if not isinstance(table, dict):
        return {}
    return {int(key): value for key, value in table.items() if isinstance(key, str) and key.isdigit()
            and isinstance(value, list)}


def _check_function(box, exercise, weights, case_timeout, left=lambda: float("inf")) -> Result:
    """`left()`: the seconds the notebook has left; no launch of cases waits past them."""
    def run(world_size, batch, inputs, first, timeout):
        if left() <= 0:
            raise SandboxTimeout("the notebook ran out of time")
        reply = box.request({"op": "run", "exercise": exercise.name, "answer": exercise.answer_name,
                             "world_size": world_size, "cases": [dataclasses.asdict(c) for c in batch],
                             "inputs": inputs, "first": first, "case_timeout": timeout},
                            timeout=max(1.0, min(timeout * (len(batch) + 1) + 60, left())))
        kind = reply.get("kind") if isinstance(reply, dict) else None
        if kind == "missing":
            raise _NotGradable(_zero(exercise, f"{exercise.answer_name} is not defined in the notebook (did the cell "
                                               "that defines it run without an error?).", weights))
        if kind == "not_done":
            raise _NotGradable(Result.not_done(exercise, runner.feedback.NOT_DONE.format(function=exercise.answer_name),
                                               weights))
        if kind == "not_callable":
            raise _NotGradable(_zero(exercise, f"{exercise.answer_name} is a {str(reply.get('type'))[:60]}, not a "
                                               f"function: the exercise asks for {exercise.signature}.", weights))
        if kind != "batch":
            raise _NotGradable(_zero(exercise, "the check could not run your function: "
                                               f"{str(reply.get('error') if isinstance(reply, dict) else reply)[:300]}",
                                     weights))
        error = reply.get("launch_error")
        return runner.RankBatch(_int_keys(reply.get("records")), _int_keys(reply.get("stuck")),
                                error[:2000] if isinstance(error, str) else None)

    outcome = runner.drive(exercise, grader_cases(exercise), run, case_timeout=case_timeout,
                           budget=max(1.0, min(GRADING_BUDGET, left())))
    if outcome.not_done is not None:
        return Result.not_done(exercise, outcome.not_done, weights)
    return Result.of_cases(exercise, outcome.cases, hidden=True, weights=weights)


def _check(session, exercise, weights, case_timeout) -> Result:
    try:
        box = session.sandbox()
        if exercise.kind == "question":
            result = _check_question(box, exercise, weights)
        else:
            result = _check_function(box, exercise, weights, case_timeout, left=session._left)
        if box.check_limits():
            raise SandboxDied(box.why_ended())
        return result
    except _NotGradable as exc:
        return exc.result
    except SandboxStartError:
        raise
    except (SandboxDied, SandboxTimeout, SandboxError) as exc:
        hit = session.box.limit_hit if session.box is not None else None
        session.stop()
        if hit:
            return _zero(exercise, f"not graded: while it was checked, the notebook reached the sandbox's "
                                   f"{limit_words(hit)} and was stopped.", weights)
        if session._left() <= 0:
            return _zero(exercise, "not graded: the notebook ran out of its time while this exercise was checked "
                                   "(a function that never returns?).", weights)
        return _zero(exercise, f"not graded: the notebook's process stopped answering while it was checked ({exc}).",
                     weights)


def _empty_folder(folder: pathlib.Path, keep, user: SandboxUser | None) -> None:
    """Everything in the sandbox's folder but the notebook's copy removed; its tmp/ made again."""
    for entry in pathlib.Path(folder).iterdir():
        if entry.name not in keep:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
    (pathlib.Path(folder) / "tmp").mkdir(exist_ok=True)
    if user is not None:
        os.chown(pathlib.Path(folder) / "tmp", user.uid, user.gid)


def _workdir(root, user: SandboxUser | None, isolation: str, name: str, data: bytes) -> tuple:
    """The sandbox's folder and its copy of the notebook.

    namespaces: a folder of the judge's alone (the sandbox's mount points; the copy, which the sandbox's init puts
    in the sandbox's own home). Otherwise the sandbox's home itself, owned by `user`, with the copy in it."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix="notebook-", dir=root))
    safe = name if name and not name.startswith(".") else "notebook.ipynb"
    if isolation == "namespaces":
        copy = folder / "submitted.ipynb"
        copy.write_bytes(data)
        copy.chmod(0o600)
        return folder, {"source": str(copy), "name": safe}
    (folder / "tmp").mkdir()
    copy = folder / safe
    copy.write_bytes(data)
    copy.chmod(0o600)
    if user is not None:
        for path in (folder, folder / "tmp", copy):
            os.chown(path, user.uid, user.gid)
    return folder, None


def make_workroot(prefix: str) -> pathlib.Path:
    """A work folder of the judge's in the temporary folder, marked with this process's id; the folders of judges
    that are gone (killed before they could remove theirs) are removed first."""
    remove_stale_workroots()
    root = pathlib.Path(tempfile.mkdtemp(prefix=prefix))
    (root / OWNER_FILE).write_text(str(os.getpid()))
    root.chmod(0o711)          # a sandbox may enter its own folder here, not list the others
    return root


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_workroots() -> int:
    """Remove the work folders (and the submissions' copies in them) of judges that no longer run; how many."""
    removed = 0
    for folder in pathlib.Path(tempfile.gettempdir()).glob("course_lib-grad*-*"):
        if not folder.name.startswith(WORK_PREFIXES) or folder.is_symlink() or not folder.is_dir():
            continue
        try:
            if folder.stat().st_uid != os.getuid():
                continue
            owner = int((folder / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue
        if not _alive(owner):
            shutil.rmtree(folder, ignore_errors=True)
            removed += 1
    return removed


def grade_notebook(path, *, user: SandboxUser | None = None, workroot=None, timeout: float = 900.0,
                   cell_timeout: float = 300.0, weights: dict | None = None,
                   case_timeout: float | None = None, isolation: str | None = None, limits: Limits | None = None,
                   exercises: list | None = None, notes=()) -> NotebookGrade:
    """Grade the notebook at `path`: run the cells its answers need in a sandbox, check every exercise it has
    with the hidden cases, here, from the data the sandbox returns.

    Args:
        user: run the sandbox as this unprivileged user (`sandbox.sandbox_users`; the judge must be root). As root
            without one, a user is taken for this notebook alone and swept after.
        workroot: where the sandbox's folder is made (a private temporary folder by default).
        timeout: seconds for the whole notebook; cell_timeout: seconds for one cell.
        weights: {exercise: {line: points}} from a rubric file (`rubric_file.load_weights`).
        case_timeout: seconds one case may run on the ranks (default `runner.CASE_TIMEOUT`).
        isolation: 'namespaces', 'users', 'none', or None / 'auto': the strongest this machine gives
            (`sandbox.choose_isolation`).
        limits: the sandbox's memory, disk and processes (`sandbox.Limits`; its defaults otherwise).
        exercises: the exercises to grade it on (`assign.plan_submission` decides them for a submission); None:
            those of its own assignment that it has (`assign.plan_notebook`), the others noted.
        notes: notes to give the learner with it (from the submission's plan).

    Returns:
        A `NotebookGrade`. A file that is not a runnable notebook gets status 'unreadable', 'unrunnable', 'refused'
        or 'too large' and 0 for each exercise it was to be graded on (by default those of its file name's number).

    Example::

        >>> grade = grade_notebook("submissions/alice/04_ring_scatter_reduce.ipynb")
        >>> grade.score, grade.max_score
        (8.0, 10.0)
    """
    path = pathlib.Path(path)
    started = time.monotonic()
    grade = NotebookGrade(str(path))
    grade.notes += list(notes)
    weights = weights or {}
    try:
        data = read_file(path)
        notebook = read_notebook(path, data)
    except NotebookError as exc:
        grade.status = exc.kind
        grade.notes.append(str(exc))
        names = exercises if exercises is not None else exercises_of_number(path.name)
        grade.tests = zero_tests(names, str(exc), weights)
        grade.seconds = time.monotonic() - started
        return grade
    if exercises is None:
        _, names, foreign = assign.plan_notebook(notebook, path.name)
        grade.notes += foreign
    else:
        names = list(exercises)
    if not names:
        if exercises is None:
            grade.notes.append("no exercises found in this notebook")
        else:
            grade.status = "skipped"
        grade.seconds = time.monotonic() - started
        return grade
    isolation = choose_isolation(isolation)
    own_user = running_as_root() and user is None and isolation != "none"
    if own_user:
        (user,) = sandbox_users(1, default_user())
    exercises_ = [registry.get(name) for name in names]
    own_root = workroot is None
    root = make_workroot(WORK_PREFIXES[0]) if own_root else pathlib.Path(workroot)
    workdir, copy = _workdir(root, user, isolation, path.name, data)
    session = None
    checks = {}
    try:
        session = _Session(path, code_cells(notebook), [e.answer_name for e in exercises_], workdir,
                           root / f"{workdir.name}.log", user, cell_timeout, started + timeout, grade,
                           isolation=isolation, limits=limits, notebook=copy)
        for exercise in exercises_:
            before = time.monotonic() - sum(session.timings.values())
            result = _check(session, exercise, weights.get(exercise.name), case_timeout)
            checks[exercise.name] = time.monotonic() - sum(session.timings.values()) - before
            grade.tests.append(result.to_dict())
    except NotebookError as exc:                  # its cells could not be read within the reader's limits
        grade.status = exc.kind
        grade.notes.append(str(exc))
    except SandboxStartError as exc:
        grade.status = "unrunnable"
        grade.notes.append(str(exc))
    except Exception as exc:  # noqa: BLE001 - the grader itself failed: say so, grade nothing from this notebook
        grade.status = "failed"
        grade.notes.append(f"the grader failed on this notebook: {type(exc).__name__}: {str(exc)[:300]}")
    finally:
        try:
            if session is not None:
                session.stop()
        except Exception as exc:  # noqa: BLE001 - say so on this notebook; the others are graded all the same
            grade.status = "failed"
            grade.notes.append(f"the grader failed to stop this notebook's sandbox: {type(exc).__name__}: {exc}")
        if session is not None:
            grade.info.append(session.describe_plan())
        if session is not None and session.log_tail:
            grade.info.append("the sandbox's own output ended: " + session.log_tail)
        if session is not None and session.raised > _CELL_NOTES:
            grade.notes.append(f"{session.raised - _CELL_NOTES} more cells raised errors (not listed)")
        if session is not None and session.left_running:
            grade.notes.append(f"{session.left_running} process{'es' if session.left_running != 1 else ''} the "
                               "notebook started were still running after grading and were stopped")
        if own_user:
            sweep_user(user, files=isolation == "users")
            release_users([user])
        shutil.rmtree(workdir, ignore_errors=True)
        try:
            (root / f"{workdir.name}.log").unlink()
        except OSError:
            pass
        if own_root:
            shutil.rmtree(root, ignore_errors=True)
    if grade.status != "graded":
        grade.tests = zero_tests(exercises_, grade.notes[-1], weights)
    grade.seconds = time.monotonic() - started
    grade.timings = {**{k: round(v, 3) for k, v in (session.timings if session is not None else {}).items()},
                     "checks": {k: round(v, 3) for k, v in checks.items()}}
    return grade


def describe(grade: NotebookGrade) -> str:
    """'8/10' for a graded notebook, 'unreadable' for one that could not be read."""
    if grade.status != "graded":
        return grade.status
    return f"{format_points(grade.score)}/{format_points(grade.max_score)}"
