"""Buffers follow DDP's rule (broadcast from rank 0 before every forward), in plain DP and every ZeRO stage.

The issue's reproduction: a small CNN of our own (Conv2d, ReLU, Linear), Adam, 3 ranks, 90 samples in
batches of 7, overlap on.

* Without batch normalisation the hand-made trainer equals one process on the same global batches
  (within 1e-6: the ring sums in another order than one process does).
* With a BatchNorm2d it cannot: each rank normalises by its own 7 samples. It must then equal torch's
  DDP, which broadcasts rank 0's buffers at every forward: the parameters within 1e-5 of DDP's after
  every step, the running statistics equal to DDP's and the same on every rank (rank 0's), while the
  gap to one process is large (> 1e-3). Rank 0 prints one line saying so (`batch_norm_note`), once,
  and no other rank prints it. Every ZeRO stage (zero.ShardedOptimizer and zero_sharded stages 0-3)
  keeps the same buffers as plain data parallelism, bit for bit against the naive all-reduce.
* The line says nn.SyncBatchNorm runs on GPUs only in PyTorch: checked, it refuses a CPU tensor.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import run, step_difference
from course_lib import training
from course_lib.training import sharding, zero, zero_sharded

N, BATCH, WORLD, EPOCHS = 90, 7, 3, 2


@pytest.fixture(autouse=True)
def _one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def _data():
    generator = torch.Generator().manual_seed(11)
    images = torch.randn(N, 1, 8, 8, generator=generator)
    labels = (images[:, 0, :4].sum(dim=(1, 2)) > images[:, 0, 4:].sum(dim=(1, 2))).long()
    return images, labels


def _cnn(batch_norm: bool, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    # Before a BatchNorm a convolution's bias has no effect (the mean is taken out), so its gradient is
    # rounding noise that Adam would scale up to full-size steps: it is left out, as usual.
    layers = [nn.Conv2d(1, 4, 3, bias=not batch_norm)] + ([nn.BatchNorm2d(4)] if batch_norm else []) + [
        nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2)]
    return nn.Sequential(*layers)


def _buffers(model):
    return torch.cat([b.detach().double().reshape(-1) for b in model.buffers()]) if any(True for _ in model.buffers()) \
        else torch.zeros(0)


def _hand_made(rank, world_size, batch_norm, allreduce="ring", overlap=True):
    model = _cnn(batch_norm, seed=rank)               # different replicas: the broadcast repairs them
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    options = {"overlap": True, "bucket_mb": 0.001} if overlap else {}
    entering = []                                     # the buffers every forward starts from
    model.register_forward_pre_hook(lambda module, args: entering.append(_buffers(module)))
    log = training.train_data_parallel(model, optimizer, _data(), F.cross_entropy, batch_size=BATCH, epochs=EPOCHS,
                                       allreduce=allreduce, record_parameters=True, **options)
    return log.parameters, _buffers(model), entering


def _ddp(rank, world_size):
    model = _cnn(True, seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    log = training.train_ddp(model, optimizer, _data(), F.cross_entropy, batch_size=BATCH, epochs=EPOCHS,
                             record_parameters=True)
    return log.parameters, _buffers(model)


def _one_process(batch_norm):
    model = _cnn(batch_norm, seed=0)
    batches = sum((sharding.global_batches(N, WORLD, BATCH, epoch=e) for e in range(EPOCHS)), [])
    log = training.train_single_process(model, torch.optim.Adam(model.parameters(), lr=0.01), _data(),
                                        F.cross_entropy, batches=batches, record_parameters=True)
    return log.parameters, _buffers(model)


def _gap(a, b):
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))


def test_without_batch_norm_the_trainer_equals_one_process(capfd):
    ranks = run(_hand_made, WORLD, False, timeout=90)
    single, _ = _one_process(False)
    assert all(b.numel() == 0 for b in ranks[0][2])
    assert len(ranks[0][0]) == len(single) == EPOCHS * 5 + 1          # 30 samples per rank: batches 7,7,7,7,2
    assert _gap(ranks[0][0], single) < 1e-6
    assert (single[-1] - single[0]).abs().max() > 0.05
    assert "BatchNorm" not in capfd.readouterr().out                  # no note for a model without one


def test_with_batch_norm_it_equals_ddp_and_says_why_it_differs_from_one_process(capfd):
    ranks = run(_hand_made, WORLD, True, timeout=90)
    out = capfd.readouterr().out
    ddp = run(_ddp, WORLD, timeout=90)
    single, single_buffers = _one_process(True)
    params, buffers, entering = ranks[0]
    assert _gap(params, ddp[0][0]) < 1e-5, "the hand-made trainer differs from DDP"
    assert len(entering) == EPOCHS * 5 and len({b.numel() for b in entering}) == 1
    for r in range(WORLD):
        # Every forward starts from rank 0's buffers; the forward itself then updates them with the rank's
        # own batch, so after the last one they differ between ranks, exactly as DDP's do.
        assert all(torch.equal(mine, first) for mine, first in zip(ranks[r][2], entering)), r
        assert torch.allclose(ranks[r][1], ddp[r][1], atol=1e-6, rtol=1e-6), f"rank {r}'s buffers differ from DDP's"
        assert torch.equal(ranks[r][0][-1], params[-1])
    assert not torch.equal(ranks[1][1], buffers)     # the last forward's own update: per rank
    assert _gap(params, single) > 1e-3             # per-rank batch statistics: not one process's step
    assert not torch.allclose(buffers, single_buffers, atol=1e-4)
    note = training.batch_norm_note(_cnn(True), BATCH, WORLD)
    assert note and "BatchNorm2d" in note and "SyncBatchNorm" in note and f"global batch's {WORLD * BATCH}" in note
    lines = [line for line in out.splitlines() if "SyncBatchNorm" in line]
    assert lines == [f"[rank 0] {note}"], out
    assert training.batch_norm_note(_cnn(False), BATCH, WORLD) is None
    assert training.batch_norm_note(_cnn(True), BATCH, 1) is None


def _every_stage_with_batch_norm(rank, world_size):
    out = {}
    for name in ("plain", "zero1 flat", 0, 1, 2, 3):
        model = _cnn(True, seed=rank)
        if name == "plain":
            optimizer, variant = torch.optim.Adam(model.parameters(), lr=0.01), "naive"
        elif name == "zero1 flat":
            optimizer, variant = zero.ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=0.01), "naive"
        else:
            optimizer = zero_sharded.ShardedDataParallel(model, torch.optim.Adam, stage=name, allreduce="naive",
                                                         lr=0.01)
            variant = "naive"
        log = training.train_data_parallel(model, optimizer, _data(), F.cross_entropy, batch_size=BATCH, epochs=1,
                                           allreduce=variant, record_parameters=True)
        out[name] = (log.parameters, _buffers(model))
    return out


def test_every_zero_stage_follows_the_same_rule_for_buffers():
    ranks = run(_every_stage_with_batch_norm, WORLD, timeout=120)
    for name in ("zero1 flat", 0, 1, 2, 3):
        for rank in range(WORLD):
            params, buffers = ranks[rank][name]
            plain_params, plain_buffers = ranks[rank]["plain"]
            assert step_difference(params, plain_params) is None, (name, rank)
            assert torch.equal(buffers, plain_buffers), (name, rank)     # rank 0's, then this rank's last batch


def _sync_batch_norm_on_cpu(rank, world_size):
    layer = nn.SyncBatchNorm(2)
    try:
        layer(torch.randn(4, 2))
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_sync_batch_norm_needs_a_gpu_as_the_note_says():
    assert all("expected input tensor to be on GPU" in message for message in run(_sync_batch_norm_on_cpu, 2))
