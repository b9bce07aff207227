"""Fewer bytes per gradient: three compressors, each a DDP communication hook that also runs in the hand-made trainer.

A communication hook gets one bucket of gradients (``bucket.buffer()``: a flat tensor; ``bucket.gradients()``:
one view per parameter) and returns a Future holding the bucket averaged over the ranks. Registered with
``ddp_model.register_comm_hook(state, hook)`` it replaces DDP's all-reduce; passed as
``training.train_data_parallel(..., comm_hook=hook, comm_hook_state=state)`` it replaces the hand-made
trainer's (which hands it every gradient as one bucket, laid out as DDP's bucket is after its first
step: last parameter first). All the communication is course_lib's, so `course_lib.traffic` counts it.
N = elements in the bucket, G = ranks, P = ceil(N / G); bytes each rank sends per bucket:

    uncompressed (ring all-reduce, fp32)    ~ 2 (G-1)/G N x 4                 (`ring_bytes`)

    low_precision_hook (bf16 or fp16, summed in fp32)                          (`low_precision_bytes`)
        each rank casts its gradient to 16 bits and sends piece j to rank j (all_to_all); rank j adds
        the G pieces it holds *in float32*, in rank order, divides by G, casts the mean to 16 bits and
        every rank all-gathers the means:  2 (G-1) P x 2 bytes, half the ring's. Two roundings to 16
        bits per element, never a 16-bit sum (the ring would round every partial sum; fp16 could overflow).

    powersgd_hook (Vogels et al., 2019; PyTorch's powerSGD_hook, step for step)  (`powersgd_sizes`, `powersgd_bytes`)
        each gradient viewed as a matrix M of n x m (first dimension x the rest) is sent as two thin
        matrices P = M Q (n x r) and Q = M^T P (m x r), r = matrix_approximation_rank: all-reduce P,
        orthogonalise it, compute Q, all-reduce Q, M ~ P Q^T / G. A matrix is compressed only when
        (n + m) r x min_compression_rate < n m; the others (biases, thin layers) are all-reduced as they
        are. Bytes: three ring all-reduces, of U (uncompressed), sum n r and sum m r elements.

    topk_hook (Aji & Heafield, 2017; MIT 6.5940's lecture on gradient compression)   (`topk_bytes`)
        each rank keeps the k = ceil(density N) largest entries (by magnitude) and all-gathers them as
        (value, index) pairs; every rank adds the G sparse gradients in rank order and divides by G.
        Different ranks pick different indices, so the pairs cannot be summed on the way as a ring
        does: (G-1) 2k x 4 bytes, which grows with G (the all-reduce's does not).

Error feedback (Seide et al., 2014; Karimireddy et al., 2019): what a compressor leaves out this step
(the gradient it was given, minus what its average turned into) is added to the next step's gradient,
so nothing is lost for good, only late. PowerSGD and top-k are biased compressors; without error
feedback they keep dropping the same directions. Both keep it per bucket, like PyTorch's PowerSGD.

Example (inside a launched function)::

    state = compression.PowerSGDState(matrix_approximation_rank=2, start_powerSGD_iter=2)
    log = training.train_data_parallel(model, optimizer, data, F.cross_entropy, batch_size=16,
                                       comm_hook=compression.powersgd_hook, comm_hook_state=state)
    ddp_model.register_comm_hook(compression.PowerSGDState(...), compression.powersgd_hook)   # or in DDP
"""

# No `from __future__ import annotations`: DDP checks a hook's annotations at run time and wants the real
# objects dist.GradBucket and torch.futures.Future[torch.Tensor] (see ddp.py).

import math
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from course_lib import collectives, runtime
from course_lib import allreduce as allreduce_variants

__all__ = ["LowPrecisionState", "low_precision_hook", "PowerSGDState", "powersgd_hook", "TopKState", "topk_hook",
           "ring_bytes", "low_precision_bytes", "powersgd_sizes", "powersgd_bytes", "topk_bytes",
           "should_compress", "orthogonalize"]


