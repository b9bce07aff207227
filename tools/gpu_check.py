"""Run course_lib's GPU paths for real on a machine with NVIDIA GPUs (never part of CI: CI has no GPU).

    python tools/gpu_check.py            # prints one line per check, exits non-zero if any failed

What it checks, whatever the number of GPUs:
  * resolve_backend: "auto" picks NCCL only with a GPU per rank, gloo otherwise;
  * NCCL with as many ranks as GPUs: every collective and all-reduce variant against the built-in on
    tensors that live on each rank's GPU (course_lib.device()), so the metadata checks and p2p run on CUDA;
  * CUDA already initialised in the caller (as in Colab once a cell touched the GPU): launch must start
    the ranks with spawn, and a function defined here must still travel;
  * more ranks than GPUs with backend="auto": gloo on the CPU;
  * autograd run in the caller before the launch: on a CUDA build with a GPU that starts autograd's
    device threads, after which a forked rank's backward() fails ("Unable to handle autograd's threading
    in combination with fork-based multiprocessing"): launch must not fork then;
  * nn.DataParallel as notebook 09 uses it, where there are GPUs;
  * PyTorch's PowerSGD hook in gloo ranks that "auto" chose (notebook 12), forked and spawned from a process
    that asked torch.cuda.is_available() first: the ranks must see no GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import traceback

import torch
import torch.distributed as dist

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)
import course_lib  # noqa: E402
from course_lib import allreduce, collectives  # noqa: E402

RESULTS = []

POWERSGD_IN_AUTO_RANKS = """
import os, sys
import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel
import course_lib

def powersgd_steps(rank, world_size):
    # On a CUDA build with a GPU the hook calls torch.cuda.synchronize(bucket's device) when is_available():
    # on a CPU bucket that fails ("Expected a cuda device, but got: cpu") unless the rank sees no GPU.
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 4)))
    state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2)
    model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    for _ in range(4):
        model(torch.randn(8, 32)).sum().backward()
    return torch.cuda.is_available(), os.environ.get("CUDA_VISIBLE_DEVICES")

parent_sees = torch.cuda.is_available()
ranks = torch.cuda.device_count() + 1          # more ranks than GPUs: 'auto' picks gloo
out = course_lib.launch(powersgd_steps, world_size=ranks, backend="auto", start_method=sys.argv[1], timeout=120)
assert all(seen == (False, "") for seen in out), out
print(f"parent: is_available() {parent_sees}; {ranks} ranks trained 4 steps, each saw (is_available, "
      f"CUDA_VISIBLE_DEVICES) = {out[0]}")
"""


def check(name):
    def wrap(fn):
        start = time.perf_counter()
        try:
            detail = fn()
            RESULTS.append((name, True, detail or ""))
        except Exception:  # noqa: BLE001 - report every check
            RESULTS.append((name, False, traceback.format_exc()))
        print(f"{'ok  ' if RESULTS[-1][1] else 'FAIL'} {name} ({time.perf_counter() - start:.1f} s) "
              f"{RESULTS[-1][2]}", flush=True)
        return fn
    return wrap


def every_collective(rank, world_size, numel=1_000_003):
    """Each hand-written collective against the built-in, on this rank's device."""
    device = course_lib.device()
    gen = torch.Generator().manual_seed(17 + rank)
    x = torch.randn(numel, generator=gen).to(device)
    out = {"device": str(x.device), "backend": dist.get_backend()}
    for name in ("naive", "parameter_server", "ring"):
        mine, ref = x.clone(), x.clone()
        allreduce.get(name)(mine)
        dist.all_reduce(ref)
        torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-4)
    for src in range(world_size):
        mine = x.clone()
        collectives.broadcast(mine, src=src)
        ref = x.clone()
        dist.broadcast(ref, src=src)
        assert torch.equal(mine, ref)
    gathered = [torch.empty_like(x) for _ in range(world_size)]
    collectives.all_gather(gathered, x)
    ref = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(ref, x)
    assert all(torch.equal(a, b) for a, b in zip(gathered, ref))
    mine = x.clone()
    collectives.all_reduce(mine)
    ref = x.clone()
    dist.all_reduce(ref)
    torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-4)
    return out


