"""Execute notebooks in place from a fresh kernel, so their stored outputs come from a clean run.

    python tools/execute_notebooks.py                 # every notebook in notebooks/
    python tools/execute_notebooks.py notebooks/04_ring_scatter_reduce.ipynb

Run this after changing a notebook or anything in course_lib that it prints or draws; nbval then
checks that a later run reproduces what is stored. Cells are executed in order with a 300 s limit.
"""

from __future__ import annotations

import pathlib
import sys
import time

import nbformat
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parent.parent


def execute(path: pathlib.Path) -> float:
    notebook = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    NotebookClient(notebook, timeout=300, kernel_name="python3", record_timing=False,  # no timestamps in diffs
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    elapsed = time.perf_counter() - start
    nbformat.write(notebook, path)
    return elapsed


def main(argv: list[str]) -> int:
    paths = [pathlib.Path(a) for a in argv] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    for path in paths:
        print(f"{path.name}: {execute(path):.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
