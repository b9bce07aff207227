"""Which cells of a notebook grading has to run: those the graded answers depend on, decided from the source.

A lesson notebook spends most of its run time on cells grading never reads: launches that make pictures,
benchmarks, widgets, the learner's own visible checks. `cells_to_run` keeps a cell when the answers may
depend on it, and every cell when it cannot tell:

The notebook is read backwards, keeping track of the names whose values a later kept cell (or, at the end,
the grader: the answers' names, from `exercises_in`) reads, including what the functions among them read
when they are called:

* a cell is kept when it **binds** such a name (an assignment, ``def``, ``class``, ``import``, a ``for`` or
  ``with`` target, ...); every name it reads when it runs is then needed before it (what the body of a
  function it defines reads is needed where that function is called: by the grader, or by a later cell);
* a cell is kept when it may **change** such a value without binding it: it assigns to an attribute or item
  of it (``cache[0] = 1``), calls one of its methods (``cache.append(1)``), hands it to a call that may change
  it (``fill(buffer)``; not ``print`` or ``len``), calls a function that reads needed notebook data, or, for a
  needed module, assigns into it (``os.environ[...] = ...``) or calls a global-state setter
  (``torch.manual_seed``, ``torch.set_default_dtype``);
* a cell that runs shell commands or installs packages (``!``, ``%pip``) is kept;
* **every** cell runs when the notebook does something the analysis cannot follow: ``exec``/``eval``,
  ``globals()``, ``global`` statements, ``from x import *``, ``builtins``, ``%run`` and other magics that run
  code, a cell that is not Python (a syntax error), or a cell IPython cannot translate.

Skipping is then safe in the sense that matters: a kept cell sees every value it reads as the notebook
had it. (A skipped cell can still have changed hidden state the source does not show, e.g. a random
number generator a later cell draws from; the course's answers read none.)
"""

from __future__ import annotations

import ast
import re
import symtable

__all__ = ["cells_to_run", "Analysis"]

_HARMLESS_MAGICS = {"matplotlib", "time", "timeit", "config", "load_ext", "autoreload", "reload_ext", "precision",
                    "pprint", "xmode", "alias_magic", "who", "whos"}
_INSTALL_MAGICS = {"pip", "conda", "mamba", "system", "sx", "sc"}
_UNSAFE_NAMES = {"exec", "eval", "compile", "globals", "locals", "vars", "__import__", "builtins", "__builtins__",
                 "get_ipython"}
# Builtins that never change their arguments: handing a value to them is only reading it.
_PURE_BUILTINS = {"print", "len", "range", "enumerate", "zip", "sum", "min", "max", "sorted", "str", "int", "float",
                  "repr", "isinstance", "issubclass", "list", "tuple", "dict", "set", "frozenset", "abs", "round", "any",
                  "all", "format", "hash", "id", "type", "bool", "divmod", "pow", "reversed", "callable", "chr", "ord",
                  "hex", "bin", "oct", "map", "filter", "display"}
_STATE_SETTERS = re.compile(r"^(set_|manual_seed|seed|use_deterministic|enable_|disable_|init_process_group)")


class _Unsafe(Exception):
    """The notebook does something this analysis cannot follow: run every cell."""


