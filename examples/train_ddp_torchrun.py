"""Data-parallel training with PyTorch's DistributedDataParallel, as a script for torchrun.

    torchrun --standalone --nproc-per-node 4 examples/train_ddp_torchrun.py
    torchrun --standalone --nproc-per-node 4 examples/train_ddp_torchrun.py --comm-hook ring
    python examples/train_ddp_torchrun.py --world-size 4     # no torchrun: course_lib.launch starts the ranks

torchrun starts one process per rank and tells each its RANK, WORLD_SIZE and where to meet; the
script does the five parts of DDP (below) and trains a small MLP on a spiral data set made in code.
``--comm-hook ring`` makes DDP average the gradients with course_lib's hand-written ring instead
of its own all-reduce: the result is the same. Rank 0 prints one progress line per epoch, then
checks that every rank ended with bit-identical parameters.

This is the same training as ``course_lib.training.train_ddp`` with the same arguments (notebook 09
runs both and compares the final loss). On several machines give torchrun ``--nnodes`` and a
``--rdzv-endpoint``; nothing in the script changes.
"""

import argparse
import hashlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import course_lib
from course_lib import training
from course_lib.training import toy


def train(rank, world_size, epochs=3, batch_size=16, lr=0.2, samples=600, comm_hook="none", max_steps=None):
    """One rank's DDP training; returns (final loss, fingerprint of the final parameters)."""
    # 1) init_process_group: already done, by main() under torchrun or by course_lib.launch.
    # 2) this rank's device: the CPU under gloo, GPU number LOCAL_RANK under NCCL.
    device = course_lib.device()
    # 3) a DistributedSampler deals every epoch's samples out to the ranks, without overlap.
    dataset = TensorDataset(*toy.make_spirals(samples, seed=1))
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    # 4) the model on this rank's device (the same seed everywhere; DDP broadcasts rank 0's anyway).
    model = toy.make_mlp(seed=0).to(device)
    # 5) wrap it: DDP averages the gradients during backward().
    ddp_model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if comm_hook != "none":
        ddp_model.register_comm_hook(training.CommHookState(comm_hook), training.allreduce_hook)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)

    steps, epoch_loss = 0, float("nan")
    for epoch in range(epochs):
        if max_steps is not None and steps >= max_steps:
            break
        sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
        total = torch.zeros(2, dtype=torch.float64, device=device)  # loss x samples, samples
        for inputs, targets in loader:
            if max_steps is not None and steps >= max_steps:
                break
            inputs, targets = inputs.to(device), targets.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(ddp_model(inputs), targets)
            loss.backward()
            optimizer.step()
            total += torch.tensor([loss.item() * len(inputs), len(inputs)], dtype=torch.float64, device=device)
            steps += 1
        dist.all_reduce(total)  # the epoch's mean loss over every rank's samples (for printing only)
        epoch_loss = (total[0] / total[1]).item()
        if rank == 0:
            print(f"epoch {epoch + 1} {toy.progress_bar(epoch + 1, epochs)} loss {epoch_loss:.4f}", flush=True)
    params = training.flat_parameters(model)
    fingerprint = hashlib.sha1(params.numpy().tobytes()).hexdigest()
    return {"loss": epoch_loss, "fingerprint": fingerprint, "steps": steps}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--samples", type=int, default=600, help="size of the spiral data set")
    parser.add_argument("--comm-hook", default="none", choices=["none", "ring", "naive", "parameter_server"],
                        help="average gradients with this course_lib all-reduce inside DDP")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    parser.add_argument("--world-size", type=int, default=4, help="ranks to start without torchrun")
    args = parser.parse_args()
    options = dict(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, samples=args.samples,
                   comm_hook=args.comm_hook, max_steps=args.max_steps)

    if course_lib.under_torchrun():
        # Step 1 of 5: join the process group torchrun set up (RANK, WORLD_SIZE, MASTER_ADDR, ...).
        results = course_lib.run_torchrun(train, kwargs=options)
    else:
        results = course_lib.launch(train, world_size=args.world_size, kwargs=options, timeout=300)
    if int(os.environ.get("RANK", 0)) == 0:
        world_size = len(results)
        same = len({r["fingerprint"] for r in results}) == 1
        print(f"trained on {world_size} ranks, {results[0]['steps']} training steps, comm hook: {args.comm_hook}")
        print(f"parameters identical on all {world_size} ranks: {same}")
        print(f"final loss {results[0]['loss']:.4f}")
        if not same:
            raise SystemExit("the replicas drifted apart: their parameters differ")


if __name__ == "__main__":
    main()
