"""Run a learner's function on real ranks, case by case, and never hang.

The work is split in two, so that a grader can keep the two sides in different processes:

* **rank side** (`run_batch`, in the learner's process: their notebook kernel, or the grader's sandbox):
  one `course_lib.launch` runs a batch of cases of one world size (a launch costs 0.1-0.2 s, a case
  milliseconds). Inside each rank, `_rank_main` loops over the cases; for each it takes the rank's input,
  calls the learner's function under a `Tracer`, and writes a record file (what came back, every message
  sent). `run_batch` returns the records as data (`RankBatch`).
* **judge side** (`drive`): picks the cases, computes every rank's input and the oracle (what each rank
  must end with), asks for batches, cleans what comes back (`wire.clean_record`), judges every case and
  decides what to run next. `run_function` joins the two in one process, for the learner's own check;
  the grader (`course_grader`) gives `drive` a `run_batch` that asks the sandbox.

What can go wrong, and what happens:

* an exception on some rank: that rank writes its error and stops; `launch` stops the others at
  once. The case fails with the exception; the remaining cases of that world size run in a new launch.
* a deadlock: from DEADLOCK_LOOK_AFTER seconds into a case, each rank's watchdog publishes what its rank
  is blocked in and reads what the others published. When every rank has finished or is blocked in a
  send or receive whose matching call no rank has made (`certain_deadlock`), no rank can ever move: the
  watchdogs write what each rank was blocked in and end the ranks at once. The case fails with an
  explanation read from all ranks' reports.
* an endless loop, or a hang the rule cannot be sure of (a receive from any source, a rank blocked in
  something that is not a send or receive): the watchdog notices that the case has run for
  `case_timeout` seconds, writes what the rank is blocked in (or which line of the learner's code it
  is running) and ends the rank. The first such case runs once more, alone, with RETRY_FACTOR times
  the time (a busy machine is not an endless loop). If it hangs again it fails in the same way. Once a
  hang has survived its longer run (or a deadlock was found), the function is known to hang, and a hang
  at a later world size counts at once: an endless loop then costs one timeout per world size, not
  five, and the check reaches every world size within its budget. While retries turn out to be the
  machine's slowness, every world size keeps its retry.
* each case is isolated: a hang or a crash costs that case and no other. The cases after it run in a new
  launch, so a function that hangs only when, say, the last node is smaller, keeps the points of every line
  the other cases earn. Once the function hung, a case costs a launch and perhaps a timeout, so the cases
  whose rubric lines are all missed already (`rubric.missed_for_good`: they cannot change the score) are
  not run, except the first of each world size: a ring that deadlocks everywhere still fails in seconds.
* a forbidden call (a built-in collective, course_lib's own implementation): that case scores 0.
* NotImplementedError: the exercise is "not done yet"; nothing else runs.
* a check that runs out of its overall time budget marks the cases it did not reach as not run.

No process outlives a check: `launch` kills and reaps every rank whatever happens.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

import torch

from course_lib.exercises import feedback, registry, rubric, wire
from course_lib.exercises.registry import Case, Problem
from course_lib.exercises.tracing import ForbiddenCall, Tracer, learner_frame

__all__ = ["CaseResult", "Outcome", "RankBatch", "run_function", "run_batch", "drive", "CASE_TIMEOUT", "BUDGET",
           "RETRY_FACTOR"]

CASE_TIMEOUT = 4.0   # seconds one case may take on the ranks (a correct one takes milliseconds)
DEADLOCK_LOOK_AFTER = 0.25   # seconds into a case after which the watchdogs look for a certain deadlock
RETRY_FACTOR = 4     # a case that hung runs once more, alone, with this many times the time, before it counts
BUDGET = 45.0        # seconds a whole check may take; cases not reached by then are not run
_STUCK_EXIT = 3


@dataclass
class CaseResult:
    """How one case went: 'passed', 'failed' or 'not run', and the problems found (first = earliest)."""

    case: Case
    status: str
    problems: list = field(default_factory=list)
    records: list | None = None  # the ranks' records (for pictures); None when the case did not finish

    @property
    def passed(self) -> bool:
        return self.status == "passed"


@dataclass
class Outcome:
    """Everything a check of a function found: one CaseResult per case, or `not_done`."""

    cases: list
    not_done: str | None = None


@dataclass
class RankBatch:
    """What one launch of a batch of cases brought back, as data.

    Attributes:
        records: {case index: [rank 0's record, rank 1's, ...]}, None for a rank that wrote none.
        stuck: {case index: [...]}: what each rank's watchdog wrote when the case hung, or None.
        launch_error: the launcher's message when the launch failed, else None.
    """

    records: dict
    stuck: dict
    launch_error: str | None = None


# --------------------------------------------------------------------------------------------------
# Inside each rank
# --------------------------------------------------------------------------------------------------


class _Call:
    """What an exercise's `run_case` calls the learner's function through: traced, timed, policed."""

    def __init__(self, fn, tracer, watchdog):
        self.fn, self.tracer, self._watchdog = fn, tracer, watchdog

    def __call__(self, *args, **kwargs):
        # The clock starts here, right after the case's built-in collectives lined the ranks up,
        # so every rank's watchdog fires at about the same moment.
        self._watchdog.started = time.monotonic()
        self._watchdog.in_learner = True
        try:
            with self.tracer:
                return self.fn(*args, **kwargs)
        finally:
            self._watchdog.in_learner = False

    @property
    def messages(self):
        return self.tracer.messages


class _CaseStopped(BaseException):
    """Raised in a rank after it recorded a failed case: ends the launch at once."""


class _Watchdog(threading.Thread):
    """Ends this rank when a case runs too long, or at once when the case is deadlocked, after writing where the
    rank was.

    From `DEADLOCK_LOOK_AFTER` seconds into a case, the watchdog also publishes what its rank is doing (a small
    file, `_publish`) and reads what every rank published: when `certain_deadlock` finds that no rank can ever move
    again, it leaves a marker that every rank's watchdog acts on, and the case ends without waiting for its timeout.
    """

    def __init__(self, workdir, rank, timeout, world_size=1):
        super().__init__(daemon=True, name="course_lib-exercise-watchdog")
        self.workdir, self.rank, self.timeout, self.world_size = workdir, rank, timeout, world_size
        self.main = threading.get_ident()
        self.case, self.started, self.tracer, self.in_learner = None, 0.0, None, False
        self.lock = threading.Lock()       # a case's end and a publication of its state never interleave
        self.start()

    def begin(self, index, tracer):
        with self.lock:
            self.tracer, self.started, self.case = tracer, time.monotonic(), index

    def end(self):
        with self.lock:
            if self.world_size > 1 and self.case is not None:
                # Another rank may be waiting for this one: tell it this rank has left the case, and what it posted.
                posted = _posted(self.tracer)
                with contextlib.suppress(OSError):    # without it the others wait for the timeout
                    _write_state(self.workdir, self.case, self.rank, {
                        "finished": True, "posted": posted or [], "unmatched": posted is None or self.tracer.unmatched})
            self.case = None

    def run(self):
        looked = None     # (case, every rank's state, when that read ended): the first of the two reads
        while True:
            time.sleep(0.05)
            case = self.case
            if case is None:
                continue
            elapsed = time.monotonic() - self.started
            if elapsed >= self.timeout:
                self._stop(case, deadlock=False)
            if elapsed < DEADLOCK_LOOK_AFTER or self.world_size == 1:
                continue
            try:
                looked = self._look_for_deadlock(case, looked)
            except Exception:  # noqa: BLE001 - whatever goes wrong here, the timeout above must still fire
                looked = None

    def _look_for_deadlock(self, case, looked):
        """Publish this rank's state, read everyone's, and end the case if the last two reads show a deadlock."""
        if os.path.exists(_path(self.workdir, case, "all", "deadlock")):
            self._stop(case, deadlock=True)
        with self.lock:
            if self.case != case:
                return None
            self._publish(case)
        now = [_read_state(self.workdir, case, r) for r in range(self.world_size)]
        if looked is not None and looked[0] == case and certain_deadlock(looked[1], now, looked[2]):
            open(_path(self.workdir, case, "all", "deadlock"), "w").close()
            self._stop(case, deadlock=True)
        return case, now, time.monotonic()

    def _publish(self, case):
        """Write what this rank is doing: blocked in which call (and which call of the other side would meet it),
        and what it has posted. Two publications with the same entry number: the rank was in that call all the while
        in between."""
        tracer = self.tracer
        blocked = tracer.blocked
        at = time.monotonic()
        posted = _posted(tracer)       # constant while the rank is blocked in `blocked`
        # Still the same call after reading `posted`: then it was blocked in it at `at`, and `posted` is its count.
        if blocked is None or blocked is not tracer.blocked or not self.in_learner or posted is None:
            state = {"finished": False, "entry": None, "at": at}
        else:
            state = {"finished": False, "entry": blocked[4], "match": blocked[5], "posted": posted,
                     "unmatched": tracer.unmatched, "at": at}
        _write_state(self.workdir, case, self.rank, state)

    def _stop(self, case, deadlock):
        frame = sys._current_frames().get(self.main)
        tracer = self.tracer
        blocked = tracer.blocked if tracer is not None else None
        record = {"status": "stuck", "in_learner": self.in_learner, "deadlock": deadlock,
                  "call": blocked[0] if blocked else None, "peer": blocked[1] if blocked else None,
                  "where": (blocked[3] if blocked else "") or (learner_frame(frame) if frame is not None else ""),
                  "messages": list(tracer.messages) if tracer is not None else [],
                  "printed": (tracer.printed.size, tracer.printed.text) if tracer is not None else (0, "")}
        try:
            _save(self.workdir, case, self.rank, record, suffix="stuck")
            time.sleep(0.5)  # let the other ranks' watchdogs write theirs before launch stops everyone
        finally:
            os._exit(_STUCK_EXIT)     # with a report or without one, the rank ends


def _posted(tracer):
    """[direction, peer, tag, count] of every call the rank posted, or None when it posted one while we copied."""
    try:
        return [[d, p, t, c] for (d, p, t), c in list(tracer.posted.items())]
    except RuntimeError:
        return None


def _write_state(workdir, case, rank, state):
    path = _path(workdir, case, rank, "state")
    with open(path + ".tmp", "w") as f:
        json.dump(state, f)
    os.replace(path + ".tmp", path)


def _read_state(workdir, case, rank):
    try:
        with open(_path(workdir, case, rank, "state")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def certain_deadlock(before: list, now: list, read_before: float) -> bool:
    """Whether no rank of a case can ever move again, from two reads of every rank's published state.

    A rank's state is ``{"finished": True, "posted": ...}`` once it has left the case, or, while it runs,
    ``{"finished": False, "entry": n, "match": [direction, peer, tag, k], "posted": ..., "at": t}``: blocked in its
    n-th blocking call since the case began (None: not blocked), which is its k-th call of `direction` ("send" or
    "recv") to or from `peer` with `tag`; ``posted`` lists [direction, peer, tag, count] of every call it made.

    **A consistent moment.** `before` was read by ``read_before``; `now` later. A rank that shows the same entry in
    both, with its second state written after ``read_before``, was in that call the whole time in between, so at
    ``read_before`` every rank was where the two reads say (a rank that has finished stays finished).

    **The rule.** gloo pairs the k-th send from rank s to rank r with tag t with r's k-th receive from s with tag t.
    A blocked receive completes only once its sender posts that send; a blocked send (gloo's send waits for its
    receive; measured: a 1-element send returns only when the receiver posts, 1.5 s later) only once its receiver
    posts that receive. So if, at one moment, every rank has finished or is blocked, and no blocked call's matching call
    has been posted, no call can complete and no rank can post anything ever again: a certain deadlock.

    Anything else (a rank running code, a receive from any source, a call on a subgroup or from a second thread, a
    call that failed, a state missing) is not certain, and the case's timeout decides. What the tracer does not see
    cannot be counted: a learner who calls gloo past it (``dist.distributed_c10d.send``, a ProcessGroup's methods)
    could be called deadlocked while such a message is on its way; such a function fails its check anyway (its
    messages are not in the trace).
    """
    if not now or len(before) != len(now) or any(s is None for s in before + now):
        return False
    for was, state in zip(before, now):
        if state.get("unmatched"):
            return False
        if state["finished"]:
            if not was["finished"]:
                return False
            continue
        if (was["finished"] or state.get("match") is None or was.get("entry") is None
                or was["entry"] != state["entry"] or not state["at"] > read_before):
            return False
    posted = [{(d, p, t): c for d, p, t, c in state["posted"]} for state in now]
    for rank, state in enumerate(now):
        if state["finished"]:
            continue
        direction, peer, tag, k = state["match"]
        if not 0 <= peer < len(now) or peer == rank:
            return False
        matching = "recv" if direction == "send" else "send"
        if posted[peer].get((matching, rank, tag), 0) >= k:
            return False          # the call that matches it is posted: it can complete
    return True


def _path(workdir, index, rank, suffix="done"):
    return os.path.join(workdir, f"case{index}.rank{rank}.{suffix}")


class _Pickler(pickle.Pickler):
    """Pickles CPU tensors as numpy arrays: a record holds hundreds of tiny tensors, and torch's own
    tensor pickling costs about ten times more per tensor on both ends."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.requires_grad:
            try:
                return torch.from_numpy, (obj.detach().numpy().copy(),)
            except (TypeError, RuntimeError):  # a dtype numpy lacks (bfloat16)
                return NotImplemented
        return NotImplemented


def _save(workdir, index, rank, record, suffix="done"):
    path = _path(workdir, index, rank, suffix)
    with open(path + ".tmp", "wb") as f:
        _Pickler(f, protocol=pickle.HIGHEST_PROTOCOL).dump(record)
    os.replace(path + ".tmp", path)


def _load(workdir, index, rank, suffix="done"):
    try:
        with open(_path(workdir, index, rank, suffix), "rb") as f:
            return pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError):
        return None


