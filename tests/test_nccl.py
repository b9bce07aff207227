"""course_lib.nccl: NCCL's tuner as NCCL's source writes it, its algorithms' messages on the links, and what follows
for torch's collectives on a modeled cluster."""

from __future__ import annotations

import math

import pytest

from course_lib import nccl, simulation, torch_collectives
from course_lib.network import Network

MiB = 1 << 20
H100_NODE = Network.cluster(1, 8, "nvlink4", "ib_ndr")
H100_8X8 = Network.cluster(8, 8, "nvlink4", "ib_ndr")


def _parent_children(tree_of, n):
    return {r: tree_of(n, r) for r in range(n)}


def test_the_binary_trees_are_ncclss():
    # src/graph/trees.cc's picture of 14 ranks: 0 - 8; 8 - 4, 12; 4 - 2, 6; 12 - 10, 13; 2 - 1, 3; ...
    tree = _parent_children(nccl._btree, 14)
    assert tree[0] == (-1, [8]) and tree[8] == (0, [4, 12]) and tree[12] == (8, [10, 13])
    assert tree[4] == (8, [2, 6]) and tree[13] == (12, []) and tree[1] == (2, [])
    # the second tree: the first mirrored for an even count (12 ranks: 11 is the root of the mirror), shifted by one
    # for an odd count (13 ranks: rank 1 is the root); in both every rank is a leaf in one of the two trees
    for n in (12, 13, 14, 2, 3, 8):
        first = {r: nccl._dtree(n, r, 0) for r in range(n)}
        second = {r: nccl._dtree(n, r, 1) for r in range(n)}
        assert sum(up == -1 for up, _ in first.values()) == sum(up == -1 for up, _ in second.values()) == 1
        for trees in (first, second):          # a tree: every child names its parent, every rank reached once
            children = [c for _, down in trees.values() for c in down]
            assert sorted(children) == sorted(r for r, (up, _) in trees.items() if up != -1)
            assert all(r in trees[up][1] for r, (up, _) in trees.items() if up != -1)
        if n > 2 and n % 2 == 0:     # mirrored: a rank inner in one tree is a leaf in the other
            assert all(not first[r][1] or not second[r][1] for r in range(n)), n
    assert nccl._dtree(12, 11, 1)[0] == -1
    # the shifted picture of 13 ranks: 1 - 9; 9 - 5, 0; 0 - 11; 11 - 10, 12
    assert [nccl._dtree(13, r, 1) for r in (1, 9, 0, 11)] == [(-1, [9]), (1, [5, 0]), (9, [11]), (0, [10, 12])]


def test_the_tuner_costs_as_tuning_cc_does():
    one = nccl.Topology.of(H100_NODE, range(8))
    options = {(o.algorithm, o.protocol): o for o in nccl.tune(one, "all_reduce", MiB)}
    # ring latency: base + 2(G-1) NVLink hops; LL: 6.6 + 14 x 0.6 us
    assert options["ring", "LL"].latency == pytest.approx(6.6 + 14 * 0.6)
    assert options["ring", "Simple"].latency == pytest.approx(8.4 + 14 * 3.4)
    # LL's bus bandwidth is half the link's, at most llMaxBw (141 GB/s on one Hopper node); algbw = bus G / 2(G-1)
    assert options["ring", "LL"].bandwidth == pytest.approx(min(141.0, 370 * 0.5) * 8 / 14)
    # NVLS: a head per GPU, B/(K+1) each, at 0.85 efficiency, twice (two operations pipelined)
    nvls = options["nvls", "Simple"]
    assert nvls.latency == 25 and nvls.bandwidth == pytest.approx(8 * (370 / 9) * 0.85 * 7 / 8 * 2 * 8 / 14)
    assert ("nvls_tree", "Simple") not in options            # one node: no NVLS tree
    # two nodes: the tree's latency is its chain inside the node and log2(M) network levels, up and down
    two = nccl.Topology.of(Network.cluster(2, 8, "nvlink4", "ib_ndr"), range(16))
    tree_ll = {(o.algorithm, o.protocol): o for o in nccl.tune(two, "all_reduce", 8)}["tree", "LL"]
    assert tree_ll.latency == pytest.approx(6.8 + 2 * (7 * 0.6 + 1 * 5.0))
    assert nccl.choose(two, "all_reduce", 8).algorithm == "tree"
    # A100 has no NVLS; a plain 10 GbE network is one GPU per node, where NCCL keeps LL128 off over sockets
    a100 = nccl.Topology.of(Network.cluster(1, 8, "nvlink3", "ib_hdr"), range(8))
    assert {o.algorithm for o in nccl.tune(a100, "all_reduce", MiB)} == {"tree", "ring"}
    ethernet = nccl.Topology.of(Network.preset("10GbE"), range(4))
    assert ethernet.nodes == 4 and {o.protocol for o in nccl.tune(ethernet, "all_reduce", MiB)} == {"LL", "Simple"}


