"""`predict` takes the all-reduce function itself: its messages are read from its code and simulated.

The oracle is the prediction by name (a closed formula for ring, naive and the parameter server; the same
recording of the course's code for the others), which tests/test_network.py holds against real modeled
launches. `predict` also runs inside a launched rank (a learner's tuner calls it there), and must leave that
rank as it found it.
"""

import pytest
import torch
import torch.distributed as dist

import course_lib
from course_lib import Network, allreduce, backend, network, p2p, traffic

NAMED = sorted(set(allreduce.VARIANTS) - {"master"})


@pytest.mark.parametrize("name", NAMED)
@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 8])
def test_a_function_predicts_what_its_name_predicts(name, world_size):
    net = Network.preset("10GbE")
    for numel in (1, world_size + 1, 3 * world_size + 2, 100_003):      # lengths that do not divide
        by_name = net.predict(name, 4 * numel, world_size)
        by_code = net.predict(allreduce.get(name), 4 * numel, world_size)
        assert by_code == pytest.approx(by_name, rel=1e-12, abs=1e-15), (name, world_size, numel)


def test_a_cluster_predicts_a_function_as_its_name():
    cluster = Network.cluster(2, 4)
    for name in ("ring", "naive", "tree"):
        assert cluster.predict(allreduce.get(name), 1 << 20) == pytest.approx(cluster.predict(name, 1 << 20), rel=1e-12)
    assert cluster.predict(allreduce.ring, 1 << 20, 5) == pytest.approx(cluster.predict("ring", 1 << 20, 5), rel=1e-12)


def _ring_and_one_more_message(tensor):
    allreduce.ring(tensor)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        p2p.send(tensor[:1], world_size - 1)
    elif rank == world_size - 1:
        p2p.recv(tensor[:1], 0)


@pytest.mark.parametrize("world_size", [2, 4, 7])
def test_a_variant_with_one_more_message_predicts_more(world_size):
    net = Network.preset("10GbE")
    ring = net.predict(allreduce.ring, 1 << 20, world_size)
    more = net.predict(_ring_and_one_more_message, 1 << 20, world_size)
    assert more > ring     # the extra message leaves after rank 0's ring ends, so the last rank ends later


def test_a_function_is_predicted_on_its_element_size_and_refuses_others():
    net = Network.preset("10GbE")
    assert net.predict(allreduce.ring, 8 * 1000, 4, element_size=8) == pytest.approx(
        net.predict("ring", 8 * 1000, 4, element_size=8), rel=1e-12)
    with pytest.raises(ValueError, match="element_size"):
        net.predict(allreduce.ring, 3 * 1000, 4, element_size=3)
    with pytest.raises(ValueError, match="whole number"):
        net.predict(allreduce.ring, 1001, 4)


def _ring_after_a_prediction(tensor):
    """A tuner's shape: asks the model first (a recording inside this recording), then runs the ring."""
    Network.preset("10GbE").predict("tree", tensor.numel() * tensor.element_size(), dist.get_world_size())
    allreduce.ring(tensor)


def test_a_function_that_predicts_is_predicted_as_what_it_sends():
    net = Network.preset("1GbE")
    assert net.predict(_ring_after_a_prediction, 4 * 1001, 5) == net.predict(allreduce.ring, 4 * 1001, 5)


NAMES = sorted(set(allreduce.VARIANTS))
NUMEL = 1001          # divides by no G tried


def _predict_inside(rank, world_size, link):
    """Every prediction, by name and by function, made inside this rank between its own all-reduces; what it
    saw of its own state before and after; and the results of the collectives made after it."""
    network._simulated_cache.clear()        # a forked rank inherits the launcher's cache: record here, in the rank
    network._recorded_cache.clear()
    modeled = network.current() is not None
    link = network.current() or link
    own = (dist.group.WORLD, dist.get_rank(), backend.layers())
    tensor = torch.full((NUMEL,), float(rank + 1))
    with traffic.record() as counted:
        allreduce.ring(tensor)
        before = (len(counted.events), course_lib.clock() if modeled else None)
        by_name = {name: link.predict(name, 4 * NUMEL, world_size) for name in NAMES}
        by_function = {name: link.predict(allreduce.get(name), 4 * NUMEL, world_size) for name in NAMES}
        after = (len(counted.events), course_lib.clock() if modeled else None)
    summed = torch.full((NUMEL,), float(rank + 1))
    dist.all_reduce(summed)
    tree = torch.full((NUMEL,), float(rank + 1))
    allreduce.get("tree")(tree)
    total = world_size * (world_size + 1) / 2
    results = [bool(torch.all(t == total)) for t in (tensor, summed, tree)]
    return by_name, by_function, before, after, own == (dist.group.WORLD, dist.get_rank(), backend.layers()), results


@pytest.mark.parametrize("world_size", [1, 3, 4])
@pytest.mark.parametrize("where", ["gloo", "modeled"])
def test_a_prediction_inside_a_rank_is_the_one_outside_and_leaves_the_rank_as_it_was(world_size, where):
    """Inside a rank the prediction records in a process group of its own: the same numbers as outside, and the
    rank's group, layers, traffic counts and modeled clock (reductions charged on it, so a recorded addition would
    show) as they were; its collectives afterwards still sum."""
    link = Network("123 MB/s", "77 us").with_memory_bandwidth("100 GB/s")
    options = dict(backend="gloo") if where == "gloo" else dict(network=link)
    per_rank = course_lib.launch(_predict_inside, world_size, args=(link,), timeout=120, **options)
    outside_by_name = {name: link.predict(name, 4 * NUMEL, world_size) for name in NAMES}
    outside_by_function = {name: link.predict(allreduce.get(name), 4 * NUMEL, world_size) for name in NAMES}
    for rank, (by_name, by_function, before, after, same_group, results) in enumerate(per_rank):
        assert by_name == outside_by_name and by_function == outside_by_function, rank
        assert after == before, rank                 # the messages counted, and the modeled clock
        assert same_group and results == [True, True, True], (rank, same_group, results)
        if where == "modeled" and world_size > 1:
            assert before[1] > 0                     # the ring before it did cost time on this clock


def _predict_in_a_traced_call(rank, world_size):
    """A tuner inside an exercise check: the tracer refuses course_lib's all-reduces by name and logs every call."""
    from course_lib.exercises.tracing import Tracer

    network._simulated_cache.clear()
    network._recorded_cache.clear()
    with Tracer(forbidden_modules=("collectives", "allreduce", "fast_allreduce")) as tracer:
        times = {name: Network.preset("1GbE").predict(name, 4 * NUMEL, world_size) for name in NAMES}
        if rank < 2:
            p2p.send(torch.ones(5), 1) if rank == 0 else p2p.recv(torch.empty(5), 0)
    return times, tracer.events


def test_a_prediction_inside_a_traced_call_is_allowed_and_not_traced():
    per_rank = course_lib.launch(_predict_in_a_traced_call, 3, backend="course_lib", timeout=120)
    outside = {name: Network.preset("1GbE").predict(name, 4 * NUMEL, 3) for name in NAMES}
    assert [times for times, _ in per_rank] == [outside] * 3
    assert [events for _, events in per_rank] == [[("send", 1, 20, 0)], [("recv", 0, 20, 0)], []]
