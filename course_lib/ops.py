"""Reduce operations, how two ranks' values become one, and the tensor shapes the algorithms work on.

    SUM      a + b            AVG      (a_0 + ... + a_{G-1}) / G, floating dtypes only
    PRODUCT  a * b            MAX/MIN  elementwise max(a, b) / min(a, b)

`torch.distributed.ReduceOp.SUM` and friends are accepted, so are ReduceOp objects such as
``ReduceOp(ReduceOp.SUM)``, and so are the strings "sum", "avg", ... AVG is a SUM whose result is
divided by the world size once at the end, which is why it needs a dtype that can hold a fraction:
torch refuses AVG on integer tensors, and so do we.

Deliberately left out: torch's bitwise BAND, BOR, BXOR and NCCL's PREMUL_SUM (they teach nothing
about combining gradients), and SUM on bool tensors (see `check_dtype`).

The algorithms cut a tensor the way `torch.tensor_split` does (`chunk_sizes`) and work on a flat view of it
(`flat_view`). This module imports nothing else of course_lib: it is the bottom of the algorithms' layers.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

__all__ = ["SUM", "AVG", "PRODUCT", "MAX", "MIN", "OPS", "normalize", "check_dtype", "combine_", "finish_",
           "reduce_in_rank_order", "chunk_sizes", "flat_view", "contiguous_flat"]

SUM, AVG, PRODUCT, MAX, MIN = "SUM", "AVG", "PRODUCT", "MAX", "MIN"
OPS = (SUM, AVG, PRODUCT, MAX, MIN)

_FROM_TORCH = {dist.ReduceOp.SUM: SUM, dist.ReduceOp.AVG: AVG, dist.ReduceOp.PRODUCT: PRODUCT,
               dist.ReduceOp.MAX: MAX, dist.ReduceOp.MIN: MIN}


_SUPPORTED = (f"use one of torch.distributed.ReduceOp.{', ReduceOp.'.join(OPS)} "
              f"(or the strings {', '.join(repr(o.lower()) for o in OPS)})")


def normalize(op) -> str:
    """The name ('SUM', 'AVG', ...) of a reduce op given as a torch ReduceOp or a string."""
    if isinstance(op, str) and op.upper() in OPS:
        return op.upper()
    kind = op
    if not isinstance(op, dist.ReduceOp.RedOpType) and isinstance(op, dist.ReduceOp):
        kind = op.op  # a ReduceOp object, e.g. ReduceOp(ReduceOp.SUM), wraps the RedOpType ReduceOp.SUM
    try:
        name = _FROM_TORCH.get(kind)
    except TypeError:  # unhashable
        name = None
    if name is not None:
        return name
    if isinstance(kind, dist.ReduceOp.RedOpType):  # a real torch op that course_lib leaves out
        shown = f"ReduceOp.{kind.name}"
        instead = ("multiply your tensor by the factor yourself, then reduce with SUM"
                   if kind == dist.ReduceOp.PREMUL_SUM else
                   f"call torch.distributed's own collective, e.g. torch.distributed.all_reduce(tensor, op={shown})")
        raise ValueError(f"unsupported reduce op {shown}: course_lib deliberately implements only the reductions "
                         f"that combine gradients; {_SUPPORTED}. For {shown}, {instead}.")
    raise ValueError(f"unsupported reduce op {op!r}: {_SUPPORTED}.")


def check_dtype(op: str, dtype: torch.dtype) -> str | None:
    """Why `op` cannot reduce tensors of `dtype`, or None when it can."""
    if op == AVG and not (dtype.is_floating_point or dtype.is_complex):
        return (f"AVG cannot average a {dtype} tensor: the mean of integers is a fraction. Convert it to a "
                "floating dtype first (tensor.float()), or reduce with SUM and divide yourself.")
    if op in (MAX, MIN) and dtype.is_complex:
        return f"{op} is not defined for complex numbers ({dtype}): they have no order."
    if dtype == torch.bool and op == AVG:
        return "AVG of a bool tensor is a fraction: convert it to a floating dtype first (tensor.float())."
    if dtype == torch.bool and op == SUM:
        return ("SUM of a bool tensor is ambiguous: torch.distributed accepts it and leaves byte sums such as 2 "
                "or 3 in the bool tensor, which course_lib deliberately refuses. Use MAX (logical or), "
                "MIN (logical and), or convert to int (tensor.int()) to count.")
    return None


# What a reduction of two `nbytes` tensors costs on a modeled clock: None (free) unless a modeled network with a
# `memory_bandwidth` is active, whose clock then puts its `reduction(nbytes)` here (`course_lib.modeled_clock`).
charge_reduction = None


def combine_(accumulator: torch.Tensor, incoming: torch.Tensor, op: str) -> torch.Tensor:
    """accumulator <- accumulator (op) incoming, in place. AVG adds here and divides in `finish_`.

    On a modeled clock whose network has a `memory_bandwidth`, this costs the time a device bound by its
    memory takes: read both, write one (`charge_reduction`)."""
    if charge_reduction is not None:
        charge_reduction(accumulator.numel() * accumulator.element_size())
    if op in (SUM, AVG):
        if accumulator.dtype == torch.bool:
            return accumulator.logical_or_(incoming)
        return accumulator.add_(incoming)
    if op == PRODUCT:
        if accumulator.dtype == torch.bool:
            return accumulator.logical_and_(incoming)
        return accumulator.mul_(incoming)
    if op == MAX:
        return torch.maximum(accumulator, incoming, out=accumulator)
    if op == MIN:
        return torch.minimum(accumulator, incoming, out=accumulator)
    raise ValueError(f"unknown op {op!r}")


def finish_(tensor: torch.Tensor, op: str, world_size: int) -> torch.Tensor:
    """Last touch of a fully reduced value: AVG divides the sum by the number of ranks."""
    if op == AVG:
        tensor.div_(world_size)
    return tensor


def reduce_in_rank_order(out: torch.Tensor, tensors: list, op: str) -> torch.Tensor:
    """out <- tensors[0] op tensors[1] op ... op tensors[G-1], always in that order.

    Floating-point addition is not associative: a rank that added the same numbers in another order
    could end one rounding step away from the others. Reducing in rank order on every rank that
    reduces keeps replicas bit-identical.
    """
    out.copy_(tensors[0])
    for other in tensors[1:]:
        combine_(out, other, op)
    return finish_(out, op, len(tensors))


# --------------------------------------------------------------------------------------------------
# The tensor shapes the algorithms work on
# --------------------------------------------------------------------------------------------------


def chunk_sizes(numel: int, world_size: int) -> list[int]:
    """Sizes of the G chunks `torch.tensor_split` makes: the first numel % G chunks are one longer."""
    base, extra = divmod(numel, world_size)
    return [base + 1 if i < extra else base for i in range(world_size)]


@contextlib.contextmanager
def flat_view(tensor: torch.Tensor):
    """A 1-D view of `tensor` to work on in place; a non-contiguous tensor is copied and written back."""
    if tensor.is_contiguous():
        yield tensor.view(-1)
    else:
        flat = tensor.reshape(-1).clone()
        yield flat
        tensor.copy_(flat.view(tensor.shape))


def contiguous_flat(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as a contiguous 1-D tensor (a view when possible) for sending."""
    return tensor.reshape(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
