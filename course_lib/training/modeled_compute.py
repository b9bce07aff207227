"""Modeled compute: layers whose forward and backward take a fixed time, as on an accelerator.

On a GPU, a layer's backward runs on the device while the CPU thread that launched it is free, so a
communication thread can move gradients at the same time. On this course's machines the ranks are
processes sharing a few CPU cores: a real backward and a communication thread compete for the same
cores, and overlapping them hides little (notebook 11 measures it). To show what overlap buys where
compute and communication use different hardware, `ComputeDelay` stands in for a layer's compute:

    forward:   takes `forward_s` seconds, returns its input unchanged
    backward:  takes `backward_s` seconds, returns the incoming gradient unchanged

It calls `course_lib.compute(seconds)`: under a modeled network (`launch(..., network=)`) that moves the
rank's modeled clock on and costs no real time; otherwise it sleeps, which gives up the CPU (and
Python's GIL), like a rank waiting for its GPU. Put one after each
layer whose gradients you want to become ready `backward_s` later (`with_compute_delays`): in backward
the delay runs first, then the layer's own backward produces its gradients. The numbers a model
computes are exactly those of the model without the delays.

Used with a modeled network (`course_lib.Network`), both sides of the overlap are then modeled:
compute by these delays, communication by the link, on the modeled clock; what it shows is the
schedule, the same in every run.

Example::

    model = with_compute_delays(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)),
                                forward_s=0.002, backward_s=0.02)

Compute from FLOPs: `with_flops_compute(model, samples, peak_flops)` puts after each `nn.Linear` a delay of
its own floating-point operations for `samples` rows at `peak_flops` per second (`linear_flops` counts
them), as a layer of that shape takes on an accelerator running at that rate::

    H100_BF16 = 989e12        # FLOP/s, the H100 SXM's dense BF16 tensor-core peak (datasheet)
    model = with_flops_compute(toy.make_mlp(hidden=512, depth=4), samples=65536, peak_flops=H100_BF16)

The rows the delays are computed for need not be the rows the model really computes on: the gradients'
size, which is what the network carries, does not depend on the batch, so a notebook can model the
compute of a large per-GPU batch while this machine works on a few samples.

Compute from FLOPs, for any model and any training script: inside ``with flop_compute(peak_flops):`` every
torch operation the thread runs (forward, and backward when it is called inside the block) costs its
floating-point operations, counted by the formulas of torch's own `torch.utils.flop_counter`
(`FlopCounterMode`'s registry: matrix products, convolutions, attention), divided by `peak_flops`. A plain
DistributedDataParallel script then reads a step time on the modeled clock, its buckets' all-reduces
overlapping the backward that is still running::

    with flop_compute(989e12, scale=65536 / 16):     # an H100's BF16 peak; 16 rows computed, 65,536 modeled
        loss = ddp_model(x).sum()
        loss.backward()
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from course_lib import runtime

__all__ = ["ComputeDelay", "with_compute_delays", "linear_flops", "model_flops", "with_flops_compute", "flop_compute",
           "FlopClock"]


class _Delay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, forward_s, backward_s):
        ctx.backward_s = backward_s
        if forward_s > 0:
            runtime.compute(forward_s)
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        if ctx.backward_s > 0:
            runtime.compute(ctx.backward_s)
        return grad, None, None


class ComputeDelay(nn.Module):
    """A layer that computes nothing and takes `forward_s` seconds forward, `backward_s` backward.

    Args:
        forward_s: seconds its forward takes (>= 0).
        backward_s: seconds its backward takes (>= 0).
    """

    def __init__(self, forward_s: float, backward_s: float):
        super().__init__()
        if not (forward_s >= 0 and backward_s >= 0):
            raise ValueError(f"compute delays are seconds >= 0, got forward_s={forward_s}, backward_s={backward_s}")
        self.forward_s, self.backward_s = float(forward_s), float(backward_s)

    def forward(self, tensor: torch.Tensor) -> torch.Tensor:
        return _Delay.apply(tensor, self.forward_s, self.backward_s)

    def extra_repr(self) -> str:
        return f"forward_s={self.forward_s:g}, backward_s={self.backward_s:g}"


def with_compute_delays(model: nn.Sequential, forward_s: float, backward_s: float) -> nn.Sequential:
    """A new Sequential with a `ComputeDelay(forward_s, backward_s)` after every layer that has parameters.

    The layers themselves are shared with `model` (not copied), so the parameters are the same objects.
    """
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"with_compute_delays takes an nn.Sequential, got {type(model).__name__}")
    layers = []
    for layer in model:
        layers.append(layer)
        if any(True for _ in layer.parameters()):
            layers.append(ComputeDelay(forward_s, backward_s))
    return nn.Sequential(*layers)


def linear_flops(layer: nn.Linear, samples: int, input_gradient: bool = True) -> tuple[float, float]:
    """(forward, backward) floating-point operations of one `nn.Linear` on `samples` rows.

    Forward: a multiply and an add per weight and row, 2 n_in n_out, plus n_out for the bias. Backward: the
    weight's gradient (2 n_in n_out per row: the same multiply-adds) and the bias's (n_out), and the input's
    gradient (another 2 n_in n_out) unless `input_gradient` is False (the first layer: its input is the data,
    which needs no gradient, and autograd skips it). So backward is about twice forward, the usual rule.
    """
    if not isinstance(layer, nn.Linear):
        raise TypeError(f"linear_flops counts an nn.Linear, not a {type(layer).__name__}")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
        raise ValueError(f"samples must be a whole number >= 0, got {samples!r}")
    matmul = 2 * layer.in_features * layer.out_features * samples
    bias = layer.out_features * samples if layer.bias is not None else 0
    return float(matmul + bias), float(matmul * (2 if input_gradient else 1) + bias)


def model_flops(model: nn.Sequential, samples: int) -> list[tuple[int, float, float]]:
    """[(index in `model`, forward FLOPs, backward FLOPs)] of every layer with parameters, for `samples` rows.

    Every such layer must be an `nn.Linear` (element-wise layers such as ReLU cost a memory pass, not FLOPs worth
    counting next to a matrix product, and are left out). The first one needs no input gradient.

    Raises:
        TypeError: a layer with parameters that is not an nn.Linear (its FLOPs depend on more than its shape).
    """
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"model_flops takes an nn.Sequential, got {type(model).__name__}")
    out = []
    for index, layer in enumerate(model):
        if not any(True for _ in layer.parameters()):
            continue
        if not isinstance(layer, nn.Linear):
            raise TypeError(f"layer {index} ({type(layer).__name__}) has parameters but is not an nn.Linear: its FLOPs "
                            "depend on more than its shape; model its compute with ComputeDelay(forward_s, backward_s)")
        out.append((index, *linear_flops(layer, samples, input_gradient=bool(out))))
    return out


def with_flops_compute(model: nn.Sequential, samples: int, peak_flops: float) -> nn.Sequential:
    """A new Sequential with, after every `nn.Linear`, a `ComputeDelay` of that layer's FLOPs for `samples` rows
    at `peak_flops` floating-point operations per second (`model_flops`).

    The layers are shared with `model` (not copied), so the parameters are the same objects. On the modeled
    clock a step then takes sum(FLOPs) / peak_flops of compute, spread over the layers as an accelerator running
    at that rate would spend it, and each layer's gradients become ready when its backward would finish.
    """
    if isinstance(peak_flops, bool) or not isinstance(peak_flops, (int, float)) or not peak_flops > 0:
        raise ValueError(f"peak_flops must be a positive number of floating-point operations per second, "
                         f"got {peak_flops!r}")
    delays = {index: (forward / peak_flops, backward / peak_flops) for index, forward, backward in
              model_flops(model, samples)}
    layers = []
    for index, layer in enumerate(model):
        layers.append(layer)
        if index in delays:
            layers.append(ComputeDelay(*delays[index]))
    return nn.Sequential(*layers)


class FlopClock(TorchDispatchMode):
    """A dispatch mode that charges each torch operation its FLOPs at `peak_flops` on this thread's modeled clock
    (see `flop_compute`). `flops` counts what it charged, `scale` included."""

    def __init__(self, peak_flops: float, scale: float = 1.0):
        super().__init__()
        for name, value in (("peak_flops", peak_flops), ("scale", scale)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        self.peak_flops, self.scale = float(peak_flops), float(scale)
        self.flops = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        count = flop_registry.get(func._overloadpacket)
        if count is not None:
            flops = count(*args, **kwargs, out_val=out) * self.scale
            if flops:
                self.flops += flops
                runtime.compute(flops / self.peak_flops)
        return out


@contextlib.contextmanager
def flop_compute(peak_flops: float, scale: float = 1.0):
    """Inside the block, every torch operation of this thread costs its FLOPs / `peak_flops` of compute on the
    modeled clock (`course_lib.compute`; outside a modeled launch it sleeps that long).

    FLOPs are counted as `torch.utils.flop_counter.FlopCounterMode` counts them (its formulas: 2 m n k for a
    matrix product of (m, k) and (k, n), likewise convolutions and attention; element-wise operations count 0,
    as there). Backward is charged when it runs inside the block, layer by layer as autograd runs it, so
    gradients become ready, and DDP's buckets start, when an accelerator of that peak would have them.

    Args:
        peak_flops: floating-point operations per second (989e12: an H100 SXM's dense BF16 peak, datasheet).
        scale: FLOPs charged per FLOP computed: the modeled batch over the batch this machine computes
            (the gradients, which the network carries, do not depend on the batch).

    Yields the `FlopClock` (its `flops` is what was charged).
    """
    mode = FlopClock(peak_flops, scale)
    with mode:
        yield mode
