"""course_lib.training against its oracles: DistributedSampler, one-process training, torch DDP.

* sharding: every rank's indices equal `DistributedSampler`'s, for dataset lengths that do and do
  not divide by the world size, with and without drop_last and shuffling, in several epochs.
* data parallel: after k steps (two epochs, so the uneven last batch and a reshuffle are included)
  the hand-made trainer on N = 1..4 ranks, a single process on the same global batches, and torch
  DDP (gloo) hold the same parameters step for step; the N replicas are bit-identical at every step.
  With uneven shards (pad=False), N ranks with batch B equal one process with batch N x B.
* DDP communication hook: DDP with course_lib's ring ends where DDP with its own all-reduce ends,
  and the ring's traffic inside DDP is what the ring must send for those buckets.
* parameter server: sync mode equals data-parallel SGD; async staleness is recorded for every
  update and never exceeds the bound the test sets; the loss goes down; every run terminates.
* model parallel: stages on N ranks give the one-process model's losses and parameters.
* the torchrun example runs and prints the loss that train_ddp computes for the same settings.
* mistakes (a per-sample loss, a one-rank parameter server, too many stages) fail with a clear message.

A 203-sample data set (203 = 7 x 29) does not divide by 2, 3 or 4. Every launch has a timeout, so a
hang fails within it instead of blocking the suite.
"""

from __future__ import annotations

import itertools
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

import course_lib
from conftest import ring_elements_sent, run
from course_lib import allreduce, traffic, training
from course_lib.training import sharding, toy

ROOT = pathlib.Path(__file__).resolve().parent.parent
N_SAMPLES, BATCH, LR, MOMENTUM = 203, 8, 0.2, 0.9
DATA = toy.make_spirals(N_SAMPLES, seed=3)


