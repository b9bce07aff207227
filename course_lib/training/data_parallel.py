"""Data-parallel training from scratch: what `DistributedDataParallel` does, spelled out.

Every rank holds a full replica of the model. One training step on G ranks:

    0. (once) rank 0's parameters are broadcast, so every replica starts from the same point
    1. each rank takes its own disjoint slice of the global batch          (sharding.py)
    2. forward, loss, backward on that slice: a local gradient
    3. all-reduce the gradients and divide: every rank now holds the gradient of the global batch
    4. optimizer.step() on every rank: the same gradient on the same parameters gives the same
       parameters, so the replicas stay identical, bit for bit, without ever sending a parameter

Step 3 is one all-reduce of one flat buffer holding every gradient, plus two numbers:

    [ count_r * grad_r (all parameters) ... | count_r * loss_r | count_r ]   --all-reduce SUM-->
    [ sum_r count_r grad_r ...              | sum_r count_r loss_r | total ] / total

Dividing by the total number of samples (not by G) is what keeps the step exact when the ranks'
batches differ in size: the mean of per-rank means equals the global mean only when every rank
has the same number of samples. Weighted this way, G ranks with batch B compute exactly the step
one process computes on the same N x B samples (up to floating-point rounding).

Use inside a function started by `course_lib.launch` (or torchrun)::

    def fn(rank, world_size):
        model = toy.make_mlp(seed=rank)              # different on purpose: step 0 repairs that
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return train_data_parallel(model, optimizer, (inputs, labels), F.cross_entropy, batch_size=16)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from course_lib import allreduce as allreduce_variants
from course_lib import collectives, traffic
from course_lib.training import sharding
from course_lib.training.buckets import MIB, BucketTiming, GradientBuckets, StepTimeline
from course_lib.training.toy import progress_bar

__all__ = ["TrainingLog", "flat_parameters", "flat_gradient", "set_flat_gradient", "broadcast_parameters",
           "average_gradients", "apply_reduced_gradient",
           "train_data_parallel", "train_single_process", "take_batch"]


@dataclass
class TrainingLog:
    """What one rank saw while training (picklable: `launch` brings it back to the notebook).

    Attributes:
        rank, world_size: who trained.
        losses: per step, the mean loss over the whole global batch (all ranks), before the update.
        samples: per step, the number of samples in the global batch.
        local_samples: per step, how many of them this rank processed.
        epoch_losses: per epoch, the sample-weighted mean of `losses`.
        parameters: per step, a flat CPU copy of all parameters after the update
            (only with ``record_parameters=True``; the initial parameters come first).
        bytes_sent: bytes this rank sent for gradient averaging (counted by course_lib.traffic).
        timeline: per step, a `StepTimeline` (forward, backward, optimizer and total seconds, and when
            each gradient bucket's all-reduce ran and what it sent); filled by `train_data_parallel`.
    """

    rank: int = 0
    world_size: int = 1
    losses: list = field(default_factory=list)
    samples: list = field(default_factory=list)
    local_samples: list = field(default_factory=list)
    epoch_losses: list = field(default_factory=list)
    parameters: list = field(default_factory=list)
    bytes_sent: int = 0
    timeline: list = field(default_factory=list)
    _epoch_loss: float = field(default=0.0, repr=False)  # running sums of the epoch in progress
    _epoch_samples: int = field(default=0, repr=False)

    @property
    def final_parameters(self) -> torch.Tensor:
        return self.parameters[-1]

    @property
    def step_times(self) -> list:
        """Seconds per step (zero_grad to the end of optimizer.step), from `timeline`."""
        return [t.total for t in self.timeline]

    def record_step(self, mean_loss: float, samples: int, local_samples: int, model: nn.Module | None = None):
        """Log one optimizer step: the global batch's mean loss and size, this rank's share of it,
        and (when `model` is given) a copy of the parameters after the update."""
        self.losses.append(mean_loss)
        self.samples.append(samples)
        self.local_samples.append(local_samples)
        self._epoch_loss += mean_loss * samples
        self._epoch_samples += samples
        if model is not None:
            self.parameters.append(flat_parameters(model))

    def end_epoch(self, epoch: int, done: int, total: int, show_progress: bool = False) -> None:
        """Close the epoch: its sample-weighted mean loss, and a progress line if asked."""
        if self._epoch_samples:
            self.epoch_losses.append(self._epoch_loss / self._epoch_samples)
            if show_progress:
                print(f"epoch {epoch + 1} {progress_bar(done, total)} loss {self.epoch_losses[-1]:.4f}", flush=True)
        self._epoch_loss, self._epoch_samples = 0.0, 0


# --------------------------------------------------------------------------------------------------
# The pieces
# --------------------------------------------------------------------------------------------------


def _parameters_of(model) -> list:
    return list(model.parameters()) if isinstance(model, nn.Module) else list(model)


def flat_parameters(model: nn.Module) -> torch.Tensor:
    """All of the model's parameters (or of a list of parameters), concatenated into one 1-D CPU tensor (a copy)."""
    return torch.cat([p.detach().reshape(-1).cpu() for p in _parameters_of(model)])


def flat_gradient(model: nn.Module) -> torch.Tensor:
    """All of the model's (or a list of parameters') gradients in one 1-D tensor (zeros where there is none)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in _parameters_of(model)])


def set_flat_gradient(model: nn.Module, flat: torch.Tensor) -> None:
    """The inverse of `flat_gradient`: cut `flat` back into every parameter's ``.grad`` (copies)."""
    offset = 0
    for p in model.parameters():
        p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()


def broadcast_parameters(model: nn.Module, src: int = 0) -> None:
    """Copy rank `src`'s parameters and buffers into every rank's model, in place (step 0).

    Everything travels as one flat tensor through `course_lib.collectives.broadcast`: one message
    per rank instead of one per parameter.
    """
    tensors = [p.data for p in model.parameters()] + [b for b in model.buffers() if b.is_floating_point()]
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1).to(tensors[0].dtype) for t in tensors])
    collectives.broadcast(flat, src=src)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def average_gradients(model: nn.Module, count: int, loss_sum: float, allreduce: str | Callable = "ring"):
    """Step 3: replace every rank's local gradient by the gradient of the global batch.

    Args:
        model: this rank's replica; its ``.grad`` fields hold the gradient of the *mean* loss over
            this rank's `count` samples (None or zeros when `count` is 0).
        count: number of samples this rank processed in this step.
        loss_sum: this rank's loss summed over its samples (mean loss x count), for logging.
        allreduce: name of a `course_lib.allreduce` variant ('ring', 'naive', 'parameter_server')
            or any function ``f(tensor, op)`` that all-reduces in place.

    Returns:
        (total_count, global_mean_loss) over all ranks.
    """
    gradient = flat_gradient(model)
    # The loss sum and sample count ride along at the end of the same buffer: one all-reduce.
    buffer = torch.cat([gradient * count, gradient.new_tensor([loss_sum, count])])
    _allreduce_function(allreduce)(buffer, "sum")
    return apply_reduced_gradient(model, buffer)


