"""The modeled network (course_lib.network) and its clock: units, presets, clusters, predictions, and the
times real launches read on the modeled clock.

On the modeled clock time is computed, not waited for: a launch's times are the model's equations applied
to the messages the ranks really sent, whatever else this machine is doing. So the tests hold them to
`Network.predict` exactly (to 1e-9 relative: floating-point sums in another order), on every world size
1..8, lengths that do not divide by G, both topologies and a cluster; and `predict` itself to the closed
formulas of network.py's docstring where those hold (G a power of two, lengths that divide). A model
that charged nothing, or charged twice, or depended on which process ran first, fails.
"""

from __future__ import annotations

import functools
import math
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import course_lib
from course_lib import (allreduce, bench, collectives, nccl, network, p2p, recording, simulation, torch_collectives,
                        traffic)
from course_lib.network import Cluster, Network, parse_bandwidth, parse_latency
from course_lib.simulation import ModeledDeadlock, Simulator

EXACT = 1e-9


# --------------------------------------------------------------------------------------------------
# units and construction
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("100 MB/s", 100e6), ("100MB/s", 100e6), ("1.25 GB/s", 1.25e9), ("10 Gbit/s", 1.25e9), ("10 Gb/s", 1.25e9),
    ("10 Gbps", 1.25e9), ("100 MiB/s", 100 * 2 ** 20), ("2e3 kB/s", 2e6), ("8 bit/s", 1.0), (5e6, 5e6),
    ("unlimited", math.inf), (math.inf, math.inf)])
def test_bandwidth_units(text, expected):
    assert parse_bandwidth(text) == pytest.approx(expected)


@pytest.mark.parametrize("text, expected", [
    ("50 us", 50e-6), ("50us", 50e-6), ("50 µs", 50e-6), ("0.2 ms", 2e-4), ("5ms", 5e-3), ("1 s", 1.0),
    ("100 ns", 1e-7), (0, 0.0), (0.003, 0.003)])
def test_latency_units(text, expected):
    assert parse_latency(text) == pytest.approx(expected)


