"""Write the student versions of the notebooks that have exercises: assignments/NN_name.ipynb.

    python tools/make_assignments.py            # regenerate assignments/ from notebooks/
    python tools/make_assignments.py --check    # exit 1 if assignments/ is out of date

notebooks/ stays the source, solutions included, marked the way nbgrader marks them, so an instructor
who uses nbgrader can use the notebooks as they are. This script makes the same student version
without nbgrader:

* a region between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` becomes
  ``raise NotImplementedError("your code here")``, indented like the markers (inside a function, the
  function still defines, and a check of it says "not done yet"). At the top level of a cell, where a
  raise would stop the notebook, each name the region assigns becomes ``name = ...  # your answer here``
  (`exercises.check` reads ``...`` as "not done yet");
* a region between ``### BEGIN HIDDEN TESTS`` and ``### END HIDDEN TESTS`` is removed (the grader runs
  the hidden cases itself);
* a cell that shows course_lib's own implementation of an exercise the notebook asks for (its source:
  ``inspect.getsource``, ``??``, ``%psource``, reading the module's file) is replaced by a comment saying that
  the reference is in the instructor's copy. The cell is found by what it does, not by a mark: it reads source
  and names something in a module the notebook's exercises forbid (``course_lib.allreduce`` for the ring,
  ``course_lib.training`` for average_gradients; `exercises.list()` shows them). Notebooks without such
  exercises (lecture-only ones, or 06 with only questions) keep their reference cells;
* every output and execution count is cleared, and the stored widget state with them;
* everything else, the cell ids and nbgrader's cell metadata included, is kept as it is.

``--check`` also fails when a file in assignments/ shows such a reference, or holds a run of lines of its
source (pasted in), whatever made the file.

`make_student` is a pure function of the notebook: anything else that rewrites notebooks (a stamp
that adds an install cell or a badge) gives the same result whether it runs before or after it. The
files written are stamped (`tools/stamp_notebooks.py`) with their own path, so their Colab badge opens
the student copy.
"""

from __future__ import annotations

import argparse
import ast
import copy
import importlib
import inspect
import pathlib
import re
import sys

import nbformat

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import stamp_notebooks  # noqa: E402  (tools/ is a folder of scripts, not a package)

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE, TARGET = ROOT / "notebooks", ROOT / "assignments"

BEGIN_SOLUTION = re.compile(r"^(\s*)#+\s*BEGIN SOLUTION\s*$")
END_SOLUTION = re.compile(r"^\s*#+\s*END SOLUTION\s*$")
BEGIN_HIDDEN = re.compile(r"^\s*#+\s*BEGIN HIDDEN TESTS\s*$")
END_HIDDEN = re.compile(r"^\s*#+\s*END HIDDEN TESTS\s*$")
STUB = 'raise NotImplementedError("your code here")'


class MarkerError(ValueError):
    """Markers that do not pair up."""


def _regions(lines, begin, end, where):
    """Yield (start, stop) line indices of each begin..end region (markers included)."""
    start = None
    for index, line in enumerate(lines):
        if begin.match(line):
            if start is not None:
                raise MarkerError(f"{where}: a BEGIN marker inside another region (line {index + 1})")
            start = index
        elif end.match(line):
            if start is None:
                raise MarkerError(f"{where}: an END marker without a BEGIN (line {index + 1})")
            yield start, index
            start = None
    if start is not None:
        raise MarkerError(f"{where}: a BEGIN marker without an END (line {start + 1})")


def _top_level_stub(region_lines, where) -> list[str]:
    """`name = ...  # your answer here` for each name a top-level solution region assigns."""
    try:
        tree = ast.parse("\n".join(region_lines))
    except SyntaxError as exc:
        raise MarkerError(f"{where}: a top-level solution region must be valid Python: {exc}") from None
    names = []
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for target in targets:
            if isinstance(target, ast.Name) and target.id not in names:
                names.append(target.id)
    if not names or len(names) != len(tree.body):
        raise MarkerError(f"{where}: a solution region at the top level of a cell may only assign answers "
                          "(name = value); put code inside a function instead")
    return [f"{name} = ...  # your answer here" for name in names]


