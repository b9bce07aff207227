"""Notebook 11: the all-reduces that beat the ring somewhere, written by the learner.

    tree(tensor)               binomial-tree reduce to rank 0, then broadcast back down the same tree:
                               2 ceil(log2 G) steps, every message the whole tensor
    halving_doubling(tensor)   Rabenseifner: recursive-halving reduce-scatter, recursive-doubling
                               all-gather on P = 2^m ranks; when G is not a power of two the E = G - P
                               extra ranks fold their tensor into a partner first and get the result
                               back last: 2 log2 P (+2) steps, 2 (P-1)/P N (+N) elements per rank

Both end with every rank's tensor equal to torch.distributed.all_reduce's. The check reads the
schedule from the messages the ranks really sent: the s-th message a rank sends is its step s, and
with tagged data the values of a message say whose contributions it holds (`viz.decode_tag`).

Two styles of each are accepted, because both are the algorithm (a correct solution that fails is a
bug of the check, not of the learner):

* tree: the notebook's (reduce step j: ranks whose lowest set bit is 2^j send to r - 2^j; parent(r) =
  r minus its lowest set bit) or the mirror image (parent(r) = r minus its highest set bit: the
  distance halves each step). The check infers which from rank 3's first message.
* halving_doubling: the partner distance halving (P/2, P/4, ..., 1: the notebook's) or doubling
  (1, 2, ..., P/2) in the reduce-scatter, the all-gather retracing it backwards; halves cut at
  `tensor_split` block boundaries or at element midpoints; extra ranks folded the notebook's way
  (ranks 0..2E-1 pair up, the even one sends its tensor to the odd one) or from the top (rank P + i
  folds into rank i). Each message is about half of what the sender still holds: within P/2 + 1
  elements of N / 2^(k+1) in reduce-scatter step k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from course_lib import viz
from course_lib.exercises import data
from course_lib.exercises.allreduce_variants import _result_problems
from course_lib.exercises.cases import standard_cases
from course_lib.exercises.registry import FunctionExercise, Problem, register
from course_lib.exercises.ring import _run_all_reduce_case
from course_lib.exercises.rubric import SINGLE_RANK, UNEVEN_LENGTHS, Family, RubricLine

__all__ = ["Tree", "HalvingDoubling", "NOT_POWER_OF_TWO", "tree_parent", "hd_schedule", "Expected"]

NOT_POWER_OF_TWO = Family("G not a power of two (G = 3, 5, 6, 7)",
                          lambda case: case.world_size & (case.world_size - 1) != 0)


@dataclass(frozen=True)
class Expected:
    """One message the schedule has a rank send.

    Attributes:
        phase: 'reduce' / 'broadcast' (tree), 'fold' / 'reduce-scatter' / 'all-gather' / 'unfold' (halving-doubling).
        step: the step within the phase.
        peer: the rank it goes to.
        holds: whose contributions it carries.
        size: about how many elements (exact for whole tensors), and `slack` the elements it may be off by.
        rule: the rule that picks `peer`, in words, for feedback.
    """

    phase: str
    step: int
    peer: int
    holds: frozenset
    size: float
    slack: float = 0.0
    rule: str = ""

    def where(self, rank: int) -> str:
        return f"{self.phase} step {self.step}: rank {rank}"

    def fits(self, numel: int) -> bool:
        return abs(numel - self.size) <= self.slack


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return ", ".join(map(str, ranks)) if ranks else "none"


def _holds_of(message, world_size: int):
    """(status, ranks) of a tagged message, element by element: ('ok', ranks) when every element holds the
    same ranks' contributions (pieces may differ: a half can straddle chunks), ('mixed', None) when elements
    hold different ranks, ('bad', None) when a value is no sum of distinct ranks' tags, ('empty', None)."""
    values = data.as_float_tensor(message.data)
    if values is None or values.numel() == 0:
        return "empty", None
    sets = set()
    for value in set(values.tolist()):
        try:
            sets.add(viz.decode_tag(value, world_size)[0])
        except (ValueError, OverflowError):
            return "bad", None
    return ("ok", sets.pop()) if len(sets) == 1 else ("mixed", None)


