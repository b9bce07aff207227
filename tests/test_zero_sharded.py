"""ZeRO stages 0-3 layer by layer (training.zero_sharded) against plain data parallelism, and their memory.

* Step for step, G = 1..6: a model of layers of 93, 992 and 96 parameters (make_mlp(hidden=31): at
  every G from 2 to 6 some layer does not divide by G, so its pieces are padded), Adam and SGD with
  momentum, rank-dependent initial replicas (the broadcast repairs them), uneven shards (pad=False, 61
  samples in batches of 5, so that at G = 2, 3, 4, 6 some ranks have no sample in the last step and
  still join every all-gather and reduce-scatter), one epoch. Stages 1, 2, 3 and 3 with prefetch hold exactly the
  parameters of `train_data_parallel(allreduce="naive")` after every step: the reduce-scatter sums
  each element in rank order 0..G-1, as the naive all-reduce does, and Adam updates element by
  element (tolerance 0, stated). Stage 0 equals it exactly with the naive all-reduce and within 1e-5
  with the ring (a different summation order). The replicas (the all-gathered parameters) are
  bit-identical on every rank.
* Bytes: every rank's bytes sent equal `zero_sharded.expected_bytes_sent` (the per-layer formulas).
* Memory, G = 2, 4, 8: the census when the optimizer steps is within 10% of the Playbook's formula
  (`memory.model_state_bytes`) for parameters, gradients and optimizer state, every stage; the
  census's peak during a step equals `memory.schedule_bytes` (the schedule's own element count) on
  every rank, exactly; and the peaks fall stage by stage where the formula says they must.
* Bad input fails with a clear message on every rank; nothing hangs.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from conftest import run, step_difference
from course_lib import training
from course_lib.training import memory, sharding, toy, zero_sharded

DATA = toy.make_spirals(61, seed=5)
BATCH, EPOCHS = 5, 1
OPTIMIZERS = {"adam": (torch.optim.Adam, {"lr": 0.02, "weight_decay": 1e-3}),
              "sgd": (torch.optim.SGD, {"lr": 0.2, "momentum": 0.9})}
CONFIGS = {"stage 0 naive": dict(stage=0, allreduce="naive"), "stage 0 ring": dict(stage=0),
           "ZeRO-1": dict(stage=1), "ZeRO-2": dict(stage=2), "ZeRO-3": dict(stage=3),
           "ZeRO-3 prefetch": dict(stage=3, prefetch=True)}


@pytest.fixture(autouse=True)
def _one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def _model(rank):
    return toy.make_mlp(hidden=31, seed=100 + rank)     # layers of 93, 992 and 96 parameters


def _train(optimizer_name, config):
    model = _model(dist.get_rank())
    cls, options = OPTIMIZERS[optimizer_name]
    if config is None:
        optimizer, variant = cls(model.parameters(), **options), "naive"
    else:
        optimizer, variant = zero_sharded.ShardedDataParallel(model, cls, **config, **options), "ring"
    log = training.train_data_parallel(model, optimizer, DATA, F.cross_entropy, batch_size=BATCH, epochs=EPOCHS,
                                       pad=False, allreduce=variant, record_parameters=True)
    return log


def _every_stage(rank, world_size):
    out = {}
    for name in OPTIMIZERS:
        out[name, "plain"] = _train(name, None)
        for config in CONFIGS:
            if name == "sgd" and config not in ("ZeRO-3 prefetch", "stage 0 ring"):
                continue                      # SGD once per kind of schedule: the launch stays short
            out[name, config] = _train(name, CONFIGS[config])
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 6])
def test_every_stage_equals_plain_data_parallelism_step_for_step(world_size):
    ranks = run(_every_stage, world_size, timeout=240)
    units = [93, 992, 96]
    assert [p.numel() for p in _model(0).parameters()] == [62, 31, 961, 31, 93, 3]
    assert world_size == 1 or any(n % world_size for n in units)
    counts = [len(b) for r in range(world_size)
              for b in sharding.split_batches(sharding.shard_indices(61, r, world_size, pad=False), BATCH)]
    steps = EPOCHS * sharding.steps_per_epoch(61, world_size, BATCH, pad=False)
    if world_size in (2, 3, 4, 6):   # some rank runs out of samples one step early: it joins with none
        assert any(len(sharding.split_batches(sharding.shard_indices(61, r, world_size, pad=False), BATCH))
                   < steps // EPOCHS for r in range(world_size)), counts
    for (name, config), log in ranks[0].items():
        plain = ranks[0][name, "plain"]
        assert len(log.parameters) == steps + 1, (name, config)
        assert log.samples == plain.samples and all(s > 0 for s in log.samples)
        tolerance = 1e-5 if config == "stage 0 ring" else None           # None: bit for bit
        assert step_difference(log.parameters, plain.parameters, tol=tolerance) is None, (name, config)
        if tolerance is None:
            assert log.losses == plain.losses, (name, config)
        assert (plain.parameters[-1] - plain.parameters[0]).abs().max() > 0.02     # a wrong step would show
        for r, other in enumerate(ranks[1:], start=1):
            assert step_difference(other[name, config].parameters, log.parameters) is None, (name, config, r)
        if config != "plain":
            for r, other in enumerate(ranks):
                kwargs = CONFIGS[config]
                expected = zero_sharded.expected_bytes_sent(units, world_size, kwargs["stage"], rank=r, steps=steps) \
                    if kwargs.get("allreduce", "ring") == "ring" else None
                if expected is not None:
                    assert other[name, config].bytes_sent == expected, (name, config, r)


# --------------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------------

MEMORY_MODEL = dict(hidden=64, depth=4)       # layers of 192, 4160, 4160, 4160, 195 parameters


def _measure_memory(rank, world_size):
    out = {}
    for stage, prefetch in ((0, False), (1, False), (2, False), (3, False), (3, True)):
        model = toy.make_mlp(**MEMORY_MODEL, seed=rank)
        census = memory.MemoryCensus()
        sharded = zero_sharded.ShardedDataParallel(model, torch.optim.Adam, stage=stage, prefetch=prefetch,
                                                   census=census, lr=0.01)
        data = toy.make_spirals(16 * world_size, seed=1)
        training.train_data_parallel(model, sharded, data, F.cross_entropy, batch_size=8, max_steps=1)
        census.reset()                  # after the first step: Adam's state exists from here on
        training.train_data_parallel(model, sharded, data, F.cross_entropy, batch_size=8, max_steps=1)
        at_step = census.at("after optimizer step")
        out[stage, prefetch] = {"peak": dict(census.peak), "steady": dict(census.steady),
                                "at_step": {"params": at_step.params, "grads": at_step.grads,
                                            "optimizer": at_step.optimizer},
                                "units": [u.numel for u in sharded.units]}
    return out


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_memory_per_rank_measured_against_the_formulas(world_size):
    ranks = run(_measure_memory, world_size, timeout=240)
    for rank, runs in enumerate(ranks):
        for (stage, prefetch), measured in runs.items():
            units = measured["units"]
            assert units == [192, 4160, 4160, 4160, 195]
            formula = memory.model_state_bytes(sum(units), world_size, stage)
            schedule = memory.schedule_bytes(units, world_size, stage, rank=rank, prefetch=prefetch)
            for kind in memory.KINDS:
                ratio = measured["at_step"][kind] / formula[kind]
                assert abs(ratio - 1) <= 0.10, (rank, stage, prefetch, kind, ratio)
                assert measured["at_step"][kind] == schedule["at_step"][kind], (rank, stage, prefetch, kind)
                assert measured["peak"][kind] == schedule["peak"][kind], (rank, stage, prefetch, kind,
                                                                          measured["peak"][kind], schedule["peak"][kind])
        # What each stage saves, where the formula says: optimizer from stage 1, gradients from 2, parameters at 3.
        at = {key: runs[key]["at_step"] for key in runs}
        if world_size > 1:
            assert at[1, False]["optimizer"] < at[0, False]["optimizer"] / (world_size - 0.5)
            assert at[1, False]["grads"] == at[0, False]["grads"] or at[1, False]["grads"] > at[2, False]["grads"]
            assert at[2, False]["grads"] < at[1, False]["grads"] / (world_size - 0.5)
            assert at[3, False]["params"] < at[2, False]["params"] / (world_size - 0.5)
            assert runs[3, True]["peak"]["params"] > runs[3, False]["peak"]["params"]   # two layers at once
        # Between steps ZeRO-2 and -3 hold no gradient at all; stage 3 holds only its pieces.
        assert runs[2, False]["steady"]["grads"] == 0 and runs[3, False]["steady"]["grads"] == 0
        assert runs[3, False]["steady"]["params"] == runs[3, False]["at_step"]["params"]


def test_formulas_on_paper():
    # 7B parameters, fp32 Adam: 16 bytes a parameter, 112 GB on one rank; ZeRO-3 on 1024 ranks: 1/1024 of it.
    assert memory.model_state_bytes(7e9, 1, 0)["total"] == 16 * 7e9
    assert memory.model_state_bytes(7e9, 1024, 3)["total"] == pytest.approx(16 * 7e9 / 1024)
    assert memory.model_state_bytes(7e9, 8, 1)["total"] == pytest.approx(8 * 7e9 + 8 * 7e9 / 8)
    mixed = memory.model_state_bytes(7e9, 64, 2, precision="mixed")          # the Playbook's own table
    assert mixed["params"] == 2 * 7e9 and mixed["grads"] == pytest.approx(2 * 7e9 / 64)
    assert mixed["optimizer"] == pytest.approx(12 * 7e9 / 64)
    with pytest.raises(ValueError, match="stage must be 0"):
        memory.model_state_bytes(10, 2, 4)
    with pytest.raises(ValueError, match="precision must be one of"):
        memory.model_state_bytes(10, 2, 1, precision="fp8")


def test_census_counts_each_storage_once():
    census = memory.MemoryCensus()
    flat = torch.zeros(100)
    sample = census.count("x", params=[flat, flat[:10], flat[50:].view(5, 10)], grads=[torch.zeros(7), None],
                          optimizer=[flat])
    assert (sample.params, sample.grads, sample.optimizer) == (400, 28, 0)     # flat counted once, as params
    flat.untyped_storage().resize_(0)
    assert census.count("freed", params=[flat]).params == 0
    assert census.peak == {"params": 400, "grads": 28, "optimizer": 0, "total": 428}
    assert census.at("x") is sample
    with pytest.raises(KeyError, match="no census sample taken at 'nowhere'"):
        census.at("nowhere")


# --------------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------------

class _Shared(nn.Module):
    """One Linear called twice in a forward (weight sharing), which ShardedDataParallel refuses."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(2, 2)

    def forward(self, x):
        return self.layer(self.layer(x))


