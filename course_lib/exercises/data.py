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
           "which_input", "chunk_sizes", "as_float_tensor", "all_reduce_oracle", "contributors", "received_by",
           "unexplained_contributors", "unexplained_values", "averaged"]


def make_input(case, rank: int, numel: int | None = None) -> torch.Tensor:
    """Rank `rank`'s input for `case` (float32, 1-D): the same on every call, everywhere."""
    numel = case.numel if numel is None else numel
    if case.data == "tagged":
        return viz.tagged_tensor(rank, case.world_size, numel)
    generator = torch.Generator().manual_seed(1_000_003 * case.seed + 7919 * rank + 104_729 * case.world_size + numel)
    return torch.empty(numel, dtype=torch.float64).uniform_(-1.0, 1.0, generator=generator).float()


def all_reduce_oracle(inputs) -> list[dict]:
    """What an all-reduce (sum) of `inputs` (one tensor per rank) must leave on every rank, computed here.

    Returns one dict per rank: 'start' (its input), 'expected' (the sum, exact in float64 and then rounded
    to float32, the learner's dtype) and 'abs_sum' (sum of |x| over the ranks, for `tolerance`).
    """
    total = torch.stack([t.double() for t in inputs]).sum(0) if inputs else torch.zeros(0)
    abs_sum = torch.stack([t.double().abs() for t in inputs]).sum(0) if inputs else torch.zeros(0)
    expected = total.float()
    return [{"start": t.clone(), "expected": expected.clone(), "abs_sum": abs_sum.clone()} for t in inputs]


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


def averaged(actual, expected, world_size: int) -> bool:
    """True when `actual` is `expected` (a sum over `world_size` ranks) divided by `world_size`, element by element
    (to float32's rounding): an average where the exercise asks for the sum."""
    a, e = as_float_tensor(actual), as_float_tensor(expected)
    if a is None or e is None or a.shape != e.shape or world_size < 2 or a.numel() == 0 or not bool(e.abs().sum() > 0):
        return False
    scale = e.abs().clamp_min(1e-30)
    return bool(((a * world_size - e).abs() <= 1e-5 * scale + 1e-30).all())


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


# --------------------------------------------------------------------------------------------------
# Was a result made of what the rank received?
# --------------------------------------------------------------------------------------------------
#
# The trace says what every rank sent, with a copy of the data. A rank can end with data of another
# rank only if some message brought it (or its input held it). A result that holds more was computed
# some way the trace does not show: a collective called around the check (a reference kept from before
# the check swapped the names), or a report written to look right. Such a case fails every line.


def received_by(records, rank: int) -> list:
    """The data of every message the other ranks' traces say they sent to `rank`."""
    return [m.data for r, record in enumerate(records) if r != rank for m in record.get("messages", ())
            if m.is_send and m.peer == rank and m.data is not None]


def contributors(values, world_size: int) -> frozenset:
    """The ranks whose tagged data (`viz.tag`) any element of `values` holds; values that are no tag sum add nobody."""
    flat = as_float_tensor(values)
    if flat is None:
        return frozenset()
    ranks: set = set()
    for value in set(flat.tolist()):
        try:
            ranks |= viz.decode_tag(value, world_size)[0]
        except (ValueError, OverflowError):
            continue
    return frozenset(ranks)


def unexplained_contributors(result, own, received, world_size: int) -> frozenset:
    """Ranks whose tagged data `result` holds although neither `own` (the rank's input) nor any received message held it."""
    allowed = set(contributors(own, world_size))
    for data in received:
        allowed |= contributors(data, world_size)
    return contributors(result, world_size) - allowed


def unexplained_values(result, own, received) -> bool:
    """True when some element of `result` is a value that neither `own` nor any received message held
    (for exercises that only copy data: broadcast, all-gather, the token)."""
    flat = as_float_tensor(result)
    if flat is None or flat.numel() == 0:
        return False
    seen: set = set()
    for data in [own, *received]:
        values = as_float_tensor(data)
        if values is not None:
            seen.update(values.tolist())
    return any(value not in seen for value in flat.tolist())
