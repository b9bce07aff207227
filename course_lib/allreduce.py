"""Three ways for G ranks to all-reduce a tensor of N elements, written from point-to-point messages.

After any of them every rank holds op(x_0, x_1, ..., x_{G-1}) elementwise, in place, exactly like
`torch.distributed.all_reduce(tensor, op)`. They differ in who sends what:

    variant            elements each rank sends        busiest rank sends + receives    latencies in a row
    naive              (G-1) N                         2 (G-1) N                        1 (G-1 messages at once)
    parameter_server   N (root: (G-1) N)               2 (G-1) N        (the root)      2
    ring               2 (G-1) N / G                   4 (G-1) N / G                    2 (G-1)

The ring moves as many elements in total as the parameter server, 2 (G-1) N, but spreads them evenly,
so each rank's share stays about 2N however many ranks join. Its price is 2 (G-1) steps one after another,
each with a latency: for small tensors the naive exchange beats it (its G-1 messages leave at once, so
their latencies overlap), and it beats the parameter server at any size. fast_allreduce's recursive doubling
needs log2 P latencies (P the largest power of two <= G, 2 more when G is not one), its tree 2 ceil(log2 G).

Every variant reduces in the same order on every rank, so floating-point results are bit-identical
across ranks (a replica that drifts by one rounding step is still a replica that drifts).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib import ops, p2p, runtime, traffic
from course_lib.ops import chunk_sizes
from course_lib.ops import flat_view as _flat

__all__ = ["naive", "parameter_server", "ring", "ring_scatter_reduce", "ring_all_gather", "chunk_sizes",
           "owned_chunk", "VARIANTS", "get"]  # noqa: F822 - VARIANTS loads on first use (module __getattr__)


def owned_chunk(rank: int, world_size: int) -> int:
    """The chunk that rank `rank` holds fully reduced after the ring's scatter-reduce: (r + 1) mod G."""
    return (rank + 1) % world_size


def _prepare(call: str, tensor, op=runtime.NO_OP, root=None) -> str:
    """Check this rank's arguments, agree on them with the other ranks, return the op's name."""
    return runtime.prepare(call, tensor, op=op, root=root)


# --------------------------------------------------------------------------------------------------
# 1. Naive: everybody sends everything to everybody
# --------------------------------------------------------------------------------------------------


def naive(tensor: torch.Tensor, op=ops.SUM) -> None:
    """All-reduce by full exchange: each rank sends its whole tensor to each of the G-1 others.

    Every rank then holds all G tensors and reduces them itself. G-1 steps, all posted at once (on a
    modeled link their latencies overlap), and (G-1) N elements leave every rank, G (G-1) N in total.

    Args:
        tensor: this rank's input; overwritten with the result.
        op: SUM, AVG, PRODUCT, MAX or MIN.
    """
    op = _prepare("allreduce.naive", tensor, op)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    with _flat(tensor) as flat:
        everyone = [None] * world_size
        everyone[rank] = flat.clone()
        with traffic.phase("exchange"):
            # Step k: send to the rank k+1 places ahead, receive from the one k+1 behind. Every send and
            # every receive is posted at once, before waiting for any: no rank can block another, and
            # all G-1 messages are on their way together (the flood that names the method).
            sends = [p2p.isend(everyone[rank], (rank + step + 1) % world_size)
                     for step in traffic.steps(world_size - 1)]
            receives = []
            for step in traffic.steps(world_size - 1):
                src = (rank - step - 1) % world_size
                everyone[src] = torch.empty_like(flat)
                receives.append(p2p.irecv(everyone[src], src))
            for request in receives + sends:
                request.wait()
        ops.reduce_in_rank_order(flat, everyone, op)


# --------------------------------------------------------------------------------------------------
# 2. Master / parameter server: reduce at the root, then broadcast
# --------------------------------------------------------------------------------------------------


def parameter_server(tensor: torch.Tensor, op=ops.SUM, root: int = 0) -> None:
    """All-reduce through one root (the seeds' master): everyone sends to `root`, which reduces and sends the result back.

    Phase 'reduce': G-1 messages of N elements arrive at the root (notebook 02's flat reduce).
    Phase 'broadcast': the root sends N elements to each of the G-1 others (its flat broadcast).
    Total 2 (G-1) N elements, all of them through one root that does both phases one after the
    other: with one unsharded root its link is the bottleneck.
    """
    op = _prepare("allreduce.parameter_server", tensor, op, root=root)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    others = [r for r in range(world_size) if r != root]
    with _flat(tensor) as flat:
        with traffic.phase("reduce"):                 # everyone -> root
            if rank == root:
                everyone = [flat.clone() if r == root else torch.empty_like(flat) for r in range(world_size)]
                for src in others:
                    p2p.recv(everyone[src], src)
                ops.reduce_in_rank_order(flat, everyone, op)
            else:
                p2p.send(flat, root)
        with traffic.phase("broadcast"):              # root -> everyone
            if rank == root:
                for request in [p2p.isend(flat, dst) for dst in others]:
                    request.wait()
            else:
                p2p.recv(flat, root)


