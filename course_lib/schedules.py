"""The schedules written by hand: what a collective's messages are, as data, where no code of course_lib's sends them.

`schedule(algorithm, nbytes, G)` returns, for every rank r, the calls it makes, in program order, in the form
`simulation.replay` times and `exercises.tracing.Tracer` records:

    ("isend" | "send", peer, nbytes, tag)     ("irecv" | "recv", peer, nbytes, tag)     ("wait", index)

(`index`: the position of the isend / irecv in that rank's list). Only the messages: adding chunks
costs nothing on the modeled clock.

Chunks are cut as the implementations cut them: `torch.tensor_split` into G pieces (the first
numel mod G one element longer, `pieces`), in whole elements of `element_size` bytes.

What is here: for torch's built-in collectives on the modeled clock (`torch_collectives.collective_time`) that
NCCL's model (`course_lib.nccl`) does not time, a pairwise all-to-all and a direct gather and scatter; and for
clusters, the hierarchical all-reduce (reduce-scatter inside a node, all-reduce across nodes on each rank's rail,
all-gather inside the node), which `Cluster.predict("hierarchical")`, notebook 13 and its
exercise's check time.

The course's own all-reduces (`course_lib.allreduce`, `course_lib.fast_allreduce`) are not written here a
second time: `Network.predict` records the messages their code sends (`course_lib.recording`), so a schedule
can never drift from the code it describes.
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
# torch's built-in collectives (as NCCL runs them, simplified) and the hierarchical all-reduce
# --------------------------------------------------------------------------------------------------


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
    "hierarchical": _hierarchical,
    # built-in collectives that NCCL's model (`course_lib.nccl`) does not time
    "pairwise": _pairwise,
    "direct_gather": _direct, "direct_scatter": lambda *a, **k: _direct(*a, gather=False, **k),
}


def schedule(algorithm: str, nbytes: int, world_size: int, root: int = 0, node_size: int | None = None,
             element_size: int = 4) -> list:
    """Every rank's calls for one `algorithm` on `nbytes` per rank (see the module docstring)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"no schedule for {algorithm!r}; known: {', '.join(ALGORITHMS)}. A course all-reduce's "
                         "messages are read from its code: recording.record_schedule(allreduce.get(name), G, numel)")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    numel = int(nbytes) // element_size
    scripts = [_Script() for _ in range(world_size)]
    if world_size > 1:
        for rank, script in enumerate(scripts):
            ALGORITHMS[algorithm](script, rank, world_size, numel, element_size, root=root, node_size=node_size)
    return [script.events for script in scripts]
