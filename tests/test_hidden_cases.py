"""The hidden cases are the grader's: course_lib alone has none, and course_grader's lists hold every visible case.

course_lib is all a learner installs (Colab, the student copies), so nothing in it may hold or make a hidden case;
course_grader/hidden_cases.py builds the grader's list of every function exercise from its visible list.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

import course_grader
import planted_bugs_part2 as pb2
from course_grader import hidden_cases
from course_lib import exercises
from course_lib.exercises import registry

ROOT = pathlib.Path(__file__).resolve().parent.parent
FUNCTION_EXERCISES = [e for e in registry.all_exercises(include_pending=True) if e.kind == "function"]
CHECK_LINE = re.compile(r'^result = exercises\.check\("(\w+)", \w+, cases=cases\)$', re.M)


def _check_cells() -> list:
    """(exercise name, the check cell's source before its check line) for every check cell of notebooks/ that has a
    hidden-test region."""
    cells = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            source = "".join(cell["source"])
            if cell["cell_type"] == "code" and "### BEGIN HIDDEN TESTS" in source:
                match = CHECK_LINE.search(source)
                assert match, (path.name, source)
                cells.append((match.group(1), source[:match.start()]))
    return cells


def _cases_of(before: str, execution, monkeypatch):
    """What `cases` is after a check cell's lines before its check, with NBGRADER_EXECUTION = `execution` (None:
    unset)."""
    if execution is None:
        monkeypatch.delenv("NBGRADER_EXECUTION", raising=False)
    else:
        monkeypatch.setenv("NBGRADER_EXECUTION", execution)
    namespace = {}
    exec(before, namespace)
    return namespace["cases"]


def test_a_check_cell_takes_the_graders_cases_only_under_nbgrader_autograde(monkeypatch):
    """nbgrader sets NBGRADER_EXECUTION to 'autograde' while it autogrades and to 'validate' while it validates.
    Only autograde runs the grader's cases; everywhere else (a clone, Binder, Colab, nbval, validate) the check cell
    runs the visible ones, even where course_grader can be imported, as it can here and in any clone (the setup cell
    puts the clone's root on sys.path)."""
    assert importlib.util.find_spec("course_grader") is not None
    cells = _check_cells()
    assert {name for name, _ in cells} == {e.name for e in registry.all_exercises() if e.kind == "function"}
    for name, before in cells:
        assert _cases_of(before, "autograde", monkeypatch) == hidden_cases.grader_cases(name), name
        assert _cases_of(before, None, monkeypatch) is None, name
        assert _cases_of(before, "validate", monkeypatch) is None, name
    # Where course_grader cannot be imported (Colab, a learner's machine) the same lines leave the visible check;
    # under autograde they fail instead of grading on the visible cases alone.
    script = ("import os, sys, json\nsys.modules['course_grader'] = None\n"
              f"for name, before in json.loads({json.dumps(json.dumps(cells))}):\n"
              "    os.environ.pop('NBGRADER_EXECUTION', None)\n"
              "    namespace = {}\n    exec(before, namespace)\n    assert namespace['cases'] is None, name\n"
              "    os.environ['NBGRADER_EXECUTION'] = 'autograde'\n"
              "    try:\n        exec(before, {})\n    except ImportError:\n        pass\n"
              "    else:\n        raise AssertionError(f'{name}: autograde without course_grader did not fail')\n")
    env = {k: v for k, v in os.environ.items() if k != "NBGRADER_EXECUTION"}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stderr


def test_course_lib_alone_has_no_hidden_case_and_says_where_they_went():
    """In a Python where course_grader cannot be imported, course_lib still checks, with visible cases only."""
    script = textwrap.dedent("""
        import sys
        sys.modules["course_grader"] = None          # as on Colab: the grader is not installed
        from course_lib import exercises
        from course_lib.exercises import registry
        functions = [e for e in registry.all_exercises(include_pending=True) if e.kind == "function"]
        assert functions
        hidden = [(e.name, c) for e in functions for c in e.cases() if c.hidden]
        assert not hidden, hidden
        try:
            exercises.check("ring", lambda tensor: None, hidden=True)
        except ValueError as error:
            print(error)
        else:
            raise AssertionError("check(..., hidden=True) did not refuse")
        assert not any(name.startswith("course_grader.") for name in sys.modules), "course_lib imported the grader"
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
    message = run.stdout
    assert "course_grader" in message and "pip install -e ./course_grader" in message, message
    assert "exercises.check('ring', ring)" in message and "from course_grader import check" in message, message


def test_check_hidden_false_is_still_the_visible_check():
    """Older notebooks pass hidden=False: it runs, and means the visible cases."""
    assert exercises.check("fit_alpha_beta", pb2.fit_lstsq_rows_over_t, hidden=False).passed


def test_a_question_takes_no_cases():
    with pytest.raises(TypeError, match="question"):
        exercises.check("ring_steps", "2(G-1)", cases=[])


@pytest.mark.parametrize("exercise", FUNCTION_EXERCISES, ids=lambda e: e.name)
def test_the_grader_runs_every_visible_case_in_order_and_more(exercise):
    visible, grader = exercise.cases(), hidden_cases.grader_cases(exercise)
    assert visible and not any(case.hidden for case in visible)
    assert [case for case in grader if not case.hidden] == visible
    extra = [case for case in grader if case.hidden]
    assert extra and not set(extra) & set(visible)
    assert len(set(grader)) == len(grader), "a case twice"


def test_every_function_exercise_has_a_rule():
    assert set(hidden_cases.RULES) == {e.name for e in FUNCTION_EXERCISES}


def test_the_hidden_world_sizes_are_run_by_the_grader_only():
    ring = registry.get("ring")
    visible_sizes = {case.world_size for case in ring.cases()}
    grader_sizes = {case.world_size for case in hidden_cases.grader_cases(ring)}
    assert grader_sizes == visible_sizes | set(hidden_cases.HIDDEN_SIZES) and not visible_sizes & set(hidden_cases.HIDDEN_SIZES)


def test_the_graders_check_runs_its_cases_and_says_so():
    visible = exercises.check("fit_alpha_beta", pb2.fit_lstsq_rows_over_t)
    grader = course_grader.check("fit_alpha_beta", pb2.fit_lstsq_rows_over_t)
    assert visible.passed and grader.passed
    assert [c.case for c in visible.cases] == registry.get("fit_alpha_beta").cases()
    assert [c.case for c in grader.cases] == hidden_cases.grader_cases(registry.get("fit_alpha_beta"))
    assert "hidden cases included" in repr(grader) and "hidden" not in repr(visible)
    assert grader.hidden and not visible.hidden