def test_ncclss_variables_restrict_the_choice(monkeypatch):
    topo = nccl.Topology.of(H100_NODE, range(8))
    assert nccl.choose(topo, "all_reduce", 1 << 30).algorithm == "nvls"
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    assert nccl.choose(topo, "all_reduce", 1 << 30).algorithm == "ring"
    monkeypatch.setenv("NCCL_ALGO", "allreduce:tree")
    assert nccl.choose(topo, "all_reduce", 1 << 30).algorithm == "tree"
    monkeypatch.setenv("NCCL_ALGO", "^NVLS")
    assert nccl.choose(topo, "all_reduce", 1 << 30).algorithm != "nvls"
    monkeypatch.setenv("NCCL_ALGO", "ring")
    monkeypatch.setenv("NCCL_PROTO", "Simple")
    assert (nccl.choose(topo, "all_reduce", 8).protocol, nccl.choose(topo, "all_reduce", 8).algorithm) == ("Simple", "ring")
    monkeypatch.setenv("NCCL_ALGO", "NVLSTree")
    with pytest.raises(ValueError, match="no NCCL algorithm and protocol left for all_reduce.*NCCL_ALGO='NVLSTree'"):
        nccl.choose(topo, "all_reduce", 8)


def _all_copies(topo, nbytes, copies):
    """Every channel copy of the ring simulated for real (each copy's messages on their own tag)."""
    order = nccl._ring_order(topo)
    part = nbytes // copies
    scripts = [[] for _ in range(topo.ranks)]
    for c in range(copies):
        rotated = [nccl._rotated(topo, r, c) for r in order]
        threads = nccl._ring(rotated, part, 2 * (topo.ranks - 1), 1 << 30, part, 4)
        for rank, mine in enumerate(threads):
            scripts[rank].extend([[(e[0], e[1], e[2], c) if len(e) == 4 else e for e in script] for script in mine])
    return scripts