def _content_problem(case, rank, message, want: Expected):
    """What is wrong with what a message carried (tagged data only), in words, or None."""
    if case.data != "tagged" or message.data is None or message.numel == 0:
        return None
    status, holds = _holds_of(message, case.world_size)
    where = f"{want.where(rank)} sent rank {message.peer}"
    complete = want.holds == data.everyone(case.world_size)
    if status == "bad":
        return (f"{where} values that are no sum of distinct ranks' data: a contribution was added twice "
                f"(or a received result added instead of copied). It should carry the sum of ranks {_ranks(want.holds)}.")
    if status == "mixed":
        return (f"{where} elements holding different ranks' contributions: part of what it sent was summed and "
                f"part not. Every element should hold the sum of ranks {_ranks(want.holds)}.")
    if holds == want.holds:
        return None
    if rank in want.holds and rank not in holds and holds < want.holds:
        return (f"{where} the sum of ranks {_ranks(holds)}, without its own values: it overwrote its tensor with what it "
                f"received instead of adding to it (tensor += received). It should carry the sum of ranks "
                f"{_ranks(want.holds)}.")
    if holds == {rank} and len(want.holds) > 1:
        return (f"{where} only its own input; by then it should hold the sum of ranks {_ranks(want.holds)}: add what "
                "it received into its tensor before sending it on.")
    if complete:
        return (f"{where} the sum of ranks {_ranks(holds)}, not the complete sum: in the {want.phase} only the finished "
                f"result (all {case.world_size} ranks) travels.")
    return f"{where} the sum of ranks {_ranks(holds)}; at this step it should carry the sum of ranks {_ranks(want.holds)}."


def _size_rule(want: Expected, numel: int) -> str:
    """Why the message should have had `want.size` elements, in words."""
    if not want.slack:
        return f"this message carries the whole tensor, N = {numel} elements."
    formula = "N / 2^(k+1)" if want.phase == "reduce-scatter" else "N 2^k / P"
    return (f"about {formula} = {want.size:.3g} elements belong in {want.phase} step {want.step}: the reduce-scatter "
            "halves what a rank holds at every step, and the all-gather doubles it back.")


def _match_schedule(case, rank, sends, plan, complete, line_of):
    """Compare one rank's sends with its planned messages, in order; the problems found (first one per rank).

    Empty messages are left out on both sides when the plan allows a piece of 0 elements (N < P): a learner may
    skip sending nothing. `line_of(expected, kind)` names the rubric line a problem costs ('peer', 'size',
    'holds', 'count').
    """
    sends = [m for m in sends if m.numel > 0]
    plan = list(plan)
    problems = []

    def add(expected, text, kind, step_order):
        problems.append(Problem(text, order=(step_order, rank), step=expected.step if expected else None,
                                phase=expected.phase if expected else None, line=line_of(expected, kind)))

    def accepts(expected, message):
        return (expected.peer == message.peer and expected.fits(message.numel)
                and _content_problem(case, rank, message, expected) is None)

    def may_be_empty(expected):
        return expected.size - expected.slack <= 0

    position = 0
    for message in sends:
        ahead = position          # a piece that may be empty may have been left out: look past such pieces
        while ahead < len(plan) and may_be_empty(plan[ahead]) and not accepts(plan[ahead], message):
            ahead += 1
        if ahead < len(plan) and accepts(plan[ahead], message):
            position = ahead + 1
            continue
        if position >= len(plan):
            add(None, f"rank {rank} sent {len(sends)} non-empty messages; its schedule has only {len(plan)} "
                      f"({', '.join(f'{e.phase} step {e.step} to rank {e.peer}' for e in plan) or 'none'}).",
                "count", (len(plan) + 1,))
            return problems
        want = plan[position]
        order = (position,)
        if message.peer != want.peer:
            add(want, f"{want.where(rank)} sent to rank {message.peer}; {want.rule}", "peer", order)
            return problems
        if not want.fits(message.numel):
            add(want, f"{want.where(rank)} sent {message.numel} elements to rank {message.peer}; "
                      + _size_rule(want, case.numel), "size", order)
            return problems
        add(want, _content_problem(case, rank, message, want), "holds", order)
        return problems
    if complete:
        rest = [e for e in plan[position:] if e.size - e.slack > 0]
        if rest:
            e = rest[0]
            what = "its whole tensor" if e.phase == "fold" else f"the sum of ranks {_ranks(e.holds)}"
            add(e, f"rank {rank} sent nothing in {e.phase} step {e.step}: it should send rank {e.peer} {what}; "
                   + e.rule, "count", (plan.index(e),))
    return problems


# --------------------------------------------------------------------------------------------------
# The binomial tree
# --------------------------------------------------------------------------------------------------


def _lowest_bit(r: int) -> int:
    return r & -r


