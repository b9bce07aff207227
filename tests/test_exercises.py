"""course_lib.exercises: correct solutions in any style get full marks, planted bugs lose points with the
right first problem, and nothing a learner's code does can hang a check or leave a process behind.

The function checks run here on a few world sizes (1 and 3, or 1, 3 and 5, hidden cases included) with a
short case timeout, to stay fast; benchmarks/exercise_catch_rate.py runs every bug on every hidden case
through the public `exercises.check` and measures the catch rate and the time.
"""

from __future__ import annotations

import os
import pathlib
import re
import sys
import time
import types

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

import course_lib  # noqa: E402
import planted_bugs as pb  # noqa: E402
from course_lib import allreduce, exercises, traffic  # noqa: E402
import course_grader  # noqa: E402
from course_grader.hidden_cases import grader_cases  # noqa: E402
from course_lib.exercises import feedback, questions, registry, runner  # noqa: E402
from course_lib.exercises.report import Result  # noqa: E402
from course_lib.viz import traffic_plots  # noqa: E402


def _run(entry, sizes=(1, 3), case_timeout=2.0):
    exercise = registry.get(entry.exercise)
    cases = [c for c in grader_cases(exercise) if c.world_size in sizes]
    outcome = runner.run_function(exercise, entry.fn, cases=cases, case_timeout=case_timeout)
    assert outcome.not_done is None, outcome.not_done
    return Result.of_cases(exercise, outcome.cases, hidden=True), outcome


def _all_children():
    """Live child processes of this process (zombies included: they were not reaped)."""
    me, children = os.getpid(), []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            children.append(int(stat.parent.name))
    return children


_EARLIER_CHILDREN: set = set()


@pytest.fixture(autouse=True, scope="module")
def _children_before_this_module():
    """The children this worker had before these tests: a session fixture of an earlier test on the same worker (the
    browser tests' JupyterLab and Playwright driver) is not something a check left behind."""
    _EARLIER_CHILDREN.update(_all_children())
    yield
    _EARLIER_CHILDREN.clear()


def _children():
    """Child processes started since this module began and still there (zombies included: they were not reaped)."""
    return [pid for pid in _all_children() if pid not in _EARLIER_CHILDREN]


# --------------------------------------------------------------------------------------------------
# Function exercises
# --------------------------------------------------------------------------------------------------


def test_the_planted_catalogue_covers_every_function_exercise_and_enough_bugs():
    # notebooks 00-07; tests/planted_bugs_part2.py catalogues the exercises of 08-11 (test_exercises_part2.py)
    functions = {e.name for e in registry.all_exercises() if e.kind == "function" and e.notebook[:2] <= "07"}
    assert {e.exercise for e in pb.CORRECT} == functions
    assert {e.exercise for e in pb.BUGS} == functions
    assert len(pb.BUGS) >= 20
    assert all(e.expect for e in pb.BUGS)


@pytest.mark.parametrize("entry", pb.CORRECT, ids=lambda e: f"{e.exercise}-{e.name}")
def test_correct_solutions_in_every_style_get_full_marks(entry):
    result, outcome = _run(entry, sizes=(1, 3, 5))
    assert result.score == result.max_score, repr(result)
    assert result.passed and result.status == "passed"


@pytest.mark.parametrize("entry", pb.BUGS, ids=lambda e: f"{e.exercise}-{e.name}")
def test_planted_bugs_lose_points_and_the_first_problem_names_them(entry):
    started = time.monotonic()
    result, outcome = _run(entry)
    assert result.score < result.max_score, repr(result)
    first = next(c for c in outcome.cases if not c.passed).problems[0].message
    assert entry.expect in first, first
    # The report's text names the same first problem, and says nothing that changes from run to run.
    text = repr(result)
    assert first.splitlines()[0] in text
    assert not re.search(r"0x[0-9a-f]{6,}|\d+\.\d+ ?s\b|/tmp/", text), text
    assert time.monotonic() - started < 60
    assert _children() == []


