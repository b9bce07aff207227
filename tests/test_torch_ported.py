"""PyTorch's own collective tests, ported to course_lib, plus the calls a torch user makes that they skip.

torch/testing/_internal/distributed/distributed_test.py runs these for gloo (CPU):

    broadcast     every src; float, double, int8, uint8, int, long (half needs CUDA there; gloo's CPU
                  half works, so it is here too); torch's own fill values (-1e-10, -1e-100, 129, ...)
    reduce        SUM, PRODUCT, MIN, MAX from master/worker values, every dst; the same twice in a row
    all_reduce    SUM, PRODUCT, MIN, MAX; SUM async_op=True; SUM on complex64; on complex, MAX, MIN,
                  PRODUCT, BAND, BOR, BXOR refused
    scatter       every src, float and complex64, scatter_list=[] on the other ranks; no src = rank 0
    gather        every dst, gather_list=[] on the other ranks; no dst = rank 0
    all_gather    float and complex64
    all_to_all    pieces of i + 1 rows for rank i (that test runs on MPI/NCCL only; gloo has it too)

Each is ported with torch's expected values, and also compared with torch.distributed on the same
inputs. Then what those tests leave out and a torch user still writes, each checked against torch:
buffers that alias (``reduce_scatter(input_list[rank], input_list)``, ``all_to_all(lst, lst)``,
overlapping views), ``async_op=True`` on every collective with several in flight, ReduceOp objects,
the other dtypes gloo supports (int8, uint8, int32, float16, bool, complex), roots given as
``group_src`` / ``group_dst``, and ``group=`` the default group. One launch per world size 1..6 runs
every case (as in test_collectives); the async handle's own behaviour gets small launches of its own.

Where course_lib deliberately differs from torch (complex PRODUCT is computed, not refused), the
test says so and checks the result against the exact product.
"""

from __future__ import annotations

import functools
import operator
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

import course_lib
from conftest import TORCH_OPS, assert_no_failures, make_input, mismatch, run, tolerance
from course_lib import collectives, traffic

R = dist.ReduceOp


# -------------------------------------------------------------------------------------------------
# Ported from distributed_test.py (torch's helpers and values, generalised to G = 1)
# -------------------------------------------------------------------------------------------------


def _build_tensor(size, value=None, dtype=torch.float):
    """torch's test helper: a size x size x size tensor filled with `value` (default: size)."""
    return torch.empty(size, size, size, dtype=dtype).fill_(size if value is None else value)


BROADCAST_VALUES = [(torch.float, -1e-10), (torch.double, -1e-100), (torch.half, -0.1), (torch.int8, -2),
                    (torch.uint8, 129), (torch.int, -1e5), (torch.long, -1e15)]

# op, master value, worker value, how to combine: torch's _test_reduce_helper / _test_all_reduce_helper
REDUCE_VALUES = [(R.SUM, 2, 10, operator.add), (R.PRODUCT, 2, 10, operator.mul),
                 (R.MIN, 1010, 1, min), (R.MAX, -1, 10, max)]


def _expected(G, master, worker, combine):
    """torch writes 2 + 10 (G - 1) etc.; the same, computed, also right for G = 1."""
    return functools.reduce(combine, [worker] * (G - 1), master)


def ported_broadcast(rank, G, seed):
    problems = []
    for dtype, value in BROADCAST_VALUES:
        for src in range(G):
            expected = _build_tensor(src + 1, value, dtype)
            mine = expected.clone() if rank == src else _build_tensor(src + 1, -1, dtype)
            collectives.broadcast(mine, src)
            problems.append(mismatch(mine, expected, what=f"{dtype} src={src}"))
    return problems


def ported_reduce(rank, G, seed, twice=False):
    problems = []
    for op, master, worker, combine in REDUCE_VALUES:
        for dst in range(G):
            tensors = [_build_tensor(dst + 1).fill_(master if rank == dst else worker) for _ in range(1 + twice)]
            for tensor in tensors:
                collectives.reduce(tensor, dst, op)
            if rank == dst:
                want = _build_tensor(dst + 1, _expected(G, master, worker, combine))
                problems += [mismatch(t, want, what=f"{op} dst={dst}") for t in tensors]
    return problems


def ported_all_reduce(rank, G, seed, async_op=False, dtype=torch.float):
    problems = []
    values = REDUCE_VALUES if dtype == torch.float else [(R.SUM, complex(2, 3), complex(10, 11), operator.add)]
    for op, master, worker, combine in values:
        for src in range(G):
            tensor = _build_tensor(src + 1, dtype=dtype).fill_(master if rank == src else worker)
            work = collectives.all_reduce(tensor, op, None, async_op=async_op)
            if async_op:
                work.wait()
            want = _build_tensor(src + 1, dtype=dtype).fill_(_expected(G, master, worker, combine))
            problems.append(mismatch(tensor, want, what=f"{op} {dtype} src={src} async_op={async_op}"))
    return problems