def _highest_bit(r: int) -> int:
    return 1 << (r.bit_length() - 1)


def tree_parent(rank: int, style: str = "low") -> int:
    """Rank r's parent: r minus its lowest set bit (the notebook's tree), or minus its highest ('high')."""
    return rank - (_lowest_bit(rank) if style == "low" else _highest_bit(rank))


def tree_plan(world_size: int, style: str = "low") -> dict:
    """{rank: [Expected, ...]}: the reduce message up to the parent (holding the rank's subtree), then the
    complete sum down to every child, farthest first. Reduce step j = log2 of the distance (low style) or
    L - 1 - that (high style), L = ceil(log2 G); the broadcast mirrors it. Sizes are filled in by `_with_size`."""
    G = world_size
    levels = (G - 1).bit_length()
    children = {r: [c for c in range(1, G) if tree_parent(c, style) == r] for r in range(G)}

    def subtree(r):
        out = {r}
        for c in children[r]:
            out |= subtree(c)
        return frozenset(out)

    def step_of(distance, phase):
        j = distance.bit_length() - 1
        up = j if style == "low" else levels - 1 - j
        return up if phase == "reduce" else levels - 1 - up

    rule_up = ("in the binomial tree rank r sends its partial sum up to r minus its lowest set bit, "
               if style == "low" else "in this tree (the distance halving each step) rank r sends its partial sum "
                                      "up to r minus its highest set bit, ")
    plan = {}
    for r in range(G):
        messages = []
        if r > 0:
            parent = tree_parent(r, style)
            after = f", once it has added what its children ({_ranks(children[r])}) sent." if children[r] else "."
            messages.append(Expected("reduce", step_of(r - parent, "reduce"), parent, subtree(r), 0,
                                     rule=rule_up + f"rank {parent}{after}"))
        for c in sorted(children[r], key=lambda c: -(c - r) if style == "low" else (c - r)):
            messages.append(Expected("broadcast", step_of(c - r, "broadcast"), c, data.everyone(G), 0,
                                     rule=f"in the broadcast a rank sends the complete sum down the same tree, to "
                                          f"its children ({_ranks(children[r])} for rank {r})."))
        plan[r] = messages
    return plan


def _with_size(plan, numel):
    return {r: [Expected(e.phase, e.step, e.peer, e.holds, numel, 0, e.rule) for e in es] for r, es in plan.items()}


def _in_their_order(plan, sends):
    """The plan with its broadcast messages in the order the rank sent them: which child is served first changes
    only how long the broadcast takes, not whether it is right."""
    peers = [m.peer for m in sends if m.numel]
    down = [e for e in plan if e.phase == "broadcast"]
    down.sort(key=lambda e: peers.index(e.peer) if e.peer in peers else len(peers))
    return [e for e in plan if e.phase != "broadcast"] + down


def _tree_style(records, G) -> str:
    """'high' when rank 3's first message goes to rank 1 (the mirrored tree), else the notebook's 'low'."""
    if G >= 4:
        first = next((m for m in records[3]["messages"] if m.is_send and m.numel), None)
        if first is not None and first.peer == 1:
            return "high"
    return "low"


class Tree(FunctionExercise):
    def run_case(self, call, case, rank, world_size, inputs):
        return _run_all_reduce_case(call, case, rank, world_size, inputs)

    def judge(self, case, records, complete=True):
        G, N = case.world_size, case.numel
        style = _tree_style(records, G)
        plan = _with_size(tree_plan(G, style), N)

        def line_of(expected, kind):
            if expected is None:
                return "reduce"
            return "broadcast" if expected.phase == "broadcast" else "reduce"

        problems = []
        for rank, record in enumerate(records):
            sends = [m for m in record["messages"] if m.is_send]
            found = _match_schedule(case, rank, sends, _in_their_order(plan[rank], sends), complete, line_of)
            for p in found:   # reduce problems come before broadcast ones, then by step, then by rank
                p.order = ((0 if p.phase != "broadcast" else 1), p.step or 0, rank)
            problems += found
        if complete:
            added = _added_result(case, records)
            results = _result_problems(case, records, "the tree")
            if added or any(p.phase == "broadcast" for p in problems):
                # A broadcast that adds instead of copying leaves sums of repeated contributions, which no tagged
                # message decodes to: "values no message carried" would blame every line (the reduce's too) for
                # what is the broadcast's mistake, already named.
                results = [p for p in results if p.line is not None]
            problems += added + results
            problems += _same_bits(case, records, "the broadcast copies rank 0's result")
        return problems


