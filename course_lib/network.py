"""A modeled network under every point-to-point message, so a laptop can show what a cluster's link does.

On a laptop, Colab or Binder the ranks share a few cores and talk over loopback at several GB/s: a
message's time is set by the CPU, not by a link, and the course's formulas (the master's link is the
bottleneck; the ring's time hardly grows with G) never show on the clock. With a `Network`, every
message a rank sends pays for a link you choose::

    net = course_lib.Network(bandwidth="100 MB/s", latency="200 us")       # topology="switch"
    course_lib.launch(fn, world_size=4, network=net)

The real transfer still happens (over loopback, underneath), and the call then waits until the time
the modeled link would have delivered it. Every `course_lib.p2p` call and torch.distributed's own
``send`` / ``recv`` / ``isend`` / ``irecv`` (and ``batch_isend_irecv`` on gloo, made of them) are modeled,
blocking and non-blocking alike; a call never completes before its modeled time.

The model
---------
B is the bandwidth (bytes per second, each direction), a the latency (seconds), n a message's bytes.

``topology="switch"`` (the default): every rank has one full-duplex link into a non-blocking switch,
an outgoing side and an incoming side. A message from rank s to rank d

1. leaves s's outgoing side when it is free:            start = max(now, out_free[s]);
   it occupies that side for n/B:                       out_free[s] = start + n/B
   (a blocking send, or an isend's wait, completes then: the data has left the rank);
2. enters d's incoming side at the earliest time >= start at which that side is free for n/B (the
   switch buffers it meanwhile: s's side is not held up by a busy receiver), and
3. arrives a after its last byte went through:           arrival = in_start + n/B + a.
   The receive completes at max(arrival, when it was called).

``topology="full"``: every ordered pair of ranks has a link of its own (a full mesh, as between the
GPUs of an AMD MI300X platform or in a small NVLink mesh): one queue per destination on the sending
side, no shared incoming side, so arrival = start + n/B + a with start = max(now, out_free[s][d]).

Compute between messages (adding chunks, a backward pass) is real time on this machine; only
messages are modeled. What the model predicts for the course's all-reduces (`Network.predict`):

    algorithm           switch                                   full
    ring                2(G-1) (a + c/B)                         the same (one neighbour each way)
    ring_bidirectional  2(G-1) (a + c/B)                         2(G-1) (a + c/(2B))  (G > 2)
    ring_pipelined      (R-1) max(k u, u + a) + k u + a          the same
    naive               a + (G-1) N/B                            a + N/B
    parameter_server    2a + 2(G-1) N/B                          2a + 2N/B
    tree                2 L (a + N/B) when G = 2^L               the same
                        (less otherwise: followed through the schedule by `predict`)
    halving_doubling    2 log2(P) a + 2(P-1)/P N/B  (+ up to 2(a + N/B) when G != P: see below)
    recursive_doubling  log2(P) (a + N/B)           (+ up to 2(a + N/B) when G != P)

N = bytes per rank, c = the largest chunk's bytes (N/G), L = ceil(log2 G), P the largest power of two
<= G, R = 2(G-1) rounds of k segments of u = c/(k B) seconds each. When G is not a power of two, the
tree, halving-doubling and recursive doubling have ranks that start early (no children, no fold
partner), and `predict` follows their schedules rather than adding whole steps. The latency a is paid once per
message *in flight*, not once per message sent: messages that leave one after another overlap their
latencies (the naive exchange pays one a, not G-1), unlike the course's step-count model in
`course_lib.cost`, where alpha stands for the software cost of a step, which cannot overlap.

What it leaves out: congestion inside the switch (it is non-blocking: only the ranks' own sides
queue), TCP (slow start, acknowledgements, retransmission, window limits), the NIC's own work and
offloads (checksums, RDMA, GPUDirect), packet headers, and any cost of a message that is not a
point-to-point one: torch.distributed's built-in collectives (``dist.all_reduce`` and the rest) run
at this machine's speed, and the first one a learner calls under a network says so once. The
incoming side serves messages in the order of their start times as far as it knows them: a rank
books a message when its receive completes, so a message received late can take an earlier free gap.

The model can only add time: a link faster than this machine's own loopback and per-message cost
(tens of microseconds to a millisecond here) cannot be modeled. A receive that completes later than
its modeled arrival by more than half the message's modeled time (and 0.2 ms) is counted as late;
after a launch in which more than a tenth of the messages were late, `launch` says so in one line,
and `last_launch()` gives the counts (`report_late(False)` keeps the line back, for code that checks
the counts itself). All ranks must be on one
machine: they share its clock and a small table of message start times (a memory-mapped file).
"""

