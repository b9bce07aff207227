"""Notebook 13: the hierarchical all-reduce, written by the learner, checked from its messages and timed on a cluster.

    hierarchical_allreduce(tensor, node_size) -> None

The G ranks sit in nodes of `node_size` = K consecutive ranks: node m holds ranks mK .. mK + K - 1, and a rank's
**local rank** is i = r mod K. Inside a node the ranks talk over fast links (NVLink), between nodes over slow ones
(InfiniBand). Every rank ends with the sum over all ranks, in place, after three phases:

1. **reduce-scatter inside the node**: the node's k ranks cut the tensor into k **shards**
   (``torch.tensor_split(tensor, k)``) and run the ring's scatter-reduce among themselves: in step s = 0 .. k-2
   local rank i sends shard (i - s) mod k to local rank (i + 1) mod k, receives shard (i - s - 1) mod k from
   local rank (i - 1) mod k and adds it. Local rank i then holds shard (i + 1) mod k summed over its node;
2. **across the nodes, on its rail**: the ranks with the same local rank on the M nodes (a **rail**: on a
   rail-optimised cluster they share a network of their own) all-reduce that shard with the ring of notebook 05:
   the shard cut into M **pieces**, M - 1 scatter-reduce steps (node m sends piece (m - s) mod M to node
   m + 1's rank on its rail) and M - 1 all-gather steps (piece (m + 1 - s) mod M);
3. **all-gather inside the node**: the ring's all-gather among the node's k ranks: in step s local rank i sends
   shard (i + 1 - s) mod k to local rank i + 1; the receiver copies it.

With one node (K >= G) phase 2 is empty and this is the ring of notebook 05; with K = 1 every rank is a node and
phases 1 and 3 are empty: a flat ring. The ring's two conventions are both accepted: a rank may end phase 1
holding shard (i + 1) mod k (notebook 04's ring) or shard i (torch's reduce_scatter), the same in phase 2, and
the rings may run to the left instead of the right; the check infers which from the messages.

**A node size that does not divide G.** The last node is then smaller: the E = G mod K ranks beyond the last
full node. Its ranks are folded in, as halving-doubling folds its extra ranks (notebook 11): rank r >= G - E
first sends its whole tensor to rank r - K (the rank with its local rank on the last full node), which adds it
to its own; the full nodes run the three phases; at the end rank r - K sends the result back to rank r. (A
smaller node cannot join the rails: it would cut the tensor into fewer shards than the others, so its shards
would not line up with theirs.)

How it is checked
-----------------
On G = 1 .. 8 ranks with several node sizes, on tagged tensors (every element of rank r's tensor at position p
holds 2**r + p * 2**G: a sum says exactly whose contributions it holds and which position it came from) and on
random ones, some of lengths that do not divide. The check reads every message the ranks sent: its peer, its
size, which positions it carried and whose contributions; the first message that differs from the schedule is
named with its phase, step, rank, shard and piece. Then every rank's result is compared with the sum.

How it is timed
---------------
On G = 8 ranks (2 nodes of 4; the grader adds 4 nodes of 2) at 1 MiB per rank, the schedule the ranks really
made (every send, receive and wait, in program order, `tracing.Tracer.events`) is replayed on two modeled
clusters (`course_lib.simulation.replay`, the simulation a launch under ``network=`` runs): H100 nodes on NVSwitch
(``nvlink4``) joined by InfiniBand NDR (``ib_ndr``), one port per GPU and one per node. The reference is
``Cluster.predict("hierarchical", ...)``, the library's schedule of the same three phases; the line is met when
yours takes at most 1/0.9 of it on both. The score depends on the schedule alone, not on this machine.

`record_schedule(fn, world_size, numel, *args)` records an SPMD all-reduce's schedule without launching ranks
(every rank's calls, in one process, on tensors without data), so a notebook can time your function at 64 and
128 ranks and 64 MiB per rank with `simulation.replay`.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch

from course_lib import viz
from course_lib.exercises import data, feedback
from course_lib.exercises.cases import clone
from course_lib.exercises.registry import Case, FunctionExercise, Problem, register
from course_lib.exercises.rubric import SINGLE_RANK, Family, RubricLine
from course_lib.recording import record_schedule  # noqa: F401 - notebook 13 calls it from here
from course_lib.schedules import pieces

__all__ = ["HierarchicalAllReduce", "Layout", "Expected", "Ring", "plan", "STYLES", "DEFAULT_STYLE", "positional_input",
           "record_schedule", "draw_schedule", "timed_clusters", "THRESHOLD", "TIMED_BYTES", "node_sizes_for",
           "hierarchical_cases", "timed_case", "in_check_order"]

KiB, MiB = 1024, 1024 * 1024
TIMED_BYTES = 1 * MiB       # bytes per rank of the timed cases
THRESHOLD = 0.9             # the timed line: the library's schedule's time / yours >= 90% on both clusters


# --------------------------------------------------------------------------------------------------
# Who is where: nodes, local ranks, the folded ranks of a node that is not full
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """G ranks in nodes of `node_size`: the nodes that run the three phases and the ranks folded into them.

    Attributes:
        world_size: G.
        node_size: K as given.
        k: ranks per node that takes part (min(K, G)).
        nodes: M, the nodes that take part (G // K full nodes, or 1 when K >= G).
        extra: E, the ranks of the smaller last node that are folded in (0 when K divides G or K >= G).
    """

    world_size: int
    node_size: int

    @property
    def k(self) -> int:
        return min(self.node_size, self.world_size)

    @property
    def nodes(self) -> int:
        return max(1, self.world_size // self.k)

    @property
    def extra(self) -> int:
        return self.world_size - self.nodes * self.k

    def node(self, rank: int) -> int:
        return rank // self.k

    def local(self, rank: int) -> int:
        return rank % self.k

    def rank(self, node: int, local: int) -> int:
        return node * self.k + local

    def folded(self, rank: int) -> bool:
        """A rank of the smaller last node (it hands its tensor to rank - K and gets the result back)."""
        return rank >= self.nodes * self.k

    def host(self, rank: int) -> int | None:
        """The rank a folded rank folds into, or the folded rank a host serves (None for the others)."""
        if self.folded(rank):
            return rank - self.k
        guest = rank + self.k
        return guest if self.extra and guest < self.world_size and self.folded(guest) else None

    @functools.lru_cache(maxsize=None)
    def team(self, rank: int) -> frozenset:
        """Whose data a rank that takes part adds in: its own and its guest's."""
        guest = self.host(rank)
        return frozenset({rank} | ({guest} if guest is not None else set()))

    @functools.lru_cache(maxsize=None)
    def node_team(self, node: int) -> frozenset:
        return frozenset().union(*(self.team(self.rank(node, i)) for i in range(self.k)))

    def describe(self) -> str:
        text = f"{self.nodes} node{'s' if self.nodes > 1 else ''} of {self.k}"
        if self.extra:
            text += (f", and a last node of {self.extra} (rank{'s' if self.extra > 1 else ''} "
                     f"{', '.join(str(r) for r in range(self.world_size - self.extra, self.world_size))}) folded into "
                     f"the last full node")
        return text


# --------------------------------------------------------------------------------------------------
# The schedule, message by message
# --------------------------------------------------------------------------------------------------

PHASES = ("fold", "reduce-scatter inside", "across: scatter-reduce", "across: all-gather", "all-gather inside",
          "unfold")
LINE_OF_PHASE = {"fold": "partial_node", "unfold": "partial_node", "reduce-scatter inside": "reduce_scatter",
                 "across: scatter-reduce": "across", "across: all-gather": "across", "all-gather inside": "all_gather"}


@dataclass(frozen=True)
class Ring:
    """One ring's convention: `direction` +1 (send to the right, i + 1) or -1; `offset` 1 (member j ends its
    scatter-reduce holding chunk j + 1, notebook 04) or 0 (chunk j, torch's reduce_scatter)."""

    direction: int = 1
    offset: int = 1

    def scatter_chunk(self, j: int, step: int, n: int) -> int:
        return (j - self.direction * step + self.direction * (self.offset - 1)) % n

    def owned(self, j: int, n: int) -> int:
        return (j + self.direction * self.offset) % n

    def gather_chunk(self, j: int, step: int, n: int) -> int:
        return (self.owned(j, n) - self.direction * step) % n

    def next(self, j: int, n: int) -> int:
        return (j + self.direction) % n

    def words(self) -> str:
        side = "right (i + 1)" if self.direction == 1 else "left (i - 1)"
        return f"to the {side}"


RINGS = (Ring(1, 1), Ring(1, 0), Ring(-1, 1), Ring(-1, 0))
# (inside the node, across the nodes): the notebook's first; the check picks whichever fits the messages best
STYLES = tuple(itertools.product(RINGS, RINGS))
DEFAULT_STYLE = STYLES[0]


@dataclass(frozen=True)
class Expected:
    """One message a rank's schedule sends.

    Attributes:
        phase: one of `PHASES`; step: the step within it.
        peer: the rank it goes to.
        lo, hi: the positions of the tensor it carries, [lo, hi).
        holds: whose contributions every element holds.
        what: the piece in the learner's words ('shard 2 of 4', 'piece 1 of 2 of shard 3', 'its whole tensor').
        rule: why this peer and this piece, in words.
    """

    phase: str
    step: int
    peer: int
    lo: int
    hi: int
    holds: frozenset
    what: str
    rule: str

    @property
    def size(self) -> int:
        return self.hi - self.lo

    def where(self, rank: int, layout: Layout) -> str:
        if self.phase in ("fold", "unfold"):
            return f"{self.phase}: rank {rank}"
        if self.phase.startswith("across"):
            return (f"{self.phase} step {self.step} on rail {layout.local(rank)} (local rank {layout.local(rank)} of "
                    f"every node): rank {rank} (node {layout.node(rank)})")
        return (f"{self.phase} node {layout.node(rank)} step {self.step}: rank {rank} (local rank "
                f"{layout.local(rank)})")


def _offsets(sizes):
    out, total = [], 0
    for size in sizes:
        out.append(total)
        total += size
    return out


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    if not ranks:
        return "none"
    runs, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            runs.append(str(start) if start == a else f"{start}-{a}" if a > start + 1 else f"{start}, {a}")
            start = b
    return ", ".join(runs)


@functools.lru_cache(maxsize=512)
def plan(world_size: int, node_size: int, numel: int, style=DEFAULT_STYLE) -> dict:
    """{rank: [Expected, ...]}: every message of the hierarchical all-reduce, in the order each rank sends them.

    `style` is (inside, across): the `Ring` conventions of the two rings (see the module docstring). Cached: treat
    the answer as read-only."""
    layout = Layout(world_size, node_size)
    inside, across = style
    G, k, M = world_size, layout.k, layout.nodes
    everyone = data.everyone(G)
    shard_sizes = pieces(numel, k)
    shard_starts = _offsets(shard_sizes)
    out = {r: [] for r in range(G)}
    if G == 1:
        return out
    for r in range(G):
        if layout.folded(r):
            host = layout.host(r)
            out[r].append(Expected("fold", 0, host, 0, numel, frozenset({r}), "its whole tensor",
                                   f"the last node is smaller than node_size = {node_size}: its ranks fold in first, "
                                   f"rank r sending its whole tensor to rank r - {node_size} = {host}."))
    for m in range(M):
        base = layout.rank(m, 0)
        for i in range(k):
            r = base + i
            peer = base + inside.next(i, k)
            for s in range(k - 1):
                c = inside.scatter_chunk(i, s, k)
                holds = frozenset().union(*(layout.team(base + (i - inside.direction * t) % k) for t in range(s + 1)))
                out[r].append(Expected(
                    "reduce-scatter inside", s, peer, shard_starts[c], shard_starts[c] + shard_sizes[c], holds,
                    f"shard {c} of {k}",
                    f"inside a node of K = {k} the ring sends {inside.words()}, local rank {inside.next(i, k)} = rank "
                    f"{peer}, and in step {s} local rank {i} sends shard {c} of its K = {k} shards "
                    f"(torch.tensor_split(tensor, {k})), holding the sum of ranks {_ranks(holds)}."))
    for m in range(M):
        for i in range(k):
            r = layout.rank(m, i)
            own = inside.owned(i, k)
            lo, size = shard_starts[own], shard_sizes[own]
            piece_sizes = pieces(size, M)
            piece_starts = [lo + o for o in _offsets(piece_sizes)]
            peer = layout.rank(across.next(m, M), i)
            for s in range(M - 1):
                c = across.scatter_chunk(m, s, M)
                holds = frozenset().union(*(layout.node_team((m - across.direction * t) % M) for t in range(s + 1)))
                out[r].append(Expected(
                    "across: scatter-reduce", s, peer, piece_starts[c], piece_starts[c] + piece_sizes[c], holds,
                    f"piece {c} of {M} of shard {own}",
                    f"across the nodes each rank talks only to its rail, the same local rank {i} on the next node "
                    f"{across.words()}: node {across.next(m, M)}'s rank {peer}. It all-reduces the shard it holds "
                    f"complete for its node (shard {own}) cut into M = {M} pieces; scatter-reduce step {s} sends piece "
                    f"{c}, holding the sum of nodes {_ranks((m - across.direction * t) % M for t in range(s + 1))} "
                    f"(ranks {_ranks(holds)})."))
            for s in range(M - 1):
                c = across.gather_chunk(m, s, M)
                out[r].append(Expected(
                    "across: all-gather", s, peer, piece_starts[c], piece_starts[c] + piece_sizes[c], everyone,
                    f"piece {c} of {M} of shard {own}",
                    f"in the all-gather across the nodes, step {s}, node {m}'s rank on rail {i} sends piece {c} of "
                    f"shard {own}, complete (the sum over every rank), to rank {peer}."))
    for m in range(M):
        base = layout.rank(m, 0)
        for i in range(k):
            r = base + i
            peer = base + inside.next(i, k)
            for s in range(k - 1):
                c = inside.gather_chunk(i, s, k)
                out[r].append(Expected(
                    "all-gather inside", s, peer, shard_starts[c], shard_starts[c] + shard_sizes[c], everyone,
                    f"shard {c} of {k}",
                    f"in the all-gather inside the node, step {s}, local rank {i} sends shard {c} (complete: the sum "
                    f"over every rank) to local rank {inside.next(i, k)} = rank {peer}."))
            guest = layout.host(r)
            if guest is not None:
                out[r].append(Expected("unfold", 0, guest, 0, numel, everyone, "the result",
                                       f"after the all-gather rank {r} sends the result back to the rank that folded "
                                       f"into it, rank {guest}."))
    return out


# --------------------------------------------------------------------------------------------------
# Reading a message: which positions it carried, whose data they hold
# --------------------------------------------------------------------------------------------------


def positional_input(rank: int, world_size: int, numel: int) -> torch.Tensor:
    """Rank `rank`'s tagged input: element p holds viz.tag(rank, p, G) = 2**rank + p * 2**G, so a sum of such
    values says whose contributions it holds (the low G bits) and which position it came from. Exact in float32
    for G <= 8 and fewer than 8,192 elements."""
    return torch.tensor([viz.tag(rank, p, world_size) for p in range(numel)], dtype=torch.float32)


def _read(values, world_size):
    """('ok', holds, positions) when every element is a tag sum over one set of ranks; ('mixed', None, positions)
    when elements hold different ranks; ('bad', None, None) when a value is no sum of distinct ranks' tags."""
    flat = data.as_float_tensor(values)
    if flat is None:
        return "bad", None, None
    holds, positions = set(), []
    for value in flat.tolist():
        try:
            ranks, position = viz.decode_tag(value, world_size)
        except (ValueError, OverflowError):
            return "bad", None, None
        if position is None:             # a 0: no rank's data at all (a buffer never filled)
            return "bad", None, None
        holds.add(ranks)
        positions.append(position)
    return ("ok", holds.pop(), positions) if len(holds) == 1 else ("mixed", None, positions)


def _which_piece(layout, numel, positions, style):
    """The shard (or piece) a run of positions is, in words, if it is one."""
    lo, hi = min(positions), max(positions) + 1
    if sorted(positions) != list(range(lo, hi)):
        return f"elements {_ranks(positions)}"
    k, M = layout.k, layout.nodes
    starts, sizes = _offsets(pieces(numel, k)), pieces(numel, k)
    for c in range(k):
        if (starts[c], starts[c] + sizes[c]) == (lo, hi):
            return f"shard {c} of {k} (elements {lo}..{hi - 1})"
    for c in range(k):
        ps, pz = _offsets(pieces(sizes[c], M)), pieces(sizes[c], M)
        for q in range(M):
            if (starts[c] + ps[q], starts[c] + ps[q] + pz[q]) == (lo, hi):
                return f"piece {q} of {M} of shard {c} (elements {lo}..{hi - 1})"
    return f"elements {lo}..{hi - 1}"


def _content_problem(case, layout, rank, message, want: Expected):
    """What is wrong with what a message carried (tagged data only), in words, or None."""
    if case.data != "tagged" or message.data is None or message.numel == 0:
        return None
    status, holds, positions = _read(message.data, case.world_size)
    where = f"{want.where(rank, layout)} sent rank {message.peer}"
    if status == "bad" and _averaged_message(case, message, want):
        return (f"{where} {want.what} holding the sum of ranks {_ranks(want.holds)} divided by G = {case.world_size}: "
                f"an average. hierarchical_allreduce must leave the sum over every rank, not the average: take out "
                f"the division by the world size.")
    if status == "bad":
        return (f"{where} values that are no sum of distinct ranks' data: a contribution was added twice (or a "
                f"received result added instead of copied). It should carry {want.what}, holding the sum of ranks "
                f"{_ranks(want.holds)}.")
    if positions != list(range(want.lo, want.hi)):
        if not (len(set(positions)) == len(positions) and 0 <= min(positions) and max(positions) < case.numel
                and sorted(positions) == list(range(min(positions), max(positions) + 1))):
            return (f"{where} values that are no sum of distinct ranks' data at their positions: a contribution was "
                    f"added twice (or a received result added instead of copied). It should carry {want.what}, "
                    f"holding the sum of ranks {_ranks(want.holds)}.")
        got = _which_piece(layout, case.numel, positions, None)
        return (f"{where} {got}; it should send {want.what} (elements {want.lo}..{want.hi - 1}): " + want.rule)
    if status == "mixed":
        return (f"{where} {want.what} with elements holding different ranks' contributions: part of it was summed and "
                f"part not. Every element should hold the sum of ranks {_ranks(want.holds)}.")
    if holds == want.holds:
        return None
    if rank in want.holds and rank not in holds and holds < want.holds:
        return (f"{where} {want.what} holding the sum of ranks {_ranks(holds)}, without its own values: it overwrote "
                f"its shard with what it received instead of adding to it (+=). It should hold the sum of ranks "
                f"{_ranks(want.holds)}.")
    if holds == {rank} and len(want.holds) > 1:
        return (f"{where} {want.what} holding only its own input; by this step it should hold the sum of ranks "
                f"{_ranks(want.holds)}: add what it received before sending it on.")
    return (f"{where} {want.what} holding the sum of ranks {_ranks(holds)}; at this step it should hold the sum of "
            f"ranks {_ranks(want.holds)}.")


def _averaged_message(case, message, want) -> bool:
    """True when a tagged message carries the positions and ranks it should, each value divided by G."""
    if case.data != "tagged" or message.data is None or message.numel == 0 or case.world_size < 2:
        return False
    flat = data.as_float_tensor(message.data)
    if flat is None:
        return False
    scaled = flat * case.world_size
    rounded = scaled.round()
    if not bool(((scaled - rounded).abs() <= 1e-4 * rounded.abs().clamp_min(1)).all()):
        return False
    status, holds, positions = _read(rounded, case.world_size)
    return status == "ok" and holds == want.holds and positions == list(range(want.lo, want.hi))


def _misses_own_node(case, layout, rank, message, want) -> bool:
    """True when a tagged message across the nodes lacks contributions of the sender's own node: the reduce-scatter
    inside the node, not the ring across, left them out."""
    status, holds, _positions = _read(message.data, case.world_size)
    return status == "ok" and bool((want.holds - holds) & layout.node_team(layout.node(rank)))


def _wrong_positions(case, message, want) -> bool:
    """True when a tagged message carried a whole run of other positions (another shard or piece), not bad sums."""
    status, _holds, positions = _read(message.data, case.world_size)
    return (status != "bad" and positions != list(range(want.lo, want.hi))
            and sorted(positions) == list(range(min(positions), max(positions) + 1)))


def _size_text(want: Expected, layout) -> str:
    if want.phase in ("fold", "unfold"):
        return f"{want.what} is N = {want.size} elements."
    if want.phase.startswith("across"):
        return (f"{want.what} has {want.size} elements: the shard cut with torch.tensor_split(shard, M) into the "
                f"M = {layout.nodes} nodes' pieces.")
    return f"{want.what} has {want.size} elements: the tensor cut with torch.tensor_split(tensor, {layout.k})."


def _match(case, layout, rank, sends, expected, complete):
    """The first problem of one rank's sends against its planned messages, or []. Empty messages are left out on
    both sides (N < k leaves some shards empty; a learner may skip sending nothing)."""
    sends = [m for m in sends if m.numel > 0]
    expected = [e for e in expected if e.size > 0]

    def problem(want, text, kind, position):
        phase = want.phase if want is not None else "extra"
        index = PHASES.index(phase) if phase in PHASES else len(PHASES)
        return [Problem(text, order=(index, want.step if want else 0, rank, position),
                        step=want.step if want else None, phase=phase,
                        line=LINE_OF_PHASE.get(phase, "values" if want is None else None))]

    for position, message in enumerate(sends):
        if position >= len(expected):
            scheduled = "; ".join(f"{e.phase} step {e.step} to rank {e.peer}" for e in expected) or "none"
            last = expected[-1] if expected else None
            text = (f"rank {rank} sent {len(sends)} non-empty messages; its schedule has {len(expected)} ({scheduled}). "
                    f"Message {position + 1} went to rank {message.peer}.")
            result = problem(last, text, "count", position)
            result[0].order = (len(PHASES), 0, rank, position)
            return result
        want = expected[position]
        if message.peer != want.peer:
            return problem(want, f"{want.where(rank, layout)} sent to rank {message.peer}; {want.rule}", "peer", position)
        if message.numel != want.size:
            return problem(want, f"{want.where(rank, layout)} sent {message.numel} elements to rank {message.peer}; "
                           + _size_text(want, layout), "size", position)
        text = _content_problem(case, layout, rank, message, want)
        if text:
            found = problem(want, text, "holds", position)
            first_of_phase = next(e for e in expected if e.phase == want.phase) is want
            earlier = _produced_by(want, layout) if first_of_phase else None
            if earlier is None and want.phase.startswith("across") and layout.k > 1 \
                    and _misses_own_node(case, layout, rank, message, want):
                earlier = ("reduce-scatter inside the node", "reduce_scatter")
            if earlier is not None and not _wrong_positions(case, message, want) \
                    and not _averaged_message(case, message, want):
                found[0].message += f" (It sends what the {earlier[0]} left it: that phase did not finish this data.)"
                found[0].line = earlier[1]
            return found
    if complete and len(sends) < len(expected):
        want = expected[len(sends)]
        return problem(want, f"{want.where(rank, layout)} sent nothing: it should send rank {want.peer} {want.what}; "
                       + want.rule, "count", len(sends))
    return []


def _produced_by(want: Expected, layout):
    """(phase in words, rubric line) of the earlier phase whose result the first (non-empty) message of a phase
    forwards; None when that message's content is its own phase's work."""
    if want.phase == "across: scatter-reduce" and layout.k > 1:
        return "reduce-scatter inside the node", "reduce_scatter"
    if want.phase == "all-gather inside":
        if layout.nodes > 1:
            return "all-reduce across the nodes", "across"
        return "reduce-scatter inside the node", "reduce_scatter"
    if want.phase == "unfold":
        if layout.k > 1:
            return "all-gather inside the node", "all_gather"
        return "all-reduce across the nodes", "across"
    return None


def _schedule_problems(case, layout, records, style, complete):
    expected = plan(case.world_size, layout.node_size, case.numel, style)
    problems = []
    for rank, record in enumerate(records):
        sends = [m for m in record["messages"] if m.is_send]
        problems += _match(case, layout, rank, sends, expected[rank], complete)
    return sorted(problems, key=lambda p: p.order)


def _anchors(case, layout, records, style) -> int:
    """How many of the ranks' first messages inside the node and across the nodes disagree with `style` (their
    peer, and their positions with tagged data or their size otherwise): what the learner meant, before any slip."""
    expected_by_rank = plan(case.world_size, layout.node_size, case.numel, style)
    misses = 0
    for rank, record in enumerate(records):
        if record is None:
            continue
        expected = [e for e in expected_by_rank[rank] if e.size > 0]
        sends = [m for m in record["messages"] if m.is_send and m.numel > 0]
        for phase in ("reduce-scatter inside", "across: scatter-reduce"):
            want = next((e for e in expected if e.phase == phase), None)
            if want is None or expected.index(want) >= len(sends):
                continue
            message = sends[expected.index(want)]
            if message.peer != want.peer or message.numel != want.size:
                misses += 1
            elif case.data == "tagged" and message.data is not None:
                status, _holds, positions = _read(message.data, case.world_size)
                misses += status != "bad" and positions != list(range(want.lo, want.hi))
    return misses


def _best_style(case, layout, records, complete):
    """The style the messages follow: among those that agree best with every rank's first message of each ring
    (the learner's convention), the one whose first problem comes latest; the notebook's on a tie."""
    best = None
    for index, style in enumerate(STYLES):
        problems = _schedule_problems(case, layout, records, style, complete)
        anchors = _anchors(case, layout, records, style)
        if not problems and not anchors:
            return style, problems
        key = (-anchors, not problems, problems[0].order if problems else (), -len(problems), -index)
        if best is None or key > best[0]:
            best = (key, style, problems)
    return best[1], best[2]


# --------------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------------

VISIBLE_SIZES = (1, 2, 3, 4, 5, 8)
TIMED_NODE_SIZE = 4          # the check's timed case: 2 nodes of 4


def node_sizes_for(world_size: int) -> dict:
    """{'divides': [the largest node size 1 < K < G that divides G, else G], 'partial': [the smallest K that leaves a
    smaller last node, if any]}: the node sizes of the check's cases of G ranks."""
    G = world_size
    proper = [K for K in range(2, G) if G % K == 0]
    partial = [K for K in range(2, G) if G % K]
    return {"divides": [max(proper)] if proper else [G],
            "partial": partial[:1]}                     # the smallest: the most folded ranks


def even_numel(world_size, node_size, factor=2):
    """factor x k x M elements: a length that splits evenly into k chunks on each of the M nodes that take part."""
    layout = Layout(world_size, node_size)
    return factor * layout.k * layout.nodes


def _divides(case) -> bool:
    layout = Layout(case.world_size, case.root)
    return not layout.extra


def _even(case) -> bool:
    layout = Layout(case.world_size, case.root)
    return case.numel % (layout.k * layout.nodes) == 0


UNEVEN = Family("lengths that the node size or the number of nodes does not divide (N < k included)",
                lambda case: case.world_size > 1 and case.data != "timed" and not _even(case))
PARTIAL_NODE = Family("a node size that does not divide G (the smaller last node folded in)",
                      lambda case: case.world_size > 1 and case.data != "timed" and not _divides(case))
TIMED = Family(f"timed at {TIMED_BYTES // MiB} MiB per rank on two modeled clusters", lambda case: case.data == "timed")


def hierarchical_cases(sizes: tuple = VISIBLE_SIZES) -> list:
    """The check's untimed cases for every G in `sizes` (G = 1..5 and 8): for G > 1, on the node size of
    `node_sizes_for(G)` that divides G, tagged lengths that divide and one that does not (2G + 1) and random data;
    on a node size that leaves a smaller last node, tagged data. A case's `root` is its node size."""
    cases = []
    for G in sorted(sizes):
        if G == 1:
            cases.append(Case(1, 5, "tagged", 0, 1))
            continue
        node_sizes = node_sizes_for(G)
        main = node_sizes["divides"][0]
        cases += [Case(G, even_numel(G, main, 2), "tagged", 0, main),
                  Case(G, 2 * G + 1, "tagged", 0, main),
                  Case(G, even_numel(G, main, 3), "random", 1, main)]
        cases += [Case(G, even_numel(G, K, 2), "tagged", 0, K) for K in node_sizes["partial"]]
    return cases


def timed_case(world_size: int, node_size: int) -> Case:
    """A timed case: TIMED_BYTES per rank on `world_size` ranks in nodes of `node_size`."""
    return Case(world_size, TIMED_BYTES // 4, "timed", 0, node_size)


def in_check_order(cases) -> list:
    """The order the cases run and are reported in: by G, the untimed cases first, the grader's after the check's,
    then by node size and length."""
    return sorted(cases, key=lambda c: (c.world_size, c.data == "timed", c.hidden, c.root, c.numel))


def timed_clusters(world_size: int, node_size: int) -> tuple:
    """The two clusters a timed case is replayed on: H100 nodes of `node_size` on NVSwitch, InfiniBand NDR between
    them, one port per GPU (rail-optimised) and one per node."""
    from course_lib.network import Network

    nodes = world_size // node_size
    return tuple(Network.cluster(nodes, node_size, "nvlink4", "ib_ndr", nics=nics,
                                 name=f"{nodes} x {node_size}, one port per {'GPU' if nics == 'per_gpu' else 'node'}")
                 for nics in ("per_gpu", "per_node"))


def _seconds(value: float) -> str:
    for unit, size in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if value >= size:
            return f"{value / size:.3g} {unit}"
    return f"{value * 1e9:.3g} ns"


# --------------------------------------------------------------------------------------------------
# The exercise
# --------------------------------------------------------------------------------------------------


class HierarchicalAllReduce(FunctionExercise):
    observed = ("after", "samples", "events")

    def cases(self):
        return in_check_order(hierarchical_cases() + [timed_case(8, TIMED_NODE_SIZE)])

    def inputs(self, case):
        if case.data == "timed":
            return [{"numel": case.numel, "seed": case.seed}] * case.world_size
        if case.data == "tagged":
            return [positional_input(r, case.world_size, case.numel) for r in range(case.world_size)]
        return [data.make_input(case, r) for r in range(case.world_size)]

    def oracle(self, case, inputs):
        if case.data != "timed":
            return data.all_reduce_oracle(inputs)
        from course_lib.exercises.capstone import _values, sample_positions

        positions = sample_positions(case.numel, case.world_size)
        expected = torch.stack([_values(positions, r, case.seed).double() for r in range(case.world_size)]).sum(0)
        return [{"positions": positions, "expected_samples": expected.float()} for _ in range(case.world_size)]

    def tracer_options(self, case):
        if case.data == "timed":
            return {"keep_data": False, "landing": False, "largest_message": 0}
        return {}

    def run_case(self, call, case, rank, world_size, inputs):
        if case.data != "timed":
            tensor = inputs.clone()
            call(tensor, case.root)
            return {"after": clone(tensor)}
        from course_lib.exercises.capstone import sample_positions, timed_input

        tensor = timed_input(inputs["numel"], rank, inputs["seed"])
        call(tensor, case.root)
        samples = tensor.reshape(-1)[sample_positions(case.numel, world_size)].clone() \
            if tensor.numel() == case.numel else tensor.reshape(-1)[:0].clone()
        return {"samples": samples, "events": list(call.tracer.events)}

    def judge(self, case, records, complete=True):
        layout = Layout(case.world_size, case.root)
        if case.data == "timed":
            return self._judge_timed(case, layout, records) if complete else []
        _style, problems = _best_style(case, layout, records, complete)
        if complete:
            problems += _result_problems(case, layout, records)
        return problems

    def _judge_timed(self, case, layout, records):
        from course_lib.simulation import ScheduleError, replay

        problems = _sample_problems(case, records)
        G, nbytes = case.world_size, 4 * case.numel
        times = []
        for cluster in timed_clusters(G, case.root):
            try:
                timing = replay([record["events"] for record in records], cluster)
            except (ScheduleError, TypeError, ValueError, IndexError, KeyError) as exc:
                return problems + [Problem(feedback.readable(f"the schedule could not be timed: {exc}"), order=(-1,),
                                           line="timed")]
            reference = cluster.predict("hierarchical", nbytes)
            times.append((cluster, timing, reference, cluster.predict("ring", nbytes)))
        records[0]["timing"] = times
        if any(p.line == "values" for p in problems):
            # A schedule that skips a phase is faster and wrong: its time counts only with the right sums.
            problems.append(Problem(
                f"the time of {nbytes // MiB} MiB per rank on {G} ranks in nodes of {case.root} does not count: its "
                "results are wrong (above), and the timed line needs the right sums on every rank. A schedule with a "
                "phase missing is faster than the hierarchical one, not better.", order=(7, G, case.root), line="timed"))
            return problems
        for cluster, timing, reference, flat in times:
            score = reference / timing.seconds if timing.seconds > 0 else 0.0
            if score < THRESHOLD:
                problems.append(Problem(
                    f"{nbytes // MiB} MiB per rank on {cluster.name} (nvlink4 inside, ib_ndr between): yours took "
                    f"{_seconds(timing.seconds)}, the hierarchical schedule takes {_seconds(reference)} "
                    f"({100 * score:.0f}% of its speed; the line asks for {100 * THRESHOLD:.0f}%) and the flat ring "
                    f"{_seconds(flat)}. Your critical path has {timing.latencies} messages one after another (the "
                    f"schedule's: 2(k-1) + 2(M-1) = {2 * (layout.k - 1) + 2 * (layout.nodes - 1)}) and your busiest "
                    f"rank moves {timing.busiest_bytes / nbytes:.2f} N bytes.", order=(7, G, case.root), line="timed"))
                break
        return problems

    def report_lines(self, case_results):
        rows = []
        for result in case_results:
            if result.case.data != "timed" or not result.records or "timing" not in (result.records[0] or {}):
                continue
            wrong = any(p.line == "values" for p in result.problems)
            for cluster, timing, reference, flat in result.records[0]["timing"]:
                rows.append(f"  {cluster.name:<30} {_seconds(timing.seconds):>9} {_seconds(reference):>9} "
                            f"{100 * reference / timing.seconds:>5.0f}% {_seconds(flat):>9}"
                            + ("  (wrong results: not counted)" if wrong else ""))
        if not rows:
            return []
        return [f"Timed on the modeled clusters ({TIMED_BYTES // MiB} MiB per rank, your schedule replayed; score = "
                "the hierarchical schedule's time / yours):",
                f"  {'cluster':<30} {'yours':>9} {'schedule':>9} {'score':>6} {'flat ring':>9}", *rows]


def _sample_problems(case, records):
    for rank, record in enumerate(records):
        samples, positions, expected = record["samples"], record["positions"], record["expected_samples"]
        if not isinstance(samples, torch.Tensor) or samples.shape != expected.shape:
            return [Problem(f"{TIMED_BYTES // MiB} MiB on {case.world_size} ranks: rank {rank}'s tensor changed size: "
                            "write the sum into `tensor` itself, in place.", order=(6, rank), line="values")]
        bad = (samples != expected).nonzero()
        if bad.numel():
            i = int(bad[0])
            average = (" divided by G: an average, where hierarchical_allreduce must leave the sum"
                       if data.averaged(samples, expected, case.world_size) else "")
            return [Problem(f"{TIMED_BYTES // MiB} MiB on {case.world_size} ranks in nodes of {case.root}: rank {rank}'s "
                            f"element {int(positions[i])} is {float(samples[i]):.6g}; the sum over every rank is "
                            f"{float(expected[i]):.6g}{average}.", order=(6, rank), line="values")]
    for rank, record in enumerate(records):
        received = sum(e[2] for e in record["events"] if isinstance(e, tuple) and e[0] in ("recv", "irecv"))
        if case.world_size > 1 and received < (case.world_size - 1) * 4 * case.numel // case.world_size:
            return [Problem(f"rank {rank} received {received:,} bytes; every rank must receive at least (G-1)/G of the "
                            f"tensor's {4 * case.numel:,} bytes: its result did not come through the messages the check "
                            "traces.", order=(-1, rank))]
    return []


def _result_problems(case, layout, records):
    """Every rank's tensor against the sum ('values'); a result holding contributions no received message carried
    costs every line."""
    G = case.world_size
    problems = []
    for rank, record in enumerate(records):
        if case.data == "tagged":
            extra = data.unexplained_contributors(record["after"], record["start"], data.received_by(records, rank), G)
            if extra:
                problems.append(Problem(
                    f"after your all-reduce rank {rank} holds the values of rank{'s' if len(extra) > 1 else ''} "
                    f"{_ranks(extra)}, but no message it received carried them: they did not come through the "
                    "point-to-point messages the check traces.", order=(-1, rank)))
                continue
        tol = None if case.data == "tagged" else data.tolerance(record["abs_sum"], G)
        diff = data.first_difference(record["after"], record["expected"], tol)
        if diff is None:
            continue
        if data.same_values(record["after"], record["start"]):
            text = (f"rank {rank}'s tensor was not changed: write the sum into `tensor` itself, in place "
                    "(tensor.copy_(...), tensor[...] += ...), not into a new tensor.")
        elif data.averaged(record["after"], record["expected"], G):
            index, value, want = diff
            text = (f"after your all-reduce, rank {rank}'s element {index} ({_element_words(layout, case.numel, index)}) "
                    f"is {value:.6g}: the sum over every rank, {want:.6g}, divided by G = {G}. Your result is the "
                    "average over the ranks; hierarchical_allreduce must leave the sum in every rank's tensor: take "
                    "out the division by the world size.")
        else:
            index, value, want = diff
            text = f"after your all-reduce, rank {rank}'s element {index}"
            if index >= 0:
                text += f" ({_element_words(layout, case.numel, index)})"
            if index >= 0 and case.data == "tagged":
                try:
                    holds, _ = viz.decode_tag(value, G)
                    missing = data.everyone(G) - holds
                    text += (f" holds the sum of ranks {_ranks(holds)}: ranks {_ranks(missing)}'s values are missing"
                             + _missing_why(layout, rank, holds) + ".")
                except (ValueError, OverflowError):
                    text += f" is {value:.6g}, no sum of distinct ranks' data: a contribution was added twice."
            elif index >= 0:
                text += f" is {value:.6g}; the sum over every rank is {want:.6g}."
            else:
                text += " has the wrong shape: keep the tensor's shape and write into it."
        problems.append(Problem(text, order=(8, rank), line="values"))
    return problems


def _element_words(layout, numel, index) -> str:
    sizes = pieces(numel, layout.k)
    starts = _offsets(sizes)
    shard = max(c for c in range(layout.k) if starts[c] <= index)
    if layout.nodes == 1:
        return f"in shard {shard} of {layout.k}"
    piece_starts = _offsets(pieces(sizes[shard], layout.nodes))
    piece = max(q for q in range(layout.nodes) if starts[shard] + piece_starts[q] <= index)
    return f"in shard {shard} of {layout.k}, piece {piece} of {layout.nodes}"


def _missing_why(layout, rank, holds) -> str:
    if layout.folded(rank) or layout.nodes == 1:
        return ""
    node = layout.node(rank)
    if holds == layout.node_team(node):
        return ": only its own node's sum, as if the all-reduce across the nodes never reached this element"
    return ""


# --------------------------------------------------------------------------------------------------
# Recording a schedule without launching ranks
# --------------------------------------------------------------------------------------------------


def draw_schedule(events_by_rank, node_size: int, title: str = "", ax=None):
    """A picture of a recorded schedule (`record_schedule`, or a tracer's events): one row per rank, the s-th message
    each rank sends in column s, an arrow to its receiver, as thick as its bytes; blue inside a node, red across
    nodes. Nodes of `node_size` ranks are the shaded bands. Returns the matplotlib Axes."""
    import matplotlib.pyplot as plt

    G = len(events_by_rank)
    sends = [[e for e in events if e[0] in ("send", "isend")] for events in events_by_rank]
    width = max((len(s) for s in sends), default=0)
    biggest = max((e[2] for s in sends for e in s), default=1) or 1
    if ax is None:
        _fig, ax = plt.subplots(figsize=(min(13.0, 1.5 + 0.45 * max(width, 1)), 0.34 * G + 1.3))
    for node in range(0, -(-G // node_size)):
        if node % 2 == 0:
            ax.axhspan(node * node_size - 0.5, min(G, (node + 1) * node_size) - 0.5, color="0.92", zorder=0)
    for rank, messages in enumerate(sends):
        for step, (_op, peer, nbytes, _tag) in enumerate(messages):
            across = peer // node_size != rank // node_size
            ax.annotate("", xy=(step + 0.8, peer), xytext=(step, rank), zorder=2,
                        arrowprops=dict(arrowstyle="-|>", color="C3" if across else "C0", shrinkA=0, shrinkB=0,
                                        lw=0.6 + 2.4 * nbytes / biggest, mutation_scale=7))
    ax.plot([], [], color="C0", label="inside a node (NVLink)")
    ax.plot([], [], color="C3", label="across nodes (InfiniBand)")
    ax.set(xlim=(-0.5, width + 0.3), ylim=(G - 0.5, -0.5), xlabel="the s-th message each rank sends",
           ylabel="rank", yticks=range(G), title=title)
    ax.legend(fontsize=8, loc="upper right", framealpha=0.9)
    return ax


# --------------------------------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------------------------------

FORBIDDEN = ("collectives", "allreduce", "fast_allreduce")

register(HierarchicalAllReduce(
    name="hierarchical_allreduce", notebook="13_from_a_node_to_a_cluster", points=10,
    signature="hierarchical_allreduce(tensor, node_size) -> None",
    summary="all-reduce on nodes of node_size ranks: reduce-scatter inside the node, a ring all-reduce of the shard "
            "across the nodes on each rank's rail, all-gather inside the node; a smaller last node folds in",
    rubric=(RubricLine("reduce_scatter", "inside each node, k - 1 ring steps: each rank sends one shard "
                                         "(tensor_split(tensor, k)) to its neighbour in the node, holding the sum of "
                                         "the ranks before it", 1.5),
            RubricLine("across", "across the nodes, each rank all-reduces the shard it holds with the same local rank "
                                 "on the other nodes only (its rail): 2(M - 1) ring steps on pieces of that shard", 1.5),
            RubricLine("all_gather", "inside each node, k - 1 ring steps that pass the complete shards on; the "
                                     "receivers copy them", 1),
            RubricLine("values", "every rank ends with the sum over all ranks, in place", 1.5),
            RubricLine("uneven", "also right when N is not a multiple of the node size or of the number of nodes "
                                 "(some shards or pieces empty)", 0.5, family=UNEVEN),
            RubricLine("partial_node", "a node size that does not divide G: the smaller last node's ranks fold their "
                                       "tensor into rank r - node_size and get the result back", 2.5,
                       family=PARTIAL_NODE),    # a quarter: any G is the exercise's point, the smaller node its slip
            RubricLine("timed", f"its schedule, replayed on 8 H100s in nodes on NVSwitch joined by InfiniBand (one port "
                                f"per GPU, and one per node), takes at most 1/{THRESHOLD:g} of the hierarchical "
                                f"schedule's time", 1, family=TIMED),
            RubricLine("single", "with one rank (G = 1) it sends nothing and leaves the tensor as it is", 0.5,
                       family=SINGLE_RANK)),
    root_name="node_size", forbidden=FORBIDDEN, time_factor=1.5))
