"""The capstone of notebook 11, "beat the ring": any all-reduce, timed on modeled links, scored against the best
known schedule at every size.

    beat_the_ring(tensor, link) -> None

`tensor` is this rank's 1-D float32 tensor; afterwards every rank holds the sum, in place (like
torch.distributed.all_reduce). `link` is the `course_lib.Network` the time is taken on: the function may read
``link.latency`` and ``link.bandwidth`` (and call ``link.predict``) to choose its schedule, as NCCL's tuner
reads the topology. Any algorithm, any mix; built-in collectives and course_lib's own all-reduces are off limits.

How it is timed
---------------
The learner's function runs on real ranks (gloo, this machine); every send, receive and wait it makes is
recorded in program order (`tracing.Tracer.events`). The judge then *replays* that schedule on the modeled
link with `course_lib.simulation.replay`, the very simulation a launch under `network=` runs (topology
"switch"): a message of n bytes from s to d

    leaves s's outgoing side when it is free:     start = max(now_s, out_free_s),  out_free_s = start + n/B
    enters d's incoming side when that is free (first come, first served), arrives a later:
                                                  arrival = in_start + n/B + a
    a blocking send (or an isend's wait) ends at out_free_s; a receive (or an irecv's wait) at max(now_d, arrival)

and compute takes no time. The time is the last rank's clock. It depends only on the schedule, so the same
code scores the same on every run and every machine (a loaded machine slows the real run, not the replay),
and it is the time `course_lib.launch(..., network=link)` reads on the modeled clock for the same schedule
(benchmarks/capstone_repeatability.py compares the two). Nothing the ranks report is trusted as a time: they
report what they sent and received, and the judge times it.

Where it is timed
-----------------
Two links from `course_lib.network.PRESETS` (`LINKS`): InfiniBand NDR (``ib_ndr``: 48 GB/s, 5 us, so a
latency is worth a B = 240 KB: latency rules up to hundreds of KiB) and Gigabit Ethernet (``1GbE``: 117.7 MB/s,
50 us, a B = 5.9 KB: the bytes rule from tens of KiB), G = 4 and 8 ranks, 4 KiB, 64 KiB, 1 MiB and 16 MiB
per rank (64 MiB, timed until the links were these presets, added nothing: halving-doubling is best there on both,
as at 16 MiB, and it cost the check most of its time and memory). At each (link, G, size) the best of four is the fastest of the course's ring, tree,
recursive doubling and halving-doubling under the same model (`Network.predict`): on these G (powers of two)
recursive doubling below a size that depends on the link, halving-doubling above it. The learner's score there is
best / yours. A size's rubric line is met when the score is at least 90% on both links and both G. Beside them the
lower bounds no point-to-point schedule passes on this model: one latency (every rank must hear from every other, and
here a rank's messages may all be in flight at once: the naive exchange pays a single latency; with one message at a
time per rank the bound would be ceil(log2 G) latencies), and 2 (G-1)/G S / B (some rank must send at least
2 (G-1)/G S bytes through its one link: Patarasuk and Yuan 2009; for messages that carry the tensor's own 4-byte
elements). Notation as in docs/notation.md.

Correct results are required: on small tagged and random tensors (G = 1..8, lengths that do not divide by G)
the whole result is compared, and on the timed tensors 2,000-odd positions (chunk boundaries included) are.
"""

from __future__ import annotations

import math
import torch

from course_lib.exercises import data, feedback
from course_lib.exercises.allreduce_variants import _result_problems
from course_lib.exercises.cases import clone, standard_cases
from course_lib.exercises.registry import Case, FunctionExercise, Problem, register
from course_lib.exercises.rubric import Family, RubricLine
from course_lib.simulation import ScheduleError, Timing
from course_lib.simulation import replay as _replay

__all__ = ["BeatTheRing", "LINKS", "SIZES", "WORLD_SIZES", "replay", "Timing", "ReplayError", "best_known",
           "latency_bound", "bandwidth_bound", "timed_input", "sample_positions", "REFERENCES", "THRESHOLD",
           "on_every_link", "timed_cases", "in_check_order"]

KiB, MiB = 1024, 1024 * 1024
SIZES = (4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB)      # bytes per rank
WORLD_SIZES = (4, 8)
REFERENCES = ("ring", "tree", "recursive_doubling", "halving_doubling")
THRESHOLD = 0.9            # a size's line: best / yours >= 90% on both links and both G


def _links():
    from course_lib.network import Network

    return (Network.preset("ib_ndr"), Network.preset("1GbE"))


LINKS = _links()


