"""Which notebook cells run longer than a threshold (default 2 s): where live progress matters.

    python tools/cell_timings.py                        # every notebook, cells over 2 s
    python tools/cell_timings.py notebooks/07_*.ipynb --over 1

Executes a copy of each notebook with nbclient (the stored notebook is not touched) and prints, per
notebook, its slow cells: index, seconds, and the cell's first line. Times depend on the machine and
on what else runs on it: read them as "seconds, not milliseconds", not as benchmarks.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import sys

import nbformat
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parent.parent


def cell_seconds(path: pathlib.Path) -> list[tuple[int, float, str]]:
    """(cell index, seconds, first line) for every code cell of the notebook, from a fresh kernel."""
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3", record_timing=True,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    rows = []
    for index, cell in enumerate(notebook.cells):
        timing = cell.metadata.get("execution", {})
        if cell.cell_type == "code" and "shell.execute_reply" in timing:
            start = datetime.datetime.fromisoformat(timing["iopub.execute_input"].replace("Z", "+00:00"))
            end = datetime.datetime.fromisoformat(timing["shell.execute_reply"].replace("Z", "+00:00"))
            first = next((line for line in cell.source.splitlines() if line.strip()), "")
            rows.append((index, (end - start).total_seconds(), first))
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=pathlib.Path)
    parser.add_argument("--over", type=float, default=2.0, help="seconds (default 2)")
    args = parser.parse_args(argv)
    for path in args.notebooks or sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        rows = cell_seconds(path)
        slow = [row for row in rows if row[1] > args.over]
        print(f"{path.name}: {sum(s for _, s, _ in rows):.1f} s in all, {len(slow)} cell(s) over {args.over:g} s",
              flush=True)
        for index, seconds, first in slow:
            print(f"  cell {index:>2}  {seconds:6.1f} s  {first[:90]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
