"""The student notebooks in assignments/: up to date with notebooks/, free of solutions, and usable by
nbgrader's own generate_assignment and autograde (the instructor's other route)."""

from __future__ import annotations

import copy
import importlib.util
import os
import pathlib
import subprocess
import sys

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("make_assignments", ROOT / "tools" / "make_assignments.py")
make_assignments = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_assignments)


SOURCES = [path.name for path in make_assignments.sources()]


def test_every_notebook_with_an_exercise_has_a_student_copy():
    from course_lib.exercises import registry

    with_exercises = sorted({exercise.notebook + ".ipynb" for exercise in registry.all_exercises()})
    assert len(with_exercises) >= 8 and all((ROOT / "notebooks" / name).exists() for name in with_exercises)
    assert SOURCES == with_exercises, "a notebook has an exercise in the registry but no Your-turn cell, or the reverse"


def test_assignments_are_up_to_date_with_the_notebooks():
    sources = make_assignments.sources()
    on_disk = sorted(p.name for p in (ROOT / "assignments").glob("*.ipynb"))
    assert on_disk == sorted(p.name for p in sources), "run: python tools/make_assignments.py"
    for path in sources:
        assert (ROOT / "assignments" / path.name).read_text() == make_assignments.assignment_text(path), \
            f"assignments/{path.name} is out of date: run python tools/make_assignments.py"


@pytest.mark.parametrize("name", SOURCES)
def test_a_student_notebook_keeps_the_lesson_and_loses_the_solutions(name):
    source = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    student = nbformat.read(ROOT / "assignments" / name, as_version=4)
    assert [c.get("id") for c in student.cells] == [c.get("id") for c in source.cells]
    assert [c.metadata.get("nbgrader") for c in student.cells] == [c.metadata.get("nbgrader") for c in source.cells]
    for before, after in zip(source.cells, student.cells):
        if after.cell_type == "markdown":
            if "badges" in after.metadata.get("tags", []):   # the student copy opens itself in Colab
                assert f"assignments/{name}" in after.source and f"notebooks/{name}" in before.source
            else:
                assert after.source == before.source
            continue
        assert after.outputs == [] and after.execution_count is None
        assert "SOLUTION" not in after.source and "HIDDEN TESTS" not in after.source
        if before.source.startswith("### BEGIN SOLUTION"):           # answers to questions, at the top level
            assert after.source and all(line.endswith(" = ...  # your answer here") for line in after.source.split("\n"))
        elif "### BEGIN SOLUTION" in before.source:
            assert 'raise NotImplementedError("your code here")' in after.source
            assert after.source.split("\n")[0] == before.source.split("\n")[0]   # the def line stays
        elif make_assignments.shows_reference(before.source, make_assignments.forbidden_modules(source, name),
                                              make_assignments._aliases(source)):
            assert after.source == make_assignments.REFERENCE_NOTE.format(name=name)
        else:
            assert after.source == make_assignments.clear_solutions(before.source)
    assert "widgets" not in student.metadata


def test_no_assignment_shows_the_reference_of_an_exercise_it_asks_for():
    """Notebooks 02-05 and 07 show course_lib's implementation after their exercise; their student copies do not."""
    replaced = []
    for name in SOURCES:
        student = nbformat.read(ROOT / "assignments" / name, as_version=4)
        assert make_assignments.reference_problems(student, name) == [], name
        replaced += [name for c in student.cells if c.source.startswith("# In the instructor's copy this cell shows")]
    for name in SOURCES:                                   # the instructor's copy keeps it where there is one
        source = nbformat.read(ROOT / "notebooks" / name, as_version=4)
        assert bool(make_assignments.reference_problems(source, name)) == (name in replaced), name
    assert sorted(replaced) == ["02_collectives.ipynb", "03_naive_and_master_allreduce.ipynb",
                                "04_ring_scatter_reduce.ipynb", "05_ring_all_gather.ipynb",
                                "07_data_parallel_training.ipynb"]


def _notebook(*sources):
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in sources]
    return notebook


