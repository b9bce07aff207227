"""The modeled network (course_lib.network): units, the queueing rules, and the times it gives.

Every timing test here compares a measured time with what the link's model predicts: a network that
did nothing would read far below the prediction and fail, one that charged twice far above. The
tolerances are the issue's ([0.85, 1.35] where bandwidth is the limit, [0.85, 1.5] where latency is):
the remainder is this machine's own cost per message (waking up, adding chunks), which the model
does not contain. Times are medians over repetitions of the slowest rank, argument checks on.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.distributed as dist

import course_lib
from course_lib import allreduce, bench, collectives, network, p2p, traffic
from course_lib.network import Network, parse_bandwidth, parse_latency


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
    assert gbe.bandwidth == 125e6 and gbe.latency == 50e-6 and gbe.topology == "switch"
    assert Network.parse("1GbE") == gbe and Network.parse("1GbE, full").topology == "full"
    assert Network.parse("100 MB/s, 200 us, full") == Network(100e6, 200e-6, "full")
    assert Network.parse("100 MB/s") == Network(100e6)
    assert repr(Network("100 MB/s", "200 us")) == "Network(bandwidth='100 MB/s', latency='200 us', topology='switch')"
    assert Network("100 MB/s", "200 us").describe() == "100 MB/s, 200 us, switch"
    assert gbe.describe().startswith("1GbE (125 MB/s, 50 us")
    assert Network("100 MB/s", "200 us").message_time(1_000_000) == pytest.approx(0.0102)
    for name, (bandwidth, latency, topology, source) in network.PRESETS.items():
        assert bandwidth > 0 and latency >= 0 and topology in network.TOPOLOGIES and len(source) > 40, name
    with pytest.raises(ValueError, match="no network preset called 'wifi'.*1GbE"):
        Network.preset("wifi")
    with pytest.raises(ValueError, match="BANDWIDTH, LATENCY"):
        Network.parse("1 GB/s, 1 us, full, extra")


def test_launch_and_bench_refuse_what_cannot_be_modeled():
    with pytest.raises(ValueError, match="not understood"):
        course_lib.launch(lambda rank, world_size: None, 2, network="fast please")
    with pytest.raises(ValueError, match="'builtin'.*cannot be timed on a modeled network"):
        bench.run(sizes=["4KiB"], world_sizes=[2], variants=["ring", "builtin"], network="1GbE")
    with pytest.raises(ValueError, match="no prediction for 'telepathy'"):
        Network("1 GB/s").predict("telepathy", 1024, 4)


def test_the_incoming_calendar_books_the_earliest_free_gap():
    calendar = network._Calendar()
    assert calendar.book(10.0, 2.0) == 10.0          # [10, 12)
    assert calendar.book(10.5, 1.0) == 12.0          # busy until 12: queues behind it
    assert calendar.book(5.0, 1.0) == 5.0            # an earlier gap is free: taken
    assert calendar.book(4.5, 1.0) == 6.0            # [4.5, 5.5) overlaps [5, 6): after it
    assert calendar.book(7.0, 3.5) == 13.0           # 7..10.5 would hit [10, 13): after 13
    assert calendar.starts == [5.0, 10.0] and calendar.ends == [7.0, 16.5]  # touching intervals merged


def test_predictions_follow_the_formulas():
    net = Network("100 MB/s", "1 ms")
    a, b, n = 1e-3, 100e6, 4 * 1024 * 1024
    assert net.predict("ring", n, 4) == pytest.approx(6 * (a + n / 4 / b))
    assert net.predict("naive", n, 4) == pytest.approx(a + 3 * n / b)
    assert net.predict("parameter_server", n, 4) == pytest.approx(2 * a + 6 * n / b)
    assert net.predict("tree", n, 8) == pytest.approx(6 * (a + n / b))
    # G = 5: rank 4 has no children and sends at once, so latency-bound the tree takes 4 steps, not 6
    assert Network("unlimited", "1 ms").predict("tree", n, 5) == pytest.approx(4e-3)
    assert net.predict("halving_doubling", n, 4) == pytest.approx(4 * a + 1.5 * n / b)
    assert net.predict("recursive_doubling", n, 8) == pytest.approx(3 * (a + n / b))
    # not a power of two: at most fold + the steps + unfold, at least the steps (the schedule decides;
    # the measured test below holds the followed schedule to the clock)
    for g in (3, 5, 6, 7):
        p = 1 << (g.bit_length() - 1)
        k = p.bit_length() - 1
        hd, rd = net.predict("halving_doubling", n, g), net.predict("recursive_doubling", n, g)
        assert 2 * k * a + 2 * (p - 1) / p * n / b < hd <= 2 * (k + 1) * a + 2 * (p - 1) / p * n / b + 2 * n / b
        assert k * (a + n / b) < rd <= (k + 2) * (a + n / b)
    latency_only = Network("unlimited", "1 ms")
    assert latency_only.predict("recursive_doubling", n, 3) == pytest.approx(2e-3)  # rank 2 swaps at once: 2 hops
    full = Network("100 MB/s", "1 ms", "full")
    assert full.predict("ring_bidirectional", n, 4) == pytest.approx(6 * (a + n / 8 / b))
    assert full.predict("naive", n, 4) == pytest.approx(a + n / b)
    # an uneven length: the largest chunk sets every step
    assert net.predict("ring", 4 * 10, 3) == pytest.approx(4 * (a + 16 / b))
    assert net.predict("ring", n, 1) == 0.0


# --------------------------------------------------------------------------------------------------
# the queueing rules, one message at a time
# --------------------------------------------------------------------------------------------------


def _one_message_then_incast(rank, world_size, nbytes):
    """Rank 1 sends one message to rank 0; then every other rank sends one to rank 0 at once.

    Returns moments on time.monotonic(), which is one clock for every process of the machine, so a
    receive's end can be compared with its send's start.
    """
    tensor = torch.full((nbytes // 4,), float(rank))
    moments = {}
    dist.barrier()
    if rank == 1:
        moments["send_start"] = time.monotonic()
        p2p.send(tensor, 0)
        moments["send_end"] = time.monotonic()
    elif rank == 0:
        p2p.recv(tensor, 1)
        moments["recv_end"] = time.monotonic()
        assert torch.all(tensor == 1)
    dist.barrier()
    if rank == 0:
        buffers = [torch.empty(nbytes // 4) for _ in range(world_size)]
        requests = [p2p.irecv(buffers[src], src) for src in range(1, world_size)]
        for src, request in zip(range(1, world_size), requests):
            request.wait()
            assert torch.all(buffers[src] == src)
        moments["incast_end"] = time.monotonic()
    else:
        moments["incast_start"] = time.monotonic()
        p2p.send(tensor, 0)
        moments["incast_send_end"] = time.monotonic()
    return moments


@pytest.mark.parametrize("topology", ["switch", "full"])
def test_a_message_takes_latency_plus_bytes_over_bandwidth_and_incast_queues_on_a_switch(topology):
    net = Network("20 MB/s", "10 ms", topology)
    nbytes = 200_000  # 10 ms on the wire
    wire, one = nbytes / net.bandwidth, net.message_time(nbytes)
    # three senders into one incoming side: a switch serves them one after another, a full mesh at once
    incast = (3 if topology == "switch" else 1) * wire + net.latency
    slack = 0.3 * one  # this machine's own cost: waking up, scheduling four processes on two cores
    # Every run must respect the model's floors; the fastest of three must also come close to them
    # (a loaded machine can only add time, so one slow run is not a fault of the model).
    runs, late = [], []
    for _ in range(3):
        moments = course_lib.launch(_one_message_then_incast, 4, args=(nbytes,), network=net)
        took = moments[0]["recv_end"] - moments[1]["send_start"]
        send = moments[1]["send_end"] - moments[1]["send_start"]
        incast_took = moments[0]["incast_end"] - min(m["incast_start"] for m in moments[1:])
        # the senders' own sides are free: none waits for the busy receiver
        sides = max(m["incast_send_end"] - m["incast_start"] for m in moments[1:])
        assert took >= one and send >= wire and incast_took >= incast, (took, send, incast_took)
        assert min(m["incast_send_end"] - m["incast_start"] for m in moments[1:]) >= wire
        runs.append((took, send, incast_took, sides))
        stats = network.last_launch()
        assert stats.messages == 4, stats
        late.append(stats.late)
    took, send, incast_took, sides = (min(values) for values in zip(*runs))
    assert took < one + slack, runs
    assert send < wire + slack, runs  # a send ends when its bytes have left, before they arrive
    assert incast_took < incast + slack, runs
    assert sides < wire + slack, runs
    assert min(late) == 0, late


def _tensors(rank):
    """Rank `rank`'s two messages: random, different on every rank, of two sizes."""
    gen = torch.Generator().manual_seed(rank)
    return torch.randn(1000, generator=gen), torch.randn(777, generator=gen)