def apply_reduced_gradient(model: nn.Module, buffer: torch.Tensor):
    """Finish step 3 from the all-reduced ``[sum_r count_r grad_r | sum_r loss_r | total]`` buffer.

    Sets every ``.grad`` to the global batch's gradient (the sum divided by the total sample count).

    Returns:
        (total_count, global_mean_loss).
    """
    total_count, total_loss = buffer[-1].item(), buffer[-2].item()
    set_flat_gradient(model, buffer[:-2] / total_count)
    return int(round(total_count)), total_loss / total_count


def _allreduce_function(allreduce):
    if isinstance(allreduce, str):
        return allreduce_variants.get(allreduce)
    if not callable(allreduce):
        raise TypeError(f"allreduce must be a course_lib.allreduce variant's name or a function f(tensor, op), "
                        f"got {type(allreduce).__name__}")
    return allreduce


def take_batch(dataset, indices: list[int], device: torch.device):
    """(inputs, targets) of the samples `indices`, on `device`.

    `dataset` is a pair of tensors (inputs, targets) with the samples along dimension 0, a
    `torch.utils.data.TensorDataset`, or any map-style dataset whose items are (input, target).
    """
    tensors = _tensor_pair(dataset)
    if tensors is not None:
        index = torch.tensor(indices, dtype=torch.long)
        inputs, targets = tensors[0][index], tensors[1][index]
    else:
        inputs, targets = torch.utils.data.default_collate([dataset[i] for i in indices])
    return inputs.to(device), targets.to(device)


