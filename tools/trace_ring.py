"""What one `allreduce.ring` runs through inside a rank: the lines of course_lib that execute, per file.

    python tools/trace_ring.py              # 4 ranks, 1,000 elements, plain gloo (no modeled network)

Each rank traces itself (`sys.settrace`) for one call of `allreduce.ring` and collects the distinct
(file, line) pairs of course_lib's own code that ran; the table gives, per file, the most any rank ran.
torch's code is not counted: it is the layer the ring is written on, not part of the course's library.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import course_lib
from course_lib import allreduce

PACKAGE = os.path.dirname(os.path.abspath(course_lib.__file__)) + os.sep


def _traced_ring(rank, world_size, numel):
    ran = set()

    def tracer(frame, event, arg):
        name = frame.f_code.co_filename
        if not name.startswith(PACKAGE):
            return None                       # nothing below a frame outside course_lib is counted
        if event in ("call", "line"):
            ran.add((os.path.relpath(name, PACKAGE), frame.f_lineno))
        return tracer

    tensor = torch.arange(numel, dtype=torch.float32) * (rank + 1)
    sys.settrace(tracer)
    try:
        allreduce.ring(tensor)
    finally:
        sys.settrace(None)
    per_file = {}
    for name, _line in ran:
        per_file[name] = per_file.get(name, 0) + 1
    return per_file


def trace(world_size: int = 4, numel: int = 1000) -> dict:
    """{file: the most lines any rank ran in it} for one ring."""
    results = course_lib.launch(_traced_ring, world_size=world_size, args=(numel,))
    files = sorted({name for per_file in results for name in per_file})
    return {name: max(per_file.get(name, 0) for per_file in results) for name in files}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--numel", type=int, default=1000)
    args = parser.parse_args()
    table = trace(args.world_size, args.numel)
    width = max(len(name) for name in table)
    for name, count in sorted(table.items(), key=lambda item: -item[1]):
        print(f"{name:<{width}}  {count:4d} lines")
    print(f"{'in all':<{width}}  {sum(table.values()):4d} lines in {len(table)} files")


if __name__ == "__main__":
    main()