def clear_solutions(source: str, where: str = "cell") -> str:
    """The student version of one code cell's source."""
    lines = source.split("\n")
    hidden = list(_regions(lines, BEGIN_HIDDEN, END_HIDDEN, where))
    for start, stop in reversed(hidden):
        del lines[start:stop + 1]
    for start, stop in reversed(list(_regions(lines, BEGIN_SOLUTION, END_SOLUTION, where))):
        indent = BEGIN_SOLUTION.match(lines[start]).group(1)
        if indent:
            stub = [indent + STUB]
        else:
            stub = _top_level_stub(lines[start + 1:stop], where)
        lines[start:stop + 1] = stub
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Cells that show the reference
# --------------------------------------------------------------------------------------------------

# What reads source: inspect's functions, IPython's ?? / %psource / %pfile / %pycat / %load, a module's file.
_SOURCE_READERS = re.compile(r"\bgetsource(lines|file)?\b|\?\?|%(psource|pfile|pycat|load)\b|__file__|\blinecache\b")
REFERENCE_NOTE = ("# In the instructor's copy this cell shows course_lib's own implementation of the exercise above:\n"
                  "# the answer, so it is left out of the student copy. Compare with it after you have written yours:\n"
                  "# it is in notebooks/{name} (or in the installed course_lib).")


def forbidden_modules(notebook, name: str = "") -> set:
    """'course_lib.allreduce', ... : the course_lib modules whose implementation the notebook's exercises ask for."""
    from course_lib.exercises import registry
    from course_grader.notebook import exercises_in

    modules = set()
    for exercise in map(registry.get, exercises_in(notebook, name)):
        modules |= {f"course_lib.{module}" for module in getattr(exercise, "forbidden", ())}
    return modules


def _aliases(notebook) -> dict:
    """{name: dotted path} for every name the notebook's imports bind to course_lib (or a part of it)."""
    aliases = {}
    for cell in notebook.cells:
        if cell.cell_type != "code":
            continue
        for line in cell.source.split("\n"):
            line = line.strip()
            if not line.startswith(("import ", "from ")):
                continue
            try:
                tree = ast.parse(line)
            except SyntaxError:
                continue
            for node in tree.body:
                if isinstance(node, ast.Import):
                    for alias in node.names:
                        if alias.asname:
                            aliases[alias.asname] = alias.name
                        else:
                            aliases[alias.name.split(".")[0]] = alias.name.split(".")[0]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    for alias in node.names:
                        aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return aliases


def _dotted(node) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def _referenced(source: str, aliases: dict) -> set:
    """Dotted course_lib paths the cell names (through the notebook's imports), and file names in its strings."""
    code = "\n".join(re.sub(r"^\s*[%!].*$", "pass", line) for line in source.split("\n"))
    code = re.sub(r"([\w.]+)\?\?", r"\1", code)
    try:
        tree = ast.parse(code)
    except SyntaxError:
        tree = ast.parse("pass")
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Attribute, ast.Name)):
            dotted = _dotted(node)
            if dotted:
                root, _, rest = dotted.partition(".")
                full = aliases.get(root, root) + (f".{rest}" if rest else "")
                found.add(full)
    for word in re.findall(r"[\w./]+", source):          # magics and strings: %psource course_lib.allreduce.ring
        if "course_lib" in word:
            found.add(word.replace("/", ".").removesuffix(".py"))
    return found


def shows_reference(source: str, modules: set, aliases: dict | None = None) -> bool:
    """True when the cell reads source and names something in one of `modules` (dotted course_lib paths)."""
    if not modules or not _SOURCE_READERS.search(source):
        return False
    named = _referenced(source, aliases or {})
    return any(path == module or path.startswith(module + ".") for path in named for module in modules)


def _significant(lines) -> list[str]:
    """The lines of code worth comparing: stripped, no blanks, comments or docstring quotes."""
    return [line.strip() for line in lines if len(line.strip()) >= 12 and not line.strip().startswith(("#", '"""'))]


def reference_sources(modules) -> dict:
    """{'course_lib.allreduce.ring': its significant lines} for every function defined in `modules`."""
    sources = {}
    for module_name in sorted(modules):
        module = importlib.import_module(module_name)
        for name, function in inspect.getmembers(module, inspect.isfunction):
            if function.__module__ == module_name:
                sources[f"{module_name}.{name}"] = _significant(inspect.getsource(function).split("\n"))
    return sources


