"""A learner who changes WORLD_SIZE at the top of a notebook still gets a correct run.

nbval (in the main test command) checks every notebook as stored, with WORLD_SIZE = 4. Here each
notebook is executed again with its `WORLD_SIZE = ...` line rewritten to 2, 3 and 8: the fewest ranks, an odd
number that is not a power of two (uneven chunks, a fold in halving-doubling), and more ranks than this
machine has cores. The notebooks assert their own numbers (computed from WORLD_SIZE), so a lesson that only
works for 4 ranks fails here. (5 was a fourth size until the course reached 13 notebooks; what set it apart, odd and
one rank beyond a power of two, 3 has too, and it cost about two of CI's 20 minutes.)

The three sizes run one after another in one kernel, each from a namespace emptied by `%reset -f` (a cell that
reads a name before the notebook binds it still fails, as in a fresh kernel). What carries over is the kernel
process: its imported modules, and that is the point (a kernel's start and the notebook's imports of torch,
course_lib and matplotlib cost about 3 s of CPU, paid once per notebook instead of three times), but also their
state: torch's global random generator and settings, course_lib's notices already given, the environment and the
working folder. The notebooks seed what they draw and change none of the rest; on a GPU machine a backward() at one
size would make `launch` spawn the ranks of the next (see `launch`), which these CPU runs never meet. A failure
names its size, and the sizes after it still run, in a new kernel.

The exercises' check cells (nbgrader `grade` cells) are left out of these runs: `exercises.check`
runs the learner's function on its own cases and world sizes (1 to 6) whatever WORLD_SIZE says, so
running it again at three more world sizes repeats the same work (about a minute of CI). nbval runs
them in every notebook, and tests/test_grade.py and tests/test_exercises.py grade them.

So are the other cells whose work does not depend on WORLD_SIZE (`world_size_plan`): a cell runs here when
it reads WORLD_SIZE, or a name a cell that did so bound or changed (G, the ranks' results, their plots), or
when a cell that runs needs what it binds; the rest compute what nbval computed at 4 ranks, the same at any
size (notebook 13's launches of 64 ranks, 10's and 12's own 64-rank launches). The reading is by names: a
cell that reads WORLD_SIZE through hidden state (a library setting another cell made from WORLD_SIZE) would be
left out wrongly, which loses that cell's run here. The other way round it errs towards running: a cell runs when
it binds, or calls any method of, an object a running cell reads (so `rng.random()` and `model.train()` keep their
effects), a function's body counts where the function is used, and cells that seed or run IPython magics always
run; a left-out cell still runs its imports. What it cannot see (a function that changes a global object in place,
`exec`) could leave out a cell a running one relies on: that cell then fails here, loudly (NameError, an assert),
and the fix is to say it in the notebook's names.
"""

from __future__ import annotations

import ast
import copy
import pathlib
import re
import symtable
from dataclasses import dataclass, field

import pytest
from conftest import execute_notebook, is_exercise_check

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


def test_exercise_checks_do_not_read_world_size():
    # The reason they may be left out above: no check cell reads WORLD_SIZE (or G), and one exists.
    checks = [cell for path in _notebooks() for cell in nbformat.read(path, as_version=4).cells
              if is_exercise_check(cell)]
    assert checks, "no exercise check cells found: has the nbgrader metadata changed?"
    for cell in checks:
        assert "WORLD_SIZE" not in cell.source and not re.search(r"\bG\b", cell.source), cell.source


# --------------------------------------------------------------------------------------------------
# Which cells depend on WORLD_SIZE: read from the names each top-level statement reads and binds
# --------------------------------------------------------------------------------------------------

_MUTATORS = {"append", "extend", "update", "add", "pop", "insert", "setdefault", "clear", "remove", "sort",
             "discard", "popitem", "appendleft", "extendleft", "fill", "put", "resize", "__setitem__"}
_ALWAYS = ("seed", "chdir", "run_line_magic", "run_cell_magic", "system", "getoutput")   # effects beyond names


@dataclass
class _Statement:
    """What one top-level statement of a cell does with names. `defines`: for a function (or class) it defines,
    the globals its body reads and assigns, which count where the function is used, not where it is defined."""

    reads: set
    binds: set
    imports: set
    changes: set
    touches: set
    rebinds: bool                 # a plain assignment, import or definition: the name's earlier value is gone
    defines: dict = field(default_factory=dict)


