"""Ring all-reduce under torchrun: the same SPMD function the notebooks launch, run by torchrun.

    torchrun --nproc-per-node 4 examples/ring_allreduce_torchrun.py
    python examples/ring_allreduce_torchrun.py        # no torchrun: course_lib.launch starts 4 ranks
    torchrun --nproc-per-node 4 examples/ring_allreduce_torchrun.py --network "100 MB/s, 1 ms"

With --network every message of the ring takes the time of that modeled link (course_lib.network) on
the ranks' modeled clocks (course_lib.clock()), and the example prints that time beside the model's
prediction. A modeled network needs all ranks on one machine.

On several machines, give torchrun --nnodes and a --rdzv-endpoint as usual; nothing here changes.
"""

import argparse
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
    dist.barrier()
    start = course_lib.clock()          # modeled time under --network, this machine's otherwise
    with traffic.record() as recording:
        allreduce.ring(mine)
    seconds = course_lib.clock() - start
    torch.testing.assert_close(mine, expected, rtol=1e-5, atol=1e-4)
    return {"rank": rank, "elements_sent": recording.elements_sent, "messages_sent": recording.messages_sent,
            "seconds": seconds}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--network", default=None, help="model a link, e.g. '100 MB/s, 1 ms' or 1GbE")
    network = parser.parse_args().network
    if course_lib.under_torchrun():   # this process is one of torchrun's ranks
        results = course_lib.run_torchrun(ring_versus_builtin, network=network)
    else:                             # start 4 local ranks ourselves
        results = course_lib.launch(ring_versus_builtin, world_size=4, network=network)
    if int(os.environ.get("RANK", 0)) == 0:  # print once, not once per rank
        world_size = len(results)
        for row in results:
            print(f"rank {row['rank']}: sent {row['messages_sent']} messages, {row['elements_sent']} elements")
        print(f"ring all-reduce on {world_size} ranks matches torch.distributed.all_reduce")
        if network is not None:
            link = course_lib.Network.parse(network)
            slowest = max(row["seconds"] for row in results)
            predicted = link.predict("ring", 4 * 1_000_003, world_size)
            print(f"on the modeled link ({link.describe()}): {slowest * 1e3:.0f} ms, "
                  f"the model predicts {predicted * 1e3:.0f} ms (x{slowest / predicted:.2f})")


if __name__ == "__main__":
    main()