def test_one_channel_on_its_fair_share_times_what_every_channel_together_takes():
    """The C channels of NCCL's ring are one channel rotated inside each node; simulating one on its fair share of
    every side gives the time of simulating them all (processor sharing against first come first served)."""
    for cluster in (Network.cluster(2, 4, "nvlink4", "ib_ndr"), Network.cluster(3, 4, "nvlink4", "ib_ndr", nics="per_node"),
                    Network.cluster(2, 4, "nvlink4", "ib_ndr", nics=2)):
        g = cluster.world_size
        topo = nccl.Topology.of(cluster, range(g))
        members = tuple(range(g))
        nbytes = 64 * MiB
        every = simulation.replay_threads(_all_copies(topo, nbytes, 4), nccl._Links(cluster, members, topo, "ring", "Simple"))
        one = nccl._ring(nccl._ring_order(topo), nbytes // 4, 2 * (g - 1), 1 << 30, nbytes // 4, 4)
        share = nccl._fair_shares(cluster, members, topo, one, 4)
        alone = simulation.replay_threads(one, nccl._Links(cluster, members, topo, "ring", "Simple", share=share))
        assert alone.seconds == pytest.approx(every.seconds, rel=0.05), cluster


def test_ncclss_ring_uses_every_card_where_a_ring_in_rank_order_uses_one():
    cluster = Network.cluster(4, 4, "nvlink4", "ib_ndr")
    g, nbytes = 16, 256 * MiB
    import os
    os.environ["NCCL_ALGO"] = "Ring"
    try:
        ncclss = nccl.collective(cluster, "all_reduce", nbytes, range(g))
    finally:
        del os.environ["NCCL_ALGO"]
    single = cluster.predict("ring", nbytes)
    assert ncclss.algorithm == "ring"
    bus, card = nccl.bus_bandwidth("all_reduce", nbytes, g, ncclss.seconds), Network.preset("ib_ndr").bandwidth
    assert 3.3 * card < bus < 4 * card                          # four cards per node, each carrying its channel
    assert nccl.bus_bandwidth("all_reduce", nbytes, g, single) < 1.01 * card    # one card per node at a time


def test_nvls_beats_the_links_bound_of_point_to_point_schedules():
    g, nbytes = 8, 1 << 30
    choice = nccl.collective(H100_NODE, "all_reduce", nbytes, range(g))
    nvlink = Network.preset("nvlink4").bandwidth
    assert choice.algorithm == "nvls" and nccl.bus_bandwidth("all_reduce", nbytes, g, choice.seconds) > 1.2 * nvlink
    # the ring on the same node cannot: at best the link's bandwidth
    assert nccl.bus_bandwidth("all_reduce", nbytes, g, H100_NODE.predict("ring", nbytes)) < nvlink


@pytest.mark.parametrize("network, g", [(H100_NODE, 8), (Network.cluster(2, 8, "nvlink4", "ib_ndr"), 16),
                                        (Network.cluster(4, 8, "nvlink3", "ib_hdr"), 32),
                                        (Network.preset("10GbE"), 4)])
def test_the_simulated_time_follows_ncclss_own_estimate(network, g):
    """The replay of the chosen algorithm's messages and NCCL's formula for it agree to within 1.5x (what the
    simulation adds: queueing, pipeline fill, rails shared)."""
    for nbytes in (8, 64 << 10, MiB, 64 * MiB):
        choice = nccl.collective(network, "all_reduce", nbytes, range(g))
        assert choice.estimate / 1.5 < choice.seconds < 1.5 * choice.estimate, (nbytes, choice)
        assert math.isfinite(choice.seconds) and str(choice).startswith(f"AllReduce: {nbytes} Bytes -> Algo ")


def test_all_gather_reduce_scatter_and_broadcast_run_as_ncclss_ring():
    g, nbytes = 16, 64 * MiB
    cluster = Network.cluster(2, 8, "nvlink4", "ib_ndr")
    for function in ("all_gather", "reduce_scatter", "broadcast", "reduce"):
        choice = nccl.collective(cluster, function, nbytes, range(g), root=3)
        assert choice.algorithm == "ring" and choice.seconds > 0
        bus, cards = nccl.bus_bandwidth(function, nbytes, g, choice.seconds), 8 * Network.preset("ib_ndr").bandwidth
        # every card carries its channel; a broadcast's chain of 16 hops fills its pipeline of 8 chunks slowly
        assert (0.3 if function in ("broadcast", "reduce") else 0.5) * cards < bus < 1.05 * cards, function
    assert torch_collectives.collective_time(cluster, "all_gather", nbytes, range(g), with_algorithm=True)[1] == "ring/Simple"


def test_the_nodes_symmetry_lets_one_node_or_one_gpu_stand_for_all_exactly():
    """Every node of a uniform cluster does what the first does at the same times in NCCL's ring, and every GPU of
    a node what the first does in NVLS: simulating that one gives the time of simulating them all."""
    for cluster in (Network.cluster(3, 4, "nvlink4", "ib_ndr"), Network.cluster(2, 4, "nvlink4", "ib_ndr", nics=2)):
        g = cluster.world_size
        topo = nccl.Topology.of(cluster, range(g))
        members, order = tuple(range(g)), nccl._ring_order(topo)
        nbytes = g * 4 * 4 * 4096                      # pieces all alike: the symmetry is exact
        times = []
        for period in (None, 4):
            threads = nccl._ring(order, nbytes // 4, 2 * (g - 1), 1 << 20, nbytes // 8, 4, False, period)
            wrap = nccl._wrap(order, period) if period else {}
            share = nccl._fair_shares(cluster, members, topo, threads, 4, wrap)
            links = nccl._Links(cluster, members, topo, "ring", "Simple", share=share, wrap=wrap)
            times.append(simulation.replay_threads(threads, links).seconds)
        assert times[0] == pytest.approx(times[1], rel=1e-9), cluster
        times = []
        for reduce in (False, True):
            threads, switches = nccl._nvls(topo, "all_reduce", nbytes, "nvls_tree", 4, reduce=reduce)
            share = {}
            if reduce and topo.nics < topo.per_node:
                heads = [ranks[0] for ranks in topo.locals]
                for a, b in zip(heads, heads[1:] + heads[:1]):
                    _, _, out_side, in_side = cluster.route(a, b)
                    share[out_side] = share[in_side] = topo.nics / topo.per_node
            links = nccl._Links(cluster, members, topo, "nvls_tree", "Simple", share=share, switches=switches,
                                switch_factor=0.85)
            times.append(simulation.replay_threads(threads, links).seconds)
        # exactly where every GPU has a card; two GPUs on one card queue on it in the full simulation, share it
        # evenly in the reduced one
        assert times[0] == pytest.approx(times[1], rel=1e-9 if topo.nics == topo.per_node else 0.05), cluster


def test_the_per_call_line_spells_algorithm_and_protocol_as_nccls_log_does():
    # src/collectives.cc: ncclAlgoToString / ncclProtoToString, what NCCL_DEBUG_SUBSYS=TUNING prints per call
    spelled = {"TREE", "RING", "COLLNET_DIRECT", "COLLNET_CHAIN", "NVLS", "NVLS_TREE", "PAT"}
    seen = set()
    for network, g in ((Network.cluster(1, 8, "nvlink4", "ib_ndr"), 8), (Network.cluster(2, 8, "nvlink4", "ib_ndr"), 16)):
        for nbytes in (8, 1 << 20, 64 << 20):
            words = str(nccl.collective(network, "all_reduce", nbytes, range(g))).split()
            algorithm, protocol = words[words.index("Algo") + 1], words[words.index("proto") + 1]
            assert algorithm in spelled and protocol in {"LL", "LL128", "SIMPLE"}, words
            seen.add(algorithm)
    assert {"NVLS", "NVLS_TREE"} <= seen


@pytest.mark.parametrize("value, enabled", [("ring;", {"Ring"}), ("Ring,tree", {"Ring", "Tree"}), ("^NVLS", None),
                                            ("tree;allreduce:ring", {"Ring"}), ("ring;allgather:tree", {"Ring"}),
                                            ("allreduce:^ring,tree", None)])
def test_nccl_algo_is_read_as_nccls_parselist_reads_it(monkeypatch, value, enabled):
    monkeypatch.setenv("NCCL_ALGO", value)
    names = [nccl._NAMES[a] for a in nccl.ALGORITHMS]
    got = nccl._env_list("NCCL_ALGO", names, "all_reduce")
    if value == "^NVLS":
        enabled = set(names) - {"NVLS"}
    if value == "allreduce:^ring,tree":
        enabled = set(names) - {"Ring", "Tree"}
    assert got == enabled


@pytest.mark.parametrize("value, reason", [("ring;tree", "except the first must have a prefix"),
                                           ("all_reduce:ring", "unrecognized prefix"), ("tree,rnig", "unrecognized element")])
def test_what_nccl_refuses_in_nccl_algo_is_refused_with_its_reason(monkeypatch, value, reason):
    monkeypatch.setenv("NCCL_ALGO", value)
    with pytest.raises(ValueError, match=reason):
        nccl.collective(Network.cluster(1, 8, "nvlink4", "ib_ndr"), "all_reduce", 1 << 20, range(8))