def _raw_torch_calls(rank, world_size):
    """A learner's code: torch.distributed's own calls, tags out of order, any source, a batch, a subgroup.

    Returns {section: (start, end)} on time.monotonic(), one clock for every rank of the machine.
    """
    left, right = (rank - 1) % world_size, (rank + 1) % world_size
    first, second = _tensors(rank)
    got_first, got_second = torch.empty(1000), torch.empty(777)
    moments = {}
    # two messages to the right, tags 1 then 2; received in the other order
    start = time.monotonic()
    sends = [dist.isend(first, right, tag=1), dist.isend(second, right, tag=2)]
    dist.recv(got_second, left, tag=2)
    dist.recv(got_first, left, tag=1)
    for request in sends:
        request.wait()
    moments["tags"] = (start, time.monotonic())
    assert torch.equal(got_first, _tensors(left)[0]) and torch.equal(got_second, _tensors(left)[1])
    # from any source: rank 0 collects one message from every other rank
    dist.barrier()
    start = time.monotonic()
    if rank == 0:
        senders = sorted(dist.recv(got_first, None) for _ in range(world_size - 1))
        assert senders == list(range(1, world_size)), senders
    else:
        dist.send(first, 0)
    moments["any_source"] = (start, time.monotonic())
    # batch_isend_irecv round the ring
    dist.barrier()
    start = time.monotonic()
    ops = [dist.P2POp(dist.isend, first, right), dist.P2POp(dist.irecv, got_first, left)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    moments["batch"] = (start, time.monotonic())
    assert torch.equal(got_first, _tensors(left)[0])
    # a subgroup of the even ranks: group_dst / group_src name ranks inside it
    evens = dist.new_group(list(range(0, world_size, 2)))
    dist.barrier()
    start = time.monotonic()
    if rank == 0:
        dist.send(second, group=evens, group_dst=1)
    elif rank == 2:
        dist.recv(got_second, group=evens, group_src=0)
        assert torch.equal(got_second, _tensors(0)[1])
    moments["subgroup"] = (start, time.monotonic())
    return moments


def test_torch_distributed_calls_are_modeled_and_still_deliver_the_right_data():
    net = Network("10 MB/s", "5 ms")
    moments = course_lib.launch(_raw_torch_calls, 4, network=net)

    def took(section, receiver, *senders):  # from the first sender's start to the receiver's end
        return moments[receiver][section][1] - min(moments[s][section][0] for s in senders)

    for rank in range(4):
        left = (rank - 1) % 4
        # the second message leaves after the first, so it arrives after both have crossed the wire
        assert took("tags", rank, left) >= 4 * (1000 + 777) / net.bandwidth + net.latency
        assert took("batch", rank, left) >= net.message_time(4000)
    assert took("any_source", 0, 1, 2, 3) >= 3 * 4000 / net.bandwidth + net.latency  # three into one side
    assert took("subgroup", 2, 0) >= net.message_time(4 * 777)
    assert network.last_launch().messages == 4 * 2 + 3 + 4 + 1


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


def _async_and_builtin(rank, world_size):
    tensor = torch.arange(10.0) * (rank + 1)
    work = collectives.all_reduce(tensor, async_op=True)  # runs on the rank's worker thread
    work.wait()
    expected = torch.arange(10.0) * sum(range(1, world_size + 1))
    assert torch.equal(tensor, expected)
    other = torch.ones(3)
    dist.all_reduce(other)   # a built-in: not modeled, says so once
    dist.all_reduce(other)
    return other


def test_async_collectives_are_modeled_and_a_builtin_says_it_is_not(capfd):
    results = course_lib.launch(_async_and_builtin, 3, network="100 MB/s, 2 ms")
    assert all(torch.equal(r, torch.full((3,), 9.0)) for r in results)
    err = capfd.readouterr()
    text = err.out + err.err
    for rank in range(3):
        assert text.count(f"[rank {rank}] course_lib: torch.distributed.all_reduce is not modeled") == 1, text
    assert "all_gather is not modeled" not in text  # course_lib's own argument check is not the learner's call


def test_a_link_faster_than_this_machine_is_reported_not_silently_timed(capfd):
    # 1 MiB chunks: 2.3 us on the modeled NVLink, a few hundred us through this machine's loopback at the least,
    # so most messages arrive later than the model allows whatever the load (1-element messages were late only
    # 20% of the time on a quiet machine: the line's threshold is a tenth)
    def many_chunks(rank, world_size):
        tensor = torch.zeros(1 << 20)
        for _ in range(30):
            allreduce.ring(tensor)

    course_lib.launch(many_chunks, 4, network="nvlink4")
    stats = network.last_launch()
    assert stats.messages == 30 * 2 * 3 * 4 and stats.late_share > 0.5, stats
    captured = capfd.readouterr()
    assert "took longer on this machine than on the modeled link (nvlink4" in captured.err, captured.err


# --------------------------------------------------------------------------------------------------
# measured against the alpha-beta predictions, G = 2..8
# --------------------------------------------------------------------------------------------------

BANDWIDTH_BOUND = Network("10 MB/s", "200 us")
LATENCY_BOUND = Network("1 GB/s", "20 ms")
REPS = 3
# Every message below takes about 40 ms (bandwidth-bound) or 20 ms (latency-bound) on its link. This
# machine's own cost per message (a wake-up, a gloo transfer that only starts once its receive is
# posted) is 0.3 ms to a few ms, more while the other test worker keeps a core busy; it must stay
# small beside the link's time for the comparison to be about the model. (The issue's own figures,
# 8 MiB at 50 MB/s and 4 KiB on a 5 ms link, are measured on a quiet machine by
# benchmarks/network_model.py.)
STEP_BYTES = 384 * 1024


def _bandwidth_bound_sizes(world_size):
    # the +12 makes lengths that no G divides (the largest chunk then sets each ring step)
    return {"ring": STEP_BYTES * world_size + 12, "halving_doubling": STEP_BYTES * world_size + 12,
            "naive": STEP_BYTES + 12, "parameter_server": STEP_BYTES + 12, "tree": STEP_BYTES + 12,
            "recursive_doubling": STEP_BYTES + 12}


def _time_variants(rank, world_size, cases, reps, arg_checks):
    """Each (variant, nbytes) call's time on this rank, `reps` times."""
    times = {}
    for variant, nbytes in cases:
        function = allreduce.get(variant)
        tensor = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(rank))
        samples = []
        for _ in range(reps):
            dist.barrier()
            start = time.perf_counter()
            with course_lib._checks.checking(arg_checks):
                function(tensor)
            samples.append(time.perf_counter() - start)
        times[(variant, nbytes)] = samples
    return times