def size_name(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"


def _seconds(value: float) -> str:
    for unit, size in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if value >= size:
            return f"{value / size:.3g} {unit}"
    return f"{value * 1e9:.3g} ns"


# --------------------------------------------------------------------------------------------------
# Inputs big enough to time, made on the ranks from a formula the judge can evaluate anywhere
# --------------------------------------------------------------------------------------------------


PERIOD = 65521   # a prime: no chunk boundary (sizes are powers of two) is a multiple of it


def _table(rank: int, seed: int) -> torch.Tensor:
    """One period of rank r's values: ((k (2654435761 + 2r) + seed 9973) mod 65536) / 65536 - 1/2, k < PERIOD.
    Multiples of 2^-16 in [-1/2, 1/2): a sum over 8 ranks is exact in float32, in any order."""
    k = torch.arange(PERIOD, dtype=torch.int64)
    mixed = (k * (2654435761 + 2 * rank) + seed * 9973) % 65536
    return (mixed.to(torch.float64) / 65536 - 0.5).to(torch.float32)


def _values(index: torch.Tensor, rank: int, seed: int) -> torch.Tensor:
    """x_r[i] = table_r[i mod PERIOD]: different on every rank and, within a period, at every position."""
    return _table(rank, seed)[index.to(torch.int64) % PERIOD]


def timed_input(numel: int, rank: int, seed: int) -> torch.Tensor:
    """Rank `rank`'s tensor for a timed case, made on the rank (16 MiB per rank would not travel as data): the
    period repeated, a memory copy rather than arithmetic on every element."""
    table = _table(rank, seed)
    return table.repeat(-(-numel // PERIOD))[:numel].clone()


def sample_positions(numel: int, world_size: int) -> torch.Tensor:
    """The positions whose sums the judge checks on a timed case: 2,048 spread over the tensor, and the first and
    last element of every chunk of G (where an off-by-one cut shows)."""
    spread = torch.linspace(0, numel - 1, 2048).round().to(torch.int64)
    sizes = data.chunk_sizes(numel, world_size)
    starts = torch.tensor([sum(sizes[:c]) for c in range(world_size)], dtype=torch.int64)
    edges = torch.cat([starts, starts + torch.tensor(sizes) - 1, torch.tensor([numel - 1])])
    return torch.unique(torch.cat([spread, edges.clamp(0, numel - 1)]))


# --------------------------------------------------------------------------------------------------
# The replay
# --------------------------------------------------------------------------------------------------

# The replay is the modeled network's own simulation (course_lib.simulation): the same equations, the same code
# as a launch under `network=`.
ReplayError = ScheduleError


def replay(events_by_rank, link) -> Timing:
    """Time a recorded schedule on `link` (see the module docstring and `course_lib.simulation.replay`)."""
    return _replay(events_by_rank, link)


def best_known(link, nbytes: int, world_size: int) -> tuple[str, float]:
    """(name, seconds) of the fastest of the course's four schedules (`REFERENCES`) for this size on this link:
    the best known to the course, not to the field (NCCL's pipelined trees, channels and NVLS are not among them)."""
    times = {name: link.predict(name, nbytes, world_size) for name in REFERENCES}
    name = min(times, key=lambda n: (times[n], REFERENCES.index(n)))
    return name, times[name]


def latency_bound(link, world_size: int) -> float:
    """a: every rank must hear from every other, and on this model a rank's messages may all be in flight at once (the
    naive exchange's are), so one latency is the least; ceil(log2 G) a holds only with one message at a time."""
    return link.latency if world_size > 1 else 0.0


def bandwidth_bound(link, nbytes: int, world_size: int) -> float:
    """2 (G-1)/G S / B: in any all-reduce some rank sends at least that many bytes through its one link (Patarasuk and
    Yuan 2009), for messages that carry the tensor's own elements."""
    return 2 * (world_size - 1) / world_size * nbytes / link.bandwidth


# --------------------------------------------------------------------------------------------------
# The exercise
# --------------------------------------------------------------------------------------------------


def _size_line_key(nbytes: int) -> str:
    return "t_" + size_name(nbytes).replace(" ", "").lower()


def _timed_family(nbytes):
    return Family(f"timed at {size_name(nbytes)} per rank (both links, G = 4 and 8)",
                  lambda case, n=nbytes: case.data == "timed" and case.numel * 4 == n)


def on_every_link(cases) -> list[Case]:
    """Each of `cases` once per link (a case's root is its link's index into LINKS)."""
    return [Case(c.world_size, c.numel, c.data, c.seed, link, c.hidden) for c in cases for link in range(len(LINKS))]


def timed_cases(world_sizes) -> list[Case]:
    """A timed case for every G in `world_sizes`, every size in SIZES and every link."""
    return [Case(G, nbytes // 4, "timed", 0, link) for G in world_sizes for nbytes in SIZES
            for link in range(len(LINKS))]


def in_check_order(cases) -> list[Case]:
    """The order the cases run and are reported in: by G, the small cases before the timed ones, by length."""
    return sorted(cases, key=lambda c: (c.world_size, c.data == "timed", c.numel))


class BeatTheRing(FunctionExercise):
    observed = ("after", "samples", "events")

    def cases(self):
        # The learner's check times G = 4 (the table, in about ten seconds); the grader's cases time G = 8 as well.
        return in_check_order(on_every_link(standard_cases()) + timed_cases(WORLD_SIZES[:1]))

    def inputs(self, case):
        if case.data == "timed":
            return [{"numel": case.numel, "seed": case.seed}] * case.world_size
        return [data.make_input(case, rank) for rank in range(case.world_size)]

    def oracle(self, case, inputs):
        if case.data != "timed":
            return [{**facts, "link": case.root} for facts in data.all_reduce_oracle(inputs)]
        positions = sample_positions(case.numel, case.world_size)
        expected = torch.stack([_values(positions, r, case.seed).double() for r in range(case.world_size)]).sum(0)
        return [{"positions": positions, "expected_samples": expected.float()} for _ in range(case.world_size)]

    def tracer_options(self, case):
        if case.data == "timed":        # sizes only: copies of 16 MiB messages would double every rank's memory
            return {"keep_data": False, "landing": False, "largest_message": 0}
        return {}

    def run_case(self, call, case, rank, world_size, inputs):
        link = LINKS[case.root]
        if case.data != "timed":
            tensor = inputs.clone()
            call(tensor, link)
            return {"after": clone(tensor), "events": list(call.tracer.events)}
        tensor = timed_input(inputs["numel"], rank, inputs["seed"])
        call(tensor, link)
        samples = tensor.reshape(-1)[sample_positions(case.numel, world_size)].clone() \
            if tensor.numel() == case.numel else tensor.reshape(-1)[:0].clone()
        return {"samples": samples, "events": list(call.tracer.events)}

    def judge(self, case, records, complete=True):
        if not complete:
            return []
        if case.data != "timed":
            return _result_problems(case, records, "your all-reduce")
        problems = self._sample_problems(case, records)
        G, N = case.world_size, case.numel
        for rank, record in enumerate(records):
            received = sum(e[2] for e in record["events"] if isinstance(e, tuple) and e[0] in ("recv", "irecv"))
            if G > 1 and received < 4 * N:
                return problems + [Problem(
                    f"rank {rank} received {received:,} bytes; every rank must receive at least S = {4 * N:,} bytes "
                    "(the sum at each of its positions needs the other ranks' values, and they arrive only by "
                    "messages): its result did not come through the messages the check traces.", order=(-1, rank))]
        link = LINKS[case.root]
        try:
            timing = replay([record["events"] for record in records], link)
        except (ReplayError, TypeError, ValueError, IndexError, KeyError) as exc:
            return problems + [Problem(feedback.readable(f"the schedule could not be timed: {exc}"), order=(-1,))]
        best_name, best = best_known(link, 4 * N, G)
        score = best / timing.seconds if timing.seconds > 0 else 1.0
        records[0]["timing"] = (timing, best_name, best, score)
        if score < THRESHOLD:
            same = [name for name in REFERENCES if abs(link.predict(name, 4 * N, G) - timing.seconds) <= 1e-9 + 1e-6 * best]
            problems.append(Problem(
                f"{size_name(4 * N)} per rank on {G} ranks over the {link.name} link ({_link_text(link)}): yours took "
                f"{_seconds(timing.seconds)}" + (f" (exactly {_names[same[0]]}'s time)" if same else "")
                + f", {_names[best_name]} takes {_seconds(best)} there: {100 * score:.0f}% of "
                f"the best of the course's four schedules (the line asks for {100 * THRESHOLD:.0f}%). " + _where(timing, link, 4 * N, G),
                order=(5, G, N), line=_size_line_key(4 * N)))
        return problems

    def _sample_problems(self, case, records):
        for rank, record in enumerate(records):
            samples, positions, expected = record["samples"], record["positions"], record["expected_samples"]
            if not isinstance(samples, torch.Tensor) or samples.shape != expected.shape:
                return [Problem(f"rank {rank}'s tensor changed size: write the sum into `tensor` itself, in place.",
                                order=(0, rank), line="values")]
            bad = (samples != expected).nonzero()
            if bad.numel():
                i = int(bad[0])
                chunk = _chunk_of(int(positions[i]), case.numel, case.world_size)
                return [Problem(
                    f"{size_name(4 * case.numel)} on {case.world_size} ranks: rank {rank}'s element {int(positions[i])} "
                    f"(in chunk {chunk} of {case.world_size}) is {float(samples[i]):.6g}; the sum over every rank is "
                    f"{float(expected[i]):.6g}.", order=(0, rank), line="values")]
        return []

    def report_lines(self, case_results):
        """The table of where the time went: one row per timed case that ran."""
        rows = []
        for result in case_results:
            if result.case.data != "timed" or not result.records or "timing" not in (result.records[0] or {}):
                continue
            timing, best_name, best, score = result.records[0]["timing"]
            link, G, nbytes = LINKS[result.case.root], result.case.world_size, 4 * result.case.numel
            rows.append(f"  {link.name:<15} {G:>2} {size_name(nbytes):>7} {_seconds(timing.seconds):>9} "
                        f"{_names[best_name]:>18} {_seconds(best):>9} {100 * score:>5.0f}% "
                        f"{_seconds(latency_bound(link, G)):>9} {_seconds(bandwidth_bound(link, nbytes, G)):>9} "
                        f"{timing.latencies:>4} {timing.busiest_bytes / nbytes:>6.2f}S")
        if not rows:
            return []
        return ["Where the time went (modeled clock; score = best of four / yours; bounds: one latency a and "
                "2(G-1)/G S/B;", "  hops = latencies on your critical path, link = bytes through your busiest link):",
                f"  {'link':<15} {'G':>2} {'size':>7} {'yours':>9} {'best of four':>18} {'time':>9} {'score':>6} "
                f"{'lat.bound':>9} {'bw.bound':>9} {'hops':>4} {'link':>7}", *rows]


_names = {"ring": "the ring", "tree": "the tree", "recursive_doubling": "recursive doubling",
          "halving_doubling": "halving-doubling"}


def _link_text(link) -> str:
    from course_lib.network import _format_bandwidth

    return f"{_format_bandwidth(link.bandwidth)}, {_seconds(link.latency)}"


def _where(timing, link, nbytes, G) -> str:
    """Where a slow schedule's time went, in words: latencies on its critical path, bytes through its busiest link."""
    latency_part = timing.latencies * link.latency
    wire = timing.busiest_bytes / link.bandwidth
    text = (f"Your critical path has {timing.latencies} latencies ({_seconds(latency_part)}; the bound is one, and "
            f"recursive doubling takes ceil(log2 G) = {math.ceil(math.log2(G))}), and your busiest link carries {timing.busiest_bytes / nbytes:.2f} S "
            f"bytes, S the tensor's ({_seconds(wire)}; the bound is 2(G-1)/G S = {2 * (G - 1) / G:.2f} S).")
    if latency_part > wire:
        text += " Latencies dominate here: fewer steps one after another (recursive doubling: log2 G swaps)."
    else:
        text += (" Bytes dominate here: send each byte fewer times (the ring and halving-doubling move 2(G-1)/G S per "
                 "rank; a tree or recursive doubling move S per step).")
    return text


def _chunk_of(index, numel, G) -> int:
    offset = 0
    for chunk, size in enumerate(data.chunk_sizes(numel, G)):
        if index < offset + size:
            return chunk
        offset += size
    return G - 1


_VALUES = RubricLine("values", "every rank ends with the sum over all ranks, in place: whole results on small tagged and "
                               "random tensors (G = 1..8, lengths that do not divide by G, both links), sampled "
                               "positions on the timed ones", 4)

register(BeatTheRing(
    name="beat_the_ring", notebook="11_beat_the_ring", points=10,
    signature="beat_the_ring(tensor, link) -> None",
    summary="any all-reduce (sum, in place), its schedule replayed on the modeled clock over InfiniBand NDR and Gigabit "
            "Ethernet at 4 KiB to 16 MiB, G = 4 and 8; each size scored against the fastest of ring, tree, recursive "
            "doubling and halving-doubling there",
    rubric=(_VALUES,) + tuple(
        RubricLine(_size_line_key(n), f"{size_name(n)} per rank: at least {100 * THRESHOLD:.0f}% of the best of the "
                                      "course's four schedules' speed on both links, G = 4 and 8 (correct results required)",
                   1.5, family=_timed_family(n)) for n in SIZES),
    root_name="link", forbidden=("collectives", "allreduce", "fast_allreduce"), time_factor=5.0))
