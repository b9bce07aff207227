"""The data a check feeds the learner's function, and how to read back what came out.

Two kinds of input, both different on every rank and at every position:

* tagged: `course_lib.viz.tagged_tensor`: rank r's chunk c holds 2**r + c * 2**G, so a sum says which
  ranks went into it and which chunk it belongs to (`decode`). Sums of tags are exact in float32, so
  results are compared bit for bit, and feedback can say "chunk 1 holding a+b" from the numbers alone.
* random: uniform floats, like a gradient. Summation order changes the last bits, so results are
  compared within `tolerance`: (G + 1) eps sum_r |x_r|, elementwise (a missing or doubled
  contribution is far outside it).
"""

from __future__ import annotations

import torch

from course_lib import viz
from course_lib.allreduce import chunk_sizes

__all__ = ["make_input", "tolerance", "decode", "decode_whole", "label", "everyone", "first_difference", "same_values",
           "which_input", "chunk_sizes", "as_float_tensor"]


def make_input(case, rank: int, numel: int | None = None) -> torch.Tensor:
    """Rank `rank`'s input for `case` (float32, 1-D): the same on every call, everywhere."""
    numel = case.numel if numel is None else numel
    if case.data == "tagged":
        return viz.tagged_tensor(rank, case.world_size, numel)
    generator = torch.Generator().manual_seed(1_000_003 * case.seed + 7919 * rank + 104_729 * case.world_size + numel)
    return torch.empty(numel, dtype=torch.float64).uniform_(-1.0, 1.0, generator=generator).float()


def tolerance(abs_sum: torch.Tensor, world_size: int) -> torch.Tensor:
    """Elementwise bound on |result - built-in| for a sum over `world_size` ranks with sum |x| = abs_sum."""
    eps = torch.finfo(torch.float32).eps
    return (world_size + 1) * eps * abs_sum.double() + torch.finfo(torch.float32).tiny


def as_float_tensor(value) -> torch.Tensor | None:
    """`value` (tensor, number or list of numbers) as a flat float64 CPU tensor, or None if it is not numbers."""
    try:
        return torch.as_tensor(value).detach().reshape(-1).cpu().double()
    except (TypeError, ValueError, RuntimeError):
        return None


def decode(values, world_size: int):
    """What a piece of tagged data holds.

    Returns:
        ('empty', None, None) for no elements;
        ('ok', ranks, piece) when every element is the tag sum of the same set of ranks for one piece;
        ('mixed', None, pieces) when the elements belong to different pieces (a cut in the wrong place);
        ('bad', None, None) when a value is no sum of distinct ranks' tags (a contribution counted twice,
        or data that is no rank's input at all).
    """
    flat = torch.as_tensor(values).detach().reshape(-1).cpu()
    if flat.numel() == 0:
        return "empty", None, None
    decoded = set()
    for value in set(flat.tolist()):
        try:
            decoded.add(viz.decode_tag(value, world_size))
        except ValueError:
            return "bad", None, None
    pieces = sorted({piece for _, piece in decoded if piece is not None})
    if len(decoded) == 1:
        ranks, piece = decoded.pop()
        return "ok", ranks, piece
    if len(pieces) > 1:
        return "mixed", None, pieces
    return "bad", None, None


def decode_whole(values, world_size: int):
    """For a whole tagged tensor (cut like `viz.tagged_tensor` cuts it): the set of ranks whose data it
    sums, when every chunk holds the same ranks' contributions to its own chunk; else None."""
    flat = torch.as_tensor(values).detach().reshape(-1).cpu()
    if flat.numel() == 0:
        return None
    try:
        sets = {ranks for ranks in viz.decode_chunks(flat, world_size) if ranks is not None}
    except ValueError:
        return None
    return sets.pop() if len(sets) == 1 else None


def everyone(world_size: int) -> frozenset:
    return frozenset(range(world_size))


def label(ranks, world_size: int) -> str:
    """'a+b+c' for ranks {0, 1, 2}; 'nothing' for no rank."""
    return viz.provenance_label(ranks, world_size) or "nothing"


def first_difference(actual, expected, tol=None):
    """(index, actual value, expected value) of the first element outside the tolerance, or None.

    `tol` None means bit-exact. NaN never matches.
    """
    a, e = as_float_tensor(actual), as_float_tensor(expected)
    if a is None or e is None or a.shape != e.shape:
        return -1, None, None
    if tol is None:
        bad = ~(a == e)
    else:
        bad = ~((a - e).abs() <= tol.reshape(-1))
    if not bool(bad.any()):
        return None
    index = int(bad.nonzero()[0])
    return index, a[index].item(), e[index].item()


def same_values(a, b) -> bool:
    a, b = as_float_tensor(a), as_float_tensor(b)
    return a is not None and b is not None and a.shape == b.shape and bool((a == b).all())


def which_input(values, inputs) -> int | None:
    """The rank whose input `values` equals exactly (copies are exact), or None."""
    for rank, start in enumerate(inputs):
        if same_values(values, start):
            return rank
    return None
