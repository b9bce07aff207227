"""A learner who changes WORLD_SIZE at the top of a notebook still gets a correct run.

nbval (in the main test command) checks every notebook as stored, with WORLD_SIZE = 4. Here each
notebook is executed again with its `WORLD_SIZE = ...` line rewritten to 2, 3 and 8: the fewest ranks, an odd
number that is not a power of two (uneven chunks, a fold in halving-doubling), and more ranks than this
machine has cores. The notebooks assert their own numbers (computed from WORLD_SIZE), so a lesson that only
works for 4 ranks fails here. (5 was a fourth size until the course reached 13 notebooks; what set it apart, odd and
one rank beyond a power of two, 3 has too, and it cost about two of CI's 20 minutes.)

The exercises' check cells (nbgrader `grade` cells) are left out of these runs: `exercises.check`
runs the learner's function on its own cases and world sizes (1 to 6) whatever WORLD_SIZE says, so
running it again at three more world sizes repeats the same work (about a minute of CI). nbval runs
them in every notebook, and tests/test_grade.py and tests/test_exercises.py grade them.

So are the other cells whose work does not depend on WORLD_SIZE (`world_size_plan`): a cell runs here when
it reads WORLD_SIZE, or a name a cell that did so bound or changed (G, the ranks' results, their plots), or
when a cell that runs needs what it binds; the rest compute what nbval computed at 4 ranks, the same at any
size (notebook 13's launches of 64 ranks, 10's and 12's own 64-rank launches). The reading is by names: a
cell that reads WORLD_SIZE through hidden state (a library setting another cell made from WORLD_SIZE) would be
left out wrongly, which loses that cell's run here and never fails one; a cell left out whose names a later
cell needs fails that cell at once (NameError). Cells that seed or run IPython magics always run, and a cell left
out still runs its imports.
"""

from __future__ import annotations

import ast
import pathlib
import re
import symtable

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


# --------------------------------------------------------------------------------------------------
# Which cells depend on WORLD_SIZE: read from the names each top-level statement reads and binds
# --------------------------------------------------------------------------------------------------

_MUTATORS = {"append", "extend", "update", "add", "pop", "insert", "setdefault", "clear", "remove", "sort",
             "discard", "popitem"}
_ALWAYS = ("seed", "chdir", "run_line_magic", "run_cell_magic", "system")   # calls whose effect is not a name


def _python(source: str) -> ast.Module:
    from IPython.core.inputtransformer2 import TransformerManager

    return ast.parse(TransformerManager().transform_cell(source))


def _reads_in_functions(table, out):
    """Globals read inside the functions, classes and lambdas a statement defines (read when they run)."""
    for child in table.get_children():
        out |= {s.get_name() for s in child.get_symbols()
                if s.is_referenced() and (s.is_global() or s.is_free()) and not s.is_local()}
        _reads_in_functions(child, out)


def _changed(statement) -> set:
    """Names whose object a statement changes in place: `x[k] = ...`, `x.attr = ...`, `x.append(...)`."""
    out = set()
    for node in ast.walk(statement):
        target = None
        if isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(node.ctx, (ast.Store, ast.Del)):
            target = node
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS:
            target = node.func.value
        while isinstance(target, (ast.Attribute, ast.Subscript)):
            target = target.value
        if isinstance(target, ast.Name):
            out.add(target.id)
    return out


def _statements(source: str) -> list:
    """(reads, binds, imports, changes, rebinds) per top-level statement of a cell; `rebinds`: a plain
    assignment, import or definition, after which the name's earlier value no longer matters."""
    out = []
    for statement in _python(source).body:
        table = symtable.symtable(ast.unparse(statement), "<cell>", "exec")
        symbols = table.get_symbols()
        binds = {s.get_name() for s in symbols if s.is_assigned() or s.is_imported() or s.is_namespace()}
        imports = {s.get_name() for s in symbols if s.is_imported() and not s.is_assigned()}
        reads = {s.get_name() for s in symbols if s.is_referenced()}
        _reads_in_functions(table, reads)
        if isinstance(statement, (ast.For, ast.AsyncFor, ast.While, ast.If, ast.With, ast.AsyncWith, ast.Try)):
            reads -= binds      # a loop's or a block's own names, bound in it before it reads them
        rebinds = isinstance(statement, (ast.Assign, ast.AnnAssign, ast.Import, ast.ImportFrom, ast.FunctionDef,
                                         ast.AsyncFunctionDef, ast.ClassDef))
        out.append((reads, binds, imports, _changed(statement), rebinds))
    return out