def _tensor_pair(dataset):
    """(inputs, targets) when `dataset` is a pair of tensors or a TensorDataset of two, else None."""
    tensors = getattr(dataset, "tensors", dataset)
    if isinstance(tensors, (tuple, list)) and len(tensors) == 2 and all(isinstance(t, torch.Tensor) for t in tensors):
        return tensors
    return None


def _dataset_len(dataset) -> int:
    tensors = _tensor_pair(dataset)
    if tensors is not None:
        if len(tensors[0]) != len(tensors[1]):
            raise ValueError(f"inputs and targets must hold the same number of samples, got {len(tensors[0])} "
                             f"and {len(tensors[1])}")
        return len(tensors[0])
    return len(dataset)


def _local_loss(model, loss_fn, inputs, targets) -> torch.Tensor:
    """Forward and loss; the loss must be the mean over the batch (every torch loss's default)."""
    loss = loss_fn(model(inputs), targets)
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
        raise ValueError("loss_fn must return one number (a 0-dim tensor): the mean loss over the batch, "
                         f"like torch.nn.functional.cross_entropy does; got {type(loss).__name__} "
                         f"{tuple(getattr(loss, 'shape', ()))}")
    return loss


def _check_model(model):
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    params = list(model.parameters())
    if not params:
        raise ValueError("the model has no parameters: there is nothing to train")
    if len({p.dtype for p in params}) > 1:
        raise ValueError("all parameters must share one dtype to travel in one buffer; got "
                         f"{sorted({str(p.dtype) for p in params})}")
    return params


# --------------------------------------------------------------------------------------------------
# The training loops
# --------------------------------------------------------------------------------------------------