def _done(tensor):
    """A completed Future holding `tensor` (course_lib's collectives block, so the work is done)."""
    future = torch.futures.Future(devices=[tensor.device]) if tensor.is_cuda else torch.futures.Future()
    future.set_result(tensor)
    return future


def _world():
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("a communication hook averages over the ranks of a process group: call it inside a "
                           "function started by course_lib.launch (or under torchrun), through DDP or "
                           "training.train_data_parallel(comm_hook=...).")
    return dist.get_rank(), dist.get_world_size()


def _allreduce(tensor, variant="ring"):
    with runtime.unchecked():          # the ranks' buckets agree: DDP (or the trainer) built them the same way
        allreduce_variants.get(variant)(tensor, "sum")


# --------------------------------------------------------------------------------------------------
# Formulas: bytes each rank sends per bucket
# --------------------------------------------------------------------------------------------------


def ring_bytes(numel: int, world_size: int, rank: int = 0, element_size: int = 4) -> int:
    """Bytes rank `rank` sends in course_lib's ring all-reduce of `numel` elements (~ 2 (G-1)/G numel)."""
    from course_lib import fast_allreduce

    return element_size * fast_allreduce.expected_traffic("ring", numel, world_size, rank)["elements_sent"]


def low_precision_bytes(numel: int, world_size: int, element_size: int = 2) -> int:
    """Bytes every rank sends in `low_precision_hook`: all_to_all and all_gather of P = ceil(N/G), 16 bits."""
    piece = math.ceil(numel / world_size)
    return 2 * (world_size - 1) * piece * element_size


def should_compress(num_rows: int, num_cols: int, rank: int, min_compression_rate: float) -> bool:
    """PowerSGD's rule: compress an n x m matrix when (n + m) r x min_compression_rate < n m."""
    return (num_rows + num_cols) * rank * min_compression_rate < num_rows * num_cols


def powersgd_sizes(shapes, matrix_approximation_rank: int, min_compression_rate: float = 2) -> dict:
    """Elements PowerSGD all-reduces per bucket of gradients of these shapes (after its start step).

    Returns:
        {'uncompressed': U, 'p': sum n r, 'q': sum m r, 'total': U + sum (n + m) r, 'original': sum n m}
        with r = min(n, m, matrix_approximation_rank) per matrix, as PyTorch's powerSGD_hook counts.
    """
    sizes = {"uncompressed": 0, "p": 0, "q": 0, "original": 0}
    for shape in shapes:
        shape = tuple(shape)
        n = shape[0] if shape else 1
        m = math.prod(shape[1:]) if len(shape) > 1 else 1
        r = min(n, m, matrix_approximation_rank)
        sizes["original"] += n * m
        if should_compress(n, m, r, min_compression_rate):
            sizes["p"] += n * r
            sizes["q"] += m * r
        else:
            sizes["uncompressed"] += n * m
    sizes["total"] = sizes["uncompressed"] + sizes["p"] + sizes["q"]
    return sizes


def powersgd_bytes(shapes, matrix_approximation_rank: int, world_size: int, rank: int = 0,
                   min_compression_rate: float = 2, element_size: int = 4) -> int:
    """Bytes rank `rank` sends per bucket: three ring all-reduces, of U, sum n r and sum m r elements."""
    sizes = powersgd_sizes(shapes, matrix_approximation_rank, min_compression_rate)
    return sum(ring_bytes(sizes[key], world_size, rank, element_size) for key in ("uncompressed", "p", "q"))


def topk_bytes(numel: int, density: float, world_size: int, element_size: int = 4) -> int:
    """Bytes every rank sends in `topk_hook`: an all-gather of k values and k int32 indices, k = ceil(density N)."""
    k = _k(numel, density)
    return (world_size - 1) * 2 * k * element_size


def _k(numel, density):
    return min(numel, max(1, math.ceil(density * numel))) if numel else 0


# --------------------------------------------------------------------------------------------------
# bf16 / fp16 with fp32 accumulation
# --------------------------------------------------------------------------------------------------