@pytest.mark.parametrize("entry", pb.WAYS_ROUND, ids=lambda e: f"{e.exercise}-{e.name}")
def test_ways_round_writing_it_score_zero(entry):
    """course_lib's faster all-reduces, the built-in reached through torch.distributed.distributed_c10d or the process
    group, and padding messages next to a mean made some other way: 0 points, the first problem naming it."""
    result, outcome = _run(entry, sizes=(1, 2, 3))
    assert result.score == 0, repr(result)
    first = next(c for c in outcome.cases if not c.passed).problems[0].message
    assert entry.expect in first, first
    assert _children() == []


def test_partial_credit_follows_the_rubric_lines():
    # Floor-division chunks are right exactly when G divides N: every line holds on those cases, and only the
    # family line about uneven lengths is missed, so the ring keeps all its other points.
    result, outcome = _run(pb.Entry("ring_scatter_reduce", pb.rs_floor_division), sizes=(1, 3, 5))
    passed = [c.case for c in outcome.cases if c.passed]
    assert passed and len(passed) < len(outcome.cases)
    assert all(c.numel % c.world_size == 0 for c in passed)
    exercise = registry.get("ring_scatter_reduce")
    uneven = next(line for line in exercise.rubric if line.key == "uneven")
    assert [line.key for line in result.lines if not line.met] == ["uneven"]
    assert result.score == exercise.points - uneven.points
    assert "MISSED" in repr(result) and "uneven: " + uneven.text in repr(result)


def test_a_hung_check_leaves_nothing_behind_and_the_next_check_is_unaffected():
    started = time.monotonic()
    broken, _ = _run(pb.Entry("ring_scatter_reduce", pb.rs_deadlock), sizes=(2, 3))
    assert "deadlock" in repr(broken) and time.monotonic() - started < 30
    assert _children() == []
    fine, _ = _run(pb.Entry("ring_scatter_reduce", pb.rs_isend_recv), sizes=(2, 3))
    assert fine.passed, repr(fine)


def test_a_deadlock_names_the_ranks_waiting_for_each_other_and_where():
    _, outcome = _run(pb.Entry("ring_scatter_reduce", pb.rs_deadlock), sizes=(2,))
    message = outcome.cases[0].problems[-1].message
    assert "ranks 0 and 1 were both blocked in recv from each other: deadlock" in message
    assert "dist.recv(buffer, (rank - 1) % G)" in message          # the learner's own line
    # A hang costs its own case only: the next case tests other lines (the first one is an uneven length) and runs;
    # once every line is missed, the rest cannot change the score and is not run.
    assert outcome.cases[1].status == "failed" and "deadlock" in outcome.cases[1].problems[-1].message
    assert [c.status for c in outcome.cases[2:]] == ["not run"] * (len(outcome.cases) - 2)


def _counted_drive(fn, sizes, case_timeout):
    """runner.drive on the real ranks, with every launch it asks for recorded as (world size, cases, timeout)."""
    exercise = registry.get("ring_scatter_reduce")
    cases = [c for c in grader_cases(exercise) if c.world_size in sizes]
    launches = []

    def run(world_size, batch, inputs, first_index, timeout):
        launches.append((world_size, len(batch), timeout))
        return runner.run_batch(exercise.name, fn, world_size, batch, inputs, first_index, timeout)

    return runner.drive(exercise, cases, run, case_timeout=case_timeout), launches