def _added_result(case, records):
    """A receiver in the broadcast that added the result to its own tensor instead of copying it: it ends with
    its input plus the sum."""
    if case.world_size < 2:
        return []
    for rank, record in enumerate(records[1:], start=1):
        start, after, expected = record.get("start"), record.get("after"), record.get("expected")
        if not all(isinstance(t, torch.Tensor) for t in (start, after, expected)) or after.shape != start.shape:
            continue
        added = start.double() + expected.double()
        tol = 1e-6 * (added.abs() + 1) if case.data == "random" else 0
        if bool(((after.double() - added).abs() <= tol).all()) and not bool((after == expected).all()):
            return [Problem(f"rank {rank} ends with its own input plus the sum: in the broadcast it added the result "
                            "it received to its tensor. The receiver copies it (receive into the tensor itself, or "
                            "tensor.copy_(received)).", order=(8, rank), line="broadcast")]
    return []


def _same_bits(case, records, why):
    """With random data: every rank must hold rank 0's bits (a broadcast copies, it does not re-add)."""
    if case.data != "random" or case.world_size < 2:
        return []
    first = records[0]["after"]
    for rank, record in enumerate(records[1:], start=1):
        if isinstance(first, torch.Tensor) and isinstance(record["after"], torch.Tensor) \
                and not torch.equal(record["after"], first):
            return [Problem(f"rank 0 and rank {rank} hold different bits: {why}, so every rank should hold exactly "
                            "the same result.", order=(10, rank), line="values")]
    return []


# --------------------------------------------------------------------------------------------------
# Halving-doubling
# --------------------------------------------------------------------------------------------------


def _power_of_two_below(G: int) -> int:
    return 1 << (G.bit_length() - 1)


@dataclass(frozen=True)
class _Fold:
    """How the E = G - P extra ranks are folded in: 'pairs' (the notebook's: ranks 0..2E-1 pair up, the even one
    sends to the odd one, which takes part as virtual rank r // 2; the others are r - E) or 'top' (rank P + i
    sends to rank i; ranks 0..P-1 take part as themselves)."""

    style: str
    world_size: int

    @property
    def p(self) -> int:
        return _power_of_two_below(self.world_size)

    @property
    def extra(self) -> int:
        return self.world_size - self.p

    def sits_out(self, rank: int) -> bool:
        if self.style == "pairs":
            return rank < 2 * self.extra and rank % 2 == 0
        return rank >= self.p

    def partner(self, rank: int):
        """The fold partner of `rank` (either side of the pair), or None."""
        if self.style == "pairs":
            if rank >= 2 * self.extra:
                return None
            return rank + 1 if rank % 2 == 0 else rank - 1
        if rank >= self.p:
            return rank - self.p
        return rank + self.p if rank < self.extra else None

    def real(self, virtual: int) -> int:
        if self.style == "pairs":
            return 2 * virtual + 1 if virtual < self.extra else virtual + self.extra
        return virtual

    def virtual(self, rank: int) -> int:
        if self.style == "pairs":
            return rank // 2 if rank < 2 * self.extra else rank - self.extra
        return rank

    def team(self, virtual: int) -> frozenset:
        """The real ranks whose data virtual rank v holds after the fold: its own and its partner's."""
        r = self.real(virtual)
        partner = self.partner(r)
        return frozenset({r} | ({partner} if partner is not None else set()))


