"""PyTorch's own DistributedDataParallel, and course_lib's all-reduce running inside it.

`train_ddp` is the textbook DDP loop, in the five parts every tutorial lists:

    1. init_process_group            (done by course_lib.launch or torchrun before we get here)
    2. pick this rank's device       (course_lib.device(): the CPU under gloo, GPU `rank` under NCCL)
    3. DistributedSampler            (each rank loads its own shard of every epoch)
    4. model.to(device)
    5. DistributedDataParallel(model)  (broadcasts rank 0's parameters, then all-reduces gradients
                                        in buckets while backward is still running)

DDP lets you replace its gradient all-reduce through a *communication hook*: a function
``hook(state, bucket) -> torch.futures.Future`` that DDP calls once per gradient bucket, with the
bucket's gradients flattened into ``bucket.buffer()``. `allreduce_hook` is such a hook that averages
the bucket with a hand-written `course_lib.allreduce` variant (the ring by default), so the
algorithm you wrote runs inside the real thing::

    ddp_model = DistributedDataParallel(model)
    state = CommHookState("ring")
    ddp_model.register_comm_hook(state, allreduce_hook)
"""

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

# DistributedDataParallel imports torch._dynamo (hundreds of modules) the first time a model is
# wrapped. Importing it here, in the notebook's process, means the ranks forked by course_lib.launch
# inherit it instead of each paying seconds for the same import at the same time.
import torch._dynamo  # noqa: F401
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import course_lib
from course_lib import allreduce as allreduce_variants
from course_lib.training.data_parallel import TrainingLog, _check_model, _local_loss, flat_parameters

__all__ = ["CommHookState", "allreduce_hook", "train_ddp"]


@dataclass
class CommHookState:
    """The `state` DDP hands to `allreduce_hook` on every call.

    Attributes:
        allreduce: the course_lib all-reduce variant to use ('ring', 'naive', 'parameter_server').
        buckets_per_step: the number of gradient elements of every bucket the hook averaged,
            grouped by training step (filled in by the hook: it shows how DDP cut the gradients into
            buckets; DDP marks each step's last bucket, and rebuilds its buckets after the first
            step, so step 0 may differ).
        bucket_sizes: (read-only) the same sizes in one list, in order.
    """

    allreduce: str = "ring"
    buckets_per_step: list = field(default_factory=list)
    _step_finished: bool = field(default=True, repr=False)

    @property
    def bucket_sizes(self) -> list:
        return [size for step in self.buckets_per_step for size in step]


# No `from __future__ import annotations` in this module: DDP checks the hook's annotations at
# run time and wants the real objects dist.GradBucket and torch.futures.Future[torch.Tensor].
def allreduce_hook(state: CommHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average one gradient bucket with a course_lib all-reduce.

    Does what DDP's built-in `allreduce_hook` does (divide by the world size, then all-reduce SUM),
    with `course_lib.allreduce.get(state.allreduce)` in place of `torch.distributed.all_reduce`.
    Our all-reduce blocks until it is done, so the returned Future is already complete.
    """
    buffer = bucket.buffer()
    if state._step_finished:
        state.buckets_per_step.append([])
    state.buckets_per_step[-1].append(buffer.numel())
    state._step_finished = bucket.is_last()
    buffer.div_(dist.get_world_size())  # before summing, as DDP's own hook does (avoids fp16 overflow)
    allreduce_variants.get(state.allreduce)(buffer, "sum")
    future = torch.futures.Future(devices=[buffer.device]) if buffer.is_cuda else torch.futures.Future()
    future.set_result(buffer)
    return future


def _as_dataset(dataset):
    if isinstance(dataset, (tuple, list)) and len(dataset) == 2:
        return TensorDataset(*dataset)
    return dataset


def train_ddp(model: nn.Module, optimizer: torch.optim.Optimizer, dataset, loss_fn: Callable, *, batch_size: int,
              epochs: int = 1, start_epoch: int = 0, max_steps: int | None = None, shuffle: bool = True, seed: int = 0,
              drop_last: bool = False, comm_hook: CommHookState | None = None, bucket_cap_mb: float | None = None,
              record_parameters: bool = False, progress: bool = False) -> TrainingLog:
    """Train with `torch.nn.parallel.DistributedDataParallel`; same arguments and log as `train_data_parallel`.

    Args:
        comm_hook: a `CommHookState` to average gradients with course_lib's all-reduce through
            `allreduce_hook`; None keeps DDP's built-in all-reduce.
        bucket_cap_mb: DDP's gradient bucket size in MiB (None: DDP's default of 25).
        (the others as in `course_lib.training.train_data_parallel`)

    Returns:
        A `TrainingLog`; its losses are the global-batch mean losses (an extra all-reduce, for the log only).
    """
    _check_model(model)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = course_lib.device()                                                    # step 2
    sampler = DistributedSampler(_as_dataset(dataset), num_replicas=world_size, rank=rank, shuffle=shuffle,
                                 seed=seed, drop_last=drop_last)                    # step 3
    loader = DataLoader(_as_dataset(dataset), batch_size=batch_size, sampler=sampler)
    model.to(device)                                                                # step 4
    options = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    device_ids = [device.index] if device.type == "cuda" else None
    ddp_model = DistributedDataParallel(model, device_ids=device_ids, **options)   # step 5
    if comm_hook is not None:
        ddp_model.register_comm_hook(comm_hook, allreduce_hook)
    log = TrainingLog(rank=rank, world_size=world_size)
    if record_parameters:
        log.parameters.append(flat_parameters(model))
    for epoch in range(start_epoch, start_epoch + epochs):
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            if max_steps is not None and len(log.losses) >= max_steps:
                break
            inputs, targets = inputs.to(device), targets.to(device)
            optimizer.zero_grad()
            loss = _local_loss(ddp_model, loss_fn, inputs, targets)
            loss.backward()          # DDP all-reduces the gradients here, bucket by bucket
            optimizer.step()
            both = torch.tensor([loss.item() * len(inputs), len(inputs)], dtype=torch.float64, device=device)
            dist.all_reduce(both)
            total_loss, total = both.tolist()
            log.record_step(total_loss / total, int(total), len(inputs), model if record_parameters else None)
        log.end_epoch(epoch, epoch - start_epoch + 1, epochs, show_progress=progress and rank == 0)
    return log