def test_a_hang_is_retried_with_more_time_once_per_check_once_it_proved_real():
    """The first hang runs again alone with RETRY_FACTOR times the time; once that run hangs too, the function is
    known to hang, and the next world size's hang counts at once (an endless loop: one timeout per world size)."""
    outcome, launches = _counted_drive(pb.rs_endless_loop, sizes=(2, 3, 4), case_timeout=1.0)
    longer = 1.0 * runner.RETRY_FACTOR
    # G=2's first case is an uneven length: the core case after it runs too (a hang costs its own case only), at
    # once with the known hang's timeout, and then no line can be earned: later sizes run their first case only.
    assert [(g, timeout) for g, _, timeout in launches] == [(2, 1.0), (2, longer), (2, 1.0), (3, 1.0), (4, 1.0)], \
        launches
    failed = [c for c in outcome.cases if c.status == "failed"]
    assert [c.case.world_size for c in failed] == [2, 2, 3, 4]
    assert all("endless loop" in c.problems[-1].message for c in failed), [c.problems[-1].message for c in failed]


def _send_first_ring(tensor):
    """Every rank sends to its right neighbour with a blocking send, then receives: gloo's send waits for its
    receive, so the ranks wait for each other in a circle."""
    rank, G = torch.distributed.get_rank(), torch.distributed.get_world_size()
    chunks = torch.tensor_split(tensor, G)
    for s in range(G - 1):
        buffer = torch.empty_like(chunks[(rank - s - 1) % G])
        torch.distributed.send(chunks[(rank - s) % G], (rank + 1) % G)
        torch.distributed.recv(buffer, (rank - 1) % G)
        chunks[(rank - s - 1) % G].add_(buffer)
    return (rank + 1) % G


def _one_send_short(tensor):
    """Rank 1 returns before its last send, and rank 0's receive waits for it; the other ranks are correct."""
    rank, G = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if rank == 1 and G > 1:
        return (rank + 1) % G
    return pb.rs_isend_recv(tensor)


def _tags_disagree(tensor):
    """Rank 0 sends with tag 1, rank 1 receives with tag 2; the other ranks are correct."""
    rank, G = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if rank == 0 and G > 1:
        torch.distributed.send(tensor, 1, tag=1)
    elif rank == 1:
        torch.distributed.recv(torch.empty_like(tensor), 0, tag=2)
    return pb.rs_isend_recv(tensor)


@pytest.mark.parametrize("fn, expect", [
    (pb.rs_deadlock, "ranks 0 and 1 were both blocked in recv from each other: deadlock"),
    (_send_first_ring, "ranks 0 and 1 were both blocked in send to each other: deadlock"),
    (_one_send_short, "but rank 1 had already returned from ring_scatter_reduce: a recv with no matching send"),
    (_tags_disagree, "rank 0 was sending to rank 1 while rank 1 was receiving from rank 0, but the two calls do not "
                     "match: a different tag"),
], ids=["recv_first", "send_first", "a_rank_returned", "tags_disagree"])
def test_a_certain_deadlock_is_found_at_once_not_after_the_timeout(fn, expect):
    """With a case timeout of 10 s, a deadlock at each world size is still found in about a second: no retry,
    and the explanation names the ranks and says the check stopped the case itself. Without the watchdogs' rule
    the first case would wait 10 s, then run again for 40 s (and the check would run out of its 45 s)."""
    started = time.monotonic()
    outcome, launches = _counted_drive(fn, sizes=(2, 3), case_timeout=10.0)
    # G=2's first case is an uneven length (its family line only), so the next, a core case, runs too; after it
    # no line can be earned, and G=3 runs its first case only.
    assert [(g, timeout) for g, _, timeout in launches] == [(2, 10.0), (2, 10.0), (3, 10.0)], launches
    failed = [c for c in outcome.cases if c.status == "failed"]
    assert [c.case.world_size for c in failed] == [2, 2, 3]
    first = failed[0].problems[-1].message
    assert expect in first and "(Found at once: no rank could ever move again.)" in first, first
    assert [c.status for c in outcome.cases if c.case.world_size == 2][2:] == ["not run"] * 4
    assert outcome.cases[2].problems[0].message.startswith("not run: an earlier case with G=2 deadlocked")
    assert time.monotonic() - started < 20
    assert _children() == []