def _measured_over_predicted(net, world_size, cases, arg_checks=True):
    """The fastest of REPS repetitions (each the slowest rank's time), divided by the model's prediction.

    The fastest, not the median: the link's time is a floor that the model guarantees, and load from
    the other test worker can only add to a repetition, so the least of them is the one to hold to
    the model (benchmarks/network_model.py reports medians and spreads, on a quiet machine).
    """
    results = course_lib.launch(_time_variants, world_size, args=(cases, REPS, arg_checks), network=net, timeout=120)
    ratios = {}
    for variant, nbytes in cases:
        slowest = [max(r[(variant, nbytes)][i] for r in results) for i in range(REPS)]
        ratios[variant] = min(slowest) / net.predict(variant, nbytes, world_size)
    return ratios


@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 6, 7, 8])
def test_measured_times_follow_the_model(world_size):
    bandwidth_cases = list(_bandwidth_bound_sizes(world_size).items())
    ratios = _measured_over_predicted(BANDWIDTH_BOUND, world_size, bandwidth_cases)
    assert all(0.9 <= r <= 1.35 for r in ratios.values()), ratios
    # Latency-bound, without course_lib's argument check: it agrees through a built-in all_gather, which
    # the model does not see and which costs a few ms here, as much as a step of this link
    # (benchmarks/network_model.py times it with the check on, as a learner's call has it).
    latency_cases = [("ring", 4096), ("tree", 4096), ("halving_doubling", 4096), ("recursive_doubling", 4096)]
    ratios = _measured_over_predicted(LATENCY_BOUND, world_size, latency_cases, arg_checks=False)
    assert all(0.9 <= r <= 1.5 for r in ratios.values()), ratios


