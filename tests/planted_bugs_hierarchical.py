"""Learner code for notebook 13's exercise, hierarchical_allreduce: correct solutions in two styles, and planted
bugs, each with a piece of the first problem its check must report (`expect`).

Same catalogue format as tests/planted_bugs_part2.py (`Entry`): used by tests/test_hierarchical_exercise.py on a
few world sizes, and by benchmarks/hierarchical_catch_rate.py on every hidden case.

Most bugs are one change to `_hierarchical`, the notebook's solution written with switches, so each reads as the
slip it is.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib import p2p
from planted_bugs_part2 import Entry


def _hierarchical(tensor, node_size, *, rs_plus=False, rs_copy=False, rail_local0=False, across_whole=False,
                  skip_across_gather=False, across_gather_plus=False, skip_inside_gather=False,
                  inside_gather_adds=False, no_fold=False, fold_to_zero=False, fold_to_left=False,
                  serial_ring=False):
    """The notebook's solution (isend + recv + wait, notebook 04's convention), with one switch per slip."""
    rank, G = dist.get_rank(), dist.get_world_size()
    k = min(node_size, G)
    M = max(1, G // k)
    if rank >= M * k:                                   # a rank of a smaller last node
        if no_fold:
            return
        host = 0 if fold_to_zero else rank - 1 if fold_to_left else rank - k
        dist.send(tensor, host)
        dist.recv(tensor, host)
        return
    guests = [g for g in range(M * k, G) if (0 if fold_to_zero else g - 1 if fold_to_left else g - k) == rank]
    if no_fold:
        guests = []
    for guest in guests:
        incoming = torch.empty_like(tensor)
        dist.recv(incoming, guest)
        tensor += incoming
    node, i = divmod(rank, k)
    right, left = node * k + (i + 1) % k, node * k + (i - 1) % k
    shards = torch.tensor_split(tensor, k)

    def exchange(send, receive, to, frm):
        if serial_ring and i == 0:                      # local rank 0 receives first: the ring waits on it
            dist.recv(receive, frm)
            dist.send(send, to)
        elif serial_ring:
            dist.send(send, to)
            dist.recv(receive, frm)
        else:
            request = dist.isend(send, to)
            dist.recv(receive, frm)
            request.wait()

    for s in range(k - 1):                              # 1. reduce-scatter inside the node
        c = (i + s) % k if rs_plus else (i - s) % k
        incoming = torch.empty_like(shards[(c - 1) % k])
        exchange(shards[c], incoming, right, left)
        if rs_copy:
            shards[(c - 1) % k].copy_(incoming)
        else:
            shards[(c - 1) % k].add_(incoming)
    mine = tensor if across_whole else shards[(i + 1) % k]
    pieces = torch.tensor_split(mine, M)                # 2. across the nodes, on the rail
    peer_local = 0 if rail_local0 else i
    up, down = ((node + 1) % M) * k + peer_local, ((node - 1) % M) * k + peer_local
    if not (rail_local0 and i != 0):
        for s in range(M - 1):
            incoming = torch.empty_like(pieces[(node - s - 1) % M])
            request = dist.isend(pieces[(node - s) % M], up)
            dist.recv(incoming, down)
            request.wait()
            pieces[(node - s - 1) % M].add_(incoming)
        if not skip_across_gather:
            for s in range(M - 1):
                c = (node + 1 + s) % M if across_gather_plus else (node + 1 - s) % M
                request = dist.isend(pieces[c], up)
                dist.recv(pieces[(c - 1) % M], down)
                request.wait()
    if not skip_inside_gather:                          # 3. all-gather inside the node
        for s in range(k - 1):
            c = (i + 1 - s) % k
            if inside_gather_adds:
                incoming = torch.empty_like(shards[(c - 1) % k])
                exchange(shards[c], incoming, right, left)
                shards[(c - 1) % k].add_(incoming)
            else:
                exchange(shards[c], shards[(c - 1) % k], right, left)
    for guest in guests:
        dist.send(tensor, guest)


# --------------------------------------------------------------------------------------------------
# Correct, in two styles
# --------------------------------------------------------------------------------------------------


def hier_notebook(tensor, node_size):
    """The notebook's solution."""
    _hierarchical(tensor, node_size)