def _python(source: str) -> ast.Module:
    from IPython.core.inputtransformer2 import TransformerManager

    return ast.parse(TransformerManager().transform_cell(source))


def _inner_globals(table, reads, assigns):
    """Globals read (and assigned, `global x`) inside the functions, classes and lambdas below `table`."""
    for child in table.get_children():
        for symbol in child.get_symbols():
            if symbol.is_referenced() and (symbol.is_global() or symbol.is_free()) and not symbol.is_local():
                reads.add(symbol.get_name())
            if symbol.is_declared_global() and symbol.is_assigned():
                assigns.add(symbol.get_name())
        _inner_globals(child, reads, assigns)


def _root(node):
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda, ast.ListComp, ast.SetComp,
           ast.DictComp, ast.GeneratorExp)


def _walk_this_scope(node):
    """ast.walk without descending into function, class, lambda and comprehension bodies (scopes of their own)."""
    todo = [node]
    while todo:
        node = todo.pop()
        yield node
        todo.extend(child for child in ast.iter_child_nodes(node) if not isinstance(child, _SCOPES))


def _stored_first(statement) -> set:
    """Names a compound statement stores before it reads them, in the order Python evaluates it (a loop's own
    variables, `x = ...` before `print(x)`), as opposed to `acc = acc + i` or `if G > 2: G = 2`."""
    first = {}

    def visit(node):
        if isinstance(node, _SCOPES):
            return
        if isinstance(node, ast.Name):
            first.setdefault(node.id, isinstance(node.ctx, ast.Store))
            return
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):       # the value is evaluated first
            order = [node.value] + (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
                first.setdefault(node.target.id, False)                        # x += 1 reads x first
            for child in order:
                if child is not None:
                    visit(child)
            return
        if isinstance(node, (ast.For, ast.AsyncFor)):
            for child in [node.iter, node.target, *node.body, *node.orelse]:
                visit(child)
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(statement)
    return {name for name, stored in first.items() if stored}


def _changed(statement) -> tuple:
    """(changes, touches): the names whose object a statement changes in place, as far as can be told
    (`x[k] = ...`, `x.attr = ...`, `x.append(...)`, torch's `t.add_(...)`), and, wider, the names whose object it
    may change: any method call (`model.train()`, `rng.random()`). A change in a statement that depends on
    WORLD_SIZE makes the object depend on it; a cell that may change an object a running cell needs runs too.
    (`world_size_plan` takes the notebook's modules out: `np.log(...)` changes no module.)"""
    changes, touches = set(), set()
    for node in _walk_this_scope(statement):
        if isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(node.ctx, (ast.Store, ast.Del)):
            changes.add(_root(node))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            method, owner = node.func.attr, _root(node.func.value)
            touches.add(owner)
            if method in _MUTATORS or (method.endswith("_") and not method.startswith("_")):
                changes.add(owner)
    return changes - {None}, (touches | changes) - {None}


def _magic_bodies(statement) -> list:
    """The Python inside `%%time` / `%time x = ...` (IPython turns them into strings)."""
    bodies = []
    for node in ast.walk(statement):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("run_cell_magic", "run_line_magic"):
            for argument in node.args[1:]:
                if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
                    try:
                        bodies += _python(argument.value).body
                    except SyntaxError:
                        pass
    return bodies


def _statements(tree: ast.Module) -> list:
    """A `_Statement` per top-level statement of a cell (and per statement inside its magics)."""
    out = []
    body = tree.body + [inner for statement in tree.body for inner in _magic_bodies(statement)]
    for statement in body:
        table = symtable.symtable(ast.unparse(statement), "<cell>", "exec")
        symbols = table.get_symbols()
        binds = {s.get_name() for s in symbols if s.is_assigned() or s.is_imported() or s.is_namespace()}
        imports = {s.get_name() for s in symbols if s.is_imported() and not s.is_assigned()}
        reads = {s.get_name() for s in symbols if s.is_referenced()}
        inner_reads, inner_assigns = set(), set()
        _inner_globals(table, inner_reads, inner_assigns)
        reads |= inner_reads                   # as if called here too (a lambda or generator may well be)
        reads |= {n.target.id for n in ast.walk(statement)
                  if isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name)}       # x += 1 reads x
        if not isinstance(statement, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            reads -= _stored_first(statement)  # a loop's own variables, a block's names set before they are read
        defines = {}
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defines[statement.name] = (inner_reads, inner_assigns)
        elif isinstance(statement, ast.Assign) and isinstance(statement.value, ast.Lambda):
            defines.update({t.id: (inner_reads, inner_assigns) for t in statement.targets if isinstance(t, ast.Name)})
        rebinds = isinstance(statement, (ast.Assign, ast.AnnAssign, ast.Import, ast.ImportFrom, ast.FunctionDef,
                                         ast.AsyncFunctionDef, ast.ClassDef))
        out.append(_Statement(reads, binds, imports, *_changed(statement), rebinds, defines))
    return out


def _always_runs(tree: ast.Module) -> bool:
    calls = {node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
             for node in ast.walk(tree) if isinstance(node, ast.Call)}
    return any(word in call for call in calls for word in _ALWAYS)


def _imports_of(source: str) -> str:
    """A left-out cell's top-level imports, which still run: what they bind and set up costs nothing."""
    return "\n".join(ast.unparse(s) for s in _python(source).body if isinstance(s, (ast.Import, ast.ImportFrom)))


def _through_calls(names: set, defines: dict) -> tuple:
    """`names` read, plus what the functions among them read and assign when called (transitively)."""
    reads, assigns, todo = set(names), set(), list(names)
    while todo:
        inner_reads, inner_assigns = defines.get(todo.pop(), (set(), set()))
        assigns |= inner_assigns
        for name in inner_reads - reads:
            reads.add(name)
            todo.append(name)
    return reads, assigns


def world_size_plan(sources: list) -> set:
    """The positions of the code cells (`sources`, in order) that a run at another WORLD_SIZE must execute.

    Forward, statement by statement: a statement that binds WORLD_SIZE, or reads a name that depends on it
    (directly, or inside a function it uses), makes its cell depend on it, and what it binds or may change
    depends on it from then on (a plain top-level rebinding from other values ends that). Backward: a cell also
    runs when a later running cell reads (or changes) a name it binds; cells that seed or run magics always
    run, and a cell left out still runs its imports.
    """
    trees = [_python(source) for source in sources]
    statements = [_statements(tree) for tree in trees]
    modules = {name for cell in statements for statement in cell for name in statement.imports}
    for cell in statements:
        for statement in cell:
            statement.changes -= modules
            statement.touches -= modules
    defines = {}
    for cell in statements:
        for statement in cell:
            for name, (reads, assigns) in statement.defines.items():        # every definition of a name, merged
                known = defines.setdefault(name, (set(), set()))
                known[0].update(reads)
                known[1].update(assigns)
    depends, dependent = {"WORLD_SIZE"}, set()
    for position, cell in enumerate(statements):
        for statement in cell:
            reads, assigns = _through_calls(statement.reads, defines)
            binds = statement.binds | assigns
            if reads & depends or "WORLD_SIZE" in binds:
                dependent.add(position)
                depends |= (binds - statement.imports) | statement.changes
            elif statement.rebinds:
                depends -= binds - statement.changes
    run, needed = set(), set()
    for position in reversed(range(len(sources))):
        reads, rebound, touched = set(), set(), set()
        for statement in statements[position]:
            statement_reads, assigns = _through_calls(statement.reads, defines)
            reads |= (statement_reads | statement.touches) - rebound
            touched |= statement.binds | assigns | statement.touches
            if statement.rebinds:
                rebound |= statement.binds - statement.changes
        if position in dependent or touched & needed or _always_runs(trees[position]):
            run.add(position)
            needed = (needed - rebound) | reads
    return run


def _planned_cells(path):
    """The notebook, and its code cells as the world-size runs execute them: the plan's cells, the rest reduced to
    their imports, the exercise checks to a comment, all without stored outputs. The plan is the same at any size."""
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    runs = world_size_plan([cell.source for cell in code if not is_exercise_check(cell)])
    position = 0
    for cell in code:
        cell.execution_count, cell.outputs = None, []     # run from blank, not from the stored run
        if is_exercise_check(cell):
            cell.source = "# exercise check: independent of WORLD_SIZE, run by nbval (see the module docstring)"
            continue
        if position not in runs:
            cell.source = "# independent of WORLD_SIZE: run by nbval at 4 ranks (see the module docstring)\n" + \
                _imports_of(cell.source)
        position += 1
    return notebook, code


# Between two world sizes the kernel forgets every name the notebook bound, as a fresh kernel would (a cell that reads
# a name before the notebook binds it still fails), and closes the last size's figures.
_FRESH_START = ("%reset -f\nimport sys\nif 'matplotlib.pyplot' in sys.modules:\n"
                "    sys.modules['matplotlib.pyplot'].close('all')\ndel sys")


def _run_in_one_kernel(planned, sizes):
    """Run the notebook (`_planned_cells`) at each of `sizes` in turn in one kernel, until something fails. Returns
    None, or (position in `sizes`, whether it failed in the reset before that size, nbclient's error: the failing
    cell and its traceback, a cell's timeout, a dead kernel)."""
    original, code = planned
    notebook = nbformat.v4.new_notebook(metadata=original.metadata)
    owner = []                                     # per cell: (position of its size, is it the reset cell)
    for position, size in enumerate(sizes):
        notebook.cells.append(nbformat.v4.new_code_cell(f"# WORLD_SIZE = {size} from here on\n" + _FRESH_START))
        for cell in code:
            cell = copy.deepcopy(cell)
            cell.source = WORLD_SIZE_LINE.sub(f"WORLD_SIZE = {size}", cell.source)
            notebook.cells.append(cell)
        owner += [(position, True)] + [(position, False)] * len(code)
    running = []
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOKS)}},
                                     on_cell_start=lambda cell, cell_index: running.append(cell_index))
    try:
        execute_notebook(client)
    except Exception as exc:  # noqa: BLE001 - CellExecutionError, CellTimeoutError, DeadKernelError, ...
        return (*owner[running[-1]], exc) if running else (0, True, exc)
    return None


