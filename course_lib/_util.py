"""Small tensor helpers shared by the algorithms."""

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


def contiguous_flat(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as a contiguous 1-D tensor (a view when possible) for sending."""
    return tensor.reshape(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
