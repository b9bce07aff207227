"""How fast can a ring all-reduce written in Python be, next to gloo's C++ one? Prototypes and a profile.

    python benchmarks/ring_speed_experiments.py                  # 4 ranks, 16 MiB and 64 MiB
    python benchmarks/ring_speed_experiments.py --sizes 16MiB --reps 9 --world-size 4

Variants timed in the same launch, taking turns within every repetition (so background load hits all
of them alike), each repetition = the slowest rank's time after a barrier, median over repetitions;
the "paired" ratio is the median over repetitions of (variant's time / builtin's time in the same
repetition), which cancels load that hits both:

    builtin        torch.distributed.all_reduce (gloo: a ring in C++ that cuts each chunk into segments)
    ring           course_lib.allreduce.ring, the one the course teaches
    ring_plain     the same schedule on torch.distributed.isend/irecv directly: what course_lib.p2p's
                   checks, tracing and status line cost
    ring_recv_first ring_plain, but each step posts its irecv before its isend
    ring_proposed  course_lib's ring with that one change, still on course_lib.p2p (the proposal; since
                   adopted by course_lib.allreduce.ring, so it and 'ring' now time the same code)
    ring_pipelined every chunk is cut into `segments` pieces; all of a step's receives are posted at once
                   and each piece is added as soon as it arrives, then sent on at once for the next step,
                   so adding one piece overlaps receiving the next (gloo's idea, in Python)
    ring_bidir     half the tensor goes round clockwise, the other half anticlockwise, both at once:
                   every socket carries traffic both ways

`--profile` also splits the course ring's time per step into waiting for the left neighbour's chunk,
adding it, and waiting for our own send to complete.

These are experiments: the course's ring stays the readable one in course_lib/allreduce.py.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import course_lib
from course_lib import allreduce, ops, p2p, traffic
from course_lib.bench import format_bytes, parse_bytes


# --------------------------------------------------------------------------------------------------
# Prototypes (same schedule and chunking as course_lib.allreduce.ring: rank r ends owning (r+1) mod G)
# --------------------------------------------------------------------------------------------------


def ring_plain(tensor: torch.Tensor) -> None:
    """course_lib's ring schedule, on the raw torch.distributed calls."""
    rank, g = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % g, (rank - 1) % g
    chunks = torch.tensor_split(tensor.view(-1), g)
    incoming = torch.empty_like(chunks[0])
    for step in range(g - 1):
        send, recv = (rank - step) % g, (rank - step - 1) % g
        request = dist.isend(chunks[send], right)
        buffer = incoming[: chunks[recv].numel()]
        dist.recv(buffer, left)
        chunks[recv].add_(buffer)
        request.wait()
    for step in range(g - 1):
        send, recv = (rank + 1 - step) % g, (rank - step) % g
        request = dist.isend(chunks[send], right)
        dist.recv(chunks[recv], left)
        request.wait()


def ring_recv_first(tensor: torch.Tensor) -> None:
    """ring_plain with the receive posted *before* the send in every step.

    Posting a large isend can write part of the message in the calling thread; until it returns,
    this rank has not told its left neighbour where to put the incoming chunk, so the neighbour's
    data waits. Posting irecv first lets both transfers run at once.
    """
    rank, g = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % g, (rank - 1) % g
    chunks = torch.tensor_split(tensor.view(-1), g)
    incoming = torch.empty_like(chunks[0])
    for step in range(g - 1):
        send, recv = (rank - step) % g, (rank - step - 1) % g
        buffer = incoming[: chunks[recv].numel()]
        receive = dist.irecv(buffer, left)
        request = dist.isend(chunks[send], right)
        receive.wait()
        chunks[recv].add_(buffer)
        request.wait()
    for step in range(g - 1):
        send, recv = (rank + 1 - step) % g, (rank - step) % g
        receive = dist.irecv(chunks[recv], left)
        request = dist.isend(chunks[send], right)
        receive.wait()
        request.wait()


