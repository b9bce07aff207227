"""Reading a submission in a child process the judge bounds: what a notebook holds can cost only that notebook.

Parsing a notebook's JSON and planning its cells (IPython's translation of ``!cmd`` and ``%magic`` lines, the
Python parser, the symbol tables) run on data the submission chose. In the judge itself a JSON array nested
100,000 deep or an expression of 100,000 terms raises RecursionError, a cell of 499 ``x = !true`` lines costs
minutes of IPython's rewriting (it translates one such line per pass over the cell), and a large file of
empty objects costs gigabytes. So the judge never does that work itself: a child process does, with

* a wall-clock limit (`SECONDS` per request; it is killed past it),
* an address-space limit (`MEMORY`) and a CPU-time limit of its own (`resource.setrlimit`),
* nothing of the judge's: it runs ``python -I`` on this file (no environment, no working folder on its path),
  imports only the standard library, IPython's translator and the two modules that read (notebook.py,
  cells.py, loaded from their files), and gets the submission's bytes on its standard input;

and answers with plain JSON of bounded size: the code cells' sources (at most `notebook.MAX_CODE_CHARS`) and
the cells' nbgrader ids. A child that fails, runs out of time or memory, or dies, makes that one notebook
refused with the reason ('too large'): every other submission is graded as usual.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import signal
import subprocess
import sys
import threading

__all__ = ["read", "plan", "SECONDS", "MEMORY"]

SECONDS = 20.0               # one request; the course's largest notebook takes under a second
MEMORY = 1 << 30             # the child's address space (a 32 MiB notebook of outputs needs about 300 MB)
_CACHE_SIZE = 32             # notebooks read recently (a class's notebook is read when planned and when graded)

_HERE = pathlib.Path(__file__).resolve().parent
_cache: dict = {}
_cache_lock = threading.Lock()


class _Failed(Exception):
    """The child gave no answer: timed out, ran out of memory, or died. `cell`: the code cell it was reading."""

    def __init__(self, why: str, cell: int | None):
        super().__init__(why)
        self.cell = cell


def _ask(request: dict, data: bytes = b"") -> dict:
    """The child's answer to `request` (and `data` on its standard input after the request's line)."""
    child = subprocess.Popen([sys.executable, "-I", str(_HERE / "reading.py")], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd="/", start_new_session=True)
    try:
        out, _ = child.communicate(json.dumps(request).encode() + b"\n" + data, timeout=SECONDS)
        why = None
    except subprocess.TimeoutExpired:
        child.kill()
        out, _ = child.communicate()
        why = f"more than {SECONDS:g} s"
    lines = out.decode("utf-8", "replace").splitlines()
    if why is None and lines and lines[-1].startswith("result "):
        return json.loads(lines[-1][len("result "):])
    cells = [int(line.split()[1]) for line in lines if line.startswith("cell ") and line.split()[1].isdigit()]
    if why is None:
        why = (f"more than {MEMORY >> 20} MiB of memory" if "out of memory" in lines else
               f"more than {SECONDS:g} s of CPU time" if child.returncode == -signal.SIGXCPU else
               f"the reader ended with status {child.returncode}")
    raise _Failed(why, cells[-1] if cells else None)


def read(data: bytes, name: str) -> dict:
    """The notebook in `data` as {'cells': [{'cell_type', 'source', 'metadata'}], 'metadata': {}}: code cells with
    their source, the others with '' (grading reads no markdown); each cell's metadata only its nbgrader
    grade_id. Raises `notebook.NotebookError` as `read_notebook` documents, and 'too large' when the
    child could not read it within its limits."""
    from course_grader.notebook import NotebookError, safe_name

    key = hashlib.sha256(data).hexdigest() + name
    with _cache_lock:
        if key in _cache:
            return _cache[key]
    try:
        answer = _ask({"op": "read", "name": name}, data)
    except _Failed as exc:
        raise NotebookError("too large", f"{safe_name(name)} could not be read within the grader's limits ({exc}): "
                                         "submit the notebook Jupyter saved, with its outputs cleared") from None
    if "error" in answer:
        raise NotebookError(*answer["error"])
    with _cache_lock:
        _cache[key] = answer["notebook"]
        while len(_cache) > _CACHE_SIZE:
            _cache.pop(next(iter(_cache)))
    return answer["notebook"]


def read_notebook(path, data: bytes | None = None) -> dict:
    """The notebook at `path` as {'cells': [{'cell_type', 'source', 'metadata'}, ...], 'metadata': {}}: each code
    cell's source as a string (other cells' as ''), each cell's metadata only its nbgrader grade_id; or
    NotebookError saying why it cannot be graded (see `course_grader.notebook`). `data`: its bytes, when already
    read with `read_file`. The parsing runs in a child process with limits on time and memory
    (`read`): nothing in the file can cost the judge more than that."""
    from course_grader.notebook import read_file

    path = pathlib.Path(path)
    if data is None:
        data = read_file(path)
    return read(data, path.name)


def plan(sources, answer_names, positions=None) -> tuple[list, str]:
    """`cells.cells_to_run(sources, answer_names)`, worked out in the child.

    Args:
        positions: each source's cell number in the notebook, for the message.

    Raises:
        NotebookError: 'too large', naming the cell the child was reading when it ran out of time or memory.
    """
    from course_grader.notebook import NotebookError

    try:
        answer = _ask({"op": "plan", "sources": list(sources), "names": list(answer_names)})
    except _Failed as exc:
        where = "its cells"
        if exc.cell is not None:
            where = f"cell {positions[exc.cell] if positions else exc.cell}"
        raise NotebookError("too large", f"the grader could not read {where} within its limits ({exc}): a cell "
                                         "of many shell (!) or magic (%) lines, or an expression nested thousands "
                                         "deep, costs that much; write it as plain Python") from None
    return answer["plan"], answer["note"]


# --------------------------------------------------------------------------------------------------
# The child
# --------------------------------------------------------------------------------------------------


def _load(name: str):
    """One of this package's reading modules, from its file (the package itself would import the judge)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_course_lib_reading_{name}", _HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _child() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    cpu = int(SECONDS) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    try:
        answer = _answer(json.loads(sys.stdin.buffer.readline()))
    except MemoryError:
        answer = None
    if answer is None:
        print("out of memory", flush=True)
        sys.exit(3)
    print("result " + json.dumps(answer), flush=True)


def _answer(request: dict) -> dict:
    notebook, cells = _load("notebook"), _load("cells")
    if request["op"] == "read":
        try:
            answer = {"notebook": notebook.parse_notebook(sys.stdin.buffer.read(), request["name"])}
        except notebook.NotebookError as exc:
            answer = {"error": [exc.kind, str(exc)]}
        except RecursionError:
            answer = {"error": ["unreadable", f"{notebook.safe_name(request['name'])} holds values nested deeper "
                                              "than any notebook: submit the .ipynb file that Jupyter saves"]}
    else:
        def progress(index):
            print(f"cell {index}", flush=True)

        indices, note = cells.cells_to_run(request["sources"], request["names"], progress=progress)
        answer = {"plan": indices, "note": note}
    return answer


if __name__ == "__main__":
    _child()
