"""Learner code for the exercises of notebooks 08-11 and the capstone: correct solutions in two or more
styles, and planted bugs, each with a piece of the first problem its check must report (`expect`).

Same catalogue format as tests/planted_bugs.py (which includes these entries): used by
tests/test_exercises_part2.py on a few cases and by benchmarks/exercise_catch_rate.py on every hidden case.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from course_lib import p2p
from course_lib.exercises.training_step import LR as LR_ZERO   # the learning rate the zero1_step check trains with


def _rg():
    return dist.get_rank(), dist.get_world_size()


# ==================================================================================================
# tree (notebook 11)
# ==================================================================================================


def tree_lowest_bit_p2p(tensor):
    """The notebook's tree: reduce step j, ranks with lowest set bit 2^j send to r - 2^j; blocking p2p."""
    rank, G = _rg()
    levels = (G - 1).bit_length()
    incoming = torch.empty_like(tensor)
    for j in range(levels):
        mask = 1 << j
        if rank % (2 * mask) == mask:
            p2p.send(tensor, rank - mask)
        elif rank % (2 * mask) == 0 and rank + mask < G:
            p2p.recv(incoming, rank + mask)
            tensor += incoming
    for j in reversed(range(levels)):
        mask = 1 << j
        if rank % (2 * mask) == 0 and rank + mask < G:
            p2p.send(tensor, rank + mask)
        elif rank % (2 * mask) == mask:
            p2p.recv(tensor, rank - mask)


def tree_highest_bit_dist(tensor):
    """The mirrored tree: the distance halves each reduce step (rank r sends to r minus its highest set bit),
    torch.distributed directly, isend + wait; a parent first collects all its children."""
    rank, G = _rg()
    parent = rank - (1 << (rank.bit_length() - 1)) if rank else None
    children = [rank + d for d in (1 << k for k in range(G.bit_length())) if d > rank and rank + d < G]
    for child in sorted(children, reverse=True):
        buffer = torch.zeros_like(tensor)
        dist.recv(buffer, child)
        tensor.add_(buffer)
    if parent is not None:
        dist.isend(tensor.clone(), parent).wait()
        dist.recv(tensor, parent)
    for child in sorted(children):
        dist.send(tensor, child)


def tree_parent_minus_one(tensor):                # tree_lowest_bit_p2p sending up to rank - 1
    rank, G = _rg()
    levels = (G - 1).bit_length()
    incoming = torch.empty_like(tensor)
    for j in range(levels):
        mask = 1 << j
        if rank % (2 * mask) == mask:
            p2p.send(tensor, rank - 1)
        elif rank % (2 * mask) == 0 and rank + mask < G:
            p2p.recv(incoming, rank + mask)
            tensor += incoming
    for j in reversed(range(levels)):
        mask = 1 << j
        if rank % (2 * mask) == 0 and rank + mask < G:
            p2p.send(tensor, rank + mask)
        elif rank % (2 * mask) == mask:
            p2p.recv(tensor, rank - mask)


def tree_overwrites_in_reduce(tensor):            # tree_lowest_bit_p2p with tensor.copy_(incoming) for +=
    rank, G = _rg()
    levels = (G - 1).bit_length()
    incoming = torch.empty_like(tensor)
    for j in range(levels):
        mask = 1 << j
        if rank % (2 * mask) == mask:
            p2p.send(tensor, rank - mask)
        elif rank % (2 * mask) == 0 and rank + mask < G:
            p2p.recv(incoming, rank + mask)
            tensor.copy_(incoming)
    for j in reversed(range(levels)):
        mask = 1 << j
        if rank % (2 * mask) == 0 and rank + mask < G:
            p2p.send(tensor, rank + mask)
        elif rank % (2 * mask) == mask:
            p2p.recv(tensor, rank - mask)


def tree_floor_log(tensor):                        # levels = floor(log2 G): one level short when G is no power of 2
    rank, G = _rg()
    levels = G.bit_length() - 1
    incoming = torch.empty_like(tensor)
    for j in range(levels):
        mask = 1 << j
        if rank % (2 * mask) == mask:
            p2p.send(tensor, rank - mask)
        elif rank % (2 * mask) == 0 and rank + mask < G:
            p2p.recv(incoming, rank + mask)
            tensor += incoming
    for j in reversed(range(levels)):
        mask = 1 << j
        if rank % (2 * mask) == 0 and rank + mask < G:
            p2p.send(tensor, rank + mask)
        elif rank % (2 * mask) == mask:
            p2p.recv(tensor, rank - mask)


def tree_broadcast_adds(tensor):                   # the broadcast receives into a buffer and adds it
    rank, G = _rg()
    levels = (G - 1).bit_length()
    incoming = torch.empty_like(tensor)
    for j in range(levels):
        mask = 1 << j
        if rank % (2 * mask) == mask:
            p2p.send(tensor, rank - mask)
        elif rank % (2 * mask) == 0 and rank + mask < G:
            p2p.recv(incoming, rank + mask)
            tensor += incoming
    for j in reversed(range(levels)):
        mask = 1 << j
        if rank % (2 * mask) == 0 and rank + mask < G:
            p2p.send(tensor, rank + mask)
        elif rank % (2 * mask) == mask:
            p2p.recv(incoming, rank - mask)
            tensor += incoming


def tree_reduce_only(tensor):                      # forgets the broadcast: only rank 0 has the sum
    rank, G = _rg()
    incoming = torch.empty_like(tensor)
    for j in range((G - 1).bit_length()):
        mask = 1 << j
        if rank % (2 * mask) == mask:
            p2p.send(tensor, rank - mask)
        elif rank % (2 * mask) == 0 and rank + mask < G:
            p2p.recv(incoming, rank + mask)
            tensor += incoming