def _blocked(entry, match, posted=(), at=1.0):
    return {"finished": False, "entry": entry, "match": list(match), "posted": [list(p) for p in posted], "at": at}


def _finished(posted=()):
    return {"finished": True, "posted": [list(p) for p in posted]}


# Two ranks, each blocked in its first recv from the other, nothing sent: the textbook deadlock.
_RECV_RECV = [_blocked(1, ("recv", 1, 0, 1), [("recv", 1, 0, 1)]), _blocked(1, ("recv", 0, 0, 1), [("recv", 0, 0, 1)])]


@pytest.mark.parametrize("before, now, certain", [
    (_RECV_RECV, [dict(s, at=2.0) for s in _RECV_RECV], True),
    # rank 1 had posted an isend to rank 0 before it blocked: rank 0's receive can complete
    (_RECV_RECV, [dict(_RECV_RECV[0], at=2.0),
                  _blocked(1, ("recv", 0, 0, 1), [("recv", 0, 0, 1), ("send", 0, 0, 1)], at=2.0)], False),
    # the same recv-recv, but rank 1's second state is no newer than the first read: it may have moved since
    (_RECV_RECV, [dict(_RECV_RECV[0], at=2.0), _RECV_RECV[1]], False),
    # rank 1 is in another blocking call than at the first read
    (_RECV_RECV, [dict(_RECV_RECV[0], at=2.0), dict(_RECV_RECV[1], entry=2, at=2.0)], False),
    # rank 1 is running code (not blocked), or has not published yet
    (_RECV_RECV, [dict(_RECV_RECV[0], at=2.0), {"finished": False, "entry": None, "at": 2.0}], False),
    (_RECV_RECV, [dict(_RECV_RECV[0], at=2.0), None], False),
    # a receive from any source somewhere: which send meets it is unknown
    (_RECV_RECV, [dict(_RECV_RECV[0], at=2.0), dict(_RECV_RECV[1], at=2.0, unmatched=True)], False),
    # rank 1 returned having sent nothing to rank 0, which waits for it: certain
    ([_RECV_RECV[0], _finished()], [dict(_RECV_RECV[0], at=2.0), _finished()], True),
    # ... but it finished only after the first read: the two reads are not one moment
    (_RECV_RECV, [dict(_RECV_RECV[0], at=2.0), _finished()], False),
    # rank 1 returned after sending what rank 0 waits for (the message is on its way)
    ([_RECV_RECV[0], _finished([("send", 0, 0, 1)])], [dict(_RECV_RECV[0], at=2.0), _finished([("send", 0, 0, 1)])],
     False),
    # a blocking send that its receiver has posted the receive for completes (gloo moves the data)
    ([_blocked(3, ("send", 1, 0, 2), [("send", 1, 0, 2)]), _blocked(4, ("recv", 0, 7, 1), [("recv", 0, 0, 2)])],
     [_blocked(3, ("send", 1, 0, 2), [("send", 1, 0, 2)], at=2.0),
      _blocked(4, ("recv", 0, 7, 1), [("recv", 0, 0, 2)], at=2.0)], False),
    # ... but one that it has not (rank 1 took one message with tag 0 and waits on tag 7): certain
    ([_blocked(3, ("send", 1, 0, 2), [("send", 1, 0, 2)]), _blocked(4, ("recv", 0, 7, 1), [("recv", 0, 0, 1)])],
     [_blocked(3, ("send", 1, 0, 2), [("send", 1, 0, 2)], at=2.0),
      _blocked(4, ("recv", 0, 7, 1), [("recv", 0, 0, 1)], at=2.0)], True),
], ids=["recv_recv", "message_on_its_way", "stale_state", "moved_on", "running", "no_state", "any_source",
        "peer_returned", "returned_between_reads", "returned_after_sending", "send_met", "send_unmet"])
