"""Reading a submitted notebook as data: its code cells and the exercises it has. Nothing in it is run here.

The file is read as the JSON it is (nbformat 4, the format Jupyter has saved since 2015), with the standard
library only: grading needs nothing the course's own install (requirements/base.txt) lacks. `read_file` and
`reading.read_notebook` refuse, with a message that says what to do:

* what is not a plain file: a symbolic link (never followed: the grader is often root, and the link could point
  at another student's work or at a file only root may read), a device, a pipe, a socket ('refused');
* what is too large to be a notebook of the course: more than MAX_NOTEBOOK_BYTES, MAX_CELLS cells or
  MAX_CODE_CHARS characters of code ('too large', answered before any cell is looked at);
* what is not a Python notebook: a file that is not JSON (or JSON nested deeper than a notebook), JSON that is
  not a notebook, a notebook for another language ('unreadable', 'unrunnable');
* what the reading itself cannot finish within its limits of time and memory ('too large': `reading`).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import stat

__all__ = ["parse_notebook", "read_file", "exercises_in", "exercises_of_number", "NotebookError", "CHECK_CALL",
           "code_cells", "MAX_NOTEBOOK_BYTES", "MAX_CELLS", "MAX_CODE_CHARS", "safe_name", "visible"]

CHECK_CALL = re.compile(r"""exercises\s*\.\s*check\s*\(\s*["']([A-Za-z0-9_]+)["']""")
# The course's largest notebook has 0.8 MB, 71 cells and 42,251 characters of code (11_beat_the_ring, with its
# outputs); a student's copy may hold far more, but not this much.
MAX_NOTEBOOK_BYTES = 32 * 2**20
MAX_CELLS = 2_000
MAX_CODE_CHARS = 1_000_000


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


def visible(text, lines: bool = True) -> str:
    """Text a submission produced (an error it raised, a name) as it may be shown on a terminal, in a CSV or in a
    results file: every control character (a terminal's escape sequences, a carriage return, the bidirectional
    overrides) written as its escape, so it can neither erase nor forge what is printed around it. `lines`:
    keep line breaks and tabs (False: escape them too, for one row of a table)."""
    text = str(text)
    keep = "\n\t" if lines else ""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in keep else repr(c)[1:-1] for c in text)


def safe_name(name) -> str:
    """A file or student name as it may be shown: control characters (a terminal's escape sequences among them)
    written as escapes, at most 200 characters."""
    shown = visible(name, lines=False)
    return shown if len(shown) <= 200 else shown[:197] + "..."


def read_file(path) -> bytes:
    """The bytes of the submitted file at `path`, read without following a link and only if it is a plain file
    of at most MAX_NOTEBOOK_BYTES (checked on the open file, so nothing can be swapped in between).

    Raises:
        NotebookError: 'refused' (a link, a device, a pipe, a folder), 'too large', 'unreadable' (cannot be read).
    """
    path = pathlib.Path(path)
    name = safe_name(path.name)
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise NotebookError("unreadable", f"cannot read {name}: {exc.strerror}") from None
    if stat.S_ISLNK(info.st_mode):
        raise NotebookError("refused", f"{name} is a symbolic link: the grader does not follow links (it could point "
                                       "at someone else's work); submit the notebook file itself")
    if not stat.S_ISREG(info.st_mode):
        raise NotebookError("refused", f"{name} is not a plain file (a device, a pipe, a socket or a folder): submit "
                                       "the notebook file itself")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError as exc:
        kind = "refused" if exc.errno == 40 else "unreadable"         # ELOOP: it became a link meanwhile
        raise NotebookError(kind, f"cannot read {name}: {exc.strerror}") from None
    try:
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode):
            raise NotebookError("refused", f"{name} is not a plain file: submit the notebook file itself")
        if opened.st_size > MAX_NOTEBOOK_BYTES:
            raise NotebookError("too large", f"{name} is {opened.st_size:,} bytes, more than the "
                                             f"{MAX_NOTEBOOK_BYTES // 2**20} MiB the grader reads (the course's "
                                             "largest notebook has under 1 MB): clear its outputs and submit it again")
        chunks, total = [], 0
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
            total += len(chunk)
            if total > MAX_NOTEBOOK_BYTES:
                raise NotebookError("too large", f"{name} is more than {MAX_NOTEBOOK_BYTES // 2**20} MiB")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _nbgrader_id(metadata: dict) -> dict:
    nbgrader = metadata.get("nbgrader")
    grade_id = nbgrader.get("grade_id") if isinstance(nbgrader, dict) else None
    return {"nbgrader": {"grade_id": grade_id[:200]}} if isinstance(grade_id, str) else {}


