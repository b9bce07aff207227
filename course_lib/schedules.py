"""Every all-reduce of the course as the messages each rank makes, in order: its schedule, as data.

`schedule(algorithm, nbytes, G)` returns, for every rank r, the calls that algorithm's implementation
(`course_lib.allreduce`, `course_lib.fast_allreduce`) makes, in program order, in the form
`simulation.replay` times and `exercises.tracing.Tracer` records:

    ("isend" | "send", peer, nbytes, tag)     ("irecv" | "recv", peer, nbytes, tag)     ("wait", index)

(`index`: the position of the isend / irecv in that rank's list). Only the messages: adding chunks
costs nothing on the modeled clock. tests/test_network.py holds every schedule to what the real
implementation sends and receives (peer, size, order), so `Network.predict`, which replays these,
is exactly the time a launch on that network reads.

Chunks are cut as the implementations cut them: `torch.tensor_split` into G pieces (the first
numel mod G one element longer), in whole elements of `element_size` bytes.

Also here, for torch's built-in collectives on the modeled clock (`torch_collectives.collective_time`): the ring
all-gather and reduce-scatter, a chain broadcast and reduce, a pairwise all-to-all, a direct gather and
scatter; and for clusters, the hierarchical all-reduce (reduce-scatter inside a node, all-reduce across
nodes on each rank's rail, all-gather inside the node).
"""

from __future__ import annotations

__all__ = ["schedule", "ALGORITHMS", "pieces"]


def pieces(count: int, parts: int) -> list:
    """torch.tensor_split's piece lengths: `count` elements into `parts`, the first count % parts one longer."""
    base, extra = divmod(count, parts)
    return [base + (i < extra) for i in range(parts)]


class _Script:
    """One rank's calls, built up in program order."""

    def __init__(self):
        self.events = []

    def isend(self, peer, nbytes, tag=0) -> int:
        self.events.append(("isend", peer, nbytes, tag))
        return len(self.events) - 1

    def irecv(self, peer, nbytes, tag=0) -> int:
        self.events.append(("irecv", peer, nbytes, tag))
        return len(self.events) - 1

    def send(self, peer, nbytes, tag=0) -> None:
        self.events.append(("send", peer, nbytes, tag))

    def recv(self, peer, nbytes, tag=0) -> None:
        self.events.append(("recv", peer, nbytes, tag))

    def wait(self, *indices) -> None:
        for index in indices:
            self.events.append(("wait", index))


# --------------------------------------------------------------------------------------------------
# allreduce.py
# --------------------------------------------------------------------------------------------------


def _naive(s, r, g, numel, e, **_):
    """Every send posted, then every receive, then all waited: receives first."""
    sends = [s.isend((r + k + 1) % g, numel * e) for k in range(g - 1)]
    receives = [s.irecv((r - k - 1) % g, numel * e) for k in range(g - 1)]
    s.wait(*receives, *sends)


def _parameter_server(s, r, g, numel, e, root=0, **_):
    """collectives.reduce (the root receives from every rank in turn), then collectives.broadcast."""
    if r == root:
        for src in range(g):
            if src != root:
                s.recv(src, numel * e)
        sends = [s.isend(dst, numel * e) for dst in range(g) if dst != root]
        s.wait(*sends)
    else:
        s.send(root, numel * e)
        s.recv(root, numel * e)


def _ring_phase(s, r, g, chunk_bytes, phase):
    """One phase of the ring: per step, receive posted first, then the send, then both waited."""
    for step in range(g - 1):
        if phase == "scatter_reduce":
            send_index, recv_index = (r - step) % g, (r - step - 1) % g
        else:
            send_index, recv_index = (r + 1 - step) % g, (r - step) % g
        receive = s.irecv((r - 1) % g, chunk_bytes[recv_index])
        send = s.isend((r + 1) % g, chunk_bytes[send_index])
        s.wait(receive, send)


def _ring(s, r, g, numel, e, **_):
    chunk_bytes = [n * e for n in pieces(numel, g)]
    _ring_phase(s, r, g, chunk_bytes, "scatter_reduce")
    _ring_phase(s, r, g, chunk_bytes, "all_gather")


# --------------------------------------------------------------------------------------------------
# fast_allreduce.py
# --------------------------------------------------------------------------------------------------