def tree_broadcasts_inputs(tensor):                # sends a copy taken before the reduce: the input goes down
    rank, G = _rg()
    levels = (G - 1).bit_length()
    original = tensor.clone()
    incoming = torch.empty_like(tensor)
    for j in range(levels):
        mask = 1 << j
        if rank % (2 * mask) == mask:
            p2p.send(original, rank - mask)
        elif rank % (2 * mask) == 0 and rank + mask < G:
            p2p.recv(incoming, rank + mask)
            tensor += incoming
    for j in reversed(range(levels)):
        mask = 1 << j
        if rank % (2 * mask) == 0 and rank + mask < G:
            p2p.send(tensor, rank + mask)
        elif rank % (2 * mask) == mask:
            p2p.recv(tensor, rank - mask)


# ==================================================================================================
# halving_doubling (notebook 11)
# ==================================================================================================


def _fold_pairs(flat, rank, G, core):
    """The notebook's fold: ranks 0..2E-1 pair up, the even one hands its tensor to the odd one."""
    P = 1 << (G.bit_length() - 1)
    E = G - P
    if rank < 2 * E and rank % 2 == 0:
        p2p.send(flat, rank + 1)
        p2p.recv(flat, rank + 1)
        return
    if rank < 2 * E:
        incoming = torch.empty_like(flat)
        p2p.recv(incoming, rank - 1)
        flat += incoming
    virtual = rank // 2 if rank < 2 * E else rank - E
    real = lambda v: 2 * v + 1 if v < E else v + E  # noqa: E731
    core(flat, virtual, P, real)
    if rank < 2 * E:
        p2p.send(flat, rank - 1)


def _hd_blocks_core(flat, v, P, real, distances=None, same_order=False, keep_upper=False, whole=False):
    """Recursive halving over P tensor_split blocks, then doubling back; the distances P/2, ..., 1."""
    offsets = [0]
    for block in torch.tensor_split(flat, P):
        offsets.append(offsets[-1] + block.numel())
    lo, hi = 0, P
    steps = []
    for d in distances or [P >> (k + 1) for k in range(P.bit_length() - 1)]:
        partner = v ^ d
        mid = (lo + hi) // 2
        lower, upper = (lo, mid), (mid, hi)
        mine_lower = (v < partner) != keep_upper
        keep, give = (lower, upper) if mine_lower else (upper, lower)
        if whole:
            keep, give = (lo, hi), (lo, hi)
        steps.append((partner, keep, give))
        a, b = offsets[give[0]], offsets[give[1]]
        c, e = offsets[keep[0]], offsets[keep[1]]
        buffer = torch.empty(e - c)
        request = p2p.isend(flat[a:b].clone(), real(partner))
        p2p.recv(buffer, real(partner))
        request.wait()
        flat[c:e] += buffer
        lo, hi = keep
    for partner, keep, give in (steps if same_order else reversed(steps)):
        a, b = offsets[give[0]], offsets[give[1]]
        c, e = offsets[keep[0]], offsets[keep[1]]
        request = p2p.isend(flat[c:e].clone(), real(partner))
        p2p.recv(flat[a:b], real(partner))
        request.wait()


def hd_blocks_pairs(tensor):
    """The notebook's: P blocks from tensor_split, distance halving, lower rank keeps the lower half, pairs fold."""
    rank, G = _rg()
    _fold_pairs(tensor, rank, G, _hd_blocks_core)


def hd_elements_top_doubling(tensor):
    """Another style: halves cut at element midpoints, distances 1, 2, ..., P/2, torch.distributed directly,
    irecv posted first; the top E ranks fold into ranks 0..E-1."""
    rank, G = _rg()
    P = 1 << (G.bit_length() - 1)
    if rank >= P:
        dist.send(tensor, rank - P)
        dist.recv(tensor, rank - P)
        return
    if rank + P < G:
        incoming = torch.zeros_like(tensor)
        dist.recv(incoming, rank + P)
        tensor.add_(incoming)
    lo, hi, history = 0, tensor.numel(), []
    d = 1
    while d < P:
        partner = rank ^ d
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if rank & d == 0 else ((mid, hi), (lo, mid))
        buffer = torch.zeros(keep[1] - keep[0])
        receive = dist.irecv(buffer, partner)
        send = dist.isend(tensor[give[0]:give[1]].clone(), partner)
        receive.wait()
        send.wait()
        tensor[keep[0]:keep[1]] += buffer
        history.append((partner, keep, give))
        lo, hi = keep
        d *= 2
    for partner, keep, give in reversed(history):
        receive = dist.irecv(tensor[give[0]:give[1]], partner)
        send = dist.isend(tensor[keep[0]:keep[1]].clone(), partner)
        receive.wait()
        send.wait()
    if rank + P < G:
        dist.send(tensor, rank + P)


def hd_partner_plus(tensor):                     # partner (v + d) mod P instead of v XOR d (right for d = P/2 only)
    rank, G = _rg()

    def core(flat, v, P, real):
        d, lo, hi = P // 2, 0, flat.numel()
        steps = []
        while d >= 1:
            to, source = (v + d) % P, (v - d) % P
            mid = (lo + hi) // 2
            keep, give = ((lo, mid), (mid, hi)) if v & d == 0 else ((mid, hi), (lo, mid))
            buffer = torch.empty(keep[1] - keep[0])
            request = p2p.isend(flat[give[0]:give[1]].clone(), real(to))
            p2p.recv(buffer, real(source))
            request.wait()
            flat[keep[0]:keep[1]] += buffer
            steps.append((to, source, keep, give))
            lo, hi = keep
            d //= 2
        for to, source, keep, give in reversed(steps):
            request = p2p.isend(flat[keep[0]:keep[1]].clone(), real(source))
            p2p.recv(flat[give[0]:give[1]], real(to))
            request.wait()
    _fold_pairs(tensor, rank, G, core)


