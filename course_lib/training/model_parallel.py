"""Model parallelism: the layers are split over the ranks, and every rank sees every sample.

Data parallelism copies the whole model to every rank and splits the *data*; model parallelism
splits the *model*: rank r holds stage r, a consecutive group of layers. One training step:

    forward    rank 0 runs its stage on the batch and sends the activations to rank 1, which runs
               its stage on them and sends its output to rank 2, ... the last rank computes the loss
    backward   the last rank backpropagates to its input and sends that gradient to the rank
               before it, which continues the backward pass from there, ... down to rank 0
    update     each rank steps the optimizer of its own layers: parameters never travel

What travels is activations and their gradients (batch x width numbers per stage boundary), not
parameters. The price: while one stage computes, the others wait (pipelining with micro-batches,
as in GPipe, fills some of that idle time; it is not done here).

Because every stage computes exactly what the full model computes on one process, the result is
the same, operation for operation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from course_lib import p2p, traffic
from course_lib import runtime
from course_lib.training import sharding
from course_lib.training.data_parallel import _dataset_len, flat_parameters, take_batch

__all__ = ["split_sequential", "PipelineLog", "train_model_parallel"]

_HEADER = 8  # an activation's shape travels first: [ndim, dtype code, size_0, size_1, ...]
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def split_sequential(model: nn.Sequential, parts: int) -> list[nn.Sequential]:
    """Cut an nn.Sequential into `parts` consecutive stages with (nearly) equal numbers of layers.

    The stages share the original layers (no copy), so ``split_sequential(model, 2)[1]`` holds the
    very parameters of the second half of `model`.
    """
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"split_sequential needs an nn.Sequential, got {type(model).__name__}")
    layers = list(model)
    if not 1 <= parts <= len(layers):
        raise ValueError(f"cannot split {len(layers)} layers into {parts} stages: every stage needs at least one layer")
    sizes = [len(layers) // parts + (1 if i < len(layers) % parts else 0) for i in range(parts)]
    stages, start = [], 0
    for size in sizes:
        stages.append(nn.Sequential(*layers[start:start + size]))
        start += size
    return stages


@dataclass
class PipelineLog:
    """One stage's view of model-parallel training.

    Attributes:
        rank: the stage.
        losses: per step, the batch's mean loss (only the last stage computes it; empty elsewhere).
        parameters: flat copies of this stage's parameters, before training and after each step.
        activation_elements_sent / gradient_elements_sent: what this stage sent forward / backward.
        timeline: (step, 'forward' or 'backward', start, end) of every stretch of computing, in
            `course_lib.clock()` seconds (this machine's `time.perf_counter`, one clock for all processes of a
            machine; the modeled clock under a modeled network): the gaps between them are the time the stage
            spent waiting for its neighbours.
    """

    rank: int = 0
    losses: list = field(default_factory=list)
    parameters: list = field(default_factory=list)
    activation_elements_sent: int = 0
    gradient_elements_sent: int = 0
    timeline: list = field(default_factory=list)


def _send_activation(tensor: torch.Tensor, dst: int) -> None:
    if tensor.dim() > _HEADER - 2 or tensor.dtype not in _DTYPES:
        raise ValueError(f"activations must have at most {_HEADER - 2} dimensions and a float dtype, got "
                         f"shape {tuple(tensor.shape)} {tensor.dtype}")
    header = torch.zeros(_HEADER, dtype=torch.int64, device=tensor.device)
    header[0], header[1] = tensor.dim(), _DTYPES.index(tensor.dtype)
    header[2:2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    with traffic.phase("shape"):  # labelled apart, so 'forward' counts the activations alone
        p2p.send(header, dst)
    p2p.send(tensor.detach().contiguous(), dst)


def _recv_activation(src: int, device) -> torch.Tensor:
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    with traffic.phase("shape"):
        p2p.recv(header, src)
    ndim, dtype = int(header[0]), _DTYPES[int(header[1])]
    activation = torch.empty(header[2:2 + ndim].tolist(), dtype=dtype, device=device)
    p2p.recv(activation, src)
    return activation


def train_model_parallel(stage: nn.Module, optimizer: torch.optim.Optimizer, dataset, loss_fn: Callable, *,
                         batch_size: int, epochs: int = 1, max_steps: int | None = None, shuffle: bool = True,
                         seed: int = 0, record_parameters: bool = False) -> PipelineLog:
    """Train one stage of a model split over the ranks (rank r holds stage r); call it on every rank.

    Args:
        stage: this rank's layers, e.g. ``split_sequential(model, world_size)[rank]``.
        optimizer: over ``stage.parameters()`` (may be None for a stage without parameters).
        dataset: (inputs, targets), the same on every rank: rank 0 reads the inputs, the last rank
            the targets.
        loss_fn: ``loss_fn(output, targets)`` -> mean loss, computed on the last rank.
        batch_size, epochs, max_steps, shuffle, seed: the batches are those of
            `train_single_process` with the same arguments, so the two can be compared step for step.
        record_parameters: keep a flat copy of this stage's parameters after every step.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    first, last = rank == 0, rank == world_size - 1
    params = list(stage.parameters())
    device = params[0].device if params else torch.device("cpu")
    n = _dataset_len(dataset)
    log = PipelineLog(rank=rank)
    if record_parameters:
        log.parameters.append(flat_parameters(stage) if params else torch.empty(0))
    step = 0
    with traffic.record() as recording:
        for epoch in range(epochs):
            order = sharding.epoch_order(n, 1, shuffle=shuffle, seed=seed, epoch=epoch)
            for batch in sharding.split_batches(order, batch_size):
                if max_steps is not None and step >= max_steps:
                    break
                inputs, targets = take_batch(dataset, batch, device)
                if optimizer is not None:
                    optimizer.zero_grad()
                # Forward: my input is the batch (rank 0) or the previous stage's activations.
                with traffic.phase("forward"):
                    received = inputs if first else _recv_activation(rank - 1, device).requires_grad_(True)
                    start = runtime.clock()
                    output = stage(received)
                    if last:
                        loss = loss_fn(output, targets)
                    log.timeline.append((step, "forward", start, runtime.clock()))
                    if not last:
                        _send_activation(output, rank + 1)
                # Backward: start from the loss (last rank) or from the gradient the next stage sent.
                with traffic.phase("backward"):
                    if last:
                        start = runtime.clock()
                        loss.backward()
                        log.losses.append(loss.item())
                    else:
                        grad_output = torch.empty_like(output)
                        p2p.recv(grad_output, rank + 1)
                        start = runtime.clock()
                        output.backward(grad_output)
                    log.timeline.append((step, "backward", start, runtime.clock()))
                    if not first:
                        p2p.send(received.grad.contiguous(), rank - 1)
                if optimizer is not None:
                    optimizer.step()
                if record_parameters:
                    log.parameters.append(flat_parameters(stage) if params else torch.empty(0))
                step += 1
    log.activation_elements_sent = sum(e.numel for e in recording.in_phase("forward") if e.kind == "send")
    log.gradient_elements_sent = sum(e.numel for e in recording.in_phase("backward") if e.kind == "send")
    return log