def test_the_deadlock_rule_is_certain_only_when_no_call_can_ever_complete(before, now, certain):
    assert runner.certain_deadlock(before, now, read_before=1.5) is certain


def test_the_tracer_leaves_the_rule_out_where_it_cannot_pair_sends_with_receives():
    """What the rule reads: the k-th call of a direction, peer and tag; and `unmatched` wherever that pairing is not
    known (any source, a subgroup, a tag beyond the case's range, another thread, a call or wait that failed)."""
    import threading

    from course_lib.exercises.tracing import TAG_STRIDE, Tracer

    world, subgroup = types.SimpleNamespace(code=0), types.SimpleNamespace(code=7)
    tracer = Tracer()
    assert tracer._post("recv", 1, 0, world) == ("recv", 1, 0, 1)
    assert tracer._post("recv", 1, 0, world) == ("recv", 1, 0, 2)
    assert tracer._post("send", 1, 3, world) == ("send", 1, 3, 1) and not tracer.unmatched
    def unmatched_after(act):
        fresh = Tracer()
        act(fresh)
        return fresh.unmatched
    assert unmatched_after(lambda t: t._post("recv", None, 0, world))                     # any source
    assert unmatched_after(lambda t: t._post("send", 1, 0, subgroup))                     # a subgroup
    assert unmatched_after(lambda t: t._post("send", 1, TAG_STRIDE, world))               # a tag beyond the case
    assert not unmatched_after(lambda t: t._post("send", 1, TAG_STRIDE - 1, world))

    def from_another_thread(t):
        worker = threading.Thread(target=lambda: t._post("send", 1, 0, world))
        worker.start()
        worker.join()
    assert unmatched_after(from_another_thread)

    def wait_from_another_thread(t):
        worker = threading.Thread(target=lambda: t.blocked_in("irecv.wait", 1, "irecv.wait(src=1)").__enter__())
        worker.start()
        worker.join()
    assert unmatched_after(wait_from_another_thread)

    def failing_call(t):
        with pytest.raises(RuntimeError), t.failures_unmatch():
            raise RuntimeError("Tensors must be contiguous")
    assert unmatched_after(failing_call)


def test_a_case_that_only_the_machine_made_slow_passes_on_its_retry_and_keeps_the_retry_for_later_sizes(tmp_path):
    """A correct ring whose first case at each world size takes longer than a case may (a busy machine, once)
    passes when it runs again, and the check, having learned nothing about hangs, still gives the next world
    size's slow case its retry."""
    def slow_once_ring(tensor):
        marker = tmp_path / f"slow.G{torch.distributed.get_world_size()}.rank{torch.distributed.get_rank()}"
        if not marker.exists():
            marker.touch()
            time.sleep(2.5)                  # over the 1 s a case may take, this once; under the retry's 4 s
        return pb.rs_isend_recv(tensor)

    outcome, launches = _counted_drive(slow_once_ring, sizes=(2, 3), case_timeout=1.0)
    assert all(c.passed for c in outcome.cases), [(c.case, c.problems) for c in outcome.cases if not c.passed]
    longer = [g for g, _, timeout in launches if timeout > 1.0]
    assert longer == [2, 3], launches


def test_the_ring_picture_shows_the_failing_step():
    result, outcome = _run(pb.Entry("ring_scatter_reduce", pb.rs_off_by_one_chunk), sizes=(3,))
    first = next(c for c in outcome.cases if not c.passed)
    figure = registry.get("ring_scatter_reduce").picture(first.case, first.records, first.problems[0])
    assert [ax.get_title() for ax in figure.axes] == ["yours, after scatter-reduce step 0",
                                                      "the ring's, after step 0"]
    html = result._repr_html_()
    assert "data:image/png;base64," in html and "the ring sends chunk 0" in html