def pasted_reference(source: str, references: dict, run: int = 4) -> str | None:
    """The function with the most runs of `run` consecutive significant lines of its source in `source` (pasted
    in), or None when no function has one."""
    lines = _significant(source.split("\n"))
    windows = {tuple(lines[i:i + run]) for i in range(len(lines) - run + 1)}
    matches = {name: sum(tuple(reference[i:i + run]) in windows for i in range(len(reference) - run + 1))
               for name, reference in references.items()}
    best = max(matches, key=matches.get, default=None)
    return best if best is not None and matches[best] > 0 else None


def reference_problems(notebook, name: str) -> list[str]:
    """Every cell of a student copy that shows course_lib's implementation of one of its exercises."""
    modules = forbidden_modules(notebook, name)
    if not modules:
        return []
    aliases, references, problems = _aliases(notebook), reference_sources(modules), []
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "code":
            continue
        if shows_reference(cell.source, modules, aliases):
            problems.append(f"cell {index} shows the source of {', '.join(sorted(modules))}")
        pasted = pasted_reference(cell.source, references)
        if pasted:
            problems.append(f"cell {index} holds lines of {pasted}'s source")
    return problems


def has_exercises(notebook) -> bool:
    """True when some cell holds a solution region or is an nbgrader solution cell."""
    for cell in notebook.cells:
        if cell.get("metadata", {}).get("nbgrader", {}).get("solution"):
            return True
        if cell.cell_type == "code" and any(BEGIN_SOLUTION.match(line) for line in cell.source.split("\n")):
            return True
    return False


def make_student(notebook, name: str = "notebook"):
    """The student version of `notebook` (a new notebook; the argument is not changed)."""
    student = copy.deepcopy(notebook)
    student.metadata.pop("widgets", None)      # the saved state of widget outputs, cleared with them
    modules, aliases = forbidden_modules(notebook, name), _aliases(notebook)
    for index, cell in enumerate(student.cells):
        if cell.cell_type != "code":
            continue
        if shows_reference(cell.source, modules, aliases):
            cell.source = REFERENCE_NOTE.format(name=name)
        cell.source = clear_solutions(cell.source, f"{name}, cell {index}")
        cell.outputs = []
        cell.execution_count = None
    return student


def student_text(path: pathlib.Path) -> str:
    """The student version of the notebook at `path`, as the file's text."""
    notebook = nbformat.read(path, as_version=4)
    text = nbformat.writes(make_student(notebook, path.name))
    return text if text.endswith("\n") else text + "\n"     # as nbformat.write ends a file


def assignment_text(path: pathlib.Path) -> str:
    """What assignments/<name> must hold: the student version, stamped with its own path.

    The student copy gets its own Colab badge (it opens assignments/..., not notebooks/...) and the
    same install cell, so the file written is exactly what `stamp_notebooks.py --check` expects.
    """
    project = stamp_notebooks.read_project(ROOT)
    return stamp_notebooks.stamp_notebook(student_text(path), project, f"{TARGET.name}/{path.name}")


def _shown(path: pathlib.Path) -> str:
    """`path` relative to the repository when it is in it."""
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def sources() -> list[pathlib.Path]:
    return [p for p in sorted(SOURCE.glob("[0-9][0-9]_*.ipynb")) if has_exercises(nbformat.read(p, as_version=4))]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report whether assignments/ is up to date")
    args = parser.parse_args(argv)
    wanted = {TARGET / p.name: assignment_text(p) for p in sources()}
    stale = [path for path, text in wanted.items() if not path.exists() or path.read_text() != text]
    extra = [p for p in sorted(TARGET.glob("*.ipynb")) if p not in wanted] if TARGET.exists() else []
    if args.check:
        for path in stale:
            print(f"out of date: {_shown(path)}")
        for path in extra:
            print(f"no source notebook with exercises: {_shown(path)}")
        shown = []
        for path in sorted(TARGET.glob("*.ipynb")) if TARGET.exists() else []:
            for problem in reference_problems(nbformat.read(path, as_version=4), path.name):
                shown.append(f"{_shown(path)}: {problem}")
        for problem in shown:
            print(f"shows the reference: {problem}")
        if stale or extra:
            print("run: python tools/make_assignments.py")
        return 1 if stale or extra or shown else 0
    TARGET.mkdir(exist_ok=True)
    for path in stale:
        path.write_text(wanted[path])
        print(f"wrote {_shown(path)}")
    for path in extra:
        path.unlink()
        print(f"removed {_shown(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
