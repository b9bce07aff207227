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

As in torch:

* ``async_op=True`` returns at once with a `Work` handle; the collective runs on this rank's
  background thread, and its results are in your tensors when ``work.wait()`` returns (which also
  raises its error, if it had one). Several may be in flight: each rank runs its collectives in the
  order it called them, and a synchronous call waits for the async ones before it (`course_lib._work`)::

      work = collectives.all_reduce(grad, async_op=True)
      ...                       # compute meanwhile; do not touch grad
      work.wait()               # grad now holds the sum

* inputs and outputs may be the same tensors: ``reduce_scatter(input_list[rank], input_list)``,
  ``all_to_all(lst, lst)``, ``all_gather(tensor_list, tensor_list[rank])`` and the like give the
  result separate tensors would. Every collective reads all of its inputs before it overwrites them.
* ``scatter`` and ``gather`` take ``src`` / ``dst`` = None to mean rank 0, and ``[]`` for the list on
  the other ranks; ``broadcast`` and ``reduce`` need their root. ``group_src`` / ``group_dst`` name the
  same rank as ``src`` / ``dst`` (there is one group).

Where course_lib deliberately differs, the error says so: only the default group (every rank) is
supported, the reduce ops are SUM, AVG, PRODUCT, MAX and MIN, and SUM on bool tensors is refused.
Values are reduced in rank order 0, 1, ..., G-1 wherever a rank combines several, so floating-point
results do not depend on message timing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib import ops, p2p, runtime, traffic, _work
from course_lib.ops import contiguous_flat, flat_view

__all__ = ["broadcast", "scatter", "gather", "all_gather", "all_to_all", "reduce", "all_reduce",
           "reduce_scatter", "ReduceOp", "Work"]

ReduceOp = dist.ReduceOp
Work = _work.Work


def _start(call, async_op, outputs, body, *args):
    """Run a collective's `body` now, or (async_op=True) queue it on this rank's worker thread.

    Either way it runs without autograd, like torch's collectives: receiving into a parameter is not
    an operation to differentiate, nor is copying a tensor that requires grad into an output. (The
    worker always switches autograd off; here only when some tensor argument requires grad, since
    entering no_grad costs about a microsecond on every call.)
    """
    if async_op:
        checked = runtime.is_checking()       # the worker runs it checked as the caller's thread is now

        def job():
            with runtime.checking(checked):
                body(*args)

        return _work.submit(call, job, outputs)
    if torch.is_grad_enabled() and _any_requires_grad(args):
        with torch.no_grad():
            body(*args)
    else:
        body(*args)
    return None


def _any_requires_grad(args) -> bool:
    """Does a tensor among `args`, or in a list among them, require grad?"""
    for value in args:
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                return True
        elif isinstance(value, (list, tuple)) and any(isinstance(t, torch.Tensor) and t.requires_grad for t in value):
            return True
    return False


def _as_list(outputs) -> list:
    """The output tensors a Work's result() returns (whatever was passed; it is checked later)."""
    return list(outputs) if isinstance(outputs, (list, tuple)) else []


def _only_default_group(call, group):
    """course_lib's algorithms run on every rank of the default group; torch's subgroups are left out."""
    if group is None or group is dist.group.WORLD:
        return
    try:
        every_rank = dist.get_process_group_ranks(group) == list(range(dist.get_world_size()))
    except Exception:  # not a process group at all (or no process group running): refused below
        every_rank = False
    if every_rank:
        return  # a group of every rank, in order, is the default group under another name
    raise NotImplementedError(
        f"course_lib.collectives.{call} works on the default group (every rank) only: course_lib deliberately "
        "has no subgroups, so that every algorithm reads with ranks 0..G-1. Pass group=None (the ranks of a "
        f"subgroup can call torch.distributed.{call}(..., group=group) instead, or launch only the ranks you need).")