def test_an_unfinished_exercise_is_not_done_yet_not_an_error():
    def ring_scatter_reduce(tensor):
        raise NotImplementedError("your code here")

    started = time.monotonic()
    result = course_grader.check("ring_scatter_reduce", ring_scatter_reduce)
    assert (result.score, result.status) == (0.0, "not done")
    assert "not done yet: ring_scatter_reduce still raises NotImplementedError" in repr(result)
    assert time.monotonic() - started < 10
    assert exercises.check("ring", ...).status == "not done"
    assert exercises.check("traffic_ring", ...).status == "not done"


def test_the_visible_check_of_a_correct_ring_passes_on_every_world_size_up_to_8():
    result = exercises.check("ring", pb.ring_a)
    assert result.passed, repr(result)
    assert {c.case.world_size for c in result.cases} == {1, 2, 3, 4, 5, 8}
    assert any(c.case.numel % c.case.world_size for c in result.cases)
    assert {c.case.data for c in result.cases} == {"tagged", "random"}
    hidden = grader_cases(registry.get("ring"))
    assert {c.world_size for c in hidden} == set(range(1, 9)) and len(hidden) > len(result.cases)
    visible = registry.get("ring").cases()
    assert repr(result) == f"ring: 5/5 points, all {len(visible)} cases passed (G = 1, 2, 3, 4, 5, 8)"
    assert {k: v for k, v in result.to_dict().items() if k != "lines"} == {
        "name": "ring", "score": 5.0, "max_score": 5.0, "output": repr(result)}
    assert [line["key"] for line in result.to_dict()["lines"]] == [line.key for line in registry.get("ring").rubric]
    assert all(line["met"] for line in result.to_dict()["lines"])


def test_bad_calls_of_check_are_explained():
    with pytest.raises(ValueError, match="Did you mean 'ring_all_gather'"):
        exercises.check("ring_allgather", print)
    with pytest.raises(TypeError, match="pass the function itself"):
        exercises.check("ring", 3)


def test_the_list_names_every_exercise_of_the_course():
    listing = exercises.list()
    names = {info.name for info in listing}
    assert {"pass_token", "broadcast", "all_gather", "naive", "parameter_server", "ring_scatter_reduce",
            "ring_all_gather", "ring", "average_gradients", "batch_size_quiz", "traffic_naive",
            "traffic_ring_per_rank"} <= names
    assert [i.notebook[:2] for i in listing] == sorted(i.notebook[:2] for i in listing)
    assert "04  ring_scatter_reduce" in repr(listing)
    assert {i.name for i in exercises.list("05")} == {"ring_all_gather", "ring"}


# --------------------------------------------------------------------------------------------------
# Pieces: deadlock explanations, tracing, output caps
# --------------------------------------------------------------------------------------------------


def _state(kind, call=None, peer=None, where=""):
    return {"kind": kind, "call": call, "peer": peer, "where": where, "printed": 0}


def test_stuck_ranks_are_explained_from_what_each_was_doing():
    both_send = feedback.explain_stuck({0: _state("blocked", "send", 1), 1: _state("blocked", "send", 0)}, "f", 4)
    assert both_send.startswith("ranks 0 and 1 were both blocked in send to each other: deadlock")
    orphan = feedback.explain_stuck({0: _state("finished"), 1: _state("blocked", "irecv.wait", 0)}, "f", 4)
    assert orphan.startswith("rank 1 was blocked in recv from rank 0, but rank 0 had already returned from f")
    loop = feedback.explain_stuck({0: _state("running", where="line 3 in f: while x: pass"),
                                   1: _state("blocked", "recv", 0)}, "f", 4)
    assert loop.startswith("rank 0 was still running f after 4 s, at line 3 in f: while x: pass: an endless loop?")
    assert "rank 1: blocked in recv from rank 0" in loop