def ported_complex_refused(rank, G, seed):
    """torch refuses these ops on complex tensors; course_lib refuses the same ones except PRODUCT."""
    problems = []
    for op in (R.MAX, R.MIN, R.BAND, R.BOR, R.BXOR):
        try:
            collectives.all_reduce(_build_tensor(1, dtype=torch.cfloat), op)
            problems.append(f"{op} on complex64 was accepted")
        except (TypeError, ValueError) as exc:  # torch raises ValueError("all_reduce does not support ...")
            if "all_reduce" not in str(exc) or op.name not in str(exc):
                problems.append(f"{op}: the message names neither all_reduce nor the op: {exc}")
    # Deliberately different: torch refuses PRODUCT on complex (gloo would multiply real and imaginary
    # parts separately); course_lib multiplies the complex numbers. Checked against the exact product.
    values = [complex(1 + 0.1 * r, 0.2 - 0.05 * r) for r in range(G)]
    tensor = torch.full((5,), values[rank], dtype=torch.complex128)
    collectives.all_reduce(tensor, R.PRODUCT)
    want = torch.full((5,), functools.reduce(operator.mul, values), dtype=torch.complex128)
    problems.append(None if torch.allclose(tensor, want, rtol=1e-12) else f"complex PRODUCT {tensor[0]} != {want[0]}")
    return problems


def ported_scatter(rank, G, seed, dtype=torch.float):
    problems = []
    for dest in range(G):
        tensor = _build_tensor(dest + 1, -1, dtype=dtype)
        expected = _build_tensor(dest + 1, rank, dtype=dtype)
        tensors = [_build_tensor(dest + 1, i, dtype=dtype) for i in range(G)] if rank == dest else []
        collectives.scatter(tensor, src=dest, scatter_list=tensors)
        problems.append(mismatch(tensor, expected, what=f"{dtype} src={dest}"))
    return problems


def ported_scatter_checks(rank, G, seed):
    one = torch.ones([1])
    problems = []
    output = one.clone() * -1  # scatter_list only on the source rank
    if rank == 0:
        collectives.scatter(output, src=0, scatter_list=[one.clone() * i for i in range(G)])
    else:
        collectives.scatter(output, src=0)
    problems.append(mismatch(output, one * rank, what="scatter_list only on src"))
    output = one.clone() * -1  # no src argument: rank 0
    if rank == 0:
        collectives.scatter(output, scatter_list=[one.clone() * i for i in range(G)])
    else:
        collectives.scatter(output)
    problems.append(mismatch(output, one * rank, what="no src"))
    return problems


def ported_gather(rank, G, seed):
    problems = []
    for dest in range(G):
        tensor = _build_tensor(dest + 1, rank)
        tensors = [_build_tensor(dest + 1, -1) for _ in range(G)] if rank == dest else []
        collectives.gather(tensor, dst=dest, gather_list=tensors)
        if rank == dest:
            problems += [mismatch(t, _build_tensor(dest + 1, i), what=f"dst={dest} [{i}]") for i, t in enumerate(tensors)]
    return problems


def ported_gather_checks(rank, G, seed):
    one = torch.ones([1])
    problems = []
    for keywords in (dict(dst=0), dict()):  # gather_list only on dst; then no dst argument at all
        gather_list = [one.clone() for _ in range(G)] if rank == 0 else None
        if rank == 0:
            collectives.gather(one * rank, gather_list=gather_list, **keywords)
            problems += [mismatch(gather_list[i], one * i, what=f"{keywords} [{i}]") for i in range(G)]
        else:
            collectives.gather(one * rank, **keywords)
    return problems


def ported_all_gather(rank, G, seed, dtype=torch.float):
    problems = []
    for dest in range(G):
        tensor = _build_tensor(dest + 1, rank, dtype=dtype)
        tensors = [_build_tensor(dest + 1, -1, dtype=dtype) for _ in range(G)]
        collectives.all_gather(tensors, tensor)
        problems += [mismatch(t, _build_tensor(dest + 1, i, dtype=dtype), what=f"{dtype} [{i}]")
                     for i, t in enumerate(tensors)]
    return problems


def ported_all_to_all(rank, G, seed, dtype=torch.float):
    in_splits = [i + 1 for i in range(G)]
    in_tensors = [torch.ones([in_splits[i], G], dtype=dtype) * rank for i in range(G)]
    out_tensors = [torch.ones([rank + 1, G], dtype=dtype) for _ in range(G)]
    expected = [torch.ones([rank + 1, G], dtype=dtype) * i for i in range(G)]
    collectives.all_to_all(out_tensors, in_tensors)
    return [mismatch(t, e, what=f"{dtype} [{i}]") for i, (t, e) in enumerate(zip(out_tensors, expected))]


# -------------------------------------------------------------------------------------------------
# Inputs for the oracle comparisons (random, rank- and position-dependent, any dtype)
# -------------------------------------------------------------------------------------------------


def _input(seed, who, n, dtype, op=None):
    """conftest.make_input, extended to bool (random bits) and complex (random real and imaginary parts)."""
    if dtype == torch.bool:
        return make_input(seed, who, n, torch.int64) % 2 == 1
    if dtype.is_complex:
        real = make_input(seed, who, n, torch.float64, op)
        imag = make_input(seed + 7777, who, n, torch.float64, op if op != "PRODUCT" else None) * 0.1
        return torch.complex(real, imag).to(dtype)
    return make_input(seed, who, n, dtype, op)


def _tolerance(inputs, op, dtype):
    if dtype.is_complex:
        return tolerance([x.abs() for x in inputs], op, torch.float32 if dtype == torch.complex64 else torch.float64)
    return tolerance(inputs, op, dtype)


