"""A modeled network under every message of a launch, with a clock of its own, so a laptop can time a cluster.

On a laptop, Colab or Binder the ranks share a few cores and talk over loopback: a message's time is
set by this machine, not by a link, and the course's formulas (the master's link is the bottleneck;
the ring's time hardly grows with G) never show on its clock. With a `Network`, every message a rank
sends pays for a link you choose, on a *modeled clock*::

    net = course_lib.Network(bandwidth="100 MB/s", latency="200 us")       # topology="switch"
    net = course_lib.Network.preset("ib_ndr")                              # InfiniBand NDR, 50 GB/s, 5 us
    net = course_lib.Network.cluster(nodes=8, per_node=8, intra="nvlink4", inter="ib_ndr")
    course_lib.launch(fn, world_size=4, network=net)        # inside fn: course_lib.clock() is modeled time

The real transfer still happens (over loopback, underneath), so results stay real; only time is
modeled. Every rank keeps a modeled clock: a message advances it by the equations below, compute
between messages costs nothing unless you say so (`course_lib.compute(seconds)`,
`training.ComputeDelay`, or `count_cpu=True` for this rank's CPU time), and `course_lib.clock()`
reads it. The same schedule reads the same time on every run, on any machine, under any load, and
a link far faster than this machine (NVLink at 450 GB/s) is as easy to model as a slow one.
`course_lib.simulation` keeps the clocks; this module says what the links are.

Every `course_lib.p2p` call and torch.distributed's own ``send`` / ``recv`` / ``isend`` / ``irecv``
(and ``batch_isend_irecv`` on gloo, made of them) are modeled; torch.distributed's built-in collectives
(``all_reduce``, ``broadcast``, ``all_gather``, ``reduce_scatter``, ...) take the time of the schedule
NCCL would run for them (`torch_collectives.collective_time`), so your all-reduce can race torch's.

The model
---------
Notation as in docs/notation.md: B the bandwidth (bytes per second, each direction), a the latency
(seconds), m a message's bytes, S the bytes of the tensor on each rank, G the number of ranks.

``topology="switch"`` (the default): every rank has one full-duplex link into a non-blocking switch,
an outgoing side and an incoming side. A message from rank s to rank d

1. leaves s's outgoing side when it is free:            start = max(now, out_free[s]);
   it occupies that side for m/B:                       out_free[s] = start + m/B
   (a blocking send, or an isend's wait, completes then: the data has left the rank);
2. enters d's incoming side when that side is free:     in_start = max(start, in_free[d])
   (the switch buffers it meanwhile: s's side is not held up by a busy receiver), for m/B, and
3. arrives a after its last byte went through:           arrival = in_start + m/B + a.
   The receive completes at max(arrival, when it was posted).

Each side serves messages in the order they reach it in modeled time (ties: lower rank first).

``topology="full"``: every ordered pair of ranks has a link of its own (a full mesh, as between the
GPUs of an AMD MI300X platform or in a small NVLink mesh): one queue per destination on the sending
side, no shared incoming side, so arrival = start + m/B + a with start = max(now, out_free[s][d]).

`Network.cluster(...)`: nodes of k ranks; inside a node the `intra` link (NVLink through an NVSwitch:
a switch of its own), between nodes the `inter` link through network cards on a non-blocking fabric:
one card per GPU (``nics="per_gpu"``, rail-optimised clusters: GPU i of every node has a port of its
own) or one per node (``nics="per_node"``: all of a node's GPUs share its card's two sides).

What the model predicts for the course's all-reduces (`Network.predict`):

    algorithm           switch                                   full
    ring                2(G-1) (a + c/B)                         the same (one neighbour each way)
    ring_bidirectional  2(G-1) (a + c/B)                         2(G-1) (a + c/(2B))  (G > 2)
    ring_pipelined      (R-1) max(k u, u + a) + k u + a          the same
    naive               a + (G-1) S/B                            a + S/B
    parameter_server    2a + 2(G-1) S/B                          2a + 2S/B
    tree                2 L (a + S/B)                            the same
    halving_doubling    2 log2(P) a + 2(P-1)/P S/B               the same
    recursive_doubling  log2(P) (a + S/B)                        the same

c = the largest chunk's bytes (S/G), L = ceil(log2 G), P the largest power of two <= G, R = 2(G-1)
rounds of k segments of u = c/(k B) seconds each. These closed formulas (`Network.formula`) hold when G
is a power of two and every length divides; otherwise some ranks start early (no children, no fold
partner) or chunks differ, and `predict` replays the messages the algorithm's code sends (recorded
from it, `course_lib.recording`) instead, which is exactly what a launch reads. The latency a is paid once per
message *in flight*, not once per message sent: messages that leave one after another overlap their
latencies (the naive exchange pays one a, not G-1), unlike the course's step-count model in
`course_lib.cost`, where alpha stands for the software cost of a step, which cannot overlap. On a
cluster, `predict` simulates those messages with the cluster's links (and the hierarchical all-reduce's
hand-written schedule, `schedules.schedule`).

What it leaves out: congestion inside the switch or fabric (it is non-blocking: only the ranks' own
sides queue), TCP (slow start, acknowledgements, retransmission, window limits), the NIC's own work and
offloads (checksums, RDMA, GPUDirect), packet headers, the GPU's copy engines and the cost of
reductions (unless modeled as compute), and, for built-in collectives, any other traffic on the links
while they run (they are timed on an idle network, from the moment the last rank enters them).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import NamedTuple

__all__ = ["Network", "Cluster", "PRESETS", "Preset", "parse_bandwidth", "parse_latency", "current", "last_launch",
           "LaunchStats", "report_late"]


# --------------------------------------------------------------------------------------------------
# Units
# --------------------------------------------------------------------------------------------------

_PREFIX = {"": 1, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
           "Ki": 2 ** 10, "Mi": 2 ** 20, "Gi": 2 ** 30, "Ti": 2 ** 40}
_BANDWIDTH = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(|k|K|M|G|T|Ki|Mi|Gi|Ti)"
                        r"(B|bit|b)\s*(?:/\s*s|ps)\s*$")
_PER_SECOND = {"s": 1, "ms": 1e3, "us": 1e6, "µs": 1e6, "μs": 1e6, "ns": 1e9}  # divide: 200 / 1e6 is exactly 2e-4
_LATENCY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(s|ms|us|µs|μs|ns)\s*$")


def parse_bandwidth(value) -> float:
    """Bytes per second from a number (bytes/s) or a string: "100 MB/s", "1.25 GB/s", "10 Gbit/s",
    "10 Gb/s", "10 Gbps", "100 MiB/s"; "unlimited" (or math.inf) for a link that costs nothing.

    B is a byte and b or bit a bit (10 Gbit/s = 1.25 GB/s); k, M, G, T are powers of 1000, Ki, Mi, Gi,
    Ti powers of 1024.
    """
    if isinstance(value, str) and value.strip().lower() in ("unlimited", "inf", "infinite"):
        return math.inf
    if isinstance(value, str):
        match = _BANDWIDTH.match(value)
        if not match:
            raise ValueError(f"bandwidth {value!r} is not understood: write a number and a unit per second, "
                             "e.g. '100 MB/s', '1.25 GB/s', '10 Gbit/s' or '100 MiB/s' (or a number of bytes/s)")
        number, prefix, unit = match.groups()
        value = float(number) * _PREFIX[prefix] / (8 if unit in ("b", "bit") else 1)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"bandwidth must be a positive number of bytes per second (or a string such as "
                         f"'100 MB/s'), got {value!r}")
    return float(value)


def parse_latency(value) -> float:
    """Seconds from a number (seconds) or a string: "50 us", "0.2 ms", "5ms", "1 s", "100 ns"."""
    if isinstance(value, str):
        match = _LATENCY.match(value)
        if not match:
            raise ValueError(f"latency {value!r} is not understood: write a number and a unit, e.g. '50 us', "
                             "'0.2 ms' or '1 s' (or a number of seconds)")
        value = float(match.group(1)) / _PER_SECOND[match.group(2)]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"latency must be a number of seconds >= 0 (or a string such as '50 us'), got {value!r}")
    return float(value)


def _format_bandwidth(bandwidth: float) -> str:
    if math.isinf(bandwidth):
        return "unlimited"
    for unit, size in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bandwidth >= size:
            return f"{bandwidth / size:.4g} {unit}"
    return f"{bandwidth:.4g} B/s"


def _format_latency(latency: float) -> str:
    if latency == 0:
        return "0 s"
    for unit, size in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if latency >= size:
            return f"{latency / size:.4g} {unit}"
    return f"{latency / 1e-9:.4g} ns"


# --------------------------------------------------------------------------------------------------
# The link
# --------------------------------------------------------------------------------------------------

TOPOLOGIES = ("switch", "full")
# What a link is. NVLink and PCIe join the GPUs of one node (NCCL treats them as one node's fabric); the others join
# nodes. "network": a link given by its figures alone, a network between nodes.
KINDS = ("network", "ethernet", "roce", "infiniband", "pcie", "nvlink")


@dataclass(frozen=True)
class Network:
    """A modeled link under every point-to-point message of a launch (see the module docstring).

    Args:
        bandwidth: bytes per second in each direction of a rank's link, or a string ("100 MB/s",
            "10 Gbit/s"), or "unlimited".
        latency: seconds from a message's last byte leaving the wire to its arrival, or a string
            ("50 us", "0.2 ms").
        topology: "switch" (one link per rank into a non-blocking switch) or "full" (a link per
            ordered pair of ranks).
        name: a label for tables and plots (a preset's name).
        count_cpu: False (the default): compute between messages costs nothing on the modeled clock unless
            modeled (`course_lib.compute`, `training.ComputeDelay`). True: each thread's own CPU time
            (`time.thread_time`) advances its rank's clock too, as on a cluster of CPUs like this one's
            (CPU time, not wall time, so ranks sharing this machine's cores do not slow each other).
        memory_bandwidth: None (the default): adding chunks costs nothing. A bandwidth ("3.35 TB/s", an H100's
            HBM3): every reduction course_lib's all-reduces make (`ops.combine_`) costs 3 n / memory_bandwidth
            of compute for n bytes (read two, write one), as a reduction kernel bound by memory does.
        kind: what the link is: 'network' (the default: a link between nodes given by its figures), 'ethernet',
            'roce', 'infiniband', or 'nvlink' / 'pcie' (a node's own fabric: NCCL's model of torch's collectives
            then treats the ranks as GPUs of one node, `course_lib.nccl`). Presets set it.
        wire: the line rate, where `bandwidth` is what a copy achieves on it (presets set both); None otherwise.

    Example::

        >>> net = Network("100 MB/s", "200 us")
        >>> net
        Network(bandwidth='100 MB/s', latency='200 us', topology='switch')
        >>> round(net.message_time(1_000_000), 4)       # 200 us + 1 MB / 100 MB/s
        0.0102
        >>> course_lib.launch(fn, world_size=4, network=net)   # every message of fn pays for it
    """

    bandwidth: float
    latency: float = 0.0
    topology: str = "switch"
    name: str = ""
    count_cpu: bool = False
    memory_bandwidth: float | None = None
    kind: str = "network"
    wire: float | None = None

    def __post_init__(self):
        object.__setattr__(self, "bandwidth", parse_bandwidth(self.bandwidth))
        if self.wire is not None:
            object.__setattr__(self, "wire", parse_bandwidth(self.wire))
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)} (what the link is), not {self.kind!r}")
        if self.memory_bandwidth is not None:
            object.__setattr__(self, "memory_bandwidth", parse_bandwidth(self.memory_bandwidth))
        object.__setattr__(self, "latency", parse_latency(self.latency))
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"topology must be 'switch' (one link per rank into a switch) or 'full' (a link per "
                             f"pair of ranks), not {self.topology!r}")

    def __repr__(self) -> str:
        label = f", name={self.name!r}" if self.name else ""
        cpu = ", count_cpu=True" if self.count_cpu else ""
        memory = (f", memory_bandwidth={_format_bandwidth(self.memory_bandwidth)!r}" if self.memory_bandwidth else "")
        return (f"Network(bandwidth={_format_bandwidth(self.bandwidth)!r}, latency={_format_latency(self.latency)!r}, "
                f"topology={self.topology!r}{label}{cpu}{memory})")

    def describe(self) -> str:
        """One line: '100 MB/s, 200 us, switch' (with the preset's name in front, if any, and the wire rate after
        the achieved one: 'ib_ndr (48 GB/s of 50 GB/s wire, 5 us, switch)')."""
        wire = f" of {_format_bandwidth(self.wire)} wire" if self.wire and self.wire != self.bandwidth else ""
        text = f"{_format_bandwidth(self.bandwidth)}{wire}, {_format_latency(self.latency)}, {self.topology}"
        if self.count_cpu:
            text += ", + CPU time"
        if self.memory_bandwidth:
            text += f", reductions at {_format_bandwidth(self.memory_bandwidth)}"
        return f"{self.name} ({text})" if self.name else text

    def with_cpu_time(self, enabled: bool = True) -> "Network":
        """This link with `count_cpu` set: each rank's CPU time between messages counts on its clock."""
        return replace(self, count_cpu=bool(enabled))

    def with_memory_bandwidth(self, bandwidth) -> "Network":
        """This link with reductions charged at a device's memory `bandwidth` (see `memory_bandwidth`)."""
        return replace(self, memory_bandwidth=bandwidth)

    @classmethod
    def cluster(cls, nodes: int, per_node: int, intra="nvlink4", inter="ib_ndr", nics: str = "per_gpu",
                name: str = "") -> "Cluster":
        """Nodes of `per_node` ranks: `intra` inside a node, `inter` between nodes (see `Cluster`)."""
        return Cluster(nodes, per_node, intra, inter, nics, name)

    @property
    def world_size(self) -> None:
        """Any number of ranks (a cluster has a fixed number)."""
        return None

    def route(self, src: int, dst: int) -> tuple:
        """(bandwidth, latency, outgoing side, incoming side or None) of a message from `src` to `dst`."""
        if self.topology == "full":
            return self.bandwidth, self.latency, ("pair", src, dst), None
        return self.bandwidth, self.latency, ("out", src), ("in", dst)

    @classmethod
    def preset(cls, name: str, topology: str | None = None) -> "Network":
        """A named link from `PRESETS` ('1GbE', '10GbE', 'ib_ndr', 'nvlink4'); see `PRESETS` for sources."""
        if name not in PRESETS:
            raise ValueError(f"no network preset called {name!r}; known: {', '.join(PRESETS)}. Or give the figures: "
                             "Network(bandwidth='100 MB/s', latency='200 us')")
        preset = PRESETS[name]
        return cls(preset.bandwidth, preset.latency, topology or preset.topology, name, kind=preset.kind,
                   wire=preset.wire)

    @classmethod
    def parse(cls, text: str) -> "Network":
        """A network from one string, as the benchmark's --network takes it: a preset's name, or
        'BANDWIDTH[, LATENCY[, TOPOLOGY]]', e.g. '100 MB/s, 200 us' or '1 GB/s, 5 us, full', or a cluster
        'NODESxPER_NODE:INTRA,INTER[,NICS]', e.g. '8x8:nvlink4,ib_ndr' or '4x8:nvlink3,ib_hdr,per_node'."""
        if isinstance(text, (Network, Cluster)):
            return text
        shape, colon, links = str(text).partition(":")
        if colon and re.fullmatch(r"\s*\d+\s*x\s*\d+\s*", shape):
            nodes, per_node = (int(n) for n in shape.split("x"))
            parts = [p.strip() for p in links.split(",") if p.strip()]
            if len(parts) not in (2, 3):
                raise ValueError(f"cluster {text!r}: write 'NODESxPER_NODE:INTRA,INTER[,NICS]', e.g. "
                                 "'8x8:nvlink4,ib_ndr'")
            nics = parts[2] if len(parts) == 3 else "per_gpu"
            return Cluster(nodes, per_node, parts[0], parts[1], int(nics) if nics.isdigit() else nics)
        parts = [p.strip() for p in str(text).split(",") if p.strip()]
        if len(parts) == 1 and parts[0] in PRESETS:
            return cls.preset(parts[0])
        if len(parts) == 2 and parts[0] in PRESETS and parts[1] in TOPOLOGIES:
            return cls.preset(parts[0], parts[1])
        if not 1 <= len(parts) <= 3:
            raise ValueError(f"network {text!r}: write a preset ({', '.join(PRESETS)}) or 'BANDWIDTH, LATENCY[, "
                             "TOPOLOGY]', e.g. '100 MB/s, 200 us' or '1 GB/s, 5 us, full'")
        return cls(*parts)

    # -- what the model says ----------------------------------------------------------------------

    def message_time(self, nbytes: float) -> float:
        """Seconds for one message of `nbytes` on an idle link: latency + nbytes / bandwidth."""
        return self.latency + nbytes / self.bandwidth

    def predict(self, algorithm, nbytes: int, world_size: int, element_size: int = 4,
                segment_bytes: int | None = None) -> float:
        """The model's seconds for one all-reduce of `nbytes` per rank on `world_size` ranks.

        `algorithm` is a name, or the all-reduce function itself (``allreduce.ring``, or your own
        ``fn(tensor)``): a function's messages are read from its code (`course_lib.recording`) and
        simulated, so a variant of your own is predicted exactly as a launch on this network would time it.

        Exactly the time a launch on this network reads for the course's implementation: the ring, the
        naive exchange and the parameter server by their formulas (the module docstring's, with the exact,
        largest chunk of `torch.tensor_split` where a length does not divide); the others by simulating
        the messages their code sends, recorded from it as a function's are, since the formulas hold only
        when G is a power of two and every length divides (tests/test_network.py checks both). Compute
        (adding the chunks) costs nothing on the modeled clock and is not in it. It may be called inside a
        launched rank: the recording leaves the rank's group, clock and traffic counts as they were.

        Args:
            algorithm: 'ring', 'ring_pipelined', 'ring_bidirectional', 'naive', 'parameter_server'
                (or 'master'), 'tree', 'halving_doubling', 'recursive_doubling', or 'builtin'
                (torch.distributed.all_reduce on the modeled clock: the faster of ring and tree, as NCCL picks).
            nbytes: bytes of the tensor on each rank.
            world_size: G.
            element_size: bytes per element (chunks are cut in whole elements): 1, 2, 4 or 8, and
                `nbytes` a whole number of them.
            segment_bytes: ring_pipelined's segment size (default: its own, 4 MiB); for a function, passed
                to it as ``segment_bytes=`` when given.
        """
        g, a, b = world_size, self.latency, self.bandwidth
        if g < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if callable(algorithm):
            return _recorded(self, algorithm, int(nbytes), g, element_size, segment_bytes)
        if algorithm not in _PREDICTED:
            raise ValueError(f"no prediction for {algorithm!r}: known {', '.join(repr(name) for name in _PREDICTED)}")
        if g == 1:
            return 0.0
        if algorithm in ("builtin", "nccl"):     # torch's all_reduce on the modeled clock: NCCL's choice
            from course_lib import torch_collectives

            return torch_collectives.collective_time(self, "all_reduce", nbytes, tuple(range(g)), element_size=element_size)
        numel = nbytes // element_size
        chunk = -(-numel // g) * element_size  # the largest of torch.tensor_split's G chunks
        full = self.topology == "full"
        if algorithm == "ring":
            return 2 * (g - 1) * (a + chunk / b)
        if algorithm == "naive":
            return a + (1 if full else g - 1) * nbytes / b
        if algorithm in ("parameter_server", "master"):
            return 2 * a + 2 * (1 if full else g - 1) * nbytes / b
        return _recorded_by_name(self, algorithm, int(nbytes), g, element_size, segment_bytes)

    def formula(self, algorithm: str, nbytes: int, world_size: int) -> float:
        """The module docstring's closed formula for `algorithm` (G a power of two, lengths that divide):
        what `predict` gives in those cases, and a first estimate otherwise."""
        g, a, b, n = world_size, self.latency, self.bandwidth, float(nbytes)
        if g == 1:
            return 0.0
        full = self.topology == "full"
        p = 1 << (g.bit_length() - 1)
        levels = (g - 1).bit_length()
        formulas = {
            "ring": lambda: 2 * (g - 1) * (a + n / g / b),
            "ring_bidirectional": lambda: 2 * (g - 1) * (a + n / g / (2 * b if full and g > 2 else b)),
            "naive": lambda: a + (1 if full else g - 1) * n / b,
            "parameter_server": lambda: 2 * a + 2 * (1 if full else g - 1) * n / b,
            "tree": lambda: 2 * levels * (a + n / b),
            "halving_doubling": lambda: 2 * math.log2(p) * a + 2 * (p - 1) / p * n / b,
            "recursive_doubling": lambda: math.log2(p) * (a + n / b),
        }
        if algorithm in ("master",):
            algorithm = "parameter_server"
        if algorithm not in formulas:
            raise ValueError(f"no closed formula for {algorithm!r}; known {', '.join(formulas)}")
        return formulas[algorithm]()


_PREDICTED = ("ring", "ring_pipelined", "ring_bidirectional", "naive", "parameter_server", "master", "tree",
              "halving_doubling", "recursive_doubling", "builtin", "nccl")
_simulated_cache: dict = {}
_recorded_cache: dict = {}          # (fn, numel, world_size, dtype, segment_bytes) -> the schedule recorded
_DTYPES = {1: "uint8", 2: "float16", 4: "float32", 8: "float64"}     # element_size -> the tensor recorded


def _recorded_by_name(network, name, nbytes, world_size, element_size, segment_bytes) -> float:
    """The course's all-reduce called `name`, its messages recorded from its code (`_recorded`); of them only
    ring_pipelined takes a segment size. It is read from the table of variants, not through `allreduce.get`: an
    exercise check refuses the learner course_lib's public functions by name while it runs
    (`exercises.tracing.Tracer`), and a tuner inside its ranks may still ask `predict` for them."""
    from course_lib import allreduce

    return _recorded(network, allreduce.VARIANTS[name], nbytes, world_size, element_size,
                     segment_bytes if name == "ring_pipelined" else None)


def _recorded(network, fn, nbytes, world_size, element_size=4, segment_bytes=None) -> float:
    """`fn`'s own messages (`recording.record_schedule`) replayed on `network` (cached: notebooks ask for the same
    sizes often). `segment_bytes`, when given, is passed to `fn` as ``segment_bytes=`` (ring_pipelined's)."""
    from course_lib import simulation

    if element_size not in _DTYPES:
        raise ValueError(f"element_size must be one of {sorted(_DTYPES)} bytes to record a function, got {element_size}")
    if nbytes % element_size:
        raise ValueError(f"nbytes={nbytes} is not a whole number of {element_size}-byte elements")
    if world_size == 1:
        return 0.0
    key = (network, fn, nbytes, world_size, element_size, segment_bytes)
    seconds = _simulated_cache.get(key)
    if seconds is None:
        events = _recorded_schedule(fn, world_size, nbytes // element_size, _DTYPES[element_size], segment_bytes)
        seconds = _simulated_cache[key] = simulation.replay(events, network).seconds
        if len(_simulated_cache) > 4096:
            _simulated_cache.clear()
    return seconds


def _recorded_schedule(fn, world_size, numel, dtype_name, segment_bytes) -> list:
    """`recording.record_schedule` of `fn`, cached for every network: recording runs the code of every rank, which
    costs tens of times what replaying the schedule does."""
    import functools

    import torch

    from course_lib import recording

    key = (fn, numel, world_size, dtype_name, segment_bytes)
    events = _recorded_cache.get(key)
    if events is None:
        call = fn if segment_bytes is None else functools.partial(fn, segment_bytes=segment_bytes)
        events = recording.record_schedule(call, world_size, numel, dtype=getattr(torch, dtype_name))
        if len(_recorded_cache) >= 256:          # a schedule on many ranks holds many events: fewer of them kept
            _recorded_cache.clear()
        _recorded_cache[key] = events
    return events


def _simulated(network, algorithm, nbytes, world_size, element_size=4, node_size=None) -> float:
    """The hand-written schedule of `algorithm` (`course_lib.schedules`: the hierarchical all-reduce) replayed on
    `network` (cached, as `_recorded`)."""
    from course_lib import schedules, simulation

    key = (network, algorithm, nbytes, world_size, element_size, node_size)
    seconds = _simulated_cache.get(key)
    if seconds is None:
        events = schedules.schedule(algorithm, nbytes, world_size, node_size=node_size, element_size=element_size)
        seconds = _simulated_cache[key] = simulation.replay(events, network).seconds
        if len(_simulated_cache) > 4096:
            _simulated_cache.clear()
    return seconds


class Preset(NamedTuple):
    """A named link: `bandwidth` is what a point-to-point copy achieves on it (bytes/s per direction), which the
    model uses for every algorithm alike (a learner's ring and NCCL's run on the same link); `wire` is the line
    rate, for comparison. `kind` says what the link is ('nvlink', 'pcie', 'infiniband', 'roce', 'ethernet')."""

    bandwidth: float
    latency: float
    topology: str
    source: str
    wire: float
    kind: str


# Named links. `bandwidth` is the rate a point-to-point copy achieves (a published measurement, or a derivation
# from the standard where none was found, said so); latencies are round order-of-magnitude assumptions of this
# course (one-way, small message, through the software stack that usually drives such a link), not datasheet
# figures. The derivations of the two Ethernet rates: a 1500-byte frame carries 1448 bytes of TCP payload (20 bytes
# of IPv4 header, 32 of TCP with timestamps: RFC 791, 793, 7323) and takes 1538 bytes of wire time (preamble 8,
# header 14, check sequence 4, interframe gap 12: IEEE 802.3), so TCP goodput is 1448/1538 = 94.1% of the line rate.
_TCP_GOODPUT = 1448 / 1538
PRESETS = {
    "1GbE": Preset(125e6 * _TCP_GOODPUT, 50e-6, "switch",
                   "Gigabit Ethernet (IEEE 802.3ab): 1 Gbit/s = 125 MB/s each way on the wire; TCP achieves 94.1% of "
                   "it (117.7 MB/s: of every 1538 bytes of wire time a frame carries 1448 of payload); 50 us one-way through kernel TCP and a switch "
                   "(an assumption)", 125e6, "ethernet"),
    "10GbE": Preset(1.25e9 * _TCP_GOODPUT, 20e-6, "switch",
                    "10 Gigabit Ethernet (IEEE 802.3ae): 10 Gbit/s = 1.25 GB/s each way on the wire; TCP achieves 94.1% "
                    "of it (1.177 GB/s: of every 1538 bytes of wire time a frame carries 1448 of payload); 20 us one-way (an assumption)", 1.25e9, "ethernet"),
    "roce100": Preset(12e9, 5e-6, "switch",
                      "100 Gigabit Ethernet with RoCE v2 (IEEE 802.3ba/bj): 12.5 GB/s each way on the wire; NCCL reaches "
                      "12 GB/s per 100G NIC (NVIDIA, NVIDIA/nccl-tests#119: '12 GB/s for 100G NICs'); 5 us one-way "
                      "with RDMA (an assumption)", 12.5e9, "roce"),
    "roce400": Preset(48e9, 5e-6, "switch",
                      "400 Gigabit Ethernet with RoCE v2 (IEEE 802.3bs): 50 GB/s each way on the wire; ConnectX-7 NICs "
                      "at 400G reach 48 GB/s in NCCL (NVIDIA, NVIDIA/nccl-tests#267, a RoCE cluster: 'up to 48-49GB/s "
                      "per NIC'); 5 us (an assumption)", 50e9, "roce"),
    "roce200": Preset(24e9, 5e-6, "switch",
                      "200 Gigabit Ethernet with RoCE v2 (IEEE 802.3bs): 25 GB/s each way on the wire; NCCL reaches 24 "
                      "GB/s per 200G NIC (NVIDIA, NVIDIA/nccl-tests#119: '24GB/s is the peak performance per 200G NIC'); "
                      "5 us (an assumption)", 25e9, "roce"),
    "ib_hdr": Preset(24e9, 5e-6, "switch",
                     "InfiniBand HDR, one 200 Gb/s port per GPU (ConnectX-6): 25 GB/s each way on the wire; NCCL reaches "
                     "24 GB/s per NIC (NVIDIA, NVIDIA/nccl-tests#119: '24GB/s is the peak performance per 200G NIC'; "
                     "a DGX A100's 8 of them give 192 GB/s of all-reduce bus bandwidth, NVIDIA/nccl#812); 5 us "
                     "(an assumption)", 25e9, "infiniband"),
    "ib_ndr": Preset(48e9, 5e-6, "switch",
                     "InfiniBand NDR, one 400 Gb/s port per GPU (ConnectX-7 user manual): 50 GB/s each way on the wire; "
                     "NCCL reaches 46-48 GB/s per NIC (NVIDIA, NVIDIA/nccl-tests#290: 'For NDR @ 400Gbps you should see "
                     "46-48GB/s per NIC'; the same ConnectX-7 at 400G on RoCE, #267: 'up to 48-49GB/s per NIC'); "
                     "5 us (an assumption)", 50e9, "infiniband"),
    "ib_xdr": Preset(96e9, 5e-6, "switch",
                     "InfiniBand XDR, one 800 Gb/s port per GPU (ConnectX-8 SuperNIC product brief): 100 GB/s each way "
                     "on the wire; no published NCCL figure was found: 96 GB/s is NDR's 96% of the line rate, carried "
                     "over (and a PCIe Gen5 host cannot feed it: the card is Gen6); 5 us (an assumption)", 100e9,
                     "infiniband"),
    "pcie4": Preset(25e9, 2e-6, "switch",
                    "PCIe 4.0 x16 (PCI-SIG: 16 GT/s per lane, 128b/130b encoding): 31.5 GB/s each way on the wire; a "
                    "copy reaches about 25 GB/s (an A100's host-to-device copy, 25.1 GB/s; nvbandwidth's README, "
                    "26.0); 2 us through the host (an assumption)", 31.5e9, "pcie"),
    "pcie5": Preset(53e9, 2e-6, "switch",
                    "PCIe 5.0 x16 (PCI-SIG: 32 GT/s per lane, 128b/130b encoding): 63 GB/s each way on the wire; a copy "
                    "reaches about 53 GB/s (an H100's device-to-host copy, 52.8 GB/s); 2 us (an assumption)", 63e9,
                    "pcie"),
    "nvlink3": Preset(230e9, 2e-6, "switch",
                      "NVLink 3 between A100 SXM GPUs through NVSwitch (12 links of 25 GB/s each way: 300 GB/s on the "
                      "wire); NCCL's copies reach about 230 GB/s (NVIDIA, NVIDIA/nccl-tests#149: 'the total effective "
                      "bandwidth should therefore be 240GB/s on A100, but some other bottlenecks on the GPUs limits it "
                      "to ~230GB/s'); 2 us (an assumption)", 300e9, "nvlink"),
    "nvlink4": Preset(370e9, 2e-6, "switch",
                      "NVLink 4 between H100 SXM GPUs through NVSwitch (H100 datasheet: 900 GB/s both ways together, "
                      "450 GB/s each way on the wire); NCCL's copies reach 370 GB/s (NVIDIA, NVIDIA/nccl-tests#212: "
                      "'With the protocol overhead (~20%) NCCL can get an effective NVLink bandwidth of 370GB/s'; "
                      "p2pBandwidthLatencyTest reads 371-377, NVIDIA/nccl#1264); 2 us (an assumption)",
                      450e9, "nvlink"),
    "nvlink5": Preset(722e9, 2e-6, "switch",
                      "NVLink 5 between B200 GPUs through NVSwitch (DGX B200 datasheet: 1.8 TB/s both ways together, "
                      "900 GB/s each way on the wire); no published copy rate was found: 722 GB/s is NCCL's own figure "
                      "for it (18 links of 40.1 GB/s, SM100_NVLINK_BW in NCCL 2.30's src/graph/topo.h; 80% of the wire, "
                      "as NVLink 4's 370 of 450); 2 us (an assumption)", 900e9, "nvlink"),
}


# --------------------------------------------------------------------------------------------------
# A cluster: nodes joined by a slower network
# --------------------------------------------------------------------------------------------------

NICS = ("per_gpu", "per_node")


def _as_link(value, what: str) -> "Network":
    if isinstance(value, Network):
        return value
    if isinstance(value, str):
        return Network.parse(value)
    raise TypeError(f"{what} must be a Network, a preset's name ({', '.join(PRESETS)}) or 'BANDWIDTH, LATENCY', "
                    f"got {type(value).__name__}")


@dataclass(frozen=True)
class Cluster:
    """`nodes` nodes of `per_node` ranks each: rank r sits on node r // per_node.

    Inside a node a message takes the `intra` link (its topology too: "switch" for NVLink through an
    NVSwitch, "full" for a mesh of direct links). Between nodes it takes the `inter` link's bandwidth and
    latency through network cards on a non-blocking fabric: with ``nics="per_gpu"`` every rank has a
    card of its own (rail-optimised clusters: an outgoing and an incoming side per rank, as on a switch);
    with ``nics="per_node"`` the ranks of a node share one card, so messages leaving (or entering) a node
    at the same time queue on its one side. A launch may use fewer ranks than the cluster has.

    Args:
        nodes, per_node: the shape (whole numbers >= 1).
        intra, inter: `Network`s or preset names ("nvlink4", "ib_ndr", ...).
        nics: "per_gpu" or "per_node".
        name: a label for tables and plots.
        count_cpu, memory_bandwidth: as for a `Network`.

    Example::

        >>> dgx = Network.cluster(nodes=8, per_node=8, intra="nvlink4", inter="ib_ndr")
        >>> dgx.world_size
        64
        >>> dgx.predict("ring", 64 * 2**20) > dgx.predict("hierarchical", 64 * 2**20)
        True
    """

    nodes: int
    per_node: int
    intra: Network = "nvlink4"
    inter: Network = "ib_ndr"
    nics: str = "per_gpu"
    name: str = ""
    count_cpu: bool = False
    memory_bandwidth: float | None = None

    def __post_init__(self):
        if self.memory_bandwidth is not None:
            object.__setattr__(self, "memory_bandwidth", parse_bandwidth(self.memory_bandwidth))
        for field_name in ("nodes", "per_node"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field_name} must be a whole number >= 1, got {value!r}")
        object.__setattr__(self, "intra", _as_link(self.intra, "intra"))
        object.__setattr__(self, "inter", _as_link(self.inter, "inter"))
        if self.nics not in NICS and not (isinstance(self.nics, int) and not isinstance(self.nics, bool)
                                          and 1 <= self.nics <= self.per_node and self.per_node % self.nics == 0):
            raise ValueError(f"nics must be 'per_gpu' (a network card per rank, rail-optimised), 'per_node' (one "
                             f"card a node's ranks share) or a number of cards per node that divides per_node="
                             f"{self.per_node}, not {self.nics!r}")

    @property
    def world_size(self) -> int:
        """The most ranks it holds: nodes x per_node."""
        return self.nodes * self.per_node

    def node(self, rank: int) -> int:
        return rank // self.per_node

    def describe(self) -> str:
        text = (f"{self.nodes} x {self.per_node} ranks; inside a node {self.intra.describe()}; between nodes "
                f"{self.inter.describe()}, {self._cards_text()}")
        if self.count_cpu:
            text += "; + CPU time"
        return f"{self.name} ({text})" if self.name else text

    def __repr__(self) -> str:
        label = f", name={self.name!r}" if self.name else ""
        return (f"Network.cluster(nodes={self.nodes}, per_node={self.per_node}, intra={self.intra.name or self.intra!r}"
                f", inter={self.inter.name or self.inter!r}, nics={self.nics!r}{label})")

    def with_cpu_time(self, enabled: bool = True) -> "Cluster":
        return replace(self, count_cpu=bool(enabled))

    def with_memory_bandwidth(self, bandwidth) -> "Cluster":
        return replace(self, memory_bandwidth=bandwidth)

    @property
    def cards(self) -> int:
        """Network cards per node."""
        return self.per_node if self.nics == "per_gpu" else 1 if self.nics == "per_node" else self.nics

    def _cards_text(self) -> str:
        if self.nics == "per_gpu":
            return "one card per rank"
        return "one card per node" if self.cards == 1 else f"{self.cards} cards per node"

    def card(self, rank: int) -> tuple:
        """The network card `rank` sends and receives through: (node, card index)."""
        return self.node(rank), (rank % self.per_node) * self.cards // self.per_node

    def route(self, src: int, dst: int) -> tuple:
        """(bandwidth, latency, outgoing side, incoming side or None) of a message from `src` to `dst`."""
        if self.node(src) == self.node(dst):
            bandwidth, latency, out_side, in_side = self.intra.route(src, dst)
            return bandwidth, latency, ("intra",) + out_side, None if in_side is None else ("intra",) + in_side
        return self.inter.bandwidth, self.inter.latency, ("card_out", self.card(src)), ("card_in", self.card(dst))

    def predict(self, algorithm, nbytes: int, world_size: int | None = None, element_size: int = 4,
                segment_bytes: int | None = None) -> float:
        """The model's seconds for one all-reduce of `nbytes` per rank on the first `world_size` ranks (default:
        all), simulated with the cluster's links: any algorithm `Network.predict` knows, as the messages its
        code sends (the ring is one ring over every rank, in rank order, so it crosses between nodes), and
        'hierarchical' (`course_lib.schedules`' schedule: reduce-scatter inside each node, a ring all-reduce
        of each shard across nodes on its own rail, all-gather inside each node). `algorithm` may be the
        function itself, as for `Network.predict`."""
        g = self.world_size if world_size is None else world_size
        if not 1 <= g <= self.world_size:
            raise ValueError(f"world_size must be 1..{self.world_size} on {self.nodes} nodes of {self.per_node}, got {g}")
        if callable(algorithm):
            return _recorded(self, algorithm, int(nbytes), g, element_size, segment_bytes)
        if algorithm not in _PREDICTED + ("hierarchical",):
            raise ValueError(f"no prediction for {algorithm!r}: known "
                             f"{', '.join(repr(name) for name in _PREDICTED + ('hierarchical',))}")
        if g == 1:
            return 0.0
        if algorithm in ("builtin", "nccl"):
            from course_lib import torch_collectives

            return torch_collectives.collective_time(self, "all_reduce", nbytes, tuple(range(g)), element_size=element_size)
        if algorithm == "hierarchical":
            return _simulated(self, algorithm, int(nbytes), g, element_size, self.per_node)
        return _recorded_by_name(self, algorithm, int(nbytes), g, element_size, segment_bytes)

    def collective_time(self, kind: str, nbytes: int, members) -> float:
        from course_lib import torch_collectives

        return torch_collectives.collective_time(self, kind, nbytes, members)



# --------------------------------------------------------------------------------------------------
# What the launch measured
# --------------------------------------------------------------------------------------------------


def current():
    """The network modeled in this rank (a `Network` or `Cluster`), or None (plain loopback)."""
    from course_lib import runtime

    return runtime.current_network()


def last_launch():
    """In the launching process: what the last launch on a modeled network counted (`LaunchStats`), or None."""
    from course_lib import modeled_clock as clock

    return clock.last_launch()


def report_late(enabled: bool = True) -> None:
    """Kept so notebooks written for the sleeping model still run: on the modeled clock no message can be late
    (time is computed, not waited for), so there is nothing to report either way."""


def __getattr__(name):
    if name == "LaunchStats":
        from course_lib.modeled_clock import LaunchStats

        return LaunchStats
    raise AttributeError(f"module 'course_lib.network' has no attribute {name!r}")