def hd_same_order_all_gather(tensor):            # the all-gather repeats the reduce-scatter's order
    rank, G = _rg()
    _fold_pairs(tensor, rank, G, lambda flat, v, P, real: _hd_blocks_core(flat, v, P, real, same_order=True))


def hd_both_keep_lower(tensor):                  # both partners keep the lower half
    rank, G = _rg()

    def core(flat, v, P, real):
        offsets = [0]
        for block in torch.tensor_split(flat, P):
            offsets.append(offsets[-1] + block.numel())
        lo, hi, steps = 0, P, []
        d = P // 2
        while d >= 1:
            partner = v ^ d
            mid = (lo + hi) // 2
            keep, give = (lo, mid), (mid, hi)
            buffer = torch.empty(offsets[keep[1]] - offsets[keep[0]])
            request = p2p.isend(flat[offsets[give[0]]:offsets[give[1]]].clone(), real(partner))
            p2p.recv(buffer, real(partner))
            request.wait()
            flat[offsets[keep[0]]:offsets[keep[1]]] += buffer
            steps.append((partner, keep, give))
            lo, hi = keep
            d //= 2
        for partner, keep, give in reversed(steps):
            request = p2p.isend(flat[offsets[keep[0]]:offsets[keep[1]]].clone(), real(partner))
            p2p.recv(flat[offsets[give[0]]:offsets[give[1]]], real(partner))
            request.wait()
    _fold_pairs(tensor, rank, G, core)


def hd_step_short(tensor):                       # one halving step fewer: range(m - 1)
    rank, G = _rg()
    _fold_pairs(tensor, rank, G, lambda flat, v, P, real: _hd_blocks_core(
        flat, v, P, real, distances=[P >> (k + 1) for k in range(max(P.bit_length() - 2, 0))]))


def hd_whole_tensor(tensor):                     # swaps the whole tensor every step (recursive doubling) twice over
    rank, G = _rg()
    _fold_pairs(tensor, rank, G, lambda flat, v, P, real: _hd_blocks_core(flat, v, P, real, whole=True))


def hd_no_fold(tensor):                          # power-of-two only: the extra ranks are left out
    rank, G = _rg()
    P = 1 << (G.bit_length() - 1)
    if rank >= P:
        return
    _hd_blocks_core(tensor, rank, P, lambda u: u)


def hd_no_unfold(tensor):                        # folds, but never sends the result back
    rank, G = _rg()
    P = 1 << (G.bit_length() - 1)
    E = G - P
    if rank < 2 * E and rank % 2 == 0:
        p2p.send(tensor, rank + 1)
        return
    if rank < 2 * E:
        incoming = torch.empty_like(tensor)
        p2p.recv(incoming, rank - 1)
        tensor += incoming
    virtual = rank // 2 if rank < 2 * E else rank - E
    _hd_blocks_core(tensor, virtual, P, lambda v: 2 * v + 1 if v < E else v + E)


def hd_floor_halves(tensor):                     # halves of N // 2: the last element is never sent
    rank, G = _rg()
    P = 1 << (G.bit_length() - 1)
    if G != P:
        return hd_blocks_pairs(tensor)
    lo, hi, history, d = 0, tensor.numel(), [], P // 2
    size = tensor.numel()
    while d >= 1:
        partner = rank ^ d
        half = size // 2
        keep, give = ((lo, lo + half), (lo + half, lo + 2 * half)) if rank < partner else \
            ((lo + half, lo + 2 * half), (lo, lo + half))
        buffer = torch.empty(keep[1] - keep[0])
        request = p2p.isend(tensor[give[0]:give[1]].clone(), partner)
        p2p.recv(buffer, partner)
        request.wait()
        tensor[keep[0]:keep[1]] += buffer
        history.append((partner, keep, give))
        lo, hi = keep
        size = half
        d //= 2
    for partner, keep, give in reversed(history):
        request = p2p.isend(tensor[keep[0]:keep[1]].clone(), partner)
        p2p.recv(tensor[give[0]:give[1]], partner)
        request.wait()


# ==================================================================================================
# fit_alpha_beta (notebook 10)
# ==================================================================================================


