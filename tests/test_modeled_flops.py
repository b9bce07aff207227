"""Compute modeled from FLOPs (`training.modeled_compute`: linear_flops, model_flops, with_flops_compute), as notebook
13 models an H100's: the counts follow the rule (2 n_in n_out per row forward, backward twice that except the first
layer's), the model computes what it computed before, and on the modeled clock a training step's forward and backward
take exactly their FLOPs at the stated peak."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import course_lib
from course_lib import training
from course_lib.network import Network
from course_lib.training.modeled_compute import ComputeDelay, linear_flops, model_flops, with_flops_compute

PEAK = 989e12


def test_a_linear_layer_counts_a_multiply_and_an_add_per_weight_and_row():
    layer = nn.Linear(3, 5)
    assert linear_flops(layer, 7) == (2 * 3 * 5 * 7 + 5 * 7, 2 * 2 * 3 * 5 * 7 + 5 * 7)
    assert linear_flops(layer, 7, input_gradient=False) == (245.0, 245.0)       # the first layer: no input gradient
    assert linear_flops(nn.Linear(3, 5, bias=False), 2) == (60.0, 120.0)
    with pytest.raises(TypeError, match="nn.Linear"):
        linear_flops(nn.Conv1d(1, 1, 3), 1)
    with pytest.raises(ValueError, match="whole number"):
        linear_flops(layer, 2.5)


def test_a_model_counts_each_linear_and_the_first_one_without_its_input_gradient():
    model = training.make_mlp(in_features=2, hidden=8, out_features=3, depth=2)
    flops = model_flops(model, 10)
    assert [index for index, _, _ in flops] == [0, 2, 4]                          # the Linear layers; ReLUs cost nothing
    assert flops[0][1:] == linear_flops(model[0], 10, input_gradient=False)
    assert flops[1][1:] == linear_flops(model[2], 10) and flops[2][2] == 2 * flops[2][1] - 3 * 10
    with pytest.raises(TypeError, match="not an nn.Linear"):
        model_flops(nn.Sequential(nn.Linear(2, 4), nn.LayerNorm(4)), 1)
    with pytest.raises(TypeError, match="nn.Sequential"):
        model_flops(nn.Linear(2, 2), 1)


def test_the_delays_follow_the_flops_and_leave_the_numbers_alone():
    model = training.make_mlp(in_features=2, hidden=8, out_features=3, depth=2, seed=1)
    timed = with_flops_compute(model, 64, PEAK)
    delays = [layer for layer in timed if isinstance(layer, ComputeDelay)]
    assert [(d.forward_s, d.backward_s) for d in delays] == [(f / PEAK, b / PEAK) for _, f, b in model_flops(model, 64)]
    assert [id(p) for p in timed.parameters()] == [id(p) for p in model.parameters()]
    x = torch.randn(5, 2, generator=torch.Generator().manual_seed(0))
    assert torch.equal(timed(x), model(x))
    for bad in (0, -1.0, True, "989e12"):
        with pytest.raises(ValueError, match="peak_flops"):
            with_flops_compute(model, 1, bad)


def _one_step(rank, world_size, samples):
    model = with_flops_compute(training.make_mlp(in_features=2, hidden=64, out_features=3, depth=2), samples, PEAK)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    log = training.train_data_parallel(model, optimizer, training.make_spirals(64, seed=0), F.cross_entropy,
                                       batch_size=4, max_steps=1)
    step = log.timeline[-1]
    return step.forward, step.backward


def test_on_the_modeled_clock_forward_and_backward_take_their_flops_at_the_peak():
    samples = 65536
    flops = model_flops(training.make_mlp(in_features=2, hidden=64, out_features=3, depth=2), samples)
    for forward, backward in course_lib.launch(_one_step, 2, args=(samples,), network=Network.preset("nvlink4")):
        assert math.isclose(forward, sum(f for _, f, _ in flops) / PEAK, rel_tol=1e-9)
        assert math.isclose(backward, sum(b for _, _, b in flops) / PEAK, rel_tol=1e-9)