def _differs(actual, expected, tol=None, what=""):
    """conftest.mismatch, for complex tensors too (compared as pairs of reals)."""
    if actual.dtype.is_complex and expected.dtype.is_complex:
        tol = None if tol is None else torch.stack([tol, tol], dim=-1)
        return mismatch(torch.view_as_real(actual), torch.view_as_real(expected), tol, what)
    return mismatch(actual, expected, tol, what)


def _torch_gather(tensor, gather_list, dst):
    """dist.gather, through real views for complex tensors (gloo's gather has no complex type)."""
    if tensor.dtype.is_complex:
        tensor = torch.view_as_real(tensor)
        gather_list = [torch.view_as_real(t) for t in gather_list] if gather_list else gather_list
    dist.gather(tensor, gather_list, dst)


# -------------------------------------------------------------------------------------------------
# Every collective, on the dtypes and ops gloo supports beyond test_collectives' four dtypes
# -------------------------------------------------------------------------------------------------

# What gloo computes on the CPU (measured): AVG only for floating dtypes, int16 not at all, complex
# only SUM and AVG. bool SUM leaves byte sums 2, 3 in the bool tensor: course_lib refuses it (see
# test_bad_input), so bool is compared on PRODUCT, MIN, MAX.
EXTRA_DTYPES = {
    torch.int8: ("SUM", "PRODUCT", "MIN", "MAX"),
    torch.uint8: ("SUM", "PRODUCT", "MIN", "MAX"),
    torch.int32: ("SUM", "PRODUCT", "MIN", "MAX"),
    torch.float16: ("SUM", "AVG", "PRODUCT", "MIN", "MAX"),
    torch.bool: ("PRODUCT", "MIN", "MAX"),
    torch.complex64: ("SUM", "AVG"),
    torch.complex128: ("SUM", "AVG"),
}


def every_collective(rank, G, seed, dtype, op, n):
    """All eight collectives on one dtype against torch; `op` for the three that reduce."""
    problems = []
    everyone = [_input(seed, r, n, dtype, op) for r in range(G)]
    x = everyone[rank]
    tol = _tolerance(everyone, op, dtype)
    root = seed % G

    expected = x.clone()
    dist.all_reduce(expected, TORCH_OPS[op])
    mine = x.clone()
    collectives.all_reduce(mine, op)
    problems.append(_differs(mine, expected, tol, f"all_reduce {op}"))

    expected = x.clone()
    dist.reduce(expected, root, TORCH_OPS[op])
    mine = x.clone()
    collectives.reduce(mine, root, op)
    problems.append(_differs(mine, expected if rank == root else x, tol if rank == root else None, f"reduce {op}"))

    pieces = [_input(seed + 1, rank * G + j, n, dtype, op) for j in range(G)]
    expected = torch.empty_like(x)
    dist.reduce_scatter(expected, [p.clone() for p in pieces], TORCH_OPS[op])
    mine = torch.empty_like(x)
    collectives.reduce_scatter(mine, [p.clone() for p in pieces], op)
    contributions = [_input(seed + 1, r * G + rank, n, dtype, op) for r in range(G)]
    problems.append(_differs(mine, expected, _tolerance(contributions, op, dtype), f"reduce_scatter {op}"))

    if op == EXTRA_DTYPES[dtype][0]:  # the copies once per dtype
        expected = x.clone()
        dist.broadcast(expected, root)
        mine = x.clone()
        collectives.broadcast(mine, root)
        problems.append(_differs(mine, expected, what="broadcast"))

        expected = [torch.empty_like(x) for _ in range(G)]
        dist.all_gather(expected, x)
        mine = [torch.empty_like(x) for _ in range(G)]
        collectives.all_gather(mine, x)
        problems += [_differs(m, e, what=f"all_gather [{j}]") for j, (m, e) in enumerate(zip(mine, expected))]

        expected = [torch.empty_like(x) for _ in range(G)] if rank == root else []
        _torch_gather(x, expected, root)
        mine = [torch.empty_like(x) for _ in range(G)] if rank == root else []
        collectives.gather(x, mine, root)
        problems += [_differs(m, e, what=f"gather [{j}]") for j, (m, e) in enumerate(zip(mine, expected))]

        expected = torch.empty_like(x)
        dist.scatter(expected, [p.clone() for p in pieces] if rank == root else None, root)
        mine = torch.empty_like(x)
        collectives.scatter(mine, [p.clone() for p in pieces] if rank == root else [], root)
        problems.append(_differs(mine, expected, what="scatter"))

        expected = [torch.empty_like(x) for _ in range(G)]
        dist.all_to_all(expected, [p.clone() for p in pieces])
        mine = [torch.empty_like(x) for _ in range(G)]
        collectives.all_to_all(mine, [p.clone() for p in pieces])
        problems += [_differs(m, e, what=f"all_to_all [{j}]") for j, (m, e) in enumerate(zip(mine, expected))]
    return problems


# -------------------------------------------------------------------------------------------------
# Aliased buffers: torch.distributed on separate copies is the oracle; where torch also gets the
# aliased call itself right on gloo (reduce_scatter into input_list[rank], all_to_all on one list,
# all_gather into a list holding the input), that is compared too.
# -------------------------------------------------------------------------------------------------


def _pieces(seed, rank, G, n, dtype=torch.float32, op=None):
    return [make_input(seed, rank * G + j, n, dtype, op) for j in range(G)]


