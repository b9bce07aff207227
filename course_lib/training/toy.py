"""Small data sets and models made in code, for the training lessons (nothing is downloaded).

    inputs, labels = make_spirals(n=600, classes=3, seed=0)   # 2-D points on interleaved spiral arms
    model = make_mlp(in_features=2, hidden=32, out_features=3, seed=0)
    print(progress_bar(3, 10), "loss 0.4123")                 # [#######-----------------]  3/10 loss ...
"""

from __future__ import annotations

import math

import torch
from torch import nn

from course_lib._util import progress_bar  # re-exported: the training loops print it

__all__ = ["make_spirals", "make_regression", "make_mlp", "progress_bar"]


def make_spirals(n: int = 600, classes: int = 3, noise: float = 0.15, seed: int = 0):
    """Points on `classes` interleaved spiral arms in the plane: a task a linear model cannot solve.

    Returns:
        (inputs, labels): a float32 tensor of shape (n, 2) and an int64 tensor of shape (n,).
        Sample i belongs to arm i mod `classes`, so every class is (almost) equally large.
    """
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % classes
    radius = torch.rand(n, generator=generator) * 0.9 + 0.1
    angle = labels * (2 * math.pi / classes) + 3.0 * radius + noise * torch.randn(n, generator=generator)
    inputs = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1)
    return inputs.float(), labels


def make_regression(n: int = 512, features: int = 8, noise: float = 0.1, seed: int = 0):
    """y = x . w + noise with a fixed random w: a convex problem whose loss curve is easy to read.

    Returns:
        (inputs, targets): shapes (n, features) and (n, 1), float32.
    """
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(n, features, generator=generator)
    weights = torch.randn(features, 1, generator=generator)
    targets = inputs @ weights + noise * torch.randn(n, 1, generator=generator)
    return inputs, targets


def make_mlp(in_features: int = 2, hidden: int = 32, out_features: int = 3, depth: int = 2, seed: int = 0) -> nn.Sequential:
    """A Linear-ReLU stack with `depth` hidden layers, initialised from `seed` (the global RNG is left alone).

    The same seed gives the same weights on every rank; a rank-dependent seed gives different
    replicas, which is what the data-parallel trainer's initial broadcast repairs.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, out_features))
        return nn.Sequential(*layers)