def _raising_function(exc) -> str:
    """The name of the innermost learner function in the traceback (the one still to be written)."""
    name, tb = "", exc.__traceback__
    while tb is not None:
        if learner_frame(_OneFrame(tb)):
            name = tb.tb_frame.f_code.co_name
        tb = tb.tb_next
    return name


class _OneFrame:
    def __init__(self, tb):
        self.f_code, self.f_lineno, self.f_back = tb.tb_frame.f_code, tb.tb_lineno, None


def _lost_a_peer(exc) -> bool:
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        words in text for words in ("connection closed", "connection reset", "broken pipe", "connection refused"))


def _rank_main(rank, world_size, exercise_name, fn, cases, inputs, first_index, workdir, case_timeout):
    exercise = registry.get(exercise_name)
    # The cases are tiny, and a forked rank that uses OpenMP threads after the notebook process did
    # can hang in its first parallel region (libgomp is not fork-safe): one thread each.
    torch.set_num_threads(1)
    watchdog = _Watchdog(workdir, rank, case_timeout, world_size)
    namespaces = [getattr(fn, "__globals__", None)]
    for offset, case in enumerate(cases):
        index = first_index + offset
        options = {"largest_message": case.numel, **exercise.tracer_options(case)}
        tracer = Tracer(case_index=offset + 1, forbidden_modules=exercise.forbidden, namespaces=namespaces, **options)
        # Line the ranks up, so that every rank's watchdog starts counting at about the same moment: on a busy
        # machine a rank can start a case seconds after another, which would otherwise read as a hang.
        torch.distributed.barrier()
        watchdog.begin(index, tracer)
        try:
            record = exercise.run_case(_Call(fn, tracer, watchdog), case, rank, world_size, inputs[offset][rank])
            record["status"] = "ok"
        except ForbiddenCall as exc:
            record = {"status": "forbidden", "what": exc.what}
        except NotImplementedError as exc:
            record = {"status": "not_done", "function": _raising_function(exc)}
        except BaseException as exc:  # noqa: BLE001 - the learner's code may raise anything
            if _lost_a_peer(exc):
                # Another rank ended (its watchdog, or its own error): that rank's report is the story.
                # launch is stopping everyone; wait for it rather than report a consequence.
                time.sleep(case_timeout + 5)
            record = {"status": "error", **feedback.describe_exception(exc)}
        watchdog.end()
        record["messages"] = tracer.messages
        record["printed"] = (tracer.printed.size, tracer.printed.text)
        _save(workdir, index, rank, record)
        if record["status"] == "not_done" or (record["status"] != "ok"
                                              and not _everyone_reported(workdir, index, world_size)):
            # Some rank is still inside the case, waiting for this one: end the launch.
            raise _CaseStopped()
        # Every rank finished this case (some with an error): nobody waits, and the tags keep any
        # message it left behind out of the next case, so go on without a new launch.
    return None