def alias_reduce_scatter(rank, G, seed, op, shift):
    """reduce_scatter(input_list[(rank + shift) % G], input_list): shift 0 is the usual idiom."""
    n = G + 1
    pieces = _pieces(seed, rank, G, n, op=op)
    expected = torch.empty(n)
    dist.reduce_scatter(expected, [p.clone() for p in pieces], TORCH_OPS[op])
    mine = [p.clone() for p in pieces]
    collectives.reduce_scatter(mine[(rank + shift) % G], mine, op)
    tol = tolerance([make_input(seed, r * G + rank, n, torch.float32, op) for r in range(G)], op, torch.float32)
    problems = [mismatch(mine[(rank + shift) % G], expected, tol, f"output = input_list[rank+{shift}]")]
    if shift == 0:  # torch's own answer with the very same aliasing
        aliased = [p.clone() for p in pieces]
        dist.reduce_scatter(aliased[rank], aliased, TORCH_OPS[op])
        problems.append(mismatch(mine[rank], aliased[rank], tol, "vs torch's aliased call"))
    return problems


def alias_all_to_all(rank, G, seed, layout):
    """all_to_all where the output list is the input list ("same"), a rotation of it ("rotated"),
    or views of one buffer shifted by one element against the inputs ("overlapping")."""
    n = 2 * G + 1
    pieces = _pieces(seed, rank, G, n)
    expected = [torch.empty(n) for _ in range(G)]
    dist.all_to_all(expected, [p.clone() for p in pieces])

    def arrange(source):
        if layout == "same":
            return source, source
        if layout == "rotated":
            return source[1:] + source[:1], source
        buffer = torch.cat([torch.cat(source), torch.zeros(1)])
        return [buffer[j * n + 1:(j + 1) * n + 1] for j in range(G)], [buffer[j * n:(j + 1) * n] for j in range(G)]

    outputs, inputs = arrange([p.clone() for p in pieces])
    collectives.all_to_all(outputs, inputs)
    problems = [mismatch(o, e, what=f"{layout} [{j}]") for j, (o, e) in enumerate(zip(outputs, expected))]
    if layout != "overlapping":
        torch_out, torch_in = arrange([p.clone() for p in pieces])
        dist.all_to_all(torch_out, torch_in)
        problems += [mismatch(o, t, what=f"{layout} vs torch's aliased call [{j}]")
                     for j, (o, t) in enumerate(zip(outputs, torch_out))]
    return problems


def alias_all_gather(rank, G, seed, shift):
    """all_gather(tensor_list, tensor_list[(rank + shift) % G])."""
    n = G + 2
    x = make_input(seed, rank, n, torch.float32)
    expected = [torch.empty(n) for _ in range(G)]
    dist.all_gather(expected, x.clone())
    results = []
    for call in (collectives.all_gather, dist.all_gather):
        tensor_list = [torch.full((n,), -1.0) for _ in range(G)]
        tensor_list[(rank + shift) % G].copy_(x)
        call(tensor_list, tensor_list[(rank + shift) % G])
        results.append(tensor_list)
    return ([mismatch(m, e, what=f"shift {shift} [{j}]") for j, (m, e) in enumerate(zip(results[0], expected))]
            + [mismatch(m, t, what=f"shift {shift} vs torch's aliased call [{j}]")
               for j, (m, t) in enumerate(zip(*results))])


def alias_scatter(rank, G, seed, shift):
    """On src, the output tensor is scatter_list[(src + shift) % G]. (torch's own aliased call is no
    oracle here: with shift 1 gloo overwrote the piece while sending it, seen at G = 3.)"""
    n, src = G + 1, seed % G
    pieces = [make_input(seed, 100 + j, n, torch.float32) for j in range(G)]
    expected = torch.empty(n)
    dist.scatter(expected, [p.clone() for p in pieces] if rank == src else None, src)
    if rank == src:
        scatter_list = [p.clone() for p in pieces]
        tensor = scatter_list[(src + shift) % G]
    else:
        scatter_list, tensor = None, torch.full((n,), -1.0)
    collectives.scatter(tensor, scatter_list, src)
    return [mismatch(tensor, expected, what=f"shift {shift}")]


def alias_gather(rank, G, seed, shift):
    """On dst, the input tensor is gather_list[(dst + shift) % G]."""
    n, dst = G + 1, seed % G
    x = make_input(seed, rank, n, torch.float32)
    expected = [torch.empty(n) for _ in range(G)] if rank == dst else None
    dist.gather(x.clone(), expected, dst)
    if rank != dst:
        collectives.gather(x.clone(), None, dst)
        return []
    gather_list = [torch.full((n,), -1.0) for _ in range(G)]
    gather_list[(dst + shift) % G].copy_(x)
    collectives.gather(gather_list[(dst + shift) % G], gather_list, dst)
    return [mismatch(g, e, what=f"shift {shift} [{j}]") for j, (g, e) in enumerate(zip(gather_list, expected))]


# -------------------------------------------------------------------------------------------------
# async_op=True on every collective, several in flight, mixed with synchronous calls
# -------------------------------------------------------------------------------------------------