def test_a_full_mesh_halves_the_bidirectional_ring_and_frees_the_naive_exchange():
    switch, full = Network("10 MB/s", "200 us"), Network("10 MB/s", "200 us", "full")
    cases = [("ring", 4 * STEP_BYTES), ("ring_bidirectional", 4 * STEP_BYTES), ("naive", STEP_BYTES)]
    on_switch = _measured_over_predicted(switch, 4, cases)
    on_full = _measured_over_predicted(full, 4, cases)
    for ratios in (on_switch, on_full):
        assert all(0.9 <= r <= 1.35 for r in ratios.values()), (on_switch, on_full)
    n = 4 * STEP_BYTES
    # the predictions themselves: the same on a switch (one link per rank), about half on a full mesh
    assert switch.predict("ring_bidirectional", n, 4) == pytest.approx(switch.predict("ring", n, 4))
    assert 0.45 < full.predict("ring_bidirectional", n, 4) / full.predict("ring", n, 4) < 0.55
    assert full.predict("naive", STEP_BYTES, 4) == pytest.approx(full.message_time(STEP_BYTES))


def test_on_two_ranks_the_bidirectional_ring_has_one_link_whatever_the_topology():
    # With G = 2 a rank's left and right neighbour are one rank: both halves of a chunk queue on the one
    # link to it, so a full mesh gains nothing (the prediction once said half; notebook 11 measured 2x that).
    full = Network("10 MB/s", "200 us", "full")
    n = 4 * STEP_BYTES
    assert full.predict("ring_bidirectional", n, 2) == pytest.approx(full.predict("ring", n, 2))
    ratios = _measured_over_predicted(full, 2, [("ring_bidirectional", n)])
    assert all(0.9 <= r <= 1.35 for r in ratios.values()), ratios


def test_the_late_line_is_printed_once_and_report_late_false_keeps_it_back(capsys):
    import importlib
    launch_module = importlib.import_module("course_lib.launch")
    net = Network("123 kB/s", "7 ms")
    late = network.LaunchStats(net, messages=10, late=5, late_seconds=0.05, modeled_seconds=0.1)
    on_time = network.LaunchStats(net, messages=10, late=1, late_seconds=0.01, modeled_seconds=0.1)
    assert on_time.notice() is None and "5 of 10 messages" in late.notice()
    try:
        network.report_late(False)
        launch_module._report_network(late)
        assert capsys.readouterr().err == ""
        network.report_late(True)
        launch_module._report_network(late)
        launch_module._report_network(late)
        assert capsys.readouterr().err.count("5 of 10 messages took longer") == 1
    finally:
        network.report_late(True)