def _pick_root(call, name, value, group_value, default=None):
    """torch's pair src / group_src (or dst / group_dst) -> (the root rank, a local check).

    With one group the two name the same rank; as in torch, passing both is an error.
    """
    root = value if group_value is None else group_value

    def local():
        if value is not None and group_value is not None:
            raise ValueError(f"{call}: pass {name} or group_{name}, not both (got {name}={value!r}, "
                             f"group_{name}={group_value!r}); torch.distributed refuses both too.")

    return (default if root is None else root), local


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


def _root_list_check(call, name, items, like, root_name, root, rank, world_size, also):
    """The local check of a rooted collective's list: G tensors like `like` on the root; None or an
    empty list elsewhere (as torch allows). `also`: a further local check to run first."""

    def local():
        also()
        if rank == root:
            _check_list(call, name, items, like, world_size)
        elif items is not None and not (isinstance(items, (list, tuple)) and len(items) == 0):
            raise ValueError(f"{call}: {name} must be None or [] on ranks other than {root_name}={root} "
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


# Inputs and outputs may share memory (torch allows `all_to_all(lst, lst)`), so a collective must read
# an input before it writes an output on top of it. Where the order of the messages alone does not
# guarantee that, the input is copied first; these helpers tell when.


def _span(tensor):
    """The address range [first, end) of the bytes `tensor` can touch."""
    extent = tensor.numel() if tensor.is_contiguous() else \
        1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    first = tensor.data_ptr()
    return first, first + extent * tensor.element_size()


def _shares_memory(a, b) -> bool:
    """Could writing `a` change `b`? (Overlapping address ranges: never a false "no".)"""
    if a.numel() == 0 or b.numel() == 0:
        return False
    (a_first, a_end), (b_first, b_end) = _span(a), _span(b)
    return a_first < b_end and b_first < a_end


def _copy_into(output, source):
    """output <- source (reshaped), safe when the two overlap."""
    if output is source:
        return
    if _shares_memory(output, source):
        source = source.clone()
    output.copy_(source.reshape(output.shape))


def _unaliased(inputs, outputs):
    """`inputs`, with each one that shares memory with some output replaced by a private copy."""
    written = [_span(out) for out in outputs if out.numel()]

    def aliased(x):
        if x.numel() == 0:
            return False
        first, end = _span(x)
        return any(first < out_end and out_first < end for out_first, out_end in written)

    return [x.clone() if aliased(x) else x for x in inputs]


# --------------------------------------------------------------------------------------------------


def broadcast(tensor: torch.Tensor, src: int | None = None, group=None, async_op: bool = False,
              group_src: int | None = None):
    """Copy `src`'s tensor into `tensor` on every rank (in place).

    The root sends the whole tensor to each of the G-1 others: (G-1) N elements, all from the root.

    Args:
        tensor: the data on `src`; where the data lands on every other rank.
        src: the rank that holds the data (required, as in torch; `group_src` names it too).
        group: None (the default group, every rank); course_lib has no subgroups.
        async_op: return a `Work` at once and run in the background.

    Returns:
        A `Work` if async_op, else None.
    """
    _only_default_group("broadcast", group)
    src, local = _pick_root("broadcast", "src", src, group_src)
    return _start("broadcast", async_op, [tensor], _broadcast, tensor, src, local)


def _broadcast(tensor, src, local):
    rank, world_size = _rank_and_size()
    runtime.prepare("broadcast", tensor, root=src, root_name="src", local=local)
    with flat_view(tensor) as flat, traffic.phase("broadcast"):
        if rank == src:
            _wait_all([p2p.isend(flat, dst) for dst in range(world_size) if dst != src])
        else:
            p2p.recv(flat, src)


def scatter(tensor: torch.Tensor, scatter_list=None, src: int | None = None, group=None, async_op: bool = False,
            group_src: int | None = None):
    """Rank j receives ``scatter_list[j]`` from `src` into `tensor`.

    Args:
        tensor: output on every rank.
        scatter_list: on `src`, a list of G tensors shaped like `tensor` (`tensor` may be one of
            them); None or [] on the other ranks.
        src: the rank that holds the list; None means rank 0, as in torch.
        group, async_op: as in `broadcast`.

    Returns:
        A `Work` if async_op, else None.
    """
    _only_default_group("scatter", group)
    src, local = _pick_root("scatter", "src", src, group_src, default=0)
    return _start("scatter", async_op, [tensor], _scatter, tensor, scatter_list, src, local)


def _scatter(tensor, scatter_list, src, also):
    rank, world_size = _rank_and_size()
    local = _root_list_check("scatter", "scatter_list", scatter_list, tensor, "src", src, rank, world_size, also)
    runtime.prepare("scatter", tensor, root=src, root_name="src", local=local)
    with traffic.phase("scatter"):
        if rank == src:
            outgoing = {dst: contiguous_flat(scatter_list[dst]) for dst in range(world_size) if dst != src}
            _wait_all([p2p.isend(piece, dst, chunk=dst) for dst, piece in outgoing.items()])
            _copy_into(tensor, scatter_list[src])  # after the sends: `tensor` may be a piece that was sent
        else:
            _recv_into(tensor, src, chunk=rank)


def gather(tensor: torch.Tensor, gather_list=None, dst: int | None = None, group=None, async_op: bool = False,
           group_dst: int | None = None):
    """`dst` receives every rank's `tensor`: rank j's lands in ``gather_list[j]``.

    Args:
        tensor: this rank's input (on `dst` it may be one of the gather_list entries).
        gather_list: on `dst`, a list of G tensors shaped like `tensor`; None or [] on the other ranks.
        dst: the rank that collects; None means rank 0, as in torch.
        group, async_op: as in `broadcast`.

    Returns:
        A `Work` if async_op, else None.
    """
    _only_default_group("gather", group)
    dst, local = _pick_root("gather", "dst", dst, group_dst, default=0)
    return _start("gather", async_op, _as_list(gather_list), _gather, tensor, gather_list, dst, local)


def _gather(tensor, gather_list, dst, also):
    rank, world_size = _rank_and_size()
    local = _root_list_check("gather", "gather_list", gather_list, tensor, "dst", dst, rank, world_size, also)
    runtime.prepare("gather", tensor, root=dst, root_name="dst", local=local)
    with traffic.phase("gather"):
        if rank == dst:
            _copy_into(gather_list[dst], tensor)  # first: `tensor` may be an entry a message overwrites
            for src in range(world_size):
                if src != dst:
                    _recv_into(gather_list[src], src, chunk=src)
        else:
            p2p.send(contiguous_flat(tensor), dst, chunk=rank)


def all_gather(tensor_list, tensor: torch.Tensor, group=None, async_op: bool = False):
    """Every rank's ``tensor_list[j]`` receives rank j's `tensor`.

    Written as a ring, like the second phase of ring all-reduce: in step s rank r passes the piece
    that started on rank (r - s) mod G to its right neighbour. Each rank sends (G-1) N elements.
    `tensor` may be one of the entries of `tensor_list`.

    Returns:
        A `Work` if async_op, else None.
    """
    _only_default_group("all_gather", group)
    return _start("all_gather", async_op, _as_list(tensor_list), _all_gather, tensor_list, tensor)


def _all_gather(tensor_list, tensor):
    rank, world_size = _rank_and_size()
    runtime.prepare("all_gather", tensor,
                    local=lambda: _check_list("all_gather", "tensor_list", tensor_list, tensor, world_size))
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    _copy_into(tensor_list[rank], tensor)  # first: later steps may overwrite `tensor` if it is an entry
    with traffic.phase("all_gather"):
        for step in traffic.steps(world_size - 1):
            send_index, recv_index = (rank - step) % world_size, (rank - step - 1) % world_size
            request = p2p.isend(contiguous_flat(tensor_list[send_index]), right, chunk=send_index)
            _recv_into(tensor_list[recv_index], left, chunk=recv_index)
            request.wait()


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op: bool = False):
    """Rank r's ``output_tensor_list[j]`` receives rank j's ``input_tensor_list[r]``.

    A transpose of the G x G matrix of pieces. In step k rank r sends to r+k+1 and receives from
    r-k-1, so every pair meets exactly once. The pieces may differ in size, as in torch, but rank j's
    ``input_tensor_list[r]`` and rank r's ``output_tensor_list[j]`` must match. The two lists may be
    the same list, or share tensors: an input that shares memory with an output is copied first.

    Returns:
        A `Work` if async_op, else None.
    """
    _only_default_group("all_to_all", group)
    return _start("all_to_all", async_op, _as_list(output_tensor_list), _all_to_all, output_tensor_list,
                  input_tensor_list)


