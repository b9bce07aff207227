"""python -m course_grader: solution notebooks get full marks, student notebooks get 0, a submission that
crashes half-way keeps the points of what it completed, and the command's outputs and exit status say
what happened.

Grading a notebook costs a few seconds to a few tens (a sandbox runs the cells the answers need, then every
exercise is checked with the hidden cases), so the suite grades each notebook once where it must:

* every solution notebook in notebooks/, in one call of the command (as Gradescope grades one student);
* every student notebook in assignments/, in one call of the command;
* the stored outputs: nbval (in the same test command) re-executes every notebook in notebooks/, and each
  check cell's stored output is its full score on the visible cases, what the cell prints in a clone, on Binder
  and on Colab alike; its hidden-test region takes the grader's cases only under nbgrader's autograde
  (`test_every_check_cell_stores_full_marks`).

The cheats a submission might try are in test_grade_cheats.py, Gradescope's layout in test_grade_gradescope.py.
"""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys
import time

import nbformat
import pytest

import course_grader as grade
from course_grader.hidden_cases import grader_cases
from course_lib.exercises import registry
from course_grader import cli, judge
from course_grader.notebook import CHECK_CALL

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted(p.name for p in (ROOT / "assignments").glob("[0-9][0-9]_*.ipynb"))  # every one with exercises


def _points(notebook_grade):
    return {t["name"]: (t["score"], t["max_score"]) for t in notebook_grade.tests}


def test_there_is_a_notebook_for_every_exercise():
    assert len(NOTEBOOKS) >= 8
    assert {e.notebook + ".ipynb" for e in registry.all_exercises()} == set(NOTEBOOKS)


def _check_cells(notebook):
    return [c for c in notebook.cells if c.cell_type == "code" and c.metadata.get("nbgrader", {}).get("grade")]


def _stored_score(cell):
    results = [o for o in cell.get("outputs", []) if o.get("output_type") == "execute_result"]
    assert len(results) == 1, f"check cell {cell.get('id')} has no stored score: run tools/execute_notebooks.py"
    return float(results[0]["data"]["text/plain"])


def _shown_text(cell):
    return "\n".join(o.get("data", {}).get("text/plain", "") for o in cell.get("outputs", [])
                     if o.get("output_type") == "display_data")


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_every_check_cell_stores_full_marks(name):
    """Each check cell's stored result is full marks on the visible cases; nbval keeps fresh runs equal to it."""
    notebook = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    checked = []
    for cell in _check_cells(notebook):
        names = CHECK_CALL.findall(cell.source)
        assert names, f"check cell {cell.id} checks no exercise"
        points = sum(registry.get(n).points for n in names)
        assert cell.metadata["nbgrader"]["points"] == points, (cell.id, names)    # what nbgrader awards
        assert _stored_score(cell) == points, (cell.id, _shown_text(cell))
        for exercise in names:
            line = next(l for l in _shown_text(cell).splitlines() if l.startswith(exercise + ": "))
            assert line.startswith(f"{exercise}: {registry.get(exercise).points:g}/{registry.get(exercise).points:g} point")
            if registry.get(exercise).kind == "function":     # the visible cases: the grader's run under autograde
                assert "hidden" not in line and f"all {len(registry.get(exercise).cases())} cases" in line, line
        checked += names
    assert sorted(checked) == sorted(grade.exercises_in(notebook, name)), "each exercise checked once, all of them"
    assert sorted(checked) == sorted(e.name for e in registry.all_exercises() if e.notebook + ".ipynb" == name)


