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
"""

from __future__ import annotations

import torch
from torch import nn

from course_lib import modeled_clock as _clock

__all__ = ["ComputeDelay", "with_compute_delays"]


class _Delay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, forward_s, backward_s):
        ctx.backward_s = backward_s
        if forward_s > 0:
            _clock.compute(forward_s)
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        if ctx.backward_s > 0:
            _clock.compute(ctx.backward_s)
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