class Analysis:
    """What one cell binds, reads and calls (see `cells_to_run`)."""

    def __init__(self, source: str):
        self.binds: set = set()          # names bound at the cell's top level
        self.modules: set = set()        # ... of which by import
        self.functions: dict = {}        # top-level def/class name -> the global names its body reads
        self.reads: set = set()          # every global name the cell reads, inside its functions too
        self.top_reads: set = set()      # global names read when the cell runs (not inside def/class bodies)
        self.top_calls: set = set()      # names called when the cell runs (f(...))
        self.stores: set = set()         # names whose attributes or items the cell assigns or deletes when it runs
        self.handles: set = set()        # names whose methods it calls, or that it passes to a call, when it runs
        self.state_calls: set = set()    # names whose global-state setters the cell calls (torch.manual_seed)
        self.always = False              # installs packages or runs shell commands
        self.kills: set = set()          # names every run of the cell binds anew (plain top-level statements)
        self.constants: set = set()      # names it binds to a value nothing can change (a literal, a lambda)
        tree = self._python(source)
        self._scopes(symtable.symtable(ast.unparse(tree), "cell", "exec"))
        self._statements(tree)

    def _scopes(self, top):
        """Names bound and read, from Python's own symbol tables (so a function's locals are not mistaken for
        notebook names)."""
        for symbol in top.get_symbols():
            name = symbol.get_name()
            if symbol.is_imported():
                self.modules.add(name)
            if symbol.is_assigned() or symbol.is_imported():
                self.binds.add(name)
            if symbol.is_referenced():
                self.top_reads.add(name)
        for child in top.get_children():
            reads = _global_reads(child)
            if child.get_type() == "function" and child.get_name() in self.binds:
                self.functions[child.get_name()] = reads    # read when the function is called, not now
            else:                                  # a class body, a lambda, a comprehension: runs (or may) right here
                self.top_reads |= reads
                if child.get_type() == "class":
                    self.functions[child.get_name()] = reads
        self.reads = self.top_reads | set().union(*self.functions.values())
        unsafe = self.reads & _UNSAFE_NAMES
        if unsafe:
            raise _Unsafe(f"it uses {sorted(unsafe)[0]}")

    def _statements(self, tree):
        """What the cell's top level may do to values it does not rebind: store into them, call their methods,
        hand them to a call (which may change them), call global-state setters."""
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.kills.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                self.kills |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and getattr(node, "value", None) is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = {t.id for t in targets if isinstance(t, ast.Name)}
                self.kills |= names
                if _constant(node.value):
                    self.constants |= names
        for node in _top_level_nodes(tree):
            if isinstance(node, ast.ImportFrom) and any(alias.name == "*" for alias in node.names):
                raise _Unsafe("from ... import * binds names the source does not show")
            if isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(node.ctx, (ast.Store, ast.Del)):
                root = _root(node)
                if root:
                    self.stores.add(root)
            if not isinstance(node, ast.Call):
                continue
            if isinstance(node.func, ast.Name):
                self.top_calls.add(node.func.id)
            elif isinstance(node.func, ast.Attribute):
                root = _root(node.func)
                if root and _STATE_SETTERS.match(node.func.attr):
                    self.state_calls.add(root)
                if root:
                    self.handles.add(root)
            pure = isinstance(node.func, ast.Name) and node.func.id in _PURE_BUILTINS
            if not pure:
                self.handles |= {arg.id for arg in [*node.args, *(k.value for k in node.keywords)]
                                 if isinstance(arg, ast.Name)}
                self.handles |= {arg.value.id for arg in node.args
                                 if isinstance(arg, ast.Starred) and isinstance(arg.value, ast.Name)}

    # -- IPython syntax -------------------------------------------------------------------------------

    def _python(self, source: str) -> ast.Module:
        """The cell as a Python tree: IPython's own translation, with its magic calls checked and then replaced
        by None."""
        try:
            code = _transformer().transform_cell(source)
        except Exception as exc:  # noqa: BLE001
            raise _Unsafe(f"IPython cannot translate it ({type(exc).__name__})") from None
        try:
            tree = ast.parse(code)
        except SyntaxError:
            raise _Unsafe("it is not valid Python") from None
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_get_ipython(node.func.value):
                kind = node.func.attr
                name = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else None
                if kind in ("system", "getoutput") or name in _INSTALL_MAGICS:
                    self.always = True
                elif kind in ("run_line_magic", "run_cell_magic") and name in _HARMLESS_MAGICS and kind != "run_cell_magic":
                    continue
                elif kind == "run_cell_magic" and name in ("time", "timeit", "capture"):
                    body = node.args[2].value if len(node.args) > 2 and isinstance(node.args[2], ast.Constant) else None
                    if not isinstance(body, str):
                        raise _Unsafe(f"the cell magic %%{name} hides its code")
                    return self._python(body)
                else:
                    raise _Unsafe(f"the magic {name or kind} may run code")
        return _WithoutMagics().visit(tree)

_TRANSFORMER: list = []


def _transformer():
    """IPython's translation of its syntax into Python, made once."""
    if not _TRANSFORMER:
        from IPython.core.inputtransformer2 import TransformerManager

        _TRANSFORMER.append(TransformerManager())
    return _TRANSFORMER[0]


class _WithoutMagics(ast.NodeTransformer):
    """Replaces get_ipython().something(...) calls, already checked, by None."""

    def visit_Call(self, node):
        if isinstance(node.func, ast.Attribute) and _is_get_ipython(node.func.value):
            return ast.copy_location(ast.Constant(None), node)
        return self.generic_visit(node)


def _is_get_ipython(node) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "get_ipython"


def _global_reads(table) -> set:
    """The global names a function, class, lambda or comprehension (and everything nested in it) reads."""
    reads = set()
    for symbol in table.get_symbols():
        if symbol.is_declared_global():
            raise _Unsafe("a global statement binds names where the source does not show it")
        if symbol.is_global() and symbol.is_referenced():
            reads.add(symbol.get_name())
    for child in table.get_children():
        reads |= _global_reads(child)
    return reads


def _constant(node) -> bool:
    """True for an expression whose value no later code can change: a number, a string, ``...``, a lambda,
    arithmetic and tuples of those (the answers to the course's questions)."""
    if isinstance(node, (ast.Constant, ast.Lambda)):
        return True
    if isinstance(node, ast.Tuple):
        return all(_constant(e) for e in node.elts)
    if isinstance(node, ast.UnaryOp):
        return _constant(node.operand)
    if isinstance(node, ast.BinOp):
        return _constant(node.left) and _constant(node.right)
    return False


