"""The exercises of notebooks 08-11 and the capstone: correct solutions in two or more styles get full marks,
planted bugs lose points and the first problem names them, and each rubric has slips that keep part of it.

The function checks run on a few world sizes each (`Entry.sizes`); benchmarks/exercise_catch_rate.py --part 2
runs every entry on every hidden case and records the catch rate.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

import planted_bugs_part2 as pb  # noqa: E402
from course_grader.hidden_cases import grader_cases  # noqa: E402
from course_lib.exercises import registry, runner  # noqa: E402
from course_lib.exercises.report import Result  # noqa: E402

PART_TWO = ("08", "09", "10", "11")


def _run(exercise_name, fn, sizes, case_timeout=2.0):
    exercise = registry.get(exercise_name)
    cases = [c for c in grader_cases(exercise) if c.world_size in sizes]
    outcome = runner.run_function(exercise, fn, cases=cases, case_timeout=case_timeout)
    assert outcome.not_done is None, outcome.not_done
    return Result.of_cases(exercise, outcome.cases, hidden=True), outcome


def _first_problem(outcome) -> str:
    return next(c for c in outcome.cases if not c.passed).problems[0].message


def test_every_function_exercise_of_part_two_has_two_correct_styles_and_planted_bugs():
    functions = {e.name for e in registry.all_exercises(include_pending=True)
                 if e.kind == "function" and e.notebook[:2] in PART_TWO}
    styles = {name: [e for e in pb.CORRECT if e.exercise == name] for name in functions}
    assert all(len(found) >= 2 for found in styles.values()), styles
    assert {e.exercise for e in pb.BUGS} == functions
    assert all(e.expect for e in pb.BUGS)


@pytest.mark.parametrize("entry", pb.CORRECT, ids=lambda e: f"{e.exercise}-{e.name}")
def test_correct_solutions_in_every_style_get_full_marks(entry):
    result, outcome = _run(entry.exercise, entry.fn, entry.sizes)
    assert result.score == result.max_score, repr(result)


@pytest.mark.parametrize("entry", pb.BUGS, ids=lambda e: f"{e.exercise}-{e.name}")
def test_planted_bugs_lose_points_and_the_first_problem_names_them(entry):
    result, outcome = _run(entry.exercise, entry.fn, entry.sizes)
    assert result.score < result.max_score, repr(result)
    first = _first_problem(outcome)
    assert entry.expect in first, first


# Partial credit: a slip costs the lines it touches and keeps the others (sizes 1, 3 and 4 cover every line).
SLIPS = {
    "tree": [(pb.tree_floor_log, {"any_g"}), (pb.tree_reduce_only, {"broadcast", "values"})],
    "halving_doubling": [(pb.hd_no_fold, {"non_power_of_two", "uneven"}),
                         (pb.hd_whole_tensor, {"halves"}),
                         (pb.hd_same_order_all_gather, {"partners", "values"})],
    "ring_hook": [(pb.hook_sum_not_mean, {"mean", "training"}), (pb.hook_ring_to_the_left, {"ring"})],
    "beat_the_ring": [(pb.beat_ring_only, {"t_4kib", "t_64kib", "t_1mib"}),
                      (pb.beat_blocking_doubling, {"t_4kib", "t_64kib"})],
    "overlapped_buckets": [(pb.overlap_starts_in_finish, {"overlap"}), (pb.overlap_waits_in_hook, {"overlap"})],
    "zero1_step": [(pb.zero_whole_tensor, {"shard", "gather"}), (pb.zero_sum_not_mean, {"training"})],
    "fit_alpha_beta": [(pb.fit_swapped, {"returned"}), (pb.fit_plain_least_squares, {"weighted"}),
                       (pb.fit_through_origin, {"fit"})],
}


@pytest.mark.parametrize("name", sorted(SLIPS))
def test_a_slip_keeps_the_lines_it_gets_right(name):
    for fn, missed in SLIPS[name]:
        result, _ = _run(name, fn, (1, 3, 4))
        assert 0.2 <= result.score / result.max_score <= 0.9, (fn.__name__, repr(result))
        assert {line.key for line in result.lines if line.tested and not line.met} == missed, (fn.__name__, repr(result))


def test_the_fit_exercise_asks_for_the_relative_fit_and_plain_least_squares_is_not_it():
    """The reference is cost.fit's relative weighting; on every noisy case plain least squares misses by > 2%, so the
    'weighted' line is about something; on the recorded modeled-link run the fit finds the link it was set to."""
    from course_lib import cost
    from course_lib.exercises import fitting

    exercise = registry.get("fit_alpha_beta")
    for case in grader_cases(exercise):
        (inputs,) = exercise.inputs(case)
        alpha, beta = fitting.relative_fit(inputs["sizes"], inputs["times"])
        reference = cost.fit(cost.Model("one message", lambda g: 1.0, lambda g: 1.0, lambda g: 0.0, "a + n b"),
                             [2] * len(inputs["sizes"]), inputs["sizes"], inputs["times"])
        assert abs(alpha / reference.alpha - 1) < 1e-9 and abs(beta / reference.beta - 1) < 1e-9
        if case.data == "noisy":
            plain_alpha, _ = fitting.plain_fit(inputs["sizes"], inputs["times"])
            assert abs(plain_alpha / alpha - 1) > 0.02, case
        if case.data == "measured":
            assert abs(alpha / 5e-3 - 1) < 0.03 and abs(beta / 1e-9 - 1) < 0.03


def test_the_halving_doubling_schedule_pairs_partners_by_xor_and_halves_the_sizes():
    from course_lib.exercises.fast_variants import hd_schedule

    plan = hd_schedule(8, 64)
    assert [(e.phase, e.peer, e.size) for e in plan[3]] == [
        ("reduce-scatter", 7, 32), ("reduce-scatter", 1, 16), ("reduce-scatter", 2, 8),
        ("all-gather", 2, 8), ("all-gather", 1, 16), ("all-gather", 7, 32)]
    assert plan[3][1].holds == {3, 7}
    # G = 6, the notebook's fold: 0 -> 1 and 2 -> 3; rank 1 plays virtual 0, rank 3 virtual 1, 4 and 5 are 2 and 3.
    folded = hd_schedule(6, 12)
    assert [(e.phase, e.peer) for e in folded[0]] == [("fold", 1)]
    assert [(e.phase, e.peer) for e in folded[1]][0] == ("reduce-scatter", 4)
    assert folded[1][0].holds == {0, 1}
    assert folded[1][-1].phase == "unfold" and folded[1][-1].peer == 0


def test_the_tree_plan_sends_each_subtree_up_once_and_the_sum_down():
    from course_lib.exercises.fast_variants import tree_plan

    plan = tree_plan(6)
    assert [(e.phase, e.peer, sorted(e.holds)) for e in plan[4]] == [("reduce", 0, [4, 5]), ("broadcast", 5, list(range(6)))]
    assert [e.peer for e in plan[0]] == [4, 2, 1]            # farthest child first
    assert [(e.phase, e.peer) for e in tree_plan(6, "high")[3]] == [("reduce", 1)]


# Notebook 08's questions: the right answer, and slips that keep half.
QUESTIONS = {
    "straggler_staleness": (5, [6, 1.75, 2.5]),
    "stable_step_size": (0.178, [0.8, 0.445, 0.4]),
}


@pytest.mark.parametrize("name", sorted(QUESTIONS))
def test_the_questions_of_notebook_08_score_blank_right_and_slips(name):
    from course_lib import exercises

    right, slips = QUESTIONS[name]
    assert exercises.check(name, ...).score == 0
    assert exercises.check(name, right).score == 1
    for answer in slips:
        result = exercises.check(name, answer)
        assert result.score == 0.5, (answer, repr(result))
        assert "That" in repr(result)          # the slip's hint, not only "not right"


def test_the_recorded_run_is_computed_and_its_staleness_follows_the_definition():
    from course_lib.exercises.stale_questions import recorded_run

    log = recorded_run()
    assert [u.applied_at for u in log] == list(range(len(log)))
    assert all(u.staleness >= 0 for u in log)
    straggler = [u for u in log if u.worker == 1]
    assert [u.staleness for u in straggler] == [4, 6]          # the fast workers' updates land while it computes
    assert recorded_run({1: 1}) == [type(log[0])(k, 1, k, k) for k in range(len(log))]   # alone: always fresh