@pytest.mark.parametrize("cell", [
    "import inspect\nprint(inspect.getsource(ar.ring_scatter_reduce))",
    "from inspect import getsource\ngetsource(ring)",
    "ar.ring_scatter_reduce??",
    "%psource course_lib.allreduce.ring_scatter_reduce",
    "print(open(ar.__file__).read())",
    "%pycat course_lib/allreduce.py",
    "import inspect\nsrc = [inspect.getsource(f) for f in (course_lib.allreduce.ring,)]",
])
def test_a_reference_cell_is_found_by_what_it_does(cell):
    imports = "import course_lib\nimport course_lib.allreduce as ar\nfrom course_lib.allreduce import ring"
    check = 'exercises.check("ring_scatter_reduce", ring_scatter_reduce)'
    student = make_assignments.make_student(_notebook(imports, check, cell), "04_ring_scatter_reduce.ipynb")
    assert student.cells[2].source.startswith("# In the instructor's copy"), cell
    assert student.cells[0].source == imports and student.cells[1].source == check
    # The same cell in a notebook whose exercise does not ask for the ring (06: questions only) stays.
    lecture = make_assignments.make_student(_notebook(imports, cell), "06_ring_cost.ipynb")
    assert lecture.cells[1].source == cell
    # Reading the source of something else (a helper module) is not the reference either.
    other = make_assignments.make_student(_notebook(imports, check, "import inspect\ninspect.getsource(course_lib.viz)"),
                                          "04_ring_scatter_reduce.ipynb")
    assert other.cells[2].source == "import inspect\ninspect.getsource(course_lib.viz)"


def test_the_check_fails_when_a_reference_slips_back_in(tmp_path, monkeypatch, capsys):
    import inspect as inspect_module

    from course_lib import allreduce

    copy_of_assignments = tmp_path / "assignments"          # named so: the student copies' badges say it
    copy_of_assignments.mkdir()
    for path in (ROOT / "assignments").glob("*.ipynb"):
        (copy_of_assignments / path.name).write_text(path.read_text())
    monkeypatch.setattr(make_assignments, "TARGET", copy_of_assignments)
    assert make_assignments.main(["--check"]) == 0
    target = copy_of_assignments / "04_ring_scatter_reduce.ipynb"
    notebook = nbformat.read(target, as_version=4)
    notebook.cells.append(nbformat.v4.new_code_cell(inspect_module.getsource(allreduce.ring_scatter_reduce)))  # pasted
    nbformat.write(notebook, target)
    assert make_assignments.main(["--check"]) == 1
    out = capsys.readouterr().out
    assert "04_ring_scatter_reduce.ipynb: cell" in out and "course_lib.allreduce.ring_scatter_reduce's source" in out


def test_solution_regions_become_stubs_at_their_indentation():
    clear = make_assignments.clear_solutions
    assert clear("def f(x):\n    y = 1\n    ### BEGIN SOLUTION\n    return x + y\n    ### END SOLUTION\n") == \
        'def f(x):\n    y = 1\n    raise NotImplementedError("your code here")\n'
    assert clear("### BEGIN SOLUTION\nanswer = 2 * (G - 1)\nother: int = 3\n### END SOLUTION\nprint(answer)") == \
        "answer = ...  # your answer here\nother = ...  # your answer here\nprint(answer)"
    assert clear("a = 1\n### BEGIN HIDDEN TESTS\na = 2\n### END HIDDEN TESTS\nb = a") == "a = 1\nb = a"
    for broken in ("### BEGIN SOLUTION\nx = 1\n", "x = 1\n### END SOLUTION", "### BEGIN SOLUTION\nprint(1)\n### END SOLUTION"):
        with pytest.raises(make_assignments.MarkerError):
            clear(broken)


def test_making_the_student_version_commutes_with_stamping_the_notebooks():
    """Another tool adds an install cell and a badge to every notebook: before or after, same result."""
    source = nbformat.read(ROOT / "notebooks" / "04_ring_scatter_reduce.ipynb", as_version=4)
    original = copy.deepcopy(source)

    def stamp(notebook):
        notebook = copy.deepcopy(notebook)
        notebook.cells.insert(0, nbformat.v4.new_markdown_cell("[Open in Colab](https://example.org)", id="badge"))
        notebook.cells[1].source = "%pip install -q course_lib\n" + notebook.cells[1].source
        return notebook

    one = make_assignments.make_student(stamp(source))
    other = stamp(make_assignments.make_student(source))
    assert nbformat.writes(one) == nbformat.writes(other)
    assert source == original                                   # a pure function: the input is untouched


# --------------------------------------------------------------------------------------------------
# nbgrader, the instructor's other route
# --------------------------------------------------------------------------------------------------


