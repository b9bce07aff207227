"""What a submission is graded on, and the files and sizes the grader accepts, decided before any sandbox runs
(issue 26): fast tests, no notebook is run here.

* the assignment of a notebook (nbgrader metadata, file name, checks) and of a submission (--assignment);
* one copy per exercise, by a stated rule; other assignments' exercises score nothing; missing ones count 0;
* links, pipes and devices refused without being opened; sizes refused before any cell is looked at;
* the cell plan linear in the notebook's size (a budget, past which every cell runs);
* CSV cells a spreadsheet would read as formulas written as text;
* the command's clear errors for bad arguments;
* without namespaces, students graded one at a time.
"""

from __future__ import annotations

import csv
import json
import os
import pathlib
import stat
import subprocess
import sys
import threading
import time

import nbformat
import pytest

from course_lib.exercises import registry
from course_grader import assign, batch, cells, cli, judge, results
from course_grader.notebook import MAX_CELLS, NotebookError, read_file
from course_grader.reading import read_notebook

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _write(path: pathlib.Path, cells_, metadata_ids=()) -> pathlib.Path:
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in cells_]
    for cell, grade_id in zip(notebook.cells, metadata_ids):
        cell.metadata["nbgrader"] = {"grade_id": grade_id, "solution": True, "grade": False}
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(notebook, path)
    return path