def fit_lstsq_rows_over_t(sizes, times):
    """numpy: divide every row of X = [1, n] and t by t, then lstsq."""
    import numpy as np

    t = np.array(times)
    X = np.column_stack([np.ones(len(sizes)), np.array(sizes)]) / t[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(X, t / t, rcond=None)
    return alpha, beta


def fit_normal_equations(sizes, times):
    """Pure Python: the 2 x 2 normal equations of sum ((a + b n - t) / t)^2, solved by Cramer's rule."""
    w = [1 / t ** 2 for t in times]
    s1 = sum(w)
    sn = sum(wi * n for wi, n in zip(w, sizes))
    snn = sum(wi * n * n for wi, n in zip(w, sizes))
    st = sum(wi * t for wi, t in zip(w, times))
    snt = sum(wi * n * t for wi, n, t in zip(w, sizes, times))
    det = s1 * snn - sn * sn
    return (st * snn - sn * snt) / det, (s1 * snt - sn * st) / det


def fit_polyfit_weights(sizes, times):
    """np.polyfit's w multiplies each residual: w = 1/t is the relative error."""
    import numpy as np

    beta, alpha = np.polyfit(np.array(sizes, dtype=float), np.array(times), 1, w=1 / np.array(times))
    return float(alpha), float(beta)


def fit_swapped(sizes, times):                    # returns (beta, alpha)
    alpha, beta = fit_lstsq_rows_over_t(sizes, times)
    return beta, alpha


def fit_bandwidth(sizes, times):                  # returns 1/beta, the bandwidth, for beta
    alpha, beta = fit_lstsq_rows_over_t(sizes, times)
    return alpha, 1 / beta


def fit_milliseconds(sizes, times):               # alpha in ms
    alpha, beta = fit_lstsq_rows_over_t(sizes, times)
    return alpha * 1e3, beta


def fit_sizes_in_mib(sizes, times):               # sizes converted to MiB first: beta per MiB
    return fit_lstsq_rows_over_t([n / 2 ** 20 for n in sizes], times)


def fit_plain_least_squares(sizes, times):        # unweighted: the 64 MiB point dominates
    import numpy as np

    X = np.column_stack([np.ones(len(sizes)), np.array(sizes)])
    (alpha, beta), *_ = np.linalg.lstsq(X, np.array(times), rcond=None)
    return alpha, beta


def fit_through_origin(sizes, times):             # no column of ones: alpha forced to 0
    import numpy as np

    n, t = np.array(sizes), np.array(times)
    return 0.0, float((n / t) @ np.ones_like(t) / ((n / t) @ (n / t)))


def fit_two_endpoints(sizes, times):              # the line through the smallest and the largest point
    beta = (times[-1] - times[0]) / (sizes[-1] - sizes[0])
    return times[0] - beta * sizes[0], beta


def fit_weights_squared(sizes, times):            # polyfit with w = 1/t^2: residuals divided by t twice
    import numpy as np

    beta, alpha = np.polyfit(np.array(sizes, dtype=float), np.array(times), 1, w=1 / np.array(times) ** 2)
    return float(alpha), float(beta)


# ==================================================================================================
# beat_the_ring (notebook 11's capstone)
# ==================================================================================================


def _ring(tensor):
    """The learner's ring from notebook 05: scatter-reduce then all-gather, isend + recv."""
    rank, G = _rg()
    chunks = torch.tensor_split(tensor, G)
    for s in range(G - 1):
        buffer = torch.empty_like(chunks[(rank - s - 1) % G])
        request = dist.isend(chunks[(rank - s) % G], (rank + 1) % G)
        dist.recv(buffer, (rank - 1) % G)
        request.wait()
        chunks[(rank - s - 1) % G].add_(buffer)
    for s in range(G - 1):
        request = dist.isend(chunks[(rank + 1 - s) % G], (rank + 1) % G)
        dist.recv(chunks[(rank - s) % G], (rank - 1) % G)
        request.wait()


def _recursive_doubling(tensor, blocking=False):
    """Swap the whole tensor with the rank 2^j away, log2 P times; fold like halving-doubling otherwise."""
    rank, G = _rg()

    def core(flat, v, P, real):
        incoming = torch.empty_like(flat)
        d = 1
        while d < P:
            partner = real(v ^ d)
            if blocking and v & d:
                p2p.recv(incoming, partner)
                p2p.send(flat, partner)
            elif blocking:
                p2p.send(flat, partner)
                p2p.recv(incoming, partner)
            else:
                request = p2p.isend(flat.clone(), partner)
                p2p.recv(incoming, partner)
                request.wait()
            flat += incoming
            d *= 2
    _fold_pairs(tensor, rank, G, core)


def beat_ring_only(tensor, link):
    """The plain ring everywhere: correct, and what the capstone is to beat."""
    _ring(tensor)


def beat_tuned_by_prediction(tensor, link):
    """The learner's tuner: whichever of its own schedules the alpha-beta model says is fastest on this link."""
    G = dist.get_world_size()
    own = {"ring": _ring, "recursive_doubling": _recursive_doubling, "halving_doubling": hd_blocks_pairs,
           "tree": tree_lowest_bit_p2p}
    nbytes = tensor.numel() * tensor.element_size()
    name = min(own, key=lambda n: link.predict(n, nbytes, G))
    own[name](tensor)


def beat_size_thresholds(tensor, link):
    """Another style: the crossover worked out by hand from the alpha-beta costs (G a power of two, P = G):
    recursive doubling, log2 P (a + N/B), beats halving-doubling, 2 log2 P a + 2(P-1)/P N/B, while
    N < log2 P a B / (log2 P - 2(P-1)/P); above it halving-doubling (the ring never wins on this model)."""
    G = dist.get_world_size()
    P = 1 << (G.bit_length() - 1)
    steps = P.bit_length() - 1
    nbytes = tensor.numel() * tensor.element_size()
    denominator = steps - 2 * (P - 1) / P
    crossover = steps * link.latency * link.bandwidth / denominator if denominator > 0 else float("inf")
    if nbytes < crossover:
        _recursive_doubling(tensor)
    else:
        hd_elements_top_doubling(tensor)


def beat_blocking_doubling(tensor, link):        # beat_size_thresholds with blocking, ordered sends in the swaps
    G = dist.get_world_size()
    P = 1 << (G.bit_length() - 1)
    steps = P.bit_length() - 1
    nbytes = tensor.numel() * tensor.element_size()
    denominator = steps - 2 * (P - 1) / P
    crossover = steps * link.latency * link.bandwidth / denominator if denominator > 0 else float("inf")
    if nbytes < crossover:
        _recursive_doubling(tensor, blocking=True)
    else:
        hd_elements_top_doubling(tensor)


def beat_crossover_in_megabytes(tensor, link):   # the crossover computed with the bandwidth in MB/s: always halving-doubling
    G = dist.get_world_size()
    P = 1 << (G.bit_length() - 1)
    steps = P.bit_length() - 1
    nbytes = tensor.numel() * tensor.element_size()
    crossover = steps * link.latency * (link.bandwidth / 1e6) / max(steps - 2 * (P - 1) / P, 1e-9)
    if nbytes < crossover:
        _recursive_doubling(tensor)
    else:
        hd_elements_top_doubling(tensor)


def beat_tree_for_small(tensor, link):           # the tree where recursive doubling belongs: twice the latencies
    G = dist.get_world_size()
    nbytes = tensor.numel() * tensor.element_size()
    if link.predict("recursive_doubling", nbytes, G) <= link.predict("halving_doubling", nbytes, G):
        tree_lowest_bit_p2p(tensor)
    else:
        hd_blocks_pairs(tensor)


def beat_tree_or_ring(tensor, link):              # the tree below the tree-ring crossover, the ring above it
    """A chooser told as 'where the tree stops beating the ring': the best of those two, never recursive doubling or
    halving-doubling, which beat the tree below its crossover and the ring above it."""
    G = dist.get_world_size()
    nbytes = tensor.numel() * tensor.element_size()
    if link.predict("tree", nbytes, G) < link.predict("ring", nbytes, G):
        tree_lowest_bit_p2p(tensor)
    else:
        _ring(tensor)


def beat_doubling_keeps_copy(tensor, link):      # recursive doubling that adds into a copy and never writes back
    G = dist.get_world_size()
    nbytes = tensor.numel() * tensor.element_size()
    if link.predict("recursive_doubling", nbytes, G) <= link.predict("halving_doubling", nbytes, G):
        _recursive_doubling(tensor.clone())
    else:
        hd_blocks_pairs(tensor)


# ==================================================================================================
# ring_hook (notebook 09)
# ==================================================================================================


def _done(tensor):
    future = torch.futures.Future()
    future.set_result(tensor)
    return future


def hook_divide_then_ring(state, bucket):
    """As DDP's own hook: divide by G first (no overflow in fp16), then the ring, in place on the buffer."""
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size())
    _ring(buffer)
    return _done(buffer)