def _all_to_all(output_tensor_list, input_tensor_list):
    rank, world_size = _rank_and_size()

    def local():
        _check_list("all_to_all", "input_tensor_list", input_tensor_list, None, world_size)
        _check_list("all_to_all", "output_tensor_list", output_tensor_list, None, world_size)
        dtypes = {t.dtype for t in list(input_tensor_list) + list(output_tensor_list)}
        if len(dtypes) > 1:
            raise TypeError(f"all_to_all: every tensor must have the same dtype, got {sorted(map(str, dtypes))}.")

    first = input_tensor_list[0] if isinstance(input_tensor_list, (list, tuple)) and input_tensor_list else None
    _checks_all_to_all(rank, world_size, first, input_tensor_list, output_tensor_list, local)
    inputs = _unaliased(input_tensor_list, output_tensor_list)
    _copy_into(output_tensor_list[rank], inputs[rank])
    with traffic.phase("all_to_all"):
        for step in traffic.steps(world_size - 1):
            dst, src = (rank + step + 1) % world_size, (rank - step - 1) % world_size
            request = p2p.isend(contiguous_flat(inputs[dst]), dst, chunk=dst)
            _recv_into(output_tensor_list[src], src, chunk=rank)
            request.wait()


def _checks_all_to_all(rank, world_size, first, inputs, outputs, local):
    """Beyond the usual agreement: what j sends to r must have the size r expects from j."""
    runtime.drain()  # like runtime.prepare: run after the async collectives queued before this one
    problem = None
    try:
        local()
    except (TypeError, ValueError) as exc:
        problem = exc
    sizes = {}
    for j in range(world_size):
        sizes[f"in{j}"] = inputs[j].numel() if problem is None else -1
        sizes[f"out{j}"] = outputs[j].numel() if problem is None else -1
    dtype = runtime.dtype_code(first.dtype) if isinstance(first, torch.Tensor) and problem is None else -1
    table = runtime.agree("all_to_all", {"dtype": dtype, **sizes}, same=("dtype",), problem=problem,
                          device=runtime.metadata_device(first if isinstance(first, torch.Tensor) else None))
    wrong = [(j, r, table[j][f"in{r}"], table[r][f"out{j}"]) for r in range(len(table)) for j in range(len(table))
             if table[j][f"in{r}"] != table[r][f"out{j}"]]
    if wrong:
        j, r, sent, expected = wrong[0]
        raise runtime.MismatchError(
            f"all_to_all: rank {j}'s input_tensor_list[{r}] has {sent} elements but rank {r}'s "
            f"output_tensor_list[{j}] has room for {expected} ({len(wrong)} such pair(s)). The piece rank j sends "
            "to rank r must be exactly as large as the one rank r expects from rank j.")