def _bad_inputs(rank, world_size):
    errors = {}

    def attempt(name, make):
        try:
            make()
            errors[name] = "no error"
        except Exception as exc:  # noqa: BLE001
            errors[name] = f"{type(exc).__name__}: {exc}"

    model = _model(0)
    attempt("stage", lambda: zero_sharded.ShardedDataParallel(model, torch.optim.SGD, stage=4, lr=1))
    attempt("prefetch", lambda: zero_sharded.ShardedDataParallel(model, torch.optim.SGD, stage=2, prefetch=True, lr=1))
    attempt("instance", lambda: zero_sharded.ShardedDataParallel(model, torch.optim.SGD(model.parameters(), lr=1)))
    attempt("allreduce", lambda: zero_sharded.ShardedDataParallel(model, torch.optim.SGD, allreduce="fast", lr=1))
    frozen = _model(0)
    frozen[0].bias.requires_grad_(False)
    attempt("frozen", lambda: zero_sharded.ShardedDataParallel(frozen, torch.optim.SGD, lr=1))
    other = _model(0) if rank == 0 else toy.make_mlp(hidden=32)
    attempt("different models", lambda: zero_sharded.ShardedDataParallel(other, torch.optim.SGD, lr=1))
    sharded = zero_sharded.ShardedDataParallel(model, torch.optim.SGD, stage=3, lr=1)
    attempt("forward outside a step", lambda: model(DATA[0][:4]))
    attempt("closure", lambda: sharded.step(lambda: 0.0))
    attempt("bucket_mb", lambda: training.train_data_parallel(model, sharded, DATA, F.cross_entropy, batch_size=4,
                                                              bucket_mb=1))
    attempt("another model", lambda: training.train_data_parallel(_model(0), sharded, DATA, F.cross_entropy,
                                                                  batch_size=4))
    shared = _Shared()
    twice = zero_sharded.ShardedDataParallel(shared, torch.optim.SGD, stage=3, lr=1)
    attempt("layer twice", lambda: training.train_data_parallel(shared, twice, (torch.randn(8, 2),
                                                                                torch.randn(8, 2)),
                                                                F.mse_loss, batch_size=4, max_steps=1))
    # One sample on two ranks, pad=False: rank 1 has none in the first step.
    lonely = _model(0)
    stage3 = zero_sharded.ShardedDataParallel(lonely, torch.optim.SGD, stage=3, lr=1)
    attempt("no samples first", lambda: training.train_data_parallel(lonely, stage3, (DATA[0][:1], DATA[1][:1]),
                                                                     F.cross_entropy, batch_size=1, pad=False))
    return errors


