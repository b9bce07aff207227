"""A learner who changes WORLD_SIZE at the top of a notebook still gets a correct run.

nbval (in the main test command) checks every notebook as stored, with WORLD_SIZE = 4. Here each
notebook is executed again with its `WORLD_SIZE = ...` line rewritten to 2, 3 and 8: the fewest ranks, an odd
number that is not a power of two (uneven chunks, a fold in halving-doubling), and more ranks than this
machine has cores. The notebooks assert their own numbers (computed from WORLD_SIZE), so a lesson that only
works for 4 ranks fails here. (5 was a fourth size until the course reached 13 notebooks; what set it apart, odd and
one rank beyond a power of two, 3 has too, and it cost about two of CI's 20 minutes.)

The exercises' check cells (nbgrader `grade` cells) are left out of these runs: `exercises.check`
runs the learner's function on its own cases and world sizes (1 to 6) whatever WORLD_SIZE says, so
running it again at four more world sizes repeats the same work (about a minute of CI). nbval runs
them in every notebook, and tests/test_grade.py and tests/test_exercises.py grade them.
"""

from __future__ import annotations

import pathlib
import re

import pytest
from conftest import execute_notebook

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
WORLD_SIZE_LINE = re.compile(r"^WORLD_SIZE = \d+", re.MULTILINE)
SIZES = (2, 3, 8)


def _notebooks():
    return sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def test_every_notebook_has_exactly_one_world_size_line():
    assert _notebooks(), "no notebooks found"
    for path in _notebooks():
        notebook = nbformat.read(path, as_version=4)
        hits = [c for c in notebook.cells if c.cell_type == "code" and WORLD_SIZE_LINE.search(c.source)]
        assert len(hits) == 1 and len(WORLD_SIZE_LINE.findall(hits[0].source)) == 1, path.name


def _is_exercise_check(cell) -> bool:
    grading = cell.get("metadata", {}).get("nbgrader", {})
    return cell.cell_type == "code" and grading.get("grade", False) and not grading.get("solution", False)


def test_exercise_checks_do_not_read_world_size():
    # The reason they may be left out above: no check cell reads WORLD_SIZE (or G), and one exists.
    checks = [cell for path in _notebooks() for cell in nbformat.read(path, as_version=4).cells
              if _is_exercise_check(cell)]
    assert checks, "no exercise check cells found: has the nbgrader metadata changed?"
    for cell in checks:
        assert "WORLD_SIZE" not in cell.source and not re.search(r"\bG\b", cell.source), cell.source


def _run_with_world_size(path, world_size):
    notebook = nbformat.read(path, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code" and WORLD_SIZE_LINE.search(cell.source):
            cell.source = WORLD_SIZE_LINE.sub(f"WORLD_SIZE = {world_size}", cell.source)
        if _is_exercise_check(cell):
            cell.source = "# exercise check: independent of WORLD_SIZE, run by nbval (see the module docstring)"
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    execute_notebook(client)  # raises CellExecutionError, with the failing cell and traceback, on any error


# One class per world size: pytest-xdist's --dist loadscope hands each class to one worker, so the
# sizes can run side by side while every notebook still runs start to finish in one kernel.
class TestWorldSize2:
    @pytest.mark.parametrize("path", _notebooks(), ids=lambda p: p.stem)
    def test_notebook_runs(self, path):
        _run_with_world_size(path, 2)


class TestWorldSize3:
    @pytest.mark.parametrize("path", _notebooks(), ids=lambda p: p.stem)
    def test_notebook_runs(self, path):
        _run_with_world_size(path, 3)


class TestWorldSize8:
    @pytest.mark.parametrize("path", _notebooks(), ids=lambda p: p.stem)
    def test_notebook_runs(self, path):
        _run_with_world_size(path, 8)


def test_the_classes_cover_every_size():
    assert sorted(int(name[len("TestWorldSize"):]) for name in globals() if name.startswith("TestWorldSize")) \
        == sorted(SIZES)
