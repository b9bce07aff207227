"""python -m course_lib.grade: solution notebooks get full marks, student notebooks run to their end and get 0,
and a submission that crashes half-way keeps the points of what it completed."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time

import nbformat
import pytest

from course_lib import grade

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = ["04_ring_scatter_reduce.ipynb", "05_ring_all_gather.ipynb"]


def _points(notebook_grade):
    return {t["name"]: (t["score"], t["max_score"]) for t in notebook_grade.tests}


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_a_solution_notebook_gets_full_marks(name):
    result = grade.grade_notebook(ROOT / "notebooks" / name)
    assert result.tests and result.score == result.max_score, result.tests
    assert result.notes == []


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_a_student_notebook_runs_to_its_end_and_gets_zero(name):
    started = time.monotonic()
    result = grade.grade_notebook(ROOT / "assignments" / name)
    assert result.notes == [], result.notes                 # no cell raised: the lesson runs without the answers
    assert result.score == 0 and result.max_score > 0
    assert all("not done yet" in t["output"] for t in result.tests), result.tests
    assert time.monotonic() - started < 120


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