@pytest.mark.parametrize("kwargs, message", [
    (dict(bandwidth="fast"), "bandwidth 'fast' is not understood.*'100 MB/s'"),
    (dict(bandwidth="100 MB"), "not understood.*per second"),
    (dict(bandwidth=0), "positive number of bytes per second"),
    (dict(bandwidth=-5), "positive"),
    (dict(bandwidth=True), "positive"),
    (dict(bandwidth="1 GB/s", latency="-1 ms"), "latency '-1 ms' is not understood"),
    (dict(bandwidth="1 GB/s", latency=-0.1), "latency must be a number of seconds >= 0"),
    (dict(bandwidth="1 GB/s", latency="soon"), "e.g. '50 us'"),
    (dict(bandwidth="1 GB/s", topology="ring"), "topology must be 'switch'.*or 'full'"),
])
def test_bad_networks_are_explained(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Network(**kwargs)


def test_presets_parse_and_describe():
    gbe = Network.preset("1GbE")
    assert gbe.wire == 125e6 and gbe.bandwidth == pytest.approx(125e6 * 1448 / 1538) and gbe.latency == 50e-6
    assert gbe.topology == "switch" and gbe.kind == "ethernet"
    assert Network.parse("1GbE") == gbe and Network.parse("1GbE, full").topology == "full"
    assert Network.parse("100 MB/s, 200 us, full") == Network(100e6, 200e-6, "full")
    assert Network.parse("100 MB/s") == Network(100e6)
    assert repr(Network("100 MB/s", "200 us")) == "Network(bandwidth='100 MB/s', latency='200 us', topology='switch')"
    assert Network("100 MB/s", "200 us").describe() == "100 MB/s, 200 us, switch"
    assert gbe.describe().startswith("1GbE (117.7 MB/s of 125 MB/s wire, 50 us")
    assert Network("100 MB/s", "200 us").message_time(1_000_000) == pytest.approx(0.0102)
    for name, preset in network.PRESETS.items():
        assert 0 < preset.bandwidth <= preset.wire and preset.latency >= 0, name
        assert preset.topology in network.TOPOLOGIES and preset.kind in network.KINDS and len(preset.source) > 40, name
    # every interconnect the course uses is there, with its line rate, and the rate a copy achieves on it (NVIDIA's
    # published figures: about 80% of NVLink's wire, 96% of an InfiniBand or RoCE card's)
    rates = {"nvlink3": 300e9, "nvlink4": 450e9, "nvlink5": 900e9, "pcie4": 31.5e9, "pcie5": 63e9, "ib_hdr": 25e9,
             "ib_ndr": 50e9, "ib_xdr": 100e9, "roce100": 12.5e9, "roce200": 25e9, "roce400": 50e9, "1GbE": 125e6,
             "10GbE": 1.25e9}
    assert {name: Network.preset(name).wire for name in rates} == rates
    achieved = {"nvlink3": 230e9, "nvlink4": 370e9, "ib_hdr": 24e9, "ib_ndr": 48e9, "roce400": 48e9}
    assert {name: Network.preset(name).bandwidth for name in achieved} == achieved
    with pytest.raises(ValueError, match="no network preset called 'wifi'.*1GbE"):
        Network.preset("wifi")
    with pytest.raises(ValueError, match="BANDWIDTH, LATENCY"):
        Network.parse("1 GB/s, 1 us, full, extra")


def test_a_cluster_is_nodes_of_ranks_with_two_links():
    dgx = Network.cluster(nodes=8, per_node=8, intra="nvlink4", inter="ib_ndr")
    assert isinstance(dgx, Cluster) and dgx.world_size == 64 and dgx.node(15) == 1
    nv, ib = Network.preset("nvlink4"), Network.preset("ib_ndr")
    # inside a node: NVLink sides of the two ranks; between nodes: the ranks' own cards (rail-optimised)
    assert dgx.route(0, 7) == (nv.bandwidth, nv.latency, ("intra", "out", 0), ("intra", "in", 7))
    assert dgx.route(0, 8) == (ib.bandwidth, ib.latency, ("card_out", (0, 0)), ("card_in", (1, 0)))
    assert dgx.route(3, 12) == (ib.bandwidth, ib.latency, ("card_out", (0, 3)), ("card_in", (1, 4)))
    shared = Network.cluster(8, 8, nics="per_node")
    assert shared.route(3, 12) == (ib.bandwidth, ib.latency, ("card_out", (0, 0)), ("card_in", (1, 0)))
    halves = Network.cluster(8, 8, nics=4)                 # two GPUs per card: local 0-1 on card 0, 6-7 on card 3
    assert halves.route(7, 9) == (ib.bandwidth, ib.latency, ("card_out", (0, 3)), ("card_in", (1, 0)))
    assert halves.cards == 4 and "4 cards per node" in halves.describe()
    assert Network.parse(dgx) is dgx and "8 x 8 ranks" in dgx.describe()
    for kwargs, message in [(dict(nodes=0, per_node=8), "nodes must be a whole number >= 1"),
                            (dict(nodes=2, per_node=2.5), "per_node must be a whole number"),
                            (dict(nodes=2, per_node=2, nics="per_rack"), "nics must be 'per_gpu'"),
                            (dict(nodes=2, per_node=8, nics=3), "divides per_node=8"),
                            (dict(nodes=2, per_node=2, intra="warp drive"), "no network preset|not understood")]:
        with pytest.raises(ValueError, match=message):
            Network.cluster(**kwargs)
    with pytest.raises(ValueError, match="does not fit the modeled cluster of 4 ranks"):
        course_lib.launch(lambda rank, world_size: None, 5, network=Network.cluster(2, 2))


def test_launch_refuses_what_cannot_be_modeled():
    with pytest.raises(ValueError, match="not understood"):
        course_lib.launch(lambda rank, world_size: None, 2, network="fast please")
    with pytest.raises(ValueError, match="modeled clock runs the ranks on gloo"):
        course_lib.launch(lambda rank, world_size: None, 2, network="1GbE", backend="nccl")
    with pytest.raises(ValueError, match="no prediction for 'telepathy'"):
        Network("1 GB/s").predict("telepathy", 1024, 4)


# --------------------------------------------------------------------------------------------------
# predictions: the closed formulas, and the schedules they come from
# --------------------------------------------------------------------------------------------------


def test_predictions_follow_the_formulas_where_they_hold():
    net = Network("100 MB/s", "1 ms")
    a, b, n = 1e-3, 100e6, 4 * 1024 * 1024
    assert net.predict("ring", n, 4) == pytest.approx(6 * (a + n / 4 / b), rel=EXACT)
    assert net.predict("naive", n, 4) == pytest.approx(a + 3 * n / b, rel=EXACT)
    assert net.predict("parameter_server", n, 4) == pytest.approx(2 * a + 6 * n / b, rel=EXACT)
    assert net.predict("tree", n, 8) == pytest.approx(6 * (a + n / b), rel=EXACT)
    assert net.predict("halving_doubling", n, 4) == pytest.approx(4 * a + 1.5 * n / b, rel=EXACT)
    assert net.predict("recursive_doubling", n, 8) == pytest.approx(3 * (a + n / b), rel=EXACT)
    full = Network("100 MB/s", "1 ms", "full")
    assert full.predict("ring_bidirectional", n, 4) == pytest.approx(6 * (a + n / 8 / b), rel=EXACT)
    assert full.predict("naive", n, 4) == pytest.approx(a + n / b, rel=EXACT)
    # an uneven length: the largest chunk sets every step of the ring
    assert net.predict("ring", 4 * 10, 3) == pytest.approx(4 * (a + 16 / b), rel=EXACT)
    assert net.predict("ring", n, 1) == 0.0
    # G = 5: rank 4 has no children and sends at once, so latency-bound the tree takes 4 steps, not 6
    assert Network("unlimited", "1 ms").predict("tree", n, 5) == pytest.approx(4e-3, rel=EXACT)
    # with 3 ranks recursive doubling's fold delays only one pair: rank 2 swaps at once, 2 hops, not 3
    assert Network("unlimited", "1 ms").predict("recursive_doubling", n, 3) == pytest.approx(2e-3, rel=EXACT)
    for algorithm in ("ring", "naive", "parameter_server", "tree", "halving_doubling", "recursive_doubling",
                      "ring_bidirectional"):
        for g in (2, 4, 8):
            for link in (net, full):
                assert link.predict(algorithm, 4096 * g, g) == pytest.approx(link.formula(algorithm, 4096 * g, g),
                                                                             rel=EXACT), (algorithm, g)


@pytest.mark.parametrize("algorithm, segment_bytes", [(name, None) for name in sorted(set(allreduce.VARIANTS))]
                         + [("ring_pipelined", 400)])
def test_predict_is_the_replay_of_what_the_code_sends(algorithm, segment_bytes):
    """predict by name is the replay of the messages the algorithm's code sends (record_schedule, which the next test
    holds to a real launch): by the closed formula for the ring, the naive exchange and the parameter server, by that
    very replay for the others, on G = 1..8, lengths that do not divide, both topologies and a cluster."""
    fn = allreduce.get(algorithm)
    if segment_bytes is not None:
        fn = functools.partial(fn, segment_bytes=segment_bytes)
    links = (Network.preset("10GbE"), Network("10 MB/s", "200 us", "full"), Network.cluster(2, 4))
    for g in range(1, 9):
        for numel in (g + 1, 1000 * g + 3):
            events = recording.record_schedule(fn, g, numel)
            for link in links:
                replayed = simulation.replay(events, link).seconds
                predicted = link.predict(algorithm, 4 * numel, g, segment_bytes=segment_bytes)
                assert predicted == pytest.approx(replayed, rel=EXACT, abs=1e-15), (algorithm, g, numel, link)


def _launched_messages(rank, world_size, numel, name, segment_bytes):
    """What one rank of a real launch sends and receives in `name`'s all-reduce: (kind, peer, bytes), in order."""
    fn = allreduce.get(name)
    if segment_bytes is not None:
        fn = functools.partial(fn, segment_bytes=segment_bytes)
    tensor = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    with traffic.record() as recording:
        fn(tensor)
    return [(e.kind, e.peer, e.numel * 4) for e in recording.events]


@pytest.mark.parametrize("algorithm, segment_bytes", [(name, None) for name in sorted(set(allreduce.VARIANTS))]
                         + [("ring_pipelined", 400)])
def test_what_record_schedule_records_is_what_a_launch_sends_and_receives(algorithm, segment_bytes):
    """record_schedule runs each rank's code on a process group that moves nothing: it is only right if the
    messages it logs (peer, size, order) are the ones a real gloo launch of the same code makes."""
    fn = allreduce.get(algorithm)
    if segment_bytes is not None:
        fn = functools.partial(fn, segment_bytes=segment_bytes)
    for g in (1, 2, 3, 5, 6, 8):
        numel = 1000 * g + 3   # no G divides it
        launched = course_lib.launch(_launched_messages, g, args=(numel, algorithm, segment_bytes))
        recorded = recording.record_schedule(fn, g, numel)
        for rank in range(g):
            logged = [("send" if e[0] in ("send", "isend") else "recv", e[1], e[2])
                      for e in recorded[rank] if e[0] != "wait"]
            assert launched[rank] == logged, (algorithm, g, rank)


# --------------------------------------------------------------------------------------------------
# the simulator on its own: queueing that does not depend on the order things are learnt in
# --------------------------------------------------------------------------------------------------


def test_an_incoming_side_serves_messages_in_modeled_time_whatever_order_they_are_learnt_in():
    # three senders into rank 0 on a switch: 10 ms, 2 ms and 5 ms messages leaving at 0, 1 ms and 3 ms
    net = Network("1 MB/s", "1 ms")
    scripts = {
        1: (0.000, [("isend", (1, 0), 0, 10_000), ("wait", (1, 0))]),
        2: (0.001, [("isend", (2, 0), 0, 2_000), ("wait", (2, 0))]),
        3: (0.003, [("isend", (3, 0), 0, 5_000), ("wait", (3, 0))]),
        0: (0.0, [("irecv", ("r", 1), 1, 0), ("irecv", ("r", 2), 2, 0), ("irecv", ("r", 3), 3, 0),
                  ("wait", ("r", 3))]),
    }
    results = []
    for order in ([0, 1, 2, 3], [3, 2, 1, 0], [0, 3, 1, 2]):
        sim = Simulator(net, 4)
        for rank in order:
            clock, operations = scripts[rank]
            for op, *args in operations:
                getattr(sim, op)(rank << 16, clock, *args)
        ends = {}
        while 0 not in ends:
            woken = sim.run()
            assert woken, "nothing left to run"
            for actor, _request, when, _detail in woken:
                ends[actor >> 16] = when
                if actor:
                    sim.finish(actor)      # a sender whose send has left is done
        results.append(ends)
    # first come, first served in modeled time: [0, 10), then [10, 12), then [12, 17) ms; the last arrives at 18
    assert all(r == results[0] for r in results), results
    assert results[0][0] == pytest.approx(0.018, rel=EXACT)
    assert results[0][3] == pytest.approx(0.008, rel=EXACT)   # a send ends when its bytes have left its own side


def test_a_receive_from_any_source_gets_the_earliest_arrival():
    net = Network("1 MB/s", "1 ms")
    sim = Simulator(net, 3)
    sim.isend(1 << 16, 0.005, "a", 0, 1000)     # leaves at 5 ms, arrives at 7 ms
    sim.isend(2 << 16, 0.0, "b", 0, 3000)       # leaves at 0, arrives at 4 ms
    sim.finish(1 << 16)
    sim.finish(2 << 16)
    sim.irecv(0, 0.0, "r", None, 4000)
    sim.wait(0, 0.0, "r")
    woken = sim.run()
    assert [(when, source) for actor, _r, when, source in woken if actor == 0] == [(pytest.approx(0.004), 2)]


def test_a_deadlock_in_modeled_time_is_found_and_explained():
    sim = Simulator(Network("1 MB/s", "1 ms"), 2)
    sim.irecv(0, 0.0, "r0", 1, 8)
    sim.wait(0, 0.0, "r0")
    sim.irecv(1 << 16, 0.0, "r1", 0, 8)
    sim.wait(1 << 16, 0.0, "r1")
    assert sim.run() == []
    text = sim.deadlock()
    assert "rank 0 waits in a receive from rank 1" in text and "rank 1 waits in a receive from rank 0" in text
    with pytest.raises(simulation.ScheduleError, match="never sent"):
        simulation.replay([[("recv", 1, 8, 0)], [("recv", 0, 8, 0)]], Network("1 GB/s"))


def test_one_card_per_node_is_shared_by_the_nodes_ranks():
    # 2 nodes of 4: every rank of node 0 sends 1 MB to its partner on node 1 at once
    schedule = [[("send", r + 4, 1_000_000, 0)] if r < 4 else [("recv", r - 4, 1_000_000, 0)] for r in range(8)]
    rails = simulation.replay(schedule, Network.cluster(2, 4, inter="1 GB/s, 10 us"))
    shared = simulation.replay(schedule, Network.cluster(2, 4, inter="1 GB/s, 10 us", nics="per_node"))
    assert rails.seconds == pytest.approx(1e-3 + 10e-6, rel=EXACT)        # four cards, four messages at once
    assert shared.seconds == pytest.approx(4e-3 + 10e-6, rel=EXACT)       # one card: one after another


def test_on_a_cluster_the_hierarchy_beats_the_flat_ring_as_the_equations_say():
    nbytes = 64 * 2 ** 20
    dgx = Network.cluster(8, 8, "nvlink4", "ib_ndr")
    nv, ib = Network.preset("nvlink4"), Network.preset("ib_ndr")
    flat, hierarchical = dgx.predict("ring", nbytes), dgx.predict("hierarchical", nbytes)
    # the flat ring pushes 2(G-1) chunks through each node's inter-node hop, one after another: that link's
    # bandwidth sets it (its latency hides behind the next chunk), so it lies between the wire time alone and
    # every step taking the slow hop's latency too
    wire = 126 * nbytes / 64 / ib.bandwidth
    assert wire < flat < 1.01 * wire + 8 * ib.latency
    shard = nbytes / 8
    by_equations = (2 * 7 * (nv.latency + shard / nv.bandwidth)
                    + 2 * 7 * (ib.latency + shard / 8 / ib.bandwidth))
    assert hierarchical == pytest.approx(by_equations, rel=1e-6)
    assert flat / hierarchical == pytest.approx(wire / by_equations, rel=0.02) and flat / hierarchical > 3


# --------------------------------------------------------------------------------------------------
# launches on the modeled clock: exactly the model, the right data, any load
# --------------------------------------------------------------------------------------------------


def _time_variants(rank, world_size, cases):
    """Each (variant, nbytes) call's time on this rank's modeled clock."""
    times = {}
    for variant, nbytes in cases:
        tensor = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(rank))
        expected = tensor.clone()
        with course_lib.modeled_clock.untimed():
            dist.all_reduce(expected)
        dist.barrier()
        start = course_lib.clock()
        allreduce.get(variant)(tensor)
        times[(variant, nbytes)] = course_lib.clock() - start
        assert torch.allclose(tensor, expected, rtol=1e-4, atol=1e-4), variant
    return times