def test_launch_shows_only_the_start_of_a_flood_of_output(capsys):
    def loud(rank, world_size):
        for i in range(20_000):
            print("line", i)

    course_lib.launch(loud, world_size=2, backend="gloo")
    out = capsys.readouterr().out
    cap = sys.modules["course_lib.launch"].MAX_OUTPUT_CHARS
    for rank in (0, 1):  # each rank's own text, without the "[rank r] " prefixes, stops at the cap
        shown = "".join(line.split("] ", 1)[1] + "\n" for line in out.splitlines() if line.startswith(f"[rank {rank}]"))
        assert cap - 20 < len(shown) < cap + 200
    assert re.search(r"\[rank 1\] \.\.\. rank 1 wrote [\d,]+ bytes to stdout in all; only the first 20,000 "
                     r"characters are shown", out)


# --------------------------------------------------------------------------------------------------
# Questions
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["G*(G-1)*N", "G(G-1)N", "(G^2 - G) N", "N*G*G - N*G", "g(g-1)n", "G × (G − 1) × N"])
def test_formulas_are_read_as_the_course_writes_them(text):
    assert exercises.check("traffic_naive", text).passed


@pytest.mark.parametrize("text", ["__import__('os').getcwd()", "G.real", "open('x')", "G ** 99", "[G, N]", "x * G"])
def test_anything_but_arithmetic_in_g_and_n_is_refused_without_running_it(text):
    result = exercises.check("traffic_naive", text)
    assert result.score == 0 and result.status == "failed"
    with pytest.raises(questions.FormulaError):
        questions.parse_formula(text)


def test_every_question_accepts_its_answer_and_explains_the_usual_slips():
    answers = {"batch_size_quiz": "B", "batches_per_epoch": 1, "batch_per_gpu": 32, "shard_weights": (0.25, 0.75),
               "naive_vs_master_ranks": 20, "ring_steps": "2(G-1)"}
    # The traffic formulas as the course writes them (viz.traffic_plots.FORMULAS), e.g. "2(G-1)N/G".
    for name, (variant, quantity) in {"traffic_naive": ("naive", "total_sent"),
                                      "traffic_naive_per_rank": ("naive", "max_sent"),
                                      "traffic_parameter_server": ("parameter_server", "total_sent"),
                                      "traffic_parameter_server_root": ("parameter_server", "max_sent"),
                                      "traffic_ring": ("ring", "total_sent"),
                                      "traffic_ring_per_rank": ("ring", "max_sent")}.items():
        answers[name] = traffic_plots.FORMULAS[(variant, quantity)][1]
    # notebook 08's questions are tested in test_exercises_part2.py
    questions_ = {e.name for e in registry.all_exercises() if e.kind == "question" and e.notebook[:2] <= "07"}
    assert set(answers) == questions_
    for name, answer in answers.items():
        assert exercises.check(name, answer).passed, (name, answer)
    assert exercises.check("traffic_ring_per_rank", lambda G, N: 2 * (G - 1) * N / G).passed
    slip = exercises.check("traffic_naive", "(G-1)*N")
    assert "That is what one rank sends" in repr(slip) and slip.score == 0.5       # one of its two lines
    assert [line.key for line in slip.lines if not line.met] == ["all_ranks"]
    assert "one phase only" in repr(exercises.check("traffic_ring_per_rank", "(G-1)N/G"))
    assert "check time per epoch" in repr(exercises.check("batch_size_quiz", "A"))
    assert "answer with one of the letters" in repr(exercises.check("batch_size_quiz", 2))
    assert exercises.check("shard_weights", [0.5, 0.5]).score == 0.5     # they add up to 1, not in proportion
    assert exercises.check("shard_weights", [1, 2]).score == 0


def test_the_ring_steps_answer_matches_a_recorded_ring():
    def steps(rank, world_size):
        with traffic.record() as rec:
            allreduce.ring(torch.arange(10.0))
        return rec.messages_sent

    for world_size in (2, 3, 5):
        sent = course_lib.launch(steps, world_size=world_size, backend="gloo")
        truth = questions.parse_formula("2*(G-1)")(world_size, 10)
        assert sent == [truth] * world_size
