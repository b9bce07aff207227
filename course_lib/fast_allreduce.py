"""Five faster all-reduces, written from the same point-to-point messages as `course_lib.allreduce`.

The plain ring in `course_lib.allreduce` is the one to read first. Each variant here changes one
thing about it, and each has the same contract: `fn(tensor, op)` leaves op(x_0, ..., x_{G-1}) in
`tensor` on every rank, in place, for any shape, contiguity, length, dtype, op and world size.

    variant              what changes                                   steps            elements a rank sends
    ring                 (the reference)                                2(G-1)           2(G-1) N/G
    ring_pipelined       chunks cut into k segments: adding segment i   2(G-1)           2(G-1) N/G, 2(G-1) k messages
                         overlaps receiving segment i+1
    ring_bidirectional   half of every chunk goes round each way        2(G-1)           2(G-1) N/G  (half on each link)
    halving_doubling     exchange with partners 2^j apart (Rabenseifner) 2 log2 P (+2)    2(P-1) N/P  (+N, see below)
    recursive_doubling   swap the whole tensor with partners 2^j apart  log2 P (+2)      N log2 P    (+N, see below)
    tree                 binomial reduce to rank 0, binomial broadcast  2 ceil(log2 G)   up to ceil(log2 G) N (rank 0)

(N elements per rank, G ranks, P the largest power of two <= G; every count is exact when N is
divisible by G or P, and `expected_traffic` gives the exact count for any N.)

Which one wins is a question of alpha (the fixed price of a step) against beta (the price of a byte):
the tree and halving-doubling take log2 G steps instead of G-1, so they win for small tensors; the
ring variants and, when G is a power of two, halving-doubling move the fewest bytes per rank, so they
win for large ones; the tree moves the most (rank 0 sends ceil(log2 G) N).
`course_lib.cost` turns this into times and crossover sizes; `benchmarks/fast_allreduce_figures.py`
measures them.

Every variant computes each element's final value on exactly one rank and copies it to the
others, so the result is bit-identical on every rank, like the plain ring's.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from course_lib import ops, p2p, runtime, traffic
from course_lib.ops import chunk_sizes  # sizes of torch.tensor_split's parts
from course_lib.ops import flat_view as _flat

__all__ = ["ring_pipelined", "ring_bidirectional", "halving_doubling", "recursive_doubling", "tree", "SEGMENT_BYTES",
           "segments_per_chunk", "expected_traffic", "expected_steps", "VARIANTS"]


def _offsets(sizes: list[int]) -> list[int]:
    """[0, s0, s0+s1, ...]: where each block starts, and the total at the end."""
    out = [0]
    for size in sizes:
        out.append(out[-1] + size)
    return out


# Receive buffers are kept from one call to the next (per thread, dtype and device). Fresh memory is
# not free: the kernel maps and zeroes each 4 KiB page the first time it is touched, and a 64 MiB
# all-reduce needs tens of MiB of receive buffers: thousands of page faults per call, every call.
# The price: the largest buffer asked for stays allocated (ring_pipelined 2N/G elements, tree and
# halving_doubling up to N), one per thread and dtype, until the process ends.
_workspace: dict = {}


def _scratch(like: torch.Tensor, numel: int) -> torch.Tensor:
    """A 1-D buffer of `numel` elements (like's dtype and device) to receive into, reused across calls."""
    key = (threading.get_ident(), like.dtype, like.device)
    buffer = _workspace.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = _workspace[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buffer[:numel]


# ==================================================================================================
# 1. ring_pipelined: the ring, with every chunk cut into segments that flow through one after another
# ==================================================================================================
#
# The plain ring waits for a whole chunk (N/G elements) to arrive, then adds it, then sends it on:
# while it adds, its link is idle, and while it waits, its CPU is. Cutting each chunk into k segments
# lets the two overlap: segment i is added (and sent on) while segment i+1 is still arriving. This
# is what gloo's own ring does (gloo/allreduce.cc: segments of at most 1 MiB, two in flight) and
# what baidu-allreduce's collectives.cu does on GPUs.
#
# The schedule is the ring's 2(G-1) rounds, scatter-reduce then all-gather, with a segment index
# added. Rank r, round s (chunk indices mod G, "->" sends right, "<-" receives from the left):
#
#   round                    sends (segment by segment)       receives                  then
#   scatter_reduce step 0    chunk r (its own data) ->        <- chunk r-1              add
#   scatter_reduce step s    chunk r-s ->                     <- chunk r-s-1            add
#   scatter_reduce step G-2  chunk r+2 ->                     <- chunk r+1              add, now complete
#   all_gather step 0        chunk r+1 (complete) ->          <- chunk r                copy into place
#   all_gather step t        chunk r+1-t ->                   <- chunk r-t              copy into place
#
# The chunk a rank sends in round s+1 is the one it received in round s, so segment i goes on as soon
# as it has been added: it is sent while segment i+1 of the same round is still being received. And
# every receive of round s+1 is posted when round s starts, so the left neighbour's first segments
# find their buffers ready: a gloo message only moves once its receive is posted.
#
# G = 3, k = 2 segments per chunk (a0 a1 | b0 b1 | c0 c1), what rank 0 does; ranks 1 and 2 do the same
# with their indices shifted:
#
#   time ->   send a0 a1 (x0)         add c0, send c0     add c1, send c1     ...all_gather: forward b0, b1
#             receive c0 c1 (x2)      (c1 still arriving) (round 1's b0 arriving)
#
# Elements rank r sends: 2N - |chunk r+1| - |chunk r+2| (as the ring: it never sends the chunk it
# ends up owning during scatter-reduce, nor its right neighbour's during all-gather), 2(G-1) N/G
# when G divides N, in 2(G-1) k messages. Steps: G-1 per phase.

# Chosen by measurement, not guessed (benchmarks/ring_segment_size.py; figures in
# benchmarks/results/ring_segment_size.md). The rule: every segment is one more message, which costs
# Python and gloo bookkeeping and a wake-up of the waiting rank, while adding (all that a segment
# overlaps with the transfer) is a small share of the ring's time where the CPU is the bottleneck, as
# with four ranks on two cores. There a segment should be large: keep a size within the machine's
# launch-to-launch noise of the fastest one measured (segments of 1 MiB and less cost measurably
# more), yet small enough that a large chunk is still cut into several, so that the schedule stays
# the pipelined one. 4 MiB is that size here. gloo caps its segments at 1 MiB, and NCCL's ring moves
# 1 MiB slices with its Simple protocol (smaller for small calls). On hardware where the link, not the
# CPU, is the bottleneck, smaller is better.
SEGMENT_BYTES = 4 << 20


def segments_per_chunk(numel: int, world_size: int, element_size: int, segment_bytes: int = SEGMENT_BYTES) -> int:
    """k: how many segments each of the G chunks is cut into, k = ceil(largest chunk's bytes / segment_bytes).

    Computed from the largest chunk (the first), so every rank cuts every chunk the same way. The cut
    is made in whole elements (`torch.tensor_split` into k parts), so when `segment_bytes` is not a
    multiple of the element size a segment can be up to one element longer than `segment_bytes`.
    """
    if segment_bytes <= 0:
        raise ValueError(f"segment_bytes must be positive, got {segment_bytes}")
    largest = -(-numel // world_size) * element_size
    return max(1, -(-largest // segment_bytes))


@dataclass(frozen=True)
class _Round:
    phase: str
    step: int
    send: int   # chunk sent this round
    recv: int   # chunk received this round


def _ring_rounds(rank: int, world_size: int) -> list[_Round]:
    """The ring's 2(G-1) rounds for `rank`, as in the table above."""
    g = world_size
    return ([_Round("scatter_reduce", s, (rank - s) % g, (rank - s - 1) % g) for s in range(g - 1)]
            + [_Round("all_gather", t, (rank + 1 - t) % g, (rank - t) % g) for t in range(g - 1)])


def ring_pipelined(tensor: torch.Tensor, op=ops.SUM, segment_bytes: int | None = None) -> None:
    """Ring all-reduce whose chunks travel in segments, so adding one overlaps receiving the next.

    Same rounds and same bytes as `course_lib.allreduce.ring`: steps 2(G-1) (G-1 per phase), elements
    sent per rank 2(G-1) N/G; messages per rank 2(G-1) k, k = `segments_per_chunk(...)`.

    Args:
        tensor: this rank's input; overwritten with the result.
        op: SUM, AVG, PRODUCT, MAX or MIN.
        segment_bytes: largest segment, in bytes (default `SEGMENT_BYTES` = 4 MiB). Must be the same on
            every rank.

    Example::

        >>> def fn(rank, world_size):
        ...     t = torch.arange(6.0) * (rank + 1)
        ...     fast_allreduce.ring_pipelined(t, segment_bytes=8)   # 2 floats a segment
        ...     return t
        >>> course_lib.launch(fn, world_size=2)[0]
        tensor([ 0.,  3.,  6.,  9., 12., 15.])
    """
    segment_bytes = SEGMENT_BYTES if segment_bytes is None else segment_bytes

    def check_segment():
        if isinstance(segment_bytes, bool) or not isinstance(segment_bytes, int) or segment_bytes <= 0:
            raise ValueError(f"allreduce.ring_pipelined: segment_bytes={segment_bytes!r} must be a positive "
                             f"number of bytes, e.g. {SEGMENT_BYTES} (4 MiB), or None for the default")

    op = runtime.prepare("allreduce.ring_pipelined", tensor, op=op, local=check_segment)
    # Ranks that cut their chunks differently would wait for segments that never come: agree first.
    runtime.agree("allreduce.ring_pipelined", {"segment_bytes": segment_bytes}, same=("segment_bytes",),
                  device=runtime.metadata_device(tensor))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size == 1:
        return  # nothing to combine; AVG over one rank is the value itself
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    with _flat(tensor) as flat:
        k = segments_per_chunk(flat.numel(), world_size, flat.element_size(), segment_bytes)
        pieces = [torch.tensor_split(chunk, k) for chunk in torch.tensor_split(flat, world_size)]
        # Two rounds of incoming segments can be in flight at once (this one and the next): two buffers,
        # each cut like chunk 0, whose segments are the largest: every other chunk's fit in their start.
        largest = -(-flat.numel() // world_size)  # chunk 0's length
        scratch = [torch.tensor_split(half, k) for half in _scratch(flat, 2 * largest).tensor_split(2)]
        rounds = _ring_rounds(rank, world_size)

        def post_receives(s):
            """Post every receive of round s; return [(buffer, request)] in segment order."""
            now = rounds[s]
            reducing = now.phase == "scatter_reduce"
            posted = []
            with traffic.phase(now.phase), traffic.at_step(now.step):
                for i, piece in enumerate(pieces[now.recv]):
                    # scatter-reduce lands beside the chunk and is added; all-gather lands in place.
                    buffer = scratch[s % 2][i][: piece.numel()] if reducing else piece
                    posted.append((buffer, p2p.irecv(buffer, left, chunk=now.recv)))
            return posted

        def send(s, piece):
            """Send one segment as part of round s (which may be the round after the one running)."""
            with traffic.phase(rounds[s].phase), traffic.at_step(rounds[s].step):
                return p2p.isend(piece, right, chunk=rounds[s].send)

        sends = [send(0, piece) for piece in pieces[rounds[0].send]]
        incoming = post_receives(0)
        for s, now in enumerate(rounds):
            has_next = s + 1 < len(rounds)
            # Post the next round's receives now, before this round's data is touched. Not on 2 ranks:
            # there the next round receives into the very chunk this round is still sending.
            upcoming = post_receives(s + 1) if has_next and world_size > 2 else None
            forwards = []
            for i, (buffer, request) in enumerate(incoming):
                request.wait()
                piece = pieces[now.recv][i]
                if now.phase == "scatter_reduce":
                    ops.combine_(piece, buffer, op)
                    if now.step == world_size - 2:
                        ops.finish_(piece, op, world_size)  # this chunk is now complete: AVG divides here
                if has_next:
                    forwards.append(send(s + 1, piece))  # round s+1 sends what round s received
            for request in sends:
                request.wait()
            sends = forwards
            if has_next:
                incoming = upcoming if upcoming is not None else post_receives(s + 1)


# ==================================================================================================
# 2. ring_bidirectional: two rings at once, one clockwise and one anticlockwise
# ==================================================================================================
#
# In the plain ring every rank sends only to the right and receives only from the left: each link
# carries traffic one way. Here every chunk is halved; the first halves go round the ring clockwise
# (exactly the plain ring's schedule), the second halves anticlockwise (the mirror image: send left,
# receive from the right). Each step a rank sends two half-chunks, one on each link, and receives two.
#
# Rank r, step s (chunk indices mod G; cw = first halves, ccw = second halves):
#
#   phase            clockwise half                       anticlockwise half
#   scatter_reduce   send chunk r-s ->,   <- recv r-s-1    <- send chunk r+s,   recv r+s+1 ->    (add both)
#   all_gather       send chunk r+1-s ->, <- recv r-s      <- send chunk r-1+s, recv r+s ->
#   owns at the end  chunk r+1 complete                    chunk r-1 complete
#
# G = 4, rank 0: scatter-reduce sends the first half of chunks 0, 3, 2 to rank 1 and the second half
# of chunks 0, 1, 2 to rank 3; it ends owning half of chunk 1 and half of chunk 3.
#
# Elements a rank sends: the same 2(G-1) N/G as the ring (N/G per step, now N/2G on each link), in
# 4(G-1) messages; steps 2(G-1). On 2 ranks both neighbours are the same rank: the two directions are
# told apart by their message tag.

_CLOCKWISE_TAG, _ANTICLOCKWISE_TAG = 0, 1


@dataclass(frozen=True)
class _Move:
    """What one direction of ring_bidirectional does in one step."""
    parts: list            # this direction's half of every chunk
    send: int              # index of the part sent ...
    recv: int              # ... and of the part received
    dest: int              # the neighbour it goes to
    source: int            # the neighbour it comes from
    tag: int               # keeps the two directions' messages apart
    spare: torch.Tensor | None = None   # where a received part lands before it is added


def ring_bidirectional(tensor: torch.Tensor, op=ops.SUM) -> None:
    """Ring all-reduce with half of every chunk going round each way, so both links of a rank work.

    Steps 2(G-1); elements sent per rank 2(G-1) N/G (half to each neighbour), in 4(G-1) messages.

    Args:
        tensor: this rank's input; overwritten with the result.
        op: SUM, AVG, PRODUCT, MAX or MIN.
    """
    op = runtime.prepare("allreduce.ring_bidirectional", tensor, op=op)
    rank, g = dist.get_rank(), dist.get_world_size()
    if g == 1:
        return
    right, left = (rank + 1) % g, (rank - 1) % g
    with _flat(tensor) as flat:
        halves = [torch.tensor_split(chunk, 2) for chunk in torch.tensor_split(flat, g)]
        clockwise, anticlockwise = [h[0] for h in halves], [h[1] for h in halves]
        buffer = _scratch(flat, clockwise[0].numel() + anticlockwise[0].numel())
        scratch = (buffer[: clockwise[0].numel()], buffer[clockwise[0].numel():])

        def exchange(moves, reduce):
            """One step in both directions: post both receives, then both sends, then add (or copy)."""
            received = []
            for move in moves:  # receives first, as in the ring
                part = move.parts[move.recv]
                target = move.spare[: part.numel()] if reduce else part
                received.append((part, target, p2p.irecv(target, move.source, tag=move.tag, chunk=move.recv)))
            sends = [p2p.isend(move.parts[move.send], move.dest, tag=move.tag, chunk=move.send) for move in moves]
            for place, target, request in received:
                request.wait()
                if reduce:
                    ops.combine_(place, target, op)
            for request in sends:
                request.wait()

        with traffic.phase("scatter_reduce"):
            for s in traffic.steps(g - 1):
                exchange([_Move(clockwise, send=(rank - s) % g, recv=(rank - s - 1) % g, dest=right, source=left,
                                tag=_CLOCKWISE_TAG, spare=scratch[0]),
                          _Move(anticlockwise, send=(rank + s) % g, recv=(rank + s + 1) % g, dest=left, source=right,
                                tag=_ANTICLOCKWISE_TAG, spare=scratch[1])], reduce=True)
        ops.finish_(clockwise[(rank + 1) % g], op, g)
        ops.finish_(anticlockwise[(rank - 1) % g], op, g)
        with traffic.phase("all_gather"):
            for s in traffic.steps(g - 1):
                exchange([_Move(clockwise, send=(rank + 1 - s) % g, recv=(rank - s) % g, dest=right, source=left,
                                tag=_CLOCKWISE_TAG),
                          _Move(anticlockwise, send=(rank - 1 + s) % g, recv=(rank + s) % g, dest=left, source=right,
                                tag=_ANTICLOCKWISE_TAG)], reduce=False)


# ==================================================================================================
# 3. halving_doubling: recursive halving reduce-scatter, recursive doubling all-gather (Rabenseifner)
# ==================================================================================================
#
# With P = 2^m ranks, the tensor is cut into P blocks. Reduce-scatter by recursive halving: at step j
# every rank pairs with the rank P/2^(j+1) away (its number with one bit flipped), they split the
# blocks both still work on into halves, each sends the half the other keeps and adds the half it
# receives. After m steps rank v holds block v complete. The all-gather by recursive doubling retraces
# the same pairs backwards: each sends everything it has complete, and the complete part doubles.
#
# P = 4 (blocks 0..3), "<->" an exchange, [lo, hi) the blocks a rank still works on:
#
#   reduce_scatter step 0 (distance 2)    0 <-> 2, 1 <-> 3     0,1 keep [0,2)   2,3 keep [2,4)
#   reduce_scatter step 1 (distance 1)    0 <-> 1, 2 <-> 3     rank v keeps block v
#   all_gather step 0 (distance 1)        0 <-> 1, 2 <-> 3     0,1 have [0,2)   2,3 have [2,4)
#   all_gather step 1 (distance 2)        0 <-> 2, 1 <-> 3     everyone has [0,4)
#
# Each rank sends N/2 + N/4 + ... + N/P = (P-1) N/P elements in each phase, in log2 P steps: the ring's
# bytes in far fewer steps. The price: the partner is 2^j ranks away, fine on a switch, not on a ring
# of links.
#
# G not a power of two (the standard way, as in MPICH): with P the largest power of two below G and
# E = G - P extra ranks, the first 2E ranks pair up (0,1), (2,3), ...; in phase 'fold' each even one
# sends its whole tensor to its odd partner, which adds it, and sits out. The P remaining ranks run
# the algorithm above (rank v of it is real rank 2v+1 for v < E, v+E after), and in phase 'unfold'
# each odd partner sends the result back. Those 2E ranks take 2 more steps and move N more each way.
#
# G = 6 (P = 4, E = 2):  fold: 0 -> 1, 2 -> 3;  ranks 1, 3, 4, 5 play 0, 1, 2, 3 above;  unfold: 1 -> 0, 3 -> 2.
#
# Elements a rank sends: 2 (P-1) N/P if it is one of the P (+ N if it had a fold partner); a folded
# rank sends N. Steps: 2 log2 P, + 2 when G is not a power of two.


def _power_of_two_below(world_size: int) -> int:
    return 1 << (world_size.bit_length() - 1)


def _hd_halvings(virtual_rank: int, blocks: int, numel: int) -> list[tuple]:
    """The reduce-scatter's exchanges for one of the P ranks: [(partner, keep, give)], spans in elements."""
    offsets = _offsets(chunk_sizes(numel, blocks))
    lo, hi, out = 0, blocks, []
    distance = blocks // 2
    while distance >= 1:
        partner = virtual_rank ^ distance
        mid = (lo + hi) // 2
        lower, upper = (offsets[lo], offsets[mid]), (offsets[mid], offsets[hi])
        keep, give = (lower, upper) if virtual_rank < partner else (upper, lower)
        out.append((partner, keep, give))
        lo, hi = (lo, mid) if virtual_rank < partner else (mid, hi)
        distance //= 2
    return out


def halving_doubling(tensor: torch.Tensor, op=ops.SUM) -> None:
    """Rabenseifner's all-reduce: recursive-halving reduce-scatter, then recursive-doubling all-gather.

    Steps 2 log2 P (P = the largest power of two <= G), plus 2 when G is not a power of two (fold,
    unfold). Elements sent per rank 2 (P-1) N/P, plus N for ranks that fold (see the table above).

    Args:
        tensor: this rank's input; overwritten with the result.
        op: SUM, AVG, PRODUCT, MAX or MIN.
    """
    op = runtime.prepare("allreduce.halving_doubling", tensor, op=op)
    with _flat(tensor) as flat:
        _folded(flat, op, _halving_doubling_core)


def _folded(flat, op, core) -> None:
    """Run `core(flat, op, virtual, p, extra, world_size)` on the largest power of two P <= G ranks.

    When G is not a power of two, the first 2E ranks (E = G - P) pair up: in phase 'fold' the even one
    of a pair sends its whole tensor to the odd one, which combines it and takes part; in phase 'unfold'
    it sends the result back. Used by halving_doubling and recursive_doubling.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    p = _power_of_two_below(world_size)
    extra = world_size - p
    folds = rank < 2 * extra            # this rank is in one of the pairs (0,1), (2,3), ...
    sits_out = folds and rank % 2 == 0  # the even one of a pair hands its tensor over
    if extra:
        with traffic.phase("fold"):
            for _ in traffic.steps(1):
                if sits_out:
                    p2p.send(flat, rank + 1)
                elif folds:
                    incoming = _scratch(flat, flat.numel())
                    p2p.recv(incoming, rank - 1)
                    ops.combine_(flat, incoming, op)
    if not sits_out:
        virtual = rank // 2 if folds else rank - extra
        core(flat, op, virtual, p, extra, world_size)
    if extra:
        with traffic.phase("unfold"):
            for _ in traffic.steps(1):
                if sits_out:
                    p2p.recv(flat, rank + 1)
                elif folds:
                    p2p.send(flat, rank - 1)


def _real_rank(virtual: int, extra: int) -> int:
    """Virtual rank v of the P ranks that take part -> the real rank (see _folded)."""
    return 2 * virtual + 1 if virtual < extra else virtual + extra


def _halving_doubling_core(flat, op, virtual, p, extra, world_size):
    """The power-of-two algorithm among the P ranks that take part (virtual ranks 0..P-1)."""
    real = lambda v: _real_rank(v, extra)  # noqa: E731
    halvings = _hd_halvings(virtual, p, flat.numel())
    scratch = _scratch(flat, max([keep[1] - keep[0] for _, keep, _ in halvings], default=0))
    with traffic.phase("reduce_scatter"):
        for step in traffic.steps(len(halvings)):
            partner, (keep_lo, keep_hi), (give_lo, give_hi) = halvings[step]
            buffer = scratch[: keep_hi - keep_lo]
            receive = p2p.irecv(buffer, real(partner))
            send = p2p.isend(flat[give_lo:give_hi], real(partner))
            receive.wait()
            ops.combine_(flat[keep_lo:keep_hi], buffer, op)
            send.wait()
    mine = halvings[-1][1] if halvings else (0, flat.numel())
    ops.finish_(flat[mine[0]:mine[1]], op, world_size)  # AVG divides by G, not by P: folded ranks count
    with traffic.phase("all_gather"):
        # Backwards through the same pairs: send what was kept (now complete), receive what was given.
        for step in traffic.steps(len(halvings)):
            partner, (keep_lo, keep_hi), (give_lo, give_hi) = halvings[-1 - step]
            receive = p2p.irecv(flat[give_lo:give_hi], real(partner))
            send = p2p.isend(flat[keep_lo:keep_hi], real(partner))
            receive.wait()
            send.wait()


# ==================================================================================================
# 4. recursive_doubling: every step, swap the whole partial result with the rank 2^j away
# ==================================================================================================
#
# Step j = 0 .. log2 P - 1: virtual rank v sends its whole tensor to v XOR 2^j, receives the partner's,
# and combines the two. After step j every rank holds the sum over its block of 2^(j+1) ranks; after
# log2 P steps, over all of them. Non-powers of two fold first, as halving_doubling does (_folded).
#
# G = 4, x_r = rank r's tensor:
#
#   step 0     0 <-> 1, 2 <-> 3     rank 0 holds x0+x1, rank 2 holds x2+x3
#   step 1     0 <-> 2, 1 <-> 3     every rank holds (x0+x1)+(x2+x3)
#
# The fewest steps of any all-reduce, log2 P (the latency lower bound ceil(log2 G) when G is a power of
# two), but every step moves the whole tensor: log2 P times N per rank, against the ring's 2(G-1)/G N.
# The choice for the smallest tensors, and the worst for large ones. Every rank combines the same two
# partial results at every step (a + b and b + a are the same floating-point number), so the result is
# bit-identical on every rank.
#
#     elements sent by rank r = N log2 P (+ N for a rank with a fold partner); a folded rank sends N.


def recursive_doubling(tensor: torch.Tensor, op=ops.SUM) -> None:
    """All-reduce in log2 P steps: at step j, swap the whole partial result with the rank 2^j away.

    Steps log2 P (P = the largest power of two <= G), plus 2 when G is not a power of two (fold,
    unfold). Elements sent per rank N log2 P (+ N for ranks that fold).

    Args:
        tensor: this rank's input; overwritten with the result.
        op: SUM, AVG, PRODUCT, MAX or MIN.
    """
    op = runtime.prepare("allreduce.recursive_doubling", tensor, op=op)
    with _flat(tensor) as flat:
        _folded(flat, op, _recursive_doubling_core)


def _recursive_doubling_core(flat, op, virtual, p, extra, world_size):
    incoming = _scratch(flat, flat.numel())
    with traffic.phase("exchange"):
        for step in traffic.steps(p.bit_length() - 1):
            partner = _real_rank(virtual ^ (1 << step), extra)
            receive = p2p.irecv(incoming, partner)
            send = p2p.isend(flat, partner)
            receive.wait()
            send.wait()  # flat is still being sent until then: combine only afterwards
            ops.combine_(flat, incoming, op)
    ops.finish_(flat, op, world_size)  # AVG divides by G (folded ranks count too)


# ==================================================================================================
# 5. tree: binomial-tree reduce to rank 0, then binomial-tree broadcast
# ==================================================================================================
#
# Reduce, step j = 0 .. L-1 (L = ceil(log2 G)): every rank whose lowest set bit is 2^j sends its
# (partial) tensor to the rank 2^j below it and is done; that rank adds it. Broadcast retraces the
# tree from the top: at step j the ranks that have the result send it 2^(L-1-j) ranks up.
#
# G = 5 (L = 3):
#
#   reduce step 0      1 -> 0, 3 -> 2          broadcast step 0      0 -> 4
#   reduce step 1      2 -> 0                  broadcast step 1      0 -> 2
#   reduce step 2      4 -> 0                  broadcast step 2      0 -> 1, 2 -> 3
#
# Every message carries the whole tensor, so the tree moves far more bytes than a ring, but it needs
# only 2 ceil(log2 G) steps, and a step with one message per rank: for a small tensor the steps are the
# whole cost. Rank r receives from each of its children (ranks r + 2^j, j below r's lowest set bit,
# that exist) and sends N once up (not rank 0), then the mirror image in the broadcast:
#
#     elements sent by rank r = N * (children(r) + (1 if r > 0 else 0)); rank 0 has L children.


def _children(rank: int, world_size: int) -> list[int]:
    """The ranks that send to `rank` in the reduce (and receive from it in the broadcast), nearest first."""
    out, mask = [], 1
    while mask < world_size and rank % (2 * mask) == 0:
        if rank + mask < world_size:
            out.append(rank + mask)
        mask *= 2
    return out


def tree(tensor: torch.Tensor, op=ops.SUM) -> None:
    """Binomial-tree reduce to rank 0, then binomial-tree broadcast from it.

    Steps 2 ceil(log2 G). Elements sent by rank r: N (children(r) + [r > 0]); rank 0 sends
    ceil(log2 G) N, the most. The small-message all-reduce: fewest steps, most bytes.

    Args:
        tensor: this rank's input; overwritten with the result.
        op: SUM, AVG, PRODUCT, MAX or MIN.
    """
    op = runtime.prepare("allreduce.tree", tensor, op=op)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    levels = (world_size - 1).bit_length()  # ceil(log2 G)
    with _flat(tensor) as flat:
        incoming = _scratch(flat, flat.numel()) if _children(rank, world_size) else None
        with traffic.phase("reduce"):
            for step in traffic.steps(levels):
                mask = 1 << step
                if rank % (2 * mask) == mask:                    # lowest set bit 2^step: send up, done
                    p2p.send(flat, rank - mask)
                elif rank % (2 * mask) == 0 and rank + mask < world_size:
                    p2p.recv(incoming, rank + mask)
                    ops.combine_(flat, incoming, op)
        if rank == 0:
            ops.finish_(flat, op, world_size)
        with traffic.phase("broadcast"):
            for step in traffic.steps(levels):
                mask = 1 << (levels - 1 - step)
                if rank % (2 * mask) == 0 and rank + mask < world_size:
                    p2p.send(flat, rank + mask)
                elif rank % (2 * mask) == mask:
                    p2p.recv(flat, rank - mask)


VARIANTS = {"ring_pipelined": ring_pipelined, "ring_bidirectional": ring_bidirectional,
            "halving_doubling": halving_doubling, "recursive_doubling": recursive_doubling, "tree": tree}


# ==================================================================================================
# What the trace must show: the formulas of the tables above, as numbers
# ==================================================================================================


def expected_steps(variant: str, world_size: int) -> dict:
    """{phase: steps} of a variant on G ranks, counted over all ranks (see `traffic.step_counts`).

    ring_pipelined, ring_bidirectional: G-1 per phase. halving_doubling: log2 P per phase, and one
    'fold' and one 'unfold' step when G is not a power of two. recursive_doubling: log2 P in 'exchange',
    and 'fold' / 'unfold' the same way. tree: ceil(log2 G) per phase.
    Phases without steps (world size 1) are left out.
    """
    g = world_size
    if variant in ("ring", "ring_pipelined", "ring_bidirectional"):
        counts = {"scatter_reduce": g - 1, "all_gather": g - 1}
    elif variant == "halving_doubling":
        m = _power_of_two_below(g).bit_length() - 1
        counts = {"reduce_scatter": m, "all_gather": m}
        if g != _power_of_two_below(g):
            counts.update(fold=1, unfold=1)
    elif variant == "recursive_doubling":
        counts = {"exchange": _power_of_two_below(g).bit_length() - 1}
        if g != _power_of_two_below(g):
            counts.update(fold=1, unfold=1)
    elif variant == "tree":
        counts = {"reduce": (g - 1).bit_length(), "broadcast": (g - 1).bit_length()}
    else:
        raise ValueError(f"no step formula for {variant!r}; known: {['ring'] + sorted(VARIANTS)}")
    return {name: n for name, n in counts.items() if n}


def expected_traffic(variant: str, numel: int, world_size: int, rank: int, element_size: int = 4,
                     segment_bytes: int = SEGMENT_BYTES) -> dict:
    """Elements and messages rank `rank` sends and receives in one all-reduce of `numel` elements.

    The closed forms (N = numel, G = world size, c_i = size of chunk i = `tensor_split` sizes):

        ring                 sent = 2N - c_{r+1} - c_{r+2}     messages 2(G-1)  (course_lib.allreduce.ring)
        ring_pipelined       the same elements                 messages 2(G-1) k
        ring_bidirectional   the same, counted on each half-chunk ring (clockwise and anticlockwise)
        halving_doubling     sent = (N - b_v) + sum of the halves kept  (= 2 (P-1) N/P when P | N),
                             + N for a rank with a fold partner; a folded rank sends N
        recursive_doubling   sent = N log2 P, + N for a rank with a fold partner; a folded rank sends N
        tree                 sent = N (children(r) + [r > 0])

    Returns:
        {"elements_sent", "elements_received", "messages_sent", "messages_received"}.
    """
    g, n, r = world_size, numel, rank
    if g == 1:
        return dict(elements_sent=0, elements_received=0, messages_sent=0, messages_received=0)
    if variant in ("ring", "ring_pipelined"):
        c = chunk_sizes(n, g)
        sent = 2 * n - c[(r + 1) % g] - c[(r + 2) % g]
        received = 2 * n - c[r] - c[(r + 1) % g]  # scatter-reduce never gets chunk r; all-gather not r+1
        k = 1 if variant == "ring" else segments_per_chunk(n, g, element_size, segment_bytes)
        return dict(elements_sent=sent, elements_received=received,
                    messages_sent=2 * (g - 1) * k, messages_received=2 * (g - 1) * k)
    if variant == "ring_bidirectional":
        first = [chunk_sizes(size, 2)[0] for size in chunk_sizes(n, g)]
        second = [size - f for size, f in zip(chunk_sizes(n, g), first)]
        sent = (sum(first) * 2 - first[(r + 1) % g] - first[(r + 2) % g]
                + sum(second) * 2 - second[(r - 1) % g] - second[(r - 2) % g])
        received = (sum(first) * 2 - first[r] - first[(r + 1) % g]
                    + sum(second) * 2 - second[r] - second[(r - 1) % g])
        return dict(elements_sent=sent, elements_received=received,
                    messages_sent=4 * (g - 1), messages_received=4 * (g - 1))
    if variant == "halving_doubling":
        p = _power_of_two_below(g)
        extra = g - p
        if r < 2 * extra and r % 2 == 0:  # folded: hands over N, gets N back
            return dict(elements_sent=n, elements_received=n, messages_sent=1, messages_received=1)
        virtual = r // 2 if r < 2 * extra else r - extra
        halvings = _hd_halvings(virtual, p, n)
        given = sum(hi - lo for _, _, (lo, hi) in halvings)    # = N - own block
        kept = sum(hi - lo for _, (lo, hi), _ in halvings)
        steps = len(halvings)
        partnered = r < 2 * extra  # the odd rank of a fold pair: N in, N back out, one message each
        return dict(elements_sent=given + kept + n * partnered, elements_received=kept + given + n * partnered,
                    messages_sent=2 * steps + partnered, messages_received=2 * steps + partnered)
    if variant == "recursive_doubling":
        p = _power_of_two_below(g)
        extra = g - p
        if r < 2 * extra and r % 2 == 0:  # folded: hands over N, gets N back
            return dict(elements_sent=n, elements_received=n, messages_sent=1, messages_received=1)
        steps = p.bit_length() - 1
        partnered = r < 2 * extra
        return dict(elements_sent=n * (steps + partnered), elements_received=n * (steps + partnered),
                    messages_sent=steps + partnered, messages_received=steps + partnered)
    if variant == "tree":
        up = 1 if r > 0 else 0
        children = len(_children(r, g))
        return dict(elements_sent=n * (children + up), elements_received=n * (children + up),
                    messages_sent=children + up, messages_received=children + up)
    raise ValueError(f"no traffic formula for {variant!r}; known: {sorted(['ring', *VARIANTS])}")
