"""Gradient buckets all-reduced during backward (train_data_parallel(overlap=True)) against its oracles.

* Same parameters step for step as today's trainer (one all-reduce after backward) and as one
  process on the same global batches, for 1 to 4 ranks, two epochs (uneven last batch and a
  reshuffle included), and with uneven shards (pad=False: on 4 ranks one rank has no sample in the
  last step and joins with a zero gradient):
    - 'naive' all-reduce: bit-identical to today's trainer (every element summed in rank order);
    - 'ring': within float tolerance (chunk boundaries move with the buckets, so does the summation
      order), and bit-identical with one bucket (then the buffer is today's);
  the replicas are bit-identical on every rank after every step.
* Every bucket is all-reduced exactly once per step, in index order, on every rank: a counting
  all-reduce sees exactly the plan's bucket sizes, and the traffic per bucket is the ring's.
* Overlap is real: with a layer whose backward sleeps, the later layers' buckets start before
  backward ends; without overlap no bucket starts before it ends.
* Hooks are removed and the communication thread is gone afterwards, also after a failed step.
* Bad arguments, and ranks that disagree about the buckets, fail with a clear error.

The model is toy.make_mlp (1251 parameters); buckets of 200 bytes cut it into 3 buckets.
"""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import course_lib
from conftest import ring_elements_sent, run, step_difference
from course_lib import allreduce, training
from course_lib.training import buckets as buckets_module
from course_lib.training import sharding, toy

N_SAMPLES, BATCH, LR, MOMENTUM = 203, 8, 0.2, 0.9
DATA = toy.make_spirals(N_SAMPLES, seed=3)
SMALL_BUCKETS_MB = 200 / buckets_module.MIB      # 3 buckets for make_mlp()
THREAD = buckets_module._THREAD_NAME


@pytest.fixture(autouse=True)
def _one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def _hooks_left(model):
    """Post-accumulate-grad hooks still registered on the model's parameters."""
    for p in model.parameters():
        assert hasattr(p, "_post_accumulate_grad_hooks"), "torch moved its hook registry: update this test"
    return sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())


def _comm_threads():
    return [t.name for t in threading.enumerate() if t.name == THREAD]


def _counting(calls, variant="ring"):
    """A course_lib all-reduce that remembers the size of every tensor it was given."""

    def counted(tensor, op):
        calls.append(tensor.numel())
        allreduce.get(variant)(tensor, op)

    return counted


def _train(variant, pad=True, batch=BATCH, **options):
    model = toy.make_mlp(seed=100 + torch.distributed.get_rank())   # the broadcast must repair this
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    log = training.train_data_parallel(model, optimizer, DATA, F.cross_entropy, batch_size=batch, epochs=2, pad=pad,
                                       allreduce=variant, record_parameters=True, **options)
    return log, _hooks_left(model)


def _every_trainer(rank, world_size):
    """One launch per world size: today's trainer and the bucketed ones, side by side."""
    calls = []
    runs = {
        "today naive": _train("naive"),
        "overlap naive": _train("naive", overlap=True, bucket_mb=SMALL_BUCKETS_MB),
        "after naive": _train("naive", overlap=False, bucket_mb=SMALL_BUCKETS_MB),
        "today ring": _train("ring"),
        "overlap ring": _train(_counting(calls), overlap=True, bucket_mb=SMALL_BUCKETS_MB),
        "overlap ring, one bucket": _train("ring", overlap=True, bucket_mb=math.inf),
        "today naive uneven": _train("naive", pad=False, batch=10),
        "overlap naive uneven": _train("naive", pad=False, batch=10, overlap=True, bucket_mb=SMALL_BUCKETS_MB),
    }
    return {"runs": runs, "calls": calls, "threads": _comm_threads()}


def _one_process(world_size):
    model = toy.make_mlp(seed=100)
    batches = sum((sharding.global_batches(N_SAMPLES, world_size, BATCH, epoch=e) for e in range(2)), [])
    return training.train_single_process(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
                                         DATA, F.cross_entropy, batches=batches, record_parameters=True)


