"""Time the all-reduce variants the way nccl-tests does: median time, algbw and busbw.

From a notebook or a script::

    from course_lib import bench
    results = bench.run(sizes=["64KiB", "16MiB"], world_sizes=[2, 4])
    print(results.table())            # one row per (world size, size, variant)
    results.plot()                    # time and bus bandwidth against size
    results[0].median, results[0].busbw

From a terminal, on local ranks started here, or under torchrun (one process per GPU / node)::

    python -m course_lib.bench --sizes 1KiB,1MiB,16MiB --world-sizes 2,4 --json out.json --plot out.png
    torchrun --nproc-per-node 4 -m course_lib.bench --sizes 16MiB,64MiB

How one measurement is made (inside every rank, for every size):

* the input is refilled from a saved copy before each call (outside the timed region), so every
  call reduces the same numbers;
* all ranks meet at a barrier, then each times its own call with `time.perf_counter`;
* the time of that repetition is the slowest rank's time: an all-reduce is finished when the last
  rank has its result;
* `warmup` calls per variant are thrown away (first-touch page faults, socket buffers growing),
  then `reps` are kept; variants take turns within each repetition, so a burst of load from
  something else on the machine hits all of them alike;
* the first result of every variant is compared with `torch.distributed.all_reduce`'s (like
  nccl-tests' "#wrong" column): a fast wrong answer is not a result.

Bandwidths follow nccl-tests (doc/PERFORMANCE.md in github.com/NVIDIA/nccl-tests), in GB/s = 1e9
bytes per second:

    algbw = S / t                               S = bytes of the tensor on one rank
    busbw = algbw * 2 (G - 1) / G               for all-reduce on G ranks

busbw is the speed the busiest link must have had for the time t: any all-reduce must move each
byte 2 (G-1)/G times over a rank's link, so busbw can be compared with the hardware's link speed
whatever the number of ranks.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

import course_lib
from course_lib import allreduce

__all__ = ["Result", "Results", "run", "measure_in_rank", "algbw", "busbw", "BUSBW_FACTORS",
           "VARIANTS", "parse_bytes", "format_bytes", "main"]

# The hand-written variants of course_lib.allreduce, then PyTorch's own all-reduce for comparison.
VARIANTS = ("naive", "parameter_server", "ring", "builtin")

# nccl-tests' correction factors from algbw to busbw, G = number of ranks (doc/PERFORMANCE.md).
BUSBW_FACTORS = {
    "all_reduce": lambda g: 2 * (g - 1) / g,
    "reduce_scatter": lambda g: (g - 1) / g,
    "all_gather": lambda g: (g - 1) / g,
    "all_to_all": lambda g: (g - 1) / g,
    "broadcast": lambda g: 1.0,
    "reduce": lambda g: 1.0,
}


def algbw(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 bytes/s): the tensor's size over the time, `S / t`."""
    return nbytes / seconds / 1e9


def busbw(algbw_gbps: float, world_size: int, collective: str = "all_reduce") -> float:
    """Bus bandwidth in GB/s: `algbw` times nccl-tests' factor for the collective (2(G-1)/G for all-reduce)."""
    try:
        factor = BUSBW_FACTORS[collective]
    except KeyError:
        raise ValueError(f"no busbw factor for {collective!r}; known: {sorted(BUSBW_FACTORS)}") from None
    return algbw_gbps * factor(world_size)


# --------------------------------------------------------------------------------------------------
# Sizes written for humans: "16MiB", "64K", "1048576"
# --------------------------------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30,
          "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_bytes(text) -> int:
    """'16MiB' -> 16777216. K/M/G and KiB/MiB/GiB are powers of 1024 (as in nccl-tests' -b/-e), KB/MB/GB of 1000."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size in bytes: write e.g. 4096, 64KiB, 16MiB or 1GiB")
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if value != int(value) or value <= 0:
        raise ValueError(f"size {text!r} must be a positive whole number of bytes")
    return int(value)


def format_bytes(nbytes: int) -> str:
    """16777216 -> '16 MiB' (binary units, exact when possible)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:g} {unit}" if value == int(value) else f"{value:.3g} {unit}"
    return f"{nbytes:.4g} B"  # below 1 KiB: whole numbers print as they are, a fraction to 4 digits


