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
    drop_finished_live_lines(notebook)
    nbformat.write(notebook, path)
    return elapsed


def drop_finished_live_lines(notebook) -> None:
    """Remove what course_lib.live's progress lines leave behind, which depends on how long cells took.

    A live line ends as a view of no widget (model_id ''), shown as nothing; its widget's state
    stays in the notebook's metadata. Drop both: the outputs of views of nothing, and the state of
    every widget that no remaining output shows (keeping models that refer to a shown one, like links).
    """
    view = "application/vnd.jupyter.widget-view+json"
    shown = set()
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs = [o for o in cell.outputs if o.get("data", {}).get(view, {}).get("model_id", None) != ""]
            shown |= {o["data"][view]["model_id"] for o in cell.outputs if view in o.get("data", {})}
    states = notebook.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state")
    if not states:
        return
    refs = {m: {r for r in states if f"IPY_MODEL_{r}" in repr(state)} for m, state in states.items()}
    keep, changed = set(shown), True
    while changed:  # what a kept model refers to, and what refers to a kept model
        grown = keep | {r for m in keep if m in refs for r in refs[m]} | {m for m, rs in refs.items() if rs & keep}
        changed, keep = grown != keep, grown
    for model_id in set(states) - keep:
        del states[model_id]
    if not states:
        del notebook.metadata["widgets"]


def main(argv: list[str]) -> int:
    paths = [pathlib.Path(a) for a in argv] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    for path in paths:
        print(f"{path.name}: {execute(path):.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
