"""The theory notebook 08 uses to pick a step size: the stability limit of gradient descent with stale
gradients (`stale_step_limit`) and the curvature of a loss (`sharpest_curvature`), each against an oracle.
No ranks are launched: both are plain functions.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import course_lib
from course_lib.training import toy
from course_lib.training.parameter_server import sharpest_curvature, stale_step_limit


def _distance_after(a, s, steps=3000):
    """|x| at the end of the delayed recursion x_{t+1} = x_t - a x_{t-s}, started at x = 1."""
    x = [1.0] * (s + 1)
    for _ in range(steps):
        x.append(x[-1] - a * x[-1 - s])
    return max(abs(v) for v in x[-(s + 1):])


@pytest.mark.parametrize("staleness", range(6))
@pytest.mark.parametrize("curvature", [0.5, 2.0])
def test_the_limit_separates_shrinking_from_exploding(staleness, curvature):
    limit = stale_step_limit(curvature, staleness)
    assert _distance_after(0.97 * limit * curvature, staleness) < 1e-3
    assert _distance_after(1.03 * limit * curvature, staleness) > 1e3


def test_the_familiar_cases_and_bad_input():
    assert stale_step_limit(4.0, 0) == pytest.approx(0.5)      # lr < 2 / L
    assert stale_step_limit(4.0, 1) == pytest.approx(0.25)     # halved by one update of staleness
    with pytest.raises(ValueError):
        stale_step_limit(0.0, 1)
    with pytest.raises(ValueError):
        stale_step_limit(1.0, -1)


def _curvatures(rank, world_size):
    """(measured, exact) curvature of a linear regression and of a small network, in a spawned rank.

    Computed away from the pytest process on purpose: once a process has run torch's OpenMP threads,
    a rank forked from it later hangs at its first multi-threaded op (GNU OpenMP is not fork-safe),
    and the world-size-1 launches of other tests fork from this process.
    """
    inputs, targets = toy.make_regression(300, features=5, seed=4)
    torch.manual_seed(1)
    with_bias = torch.cat([inputs, torch.ones(300, 1)], dim=1)
    linear = (sharpest_curvature(nn.Linear(5, 1), (inputs, targets), F.mse_loss),
              2 * torch.linalg.eigvalsh(with_bias.T @ with_bias / 300).max().item())

    inputs, targets = toy.make_regression(64, features=3, seed=5)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    inputs, targets = inputs.double(), targets.double()
    shapes = [p.shape for p in model.parameters()]

    def loss_of(flat):
        chunks, offset = [], 0
        for shape in shapes:
            n = torch.Size(shape).numel()
            chunks.append(flat[offset:offset + n].view(shape))
            offset += n
        w1, b1, w2, b2 = chunks
        return F.mse_loss(torch.tanh(inputs @ w1.T + b1) @ w2.T + b2, targets)

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    eigenvalues = torch.linalg.eigvalsh(torch.autograd.functional.hessian(loss_of, flat))
    dominant = eigenvalues[eigenvalues.abs().argmax()].item()  # power iteration finds the largest in size
    network = (sharpest_curvature(model, (inputs, targets), F.mse_loss, iterations=500), dominant)
    return linear, network


def test_curvature_matches_the_exact_hessian():
    """Linear regression: the top eigenvalue of 2 AᵀA / n (A with a column of ones for the bias);
    a small tanh network: the dominant eigenvalue of its full Hessian."""
    linear, network = course_lib.launch(_curvatures, world_size=1, start_method="spawn", timeout=120)[0]
    assert linear[0] == pytest.approx(linear[1], rel=1e-4)
    assert network[0] == pytest.approx(network[1], rel=1e-3)
