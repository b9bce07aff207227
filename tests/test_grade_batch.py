"""Grading a class in one command: 20 synthetic students (copies, a link, a blank copy, slips, names a spreadsheet
would run, a hostile notebook), progress on stderr, one results file per student, a CSV with one column per
exercise; nbgrader's submitted/ folders; and what the cell plan keeps and leaves out.

The students' notebook is notebook 06's answers (three formula questions), so each grading costs about the
sandbox's start: the test is about the batch, not the checks. The scores are compared with the learner's own
check (`exercises.check`) of the same answers, run here.
"""

from __future__ import annotations

import csv
import json
import pathlib
import shutil
import subprocess
import sys

import nbformat
import pytest

from course_lib import exercises
from course_lib.exercises import registry
from course_grader import cells, cli

ROOT = pathlib.Path(__file__).resolve().parent.parent

QUESTIONS = ("traffic_ring", "traffic_ring_per_rank", "ring_steps")
# Answers a class gives: right, the known slips (partial credit), nothing yet, a lambda, nonsense.
ANSWERS = [
    {"traffic_ring": "2*(G-1)*N", "traffic_ring_per_rank": "2(G-1)N/G", "ring_steps": "2(G-1)"},
    {"traffic_ring": "(G-1)*N", "traffic_ring_per_rank": "(G-1)N/G", "ring_steps": "G - 1"},
    {"traffic_ring": "2(G-1)N/G", "traffic_ring_per_rank": "2N", "ring_steps": "2G"},
    {"traffic_ring": ..., "traffic_ring_per_rank": ..., "ring_steps": ...},
    {"traffic_ring": "lambda G, N: 2 * (G - 1) * N", "traffic_ring_per_rank": "lambda G, N: 2 * N",
     "ring_steps": "lambda G, N: 2 * G - 2"},
    {"traffic_ring": "N^2", "traffic_ring_per_rank": "__import__('os')", "ring_steps": "lambda G, N: 1 / 0"},
]


def _source(answers: dict) -> str:
    lines = []
    for name, answer in answers.items():
        if answer is ...:
            lines.append(f"{name} = ...")
        elif answer.startswith("lambda"):
            lines.append(f"{name} = {answer}")
        else:
            lines.append(f"{name} = {answer!r}")
    return "\n".join(lines)


def _write_notebook(path: pathlib.Path, source: str) -> None:
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    notebook.cells = [nbformat.v4.new_markdown_cell("# Ring cost"), nbformat.v4.new_code_cell("import math"),
                      nbformat.v4.new_code_cell(source)]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(notebook, path)


def _expected(answers: dict) -> dict:
    """What the learner's own check gives each answer, in this process: the oracle for the grader's scores."""
    namespace: dict = {}
    exec(_source(answers), namespace)  # noqa: S102 - the test's own answers
    return {name: exercises.check(name, namespace[name]).score for name in QUESTIONS}


HOSTILE = '''
import glob, os, signal, time
stolen = []
for path in glob.glob("/tmp/*/class/*/06_ring_cost.ipynb") + glob.glob("/tmp/*/*/*/06_ring_cost.ipynb"):
    try:
        stolen.append(open(path).read()[:10])          # another student's answers
    except OSError:
        pass
chunks = []
for _ in range(15):                                      # 1.5 GB, more than its 1 GiB
    chunks.append(b"1" * (100 << 20))
for _ in range(400):                                     # and processes, more than its 256
    try:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
    except OSError:
        break
os.kill(-1, signal.SIGKILL)
traffic_ring = traffic_ring
'''
FORMULA_NAMES = ('=HYPERLINK("https:example.com","open me")', "+1+2", "-3", "@SUM(A1)")