def _ring_pipelined(s, r, g, numel, e, segment_bytes=None, **_):
    from course_lib.fast_allreduce import SEGMENT_BYTES, _ring_rounds, segments_per_chunk

    k = segments_per_chunk(numel, g, e, segment_bytes or SEGMENT_BYTES)
    segment_bytes_of = [[n * e for n in pieces(c, k)] for c in pieces(numel, g)]
    rounds = _ring_rounds(r, g)
    right, left = (r + 1) % g, (r - 1) % g

    def post_receives(round_index):
        return [s.irecv(left, size) for size in segment_bytes_of[rounds[round_index].recv]]

    sends = [s.isend(right, size) for size in segment_bytes_of[rounds[0].send]]
    incoming = post_receives(0)
    for index, now in enumerate(rounds):
        has_next = index + 1 < len(rounds)
        upcoming = post_receives(index + 1) if has_next and g > 2 else None
        forwards = []
        for i, request in enumerate(incoming):
            s.wait(request)
            if has_next:
                forwards.append(s.isend(right, segment_bytes_of[now.recv][i]))
        s.wait(*sends)
        sends = forwards
        if has_next:
            incoming = upcoming if upcoming is not None else post_receives(index + 1)


def _ring_bidirectional(s, r, g, numel, e, **_):
    halves = [pieces(c, 2) for c in pieces(numel, g)]
    clockwise, anticlockwise = [h[0] * e for h in halves], [h[1] * e for h in halves]
    right, left = (r + 1) % g, (r - 1) % g
    for phase in ("scatter_reduce", "all_gather"):
        for step in range(g - 1):
            if phase == "scatter_reduce":
                cw, ccw = ((r - step) % g, (r - step - 1) % g), ((r + step) % g, (r + step + 1) % g)
            else:
                cw, ccw = ((r + 1 - step) % g, (r - step) % g), ((r - 1 + step) % g, (r + step) % g)
            receives = [s.irecv(left, clockwise[cw[1]], 0), s.irecv(right, anticlockwise[ccw[1]], 1)]
            sends = [s.isend(right, clockwise[cw[0]], 0), s.isend(left, anticlockwise[ccw[0]], 1)]
            s.wait(*receives, *sends)


