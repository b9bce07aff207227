"""What tests/test_rubric.py (00-07) and tests/test_rubric_part2.py (08-11) both do with a rubric result.

A function exercise is run on its hidden cases of G = 1, 3 and 4 (core cases, uneven lengths, G = 1, a G that
is not a power of two and other roots among them), which test every rubric line and stay fast;
test_grade.py grades the full hidden cases through the sandbox.
"""

from __future__ import annotations

from course_grader.hidden_cases import grader_cases
from course_lib.exercises import registry, runner
from course_lib.exercises.report import Result

SIZES = (1, 3, 4)


def check(name, fn) -> Result:
    """`fn` checked as exercise `name` on the hidden cases of SIZES, scored by its rubric."""
    exercise = registry.get(name)
    cases = [c for c in grader_cases(exercise) if c.world_size in SIZES]
    outcome = runner.run_function(exercise, fn, cases=cases)
    if outcome.not_done is not None:
        return Result.not_done(exercise, outcome.not_done)
    return Result.of_cases(exercise, outcome.cases, hidden=True)


def missed(result) -> set:
    """The keys of the rubric lines the result's cases tested and did not meet."""
    return {line.key for line in result.lines if line.tested and not line.met}


def assert_named(result, keys) -> None:
    """The feedback names every missed line, as 'MISSED ... key: text'."""
    text = repr(result)
    for key in keys:
        line = next(l for l in registry.get(result.name).rubric if l.key == key)
        assert "MISSED" in text and f"{key}: {line.text}" in text, text
