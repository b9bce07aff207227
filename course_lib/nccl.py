"""torch's own collectives as NCCL runs them, on the modeled network.

Under a modeled launch ``dist.all_reduce`` (and ``all_gather``, ``reduce_scatter``, ``broadcast``, ``reduce``) takes
the time of what NCCL would run for it, and ``Network.predict("builtin", ...)`` says the same. What NCCL runs is
decided in three steps, each a few lines of arithmetic:

1. **The topology NCCL sees** (`Topology.of`): G GPUs in M nodes of K; inside a node the `intra` link (NVLink into an
   NVSwitch: one port per GPU), between nodes the `inter` link through network cards (one per GPU, rail-optimised,
   or one per node). A plain `Network` of NVLink or PCIe is one node; any other plain `Network` is G nodes of one GPU.

2. **The tuner** (`tune`): NCCL's own cost model (`src/graph/tuning.cc`, NCCL 2.30.7). For every algorithm a and
   protocol p it knows a latency and a bandwidth, and it picks the fastest::

       time(a, p) = latency(a, p) + bytes / bandwidth(a, p)

   latency = NCCL's fixed cost per call, plus its per-hop latency (per link type and protocol) times the hops on the
   algorithm's path; bandwidth = the bus bandwidth the algorithm gets from the links (`channels x per-channel
   bandwidth`, which this module derives from the same links a learner's code uses), times the protocol's share,
   converted to S/t. NCCL's constants are copied below with their names; `NCCL_ALGO` and `NCCL_PROTO` restrict the
   choice as in NCCL.

3. **The run** (`collective`): the chosen algorithm's messages, replayed by `course_lib.simulation` on those same
   links, each message at its link's bandwidth times the protocol's share, arriving NCCL's per-hop latency after
   its last byte; plus the fixed cost per call. NCCL's lead over a learner's ring therefore comes only from what
   NCCL does: every network card at once, pipelining, reduction inside the switch, LL's short hops.

The algorithms, as NCCL runs them (NVIDIA's maintainers' words in the sources column of docs/nccl_model.md):

* **ring**: C channels, each a ring over all G GPUs carrying S/C. On a cluster channel c enters every node at local
  GPU c and leaves it one GPU before, so each channel crosses each node boundary on its own card: the ring uses
  every card (rail-aligned, NVIDIA/nccl#1453's ring listings). Each step's chunk is cut in slices, forwarded as they
  arrive. The C channels are copies of one another, rotated one GPU along inside each node; each side of a link is
  shared by the channels that use it, so one channel is simulated, on its fair share of every side.
* **tree**: a chain through the GPUs of a node and, across nodes, a double binary tree (two trees, each carrying
  half the data, the second the first mirrored, so that with an even count each node is a leaf in one of them;
  `_btree` is NCCL's ncclGetBtree), chunks flowing up (reduce)
  and down (broadcast) at the same time, from two groups of threads (NVIDIA/nccl#545, #919).
* **nvls**: on one node of an NVSwitch generation (H100, B200): the switch adds the GPUs' data (multimem.ld_reduce)
  and copies the result to every GPU (multimem.st), so each GPU's port carries S (1 + 1/K) instead of the ring's
  2 S (K-1)/K, at NCCL's NVLS efficiency (0.85 on Hopper). Bus bandwidth can then exceed the link's: no
  point-to-point schedule can do that.
* **nvls_tree**: across such nodes: NVLS inside each node, then a double binary tree of each GPU's shard across the
  nodes, on that GPU's card.

The protocols: **LL** (8-byte lines of 4 bytes of data and a 4-byte flag: no fence, the shortest hop, at most half
the bandwidth), **LL128** (128-byte lines with 120 bytes of data), **Simple** (all bandwidth, a fence and a flag per
slice: the longest hop).

What is left out: CollNet (in-network reduction by InfiniBand SHARP switches, off unless configured), PAT (NCCL's
all-gather and reduce-scatter for one GPU per node) and NVLS for all-gather and reduce-scatter (NCCL has it on
NVSwitch nodes): the ring stands in for both, flow control (NCCL's 8 buffer slots per
connection), the SMs the kernels take from compute, congestion in the fabric, and NCCL's per-generation graph
search (its channel count and per-channel bandwidth are derived here from the links, see `graphs`).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field

from course_lib import simulation

__all__ = ["Topology", "Option", "Choice", "tune", "collective", "choose", "tuning_table", "ALGORITHMS", "PROTOCOLS",
           "bus_bandwidth", "algorithm_bandwidth", "BUSBW_FACTORS"]

ALGORITHMS = ("tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree", "pat")   # NCCL's order
PROTOCOLS = ("LL", "LL128", "Simple")                                                         # NCCL's order
_NAMES = {"tree": "Tree", "ring": "Ring", "collnet_direct": "CollNetDirect", "collnet_chain": "CollNetChain",
          "nvls": "NVLS", "nvls_tree": "NVLSTree", "pat": "PAT"}
_FUNCTIONS = ("broadcast", "reduce", "all_gather", "reduce_scatter", "all_reduce")            # NCCL's ncclFunc order
_NCCL_FUNC = {"broadcast": "broadcast", "reduce": "reduce", "all_gather": "allgather",
              "reduce_scatter": "reducescatter", "all_reduce": "allreduce"}              # NCCL_ALGO's prefixes
# How NCCL spells them in its per-call INFO line (src/collectives.cc: ncclAlgoToString, ncclProtoToString); the
# TUNING table and NCCL_ALGO use _NAMES
_CALL_ALGO = {"tree": "TREE", "ring": "RING", "collnet_direct": "COLLNET_DIRECT", "collnet_chain": "COLLNET_CHAIN",
              "nvls": "NVLS", "nvls_tree": "NVLS_TREE", "pat": "PAT"}
_CALL_PROTO = {"LL": "LL", "LL128": "LL128", "Simple": "SIMPLE"}
_FUNC_STR = {"broadcast": "Broadcast", "reduce": "Reduce", "all_gather": "AllGather",
             "reduce_scatter": "ReduceScatter", "all_reduce": "AllReduce"}               # NCCL's ncclFuncStr

# --------------------------------------------------------------------------------------------------
# NCCL's constants (src/graph/tuning.cc, NCCL 2.30.7; microseconds and GB/s), indexed [algorithm][protocol]
# --------------------------------------------------------------------------------------------------

BASE_LATENCY = {"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4), "nvls": (0, 0, 0), "nvls_tree": (0, 0, 0)}
HW_LATENCY = {   # per hop, by the link the hop takes
    "nvlink": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4), "nvls": (0, 0, 25), "nvls_tree": (0, 0, 25)},
    "pci": {"tree": (1.0, 1.9, 4.0), "ring": (1.0, 2.5, 5.7), "nvls": (0, 0, 0), "nvls_tree": (0, 0, 0)},
    "net": {"tree": (5.0, 8.5, 14), "ring": (2.7, 4.0, 14.0), "nvls": (0, 0, 18), "nvls_tree": (0, 0, 20.9)},
}
# rows: Volta/Intel, Ampere/AMD, Hopper, Blackwell (one node: by GPU; more: by host CPU); columns: 1, 2, 3+ nodes
LL_MAX_BW = ((39.0, 39.0, 20.4), (87.7, 22.5, 19.0), (141.0, 45.0, 35.0), (282.0, 90.0, 70.0))
PER_CHANNEL_MAX_RING_LL128 = ((20.0,) * 3, (20.0,) * 3, (36.7,) * 3, (40.0,) * 3)
PER_CHANNEL_MAX_TREE_LL128 = ((20.0,) * 3, (20.0,) * 3, (36.7, 36.7, 29.0), (55.6, 31.67, 20.0))
PER_CHANNEL_MAX_TREE = ((26.5, 18.5, 10.0), (24.0, 23.6, 17.8), (38.7, 41.4, 36.0), (70.0, 42.8, 24.0))
PER_CHANNEL_MAX_NVLS_TREE = ((26.5, 18.5, 10.0), (24.0, 23.6, 17.8), (0.0, 57.7, 45.5), (0.0, 96.0, 80.0))
NVLS_EFFICIENCY = (0.0, 0.0, 0.85, 0.74)
# "Trees are not perfectly sticking to the model for medium sizes": per protocol, sizes 64 B << i
TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9),
)
GPUS = ("volta", "ampere", "hopper", "blackwell")
# Per-thread bytes below which a call uses fewer channels (src/include/comm.h: LL 8 (x G for the ring), LL128 8,
# Simple 64), and the threads per channel (512; 640 for LL128 and for trees).
_THREAD_THRESHOLD = (8, 8, 64)
# Chunk (pipeline unit) per channel, payload bytes (src/enqueue.cc calcCollChunking; buffers of 4 MiB Simple, 512 KiB
# LL, 4,915,200 B LL128, in NCCL_STEPS = 8 steps): the ring's Simple slice is 2 steps (all-reduce, all-gather,
# reduce-scatter), every other chunk one step ("chain": broadcast and reduce).
_CHUNK = {("ring", "Simple"): 1 << 20, ("ring", "LL"): 32 << 10, ("ring", "LL128"): 576_000, ("chain", "Simple"): 512 << 10,
          ("tree", "Simple"): 512 << 10, ("tree", "LL"): 32 << 10, ("tree", "LL128"): 576_000,
          ("nvls", "Simple"): 128 << 10, ("nvls_tree", "Simple"): 64 << 10}
# The GPUs behind the NVLink presets, and the host CPU of their reference servers (NCCL's multi-node LL bandwidth
# and its network overhead depend on it): DGX A100 has AMD EPYC 7742s, DGX H100 and DGX B200 Intel Xeons.
_GPU_OF = {"nvlink3": ("ampere", "amd"), "nvlink4": ("hopper", "intel"), "nvlink5": ("blackwell", "intel")}
# At most this many messages per step (ring slices) and chunks per tree or NVLS pipeline are simulated; larger
# calls move larger pieces (the time of a long pipeline hardly depends on how finely it is cut).
_MAX_SLICES, _MAX_CHUNKS = 4, 128
# NCCL_STEPS: buffer slots per connection, so at most this many chunks ahead of the receiver (src/device.h)
_STEPS = 8
# LL and LL128 forward a line as soon as it has arrived (no store and forward of a whole chunk): their chunks are
# simulated as at least this many messages per hop of the path, of at least _LINE_BYTES each
_STREAM_PIECES, _LINE_BYTES = 4, 512


# --------------------------------------------------------------------------------------------------
# 1. The topology NCCL sees
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Topology:
    """What NCCL's tuner reads from the machine, for one group of ranks.

    Attributes:
        ranks, nodes, per_node: G, M and K (the largest number of the group's ranks on one node).
        intra, inter: the links inside a node and between nodes (a `Network`; None where there is none).
        nics: network cards per node the group's traffic can use (K with a card per GPU, 1 with one per node).
        gpu: 'volta', 'ampere', 'hopper' or 'blackwell' (from the NVLink preset; 'hopper' otherwise).
        host: 'intel' or 'amd' (the reference server's CPU).
        node_of: each group rank's node (0..M-1).
    """

    ranks: int
    nodes: int
    per_node: int
    intra: object
    inter: object
    nics: int
    gpu: str = "hopper"
    host: str = "intel"
    node_of: tuple = ()

    @classmethod
    def of(cls, network, members) -> "Topology":
        members = tuple(members)
        g = len(members)
        if hasattr(network, "per_node"):                       # a Cluster
            node_ids = [network.node(m) for m in members]
            order = sorted(set(node_ids))
            node_of = tuple(order.index(n) for n in node_ids)
            nodes = len(order)
            per_node = max(node_of.count(n) for n in range(nodes))
            intra = network.intra if per_node > 1 else None
            inter = network.inter if nodes > 1 else None
            nics = network.cards if network.nics != "per_gpu" else per_node
            link = network.intra
        elif getattr(network, "kind", "network") in ("nvlink", "pcie"):
            node_of, nodes, per_node, intra, inter, nics, link = (0,) * g, 1, g, network, None, 0, network
        else:
            node_of, nodes, per_node, intra, inter, nics, link = tuple(range(g)), g, 1, None, network, 1, network
        gpu, host = _GPU_OF.get(getattr(link, "name", ""), ("hopper", "intel"))
        return cls(g, nodes, per_node, intra, inter, nics, gpu, host, node_of)

    @property
    def gpu_index(self) -> int:
        return GPUS.index(self.gpu)

    @functools.cached_property
    def locals(self) -> list:
        """Each node's ranks, in group order."""
        out = [[] for _ in range(self.nodes)]
        for rank, node in enumerate(self.node_of):
            out[node].append(rank)
        return out

    @property
    def intra_kind(self) -> str:
        """'nvlink' or 'pci': how NCCL's per-hop latencies see the link inside a node."""
        return "nvlink" if self.intra is not None and getattr(self.intra, "kind", "") == "nvlink" else "pci"

    @property
    def nvswitch(self) -> bool:
        """NVLink through a switch (NVLS needs it, and a GPU generation from Hopper on)."""
        return (self.intra is not None and getattr(self.intra, "kind", "") == "nvlink"
                and self.intra.topology == "switch")

    @property
    def rdma(self) -> bool:
        """Cards that write into GPU memory (InfiniBand, RoCE): NCCL enables LL128 over them."""
        return self.inter is None or getattr(self.inter, "kind", "") in ("infiniband", "roce")


@dataclass(frozen=True)
class Graph:
    """NCCL's search result for one algorithm: `channels` and the bandwidth of each inside and between nodes (GB/s)."""

    channels: int
    intra: float
    inter: float


def graphs(topo: Topology) -> dict:
    """The per-algorithm graphs NCCL's search would find (`Graph`), derived from the links.

    Ring and tree: on one node the channels share each GPU's NVLink (their bandwidths sum to its achieved rate;
    12 search channels on an NVSwitch node, as NCCL finds on H100 and A100); across nodes one search channel per
    card, together the cards' rate, or less where each GPU's NVLink cannot feed them (a node's exit GPU sends over
    its card, so K/(K-1) of the NVLink rate). NVLS: a head per GPU (per card across nodes), each taking twice its
    bandwidth from the head's NVLink, so B/(K+1) each.
    """
    out = {}
    b_intra = topo.intra.bandwidth / 1e9 if topo.intra is not None else math.inf
    b_inter = topo.inter.bandwidth / 1e9 if topo.inter is not None else math.inf
    if topo.nodes == 1:
        channels = 12 if topo.nvswitch else 2
        total = b_intra
    else:
        channels = max(1, topo.nics)
        total = topo.nics * b_inter
        if topo.per_node > 1:
            total = min(total, b_intra * topo.per_node / (topo.per_node - 1))
    out["ring"] = out["tree"] = Graph(channels, total / channels, total / channels)
    if topo.nvswitch and topo.gpu_index >= 2 and topo.per_node > 1:
        heads = topo.per_node if topo.nodes == 1 else max(1, topo.nics)
        per_head = b_intra / (topo.per_node + 1)
        if topo.nodes == 1:
            out["nvls"] = Graph(heads, per_head, math.inf)
        else:
            out["nvls_tree"] = Graph(heads, per_head, b_inter * topo.nics / heads)
    return out


# --------------------------------------------------------------------------------------------------
# 2. The tuner
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Option:
    """One (algorithm, protocol) as NCCL's tuner costs it: `latency` (us), `bandwidth` (algorithm bandwidth, GB/s, as
    NCCL's table holds it), `time` (us, for the call's bytes)."""

    algorithm: str
    protocol: str
    latency: float
    bandwidth: float
    time: float


def _log2i(n: int) -> int:
    return max(0, int(n).bit_length() - 1)


def _env_list(variable: str, names, function: str) -> set | None:
    """The names NCCL_ALGO / NCCL_PROTO enable for `function`, read as NCCL's parseList reads them
    (src/graph/tuning.cc), or None when unset: entries separated by ';' (empty ones skipped), each
    '[function:]name,name' or '[function:]^name,...' (all but those); only the first entry may lack its function;
    names and functions in any case. What NCCL refuses (a later entry without a function, an unknown function or
    name) raises ValueError with NCCL's reason."""
    text = os.environ.get(variable)
    if not text:
        return None
    lowered = {n.lower(): n for n in names}
    functions = set(_NCCL_FUNC.values())
    enabled = set(names)
    for position, entry in enumerate(e for e in text.split(";") if e):
        parts = [p for p in entry.split(":") if p]
        if len(parts) == 1:
            if position:
                raise ValueError(f"{variable}={text!r}: all entries except the first must have a prefix (NCCL "
                                 f"refuses it too), e.g. {variable}='{parts[0]};allreduce:{parts[0]}'")
            prefix, elements = None, parts[0]
        else:
            prefix, elements = parts[0], parts[1]
            if prefix.lower() not in functions:
                raise ValueError(f"{variable}={text!r}: unrecognized prefix {prefix!r}; NCCL's are "
                                 f"{', '.join(sorted(functions))}")
        negate = elements.startswith("^")
        chosen = set()
        for element in (e for e in elements[negate:].split(",") if e):
            if element.lower() not in lowered:
                raise ValueError(f"{variable}={text!r}: unrecognized element {element!r}; NCCL's are "
                                 f"{', '.join(names)}")
            chosen.add(lowered[element.lower()])
        if prefix is None or prefix.lower() == _NCCL_FUNC[function]:
            enabled = set(names) - chosen if negate else chosen
    return enabled


def tune(topo: Topology, function: str, nbytes: int) -> list:
    """NCCL's cost of every algorithm and protocol for one call of `function` on `nbytes` (`Option`s, in NCCL's
    order; only those NCCL would consider)."""
    if function not in _FUNCTIONS:
        raise ValueError(f"NCCL's tuner costs {', '.join(_FUNCTIONS)}, not {function!r}")
    g, m = topo.ranks, topo.nodes
    ppn = g / m
    gpu = topo.gpu_index
    column = m - 1 if m <= 2 else 2
    row = gpu if m == 1 else (1 if topo.host == "amd" else 0)
    ll_max = LL_MAX_BW[row][column]
    nsteps = 2 * (g - 1) if function == "all_reduce" else g - 1 if function in ("all_gather", "reduce_scatter") else g
    net_overhead = 2.0 if topo.host == "amd" else 1.0
    intra_hw = HW_LATENCY["nvlink" if topo.intra_kind == "nvlink" else "pci"]
    hw = intra_hw if m == 1 else HW_LATENCY["net"]
    algos = _env_list("NCCL_ALGO", [_NAMES[a] for a in ALGORITHMS], function)
    protos = _env_list("NCCL_PROTO", PROTOCOLS, function)
    found = graphs(topo)
    options = []
    for algo in ALGORITHMS:
        graph = found.get(algo)
        if graph is None or (algos is not None and _NAMES[algo] not in algos):
            continue
        if function != "all_reduce" and algo != "ring":        # the others run NCCL's ring here (docstring)
            continue
        for p, proto in enumerate(PROTOCOLS):
            if algo in ("nvls", "nvls_tree") and proto != "Simple":
                continue
            if protos is not None and proto not in protos:
                continue
            if proto == "LL128" and not _ll128_enabled(topo):
                continue
            bw = graph.intra if m <= 2 else graph.inter
            if algo in ("nvls", "nvls_tree"):
                intra_bw = graph.intra * NVLS_EFFICIENCY[gpu] * (graph.channels - 1) / graph.channels
                intra_bw *= 2.0                                       # all_reduce only, above
                inter_bw = graph.inter * (2 if m <= 2 and algo == "nvls_tree" else 1)
                cap = PER_CHANNEL_MAX_NVLS_TREE[gpu][column] if algo == "nvls_tree" else math.inf
                bw = min(intra_bw, inter_bw, cap)
            bus = graph.channels * bw
            if algo == "ring" and proto == "LL":
                bus = min(ll_max, bus * .5)
            if algo == "ring" and proto == "LL128":
                bus = min(bus * 0.92, graph.channels * PER_CHANNEL_MAX_RING_LL128[gpu][column])
            if algo == "tree" and function == "all_reduce":
                bus = min(bus * .92, graph.channels * PER_CHANNEL_MAX_TREE[gpu][column])
            if algo == "tree" and proto == "LL":
                bus = min(bus / 3.8, ll_max)
            if algo == "tree" and proto == "LL128":
                bus = min(bus * (7.0 / 9.0 if m == 1 else 120.0 / 128.0),
                          graph.channels * PER_CHANNEL_MAX_TREE_LL128[gpu][column])
            bandwidth = bus * (g / nsteps if algo in ("ring", "nvls", "nvls_tree") else .5)
            latency = BASE_LATENCY[algo][p]
            intra_lat = intra_hw[algo][p]
            inter_lat = HW_LATENCY["net"]["tree" if ppn == 1 else algo][p]
            if algo == "ring":
                if function in ("reduce", "broadcast"):
                    if m == 1:                       # every channel the same ring ("sameChannels"): one hop
                        latency += hw[algo][p]
                    else:
                        latency += nsteps * hw["tree" if proto == "Simple" else algo][p]
                else:
                    overhead = (net_overhead * (3 if proto == "Simple" else 1)) if m > 1 else 0.0
                    intra_lat = max(intra_lat, overhead)
                    inter_steps = 0 if m == 1 else 2 * (m - 1) if function == "all_reduce" else m - 1
                    latency += (nsteps - inter_steps) * intra_lat + inter_steps * inter_lat
            elif algo == "tree":
                latency += 2 * ((g // m - 1) * intra_lat + _log2i(m) * inter_lat)
            elif algo == "nvls":
                latency = intra_lat + (inter_lat if m > 1 else 0)
            elif algo == "nvls_tree":
                latency += intra_lat + 2 * _log2i(m) * inter_lat
            time = _algo_time(topo, function, algo, p, nbytes, latency, bandwidth)
            options.append(Option(algo, proto, latency, bandwidth, time))
    return options


def _ll128_enabled(topo: Topology) -> bool:
    """NCCL enables LL128 by default over NVLink inside a node and, between nodes, over cards that write into GPU
    memory (up to PXN on Hopper and later; up to PXB before): InfiniBand and RoCE here, not TCP sockets."""
    if topo.nodes == 1:
        return topo.intra_kind == "nvlink"
    return topo.rdma and (topo.per_node == 1 or topo.intra_kind == "nvlink")


def _exec_channels(topo: Topology, algo: str) -> int:
    """Channels a call runs on: twice the search channels (src/graph/connect.cc); NVLS: 16 on Hopper, 24 or 32 on
    Blackwell (src/transport/nvls.cc)."""
    if algo in ("nvls", "nvls_tree"):
        return 16 if topo.gpu == "hopper" else (24 if topo.nodes == 1 else 32)
    return min(64, 2 * graphs(topo)[algo].channels)


def _algo_time(topo, function, algo, p, nbytes, latency, bandwidth) -> float:
    """NCCL's ncclTopoGetAlgoTime (us): latency + bytes / bandwidth, with its two corrections."""
    if bandwidth <= 0:
        return math.inf
    log_size = _log2i(nbytes >> 6) if nbytes >= 64 else -1
    if algo == "tree" and function == "all_reduce" and 0 <= log_size < 23:
        bandwidth *= TREE_CORRECTION[p][log_size]
    if (algo == "ring" and p == 2 and topo.nodes > 1 and function == "all_reduce"
            and nbytes / (_exec_channels(topo, "ring") * topo.ranks) >= 64):
        latency *= 1.4 if topo.gpu_index >= 1 else 1.9          # "Plateau effect of ring"
    return latency + nbytes / (1000 * bandwidth)


def choose(topo: Topology, function: str, nbytes: int) -> Option:
    """NCCL's choice: the least time; ties go to the earlier algorithm, then the earlier protocol."""
    options = [o for o in tune(topo, function, nbytes) if math.isfinite(o.time)]
    if not options:
        raise ValueError(f"no NCCL algorithm and protocol left for {function} (NCCL_ALGO={os.environ.get('NCCL_ALGO')!r}, "
                         f"NCCL_PROTO={os.environ.get('NCCL_PROTO')!r}): unset them or allow more")
    best = options[0]
    for option in options[1:]:
        if option.time < best.time:
            best = option
    return best


def tuning_table(network, world_size: int | None = None, members=None) -> str:
    """The table NCCL prints with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=TUNING: per function, latency (us) / algorithm
    bandwidth (GB/s) of every algorithm and protocol (0.0/0.0 where NCCL would not use it)."""
    if members is None:
        members = range(world_size if world_size is not None else network.world_size)
    topo = Topology.of(network, members)
    shown = ("tree", "ring", "nvls", "nvls_tree")
    header = "  Algorithm   |" + "".join(f" {'':>14}   {_NAMES[a]:>14}   {'':>14} |" for a in shown)
    protocols = "  Protocol    |" + "".join(f" {p:>14} |" for _ in shown for p in PROTOCOLS)
    lines = [header, protocols]
    for function in _FUNCTIONS:
        found = {(o.algorithm, o.protocol): o for o in tune(topo, function, 0)}
        cells = []
        for a in shown:
            for p in PROTOCOLS:
                o = found.get((a, p))
                cells.append(f"{o.latency:8.1f}/{o.bandwidth:6.1f} |" if o else f"{0.0:8.1f}/{0.0:6.1f} |")
        lines.append(f"{_FUNC_STR[function]:>13} |" + "".join(cells))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# 3. The run: the chosen algorithm's messages on the links
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Choice:
    """What NCCL runs for one call, and how long it takes on the modeled network.

    Attributes:
        function, nbytes: the call.
        algorithm, protocol, channels: NCCL's choice (channels: how many the call runs on).
        seconds: the simulated time: the fixed cost per call plus the replay of its messages.
        estimate: NCCL's own estimate (its tuner's time for the choice), seconds.
        options: every (algorithm, protocol) the tuner costed (`Option`).
    """

    function: str
    nbytes: int
    algorithm: str
    protocol: str
    channels: int
    seconds: float
    estimate: float
    options: tuple = field(default=(), repr=False)

    def __str__(self) -> str:
        """One line in the form of NCCL's INFO line for a call ('AllReduce: 1048576 Bytes -> Algo RING proto LL128
        channel{Lo..Hi}={0..15}', src/enqueue.cc, NCCL's spelling), with the modeled time."""
        return (f"{_FUNC_STR[self.function]}: {self.nbytes} Bytes -> Algo {_CALL_ALGO[self.algorithm]} "
                f"proto {_CALL_PROTO[self.protocol]} channel{{Lo..Hi}}={{0..{self.channels - 1}}}: "
                f"{self.seconds * 1e6:.1f} us (NCCL's estimate {self.estimate * 1e6:.1f} us)")


_cache: dict = {}


def collective(network, function: str, nbytes: int, members, root: int = 0, element_size: int = 4) -> Choice:
    """What NCCL runs for `function` on `nbytes` over the global ranks `members` of `network`, and its time.

    `nbytes`: the tensor's bytes for all_reduce, broadcast and reduce; the whole buffer (G pieces) for all_gather and
    reduce_scatter, as `torch_collectives.collective_time` takes them. `root`: the root's place in `members`.
    """
    members = tuple(members)
    key = (network, function, int(nbytes), members, root, element_size, os.environ.get("NCCL_ALGO"),
           os.environ.get("NCCL_PROTO"))
    found = _cache.get(key)
    if found is None:
        topo = Topology.of(network, members)
        option = choose(topo, function, max(int(nbytes), 0))
        channels = _channels_used(topo, option.algorithm, option.protocol, nbytes)
        seconds = _run(network, topo, members, function, option, int(nbytes), channels, root, element_size)
        found = _cache[key] = Choice(function, int(nbytes), option.algorithm, option.protocol, channels, seconds,
                                     option.time * 1e-6, tuple(tune(topo, function, int(nbytes))))
        if len(_cache) > 4096:
            _cache.clear()
    return found


def _channels_used(topo, algo, proto, nbytes) -> int:
    """NCCL's run-time channel count: one fewer while each channel's threads would carry less than the threshold."""
    channels = _exec_channels(topo, algo)
    if algo in ("nvls", "nvls_tree"):
        return channels
    p = PROTOCOLS.index(proto)
    threads = 640 if (p == 1 or algo == "tree") else 512
    threshold = _THREAD_THRESHOLD[p] * (topo.ranks if (algo == "ring" and p == 0) else 1)
    while nbytes < channels * threads * threshold and channels >= 2:
        channels -= 1
    return channels


# nccl-tests' factors from algorithm to bus bandwidth, G the number of ranks (its doc/PERFORMANCE.md)
BUSBW_FACTORS = {
    "all_reduce": lambda g: 2 * (g - 1) / g,
    "reduce_scatter": lambda g: (g - 1) / g,
    "all_gather": lambda g: (g - 1) / g,
    "all_to_all": lambda g: (g - 1) / g,
    "broadcast": lambda g: 1.0,
    "reduce": lambda g: 1.0,
}


def bus_bandwidth(function: str, nbytes: int, world_size: int, seconds: float) -> float:
    """nccl-tests' bus bandwidth (bytes/s): S/t times `BUSBW_FACTORS[function](G)` (`nbytes`: the whole buffer for
    all-gather and reduce-scatter)."""
    if function not in BUSBW_FACTORS:
        raise ValueError(f"no bus bandwidth factor for {function!r}; known: {sorted(BUSBW_FACTORS)}")
    return algorithm_bandwidth(nbytes, seconds) * BUSBW_FACTORS[function](world_size)


def algorithm_bandwidth(nbytes: int, seconds: float) -> float:
    """nccl-tests' algorithm bandwidth: S/t (bytes/s)."""
    return nbytes / seconds if seconds > 0 else math.inf


class _Links:
    """The network as one simulated channel sees it: `members` placed on `network`'s links, each side's bandwidth
    cut to this channel's fair share (`share`) and the protocol's (`factor`), each hop arriving NCCL's per-hop
    latency after its last byte. `switches`: {rank: node} of NVLS's NVSwitches, beyond the group's ranks: a port
    per GPU of that node, the GPU's own NVLink on the other side, at `switch_factor` of its bandwidth (NVLS's
    efficiency). `wrap`: {(src, dst): (src, dst)} messages that take another pair's route (`_ring`'s period)."""

    def __init__(self, network, members, topo, algo, proto, share=None, factor=1.0, switches=None, switch_factor=1.0,
                 wrap=None):
        self.network, self.members, self.topo = network, members, topo
        self.factor, self.share, self.switches = factor, share or {}, switches or {}
        self.switch_factor, self.wrap = switch_factor, wrap or {}
        p = PROTOCOLS.index(proto)
        intra = HW_LATENCY["nvlink" if topo.intra_kind == "nvlink" else "pci"][algo][p]
        inter = HW_LATENCY["net"]["tree" if topo.per_node == 1 else algo][p]
        if algo == "ring" and topo.nodes > 1:
            intra = max(intra, (2.0 if topo.host == "amd" else 1.0) * (3 if proto == "Simple" else 1))
        self.latency = {True: intra * 1e-6, False: inter * 1e-6}

    def _nvlink_sides(self, gpu):
        """(bandwidth, outgoing side, incoming side) of `gpu`'s NVLink (found from a message to a node mate)."""
        mate = next((r for r in range(self.topo.ranks) if r != gpu and self.topo.node_of[r] == self.topo.node_of[gpu]),
                    None)
        if mate is None:
            return self.topo.intra.bandwidth, ("nvls", "gpu out", gpu), ("nvls", "gpu in", gpu)
        bandwidth, _, out_side, _ = self.network.route(self.members[gpu], self.members[mate])
        _, _, _, in_side = self.network.route(self.members[mate], self.members[gpu])
        return bandwidth, out_side, in_side

    def route(self, src, dst):
        if src in self.switches or dst in self.switches:
            gpu = dst if src in self.switches else src
            bandwidth, out_side, in_side = self._nvlink_sides(gpu)
            if src in self.switches:
                return bandwidth * self.switch_factor, 0.0, ("nvls", "out", gpu), in_side
            return bandwidth * self.switch_factor, 0.0, out_side, ("nvls", "in", gpu)
        src, dst = self.wrap.get((src, dst), (src, dst))
        bandwidth, _, out_side, in_side = self.network.route(self.members[src], self.members[dst])
        share = min(self.share.get(out_side, 1.0), self.share.get(in_side, 1.0) if in_side is not None else 1.0)
        same_node = self.topo.node_of[src] == self.topo.node_of[dst]
        return bandwidth * share * self.factor, self.latency[same_node], out_side, in_side


def _protocol_share(topo, function, algo, proto) -> float:
    """The share of the links' bandwidth a protocol gets: NCCL's refinement of the algorithm's bus bandwidth (LL:
    half, at most llMaxBw; LL128: 92%, at most its per-channel cap; the tree's 92% and caps) over the unrefined one."""
    graph = graphs(topo)[algo]
    raw = graph.channels * (graph.intra if topo.nodes <= 2 else graph.inter)
    g = topo.ranks
    nsteps = 2 * (g - 1) if function == "all_reduce" else g - 1 if function in ("all_gather", "reduce_scatter") else g
    ratio = g / nsteps if algo == "ring" else .5
    for option in tune(topo, function, 0):
        if (option.algorithm, option.protocol) == (algo, proto):
            return option.bandwidth / (raw * ratio)
    return 1.0


def _run(network, topo, members, function, option, nbytes, channels, root, element_size) -> float:
    """Seconds: the fixed cost per call plus the replay of the chosen algorithm's messages."""
    algo, proto = option.algorithm, option.protocol
    p = PROTOCOLS.index(proto)
    fixed = BASE_LATENCY[algo][p] * 1e-6
    if topo.ranks == 1 or nbytes <= 0:
        return fixed
    factor = _protocol_share(topo, function, algo, proto)
    if algo in ("nvls", "nvls_tree"):
        fixed += HW_LATENCY["nvlink"][algo][p] * 1e-6
        threads, switches = _nvls(topo, function, nbytes, algo, element_size)
        share = {}
        if topo.nodes > 1 and topo.nics < topo.per_node:      # the GPUs on a card that are not simulated share it
            heads = [ranks[0] for ranks in topo.locals]
            for a, b in zip(heads, heads[1:] + heads[:1]):
                _, _, out_side, in_side = network.route(members[a], members[b])
                share[out_side] = share[in_side] = topo.nics / topo.per_node
        links = _Links(network, members, topo, algo, proto, share=share, switches=switches,
                       switch_factor=NVLS_EFFICIENCY[topo.gpu_index])
        return fixed + simulation.replay_threads(threads, links).seconds
    # The channels this call runs on, as copies of one rotated inside each node (one copy on a single node, where
    # every channel takes the same links): each copy moves nbytes / copies. A channel moves at most its part of
    # the graph's bandwidth, so a call on fewer channels than the full count gets that much less.
    full = 1 if topo.nodes == 1 else topo.per_node
    copies = 1 if topo.nodes == 1 else max(1, min(channels, topo.per_node))
    factor *= min(1.0, (channels / _exec_channels(topo, algo)) * (full / copies))
    part = -(-nbytes // copies)
    order = _ring_order(topo, root if function in ("broadcast", "reduce") else None)
    chunk = _CHUNK.get(("chain" if function in ("broadcast", "reduce") else algo, proto)) or _CHUNK[(algo, proto)]
    per_exec = max(1, -(-nbytes // channels))
    streaming = proto != "Simple"
    wrap = {}
    if algo == "tree":
        threads = _tree(topo, part, chunk, per_exec, element_size, streaming)
    elif function in ("broadcast", "reduce"):
        threads = _chain(order, part, chunk, per_exec, function == "reduce", element_size, streaming)
    else:
        rounds = 2 * (topo.ranks - 1) if function == "all_reduce" else topo.ranks - 1
        uniform = topo.nodes > 1 and topo.per_node > 1 and len({len(ranks) for ranks in topo.locals}) == 1
        period = topo.per_node if uniform else None
        threads = _ring(order, part, rounds, chunk, per_exec, element_size, streaming, period)
        wrap = _wrap(order, period) if period else {}
    share = _fair_shares(network, members, topo, threads, copies, wrap)
    links = _Links(network, members, topo, algo, proto, share=share, factor=factor, wrap=wrap)
    return fixed + simulation.replay_threads(threads, links).seconds


def _ring_order(topo: Topology, root=None) -> list:
    """Channel 0's ring: node by node, each node's ranks in group order (it enters a node at its first rank and leaves
    from its last); from `root` on for a broadcast or reduce."""
    order = sorted(range(topo.ranks), key=lambda r: (topo.node_of[r], r))
    if root is not None:
        start = order.index(root)
        order = order[start:] + order[:start]
    return order


def _rotated(topo: Topology, rank: int, c: int) -> int:
    """The rank that plays `rank`'s part in channel copy c: c places along inside its node."""
    local = topo.locals[topo.node_of[rank]]
    return local[(local.index(rank) + c) % len(local)]


def _fair_shares(network, members, topo, threads, copies, wrap=None) -> dict:
    """Each side's share for channel copy 0: its bytes over the bytes of every copy (the copies are copy 0 rotated),
    so a side the copies all use is split evenly and a card only one copy uses is that copy's alone."""
    if copies == 1:
        return {}
    mine, total = {}, {}
    pairs = {}                                  # (src, dst) -> bytes: the same pairs talk many times
    for rank, scripts in enumerate(threads):
        for script in scripts:
            for e in script:
                if e[0] in ("send", "isend"):
                    pair = (wrap or {}).get((rank, e[1]), (rank, e[1]))
                    pairs[pair] = pairs.get(pair, 0) + e[2]
    rotate = [[_rotated(topo, r, c) for r in range(topo.ranks)] for c in range(copies)]
    for c in range(copies):
        for (src, dst), nbytes in pairs.items():
            _, _, out_side, in_side = network.route(members[rotate[c][src]], members[rotate[c][dst]])
            for side in (out_side, in_side):
                if side is not None:
                    total[side] = total.get(side, 0) + nbytes
                    if c == 0:
                        mine[side] = mine.get(side, 0) + nbytes
    return {side: mine[side] / total[side] for side in mine}


def _pieces(nbytes: int, parts: int, element_size: int) -> list:
    """`nbytes` cut in `parts` pieces of whole elements, the first ones one element longer (torch.tensor_split)."""
    count = max(0, nbytes // element_size)
    base, extra = divmod(count, parts)
    return [(base + (i < extra)) * element_size for i in range(parts)]


def _count(nbytes: int, chunk: int, per_exec: int, streaming: bool, most: int, per: int = 1, depth: int = 1) -> int:
    """How many messages `nbytes` (one piece of `per` that a channel of `per_exec` bytes moves) is cut into: one per
    NCCL chunk of that channel, at most `most`. LL and LL128 (`streaming`) pass their lines on one by one, so a
    chunk does not wait at each hop for its last byte: at least _STREAM_PIECES messages per hop of a path `depth`
    hops long, each of _LINE_BYTES or more, keep that wait small."""
    count = max(1, min(most, math.ceil(per_exec / max(1, per) / chunk)))
    if streaming:
        count = max(count, min(most, _STREAM_PIECES * depth, nbytes // _LINE_BYTES))
    return max(1, count)


def _ring(order, nbytes, rounds, chunk, per_exec, element_size, streaming=False, period=None) -> list:
    """Channel 0 of NCCL's ring: in round j position i sends piece (i - j) mod G to its right and receives piece
    (i - j - 1) from its left (the scatter-reduce's rule, carried on through the all-gather); a piece goes on in
    slices, each forwarded as soon as it has arrived (so round j+1's slice s leaves when round j's slice s is in).

    `period`: on nodes of that many ranks each, every node does what the first one does at the same times (the ring
    and the cluster look the same from every node; exactly so where the pieces are equal, within an element's
    time otherwise), so only the first node's ranks are simulated, its last rank sending to its first across the
    nodes (`_wrap` says which route that message takes)."""
    g = len(order)
    pieces = _pieces(nbytes, g, element_size)
    slices = _count(max(pieces), chunk, per_exec, streaming, _MAX_SLICES, per=g, depth=1)
    parts = [_pieces(size, slices, 1) for size in pieces]
    threads = [[] for _ in range(g)]
    ring = order[:period] if period else order
    for i, rank in enumerate(ring):
        right, left = ring[(i + 1) % len(ring)], ring[(i - 1) % len(ring)]
        events = []
        receives = []
        for j in range(rounds):
            receives.append([len(events) + s for s in range(slices)])
            events.extend(("irecv", left, size, 0) for size in parts[(i - j - 1) % g])
        events.extend(("isend", right, size, 0) for size in parts[i % g])
        for j in range(rounds):
            for s in range(slices):
                events.append(("wait", receives[j][s]))
                if j + 1 < rounds:
                    events.append(("isend", right, parts[(i - j - 1) % g][s], 0))
        threads[rank] = [events]
    return threads


def _wrap(order, period) -> dict:
    """The message from the simulated node's last rank to its first stands for the one to the next node's first."""
    return {(order[period - 1], order[0]): (order[period - 1], order[period])}


def _chain(order, nbytes, chunk, per_exec, reverse=False, element_size=4, streaming=False) -> list:
    """Broadcast along channel 0's ring from the root (`order[0]`), or reduce (`reverse`) along it towards the root:
    the data cut in NCCL's chunks, each passed on as soon as it has arrived."""
    g = len(order)
    path = order[1:] + order[:1] if reverse else order
    count = _count(nbytes, chunk, per_exec, streaming, _MAX_CHUNKS, depth=g - 1)
    parts = [p for p in _pieces(nbytes, count, element_size) if p] or [nbytes]
    threads = [None] * g
    for k, rank in enumerate(path):
        events = []
        for size in parts:
            if k > 0:
                events.append(("recv", path[k - 1], size, 0))
            if k < g - 1:
                events.append(("isend", path[k + 1], size, 0))
        threads[rank] = [events]
    return threads


def _btree(nranks: int, rank: int):
    """NCCL's ncclGetBtree (src/graph/trees.cc): (parent, [children]) of `rank` in a binary tree over `nranks`
    rooted at 0, alternating leaves and inner nodes."""
    bit = 1
    while bit < nranks:
        if bit & rank:
            break
        bit <<= 1
    if rank == 0:
        return -1, ([bit >> 1] if nranks > 1 else [])
    up = (rank ^ bit) | (bit << 1)
    if up >= nranks:
        up = rank ^ bit
    lowbit = bit >> 1
    down0 = -1 if lowbit == 0 else rank - lowbit
    down1 = -1 if lowbit == 0 else rank + lowbit
    while down1 >= nranks:
        down1 = -1 if lowbit == 0 else rank + lowbit
        lowbit >>= 1
    return up, [d for d in (down0, down1) if d != -1]


def _dtree(nranks: int, rank: int, tree: int):
    """The second tree of NCCL's double binary tree (ncclGetDtree): the first one mirrored (even node count: a node
    inner in one tree is then a leaf in the other) or shifted by one (odd)."""
    if tree == 0 or nranks == 1:
        return _btree(nranks, rank)
    if nranks % 2:
        up, down = _btree(nranks, (rank - 1) % nranks)
        return (-1 if up == -1 else (up + 1) % nranks), [(d + 1) % nranks for d in down]
    up, down = _btree(nranks, nranks - 1 - rank)
    return (-1 if up == -1 else nranks - 1 - up), [nranks - 1 - d for d in down]


def _tree_links(topo: Topology, tree: int):
    """(parent, children) of every rank in channel 0's tree `tree`: a chain through each node from its first rank,
    the first ranks joined across nodes by NCCL's double binary tree."""
    locals_of = topo.locals
    parent, children = [-1] * topo.ranks, [[] for _ in range(topo.ranks)]
    for n, ranks in enumerate(locals_of):
        for k, r in enumerate(ranks):
            if k:
                parent[r] = ranks[k - 1]
            if k + 1 < len(ranks):
                children[r].append(ranks[k + 1])
        up, down = _dtree(topo.nodes, n, tree)
        head = ranks[0]
        if up != -1:
            parent[head] = locals_of[up][0]
        children[head].extend(locals_of[d][0] for d in down)
    return parent, children


def _tree(topo: Topology, nbytes: int, chunk: int, per_exec: int, element_size: int, streaming=False) -> list:
    """Channel 0 of NCCL's tree all-reduce: each of the two trees carries half, in chunks; on every rank one thread
    sends chunks up (after its children's have arrived) while another sends them down (after its parent's has):
    NCCL's split thread groups. The root receives its children's chunk and sends it straight back down."""
    threads = [[] for _ in range(topo.ranks)]
    depth = topo.per_node + max(1, topo.nodes - 1).bit_length()       # the chain, then the tree's levels
    for tree, half in enumerate(_pieces(nbytes, 2, element_size)):
        if not half:
            continue
        count = _count(half, chunk, per_exec, streaming, _MAX_CHUNKS, per=2, depth=depth)
        parts = [p for p in _pieces(half, count, element_size) if p]
        parent, children = _tree_links(topo, tree)
        up, down = 2 * tree + 1, 2 * tree + 2
        for r in range(topo.ranks):
            lift, lower = [], []
            for size in parts:
                receives = []
                for child in children[r]:
                    receives.append(len(lift))
                    lift.append(("irecv", child, size, up))
                lift.extend(("wait", k) for k in receives)
                if parent[r] != -1:
                    lift.append(("isend", parent[r], size, up))
                    lower.append(("recv", parent[r], size, down))
                    lower.extend(("isend", child, size, down) for child in children[r])
                else:
                    lift.extend(("isend", child, size, down) for child in children[r])
            threads[r].extend(script for script in (lift, lower) if script)
    return [scripts or [[]] for scripts in threads]


def _nvls(topo: Topology, function: str, nbytes: int, algo: str, element_size: int, reduce: bool = True):
    """NVLS inside each node, and for nvls_tree a double binary tree of each GPU's shard across the nodes.

    Per chunk: every GPU sends the chunk to its node's switch (its part of multimem.ld_reduce), which sends each GPU
    its reduced shard; the GPU (after the shard's trip across the nodes, for nvls_tree: each half up and down one
    of the two trees) stores it back through the switch (multimem.st), which sends every GPU of the node the whole
    reduced chunk. A GPU sends at most _STEPS chunks ahead (the switch hands back a credit per chunk), and separate
    threads keep the reduce-scatter, each tree and the all-gather of successive chunks going at once, as NCCL
    pipelines them. Returns (threads per rank, {switch rank: node}): a switch per node, after the group's ranks.

    Where every node has as many GPUs, the GPUs of a node do the same thing at the same times on links of their
    own (their shards are as large, their trips cross the nodes on their own cards): only each node's first GPU is
    simulated, and the switch waits for it alone. A card shared by several GPUs gives it its share (`_Links`)."""
    g = topo.ranks
    tree = algo == "nvls_tree" and topo.nodes > 1
    uniform = reduce and len({len(ranks) for ranks in topo.locals}) == 1
    threads = [[] for _ in range(g + topo.nodes)]
    chunk = _CHUNK[(algo, "Simple")]
    count = max(1, min(_MAX_CHUNKS, math.ceil(nbytes / (chunk * _exec_channels(topo, algo)))))
    parts = [p for p in _pieces(nbytes, count, element_size) if p]
    locals_of = topo.locals
    halves = 2 if tree else 1

    def pieces_of(size, i):
        """The pieces of GPU i's reduced shard of a chunk: its two tree halves (nvls_tree), or the shard."""
        shard = _pieces(size, len(ranks), element_size)[i]
        return _pieces(shard, halves, element_size)

    for n, ranks in enumerate(locals_of):
        switch = g + n
        simulated = ranks[:1] if uniform else ranks
        gather, give = [], []
        for size in parts:
            receives = [len(gather) + i for i in range(len(simulated))]
            gather.extend(("irecv", r, size, 10) for r in simulated)
            gather.extend(("wait", i) for i in receives)
            for i, r in enumerate(simulated):
                gather.append(("isend", r, 0, 15))                                   # a buffer slot is free
                gather.extend(("isend", r, piece, 11 + h) for h, piece in enumerate(pieces_of(size, i)) if piece)
            receives = []
            for i, r in enumerate(simulated):
                for piece in pieces_of(size, i):
                    if piece:
                        receives.append(len(give))
                        give.append(("irecv", r, piece, 13))
            give.extend(("wait", i) for i in receives)
            give.extend(("isend", r, size, 14) for r in simulated)
        threads[switch] = [gather, give]
        for i, r in enumerate(simulated):
            sender = [("isend", switch, size, 10) for size in parts[:_STEPS]]
            for c in range(len(parts)):
                sender.append(("recv", switch, 0, 15))
                if c + _STEPS < len(parts):
                    sender.append(("isend", switch, parts[c + _STEPS], 10))
            trips = [[] for _ in range(halves)]
            downs = [[] for _ in range(halves)]
            for size in parts:
                for h, piece in enumerate(pieces_of(size, i)):
                    if not piece:
                        continue
                    trips[h].append(("recv", switch, piece, 11 + h))
                    if tree:
                        _shard_tree(topo, locals_of, n, i, h, piece, trips[h], downs[h], switch)
                    else:
                        trips[h].append(("isend", switch, piece, 13))
            receive = [("recv", switch, size, 14) for size in parts]
            threads[r] = [script for script in (sender, *trips, *downs, receive) if script]
    return threads, {g + n: n for n in range(topo.nodes)}


def _shard_tree(topo, locals_of, node, local, tree, piece, up, down, switch) -> None:
    """One half of one GPU's reduced shard on its trip across the nodes (nvls_tree): up tree `tree` of the double
    binary tree among the GPUs of the same local index (one card each) and down again, then stored back through the
    switch. `up` and `down` are the two threads' scripts."""
    def gpu(n):
        ranks = locals_of[n]
        return ranks[local % len(ranks)]

    up_node, down_nodes = _dtree(topo.nodes, node, tree)
    tag_up, tag_down = 20 + 2 * tree, 21 + 2 * tree
    receives = []
    for d in down_nodes:
        receives.append(len(up))
        up.append(("irecv", gpu(d), piece, tag_up))
    up.extend(("wait", k) for k in receives)
    if up_node == -1:                       # the root: the half is complete here
        up.extend(("isend", gpu(d), piece, tag_down) for d in down_nodes)
        up.append(("isend", switch, piece, 13))
    else:
        up.append(("isend", gpu(up_node), piece, tag_up))
        down.append(("recv", gpu(up_node), piece, tag_down))
        down.extend(("isend", gpu(d), piece, tag_down) for d in down_nodes)
        down.append(("isend", switch, piece, 13))