def _format_seconds(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.0f} us"


# --------------------------------------------------------------------------------------------------
# Result records
# --------------------------------------------------------------------------------------------------


@dataclass
class Result:
    """One variant timed at one size on one number of ranks.

    Attributes:
        variant: 'naive', 'parameter_server', 'ring' or 'builtin' (torch.distributed.all_reduce).
        world_size: number of ranks G.
        nbytes: size of the tensor on each rank, in bytes (S in nccl-tests).
        numel: number of elements.
        dtype: e.g. 'float32'.
        backend: 'gloo' or 'nccl'.
        times: seconds of every kept repetition, each the slowest rank's time.
        correct: whether the variant's result matched torch.distributed.all_reduce's.
    """

    variant: str
    world_size: int
    nbytes: int
    numel: int
    dtype: str
    backend: str
    times: list = field(default_factory=list)
    correct: bool = True

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def min(self) -> float:
        return min(self.times)

    @property
    def max(self) -> float:
        return max(self.times)

    @property
    def quartiles(self) -> tuple[float, float]:
        """(25th, 75th) percentile of the times; with one repetition both are that time."""
        if len(self.times) < 2:
            return (self.times[0], self.times[0])
        q1, _, q3 = statistics.quantiles(self.times, n=4, method="inclusive")
        return (q1, q3)

    @property
    def algbw(self) -> float:
        """GB/s from the median time."""
        return algbw(self.nbytes, self.median)

    @property
    def busbw(self) -> float:
        """GB/s from the median time, nccl-tests' all-reduce factor 2(G-1)/G."""
        return busbw(self.algbw, self.world_size)

    def to_dict(self) -> dict:
        """Plain data for JSON: the raw times and every derived number."""
        record = asdict(self)
        q1, q3 = self.quartiles
        record.update(median_s=self.median, min_s=self.min, max_s=self.max, q1_s=q1, q3_s=q3,
                      algbw_GBps=self.algbw, busbw_GBps=self.busbw)
        return record

    @classmethod
    def from_dict(cls, record: dict) -> "Result":
        names = ("variant", "world_size", "nbytes", "numel", "dtype", "backend", "times", "correct")
        return cls(**{name: record[name] for name in names})

    def __str__(self) -> str:
        return (f"{self.variant} G={self.world_size} {format_bytes(self.nbytes)}: median "
                f"{_format_seconds(self.median)}, busbw {self.busbw:.3g} GB/s")