def _one_process_full_batch(world_size, batch):
    model = toy.make_mlp(seed=100)
    return training.train_single_process(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
                                         DATA, F.cross_entropy, batch_size=world_size * batch, epochs=2,
                                         record_parameters=True)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_overlap_equals_todays_trainer_and_one_process(world_size):
    ranks = run(_every_trainer, world_size, timeout=120)
    logs = {name: [r["runs"][name][0] for r in ranks] for name in ranks[0]["runs"]}
    single = _one_process(world_size)
    steps = 2 * sharding.steps_per_epoch(N_SAMPLES, world_size, BATCH)
    plan = training.plan_buckets(list(toy.make_mlp().parameters()), SMALL_BUCKETS_MB * buckets_module.MIB)
    assert len(plan) == 3

    for name, per_rank in logs.items():
        assert all(hooks == 0 for _, hooks in [r["runs"][name] for r in ranks]), f"{name}: hooks left behind"
        for log in per_rank[1:]:    # replicas bit-identical after every step
            assert step_difference(log.parameters, per_rank[0].parameters) is None, \
                f"{name}: rank {log.rank} drifted from rank 0"
    assert all(not r["threads"] for r in ranks), "a communication thread outlived its training"

    today, overlap, after = logs["today naive"][0], logs["overlap naive"][0], logs["after naive"][0]
    assert len(today.parameters) == steps + 1
    for other in (overlap, after):   # naive: every element summed in rank order, whatever the bucket
        assert step_difference(other.parameters, today.parameters) is None
        assert other.losses == today.losses and other.samples == today.samples
    ring_today, ring_overlap = logs["today ring"][0], logs["overlap ring"][0]
    assert step_difference(ring_overlap.parameters, ring_today.parameters, tol=2e-5) is None
    one_bucket = logs["overlap ring, one bucket"][0]
    assert step_difference(one_bucket.parameters, ring_today.parameters) is None
    assert step_difference(overlap.parameters, single.parameters, tol=2e-5) is None
    assert step_difference(ring_overlap.parameters, single.parameters, tol=2e-5) is None
    assert (single.parameters[-1] - single.parameters[0]).abs().max() > 0.1   # a wrong step would show

    # Uneven shards: N ranks with batch B == one process with batch N x B; on 4 ranks one rank sat out.
    uneven, uneven_today = logs["overlap naive uneven"], logs["today naive uneven"][0]
    assert step_difference(uneven[0].parameters, uneven_today.parameters) is None
    assert step_difference(uneven[0].parameters, _one_process_full_batch(world_size, 10).parameters, tol=2e-5) is None
    if world_size == 4:
        assert [log.local_samples[-1] for log in uneven] == [1, 1, 1, 0]

    # Every bucket exactly once per step, in index order, and the same sizes on every rank.
    for r in ranks:
        assert r["calls"] == [b.numel for b in plan] * steps, f"rank {ranks.index(r)} reduced other buckets"
    for name in ("overlap naive", "after naive", "overlap ring"):
        for log in logs[name]:
            assert len(log.timeline) == steps
            for t in log.timeline:
                assert [b.bucket for b in t.buckets] == [0, 1, 2]
                assert [b.numel for b in t.buckets] == [b.numel for b in plan]
                for b, following in zip(t.buckets, t.buckets[1:]):   # one thread: one bucket after the other
                    assert b.ready <= b.start <= b.end <= following.start
    for log in logs["overlap ring"]:
        for t in log.timeline:
            assert [b.bytes_sent // 4 for b in t.buckets] == [ring_elements_sent([b.numel], log.rank, world_size)
                                                             for b in plan]
        assert log.bytes_sent == steps * sum(b.bytes_sent for b in log.timeline[0].buckets)
    assert len(logs["today ring"][0].timeline[0].buckets) == 1


