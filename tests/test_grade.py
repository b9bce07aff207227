"""python -m course_lib.grade: solution notebooks get full marks, student notebooks run to their end and get 0,
and a submission that crashes half-way keeps the points of what it completed.

Grading a notebook costs 10-60 s (a fresh kernel runs it, then every exercise is checked with the hidden
cases), so the suite grades each notebook once where it must:

* every student notebook in assignments/, in one call of the command (as an instructor runs it);
* the solution notebooks: nbval (in the same test command) re-executes every notebook in notebooks/ and
  fails when an output differs from the stored one, and each check cell's stored output is its score with
  the hidden cases. So `test_every_check_cell_stores_full_marks` (no execution) plus nbval proves that a
  fresh run of each solution notebook scores full marks. What the grader does beyond the notebook's own
  checks (find every exercise, look each answer up by name after the whole notebook ran) is checked
  statically for every notebook and end to end on one (03: function exercises and questions).
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

from course_lib import grade
from course_lib.exercises import registry

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
    """Each check cell's stored result is full marks with the hidden cases; nbval keeps fresh runs equal to it."""
    notebook = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    checked = []
    for cell in _check_cells(notebook):
        names = grade._CHECK_CALL.findall(cell.source)
        assert names, f"check cell {cell.id} checks no exercise"
        points = sum(registry.get(n).points for n in names)
        assert cell.metadata["nbgrader"]["points"] == points, (cell.id, names)    # what nbgrader awards
        assert _stored_score(cell) == points, (cell.id, _shown_text(cell))
        for exercise in names:
            line = next(l for l in _shown_text(cell).splitlines() if l.startswith(exercise + ": "))
            assert line.startswith(f"{exercise}: {registry.get(exercise).points:g}/{registry.get(exercise).points:g} point")
            if registry.get(exercise).kind == "function":
                assert "hidden cases included" in line, line     # the notebook ran the grader's cases too
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


def test_the_grader_gives_a_solution_notebook_full_marks():
    result = grade.grade_notebook(ROOT / "notebooks" / "03_naive_and_master_allreduce.ipynb")
    assert result.notes == [], result.notes
    assert {t["name"] for t in result.tests} == {e.name for e in registry.all_exercises() if e.notebook.startswith("03")}
    assert all(t["score"] == t["max_score"] > 0 for t in result.tests), result.tests
    assert all("hidden cases included" in t["output"] for t in result.tests if registry.get(t["name"]).kind == "function")


def test_every_student_notebook_runs_to_its_end_and_gets_zero(tmp_path):
    """One call of the command on all of assignments/, as an instructor grades a class."""
    out = tmp_path / "results.json"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "course_lib.grade", *(str(ROOT / "assignments" / n) for n in NOTEBOOKS),
                           "--json", str(out)], capture_output=True, text=True, timeout=300 * len(NOTEBOOKS), cwd=tmp_path)
    seconds = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["score"] == 0
    for name in NOTEBOOKS:
        stem = pathlib.Path(name).stem
        tests = {t["name"][len(stem) + 2:]: t for t in results["tests"] if t["name"].startswith(stem + ": ")}
        assert "notebook run" not in tests, tests["notebook run"]["output"]    # no cell raised: the lesson runs
        assert set(tests) == {e.name for e in registry.all_exercises() if e.notebook + ".ipynb" == name}
        for test in tests.values():
            assert test["score"] == 0 and test["max_score"] > 0 and "not done yet" in test["output"], test
    assert seconds < 120 * len(NOTEBOOKS)       # the bound, 2 min a notebook, on average


def _submission(tmp_path, cells):
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in cells]
    path = tmp_path / "submission.ipynb"
    nbformat.write(notebook, path)
    return path


_IMPORTS = "import torch, torch.distributed as dist\nfrom course_lib import exercises"
_RING_ALL_GATHER = '''def ring_all_gather(tensor):
    rank, G = dist.get_rank(), dist.get_world_size()
    chunks = torch.tensor_split(tensor, G)
    for step in range(G - 1):
        request = dist.isend(chunks[(rank + 1 - step) % G], (rank + 1) % G)
        dist.recv(chunks[(rank - step) % G], (rank - 1) % G)
        request.wait()'''


def test_a_submission_that_crashes_half_way_keeps_what_it_completed(tmp_path):
    path = _submission(tmp_path, [
        _IMPORTS,
        _RING_ALL_GATHER,
        '# exercises.check("ring_all_gather", ring_all_gather)  (the grader finds the exercise from this line)',
        "raise RuntimeError('a cell the learner broke')",
        "while True:\n    pass",                                  # interrupted after the cell timeout
        "import os\nos._exit(1)",                                 # the kernel dies; the run is repeated without it
        'def ring(tensor):\n    ring_scatter_reduce(tensor)\n    ring_all_gather(tensor)',
        '# exercises.check("ring", ring)',
    ])
    result = grade.grade_notebook(path, cell_timeout=3)
    points = _points(result)
    assert points["ring_all_gather"] == (10.0, 10.0)
    assert points["ring"][0] == 0                            # ring_scatter_reduce is not defined in this notebook
    assert "ring_scatter_reduce" in next(t["output"] for t in result.tests if t["name"] == "ring")
    notes = "\n".join(result.notes)
    assert "cell 3 raised RuntimeError: a cell the learner broke" in notes
    assert "cell 4 ran longer than 3 s and was interrupted" in notes
    assert "the kernel died in cell 5" in notes


def test_the_command_prints_a_table_and_writes_gradescope_json(tmp_path):
    path = _submission(tmp_path, [_IMPORTS, _RING_ALL_GATHER, 'exercises.check("ring_all_gather", ring_all_gather)'])
    out = tmp_path / "results.json"
    done = subprocess.run([sys.executable, "-m", "course_lib.grade", str(path), "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "submission.ipynb  ring_all_gather   10/10  all 43 cases passed" in done.stdout
    assert done.stdout.rstrip().splitlines()[-1].split() == ["total", "10/10"]
    results = json.loads(out.read_text())
    assert results["score"] == 10.0
    assert results["tests"] == [{"name": "submission: ring_all_gather", "score": 10.0, "max_score": 10.0,
                                 "output": results["tests"][0]["output"]}]
    assert results["tests"][0]["output"].startswith("ring_all_gather: 10/10 points")


def test_the_exercises_of_a_notebook_are_found_from_its_checks_and_its_number():
    notebook = nbformat.read(ROOT / "assignments" / "05_ring_all_gather.ipynb", as_version=4)
    assert grade.exercises_in(notebook, "05_ring_all_gather.ipynb") == ["ring_all_gather", "ring"]
    assert grade.exercises_in(notebook, "renamed.ipynb") == ["ring_all_gather", "ring"]
    empty = nbformat.v4.new_notebook()
    assert grade.exercises_in(empty, "04_mine.ipynb") == ["ring_scatter_reduce"]
    assert grade.exercises_in(empty, "mine.ipynb") == []


def test_a_missing_file_is_a_usage_error(tmp_path):
    done = subprocess.run([sys.executable, "-m", "course_lib.grade", str(tmp_path / "nope.ipynb")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "no such file" in done.stderr