def parse_notebook(data: bytes, filename: str) -> dict:
    """`reading.read_notebook`'s answer, worked out here: run it only where a RecursionError or a large allocation costs
    nothing but this notebook (`reading`'s child process)."""
    name = safe_name(pathlib.Path(filename).name)
    try:
        raw = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise NotebookError("unreadable", f"{name} is not a Jupyter notebook (not JSON: {exc}). Submit the "
                                          ".ipynb file that Jupyter saves, not an export.") from None
    except RecursionError:
        raise NotebookError("unreadable", f"{name} is JSON nested deeper than any notebook (Jupyter's nest a few "
                                          "levels): submit the .ipynb file that Jupyter saves") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("cells"), list):
        if isinstance(raw, dict) and "worksheets" in raw:
            raise NotebookError("unreadable", f"{name} is an old (nbformat 3) notebook: open it in Jupyter and "
                                              "save it, which writes the current format")
        raise NotebookError("unreadable", f"{name} is JSON but not a Jupyter notebook (no list of cells)")
    metadata = raw.get("metadata") if isinstance(raw.get("metadata"), dict) else {}
    kernelspec = metadata.get("kernelspec") if isinstance(metadata.get("kernelspec"), dict) else {}
    language_info = metadata.get("language_info") if isinstance(metadata.get("language_info"), dict) else {}
    language = kernelspec.get("language") or language_info.get("name") or "python"
    if str(language).lower() != "python":
        raise NotebookError("unrunnable", f"{name} is a {safe_name(language)[:40]} notebook; the course's notebooks "
                                          "are Python")
    if len(raw["cells"]) > MAX_CELLS:
        raise NotebookError("too large", f"{name} has {len(raw['cells']):,} cells, more than the {MAX_CELLS:,} the "
                                         "grader reads (the course's notebooks have under 100): submit the "
                                         "notebook with the cells of the exercises, not a generated one")
    cells, code = [], 0
    for index, cell in enumerate(raw["cells"]):
        source = _text(cell.get("source")) if isinstance(cell, dict) else None
        if source is None:
            raise NotebookError("unreadable", f"{name} is a damaged notebook: cell {index} has no source text")
        cell_metadata = cell.get("metadata") if isinstance(cell.get("metadata"), dict) else {}
        kind = cell.get("cell_type") if isinstance(cell.get("cell_type"), str) else None
        cells.append({"cell_type": kind, "source": source if kind == "code" else "",
                      "metadata": _nbgrader_id(cell_metadata)})
        if kind == "code":
            code += len(source)
    if code > MAX_CODE_CHARS:
        raise NotebookError("too large", f"{name} has {code:,} characters of code, more than the {MAX_CODE_CHARS:,} "
                                         "the grader reads (the course's notebooks have under 50,000)")
    return {"cells": cells, "metadata": {}}


def code_cells(notebook) -> list[tuple[int, str]]:
    """(position in the notebook, source) of every code cell (of `reading.read_notebook`'s dict or an nbformat node)."""
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

        >>> exercises_in(reading.read_notebook("assignments/05_ring_all_gather.ipynb"), "05_ring_all_gather.ipynb")
        ['ring_all_gather', 'ring']
    """
    from course_lib.exercises import registry

    names = []
    for _, source in code_cells(notebook):
        names += [n for n in CHECK_CALL.findall(source) if n not in names]
    names += [n for n in exercises_of_number(filename) if n not in names]
    known = {e.name for e in registry.all_exercises()}
    return [n for n in names if n in known]