def _run_at_world_sizes(path, sizes=SIZES):
    """Run the notebook at every one of `sizes`, sharing a kernel between them: its start and the notebook's
    imports (torch, course_lib, matplotlib: about 3 s of CPU) are paid once, not once per size. After a failure
    the sizes after it still run, in a new kernel, and every failure is reported with its size; a failure in the
    reset between two sizes (or in a kernel's start) is reported as such, and the next size runs in a new kernel."""
    planned = _planned_cells(path)
    failures, remaining = [], list(sizes)
    while remaining:
        failed = _run_in_one_kernel(planned, remaining)
        if failed is None:
            break
        position, in_reset, error = failed
        text = f"{type(error).__name__}: {error}"
        if in_reset and position > 0:
            failures.append(f"{path.name} between WORLD_SIZE = {remaining[position - 1]} and {remaining[position]}, "
                            f"in the reset or the kernel:\n{text}")
            remaining = remaining[position:]
        elif in_reset:
            failures.append(f"{path.name}: the kernel for WORLD_SIZE = {', '.join(map(str, remaining))} failed "
                            f"before the notebook's first cell:\n{text}")
            break
        else:
            failures.append(f"{path.name} at WORLD_SIZE = {remaining[position]}:\n{text}")
            remaining = remaining[position + 1:]
    if failures:
        pytest.fail("\n\n".join(failures), pytrace=False)