class HeadRegisteredFirst(nn.Module):
    """make_mlp's layers with the head registered first. The buckets follow registration order
    backwards, so the head lands in the last bucket, yet backward completes its gradient first:
    that bucket must wait until buckets 0, 1, ... have been launched."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(100)
        self.head = nn.Linear(32, 3)
        self.body = nn.Sequential(nn.Linear(2, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())

    def forward(self, x):
        return self.head(self.body(x))


def _out_of_order(rank, world_size):
    runs, calls = {}, []
    for name, options in [("today", {"allreduce": "naive"}),
                          ("overlap", {"allreduce": _counting(calls, "naive"), "overlap": True,
                                       "bucket_mb": SMALL_BUCKETS_MB})]:
        model = HeadRegisteredFirst()
        # batch 25 without padding: on 4 ranks the last rank has no sample in the last step, so its
        # buckets are all complete at once while the others complete them in autograd's order.
        runs[name] = training.train_data_parallel(model, torch.optim.SGD(model.parameters(), lr=LR), DATA,
                                                  F.cross_entropy, batch_size=25, epochs=1, pad=False,
                                                  record_parameters=True, **options)
    return runs, calls


def test_buckets_launch_in_index_order_when_gradients_arrive_in_another():
    world_size = 4
    ranks = run(_out_of_order, world_size, timeout=60)
    plan = training.plan_buckets(list(HeadRegisteredFirst().parameters()), SMALL_BUCKETS_MB * buckets_module.MIB)
    assert plan[-1].params == (0, 1)    # the head: its gradient is complete first, its bucket goes last
    assert [runs["overlap"].local_samples[-1] for runs, _ in ranks] == [1, 1, 1, 0]
    for runs, calls in ranks:
        assert calls == [b.numel for b in plan] * len(runs["overlap"].losses)
        assert step_difference(runs["overlap"].parameters, runs["today"].parameters) is None
        for t in runs["overlap"].timeline:
            assert [b.bucket for b in t.buckets] == list(range(len(plan)))
            readies = [b.ready for b in t.buckets]
            assert readies == sorted(readies)


# --------------------------------------------------------------------------------------------------
# The all-reduce really runs during backward
# --------------------------------------------------------------------------------------------------


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class SlowBackward(nn.Module):
    """Identity forward; its backward sleeps, like an expensive early layer."""

    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        return _Sleep.apply(x, self.seconds)


SLEEP = 0.3


def _slow_model_timelines(rank, world_size):
    out = {}
    for overlap in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(2, 32), SlowBackward(SLEEP), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                              nn.Linear(32, 3))
        log = training.train_data_parallel(model, torch.optim.SGD(model.parameters(), lr=LR), DATA, F.cross_entropy,
                                           batch_size=BATCH, max_steps=3, overlap=overlap, bucket_mb=SMALL_BUCKETS_MB)
        out[overlap] = log.timeline
    return out


def test_buckets_of_later_layers_are_reduced_while_backward_still_runs():
    for timelines in run(_slow_model_timelines, 2, timeout=60):
        for t in timelines[True]:
            first, second, last = t.buckets   # head, middle layer, first layer (behind the sleep)
            assert t.backward >= SLEEP
            assert first.start < t.backward and second.start < t.backward, t
            assert last.ready >= SLEEP
            assert t.exposed_communication < t.communication_done
        for t in timelines[False]:
            assert all(b.start >= t.backward for b in t.buckets), t


# --------------------------------------------------------------------------------------------------
# Cleaning up after a failure, and bad input
# --------------------------------------------------------------------------------------------------


def _failing_runs(rank, world_size):
    out = {}

    def fails_in_bucket_1_of_the_second_step(calls=[]):   # noqa: B006 - the counter is the point
        def reduce(tensor, op):
            calls.append(tensor.numel())
            if len(calls) == 3 + 2:
                raise ValueError("planted failure in bucket 1 of the second step")
            allreduce.ring(tensor, op)
        return reduce

    def loss_fails_in_the_fourth_step(calls=[]):   # noqa: B006
        def loss(out, y):
            calls.append(1)
            if len(calls) == 4:
                raise ArithmeticError("planted failure in the loss of the fourth step")
            return F.cross_entropy(out, y)
        return loss

    for name, allreduce_fn, loss_fn in [("comm", fails_in_bucket_1_of_the_second_step(), F.cross_entropy),
                                        ("loss", "ring", loss_fails_in_the_fourth_step())]:
        model = toy.make_mlp()
        try:
            training.train_data_parallel(model, torch.optim.SGD(model.parameters(), lr=LR), DATA, loss_fn,
                                         batch_size=BATCH, max_steps=6, allreduce=allreduce_fn, overlap=True,
                                         bucket_mb=SMALL_BUCKETS_MB)
            out[name] = "no error"
        except Exception as exc:  # noqa: BLE001
            out[name] = f"{type(exc).__name__}: {exc}"
        time.sleep(0.05)
        out[name + " hooks"], out[name + " threads"] = _hooks_left(model), _comm_threads()
    return out


def test_hooks_and_thread_are_gone_after_a_failed_step():
    for r in run(_failing_runs, 2, timeout=60):
        assert r["comm"].startswith("RuntimeError: the all-reduce of a gradient bucket failed on the "
                                    "communication thread") and "planted failure in bucket 1" in r["comm"]
        assert r["loss"] == "ArithmeticError: planted failure in the loss of the fourth step"
        assert r["comm hooks"] == r["loss hooks"] == 0
        assert r["comm threads"] == r["loss threads"] == []


def _bad_arguments(rank, world_size):
    model = toy.make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    cases = {
        "bucket_mb=0": dict(bucket_mb=0, overlap=True),
        "bucket_mb=-1": dict(bucket_mb=-1),
        "bucket_mb='4'": dict(bucket_mb="4", overlap=True),
        "overlap='yes'": dict(overlap="yes"),
        "allreduce=42": dict(allreduce=42, overlap=True),
        "allreduce='bogus'": dict(allreduce="bogus", overlap=True),
        "bucket_mb differs": dict(bucket_mb=SMALL_BUCKETS_MB if rank == 0 else 1.0, overlap=True),
        "overlap differs": dict(bucket_mb=1.0, overlap=rank == 0),
        "allreduce differs": dict(allreduce="ring" if rank == 0 else "naive", overlap=True),
    }
    errors = {}
    for name, options in cases.items():
        try:
            training.train_data_parallel(model, optimizer, DATA, F.cross_entropy, batch_size=BATCH, max_steps=1,
                                         **options)
            errors[name] = "no error"
        except Exception as exc:  # noqa: BLE001
            errors[name] = f"{type(exc).__name__}: {exc}"
    errors["hooks"] = _hooks_left(model)
    return errors


def test_bad_arguments_fail_with_a_clear_message():
    for errors in run(_bad_arguments, 2, timeout=60):
        assert "ValueError: bucket_mb must be a positive number of MiB" in errors["bucket_mb=0"]
        assert "ValueError: bucket_mb must be a positive number of MiB" in errors["bucket_mb=-1"]
        assert "ValueError: bucket_mb must be a positive number of MiB" in errors["bucket_mb='4'"]
        assert errors["overlap='yes'"] == "TypeError: overlap must be True or False, got 'yes'"
        assert errors["allreduce=42"].startswith("TypeError: allreduce must be a course_lib.allreduce variant's name")
        assert errors["allreduce='bogus'"].startswith("ValueError: unknown all-reduce variant 'bogus'")
        assert errors["bucket_mb differs"].startswith("MismatchError: train_data_parallel(bucket_mb=..., overlap=...):"
                                                      " the ranks disagree about number of buckets")
        assert "the ranks disagree about overlap: rank 0: 1; rank 1: 0" in errors["overlap differs"]
        assert "disagree about allreduce: rank 0: 'ring'; rank 1: 'naive'" in errors["allreduce differs"]
        assert errors["hooks"] == 0


def test_bucket_plan_walks_backwards_and_never_splits_a_parameter():
    params = list(toy.make_mlp().parameters())   # 64, 32, 1024, 32, 96, 3 elements
    sizes = [p.numel() for p in params]
    for cap in (1, 200, 600, 4100, 10**9, math.inf):
        plan = training.plan_buckets(params, cap)
        covered = [i for b in reversed(plan) for i in b.params]
        assert covered == list(range(len(params))), cap              # every parameter once, in order
        assert [b.index for b in plan] == list(range(len(plan)))
        assert plan[0].params[-1] == len(params) - 1                  # bucket 0 holds the last layer
        assert plan[0].numel == sum(sizes[i] for i in plan[0].params) + 2   # + loss sum and count
        for b in plan[:-1]:                                          # all but the last are full
            assert sum(sizes[i] for i in b.params) * 4 >= cap
            assert sum(sizes[i] for i in b.params[1:]) * 4 < cap
    assert len(training.plan_buckets(params, 1)) == len(params)
    assert len(training.plan_buckets(params, math.inf)) == 1
    with pytest.raises(ValueError, match="bucket size must be a positive number of bytes"):
        training.plan_buckets(params, 0)


def test_compute_delays_take_their_time_and_change_no_number():
    # training.ComputeDelay stands in for an accelerator's compute: its sleep must be where backward
    # makes a layer's gradient (before it), and the model's values and gradients must stay the same.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    delayed = training.with_compute_delays(plain, forward_s=0.002, backward_s=0.03)
    assert [type(m).__name__ for m in delayed] == ["Linear", "ComputeDelay", "ReLU", "Linear", "ComputeDelay"]
    assert list(delayed.parameters()) == list(plain.parameters())      # the same tensors, not copies
    x = torch.randn(4, 6)
    expected = [g.clone() for g in torch.autograd.grad(plain(x).square().sum(), list(plain.parameters()))]
    ready = {}
    for index, p in enumerate(delayed.parameters()):
        p.register_post_accumulate_grad_hook(lambda p, index=index: ready.update({index: time.perf_counter()}))
    start = time.perf_counter()
    out = delayed(x)
    assert time.perf_counter() - start >= 2 * 0.002
    assert torch.equal(out, plain(x))
    begin = time.perf_counter()
    out.square().sum().backward()
    assert time.perf_counter() - begin >= 2 * 0.03
    assert all(torch.equal(p.grad, g) for p, g in zip(delayed.parameters(), expected))
    # The last layer's gradients (indices 2, 3) are ready after one delay, the first layer's after two.
    assert min(ready[2], ready[3]) - begin >= 0.03 and min(ready[0], ready[1]) - begin >= 0.06
    with pytest.raises(ValueError, match="seconds >= 0"):
        training.ComputeDelay(-1, 0)
    with pytest.raises(TypeError, match="nn.Sequential"):
        training.with_compute_delays(nn.Linear(2, 2), 0, 0)
