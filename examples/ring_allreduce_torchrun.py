"""Ring all-reduce under torchrun: the same SPMD function the notebooks launch, run by torchrun.

    torchrun --nproc-per-node 4 examples/ring_allreduce_torchrun.py
    python examples/ring_allreduce_torchrun.py        # no torchrun: course_lib.launch starts 4 ranks

On several machines, give torchrun --nnodes and a --rdzv-endpoint as usual; nothing here changes.
"""

import os

import torch
import torch.distributed as dist

import course_lib
from course_lib import allreduce, traffic


def ring_versus_builtin(rank, world_size, numel=1_000_003):
    """All-reduce a rank-dependent tensor with course_lib's ring and with torch; return the traffic."""
    generator = torch.Generator().manual_seed(1234 + rank)
    mine = torch.randn(numel, generator=generator).to(course_lib.device())
    expected = mine.clone()
    dist.all_reduce(expected)
    with traffic.record() as recording:
        allreduce.ring(mine)
    torch.testing.assert_close(mine, expected, rtol=1e-5, atol=1e-4)
    return {"rank": rank, "elements_sent": recording.elements_sent, "messages_sent": recording.messages_sent}


def main():
    if course_lib.under_torchrun():
        results = course_lib.run_torchrun(ring_versus_builtin)   # this process is one of torchrun's ranks
    else:
        results = course_lib.launch(ring_versus_builtin, world_size=4)  # start 4 local ranks ourselves
    if int(os.environ.get("RANK", 0)) == 0:  # print once, not once per rank
        world_size = len(results)
        for row in results:
            print(f"rank {row['rank']}: sent {row['messages_sent']} messages, {row['elements_sent']} elements")
        print(f"ring all-reduce on {world_size} ranks matches torch.distributed.all_reduce")


if __name__ == "__main__":
    main()
