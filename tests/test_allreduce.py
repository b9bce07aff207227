"""course_lib.allreduce's variants against torch.distributed.all_reduce (gloo), inside launch.

One launch per world size 1..6 runs naive, parameter_server (several roots), ring, and the ring's two
phases called one after the other, for every (dtype, op) pair torch allows (float32, float64,
int64, bfloat16 x SUM, AVG, PRODUCT, MAX, MIN; no AVG for int64), lengths 0, 1, below / not
divisible by / divisible by G, multi-dimensional and non-contiguous tensors, and about a million
elements for a few pairs. Integers, MAX and MIN must match torch exactly, float sums and products
within a bound derived from the inputs; every rank's result must be bit-identical to every other
rank's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from conftest import (DTYPES, MILLION, TORCH_OPS, assert_no_failures, assert_same_on_every_rank, digest,
                      gaps_untouched, lengths, make_input, mismatch, ops_for, run, strided, tolerance)
from course_lib import allreduce


def composed(tensor, op):
    """The ring as two calls, checking what ring_scatter_reduce returns on the way."""
    owned = allreduce.ring_scatter_reduce(tensor, op)
    allreduce.ring_all_gather(tensor)
    return owned


VARIANT_NAMES = ("naive", "parameter_server", "ring", "composed")


def _shapes(G):
    one_d = [((n,), False) for n in lengths(G)]
    return one_d + [((3, G + 2), False), ((3, G + 2), True), ((2, 3, G + 1), True), ((G + 1,), True)]


def _cases(G):
    """(variant, dtype, op, shape, non-contiguous?, root) for world size G, the same on every rank."""
    shapes = _shapes(G)
    one_d, extra = shapes[: len(lengths(G))], shapes[len(lengths(G)):]
    pairs = [(dtype, op) for dtype in DTYPES for op in ops_for(dtype)]
    cases = []
    for v, variant in enumerate(VARIANT_NAMES):
        # every (dtype, op) pair, the length rotating so that each variant sees every length
        for i, (dtype, op) in enumerate(pairs):
            shape, noncontig = one_d[(i + v) % len(one_d)]
            cases.append((variant, dtype, op, shape, noncontig, (i + v) % G))
        for k, (shape, noncontig) in enumerate(extra):
            dtype, op = pairs[(5 * k + v) % len(pairs)]
            cases.append((variant, dtype, op, shape, noncontig, (k + 1) % G))
    for root in range(G):  # the parameter server at every root
        cases.append(("parameter_server", torch.float32, "SUM", (G + 1,), False, root))
    if G == 3:  # about a million elements, a few combinations
        cases += [("ring", torch.float32, "SUM", (MILLION,), False, 0),
                  ("naive", torch.bfloat16, "AVG", (MILLION,), False, 0),
                  ("parameter_server", torch.int64, "MAX", (MILLION,), False, G - 1)]
    return cases


def _name(case):
    variant, dtype, op, shape, noncontig, root = case
    where = f" root={root}" if variant == "parameter_server" else ""
    return f"{variant} {op} {str(dtype)[6:]} shape={shape}{' strided' if noncontig else ''}{where}"


def _variants_rank(rank, G):
    failures, digests = [], {}
    cases = _cases(G)
    for seed, case in enumerate(cases):
        variant, dtype, op, shape, noncontig, root = case
        name = _name(case)
        everyone = [make_input(seed, r, shape, dtype, op) for r in range(G)]
        expected = everyone[rank].clone()
        dist.all_reduce(expected, op=TORCH_OPS[op])
        mine = strided(everyone[rank]) if noncontig else everyone[rank].clone()
        op_arg = TORCH_OPS[op] if seed % 2 else op  # both spellings are accepted
        try:
            if variant == "parameter_server":
                allreduce.parameter_server(mine, op_arg, root=root)
            elif variant == "composed":
                owned = composed(mine, op_arg)
                if owned != (rank + 1) % G or owned != allreduce.owned_chunk(rank, G):
                    failures.append(f"{name}: ring_scatter_reduce returned {owned!r}, expected {(rank + 1) % G}")
            else:
                allreduce.get(variant)(mine, op_arg)
        except Exception as exc:
            raise RuntimeError(f"case {name!r} raised on rank {rank}") from exc
        if noncontig and not gaps_untouched(mine):
            failures.append(f"{name}: wrote into the buffer between the strided tensor's elements")
        problem = mismatch(mine, expected, tolerance(everyone, op, dtype), what="result vs torch")
        if problem:
            failures.append(f"{name}: {problem}")
        digests[name] = digest(mine)
    return failures, digests, len(cases)


def test_every_variant_matches_torch_and_is_identical_on_every_rank(world_size):
    results = run(_variants_rank, world_size, timeout=120)
    assert results[0][2] >= 4 * 19
    assert_no_failures([failures for failures, _, _ in results], f"G={world_size}")
    assert_same_on_every_rank([digests for _, digests, _ in results], f"G={world_size}")


def _rank_order_rank(rank, G):
    """naive and parameter_server combine the G tensors in rank order 0, 1, ..., G-1 (documented)."""
    failures = []
    for seed, (variant, dtype) in enumerate([("naive", torch.float32), ("parameter_server", torch.bfloat16),
                                             ("naive", torch.bfloat16), ("parameter_server", torch.float32)]):
        everyone = [make_input(seed, r, (301,), dtype) * (8.0 ** r) for r in range(G)]  # mixed magnitudes
        in_rank_order = everyone[0].clone()
        for other in everyone[1:]:
            in_rank_order += other
        mine = everyone[rank].clone()
        allreduce.get(variant)(mine, "sum")
        failures.append(mismatch(mine, in_rank_order, what=f"{variant} {dtype}"))
    return [f for f in failures if f]


@pytest.mark.parametrize("G", [4])
def test_naive_and_parameter_server_reduce_in_rank_order(G):
    assert_no_failures(run(_rank_order_rank, G), f"G={G}")


# -------------------------------------------------------------------------------------------------
# Pure helpers: no launch needed
# -------------------------------------------------------------------------------------------------


def test_chunk_sizes_are_torch_tensor_split_sizes():
    for world_size in range(1, 9):
        for numel in list(range(0, 40)) + [MILLION, 10**6]:
            expected = [c.numel() for c in torch.tensor_split(torch.empty(numel), world_size)]
            assert allreduce.chunk_sizes(numel, world_size) == expected, (numel, world_size)


def test_owned_chunk_is_the_next_rank():
    for world_size in range(1, 9):
        assert [allreduce.owned_chunk(r, world_size) for r in range(world_size)] == \
            [(r + 1) % world_size for r in range(world_size)]


def test_get_names_every_variant_and_rejects_unknown_ones():
    assert allreduce.get("naive") is allreduce.naive
    assert allreduce.get("ring") is allreduce.ring
    assert allreduce.get("parameter_server") is allreduce.get("master") is allreduce.parameter_server
    with pytest.raises(ValueError, match="unknown all-reduce variant 'telepathy'.*naive"):
        allreduce.get("telepathy")
