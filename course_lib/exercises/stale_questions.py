"""Notebook 08's questions, computed from the lesson rather than stored.

    check("straggler_staleness", 2.5)        the mean staleness of the straggler's gradients in a recorded run
    check("stable_step_size", 0.178)         the largest stable step size for gradients s updates old

The recorded run (`recorded_run`) is an asynchronous parameter server played out with fixed compute times, so
it is the same everywhere (the notebook's real runs depend on timing): workers 1..W take `COMPUTE[w]` time units
per gradient; the server applies each gradient the moment it arrives (ties: lower rank first) and replies with
its new version. Staleness of an applied gradient = the server's version when it is applied - the version it was
computed on.

The stability limit (notebook 08, `training.parameter_server.stale_step_limit`): on a quadratic of curvature λ (notebook 08 writes it so),
gradient descent with gradients s updates old converges while

    lr < 2 sin(pi / (2 (2 s + 1))) / λ         (s = 0: 2 / λ)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from course_lib.exercises.questions import Question, Slip
from course_lib.exercises.registry import register
from course_lib.exercises.rubric import RubricLine

__all__ = ["recorded_run", "Update", "COMPUTE", "UPDATES", "CURVATURE", "STALENESS", "step_limit"]

COMPUTE = {1: 3, 2: 1, 3: 1}     # time units per gradient: rank 1 is the straggler
UPDATES = 12
CURVATURE, STALENESS = 2.5, 3     # the question's λ and s


@dataclass(frozen=True)
class Update:
    """One applied gradient: the update's number (from 0), the worker that sent it, the version it was computed on,
    and the server's version when it was applied (= the number of updates before it)."""

    number: int
    worker: int
    computed_on: int
    applied_at: int

    @property
    def staleness(self) -> int:
        return self.applied_at - self.computed_on


def recorded_run(compute=None, updates: int = UPDATES) -> list[Update]:
    """The asynchronous server's log with fixed compute times (see the module docstring)."""
    compute = COMPUTE if compute is None else compute
    ready = {w: (compute[w], 0) for w in compute}     # worker -> (time its gradient arrives, version computed on)
    version, log = 0, []
    while len(log) < updates:
        worker = min(ready, key=lambda w: (ready[w][0], w))
        arrives, computed_on = ready[worker]
        log.append(Update(len(log), worker, computed_on, version))
        version += 1
        ready[worker] = (arrives + compute[worker], version)   # the reply carries the new version
    return log


def _mean(values) -> Fraction:
    values = list(values)
    return Fraction(sum(values), len(values))


def _straggler_mean(offset: int = 0, worker: int | None = 1) -> Fraction:
    return _mean(u.staleness + offset for u in recorded_run() if worker is None or u.worker == worker)


def step_limit(curvature: float, staleness: int) -> float:
    """2 sin(pi / (2 (2 s + 1))) / λ."""
    return 2 * math.sin(math.pi / (2 * (2 * staleness + 1))) / curvature


@dataclass
class ToleratedQuestion(Question):
    """A number question whose answer is computed with floats (a sine): right within `tolerance`, relative."""

    tolerance: float = 1e-3

    def _grade_number(self, answer):
        from course_lib.exercises.questions import _as_fraction, _show

        value = _as_fraction(answer)
        if value is None:
            return False, f"this question asks for a number; got {type(answer).__name__} {answer!r}.", ()
        right = Fraction(self.truth())
        if abs(value - right) <= Fraction(self.tolerance) * abs(right):
            return True, "right.", ()
        text = f"{_show(value)} is not right" + (f": {self.quantity}." if self.quantity else ".")
        for slip in self.slips:
            target = Fraction(slip.answer())
            if abs(value - target) <= Fraction(self.tolerance) * abs(target):
                return False, f"{text} {slip.hint}", slip.met
        return False, text, ()


register(Question(
    name="straggler_staleness", notebook="08_sync_vs_async", points=1, signature="a number",
    summary="in the recorded asynchronous run (rank 1 takes 3 time units per gradient, ranks 2 and 3 take 1), the mean "
            "staleness of rank 1's gradients",
    answer_kind="number", truth=_straggler_mean,
    quantity="staleness = the server's version when the gradient is applied - the version it was computed on",
    rubric=(RubricLine("definition", "staleness = the server's version when applied - the version computed on "
                                     "(the update itself does not count)", 0.5),
            RubricLine("straggler", "the mean over rank 1's gradients only", 0.5)),
    slips=(Slip(lambda: _straggler_mean(offset=1), "That counts the update itself: a gradient applied on the version it "
                "was computed on has staleness 0.", ("straggler",)),
           Slip(lambda: _straggler_mean(worker=None), "That is the mean over every worker's gradients; the question "
                "asks for rank 1's, the straggler's.", ("definition",)),
           Slip(lambda: _mean(u.computed_on for u in recorded_run() if u.worker == 1), "That is the mean of the versions "
                "rank 1 computed on; staleness is how many updates landed in between.", ("straggler",)))))

register(ToleratedQuestion(
    name="stable_step_size", notebook="08_sync_vs_async", points=1, signature="a number",
    summary=f"the largest stable step size when the sharpest curvature is λ = {CURVATURE} and every gradient is "
            f"s = {STALENESS} updates old",
    answer_kind="number", truth=lambda: step_limit(CURVATURE, STALENESS),
    quantity=f"lr < 2 sin(pi / (2 (2s + 1))) / λ with λ = {CURVATURE}, s = {STALENESS} (within 0.1%)",
    rubric=(RubricLine("curvature", "the limit scales as 1 / λ: divided by the curvature", 0.5),
            RubricLine("staleness", "the staleness lowers it: 2 sin(pi / (2 (2s + 1))) in place of 2", 0.5)),
    slips=(Slip(lambda: 2 / CURVATURE, "That is the limit for fresh gradients (s = 0); stale ones lower it to "
                "2 sin(pi / (2 (2s + 1))) / λ.", ("curvature",)),
           Slip(lambda: 2 * math.sin(math.pi / (2 * (2 * STALENESS + 1))), "That is η λ: divide by the curvature λ.",
                ("staleness",)),
           Slip(lambda: step_limit(CURVATURE, 1), "That is the limit for s = 1; the question's gradients are "
                f"{STALENESS} updates old.", ("curvature",)))))