def _everyone_reported(workdir, index, world_size, wait: float = 0.3) -> bool:
    deadline = time.monotonic() + wait
    while True:
        if all(os.path.exists(_path(workdir, index, r)) for r in range(world_size)):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


# --------------------------------------------------------------------------------------------------
# Rank side: one launch for a batch of cases
# --------------------------------------------------------------------------------------------------


def _launch_quietly(*args, **kwargs):
    """course_lib.launch with the ranks' relayed output kept out of the notebook (and out of stderr,
    which nbgrader would read as a failed test)."""
    from course_lib.launch import LaunchError, launch

    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        try:
            launch(*args, **kwargs)
            return None
        except LaunchError as err:
            return err


def run_batch(exercise_name: str, fn, world_size: int, cases, inputs, first_index: int,
              case_timeout: float) -> RankBatch:
    """Run `cases` (all of world size `world_size`, numbered from `first_index`) on `fn` in one launch.

    Runs in the learner's process: the ranks are forked from it and carry `fn`.

    Args:
        exercise_name: the exercise whose `run_case` builds each call.
        inputs: inputs[k][r] is rank r's input for cases[k] (`FunctionExercise.inputs`).
        case_timeout: seconds one case may take on the ranks.

    Returns:
        A `RankBatch`: every rank's record per case, what hung ranks wrote, the launcher's error.
    """
    import importlib

    for module in registry.get(exercise_name).forbidden:
        # Imported here, once, rather than by every forked rank's tracer (which swaps their functions out).
        importlib.import_module(f"course_lib.{module}")
    workdir = tempfile.mkdtemp(prefix="course_lib-check-")
    try:
        backstop = case_timeout * (len(cases) + 1) + 10
        error = _launch_quietly(_rank_main, world_size,
                                args=(exercise_name, fn, list(cases), list(inputs), first_index, workdir, case_timeout),
                                backend="course_lib", timeout=backstop)
        indices = range(first_index, first_index + len(cases))
        records = {i: [_load(workdir, i, r) for r in range(world_size)] for i in indices}
        stuck = {i: [_load(workdir, i, r, "stuck") for r in range(world_size)] for i in indices}
        return RankBatch(records, stuck, None if error is None else str(error))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# Judge side: cases, oracle, judging
