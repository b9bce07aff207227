"""Which segment size should ring_pipelined cut its chunks into? Measured, not guessed.

    python benchmarks/ring_segment_size.py                       # 4 ranks, 16 MiB and 64 MiB, 9 reps
    python benchmarks/ring_segment_size.py --reps 3 --segments 256KiB,1MiB   # a quick look

Small segments overlap adding with receiving more finely but pay Python's per-message cost (a p2p
call, a traffic label, a gloo work object: tens of microseconds) many times; large ones pay it rarely
but leave the link idle while a big segment is added. `course_lib.fast_allreduce.ring_pipelined`
with each segment size, the plain ring (= one segment per chunk, no early receives) and gloo's
built-in are timed in one launch, every repetition running each once, in an order shuffled anew each time
(`course_lib.bench.measure_in_rank`), and compared by paired ratios against the built-in. Each call's CPU
time over all ranks and the machine's idle share are recorded too (cpu=True): more segments mean more
messages, which cost CPU, and fewer idle cores, which saves time; the two columns show which wins.

Writes benchmarks/results/ring_segment_size.{json,md} (or --out STEM). The default of
`fast_allreduce.SEGMENT_BYTES` is the size this chose; the comment above it gives the rule, and the
figures are in that file, whose last section pools repeated launches (benchmarks/pool_results.py):
run further launches with --out /tmp/..., so that the results folder keeps one file per benchmark.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import shlex
import sys

import course_lib
from course_lib import allreduce, bench, fast_allreduce

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def _name(segment_bytes: int) -> str:
    return f"pipelined_{bench.format_bytes(segment_bytes).replace(' ', '')}"


def _measure(rank, world_size, sizes, segments, reps, warmup):
    # Inside this rank's process only: one entry per segment size, so bench can time them by name.
    for segment in segments:
        allreduce.VARIANTS[_name(segment)] = functools.partial(fast_allreduce.ring_pipelined, segment_bytes=segment)
    names = ["ring"] + [_name(s) for s in segments] + ["builtin"]
    return [record for nbytes in sizes for record in bench.measure_in_rank(nbytes, names, reps, warmup, cpu=True)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--sizes", default="16MiB,64MiB")
    parser.add_argument("--segments", default="64KiB,256KiB,1MiB,4MiB")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--note", default="", help="recorded in the results (e.g. 'machine shared with other jobs')")
    parser.add_argument("--out", default=str(RESULTS / "ring_segment_size"))
    args = parser.parse_args(argv)
    sizes = [bench.parse_bytes(s) for s in args.sizes.split(",")]
    segments = [bench.parse_bytes(s) for s in args.segments.split(",")]
    before = bench.machine_description()["loadavg"]
    records = course_lib.launch(_measure, args.world_size, backend="gloo", timeout=3000,
                                args=(sizes, segments, args.reps, args.warmup))[0]
    results = bench.Results(bench.Result(**record) for record in records)
    print(results.table("builtin"))
    meta = {"command": "python benchmarks/ring_segment_size.py " + shlex.join(sys.argv[1:] if argv is None else argv),
            "reps": args.reps, "warmup": args.warmup, "loadavg_before": before,
            "loadavg_after": bench.machine_description()["loadavg"], "note": args.note,
            "segments": {_name(s): s for s in segments},
            "chosen": fast_allreduce.SEGMENT_BYTES}
    for path in results.save(args.out, "builtin", title="ring_pipelined: segment size", meta=meta):
        print("wrote", path, file=sys.stderr)
    return 0 if all(r.correct for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