class Results(list):
    """A list of `Result` records that can also print, plot and save itself."""

    def where(self, variant=None, world_size=None, nbytes=None) -> "Results":
        """The records matching every criterion given (sizes may be written '16MiB')."""
        nbytes = None if nbytes is None else parse_bytes(nbytes)
        return Results(r for r in self if (variant is None or r.variant == variant)
                       and (world_size is None or r.world_size == world_size)
                       and (nbytes is None or r.nbytes == nbytes))

    def get(self, variant, world_size, nbytes) -> Result:
        """The single record for (variant, world_size, size)."""
        found = self.where(variant, world_size, nbytes)
        if len(found) != 1:
            raise KeyError(f"{len(found)} records for variant={variant!r}, world_size={world_size}, nbytes={nbytes}")
        return found[0]

    def table(self) -> str:
        """A text table in the spirit of nccl-tests' output, one row per record."""
        header = (f"{'ranks':>5}  {'size':>9}  {'variant':<16} {'median':>10}  {'min':>10}  {'max':>10}"
                  f"  {'algbw GB/s':>10}  {'busbw GB/s':>10}  {'ok':>3}")
        lines = [header, "-" * len(header)]
        for r in self:
            lines.append(f"{r.world_size:>5}  {format_bytes(r.nbytes):>9}  {r.variant:<16} "
                         f"{_format_seconds(r.median):>10}  {_format_seconds(r.min):>10}  "
                         f"{_format_seconds(r.max):>10}  {r.algbw:>10.3g}  {r.busbw:>10.3g}  "
                         f"{'yes' if r.correct else 'NO':>3}")
        return "\n".join(lines)

    def to_json(self, path=None, meta: dict | None = None) -> str:
        """The records (raw times included) and a description of the run, as JSON text; written to `path` if given."""
        document = {"meta": {**_machine_description(), **(meta or {})},
                    "units": {"times": "seconds", "algbw_GBps": "1e9 bytes/s", "busbw_GBps": "1e9 bytes/s",
                              "nbytes": "bytes per rank"},
                    "results": [r.to_dict() for r in self]}
        text = json.dumps(document, indent=1)
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text + "\n")
        return text

    @classmethod
    def from_json(cls, path) -> "Results":
        with open(path, encoding="utf-8") as f:
            document = json.load(f)
        return cls(Result.from_dict(record) for record in document["results"])

    def plot(self, path=None, title=None):
        """Median time (bars: min..max) and busbw against size, one line per variant and world size.

        Returns the matplotlib Figure; saves it to `path` when given.
        """
        import matplotlib.pyplot as plt

        fig, (ax_time, ax_bw) = plt.subplots(1, 2, figsize=(11, 4))
        world_sizes = sorted({r.world_size for r in self})
        styles = ["-", "--", ":", "-."]
        present = {r.variant for r in self}
        for variant in [v for v in VARIANTS if v in present] + sorted(present - set(VARIANTS)):
            for i, g in enumerate(world_sizes):
                rows = sorted(self.where(variant, g), key=lambda r: r.nbytes)
                if not rows:
                    continue
                x = [r.nbytes for r in rows]
                med = [r.median for r in rows]
                err = [[r.median - r.min for r in rows], [r.max - r.median for r in rows]]
                label = f"{variant}, G={g}" if len(world_sizes) > 1 else variant
                color = f"C{list(VARIANTS).index(variant) if variant in VARIANTS else 4}"
                ax_time.errorbar(x, med, yerr=err, marker="o", ls=styles[i % 4], color=color, label=label, capsize=2)
                ax_bw.plot(x, [r.busbw for r in rows], marker="o", ls=styles[i % 4], color=color, label=label)
        for ax in (ax_time, ax_bw):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("bytes per rank")
            ax.grid(True, which="both", alpha=0.3)
        ax_time.set_yscale("log")
        ax_time.set_ylabel("time per all-reduce (s), median, bars min..max")
        ax_bw.set_ylabel("busbw (GB/s) = S/t x 2(G-1)/G")
        ax_bw.legend(fontsize=8)
        fig.suptitle(title or f"all-reduce on {self[0].backend if self else '?'}: measured")
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=120)
        return fig


def _machine_description() -> dict:
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
            "python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "course_lib": course_lib.__version__}


# --------------------------------------------------------------------------------------------------
# Inside a rank: the measurement itself
# --------------------------------------------------------------------------------------------------


def _call(variant: str):
    if variant == "builtin":
        return dist.all_reduce
    return allreduce.get(variant)


def _synchronize(device: torch.device) -> None:
    # NCCL calls return before the GPU has finished: wait for it, or we would time the launch only.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _input(numel: int, dtype: torch.dtype, rank: int, device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + rank)
    if dtype.is_floating_point:
        values = torch.randn(numel, generator=generator)
    else:
        values = torch.randint(-100, 100, (numel,), generator=generator)
    return values.to(dtype=dtype, device=device)