def ring_proposed(tensor: torch.Tensor, op=ops.SUM) -> None:
    """The change proposed for course_lib.allreduce.ring: its own code (p2p wrappers, traffic labels,
    chunk bookkeeping), with each step's receive posted before its send."""
    rank, g = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % g, (rank - 1) % g
    flat = tensor.view(-1)
    chunks = torch.tensor_split(flat, g)
    incoming = torch.empty(max(chunks[0].numel(), 0), dtype=flat.dtype, device=flat.device)
    with traffic.phase("scatter_reduce"):
        for step in traffic.steps(g - 1):
            send_index, recv_index = (rank - step) % g, (rank - step - 1) % g
            buffer = incoming[: chunks[recv_index].numel()]
            receive = p2p.irecv(buffer, left, chunk=recv_index)        # ready for the left neighbour first,
            request = p2p.isend(chunks[send_index], right, chunk=send_index)  # then start our own send
            receive.wait()
            ops.combine_(chunks[recv_index], buffer, op)
            request.wait()
    ops.finish_(chunks[(rank + 1) % g], op, g)
    with traffic.phase("all_gather"):
        for step in traffic.steps(g - 1):
            send_index, recv_index = (rank + 1 - step) % g, (rank - step) % g
            receive = p2p.irecv(chunks[recv_index], left, chunk=recv_index)
            request = p2p.isend(chunks[send_index], right, chunk=send_index)
            receive.wait()
            request.wait()


def ring_pipelined(tensor: torch.Tensor, segments: int = 4) -> None:
    """The ring with every chunk cut into `segments` pieces that flow through the ring one after another.

    Scatter-reduce: at step s rank r receives chunk (r-s-1) from the left, piece by piece. As soon as
    piece i has arrived and been added, it is complete for this step, and it is exactly piece i of the
    chunk this rank must send at step s+1: so it is sent on at once, while piece i+1 is still arriving.
    All-gather: the received pieces need no adding; piece i is forwarded as soon as it lands.
    """
    rank, g = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % g, (rank - 1) % g
    pieces = [torch.tensor_split(chunk, segments) for chunk in torch.tensor_split(tensor.view(-1), g)]
    scratch = [torch.empty_like(pieces[0][0]) for _ in range(2 * segments)]  # two steps' worth in flight

    sends = [dist.isend(piece, right) for piece in pieces[rank % g]]  # step 0 sends chunk r
    for step in range(g - 1):
        recv = (rank - step - 1) % g
        buffers = [scratch[(step % 2) * segments + i][: pieces[recv][i].numel()] for i in range(segments)]
        receives = [dist.irecv(buffer, left) for buffer in buffers]
        next_sends = []
        for i in range(segments):
            receives[i].wait()
            pieces[recv][i].add_(buffers[i])
            if step + 1 < g - 1:  # chunk recv is what this rank sends at step + 1
                next_sends.append(dist.isend(pieces[recv][i], right))
        for request in sends:
            request.wait()
        sends = next_sends
    # All-gather: rank r starts with chunk (r+1) complete and forwards what it receives.
    sends = [dist.isend(piece, right) for piece in pieces[(rank + 1) % g]]
    for step in range(g - 1):
        recv = (rank - step) % g
        receives = [dist.irecv(piece, left) for piece in pieces[recv]]
        next_sends = []
        for i in range(segments):
            receives[i].wait()
            if step + 1 < g - 1:
                next_sends.append(dist.isend(pieces[recv][i], right))
        for request in sends:
            request.wait()
        sends = next_sends


def ring_bidirectional(tensor: torch.Tensor) -> None:
    """Two rings at once: the first half of the tensor goes to the right, the second half to the left."""
    rank, g = dist.get_rank(), dist.get_world_size()
    halves = torch.tensor_split(tensor.view(-1), 2)
    # Direction +1 is course_lib's ring; direction -1 is the same ring with the ranks renumbered -r.
    plans = []  # tag 0 / tag 1 keep the two rings' messages apart (on 2 ranks both go to the same peer)
    for half, direction in zip(halves, (1, -1)):
        me = (direction * rank) % g  # my position on this ring
        peer = lambda position, d=direction: (d * position) % g  # noqa: E731  position -> real rank
        chunks = torch.tensor_split(half, g)
        plans.append((me, peer, chunks, torch.empty_like(chunks[0]), 0 if direction == 1 else 1))
    for step in range(g - 1):
        sends, received = [], []
        for me, peer, chunks, incoming, tag in plans:
            send, recv = (me - step) % g, (me - step - 1) % g
            sends.append(dist.isend(chunks[send], peer(me + 1), tag=tag))
            buffer = incoming[: chunks[recv].numel()]
            received.append((chunks[recv], buffer, dist.irecv(buffer, peer(me - 1), tag=tag)))
        for target, buffer, request in received:  # wait for each request once: gloo hangs on a second wait
            request.wait()
            target.add_(buffer)
        for request in sends:
            request.wait()
    for step in range(g - 1):
        requests = []
        for me, peer, chunks, _, tag in plans:
            send, recv = (me + 1 - step) % g, (me - step) % g
            requests.append(dist.isend(chunks[send], peer(me + 1), tag=tag))
            requests.append(dist.irecv(chunks[recv], peer(me - 1), tag=tag))
        for request in requests:
            request.wait()