def reduce(tensor: torch.Tensor, dst: int | None = None, op=ReduceOp.SUM, group=None, async_op: bool = False,
           group_dst: int | None = None):
    """`dst`'s tensor becomes op(every rank's tensor); the other ranks' tensors are left as they were.

    Every other rank sends its whole tensor to `dst`: (G-1) N elements arrive at one rank.

    Args:
        tensor: this rank's input; on `dst`, overwritten with the result.
        dst: the rank that receives the result (required, as in torch; `group_dst` names it too).
        op: SUM, AVG, PRODUCT, MAX or MIN (a torch ReduceOp, a ReduceOp object, or its name).
        group, async_op: as in `broadcast`.

    Returns:
        A `Work` if async_op, else None.
    """
    _only_default_group("reduce", group)
    dst, local = _pick_root("reduce", "dst", dst, group_dst)
    return _start("reduce", async_op, [tensor], _reduce, tensor, dst, op, local)


def _reduce(tensor, dst, op, local):
    rank, world_size = _rank_and_size()
    op = runtime.prepare("reduce", tensor, op=op, root=dst, root_name="dst", local=local)
    with flat_view(tensor) as flat, traffic.phase("reduce"):
        if rank == dst:
            everyone = [flat.clone() if r == dst else torch.empty_like(flat) for r in range(world_size)]
            for src in range(world_size):
                if src != dst:
                    p2p.recv(everyone[src], src)
            ops.reduce_in_rank_order(flat, everyone, op)
        else:
            p2p.send(flat, dst)


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    """Every rank's tensor becomes op(every rank's tensor), in place. Uses the ring algorithm.

    See `course_lib.allreduce` for the ring and for the naive and parameter-server variants.

    Returns:
        A `Work` if async_op, else None.
    """
    _only_default_group("all_reduce", group)
    return _start("all_reduce", async_op, [tensor], _all_reduce, tensor, op)


