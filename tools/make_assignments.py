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
* every output and execution count is cleared, and the stored widget state with them;
* everything else, the cell ids and nbgrader's cell metadata included, is kept as it is.

`make_student` is a pure function of the notebook: anything else that rewrites notebooks (a stamp
that adds an install cell or a badge) gives the same result whether it runs before or after it. The
files written are stamped (`tools/stamp_notebooks.py`) with their own path, so their Colab badge opens
the student copy.
"""

from __future__ import annotations

import argparse
import ast
import copy
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
    for index, cell in enumerate(student.cells):
        if cell.cell_type != "code":
            continue
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
            print(f"out of date: {path.relative_to(ROOT)}")
        for path in extra:
            print(f"no source notebook with exercises: {path.relative_to(ROOT)}")
        if stale or extra:
            print("run: python tools/make_assignments.py")
        return 1 if stale or extra else 0
    TARGET.mkdir(exist_ok=True)
    for path in stale:
        path.write_text(wanted[path])
        print(f"wrote {path.relative_to(ROOT)}")
    for path in extra:
        path.unlink()
        print(f"removed {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