LINKS = (Network("10 MB/s", "200 us"), Network("1 GB/s", "20 ms"), Network("10 MB/s", "200 us", "full"))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 6, 7, 8])
def test_every_variant_reads_exactly_the_models_time(world_size):
    variants = sorted(set(allreduce.VARIANTS))
    cases = [(v, 4 * (1000 * world_size + 3)) for v in variants] + [(v, 4096) for v in variants]
    for net in LINKS:
        results = course_lib.launch(_time_variants, world_size, args=(cases,), network=net, timeout=120)
        for variant, nbytes in cases:
            slowest = max(r[(variant, nbytes)] for r in results)
            assert slowest == pytest.approx(net.predict(variant, nbytes, world_size), rel=EXACT, abs=1e-12), \
                (net, variant, nbytes)


def _tensors(rank):
    """Rank `rank`'s two messages: random, different on every rank, of two sizes."""
    gen = torch.Generator().manual_seed(rank)
    return torch.randn(1000, generator=gen), torch.randn(777, generator=gen)


def _raw_torch_calls(rank, world_size):
    """A learner's code: torch.distributed's own calls, tags out of order, any source, a batch, a subgroup.

    Returns {section: (start, end)} on the rank's modeled clock."""
    left, right = (rank - 1) % world_size, (rank + 1) % world_size
    first, second = _tensors(rank)
    got_first, got_second = torch.empty(1000), torch.empty(777)
    moments = {}
    # two messages to the right, tags 1 then 2; received in the other order
    dist.barrier()
    start = course_lib.clock()
    sends = [dist.isend(first, right, tag=1), dist.isend(second, right, tag=2)]
    dist.recv(got_second, left, tag=2)
    dist.recv(got_first, left, tag=1)
    for request in sends:
        request.wait()
    moments["tags"] = (start, course_lib.clock())
    assert torch.equal(got_first, _tensors(left)[0]) and torch.equal(got_second, _tensors(left)[1])
    # from any source: rank 0 collects one message from every other rank, in the order they arrive
    dist.barrier()
    start = course_lib.clock()
    if rank == 0:
        senders = [dist.recv(got_first, None) for _ in range(world_size - 1)]
        moments["senders"] = senders
    else:
        course_lib.compute(0.001 * (world_size - rank))        # the last rank is ready first
        dist.send(first, 0)
    moments["any_source"] = (start, course_lib.clock())
    # batch_isend_irecv round the ring
    dist.barrier()
    start = course_lib.clock()
    ops = [dist.P2POp(dist.isend, first, right), dist.P2POp(dist.irecv, got_first, left)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    moments["batch"] = (start, course_lib.clock())
    assert torch.equal(got_first, _tensors(left)[0])
    # a subgroup of the even ranks: group_dst / group_src name ranks inside it
    evens = dist.new_group(list(range(0, world_size, 2)))
    dist.barrier()
    start = course_lib.clock()
    if rank == 0:
        dist.send(second, group=evens, group_dst=1)
    elif rank == 2:
        source = dist.recv(got_second, group=evens, group_src=0)
        assert source == 0 and torch.equal(got_second, _tensors(0)[1])
    moments["subgroup"] = (start, course_lib.clock())
    return moments


def test_torch_distributed_calls_are_modeled_exactly_and_still_deliver_the_right_data():
    net = Network("10 MB/s", "5 ms")
    moments = course_lib.launch(_raw_torch_calls, 4, network=net)

    def took(section, receiver):
        return moments[receiver][section][1] - moments[receiver][section][0]

    wire = lambda n: n / net.bandwidth  # noqa: E731
    for rank in range(4):
        # the second message leaves after the first, and arrives a latency after both have crossed the wire
        assert took("tags", rank) == pytest.approx(wire(4 * 1777) + net.latency, rel=EXACT)
        assert took("batch", rank) == pytest.approx(wire(4000) + net.latency, rel=EXACT)
    # any source: in the order they arrive (rank 3 computed least), the last one queued behind the others
    assert moments[0]["senders"] == [3, 2, 1]
    assert took("any_source", 0) == pytest.approx(0.003 + wire(4000) + net.latency, rel=EXACT)
    assert took("subgroup", 2) == pytest.approx(net.message_time(4 * 777), rel=EXACT)
    assert network.last_launch().messages == 4 * 2 + 3 + 4 + 1


def _sends_before_a_late_receiver(rank, world_size, count):
    from course_lib import modeled_clock

    if rank == 1:
        time.sleep(0.5)          # real time: rank 0 waited on its sends and dropped them long before these receives
        got = torch.empty(count, 1000)
        for row in got:
            dist.recv(row, 0)
        dist.barrier()
        return got
    for i in range(count):       # each modeled wait returns when the model says the message left, not when torch sent it
        dist.isend(torch.full((1000,), float(i)), 1).wait()
    dist.barrier()               # rank 1 has every message: torch has sent them all
    deadline = time.monotonic() + 10
    while modeled_clock._state.unsent.qsize() and time.monotonic() < deadline:
        time.sleep(0.01)
    return modeled_clock._state.unsent.qsize()


def test_sends_reach_a_late_receiver_and_the_rank_lets_them_go_once_torch_has_sent_them():
    # gloo loses a send whose handle is dropped before its receive is posted; the modeled clock keeps torch's handle
    # (and the copy it reads) until torch has sent it, and no longer: a rank does not hold every message it ever sent
    still_held, got = course_lib.launch(_sends_before_a_late_receiver, 2, args=(50,), network="1 GB/s, 1 ms")
    assert torch.equal(got, torch.arange(50.0).unsqueeze(1).expand(50, 1000))
    assert still_held == 0


def _traced_ring(rank, world_size, numel):
    tensor = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    with traffic.record() as recording:
        allreduce.ring(tensor)
    return tensor, [(e.kind, e.peer, e.numel, e.phase, e.step, e.chunk) for e in recording.events]


def test_results_and_traffic_are_the_same_with_and_without_a_network():
    plain = course_lib.launch(_traced_ring, 3, args=(1001,))
    modeled = course_lib.launch(_traced_ring, 3, args=(1001,), network="1 GB/s, 1 ms")
    for (tensor, events), (tensor_m, events_m) in zip(plain, modeled):
        assert torch.equal(tensor, tensor_m) and events == events_m


def _async_and_builtins(rank, world_size, nbytes):
    tensor = torch.arange(10.0) * (rank + 1)
    start = course_lib.clock()
    work = collectives.all_reduce(tensor, async_op=True)  # runs on the rank's worker thread, its own clock
    course_lib.compute(0.5)                               # meanwhile this thread computes for 0.5 s
    work.wait()
    overlapped = course_lib.clock() - start
    assert torch.equal(tensor, torch.arange(10.0) * sum(range(1, world_size + 1)))
    times = {}
    for name in ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier"):
        big = torch.full((nbytes // 4,), float(rank))
        dist.barrier()
        start = course_lib.clock()
        if name == "all_reduce":
            dist.all_reduce(big)
            assert torch.all(big == sum(range(world_size)))
        elif name == "broadcast":
            dist.broadcast(big, src=1)
            assert torch.all(big == 1)
        elif name == "all_gather":
            outputs = [torch.empty_like(big) for _ in range(world_size)]
            dist.all_gather(outputs, big)
            assert all(torch.all(o == r) for r, o in enumerate(outputs))
        elif name == "reduce_scatter":
            dist.reduce_scatter(big, [torch.full((nbytes // 4,), float(r)) for r in range(world_size)])
            assert torch.all(big == rank * world_size)
        else:
            dist.barrier()
        times[name] = course_lib.clock() - start
    async_work = dist.all_reduce(torch.ones(nbytes // 4), async_op=True)
    start = course_lib.clock()
    async_work.wait()
    times["async all_reduce"] = course_lib.clock() - start
    return overlapped, times


def test_async_collectives_overlap_compute_and_builtins_take_ncclss_schedule():
    net, nbytes = Network.preset("ib_ndr"), 16 * 2 ** 20
    results = course_lib.launch(_async_and_builtins, 4, args=(nbytes,), network=net)
    members = tuple(range(4))
    # torch's collectives take what NCCL would run for them (`course_lib.nccl`), one after another on the group
    expected = {"all_reduce": nccl.collective(net, "all_reduce", nbytes, members).seconds,
                "broadcast": torch_collectives.collective_time(net, "broadcast", nbytes, members),
                "all_gather": torch_collectives.collective_time(net, "all_gather", 4 * nbytes, members),
                "reduce_scatter": torch_collectives.collective_time(net, "reduce_scatter", 4 * nbytes, members),
                "barrier": 0.0, "async all_reduce": nccl.collective(net, "all_reduce", nbytes, members).seconds}
    assert net.predict("builtin", nbytes, 4) == pytest.approx(expected["all_reduce"], rel=EXACT)
    assert Network.preset("ib_ndr").predict("builtin", 4096, 8) < Network.preset("ib_ndr").predict("ring", 4096, 8)
    assert expected["broadcast"] == nccl.collective(net, "broadcast", nbytes, members, root=1).seconds
    for overlapped, times in results:
        assert overlapped == pytest.approx(0.5, rel=EXACT)     # the all-reduce hid behind the compute
        for name, seconds in expected.items():
            assert times[name] == pytest.approx(seconds, rel=EXACT, abs=1e-12), name


def test_the_same_schedule_reads_the_same_time_in_every_launch_even_with_two_busy_processes_beside_it():
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        cases = [("ring", 4 * 2 ** 20), ("tree", 4096), ("naive", 65536), ("parameter_server", 65536)]
        runs = [course_lib.launch(_time_variants, 4, args=(cases,), network="ib_ndr", timeout=120)
                for _ in range(3)]
    finally:
        for process in busy:
            process.kill()
            process.wait()
    assert runs[0] == runs[1] == runs[2]


def test_a_deadlock_on_the_modeled_clock_fails_at_once_and_says_who_waits_for_what():
    def both_receive(rank, world_size):
        p2p.recv(torch.empty(3), 1 - rank)

    started = time.monotonic()
    with pytest.raises(course_lib.RankFailedError, match="deadlock on the modeled clock.*rank 0 waits in a receive "
                                                         "from rank 1"):
        course_lib.launch(both_receive, 2, network="1 GB/s, 1 ms", timeout=60)
    assert time.monotonic() - started < 15   # the launch's timeout is 60 s: found by the simulation, not waited out


def test_compute_moves_the_modeled_clock_and_cpu_time_counts_only_when_asked():
    def spin(rank, world_size):
        start = course_lib.clock()
        course_lib.compute(0.25)
        after_compute = course_lib.clock() - start
        total = 0
        end = time.thread_time() + 0.05
        while time.thread_time() < end:          # 50 ms of this rank's own CPU time
            total += 1
        return after_compute, course_lib.clock() - start

    free = course_lib.launch(spin, 2, network="1 GB/s")
    counted = course_lib.launch(spin, 2, network=Network("1 GB/s").with_cpu_time())
    assert all(a == 0.25 and b == 0.25 for a, b in free)
    assert all(a == pytest.approx(0.25, abs=0.01) and 0.29 < b < 0.5 for a, b in counted), counted
    with pytest.raises(ValueError, match="compute.*seconds >= 0"):
        course_lib.compute(-1)


def test_sixty_four_ranks_on_a_laptop():
    results = course_lib.launch(_time_variants, 64, args=([("ring", 2 ** 20)],), network="ib_ndr", timeout=240)
    slowest = max(r[("ring", 2 ** 20)] for r in results)
    assert slowest == pytest.approx(Network.preset("ib_ndr").predict("ring", 2 ** 20, 64), rel=EXACT)


def test_report_late_is_kept_and_does_nothing():
    network.report_late(False)
    network.report_late(True)
    assert network.current() is None


def _zero3_with_prefetch(rank, world_size):
    from course_lib.training import toy
    from course_lib.training.zero_sharded import ShardedDataParallel

    torch.manual_seed(0)
    model = toy.make_mlp(hidden=64, depth=3, seed=0)
    optimizer = ShardedDataParallel(model, torch.optim.Adam, stage=3, prefetch=True, lr=0.01)
    data = (torch.randn(256, 2), torch.randint(0, 3, (256,)))
    with course_lib.unchecked():   # no argument check lining the clocks up: the two threads' messages interleave
        log = course_lib.training.train_data_parallel(model, optimizer, data, torch.nn.functional.cross_entropy,
                                                      batch_size=8, max_steps=3)
    return [step.total for step in log.timeline]


def test_an_async_worker_and_the_main_thread_share_a_rank_on_the_modeled_clock():
    # ZeRO-3's prefetch all-gathers the next layer on the rank's async thread while the main thread goes on: each
    # thread reads the matches of its own receives (a match once sat unread in the other thread's socket: a receive
    # never posted, or posted out of order and filled with another message's bytes)
    runs = [course_lib.launch(_zero3_with_prefetch, 4, network="1GbE", timeout=120) for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]


ALL_REDUCE_TAKEN_EARLY = dist.all_reduce   # as `from torch.distributed import all_reduce` at a notebook's top
ISEND_TAKEN_EARLY = dist.isend


def _through_aliases(rank, world_size):
    tensor = torch.ones(4 * 2 ** 20 // 4)
    dist.barrier()
    start = course_lib.clock()
    ALL_REDUCE_TAKEN_EARLY(tensor)
    reduced = course_lib.clock() - start
    dist.barrier()
    start = course_lib.clock()
    if rank == 0:
        ISEND_TAKEN_EARLY(tensor, 1).wait()
    elif rank == 1:
        dist.recv(tensor, 0)
    return reduced, course_lib.clock() - start


def test_names_bound_to_torchs_calls_before_the_launch_are_timed_too():
    net = Network.preset("ib_ndr")
    results = course_lib.launch(_through_aliases, 2, network=net)
    for reduced, _ in results:
        assert reduced == pytest.approx(net.predict("builtin", 4 * 2 ** 20, 2), rel=EXACT)
    assert results[1][1] == pytest.approx(net.message_time(4 * 2 ** 20), rel=EXACT)


def _time_two_reductions(rank, world_size, numel):
    from course_lib import ops

    hooked = ops.charge_reduction is not None
    accumulator = torch.full((numel,), float(rank + 1))
    incoming = torch.arange(numel, dtype=torch.float32)
    start = course_lib.clock()
    ops.combine_(accumulator, incoming, ops.SUM)
    ops.combine_(accumulator, incoming, ops.MAX)
    elapsed = course_lib.clock() - start
    expected = torch.maximum(torch.full((numel,), float(rank + 1)) + incoming, incoming)
    return hooked, elapsed, bool(torch.equal(accumulator, expected))


@pytest.mark.parametrize("memory_bandwidth", [None, "2 GB/s"])
def test_a_reduction_costs_three_passes_over_memory_only_where_the_network_says_so(memory_bandwidth):
    link = Network(bandwidth="1 GB/s", latency="5us")
    if memory_bandwidth is not None:
        link = link.with_memory_bandwidth(memory_bandwidth)
    numel = 1003
    results = course_lib.launch(_time_two_reductions, world_size=2, args=(numel,), network=link)
    from course_lib import ops

    assert ops.charge_reduction is None                          # the launching process never pays for reductions
    for hooked, elapsed, correct in results:
        assert correct
        assert hooked == (memory_bandwidth is not None)
        if memory_bandwidth is None:
            assert elapsed == 0.0
        else:                                                    # read two, write one, twice
            assert elapsed == pytest.approx(2 * 3 * numel * 4 / parse_bandwidth(memory_bandwidth), rel=1e-12)