def _top_level_nodes(tree):
    """Every node of the cell that runs when the cell runs: not inside def, class or lambda bodies."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            todo.extend(getattr(node, "decorator_list", []))
            continue
        todo.extend(ast.iter_child_nodes(node))


def _root(node) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.value if not isinstance(node, ast.Call) else node.func
    return node.id if isinstance(node, ast.Name) else None


class _Budget:
    """The backward pass's work, counted: it may do at most `limit` steps (names visited), so that planning stays
    linear in the notebook's size whatever its functions do; past that, every cell runs."""

    def __init__(self, limit: int):
        self.left = limit

    def spend(self, steps: int = 1) -> None:
        self.left -= steps
        if self.left < 0:
            raise _Unsafe("its functions read each other too deeply to follow in the time planning may take")


def cells_to_run(sources, answer_names, progress=None) -> tuple[list[int], str]:
    """The positions (in `sources`) of the cells grading must run, in order, and a note on the decision.

    Args:
        sources: the notebook's code cells' sources, in order.
        answer_names: the names the graded answers have in the notebook.
        progress: called with each cell's index before it is analysed (`reading` reports where time went).

    Returns:
        (indices, note): every index and the reason when the analysis cannot follow the notebook.

    Time: linear in the sources' length. Each cell is analysed once; the backward pass touches each cell's own
    names, and follows what functions read (each function's closure computed once) within a budget of steps
    proportional to the notebook's size; a notebook past it runs every cell.

    Example::

        >>> cells_to_run(["import torch", "x = torch.ones(3)\\nplot(x)", "def f(t):\\n    return t + 1"], ["f"])
        ([2], '')
    """
    try:
        return _plan(sources, answer_names, progress), ""
    except _Unsafe as exc:
        return list(range(len(sources))), f"every cell ran: {exc}"


def _analyse(source: str) -> Analysis:
    try:
        return Analysis(source)
    except RecursionError:
        raise _Unsafe("a cell nests its code deeper than the analysis follows") from None


def _plan(sources, answer_names, progress=None) -> list[int]:
    cells = []
    for index, source in enumerate(sources):
        if progress is not None:
            progress(index)
        cells.append(_analyse(source))
    size = sum(len(cell.binds) + len(cell.reads) + len(cell.stores) + len(cell.handles) + len(cell.top_calls)
               for cell in cells)
    budget = _Budget(100_000 + 50 * (size + len(cells)))
    kind: dict = {}
    function_reads: dict = {}
    for cell in cells:
        for name in cell.binds:
            this = ("module" if name in cell.modules else "function" if name in cell.functions else
                    "constant" if name in cell.constants else "data")
            kind[name] = this if kind.get(name, this) == this else "data"
        for name, reads in cell.functions.items():
            function_reads.setdefault(name, set()).update(reads)
    closures: dict = {}

    def closure(function) -> frozenset:
        """`function` and every global its body reads, through the functions among them (computed once)."""
        if function not in closures:
            names, todo = {function}, [function]
            while todo:
                for read in function_reads.get(todo.pop(), ()):
                    budget.spend()
                    if read not in names:
                        names.add(read)
                        todo.append(read)
            closures[function] = frozenset(names)
        return closures[function]

    def expand(names) -> set:
        """`names` and, for every function among them, the globals its body reads (at the time it is called)."""
        out = set()
        for name in names:
            budget.spend()
            out |= closure(name) if name in function_reads else {name}
        budget.spend(len(out))
        return out

    # Backwards through the notebook: `live` holds the names whose values some later kept cell (or, at the
    # end, the grader) reads. A cell matters when it binds a live name or may change a live value.
    live = expand(answer_names)

    def is_data(name) -> bool:
        return name in live and kind.get(name) == "data"

    def changes_data(name) -> bool:
        """Calling `name` may change a live value: it is a function whose body reads one."""
        if name not in function_reads:
            return False
        reached = closure(name)
        budget.spend(len(reached))
        return any(is_data(n) for n in reached)

    keep = []
    for index in range(len(cells) - 1, -1, -1):
        cell = cells[index]
        touched = cell.stores | cell.handles
        budget.spend(len(touched) + len(cell.top_calls) + len(cell.binds) + len(cell.state_calls))
        changes = (any(is_data(n) or changes_data(n) for n in touched)
                   or any(changes_data(n) for n in cell.top_calls)
                   or any(n in live and kind.get(n) == "module" for n in cell.stores | cell.state_calls))
        if cell.always or any(n in live for n in cell.binds) or changes:
            keep.append(index)
            # What this cell binds anew, an earlier cell's value no longer reaches the readers after it; the
            # cell's own reads are needed before it (its own bindings of them included, for a ``x = x + 1``).
            live.difference_update(cell.kills - cell.top_reads)
            live |= expand(cell.top_reads)
    return sorted(keep)
