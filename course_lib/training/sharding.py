"""Which samples each rank trains on: `torch.utils.data.DistributedSampler`'s rule, written out.

Every epoch all ranks shuffle the dataset's indices the same way (same seed, same epoch), then rank r
takes every G-th index starting at r. When the dataset length n does not divide by the world size G,
`DistributedSampler` evens the shards out one of two ways:

    drop_last=False (default)   pad: repeat the first few indices until the length divides by G,
                                so a few samples are seen twice in that epoch;
    drop_last=True              drop the last n mod G indices, so a few samples are not seen.

Either way every rank gets exactly ceil(n / G) (or floor) samples, so every rank makes the same
number of steps and its last batch has the same size. course_lib adds a third choice,
``pad=False``: no padding and no dropping, shards differ by at most one sample. The data-parallel
trainer weights each rank's gradient by its number of samples, so that still gives exactly the
gradient of one process seeing every sample once.

The N ranks' k-th batches together are always a contiguous slice of the (padded) index list:
rank r's k-th batch holds positions r + G*j for j in [k*B, (k+1)*B), so all ranks together cover
positions [k*G*B, (k+1)*G*B). That is why N ranks with per-rank batch B compute the same step as
one process with batch N x B walking the same list (`global_batches`).
"""

from __future__ import annotations

import math

import torch

__all__ = ["epoch_order", "shard_indices", "split_batches", "steps_per_epoch", "global_batches"]


def epoch_order(dataset_len: int, world_size: int, *, shuffle: bool = True, seed: int = 0, epoch: int = 0,
                drop_last: bool = False, pad: bool = True) -> list[int]:
    """The epoch's index list before it is dealt out to the ranks (padded or cut as described above).

    Args:
        dataset_len: number of samples n.
        world_size: number of ranks G.
        shuffle, seed, epoch, drop_last: as in `torch.utils.data.DistributedSampler`.
        pad: only with drop_last=False: True pads like DistributedSampler, False leaves the list as
            it is (uneven shards).
    """
    _check_sizes(dataset_len, world_size)
    if shuffle:
        # Same generator, same seed + epoch as DistributedSampler: identical order on every rank.
        generator = torch.Generator()
        generator.manual_seed(seed + epoch)
        indices = torch.randperm(dataset_len, generator=generator).tolist()
    else:
        indices = list(range(dataset_len))
    if drop_last:
        return indices[: (dataset_len // world_size) * world_size]
    if pad:
        total = math.ceil(dataset_len / world_size) * world_size
        repeats = math.ceil(total / dataset_len) if dataset_len else 0
        return (indices * max(repeats, 1))[:total]
    return indices


def shard_indices(dataset_len: int, rank: int, world_size: int, *, shuffle: bool = True, seed: int = 0,
                  epoch: int = 0, drop_last: bool = False, pad: bool = True) -> list[int]:
    """The sample indices rank `rank` trains on in epoch `epoch`.

    With the default ``pad=True`` this is exactly ``list(DistributedSampler(dataset, world_size, rank,
    shuffle, seed, drop_last))`` after ``set_epoch(epoch)``.

    Example::

        >>> shard_indices(10, rank=1, world_size=4, shuffle=False)       # padded to 12: 0..9, 0, 1
        [1, 5, 9]
        >>> shard_indices(10, rank=3, world_size=4, shuffle=False)
        [3, 7, 1]
        >>> shard_indices(10, rank=3, world_size=4, shuffle=False, pad=False)
        [3, 7]
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in 0..{world_size - 1} (world_size={world_size}), got {rank!r}")
    order = epoch_order(dataset_len, world_size, shuffle=shuffle, seed=seed, epoch=epoch, drop_last=drop_last, pad=pad)
    return order[rank::world_size]


def split_batches(indices: list[int], batch_size: int) -> list[list[int]]:
    """Cut an index list into batches of `batch_size`; the last one may be shorter (DataLoader's drop_last=False)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a whole number >= 1, got {batch_size!r}")
    return [indices[start:start + batch_size] for start in range(0, len(indices), batch_size)]


def steps_per_epoch(dataset_len: int, world_size: int, batch_size: int, *, drop_last: bool = False,
                    pad: bool = True) -> int:
    """How many optimizer steps one epoch takes: the number of batches of the largest shard (rank 0's)."""
    rank0 = len(shard_indices(dataset_len, 0, world_size, shuffle=False, drop_last=drop_last, pad=pad))
    return math.ceil(rank0 / batch_size)


def global_batches(dataset_len: int, world_size: int, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                   epoch: int = 0, drop_last: bool = False, pad: bool = True) -> list[list[int]]:
    """What one process must train on to reproduce G ranks with per-rank batch `batch_size`.

    Step k's global batch is the union of every rank's k-th batch, which is the slice
    [k*G*B, (k+1)*G*B) of `epoch_order` (see the module docstring).
    """
    order = epoch_order(dataset_len, world_size, shuffle=shuffle, seed=seed, epoch=epoch, drop_last=drop_last, pad=pad)
    return split_batches(order, world_size * batch_size)


def _check_sizes(dataset_len, world_size):
    if isinstance(dataset_len, bool) or not isinstance(dataset_len, int) or dataset_len < 1:
        raise ValueError(f"the dataset must hold at least one sample, got length {dataset_len!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1, got {world_size!r}")