def async_everything(rank, G, seed):
    """Queue all eight collectives (and a few more) with async_op=True, make synchronous calls in
    between, wait in reverse order: every result must be torch's. Odd seeds make odd ranks call the
    same collectives synchronously: async_op is a rank's own choice, as in torch."""
    n, root = G + 1, seed % G
    x = make_input(seed, rank, n, torch.float32)
    pieces = _pieces(seed, rank, G, n)
    everyone = [make_input(seed, r, n, torch.float32) for r in range(G)]
    asynchronous = not (seed % 2 and rank % 2)

    oracle = {}
    oracle["all_reduce"] = x.clone()
    dist.all_reduce(oracle["all_reduce"])
    oracle["reduce"] = x.clone()
    dist.reduce(oracle["reduce"], root)
    oracle["broadcast"] = x.clone()
    dist.broadcast(oracle["broadcast"], root)
    oracle["all_gather"] = [torch.empty(n) for _ in range(G)]
    dist.all_gather(oracle["all_gather"], x)
    oracle["gather"] = [torch.empty(n) for _ in range(G)] if rank == root else None
    dist.gather(x, oracle["gather"], root)
    oracle["scatter"] = torch.empty(n)
    dist.scatter(oracle["scatter"], [p.clone() for p in pieces] if rank == root else None, root)
    oracle["all_to_all"] = [torch.empty(n) for _ in range(G)]
    dist.all_to_all(oracle["all_to_all"], [p.clone() for p in pieces])
    oracle["reduce_scatter"] = torch.empty(n)
    dist.reduce_scatter(oracle["reduce_scatter"], [p.clone() for p in pieces])

    mine = {"all_reduce": x.clone(), "reduce": x.clone(), "broadcast": x.clone(),
            "all_gather": [torch.full((n,), -1.0) for _ in range(G)],
            "gather": [torch.full((n,), -1.0) for _ in range(G)] if rank == root else None,
            "scatter": torch.full((n,), -1.0), "all_to_all": [torch.full((n,), -1.0) for _ in range(G)],
            "reduce_scatter": torch.full((n,), -1.0)}
    pieces_in = [p.clone() for p in pieces]
    works = [
        (collectives.all_reduce(mine["all_reduce"], async_op=asynchronous), [mine["all_reduce"]]),
        (collectives.reduce(mine["reduce"], root, async_op=asynchronous), [mine["reduce"]]),
        (collectives.broadcast(mine["broadcast"], root, async_op=asynchronous), [mine["broadcast"]]),
    ]
    sync_sum = x.clone()
    collectives.all_reduce(sync_sum)  # a synchronous call between async ones: it runs after them
    works += [
        (collectives.all_gather(mine["all_gather"], x, async_op=asynchronous), mine["all_gather"]),
        (collectives.gather(x, mine["gather"], root, async_op=asynchronous), mine["gather"] or []),
        (collectives.scatter(mine["scatter"], [p.clone() for p in pieces] if rank == root else None, root,
                             async_op=asynchronous), [mine["scatter"]]),
        (collectives.all_to_all(mine["all_to_all"], pieces_in, async_op=asynchronous), mine["all_to_all"]),
        (collectives.reduce_scatter(mine["reduce_scatter"], pieces_in, async_op=asynchronous),
         [mine["reduce_scatter"]]),
    ]
    problems = []
    for work, outputs in reversed(works):
        if asynchronous:
            if not isinstance(work, collectives.Work):
                problems.append(f"async_op=True returned {work!r}")
                continue
            work.wait()
            if not (work.is_completed() and work.is_success() and work.exception() is None):
                problems.append(f"{work}: not completed successfully after wait()")
            if any(a is not b for a, b in zip(work.result(), outputs)) or len(work.result()) != len(outputs):
                problems.append(f"{work}: result() is not the output tensors")
            from_future = work.get_future().wait()
            if len(from_future) != len(outputs) or any(a is not b for a, b in zip(from_future, outputs)):
                problems.append(f"{work}: get_future() does not hold the result")
        elif work is not None:
            problems.append(f"async_op=False returned {work!r}")
    tol = tolerance(everyone, "SUM", torch.float32)
    problems.append(mismatch(sync_sum, oracle["all_reduce"], tol, "sync all_reduce between async ones"))
    problems.append(mismatch(mine["all_reduce"], oracle["all_reduce"], tol, "all_reduce"))
    problems.append(mismatch(mine["reduce"], oracle["reduce"] if rank == root else x, tol if rank == root else None,
                             "reduce"))
    problems.append(mismatch(mine["broadcast"], oracle["broadcast"], what="broadcast"))
    problems += [mismatch(m, e, what=f"all_gather [{j}]") for j, (m, e) in enumerate(zip(mine["all_gather"],
                                                                                             oracle["all_gather"]))]
    if rank == root:
        problems += [mismatch(m, e, what=f"gather [{j}]") for j, (m, e) in enumerate(zip(mine["gather"],
                                                                                         oracle["gather"]))]
    problems.append(mismatch(mine["scatter"], oracle["scatter"], what="scatter"))
    problems += [mismatch(m, e, what=f"all_to_all [{j}]") for j, (m, e) in enumerate(zip(mine["all_to_all"],
                                                                                             oracle["all_to_all"]))]
    contributions = [make_input(seed, r * G + rank, n, torch.float32) for r in range(G)]
    problems.append(mismatch(mine["reduce_scatter"], oracle["reduce_scatter"],
                             tolerance(contributions, "SUM", torch.float32), "reduce_scatter"))
    return [f"{'async' if asynchronous else 'sync'}: {p}" for p in problems if p]