def test_the_map_of_nbgrader_cells_is_the_course_notebooks():
    """cell_assignments() gives every nbgrader grade_id of notebooks/ and assignments/ the notebook it is in (for the
    notebooks with exercises), and names no cell those notebooks lack."""
    found = {}
    graded = {e.notebook for e in registry.all_exercises()}
    for folder in ("notebooks", "assignments"):
        for path in sorted((ROOT / folder).glob("[0-9][0-9]_*.ipynb")):
            for cell in nbformat.read(path, as_version=4).cells:
                grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
                if grade_id and path.stem in graded:
                    assert found.setdefault(grade_id, path.stem) == path.stem, grade_id
    known = assign.cell_assignments()
    assert {cell: known.get(cell) for cell in found} == found
    placed = {n.stem for n in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")}
    assert set(assign.ASSIGNMENT_CELLS) <= set(found) and set(assign.ASSIGNMENT_CELLS.values()) <= placed


@pytest.mark.parametrize("name, ids, checks, expected", [
    ("Copy of my ring.ipynb", ["ring_scatter_reduce", "check_ring_scatter_reduce"], [], "04_ring_scatter_reduce"),
    ("04_ring_scatter_reduce.ipynb", ["ring_scatter_reduce", "pass_token", "check_pass_token"], [],
     "04_ring_scatter_reduce"),                                   # 00's cells pasted in: the file name agrees with 04
    ("mine.ipynb", ["pass_token", "check_pass_token", "ring_scatter_reduce"], [], "00_hello_ranks"),
    ("06_anything.ipynb", [], [], "06_ring_cost"),
    ("untitled.ipynb", [], ['exercises.check("ring", ring)'], "05_ring_all_gather"),
    ("untitled.ipynb", [], [], None),
])
def test_a_notebooks_assignment(tmp_path, name, ids, checks, expected):
    path = _write(tmp_path / name, ["x = 1"] * len(ids) + checks, ids)
    assert assign.assignment_of(read_notebook(path), name)[0] == expected


@pytest.mark.parametrize("text, expected", [("04", ["04_ring_scatter_reduce"]), ("4", ["04_ring_scatter_reduce"]),
                                            ("04_ring_scatter_reduce.ipynb", ["04_ring_scatter_reduce"]),
                                            ("04,06", ["04_ring_scatter_reduce", "06_ring_cost"])])
def test_assignment_names(text, expected):
    assert assign.resolve_assignment(text) == expected


@pytest.mark.parametrize("text", ["12", "ring", "04_ring"])
def test_a_name_that_is_no_assignment_says_which_are(text):
    with pytest.raises(ValueError, match="00_hello_ranks, 01_why_data_parallelism"):
        assign.resolve_assignment(text)


def test_copies_are_graded_once_by_the_stated_rule(tmp_path):
    top = _write(tmp_path / "04_ring_scatter_reduce.ipynb", ["def ring_scatter_reduce(t):\n    return 0"])
    old = _write(tmp_path / "old" / "04_ring_scatter_reduce.ipynb", ["def ring_scatter_reduce(t):\n    return 1"])
    copy = _write(tmp_path / "04_ring_scatter_reduce-Copy1.ipynb", ["def ring_scatter_reduce(t):\n    return 2"])
    plan = assign.plan_submission([copy, old, top])
    graded = {p.path: p.grade for p in plan.notebooks}
    assert graded == {top: ["ring_scatter_reduce"], old: [], copy: []}
    chosen = next(p for p in plan.notebooks if p.path == top)
    assert "ring_scatter_reduce: also in old/04_ring_scatter_reduce.ipynb; graded in this notebook only (one copy of each exercise is graded" in chosen.notes[0]
    assert all("ring_scatter_reduce: graded in 04_ring_scatter_reduce.ipynb, not in this copy" in p.notes[0]
               for p in plan.notebooks if p.path != top)


def test_a_readable_copy_wins_over_a_refused_one(tmp_path):
    good = _write(tmp_path / "sub" / "04_ring_scatter_reduce.ipynb", ["x = 1"])
    link = tmp_path / "04_ring_scatter_reduce.ipynb"
    link.symlink_to(good)
    plan = assign.plan_submission([link, good], root=tmp_path)
    assert [p.grade for p in plan.notebooks] == [[], ["ring_scatter_reduce"]]
    assert plan.notebooks[0].error.kind == "refused"


def test_other_assignments_exercises_score_nothing_and_missing_ones_count(tmp_path):
    path = _write(tmp_path / "04_ring_scatter_reduce.ipynb", ["x = 1", 'exercises.check("pass_token", f)'])
    plan = assign.plan_submission([path])
    assert plan.assignments == ["04_ring_scatter_reduce"] and plan.notebooks[0].grade == ["ring_scatter_reduce"]
    assert any("pass_token is an exercise of 00_hello_ranks" in note for note in plan.notebooks[0].notes)
    plan = assign.plan_submission([path], assignment=["04_ring_scatter_reduce", "05_ring_all_gather"])
    assert plan.missing == ["ring_all_gather", "ring"]
    plan = assign.plan_submission([path], assignment=["06_ring_cost"])
    assert plan.notebooks[0].grade == [] and plan.missing == ["traffic_ring", "traffic_ring_per_rank", "ring_steps"]
    assert any("ring_scatter_reduce is an exercise of 04_ring_scatter_reduce, not of this submission's assignment "
               "(06_ring_cost)" in note for note in plan.notebooks[0].notes)


def test_a_submission_never_scores_above_its_total():
    grade = judge.NotebookGrade("04.ipynb")
    grade.tests = [{"name": "ring_scatter_reduce", "score": 10, "max_score": 10, "output": "", "lines": []}]
    forged = judge.NotebookGrade("05.ipynb")
    forged.tests = [{"name": "ring", "score": 50, "max_score": 5, "output": "", "lines": []}]
    submission = batch.SubmissionGrade("s", [grade, forged])
    assert submission.score == submission.max_score == 15
    assert results.results_json([grade, forged])["score"] == 15


# --------------------------------------------------------------------------------------------------
# Files as given, sizes
# --------------------------------------------------------------------------------------------------


def test_links_pipes_and_devices_are_refused_without_being_opened(tmp_path):
    secret = tmp_path / "secret.ipynb"
    secret.write_text("{}")
    (tmp_path / "link.ipynb").symlink_to(secret)
    os.mkfifo(tmp_path / "pipe.ipynb")                        # opening it for reading would wait for a writer
    os.mknod(tmp_path / "device.ipynb", 0o644 | stat.S_IFCHR, os.makedev(1, 5))
    started = time.monotonic()
    for name, words in (("link.ipynb", "is a symbolic link"), ("pipe.ipynb", "is not a plain file"),
                        ("device.ipynb", "is not a plain file")):
        with pytest.raises(NotebookError, match=words) as caught:
            read_file(tmp_path / name)
        assert caught.value.kind == "refused"
    assert time.monotonic() - started < 5


def test_a_folder_is_walked_without_following_links(tmp_path):
    student = tmp_path / "class" / "ada"
    _write(student / "06_ring_cost.ipynb", ["x = 1"])
    (tmp_path / "elsewhere").mkdir()
    _write(tmp_path / "elsewhere" / "04_ring_scatter_reduce.ipynb", ["x = 1"])
    (student / "linked_folder").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "class" / "bob").symlink_to(tmp_path / "elsewhere")
    submissions = {s.name: s for s in batch.collect_class(tmp_path / "class")}
    assert [p.name for p in submissions["ada"].notebooks] == ["06_ring_cost.ipynb"]
    assert "linked_folder is a symbolic link to a folder: not followed" in submissions["ada"].notes[0]
    assert submissions["bob"].notebooks == [] and "is a symbolic link: not followed" in submissions["bob"].problem


@pytest.mark.parametrize("what", ["bytes", "cells", "code"])
def test_a_notebook_too_large_is_refused_before_any_cell_is_read(tmp_path, what):
    path = tmp_path / "06_ring_cost.ipynb"
    if what == "bytes":
        with open(path, "wb") as f:                           # sparse: 33 MiB without writing them
            f.truncate(33 << 20)
    else:
        count, source = (MAX_CELLS + 1, "x = 1") if what == "cells" else (10, "x = 1\n" * 200_000)
        _write(path, [source] * count)
    started = time.monotonic()
    grade = judge.grade_notebook(path)
    assert grade.status == "too large" and grade.score == 0 and grade.max_score == 3, grade.notes
    assert time.monotonic() - started < 10


def test_a_notebook_of_60000_cells_is_answered_in_under_30_s(tmp_path):
    path = tmp_path / "06_ring_cost.ipynb"
    path.write_text(json.dumps({"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [
        {"cell_type": "code", "id": f"c{i}", "metadata": {}, "execution_count": None, "outputs": [],
         "source": f"x{i} = x{i - 1} + 1"} for i in range(60_000)]}))
    started = time.monotonic()
    grade = judge.grade_notebook(path)
    seconds = time.monotonic() - started
    assert grade.status == "too large" and "60,000 cells" in grade.notes[0]
    assert seconds < 30, seconds


