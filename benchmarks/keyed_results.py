"""One results file per benchmark, a run per key: the shared writer of the benchmarks that keep several runs.

A run goes under its key in OUT.json's "runs" (replacing an earlier run with the same key, keeping the others), the
runs are ordered by world size and then key, and OUT.md is rewritten from all of them by the benchmark's own
`markdown(runs)`.
"""

from __future__ import annotations

import json
import pathlib


def write_run(out, key: str, result: dict, markdown) -> tuple[pathlib.Path, pathlib.Path]:
    """Put `result` under `key` in OUT.json and rewrite OUT.md; returns both paths."""
    json_path, md_path = pathlib.Path(f"{out}.json"), pathlib.Path(f"{out}.md")
    runs = json.loads(json_path.read_text())["runs"] if json_path.exists() else {}
    runs[key] = result
    runs = {k: runs[k] for k in sorted(runs, key=lambda k: (runs[k]["options"]["world_size"], k))}
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    md_path.write_text(markdown(runs))
    return json_path, md_path
