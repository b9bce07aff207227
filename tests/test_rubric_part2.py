"""Rubric scoring for the exercises of notebooks 08-11 (issue 21), as tests/test_rubric.py does for 00-07: a blank
answer scores 0, a correct one full marks, and at least two one-token slips each score between 20% and 85% with
the lines they miss named in the feedback.

The correct answers and most slips are tests/planted_bugs_part2.py's. Of the tree's planted bugs only the forgotten
broadcast and the broadcast that adds instead of copying are slips that keep part of the rubric (tree_floor_log
keeps 90%, the wrong parent, the overwrite and the broadcast of the inputs score 0), so more of its one-token slips
are written here.

The function exercises run on the hidden cases of G = 1, 3 and 4 (core cases, G = 1, a G that is not a power of
two, uneven lengths, and for beat_the_ring every timed size on both links), which test every rubric line;
tests/test_exercises_part2.py and benchmarks/exercise_catch_rate.py run the rest.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import planted_bugs_part2 as pb  # noqa: E402
from rubric_checks import assert_named as _assert_named, check as _check, missed as _missed  # noqa: E402
from course_lib import exercises, p2p  # noqa: E402
from course_lib.exercises import registry  # noqa: E402

PART_TWO = ("08", "09", "10", "11")


# --------------------------------------------------------------------------------------------------
# One-token slips of the notebook's tree (tree_lowest_bit_p2p) that the planted bugs do not cover
# --------------------------------------------------------------------------------------------------


def _tree(tensor, *, new_tensor=False, broadcast_levels=None, broadcast_upwards=False):
    rank, G = dist.get_rank(), dist.get_world_size()
    levels = (G - 1).bit_length()
    incoming = torch.empty_like(tensor)
    for j in range(levels):
        mask = 1 << j
        if rank % (2 * mask) == mask:
            p2p.send(tensor, rank - mask)
        elif rank % (2 * mask) == 0 and rank + mask < G:
            p2p.recv(incoming, rank + mask)
            if new_tensor:
                tensor = tensor + incoming
            else:
                tensor += incoming
    down = range(levels if broadcast_levels is None else broadcast_levels(levels))
    for j in (down if broadcast_upwards else reversed(down)):
        mask = 1 << j
        if rank % (2 * mask) == 0 and rank + mask < G:
            p2p.send(tensor, rank + mask)
        elif rank % (2 * mask) == mask:
            p2p.recv(tensor, rank - mask)


def tree_new_tensor_in_reduce(tensor):          # tensor = tensor + incoming for tensor += incoming: not in place
    _tree(tensor, new_tensor=True)


def tree_broadcast_not_reversed(tensor):        # range(levels) for reversed(range(levels)) in the broadcast
    _tree(tensor, broadcast_upwards=True)


def tree_broadcast_step_short(tensor):          # the broadcast's loop bound one short: range(levels - 1)
    _tree(tensor, broadcast_levels=lambda levels: levels - 1)


# Two one-token slips (or more) per function exercise: the slip, and the rubric lines it must miss.
SLIPS = {
    "ring_hook": [(pb.hook_sum_not_mean, {"mean", "training"}),                        # 3/10
                  (pb.hook_divides_by_g_minus_one, {"mean", "training"}),              # 3/10
                  (pb.hook_returns_tensor, {"mean"}),                                  # 6/10
                  (pb.hook_ring_to_the_left, {"ring"})],                               # 8/10
    "fit_alpha_beta": [(pb.fit_swapped, {"returned"}),                                 # 4/5
                       (pb.fit_milliseconds, {"returned"}),                            # 4/5
                       (pb.fit_weights_squared, {"weighted"}),                         # 3/5
                       (pb.fit_through_origin, {"fit"})],                              # 3/5
    "tree": [(tree_new_tensor_in_reduce, {"values"}),                                  # 8/10
             (tree_broadcast_not_reversed, {"broadcast", "values"}),                   # 5/10
             (tree_broadcast_step_short, {"broadcast", "values"}),                     # 5/10
             (pb.tree_reduce_only, {"broadcast", "values"}),                           # 5/10
             (pb.tree_broadcast_adds, {"broadcast", "values"})],                       # 5/10
    "halving_doubling": [(pb.hd_partner_plus, {"partners", "values"}),                 # 5.5/10
                         (pb.hd_same_order_all_gather, {"partners", "values"}),        # 5.5/10
                         (pb.hd_step_short, {"partners", "values"}),                   # 5.5/10
                         (pb.hd_both_keep_lower, {"halves", "values"}),                # 6/10
                         (pb.hd_no_unfold, {"non_power_of_two", "uneven"})],           # 7.5/10
    "overlapped_buckets": [(pb.overlap_sum_not_mean, {"mean", "training"}),            # 6/10
                           (pb.overlap_waits_in_hook, {"overlap"})],                   # 7/10
    "zero1_step": [(pb.zero_sum_not_mean, {"training"}),                               # 6/10
                   (pb.zero_gathers_into_wrong_slot, {"training"}),                    # 6/10
                   (pb.zero_gathers_gradients, {"gather"})],                           # 7.5/10
    "beat_the_ring": [(pb.beat_crossover_in_megabytes, {"t_4kib", "t_64kib"}),                      # 7/10
                      (pb.beat_tree_for_small, {"t_4kib", "t_64kib"}),                              # 7/10
                      (pb.beat_blocking_doubling, {"t_4kib", "t_64kib"}),                           # 7/10
                      (pb.beat_tree_or_ring, {"t_4kib", "t_64kib", "t_1mib"})],                     # 5.5/10
}
CORRECT = {entry.exercise: entry.fn for entry in reversed(pb.CORRECT)}   # the first style of each


def _blank(*args, **kwargs):
    raise NotImplementedError("your code here")


def test_every_exercise_of_notebooks_08_to_11_is_covered():
    part_two = [e for e in registry.all_exercises(include_pending=True) if e.notebook[:2] in PART_TWO]
    functions = {e.name for e in part_two if e.kind == "function"}
    assert set(SLIPS) == functions and set(CORRECT) == functions
    assert all(len(slips) >= 2 for slips in SLIPS.values())
    assert set(QUESTIONS) == {e.name for e in part_two} - functions


def test_the_slips_written_here_are_not_the_planted_bugs_and_the_rest_are():
    planted = {entry.fn for entry in pb.BUGS}
    for name, slips in SLIPS.items():
        for fn, _ in slips:
            assert (fn in planted) != (fn.__module__ == __name__), (name, fn.__name__)
            if fn in planted:
                assert next(e for e in pb.BUGS if e.fn is fn).exercise == name, (name, fn.__name__)


@pytest.mark.parametrize("name", sorted(SLIPS))
def test_a_function_exercise_scores_zero_blank_full_correct_and_partly_for_slips(name):
    blank = _check(name, _blank)
    assert blank.score == 0 and blank.status == "not done", repr(blank)
    correct = _check(name, CORRECT[name])
    assert correct.score == correct.max_score == registry.get(name).points, repr(correct)
    for fn, missed in SLIPS[name]:
        result = _check(name, fn)
        assert result.max_score == registry.get(name).points, (fn.__name__, repr(result))   # every line tested
        assert 0.2 <= result.score / result.max_score <= 0.85, (fn.__name__, repr(result))
        assert _missed(result) == missed, (fn.__name__, repr(result))
        _assert_named(result, missed)


# Notebook 08's questions: the right answer, and slips with the line each must miss. (test_exercises_part2.py
# checks their scores; this checks that the feedback names the missed line.)
QUESTIONS = {
    "straggler_staleness": (5, [(6, {"definition"}), (1.75, {"straggler"}), (2.5, {"definition"})]),
    "stable_step_size": (0.178, [(0.8, {"staleness"}), (0.445, {"curvature"}), (0.4, {"staleness"})]),
}


@pytest.mark.parametrize("name", sorted(QUESTIONS))
def test_a_question_of_notebook_08_scores_zero_blank_full_right_and_partly_for_slips(name):
    question = registry.get(name)
    right, slips = QUESTIONS[name]
    assert exercises.check(name, ...).score == 0
    assert exercises.check(name, right).score == question.points
    assert len(slips) >= 2
    for answer, missed in slips:
        result = exercises.check(name, answer)
        assert 0.2 <= result.score / result.max_score <= 0.85, (answer, repr(result))
        assert _missed(result) == missed, (answer, repr(result))
        _assert_named(result, missed)