def hook_ring_on_a_copy_then_divide(state, bucket):
    """Another style: the ring on a flat copy through course_lib.p2p, divided afterwards, a new tensor returned."""
    rank, G = _rg()
    flat = bucket.buffer().clone()
    chunks = torch.tensor_split(flat, G)
    for s in range(G - 1):
        incoming = torch.empty_like(chunks[(rank - s - 1) % G])
        if rank % 2 == 0:
            p2p.send(chunks[(rank - s) % G].clone(), (rank + 1) % G)
            p2p.recv(incoming, (rank - 1) % G)
        else:
            p2p.recv(incoming, (rank - 1) % G)
            p2p.send(chunks[(rank - s) % G].clone(), (rank + 1) % G)
        chunks[(rank - s - 1) % G].add_(incoming)
    for s in range(G - 1):
        request = p2p.isend(chunks[(rank + 1 - s) % G].clone(), (rank + 1) % G)
        p2p.recv(chunks[(rank - s) % G], (rank - 1) % G)
        request.wait()
    return _done(flat / G)


def hook_sum_not_mean(state, bucket):             # hook_divide_then_ring without the division
    buffer = bucket.buffer()
    _ring(buffer)
    return _done(buffer)


def hook_no_exchange(state, bucket):              # divides, but never all-reduces
    buffer = bucket.buffer()
    return _done(buffer.div_(dist.get_world_size()))


def hook_reduces_twice(state, bucket):            # the ring twice over the bucket
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size())
    _ring(buffer)
    _ring(buffer)
    return _done(buffer)


def hook_returns_tensor(state, bucket):           # returns the tensor itself instead of a Future
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size())
    _ring(buffer)
    return buffer


def hook_ring_to_the_left(state, bucket):         # the ring turned the other way: sends to r - 1
    rank, G = _rg()
    buffer = bucket.buffer()
    buffer.div_(G)
    chunks = torch.tensor_split(buffer, G)
    for s in range(G - 1):
        incoming = torch.empty_like(chunks[(rank + s + 1) % G])
        request = dist.isend(chunks[(rank + s) % G], (rank - 1) % G)
        dist.recv(incoming, (rank + 1) % G)
        request.wait()
        chunks[(rank + s + 1) % G].add_(incoming)
    for s in range(G - 1):
        request = dist.isend(chunks[(rank - 1 + s) % G], (rank - 1) % G)
        dist.recv(chunks[(rank + s) % G], (rank + 1) % G)
        request.wait()
    return _done(buffer)


def hook_divides_by_g_minus_one(state, bucket):   # hook_divide_then_ring with G - 1 for G
    buffer = bucket.buffer()
    buffer.div_(max(dist.get_world_size() - 1, 1))
    _ring(buffer)
    return _done(buffer)


# ==================================================================================================
# overlapped_buckets (notebook 11)
# ==================================================================================================


def overlap_counters(buckets, start_allreduce):
    """Count the gradients each bucket still waits for; the hook of its last one copies them into a flat buffer and
    starts the bucket. finish() waits in bucket order, divides by G and copies back."""
    G = dist.get_world_size()
    missing = [len(bucket) for bucket in buckets]
    flats, handles = [None] * len(buckets), [None] * len(buckets)

    def ready(k):
        missing[k] -= 1
        if missing[k] == 0:
            flats[k] = torch.cat([p.grad.reshape(-1) for p in buckets[k]])
            handles[k] = start_allreduce(k, flats[k])

    for k, bucket in enumerate(buckets):
        for p in bucket:
            p.register_post_accumulate_grad_hook(lambda _p, k=k: ready(k))

    def finish():
        for k, bucket in enumerate(buckets):
            handles[k].wait()
            for p, piece in zip(bucket, torch.split(flats[k] / G, [p.numel() for p in bucket])):
                p.grad.copy_(piece.view_as(p))
            missing[k] = len(bucket)
    return finish