def test_bad_inputs_fail_clearly_on_every_rank():
    for rank, errors in enumerate(run(_bad_inputs, 2, timeout=90)):
        assert errors["stage"].startswith("ValueError: stage must be 0 (plain data parallelism), 1, 2 or 3")
        assert errors["prefetch"].startswith("ValueError: prefetch=True starts the next layer's parameter all-gather")
        assert errors["instance"].startswith("TypeError: optimizer_class must be a torch.optim.Optimizer class")
        assert errors["allreduce"].startswith("ValueError: allreduce must name a course_lib.allreduce variant")
        assert "do not require grad: ShardedDataParallel trains every parameter" in errors["frozen"]
        assert errors["different models"].startswith("MismatchError: ShardedDataParallel: the ranks disagree about "
                                                     "plan"), errors["different models"]
        assert errors["forward outside a step"].startswith("RuntimeError: this model's parameters are sharded between "
                                                           "steps (ZeRO-3)")
        assert errors["closure"].startswith("NotImplementedError: ShardedDataParallel.step takes no closure")
        assert "it does not take bucket_mb or overlap=True" in errors["bucket_mb"]
        assert errors["another model"].startswith("ValueError: this ShardedDataParallel wraps another model")
        assert "ran twice in one forward" in errors["layer twice"]
        assert errors["no samples first"].startswith("RuntimeError: rank(s) [1] have no samples in the first step")
    with pytest.raises(RuntimeError, match="create it inside a function started by course_lib.launch"):
        zero_sharded.ShardedDataParallel(_model(0), torch.optim.SGD, lr=1)