# One test per notebook: pytest-xdist hands each to a worker of its own (tests/conftest.py sends the longest first).
@pytest.mark.parametrize("path", _notebooks(), ids=lambda p: p.stem)
def test_notebook_runs_at_other_world_sizes(path):
    _run_at_world_sizes(path)


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


def test_what_a_statement_updates_it_reads_first():
    assert _planned("WORLD_SIZE = 4", "n = 0", "n += WORLD_SIZE") == [0, 1, 2]               # n = 0 is needed
    assert _planned("WORLD_SIZE = 4", "sizes = [WORLD_SIZE]", "sizes += [8]", "print(sizes)") == [0, 1, 2, 3]
    assert _planned("WORLD_SIZE = 4", "G = WORLD_SIZE\nif G > 2:\n    G = 2", "print(G)") == [0, 1, 2]
    assert _planned("WORLD_SIZE = 4", "acc = 0", "for i in range(WORLD_SIZE):\n    acc = acc + i") == [0, 1, 2]
    assert _planned("WORLD_SIZE = 4", "m = WORLD_SIZE", "for v in range(3):\n    m = v * 2\n    print(m)") == [0, 1]


def test_a_function_counts_where_it_is_used():
    assert _planned("def f():\n    return G * 2", "WORLD_SIZE = 4", "G = WORLD_SIZE", "print(f())") == [0, 1, 2, 3]
    assert _planned("WORLD_SIZE = 4", "def f():\n    return helper() * WORLD_SIZE", "def helper():\n    return 2",
                    "f()") == [0, 1, 2, 3]
    assert _planned("WORLD_SIZE = 4", "def f():\n    global X\n    X = 1", "f()", "print(X, WORLD_SIZE)") == \
        [0, 1, 2, 3]


