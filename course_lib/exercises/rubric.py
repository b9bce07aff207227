"""Rubric lines: how an exercise's points are split, and which lines a run of its cases earns.

An instructor grades by lines ("sends to the right neighbour", "returns the right chunk", "works when N
does not divide by G"), so a learner who got the schedule right and the return value wrong keeps most of
the points. Every exercise lists its lines when it registers (`RubricLine`); its `judge` tags every problem
it finds with the line it costs (``Problem(..., line="values")``, or ``line=None`` for one that costs them
all: an exception, a hang, a result no message explains).

Two kinds of line:

* an **aspect** line ("the messages", "the values", "the return value") is tested by the *core* cases:
  those no family line claims. It is met when every core case ran to its end without a problem on it.
* a **family** line ("lengths that do not divide by G", "G = 1", "a root other than 0") is tested by the
  cases of its family. It is met when those cases show no problem that the core cases did not already
  show: a ring that is right for even lengths and wrong for uneven ones misses the family line and keeps
  the rest; a ring that is wrong everywhere is not charged twice. A family line needs some aspect line
  met (an empty answer earns nothing), and like every line it needs each case it tests to have finished.

Questions (`questions.py`) have lines too: the parts of the reasoning a known slip still gets right.

Instructors re-weight or drop lines with a small TOML or JSON file (`rubric_file.load_weights`); the
defaults are `rubric_file.defaults_toml()`, committed as docs/rubric.toml.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["Family", "RubricLine", "LineResult", "UNEVEN_LENGTHS", "SINGLE_RANK", "OTHER_ROOTS", "evaluate_cases",
           "evaluate_met", "single_line", "lines_tested_by",
           "missed_for_good"]


@dataclass(frozen=True)
class Family:
    """A family of cases a family line is about: a name for people and a test for cases."""

    name: str
    test: Callable


UNEVEN_LENGTHS = Family("lengths that do not divide by G (N < G included)",
                        lambda case: case.world_size > 1 and case.numel % case.world_size != 0)
SINGLE_RANK = Family("G = 1", lambda case: case.world_size == 1)
OTHER_ROOTS = Family("a root other than rank 0", lambda case: case.root not in (None, 0))


@dataclass(frozen=True)
class RubricLine:
    """One line of an exercise's rubric.

    Args:
        key: a short name, unique in the exercise: the key a rubric file uses, and what problems are tagged with.
        text: what the line checks, in words the learner reads next to met / missed.
        points: its default points; the exercise's points are the sum of its lines'.
        family: for a family line, the cases it is about (`UNEVEN_LENGTHS`, `SINGLE_RANK`, `OTHER_ROOTS`, or
            your own `Family`); None for an aspect line.

    Example::

        >>> RubricLine("returned", "returns (r + 1) mod G, the chunk it holds complete", 2)
    """

    key: str
    text: str
    points: float
    family: Family | None = None


def single_line(points: float) -> RubricLine:
    """The one line of an exercise registered without a rubric: every case passes."""
    return RubricLine("cases", "every case passes", points)


@dataclass
class LineResult:
    """How one rubric line went: its points earned and possible, and for a missed line, why (`evidence`).

    A line no case tested (a check run on a few cases only, as the tests do) has `tested` False and counts
    for nothing either way; the grader's hidden cases test every line (a test keeps it so).
    """

    key: str
    text: str
    points: float
    max_points: float
    met: bool
    evidence: str = ""
    tested: bool = True

    def to_dict(self) -> dict:
        return {"key": self.key, "text": self.text, "points": self.points, "max_points": self.max_points,
                "met": self.met, "evidence": self.evidence, "tested": self.tested}


# --------------------------------------------------------------------------------------------------
# Which lines a run earns
# --------------------------------------------------------------------------------------------------


def _failed_lines(result, keys: set) -> set:
    """The line keys case `result` fails: all of them when it did not finish or a problem costs every line."""
    if result.status == "passed":
        return set()
    if result.records is None:          # an exception, a hang, a forbidden call, not run: nothing verified
        return set(keys)
    failed = set()
    for problem in result.problems:
        if problem.line is None or problem.line not in keys:
            return set(keys)
        failed.add(problem.line)
    return failed


def _evidence(result, key: str, root_name: str) -> str:
    """'G=3, N=7, tagged: <the first problem on this line>' for a case that fails line `key`."""
    relevant = [p for p in result.problems if p.line in (key, None)] or result.problems
    first = relevant[0].message.splitlines()[0] if relevant else result.status
    return f"{result.case.label(root_name)}: {first}"


def lines_tested_by(lines, case) -> set:
    """The keys of the lines a case can earn: its families' lines, or the aspect lines for a core case."""
    families = {line.key for line in lines if line.family is not None and line.family.test(case)}
    return families or {line.key for line in lines if line.family is None}