def train_data_parallel(model: nn.Module, optimizer: torch.optim.Optimizer, dataset, loss_fn: Callable, *,
                        batch_size: int, epochs: int = 1, start_epoch: int = 0, max_steps: int | None = None,
                        shuffle: bool = True, seed: int = 0, drop_last: bool = False, pad: bool = True,
                        allreduce: str | Callable = "ring", bucket_mb: float | None = None, overlap: bool = False,
                        record_parameters: bool = False, progress: bool = False) -> TrainingLog:
    """Train `model` data-parallel on this rank; call it on every rank of a launched group.

    Args:
        model: this rank's replica (any nn.Module). Rank 0's parameters are broadcast first.
        optimizer: an optimizer over ``model.parameters()``, created the same way on every rank; or a
            `course_lib.training.zero.ShardedOptimizer`, which reduce-scatters the gradients, steps its
            shard and all-gathers the parameters itself (ZeRO-1).
        dataset: (inputs, targets) tensors or a dataset of (input, target) pairs, the same on every rank.
        loss_fn: ``loss_fn(model(inputs), targets)`` -> mean loss over the batch.
        batch_size: samples per rank per step (the global batch is world_size times larger).
        epochs, start_epoch: train epochs start_epoch .. start_epoch + epochs - 1 (the epoch number
            seeds the shuffle, as `DistributedSampler.set_epoch` does, so resuming reproduces the data order).
        max_steps: stop after this many steps in total (None: run every epoch to the end).
        shuffle, seed, drop_last, pad: how the data is dealt out (see `sharding`).
        allreduce: the all-reduce that averages the gradients: a `course_lib.allreduce` name or a function.
        bucket_mb: cut the gradients into buckets of this many MiB (DDP's ``bucket_cap_mb``; see
            `course_lib.training.buckets`). None: one all-reduce of all gradients after backward (25
            with ``overlap=True``); ``math.inf``: one bucket.
        overlap: start each bucket's all-reduce during backward, as soon as its gradients are ready,
            on a communication thread (see `course_lib.training.buckets`). False: after backward.
        record_parameters: keep a flat copy of the parameters after every step (for checks and plots).
        progress: rank 0 prints a progress line after every epoch.

    Returns:
        A `TrainingLog`; ``log.timeline`` holds every step's timings and its buckets' all-reduces.

    Example::

        log = train_data_parallel(model, optimizer, data, F.cross_entropy, batch_size=16,
                                  overlap=True, bucket_mb=1)
        log.step_times                       # seconds per step
        log.timeline[-1].buckets[0].start    # when the last layers' all-reduce began, after backward began
    """
    _check_model(model)
    sharded = callable(getattr(optimizer, "reduce_gradients", None))   # a zero.ShardedOptimizer
    bucket_bytes = _bucket_bytes(bucket_mb, overlap, sharded)
    reduce_in_place = _allreduce_function(allreduce)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    n = _dataset_len(dataset)
    device = next(model.parameters()).device
    log = TrainingLog(rank=rank, world_size=world_size)
    broadcast_parameters(model)                                                      # step 0
    if record_parameters:
        log.parameters.append(flat_parameters(model))
    steps = sharding.steps_per_epoch(n, world_size, batch_size, drop_last=drop_last, pad=pad)
    buckets = None
    if bucket_bytes is not None:
        name = allreduce if isinstance(allreduce, str) else getattr(allreduce, "__qualname__", "function")
        buckets = GradientBuckets(list(model.parameters()), bucket_bytes, reduce_in_place, overlap=overlap, name=name)
    try:
        with traffic.record() as recording:
            for epoch in range(start_epoch, start_epoch + epochs):
                mine = sharding.shard_indices(n, rank, world_size, shuffle=shuffle, seed=seed, epoch=epoch,
                                              drop_last=drop_last, pad=pad)                # step 1
                batches = sharding.split_batches(mine, batch_size)
                for step in range(steps):
                    if max_steps is not None and len(log.losses) >= max_steps:
                        break
                    # With pad=False a rank can run out of samples one step before the others: it
                    # still joins the all-reduce, contributing zero samples and a zero gradient.
                    batch = batches[step] if step < len(batches) else []
                    data = take_batch(dataset, batch, device) if batch else None
                    total, global_loss, timeline = _one_step(model, optimizer, loss_fn, data, len(batch), buckets,
                                                             reduce_in_place, sharded)
                    timeline.step = len(log.timeline)
                    log.timeline.append(timeline)
                    log.record_step(global_loss, total, len(batch), model if record_parameters else None)
                log.end_epoch(epoch, epoch - start_epoch + 1, epochs, show_progress=progress and rank == 0)
    finally:
        if buckets is not None:
            buckets.close()   # hooks off, communication thread stopped, even when a step failed
    log.bytes_sent = recording.bytes_sent
    return log