def overlap_sets(buckets, start_allreduce):
    """Another style: a set of the parameters still pending per bucket (reset at the start of finish's loop), one
    preallocated flat buffer per bucket filled with narrow() and offsets, waited for last bucket first."""
    G = dist.get_world_size()
    where = {}
    buffers = []
    for k, bucket in enumerate(buckets):
        offset = 0
        for p in bucket:
            where[id(p)] = (k, offset)
            offset += p.numel()
        buffers.append(torch.zeros(offset))
    pending = [set(id(p) for p in bucket) for bucket in buckets]
    handles = {}

    def hook(p):
        k, offset = where[id(p)]
        buffers[k].narrow(0, offset, p.numel()).copy_(p.grad.reshape(-1))
        pending[k].discard(id(p))
        if not pending[k]:
            handles[k] = start_allreduce(k, buffers[k])

    for bucket in buckets:
        for p in bucket:
            p.register_post_accumulate_grad_hook(hook)

    def finish():
        for k in reversed(range(len(buckets))):
            handles.pop(k).wait()
            for p in buckets[k]:
                _, offset = where[id(p)]
                p.grad.copy_(buffers[k].narrow(0, offset, p.numel()).view_as(p) / G)
            pending[k] = set(id(p) for p in buckets[k])
    return finish


def overlap_starts_in_finish(buckets, start_allreduce):   # no hooks: every bucket starts after backward
    G = dist.get_world_size()

    def finish():
        flats = [torch.cat([p.grad.reshape(-1) for p in bucket]) for bucket in buckets]
        handles = [start_allreduce(k, flat) for k, flat in enumerate(flats)]
        for k, bucket in enumerate(buckets):
            handles[k].wait()
            for p, piece in zip(bucket, torch.split(flats[k] / G, [p.numel() for p in bucket])):
                p.grad.copy_(piece.view_as(p))
    return finish


def overlap_waits_in_hook(buckets, start_allreduce):       # overlap_counters waiting right after the start
    G = dist.get_world_size()
    missing = [len(bucket) for bucket in buckets]
    flats = [None] * len(buckets)

    def ready(k):
        missing[k] -= 1
        if missing[k] == 0:
            flats[k] = torch.cat([p.grad.reshape(-1) for p in buckets[k]])
            start_allreduce(k, flats[k]).wait()

    for k, bucket in enumerate(buckets):
        for p in bucket:
            p.register_post_accumulate_grad_hook(lambda _p, k=k: ready(k))

    def finish():
        for k, bucket in enumerate(buckets):
            for p, piece in zip(bucket, torch.split(flats[k] / G, [p.numel() for p in bucket])):
                p.grad.copy_(piece.view_as(p))
            missing[k] = len(bucket)
    return finish


def overlap_starts_on_first_gradient(buckets, start_allreduce):   # starts when the first gradient arrives
    G = dist.get_world_size()
    flats, handles = [None] * len(buckets), [None] * len(buckets)

    def ready(k, p):
        if handles[k] is None:
            flats[k] = torch.cat([q.grad.reshape(-1) if q.grad is not None else torch.zeros(q.numel())
                                  for q in buckets[k]])
            handles[k] = start_allreduce(k, flats[k])

    for k, bucket in enumerate(buckets):
        for p in bucket:
            p.register_post_accumulate_grad_hook(lambda p, k=k: ready(k, p))

    def finish():
        for k, bucket in enumerate(buckets):
            handles[k].wait()
            for p, piece in zip(bucket, torch.split(flats[k] / G, [p.numel() for p in bucket])):
                p.grad.copy_(piece.view_as(p))
            handles[k] = None
    return finish


def overlap_never_resets(buckets, start_allreduce):        # overlap_counters without resetting the counts
    G = dist.get_world_size()
    missing = [len(bucket) for bucket in buckets]
    flats, handles = [None] * len(buckets), [None] * len(buckets)

    def ready(k):
        missing[k] -= 1
        if missing[k] == 0:
            flats[k] = torch.cat([p.grad.reshape(-1) for p in buckets[k]])
            handles[k] = start_allreduce(k, flats[k])

    for k, bucket in enumerate(buckets):
        for p in bucket:
            p.register_post_accumulate_grad_hook(lambda _p, k=k: ready(k))

    def finish():
        for k, bucket in enumerate(buckets):
            handles[k].wait()
            for p, piece in zip(bucket, torch.split(flats[k] / G, [p.numel() for p in bucket])):
                p.grad.copy_(piece.view_as(p))
    return finish


def overlap_sum_not_mean(buckets, start_allreduce):        # overlap_counters without the division by G
    missing = [len(bucket) for bucket in buckets]
    flats, handles = [None] * len(buckets), [None] * len(buckets)

    def ready(k):
        missing[k] -= 1
        if missing[k] == 0:
            flats[k] = torch.cat([p.grad.reshape(-1) for p in buckets[k]])
            handles[k] = start_allreduce(k, flats[k])

    for k, bucket in enumerate(buckets):
        for p in bucket:
            p.register_post_accumulate_grad_hook(lambda _p, k=k: ready(k))

    def finish():
        for k, bucket in enumerate(buckets):
            handles[k].wait()
            for p, piece in zip(bucket, torch.split(flats[k], [p.numel() for p in bucket])):
                p.grad.copy_(piece.view_as(p))
            missing[k] = len(bucket)
    return finish


# ==================================================================================================
# zero1_step (notebook 11)
# ==================================================================================================


def _ring_reduce_scatter(flat):
    """The ring's scatter-reduce, shifted so that rank r ends owning chunk r (not r + 1): returns chunk r's sum."""
    rank, G = _rg()
    chunks = [c.clone() for c in torch.tensor_split(flat, G)]
    for s in range(G - 1):
        send_c, recv_c = (rank - s - 1) % G, (rank - s - 2) % G
        incoming = torch.empty_like(chunks[recv_c])
        request = dist.isend(chunks[send_c], (rank + 1) % G)
        dist.recv(incoming, (rank - 1) % G)
        request.wait()
        chunks[recv_c] += incoming
    return chunks[rank]