# --------------------------------------------------------------------------------------------------
# 3. Ring: scatter-reduce, then all-gather
# --------------------------------------------------------------------------------------------------
#
# The tensor is cut into G chunks (torch.tensor_split: any length works, chunks may be empty).
# Rank r only ever sends to its right neighbour r+1 and receives from its left neighbour r-1.
#
# Scatter-reduce, step s = 0 .. G-2:
#     rank r sends chunk (r - s) mod G to r+1, receives chunk (r - s - 1) mod G from r-1 and adds it
#     into its own copy of that chunk.
# After G-1 steps rank r holds chunk (r + 1) mod G summed over all ranks.
#
# All-gather, step s = 0 .. G-2:
#     rank r sends chunk (r + 1 - s) mod G (complete) to r+1, receives chunk (r - s) mod G from r-1
#     and overwrites its copy.
#
# G = 4, chunks a..d on GPU-0..3 written x_r[c] (chunk c of rank r); "->" is a message to the right:
#
#   scatter-reduce   GPU-0             GPU-1             GPU-2             GPU-3
#   step 0           x0[0] -> 1        x1[1] -> 2        x2[2] -> 3        x3[3] -> 0
#   step 1           (x3+x0)[3] -> 1   (x0+x1)[0] -> 2   (x1+x2)[1] -> 3   (x2+x3)[2] -> 0
#   step 2           (.+x0)[2] -> 1    (.+x1)[3] -> 2    (.+x2)[0] -> 3    (.+x3)[1] -> 0
#   complete chunk   1                 2                 3                 0
#
#   all-gather       GPU-0             GPU-1             GPU-2             GPU-3
#   step 0           sum[1] -> 1       sum[2] -> 2       sum[3] -> 3       sum[0] -> 0
#   step 1           sum[0] -> 1       sum[1] -> 2       sum[2] -> 3       sum[3] -> 0
#   step 2           sum[3] -> 1       sum[0] -> 2       sum[1] -> 3       sum[2] -> 0
#
# Each rank sends 2 (G-1) chunks of about N/G elements: 2 (G-1) N / G, whatever the order.


def ring_scatter_reduce(tensor: torch.Tensor, op=ops.SUM) -> int:
    """Phase 1 of the ring: afterwards rank r holds one chunk fully reduced.

    Only that chunk of `tensor` is meaningful afterwards; the others hold partial sums.

    Args:
        tensor: this rank's input, modified in place.
        op: SUM, AVG, PRODUCT, MAX or MIN (AVG divides the finished chunk by G).

    Returns:
        The index of the chunk this rank now holds complete: (rank + 1) mod G. The chunks are
        ``torch.tensor_split(tensor.view(-1), G)``.
    """
    op = _prepare("allreduce.ring_scatter_reduce", tensor, op)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    with _flat(tensor) as flat:
        chunks = torch.tensor_split(flat, world_size)
        incoming = torch.empty(max(chunks[0].numel(), 0), dtype=flat.dtype, device=flat.device)
        with traffic.phase("scatter_reduce"):
            for step in traffic.steps(world_size - 1):
                send_index = (rank - step) % world_size
                recv_index = (rank - step - 1) % world_size
                # Post the receive first: the left neighbour's chunk then has somewhere to land while
                # our own send is still going out (gloo moves a message only once its receive is posted).
                buffer = incoming[: chunks[recv_index].numel()]
                receive = p2p.irecv(buffer, left, chunk=recv_index)
                send = p2p.isend(chunks[send_index], right, chunk=send_index)
                receive.wait()
                ops.combine_(chunks[recv_index], buffer, op)
                send.wait()
        mine = owned_chunk(rank, world_size)
        ops.finish_(chunks[mine], op, world_size)
    return mine


def ring_all_gather(tensor: torch.Tensor) -> None:
    """Phase 2 of the ring: pass the completed chunks round until every rank has all of them.

    Expects what `ring_scatter_reduce` leaves: rank r holds chunk (r + 1) mod G complete. Afterwards
    every rank holds every chunk complete, so `tensor` is the full result on every rank.
    """
    _prepare("allreduce.ring_all_gather", tensor)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    with _flat(tensor) as flat:
        chunks = torch.tensor_split(flat, world_size)
        with traffic.phase("all_gather"):
            for step in traffic.steps(world_size - 1):
                send_index = (rank + 1 - step) % world_size
                recv_index = (rank - step) % world_size
                receive = p2p.irecv(chunks[recv_index], left, chunk=recv_index)
                send = p2p.isend(chunks[send_index], right, chunk=send_index)
                receive.wait()
                send.wait()


def ring(tensor: torch.Tensor, op=ops.SUM) -> None:
    """Ring all-reduce: `ring_scatter_reduce` then `ring_all_gather`, in place.

    Example::

        >>> def fn(rank, world_size):
        ...     t = torch.tensor([1.0, 2.0, 3.0]) * (rank + 1)
        ...     allreduce.ring(t)
        ...     return t
        >>> course_lib.launch(fn, world_size=2)
        [tensor([3., 6., 9.]), tensor([3., 6., 9.])]
    """
    op = _prepare("allreduce.ring", tensor, op)
    with runtime.unchecked():  # agreed on once, under this function's name
        ring_scatter_reduce(tensor, op)
        ring_all_gather(tensor)


_LESSON = {"naive": naive, "parameter_server": parameter_server, "master": parameter_server, "ring": ring}


def _variants() -> dict:
    """Every variant by name: the lesson's three first, then the faster ones, which live beside the ring
    (`course_lib.fast_allreduce`, notebook 11) and load on first use: a plain ring never needs them."""
    table = globals().get("VARIANTS")
    if table is None:
        from course_lib import fast_allreduce

        table = globals()["VARIANTS"] = {**_LESSON, **fast_allreduce.VARIANTS}
    return table


def __getattr__(name):
    if name == "VARIANTS":
        return _variants()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get(name: str):
    """The all-reduce function called `name`: 'naive', 'parameter_server' / 'master', 'ring', or one of
    course_lib.fast_allreduce's 'ring_pipelined', 'ring_bidirectional', 'halving_doubling', 'tree'."""
    try:
        return _variants()[name]
    except KeyError:
        raise ValueError(f"unknown all-reduce variant {name!r}; choose one of {sorted(_variants())}") from None