def hd_schedule(world_size: int, numel: int, order: str = "halving", fold: str = "pairs") -> dict:
    """{rank: [Expected, ...]} for halving-doubling on G ranks.

    P = 2^m <= G take part; distances d_k = P/2^(k+1) ('halving', the notebook's) or 2^k ('doubling').
    Reduce-scatter step k: virtual rank v sends to v XOR d_k about N / 2^(k+1) elements holding the sum over
    its group {v XOR (any sum of d_0..d_(k-1))}; all-gather step k: to v XOR d_(m-1-k), about N 2^k / P
    elements of the complete sum. Folded ranks send their input (N elements) before and receive the
    result (N) after.
    """
    G = world_size
    f = _Fold(fold, G)
    P, m = f.p, f.p.bit_length() - 1
    distances = [P >> (k + 1) for k in range(m)] if order == "halving" else [1 << k for k in range(m)]
    slack = P / 2 + 1
    everyone = data.everyone(G)
    named = " then ".join(map(str, distances)) if distances else "none"

    def rule(phase, k, v, d):
        return (f"in halving-doubling {phase} step {k} pairs rank r with r XOR {d} (partner distances {named} in the "
                f"reduce-scatter, the same backwards in the all-gather)"
                + (f"; rank {f.real(v)} plays virtual rank {v} of the P = {P} ranks that take part after the fold"
                   if f.extra else "") + f": its partner is rank {f.real(v ^ d)}.")

    plan = {}
    for rank in range(G):
        partner = f.partner(rank)
        fold_rule = ("when G is not a power of two, the extra ranks first send their whole tensor to a partner "
                     + ("(rank 2i to rank 2i + 1, for the first 2E = " + str(2 * f.extra) + " ranks)" if fold == "pairs"
                        else f"(rank P + i to rank i, P = {P})") + f": rank {rank}'s partner is rank {partner}.")
        if f.sits_out(rank):
            plan[rank] = [Expected("fold", 0, partner, frozenset({rank}), numel, 0, fold_rule)]
            continue
        v = f.virtual(rank)
        messages = []
        group = {v}
        for k, d in enumerate(distances):
            holds = frozenset().union(*(f.team(u) for u in group))
            messages.append(Expected("reduce-scatter", k, f.real(v ^ d), holds, numel / 2 ** (k + 1), slack,
                                     rule("reduce-scatter", k, v, d)))
            group |= {u ^ d for u in group}
        for k, d in enumerate(reversed(distances)):
            messages.append(Expected("all-gather", k, f.real(v ^ d), everyone, numel * 2 ** k / P, slack,
                                     rule("all-gather", k, v, d)))
        if partner is not None:
            messages.append(Expected("unfold", 0, partner, everyone, numel, 0,
                                     f"after the all-gather rank {rank} sends the result back to the rank that folded "
                                     f"into it, rank {partner}."))
        plan[rank] = messages
    return plan


def _hd_styles(records, G, N):
    """(order, fold) the learner's messages follow: read from who sent to whom first; the notebook's by default."""
    P = _power_of_two_below(G)
    first = [next((m for m in r["messages"] if m.is_send and m.numel), None) for r in records]
    fold = "pairs"
    if G != P and (first[P] is None or first[P].peer == 0):
        fold = "top"      # rank P folds into rank 0 (or, forgotten, sends nothing): ranks 0..P-1 are themselves
    f = _Fold(fold, G)
    order = "halving"
    if P > 2:
        zero = f.real(0)
        sends = [m for m in records[zero]["messages"] if m.is_send and m.numel]
        if sends and sends[0].peer == f.real(1):
            order = "doubling"
    return order, fold


class HalvingDoubling(FunctionExercise):
    def run_case(self, call, case, rank, world_size, inputs):
        return _run_all_reduce_case(call, case, rank, world_size, inputs)

    def judge(self, case, records, complete=True):
        G, N = case.world_size, case.numel
        order, fold = _hd_styles(records, G, N)
        plan = hd_schedule(G, N, order, fold)
        phases = {"fold": 0, "reduce-scatter": 1, "all-gather": 2, "unfold": 3}

        def line_of(expected, kind):
            if expected is not None and expected.phase in ("fold", "unfold"):
                return "non_power_of_two"
            if kind in ("size", "holds"):
                return "halves"
            return "partners"

        problems = []
        for rank, record in enumerate(records):
            sends = [m for m in record["messages"] if m.is_send]
            found = _match_schedule(case, rank, sends, plan[rank], complete, line_of)
            for p in found:
                p.order = (phases.get(p.phase, 4), p.step or 0, rank)
            problems += found
        if case.data == "tagged":
            problems += _same_half_problems(case, records, plan)
        if complete:
            problems += _uncovered_elements(case, records)
            problems += _result_problems(case, records, "halving-doubling")
        return problems


def _pieces(message, world_size) -> frozenset:
    """The tagged chunks (of G) a message's elements come from."""
    values = data.as_float_tensor(message.data)
    return frozenset(viz.decode_tag(v, world_size)[1] for v in set(values.tolist())) if values is not None else frozenset()


