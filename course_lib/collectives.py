"""The MPI-style collectives, written by hand from `course_lib.p2p` messages.

Same names, arguments and in-place behaviour as `torch.distributed`, so you can swap
``dist.all_gather(...)`` for ``collectives.all_gather(...)`` and compare. G = world size, r = rank:

    broadcast(tensor, src)            src's tensor is copied into every rank's tensor
    scatter(tensor, scatter_list, src)    rank j receives src's scatter_list[j]
    gather(tensor, gather_list, dst)      dst's gather_list[j] receives rank j's tensor
    all_gather(tensor_list, tensor)       every rank's tensor_list[j] receives rank j's tensor
    all_to_all(output_list, input_list)   rank r's output_list[j] receives rank j's input_list[r]
    reduce(tensor, dst, op)               dst's tensor becomes op over every rank's tensor
    all_reduce(tensor, op)                every rank's tensor becomes op over every rank's tensor
    reduce_scatter(output, input_list, op)  rank r's output becomes op over every rank's input_list[r]

Only the default process group is supported, and every call blocks until this rank's part is done
(no ``async_op``). Values are reduced in rank order 0, 1, ..., G-1 wherever a rank combines several,
so floating-point results do not depend on message timing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib import _checks, ops, p2p, traffic
from course_lib._util import contiguous_flat, flat_view

__all__ = ["broadcast", "scatter", "gather", "all_gather", "all_to_all", "reduce", "all_reduce",
           "reduce_scatter", "ReduceOp"]

ReduceOp = dist.ReduceOp


def _only_default_group(call, group, async_op):
    if group is not None:
        raise NotImplementedError(f"course_lib.collectives.{call} works on the default group only; pass group=None.")
    if async_op:
        raise NotImplementedError(f"course_lib.collectives.{call} always blocks until done; drop async_op=True.")


def _rank_and_size():
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("no torch.distributed process group is running here: call collectives inside a "
                           "function started by course_lib.launch (or under torchrun).")
    return dist.get_rank(), dist.get_world_size()


def _check_list(call, name, items, like, world_size):
    """A list of G tensors, each with as many elements as `like` and the same dtype."""
    if not isinstance(items, (list, tuple)) or len(items) != world_size:
        got = f"a {type(items).__name__}" if not isinstance(items, (list, tuple)) else f"{len(items)} entries"
        raise ValueError(f"{call}: {name} must be a list of world_size={world_size} tensors, got {got}.")
    for j, item in enumerate(items):
        if not isinstance(item, torch.Tensor):
            raise TypeError(f"{call}: {name}[{j}] is a {type(item).__name__}, not a torch.Tensor.")
        if isinstance(like, torch.Tensor) and (item.numel() != like.numel() or item.dtype != like.dtype):
            raise ValueError(f"{call}: {name}[{j}] has {item.numel()} elements of {item.dtype}, but the tensor "
                             f"has {like.numel()} of {like.dtype}; every entry must match it.")


def _root_list_check(call, name, items, like, root_name, root, rank, world_size):
    """The local check of a rooted collective's list: G tensors like `like` on the root, None elsewhere."""

    def local():
        if rank == root:
            _check_list(call, name, items, like, world_size)
        elif items is not None:
            raise ValueError(f"{call}: {name} must be None on ranks other than {root_name}={root} "
                             f"(rank {rank} passed one).")

    return local


def _recv_into(tensor, src, chunk=None):
    """Receive into `tensor`, through a contiguous buffer if `tensor` is a strided view."""
    if tensor.is_contiguous():
        p2p.recv(tensor, src, chunk=chunk)
    else:
        buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
        p2p.recv(buffer, src, chunk=chunk)
        tensor.copy_(buffer)


def _wait_all(requests):
    for request in requests:
        request.wait()


# --------------------------------------------------------------------------------------------------


def broadcast(tensor: torch.Tensor, src: int = 0, group=None, async_op: bool = False) -> None:
    """Copy `src`'s tensor into `tensor` on every rank (in place).

    The root sends the whole tensor to each of the G-1 others: (G-1) N elements, all from the root.
    """
    _only_default_group("broadcast", group, async_op)
    rank, world_size = _rank_and_size()
    _checks.prepare("broadcast", tensor, root=src)
    with flat_view(tensor) as flat, traffic.phase("broadcast"):
        if rank == src:
            _wait_all([p2p.isend(flat, dst) for dst in range(world_size) if dst != src])
        else:
            p2p.recv(flat, src)