def _one_step(model, optimizer, loss_fn, data, count, buckets, reduce_in_place, sharded):
    """Steps 2 to 4 on this rank, timed: forward, backward (+ buckets), gradient average, update."""
    t_start = time.perf_counter()
    optimizer.zero_grad()
    loss, loss_sum = None, 0.0
    if data is not None:
        loss = _local_loss(model, loss_fn, *data)                                         # step 2
        loss_sum = loss.item() * count
    # Time zero of the step's timeline: the start of backward (the buckets count from the same instant).
    t_backward = buckets.start_step(count, loss_sum) if buckets is not None else time.perf_counter()
    if loss is not None:
        loss.backward()
    t_backward_end = time.perf_counter()
    if buckets is not None:                                                              # step 3
        buffer, bucket_timings = buckets.finish()
        total, global_loss = apply_reduced_gradient(model, buffer)
    else:
        with traffic.record() as recording:
            if sharded:
                total, global_loss = optimizer.reduce_gradients(count, loss_sum)
            else:
                total, global_loss = average_gradients(model, count, loss_sum, reduce_in_place)
        numel = sum(p.numel() for p in model.parameters()) + 2
        element = next(model.parameters()).element_size()
        after = t_backward_end - t_backward
        bucket_timings = [BucketTiming(0, numel, numel * element, ready=after, start=after,
                                       end=time.perf_counter() - t_backward, bytes_sent=recording.bytes_sent,
                                       bytes_received=recording.bytes_received,
                                       messages_sent=recording.messages_sent)]
    t_reduced = time.perf_counter()
    optimizer.step()                                                                      # step 4
    t_end = time.perf_counter()
    timeline = StepTimeline(step=0, forward=t_backward - t_start, backward=t_backward_end - t_backward,
                            communication_done=t_reduced - t_backward if buckets is None else
                            max(b.end for b in bucket_timings),
                            optimizer=t_end - t_reduced, total=t_end - t_start, buckets=bucket_timings)
    return total, global_loss, timeline


def _bucket_bytes(bucket_mb, overlap, sharded):
    """The bucket size in bytes, or None for today's single all-reduce after backward."""
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be True or False, got {overlap!r}")
    if sharded and (overlap or bucket_mb is not None):
        raise ValueError("a ShardedOptimizer reduce-scatters the whole gradient after backward: it does not take "
                         "bucket_mb or overlap=True; leave both out.")
    if bucket_mb is None:
        return 25 * MIB if overlap else None
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0:
        raise ValueError(f"bucket_mb must be a positive number of MiB (math.inf for a single bucket), got {bucket_mb!r}")
    return bucket_mb * MIB


def train_single_process(model: nn.Module, optimizer: torch.optim.Optimizer, dataset, loss_fn: Callable, *,
                         batch_size: int | None = None, epochs: int = 1, max_steps: int | None = None,
                         shuffle: bool = True, seed: int = 0, batches: list | None = None,
                         record_parameters: bool = False) -> TrainingLog:
    """The reference: ordinary training in one process, no communication at all.

    By default it walks the data like one rank of `train_data_parallel` with world_size=1 (same
    shuffle), in batches of `batch_size`. Pass `batches` (a list of index lists, e.g. from
    `sharding.global_batches`) to train on exactly those global batches instead.
    """
    _check_model(model)
    n = _dataset_len(dataset)
    device = next(model.parameters()).device
    if batches is not None:
        epoch_batches = [list(batches)]
    else:
        if batch_size is None:
            raise ValueError("give batch_size (or an explicit list of batches)")
        epoch_batches = [sharding.split_batches(sharding.epoch_order(n, 1, shuffle=shuffle, seed=seed, epoch=e),
                                                batch_size) for e in range(epochs)]
    log = TrainingLog()
    if record_parameters:
        log.parameters.append(flat_parameters(model))
    for epoch, epoch_list in enumerate(epoch_batches):
        for batch in epoch_list:
            if max_steps is not None and len(log.losses) >= max_steps:
                break
            optimizer.zero_grad()
            loss = _local_loss(model, loss_fn, *take_batch(dataset, batch, device))
            loss.backward()
            optimizer.step()
            log.record_step(loss.item(), len(batch), len(batch), model if record_parameters else None)
        log.end_epoch(epoch, epoch + 1, len(epoch_batches))
    return log