def _same_half_problems(case, records, plan):
    """Two partners that sent each other the same part of the tensor in a reduce-scatter step: each kept what it gave
    away. (Two halves of one region are disjoint; with tagged data they come from different chunks.)"""
    G = case.world_size
    sent = {}
    for rank, record in enumerate(records):
        sends = [m for m in record["messages"] if m.is_send and m.numel]
        if len(sends) == len(plan[rank]):
            sent[rank] = dict(zip(((e.phase, e.step) for e in plan[rank]), sends))
    for rank in sorted(sent):
        for (phase, step), message in sent[rank].items():
            if phase != "reduce-scatter":
                continue
            other = sent.get(message.peer, {}).get((phase, step))
            if other is None or other.peer != rank or rank > message.peer:
                continue
            mine, theirs = _pieces(message, G), _pieces(other, G)
            if mine and mine == theirs:
                return [Problem(
                    f"reduce-scatter step {step}: rank {rank} and rank {message.peer} both sent chunk"
                    f"{'s' if len(mine) > 1 else ''} {_ranks(mine)} of the tensor: each kept the half it gave away. "
                    "In a pair one keeps the lower half and the other the upper (the notebook: the rank with the "
                    "smaller number keeps the lower half) and sends the other one.", order=(1, step, rank),
                    step=step, phase=phase, line="halves")]
    return []


def _uncovered_elements(case, records):
    """With tagged data: the first element of a rank's result that holds fewer ranks than all, said by position
    (a half cut with N // 2 on both sides leaves an element out when the region is odd)."""
    if case.data != "tagged" or case.world_size < 2:
        return []
    G = case.world_size
    for rank, record in enumerate(records):
        after = data.as_float_tensor(record.get("after"))
        if after is None or after.numel() != case.numel:
            continue
        for index, value in enumerate(after.tolist()):
            try:
                holds = viz.decode_tag(value, G)[0]
            except (ValueError, OverflowError):
                break
            if holds != data.everyone(G) and holds:
                return [Problem(
                    f"after halving-doubling, rank {rank}'s element {index} holds the sum of ranks {_ranks(holds)} "
                    f"only: the pieces the ranks exchanged never covered it. The two halves of a region of n elements "
                    f"must cover all n (n // 2 and n - n // 2 when n is odd, or tensor_split's blocks).",
                    order=(9, rank), line="values")]
    return []


# course_lib's own tree and halving_doubling live in fast_allreduce: the exercise is to write them.
FORBIDDEN = ("collectives", "allreduce", "fast_allreduce")
SINGLE = RubricLine("single", "with one rank (G = 1) it sends nothing and leaves the tensor as it is", 1,
                    family=SINGLE_RANK)

register(Tree(
    name="tree", notebook="11_beat_the_ring", points=10,
    signature="tree(tensor) -> None",
    summary="binomial-tree all-reduce: every rank but 0 sends its subtree's partial sum up to its parent "
            "(r minus its lowest set bit), then the complete sum comes back down the same tree",
    rubric=(RubricLine("reduce", "the reduce: every rank but 0 sends once, to its parent, the sum of its subtree "
                                 "(its own input plus what its children sent), the whole tensor", 3),
            RubricLine("broadcast", "the broadcast: every rank sends the complete sum to each of its children once, "
                                    "the receivers copy it", 3),
            RubricLine("values", "every rank ends with the sum over all ranks, in place; with random data every rank "
                                 "holds the same bits", 2),
            RubricLine("any_g", "also right when G is not a power of two (some parents have fewer children)", 1,
                       family=NOT_POWER_OF_TWO),
            SINGLE),
    forbidden=FORBIDDEN))

register(HalvingDoubling(
    name="halving_doubling", notebook="11_beat_the_ring", points=10,
    signature="halving_doubling(tensor) -> None",
    summary="Rabenseifner's all-reduce: recursive-halving reduce-scatter with partner r XOR d, then the "
            "recursive-doubling all-gather backwards; extra ranks fold in first when G is not a power of two",
    rubric=(RubricLine("partners", "power-of-two G: reduce-scatter step k pairs r with r XOR d_k (d = P/2, ..., 1, "
                                   "or 1, ..., P/2), the all-gather the same distances backwards", 2.5),
            RubricLine("halves", "each reduce-scatter message is half of what the rank still holds (about N / 2^(k+1)), "
                                 "carrying its group's partial sum; the all-gather's pieces double, complete", 2),
            RubricLine("values", "every rank ends with the sum over all ranks, in place", 2),
            RubricLine("uneven", "also right when N does not divide by G (and N < G: some halves empty)", 1,
                       family=UNEVEN_LENGTHS),
            RubricLine("non_power_of_two", "the harder case, G = 3, 5, 6, 7: the E = G - P extra ranks fold their "
                                           "tensor into a partner, the P others run the algorithm, the result goes back",
                       1.5, family=NOT_POWER_OF_TWO),
            SINGLE),
    forbidden=FORBIDDEN))
