"""course_lib's torch.distributed backend: every way a program reaches the network goes through it, nothing in
torch.distributed is replaced, and DistributedDataParallel's own reducer is timed on the modeled clock."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.utils.flop_counter import FlopCounterMode

import course_lib
from course_lib import backend, simulation, torch_collectives
from course_lib.exercises.tracing import Tracer
from course_lib.network import Network
from course_lib.training.modeled_compute import flop_compute

TORCH_DIR = os.path.dirname(torch.__file__)
# every torch.distributed function the course's notebooks, exercises and library call
USED = ("send", "recv", "isend", "irecv", "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
        "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "barrier",
        "new_group", "batch_isend_irecv", "all_gather_object", "broadcast_object_list", "get_rank", "get_world_size",
        "init_process_group", "destroy_process_group", "monitored_barrier")


def _torchs_own(rank, world_size):
    """Which of torch's functions are not torch's own here (empty: nothing replaced), inside a traced case too."""
    def foreign():
        out = []
        for name in USED:
            function = getattr(dist, name)
            if function is not getattr(distributed_c10d, name) or not function.__code__.co_filename.startswith(TORCH_DIR):
                out.append(name)
        return out

    outside = foreign()
    with Tracer(forbidden_modules=()):
        inside = foreign()
    return outside, inside, dist.get_backend(), type(distributed_c10d._get_default_group()).__module__


def test_nothing_in_torch_distributed_is_replaced_in_a_modeled_rank_nor_by_the_tracer():
    for outside, inside, name, group_type in course_lib.launch(_torchs_own, 2, network="10GbE"):
        assert outside == [] and inside == []
        assert name == backend.NAME and group_type == "course_lib.backend"


def _every_route(rank, world_size, nbytes):
    """The modeled time of one call made each way torch offers: a function, the group's own method, a batch of p2p
    operations, an object collective, a functional collective."""
    import torch.distributed._functional_collectives as functional

    group = dist.group.WORLD
    times = {}

    def timed(name, call):
        dist.barrier()
        start = course_lib.clock()
        call()
        times[name] = course_lib.clock() - start

    tensor = torch.ones(nbytes // 4) * (rank + 1)
    timed("dist.all_reduce", lambda: dist.all_reduce(tensor))
    assert torch.all(tensor == sum(range(1, world_size + 1)))
    timed("ProcessGroup.allreduce", lambda: group.allreduce([torch.ones(nbytes // 4)]).wait())
    out = torch.empty(nbytes // 4)
    timed("functional all_reduce", lambda: out.copy_(functional.wait_tensor(
        functional.all_reduce(torch.ones(nbytes // 4), "sum", group))))
    assert torch.all(out == world_size)
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    got = torch.empty(nbytes // 4)
    ops = [dist.P2POp(dist.isend, torch.full((nbytes // 4,), float(rank)), right), dist.P2POp(dist.irecv, got, left)]
    timed("batch_isend_irecv", lambda: [work.wait() for work in dist.batch_isend_irecv(ops)])
    assert torch.all(got == left)
    objects = [None] * world_size
    timed("all_gather_object", lambda: dist.all_gather_object(objects, {"rank": rank}))
    assert objects == [{"rank": r} for r in range(world_size)]
    return times


def test_every_way_into_the_network_is_timed():
    net, nbytes, g = Network.preset("10GbE"), 1 << 20, 4
    members = tuple(range(g))
    all_reduce = torch_collectives.collective_time(net, "all_reduce", nbytes, members)
    ring_step = net.latency + nbytes / net.bandwidth      # one message to the right neighbour, all at once
    for times in course_lib.launch(_every_route, g, args=(nbytes,), network=net):
        for name in ("dist.all_reduce", "ProcessGroup.allreduce", "functional all_reduce"):
            assert times[name] == pytest.approx(all_reduce, rel=1e-9), name
        assert times["batch_isend_irecv"] == pytest.approx(ring_step, rel=1e-9)
        assert times["all_gather_object"] > 0          # two all-gathers of a few bytes: their sizes, then the data


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 10))


def _ddp_steps(rank, world_size, peak):
    """Three DDP training steps: each backward's modeled time, DDP's bucket sizes, this rank's gradients, the FLOPs."""
    model = torch.nn.parallel.DistributedDataParallel(_mlp(), bucket_cap_mb=1)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(rank))
    backward, counted = [], []
    for _ in range(3):
        model.zero_grad()
        loss = model(x).square().mean()
        if peak:
            with flop_compute(peak) as clock:
                start = course_lib.clock()
                loss.backward()
            counted.append(clock.flops)
        else:
            start = course_lib.clock()
            loss.backward()
        backward.append(course_lib.clock() - start)
    # DDP runs its first backward as one bucket of everything, then rebuilds its buckets in the order gradients came
    sizes = [int(s) for s in model._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(", ")]
    return backward, sizes, [p.grad.clone() for p in model.parameters()], counted