def main():
    gpus = torch.cuda.device_count()
    print(f"torch {torch.__version__}, {gpus} GPU(s), NCCL available: {dist.is_nccl_available()}", flush=True)

    @check("resolve_backend: auto with a GPU per rank / more ranks than GPUs")
    def _():
        assert course_lib.resolve_backend("auto", max(gpus, 1)) == ("nccl" if gpus else "gloo")
        assert course_lib.resolve_backend("auto", gpus + 1) == "gloo"
        return f"auto({gpus}) -> {course_lib.resolve_backend('auto', max(gpus, 1))}, auto({gpus + 1}) -> gloo"

    if gpus:
        @check(f"NCCL, {gpus} rank(s): every collective and variant vs the built-in, tensors on the GPU")
        def _():
            out = course_lib.launch(every_collective, world_size=gpus, backend="nccl", timeout=120)
            assert all(o["backend"] == "nccl" and o["device"].startswith("cuda") for o in out), out
            return str(out[0])

        @check("nn.DataParallel over every GPU (notebook 09's cell)")
        def _():
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
            replicated = torch.nn.DataParallel(model.cuda())
            x = torch.randn(32, 8, device="cuda")
            replicated(x).sum().backward()
            grads = [p.grad.clone() for p in model.parameters()]
            model.zero_grad()
            model(x).sum().backward()
            for a, b in zip(grads, model.parameters()):
                torch.testing.assert_close(a, b.grad)
            return f"{len(replicated.device_ids)} device(s)"

    @check("autograd used in the caller (notebook 07's one-process reference), then ranks that train")
    def _():
        model = torch.nn.Linear(4, 1)
        model(torch.randn(8, 4)).sum().backward()  # starts autograd's device threads on a CUDA build

        def train_step(rank, world_size):
            layer = torch.nn.Linear(4, 1)
            layer(torch.randn(8, 4)).sum().backward()
            return float(layer.weight.grad.abs().sum())

        out = course_lib.launch(train_step, world_size=2, backend="gloo", timeout=120)
        return f"{len(out)} ranks ran backward"

    @check("CUDA initialised in the caller: 4 ranks start with spawn on gloo")
    def _():
        if gpus:
            torch.zeros(1, device="cuda")  # what a Colab cell that touched the GPU leaves behind
            assert torch.cuda.is_initialized()
        scale = 3.0

        def closure(rank, world_size):  # a closure: only cloudpickle carries it to spawned ranks
            t = torch.full((5,), float(rank) * scale)
            allreduce.ring(t)
            return t, dist.get_backend()

        out = course_lib.launch(closure, world_size=4, backend="auto", timeout=120)
        expected = scale * sum(range(4))
        assert all(torch.equal(t, torch.full((5,), expected)) and b == "gloo" for t, b in out), out
        return "results equal, backend gloo"

    for method in ("fork", "spawn"):
        @check(f"PyTorch's PowerSGD hook in 'auto' ranks on gloo ({method}, after is_available() in the parent), "
               "as notebook 12 runs it")
        def _():
            # A fresh interpreter, as a notebook kernel is: it asks is_available() first (a common first cell, which
            # caches the device count that a forked rank inherits), then launches more ranks than there are GPUs.
            run = subprocess.run([sys.executable, "-c", POWERSGD_IN_AUTO_RANKS, method], capture_output=True,
                                 text=True, timeout=180, cwd=REPO)
            assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
            return run.stdout.strip().splitlines()[-1]

    failed = [name for name, ok, _ in RESULTS if not ok]
    print(f"\n{len(RESULTS) - len(failed)} of {len(RESULTS)} checks passed")
    for name, ok, detail in RESULTS:
        if not ok:
            print(f"--- {name}\n{detail}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
