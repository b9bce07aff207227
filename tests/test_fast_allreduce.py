"""course_lib.fast_allreduce against torch.distributed.all_reduce (gloo), and its traces against its formulas.

One launch per world size 1..6 runs every variant (ring_pipelined, also with segments of a few
elements so that chunks really are cut; ring_bidirectional; halving_doubling; recursive_doubling; tree) over float32,
float64 and int64 with SUM, MAX and MIN (and a few AVG / PRODUCT cases), lengths 1, G-1, G+1 and
primes, 2-D and non-contiguous tensors, with random inputs that differ per rank and position.
Every case is also recorded with course_lib.traffic: each rank's elements and messages must equal
`fast_allreduce.expected_traffic`, and the steps over all ranks `expected_steps`.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from conftest import (TORCH_OPS, assert_no_failures, assert_same_on_every_rank, digest, gaps_untouched,
                      make_input, mismatch, run, strided, tolerance)
from course_lib import allreduce, fast_allreduce, traffic

NAMES = ("ring_pipelined", "ring_bidirectional", "halving_doubling", "recursive_doubling", "tree")
TINY_SEGMENT = 12  # bytes: 3 float32 / 1-2 wider elements a segment, so chunks are cut into several


def _lengths(g):
    return sorted({1, max(g - 1, 1), g + 1, 7, 13, 31, 97})


def _cases(g):
    """(variant, segment_bytes, dtype, op, shape, non-contiguous?), the same on every rank."""
    pairs = [(dtype, op) for dtype in (torch.float32, torch.float64, torch.int64) for op in ("SUM", "MAX", "MIN")]
    pairs += [(torch.float64, "AVG"), (torch.float32, "PRODUCT"), (torch.int64, "PRODUCT")]
    variants = [(name, None) for name in NAMES] + [("ring_pipelined", TINY_SEGMENT)]
    extra_shapes = [((3, g + 2), False), ((3, g + 2), True), ((2, 5, g + 1), True), ((g + 1,), True), ((0,), False)]
    cases = []
    for v, (name, segment) in enumerate(variants):
        for i, (dtype, op) in enumerate(pairs):
            lengths = _lengths(g)
            cases.append((name, segment, dtype, op, (lengths[(i + v) % len(lengths)],), False))
        for k, (shape, noncontig) in enumerate(extra_shapes):
            dtype, op = pairs[(4 * k + v) % len(pairs)]
            cases.append((name, segment, dtype, op, shape, noncontig))
    return cases


def _label(case):
    name, segment, dtype, op, shape, noncontig = case
    seg = f" segment={segment}B" if segment else ""
    return f"{name}{seg} {op} {str(dtype)[6:]} shape={shape}{' strided' if noncontig else ''}"


def _function(name, segment):
    function = allreduce.get(name)
    return functools.partial(function, segment_bytes=segment) if segment else function


def _rank(rank, g):
    failures, digests, steps, flows = [], {}, {}, {}
    for seed, case in enumerate(_cases(g)):
        name, segment, dtype, op, shape, noncontig = case
        label = _label(case)
        everyone = [make_input(seed, r, shape, dtype, op) for r in range(g)]
        expected = everyone[rank].clone()
        dist.all_reduce(expected, op=TORCH_OPS[op])
        mine = strided(everyone[rank]) if noncontig else everyone[rank].clone()
        try:
            with traffic.record() as rec:
                _function(name, segment)(mine, TORCH_OPS[op] if seed % 2 else op)
        except Exception as exc:
            raise RuntimeError(f"case {label!r} raised on rank {rank}") from exc
        if noncontig and not gaps_untouched(mine):
            failures.append(f"{label}: wrote between the strided tensor's elements")
        problem = mismatch(mine, expected, tolerance(everyone, op, dtype), what="result vs torch")
        if problem:
            failures.append(f"{label}: {problem}")
        numel = mine.numel()
        want = fast_allreduce.expected_traffic(name, numel, g, rank, element_size=mine.element_size(),
                                               segment_bytes=segment or fast_allreduce.SEGMENT_BYTES)
        got = dict(elements_sent=rec.elements_sent, elements_received=rec.elements_received,
                   messages_sent=rec.messages_sent, messages_received=rec.messages_received)
        if got != want:
            failures.append(f"{label}: traffic {got}, formula says {want}")
        if any(e.phase is None or e.step is None for e in rec.events):
            failures.append(f"{label}: a message without phase/step label")
        digests[label] = digest(mine)
        steps[label] = sorted({(e.phase, e.step) for e in rec.events})
        flow = {}
        for e in rec.events:   # elements this rank sent to / received from each peer, as recorded
            flow[(e.kind, e.peer)] = flow.get((e.kind, e.peer), 0) + e.numel
        flows[label] = flow
    return failures, digests, steps, flows


def test_every_fast_variant_matches_torch_and_its_formulas(world_size):
    g = world_size
    results = run(_rank, g, timeout=180)
    assert_no_failures([failures for failures, *_ in results], f"G={g}")
    assert_same_on_every_rank([digests for _, digests, *_ in results], f"G={g}")
    for case in _cases(g):
        label = _label(case)
        # Read from the recordings, not from a formula: what rank a sent to b is what b received from a.
        flows = [result[3][label] for result in results]
        for a in range(g):
            for b in range(g):
                sent, received = flows[a].get(("send", b), 0), flows[b].get(("recv", a), 0)
                assert sent == received, f"G={g} {label}: rank {a} sent {sent} elements to {b}, which received {received}"
        # A step is counted when any rank sent or received in it (a tree's leaves sit most steps out).
        seen = {}
        for _, _, steps, _ in results:
            for phase, step in steps[label]:
                seen.setdefault(phase, set()).add(step)
        got = {phase: len(s) for phase, s in seen.items()}
        assert got == fast_allreduce.expected_steps(case[0], g), f"G={g} {label}: steps {got}"


def test_tiny_segments_really_cut_the_chunks():
    # 97 float32 on 3 ranks: chunks of 33, segments of 3 elements -> 11 segments a chunk.
    assert fast_allreduce.segments_per_chunk(97, 3, 4, TINY_SEGMENT) == 11
    assert fast_allreduce.segments_per_chunk(97, 3, 4) == 1
    # 64 MiB of float32 on 4 ranks: 16 MiB chunks of 4 MiB segments (the default)
    assert fast_allreduce.segments_per_chunk(64 * 2**20 // 4, 4, 4) == 4
    assert fast_allreduce.segments_per_chunk(16 * 2**20 // 4, 4, 4, 2**20) == 4  # 4 MiB chunks, 1 MiB segments
    with pytest.raises(ValueError, match="positive"):
        fast_allreduce.segments_per_chunk(10, 2, 4, 0)


def test_closed_forms_hold_when_the_tensor_divides_evenly():
    # The docstrings' formulas: ring variants 2(G-1)N/G per rank, halving-doubling 2(P-1)N/P (+N when
    # folding), tree N (children + 1), rank 0 ceil(log2 G) N. Checked against expected_traffic, which
    # counts exactly for any N.
    for g in range(2, 9):
        n = 2 * 3 * 5 * 7 * 8 * 16
        p = 1 << (g.bit_length() - 1)
        extra = g - p
        for r in range(g):
            for name in ("ring_pipelined", "ring_bidirectional"):
                assert fast_allreduce.expected_traffic(name, n, g, r)["elements_sent"] == 2 * (g - 1) * n // g
            hd = fast_allreduce.expected_traffic("halving_doubling", n, g, r)["elements_sent"]
            if r < 2 * extra and r % 2 == 0:
                assert hd == n
            else:
                assert hd == 2 * (p - 1) * n // p + (n if r < 2 * extra else 0)
        assert fast_allreduce.expected_traffic("tree", n, g, 0)["elements_sent"] == (g - 1).bit_length() * n
        rd = [fast_allreduce.expected_traffic("recursive_doubling", n, g, r)["elements_sent"] for r in range(g)]
        steps = p.bit_length() - 1
        assert rd == [n if (r < 2 * extra and r % 2 == 0) else n * (steps + (r < 2 * extra)) for r in range(g)]
        # The formulas agree with themselves: every element sent is received by someone, for any length
        # (the recorded traffic is checked pair by pair in the launched test above).
        for name in NAMES:
            for numel in range(0, 3 * g + 2):
                rows = [fast_allreduce.expected_traffic(name, numel, g, r) for r in range(g)]
                assert sum(x["elements_sent"] for x in rows) == sum(x["elements_received"] for x in rows)
                assert sum(x["messages_sent"] for x in rows) == sum(x["messages_received"] for x in rows)


def test_the_plain_rings_formula_agrees_with_viz_and_with_its_recording():
    # expected_traffic("ring") is the plain ring's count (one message per chunk); viz.expected_traffic
    # derives the same numbers its own way; and allreduce.ring must record exactly them.
    from course_lib import viz

    for g in range(1, 7):
        for numel in (0, 1, g - 1, 2 * g + 1, 97):
            other = viz.expected_traffic("ring", g, numel) if g > 1 else None
            for r in range(g):
                mine = fast_allreduce.expected_traffic("ring", numel, g, r)
                if other is not None:
                    assert mine == {key: values[r] for key, values in other.items()}, (g, numel, r)
                assert mine["messages_sent"] == (2 * (g - 1) if g > 1 else 0)
    recorded = run(_ring_traffic_rank, 3, 10)
    assert recorded == [fast_allreduce.expected_traffic("ring", 10, 3, r) for r in range(3)]


def _ring_traffic_rank(rank, g, numel):
    tensor = torch.arange(numel, dtype=torch.float32) * (rank + 1)
    with traffic.record() as rec:
        allreduce.ring(tensor)
    return dict(elements_sent=rec.elements_sent, elements_received=rec.elements_received,
                messages_sent=rec.messages_sent, messages_received=rec.messages_received)


def test_step_formulas():
    assert fast_allreduce.expected_steps("tree", 5) == {"reduce": 3, "broadcast": 3}
    assert fast_allreduce.expected_steps("halving_doubling", 8) == {"reduce_scatter": 3, "all_gather": 3}
    assert fast_allreduce.expected_steps("halving_doubling", 6) == \
        {"reduce_scatter": 2, "all_gather": 2, "fold": 1, "unfold": 1}
    assert fast_allreduce.expected_steps("ring_pipelined", 4) == {"scatter_reduce": 3, "all_gather": 3}
    assert fast_allreduce.expected_steps("recursive_doubling", 8) == {"exchange": 3}
    assert fast_allreduce.expected_steps("recursive_doubling", 5) == {"exchange": 2, "fold": 1, "unfold": 1}
    assert fast_allreduce.expected_steps("tree", 1) == {}
    with pytest.raises(ValueError, match="no step formula"):
        fast_allreduce.expected_steps("gossip", 4)


def test_variants_are_registered_under_stable_names():
    for name in NAMES:
        assert allreduce.get(name) is fast_allreduce.VARIANTS[name] is getattr(fast_allreduce, name)


def _bad_segments_rank(rank, g):
    outcomes = []
    for segment in ([0, 0, 0], [1024, 2048, 1024], ["1MiB"] * 3):
        try:
            fast_allreduce.ring_pipelined(torch.ones(10), segment_bytes=segment[rank])
            outcomes.append("ran")
        except ValueError as exc:  # MismatchError is a ValueError
            outcomes.append(f"{type(exc).__name__}: {exc}")
    return outcomes


def test_bad_or_disagreeing_segment_sizes_fail_clearly_instead_of_hanging():
    results = run(_bad_segments_rank, 3, timeout=60)
    for rank, (zero, differ, text) in enumerate(results):
        assert "segment_bytes=0 must be a positive number of bytes" in zero
        assert "disagree about segment_bytes" in differ and "rank 1: 2048" in differ
        assert "segment_bytes='1MiB'" in text


def _mixed_variants_rank(rank, g):
    variant = allreduce.get("tree" if rank == 0 else "ring_pipelined")
    try:
        variant(torch.ones(10))
    except ValueError as exc:
        return str(exc)
    return "ran"


def test_ranks_in_different_variants_are_named_not_hidden_behind_a_code():
    for text in run(_mixed_variants_rank, 2, timeout=60):
        assert "different functions" in text
        assert "allreduce.tree" in text and "allreduce.ring_pipelined" in text and "code" not in text