def _ring_all_gather_into(flat, mine):
    """The ring's all-gather: rank r starts with chunk r complete (`mine`) and ends with every chunk in `flat`."""
    rank, G = _rg()
    chunks = torch.tensor_split(flat, G)
    chunks[rank].copy_(mine)
    for s in range(G - 1):
        request = dist.isend(chunks[(rank - s) % G].clone(), (rank + 1) % G)
        dist.recv(chunks[(rank - s - 1) % G], (rank - 1) % G)
        request.wait()


def zero_ring(flat_params, momentum):
    """Reduce-scatter by a ring, SGD with momentum on shard r, all-gather by a ring."""
    rank, G = _rg()
    buffer = torch.zeros_like(torch.tensor_split(flat_params, G)[rank])

    def step(flat_grad):
        g = _ring_reduce_scatter(flat_grad) / G
        buffer.mul_(momentum).add_(g)
        shard = torch.tensor_split(flat_params, G)[rank]
        updated = shard - LR_ZERO * buffer
        _ring_all_gather_into(flat_params, updated)
    return step, [buffer]


def zero_direct(flat_params, momentum):
    """Another style: every rank sends each owner its chunk directly (isend to all), the owner sums and updates, then
    sends its shard to everyone; p2p calls, irecv posted first."""
    rank, G = _rg()
    sizes = [c.numel() for c in torch.tensor_split(flat_params, G)]
    state = {"buffer": torch.zeros(sizes[rank])}

    def step(flat_grad):
        pieces = torch.tensor_split(flat_grad, G)
        incoming = [torch.empty(sizes[rank]) for _ in range(G)]
        receives = [p2p.irecv(incoming[r], r) for r in range(G) if r != rank]
        sends = [p2p.isend(pieces[r].clone(), r) for r in range(G) if r != rank]
        for request in receives + sends:
            request.wait()
        incoming[rank] = pieces[rank].clone()
        g = torch.stack(incoming).sum(0) / G
        state["buffer"] = momentum * state["buffer"] + g
        shard = torch.tensor_split(flat_params, G)[rank]
        shard -= LR_ZERO * state["buffer"]
        chunks = torch.tensor_split(flat_params, G)
        receives = [p2p.irecv(chunks[r], r) for r in range(G) if r != rank]
        sends = [p2p.isend(shard.clone(), r) for r in range(G) if r != rank]
        for request in receives + sends:
            request.wait()
    return step, [state["buffer"]]


def zero_whole_tensor(flat_params, momentum):   # all-reduce of the whole gradient, momentum for every parameter
    rank, G = _rg()
    buffer = torch.zeros_like(flat_params)

    def step(flat_grad):
        g = flat_grad.clone()
        _ring(g)
        buffer.mul_(momentum).add_(g / G)
        flat_params.sub_(LR_ZERO * buffer)
    return step, [buffer]


def zero_gathers_into_wrong_slot(flat_params, momentum):   # zero_ring putting shard r into slot r + 1
    rank, G = _rg()
    buffer = torch.zeros_like(torch.tensor_split(flat_params, G)[rank])

    def step(flat_grad):
        g = _ring_reduce_scatter(flat_grad) / G
        buffer.mul_(momentum).add_(g)
        updated = torch.tensor_split(flat_params, G)[rank] - LR_ZERO * buffer
        gathered = [torch.empty(c.numel()) for c in torch.tensor_split(flat_params, G)]
        gathered[rank] = updated
        for s in range(G - 1):
            request = dist.isend(gathered[(rank - s) % G].clone(), (rank + 1) % G)
            dist.recv(gathered[(rank - s - 1) % G], (rank - 1) % G)
            request.wait()
        for c, chunk in enumerate(torch.tensor_split(flat_params, G)):
            source = gathered[(c - 1) % G]
            if source.numel() == chunk.numel():
                chunk.copy_(source)
    return step, [buffer]


def zero_sum_not_mean(flat_params, momentum):   # zero_ring without the division by G
    rank, G = _rg()
    buffer = torch.zeros_like(torch.tensor_split(flat_params, G)[rank])

    def step(flat_grad):
        g = _ring_reduce_scatter(flat_grad)
        buffer.mul_(momentum).add_(g)
        updated = torch.tensor_split(flat_params, G)[rank] - LR_ZERO * buffer
        _ring_all_gather_into(flat_params, updated)
    return step, [buffer]


def zero_gathers_gradients(flat_params, momentum):   # all-gathers the reduced gradient, every rank updates everything
    rank, G = _rg()
    buffer = torch.zeros_like(flat_params)

    def step(flat_grad):
        g = torch.zeros_like(flat_params)
        _ring_all_gather_into(g, _ring_reduce_scatter(flat_grad) / G)
        buffer.mul_(momentum).add_(g)
        flat_params.sub_(LR_ZERO * buffer)
    return step, [torch.tensor_split(buffer, G)[rank]]


def zero_momentum_forgotten(flat_params, momentum):   # a fresh buffer every step: plain SGD
    rank, G = _rg()

    def step(flat_grad):
        buffer = _ring_reduce_scatter(flat_grad) / G
        updated = torch.tensor_split(flat_params, G)[rank] - LR_ZERO * buffer
        _ring_all_gather_into(flat_params, updated)
    return step, [torch.zeros(torch.tensor_split(flat_params, G)[rank].numel())]


# ==================================================================================================
# The catalogue
# ==================================================================================================


@dataclass(frozen=True)
class Entry:
    """A solution or a planted bug. `sizes`: the world sizes the quick test runs it on (the benchmark runs every
    hidden case); `expect`: for a bug, a piece of the first problem reported."""

    exercise: str
    fn: Callable
    expect: str = ""
    sizes: tuple = (1, 3, 4)

    @property
    def name(self) -> str:
        return self.fn.__name__


