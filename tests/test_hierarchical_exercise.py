"""Notebook 13's exercise, hierarchical_allreduce: correct solutions in two styles get full marks, planted bugs lose
points with the first wrong step named, one-token slips keep part of the rubric, the schedule it checks is the
library's, and its timed part (a replay on two modeled clusters) depends on the schedule alone.

The function checks run the hidden cases of G = 1, 3, 4 and 8 (core cases, G = 1, node sizes that do not divide G,
uneven lengths, and the timed cases), which test every rubric line; benchmarks/hierarchical_catch_rate.py runs
every entry on every hidden case.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

import planted_bugs_hierarchical as pb  # noqa: E402
from rubric_checks import assert_named, missed  # noqa: E402
from course_lib import allreduce, exercises, schedules  # noqa: E402
from course_grader.hidden_cases import grader_cases  # noqa: E402
from course_lib.exercises import hierarchical, registry, runner  # noqa: E402
from course_lib.exercises.report import Result  # noqa: E402
from course_lib.network import Network  # noqa: E402
from course_lib.simulation import replay  # noqa: E402

NAME = "hierarchical_allreduce"
SIZES = (1, 3, 4, 8)
MiB = 2 ** 20


def _check(fn, sizes=SIZES):
    exercise = registry.get(NAME)
    cases = [c for c in grader_cases(exercise) if c.world_size in sizes]
    outcome = runner.run_function(exercise, fn, cases=cases, case_timeout=3.0)
    if outcome.not_done is not None:
        return Result.not_done(exercise, outcome.not_done), outcome
    return Result.of_cases(exercise, outcome.cases, hidden=True), outcome


def _first_problem(outcome) -> str:
    return next(c for c in outcome.cases if not c.passed).problems[0].message


def test_it_is_listed_and_registered_with_its_rubric():
    listed = [info for info in exercises.list() if info.name == NAME]
    assert len(listed) == 1 and listed[0].notebook == "13_from_a_node_to_a_cluster" and listed[0].points == 10
    assert "course_lib.allreduce" in listed[0].forbids and "collectives" in listed[0].forbids
    assert sum(line.points for line in registry.get(NAME).rubric) == 10


def test_every_rubric_line_is_tested_by_the_quick_sizes():
    exercise = registry.get(NAME)
    cases = [c for c in grader_cases(exercise) if c.world_size in SIZES]
    families = [line for line in exercise.rubric if line.family]
    assert [c for c in cases if not any(line.family.test(c) for line in families)]
    for line in families:
        assert any(line.family.test(c) for c in cases), line.key


def test_there_are_two_correct_styles_and_at_least_eight_planted_bugs():
    assert len(pb.CORRECT) >= 2 and len(pb.BUGS) >= 8
    assert all(entry.expect for entry in pb.BUGS) and len({entry.fn for entry in pb.BUGS}) == len(pb.BUGS)


@pytest.mark.parametrize("entry", pb.CORRECT, ids=lambda e: e.name)
def test_correct_solutions_in_both_styles_get_full_marks(entry):
    result, _ = _check(entry.fn, entry.sizes)
    assert result.score == result.max_score == 10, repr(result)


@pytest.mark.parametrize("entry", pb.BUGS, ids=lambda e: e.name)
def test_planted_bugs_lose_points_and_the_first_problem_names_the_step(entry):
    result, outcome = _check(entry.fn, entry.sizes)
    assert result.score < result.max_score, repr(result)
    assert entry.expect in _first_problem(outcome), _first_problem(outcome)


def test_a_blank_answer_scores_zero():
    def hierarchical_allreduce(tensor, node_size):
        raise NotImplementedError("your code here")

    result = exercises.check(NAME, hierarchical_allreduce)
    assert result.score == 0 and result.status == "not done"


# One-token slips and the rubric lines each must miss: each scores 20-85% and the feedback names what it missed.
# Each leaves wrong values in the timed case too, and the timed point needs the right values.
SLIPS = [(pb.hier_rs_shard_plus, {"reduce_scatter", "values", "timed"}),     # (i + s) for (i - s): 6/10
         (pb.hier_rs_overwrites, {"reduce_scatter", "values", "timed"}),     # .copy_ for .add_: 6/10
         (pb.hier_across_gather_plus, {"across", "values", "timed"}),        # (m + 1 + s) for (m + 1 - s): 6/10
         (pb.hier_inside_gather_adds, {"all_gather", "values", "timed"})]    # add for copy: 6.5/10


@pytest.mark.parametrize("slip, lines", SLIPS, ids=lambda s: getattr(s, "__name__", ""))
def test_a_one_token_slip_keeps_the_lines_it_gets_right(slip, lines):
    result, _ = _check(slip)
    assert result.max_score == 10, repr(result)                      # every line tested
    assert 0.2 <= result.score / result.max_score <= 0.85, repr(result)
    assert missed(result) == lines, repr(result)
    assert_named(result, lines)


def test_a_right_but_serialised_schedule_loses_only_the_timed_line():
    result, outcome = _check(pb.hier_serial_ring, (8,))
    assert missed(result) == {"timed"}, repr(result)
    assert "yours took" in _first_problem(outcome) and "critical path" in _first_problem(outcome)


# --------------------------------------------------------------------------------------------------
# The schedule the check reads is the library's
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size, node_size, numel", [(8, 4, 64), (8, 2, 35), (6, 3, 13), (4, 1, 9), (3, 3, 5)])
def test_the_plan_sends_what_the_librarys_hierarchical_schedule_sends(world_size, node_size, numel):
    """For node sizes that divide G, the notebook's style is schedules.schedule('hierarchical'): same peers, same
    sizes, same order on every rank (so the timed reference and the check describe one algorithm)."""
    expected = hierarchical.plan(world_size, node_size, numel)
    library = schedules.schedule("hierarchical", 4 * numel, world_size, node_size=node_size)
    for rank in range(world_size):
        sends = [(e[1], e[2] // 4) for e in library[rank] if e[0] in ("send", "isend")]
        assert [(e.peer, e.size) for e in expected[rank]] == sends, rank


def test_the_plan_folds_a_smaller_last_node_into_the_last_full_one():
    plan = hierarchical.plan(8, 3, 12)                        # nodes {0,1,2} {3,4,5}, ranks 6 and 7 folded in
    assert [(e.phase, e.peer) for e in plan[6]] == [("fold", 3)]
    assert [(e.phase, e.peer) for e in plan[7]] == [("fold", 4)]
    assert plan[3][0].phase == "reduce-scatter inside" and plan[3][0].holds == {3, 6}
    assert plan[3][-1].phase == "unfold" and plan[3][-1].peer == 6
    across = [e for e in plan[0] if e.phase.startswith("across")]
    assert {e.peer for e in across} == {3} and len(across) == 2          # rail 0: nodes 0 and 1, one step each way
    assert hierarchical.Layout(8, 3).describe().startswith("2 nodes of 3, and a last node of 2")


def test_both_ring_conventions_and_directions_are_in_the_plans_it_accepts():
    default = hierarchical.plan(4, 4, 8)
    own = hierarchical.plan(4, 4, 8, (hierarchical.Ring(1, 0), hierarchical.Ring(1, 1)))
    left = hierarchical.plan(4, 4, 8, (hierarchical.Ring(-1, 1), hierarchical.Ring(1, 1)))
    assert [e.lo for e in default[0][:3]] == [0, 6, 4]        # shards 0, 3, 2: notebook 04's ring
    assert [e.lo for e in own[0][:3]] == [6, 4, 2]            # shards 3, 2, 1: rank i ends with shard i
    assert {e.peer for e in left[0]} == {3}


# --------------------------------------------------------------------------------------------------
# Timing a learner's function at scale without launching it
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nodes, per_node", [(8, 8), (16, 8)])
def test_a_recorded_schedule_replays_to_the_models_time_at_64_mib_and_many_ranks(nodes, per_node):
    for fn in (pb.hier_notebook, pb.hier_p2p_own_left):
        events = hierarchical.record_schedule(fn, nodes * per_node, 64 * MiB // 4, per_node)
        for nics in ("per_gpu", "per_node"):
            cluster = Network.cluster(nodes, per_node, "nvlink4", "ib_ndr", nics=nics)
            assert replay(events, cluster).seconds == pytest.approx(cluster.predict("hierarchical", 64 * MiB), rel=1e-9)
    ring = hierarchical.record_schedule(allreduce.ring, 16, MiB // 4)
    cluster = Network.cluster(2, 8)
    assert replay(ring, cluster).seconds == pytest.approx(cluster.predict("ring", MiB), rel=1e-9)


def test_recording_refuses_what_it_cannot_time_and_leaves_torch_distributed_as_it_was():
    import torch.distributed as dist

    before = (dist.send, dist.get_rank, dist.is_initialized)

    def blank(tensor, node_size):
        raise NotImplementedError("your code here")

    def builtin(tensor, node_size):
        dist.all_reduce(tensor)

    with pytest.raises(NotImplementedError):
        hierarchical.record_schedule(blank, 4, 8, 2)
    with pytest.raises(RuntimeError, match="point-to-point messages only"):
        hierarchical.record_schedule(builtin, 4, 8, 2)
    assert (dist.send, dist.get_rank, dist.is_initialized) == before and not dist.is_initialized()


def test_recording_falls_back_to_cpu_tensors_when_the_function_makes_its_own():
    def with_a_cpu_buffer(tensor, node_size):
        import torch.distributed as dist

        rank, G = dist.get_rank(), dist.get_world_size()
        buffer = torch.zeros(tensor.numel())                  # on the CPU, whatever the tensor's device
        request = dist.isend(tensor, (rank + 1) % G)
        dist.recv(buffer, (rank - 1) % G)
        request.wait()
        tensor += buffer

    events = hierarchical.record_schedule(with_a_cpu_buffer, 3, 10, 1)
    assert events[0] == [("isend", 1, 40, 0), ("recv", 2, 40, 0), ("wait", 0)]
