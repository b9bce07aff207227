"""Reading a submitted notebook as data: its code cells and the exercises it has. Nothing in it is run here.

The file is read as the JSON it is (nbformat 4, the format Jupyter has saved since 2015), with the standard
library only: grading needs nothing the course's own install (requirements/base.txt) lacks. `read_notebook`
refuses, with a message that says what to do, what is not a Python notebook: a file that is not JSON, JSON
that is not a notebook, a notebook for another language.
"""

from __future__ import annotations

import json
import pathlib
import re

__all__ = ["read_notebook", "exercises_in", "exercises_of_number", "NotebookError", "CHECK_CALL", "code_cells"]

CHECK_CALL = re.compile(r"""exercises\s*\.\s*check\s*\(\s*["']([A-Za-z0-9_]+)["']""")
MAX_NOTEBOOK_BYTES = 64 * 2**20


class NotebookError(ValueError):
    """A file that cannot be graded as a notebook: `kind` is 'unreadable' (not a notebook at all) or 'unrunnable'
    (a notebook the grader cannot run)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _text(value) -> str | None:
    """A cell's source as one string (the file may store it as a list of lines)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(line, str) for line in value):
        return "".join(value)
    return None


def read_notebook(path) -> dict:
    """The notebook at `path` as {'cells': [{'cell_type', 'source'}, ...], 'metadata': {...}} (sources as
    strings), or NotebookError saying why it cannot be graded."""
    path = pathlib.Path(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise NotebookError("unreadable", f"cannot read {path.name}: {exc.strerror}") from None
    if size > MAX_NOTEBOOK_BYTES:
        raise NotebookError("unreadable", f"{path.name} is {size:,} bytes, more than any notebook of the course")
    try:
        raw = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise NotebookError("unreadable", f"{path.name} is not a Jupyter notebook (not JSON: {exc}). Submit the "
                                          ".ipynb file that Jupyter saves, not an export.") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("cells"), list):
        if isinstance(raw, dict) and "worksheets" in raw:
            raise NotebookError("unreadable", f"{path.name} is an old (nbformat 3) notebook: open it in Jupyter and "
                                              "save it, which writes the current format")
        raise NotebookError("unreadable", f"{path.name} is JSON but not a Jupyter notebook (no list of cells)")
    metadata = raw.get("metadata") if isinstance(raw.get("metadata"), dict) else {}
    kernelspec = metadata.get("kernelspec") if isinstance(metadata.get("kernelspec"), dict) else {}
    language_info = metadata.get("language_info") if isinstance(metadata.get("language_info"), dict) else {}
    language = kernelspec.get("language") or language_info.get("name") or "python"
    if str(language).lower() != "python":
        raise NotebookError("unrunnable", f"{path.name} is a {language} notebook; the course's notebooks are Python")
    cells = []
    for index, cell in enumerate(raw["cells"]):
        source = _text(cell.get("source")) if isinstance(cell, dict) else None
        if source is None:
            raise NotebookError("unreadable", f"{path.name} is a damaged notebook: cell {index} has no source text")
        cells.append({"cell_type": cell.get("cell_type"), "source": source})
    return {"cells": cells, "metadata": metadata}


def code_cells(notebook) -> list[tuple[int, str]]:
    """(position in the notebook, source) of every code cell (of `read_notebook`'s dict or an nbformat node)."""
    return [(index, _text(cell["source"])) for index, cell in enumerate(notebook["cells"])
            if cell.get("cell_type") == "code"]


def exercises_of_number(filename: str) -> list[str]:
    """The exercises of the notebook whose file name starts with its number ('04_mine.ipynb' -> ['ring_scatter_reduce'])."""
    from course_lib.exercises import registry

    number = re.match(r"(\d\d)_", pathlib.Path(filename).name)
    if not number:
        return []
    return [e.name for e in registry.all_exercises() if e.notebook.startswith(number.group(1))]


def exercises_in(notebook, filename: str = "") -> list[str]:
    """The exercises a notebook has: those its cells check, then those of its number (04_... -> '04').

    Example::

        >>> exercises_in(read_notebook("assignments/05_ring_all_gather.ipynb"), "05_ring_all_gather.ipynb")
        ['ring_all_gather', 'ring']
    """
    from course_lib.exercises import registry

    names = []
    for _, source in code_cells(notebook):
        names += [n for n in CHECK_CALL.findall(source) if n not in names]
    names += [n for n in exercises_of_number(filename) if n not in names]
    known = {e.name for e in registry.all_exercises()}
    return [n for n in names if n in known]