def _always_runs(source: str) -> bool:
    calls = {node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
             for node in ast.walk(_python(source)) if isinstance(node, ast.Call)}
    return any(word in call for call in calls for word in _ALWAYS)


def _imports_of(source: str) -> str:
    """A left-out cell's top-level imports, which still run: what they bind and set up costs nothing."""
    return "\n".join(ast.unparse(s) for s in _python(source).body if isinstance(s, (ast.Import, ast.ImportFrom)))


def world_size_plan(sources: list) -> set:
    """The positions of the code cells (`sources`, in order) that a run at another WORLD_SIZE must execute.

    Forward, statement by statement: a statement that binds WORLD_SIZE, or reads a name that depends on it,
    makes its cell depend on it, and what it binds or changes depends on it from then on (a plain rebinding
    from other values ends that). Backward: a cell also runs when a later running cell reads (or changes) a
    name it binds; cells that seed or run magics always run, and a cell left out still runs its imports.
    """
    statements = [_statements(source) for source in sources]
    depends, dependent = {"WORLD_SIZE"}, set()
    for position, cell in enumerate(statements):
        for reads, binds, imports, changes, _ in cell:
            if reads & depends or "WORLD_SIZE" in binds:
                dependent.add(position)
                depends |= (binds - imports) | changes
            else:
                depends -= binds - changes
    run, needed = set(), set()
    for position in reversed(range(len(sources))):
        reads, rebound, touched = set(), set(), set()
        for statement_reads, binds, _, changes, rebinds in statements[position]:
            reads |= (statement_reads | changes) - rebound
            touched |= binds | changes
            if rebinds:
                rebound |= binds - changes
        if position in dependent or touched & needed or _always_runs(sources[position]):
            run.add(position)
            needed = (needed - rebound) | reads
    return run


def _run_with_world_size(path, world_size):
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code" and not _is_exercise_check(cell)]
    runs = world_size_plan([cell.source for cell in code])
    for position, cell in enumerate(code):
        if position not in runs:
            cell.source = "# independent of WORLD_SIZE: run by nbval at 4 ranks (see the module docstring)\n" + \
                _imports_of(cell.source)
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


def _planned(*sources):
    return sorted(world_size_plan(list(sources)))


def test_a_cell_runs_when_it_reads_world_size_or_a_name_made_from_it():
    assert _planned("WORLD_SIZE = 4", "G = WORLD_SIZE", "table = [g * 2 for g in range(3)]", "print(G)") == [0, 1, 3]


def test_a_cell_a_running_cell_needs_runs_too_and_only_the_binding_that_reaches_it():
    assert _planned("LINK = 5", "LINK = 6", "WORLD_SIZE = 4", "t = LINK * WORLD_SIZE") == [1, 2, 3]


def test_a_name_bound_again_from_other_values_no_longer_depends():
    assert _planned("WORLD_SIZE = 4", "G = WORLD_SIZE", "G, n = 64, 1 << 20", "x = G * n") == [0, 1]


def test_functions_depend_on_the_globals_they_read_when_called():
    assert _planned("WORLD_SIZE = 4", "def ranks():\n    return list(range(WORLD_SIZE))", "def twice():\n"
                    "    return ranks() * 2", "def fixed():\n    return 64", "twice()", "fixed()") == [0, 1, 2, 4]


def test_an_object_changed_in_place_from_world_size_depends_on_it():
    assert _planned("results = {}", "WORLD_SIZE = 4", "results['g'] = WORLD_SIZE", "print(results)") == [0, 1, 2, 3]


def test_seeds_and_magics_always_run_and_a_left_out_cell_keeps_its_imports():
    assert _planned("WORLD_SIZE = 4", "torch.manual_seed(0)", "%matplotlib inline", "x = 1") == [0, 1, 2]
    assert _imports_of("import math\nfrom course_lib import bench as b\nx = math.pi") == \
        "import math\nfrom course_lib import bench as b"
