"""Data-parallel training from scratch: what `DistributedDataParallel` does, spelled out.

Every rank holds a full replica of the model. One training step on G ranks, in five parts:

    0. (once) rank 0's parameters are broadcast, so every replica starts from the same point
    1. each rank takes its own disjoint slice of the global batch          (sharding.py)
    2. forward, loss, backward on that slice: a local gradient
    3. all-reduce the gradients and divide: every rank now holds the gradient of the global batch
    4. optimizer.step() on every rank: the same gradient on the same parameters gives the same
       parameters, so the replicas stay identical, bit for bit, without ever sending a parameter

Part 3 is one all-reduce of one flat buffer holding every gradient, plus two numbers:

    [ count_r * grad_r (all parameters) ... | count_r * loss_r | count_r ]   --all-reduce SUM-->
    [ sum_r count_r grad_r ...              | sum_r count_r loss_r | total ] / total

Dividing by the total number of samples (not by G) is what keeps the step exact when the ranks'
batches differ in size: the mean of per-rank means equals the global mean only when every rank
has the same number of samples. Weighted this way, G ranks with batch B compute exactly the training
step one process computes on the same G x B samples (up to floating-point rounding).

Use inside a function started by `course_lib.launch` (or torchrun)::

    def fn(rank, world_size):
        model = toy.make_mlp(seed=rank)              # different on purpose: part 0 repairs that
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return train_data_parallel(model, optimizer, (inputs, labels), F.cross_entropy, batch_size=16)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from course_lib import allreduce as allreduce_variants
from course_lib import runtime
from course_lib import collectives, traffic
from course_lib.training import sharding
from course_lib.training.buckets import MIB, BucketTiming, GradientBuckets, StepTimeline
from course_lib.training.toy import progress_bar

__all__ = ["TrainingLog", "flat_parameters", "flat_gradient", "set_flat_gradient", "broadcast_parameters",
           "broadcast_buffers", "batch_norm_note", "average_gradients", "apply_reduced_gradient", "HookBucket",
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
    """Copy rank `src`'s parameters and buffers into every rank's model, in place (part 0).

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


def broadcast_buffers(model: nn.Module, src: int = 0) -> None:
    """DDP's rule for buffers: copy rank `src`'s buffers into every rank's model before each forward.

    Buffers (BatchNorm's running mean and variance, its batch counter ...) are not trained, so no
    gradient averages them: left alone, each rank's would drift with its own batches.
    `torch.nn.parallel.DistributedDataParallel` broadcasts them from rank 0 at the start of every
    forward (``broadcast_buffers=True``, its default); `train_data_parallel` does the same, in every
    ZeRO stage too. One `collectives.broadcast` per dtype (floats and the int64 counters travel apart).
    """
    by_dtype: dict = {}
    for buffer in model.buffers():
        by_dtype.setdefault(buffer.dtype, []).append(buffer)
    for buffers in by_dtype.values():
        flat = torch.cat([b.detach().reshape(-1) for b in buffers])
        collectives.broadcast(flat, src=src)
        offset = 0
        with torch.no_grad():
            for b in buffers:
                b.copy_(flat[offset:offset + b.numel()].view_as(b))
                offset += b.numel()


def batch_norm_note(model: nn.Module, batch_size: int, world_size: int) -> str | None:
    """The one line a model with batch normalisation gets when it trains on several ranks (None otherwise)."""
    layers = [type(m).__name__ for m in model.modules()
              if isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, nn.SyncBatchNorm)]
    if not layers or world_size < 2:
        return None
    return (f"note: {layers[0]} normalises with each rank's own batch statistics ({batch_size} samples, not the "
            f"global batch's {world_size * batch_size}), so training differs from one process; its running "
            "statistics are rank 0's, broadcast before every forward as DDP does. nn.SyncBatchNorm would compute "
            "them over the global batch (an all-reduce per layer in every forward; GPU only in PyTorch).")