def _folded(s, r, g, numel, e, core):
    """halving_doubling / recursive_doubling on the largest power of two P <= G (see fast_allreduce._folded)."""
    from course_lib.fast_allreduce import _power_of_two_below

    p = _power_of_two_below(g)
    extra = g - p
    folds = r < 2 * extra
    sits_out = folds and r % 2 == 0
    if extra:
        if sits_out:
            s.send(r + 1, numel * e)
        elif folds:
            s.recv(r - 1, numel * e)
    if not sits_out:
        core(s, r // 2 if folds else r - extra, p, extra)
    if extra:
        if sits_out:
            s.recv(r + 1, numel * e)
        elif folds:
            s.send(r - 1, numel * e)


def _halving_doubling(s, r, g, numel, e, **_):
    from course_lib.fast_allreduce import _hd_halvings, _real_rank

    def core(s, virtual, p, extra):
        halvings = _hd_halvings(virtual, p, numel)
        for partner, (keep_lo, keep_hi), (give_lo, give_hi) in halvings:
            receive = s.irecv(_real_rank(partner, extra), (keep_hi - keep_lo) * e)
            send = s.isend(_real_rank(partner, extra), (give_hi - give_lo) * e)
            s.wait(receive, send)
        for partner, (keep_lo, keep_hi), (give_lo, give_hi) in reversed(halvings):
            receive = s.irecv(_real_rank(partner, extra), (give_hi - give_lo) * e)
            send = s.isend(_real_rank(partner, extra), (keep_hi - keep_lo) * e)
            s.wait(receive, send)

    _folded(s, r, g, numel, e, core)


def _recursive_doubling(s, r, g, numel, e, **_):
    from course_lib.fast_allreduce import _real_rank

    def core(s, virtual, p, extra):
        for step in range(p.bit_length() - 1):
            partner = _real_rank(virtual ^ (1 << step), extra)
            receive = s.irecv(partner, numel * e)
            send = s.isend(partner, numel * e)
            s.wait(receive, send)

    _folded(s, r, g, numel, e, core)


def _tree(s, r, g, numel, e, **_):
    levels = (g - 1).bit_length()
    for step in range(levels):                    # reduce towards rank 0
        mask = 1 << step
        if r % (2 * mask) == mask:
            s.send(r - mask, numel * e)
        elif r % (2 * mask) == 0 and r + mask < g:
            s.recv(r + mask, numel * e)
    for step in range(levels):                    # broadcast back up the same tree
        mask = 1 << (levels - 1 - step)
        if r % (2 * mask) == 0 and r + mask < g:
            s.send(r + mask, numel * e)
        elif r % (2 * mask) == mask:
            s.recv(r - mask, numel * e)


# --------------------------------------------------------------------------------------------------
# torch's built-in collectives (as NCCL runs them, simplified) and the hierarchical all-reduce
# --------------------------------------------------------------------------------------------------


def _ring_all_gather(s, r, g, numel, e, **_):
    """`numel`: the whole output (G pieces). Rank r starts with piece r: at step s it sends piece r - s on and
    receives piece r - s - 1 (the scatter-reduce's pattern, copying instead of adding)."""
    _ring_phase(s, r, g, [n * e for n in pieces(numel, g)], "scatter_reduce")


def _ring_reduce_scatter(s, r, g, numel, e, **_):
    _ring_phase(s, r, g, [n * e for n in pieces(numel, g)], "scatter_reduce")


def _chain(s, r, g, numel, e, root=0, reverse=False, **_):
    """The whole tensor along the ring from the root (broadcast), or towards it (reduce), unpipelined."""
    order = [(root + i) % g for i in range(g)]
    if reverse:
        order = order[::-1]
    i = order.index(r)
    if i:
        s.recv(order[i - 1], numel * e)
    if i < g - 1:
        s.send(order[i + 1], numel * e)


def _pairwise(s, r, g, numel, e, **_):
    """all_to_all: piece j (of G) to rank j; every send and receive posted at once, then waited."""
    sizes = [n * e for n in pieces(numel, g)]
    requests = []
    for shift in range(1, g):
        requests.append(s.isend((r + shift) % g, sizes[(r + shift) % g]))
        requests.append(s.irecv((r - shift) % g, sizes[r]))
    s.wait(*requests)


def _direct(s, r, g, numel, e, root=0, gather=True, **_):
    """gather (every rank sends its piece to the root) or scatter (the root sends each its piece)."""
    sizes = [n * e for n in pieces(numel, g)]
    if r != root:
        (s.send if gather else s.recv)(root, sizes[r])
        return
    peers = [(root + k) % g for k in range(1, g)]
    requests = [(s.irecv if gather else s.isend)(peer, sizes[peer]) for peer in peers]
    s.wait(*requests)


def _hierarchical(s, r, g, numel, e, node_size=None, **_):
    """Reduce-scatter inside the node (a ring of its k ranks), a ring all-reduce of this rank's shard with
    the ranks of the same local index on the other nodes (its rail), all-gather inside the node."""
    k = node_size
    if not k or g % k:
        raise ValueError(f"the hierarchical schedule needs a node size that divides G (G={g}, node size {k})")
    nodes, node, local = g // k, r // k, r % k
    shard = pieces(numel, k)
    inside = [n * e for n in shard]
    base = node * k

    def intra_ring(phase):
        for step in range(k - 1):
            if phase == "scatter_reduce":
                send_index, recv_index = (local - step) % k, (local - step - 1) % k
            else:
                send_index, recv_index = (local + 1 - step) % k, (local - step) % k
            receive = s.irecv(base + (local - 1) % k, inside[recv_index], 2)
            send = s.isend(base + (local + 1) % k, inside[send_index], 2)
            s.wait(receive, send)

    if k > 1:
        intra_ring("scatter_reduce")
    mine = shard[(local + 1) % k]             # the shard this rank now holds reduced over its node
    across = [n * e for n in pieces(mine, nodes)]
    for phase in ("scatter_reduce", "all_gather"):
        for step in range(nodes - 1):
            if phase == "scatter_reduce":
                send_index, recv_index = (node - step) % nodes, (node - step - 1) % nodes
            else:
                send_index, recv_index = (node + 1 - step) % nodes, (node - step) % nodes
            receive = s.irecv(((node - 1) % nodes) * k + local, across[recv_index], 3)
            send = s.isend(((node + 1) % nodes) * k + local, across[send_index], 3)
            s.wait(receive, send)
    if k > 1:
        intra_ring("all_gather")


ALGORITHMS = {
    "naive": _naive, "parameter_server": _parameter_server, "ring": _ring,
    "ring_pipelined": _ring_pipelined, "ring_bidirectional": _ring_bidirectional,
    "halving_doubling": _halving_doubling, "recursive_doubling": _recursive_doubling, "tree": _tree,
    "hierarchical": _hierarchical,
    # built-in collectives
    "ring_all_gather": _ring_all_gather, "ring_reduce_scatter": _ring_reduce_scatter,
    "chain": _chain, "chain_reduce": lambda *a, **k: _chain(*a, reverse=True, **k),
    "pairwise": _pairwise,
    "direct_gather": _direct, "direct_scatter": lambda *a, **k: _direct(*a, gather=False, **k),
}


def schedule(algorithm: str, nbytes: int, world_size: int, root: int = 0, node_size: int | None = None,
             element_size: int = 4, segment_bytes: int | None = None) -> list:
    """Every rank's calls for one `algorithm` on `nbytes` per rank (see the module docstring)."""
    if algorithm == "master":
        algorithm = "parameter_server"
    if algorithm not in ALGORITHMS:
        raise ValueError(f"no schedule for {algorithm!r}; known: {', '.join(ALGORITHMS)}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    numel = int(nbytes) // element_size
    scripts = [_Script() for _ in range(world_size)]
    if world_size > 1:
        for rank, script in enumerate(scripts):
            ALGORITHMS[algorithm](script, rank, world_size, numel, element_size, root=root, node_size=node_size,
                                  segment_bytes=segment_bytes)
    return [script.events for script in scripts]