# --------------------------------------------------------------------------------------------------


def _states_of(records, stuck, world_size):
    states = {}
    for rank in range(world_size):
        if records[rank] is not None and records[rank]["status"] == "ok":
            states[rank] = {"kind": "finished", "call": None, "peer": None, "where": "", "printed": 0}
        elif stuck[rank] is not None:
            s = stuck[rank]
            kind = "blocked" if s["call"] else ("running" if s["in_learner"] else "finished")
            states[rank] = {"kind": kind, "call": s["call"], "peer": s["peer"], "where": s["where"],
                            "printed": s["printed"][0]}
        else:
            states[rank] = {"kind": "unknown", "call": None, "peer": None, "where": "", "printed": 0}
    return states


def _failed_case(exercise, case, records, stuck, launch_error, case_timeout):
    """Explain a case that did not finish on every rank. Returns (CaseResult, what to do next)."""
    G = case.world_size
    function = exercise.answer_name
    statuses = {r: rec["status"] for r, rec in enumerate(records) if rec is not None}
    printed = {r: rec["printed"][0] for r, rec in enumerate(records) if rec is not None}
    printed.update({r: s["printed"][0] for r, s in enumerate(stuck) if s is not None})
    loud = feedback.explain_printing(printed)
    if "not_done" in statuses.values():
        who = next(rec["function"] for rec in records if rec is not None and rec["status"] == "not_done")
        return None, feedback.NOT_DONE.format(function=who or function)
    problems = []
    if "forbidden" in statuses.values():
        what = {r: rec["what"] for r, rec in enumerate(records) if rec is not None and rec["status"] == "forbidden"}
        problems.append(Problem(feedback.explain_forbidden(what, function, G), order=(-1,)))
        follow = "next"
    elif "error" in statuses.values():
        errors = {r: rec for r, rec in enumerate(records) if rec is not None and rec["status"] == "error"}
        problems.append(Problem(feedback.explain_errors(errors, function, G), order=(-1,)))
        follow = "next"
    elif any(s is not None for s in stuck):
        # The messages sent before the case hung often show the mistake that made it hang.
        partial = [rec if rec is not None and rec["status"] == "ok" else stuck[r] for r, rec in enumerate(records)]
        if all(p is not None for p in partial):
            try:
                problems.extend(exercise.judge(case, partial, complete=False))
            except Exception:  # noqa: BLE001 - a partial trace the judge cannot read adds nothing
                pass
        problems.sort(key=lambda p: p.order)
        certain = any(s is not None and s.get("deadlock") for s in stuck)
        problems.append(Problem(feedback.explain_stuck(_states_of(records, stuck, G), function, case_timeout,
                                                       certain=certain), order=(99,)))
        follow = "deadlock" if certain else "skip"
    else:
        text = launch_error if launch_error is not None else "the ranks stopped without a report"
        problems.append(Problem(feedback.readable(f"the ranks failed: {text}"), order=(-1,)))
        follow = "next"
    if loud:
        problems.insert(0, Problem(loud, order=(-2,)))
    return CaseResult(case, "failed", problems[:1] + problems[1:]), follow


