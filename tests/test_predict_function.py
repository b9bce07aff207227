"""`predict` takes the all-reduce function itself: its messages are read from its code and simulated.

The oracle is the prediction by name (a closed formula for ring, naive and the parameter server; the
hand-written schedule of `course_lib.schedules` for the others), which tests/test_network.py holds against
real modeled launches.
"""

import pytest
import torch.distributed as dist

from course_lib import Network, allreduce, p2p

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