def _class_of_twenty(folder: pathlib.Path) -> dict:
    """20 students of notebook 06: {name: what each earns} (the learner's own check of their answers, here)."""
    expected = {}
    for i in range(12):
        _write_notebook(folder / f"student{i:02d}" / "06_ring_cost.ipynb", _source(ANSWERS[i % len(ANSWERS)]))
        expected[f"student{i:02d}"] = sum(_expected(ANSWERS[i % len(ANSWERS)]).values())
    # Three copies, the one at the top right: graded once, the top one (the rule), 3 of 3, not 9 of 3.
    _write_notebook(folder / "dup" / "06_ring_cost.ipynb", _source(ANSWERS[0]))
    _write_notebook(folder / "dup" / "old" / "06_ring_cost.ipynb", _source(ANSWERS[2]))
    _write_notebook(folder / "dup" / "06_ring_cost-Copy1.ipynb", _source(ANSWERS[5]))
    expected["dup"] = 3
    (folder / "link").mkdir()                               # another student's notebook, linked: refused
    (folder / "link" / "06_ring_cost.ipynb").symlink_to(folder / "student00" / "06_ring_cost.ipynb")
    expected["link"] = 0
    (folder / "blank").mkdir()
    shutil.copy(ROOT / "assignments" / "06_ring_cost.ipynb", folder / "blank")
    expected["blank"] = 0
    for index, name in enumerate(FORMULA_NAMES):             # names a spreadsheet would read as formulas
        _write_notebook(folder / name / "06_ring_cost.ipynb", _source(ANSWERS[index % 2]))
        expected[name] = sum(_expected(ANSWERS[index % 2]).values())
    notebook = nbformat.v4.new_notebook()                    # right answers, then everything a cell can throw
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    notebook.cells = [nbformat.v4.new_code_cell(_source(ANSWERS[0])), nbformat.v4.new_code_cell(HOSTILE)]
    (folder / "hostile").mkdir()
    nbformat.write(notebook, folder / "hostile" / "06_ring_cost.ipynb")
    expected["hostile"] = 3
    assert len(expected) == 20
    return expected


def test_a_class_of_twenty_with_copies_a_link_a_blank_copy_slips_and_a_hostile_notebook(tmp_path):
    """One command grades 20 students: every score is the learner's own check of their answers (so the hostile
    notebook, which fills its memory and processes, kills what it can and reads what it finds, changes no one
    else's grade), with progress on stderr, a results file each and a CSV that opens safely."""
    expected = _class_of_twenty(tmp_path / "class")
    out = tmp_path / "grades"
    done = subprocess.run([sys.executable, "-m", "course_grader", "--class", str(tmp_path / "class"), "--out",
                           str(out), "--jobs", "2", "--memory", "1G", "--processes", "256"], capture_output=True,
                          text=True, timeout=900, cwd=tmp_path)
    assert done.returncode == cli.EXIT_UNREADABLE, done.stderr[-3000:]         # the link was refused
    progress = [line for line in done.stderr.splitlines() if line.startswith("[")]
    assert len(progress) == 20 and progress[-1].startswith("[20/20] ") and "left" in progress[0]
    rows = list(csv.DictReader((out / "grades.csv").open()))
    assert list(rows[0]) == ["submission", "score", "max_score", "status", *QUESTIONS]
    for cell in (value for row in rows for value in row.values()):
        assert not cell.startswith(("=", "+", "-", "@")), cell            # no cell a spreadsheet runs
    shown = {row["submission"]: row for row in rows}
    for name, score in expected.items():
        row = shown["'" + name if name.startswith(("=", "+", "-", "@")) else name]
        assert float(row["score"]) == pytest.approx(score) and float(row["max_score"]) == 3, (name, row)
        assert row["status"] == ("refused" if name == "link" else "graded"), (name, row)
    for name in expected:
        results = json.loads((out / f"{cli._file_name(name)}.json").read_text())
        assert results["score"] == pytest.approx(expected[name])
    dup = json.loads((out / "dup.json").read_text())
    notes = "\n".join(t["output"] for t in dup["tests"] if t["max_score"] == 0)
    assert notes.count("graded in this notebook only") == 2 and notes.count("not in this copy") == 2
    hostile = json.loads((out / "hostile.json").read_text())
    assert "limit" in "\n".join(t["output"] for t in hostile["tests"] if t["max_score"] == 0)
    partial = shown["student01"]
    assert 0 < float(partial["traffic_ring"]) < 1                 # a known slip keeps the line it got right