def test_ddp_backward_takes_its_buckets_all_reduces_in_ddps_order_on_the_modeled_clock():
    net, g = Network.preset("10GbE"), 4
    results = course_lib.launch(_ddp_steps, g, args=(None,), network=net)
    members = tuple(range(g))
    backward, sizes, _, _ = results[0]
    parameters = sum(p.numel() for p in _mlp().parameters())
    assert sum(sizes) == 4 * parameters and len(sizes) == 2           # 2.1 MB of gradients in 1 MB buckets
    # DDP's first backward runs one bucket of everything; later ones its buckets, one after another on the group
    assert backward[0] == pytest.approx(torch_collectives.collective_time(net, "all_reduce", 4 * parameters, members), rel=1e-9)
    in_order = sum(torch_collectives.collective_time(net, "all_reduce", size, members) for size in sizes)
    for rank_backward, _, _, _ in results:
        assert rank_backward[1] == pytest.approx(in_order, rel=0.02)
        assert rank_backward[2] == pytest.approx(rank_backward[1], rel=1e-9)
    # and the data moved for real: every rank holds the mean of the ranks' gradients, one process computes it
    model = _mlp()
    expected = [torch.zeros_like(p) for p in model.parameters()]
    for rank in range(g):
        model.zero_grad()
        model(torch.randn(8, 256, generator=torch.Generator().manual_seed(rank))).square().mean().backward()
        for total, p in zip(expected, model.parameters()):
            total += p.grad / g
    for _, _, grads, _ in results:
        for got, want in zip(grads, expected):
            assert torch.allclose(got, want, atol=1e-6)


def test_ddp_with_flop_counted_compute_overlaps_its_buckets_with_backward():
    net, g, peak = Network.preset("10GbE"), 4, 4e9             # a backward of about as long as its all-reduces
    results = course_lib.launch(_ddp_steps, g, args=(peak,), network=net)
    members = tuple(range(g))
    backward, sizes, _, counted = results[0]
    # the FLOPs charged are torch's own count of the same backward (FlopCounterMode)
    model = _mlp()
    loss = model(torch.randn(8, 256)).square().mean()
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    assert counted[1] == counter.get_total_flops() > 0
    compute = counter.get_total_flops() / peak
    communication = sum(torch_collectives.collective_time(net, "all_reduce", size, members) for size in sizes)
    # overlapped: more than either alone, less than the two one after the other
    assert 0.5 < compute / communication < 2
    assert max(compute, communication) < backward[1] < 0.95 * (compute + communication)


def test_a_tracer_needs_the_course_backend_and_says_so():
    def trace(rank, world_size):
        with Tracer():
            pass

    with pytest.raises(course_lib.LaunchError, match="backend='course_lib'"):
        course_lib.launch(trace, 2, backend="gloo")


def test_record_schedule_uses_the_backend_in_this_process_and_leaves_no_group():
    from course_lib.exercises.hierarchical import record_schedule

    events = record_schedule(course_lib.allreduce.ring, 3, 7)
    assert [e[0] for e in events[0]].count("isend") == 4 and not dist.is_initialized()
    assert simulation.replay(events, Network.preset("10GbE")).seconds == pytest.approx(
        Network.preset("10GbE").predict("ring", 28, 3), rel=1e-9)


def _barrier_and_all_reduce_under_the_tracer(rank, world_size):
    with Tracer(forbidden_modules=()):
        dist.barrier()                                   # moves no data: allowed in an exercise
        try:
            dist.all_reduce(torch.ones(3))
        except BaseException as error:                   # ForbiddenCall is a BaseException
            return type(error).__name__
    return "nothing refused"


def test_the_tracer_allows_a_barrier_and_refuses_a_collective():
    assert course_lib.launch(_barrier_and_all_reduce_under_the_tracer, 2, backend="course_lib") == ["ForbiddenCall"] * 2


def _local_subgroup(rank, world_size):
    group = dist.new_group([0, 1], use_local_synchronization=True) if rank < 2 else None
    if group is not None:
        tensor = torch.ones(4)
        dist.all_reduce(tensor, group=group)
        assert torch.equal(tensor, torch.full((4,), 2.0))
    dist.barrier()
    again = dist.new_group([1, 2, 3])                    # every rank calls this one: the sequences still agree
    if rank > 0:
        tensor = torch.ones(4)
        dist.all_reduce(tensor, group=again)
        assert torch.equal(tensor, torch.full((4,), 3.0))
    return True


def test_a_subgroup_made_by_its_members_alone_does_not_hang_the_modeled_clock():
    assert course_lib.launch(_local_subgroup, 4, network="10GbE", timeout=60) == [True] * 4
