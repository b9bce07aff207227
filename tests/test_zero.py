"""ZeRO-1 (training.zero.ShardedOptimizer) against plain data parallelism and one process.

* For G = 1..4 ranks and a model of 1181 parameters (a prime: no G > 1 divides it), SGD with
  momentum and Adam, two epochs with the uneven last batch: the sharded optimizer's parameters equal
  plain data parallelism's with the same optimizer after every step: bit for bit against the 'naive'
  all-reduce (reduce-scatter sums in rank order too, and the optimizers update element by element),
  within float tolerance against the ring, and against one process on the same global batches.
  Uneven shards (pad=False) included. The replicas stay bit-identical.
* Optimizer-state bytes per rank, measured from the state tensors, are within 5% of 1/G of the
  unsharded optimizer's, and the shards are torch.tensor_split's of the flat vector.
* Traffic per step is reduce-scatter + all-gather of padded shards: (G-1)(P+2) + (G-1)P elements.
* Used in a plain loop (no trainer), step() averages the gradients itself: equal to the built-in
  all-reduce followed by the unsharded optimizer.
* Bad input: a clear error on every rank.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from conftest import run, step_difference
from course_lib import training
from course_lib.training import sharding, toy, zero

N_SAMPLES, BATCH = 203, 8
DATA = toy.make_spirals(N_SAMPLES, seed=3)
HIDDEN = 31                                   # make_mlp(hidden=31): 31^2 + 7*31 + 3 = 1181 parameters
OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 0.2, "momentum": 0.9}),
              "adam": (torch.optim.Adam, {"lr": 0.02, "weight_decay": 1e-3})}


@pytest.fixture(autouse=True)
def _one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def _model(seed=100):
    return toy.make_mlp(hidden=HIDDEN, seed=seed)


def _train(optimizer_name, sharded, variant="naive", pad=True):
    model = _model(seed=100 + dist.get_rank())   # different replicas: the broadcast repairs them
    cls, options = OPTIMIZERS[optimizer_name]
    optimizer = zero.ShardedOptimizer(model.parameters(), cls, **options) if sharded else cls(model.parameters(),
                                                                                               **options)
    log = training.train_data_parallel(model, optimizer, DATA, F.cross_entropy, batch_size=BATCH, epochs=2,
                                       pad=pad, allreduce=variant, record_parameters=True)
    shard = optimizer.shard_range if sharded else None
    return log, training.optimizer_state_bytes(optimizer), shard


def _every_optimizer(rank, world_size):
    runs = {}
    for name in OPTIMIZERS:
        runs[name, "plain"] = _train(name, sharded=False)
        runs[name, "zero"] = _train(name, sharded=True)
        runs[name, "plain ring"] = _train(name, sharded=False, variant="ring")
    runs["adam", "plain uneven"] = _train("adam", sharded=False, pad=False)
    runs["adam", "zero uneven"] = _train("adam", sharded=True, pad=False)
    return runs


def _one_process(optimizer_name, world_size):
    model = _model()
    cls, options = OPTIMIZERS[optimizer_name]
    batches = sum((sharding.global_batches(N_SAMPLES, world_size, BATCH, epoch=e) for e in range(2)), [])
    return training.train_single_process(model, cls(model.parameters(), **options), DATA, F.cross_entropy,
                                         batches=batches, record_parameters=True)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_sharded_optimizer_equals_plain_data_parallelism(world_size):
    ranks = run(_every_optimizer, world_size, timeout=120)
    numel = sum(p.numel() for p in _model().parameters())
    assert numel == 1181 and all(numel % g for g in range(2, 5))
    steps = 2 * sharding.steps_per_epoch(N_SAMPLES, world_size, BATCH)
    piece = math.ceil(numel / world_size)
    for name in OPTIMIZERS:
        plain, sharded = ranks[0][name, "plain"][0], ranks[0][name, "zero"][0]
        assert len(sharded.parameters) == steps + 1
        assert step_difference(sharded.parameters, plain.parameters) is None, f"{name}: ZeRO differs from plain DP"
        assert sharded.losses == plain.losses
        assert step_difference(sharded.parameters, ranks[0][name, "plain ring"][0].parameters, tol=2e-5) is None
        assert step_difference(sharded.parameters, _one_process(name, world_size).parameters, tol=2e-5) is None
        assert (plain.parameters[-1] - plain.parameters[0]).abs().max() > 0.1   # a wrong step would show
        for r in ranks[1:]:
            assert step_difference(r[name, "zero"][0].parameters, sharded.parameters) is None, f"{name}: replicas drifted"

        # State: 1/G of the unsharded optimizer's on every rank, measured.
        unsharded_bytes = ranks[0][name, "plain"][1]
        assert all(r[name, "plain"][1] == unsharded_bytes for r in ranks)
        for r in ranks:
            share = r[name, "zero"][1] / (unsharded_bytes / world_size)
            assert abs(share - 1) <= 0.05, f"{name}: rank state {r[name, 'zero'][1]} B vs {unsharded_bytes} B / G"
        # The shards tile the flat vector as torch.tensor_split does.
        split = torch.tensor_split(torch.arange(numel), world_size)
        assert [r[name, "zero"][2] for r in ranks] == [(int(s[0]), int(s[-1]) + 1) for s in split]

        # Reduce-scatter of pieces of P + 2 elements, all-gather of pieces of P, P = ceil(N / G).
        expected = steps * (world_size - 1) * ((piece + 2) + piece) * 4
        assert all(r[name, "zero"][0].bytes_sent == expected for r in ranks)

    uneven, uneven_plain = ranks[0]["adam", "zero uneven"][0], ranks[0]["adam", "plain uneven"][0]
    assert step_difference(uneven.parameters, uneven_plain.parameters) is None


def _plain_loop(rank, world_size, sharded):
    """No trainer: backward, then step(); the sharded optimizer averages the gradients itself."""
    model = _model(seed=7)
    optimizer = (zero.ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=0.01) if sharded
                 else torch.optim.Adam(model.parameters(), lr=0.01))
    inputs, labels = DATA
    for step in range(5):
        optimizer.zero_grad()
        rows = slice((step * world_size + rank) * BATCH, (step * world_size + rank + 1) * BATCH)
        F.cross_entropy(model(inputs[rows]), labels[rows]).backward()
        if not sharded:
            for p in model.parameters():
                dist.all_reduce(p.grad)          # the oracle: torch's own all-reduce
                p.grad /= world_size
        optimizer.step()
    return training.flat_parameters(model)


def test_sharded_optimizer_in_a_plain_loop_equals_builtin_allreduce_and_adam():
    world_size = 3
    sharded = run(_plain_loop, world_size, True)
    plain = run(_plain_loop, world_size, False)
    assert all(torch.equal(p, sharded[0]) for p in sharded)
    assert (sharded[0] - plain[0]).abs().max() < 1e-6
    assert (sharded[0] - training.flat_parameters(_model(seed=7))).abs().max() > 1e-3


def _bad_inputs(rank, world_size):
    model = _model()
    errors = {}

    def attempt(name, make):
        try:
            make()
            errors[name] = "no error"
        except Exception as exc:  # noqa: BLE001
            errors[name] = f"{type(exc).__name__}: {exc}"

    attempt("instance", lambda: zero.ShardedOptimizer(model.parameters(), torch.optim.SGD(model.parameters(), lr=1)))
    attempt("empty", lambda: zero.ShardedOptimizer([], torch.optim.SGD, lr=1))
    attempt("groups", lambda: zero.ShardedOptimizer([{"params": model.parameters()}], torch.optim.SGD, lr=1))
    mixed = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))]
    attempt("mixed dtypes", lambda: zero.ShardedOptimizer(mixed, torch.optim.SGD, lr=1))
    other = _model() if rank == 0 else toy.make_mlp(hidden=HIDDEN + 1)
    attempt("different models", lambda: zero.ShardedOptimizer(other.parameters(), torch.optim.SGD, lr=1))
    optimizer = zero.ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=1)
    attempt("closure", lambda: optimizer.step(lambda: 0.0))
    attempt("overlap", lambda: training.train_data_parallel(model, optimizer, DATA, F.cross_entropy, batch_size=8,
                                                            overlap=True))
    return errors


def test_bad_inputs_fail_clearly_on_every_rank():
    for errors in run(_bad_inputs, 2, timeout=60):
        assert errors["instance"].startswith("TypeError: optimizer_class must be a torch.optim.Optimizer class")
        assert errors["empty"].startswith("ValueError: ShardedOptimizer got no parameters")
        assert errors["groups"].startswith("TypeError: ShardedOptimizer takes one list of parameters, not parameter "
                                           "groups")
        assert errors["mixed dtypes"].startswith("ValueError: all parameters must share one dtype and device")
        assert errors["different models"].startswith("MismatchError: ShardedOptimizer: the ranks disagree about "
                                                     "numel: rank 0: 1181 parameter elements; rank 1: 1251 parameter elements")
        assert errors["closure"].startswith("NotImplementedError: ShardedOptimizer.step takes no closure")
        assert errors["overlap"].startswith("ValueError: a ShardedOptimizer reduce-scatters the whole gradient")
    with pytest.raises(RuntimeError, match="create it inside a function started by course_lib.launch"):
        zero.ShardedOptimizer(_model().parameters(), torch.optim.SGD, lr=1)


def test_optimizer_state_bytes_counts_the_state_tensors():
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    assert training.optimizer_state_bytes(optimizer) == 0          # Adam makes its state at the first step
    F.cross_entropy(model(DATA[0][:8]), DATA[1][:8]).backward()
    optimizer.step()
    n_params = len(list(model.parameters()))
    # exp_avg and exp_avg_sq (float32, one per element) and a 1-element float32 step per parameter.
    assert training.optimizer_state_bytes(optimizer) == 2 * 4 * 1181 + 4 * n_params
