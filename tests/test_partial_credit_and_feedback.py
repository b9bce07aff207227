"""Issue 40, points 5 and 6: a hang or a crash costs its own case and no other (the forgotten smaller last node of
notebook 13 keeps every line the other cases earn), the timed point needs the right values, and the feedback names
the real slip: an average where the sum is asked, a peer outside the group, long errors cut, a slow search's
progress."""

from __future__ import annotations

import time

import torch

import planted_bugs_hierarchical as pb
from rubric_checks import missed
from course_grader.hidden_cases import grader_cases
from course_lib.exercises import feedback, registry, runner
from course_lib.exercises.report import Result

NAME = "hierarchical_allreduce"


def _check(fn, sizes):
    exercise = registry.get(NAME)
    cases = [c for c in grader_cases(exercise) if c.world_size in sizes]
    outcome = runner.run_function(exercise, fn, cases=cases, case_timeout=3.0)
    return Result.of_cases(exercise, outcome.cases, hidden=True), outcome


def test_forgetting_the_smaller_last_node_costs_only_the_cases_that_have_one():
    """The slip crashes (or hangs) every case whose last node is smaller; each such case is isolated, so every
    other case of the same G still runs and passes, and the slip keeps every line but partial_node (it scored
    0/10 when a hang skipped the rest of its G). The crash is the library's error naming the peer, not a signal."""
    started = time.monotonic()
    result, outcome = _check(pb.hier_no_fold_runs_phases, (1, 3, 4, 8))
    elapsed = time.monotonic() - started
    partial = registry.get(NAME).rubric[5].family
    assert missed(result) == {"partial_node"}, repr(result)
    assert 0.2 <= result.score / result.max_score <= 0.8, repr(result)          # 7.5 of 10: the fold alone lost
    for case in outcome.cases:
        if partial.test(case.case):
            assert case.status in ("failed", "not run"), case
        else:
            assert case.passed, (case.case, case.problems[:1])
    first = next(c for c in outcome.cases if not c.passed).problems[0].message
    assert "rank 2 tried to send to rank 3, which does not exist" in first and "the ranks are 0..2" in first, first
    assert "SIGSEGV" not in repr(result)
    assert elapsed < 60, elapsed


def test_a_schedule_with_a_phase_missing_does_not_get_the_timed_point():
    """Without the all-gather inside the node the schedule is faster than the reference ("134%") and wrong."""
    result, outcome = _check(pb.hier_no_inside_all_gather, (8,))
    assert {"timed", "values", "all_gather"} <= missed(result), repr(result)
    timed = next(c for c in outcome.cases if c.case.data == "timed")
    assert any(p.line == "timed" and "does not count" in p.message for p in timed.problems), timed.problems
    assert "(wrong results: not counted)" in repr(result)


def test_the_timed_point_stays_with_a_right_schedule():
    result, _ = _check(pb.hier_notebook, (8,))
    assert "timed" not in missed(result) and "not counted" not in repr(result), repr(result)


def test_an_average_where_the_sum_is_asked_is_called_so():
    result, outcome = _check(pb.hier_averages, (3,))
    assert "values" in missed(result), repr(result)
    first = next(c for c in outcome.cases if not c.passed).problems[0].message
    assert "sum" in first and "average" in first and "divided by G = 3" in first, first
    assert "added twice" not in repr(result), repr(result)
    unfold = [p for c in outcome.cases for p in c.problems if p.message.startswith("unfold")]
    assert unfold and all("average" in p.message and "all-gather" not in p.message for p in unfold), unfold


def test_a_peer_outside_the_group_gets_the_librarys_error_naming_it():
    from course_lib.launch import LaunchError, launch

    def go(rank, world_size):
        if rank == 3:
            torch.distributed.isend(torch.ones(2), 4).wait()

    try:
        launch(go, 4, backend="course_lib", prefix_output=False)
    except LaunchError as exc:
        text = str(exc)
    else:
        raise AssertionError("a send to rank 4 of 4 went through")
    assert "isend: rank 3 tried to send to rank 4, which does not exist" in text and "0..3" in text, text
    assert "SIGSEGV" not in text


def test_a_64_rank_schedule_error_is_a_few_readable_lines():
    from course_lib.network import Network
    from course_lib.simulation import ScheduleError, replay

    events = [[("recv", (r - 1) % 64, 1024, 0)] for r in range(64)]
    try:
        replay(events, Network.cluster(8, 8))
    except ScheduleError as exc:
        text = str(exc)
    else:
        raise AssertionError("an unmatched receive replayed")
    assert len(text) < 1500 and max(len(line) for line in text.splitlines()) <= 120, text
    assert "rank 0 waits for a message from rank 63" in text and "... and 58 more ranks waiting" in text, text


def test_long_error_messages_are_wrapped_and_cut():
    long = "ScheduleError: " + "; ".join(f"rank {r} waits in a receive from rank {r - 1}" for r in range(64))
    text = feedback.readable(long)
    assert len(text) < 1000 and max(len(line) for line in text.splitlines()) <= 102
    assert text.startswith("ScheduleError: rank 0 waits") and "(cut: about" in text
    assert feedback.readable("short and sweet") == "short and sweet"
    assert len(feedback.describe_exception(ValueError(long))["message"]) < 1000


def test_a_slow_search_over_sizes_shows_its_progress(capsys, monkeypatch):
    from course_lib import torch_collectives
    from course_lib.network import Network

    monkeypatch.setattr(torch_collectives, "PROGRESS_AFTER", 0.0)
    monkeypatch.setitem(torch_collectives._progress, "last", 0.0)
    net = Network.cluster(2, 4)
    for n in (4096, 8192, 16384):
        torch_collectives.collective_time(net, "all_reduce", n, range(8))
    err = capsys.readouterr().err
    assert "collective_time: 3 calls so far" in err and "on 8 ranks" in err, err
    net.predict("nccl", 32768, 8)                 # course_lib's own calls stay quiet
    assert "collective_time" not in capsys.readouterr().err


def _fold_deadlocks(tensor, node_size):
    """The ranks of a smaller last node wait for a result their host never sends: a deadlock in exactly the cases
    with such a node; the others are right."""
    rank, G = torch.distributed.get_rank(), torch.distributed.get_world_size()
    k = min(node_size, G)
    if rank >= max(1, G // k) * k:
        torch.distributed.recv(tensor, rank - k)
        return
    pb._hierarchical(tensor, node_size, no_fold=True)


def test_a_hang_costs_its_case_only_and_the_cases_that_cannot_change_the_score_are_skipped():
    started = time.monotonic()
    result, outcome = _check(_fold_deadlocks, (3, 4))
    partial = registry.get(NAME).rubric[5].family
    assert missed(result) == {"partial_node"}, repr(result)
    assert all(c.passed for c in outcome.cases if not partial.test(c.case)), repr(result)
    hung = [c for c in outcome.cases if partial.test(c.case) and c.status == "failed"]
    skipped = [c for c in outcome.cases if c.status == "not run"]
    assert hung and "deadlock" in hung[0].problems[-1].message
    assert skipped and all(partial.test(c.case) and "(partial_node) is missed already" in c.problems[0].message
                           for c in skipped), [c.problems[0].message for c in skipped]
    assert time.monotonic() - started < 40