def _bound_at_top_level(source):
    """The names a cell binds at its top level (IPython's %magic lines read as `pass`)."""
    lines = [line[:len(line) - len(line.lstrip())] + "pass" if line.lstrip().startswith(("%", "!")) else line
             for line in source.split("\n")]
    names = set()
    for node in ast.parse("\n".join(lines)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        else:
            targets = (node.targets if isinstance(node, ast.Assign) else [node.target]
                       if isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For)) else [])
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_the_grader_finds_each_answer_where_the_notebook_checks_it(name):
    """The grader looks each answer up by name after the whole notebook ran: no later cell may rebind it."""
    notebook = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    code = [c for c in notebook.cells if c.cell_type == "code"]
    for exercise in grade.exercises_in(notebook, name):
        answer = registry.get(exercise).answer_name
        defined = [i for i, c in enumerate(code) if c.metadata.get("nbgrader", {}).get("solution")
                   and answer in _bound_at_top_level(c.source)]
        assert defined, f"{exercise}: no solution cell defines {answer}"
        later = [c.id for c in code[defined[-1] + 1:] if answer in _bound_at_top_level(c.source)]
        assert later == [], f"{name}: cells {later} rebind {answer} after the learner's answer"


def _run_grader(*args, cwd, timeout=900):
    return subprocess.run([sys.executable, "-m", "course_grader", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def _by_exercise(results, stem):
    """{exercise: [its rubric-line tests]} of notebook `stem` in a results.json."""
    tests = {}
    for test in results["tests"]:
        if test["name"].startswith(stem + ": ") and not test["name"].endswith(": notebook run"):
            exercise = test["name"][len(stem) + 2:].rsplit(": ", 1)[0]
            tests.setdefault(exercise, []).append(test)
    return tests


def test_every_solution_notebook_gets_full_marks_in_one_command(tmp_path):
    """All of notebooks/ as one student's submission, graded as Gradescope would grade it."""
    out = tmp_path / "results.json"
    done = _run_grader(*(ROOT / "notebooks" / n for n in NOTEBOOKS), "--json", out, cwd=tmp_path)
    assert done.returncode == cli.EXIT_OK, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["score"] == sum(e.points for e in registry.all_exercises())
    for name in NOTEBOOKS:
        stem = pathlib.Path(name).stem
        tests = _by_exercise(results, stem)
        assert set(tests) == {e.name for e in registry.all_exercises() if e.notebook + ".ipynb" == name}
        for exercise, lines in tests.items():
            assert [t["name"].rsplit(": ", 1)[1] for t in lines] == [l.key for l in registry.get(exercise).rubric]
            assert all(t["score"] == t["max_score"] > 0 and t["status"] == "passed" for t in lines), lines
        assert not any(t["name"] == f"{stem}: notebook run" for t in results["tests"]), "a cell raised"
    assert "hidden cases included" in next(t["output"] for t in results["tests"] if ": ring: " in t["name"])


def test_every_student_notebook_gets_zero(tmp_path):
    """One call of the command on all of assignments/, as an instructor grades a class."""
    out = tmp_path / "results.json"
    done = _run_grader(*(ROOT / "assignments" / n for n in NOTEBOOKS), "--json", out, cwd=tmp_path)
    assert done.returncode == cli.EXIT_OK, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["score"] == 0
    for name in NOTEBOOKS:
        stem = pathlib.Path(name).stem
        tests = _by_exercise(results, stem)
        assert set(tests) == {e.name for e in registry.all_exercises() if e.notebook + ".ipynb" == name}
        for exercise, lines in tests.items():
            assert all(t["score"] == 0 and t["max_score"] > 0 for t in lines)
            assert "not done yet" in lines[0]["output"], lines[0]["output"]


def _submission(tmp_path, cells, name="submission.ipynb", **metadata):
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    notebook.metadata.update(metadata)
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in cells]
    path = tmp_path / name
    nbformat.write(notebook, path)
    return path


_IMPORTS = "import torch, torch.distributed as dist\nfrom course_lib import exercises"
_RING_ALL_GATHER = '''def ring_all_gather(tensor):
    rank, G = dist.get_rank(), dist.get_world_size()
    chunks = torch.tensor_split(tensor, G)
    for step in range(G - 1):
        request = dist.isend(chunks[(rank + OFFSET - step) % G], (rank + 1) % G)
        dist.recv(chunks[(rank - step) % G], (rank - 1) % G)
        request.wait()
    SLEEPER.clear()'''


def test_a_submission_that_crashes_half_way_keeps_what_it_completed(tmp_path):
    # The answer reads OFFSET and SLEEPER, so the cells that bind them run, and each misbehaves after that.
    path = _submission(tmp_path, [
        _IMPORTS,
        _RING_ALL_GATHER,
        '# exercises.check("ring_all_gather", ring_all_gather)  (the grader finds the exercise from this line)',
        "OFFSET = 1\nraise RuntimeError('a cell the learner broke')",
        "SLEEPER = set()\nwhile True:\n    pass",                  # interrupted after the cell timeout
        "import os\nSLEEPER = set()\nos._exit(1)",                # the kernel dies; the run is repeated without it
        'def ring(tensor):\n    ring_scatter_reduce(tensor)\n    ring_all_gather(tensor)',
        '# exercises.check("ring", ring)',
        "print('a cell grading does not need')\nimport os\nos._exit(3)",
    ])
    result = judge.grade_notebook(path, cell_timeout=3)
    points = {t["name"]: (t["score"], t["max_score"]) for t in result.tests}
    assert points["ring_all_gather"] == (10.0, 10.0)
    assert points["ring"][0] == 0                            # ring_scatter_reduce is not defined in this notebook
    assert "ring_scatter_reduce" in next(t["output"] for t in result.tests if t["name"] == "ring")
    notes = "\n".join(result.notes)
    assert "cell 3 raised RuntimeError: a cell the learner broke" in notes
    assert "cell 4 ran longer than 3 s and was interrupted" in notes
    assert "the kernel died in cell 5" in notes
    assert "cell 8" not in notes                              # not run: no answer needs it
    assert "ran 5 of 9 code cells" in result.info[0]         # the dead cell left out, the cell it replaced run


def test_the_command_prints_a_table_and_writes_one_gradescope_test_per_rubric_line(tmp_path):
    path = _submission(tmp_path, [_IMPORTS, _RING_ALL_GATHER.replace("OFFSET", "1").replace("    SLEEPER.clear()", ""),
                                  'exercises.check("ring_all_gather", ring_all_gather)'])
    out = tmp_path / "results.json"
    done = _run_grader(path, "--json", out, cwd=tmp_path, timeout=300)
    assert done.returncode == cli.EXIT_OK, done.stderr
    cases = len(grader_cases(registry.get("ring_all_gather")))
    assert f"submission.ipynb  ring_all_gather   10/10  all {cases} cases passed" in done.stdout
    # Its checks make it notebook 05's: graded on all of 05, so ring (not written here) counts 0 of its 5.
    assert "submission.ipynb  ring                0/5" in done.stdout
    assert done.stdout.rstrip().splitlines()[-1].split() == ["total", "10/15"]
    results = json.loads(out.read_text())
    assert results["score"] == 10.0
    lines = registry.get("ring_all_gather").rubric
    ring = registry.get("ring").rubric
    assert [t["name"] for t in results["tests"]] == [f"submission: ring_all_gather: {line.key}" for line in lines] + \
        [f"submission: ring: {line.key}" for line in ring]
    assert [(t["score"], t["max_score"]) for t in results["tests"]] == [(line.points, line.points) for line in lines] + \
        [(0, line.points) for line in ring]
    assert results["tests"][0]["output"].startswith("met: " + lines[0].text)
    assert "ring_all_gather: 10/10 points" in results["tests"][0]["output"]


def test_a_rubric_file_reweights_and_drops_lines(tmp_path):
    """The ring's return value and its G = 1 line re-weighted by a file: the scores follow the file."""
    wrong_return = '''def ring_scatter_reduce(tensor):
    rank, G = dist.get_rank(), dist.get_world_size()
    chunks = torch.tensor_split(tensor, G)
    for s in range(G - 1):
        buffer = torch.empty_like(chunks[(rank - s - 1) % G])
        request = dist.isend(chunks[(rank - s) % G], (rank + 1) % G)
        dist.recv(buffer, (rank - 1) % G)
        request.wait()
        chunks[(rank - s - 1) % G].add_(buffer)
    return rank'''
    path = _submission(tmp_path, [_IMPORTS, wrong_return], name="04_ring_scatter_reduce.ipynb")
    rubric = tmp_path / "rubric.toml"
    rubric.write_text("[ring_scatter_reduce]\nreturned = 6\nsingle = 0\n")
    weighted_out = tmp_path / "weighted.json"
    assert _run_grader(path, "--json", weighted_out, "--rubric", rubric, cwd=tmp_path, timeout=300).returncode == 0
    weighted = json.loads(weighted_out.read_text())
    lines = {line.key: line.points for line in registry.get("ring_scatter_reduce").rubric}
    expected = {**lines, "returned": 6, "single": 0}
    by_line = {t["name"].rsplit(": ", 1)[1]: t for t in weighted["tests"]}
    assert {k: t["max_score"] for k, t in by_line.items()} == \
        {k: v for k, v in expected.items() if v > 0}                       # the dropped line is no test at all
    assert {k: t["status"] for k, t in by_line.items()} == \
        {k: "failed" if k == "returned" else "passed" for k in by_line}    # only the return value is missed
    assert weighted["score"] == sum(expected.values()) - expected["returned"]
    # (the default weights, without --rubric: test_every_solution_notebook_gets_full_marks_in_one_command)
    bad = tmp_path / "bad.toml"
    bad.write_text("[ring_scatter_reduce]\nreturn_value = 1\n")
    done = _run_grader(path, "--rubric", bad, cwd=tmp_path, timeout=60)
    assert done.returncode == cli.EXIT_USAGE and "has no rubric line 'return_value'" in done.stderr
    assert "returned" in done.stderr                                        # and it lists the lines there are


def test_the_exercises_of_a_notebook_are_found_from_its_checks_and_its_number():
    notebook = nbformat.read(ROOT / "assignments" / "05_ring_all_gather.ipynb", as_version=4)
    assert grade.exercises_in(notebook, "05_ring_all_gather.ipynb") == ["ring_all_gather", "ring"]
    assert grade.exercises_in(notebook, "renamed.ipynb") == ["ring_all_gather", "ring"]
    empty = nbformat.v4.new_notebook()
    assert grade.exercises_in(empty, "04_mine.ipynb") == ["ring_scatter_reduce"]
    assert grade.exercises_in(empty, "mine.ipynb") == []


def test_a_missing_file_is_a_usage_error(tmp_path):
    done = _run_grader(tmp_path / "nope.ipynb", cwd=tmp_path, timeout=60)
    assert done.returncode == cli.EXIT_USAGE and "no such file" in done.stderr


def test_what_cannot_be_read_or_run_exits_non_zero_after_grading_the_rest(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("my answers: G(G-1)N\n")
    r_notebook = _submission(tmp_path, ["x <- 1"], name="01_in_r.ipynb",
                             kernelspec={"name": "ir", "display_name": "R", "language": "R"})
    damaged = tmp_path / "06_damaged.ipynb"
    damaged.write_text('{"cells": "not a list"}')
    good = _submission(tmp_path, ['traffic_ring = "2*(G-1)*N"\ntraffic_ring_per_rank = "2(G-1)N/G"\nring_steps = "2(G-1)"'],
                       name="06_ring_cost.ipynb")
    out = tmp_path / "results.json"
    done = _run_grader(notes, good, "--json", out, cwd=tmp_path, timeout=300)
    assert done.returncode == cli.EXIT_UNREADABLE, done.stderr
    results = json.loads(out.read_text())
    assert results["score"] == 3                               # the good notebook was graded all the same
    assert "notes.txt is not a Jupyter notebook" in done.stdout + results["output"]
    for bad, words in ((r_notebook, "is a R notebook"), (damaged, "not a Jupyter notebook")):
        done = _run_grader(bad, "--json", out, cwd=tmp_path, timeout=120)
        assert done.returncode == cli.EXIT_UNREADABLE and words in json.loads(out.read_text())["output"]
        exercises = {e.name for e in registry.all_exercises() if e.notebook.startswith(bad.name[:2])}
        assert {t["name"].split(": ")[1] for t in json.loads(out.read_text())["tests"]} >= exercises   # each at 0