def scatter(tensor: torch.Tensor, scatter_list=None, src: int = 0, group=None, async_op: bool = False) -> None:
    """Rank j receives ``scatter_list[j]`` from `src` into `tensor`.

    Args:
        tensor: output on every rank.
        scatter_list: on `src`, a list of G tensors shaped like `tensor`; None on the other ranks.
        src: the rank that holds the list.
    """
    _only_default_group("scatter", group, async_op)
    rank, world_size = _rank_and_size()

    local = _root_list_check("scatter", "scatter_list", scatter_list, tensor, "src", src, rank, world_size)
    _checks.prepare("scatter", tensor, root=src, local=local)
    with traffic.phase("scatter"):
        if rank == src:
            outgoing = {dst: contiguous_flat(scatter_list[dst]) for dst in range(world_size) if dst != src}
            requests = [p2p.isend(piece, dst, chunk=dst) for dst, piece in outgoing.items()]
            tensor.copy_(scatter_list[src].reshape(tensor.shape))
            _wait_all(requests)
        else:
            _recv_into(tensor, src, chunk=rank)


def gather(tensor: torch.Tensor, gather_list=None, dst: int = 0, group=None, async_op: bool = False) -> None:
    """`dst` receives every rank's `tensor`: rank j's lands in ``gather_list[j]``.

    Args:
        tensor: this rank's input.
        gather_list: on `dst`, a list of G tensors shaped like `tensor`; None on the other ranks.
        dst: the rank that collects.
    """
    _only_default_group("gather", group, async_op)
    rank, world_size = _rank_and_size()

    local = _root_list_check("gather", "gather_list", gather_list, tensor, "dst", dst, rank, world_size)
    _checks.prepare("gather", tensor, root=dst, local=local)
    with traffic.phase("gather"):
        if rank == dst:
            gather_list[dst].copy_(tensor.reshape(gather_list[dst].shape))
            for src in range(world_size):
                if src != dst:
                    _recv_into(gather_list[src], src, chunk=src)
        else:
            p2p.send(contiguous_flat(tensor), dst, chunk=rank)


def all_gather(tensor_list, tensor: torch.Tensor, group=None, async_op: bool = False) -> None:
    """Every rank's ``tensor_list[j]`` receives rank j's `tensor`.

    Written as a ring, like the second phase of ring all-reduce: in step s rank r passes the piece
    that started on rank (r - s) mod G to its right neighbour. Each rank sends (G-1) N elements.
    """
    _only_default_group("all_gather", group, async_op)
    rank, world_size = _rank_and_size()
    _checks.prepare("all_gather", tensor,
                    local=lambda: _check_list("all_gather", "tensor_list", tensor_list, tensor, world_size))
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    tensor_list[rank].copy_(tensor.reshape(tensor_list[rank].shape))
    with traffic.phase("all_gather"):
        for step in traffic.steps(world_size - 1):
            send_index, recv_index = (rank - step) % world_size, (rank - step - 1) % world_size
            request = p2p.isend(contiguous_flat(tensor_list[send_index]), right, chunk=send_index)
            _recv_into(tensor_list[recv_index], left, chunk=recv_index)
            request.wait()


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op: bool = False) -> None:
    """Rank r's ``output_tensor_list[j]`` receives rank j's ``input_tensor_list[r]``.

    A transpose of the G x G matrix of pieces. In step k rank r sends to r+k+1 and receives from
    r-k-1, so every pair meets exactly once. The pieces may differ in size, as in torch, but rank j's
    ``input_tensor_list[r]`` and rank r's ``output_tensor_list[j]`` must match.
    """
    _only_default_group("all_to_all", group, async_op)
    rank, world_size = _rank_and_size()

    def local():
        _check_list("all_to_all", "input_tensor_list", input_tensor_list, None, world_size)
        _check_list("all_to_all", "output_tensor_list", output_tensor_list, None, world_size)
        dtypes = {t.dtype for t in list(input_tensor_list) + list(output_tensor_list)}
        if len(dtypes) > 1:
            raise TypeError(f"all_to_all: every tensor must have the same dtype, got {sorted(map(str, dtypes))}.")

    first = input_tensor_list[0] if isinstance(input_tensor_list, (list, tuple)) and input_tensor_list else None
    _checks_all_to_all(rank, world_size, first, input_tensor_list, output_tensor_list, local)
    output_tensor_list[rank].copy_(input_tensor_list[rank].reshape(output_tensor_list[rank].shape))
    with traffic.phase("all_to_all"):
        for step in traffic.steps(world_size - 1):
            dst, src = (rank + step + 1) % world_size, (rank - step - 1) % world_size
            request = p2p.isend(contiguous_flat(input_tensor_list[dst]), dst, chunk=dst)
            _recv_into(output_tensor_list[src], src, chunk=rank)
            request.wait()