def test_a_method_call_keeps_its_cell_when_the_object_is_needed_and_in_place_methods_pass_the_dependence_on():
    assert _planned("import numpy as np\nrng = np.random.default_rng(0)", "rng.random(3)", "WORLD_SIZE = 4",
                    "x = rng.random(WORLD_SIZE)") == [0, 1, 2, 3]                 # the stream the last cell draws from
    assert _planned("import torch\nt = torch.zeros(2)", "WORLD_SIZE = 4", "t.add_(WORLD_SIZE)", "print(t)") == \
        [0, 1, 2, 3]
    assert _planned("NET = make()", "WORLD_SIZE = 4", "t = NET.predict(WORLD_SIZE)", "u = NET.predict(64)") == [0, 1, 2]


def test_the_python_inside_a_cell_magic_is_read():
    assert _planned("WORLD_SIZE = 4", "data = [1, 2]", "%%time\nprint(len(data), WORLD_SIZE)") == [0, 1, 2]
    assert _planned("WORLD_SIZE = 4", "x = 1", "%%time\nG = WORLD_SIZE", "print(G)", "print(x)") == [0, 2, 3]


def _notebook_file(path, *sources):
    """A notebook of these code cells at `path`, for the python3 kernel."""
    notebook = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                                 "language": "python"}})
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in sources]
    nbformat.write(notebook, path)
    return path


def test_each_size_starts_from_no_names_and_every_failure_says_at_which_size(tmp_path):
    path = _notebook_file(
        tmp_path / "99_breaks_at_odd_sizes_and_eight.ipynb",
        "WORLD_SIZE = 4",
        "assert 'kept' not in globals(), 'a name bound at the last size'\nkept = WORLD_SIZE",
        "assert WORLD_SIZE % 2 == 0 or WORLD_SIZE == 5, f'this notebook breaks at {WORLD_SIZE} ranks'",
        "assert WORLD_SIZE != 8, 'and at 8'")
    with pytest.raises(pytest.fail.Exception) as failed:
        _run_at_world_sizes(path, sizes=(8, 2, 3, 5))
    report = str(failed.value)
    assert "a name bound" not in report, report
    assert report.count(" at WORLD_SIZE = ") == 2, report
    assert "at WORLD_SIZE = 8:" in report and "and at 8" in report, report
    assert "at WORLD_SIZE = 3:" in report and "this notebook breaks at 3 ranks" in report, report


def test_a_failure_in_the_reset_between_two_sizes_is_named_so_and_the_next_size_still_runs(tmp_path):
    path = _notebook_file(
        tmp_path / "99_breaks_the_reset.ipynb",
        "WORLD_SIZE = 4",
        "import sys\nif WORLD_SIZE == 2:\n    sys.modules['matplotlib.pyplot'] = None    # breaks the reset after it",
        "assert WORLD_SIZE != 3, 'this notebook breaks at 3 ranks'")
    with pytest.raises(pytest.fail.Exception) as failed:
        _run_at_world_sizes(path, sizes=(2, 3))
    report = str(failed.value)
    assert "between WORLD_SIZE = 2 and 3, in the reset" in report, report
    assert "at WORLD_SIZE = 3:" in report and "this notebook breaks at 3 ranks" in report, report
