"""Gradient compression hooks (training.compression) against their formulas and PyTorch's own hooks.

* Bytes: for G = 1..6, every rank's bytes per step, read from its traffic recording, equal the
  formula of each hook (`low_precision_bytes`, `powersgd_bytes`, `topk_bytes`, `ring_bytes` before
  PowerSGD starts) on a model whose layers do not divide by G.
* Values: with random inputs that differ by rank and position, the bf16 and fp16 hooks are within
  their two roundings of the exact mean (u sum|x_r| / G + u |mean|, u = 2^-8 or 2^-11) and give the
  same bits on every rank; top-k equals the mean of every rank's k largest entries, recomputed from
  all ranks' inputs, and its error feedback keeps exactly what was not sent.
* PowerSGD against PyTorch's `powerSGD_hook`, both as DDP communication hooks on the same model and
  data (G = 3 and 4; rank 1, 2 and 4, so QR as well as Gram-Schmidt; with and without error feedback
  and warm start): the same all-reduce sizes in every step (PyTorch's counted by wrapping
  `dist.all_reduce`), our recorded bytes equal to the ring's for those sizes, and the parameters within
  1e-4 after every step (the two all-reduces sum in different orders; PowerSGD's power iteration
  carries those last bits on).
* The hand-made trainer with a hook equals DDP with the same hook (it hands the gradients over in
  DDP's bucket order), and PyTorch's own hooks run in it too.
* Summed in fp32, the fp16 hook stays at least as close to fp32 training as PyTorch's fp16_compress_hook
  (which sums in fp16), both in DDP, G = 4.
* Bad input fails with a clear message.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from conftest import make_input, run, step_difference
from course_lib import traffic, training
from course_lib.training import compression, toy

DATA = toy.make_spirals(97, seed=2)
BATCH = 6


@pytest.fixture(autouse=True)
def _one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def _model(seed=0):
    return toy.make_mlp(hidden=31, seed=seed)         # shapes (31, 2) (31) (31, 31) (31) (3, 31) (3)


NUMEL = 1181


def _hooks():
    return {"bf16": (compression.low_precision_hook, compression.LowPrecisionState()),
            "fp16": (compression.low_precision_hook, compression.LowPrecisionState(torch.float16)),
            "powersgd": (compression.powersgd_hook,
                         compression.PowerSGDState(matrix_approximation_rank=2, start_powerSGD_iter=2)),
            "topk": (compression.topk_hook, compression.TopKState(density=0.05))}


def _train_with_every_hook(rank, world_size):
    out = {}
    for name, (hook, state) in _hooks().items():
        model = _model(seed=rank)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        log = training.train_data_parallel(model, optimizer, DATA, F.cross_entropy, batch_size=BATCH, epochs=2, max_steps=4,
                                           comm_hook=hook, comm_hook_state=state, record_parameters=True)
        out[name] = ([t.buckets[0].bytes_sent for t in log.timeline], log.parameters[-1], log.losses)
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 6])
def test_bytes_per_step_equal_the_formulas(world_size):
    ranks = run(_train_with_every_hook, world_size, timeout=120)
    shapes = [tuple(p.shape) for p in _model().parameters()][::-1]
    numel = sum(math.prod(s) for s in shapes)
    for rank, out in enumerate(ranks):
        assert out["bf16"][0] == [compression.low_precision_bytes(numel, world_size)] * 4
        assert out["fp16"][0] == [compression.low_precision_bytes(numel, world_size)] * 4
        before = compression.ring_bytes(numel, world_size, rank)
        after = compression.powersgd_bytes(shapes, 2, world_size, rank)
        assert out["powersgd"][0] == [before, before, after, after], rank
        assert out["topk"][0] == [compression.topk_bytes(numel, 0.05, world_size)] * 4
        for name, (sent, final, losses) in out.items():
            assert torch.equal(final, ranks[0][name][1]), (name, rank)            # replicas stay identical
            assert all(math.isfinite(x) for x in losses)
    if world_size > 1:
        sizes = compression.powersgd_sizes(shapes, 2)
        assert sizes == {"uncompressed": NUMEL - 961, "p": 62, "q": 62, "original": NUMEL, "total": NUMEL - 961 + 124}
        assert compression.low_precision_bytes(numel, world_size) < compression.ring_bytes(numel, world_size)


def _one_call(rank, world_size, name, numel):
    hook, state = _hooks()[name]
    inputs = make_input(5, rank, numel, torch.float32)
    bucket = training.HookBucket(inputs.clone(), [torch.nn.Parameter(torch.zeros(numel))])
    with traffic.record() as recording:
        result = hook(state, bucket).wait()
    error = state.error_dict.get(0) if hasattr(state, "error_dict") else None
    return result, recording.bytes_sent, error


@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_low_precision_is_within_two_roundings_of_the_mean(world_size):
    numel = 4 * world_size + 3
    inputs = torch.stack([make_input(5, r, numel, torch.float32).double() for r in range(world_size)])
    exact = inputs.mean(0)
    for name, u in (("bf16", 2.0 ** -8), ("fp16", 2.0 ** -11)):
        ranks = run(_one_call, world_size, name, numel)
        bound = u * inputs.abs().sum(0) / world_size + u * exact.abs() + 1e-6 * inputs.abs().sum(0)
        assert ((ranks[0][0].double() - exact).abs() <= bound).all(), name
        assert all(torch.equal(r[0], ranks[0][0]) for r in ranks), name                    # same bits everywhere
        assert (ranks[0][0].double() - exact).abs().max() > 0, name                       # it did round
        assert all(r[1] == compression.low_precision_bytes(numel, world_size) for r in ranks)


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_topk_is_the_mean_of_every_ranks_largest_entries(world_size):
    numel = 101
    k = math.ceil(0.05 * numel)
    ranks = run(_one_call, world_size, "topk", numel)
    expected = torch.zeros(numel)
    for r in range(world_size):
        x = make_input(5, r, numel, torch.float32)
        top = x.abs().topk(k).indices
        sparse = torch.zeros(numel)
        sparse[top] = x[top]
        expected += sparse
        # Error feedback keeps exactly the entries that were not sent.
        assert torch.equal(ranks[r][2], x - sparse)
    expected /= world_size
    assert torch.allclose(ranks[0][0], expected, atol=1e-7, rtol=0)
    assert all(torch.equal(r[0], ranks[0][0]) for r in ranks)
    assert int((ranks[0][0] != 0).sum()) <= world_size * k


# --------------------------------------------------------------------------------------------------
# PowerSGD against PyTorch's
# --------------------------------------------------------------------------------------------------

CASES = {"rank 2": dict(matrix_approximation_rank=2), "rank 1 no error feedback": dict(matrix_approximation_rank=1,
                                                                                       use_error_feedback=False),
         "rank 4 (QR) cold start": dict(matrix_approximation_rank=4, warm_start=False)}


def _ddp_with(which, options, rank, world_size, hand_made=False):
    model = _model(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if which == "torch":
        state, hook = torch_powersgd.PowerSGDState(None, start_powerSGD_iter=2, **options), torch_powersgd.powerSGD_hook
    else:
        state, hook = compression.PowerSGDState(start_powerSGD_iter=2, **options), compression.powersgd_hook
    sizes = []
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):            # what PyTorch's hook all-reduces
        sizes.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        with traffic.record() as recording:
            if hand_made:
                log = training.train_data_parallel(model, optimizer, DATA, F.cross_entropy, batch_size=BATCH,
                                                   epochs=2, comm_hook=hook, comm_hook_state=state,
                                                   record_parameters=True)
                params = log.parameters
            else:
                params = _ddp_loop(model, optimizer, hook, state, rank, world_size)
    finally:
        dist.all_reduce = original
    return params, sizes, recording.bytes_sent


def _ddp_loop(model, optimizer, hook, state, rank, world_size):
    dataset = TensorDataset(*DATA)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(state, hook)
    params = [training.flat_parameters(model)]
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(dataset, batch_size=BATCH, sampler=sampler):
            optimizer.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            optimizer.step()
            params.append(training.flat_parameters(model))
    return params


def _both_powersgds(rank, world_size):
    return {case: {which: _ddp_with(which, options, rank, world_size) for which in ("torch", "ours")}
            for case, options in CASES.items()}


@pytest.mark.parametrize("world_size", [3, 4])
def test_powersgd_equals_pytorchs_powersgd_hook(world_size):
    ranks = run(_both_powersgds, world_size, timeout=180)
    shapes = [tuple(p.shape) for p in _model().parameters()][::-1]
    for case, options in CASES.items():
        theirs, ours = ranks[0][case]["torch"], ranks[0][case]["ours"]
        assert step_difference(ours[0], theirs[0], tol=1e-4) is None, case
        assert (theirs[0][-1] - theirs[0][0]).abs().max() > 0.05
        assert ours[1] == [] and theirs[1], case             # ours never calls torch's all_reduce
        steps = len(theirs[0]) - 1
        sizes = compression.powersgd_sizes(shapes, options["matrix_approximation_rank"])
        per_step = [sizes["uncompressed"], sizes["p"], sizes["q"]]
        assert theirs[1] == [NUMEL] * 2 + per_step * (steps - 2), case      # PyTorch's three all-reduces per step
        for rank, run_of_rank in enumerate(ranks):
            expected = 2 * compression.ring_bytes(NUMEL, world_size, rank) + (steps - 2) * sum(
                compression.ring_bytes(n, world_size, rank) for n in per_step)
            assert run_of_rank[case]["ours"][2] == expected, (case, rank)
            assert torch.equal(run_of_rank[case]["ours"][0][-1], ours[0][-1])


def _powersgd_naive_and_ring(rank, world_size):
    out = {}
    for variant in ("ring", "naive"):
        model = _model(seed=0)
        state = compression.PowerSGDState(matrix_approximation_rank=2, start_powerSGD_iter=2, allreduce=variant)
        log = training.train_data_parallel(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), DATA,
                                           F.cross_entropy, batch_size=BATCH, max_steps=6,
                                           comm_hook=compression.powersgd_hook, comm_hook_state=state,
                                           record_parameters=True)
        out[variant] = log.parameters
    return out


def test_powersgd_with_the_naive_all_reduce_inside_gives_the_same_steps():
    out = run(_powersgd_naive_and_ring, 3)[0]
    assert step_difference(out["naive"], out["ring"], tol=1e-5) is None


def _hand_made_and_ddp(rank, world_size):
    options = CASES["rank 2"]
    return {"hand-made ours": _ddp_with("ours", options, rank, world_size, hand_made=True),
            "hand-made torch": _ddp_with("torch", options, rank, world_size, hand_made=True),
            "ddp torch": _ddp_with("torch", options, rank, world_size)}


def test_the_hand_made_trainer_runs_a_hook_as_ddp_does():
    ranks = run(_hand_made_and_ddp, 3, timeout=120)
    ddp = ranks[0]["ddp torch"][0]
    assert step_difference(ranks[0]["hand-made ours"][0], ddp, tol=1e-4) is None
    assert step_difference(ranks[0]["hand-made torch"][0], ddp, tol=1e-4) is None


def _fp16_against_pytorchs(rank, world_size):
    out = {}   # (DDP accepts PyTorch's bf16 hook only with CUDA and NCCL; its fp16 hook runs on gloo)
    for which, hook, state in (("ours", compression.low_precision_hook, compression.LowPrecisionState(torch.float16)),
                               ("torch", default_hooks.fp16_compress_hook, None)):
        model = _model(seed=0)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        params = _ddp_loop(model, optimizer, hook, state, rank, world_size)
        out[which] = params
    plain = _model(seed=0)
    out["fp32"] = _ddp_loop(plain, torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9),
                            default_hooks.allreduce_hook, None, rank, world_size)
    return out


def test_fp16_hook_tracks_fp32_training_at_least_as_well_as_pytorchs():
    out = run(_fp16_against_pytorchs, 4, timeout=120)[0]
    ours = max((a - b).abs().max().item() for a, b in zip(out["ours"], out["fp32"]))
    theirs = max((a - b).abs().max().item() for a, b in zip(out["torch"], out["fp32"]))
    assert 0 < ours <= theirs * 1.05 + 1e-6, (ours, theirs)


# --------------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------------

def _with_bucket_mb(rank, world_size):
    model = _model()
    try:
        training.train_data_parallel(model, torch.optim.SGD(model.parameters(), lr=0.1), DATA, F.cross_entropy,
                                     batch_size=4, bucket_mb=1, comm_hook=compression.topk_hook,
                                     comm_hook_state=compression.TopKState())
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_bad_input_fails_clearly():
    with pytest.raises(ValueError, match="start_powerSGD_iter must be > 1 with error feedback or warm start"):
        compression.PowerSGDState(start_powerSGD_iter=1)
    with pytest.raises(ValueError, match="matrix_approximation_rank must be a positive int"):
        compression.PowerSGDState(matrix_approximation_rank=0)
    with pytest.raises(ValueError, match="allreduce must name a course_lib.allreduce variant"):
        compression.PowerSGDState(allreduce="fastest", start_powerSGD_iter=2)
    with pytest.raises(ValueError, match=r"density must be a number in \(0, 1\]"):
        compression.TopKState(density=0)
    with pytest.raises(ValueError, match="dtype must be torch.bfloat16 or torch.float16"):
        compression.LowPrecisionState(torch.float32)
    bucket = training.HookBucket(torch.zeros(4), [torch.nn.Parameter(torch.zeros(4))])
    with pytest.raises(RuntimeError, match="call it inside a function started by course_lib.launch"):
        compression.topk_hook(compression.TopKState(), bucket)
    assert all(message.startswith("comm_hook replaces the one all-reduce after backward")
               for message in run(_with_bucket_mb, 2))