def missed_for_good(lines, case_results) -> set:
    """The keys of the lines that `case_results` already cost, whatever the cases still to run show.

    An aspect line is missed once a core case fails it; a family line once a case of its family fails it outright
    (the case did not finish, or a problem is tagged with the line), or once every aspect line is missed (a family
    line needs one met). A runner that knows the function hangs skips the cases whose lines are all in here: they
    cannot change the score, and each would cost a launch and a timeout."""
    keys = {line.key for line in lines}
    aspects = {line.key for line in lines if line.family is None}
    families = [line for line in lines if line.family is not None]
    gone = set()
    for result in case_results:
        failed = _failed_lines(result, keys)
        if not failed:
            continue
        claimed = [line for line in families if line.family.test(result.case)]
        if claimed:
            gone |= {line.key for line in claimed if line.key in failed}
        else:
            gone |= failed & aspects
    if aspects and aspects <= gone:
        gone |= {line.key for line in families}
    return gone


def evaluate_cases(lines, case_results, weights: dict | None = None, root_name: str = "root") -> list[LineResult]:
    """Which of `lines` the case results earn (see the module docstring for the rule).

    Args:
        lines: the exercise's `RubricLine`s.
        case_results: one `runner.CaseResult` per case that was to run.
        weights: {line key: points} overriding the defaults (a rubric file's entries for this exercise).
        root_name: what the root is called in case labels.

    Returns:
        One `LineResult` per line, in the rubric's order.
    """
    weights = weights or {}
    keys = {line.key for line in lines}
    aspects = [line for line in lines if line.family is None]
    families = [line for line in lines if line.family is not None]
    failed = [(result, _failed_lines(result, keys)) for result in case_results]
    core = [(r, f) for r, f in failed if not any(line.family.test(r.case) for line in families)]
    met: dict = {}
    evidence: dict = {}
    untested = set()
    for line in aspects:
        failing = [r for r, f in core if line.key in f]
        met[line.key] = bool(core) and not failing
        evidence[line.key] = _evidence(failing[0], line.key, root_name) if failing else ""
        if not core:
            untested.add(line.key)
    met_aspects = {key for key, ok in met.items() if ok}
    for line in families:
        tested = [(r, f) for r, f in failed if line.family.test(r.case)]
        failing = [r for r, f in tested if f & (met_aspects | {line.key})]
        met[line.key] = bool(tested) and bool(met_aspects or not aspects) and not failing
        if failing:
            evidence[line.key] = _evidence(failing[0], line.key, root_name)
        elif tested and not met[line.key]:
            evidence[line.key] = "no other line is met yet"
        else:
            evidence[line.key] = ""
        if not tested:
            untested.add(line.key)
    return [LineResult(line.key, line.text, 0.0, 0.0, False, "not tested by these cases", tested=False)
            if line.key in untested else _line_result(line, met[line.key], evidence[line.key], weights)
            for line in lines]


def evaluate_met(lines, met_keys, weights: dict | None = None, evidence: str = "") -> list[LineResult]:
    """`LineResult`s for lines decided directly (a question's): met when their key is in `met_keys`."""
    weights = weights or {}
    return [_line_result(line, line.key in met_keys, "" if line.key in met_keys else evidence, weights)
            for line in lines]


def _line_result(line, met: bool, evidence: str, weights: dict) -> LineResult:
    possible = float(weights.get(line.key, line.points))
    return LineResult(line.key, line.text, possible if met else 0.0, possible, met, "" if met else evidence)