def _all_reduce(tensor, op):
    from course_lib import allreduce  # one layer up (allreduce builds on these collectives)

    _rank_and_size()
    op = runtime.prepare("all_reduce", tensor, op=op)
    with runtime.unchecked():  # agreed on above, under this function's name
        allreduce.ring(tensor, op)


def reduce_scatter(output: torch.Tensor, input_list, op=ReduceOp.SUM, group=None, async_op: bool = False):
    """Rank r's `output` becomes op over every rank's ``input_list[r]``.

    Each rank sends ``input_list[j]`` straight to rank j and reduces the G pieces it receives for
    itself, in rank order. Each rank sends (G-1) N / G elements when the pieces are N / G long; the
    ring's scatter-reduce phase (`allreduce.ring_scatter_reduce`) moves the same amount, neighbour to
    neighbour. `output` may be one of the entries of `input_list` (``input_list[rank]`` is usual).

    Returns:
        A `Work` if async_op, else None.
    """
    _only_default_group("reduce_scatter", group)
    return _start("reduce_scatter", async_op, [output], _reduce_scatter, output, input_list, op)


def _reduce_scatter(output, input_list, op):
    rank, world_size = _rank_and_size()
    op = runtime.prepare("reduce_scatter", output, op=op,
                         local=lambda: _check_list("reduce_scatter", "input_list", input_list, output, world_size))
    mine = contiguous_flat(input_list[rank])
    pieces = [None] * world_size
    # The result is written over `output` at the end; if that is this rank's own piece, keep a copy.
    pieces[rank] = mine.clone() if _shares_memory(output, input_list[rank]) else mine
    with traffic.phase("reduce_scatter"):
        for step in traffic.steps(world_size - 1):
            dst, src = (rank + step + 1) % world_size, (rank - step - 1) % world_size
            request = p2p.isend(contiguous_flat(input_list[dst]), dst, chunk=dst)
            pieces[src] = torch.empty(output.numel(), dtype=output.dtype, device=output.device)
            p2p.recv(pieces[src], src, chunk=rank)
            request.wait()
    with flat_view(output) as flat:
        ops.reduce_in_rank_order(flat, pieces, op)
