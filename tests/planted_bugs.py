"""Learner code for testing the exercise checks: correct solutions in several styles, and planted bugs.

Every correct solution must get full marks; every planted bug must lose points, and the first problem
the check reports must name the mistake (`expect`: a piece of that sentence). Used by
tests/test_exercises.py (on a few cases, to stay fast) and by benchmarks/exercise_catch_rate.py (on
every hidden case, to measure the catch rate).

Styles covered: torch.distributed called directly or through course_lib.p2p; blocking send/recv
ordered by even/odd rank, isend/recv, irecv posted first, several requests waited together; chunks
from torch.tensor_split, from narrow() with computed offsets, from manual slices; with and without
chunk labels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from torch.distributed import all_reduce as builtin_all_reduce   # a learner who imports the name directly

from course_lib import allreduce, fast_allreduce, p2p


def _rg():
    return dist.get_rank(), dist.get_world_size()


def _bounds(numel, G, c):
    base, extra = divmod(numel, G)
    start = c * base + min(c, extra)
    return start, start + base + (1 if c < extra else 0)


# --------------------------------------------------------------------------------------------------
# Correct solutions
# --------------------------------------------------------------------------------------------------

# ring_scatter_reduce ------------------------------------------------------------------------------

def rs_isend_recv(tensor):
    rank, G = _rg()
    chunks = torch.tensor_split(tensor, G)
    for s in range(G - 1):
        buffer = torch.empty_like(chunks[(rank - s - 1) % G])
        request = dist.isend(chunks[(rank - s) % G], (rank + 1) % G)
        dist.recv(buffer, (rank - 1) % G)
        request.wait()
        chunks[(rank - s - 1) % G].add_(buffer)
    return (rank + 1) % G


def rs_even_odd_narrow(tensor):
    rank, G = _rg()
    n = tensor.numel()
    chunk = lambda c: tensor.narrow(0, _bounds(n, G, c)[0], _bounds(n, G, c)[1] - _bounds(n, G, c)[0])  # noqa: E731
    for s in range(G - 1):
        outgoing = chunk((rank - s) % G).clone()
        incoming = torch.empty_like(chunk((rank - s - 1) % G))
        if rank % 2 == 0:
            p2p.send(outgoing, (rank + 1) % G)
            p2p.recv(incoming, (rank - 1) % G)
        else:
            p2p.recv(incoming, (rank - 1) % G)
            p2p.send(outgoing, (rank + 1) % G)
        chunk((rank - s - 1) % G).add_(incoming)
    return (rank + 1) % G


def rs_irecv_first_labelled(tensor):
    rank, G = _rg()
    for s in range(G - 1):
        send_c, recv_c = (rank - s) % G, (rank - s - 1) % G
        a, b = _bounds(tensor.numel(), G, recv_c)
        buffer = torch.empty(b - a)
        requests = [p2p.irecv(buffer, (rank - 1) % G, chunk=recv_c)]
        a2, b2 = _bounds(tensor.numel(), G, send_c)
        requests.append(p2p.isend(tensor[a2:b2], (rank + 1) % G, chunk=send_c))
        for request in requests:
            request.wait()
        tensor[a:b] += buffer
    return (rank + 1) % G


# ring_all_gather ---------------------------------------------------------------------------------

def ag_isend_recv(tensor):
    rank, G = _rg()
    chunks = torch.tensor_split(tensor, G)
    for s in range(G - 1):
        request = dist.isend(chunks[(rank + 1 - s) % G], (rank + 1) % G)
        dist.recv(chunks[(rank - s) % G], (rank - 1) % G)
        request.wait()


def ag_even_odd(tensor):
    rank, G = _rg()
    chunks = torch.tensor_split(tensor, G)
    for s in range(G - 1):
        outgoing, incoming = chunks[(rank + 1 - s) % G], chunks[(rank - s) % G]
        if rank % 2 == 0:
            p2p.send(outgoing, (rank + 1) % G)
            p2p.recv(incoming, (rank - 1) % G)
        else:
            p2p.recv(incoming, (rank - 1) % G)
            p2p.send(outgoing, (rank + 1) % G)


def ag_irecv_first(tensor):
    rank, G = _rg()
    for s in range(G - 1):
        a, b = _bounds(tensor.numel(), G, (rank - s) % G)
        a2, b2 = _bounds(tensor.numel(), G, (rank + 1 - s) % G)
        incoming = dist.irecv(tensor[a:b], (rank - 1) % G)
        outgoing = dist.isend(tensor[a2:b2], (rank + 1) % G)
        incoming.wait()
        outgoing.wait()


def ring_a(tensor):
    rs_isend_recv(tensor)
    ag_isend_recv(tensor)


def ring_b(tensor):
    rs_even_odd_narrow(tensor)
    ag_even_odd(tensor)


def ring_c(tensor):
    rs_irecv_first_labelled(tensor)
    ag_irecv_first(tensor)


# naive, parameter server ---------------------------------------------------------------------------

def naive_batched(tensor):
    rank, G = _rg()
    mine = tensor.clone()
    requests = [dist.isend(mine, peer) for peer in range(G) if peer != rank]
    for peer in range(G):
        if peer != rank:
            buffer = torch.empty_like(tensor)
            dist.recv(buffer, peer)
            tensor += buffer
    for request in requests:
        request.wait()


def naive_stepwise_p2p(tensor):
    rank, G = _rg()
    everyone = [None] * G
    everyone[rank] = tensor.clone()
    for k in range(1, G):
        request = p2p.isend(everyone[rank], (rank + k) % G)
        everyone[(rank - k) % G] = torch.empty_like(tensor)
        p2p.recv(everyone[(rank - k) % G], (rank - k) % G)
        request.wait()
    tensor.copy_(sum(everyone[1:], everyone[0].clone()))


def naive_irecv_all_first(tensor):
    rank, G = _rg()
    buffers = {peer: torch.empty_like(tensor) for peer in range(G) if peer != rank}
    receives = [dist.irecv(buffer, peer) for peer, buffer in buffers.items()]
    mine = tensor.clone()
    for peer in buffers:
        dist.send(mine, peer)
    for request in receives:
        request.wait()
    for buffer in buffers.values():
        tensor.add_(buffer)


def ps_blocking(tensor, root=0):
    rank, G = _rg()
    if rank == root:
        for peer in range(G):
            if peer != root:
                buffer = torch.empty_like(tensor)
                dist.recv(buffer, peer)
                tensor += buffer
        for peer in range(G):
            if peer != root:
                dist.send(tensor, peer)
    else:
        dist.send(tensor, root)
        dist.recv(tensor, root)


def ps_nonblocking_p2p(tensor, root=0):
    rank, G = _rg()
    if rank != root:
        p2p.isend(tensor.clone(), root).wait()
        p2p.recv(tensor, root)
        return
    buffers = {peer: torch.empty_like(tensor) for peer in range(G) if peer != root}
    for request in [p2p.irecv(b, peer) for peer, b in buffers.items()]:
        request.wait()
    for peer in sorted(buffers):
        tensor.add_(buffers[peer])
    for request in [p2p.isend(tensor, peer) for peer in buffers]:
        request.wait()


# broadcast, all_gather, token -----------------------------------------------------------------------

def broadcast_flat(tensor, src=0):
    rank, G = _rg()
    if rank == src:
        for peer in range(G):
            if peer != src:
                p2p.send(tensor, peer)
    else:
        p2p.recv(tensor, src)


def broadcast_tree(tensor, src=0):
    rank, G = _rg()
    me = (rank - src) % G
    mask = 1
    while mask < G:
        if me & mask:
            dist.recv(tensor, (me - mask + src) % G)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if me + mask < G:
            dist.send(tensor, (me + mask + src) % G)
        mask >>= 1


def all_gather_direct(tensor_list, tensor):
    rank, G = _rg()
    requests = [dist.isend(tensor, peer) for peer in range(G) if peer != rank]
    for peer in range(G):
        if peer == rank:
            tensor_list[peer].copy_(tensor)
        else:
            dist.recv(tensor_list[peer], peer)
    for request in requests:
        request.wait()


def all_gather_ring(tensor_list, tensor):
    rank, G = _rg()
    tensor_list[rank].copy_(tensor)
    for s in range(G - 1):
        request = p2p.isend(tensor_list[(rank - s) % G], (rank + 1) % G)
        p2p.recv(tensor_list[(rank - s - 1) % G], (rank - 1) % G)
        request.wait()


def token_isend(token):
    rank, G = _rg()
    seen = [token.clone()]
    for _ in range(G - 1):
        incoming = torch.empty_like(token)
        request = dist.isend(token, (rank + 1) % G)
        dist.recv(incoming, (rank - 1) % G)
        request.wait()
        token = incoming
        seen.append(token.clone())
    return seen


def token_even_odd_lists(token):
    rank, G = _rg()
    seen = [token.tolist()]
    for _ in range(G - 1):
        incoming = torch.empty_like(token)
        if rank % 2 == 0:
            p2p.send(token, (rank + 1) % G)
            p2p.recv(incoming, (rank - 1) % G)
        else:
            p2p.recv(incoming, (rank - 1) % G)
            p2p.send(token, (rank + 1) % G)
        token = incoming
        seen.append(token.tolist())
    return seen


# average_gradients ---------------------------------------------------------------------------------

def avg_per_parameter(model):
    G = dist.get_world_size()
    for parameter in model.parameters():
        flat = parameter.grad.reshape(-1).clone()
        ring_a(flat)
        parameter.grad.copy_(flat.view_as(parameter.grad) / G)


def avg_flat_buffer(model):
    G = dist.get_world_size()
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    naive_batched(flat)
    flat /= G
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def avg_course_lib_ring(model):
    G = dist.get_world_size()
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    allreduce.ring(flat)          # allowed here: the exercise is the step, not the ring
    offset = 0
    for p in model.parameters():
        p.grad = flat[offset:offset + p.numel()].view_as(p) / G
        offset += p.numel()


# --------------------------------------------------------------------------------------------------
# Planted bugs
# --------------------------------------------------------------------------------------------------

def rs_wrong_direction(tensor):
    rank, G = _rg()
    chunks = torch.tensor_split(tensor, G)
    for s in range(G - 1):
        buffer = torch.empty_like(chunks[(rank + s + 1) % G])
        request = dist.isend(chunks[(rank + s) % G], (rank - 1) % G)
        dist.recv(buffer, (rank + 1) % G)
        request.wait()
        chunks[(rank + s + 1) % G].add_(buffer)
    return (rank - 1) % G


def rs_off_by_one_chunk(tensor):
    rank, G = _rg()
    chunks = torch.tensor_split(tensor, G)
    for s in range(G - 1):
        buffer = torch.empty_like(chunks[(rank - s) % G])
        request = dist.isend(chunks[(rank - s + 1) % G], (rank + 1) % G)
        dist.recv(buffer, (rank - 1) % G)
        request.wait()
        chunks[(rank - s) % G].add_(buffer)
    return (rank + 2) % G


def rs_plus_instead_of_minus(tensor):
    # Sends chunk (r + s) but receives into chunk (r - s - 1): from step 1 on, sender and receiver
    # disagree about the chunk, and with uneven chunks about its size (gloo would abort the receiver).
    rank, G = _rg()
    chunks = torch.tensor_split(tensor, G)
    for s in range(G - 1):
        buffer = torch.empty_like(chunks[(rank - s - 1) % G])
        request = dist.isend(chunks[(rank + s) % G], (rank + 1) % G)
        dist.recv(buffer, (rank - 1) % G)
        request.wait()
        chunks[(rank - s - 1) % G].add_(buffer)
    return (rank + 1) % G


def rs_step_short(tensor):
    rank, G = _rg()
    chunks = torch.tensor_split(tensor, G)
    for s in range(G - 2):
        buffer = torch.empty_like(chunks[(rank - s - 1) % G])
        request = dist.isend(chunks[(rank - s) % G], (rank + 1) % G)
        dist.recv(buffer, (rank - 1) % G)
        request.wait()
        chunks[(rank - s - 1) % G].add_(buffer)
    return (rank + 1) % G


def rs_floor_division(tensor):
    rank, G = _rg()
    size = tensor.numel() // G
    chunk = lambda c: tensor[c * size:(c + 1) * size]  # noqa: E731 - the remainder never travels
    for s in range(G - 1):
        buffer = torch.empty(size)
        request = dist.isend(chunk((rank - s) % G), (rank + 1) % G)
        dist.recv(buffer, (rank - 1) % G)
        request.wait()
        chunk((rank - s - 1) % G).add_(buffer)
    return (rank + 1) % G


def rs_world_size_hard_coded(tensor):
    rank, G = dist.get_rank(), 4
    chunks = torch.tensor_split(tensor, G)
    for s in range(G - 1):
        buffer = torch.empty_like(chunks[(rank - s - 1) % G])
        request = p2p.isend(chunks[(rank - s) % G], (rank + 1) % G)
        p2p.recv(buffer, (rank - 1) % G)
        request.wait()
        chunks[(rank - s - 1) % G].add_(buffer)
    return (rank + 1) % G


def rs_overwrite(tensor):
    rank, G = _rg()
    chunks = torch.tensor_split(tensor, G)
    for s in range(G - 1):
        request = dist.isend(chunks[(rank - s) % G].clone(), (rank + 1) % G)
        dist.recv(chunks[(rank - s - 1) % G], (rank - 1) % G)   # overwrites instead of adding
        request.wait()
    return (rank + 1) % G


def rs_wrong_return(tensor):
    rs_isend_recv(tensor)
    return dist.get_rank()


def rs_builtin(tensor):
    dist.all_reduce(tensor)
    return (dist.get_rank() + 1) % dist.get_world_size()


def rs_builtin_imported_name(tensor):
    builtin_all_reduce(tensor)
    return (dist.get_rank() + 1) % dist.get_world_size()


def rs_course_lib(tensor):
    return allreduce.ring_scatter_reduce(tensor)


def rs_batch_isend_irecv(tensor):
    rank, G = _rg()
    chunks = torch.tensor_split(tensor, G)
    for s in range(G - 1):
        buffer = torch.empty_like(chunks[(rank - s - 1) % G])
        ops = [dist.P2POp(dist.isend, chunks[(rank - s) % G], (rank + 1) % G),
               dist.P2POp(dist.irecv, buffer, (rank - 1) % G)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        chunks[(rank - s - 1) % G].add_(buffer)
    return (rank + 1) % G


def rs_deadlock(tensor):
    rank, G = _rg()
    chunks = torch.tensor_split(tensor, G)
    for s in range(G - 1):
        buffer = torch.empty_like(chunks[(rank - s - 1) % G])
        dist.recv(buffer, (rank - 1) % G)                      # everyone receives first
        dist.send(chunks[(rank - s) % G], (rank + 1) % G)
        chunks[(rank - s - 1) % G].add_(buffer)
    return (rank + 1) % G


def rs_endless_loop(tensor):
    rank, G = _rg()
    step = 0
    while step < G - 1:          # forgets step += 1
        tensor.add_(0)
    return (rank + 1) % G


def rs_huge_print(tensor):
    for _ in range(3_000):
        print("debugging", tensor.tolist())
    return rs_isend_recv(tensor)


def rs_exception_on_one_rank(tensor):
    rank, G = _rg()
    if rank == 1:
        raise ValueError("rank 1 gave up")
    return rs_isend_recv(tensor)


def rs_not_in_place(tensor):
    return rs_isend_recv(tensor.clone())


def rs_whole_tensor(tensor):
    rank, G = _rg()
    for s in range(G - 1):
        buffer = torch.empty_like(tensor)
        request = dist.isend(tensor.clone(), (rank + 1) % G)
        dist.recv(buffer, (rank - 1) % G)
        request.wait()
        tensor += buffer
    return (rank + 1) % G


def rs_reversed_chunk(tensor):
    """Sends each chunk back to front: the tags look right (a chunk's values are all equal), only random data shows it."""
    rank, G = _rg()
    chunks = torch.tensor_split(tensor, G)
    for s in range(G - 1):
        buffer = torch.empty_like(chunks[(rank - s - 1) % G])
        request = dist.isend(chunks[(rank - s) % G].flip(0), (rank + 1) % G)
        dist.recv(buffer, (rank - 1) % G)
        request.wait()
        chunks[(rank - s - 1) % G].add_(buffer)
    return (rank + 1) % G


def rs_fails_on_short_tensors(tensor):
    """Right whenever every chunk has an element; N < G (hidden cases) breaks it."""
    rank, G = _rg()
    chunks = torch.tensor_split(tensor, G)
    first = [c[0].item() for c in chunks]          # IndexError on an empty chunk
    del first
    return rs_isend_recv(tensor)


def ag_wrong_chunk(tensor):
    rank, G = _rg()
    chunks = torch.tensor_split(tensor, G)
    for s in range(G - 1):
        request = dist.isend(chunks[(rank - s) % G], (rank + 1) % G)     # r - s instead of r + 1 - s
        dist.recv(chunks[(rank - s - 1) % G], (rank - 1) % G)
        request.wait()


def ag_adds(tensor):
    rank, G = _rg()
    chunks = torch.tensor_split(tensor, G)
    for s in range(G - 1):
        buffer = torch.empty_like(chunks[(rank - s) % G])
        request = dist.isend(chunks[(rank + 1 - s) % G], (rank + 1) % G)
        dist.recv(buffer, (rank - 1) % G)
        request.wait()
        chunks[(rank - s) % G].add_(buffer)                              # adds instead of overwriting


def ag_to_left(tensor):
    rank, G = _rg()
    chunks = torch.tensor_split(tensor, G)
    for s in range(G - 1):
        request = dist.isend(chunks[(rank + 1 + s) % G], (rank - 1) % G)
        dist.recv(chunks[(rank + 2 + s) % G], (rank + 1) % G)
        request.wait()


def ring_without_all_gather(tensor):
    rs_isend_recv(tensor)


def ring_phases_swapped(tensor):
    ag_isend_recv(tensor)
    rs_isend_recv(tensor)


def naive_sends_twice(tensor):
    rank, G = _rg()
    mine = tensor.clone()
    requests = [dist.isend(mine, peer) for peer in range(G) if peer != rank for _ in range(2)]
    for peer in range(G):
        if peer != rank:
            for _ in range(2):
                buffer = torch.empty_like(tensor)
                dist.recv(buffer, peer)
            tensor += buffer
    for request in requests:
        request.wait()


def naive_sends_running_sum(tensor):
    rank, G = _rg()
    for k in range(1, G):
        request = dist.isend(tensor.clone(), (rank + k) % G)     # a partial sum after the first step
        buffer = torch.empty_like(tensor)
        dist.recv(buffer, (rank - k) % G)
        request.wait()
        tensor += buffer


def naive_averages(tensor):
    naive_batched(tensor)
    tensor /= dist.get_world_size()


def ps_root_zero(tensor, root=0):
    ps_blocking(tensor, 0)


def ps_forgets_root_share(tensor, root=0):
    rank, G = _rg()
    if rank == root:
        total = torch.zeros_like(tensor)           # drops the root's own tensor
        for peer in range(G):
            if peer != root:
                buffer = torch.empty_like(tensor)
                dist.recv(buffer, peer)
                total += buffer
        tensor.copy_(total)
        for peer in range(G):
            if peer != root:
                dist.send(tensor, peer)
    else:
        dist.send(tensor, root)
        dist.recv(tensor, root)


def broadcast_from_zero(tensor, src=0):
    broadcast_flat(tensor, 0)


def broadcast_into_copy(tensor, src=0):
    rank, G = _rg()
    if rank == src:
        for peer in range(G):
            if peer != src:
                dist.send(tensor, peer)
    else:
        copy = torch.empty_like(tensor)
        dist.recv(copy, src)
        tensor = copy                              # rebinds the name; the caller's tensor is untouched


def broadcast_adds(tensor, src=0):
    rank, G = _rg()
    if rank == src:
        for peer in range(G):
            if peer != src:
                dist.send(tensor, peer)
    else:
        buffer = torch.empty_like(tensor)
        dist.recv(buffer, src)
        tensor += buffer


def all_gather_wrong_slot(tensor_list, tensor):
    rank, G = _rg()
    requests = [dist.isend(tensor, peer) for peer in range(G) if peer != rank]
    tensor_list[rank].copy_(tensor)
    for peer in range(G):
        if peer != rank:
            dist.recv(tensor_list[G - 1 - peer], peer)       # the slot counted from the wrong end
    for request in requests:
        request.wait()


def all_gather_no_own_slot(tensor_list, tensor):
    rank, G = _rg()
    requests = [dist.isend(tensor, peer) for peer in range(G) if peer != rank]
    for peer in range(G):
        if peer != rank:
            dist.recv(tensor_list[peer], peer)
    for request in requests:
        request.wait()


def token_keeps_own(token):
    rank, G = _rg()
    seen = [token.clone()]
    for _ in range(G - 1):
        incoming = torch.empty_like(token)
        request = dist.isend(token, (rank + 1) % G)      # always its own token
        dist.recv(incoming, (rank - 1) % G)
        request.wait()
        seen.append(incoming.clone())
    return seen


def token_to_left(token):
    rank, G = _rg()
    seen = [token.clone()]
    for _ in range(G - 1):
        incoming = torch.empty_like(token)
        request = dist.isend(token, (rank - 1) % G)
        dist.recv(incoming, (rank + 1) % G)
        request.wait()
        token = incoming
        seen.append(token.clone())
    return seen


def avg_sum_not_mean(model):
    for parameter in model.parameters():
        flat = parameter.grad.reshape(-1).clone()
        ring_a(flat)
        parameter.grad.copy_(flat.view_as(parameter.grad))


def avg_no_exchange(model):
    return None


def avg_divides_by_wrong_count(model):
    G = dist.get_world_size()
    for parameter in model.parameters():
        flat = parameter.grad.reshape(-1).clone()
        ring_a(flat)
        parameter.grad.copy_(flat.view_as(parameter.grad) / max(G - 1, 1))


# Ways round writing it: course_lib's other all-reduces, the built-in reached through torch's own module, and
# messages that carry no gradients next to a mean made some other way. Each must score 0 (test_exercises.py).

def ring_fast_allreduce(tensor):                  # for small tensors ring_pipelined sends exactly the ring's messages
    fast_allreduce.ring_pipelined(tensor)


def naive_recursive_doubling(tensor):
    fast_allreduce.recursive_doubling(tensor)


def ps_tree(tensor, root=0):
    fast_allreduce.tree(tensor)


def rs_builtin_through_c10d(tensor):
    dist.distributed_c10d.all_reduce(tensor)
    return (dist.get_rank() + 1) % dist.get_world_size()


def _padding(model):
    """Send as many elements as an all-reduce would, and none of them a gradient."""
    rank, G = _rg()
    if G > 1:
        count = sum(p.numel() for p in model.parameters())
        request = dist.isend(torch.zeros(count), (rank + 1) % G)
        dist.recv(torch.empty(count), (rank - 1) % G)
        request.wait()


def avg_padding_only(model):
    _padding(model)


def avg_padding_and_nan(model):                   # NaN compared with anything is False: is it "not different"?
    _padding(model)
    for parameter in model.parameters():
        parameter.grad.fill_(float("nan"))


def avg_padding_and_process_group(model):         # the built-in through the process group's own method
    _padding(model)
    G = dist.get_world_size()
    for parameter in model.parameters():
        dist.group.WORLD.allreduce([parameter.grad]).wait()
        parameter.grad /= G


# One-token slips: a correct solution above with one token changed, for the rubric's partial credit -------

def token_counts_to_g(token):                     # token_isend with range(G) for range(G - 1)
    rank, G = _rg()
    seen = [token.clone()]
    for _ in range(G):
        incoming = torch.empty_like(token)
        request = dist.isend(token, (rank + 1) % G)
        dist.recv(incoming, (rank - 1) % G)
        request.wait()
        token = incoming
        seen.append(token.clone())
    return seen


def token_forgets_own(token):                     # token_isend with seen = [] for seen = [token.clone()]
    rank, G = _rg()
    seen = []
    for _ in range(G - 1):
        incoming = torch.empty_like(token)
        request = dist.isend(token, (rank + 1) % G)
        dist.recv(incoming, (rank - 1) % G)
        request.wait()
        token = incoming
        seen.append(token.clone())
    return seen


def all_gather_recv_into_own_slot(tensor_list, tensor):   # all_gather_direct with tensor_list[rank] for [peer]
    rank, G = _rg()
    requests = [dist.isend(tensor, peer) for peer in range(G) if peer != rank]
    for peer in range(G):
        if peer == rank:
            tensor_list[peer].copy_(tensor)
        else:
            dist.recv(tensor_list[rank], peer)
    for request in requests:
        request.wait()


def naive_copies_instead_of_adding(tensor):       # naive_irecv_all_first with copy_ for add_
    rank, G = _rg()
    buffers = {peer: torch.empty_like(tensor) for peer in range(G) if peer != rank}
    receives = [dist.irecv(buffer, peer) for peer, buffer in buffers.items()]
    mine = tensor.clone()
    for peer in buffers:
        dist.send(mine, peer)
    for request in receives:
        request.wait()
    for buffer in buffers.values():
        tensor.copy_(buffer)


def ring_scatter_reduce_twice(tensor):            # ring_a with rs for the second phase's ag
    rs_isend_recv(tensor)
    rs_isend_recv(tensor)


def avg_divides_by_rank_count_minus_one(model):   # avg_per_parameter with G - 1 for G
    G = dist.get_world_size()
    for parameter in model.parameters():
        flat = parameter.grad.reshape(-1).clone()
        ring_a(flat)
        parameter.grad.copy_(flat.view_as(parameter.grad) / max(G - 1, 1))


# --------------------------------------------------------------------------------------------------
# The catalogue
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    exercise: str
    fn: Callable
    expect: str = ""          # for bugs: a piece of the first problem reported
    hidden_only: bool = False  # a bug only the hidden cases can catch

    @property
    def name(self) -> str:
        return self.fn.__name__


CORRECT = [
    Entry("ring_scatter_reduce", rs_isend_recv), Entry("ring_scatter_reduce", rs_even_odd_narrow),
    Entry("ring_scatter_reduce", rs_irecv_first_labelled),
    Entry("ring_all_gather", ag_isend_recv), Entry("ring_all_gather", ag_even_odd),
    Entry("ring_all_gather", ag_irecv_first),
    Entry("ring", ring_a), Entry("ring", ring_b), Entry("ring", ring_c),
    Entry("naive", naive_batched), Entry("naive", naive_stepwise_p2p), Entry("naive", naive_irecv_all_first),
    Entry("parameter_server", ps_blocking), Entry("parameter_server", ps_nonblocking_p2p),
    Entry("broadcast", broadcast_flat), Entry("broadcast", broadcast_tree),
    Entry("all_gather", all_gather_direct), Entry("all_gather", all_gather_ring),
    Entry("pass_token", token_isend), Entry("pass_token", token_even_odd_lists),
    Entry("average_gradients", avg_per_parameter), Entry("average_gradients", avg_flat_buffer),
    Entry("average_gradients", avg_course_lib_ring),
]

BUGS = [
    Entry("ring_scatter_reduce", rs_wrong_direction, "right neighbour"),
    Entry("ring_scatter_reduce", rs_off_by_one_chunk, "the ring sends chunk"),
    Entry("ring_scatter_reduce", rs_plus_instead_of_minus, "step 1: GPU-0 sent chunk 1 to GPU-1; the ring sends chunk"),
    Entry("ring_scatter_reduce", rs_step_short, "sent only"),
    Entry("ring_scatter_reduce", rs_floor_division, "tensor_split"),
    Entry("ring_scatter_reduce", rs_world_size_hard_coded, "world_size=1"),
    Entry("ring_scatter_reduce", rs_overwrite, "overwrote"),
    Entry("ring_scatter_reduce", rs_wrong_return, "returned"),
    Entry("ring_scatter_reduce", rs_builtin, "torch.distributed.all_reduce"),
    Entry("ring_scatter_reduce", rs_builtin_imported_name, "torch.distributed.all_reduce"),
    Entry("ring_scatter_reduce", rs_course_lib, "course_lib.allreduce.ring_scatter_reduce"),
    Entry("ring_scatter_reduce", rs_batch_isend_irecv, "torch.distributed.batch_isend_irecv"),
    Entry("ring_scatter_reduce", rs_deadlock, "deadlock"),
    Entry("ring_scatter_reduce", rs_endless_loop, "endless loop"),
    Entry("ring_scatter_reduce", rs_huge_print, "printed too much"),
    Entry("ring_scatter_reduce", rs_exception_on_one_rank, "rank 1 raised ValueError"),
    Entry("ring_scatter_reduce", rs_not_in_place, "not changed"),
    Entry("ring_scatter_reduce", rs_whole_tensor, "not one chunk"),
    Entry("ring_scatter_reduce", rs_reversed_chunk, "differs from the all-reduce"),
    Entry("ring_scatter_reduce", rs_fails_on_short_tensors, "IndexError", hidden_only=True),
    Entry("ring_all_gather", ag_wrong_chunk, "the ring sends chunk"),
    Entry("ring_all_gather", ag_adds, "did it add"),
    Entry("ring_all_gather", ag_to_left, "right neighbour"),
    Entry("ring", ring_without_all_gather, "sent only"),
    Entry("ring", ring_phases_swapped, "scatter-reduce step 0"),
    Entry("naive", naive_sends_twice, "sent 2 messages to rank"),
    Entry("naive", naive_sends_running_sum, "send your own input"),
    Entry("naive", naive_averages, "element"),
    Entry("parameter_server", ps_root_zero, "root it was given"),
    Entry("parameter_server", ps_forgets_root_share, "values are missing"),
    Entry("broadcast", broadcast_from_zero, "your code broadcast from rank 0"),
    Entry("broadcast", broadcast_into_copy, "still holds its own values"),
    Entry("broadcast", broadcast_adds, "does not add"),
    Entry("all_gather", all_gather_wrong_slot, "must hold rank j's tensor"),
    Entry("all_gather", all_gather_no_own_slot, "never written"),
    Entry("pass_token", token_keeps_own, "passed on its own token again"),
    Entry("pass_token", token_to_left, "right neighbour"),
    Entry("average_gradients", avg_sum_not_mean, "not their mean"),
    Entry("average_gradients", avg_no_exchange, "no GPU sent a message"),
    Entry("average_gradients", avg_divides_by_wrong_count, "mean"),
]

# Each scores 0 on every hidden case, not just less than full marks.
WAYS_ROUND = [
    Entry("ring", ring_fast_allreduce, "course_lib.fast_allreduce.ring_pipelined"),
    Entry("naive", naive_recursive_doubling, "course_lib.fast_allreduce.recursive_doubling"),
    Entry("parameter_server", ps_tree, "course_lib.fast_allreduce.tree"),
    Entry("ring_scatter_reduce", rs_builtin_through_c10d, "torch.distributed.all_reduce"),
    Entry("average_gradients", avg_padding_only, "carried the gradients of rank"),
    Entry("average_gradients", avg_padding_and_nan, "is nan"),
    Entry("average_gradients", avg_padding_and_process_group, "the process group's all_reduce"),
]