def _is_silent(result) -> bool:
    """A finished case on G >= 2 ranks in which no rank sent a message."""
    return (result.records is not None and result.case.world_size > 1
            and not any(m.is_send for record in result.records for m in record["messages"]))


def _charge_silence(exercise, results) -> None:
    """When the function sent no message in any finished case on G >= 2 ranks, it exchanged nothing the check can
    see: what it returned or left was not made by messages (or no work was done), and the lines that found no
    fault in messages that do not exist (the chunks, the return value) earn nothing either. Every such case fails
    every line. (A function that is silent only sometimes, like a loop one step short at G = 2, is judged case by
    case as usual.)"""
    talking = [r for r in results if r.records is not None and r.case.world_size > 1 and not _is_silent(r)]
    silent = [r for r in results if _is_silent(r)]
    if talking or not silent:
        return
    for result in silent:
        result.problems.insert(0, Problem(
            f"no GPU sent a message, in any case: {exercise.answer_name} has to exchange the data with point-to-point "
            "messages (torch.distributed send/recv/isend/irecv, or course_lib.p2p). A result the messages do not "
            "explain earns nothing.", order=(-1,)))
        result.status = "failed"


def _judge(exercise, case, records):
    loud = feedback.explain_printing({r: rec["printed"][0] for r, rec in enumerate(records)})
    try:
        problems = sorted(exercise.judge(case, records), key=lambda p: p.order)
    except Exception as exc:  # noqa: BLE001 - e.g. a return value of a type nobody expected
        problems = [Problem(f"the check could not read what {exercise.answer_name} produced "
                            f"({type(exc).__name__}: {exc})")]
    if loud:
        problems.insert(0, Problem(loud, order=(-2,)))
    return CaseResult(case, "failed" if problems else "passed", problems, records)