def hier_p2p_own_left(tensor, node_size):
    """course_lib.p2p; inside the node each rank ends with shard i (torch's reduce_scatter), not i + 1; the ring
    across the nodes runs to the left and leaves node m with piece m."""
    rank, G = dist.get_rank(), dist.get_world_size()
    K = node_size
    k, M = (G, 1) if K >= G else (K, G // K)
    if rank >= M * k:
        p2p.send(tensor, rank - K)
        p2p.recv(tensor, rank - K)
        return
    node, i = divmod(rank, k)
    guest = rank + K
    if M * k <= guest < G:
        buf = torch.zeros_like(tensor)
        p2p.recv(buf, guest)
        tensor.add_(buf)

    def member(j):
        return node * k + j % k

    shards = torch.tensor_split(tensor, k)
    for s in range(k - 1):
        send_c, recv_c = (i - s - 1) % k, (i - s - 2) % k
        buf = torch.empty_like(shards[recv_c])
        request = p2p.isend(shards[send_c], member(i + 1))
        p2p.recv(buf, member(i - 1))
        request.wait()
        shards[recv_c].add_(buf)
    parts = torch.tensor_split(shards[i], M)
    to_left, from_right = ((node - 1) % M) * k + i, ((node + 1) % M) * k + i
    for s in range(M - 1):
        send_c, recv_c = (node + s + 1) % M, (node + s + 2) % M
        buf = torch.empty_like(parts[recv_c])
        request = p2p.isend(parts[send_c], to_left)
        p2p.recv(buf, from_right)
        request.wait()
        parts[recv_c].add_(buf)
    for s in range(M - 1):
        request = p2p.isend(parts[(node + s) % M], to_left)
        p2p.recv(parts[(node + s + 1) % M], from_right)
        request.wait()
    for s in range(k - 1):
        request = p2p.isend(shards[(i - s) % k], member(i + 1))
        p2p.recv(shards[(i - s - 1) % k], member(i - 1))
        request.wait()
    if M * k <= guest < G:
        p2p.send(tensor, guest)


# --------------------------------------------------------------------------------------------------
# Planted bugs
# --------------------------------------------------------------------------------------------------


def hier_rs_shard_plus(tensor, node_size):        # shard (i + s) for (i - s) in the reduce-scatter: one token
    _hierarchical(tensor, node_size, rs_plus=True)


def hier_rs_overwrites(tensor, node_size):        # .copy_ for .add_ in the reduce-scatter: one token
    _hierarchical(tensor, node_size, rs_copy=True)


def hier_rail_is_local_rank_0(tensor, node_size):  # only local rank 0 of each node talks across, with its shard
    _hierarchical(tensor, node_size, rail_local0=True)


def hier_across_whole_tensor(tensor, node_size):   # the whole tensor all-reduced across, not the node's shard
    _hierarchical(tensor, node_size, across_whole=True)


def hier_across_no_all_gather(tensor, node_size):  # the ring across the nodes stops after its scatter-reduce
    _hierarchical(tensor, node_size, skip_across_gather=True)


def hier_across_gather_plus(tensor, node_size):   # piece (m + 1 + s) for (m + 1 - s) in the all-gather across
    _hierarchical(tensor, node_size, across_gather_plus=True)


def hier_no_inside_all_gather(tensor, node_size):  # forgets phase 3
    _hierarchical(tensor, node_size, skip_inside_gather=True)


def hier_inside_gather_adds(tensor, node_size):    # the all-gather inside adds what it receives
    _hierarchical(tensor, node_size, inside_gather_adds=True)


def hier_no_fold(tensor, node_size):               # the ranks of a smaller last node do nothing
    _hierarchical(tensor, node_size, no_fold=True)


def hier_no_fold_runs_phases(tensor, node_size):
    """The learner's slip: no fold at all; the smaller last node's ranks run the three phases as if it were full,
    so one of them sends to a rank past the last (rank 2 sends to rank 3 at G = 3 in nodes of 2)."""
    rank, G = dist.get_rank(), dist.get_world_size()
    k = min(node_size, G)
    _three_phases(tensor, k, max(1, G // k), rank)


def hier_averages(tensor, node_size):             # divides by G before the result goes back: an average
    rank, G = dist.get_rank(), dist.get_world_size()
    k = min(node_size, G)
    M = max(1, G // k)
    if rank >= M * k:
        dist.send(tensor, rank - k)
        dist.recv(tensor, rank - k)
        return
    guest = rank + k if M * k <= rank + k < G else None
    if guest is not None:
        incoming = torch.empty_like(tensor)
        dist.recv(incoming, guest)
        tensor += incoming
    # the notebook's three phases (the fold is done above), then the division
    _three_phases(tensor, k, M, rank)
    tensor.div_(G)
    if guest is not None:
        dist.send(tensor, guest)


def _three_phases(tensor, k, M, rank):
    node, i = divmod(rank, k)
    right, left = node * k + (i + 1) % k, node * k + (i - 1) % k
    shards = torch.tensor_split(tensor, k)
    for s in range(k - 1):
        incoming = torch.empty_like(shards[(i - s - 1) % k])
        request = dist.isend(shards[(i - s) % k], right)
        dist.recv(incoming, left)
        request.wait()
        shards[(i - s - 1) % k].add_(incoming)
    pieces = torch.tensor_split(shards[(i + 1) % k], M)
    up, down = ((node + 1) % M) * k + i, ((node - 1) % M) * k + i
    for s in range(M - 1):
        incoming = torch.empty_like(pieces[(node - s - 1) % M])
        request = dist.isend(pieces[(node - s) % M], up)
        dist.recv(incoming, down)
        request.wait()
        pieces[(node - s - 1) % M].add_(incoming)
    for s in range(M - 1):
        request = dist.isend(pieces[(node + 1 - s) % M], up)
        dist.recv(pieces[(node - s) % M], down)
        request.wait()
    for s in range(k - 1):
        request = dist.isend(shards[(i + 1 - s) % k], right)
        dist.recv(shards[(i - s) % k], left)
        request.wait()


def hier_fold_into_rank_0(tensor, node_size):      # every folded rank hands its tensor to rank 0
    _hierarchical(tensor, node_size, fold_to_zero=True)


def hier_serial_ring(tensor, node_size):           # blocking send/recv, local rank 0 receives first: right, slow
    _hierarchical(tensor, node_size, serial_ring=True)


def hier_flat_ring(tensor, node_size):
    """A correct flat ring over all G ranks, ignoring node_size: right values, not the hierarchy."""
    rank, G = dist.get_rank(), dist.get_world_size()
    chunks = torch.tensor_split(tensor, G)
    right, left = (rank + 1) % G, (rank - 1) % G
    for s in range(G - 1):
        incoming = torch.empty_like(chunks[(rank - s - 1) % G])
        request = dist.isend(chunks[(rank - s) % G], right)
        dist.recv(incoming, left)
        request.wait()
        chunks[(rank - s - 1) % G].add_(incoming)
    for s in range(G - 1):
        request = dist.isend(chunks[(rank + 1 - s) % G], right)
        dist.recv(chunks[(rank - s) % G], left)
        request.wait()


CORRECT = [Entry("hierarchical_allreduce", hier_notebook, sizes=(1, 3, 4, 8)),
           Entry("hierarchical_allreduce", hier_p2p_own_left, sizes=(1, 3, 4, 8))]

BUGS = [
    Entry("hierarchical_allreduce", hier_rs_shard_plus, "reduce-scatter inside node 0 step 1: rank 0 (local rank 0) "
                                                        "sent rank 1 shard 1 of 3", sizes=(3,)),
    Entry("hierarchical_allreduce", hier_rs_overwrites, "it overwrote its shard with what it received", sizes=(3,)),
    Entry("hierarchical_allreduce", hier_rail_is_local_rank_0, "across: scatter-reduce step 0 on rail 1", sizes=(4,)),
    Entry("hierarchical_allreduce", hier_across_whole_tensor, "sent 4 elements to rank 2; piece 0 of 2 of shard 1 has "
                                                              "2 elements", sizes=(4,)),
    Entry("hierarchical_allreduce", hier_across_no_all_gather, "across: all-gather step 0", sizes=(4,)),
    Entry("hierarchical_allreduce", hier_across_gather_plus, "across: all-gather step", sizes=(8,)),
    Entry("hierarchical_allreduce", hier_no_inside_all_gather, "all-gather inside node 0 step 0", sizes=(3,)),
    Entry("hierarchical_allreduce", hier_inside_gather_adds, "no sum of distinct ranks", sizes=(3,)),
    Entry("hierarchical_allreduce", hier_no_fold, "fold: rank 2 sent nothing", sizes=(3,)),
    Entry("hierarchical_allreduce", hier_fold_into_rank_0, "fold: rank 6 sent to rank 0", sizes=(8,)),
    Entry("hierarchical_allreduce", hier_flat_ring, "reduce-scatter inside node 0 step 0: rank 0 (local rank 0) sent "
                                                    "2 elements to rank 1; shard 0 of 2 has 4 elements", sizes=(4,)),
    Entry("hierarchical_allreduce", hier_serial_ring, "the hierarchical schedule takes", sizes=(8,)),
]