CORRECT = [
    Entry("tree", tree_lowest_bit_p2p), Entry("tree", tree_highest_bit_dist, sizes=(1, 3, 4, 6)),
    Entry("halving_doubling", hd_blocks_pairs, sizes=(1, 3, 4, 6)),
    Entry("halving_doubling", hd_elements_top_doubling, sizes=(1, 3, 4, 6)),
]

CORRECT += [Entry("beat_the_ring", beat_tuned_by_prediction, sizes=(1, 3, 4, 8)),
            Entry("beat_the_ring", beat_size_thresholds, sizes=(1, 3, 4))]

# The capstone's quick test runs G = 4 only (the 16 MiB cases take seconds each)

CORRECT += [Entry("ring_hook", hook_divide_then_ring), Entry("ring_hook", hook_ring_on_a_copy_then_divide)]

CORRECT += [Entry("overlapped_buckets", overlap_counters), Entry("overlapped_buckets", overlap_sets),
            Entry("zero1_step", zero_ring), Entry("zero1_step", zero_direct)]

CORRECT += [Entry("fit_alpha_beta", fit_lstsq_rows_over_t, sizes=(1,)),
            Entry("fit_alpha_beta", fit_normal_equations, sizes=(1,)),
            Entry("fit_alpha_beta", fit_polyfit_weights, sizes=(1,))]

BUGS = [
    Entry("tree", tree_parent_minus_one, "in the binomial tree rank r sends its partial sum up to r minus its lowest "
                                         "set bit", sizes=(4,)),
    Entry("tree", tree_overwrites_in_reduce, "it overwrote its tensor with what it received"),
    Entry("tree", tree_floor_log, "rank 2 sent nothing in reduce step 1", sizes=(3,)),
    Entry("tree", tree_broadcast_adds, "it added the result it received"),
    Entry("tree", tree_reduce_only, "sent nothing in broadcast step"),
    Entry("tree", tree_broadcasts_inputs, "only its own input"),
    Entry("halving_doubling", hd_partner_plus, "pairs rank r with r XOR 1", sizes=(4,)),
    Entry("halving_doubling", hd_same_order_all_gather, "all-gather step 0: rank 0 sent to rank 2", sizes=(4,)),
    Entry("halving_doubling", hd_both_keep_lower, "each kept the half it gave away"),
    Entry("halving_doubling", hd_step_short, "reduce-scatter step 1: rank 0 sent to rank 2", sizes=(4,)),
    Entry("halving_doubling", hd_whole_tensor, "elements belong in reduce-scatter step 0"),
    Entry("halving_doubling", hd_no_fold, "sent nothing in fold step 0", sizes=(3,)),
    Entry("halving_doubling", hd_no_unfold, "sent nothing in unfold step 0", sizes=(3,)),
    Entry("halving_doubling", hd_floor_halves, "never covered it", sizes=(2,)),
    Entry("fit_alpha_beta", fit_swapped, "the two values are swapped", sizes=(1,)),
    Entry("fit_alpha_beta", fit_bandwidth, "is a bandwidth", sizes=(1,)),
    Entry("fit_alpha_beta", fit_milliseconds, "is in milliseconds", sizes=(1,)),
    Entry("fit_alpha_beta", fit_sizes_in_mib, "seconds per MiB", sizes=(1,)),
    Entry("fit_alpha_beta", fit_plain_least_squares, "That is ordinary least squares", sizes=(1,)),
    Entry("fit_alpha_beta", fit_through_origin, "not through the origin", sizes=(1,)),
    Entry("fit_alpha_beta", fit_two_endpoints, "the relative least-squares fit gives", sizes=(1,)),
    Entry("fit_alpha_beta", fit_weights_squared, "the relative least-squares fit gives", sizes=(1,)),
    Entry("beat_the_ring", beat_ring_only, "(exactly the ring's time), recursive doubling takes", sizes=(4,)),
    Entry("beat_the_ring", beat_blocking_doubling, "Your critical path has 4 latencies", sizes=(4,)),
    Entry("beat_the_ring", beat_crossover_in_megabytes, "Latencies dominate here", sizes=(4,)),
    Entry("beat_the_ring", beat_tree_for_small, "(exactly the tree's time)", sizes=(4,)),
    Entry("beat_the_ring", beat_tree_or_ring, "(exactly the tree's time)", sizes=(4,)),
    Entry("beat_the_ring", beat_doubling_keeps_copy, "was not changed", sizes=(4,)),
    Entry("ring_hook", hook_sum_not_mean, "the sum over the ranks, not the mean"),
    Entry("ring_hook", hook_no_exchange, "no GPU sent a message"),
    Entry("ring_hook", hook_reduces_twice, "the bucket was all-reduced twice"),
    Entry("ring_hook", hook_returns_tensor, "did not return a completed torch.futures.Future"),
    Entry("ring_hook", hook_ring_to_the_left, "your ring sends only to the right neighbour"),
    Entry("ring_hook", hook_divides_by_g_minus_one, "G - 1", sizes=(2, 3)),
    Entry("overlapped_buckets", overlap_starts_in_finish, "started after backward finished: nothing overlapped"),
    Entry("overlapped_buckets", overlap_waits_in_hook, "waited for inside backward"),
    Entry("overlapped_buckets", overlap_starts_on_first_gradient, "was started before its last gradient"),
    Entry("overlapped_buckets", overlap_never_resets, "step 1: rank 0's bucket 0"),
    Entry("overlapped_buckets", overlap_sum_not_mean, "not their mean"),
    Entry("zero1_step", zero_whole_tensor, "ZeRO-1 keeps only its shard's"),
    Entry("zero1_step", zero_gathers_into_wrong_slot, "Slot 0"),
    Entry("zero1_step", zero_sum_not_mean, "differ from plain data parallelism"),
    Entry("zero1_step", zero_gathers_gradients, "carried updated parameters"),
    Entry("zero1_step", zero_momentum_forgotten, "differ from plain data parallelism"),
]