def many_in_flight(rank, G, seed):
    """Twelve async all_reduces of different sizes in flight, waited for in a shuffled order."""
    tensors = [make_input(seed + k, rank, k + 1, torch.float64) for k in range(12)]
    expected = [t.clone() for t in tensors]
    for e in expected:
        dist.all_reduce(e)
    works = [collectives.all_reduce(t, async_op=True) for t in tensors]
    for k in torch.randperm(12, generator=torch.Generator().manual_seed(seed)).tolist():
        works[k].wait()
    everyone = lambda k: [make_input(seed + k, r, k + 1, torch.float64) for r in range(G)]  # noqa: E731
    return [mismatch(t, e, tolerance(everyone(k), "SUM", torch.float64), f"all_reduce #{k}")
            for k, (t, e) in enumerate(zip(tensors, expected))]


# -------------------------------------------------------------------------------------------------
# ReduceOp in every form torch accepts; roots as group_src / group_dst; group= the default group
# -------------------------------------------------------------------------------------------------


def reduce_op_forms(rank, G, seed, op):
    forms = {"name": op, "lower-case name": op.lower(), "ReduceOp.X": TORCH_OPS[op],
             "ReduceOp(ReduceOp.X)": R(TORCH_OPS[op]), "ReduceOp.RedOpType.X": getattr(R.RedOpType, op)}
    everyone = [make_input(seed, r, G + 1, torch.float64, op) for r in range(G)]
    expected = everyone[rank].clone()
    dist.all_reduce(expected, R(TORCH_OPS[op]))
    problems = []
    for form, value in forms.items():
        mine = everyone[rank].clone()
        collectives.all_reduce(mine, value)
        problems.append(mismatch(mine, expected, tolerance(everyone, op, torch.float64), f"all_reduce op={form}"))
        mine = everyone[rank].clone()
        collectives.reduce(mine, G - 1, value)
        if rank == G - 1:
            problems.append(mismatch(mine, expected, tolerance(everyone, op, torch.float64), f"reduce op={form}"))
        out = torch.empty(G + 1, dtype=torch.float64)  # every piece is this rank's tensor: out = all_reduce's result
        collectives.reduce_scatter(out, [everyone[rank].clone() for _ in range(G)], value)
        problems.append(mismatch(out, expected, tolerance(everyone, op, torch.float64), f"reduce_scatter op={form}"))
    return problems


def roots_and_groups(rank, G, seed):
    """src / dst given as group_src / group_dst, and group= the default group in the three ways torch
    names it (None, dist.group.WORLD, a new group of every rank) give torch's results."""
    everyone_group = dist.new_group(list(range(G)))  # every rank must create it, in the same order
    problems = []
    for group in (None, dist.group.WORLD, everyone_group):
        root = (seed + 1) % G
        x = make_input(seed, rank, G + 1, torch.float32)
        expected = x.clone()
        dist.broadcast(expected, root)
        mine = x.clone()
        collectives.broadcast(mine, group=group, group_src=root)
        problems.append(mismatch(mine, expected, what=f"broadcast group_src, group={group}"))
        expected = x.clone()
        dist.reduce(expected, root)
        mine = x.clone()
        collectives.reduce(mine, op="SUM", group=group, group_dst=root)
        if rank == root:
            problems.append(mismatch(mine, expected, tolerance([make_input(seed, r, G + 1, torch.float32)
                                                                for r in range(G)], "SUM", torch.float32),
                                     f"reduce group_dst, group={group}"))
        pieces = [make_input(seed, 50 + j, G + 1, torch.float32) for j in range(G)]
        mine = torch.empty(G + 1)
        collectives.scatter(mine, pieces if rank == root else [], group=group, group_src=root)
        problems.append(mismatch(mine, pieces[rank], what=f"scatter group_src, group={group}"))
        gathered = [torch.empty(G + 1) for _ in range(G)] if rank == root else None
        collectives.gather(x, gathered, group=group, group_dst=root)
        if rank == root:
            problems += [mismatch(g, make_input(seed, j, G + 1, torch.float32), what=f"gather group_dst [{j}]")
                         for j, g in enumerate(gathered)]
        total = x.clone()
        collectives.all_reduce(total, group=group)
        expected = x.clone()
        dist.all_reduce(expected)
        problems.append(mismatch(total, expected, tolerance([make_input(seed, r, G + 1, torch.float32)
                                                             for r in range(G)], "SUM", torch.float32),
                                 f"all_reduce group={group}"))
    return problems