def measure_in_rank(nbytes: int, variants=VARIANTS, reps: int = 5, warmup: int = 1, dtype: str = "float32",
                    check: bool = True) -> list[dict]:
    """Time every variant at one size on this rank's process group; call it on every rank.

    Returns the same list of plain records on every rank (the times are already the slowest rank's),
    ready for `Result(**record)`.
    """
    torch_dtype = getattr(torch, dtype)
    element = torch.empty((), dtype=torch_dtype).element_size()
    if nbytes % element:
        raise ValueError(f"{nbytes} bytes is not a whole number of {dtype} elements ({element} bytes each)")
    numel = nbytes // element
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = course_lib.device()
    source = _input(numel, torch_dtype, rank, device)
    work = torch.empty_like(source)
    expected = source.clone()
    dist.all_reduce(expected)
    correct = {variant: True for variant in variants}
    times = torch.zeros(len(variants), reps, dtype=torch.float64)
    for rep in range(warmup + reps):
        for index, variant in enumerate(variants):
            function = _call(variant)
            work.copy_(source)
            _synchronize(device)
            dist.barrier()
            start = time.perf_counter()
            with course_lib.unchecked():  # time the algorithm only, not course_lib's argument check
                function(work)
            _synchronize(device)
            elapsed = time.perf_counter() - start
            if rep >= warmup:
                times[index, rep - warmup] = elapsed
            if rep == 0 and check:
                # Sums in another order round differently: allow a few ulps per rank, nothing for integers.
                tolerance = world_size * max(1e-5, 8 * torch.finfo(torch_dtype).eps) if torch_dtype.is_floating_point else 0
                correct[variant] = bool(torch.allclose(work, expected, rtol=tolerance, atol=tolerance))
    # The slowest rank's time per repetition; a variant is correct only if it is correct everywhere.
    flags = torch.tensor([[float(correct[v]) for v in variants]], dtype=torch.float64)
    local = torch.cat([times, flags.T], dim=1).to(device)
    everyone = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(everyone, local)
    stacked = torch.stack(everyone).cpu()
    slowest, all_correct = stacked[:, :, :reps].amax(dim=0), stacked[:, :, reps].amin(dim=0)
    backend = dist.get_backend()
    return [dict(variant=variant, world_size=world_size, nbytes=nbytes, numel=numel, dtype=dtype,
                 backend=str(backend), times=slowest[i].tolist(), correct=bool(all_correct[i] == 1.0))
            for i, variant in enumerate(variants)]


def _measure_on_launched_rank(rank, world_size, nbytes, variants, reps, warmup, dtype, check):
    return measure_in_rank(nbytes, variants, reps, warmup, dtype, check)


# --------------------------------------------------------------------------------------------------
# From the caller's side
# --------------------------------------------------------------------------------------------------


def _check_variants(variants) -> tuple:
    variants = tuple(variants)
    unknown = [v for v in variants if v != "builtin" and v not in allreduce.VARIANTS]
    if unknown or not variants:
        raise ValueError(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    return variants


def _launch_timeout(nbytes, world_size, n_variants, calls) -> float:
    # Generous: the naive exchange pushes G-1 copies per rank through a loopback shared by all ranks;
    # at a pessimistic 20 MB/s that is the longest a healthy run may take.
    return 60.0 + calls * n_variants * (0.05 + world_size * world_size * nbytes / 20e6)


def run(sizes=("4KiB", "256KiB", "4MiB"), world_sizes=None, variants=VARIANTS, reps: int = 5,
        warmup: int = 1, dtype: str = "float32", backend: str = "auto", progress: bool = False,
        check: bool = True, timeout: float | None = None) -> Results:
    """Time all-reduce variants for every (world size, size) and return the records.

    Each (world size, size) is one `course_lib.launch` of `world_size` ranks that times every
    variant in turn. Under torchrun the ranks already exist: `world_sizes` must be omitted or equal
    to torchrun's WORLD_SIZE, and every process gets the same records back.

    Args:
        sizes: bytes per rank, as ints or strings like "16MiB".
        world_sizes: numbers of ranks to try (each at least 2); default [2, 4], or torchrun's WORLD_SIZE.
        variants: any of "naive", "parameter_server", "ring", "builtin".
        reps: kept repetitions per variant and size (the median and spread come from these).
        warmup: calls per variant thrown away first.
        dtype: element type, e.g. "float32".
        backend: "auto", "gloo" or "nccl", as for `course_lib.launch`.
        progress: print one line per finished (world size, size) to stderr.
        check: compare each variant's first result with torch.distributed.all_reduce's.
        timeout: seconds allowed per launch (default: generous, from the sizes).

    Returns:
        `Results`, a list of `Result` ordered by world size, size, variant.

    Example::

        >>> results = bench.run(sizes=["1KiB", "1MiB"], world_sizes=[2], reps=3)
        >>> [r.variant for r in results.where(nbytes="1KiB")]
        ['naive', 'parameter_server', 'ring', 'builtin']
    """
    sizes = [parse_bytes(s) for s in sizes]
    variants = _check_variants(variants)
    if reps < 1 or warmup < 0:
        raise ValueError(f"need reps >= 1 and warmup >= 0, got reps={reps}, warmup={warmup}")
    if course_lib.under_torchrun():
        return _run_under_torchrun(sizes, world_sizes, variants, reps, warmup, dtype, backend, progress, check)
    world_sizes = [2, 4] if world_sizes is None else [int(g) for g in world_sizes]
    if any(g < 2 for g in world_sizes):
        raise ValueError(f"all-reduce needs at least 2 ranks to measure anything; got world_sizes={world_sizes}")
    results, total, done, started = Results(), len(sizes) * len(world_sizes), 0, time.perf_counter()
    for world_size in world_sizes:
        for nbytes in sizes:
            limit = timeout or _launch_timeout(nbytes, world_size, len(variants), warmup + reps)
            records = course_lib.launch(_measure_on_launched_rank, world_size=world_size, backend=backend,
                                        args=(nbytes, variants, reps, warmup, dtype, check), timeout=limit)[0]
            results.extend(Result(**record) for record in records)
            done += 1
            if progress:
                _report_progress(done, total, started, results[-len(variants):])
    return results


def _report_progress(done, total, started, rows) -> None:
    first = rows[0]
    parts = ", ".join(f"{r.variant} {_format_seconds(r.median)}" for r in rows)
    print(f"[{done}/{total}, {time.perf_counter() - started:.0f} s] G={first.world_size} "
          f"{format_bytes(first.nbytes)}: {parts}", file=sys.stderr, flush=True)


def _run_under_torchrun(sizes, world_sizes, variants, reps, warmup, dtype, backend, progress, check) -> Results:
    world_size = int(os.environ["WORLD_SIZE"])
    if world_sizes is not None and list(world_sizes) not in ([], [world_size]):
        raise ValueError(f"under torchrun the number of ranks is torchrun's WORLD_SIZE={world_size}; "
                         f"world_sizes={list(world_sizes)} cannot be run. Leave it out (CLI: omit --world-sizes).")
    owns_group = not dist.is_initialized()
    if owns_group:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        backend = course_lib.resolve_backend(backend, world_size, gpus_per_node=local_world)
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend)
    try:
        results, started = Results(), time.perf_counter()
        for done, nbytes in enumerate(sizes, start=1):
            records = measure_in_rank(nbytes, variants, reps, warmup, dtype, check)
            results.extend(Result(**record) for record in records)
            if progress and dist.get_rank() == 0:
                _report_progress(done, len(sizes), started, results[-len(variants):])
        return results
    finally:
        if owns_group:
            dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# Command line: python -m course_lib.bench