@dataclass
class LowPrecisionState:
    """State of `low_precision_hook`.

    Attributes:
        dtype: what travels: torch.bfloat16 (8 bits of exponent, as fp32: no overflow) or torch.float16
            (more mantissa, overflows above 65504).
        calls: buckets averaged so far.
    """

    dtype: torch.dtype = torch.bfloat16
    calls: int = 0

    def __post_init__(self):
        if self.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be torch.bfloat16 or torch.float16 (what travels), got {self.dtype!r}")


def low_precision_hook(state: LowPrecisionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a bucket sending 16-bit numbers, summing in float32: all_to_all, add, all_gather.

    Like PyTorch's ``bf16_compress_hook`` in what travels (16 bits a number), but the sum is never
    rounded to 16 bits: each rank adds the G pieces it owns in float32 (rank order, so every rank
    gets the same bits) and only the mean is cast back. See the module docstring for the bytes.
    """
    rank, world_size = _world()
    buffer = bucket.buffer()
    numel = buffer.numel()
    piece = math.ceil(numel / world_size)
    low = torch.zeros(world_size * piece, dtype=state.dtype, device=buffer.device)
    low[:numel] = buffer                                              # rounding 1: to 16 bits
    outgoing = list(low.split(piece))
    incoming = [torch.empty(piece, dtype=state.dtype, device=buffer.device) for _ in range(world_size)]
    with runtime.unchecked():
        collectives.all_to_all(incoming, outgoing)
    total = incoming[0].float()
    for j in range(1, world_size):                                    # float32 sum, rank order
        total += incoming[j].float()
    mean = (total / world_size).to(state.dtype)                      # rounding 2: the mean, to 16 bits
    gathered = list(low.split(piece))
    with runtime.unchecked():
        collectives.all_gather(gathered, mean)
    buffer.copy_(low[:numel])
    state.calls += 1
    return _done(buffer)


# --------------------------------------------------------------------------------------------------
# PowerSGD
# --------------------------------------------------------------------------------------------------


def orthogonalize(matrices: torch.Tensor, epsilon: float = 0.0) -> None:
    """Make the columns of each matrix in a batch (b x n x r) orthonormal, in place.

    Gram-Schmidt for r <= 2 (and half precision), QR otherwise: what PyTorch's PowerSGD does, in the
    same operations, so both give the same bits.
    """
    if matrices.shape[2] <= 2 or matrices.dtype in (torch.float16, torch.bfloat16):
        for i in range(matrices.shape[2]):
            col = matrices[:, :, i:i + 1]
            if epsilon == 0:
                col /= torch.norm(col, dim=1, keepdim=True)
            else:
                col /= torch.norm(col, dim=1, keepdim=True) + epsilon
            if i + 1 < matrices.shape[2]:
                rest = matrices[:, :, i + 1:]
                rest -= torch.sum(col * rest, dim=1, keepdim=True) * col
    else:
        torch.linalg.qr(matrices, out=(matrices, torch.empty(matrices.shape[0], matrices.shape[2], matrices.shape[2],
                                                             device=matrices.device, dtype=matrices.dtype)))


@dataclass
class PowerSGDState:
    """State of `powersgd_hook`: the same settings, with the same meaning, as PyTorch's ``PowerSGDState``.

    Attributes:
        matrix_approximation_rank: r, the columns of P and Q.
        start_powerSGD_iter: plain all-reduce for the first steps (gradients change fast early on;
            and DDP rebuilds its buckets after step 1). Must be > 1 with error feedback or warm start.
        min_compression_rate: compress a matrix only when it shrinks at least this much.
        use_error_feedback: keep what compression left out and add it to the next gradient.
        warm_start: start each step's power iteration from last step's Q instead of a random one.
        orthogonalization_epsilon: added to column norms (0: none).
        random_seed: seeds Q's random start, the same on every rank (numpy's RandomState, as PyTorch's).
        allreduce: the `course_lib.allreduce` variant for its three all-reduces ('ring': the bytes of
            `powersgd_bytes`; 'naive' makes one round of messages where the ring makes 2(G-1)).
        iter: steps seen (counted on the last bucket of each step).
        sent: per step that compressed, the elements it all-reduced: {'uncompressed', 'p', 'q'}.
    """

    matrix_approximation_rank: int = 1
    start_powerSGD_iter: int = 1_000
    min_compression_rate: float = 2
    use_error_feedback: bool = True
    warm_start: bool = True
    orthogonalization_epsilon: float = 0
    random_seed: int = 0
    allreduce: str = "ring"
    iter: int = 0
    sent: list = field(default_factory=list)
    error_dict: dict = field(default_factory=dict, repr=False)
    p_memory_dict: dict = field(default_factory=dict, repr=False)
    q_memory_dict: dict = field(default_factory=dict, repr=False)
    rng: object = field(default=None, repr=False)

    def __post_init__(self):
        if isinstance(self.matrix_approximation_rank, bool) or not isinstance(self.matrix_approximation_rank, int) \
                or self.matrix_approximation_rank < 1:
            raise ValueError(f"matrix_approximation_rank must be a positive int, got {self.matrix_approximation_rank!r}")
        if (self.use_error_feedback or self.warm_start) and self.start_powerSGD_iter <= 1:
            raise ValueError("start_powerSGD_iter must be > 1 with error feedback or warm start (as in PyTorch: DDP "
                             f"rebuilds its buckets after the first step), got {self.start_powerSGD_iter}")
        if self.allreduce not in allreduce_variants.VARIANTS:
            raise ValueError(f"allreduce must name a course_lib.allreduce variant ({sorted(allreduce_variants.VARIANTS)}), "
                             f"got {self.allreduce!r}")
        self.rng = np.random.RandomState(self.random_seed)

    def _next_iter(self, bucket) -> None:
        if bucket.is_last():
            self.iter += 1


def powersgd_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PowerSGD of rank r with error feedback: PyTorch's ``powerSGD_hook``, written with course_lib's ring.

    The steps (PyTorch's, in its order; see the module docstring for the idea):

        0. before start_powerSGD_iter: a plain all-reduce, divided by G
        1. error feedback: add last step's error; keep a copy of the input
        2. split the gradients: matrices worth compressing, and the rest (all-reduced as one buffer, / G)
        3. Q: random (seeded, same on every rank) the first time, else last step's; orthogonalised
        4. P = M Q; all-reduce P (sum); orthogonalise P
        5. Q = M^T P; all-reduce Q; / G
        6. M ~ P Q^T; the new error = the input - what it became
    """
    rank, world_size = _world()
    buffer = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        state._next_iter(bucket)
        buffer.div_(world_size)
        _allreduce(buffer, state.allreduce)
        return _done(buffer)
    index = bucket.index()
    device, dtype = buffer.device, buffer.dtype
    copy = None
    if state.use_error_feedback:                                                      # 1.
        if index in state.error_dict:
            buffer.add_(state.error_dict[index])
        else:
            state.error_dict[index] = torch.zeros(buffer.numel(), device=device, dtype=dtype)
        copy = buffer.detach().clone()
    compress, plain = [], []                                                          # 2.
    p_size = q_size = 0
    for tensor in bucket.gradients():
        matrix = tensor.view(tensor.shape[0], -1) if tensor.dim() else tensor.view(1, 1)
        n, m = matrix.shape
        r = min(n, m, state.matrix_approximation_rank)
        if should_compress(n, m, r, state.min_compression_rate):
            compress.append(matrix)
            p_size, q_size = p_size + n * r, q_size + m * r
        else:
            plain.append(tensor)
    uncompressed = torch.cat([t.reshape(-1) for t in plain]) if plain else buffer.new_zeros(0)
    state.sent.append({"uncompressed": uncompressed.numel(), "p": p_size, "q": q_size})
    fresh = not state.warm_start or index not in state.p_memory_dict
    if fresh:
        state.p_memory_dict[index] = torch.empty(p_size, device=device, dtype=dtype)
        state.q_memory_dict[index] = torch.empty(q_size, device=device, dtype=dtype)
    by_shape = defaultdict(list)
    for matrix in compress:
        by_shape[matrix.shape].append(matrix)
    matrices, ps, qs = [], [], []
    p_at = q_at = 0
    for group in by_shape.values():
        for matrix in group:
            n, m = matrix.shape
            r = min(n, m, state.matrix_approximation_rank)
            matrices.append(matrix.unsqueeze(0))
            ps.append(state.p_memory_dict[index][p_at:p_at + n * r].view(1, n, r))
            qs.append(state.q_memory_dict[index][q_at:q_at + m * r].view(1, m, r))
            p_at, q_at = p_at + n * r, q_at + m * r
    if fresh:                                                                         # 3.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(state.rng.randint(1_000_000_000))
            for q in qs:
                q.copy_(torch.randn(*q.shape, device="cpu", dtype=dtype))
                orthogonalize(q, state.orthogonalization_epsilon)
    else:
        for q in qs:
            orthogonalize(q, state.orthogonalization_epsilon)
    for matrix, q, p in zip(matrices, qs, ps):                                        # 4.
        torch.bmm(matrix, q, out=p)
    _allreduce(uncompressed, state.allreduce)
    uncompressed.div_(world_size)
    at = 0
    for tensor in plain:
        tensor.copy_(uncompressed[at:at + tensor.numel()].view_as(tensor))
        at += tensor.numel()
    _allreduce(state.p_memory_dict[index], state.allreduce)
    for p in ps:
        orthogonalize(p, state.orthogonalization_epsilon)
    for matrix, p, q in zip(matrices, ps, qs):                                        # 5.
        torch.bmm(matrix.transpose(1, 2), p, out=q)
    _allreduce(state.q_memory_dict[index], state.allreduce)
    state.q_memory_dict[index].div_(world_size)
    for p, q, matrix in zip(ps, qs, matrices):                                        # 6.
        torch.bmm(p, q.transpose(1, 2), out=matrix)
    if state.use_error_feedback:
        state.error_dict[index] = copy - buffer
    if not state.warm_start:
        state.p_memory_dict.clear()
        state.q_memory_dict.clear()
    state._next_iter(bucket)
    return _done(buffer)


# --------------------------------------------------------------------------------------------------
# Top-k
# --------------------------------------------------------------------------------------------------


@dataclass
class TopKState:
    """State of `topk_hook`.

    Attributes:
        density: the share of entries each rank sends, k = ceil(density N) per bucket.
        use_error_feedback: keep what was not sent and add it to the next gradient.
        error_dict: per bucket index, the error kept for the next step.
    """

    density: float = 0.01
    use_error_feedback: bool = True
    error_dict: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if isinstance(self.density, bool) or not isinstance(self.density, (int, float)) or not 0 < self.density <= 1:
            raise ValueError(f"density must be a number in (0, 1]: the share of entries sent, got {self.density!r}")


def topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a bucket from each rank's k largest entries: all-gather (value, index) pairs, add them up.

    Indices travel as int32 bit patterns inside the float32 message (one message of 2k numbers).
    """
    rank, world_size = _world()
    buffer = bucket.buffer()
    numel, index = buffer.numel(), bucket.index()
    if numel >= 2 ** 31:
        raise ValueError(f"topk_hook sends indices as int32: a bucket of {numel} elements is too large; use smaller buckets")
    if buffer.dtype != torch.float32:
        raise TypeError(f"topk_hook packs int32 indices beside float32 values; got a {buffer.dtype} bucket")
    if state.use_error_feedback and index in state.error_dict:
        buffer.add_(state.error_dict[index])
    k = _k(numel, state.density)
    chosen = torch.topk(buffer.abs(), k, sorted=False).indices.sort().values
    values = buffer[chosen]
    if state.use_error_feedback:
        error = buffer.clone()
        error[chosen] = 0                                    # what this rank did not send, kept for the next step
        state.error_dict[index] = error
    payload = torch.cat([values, chosen.to(torch.int32).view(torch.float32)])
    gathered = [torch.empty_like(payload) for _ in range(world_size)]
    with runtime.unchecked():
        collectives.all_gather(gathered, payload)
    buffer.zero_()
    for piece in gathered:                                   # rank order: the same bits on every rank
        where = piece[k:].view(torch.int32).long()
        buffer[where] += piece[:k]
    buffer.div_(world_size)
    return _done(buffer)
