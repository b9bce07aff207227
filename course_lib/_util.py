"""Small helpers shared across course_lib: tensor views, chunk sizes and rank checks for the algorithms, a text progress bar."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def flat_view(tensor: torch.Tensor):
    """A 1-D view of `tensor` to work on in place; a non-contiguous tensor is copied and written back."""
    if tensor.is_contiguous():
        yield tensor.view(-1)
    else:
        flat = tensor.reshape(-1).clone()
        yield flat
        tensor.copy_(flat.view(tensor.shape))


def chunk_sizes(numel: int, world_size: int) -> list[int]:
    """Sizes of the G chunks `torch.tensor_split` makes: the first numel % G chunks are one longer."""
    base, extra = divmod(numel, world_size)
    return [base + 1 if i < extra else base for i in range(world_size)]


def not_a_rank(name: str, peer, world_size: int) -> str | None:
    """Why `peer` (the argument `name`: dst, src) is not a rank of a group of `world_size` ranks, or None when it is."""
    if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < world_size:
        return f"{name}={peer!r} is not a rank of this group; the ranks are 0..{world_size - 1} (world_size={world_size})."
    return None


def contiguous_flat(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as a contiguous 1-D tensor (a view when possible) for sending."""
    return tensor.reshape(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)


def progress_bar(done: int, total: int, width: int = 24) -> str:
    """A text progress bar, e.g. ``[######------]  3/6``: deterministic, so notebook outputs compare.

    It lives here, beside nothing heavy, because `course_lib.progress` draws it from a background
    thread: that thread must not be the first to import anything (see `course_lib.live._bar`).
    """
    filled = round(width * done / total) if total else width
    return f"[{'#' * filled}{'-' * (width - filled)}] {done:>{len(str(total))}}/{total}"