def _ring_profiled(tensor: torch.Tensor, clock: dict) -> None:
    """ring_plain with a stopwatch around each part of every step."""
    rank, g = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % g, (rank - 1) % g
    chunks = torch.tensor_split(tensor.view(-1), g)
    incoming = torch.empty_like(chunks[0])

    def timed(name, fn):
        start = time.perf_counter()
        out = fn()
        clock[name] = clock.get(name, 0.0) + time.perf_counter() - start
        return out

    for step in range(g - 1):
        send, recv = (rank - step) % g, (rank - step - 1) % g
        request = timed("post isend", lambda: dist.isend(chunks[send], right))
        buffer = incoming[: chunks[recv].numel()]
        timed("scatter-reduce: wait for left's chunk", lambda: dist.recv(buffer, left))
        timed("scatter-reduce: add", lambda: chunks[recv].add_(buffer))
        timed("wait for own send", request.wait)
    for step in range(g - 1):
        send, recv = (rank + 1 - step) % g, (rank - step) % g
        request = timed("post isend", lambda: dist.isend(chunks[send], right))
        timed("all-gather: wait for left's chunk", lambda: dist.recv(chunks[recv], left))
        timed("wait for own send", request.wait)


# --------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------

VARIANTS = {
    "builtin": dist.all_reduce,
    "ring": allreduce.ring,
    "ring_plain": ring_plain,
    "ring_recv_first": ring_recv_first,
    "ring_proposed": ring_proposed,
    "ring_pipelined": ring_pipelined,
    "ring_pipelined8": lambda t: ring_pipelined(t, segments=8),
    "ring_bidir": ring_bidirectional,
}


def _time_all(rank, world_size, numel, names, reps, warmup, profile):
    source = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    expected = source.clone()
    dist.all_reduce(expected)
    work = torch.empty_like(source)
    times = {name: [] for name in names}
    for rep in range(warmup + reps):
        for name in names:
            work.copy_(source)
            dist.barrier()
            start = time.perf_counter()
            with course_lib.unchecked():
                VARIANTS[name](work)
            elapsed = time.perf_counter() - start
            if rep == 0 and not torch.allclose(work, expected, rtol=1e-4, atol=1e-4):
                raise AssertionError(f"{name} gave a wrong result")
            if rep >= warmup:
                times[name].append(elapsed)
    clock = {}
    if profile:
        for _ in range(reps):
            work.copy_(source)
            dist.barrier()
            _ring_profiled(work, clock)
        clock = {k: v / reps for k, v in clock.items()}
    return times, clock


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="16MiB,64MiB")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--profile", action="store_true", help="split the ring's time per step into its parts")
    args = parser.parse_args(argv)
    names = args.variants.split(",")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{args.world_size} ranks, gloo on {os.cpu_count()} CPU(s), torch {torch.__version__}, "
          f"load average before: {load:.2f}; {args.reps} reps (+{args.warmup} warm-up), variants take turns")
    for size in args.sizes.split(","):
        nbytes = parse_bytes(size)
        ranks = course_lib.launch(_time_all, args.world_size, backend="gloo", timeout=600,
                                  args=(nbytes // 4, names, args.reps, args.warmup, args.profile))
        slowest = {name: [max(r[0][name][i] for r in ranks) for i in range(args.reps)] for name in names}
        base = statistics.median(slowest["builtin"]) if "builtin" in slowest else None
        print(f"\n{format_bytes(nbytes)} per rank")
        for name in names:
            ts = slowest[name]
            med = statistics.median(ts)
            vs = ""
            if base:
                # paired: this variant's time / builtin's in the same repetition, median over repetitions
                paired = statistics.median(t / b for t, b in zip(ts, slowest["builtin"]))
                vs = f"  {med / base:5.2f}x builtin (ratio of medians), {paired:5.2f}x (paired median)"
            print(f"  {name:<15} median {med * 1e3:8.1f} ms  (min {min(ts) * 1e3:7.1f}, max {max(ts) * 1e3:7.1f}){vs}")
        if args.profile:
            print("  course ring, where one call's time goes (mean over reps, rank 0 | slowest rank's total):")
            for part in ranks[0][1]:
                print(f"    {part:<42} {ranks[0][1][part] * 1e3:8.2f} ms | "
                      f"{max(r[1][part] for r in ranks) * 1e3:8.2f} ms")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\nload average after: {load:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