def test_planning_is_linear_and_a_tangled_notebook_runs_every_cell():
    """A chain of functions each reading the one before (every closure needed) plans in time linear in its
    size; a notebook where every cell calls the latest of 2,000 such functions (quadratic to follow exactly)
    stops at the budget and runs every cell, in well under a second per thousand cells."""
    def chain(n, call):
        sources = [f"x{i} = {i}\ndef f{i}(t):\n    return t + x{i} + f{i - 1}(t)" + (f"\nf{i}(x{i})" if call else "")
                   for i in range(1, n)]
        return ["def f0(t):\n    return t"] + sources + [f"def ring(t):\n    return f{n - 1}(t)"]
    timings = {500: [], 2000: []}
    for _ in range(3):      # interleaved, and the fastest of each: a load spike on a busy machine hits one run, not all
        for n in timings:
            started = time.monotonic()
            plan, why = cells.cells_to_run(chain(n, call=False), ["ring"])
            timings[n].append(time.monotonic() - started)
            assert why == "" and len(plan) == n + 1
    fastest = {n: min(times) for n, times in timings.items()}
    assert fastest[2000] < 12 * fastest[500] + 0.5, timings            # linear: 4x the cells, not 16x the time
    started = time.monotonic()
    plan, why = cells.cells_to_run(chain(2000, call=True), ["ring"])
    assert why.startswith("every cell ran: its functions read each other too deeply") and len(plan) == 2001
    assert time.monotonic() - started < 10


def test_csv_cells_that_would_be_formulas_are_text():
    assert [results.csv_cell(v) for v in ("=HYPERLINK(\"x\")", "+1", "-2", "@SUM(A1)", "\tx", "ada", "3")] == \
        ["'=HYPERLINK(\"x\")", "'+1", "'-2", "'@SUM(A1)", "\\tx", "ada", "3"]      # a tab is written as \t

def test_the_csv_writes_a_formula_like_name_as_text(tmp_path):
    results.write_csv(tmp_path / "grades.csv", [batch.SubmissionGrade("=cmd|' /C calc'!A0", [])])
    rows = list(csv.reader((tmp_path / "grades.csv").open()))
    assert rows[1][0] == "'=cmd|' /C calc'!A0"


# --------------------------------------------------------------------------------------------------
# The command's errors
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, words", [
    (["--assignment", "12"], "is not one of the course's assignments"),
    (["--memory", "lots"], "is not a size: write it as 4G"),
    (["--memory", "100M"], "--memory must be 256M or more"),
    (["--processes", "4"], "--processes must be 16 or more"),
    (["--disk=-1G"], "is not a size"),
    (["--isolation", "jail"], "invalid choice: 'jail'"),
])
def test_bad_arguments_say_what_was_wrong(tmp_path, args, words):
    notebook = _write(tmp_path / "06_ring_cost.ipynb", ["x = 1"])
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "course_grader", str(notebook), *args], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == cli.EXIT_USAGE and words in done.stderr, done.stderr[-2000:]
    assert time.monotonic() - started < 60


# --------------------------------------------------------------------------------------------------
# Without namespaces: one student at a time
# --------------------------------------------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="isolation 'users' needs root")
@pytest.mark.parametrize("isolation, most", [("users", 1), ("namespaces", 2)])
def test_without_namespaces_no_two_students_are_graded_at_once(tmp_path, monkeypatch, isolation, most):
    """Each student's notebooks still run in parallel; without namespaces another student's never do beside
    them (their ports, their files in /tmp would be within reach). With namespaces they may."""
    if isolation == "namespaces" and not batch.choose_isolation("auto") == "namespaces":
        pytest.skip("this machine gives no namespaces")
    for student, count in (("ada", 1), ("bob", 2), ("cy", 2)):
        for name in ("04_ring_scatter_reduce.ipynb", "06_ring_cost.ipynb")[:count]:
            _write(tmp_path / "class" / student / name, ["x = 1"])
    running, peak, lock = {}, [0, 0], threading.Lock()

    def fake(path, **kwargs):
        student = pathlib.Path(path).parent.name
        with lock:
            running[student] = running.get(student, 0) + 1
            peak[0] = max(peak[0], len([s for s, n in running.items() if n]))
            peak[1] = max(peak[1], running[student])
        time.sleep(0.3)
        with lock:
            running[student] -= 1
        return judge.NotebookGrade(str(path))
    monkeypatch.setattr(judge, "grade_notebook", fake)
    monkeypatch.setattr(batch, "refuse_exposure", lambda *a, **k: None)
    batch.grade_submissions(batch.collect_class(tmp_path / "class"), jobs=2, isolation=isolation,
                            user_base="course_lib_schedule")
    assert peak[0] == most, peak                  # students graded at the same time
    if isolation == "users":
        assert peak[1] == 2, peak                 # one student's two notebooks, side by side