def test_a_class_with_a_broken_submission_exits_3_and_grades_the_others(tmp_path):
    _write_notebook(tmp_path / "class" / "good" / "06_ring_cost.ipynb", _source(ANSWERS[0]))
    (tmp_path / "class" / "exported" ).mkdir(parents=True)
    (tmp_path / "class" / "exported" / "06_ring_cost.ipynb").write_text("<html>not a notebook</html>")
    (tmp_path / "class" / "empty").mkdir()
    out = tmp_path / "grades"
    done = subprocess.run([sys.executable, "-m", "course_grader", "--class", str(tmp_path / "class"), "--out",
                           str(out)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == cli.EXIT_UNREADABLE, done.stderr[-2000:]
    rows = {row["submission"]: row for row in csv.DictReader((out / "grades.csv").open())}
    assert rows["good"]["status"] == "graded" and float(rows["good"]["score"]) == 3
    assert rows["exported"]["status"] == "unreadable" and float(rows["exported"]["score"]) == 0
    assert rows["empty"]["status"] == "missing"
    assert "not a Jupyter notebook" in json.loads((out / "exported.json").read_text())["output"]


def test_nbgrader_submitted_folders_are_graded_into_a_csv(tmp_path):
    course = tmp_path / "course"
    for student, answers in (("ada", ANSWERS[0]), ("bob", ANSWERS[1])):
        _write_notebook(course / "submitted" / student / "ring_cost" / "06_ring_cost.ipynb", _source(answers))
    _write_notebook(course / "submitted" / "cy" / "other_assignment" / "06_ring_cost.ipynb", _source(ANSWERS[0]))
    out = tmp_path / "grades"
    done = subprocess.run([sys.executable, "-m", "course_grader", "--nbgrader", str(course), "--assignment",
                           "ring_cost", "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == cli.EXIT_UNREADABLE        # cy submitted nothing for this assignment
    rows = {row["student_id"]: row for row in csv.DictReader((out / "nbgrader_grades.csv").open())}
    assert float(rows["ada"]["score"]) == 3 and float(rows["ada"]["max_score"]) == 3
    assert float(rows["bob"]["score"]) == pytest.approx(sum(_expected(ANSWERS[1]).values()))
    assert float(rows["cy"]["score"]) == 0 and rows["ada"]["assignment"] == "ring_cost"
    assert list(rows["ada"]) == ["assignment", "duedate", "timestamp", "student_id", "last_name", "first_name", "email",
                                 "raw_score", "late_submission_penalty", "score", "max_score"]


# --------------------------------------------------------------------------------------------------
# The cell plan
# --------------------------------------------------------------------------------------------------


def test_the_plan_keeps_what_the_answers_read_and_leaves_the_lesson_out():
    sources = ["import torch, torch.distributed as dist",                       # 0: read by the answer
               "G = 4\nruns = course_lib.launch(picture, G)",                  # 1: a lesson cell
               "SCALE = 2",                                                   # 2: read by the answer
               "def ring(t):\n    for s in range(SCALE):\n        dist.send(t, 1)",
               "exercises.check('ring', ring)\nplot(runs)",                    # 4: the learner's own check
               "SCALE = 3"]                                                   # 5: rebinds it after the answer
    assert cells.cells_to_run(sources, ["ring"]) == ([0, 3, 5], "")
    # A cell that changes a value the answer reads, without binding it, is kept too.
    changes = ["table = []", "def f(t):\n    return table[0] + t", "table.append(1)", "print(table)"]
    assert cells.cells_to_run(changes, ["f"]) == ([0, 1, 2], "")
    handed = ["buffer = []", "def f(t):\n    return buffer", "fill(buffer)", "len(buffer)"]
    assert cells.cells_to_run(handed, ["f"])[0] == [0, 1, 2]
    # A function that changes notebook data when called: the cell that calls it is kept.
    calls = ["cache = {}", "def warm():\n    cache['x'] = 1", "warm()", "def f(t):\n    return cache['x']"]
    assert cells.cells_to_run(calls, ["f"])[0] == [0, 1, 2, 3]


@pytest.mark.parametrize("source", ["exec('ring = 1')", "globals()['ring'] = 1", "from os import *",
                                    "def f():\n    global ring\n    ring = 1", "%run other.py", "x = (",
                                    "%%bash\necho hi"])
def test_what_the_plan_cannot_follow_runs_every_cell(source):
    plan, why = cells.cells_to_run(["import torch", source, "def ring(t):\n    return t"], ["ring"])
    assert plan == [0, 1, 2] and why.startswith("every cell ran: ")


def test_installs_and_shell_commands_always_run():
    assert cells.cells_to_run(["%pip install -q numpy", "!echo hi", "x = 1", "def ring(t):\n    return t"],
                              ["ring"])[0] == [0, 1, 3]
