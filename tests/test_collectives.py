"""course_lib.collectives against the built-in torch.distributed collectives (gloo), inside launch.

One launch per world size 1..6 runs every case: each of the eight collectives, dtypes float32,
float64, int64 and bfloat16, lengths 0, 1, below / not divisible by / divisible by the world size,
every reduce op the dtype allows, multi-dimensional and non-contiguous tensors, roots other than 0,
and all_to_all with uneven pieces. A handful of about-a-million-element cases run at G = 3.

Each case runs the same inputs through course_lib and through torch.distributed and compares:
copies (broadcast, scatter, gather, all_gather, all_to_all) and integer / MAX / MIN reductions
must be bit-exact, float sums and products within a bound derived from the inputs (see
conftest.tolerance). The tests also check the in-place contract: inputs that must not change
do not, and a non-contiguous output is written through its own strides.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from conftest import (DTYPES, MILLION, TORCH_OPS, assert_no_failures, assert_same_on_every_rank, digest,
                      gaps_untouched, lengths, make_input, mismatch, ops_for, run, strided, tolerance)
from course_lib import collectives


def _layout(tensor, noncontiguous):
    return strided(tensor) if noncontiguous else tensor


def _shapes(world_size):
    """(shape, non-contiguous?) pairs: 1-D lengths, then a 2-D and a 3-D shape, contiguous or not."""
    one_d = [((n,), False) for n in lengths(world_size)]
    return one_d + [((3, world_size + 2), False), ((3, world_size + 2), True),
                    ((2, 3, world_size + 1), True), ((world_size + 1,), True)]


# -------------------------------------------------------------------------------------------------
# One check per collective: run course_lib and torch on the same inputs, return what differs.
# -------------------------------------------------------------------------------------------------


def check_broadcast(rank, G, seed, shape, dtype, noncontig, src):
    x = make_input(seed, rank, shape, dtype)
    expected = x.clone()
    dist.broadcast(expected, src)
    mine = _layout(x.clone(), noncontig)
    collectives.broadcast(mine, src=src)
    return [mismatch(mine, expected, what="broadcast result")] + _gaps([mine], "broadcast")


def check_scatter(rank, G, seed, shape, dtype, noncontig, src):
    pieces = [make_input(seed, 100 + j, shape, dtype) for j in range(G)] if rank == src else None
    expected = torch.empty(shape, dtype=dtype)
    dist.scatter(expected, [p.clone() for p in pieces] if pieces else None, src)
    mine = _layout(torch.full(shape, 7, dtype=dtype), noncontig)
    scatter_list = [_layout(p.clone(), noncontig) for p in pieces] if pieces else None
    collectives.scatter(mine, scatter_list, src=src)
    problems = [mismatch(mine, expected, what="scatter result")] + _gaps([mine], "scatter")
    if pieces:
        problems += [mismatch(s, p, what=f"src's scatter_list[{j}] was modified")
                     for j, (s, p) in enumerate(zip(scatter_list, pieces))]
    return problems


def check_gather(rank, G, seed, shape, dtype, noncontig, dst):
    x = make_input(seed, rank, shape, dtype)
    expected = [torch.empty(shape, dtype=dtype) for _ in range(G)] if rank == dst else None
    dist.gather(x.clone(), expected, dst)
    mine_in = _layout(x.clone(), noncontig)
    mine = [_layout(torch.full(shape, 7, dtype=dtype), noncontig) for _ in range(G)] if rank == dst else None
    collectives.gather(mine_in, mine, dst=dst)
    problems = [mismatch(mine_in, x, what="gather input was modified")]
    if rank == dst:
        problems += [mismatch(m, e, what=f"gather_list[{j}]") for j, (m, e) in enumerate(zip(mine, expected))]
        problems += _gaps(mine, "gather")
    return problems


def check_all_gather(rank, G, seed, shape, dtype, noncontig):
    x = make_input(seed, rank, shape, dtype)
    expected = [torch.empty(shape, dtype=dtype) for _ in range(G)]
    dist.all_gather(expected, x.clone())
    mine_in = _layout(x.clone(), noncontig)
    mine = [_layout(torch.full(shape, 7, dtype=dtype), noncontig) for _ in range(G)]
    collectives.all_gather(mine, mine_in)
    return ([mismatch(mine_in, x, what="all_gather input was modified")] + _gaps(mine, "all_gather")
            + [mismatch(m, e, what=f"tensor_list[{j}]") for j, (m, e) in enumerate(zip(mine, expected))])


def _piece_size(sender, receiver, seed):
    """Uneven all_to_all pieces: 0 to 4 elements, depending on who sends to whom."""
    return (3 * sender + 2 * receiver + seed) % 5


def check_all_to_all(rank, G, seed, shape, dtype, noncontig, uneven):
    if uneven:
        in_shapes = [(_piece_size(rank, j, seed),) for j in range(G)]
        out_shapes = [(_piece_size(j, rank, seed),) for j in range(G)]
    else:
        in_shapes = out_shapes = [shape] * G
    inputs = [make_input(seed, rank * G + j, s, dtype) for j, s in enumerate(in_shapes)]
    # The oracle: gloo's all_to_all wants equal pieces, all_to_all_single takes split sizes.
    flat_out = torch.empty(sum(torch.Size(s).numel() for s in out_shapes), dtype=dtype)
    dist.all_to_all_single(flat_out, torch.cat([x.reshape(-1) for x in inputs]),
                           [torch.Size(s).numel() for s in out_shapes], [x.numel() for x in inputs])
    expected = [piece.reshape(s) for piece, s in
                zip(torch.split(flat_out, [torch.Size(s).numel() for s in out_shapes]), out_shapes)]
    mine_in = [_layout(x.clone(), noncontig) for x in inputs]
    mine = [_layout(torch.full(s, 7, dtype=dtype), noncontig) for s in out_shapes]
    collectives.all_to_all(mine, mine_in)
    return ([mismatch(m, x, what=f"input_tensor_list[{j}] was modified")
             for j, (m, x) in enumerate(zip(mine_in, inputs))]
            + [mismatch(m, e, what=f"output_tensor_list[{j}]") for j, (m, e) in enumerate(zip(mine, expected))]
            + _gaps(mine, "all_to_all"))


def check_reduce(rank, G, seed, shape, dtype, noncontig, dst, op):
    everyone = [make_input(seed, r, shape, dtype, op) for r in range(G)]
    x = everyone[rank]
    expected = x.clone()
    dist.reduce(expected, dst, op=TORCH_OPS[op])
    mine = _layout(x.clone(), noncontig)
    collectives.reduce(mine, dst=dst, op=op)
    if rank != dst:  # documented: the other ranks' tensors are left as they were
        return [mismatch(mine, x, what=f"reduce {op}: non-dst tensor was modified")]
    return ([mismatch(mine, expected, tolerance(everyone, op, dtype), what=f"reduce {op} at dst")]
            + _gaps([mine], "reduce"))


def check_all_reduce(rank, G, seed, shape, dtype, noncontig, op, digests, name):
    everyone = [make_input(seed, r, shape, dtype, op) for r in range(G)]
    expected = everyone[rank].clone()
    dist.all_reduce(expected, op=TORCH_OPS[op])
    mine = _layout(everyone[rank].clone(), noncontig)
    # torch.distributed.ReduceOp and the op's name are both accepted: alternate them.
    collectives.all_reduce(mine, op=TORCH_OPS[op] if seed % 2 else op.lower())
    digests[name] = digest(mine)
    return ([mismatch(mine, expected, tolerance(everyone, op, dtype), what=f"all_reduce {op}")]
            + _gaps([mine], "all_reduce"))


def check_reduce_scatter(rank, G, seed, shape, dtype, noncontig, op, digests, name):
    inputs = [make_input(seed, rank * G + j, shape, dtype, op) for j in range(G)]
    expected = torch.empty(shape, dtype=dtype)
    dist.reduce_scatter(expected, [x.clone() for x in inputs], op=TORCH_OPS[op])
    mine_in = [_layout(x.clone(), noncontig) for x in inputs]
    mine = _layout(torch.full(shape, 7, dtype=dtype), noncontig)
    collectives.reduce_scatter(mine, mine_in, op=op)
    contributions = [make_input(seed, r * G + rank, shape, dtype, op) for r in range(G)]
    return ([mismatch(mine, expected, tolerance(contributions, op, dtype), what=f"reduce_scatter {op}")]
            + _gaps([mine], "reduce_scatter")
            + [mismatch(m, x, what=f"input_list[{j}] was modified") for j, (m, x) in enumerate(zip(mine_in, inputs))])


# -------------------------------------------------------------------------------------------------
# The rank function: every case, one launch
# -------------------------------------------------------------------------------------------------


def _cases(G):
    """(name, check, kwargs) for every case at world size G, in the same order on every rank.

    Not the full cross product (it would take minutes on two cores): every collective sees every
    dtype and every length, every reducing collective every (dtype, op) pair, lengths rotating
    through the pairs; float32 additionally gets every length and the multi-dimensional and
    strided shapes; the rooted collectives try every root once.
    """
    shapes = _shapes(G)
    one_d, extra = shapes[: len(lengths(G))], shapes[len(lengths(G)):]
    cases = []

    def label(dtype, shape, noncontig):
        return f"{str(dtype)[6:]} shape={shape}{' strided' if noncontig else ''}"

    turn = 0
    for dtype in DTYPES:
        if dtype == torch.float32:
            chosen = shapes
        else:  # some of the lengths, different ones for each dtype, and one strided shape
            steps = (0, 2, 4) if G <= 4 else (0, 3)  # fewer at G = 5, 6, where each step costs most
            chosen = [one_d[(turn + k) % len(one_d)] for k in steps] + [extra[turn % len(extra)]]
            turn += 1
        for index, (shape, noncontig) in enumerate(chosen):
            common = dict(shape=shape, dtype=dtype, noncontig=noncontig)
            name = label(dtype, shape, noncontig)
            root = (index * 3 + turn + 1) % G
            cases.append((f"broadcast {name} src={root}", check_broadcast, dict(common, src=root)))
            cases.append((f"scatter {name} src={root}", check_scatter, dict(common, src=root)))
            cases.append((f"gather {name} dst={root}", check_gather, dict(common, dst=root)))
            cases.append((f"all_gather {name}", check_all_gather, common))
            cases.append((f"all_to_all {name}", check_all_to_all, dict(common, uneven=False)))
        cases.append((f"all_to_all uneven {str(dtype)[6:]}", check_all_to_all,
                      dict(shape=(0,), dtype=dtype, noncontig=dtype == torch.float64, uneven=True)))
    # Every root, for each rooted collective.
    for root in range(G):
        common = dict(shape=(G + 1,), dtype=torch.float32, noncontig=False)
        cases.append((f"broadcast every root src={root}", check_broadcast, dict(common, src=root)))
        cases.append((f"scatter every root src={root}", check_scatter, dict(common, src=root)))
        cases.append((f"gather every root dst={root}", check_gather, dict(common, dst=root)))
        cases.append((f"reduce every root dst={root}", check_reduce, dict(common, dst=root, op="SUM")))
    # Reductions: every (dtype, op) pair with a rotating length, then shapes for two pairs.
    pairs = [(dtype, op) for dtype in DTYPES for op in ops_for(dtype)]
    reduce_cases = [(dtype, op, one_d[i % len(one_d)]) for i, (dtype, op) in enumerate(pairs)]
    reduce_cases += [(torch.float32, "SUM", s) for s in extra] + [(torch.int64, "MAX", s) for s in extra[1:3]]
    for i, (dtype, op, (shape, noncontig)) in enumerate(reduce_cases):
        common = dict(shape=shape, dtype=dtype, noncontig=noncontig, op=op)
        name = f"{op} {label(dtype, shape, noncontig)}"
        cases.append((f"reduce {name} dst={(i + 1) % G}", check_reduce, dict(common, dst=(i + 1) % G)))
        cases.append((f"all_reduce {name}", check_all_reduce, common))
        cases.append((f"reduce_scatter {name}", check_reduce_scatter, common))
    if G == 3:  # about a million elements: a few combinations only
        big = dict(shape=(MILLION,), noncontig=False)
        cases += [
            ("broadcast float32 1M", check_broadcast, dict(big, dtype=torch.float32, src=G - 1)),
            ("all_reduce float32 SUM 1M", check_all_reduce, dict(big, dtype=torch.float32, op="SUM")),
            ("reduce_scatter bfloat16 AVG ~1M/G", check_reduce_scatter,
             dict(big, shape=(MILLION // G,), dtype=torch.bfloat16, op="AVG")),
        ]
    return cases


def _gaps(tensors, what):
    """Strided outputs must be written through their strides only (see conftest.gaps_untouched)."""
    return [None if gaps_untouched(x) else f"{what}: wrote between a strided tensor's elements" for x in tensors]


def _collectives_rank(rank, G):
    failures, digests = [], {}
    for seed, (name, check, kwargs) in enumerate(_cases(G)):
        extra = dict(digests=digests, name=name) if check in (check_all_reduce, check_reduce_scatter) else {}
        try:
            problems = check(rank, G, seed, **kwargs, **extra)
        except Exception as exc:  # a crash in one case must not hide the case's name
            raise RuntimeError(f"case {name!r} raised on rank {rank}") from exc
        failures += [f"{name}: {p}" for p in problems if p]
    return failures, digests, len(_cases(G))


def test_every_collective_matches_torch(world_size):
    results = run(_collectives_rank, world_size, timeout=120)
    assert results[0][2] > 80  # the case list really is long
    assert_no_failures([failures for failures, _, _ in results], f"G={world_size}")
    # all_reduce (and reduce_scatter, where every rank gets its own piece) must agree bit for bit
    # across ranks for all_reduce: the library reduces in the same order on every rank.
    all_reduce_digests = [{k: v for k, v in d.items() if k.startswith("all_reduce")} for _, d, _ in results]
    assert_same_on_every_rank(all_reduce_digests, f"collectives.all_reduce G={world_size}")


def test_noncontiguous_cases_really_are_noncontiguous():
    """Guard against a vacuous test: the strided layouts used above are not contiguous."""
    for G in (1, 2, 6):
        for shape, noncontig in _shapes(G):
            if noncontig:
                assert not strided(torch.zeros(shape)).is_contiguous(), shape


def _reduce_keeps_order_rank(rank, G):
    """collectives.reduce / all_reduce docstrings: values are combined in rank order 0, 1, ..., G-1."""
    failures = []
    for seed, dtype in enumerate((torch.float32, torch.bfloat16)):
        everyone = [make_input(seed, r, (257,), dtype) * (10.0 ** r) for r in range(G)]  # big and small terms
        in_order = everyone[0].clone()
        for other in everyone[1:]:
            in_order += other
        mine = everyone[rank].clone()
        collectives.reduce(mine, dst=G - 1, op="SUM")
        if rank == G - 1:
            failures.append(mismatch(mine, in_order, what=f"reduce {dtype} not in rank order"))
    return [f for f in failures if f]


@pytest.mark.parametrize("G", [3, 5])
def test_reduce_combines_in_rank_order(G):
    assert_no_failures(run(_reduce_keeps_order_rank, G), f"G={G}")