def average_gradients(model: nn.Module, count: int, loss_sum: float, allreduce: str | Callable = "ring"):
    """Part 3: replace every rank's local gradient by the gradient of the global batch.

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
    """Finish part 3 from the all-reduced ``[sum_r count_r grad_r | sum_r loss_r | total]`` buffer.

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


def _checked_on_first_call(reduce_in_place):
    """One of course_lib's all-reduce variants, with its cross-rank argument check on the first call only.

    In a training run the variant is called from one place per step (the gradients and the loss sum after
    backward, or the loss sum before a hook) on a tensor whose size is fixed by the model, which every rank
    holds with the same parameters (the checked broadcast of `broadcast_parameters` said so), with op 'sum'.
    Once the ranks agreed on the first call, every later one agrees too; checking it again cost as many
    messages as the all-reduce itself in a training step of a small model. A learner's own all-reduce function,
    and a communication hook, stay checked on every call."""
    checked = False

    def reduce(tensor, op):
        nonlocal checked
        if checked:
            with runtime.unchecked():
                return reduce_in_place(tensor, op)
        result = reduce_in_place(tensor, op)
        checked = True
        return result

    return reduce


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


class HookBucket:
    """What a DDP communication hook is handed, built by `train_data_parallel(comm_hook=...)`.

    The same methods as `torch.distributed.GradBucket`: ``buffer()`` (every gradient in one flat
    tensor), ``gradients()`` (each parameter's gradient, a view into the buffer), ``parameters()``,
    ``index()`` and ``is_last()``, so one hook runs under DDP and in the hand-made trainer alike.
    The hand-made trainer hands all gradients over as one bucket (index 0, the last of its step), in
    the order DDP's bucket holds them after its first step: the model's last parameter first.
    """

    def __init__(self, buffer: torch.Tensor, params: list):
        self._buffer, self._params = buffer, list(params)

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer.copy_(tensor)

    def parameters(self) -> list:
        return self._params

    def gradients(self) -> list:
        views, offset = [], 0
        for p in self._params:
            views.append(self._buffer[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return views

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True


def train_data_parallel(model: nn.Module, optimizer: torch.optim.Optimizer, dataset, loss_fn: Callable, *,
                        batch_size: int, epochs: int = 1, start_epoch: int = 0, max_steps: int | None = None,
                        shuffle: bool = True, seed: int = 0, drop_last: bool = False, pad: bool = True,
                        allreduce: str | Callable = "ring", bucket_mb: float | None = None, overlap: bool = False,
                        comm_hook: Callable | None = None, comm_hook_state=None,
                        record_parameters: bool = False, progress: bool = False) -> TrainingLog:
    """Train `model` data-parallel on this rank; call it on every rank of a launched group.

    Before every forward, rank 0's buffers (BatchNorm's running statistics ...) are broadcast to
    every rank, as DDP does (`broadcast_buffers`); a model with batch normalisation gets one line
    saying what that does and does not make equal (`batch_norm_note`).

    Args:
        model: this rank's replica (any nn.Module). Rank 0's parameters are broadcast first.
        optimizer: an optimizer over ``model.parameters()``, created the same way on every rank; or a
            `course_lib.training.zero.ShardedOptimizer`, which reduce-scatters the gradients, steps its
            shard and all-gathers the parameters itself (ZeRO-1); or a
            `course_lib.training.zero_sharded.ShardedDataParallel` wrapping `model` (stages 0-3, layer
            by layer, its collectives run from hooks during forward and backward).
        dataset: (inputs, targets) tensors or a dataset of (input, target) pairs, the same on every rank.
        loss_fn: ``loss_fn(model(inputs), targets)`` -> mean loss over the batch.
        batch_size: samples per rank per step (the global batch is world_size times larger).
        epochs, start_epoch: train epochs start_epoch .. start_epoch + epochs - 1 (the epoch number
            seeds the shuffle, as `DistributedSampler.set_epoch` does, so resuming reproduces the data order).
        max_steps: stop after this many steps in total (None: run every epoch to the end).
        shuffle, seed, drop_last, pad: how the data is dealt out (see `sharding`).
        allreduce: the all-reduce that averages the gradients: a `course_lib.allreduce` name or a function.
            A named one checks its arguments across ranks on the first step only (`_checked_on_first_call`).
        bucket_mb: cut the gradients into buckets of this many MiB (DDP's ``bucket_cap_mb``; see
            `course_lib.training.buckets`). None: one all-reduce of all gradients after backward (25
            with ``overlap=True``); ``math.inf``: one bucket.
        overlap: start each bucket's all-reduce during backward, as soon as its gradients are ready,
            on a communication thread (see `course_lib.training.buckets`). False: after backward.
        comm_hook, comm_hook_state: a DDP communication hook ``hook(state, bucket) -> Future`` (e.g.
            from `course_lib.training.compression`) to average the gradients instead of `allreduce`:
            it gets every gradient as one `HookBucket`, scaled so that its average over the ranks is
            the global batch's gradient (each rank's times count_r G / total). The loss sum and
            sample count go first, in an all-reduce of two numbers.
        record_parameters: keep a flat copy of the parameters after every step (for checks and plots).
        progress: rank 0 prints a progress line after every epoch.

    Returns:
        A `TrainingLog`; ``log.timeline`` holds every step's timings and its buckets' all-reduces;
        ``log.bytes_sent`` what this rank sent in its steps (parameter recording left out).

    Example::

        log = train_data_parallel(model, optimizer, data, F.cross_entropy, batch_size=16,
                                  overlap=True, bucket_mb=1)
        log.step_times                       # seconds per step
        log.timeline[-1].buckets[0].start    # when the last layers' all-reduce began, after backward began
    """
    _check_model(model)
    sharded = callable(getattr(optimizer, "reduce_gradients", None))   # a zero.ShardedOptimizer
    layered = getattr(optimizer, "layered", False) is True             # a zero_sharded.ShardedDataParallel
    hook = _check_hook(comm_hook, comm_hook_state, bucket_mb, overlap, sharded or layered)
    if layered and getattr(optimizer, "model", None) is not model:
        raise ValueError("this ShardedDataParallel wraps another model: pass the model you gave it, "
                         "train_data_parallel(model, ShardedDataParallel(model, ...), ...).")
    bucket_bytes = _bucket_bytes(bucket_mb, overlap, sharded or layered)
    reduce_in_place = _allreduce_function(allreduce)
    if isinstance(allreduce, str):
        reduce_in_place = _checked_on_first_call(reduce_in_place)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    n = _dataset_len(dataset)
    device = next(model.parameters()).device
    log = TrainingLog(rank=rank, world_size=world_size)
    note = batch_norm_note(model, batch_size, world_size)
    if note and rank == 0:
        print(note, flush=True)
    if not layered:
        broadcast_parameters(model)                                                  # part 0 (layered: done)
    has_buffers = any(True for _ in model.buffers())
    if record_parameters:
        log.parameters.append(_parameters_now(model, optimizer, layered))
    steps = sharding.steps_per_epoch(n, world_size, batch_size, drop_last=drop_last, pad=pad)
    buckets = None
    if bucket_bytes is not None:
        name = allreduce if isinstance(allreduce, str) else getattr(allreduce, "__qualname__", "function")
        buckets = GradientBuckets(list(model.parameters()), bucket_bytes, reduce_in_place, overlap=overlap, name=name)
    step_fn = (_layered_step if layered else _hook_step if hook is not None else _one_step)
    try:
        for epoch in range(start_epoch, start_epoch + epochs):
            mine = sharding.shard_indices(n, rank, world_size, shuffle=shuffle, seed=seed, epoch=epoch,
                                          drop_last=drop_last, pad=pad)                    # part 1
            batches = sharding.split_batches(mine, batch_size)
            for step in range(steps):
                if max_steps is not None and len(log.losses) >= max_steps:
                    break
                # With pad=False a rank can run out of samples one step before the others: it
                # still joins the all-reduce, contributing zero samples and a zero gradient.
                batch = batches[step] if step < len(batches) else []
                data = take_batch(dataset, batch, device) if batch else None
                with traffic.record() as recording:
                    if has_buffers:
                        broadcast_buffers(model)                                         # DDP's rule
                    total, global_loss, timeline = step_fn(model, optimizer, loss_fn, data, len(batch), buckets,
                                                           reduce_in_place, sharded, hook)
                log.bytes_sent += recording.bytes_sent
                timeline.step = len(log.timeline)
                log.timeline.append(timeline)
                log.record_step(global_loss, total, len(batch))
                if record_parameters:
                    log.parameters.append(_parameters_now(model, optimizer, layered))
            log.end_epoch(epoch, epoch - start_epoch + 1, epochs, show_progress=progress and rank == 0)
    finally:
        if buckets is not None:
            buckets.close()   # hooks off, communication thread stopped, even when a step failed
    return log


def _parameters_now(model, optimizer, layered) -> torch.Tensor:
    """A flat CPU copy of the parameters (ZeRO-3 all-gathers them: every rank calls this together)."""
    return optimizer.full_parameters() if layered else flat_parameters(model)


def _check_hook(comm_hook, comm_hook_state, bucket_mb, overlap, sharded):
    if comm_hook is None:
        return None
    if not callable(comm_hook):
        raise TypeError(f"comm_hook must be a DDP communication hook, a function hook(state, bucket) -> Future; "
                        f"got {type(comm_hook).__name__}")
    if sharded or overlap or bucket_mb is not None:
        raise ValueError("comm_hook replaces the one all-reduce after backward: it does not combine with bucket_mb, "
                         "overlap=True or a sharded optimizer; leave those out.")
    return comm_hook_state, comm_hook


def _one_step(model, optimizer, loss_fn, data, count, buckets, reduce_in_place, sharded, hook=None):
    """Steps 2 to 4 on this rank, timed: forward, backward (+ buckets), gradient average, update."""
    t_start = runtime.clock()
    optimizer.zero_grad()
    loss, loss_sum = None, 0.0
    if data is not None:
        loss = _local_loss(model, loss_fn, *data)                                         # part 2
        loss_sum = loss.item() * count
    # Time zero of the step's timeline: the start of backward (the buckets count from the same instant).
    t_backward = buckets.start_step(count, loss_sum) if buckets is not None else runtime.clock()
    if loss is not None:
        loss.backward()
    t_backward_end = runtime.clock()
    if buckets is not None:                                                              # part 3
        buffer, bucket_timings = buckets.finish()
        total, global_loss = apply_reduced_gradient(model, buffer)
    else:
        with traffic.record() as recording:
            if sharded:
                total, global_loss = optimizer.reduce_gradients(count, loss_sum)
            else:
                total, global_loss = average_gradients(model, count, loss_sum, reduce_in_place)
        bucket_timings = [_after_backward_timing(model, t_backward, t_backward_end, recording)]
    t_reduced = runtime.clock()
    optimizer.step()                                                                      # part 4
    t_end = runtime.clock()
    timeline = StepTimeline(step=0, forward=t_backward - t_start, backward=t_backward_end - t_backward,
                            communication_done=t_reduced - t_backward if buckets is None else
                            max(b.end for b in bucket_timings),
                            optimizer=t_end - t_reduced, total=t_end - t_start, buckets=bucket_timings)
    return total, global_loss, timeline


def _after_backward_timing(model, t_backward, t_backward_end, recording, numel=None):
    """The one 'bucket' of a step that averages every gradient after backward."""
    numel = sum(p.numel() for p in model.parameters()) + 2 if numel is None else numel
    element = next(model.parameters()).element_size()
    after = t_backward_end - t_backward
    return BucketTiming(0, numel, numel * element, ready=after, start=after, end=runtime.clock() - t_backward,
                        bytes_sent=recording.bytes_sent, bytes_received=recording.bytes_received,
                        messages_sent=recording.messages_sent)


def _hook_step(model, optimizer, loss_fn, data, count, buckets, reduce_in_place, sharded, hook):
    """Steps 2 to 4 with a DDP communication hook averaging the gradients (see `train_data_parallel`)."""
    state, hook_fn = hook
    t_start = runtime.clock()
    optimizer.zero_grad()
    loss, loss_sum = None, 0.0
    if data is not None:
        loss = _local_loss(model, loss_fn, *data)
        loss_sum = loss.item() * count
    t_backward = runtime.clock()
    if loss is not None:
        loss.backward()
    t_backward_end = runtime.clock()
    # One bucket laid out as DDP's is after its first step: last parameter first.
    params = list(model.parameters())[::-1]
    gradient = flat_gradient(params)
    stats = gradient.new_tensor([loss_sum, count])
    reduce_in_place(stats, "sum")                     # the loss sum and sample count of the global batch
    total, total_loss = stats[1].item(), stats[0].item()
    gradient.mul_(count * dist.get_world_size() / total)   # the ranks' average is now the global gradient
    bucket = HookBucket(gradient, params)
    with traffic.record() as recording:
        future = hook_fn(state, bucket)
        averaged = future.wait()
    averaged = averaged[0] if isinstance(averaged, (list, tuple)) else averaged
    for p, value in zip(params, HookBucket(averaged, params).gradients()):
        p.grad = value.clone()
    timing = _after_backward_timing(model, t_backward, t_backward_end, recording, numel=gradient.numel())
    t_reduced = runtime.clock()
    optimizer.step()
    t_end = runtime.clock()
    timeline = StepTimeline(step=0, forward=t_backward - t_start, backward=t_backward_end - t_backward,
                            communication_done=t_reduced - t_backward, optimizer=t_end - t_reduced,
                            total=t_end - t_start, buckets=[timing])
    return int(round(total)), total_loss / total, timeline


def _layered_step(model, sharded_model, loss_fn, data, count, buckets, reduce_in_place, sharded, hook):
    """Steps 2 to 4 with a `zero_sharded.ShardedDataParallel`: its hooks communicate during forward and backward."""
    t_start = runtime.clock()
    sharded_model.zero_grad()
    sharded_model.begin_step(count)
    loss, loss_sum = None, 0.0
    with traffic.record() as recording:
        if data is not None:
            loss = _local_loss(model, loss_fn, *data)
            loss_sum = loss.item() * count
        total, global_loss = sharded_model.start_step(count, loss_sum)
        t_backward = runtime.clock()
        if loss is not None:
            loss.backward()
        t_backward_end = runtime.clock()
        sharded_model.finish_gradients()
        t_reduced = runtime.clock()
        sharded_model.step()
    t_end = runtime.clock()
    timing = BucketTiming(0, 0, 0, ready=t_backward_end - t_backward, start=0.0, end=t_reduced - t_backward,
                          bytes_sent=recording.bytes_sent, bytes_received=recording.bytes_received,
                          messages_sent=recording.messages_sent)
    timeline = StepTimeline(step=0, forward=t_backward - t_start, backward=t_backward_end - t_backward,
                            communication_done=t_reduced - t_backward, optimizer=t_end - t_reduced,
                            total=t_end - t_start, buckets=[timing])
    return total, global_loss, timeline


def _bucket_bytes(bucket_mb, overlap, sharded):
    """The bucket size in bytes, or None for today's single all-reduce after backward."""
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be True or False, got {overlap!r}")
    if sharded and (overlap or bucket_mb is not None):
        raise ValueError("a ShardedOptimizer reduce-scatters the whole gradient after backward (a "
                         "ShardedDataParallel reduces each layer's during backward): it does not take bucket_mb or "
                         "overlap=True; leave both out.")
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