@pytest.fixture(autouse=True)
def _one_thread():
    """The one-process references train tiny models: one thread is fastest, and on a busy machine
    several OpenMP threads spinning against each other made them 30x slower. Restored afterwards."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def _optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def _max_gap(a_list, b_list):
    assert len(a_list) == len(b_list), (len(a_list), len(b_list))
    return max((a - b).abs().max().item() for a, b in zip(a_list, b_list))


# --------------------------------------------------------------------------------------------------
# Sharding
# --------------------------------------------------------------------------------------------------


def test_shard_indices_equal_distributed_sampler():
    cases = itertools.product([1, 2, 3, 5, 10, 13, 203], range(1, 6), [False, True], [False, True], [0, 3])
    for n, world_size, drop_last, shuffle, epoch in cases:
        for rank in range(world_size):
            sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=shuffle,
                                         seed=11, drop_last=drop_last)
            sampler.set_epoch(epoch)
            mine = sharding.shard_indices(n, rank, world_size, shuffle=shuffle, seed=11, epoch=epoch,
                                          drop_last=drop_last)
            assert mine == list(sampler), (n, world_size, rank, drop_last, shuffle, epoch)


def test_global_batches_are_the_union_of_the_ranks_batches():
    for n, world_size, batch, drop_last, pad in itertools.product([7, 10, 13, 203], [1, 2, 3, 4], [1, 3, 8],
                                                                  [False, True], [False, True]):
        per_rank = [sharding.split_batches(sharding.shard_indices(n, r, world_size, epoch=1, drop_last=drop_last,
                                                                  pad=pad), batch) for r in range(world_size)]
        steps = sharding.steps_per_epoch(n, world_size, batch, drop_last=drop_last, pad=pad)
        union = [sorted(i for r in range(world_size) if k < len(per_rank[r]) for i in per_rank[r][k])
                 for k in range(steps)]
        expected = sharding.global_batches(n, world_size, batch, epoch=1, drop_last=drop_last, pad=pad)
        assert union == [sorted(b) for b in expected], (n, world_size, batch, drop_last, pad)
    # Without padding every sample is seen exactly once per epoch; with it, some twice.
    assert sorted(sum(sharding.global_batches(10, 4, 2, pad=False), [])) == list(range(10))
    assert len(sum(sharding.global_batches(10, 4, 2), [])) == 12


# --------------------------------------------------------------------------------------------------
# Data parallel == one process == torch DDP
# --------------------------------------------------------------------------------------------------


def _hand_made(rank, world_size, pad, variant, epochs=2):
    model = toy.make_mlp(seed=100 + rank)     # different replicas on purpose: the broadcast must fix them
    return training.train_data_parallel(model, _optimizer(model), DATA, F.cross_entropy, batch_size=BATCH,
                                        epochs=epochs, pad=pad, allreduce=variant, record_parameters=True)


def _torch_ddp(rank, world_size, hook_variant=None, bucket_cap_mb=None, epochs=2):
    model = toy.make_mlp(seed=100)
    state = training.CommHookState(hook_variant) if hook_variant else None
    with traffic.record() as recording:
        log = training.train_ddp(model, _optimizer(model), DATA, F.cross_entropy, batch_size=BATCH, epochs=epochs,
                                 comm_hook=state, bucket_cap_mb=bucket_cap_mb, record_parameters=True)
    return log, state, recording


def _one_process(batches):
    model = toy.make_mlp(seed=100)
    return training.train_single_process(model, _optimizer(model), DATA, F.cross_entropy, batches=batches,
                                         record_parameters=True)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_data_parallel_equals_one_process_and_torch_ddp(world_size):
    hand = run(_hand_made, world_size, True, "ring")
    ddp = [log for log, _, _ in run(_torch_ddp, world_size)]
    batches = sum((sharding.global_batches(N_SAMPLES, world_size, BATCH, epoch=e) for e in range(2)), [])
    single = _one_process(batches)

    steps = 2 * sharding.steps_per_epoch(N_SAMPLES, world_size, BATCH)
    assert len(hand[0].losses) == len(single.losses) == len(ddp[0].losses) == steps
    for log in hand[1:]:   # the replicas are bit-identical after every step
        assert all(torch.equal(a, b) for a, b in zip(log.parameters, hand[0].parameters)), f"rank {log.rank} drifted"
    assert _max_gap(hand[0].parameters, single.parameters) < 2e-5
    assert _max_gap(hand[0].parameters, ddp[0].parameters) < 2e-5
    assert hand[0].samples == single.samples == ddp[0].samples
    torch.testing.assert_close(torch.tensor(hand[0].losses), torch.tensor(ddp[0].losses), rtol=1e-5, atol=1e-5)
    # Enough happened that a wrong step would show: the parameters moved far from where they started.
    assert (single.parameters[-1] - single.parameters[0]).abs().max() > 0.1


@pytest.mark.parametrize("world_size,variant", [(2, "ring"), (3, "naive"), (4, "parameter_server")])
def test_uneven_shards_equal_one_process_with_the_full_batch(world_size, variant):
    hand = run(_hand_made, world_size, False, variant)
    model = toy.make_mlp(seed=100)
    single = training.train_single_process(model, _optimizer(model), DATA, F.cross_entropy,
                                           batch_size=world_size * BATCH, epochs=2, record_parameters=True)
    # The last step really is uneven: the ranks hold different numbers of samples ...
    assert len({log.local_samples[-1] for log in hand}) > 1
    # ... and still N ranks with batch B == 1 process with batch N x B, every sample once per epoch.
    assert hand[0].samples == single.samples and sum(single.samples) == 2 * N_SAMPLES
    assert _max_gap(hand[0].parameters, single.parameters) < 2e-5
    assert all(torch.equal(log.parameters[-1], hand[0].parameters[-1]) for log in hand)


def _count_checks(rank, world_size, allreduce_arg, hook):
    from course_lib import runtime
    from course_lib.training import compression

    shared = []
    original = runtime._share
    runtime._share = lambda row, g: shared.append(g) or original(row, g)      # every cross-rank check passes here
    model = toy.make_mlp(seed=100)
    comm = dict(comm_hook=compression.low_precision_hook, comm_hook_state=compression.LowPrecisionState()) if hook \
        else {}
    training.train_data_parallel(model, _optimizer(model), DATA, F.cross_entropy, batch_size=BATCH, max_steps=5,
                                 allreduce=allreduce_arg, **comm)
    runtime._share = original
    return len(shared), training.flat_parameters(model)


@pytest.mark.parametrize("hook", [False, True])
def test_a_named_all_reduce_is_checked_on_the_first_training_step_only_and_a_function_on_every_step(hook):
    named = run(_count_checks, 3, "parameter_server", hook)
    function = run(_count_checks, 3, lambda tensor, op: allreduce.parameter_server(tensor, op), hook)
    # the checked broadcast of the parameters, then the gradients' (or the loss sum's) all-reduce once or 5 times
    assert [n for n, _ in named] == [2] * 3 and [n for n, _ in function] == [6] * 3
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(named, function))


# --------------------------------------------------------------------------------------------------
# course_lib's ring inside DDP
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [3, 4])
def test_ddp_comm_hook_with_course_lib_ring_gives_ddps_result(world_size):
    builtin = run(_torch_ddp, world_size, None, 0.001, 1)
    hooked = run(_torch_ddp, world_size, "ring", 0.001, 1)
    n_params = sum(p.numel() for p in toy.make_mlp().parameters())
    steps = len(builtin[0][0].losses)
    assert _max_gap(builtin[0][0].parameters, hooked[0][0].parameters) < 1e-5
    for log, state, recording in hooked:
        # A 1 KB bucket cap cuts the gradients into several buckets, each reduced by the ring.
        assert len(state.bucket_sizes) > steps and sum(state.bucket_sizes) == steps * n_params
        assert recording.elements_sent == ring_elements_sent(state.bucket_sizes, log.rank, world_size)
        assert torch.equal(log.parameters[-1], hooked[0][0].parameters[-1])
    assert all(recording.elements_sent == 0 for _, _, recording in builtin)  # DDP's own all-reduce: untraced


# --------------------------------------------------------------------------------------------------
# Parameter server
# --------------------------------------------------------------------------------------------------


def _parameter_server(rank, world_size, mode, max_staleness, delays, epochs=2):
    model = toy.make_mlp(seed=100)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    return training.train_parameter_server(model, optimizer, DATA, F.cross_entropy, batch_size=BATCH, epochs=epochs,
                                           mode=mode, max_staleness=max_staleness, worker_delays=delays)


def test_sync_parameter_server_is_data_parallel_sgd():
    world_size = 4
    server, *workers = run(_parameter_server, world_size, "sync", None, None)
    model = toy.make_mlp(seed=100)
    batches = sum((sharding.global_batches(N_SAMPLES, world_size - 1, BATCH, epoch=e) for e in range(2)), [])
    single = training.train_single_process(model, torch.optim.SGD(model.parameters(), lr=LR), DATA,
                                           F.cross_entropy, batches=batches)
    assert server.staleness == [0] * len(batches) and server.updates == len(batches)
    assert (server.parameters - training.flat_parameters(model)).abs().max() < 2e-5
    assert all(w.rejected == 0 and w.accepted == len(batches) for w in workers)


@pytest.mark.parametrize("bound", [0, 2])
def test_async_parameter_server_staleness_is_recorded_and_bounded(bound):
    world_size = 4
    delays = [0.0, 0.004, 0.0, 0.0]   # rank 1 is a straggler, so gradients do go stale
    server, *workers = run(_parameter_server, world_size, "async", bound, delays)
    updates = (world_size - 1) * 2 * sharding.steps_per_epoch(N_SAMPLES, world_size - 1, BATCH)
    assert server.updates == len(server.worker) == updates        # as many as the sync run has gradients
    assert max(server.staleness) <= bound and min(server.staleness) >= 0
    assert sum(w.accepted for w in workers) == updates
    for w in workers:   # every push was answered, accepted or refused, and the books agree
        assert w.accepted == server.worker.count(w.rank) and w.rejected == server.rejected[w.rank]
        assert server.pushes[w.rank] == w.accepted + w.rejected == len(w.versions)
    # Which pushes are refused depends on the machine's timing, and with it how far training gets in a fixed
    # number of updates (0.70 of the initial loss on a quiet machine, 0.95 once at a load of 10-17): what holds
    # whatever the timing is that bounded staleness still makes progress.
    assert server.loss[-1] < server.initial_loss


def test_async_parameter_server_unbounded_lets_gradients_go_stale():
    server, straggler, fast = run(_parameter_server, 3, "async", None, [0.0, 0.02, 0.0], 1)
    assert sum(server.rejected.values()) == 0
    # The fast worker applies several updates while the straggler computes one gradient ...
    stale = [s for s, w in zip(server.staleness, server.worker) if w == 1]
    assert stale and max(stale) >= 2, server.staleness
    # ... and, nobody waiting for anybody, contributes most of the updates.
    assert fast.accepted > straggler.accepted
    assert server.loss[-1] < server.initial_loss


def test_stale_sgd_simulation_is_plain_sgd_without_staleness():
    model = toy.make_mlp(seed=5)
    losses = training.simulate_stale_sgd(model, DATA, F.cross_entropy, lr=LR, batch_size=BATCH, steps=10, staleness=0)
    reference = toy.make_mlp(seed=5)
    order = sharding.epoch_order(N_SAMPLES, 1, seed=0)
    ref = training.train_single_process(reference, torch.optim.SGD(reference.parameters(), lr=LR), DATA,
                                        F.cross_entropy, batches=sharding.split_batches(order, BATCH)[:10])
    assert len(losses) == 11 and len(ref.losses) == 10
    assert (training.flat_parameters(model) - training.flat_parameters(reference)).abs().max() < 1e-6
    stale = training.simulate_stale_sgd(toy.make_mlp(seed=5), DATA, F.cross_entropy, lr=LR, batch_size=BATCH,
                                        steps=10, staleness=3)
    assert stale[:2] == losses[:2] and stale != losses  # the first step is never stale; later ones are


# --------------------------------------------------------------------------------------------------
# Model parallel
# --------------------------------------------------------------------------------------------------


def _model_parallel(rank, world_size):
    stage = training.split_sequential(toy.make_mlp(depth=3, seed=100), world_size)[rank]
    optimizer = torch.optim.SGD(stage.parameters(), lr=LR) if list(stage.parameters()) else None
    return training.train_model_parallel(stage, optimizer, DATA, F.cross_entropy, batch_size=32, epochs=2,
                                         record_parameters=True)


@pytest.mark.parametrize("world_size", [2, 3])
def test_model_parallel_equals_the_model_on_one_process(world_size):
    stages = run(_model_parallel, world_size)
    model = toy.make_mlp(depth=3, seed=100)
    single = training.train_single_process(model, torch.optim.SGD(model.parameters(), lr=LR), DATA, F.cross_entropy,
                                           batch_size=32, epochs=2, record_parameters=True)
    joined = [torch.cat([s.parameters[k] for s in stages]) for k in range(len(single.parameters))]
    assert _max_gap(joined, single.parameters) < 1e-6
    torch.testing.assert_close(torch.tensor(stages[-1].losses), torch.tensor(single.losses))
    assert all(not s.losses for s in stages[:-1])
    # Activations go forward and gradients come back: batch x hidden numbers per boundary per step.
    moved = sum(single.samples) * 32   # 32 hidden units
    assert stages[0].activation_elements_sent == moved and stages[0].gradient_elements_sent == 0
    assert stages[-1].gradient_elements_sent == moved and stages[-1].activation_elements_sent == 0


# --------------------------------------------------------------------------------------------------
# Failing fast, and the torchrun example
# --------------------------------------------------------------------------------------------------


def _bad_loss(rank, world_size):
    model = toy.make_mlp()
    return training.train_data_parallel(model, _optimizer(model), DATA, lambda out, y: F.cross_entropy(
        out, y, reduction="none"), batch_size=BATCH, max_steps=1)


def test_clear_errors():
    with pytest.raises(course_lib.RankFailedError, match="loss_fn must return one number"):
        run(_bad_loss, 2, timeout=30)
    with pytest.raises(course_lib.RankFailedError, match="at least 2 ranks"):
        run(_parameter_server, 1, "async", None, None, timeout=30)
    with pytest.raises(ValueError, match="cannot split 5 layers into 6"):
        training.split_sequential(toy.make_mlp(), 6)


def _ddp_like_the_example(rank, world_size, max_steps):
    model = toy.make_mlp(seed=0)
    data = toy.make_spirals(600, seed=1)
    log = training.train_ddp(model, torch.optim.SGD(model.parameters(), lr=0.2), data, F.cross_entropy,
                             batch_size=16, epochs=3, max_steps=max_steps)
    return log


def test_torchrun_example_runs_and_matches_train_ddp():
    steps = 12
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(ROOT / "examples" / "train_ddp_torchrun.py"), "--max-steps", str(steps), "--comm-hook", "ring"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"trained on 2 ranks, {steps} training steps, comm hook: ring" in done.stdout, done.stdout
    assert "parameters identical on all 2 ranks: True" in done.stdout
    printed = float(re.search(r"final loss (\d+\.\d+)", done.stdout).group(1))
    log = run(_ddp_like_the_example, 2, steps)[0]
    # The script's last epoch is the first one here (12 steps < 19 per epoch): the same mean loss.
    assert len(log.epoch_losses) == 1 and printed == pytest.approx(log.epoch_losses[0], abs=6e-5)