from __future__ import annotations

import math
import mmap
import os
import re
import sys
import threading
import time
import zlib
from bisect import bisect_right
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

__all__ = ["Network", "PRESETS", "parse_bandwidth", "parse_latency", "current", "last_launch", "LaunchStats",
           "report_late"]


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
    for unit, size in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
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

    def __post_init__(self):
        object.__setattr__(self, "bandwidth", parse_bandwidth(self.bandwidth))
        object.__setattr__(self, "latency", parse_latency(self.latency))
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"topology must be 'switch' (one link per rank into a switch) or 'full' (a link per "
                             f"pair of ranks), not {self.topology!r}")

    def __repr__(self) -> str:
        label = f", name={self.name!r}" if self.name else ""
        return (f"Network(bandwidth={_format_bandwidth(self.bandwidth)!r}, latency={_format_latency(self.latency)!r}, "
                f"topology={self.topology!r}{label})")

    def describe(self) -> str:
        """One line: '100 MB/s, 200 us, switch' (with the preset's name in front, if any)."""
        text = f"{_format_bandwidth(self.bandwidth)}, {_format_latency(self.latency)}, {self.topology}"
        return f"{self.name} ({text})" if self.name else text

    @classmethod
    def preset(cls, name: str, topology: str | None = None) -> "Network":
        """A named link from `PRESETS` ('1GbE', '10GbE', 'ib_ndr', 'nvlink4'); see `PRESETS` for sources."""
        if name not in PRESETS:
            raise ValueError(f"no network preset called {name!r}; known: {', '.join(PRESETS)}. Or give the figures: "
                             "Network(bandwidth='100 MB/s', latency='200 us')")
        bandwidth, latency, default_topology, _source = PRESETS[name]
        return cls(bandwidth, latency, topology or default_topology, name)

    @classmethod
    def parse(cls, text: str) -> "Network":
        """A network from one string, as the benchmark's --network takes it: a preset's name, or
        'BANDWIDTH[, LATENCY[, TOPOLOGY]]', e.g. '100 MB/s, 200 us' or '1 GB/s, 5 us, full'."""
        if isinstance(text, Network):
            return text
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

    def predict(self, algorithm: str, nbytes: int, world_size: int, element_size: int = 4,
                segment_bytes: int | None = None) -> float:
        """The model's seconds for one all-reduce of `nbytes` per rank on `world_size` ranks.

        The formulas of the module docstring, with the exact (largest) chunk of `torch.tensor_split`
        where a length does not divide. Compute (adding the chunks) and this machine's own cost per
        message are not in it: a measured time is this plus them.

        Args:
            algorithm: 'ring', 'ring_pipelined', 'ring_bidirectional', 'naive', 'parameter_server'
                (or 'master'), 'tree', 'halving_doubling' or 'recursive_doubling'.
            nbytes: bytes of the tensor on each rank.
            world_size: G.
            element_size: bytes per element (chunks are cut in whole elements).
            segment_bytes: ring_pipelined's segment size (default: its own, 4 MiB).
        """
        g, a, b = world_size, self.latency, self.bandwidth
        if g < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if g == 1:
            return 0.0
        numel = nbytes // element_size
        chunk = -(-numel // g) * element_size  # the largest of torch.tensor_split's G chunks
        full = self.topology == "full"
        if algorithm == "ring":
            return 2 * (g - 1) * (a + chunk / b)
        if algorithm == "ring_bidirectional":
            half = -(-(-(-numel // g)) // 2) * element_size  # the larger half of the largest chunk
            # On a full mesh the halves going left and right take two links, at once; with 2 ranks the left and
            # right neighbour are one rank, and both halves queue on the one link to it, as on a switch.
            two_links = full and g > 2
            return 2 * (g - 1) * (a + (half if two_links else 2 * half) / b)
        if algorithm == "ring_pipelined":
            from course_lib.fast_allreduce import SEGMENT_BYTES, segments_per_chunk

            k = segments_per_chunk(numel, g, element_size, segment_bytes or SEGMENT_BYTES)
            u = chunk / k / b
            rounds = 2 * (g - 1)
            return (rounds - 1) * max(k * u, u + a) + k * u + a
        if algorithm == "naive":
            return a + (1 if full else g - 1) * nbytes / b
        if algorithm in ("parameter_server", "master"):
            return 2 * a + 2 * (1 if full else g - 1) * nbytes / b
        if algorithm == "tree":
            return _tree_time(g, a, nbytes / b, self.topology == "switch")
        if algorithm == "recursive_doubling":
            steps = (1 << (g.bit_length() - 1)).bit_length() - 1
            return _pairwise_time(g, a, nbytes / b, [nbytes / b] * steps)
        if algorithm == "halving_doubling":
            p = 1 << (g.bit_length() - 1)
            halves = [nbytes / b / 2 ** (j + 1) for j in range(p.bit_length() - 1)]
            return _pairwise_time(g, a, nbytes / b, halves + halves[::-1])
        raise ValueError(f"no prediction for {algorithm!r}: known 'ring', 'ring_pipelined', 'ring_bidirectional', "
                         "'naive', 'parameter_server', 'tree', 'halving_doubling', 'recursive_doubling'")


def _pairwise_time(world_size: int, latency: float, fold_wire: float, step_wires: list) -> float:
    """halving_doubling's and recursive_doubling's time under the model, followed through the schedule.

    The P = 2^k ranks that take part swap messages with a partner at every step (`step_wires`: the
    seconds each step's message occupies a link); a step ends when the partner's message has arrived
    and one's own has left. When G is not a power of two, the first 2E ranks fold in pairs first and
    unfold at the end (`fold_wire` each way). A folded-into rank starts the steps late, but a partner
    that did not fold starts at once, so the fold's delay reaches only some ranks: when G = P + E with
    E small, the whole takes fewer hops than fold + steps + unfold (G = 3: 2 latencies, not 3).
    Partners differ at every step, so no incoming side ever queues two messages.
    """
    p = 1 << (world_size.bit_length() - 1)
    extra = world_size - p
    hop = lambda wire: wire + latency  # noqa: E731  one message on an idle link
    # when each of the P virtual ranks can start: after its fold partner's tensor arrived, or at once
    ready = [hop(fold_wire) if v < extra else 0.0 for v in range(p)]
    for step, wire in enumerate(step_wires):
        distance = _partner_distance(p, step, len(step_wires))
        ready = [max(ready[v] + wire, ready[v ^ distance] + hop(wire)) for v in range(p)]
    unfolded = [ready[v] + hop(fold_wire) for v in range(extra)]
    return max(ready + unfolded)


def _partner_distance(p: int, step: int, steps: int) -> int:
    """The partner distance at `step`: halving_doubling goes P/2, ..., 1 then 1, ..., P/2 (2 log2 P
    steps); recursive_doubling goes 1, 2, ..., P/2 (log2 P steps)."""
    k = p.bit_length() - 1
    if steps == k:                      # recursive doubling
        return 1 << step
    return p >> (step + 1) if step < k else 1 << (step - k)


def _tree_time(world_size: int, latency: float, wire: float, switch: bool) -> float:
    """The binomial tree's time under the model, followed through its schedule (fast_allreduce.tree).

    When G is a power of two this is 2 L (a + N/B). Otherwise some ranks have fewer children and send
    up early, so the tree finishes sooner than its L levels suggest (G = 5: 4a + 5 N/B, not 6(a + N/B)).
    """
    from course_lib.fast_allreduce import _children

    children = {r: _children(r, world_size) for r in range(world_size)}
    done = {}  # reduce: when rank r's partial sum is complete (and it sends it up)
    for r in reversed(range(world_size)):  # children have higher ranks than their parent
        incoming, t = _Calendar(), 0.0
        for child in children[r]:  # received one after another, nearest first
            start = incoming.book(done[child], wire) if switch else done[child]
            t = max(t, start + wire + latency)
        done[r] = t
    has = {0: done[0]}  # broadcast: when rank r has the result
    for r in range(world_size):
        free = has[r]
        for child in reversed(children[r]):  # farthest first, each send after the last has left
            has[child] = free + wire + latency
            free += wire
    return max(has.values())


# Named links. Bandwidths are the standard line rates or vendor figures, per direction; latencies are
# round order-of-magnitude assumptions of this course (one-way, small message, through the software
# stack that usually drives such a link), not datasheet figures.
PRESETS = {
    "1GbE": (125e6, 50e-6, "switch",
             "Gigabit Ethernet (IEEE 802.3ab): 1 Gbit/s = 125 MB/s each way; 50 us one-way through kernel TCP and "
             "a switch (an assumption)"),
    "10GbE": (1.25e9, 20e-6, "switch",
              "10 Gigabit Ethernet (IEEE 802.3ae): 10 Gbit/s = 1.25 GB/s each way; 20 us one-way (an assumption)"),
    "ib_ndr": (50e9, 5e-6, "switch",
               "InfiniBand NDR, one 400 Gb/s port per GPU (ConnectX-7 user manual): 50 GB/s each way; 5 us, as "
               "course_lib.cost.INFINIBAND_NDR"),
    "nvlink4": (450e9, 2e-6, "switch",
                "NVLink 4 between H100 SXM GPUs through NVSwitch (H100 datasheet: 900 GB/s both ways together): "
                "450 GB/s each way; 2 us, as course_lib.cost.NVLINK4_H100"),
}


# --------------------------------------------------------------------------------------------------
# The shared table: what a sender tells the receiver about each message
# --------------------------------------------------------------------------------------------------
#
# A receiver needs to know when its message started to leave the sender. The sender writes that
# (with the message's size, tag and ordinal) into a memory-mapped file all ranks share, before the
# real send; the receiver reads it after the real receive, so it is always there. One ring of slots
# per ordered pair of ranks; a slot is free again once the receiver has marked it consumed.
#
# Which slot goes with which receive: gloo matches messages between two ranks with the same group
# and tag in order, so the k-th send from s to d with (group, tag) is the k-th receive of d from s
# with (group, tag): both sides count, and the count (the ordinal) is stored in the slot.

_SEQ, _GROUP, _TAG, _ORDINAL, _START, _NBYTES, _CONSUMED = range(7)
_FIELDS = 7
_COUNTERS = 4  # per rank: messages received, late ones, their seconds late, modeled receive seconds


def _slots_per_pair(world_size: int) -> int:
    return 256 if world_size <= 16 else 64


def table_bytes(world_size: int) -> int:
    """Size of the shared file for `world_size` ranks."""
    return 8 * (world_size * world_size * _slots_per_pair(world_size) * _FIELDS + world_size * _COUNTERS)


def create_table(path: str, world_size: int) -> None:
    """Create the zero-filled shared file (sparse: pages are only allocated where ranks write)."""
    with open(path, "wb") as f:
        f.truncate(table_bytes(world_size))


class _Table:
    """The shared file, as flat float64s: slot fields per ordered pair, then per-rank counters."""

    def __init__(self, path: str, world_size: int):
        self.world_size, self.slots = world_size, _slots_per_pair(world_size)
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), table_bytes(world_size))
        self.cells = memoryview(self._map).cast("d")
        self._counters = world_size * world_size * self.slots * _FIELDS

    def base(self, src: int, dst: int, slot: int) -> int:
        return ((src * self.world_size + dst) * self.slots + slot) * _FIELDS

    def counter(self, rank: int, index: int) -> int:
        return self._counters + rank * _COUNTERS + index

    def close(self) -> None:
        self.cells.release()
        self._map.close()


def read_counters(path: str, world_size: int) -> list[tuple[float, ...]]:
    """Every rank's (received, late, seconds late, modeled seconds), read by the launcher after a run."""
    table = _Table(path, world_size)
    try:
        return [tuple(table.cells[table.counter(r, i)] for i in range(_COUNTERS)) for r in range(world_size)]
    finally:
        table.close()


# --------------------------------------------------------------------------------------------------
# A rank's side of the model
# --------------------------------------------------------------------------------------------------


class _Calendar:
    """When one incoming side is busy: sorted, merged [start, end) intervals, booked earliest-fit."""

    HORIZON = 60.0  # forget intervals that ended this many seconds before the newest booking

    def __init__(self):
        self.starts: list[float] = []
        self.ends: list[float] = []

    def book(self, earliest: float, duration: float) -> float:
        """Reserve `duration` seconds at the first free moment >= `earliest`; return that moment."""
        t = earliest
        i = bisect_right(self.ends, t)  # the first interval that ends after t
        while i < len(self.starts) and self.starts[i] < t + duration:
            t = max(t, self.ends[i])
            i += 1
        self._insert(t, t + duration)
        return t

    def _insert(self, start: float, end: float) -> None:
        i = bisect_right(self.starts, start)
        self.starts.insert(i, start)
        self.ends.insert(i, end)
        # merge with touching neighbours, so a stream of back-to-back messages stays one interval
        for j in (i, i - 1):
            if 0 <= j < len(self.starts) - 1 and self.ends[j] >= self.starts[j + 1]:
                self.ends[j] = max(self.ends[j], self.ends.pop(j + 1))
                self.starts.pop(j + 1)
        if self.starts and self.ends[0] < end - self.HORIZON:
            keep = bisect_right(self.ends, end - self.HORIZON)
            del self.starts[:keep], self.ends[:keep]


def _group_code(group) -> int:
    """A number for the process group that is the same on every rank (0 for the default group)."""
    if group is None or group is distributed_c10d.GroupMember.WORLD:
        return 0
    return zlib.crc32(distributed_c10d._get_process_group_name(group).encode()) + 1


class _Model:
    """This rank's bookkeeping: its sending sides' free times, its incoming calendar, the ordinals."""

    def __init__(self, network: Network, table: _Table, rank: int):
        self.network, self.table, self.rank = network, table, rank
        self.lock = threading.Lock()
        self.out_free: dict = {}      # destination (full) or None (switch) -> time the side is free
        self.incoming = _Calendar()
        self.sent: dict = {}          # (dst, group, tag) -> messages sent so far
        self.posted: dict = {}        # (src, group, tag) -> receives posted so far
        self.next_slot: dict = {}     # (src, dst) -> where to look first
        self.seq: dict = {}           # dst -> messages written to the pair (src=rank, dst)

    # -- sending ---------------------------------------------------------------------------------

    def book_send(self, dst: int, group: int, tag: int, nbytes: int) -> float:
        """Book a message's departure and tell the receiver; return when it has left (the send's end)."""
        network = self.network
        with self.lock:
            side = dst if network.topology == "full" else None
            start = max(time.monotonic(), self.out_free.get(side, 0.0))
            end = self.out_free[side] = start + nbytes / network.bandwidth
            key = (dst, group, tag)
            ordinal = self.sent[key] = self.sent.get(key, 0) + 1
            self._write_slot(dst, group, tag, ordinal, start, nbytes)
        return end

    def _write_slot(self, dst, group, tag, ordinal, start, nbytes) -> None:
        table, cells = self.table, self.table.cells
        first = self.next_slot.get((self.rank, dst), 0)
        for offset in range(table.slots):
            slot = (first + offset) % table.slots
            base = table.base(self.rank, dst, slot)
            if cells[base + _SEQ] == 0 or cells[base + _CONSUMED] == 1:
                break
        else:
            raise RuntimeError(
                f"rank {self.rank}: more than {table.slots} messages to rank {dst} are waiting to be received under "
                "the modeled network. Receive (or wait for) messages before sending many more.")
        self.next_slot[(self.rank, dst)] = (slot + 1) % table.slots
        cells[base + _GROUP], cells[base + _TAG], cells[base + _ORDINAL] = group, tag, ordinal
        cells[base + _START], cells[base + _NBYTES], cells[base + _CONSUMED] = start, nbytes, 0
        self.seq[dst] = self.seq.get(dst, 0) + 1
        cells[base + _SEQ] = self.seq[dst]  # written last: the slot is valid from here on

    # -- receiving -------------------------------------------------------------------------------

    def post_receive(self, src: int, group: int, tag: int) -> int:
        """Count a receive from `src` when it is posted: its ordinal matches the sender's count."""
        key = (src, group, tag)
        with self.lock:
            ordinal = self.posted[key] = self.posted.get(key, 0) + 1
        return ordinal

    def complete_receive(self, src: int, group: int, tag: int, ordinal: int, called: float) -> float:
        """Book a message that has really arrived; return its modeled arrival (or 0 if unknown)."""
        network, table, cells = self.network, self.table, self.table.cells
        with self.lock:
            base = self._find_slot(src, group, tag, ordinal)
            if base is None:
                return 0.0  # sent by something the model does not see: nothing to wait for
            start, nbytes = cells[base + _START], cells[base + _NBYTES]
            cells[base + _CONSUMED] = 1
            duration = nbytes / network.bandwidth
            if network.topology == "switch":
                start = self.incoming.book(start, duration)
            arrival = start + duration + network.latency
            now = time.monotonic()
            received, late, late_seconds, modeled = (table.counter(self.rank, i) for i in range(_COUNTERS))
            cells[received] += 1
            cells[modeled] += duration + network.latency
            # Late: the real message completed well after both the modeled arrival and the call (by more
            # than half the message's modeled time, and more than a scheduler's hiccup), so the time it took
            # is this machine's, not the link's.
            excess = now - max(arrival, called)
            if excess > LATE_SLACK + 0.5 * (duration + network.latency):
                cells[late] += 1
                cells[late_seconds] += excess
        return arrival

    def _find_slot(self, src, group, tag, ordinal):
        table, cells = self.table, self.table.cells
        first = self.next_slot.get((src, self.rank), 0)
        for offset in range(table.slots):
            slot = (first + offset) % table.slots
            base = table.base(src, self.rank, slot)
            if (cells[base + _SEQ] != 0 and cells[base + _CONSUMED] == 0 and cells[base + _ORDINAL] == ordinal
                    and cells[base + _TAG] == tag and cells[base + _GROUP] == group):
                self.next_slot[(src, self.rank)] = (slot + 1) % table.slots
                return base
        return None


LATE_SLACK = 2e-4  # seconds: a receive this much (plus half its modeled time) after its modeled arrival is late


def _sleep_until(deadline: float) -> None:
    remaining = deadline - time.monotonic()
    if remaining > 0:
        time.sleep(remaining)


# --------------------------------------------------------------------------------------------------
# torch.distributed's point-to-point calls, modeled
# --------------------------------------------------------------------------------------------------

_model: _Model | None = None
_original: dict = {}  # name -> torch's own function, while a network is active
P2P_CALLS = ("send", "recv", "isend", "irecv")
# Built-ins that move data but are not modeled: the first call from a learner's code says so.
UNMODELED = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
             "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
             "all_to_all_single", "gather", "gather_object", "scatter", "scatter_object_list")
_COURSE_LIB_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _global_peer(group, peer, group_peer):
    """The global rank torch means by (peer, group_peer): `peer` is global already, `group_peer` is in `group`."""
    if group_peer is None:
        return peer
    if _group_code(group) == 0:
        return group_peer
    return dist.get_global_rank(group, group_peer)


class _ModeledWork:
    """What a modeled isend / irecv returns: torch's Work, whose `wait()` also waits for the model."""

    def __init__(self, work, finish):
        self._work, self._finish, self._deadline = work, finish, None

    def _modeled_end(self) -> float:
        if self._deadline is None:
            self._deadline = self._finish(self._work)
        return self._deadline

    def wait(self, timeout=None) -> bool:
        if self._deadline is None:  # gloo hangs on a second wait of a receive: wait for real only once
            called = time.monotonic()
            result = self._work.wait() if timeout is None else self._work.wait(timeout)
            if result is False:
                return result
            self._deadline = self._finish(self._work, called)
        _sleep_until(self._deadline)
        return True

    def is_completed(self) -> bool:
        if self._deadline is None and not self._work.is_completed():
            return False
        return time.monotonic() >= self._modeled_end()

    def __getattr__(self, name):
        return getattr(self._work, name)


def _isend(tensor, dst=None, group=None, tag=0, group_dst=None):
    peer = _global_peer(group, dst, group_dst)
    end = _model.book_send(peer, _group_code(group), tag, tensor.numel() * tensor.element_size())
    work = _original["isend"](tensor, dst, group=group, tag=tag, group_dst=group_dst)
    return _ModeledWork(work, lambda _work, called=None: end)


def _irecv(tensor, src=None, group=None, tag=0, group_src=None):
    code = _group_code(group)
    peer = _global_peer(group, src, group_src)
    ordinal = _model.post_receive(peer, code, tag) if peer is not None else None
    work = _original["irecv"](tensor, src, group=group, tag=tag, group_src=group_src)

    def finish(work, called=None):
        sender, number = peer, ordinal
        if sender is None:  # from any source: now we know who sent it
            source = work._source_rank()
            sender = source if group is None else dist.get_global_rank(group, source)
            number = _model.post_receive(sender, code, tag)
        return _model.complete_receive(sender, code, tag, number, time.monotonic() if called is None else called)

    return _ModeledWork(work, finish)


def _send(tensor, dst=None, group=None, tag=0, group_dst=None):
    _isend(tensor, dst, group, tag, group_dst).wait()


def _recv(tensor, src=None, group=None, tag=0, group_src=None):
    work = _irecv(tensor, src, group, tag, group_src)
    work.wait()
    if src is None and group_src is None:  # from any source: say who it was, as torch's recv does
        source = work._source_rank()
        return source if _group_code(group) == 0 else dist.get_global_rank(group, source)
    return _global_peer(group, src, group_src)


# torch's own send / recv are isend / irecv plus a wait, and its batch_isend_irecv calls the functions
# its P2POps name (dist.isend / dist.irecv, these) one by one on gloo: all four are modeled through
# _isend and _irecv. (On NCCL, batch_isend_irecv coalesces the operations itself and is not modeled.)
_MODELED = {"send": _send, "recv": _recv, "isend": _isend, "irecv": _irecv}


def _unmodeled_notice(name, original):
    def call(*args, **kwargs):
        caller = sys._getframe(1).f_code.co_filename
        if not caller.startswith(_COURSE_LIB_DIR) and name not in _told:
            _told.add(name)
            print(f"course_lib: torch.distributed.{name} is not modeled: under a modeled network only point-to-point "
                  "messages (send/recv/isend/irecv) pay for the link; built-in collectives run at this machine's "
                  "speed.", file=sys.stderr, flush=True)
        return original(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = original.__doc__
    call.__wrapped__ = original
    return call


_told: set = set()


def activate(network: Network, table_path: str, rank: int, world_size: int) -> None:
    """Model every point-to-point message of this process from now on (called on every rank).

    Replaces torch.distributed's send / recv / isend / irecv (in both ``torch.distributed`` and
    ``torch.distributed.distributed_c10d``, so code that imported either is modeled, and so is torch's
    batch_isend_irecv, which calls them), and wraps the built-in collectives to say once that they
    are not modeled.
    """
    global _model
    if _model is not None:
        raise RuntimeError("a modeled network is already active in this process")
    _model = _Model(network, _Table(table_path, world_size), rank)
    for name in P2P_CALLS:
        _original[name] = getattr(distributed_c10d, name)
        for module in (dist, distributed_c10d):
            setattr(module, name, _MODELED[name])
    for name in UNMODELED:
        if hasattr(dist, name):
            _original[name] = getattr(dist, name)
            setattr(dist, name, _unmodeled_notice(name, _original[name]))


def deactivate() -> None:
    """Undo `activate` (run_torchrun runs in the caller's process, which goes on afterwards)."""
    global _model
    if _model is None:
        return
    for name, function in _original.items():
        setattr(dist, name, function)
        if name in P2P_CALLS:
            setattr(distributed_c10d, name, function)
    _original.clear()
    _model.table.close()
    _model = None


def current() -> Network | None:
    """The network modeled in this rank, or None (plain loopback)."""
    return None if _model is None else _model.network


# --------------------------------------------------------------------------------------------------
# After a launch: was the model honest?
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchStats:
    """What the ranks of one launch under a network counted (`last_launch()`).

    Attributes:
        network: the modeled link.
        messages: point-to-point messages received, all ranks together.
        late: how many of them completed later than the model allows (the machine was slower).
        late_seconds: by how much, summed.
        modeled_seconds: the model's transfer time of those messages, summed.
    """

    network: Network
    messages: int
    late: int
    late_seconds: float
    modeled_seconds: float

    @property
    def late_share(self) -> float:
        return self.late / self.messages if self.messages else 0.0

    def notice(self) -> str | None:
        """One line when more than a tenth of the messages were late, else None."""
        if self.late_share <= 0.1:
            return None
        return (f"{self.late} of {self.messages} messages took longer on this machine than on the modeled link "
                f"({self.network.describe()}), by {1e3 * self.late_seconds / self.late:.2g} ms each on average: their "
                "times are this machine's, not the link's. Model a slower link (e.g. Network('100 MB/s', '1 ms')).")


_last: LaunchStats | None = None


def record_launch(network: Network, table_path: str, world_size: int) -> LaunchStats:
    """Read the ranks' counters after a launch; remember them for `last_launch()`."""
    global _last
    rows = read_counters(table_path, world_size)
    _last = LaunchStats(network, int(sum(r[0] for r in rows)), int(sum(r[1] for r in rows)),
                        sum(r[2] for r in rows), sum(r[3] for r in rows))
    return _last


_report_late = True


def report_late(enabled: bool = True) -> None:
    """Whether `launch` prints its one line after a launch whose messages this machine could not keep up with.

    On by default. Code that times several repetitions and holds the fastest to the model itself (as the
    notebooks do) can switch it off: on a shared machine one slow repetition is expected, and a line that
    appears in some runs and not others would make a notebook's stored output differ from a fresh run's.
    `last_launch()` still gives the counts.

    Example:
        >>> course_lib.network.report_late(False)
    """
    global _report_late
    _report_late = bool(enabled)


def reports_late() -> bool:
    """True unless `report_late(False)` was called in this process."""
    return _report_late


def last_launch() -> LaunchStats | None:
    """In the notebook (the launching process): the counts of the last launch that had a network."""
    return _last
