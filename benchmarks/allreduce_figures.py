"""The core issue's figures: 4-rank all-reduce times from 1 KiB to 64 MiB, with bus bandwidth.

    python benchmarks/allreduce_figures.py [--reps 5] [--world-size 4]

Times course_lib's ring, naive and parameter-server all-reduce and torch.distributed.all_reduce in
one run (course_lib.bench: warm-up, median of the kept repetitions, slowest rank per repetition),
prints nccl-tests style algbw and busbw (busbw = bytes/time x 2(G-1)/G), and then the ring's time
relative to the built-in at each size. Not a test: the figures depend on the machine and its load.
"""

import argparse

from course_lib import bench

SIZES = ["1KiB", "4KiB", "16KiB", "64KiB", "256KiB", "1MiB", "4MiB", "16MiB", "64MiB"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=4)
    options = parser.parse_args()
    results = bench.run(sizes=SIZES, world_sizes=[options.world_size], reps=options.reps, warmup=1, progress=True)
    print(results.table())
    print("\nring time / built-in time (median):")
    for size in SIZES:
        ring = results.get("ring", options.world_size, size)
        builtin = results.get("builtin", options.world_size, size)
        print(f"  {size:>7}: {ring.median / builtin.median:5.2f}x   (ring busbw {ring.busbw:.3g} GB/s, "
              f"built-in {builtin.busbw:.3g} GB/s)")


if __name__ == "__main__":
    main()
