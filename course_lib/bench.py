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
    python -m course_lib.bench --nccl-tests --network 8x8:nvlink4,ib_ndr --sizes 8,1MiB,1GiB --tuning

The last prints, launching nothing, what nccl-tests' ``all_reduce_perf`` would print on that modeled cluster
(torch's all-reduce as `course_lib.nccl` says NCCL runs it), in all_reduce_perf's own columns, so a real cluster's
output can be held beside it; `nccl_tests(network, sizes)` does the same from Python, and `Results.nccl_tests()`
prints a launched run's rows in those columns.

How one measurement is made (inside every rank, for every size):

* the input is refilled from a saved copy before each call (outside the timed region), so every
  call reduces the same numbers;
* all ranks meet at a barrier, then each times its own call with `course_lib.clock()`: this machine's
  `time.perf_counter`, or under a modeled network (`network=`) the rank's modeled clock, on which the same
  call takes the same time in every repetition (a median and spread then say the model is deterministic);
* the time of that repetition is the slowest rank's time: an all-reduce is finished when the last
  rank has its result;
* `warmup` calls per variant are thrown away (first-touch page faults, socket buffers growing),
  then `reps` are kept; variants take turns within each repetition, so a burst of load from
  something else on the machine hits all of them alike, and the order is shuffled anew in every
  repetition (the same shuffle on every rank: `run_order`), so no variant always runs first or right
  after the same neighbour;
* the first result of every variant is compared with `torch.distributed.all_reduce`'s (like
  nccl-tests' "#wrong" column): a fast wrong answer is not a result;
* with `cpu=True` every call also records the CPU time it cost (every thread of every rank's process,
  the kernel's work for its sockets included) and how much of the machine stayed idle meanwhile
  (Linux's /proc/stat). Time, CPU time and idle share tell apart two reasons a variant can be slower:
  it does more work, or it leaves cores idle while ranks wait for each other.

Bandwidths follow nccl-tests (doc/PERFORMANCE.md in github.com/NVIDIA/nccl-tests), in GB/s = 1e9
bytes per second:

    algbw = S / t                               S = bytes of the tensor on one rank
    busbw = algbw * 2 (G - 1) / G               for all-reduce on G ranks

busbw is the speed the busiest link must have had for the time t: any all-reduce must move each
byte 2 (G-1)/G times over a rank's link, so busbw can be compared with the hardware's link speed
whatever the number of ranks.

Comparing two variants: on a shared machine a single time moves by 15% or more with load, but two
variants timed in the *same* repetition see the same load. `Results.ratios(variant, reference, ...)`
gives those paired ratios t_variant / t_reference, one per repetition; their median and spread are
what the tables and `Results.to_markdown` report next to each median::

    python -m course_lib.bench --sizes 4KiB,16MiB --world-sizes 4 --variants all --reference builtin \
        --save /tmp/bench_4ranks        # writes /tmp/bench_4ranks.json and /tmp/bench_4ranks.md
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import re
import shlex
import statistics
import sys
import random
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

import course_lib
from course_lib import allreduce, runtime
from course_lib import modeled_clock as _clock
from course_lib import nccl as _nccl
from course_lib import network as network_module

__all__ = ["Result", "Results", "run", "measure_in_rank", "algbw", "busbw", "BUSBW_FACTORS",
           "VARIANTS", "ALL_VARIANTS", "parse_bytes", "format_bytes", "spread", "machine_description", "main",
           "nccl_tests", "nccl_tests_line"]

# The hand-written variants of course_lib.allreduce, then PyTorch's own all-reduce for comparison.
VARIANTS = ("naive", "parameter_server", "ring", "builtin")
# Every variant, the faster ones of course_lib.fast_allreduce included ('master' is an alias, left out).
ALL_VARIANTS = ("naive", "parameter_server", "ring", "ring_pipelined", "ring_bidirectional", "halving_doubling",
                "recursive_doubling", "tree", "builtin")

# nccl-tests' correction factors from algbw to busbw, G = number of ranks (doc/PERFORMANCE.md): one table, nccl's
BUSBW_FACTORS = _nccl.BUSBW_FACTORS


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
            if value == int(value):
                return f"{value:g} {unit}"
            # 3 significant digits, but never an exponent: 1000-1023 KiB prints as '1000 KiB', not '1e+03 KiB'
            return f"{value:.3g} {unit}" if value < 1000 else f"{value:.0f} {unit}"
    return f"{nbytes:.4g} B"  # below 1 KiB: whole numbers print as they are, a fraction to 4 digits


def _format_seconds(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.0f} us"


def spread(values) -> dict:
    """Median, quartiles and range of a list of numbers: {'median', 'q1', 'q3', 'min', 'max', 'n'}.

    The quartiles are the 'inclusive' ones (numpy's default percentiles); with one value all are that value.
    """
    values = list(values)
    if not values:
        raise ValueError("no values to summarise")
    q1, q3 = (statistics.quantiles(values, n=4, method="inclusive")[::2] if len(values) > 1
              else (values[0], values[0]))
    return dict(median=statistics.median(values), q1=q1, q3=q3, min=min(values), max=max(values), n=len(values))


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
        cpu_seconds: with `cpu=True` only: CPU seconds of every kept repetition, summed over the ranks'
            processes (all their threads, user and kernel time).
        idle_ticks, total_ticks: with `cpu=True` only, Linux only: the machine's idle and total CPU ticks
            (/proc/stat, 1/100 s per CPU) during every kept repetition, summed over the ranks' readings.
        network: under a modeled network, the link (`Network.describe()`); '' on the plain machine.
        predicted: under a modeled network, the model's seconds for one call (`Network.predict`).
    """

    variant: str
    world_size: int
    nbytes: int
    numel: int
    dtype: str
    backend: str
    times: list = field(default_factory=list)
    correct: bool = True
    cpu_seconds: list = field(default_factory=list)
    idle_ticks: list = field(default_factory=list)
    total_ticks: list = field(default_factory=list)
    network: str = ""
    predicted: float | None = None

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
    def cpu_median(self) -> float | None:
        """Median CPU seconds per call over all ranks (None unless measured with cpu=True)."""
        return statistics.median(self.cpu_seconds) if self.cpu_seconds else None

    @property
    def idle_share(self) -> float | None:
        """Share of the machine's CPU time left idle during this variant's calls, all repetitions together.

        /proc/stat counts in ticks of 1/100 s per CPU, too coarse for one call of a few ms, so the ticks of
        every repetition are added up before dividing. None unless measured with cpu=True on Linux.
        """
        total = sum(self.total_ticks)
        return sum(self.idle_ticks) / total if total else None

    @property
    def model_ratio(self) -> float | None:
        """Median time / the modeled link's prediction (None without a network)."""
        return self.median / self.predicted if self.predicted else None

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
        if self.cpu_seconds:
            record.update(cpu_median_s=self.cpu_median, idle_share=self.idle_share)
        if self.predicted:
            record.update(model_ratio=self.model_ratio)
        return record

    @classmethod
    def from_dict(cls, record: dict) -> "Result":
        names = ("variant", "world_size", "nbytes", "numel", "dtype", "backend", "times", "correct")
        # absent from files written without cpu=True, or without a network
        optional = ("cpu_seconds", "idle_ticks", "total_ticks", "network", "predicted")
        return cls(**{name: record[name] for name in names}, **{name: record[name] for name in optional if name in record})

    def __str__(self) -> str:
        return (f"{self.variant} G={self.world_size} {format_bytes(self.nbytes)}: median "
                f"{_format_seconds(self.median)}, busbw {self.busbw:.3g} GB/s")

    def ratios(self, reference: "Result") -> list[float]:
        """Paired ratios: this variant's time / the reference's time in the same repetition."""
        if (reference.world_size, reference.nbytes) != (self.world_size, self.nbytes) or \
                len(reference.times) != len(self.times):
            raise ValueError(f"{self.variant} and {reference.variant} were not timed in the same repetitions "
                             "(same world size, size and number of repetitions): their times cannot be paired")
        return [t / r for t, r in zip(self.times, reference.times)]


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

    def ratios(self, variant: str, reference: str, world_size: int, nbytes) -> list[float]:
        """Paired ratios t_variant / t_reference, one per repetition (both timed in the same one)."""
        return self.get(variant, world_size, nbytes).ratios(self.get(reference, world_size, nbytes))

    def _paired(self, r: Result, reference: str | None):
        """spread() of r's paired ratios against `reference`, or None when there is none to pair with."""
        if reference is None or r.variant == reference:
            return None
        found = self.where(reference, r.world_size, r.nbytes)
        return spread(r.ratios(found[0])) if len(found) == 1 else None

    def table(self, reference: str | None = None) -> str:
        """A text table in the spirit of nccl-tests' output, one row per record.

        With `reference` (e.g. 'builtin') a last column gives the median paired ratio against it and
        the ratios' interquartile range.
        """
        header = (f"{'ranks':>5}  {'size':>9}  {'variant':<18} {'median':>10}  {'min':>10}  {'max':>10}"
                  f"  {'algbw GB/s':>10}  {'busbw GB/s':>10}  {'ok':>3}")
        with_cpu = any(r.cpu_seconds for r in self)
        if with_cpu:
            header += f"  {'CPU/call':>10}  {'idle':>6}"
        with_model = any(r.predicted for r in self)
        if with_model:
            header += f"  {'model':>10}  {'x model':>7}"
        if reference:
            header += f"  {'x ' + reference + ' (IQR)':>24}"
        lines = [header, "-" * len(header)]
        for r in self:
            line = (f"{r.world_size:>5}  {format_bytes(r.nbytes):>9}  {r.variant:<18} "
                    f"{_format_seconds(r.median):>10}  {_format_seconds(r.min):>10}  "
                    f"{_format_seconds(r.max):>10}  {r.algbw:>10.3g}  {r.busbw:>10.3g}  "
                    f"{'yes' if r.correct else 'NO':>3}")
            if with_cpu:
                cpu, idle = _cpu_cells(r)
                line += f"  {cpu:>10}  {idle:>6}"
            if with_model:
                model, ratio = _model_cells(r)
                line += f"  {model:>10}  {ratio:>7}"
            if reference:
                paired = self._paired(r, reference)
                line += f"  {_format_ratio(paired):>24}"
            lines.append(line)
        return "\n".join(lines)

    def nccl_tests(self, variant: str = "builtin") -> str:
        """`variant`'s rows in nccl-tests' columns (median time), one block per world size."""
        blocks = []
        for g in sorted({r.world_size for r in self if r.variant == variant}):
            lines = [f"# {variant} on {g} ranks (median of {len(self.where(variant, g)[0].seconds)} calls)",
                     _NCCL_TESTS_HEADER]
            for r in self.where(variant, g):
                lines.append(nccl_tests_line(r.nbytes, r.median, g, wrong=0 if r.correct else 1))
            blocks.append("\n".join(lines))
        return "\n\n".join(blocks)

    def to_markdown(self, reference: str | None = None, title: str = "All-reduce: measured",
                    meta: dict | None = None) -> str:
        """A short markdown report: the machine, then one table per (world size, size).

        Every row: median time, interquartile range and min..max over the repetitions, and (with
        `reference`) the paired ratio against the reference variant: median (IQR, min..max).
        """
        info = {**machine_description(), **(meta or {})}
        load = info.get("loadavg_before") or info.get("loadavg")
        lines = [f"# {title}", "",
                 f"Machine: {info.get('cpus')} CPU(s) ({info.get('cpu_model', '?')}), torch {info.get('torch')}, "
                 f"Python {info.get('python')}, {info.get('date')}. Load average (1, 5, 15 min): {load}"
                 + (f", after: {info['loadavg_after']}" if info.get("loadavg_after") else "") + "."]
        if info.get("command"):
            lines += ["", f"Command: `{info['command']}`"]
        if info.get("note"):
            lines += ["", f"Note: {info['note']}"]
        reps = sorted({len(r.times) for r in self})
        lines += ["", f"Repetitions per variant: {', '.join(map(str, reps))}; each repetition runs every variant "
                      "once (order shuffled anew each repetition); a repetition's time is the slowest rank's."]
        networks = sorted({r.network for r in self if r.network})
        if networks:
            lines += ["", f"Modeled network: {'; '.join(networks)}. Every point-to-point message took the time of that "
                          "link (course_lib.network); 'model' is the link's prediction for one call "
                          "(Network.predict), 'x model' the median time divided by it."]
        if any(r.cpu_seconds for r in self):
            lines += ["", "CPU per call: CPU seconds of all ranks' processes together (every thread, user and kernel "
                          "time). Machine idle: the share of all CPUs' time that nothing ran during this variant's "
                          "calls (/proc/stat, every repetition together)."]
        for g in sorted({r.world_size for r in self}):
            for n in sorted({r.nbytes for r in self.where(world_size=g)}):
                rows = self.where(world_size=g, nbytes=n)
                with_cpu = any(r.cpu_seconds for r in rows)
                with_model = any(r.predicted for r in rows)
                lines += ["", f"## {g} ranks, {format_bytes(n)} per rank ({rows[0].backend}, {rows[0].dtype})", "",
                          "| variant | median | IQR | min..max | busbw GB/s |"
                          + (" CPU per call, all ranks: median | machine idle |" if with_cpu else "")
                          + (" model | x model |" if with_model else "")
                          + (f" x {reference}, paired: median (IQR; min..max) |" if reference else ""),
                          "| --- | --- | --- | --- | --- |" + (" --- | --- |" if with_cpu else "")
                          + (" --- | --- |" if with_model else "")
                          + (" --- |" if reference else "")]
                for r in rows:
                    q1, q3 = r.quartiles
                    row = (f"| {r.variant}{'' if r.correct else ' (WRONG RESULT)'} | {_format_seconds(r.median)} | "
                           f"{_format_seconds(q1)}..{_format_seconds(q3)} | "
                           f"{_format_seconds(r.min)}..{_format_seconds(r.max)} | {r.busbw:.3g} |")
                    if with_cpu:
                        cpu, idle = _cpu_cells(r)
                        row += f" {cpu} | {idle} |"
                    if with_model:
                        model, ratio = _model_cells(r)
                        row += f" {model} | {ratio} |"
                    if reference:
                        paired = self._paired(r, reference)
                        row += f" {_format_ratio(paired, full=True)} |"
                    lines.append(row)
        return "\n".join(lines) + "\n"

    def save(self, stem, reference: str | None = None, title: str = "All-reduce: measured",
             meta: dict | None = None) -> tuple[str, str]:
        """Write `stem`.json (every raw time, the machine) and `stem`.md (`to_markdown`); return both paths."""
        stem = str(stem)
        for suffix in (".json", ".md"):
            if stem.endswith(suffix):
                stem = stem[: -len(suffix)]
        directory = os.path.dirname(stem)
        if directory:
            os.makedirs(directory, exist_ok=True)
        meta = {"reference": reference, **(meta or {})}
        self.to_json(stem + ".json", meta=meta)
        with open(stem + ".md", "w", encoding="utf-8") as f:
            f.write(self.to_markdown(reference, title=title, meta=meta))
        return stem + ".json", stem + ".md"

    def to_json(self, path=None, meta: dict | None = None) -> str:
        """The records (raw times included) and a description of the run, as JSON text; written to `path` if given.

        With meta['reference'] set, every other record also carries its paired ratios against it.
        """
        meta = {**machine_description(), **(meta or {})}
        records = []
        for r in self:
            record = r.to_dict()
            paired = self._paired(r, meta.get("reference"))
            if paired is not None:
                record["paired_ratios"] = r.ratios(self.get(meta["reference"], r.world_size, r.nbytes))
                record["paired_ratio"] = paired
            records.append(record)
        document = {"meta": meta,
                    "units": {"times": "seconds", "algbw_GBps": "1e9 bytes/s", "busbw_GBps": "1e9 bytes/s",
                              "nbytes": "bytes per rank", "paired_ratios": "t_variant / t_reference, same repetition"},
                    "results": records}
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
        # The first four keep the colours notebook 10 has always drawn them in; the faster ones follow.
        order = list(VARIANTS) + [v for v in ALL_VARIANTS if v not in VARIANTS]
        for variant in [v for v in order if v in present] + sorted(present - set(order)):
            for i, g in enumerate(world_sizes):
                rows = sorted(self.where(variant, g), key=lambda r: r.nbytes)
                if not rows:
                    continue
                x = [r.nbytes for r in rows]
                med = [r.median for r in rows]
                err = [[r.median - r.min for r in rows], [r.max - r.median for r in rows]]
                label = f"{variant}, G={g}" if len(world_sizes) > 1 else variant
                color = f"C{order.index(variant) if variant in order else 9}"
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


# --------------------------------------------------------------------------------------------------
# nccl-tests' own columns
# --------------------------------------------------------------------------------------------------

_NCCL_TESTS_HEADER = (
    "#       size         count      type   redop    root     time   algbw   busbw #wrong\n"
    "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)       ")


def _nccl_tests_number(value: float) -> str:
    """A time or bandwidth as nccl-tests prints it (fewer decimals as it grows: 12.90, 326.6, 31289)."""
    if value >= 10000:
        return f"{value:.0f}"
    if value >= 1000:
        return f"{value:.1f}"
    return f"{value:.2f}" if value < 100 else f"{value:.1f}"


def nccl_tests_line(nbytes: int, seconds: float, world_size: int, collective: str = "all_reduce",
                    dtype: str = "float", wrong="N/A") -> str:
    """One line of nccl-tests' output (the out-of-place columns): size, count, type, redop, root, time (us),
    algbw and busbw (GB/s), #wrong."""
    element = torch.empty((), dtype=getattr(torch, "float32" if dtype == "float" else dtype)).element_size()
    redop = "sum" if collective in ("all_reduce", "reduce_scatter", "reduce") else "none"
    root = 0 if collective in ("broadcast", "reduce") else -1
    al = algbw(nbytes, seconds)
    bus = busbw(al, world_size, collective)
    return (f"{nbytes:>12} {nbytes // element:>13} {dtype:>9} {redop:>7} {root:>7} {_nccl_tests_number(seconds * 1e6):>8} "
            f"{al:>7.2f} {bus:>7.2f} {wrong!s:>6}")


def nccl_tests(network, sizes=("8", "1KiB", "64KiB", "1MiB", "64MiB", "1GiB"), world_size: int | None = None,
               collective: str = "all_reduce", tuning: bool = False) -> str:
    """What nccl-tests' ``all_reduce_perf`` (or all_gather_perf, ...) would print on the modeled `network`: torch's
    collective as `course_lib.nccl` says NCCL runs it, in nccl-tests' columns, so a real cluster's output can be
    read beside it. `tuning=True` adds, before each line, the line NCCL logs for the call with NCCL_DEBUG=INFO
    NCCL_DEBUG_SUBSYS=TUNING (algorithm, protocol, channels), and the modeled time.

    Example::

        >>> print(bench.nccl_tests("8x8:nvlink4,ib_ndr", ["1MiB", "1GiB"]))
    """
    from course_lib import nccl

    network = network_module.Network.parse(network)
    g = world_size or network.world_size
    if g is None:
        raise ValueError("a plain network fits any number of ranks: say how many (world_size=8)")
    if network.world_size is not None and g > network.world_size:
        raise ValueError(f"world_size={g} is more ranks than the cluster has ({network.describe()}): make the cluster "
                         f"larger, or leave world_size out")
    lines = [f"# nccl-tests' columns for {collective} on the model: {network.describe()}, {g} ranks", _NCCL_TESTS_HEADER]
    for size in sizes:
        nbytes = parse_bytes(size)
        choice = nccl.collective(network, collective, nbytes, range(g))
        if tuning:
            lines.append(f"# {choice}")
        lines.append(nccl_tests_line(nbytes, choice.seconds, g, collective))
    return "\n".join(lines)


def _cpu_cells(r: Result) -> tuple[str, str]:
    """(median CPU per call, machine idle share) as table text; '-' for what was not measured."""
    cpu = _format_seconds(r.cpu_median) if r.cpu_seconds else "-"
    idle = "-" if r.idle_share is None else f"{100 * r.idle_share:.1f}%"
    return cpu, idle


def _model_cells(r: Result) -> tuple[str, str]:
    """(the modeled link's prediction, median / prediction) as table text; '-' without a network."""
    if not r.predicted:
        return "-", "-"
    return _format_seconds(r.predicted), f"{r.model_ratio:.3f}"


def _format_ratio(paired, full: bool = False) -> str:
    if paired is None:
        return "-"
    text = f"{paired['median']:.3f} ({paired['q1']:.2f}..{paired['q3']:.2f}"
    return text + (f"; {paired['min']:.2f}..{paired['max']:.2f})" if full else ")")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_description() -> dict:
    """What a reader needs to judge a timing: date, CPU count and model, load average, torch and Python."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
            "python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "cpus_usable": usable, "cpu_model": _cpu_model(), "loadavg": load, "course_lib": course_lib.__version__}




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


def run_order(n_variants: int, rep: int) -> list[int]:
    """The order the variants run in during repetition `rep` (warm-up rounds included).

    A shuffle seeded by the repetition's number: every rank computes the same order without a message,
    and over many repetitions each variant runs in every position and after every other variant
    (a fixed rotation would keep the same neighbours: variant j always right after j-1).
    """
    order = list(range(n_variants))
    random.Random(rep).shuffle(order)
    return order


def _cpu_ticks() -> tuple[int, int]:
    """(idle, total) CPU ticks of the whole machine since boot, from /proc/stat; (0, 0) where there is none."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return ticks[3] + ticks[4], sum(ticks)  # idle + iowait: nothing ran on those CPUs


def measure_in_rank(nbytes: int, variants=VARIANTS, reps: int = 5, warmup: int = 1, dtype: str = "float32",
                    check: bool = True, cpu: bool = False, arg_checks: bool = False) -> list[dict]:
    """Time every variant at one size on this rank's process group; call it on every rank.

    With `cpu=True` each call's CPU time (`time.process_time`: every thread of this process) and the
    machine's idle and total ticks are recorded too, and summed over the ranks. With `arg_checks=True`
    course_lib's cross-rank argument check runs in every timed call, as in a learner's own code (by
    default it is off: the algorithm alone is timed). Under a modeled network (`course_lib.network`)
    every record also carries the link and its prediction.

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
    with _clock.untimed():  # the oracle is not what is timed
        dist.all_reduce(expected)
    correct = {variant: True for variant in variants}
    times = torch.zeros(len(variants), reps, dtype=torch.float64)
    # cpu=True: CPU seconds, idle ticks and total ticks of every kept call, one plane each.
    usage = torch.zeros(3, len(variants), reps, dtype=torch.float64)
    for rep in range(warmup + reps):
        for index in run_order(len(variants), rep):
            variant = variants[index]
            function = _call(variant)
            work.copy_(source)
            _synchronize(device)
            dist.barrier()
            if cpu:
                cpu_start, ticks_start = time.process_time(), _cpu_ticks()
            start = _clock.clock()
            with runtime.checking(arg_checks):  # by default the algorithm only, not course_lib's argument check
                function(work)
            _synchronize(device)
            elapsed = _clock.clock() - start
            if rep >= warmup:
                times[index, rep - warmup] = elapsed
                if cpu:
                    ticks = _cpu_ticks()
                    usage[:, index, rep - warmup] = torch.tensor(
                        [time.process_time() - cpu_start, ticks[0] - ticks_start[0], ticks[1] - ticks_start[1]],
                        dtype=torch.float64)
            if rep == 0 and check:  # every variant's first call
                # Sums in another order round differently: allow a few ulps per rank, nothing for integers.
                tolerance = world_size * max(1e-5, 8 * torch.finfo(torch_dtype).eps) if torch_dtype.is_floating_point else 0
                correct[variant] = bool(torch.allclose(work, expected, rtol=tolerance, atol=tolerance))
    # The slowest rank's time per repetition; a variant is correct only if it is correct everywhere.
    flags = torch.tensor([[float(correct[v]) for v in variants]], dtype=torch.float64)
    local = torch.cat([times, flags.T, *usage], dim=1).to(device)
    everyone = [torch.empty_like(local) for _ in range(world_size)]
    with _clock.untimed():
        dist.all_gather(everyone, local)
    stacked = torch.stack(everyone).cpu()
    slowest, all_correct = stacked[:, :, :reps].amax(dim=0), stacked[:, :, reps].amin(dim=0)
    summed = stacked[:, :, reps + 1:].sum(dim=0)  # CPU seconds, idle ticks, total ticks: every rank's together
    backend = dist.get_backend()
    records = []
    for i, variant in enumerate(variants):
        record = dict(variant=variant, world_size=world_size, nbytes=nbytes, numel=numel, dtype=dtype,
                      backend=str(backend), times=slowest[i].tolist(), correct=bool(all_correct[i] == 1.0))
        link = network_module.current()
        if link is not None:
            record.update(network=link.describe(), predicted=link.predict(variant, nbytes, world_size, element))
        if cpu:
            cpu_seconds, idle, total = summed[i].view(3, reps)
            record.update(cpu_seconds=cpu_seconds.tolist(), idle_ticks=[int(x) for x in idle.tolist()],
                          total_ticks=[int(x) for x in total.tolist()])
        records.append(record)
    return records


def _measure_on_launched_rank(rank, world_size, sizes, variants, reps, warmup, dtype, check, cpu=False,
                              arg_checks=False):
    return [record for nbytes in sizes
            for record in measure_in_rank(nbytes, variants, reps, warmup, dtype, check, cpu, arg_checks)]


# --------------------------------------------------------------------------------------------------
# From the caller's side
# --------------------------------------------------------------------------------------------------


def _check_variants(variants, link=None) -> tuple:
    variants = tuple(variants)
    if variants == ("all",):
        return ALL_VARIANTS
    unknown = [v for v in variants if v != "builtin" and v not in allreduce.VARIANTS]
    if unknown or not variants:
        raise ValueError(f"unknown variant(s) {unknown}; choose from {list(ALL_VARIANTS)} (or 'all')")
    if len(set(variants)) != len(variants):
        raise ValueError(f"variants {list(variants)} name one twice; each is timed once per repetition")
    return variants


def _launch_timeout(nbytes, world_size, n_variants, calls, variants=(), link=None) -> float:
    # Generous: the naive exchange pushes G-1 copies per rank through a loopback shared by all ranks;
    # at a pessimistic 20 MB/s that is the longest a healthy run may take. A modeled link's time is
    # computed, not waited for: it adds nothing.
    return 60.0 + calls * n_variants * (0.05 + world_size * world_size * nbytes / 20e6)


def run(sizes=("4KiB", "256KiB", "4MiB"), world_sizes=None, variants=VARIANTS, reps: int = 5,
        warmup: int = 1, dtype: str = "float32", backend: str = "auto", progress: bool = False,
        check: bool = True, timeout: float | None = None, one_launch: bool = False, cpu: bool = False,
        network=None, arg_checks: bool = False) -> Results:
    """Time all-reduce variants for every (world size, size) and return the records.

    Each (world size, size) is one `course_lib.launch` of `world_size` ranks that times every
    variant in turn. Under torchrun the ranks already exist: `world_sizes` must be omitted or equal
    to torchrun's WORLD_SIZE, and every process gets the same records back.

    Args:
        sizes: bytes per rank, as ints or strings like "16MiB".
        world_sizes: numbers of ranks to try (each at least 2); default [2, 4], or torchrun's WORLD_SIZE.
        variants: any of ALL_VARIANTS ("naive", ..., "tree", "builtin"), or ["all"].
        reps: kept repetitions per variant and size (the median and spread come from these).
        warmup: calls per variant thrown away first.
        dtype: element type, e.g. "float32".
        backend: "auto", "gloo" or "nccl", as for `course_lib.launch`.
        progress: print one line per finished (world size, size) to stderr.
        check: compare each variant's first result with torch.distributed.all_reduce's.
        timeout: seconds allowed per launch (default: generous, from the sizes).
        one_launch: measure every size in one launch per world size (the same processes and sockets
            for all of them, as a figure comparing sizes wants); default one launch per size.
        cpu: also record every call's CPU time over all ranks and the machine's idle share
            (`Result.cpu_median`, `Result.idle_share`).
        network: a `course_lib.Network` (or its string form, e.g. "100 MB/s, 200 us"): every message
            takes that link's time on the ranks' modeled clocks, and each record carries the link's
            prediction (`Result.predicted`); 'builtin' takes the time of NCCL's choice of schedule there.
        arg_checks: time course_lib's cross-rank argument check too, as a learner's call has it.

    Returns:
        `Results`, a list of `Result` ordered by world size, size, variant.

    Example::

        >>> results = bench.run(sizes=["1KiB", "1MiB"], world_sizes=[2], reps=3)
        >>> [r.variant for r in results.where(nbytes="1KiB")]
        ['naive', 'parameter_server', 'ring', 'builtin']
    """
    sizes = [parse_bytes(s) for s in sizes]
    link = None if network is None else network_module.Network.parse(network)
    variants = _check_variants(variants, link)
    if reps < 1 or warmup < 0:
        raise ValueError(f"need reps >= 1 and warmup >= 0, got reps={reps}, warmup={warmup}")
    if course_lib.under_torchrun():
        return _run_under_torchrun(sizes, world_sizes, variants, reps, warmup, dtype, backend, progress, check, cpu,
                                   link, arg_checks)
    world_sizes = [2, 4] if world_sizes is None else [int(g) for g in world_sizes]
    if any(g < 2 for g in world_sizes):
        raise ValueError(f"all-reduce needs at least 2 ranks to measure anything; got world_sizes={world_sizes}")
    groups = [sizes] if one_launch else [[nbytes] for nbytes in sizes]
    results, total, done, started = Results(), len(groups) * len(world_sizes), 0, time.perf_counter()
    for world_size in world_sizes:
        for group in groups:
            limit = timeout or sum(_launch_timeout(n, world_size, len(variants), warmup + reps, variants, link)
                                   for n in group)
            records = course_lib.launch(_measure_on_launched_rank, world_size=world_size, backend=backend,
                                        args=(group, variants, reps, warmup, dtype, check, cpu, arg_checks),
                                        timeout=limit, network=link)[0]
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


def _run_under_torchrun(sizes, world_sizes, variants, reps, warmup, dtype, backend, progress, check,
                        cpu=False, link=None, arg_checks=False) -> Results:
    world_size = int(os.environ["WORLD_SIZE"])
    if world_sizes is not None and list(world_sizes) not in ([], [world_size]):
        raise ValueError(f"under torchrun the number of ranks is torchrun's WORLD_SIZE={world_size}; "
                         f"world_sizes={list(world_sizes)} cannot be run. Leave it out (CLI: omit --world-sizes).")
    launcher = importlib.import_module("course_lib.launch")      # the module: course_lib.launch is a function
    owns_group = not dist.is_initialized()
    if owns_group:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        if link is not None:
            backend = launcher._modeled_backend(backend)
        else:
            backend = course_lib.resolve_backend(backend, world_size, gpus_per_node=local_world)
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend)
    modeled = None
    try:
        if link is not None:
            modeled = launcher._torchrun_network(link, dist.get_rank(), world_size)
        results, started = Results(), time.perf_counter()
        for done, nbytes in enumerate(sizes, start=1):
            records = measure_in_rank(nbytes, variants, reps, warmup, dtype, check, cpu, arg_checks)
            results.extend(Result(**record) for record in records)
            if progress and dist.get_rank() == 0:
                _report_progress(done, len(sizes), started, results[-len(variants):])
        return results
    finally:
        if modeled is not None:
            _clock.deactivate()
            dist.barrier()
            launcher.end_torchrun_network(modeled)
        if owns_group:
            dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# Command line: python -m course_lib.bench
# --------------------------------------------------------------------------------------------------


def parser_default_variants() -> str:
    """--variants' default: the plain variants and the built-in."""
    return ",".join(VARIANTS)


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
    parser.add_argument("--variants", default=parser_default_variants(),
                        help=f"default %(default)s; 'all' = {','.join(ALL_VARIANTS)}")
    parser.add_argument("--reference", default=None,
                        help="variant to pair every other one with, per repetition (e.g. builtin or ring)")
    parser.add_argument("--reps", type=int, default=9, help="kept repetitions (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=1, help="discarded calls per variant (default %(default)s)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    parser.add_argument("--json", metavar="PATH", help="write the records and the run's description as JSON")
    parser.add_argument("--save", metavar="STEM",
                        help="write STEM.json and STEM.md (e.g. /tmp/bench_4ranks)")
    parser.add_argument("--plot", metavar="PATH", help="save a plot (matplotlib) of time and busbw against size")
    parser.add_argument("--no-check", action="store_true", help="skip comparing results with the built-in all_reduce")
    parser.add_argument("--cpu", action="store_true",
                        help="also record each call's CPU time (all ranks) and the machine's idle share")
    parser.add_argument("--network", default=None, metavar="LINK",
                        help="model a link under every message: a preset (1GbE, 10GbE, ib_ndr, nvlink4) or "
                             "'BANDWIDTH, LATENCY[, TOPOLOGY]', e.g. '100 MB/s, 200 us' or '1 GB/s, 5 us, full'")
    parser.add_argument("--arg-checks", action="store_true",
                        help="time course_lib's cross-rank argument check too, as a learner's call has it")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--nccl-tests", action="store_true",
                        help="with --network and no ranks launched: print what nccl-tests' all_reduce_perf would on "
                             "the model (torch's all-reduce as NCCL runs it), in its columns; --world-sizes for a "
                             "plain network, --tuning for NCCL's TUNING line of each call")
    parser.add_argument("--tuning", action="store_true", help="with --nccl-tests: NCCL's algorithm, protocol, channels")
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    sizes = _comma_list(args.sizes)
    if args.nccl_tests:
        if args.network is None:
            raise SystemExit("--nccl-tests prints the model's figures: give --network (e.g. 8x8:nvlink4,ib_ndr)")
        world_sizes = [int(g) for g in _comma_list(args.world_sizes)] if args.world_sizes else [None]
        for g in world_sizes:
            print(nccl_tests(args.network, sizes, g, tuning=args.tuning))
        return 0
    if course_lib.under_torchrun():
        world_sizes = None if args.world_sizes is None else [int(g) for g in _comma_list(args.world_sizes)]
    else:
        world_sizes = None if args.world_sizes is None else [int(g) for g in _comma_list(args.world_sizes)]
    link = None if args.network is None else network_module.Network.parse(args.network)
    if link is not None and args.variants == parser_default_variants():
        args.variants = ",".join(v for v in VARIANTS if v != "builtin")
    variants = _check_variants(_comma_list(args.variants), link)
    if args.reference is not None and args.reference not in variants:
        raise SystemExit(f"--reference {args.reference} is not among the variants timed ({','.join(variants)})")
    load_before = machine_description()["loadavg"]
    results = run(sizes, world_sizes, variants, reps=args.reps, warmup=args.warmup,
                  dtype=args.dtype, backend=args.backend, progress=not args.quiet, check=not args.no_check,
                  cpu=args.cpu, network=link, arg_checks=args.arg_checks)
    if course_lib.under_torchrun() and int(os.environ["RANK"]) != 0:
        return 0  # every rank has the same records; rank 0 reports them
    print(results.table(args.reference))
    meta = {"command": "python -m course_lib.bench " + shlex.join(sys.argv[1:] if argv is None else list(argv)),
            "reps": args.reps, "warmup": args.warmup, "reference": args.reference, "network": args.network,
            "loadavg_before": load_before, "loadavg_after": machine_description()["loadavg"]}
    if args.json:
        results.to_json(args.json, meta=meta)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.save:
        for path in results.save(args.save, args.reference, meta=meta):
            print(f"wrote {path}", file=sys.stderr)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")  # a terminal has no display
        results.plot(args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0 if all(r.correct for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