def _checks_all_to_all(rank, world_size, first, inputs, outputs, local):
    """Beyond the usual agreement: what j sends to r must have the size r expects from j."""
    problem = None
    try:
        local()
    except (TypeError, ValueError) as exc:
        problem = exc
    sizes = {}
    for j in range(world_size):
        sizes[f"in{j}"] = inputs[j].numel() if problem is None else -1
        sizes[f"out{j}"] = outputs[j].numel() if problem is None else -1
    dtype = _checks.dtype_code(first.dtype) if isinstance(first, torch.Tensor) and problem is None else -1
    table = _checks.agree("all_to_all", {"dtype": dtype, **sizes}, same=("dtype",), problem=problem,
                          device=_checks.metadata_device(first if isinstance(first, torch.Tensor) else None))
    wrong = [(j, r, table[j][f"in{r}"], table[r][f"out{j}"]) for r in range(len(table)) for j in range(len(table))
             if table[j][f"in{r}"] != table[r][f"out{j}"]]
    if wrong:
        j, r, sent, expected = wrong[0]
        raise _checks.MismatchError(
            f"all_to_all: rank {j}'s input_tensor_list[{r}] has {sent} elements but rank {r}'s "
            f"output_tensor_list[{j}] has room for {expected} ({len(wrong)} such pair(s)). The piece rank j sends "
            "to rank r must be exactly as large as the one rank r expects from rank j.")


def reduce(tensor: torch.Tensor, dst: int = 0, op=ReduceOp.SUM, group=None, async_op: bool = False) -> None:
    """`dst`'s tensor becomes op(every rank's tensor); the other ranks' tensors are left as they were.

    Every other rank sends its whole tensor to `dst`: (G-1) N elements arrive at one rank.
    """
    _only_default_group("reduce", group, async_op)
    rank, world_size = _rank_and_size()
    op = _checks.prepare("reduce", tensor, op=op, root=dst)
    with flat_view(tensor) as flat, traffic.phase("reduce"):
        if rank == dst:
            everyone = [flat.clone() if r == dst else torch.empty_like(flat) for r in range(world_size)]
            for src in range(world_size):
                if src != dst:
                    p2p.recv(everyone[src], src)
            ops.reduce_in_rank_order(flat, everyone, op)
        else:
            p2p.send(flat, dst)


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False) -> None:
    """Every rank's tensor becomes op(every rank's tensor), in place. Uses the ring algorithm.

    See `course_lib.allreduce` for the ring and for the naive and parameter-server variants.
    """
    from course_lib import allreduce  # one layer up (allreduce builds on these collectives)

    _only_default_group("all_reduce", group, async_op)
    _rank_and_size()
    op = _checks.prepare("all_reduce", tensor, op=op)
    with _checks.unchecked():  # agreed on above, under this function's name
        allreduce.ring(tensor, op)


def reduce_scatter(output: torch.Tensor, input_list, op=ReduceOp.SUM, group=None, async_op: bool = False) -> None:
    """Rank r's `output` becomes op over every rank's ``input_list[r]``.

    Each rank sends ``input_list[j]`` straight to rank j and reduces the G pieces it receives for
    itself, in rank order. Each rank sends (G-1) N / G elements when the pieces are N / G long; the
    ring's scatter-reduce phase (`allreduce.ring_scatter_reduce`) moves the same amount, neighbour to
    neighbour.
    """
    _only_default_group("reduce_scatter", group, async_op)
    rank, world_size = _rank_and_size()
    op = _checks.prepare("reduce_scatter", output, op=op,
                         local=lambda: _check_list("reduce_scatter", "input_list", input_list, output, world_size))
    pieces = [None] * world_size
    pieces[rank] = contiguous_flat(input_list[rank])
    with traffic.phase("reduce_scatter"):
        for step in traffic.steps(world_size - 1):
            dst, src = (rank + step + 1) % world_size, (rank - step - 1) % world_size
            request = p2p.isend(contiguous_flat(input_list[dst]), dst, chunk=dst)
            pieces[src] = torch.empty(output.numel(), dtype=output.dtype, device=output.device)
            p2p.recv(pieces[src], src, chunk=rank)
            request.wait()
    with flat_view(output) as flat:
        ops.reduce_in_rank_order(flat, pieces, op)