def _nbgrader(course, *args):
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    done = subprocess.run([sys.executable, "-m", "nbgrader", *args, "--force"], cwd=course, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _submit(course, student, notebook):
    folder = course / "submitted" / student / "ring"
    folder.mkdir(parents=True)
    nbformat.write(notebook, folder / "04_ring_scatter_reduce.ipynb")


def test_nbgrader_generates_the_assignment_and_autogrades_with_partial_credit(tmp_path):
    pytest.importorskip("nbgrader", reason="nbgrader is pinned in requirements/test.txt")
    from nbgrader.api import Gradebook

    course = tmp_path / "course"
    (course / "source" / "ring").mkdir(parents=True)
    (course / "nbgrader_config.py").write_text(
        "c = get_config()\nc.CourseDirectory.course_id = 'course_lib'\n"
        f"c.CourseDirectory.root = {str(course)!r}\nc.ExecutePreprocessor.timeout = 300\n")
    source_path = ROOT / "notebooks" / "04_ring_scatter_reduce.ipynb"
    (course / "source" / "ring" / source_path.name).write_text(source_path.read_text())
    _nbgrader(course, "generate_assignment", "ring")
    released = nbformat.read(course / "release" / "ring" / source_path.name, as_version=4)
    solution = next(c for c in released.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "ring_scatter_reduce")
    assert "raise NotImplementedError" in solution.source

    def answered(body):
        notebook = copy.deepcopy(released)
        cell = next(c for c in notebook.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "ring_scatter_reduce")
        cell.source = cell.source.replace("# YOUR CODE HERE\n    raise NotImplementedError()", body)
        return notebook

    right = "\n".join(line for line in next(
        c for c in nbformat.read(source_path, as_version=4).cells
        if c.metadata.get("nbgrader", {}).get("grade_id") == "ring_scatter_reduce").source.split("\n")[3:]
        if "SOLUTION" not in line).strip()
    _submit(course, "plain", released)
    _submit(course, "solved", answered(right))
    _submit(course, "wrong_return", answered(right.replace("return (rank + 1) % G", "return rank")))
    _nbgrader(course, "autograde", "ring", "--create")
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:
        scores = {student: gradebook.find_submission("ring", student).score
                  for student in ("plain", "solved", "wrong_return")}
    assert scores["plain"] == 0 and scores["solved"] == 10
    assert 0 < scores["wrong_return"] < 10          # nbgrader read the check cell's number: partial credit


def test_the_readme_lists_every_assignment_with_its_points():
    """README's "Teaching with it" table: one row per student notebook, the registry's points, the right total."""
    import re

    from course_lib.exercises import registry

    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Teaching with it"):]
    section = section[:section.index("\n## ", 3)]
    rows = dict(re.findall(r"^\| `(\d\d_\w+)` \|.*\| (\d+) \|$", section, re.MULTILINE))
    points = {}
    for exercise in registry.all_exercises():
        points[exercise.notebook] = points.get(exercise.notebook, 0) + exercise.points
    assert {name: int(value) for name, value in rows.items()} == points
    assert sorted(f"{name}.ipynb" for name in rows) == SOURCES
    assert f"{sum(points.values()):g} points in all" in section


def test_the_readme_says_what_each_assignment_forbids_as_the_code_does():
    """The "forbids" column names exactly the course_lib modules the notebook's exercises refuse."""
    import re

    from course_lib.exercises import registry

    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Teaching with it"):]
    section = section[:section.index("\n## ", 3)]
    rows = re.findall(r"^\| `(\d\d_\w+)` \| .* \| (.*) \| \d+ \|$", section, re.MULTILINE)
    assert len(rows) == len(SOURCES)
    for notebook, forbids in rows:
        functions = [e for e in registry.all_exercises() if e.notebook == notebook and e.kind == "function"]
        modules = {f"course_lib.{m}" for e in functions for m in e.forbidden}
        named = set(re.findall(r"course_lib\.\w+", forbids.split("(so")[0]))
        assert named == modules, (notebook, forbids)
        assert ("built-in collectives" in forbids) == bool(functions) and ("(questions)" == forbids) == (not functions)
        assert all("torch.distributed collectives" in e.forbids for e in functions)
    for word in ("--rubric-defaults", "docs/rubric.toml", "--class", "--gradescope-autograder", "--nbgrader"):
        assert word in section, word