def refused_with_reasons(rank, G, seed):
    """What course_lib deliberately leaves out raises, on every rank, saying so and what to do."""
    problems = []
    attempts = {
        "BAND": lambda: collectives.all_reduce(torch.ones(3, dtype=torch.int64), R.BAND),
        "BXOR": lambda: collectives.reduce(torch.ones(3, dtype=torch.int64), 0, R.BXOR),
        "PREMUL_SUM": lambda: collectives.all_reduce(torch.ones(3), dist._make_nccl_premul_sum(2.0)),
        "bool SUM": lambda: collectives.all_reduce(torch.ones(3, dtype=torch.bool), R.SUM),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
            problems.append(f"{name} was accepted")
        except (ValueError, TypeError) as exc:
            if "deliberately" not in str(exc):
                problems.append(f"{name}: the error does not say course_lib differs on purpose: {exc}")
    if G > 1:  # a subgroup: only its members call, as in torch; they are told what to do
        subgroup = dist.new_group([0])
        if rank == 0:
            try:
                collectives.broadcast(torch.ones(2), src=0, group=subgroup)
                problems.append("a subgroup was accepted")
            except NotImplementedError as exc:
                for word in ("deliberately", "group=None", "torch.distributed.broadcast"):
                    if word not in str(exc):
                        problems.append(f"subgroup error lacks {word!r}: {exc}")
    return problems


def parameters_in_place(rank, G, seed):
    """torch's collectives write into tensors that require grad (a model's parameters) without
    complaint; so must course_lib's, sync or async (they run without autograd)."""
    everyone = [make_input(seed, r, G + 2, torch.float32) for r in range(G)]
    expected = everyone[rank].clone()
    dist.all_reduce(expected)
    problems = []
    for async_op in (False, True):
        param = torch.nn.Parameter(everyone[rank].clone())
        work = collectives.all_reduce(param, async_op=async_op)
        if work is not None:
            work.wait()
        problems.append(mismatch(param.detach(), expected, tolerance(everyone, "SUM", torch.float32),
                                 f"all_reduce into a Parameter, async_op={async_op}"))
        slots = [torch.nn.Parameter(torch.zeros(G + 2)) for _ in range(G)]
        work = collectives.all_gather(slots, everyone[rank], async_op=async_op)
        if work is not None:
            work.wait()
        problems += [mismatch(s.detach(), everyone[j], what=f"all_gather into Parameters [{j}]")
                     for j, s in enumerate(slots)]
        if not all(s.requires_grad and s.grad_fn is None for s in slots):
            problems.append("all_gather changed the Parameters' autograd state")
        # An input that requires grad (a model's output) is copied, not recorded: like torch's outputs,
        # the plain output tensors stay plain.
        weight = torch.ones(G + 2, requires_grad=True)
        plain = [torch.zeros(G + 2) for _ in range(G)]
        work = collectives.all_gather(plain, weight * (rank + 1), async_op=async_op)
        if work is not None:
            work.wait()
        if any(p.requires_grad or p.grad_fn is not None for p in plain):
            problems.append(f"all_gather of a tensor that requires grad recorded autograd, async_op={async_op}")
        problems += [mismatch(p, torch.full((G + 2,), float(j + 1)), what=f"all_gather of a graph tensor [{j}]")
                     for j, p in enumerate(plain)]
    return problems


# -------------------------------------------------------------------------------------------------
# The rank function: every case, one launch per world size
# -------------------------------------------------------------------------------------------------


def _cases(G):
    cases = [
        ("ported broadcast", ported_broadcast, {}),
        ("ported reduce", ported_reduce, {}),
        ("ported reduce twice", ported_reduce, dict(twice=True)),
        ("ported all_reduce", ported_all_reduce, {}),
        ("ported all_reduce async", ported_all_reduce, dict(async_op=True)),
        ("ported all_reduce complex64", ported_all_reduce, dict(dtype=torch.cfloat)),
        ("ported complex ops", ported_complex_refused, {}),
        ("ported scatter", ported_scatter, {}),
        ("ported scatter complex64", ported_scatter, dict(dtype=torch.cfloat)),
        ("ported scatter checks", ported_scatter_checks, {}),
        ("ported gather", ported_gather, {}),
        ("ported gather checks", ported_gather_checks, {}),
        ("ported all_gather", ported_all_gather, {}),
        ("ported all_gather complex64", ported_all_gather, dict(dtype=torch.cfloat)),
        ("ported all_to_all", ported_all_to_all, {}),
        ("ported all_to_all complex64", ported_all_to_all, dict(dtype=torch.cfloat)),
    ]
    lengths = (1, G + 1, 4 * G + 3)
    for i, (dtype, dtype_ops) in enumerate(EXTRA_DTYPES.items()):
        for k, op in enumerate(dtype_ops):
            n = lengths[(i + k) % len(lengths)]
            cases.append((f"{str(dtype)[6:]} {op} n={n}", every_collective, dict(dtype=dtype, op=op, n=n)))
    for op in ("SUM", "MAX"):
        for shift in range(min(G, 3)):
            cases.append((f"alias reduce_scatter {op} shift {shift}", alias_reduce_scatter, dict(op=op, shift=shift)))
    for layout in ("same", "rotated", "overlapping"):
        cases.append((f"alias all_to_all {layout}", alias_all_to_all, dict(layout=layout)))
    for shift in range(min(G, 3)):
        cases.append((f"alias all_gather shift {shift}", alias_all_gather, dict(shift=shift)))
        cases.append((f"alias scatter shift {shift}", alias_scatter, dict(shift=shift)))
        cases.append((f"alias gather shift {shift}", alias_gather, dict(shift=shift)))
    cases += [(f"async everything #{k}", async_everything, {}) for k in range(2)]
    cases.append(("many async in flight", many_in_flight, {}))
    cases += [(f"op forms {op}", reduce_op_forms, dict(op=op)) for op in ("SUM", "AVG", "PRODUCT", "MAX", "MIN")]
    cases.append(("roots and groups", roots_and_groups, {}))
    cases.append(("refused with reasons", refused_with_reasons, {}))
    cases.append(("parameters in place", parameters_in_place, {}))
    return cases


def _ported_rank(rank, G):
    failures = []
    for seed, (name, check, kwargs) in enumerate(_cases(G)):
        try:
            problems = check(rank, G, seed, **kwargs)
        except Exception as exc:  # a crash in one case must not hide the case's name
            raise RuntimeError(f"case {name!r} raised on rank {rank}") from exc
        failures += [f"{name}: {p}" for p in problems if p]
        dist.barrier()
    return failures, len(_cases(G))


def test_ported_torch_collective_tests_and_what_they_skip(world_size):
    results = run(_ported_rank, world_size, timeout=180)
    assert results[0][1] > 50  # the case list really is long
    assert_no_failures([failures for failures, _ in results], f"G={world_size}")


# -------------------------------------------------------------------------------------------------
# The async handle: progress in the background, timeouts, errors, recordings
# -------------------------------------------------------------------------------------------------


def _progress_without_wait(rank, G):
    """Nothing but is_completed() is called, and the all-reduce still finishes: it runs by itself."""
    tensor = torch.full((1000,), float(rank))
    work = collectives.all_reduce(tensor, async_op=True)
    deadline = time.monotonic() + 20
    while not work.is_completed() and time.monotonic() < deadline:
        time.sleep(0.001)
    return work.is_completed(), tensor[:3].tolist()


def test_an_async_collective_progresses_in_the_background():
    G = 3
    for done, values in run(_progress_without_wait, G):
        assert done, "is_completed() stayed False though the other ranks took part: no progress without wait()"
        assert values == [float(sum(range(G)))] * 3


def _wait_with_timeout(rank, G, flag):
    """Rank 1 calls the broadcast only after rank 0's wait(timeout) has given up and said so."""
    tensor = torch.full((4,), float(rank))
    if rank == 0:
        work = collectives.broadcast(tensor, src=1, async_op=True)
        try:
            work.wait(timeout=0.05)
            outcome = "no timeout"
        except TimeoutError as exc:
            outcome = str(exc)
        midway = (work.is_completed(), work.is_success(), work.exception())
        open(flag, "w").close()
        work.wait(timeout=__import__("datetime").timedelta(seconds=30))
        return outcome, midway, tensor.tolist()
    while not os.path.exists(flag):
        time.sleep(0.01)
    collectives.broadcast(tensor, src=1)
    return None


def test_wait_with_a_timeout_raises_and_the_collective_goes_on(tmp_path):
    outcome, midway, values = run(_wait_with_timeout, 2, str(tmp_path / "flag"))[0]
    assert "did not finish within 0.05 s" in outcome and "wait() again" in outcome
    assert midway == (False, True, None)  # torch's is_success() is True while the work runs
    assert values == [1.0] * 4


def _errors_come_out_of_wait(rank, G):
    work = collectives.all_reduce(torch.ones(3, dtype=torch.int64), op="avg", async_op=True)
    try:
        work.wait()
        raised = None
    except TypeError as exc:
        raised = str(exc)
    again = None
    try:
        work.wait()
    except TypeError as exc:
        again = str(exc)
    healthy = torch.ones(3)
    collectives.all_reduce(healthy)  # the rank goes on: nothing was left in flight
    return raised, again, work.is_completed(), work.is_success(), type(work.exception()).__name__, healthy.tolist()


def test_an_async_collectives_error_comes_out_of_wait_on_every_rank():
    G = 3
    for raised, again, completed, success, kind, healthy in run(_errors_come_out_of_wait, G):
        assert raised is not None and "AVG" in raised and "int64" in raised
        assert again == raised
        assert (completed, success, kind) == (True, False, "TypeError")
        assert healthy == [float(G)] * 3


def _never_waited(rank, G):
    collectives.all_reduce(torch.ones(3, dtype=torch.int64), op="avg", async_op=True)
    return "returned"


def test_an_async_error_nobody_waited_for_fails_the_rank():
    with pytest.raises(course_lib.RankFailedError) as caught:
        run(_never_waited, 2, timeout=30)
    assert "no wait() collected the error" in str(caught.value)
    assert "all_reduce" in str(caught.value) and "AVG" in str(caught.value)


def _recorded(rank, G):
    x = torch.ones(4 * G)
    with traffic.record() as rec:
        work = collectives.all_reduce(x, async_op=True)  # not waited for inside the block
    sent_inside = rec.messages_sent
    work.wait()
    before = collectives.all_reduce(torch.ones(4 * G), async_op=True)
    with traffic.record() as later:  # opened after the call: records none of its messages
        pass
    before.wait()
    return sent_inside, later.messages_sent, x.tolist()


def test_a_recording_holds_the_async_collectives_called_inside_it():
    G = 4
    for sent, later, values in run(_recorded, G):
        assert sent == 2 * (G - 1)  # the ring's messages, all of them, although wait() came after the block
        assert later == 0
        assert values == [float(G)] * (4 * G)


def test_the_launch_waits_for_async_collectives_before_it_returns_results():
    def fn(rank, G):
        tensor = torch.full((3000,), float(rank + 1))
        collectives.all_reduce(tensor, async_op=True)  # never waited for
        return tensor

    for tensor in run(fn, 3):
        assert tensor.tolist() == [6.0] * 3000  # (no big torch op here: see test_stale_step_limit._curvatures)