# --------------------------------------------------------------------------------------------------


def _comma_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m course_lib.bench",
        description="Time course_lib's all-reduce variants and torch.distributed.all_reduce; report the median "
                    "time, its spread, algbw and busbw (nccl-tests' definitions). Under torchrun the ranks are "
                    "torchrun's and --world-sizes is not used.")
    parser.add_argument("--sizes", default="4KiB,256KiB,4MiB",
                        help="bytes per rank, comma-separated, e.g. 1KiB,1MiB,16MiB (default %(default)s)")
    parser.add_argument("--world-sizes", default=None, help="numbers of ranks, e.g. 2,4,8 (default 2,4)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="default %(default)s")
    parser.add_argument("--reps", type=int, default=5, help="kept repetitions (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=1, help="discarded calls per variant (default %(default)s)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    parser.add_argument("--json", metavar="PATH", help="write the records and the run's description as JSON")
    parser.add_argument("--plot", metavar="PATH", help="save a plot (matplotlib) of time and busbw against size")
    parser.add_argument("--no-check", action="store_true", help="skip comparing results with the built-in all_reduce")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    sizes = _comma_list(args.sizes)
    if course_lib.under_torchrun():
        world_sizes = None if args.world_sizes is None else [int(g) for g in _comma_list(args.world_sizes)]
    else:
        world_sizes = None if args.world_sizes is None else [int(g) for g in _comma_list(args.world_sizes)]
    results = run(sizes, world_sizes, _comma_list(args.variants), reps=args.reps, warmup=args.warmup,
                  dtype=args.dtype, backend=args.backend, progress=not args.quiet, check=not args.no_check)
    if course_lib.under_torchrun() and int(os.environ["RANK"]) != 0:
        return 0  # every rank has the same records; rank 0 reports them
    print(results.table())
    if args.json:
        results.to_json(args.json, meta={"command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
                                         "reps": args.reps, "warmup": args.warmup})
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")  # a terminal has no display
        results.plot(args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0 if all(r.correct for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