def _merge(exercise, raw_records, oracle):
    """Each rank's record cleaned to what the judge reads, with the oracle's facts laid over it."""
    merged = []
    for rank, raw in enumerate(raw_records):
        record = wire.clean_record(raw, exercise.observed)
        if record is not None and record["status"] == "ok":
            record.update(oracle[rank])
        merged.append(record)
    return merged


def drive(exercise, cases, run, *, case_timeout: float | None = None, budget: float | None = None) -> Outcome:
    """Run every case of `exercise` through `run` (batches of one world size) and judge what comes back.

    This is the judge's side: the inputs and the oracle are computed here, and only data comes back.

    Args:
        cases: the cases to run.
        run: ``run(world_size, cases, inputs, first_index, case_timeout) -> RankBatch``; `run_batch`
            bound to the learner's function, or the grader's request to its sandbox.
        case_timeout, budget: seconds per case and for the whole check (default: CASE_TIMEOUT, BUDGET).

    Returns:
        An `Outcome`: one `CaseResult` per case, or `not_done` when the function is not written yet.
    """
    case_timeout = (CASE_TIMEOUT if case_timeout is None else case_timeout) * exercise.time_factor
    budget = (BUDGET if budget is None else budget) * exercise.time_factor
    cases = list(cases)
    inputs = [exercise.inputs(case) for case in cases]
    by_size: dict[int, list] = {}
    for index, case in enumerate(cases):
        by_size.setdefault(case.world_size, []).append(index)
    results: dict[int, CaseResult] = {}
    deadline = time.monotonic() + budget

    def evaluate(index, batch, timeout):
        """(CaseResult or None when not done yet, what to do next, whether every rank reported) for one case."""
        world_size = cases[index].world_size
        raw = batch.records.get(index) or [None] * world_size
        raw = list(raw)[:world_size] + [None] * max(0, world_size - len(raw))
        records = _merge(exercise, raw, exercise.oracle(cases[index], inputs[index]))
        if all(rec is not None and rec["status"] == "ok" for rec in records):
            return _judge(exercise, cases[index], records), "next", True
        stuck = list(batch.stuck.get(index) or [None] * world_size)[:world_size]
        stuck = [wire.clean_record(s) if s is not None else None for s in stuck + [None] * (world_size - len(stuck))]
        stuck = [s if s is not None and s["status"] == "stuck" else None for s in stuck]
        result, follow = _failed_case(exercise, cases[index], records, stuck, batch.launch_error, timeout)
        return result, follow, all(rec is not None for rec in records)

    hang_confirmed = False    # a hang survived its longer run: the function hangs, the machine is not just slow
    hang = None               # (world size, found for certain) of the first case that hung in this check
    lines = list(exercise.rubric)

    def worth_running(index, first_of_size):
        """Once the function hung, every case costs a launch and maybe a timeout: run a case only while some line it
        tests can still be earned (the first case of each world size always runs, to show what happens there)."""
        if hang is None or first_of_size or not lines:
            return True
        return not rubric.lines_tested_by(lines, cases[index]) <= rubric.missed_for_good(lines, results.values())

    def not_worth_it(index):
        G, certain = hang
        tested = rubric.lines_tested_by(lines, cases[index])
        everything = {line.key for line in lines} <= rubric.missed_for_good(lines, results.values())
        text = f"not run: an earlier case with G={G} " + ("deadlocked" if certain else "hung")
        if everything and G == cases[index].world_size:
            text += "." if certain else f", and each would cost {case_timeout:g} s more."
        elif everything:
            text += ", and no line of the rubric can still be earned: fix that first."
        else:
            text += (f", so cases that cannot change the score are skipped: the line{'s' if len(tested) > 1 else ''} "
                     f"this case tests ({', '.join(sorted(tested))}) {'are' if len(tested) > 1 else 'is'} missed "
                     "already.")
        return CaseResult(cases[index], "not run", [Problem(text)])

    for world_size in sorted(by_size):
        todo, retried, first_of_size = by_size[world_size], hang_confirmed, True
        while todo:
            if time.monotonic() > deadline:
                for index in todo:
                    results[index] = CaseResult(cases[index], "not run", [Problem(
                        f"not run: the check ran out of its {budget:g} s (earlier cases hung).")])
                break
            kept = [index for position, index in enumerate(todo) if worth_running(index, first_of_size and not position)]
            for index in todo:
                if index not in kept:
                    results[index] = not_worth_it(index)
            todo, first_of_size = kept, False
            if not todo:
                break
            # A launch runs consecutive cases (case first_index + k is the k-th): skipped cases split the rest.
            block = [todo[0]]
            while len(block) < len(todo) and todo[len(block)] == block[-1] + 1:
                block.append(todo[len(block)])
            batch = run(world_size, [cases[i] for i in block], [inputs[i] for i in block], block[0], case_timeout)
            next_todo = todo[len(block):]
            for position, index in enumerate(block):
                result, follow, everyone = evaluate(index, batch, case_timeout)
                if result is None:
                    return Outcome([], not_done=follow)
                certain = follow == "deadlock"
                if certain:
                    # Found, not guessed: every rank waited for a call no rank would ever make. No busy machine
                    # does that, so no retry, and later world sizes' hangs count at once.
                    hang_confirmed = retried = True
                    follow = "skip"
                elif follow == "skip" and not retried:
                    # A hang may be a busy machine rather than a deadlock: the case runs again alone with more
                    # time before it counts (a true deadlock costs that time once per check, not per world size).
                    retried = True
                    longer = case_timeout * RETRY_FACTOR
                    result, follow, everyone = evaluate(index, run(world_size, [cases[index]], [inputs[index]], index,
                                                                   longer), longer)
                    if result is None:
                        return Outcome([], not_done=follow)
                    certain = follow == "deadlock"
                    follow = "skip" if certain else follow
                    hang_confirmed = follow == "skip"
                    if follow != "skip":
                        everyone = False      # go on with the rest of this world size in a new launch
                results[index] = result
                if follow == "skip" and hang is None:
                    hang = (world_size, certain)
                if everyone:
                    continue          # every rank reported and went on to the next case
                # A hang or a crash costs this case only: the rest of this world size runs in a new launch (each
                # case isolated), skipping, once the function is known to hang, those that cannot change the score.
                next_todo = block[position + 1:] + next_todo
                break
            todo = next_todo
    ordered = [results[i] for i in range(len(cases))]
    _charge_silence(exercise, ordered)
    return Outcome(ordered)


def run_function(exercise, fn, *, case_timeout: float | None = None,
                 budget: float | None = None, cases=None) -> Outcome:
    """Run every case of `exercise` on `fn` in this process's ranks and judge them here (the learner's check).

    Args:
        case_timeout, budget: seconds per case and for the whole check (default: CASE_TIMEOUT, BUDGET).
        cases: run these cases instead of the exercise's own (the grader's, or a few of them in a test).
    """
    cases = exercise.cases() if cases is None else list(cases)

    def run(world_size, batch, inputs, first_index, timeout):
        return run_batch(exercise.name, fn, world_size, batch, inputs, first_index, timeout)

    return drive(exercise, cases, run, case_timeout=case_timeout, budget=budget)
