"""Rubric scoring: for every exercise of notebooks 00-07 a blank answer scores 0, a correct one full marks, and at
least two one-token slips each score between 20% and 85% with the lines they miss named in the feedback; the
rubric's defaults are documented in one place (docs/rubric.toml) and every line is tested by the hidden cases.

The function exercises run here on the hidden cases of G = 1, 3 and 4 (core cases, uneven lengths, G = 1 and
other roots among them), to stay fast; test_grade.py grades the full hidden cases through the sandbox.
"""

from __future__ import annotations

import pathlib

import pytest

import planted_bugs as pb
from rubric_checks import assert_named as _assert_named, check as _check, missed as _missed
from course_lib import exercises
from course_grader.hidden_cases import grader_cases
from course_lib.exercises import registry, rubric_file
from course_lib.exercises.questions import Slip
from course_lib.exercises.report import Result
from course_lib.viz import traffic_plots

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Two one-token slips (or more) per function exercise: the planted bug, and the lines it must miss.
SLIPS = {
    "pass_token": [(pb.token_counts_to_g, {"messages", "returned", "single"}),   # at G = 1 it sends to itself
                   (pb.token_forgets_own, {"returned"})],
    "broadcast": [(pb.broadcast_from_zero, {"any_src"}), (pb.broadcast_adds, {"values"})],
    "all_gather": [(pb.all_gather_recv_into_own_slot, {"own", "others"}), (pb.all_gather_no_own_slot, {"own"})],
    "naive": [(pb.naive_copies_instead_of_adding, {"values"}), (pb.naive_averages, {"values"})],
    "parameter_server": [(pb.ps_root_zero, {"any_root"}), (pb.ps_forgets_root_share, {"values", "root"})],
    "ring_scatter_reduce": [(pb.rs_step_short, {"messages", "values"}), (pb.rs_wrong_return, {"returned"}),
                            (pb.rs_plus_instead_of_minus, {"chunks", "values"})],
    "ring_all_gather": [(pb.ag_wrong_chunk, {"chunks", "values"}), (pb.ag_to_left, {"messages"})],
    "ring": [(pb.ring_scatter_reduce_twice, {"all_gather", "values", "uneven"}),   # uneven: its element count
             (pb.ring_without_all_gather, {"messages", "values"})],
    "average_gradients": [(pb.avg_sum_not_mean, {"mean", "training"}),
                          (pb.avg_divides_by_rank_count_minus_one, {"mean", "training"})],
}
CORRECT = {entry.exercise: entry.fn for entry in reversed(pb.CORRECT)}   # the first style of each


def test_every_exercise_of_notebooks_00_to_07_is_covered():
    names = {e.name for e in registry.all_exercises() if e.notebook[:2] <= "07"}
    functions = {e.name for e in registry.all_exercises() if e.kind == "function" and e.notebook[:2] <= "07"}
    assert functions <= names and set(SLIPS) == functions
    assert all(len(slips) >= 2 for slips in SLIPS.values())
    assert set(QUESTION_ANSWERS) == names - functions


def _blank(*args, **kwargs):
    raise NotImplementedError("your code here")


@pytest.mark.parametrize("name", sorted(SLIPS))
def test_a_function_exercise_scores_zero_blank_full_correct_and_partly_for_slips(name):
    blank = _check(name, _blank)
    assert blank.score == 0 and blank.status == "not done"
    correct = _check(name, CORRECT[name])
    assert correct.score == correct.max_score == registry.get(name).points, repr(correct)
    for fn, missed in SLIPS[name]:
        result = _check(name, fn)
        assert 0.2 <= result.score / result.max_score <= 0.85, (fn.__name__, repr(result))
        assert _missed(result) == missed, (fn.__name__, repr(result))
        _assert_named(result, missed)


# Questions: the right answer as the course writes it, and the slips whose lines are partly right.
QUESTION_ANSWERS = {
    "batch_size_quiz": ("B", ["A", "C"]),
    "batches_per_epoch": (1, None),
    "batch_per_gpu": (32, None),
    "shard_weights": ((0.25, 0.75), [(0.75, 0.25), (10, 30)]),
    "naive_vs_master_ranks": (20, None),
    "ring_steps": ("2(G-1)", None),
}
for _name, (_variant, _quantity) in {"traffic_naive": ("naive", "total_sent"), "traffic_naive_per_rank": ("naive", "max_sent"),
                                     "traffic_parameter_server": ("parameter_server", "total_sent"),
                                     "traffic_parameter_server_root": ("parameter_server", "max_sent"),
                                     "traffic_ring": ("ring", "total_sent"), "traffic_ring_per_rank": ("ring", "max_sent")}.items():
    QUESTION_ANSWERS[_name] = (traffic_plots.FORMULAS[(_variant, _quantity)][1], None)


def _slip_answers(question) -> list:
    """A question's known slips with partial credit, as a learner would give them (the value, or the formula)."""
    slips = [slip for slip in question.slips if slip.met]
    if question.answer_kind == "number":
        return [slip.answer() for slip in slips]
    return [slip.answer for slip in slips]


@pytest.mark.parametrize("name", sorted(QUESTION_ANSWERS))
def test_a_question_scores_zero_blank_full_right_and_partly_for_slips(name):
    question = registry.get(name)
    right, slips = QUESTION_ANSWERS[name]
    assert exercises.check(name, ...).score == 0
    assert exercises.check(name, right).score == question.points
    slips = slips if slips is not None else _slip_answers(question)
    assert len(slips) >= 2
    for answer in slips:
        result = exercises.check(name, answer)
        assert 0.2 <= result.score / result.max_score <= 0.85, (answer, repr(result))
        missed = _missed(result)
        assert missed and missed != {line.key for line in question.rubric}
        _assert_named(result, missed)


def test_a_slip_earns_only_the_lines_it_gets_right_everywhere():
    """A formula equal to a slip at a few points but not on the whole grid earns nothing."""
    almost = lambda G, N: (G - 1) * N if G < 1000 else 0          # noqa: E731 - one rank's count, except at G = 1024
    assert exercises.check("traffic_naive", almost).score == 0
    assert exercises.check("traffic_naive", lambda G, N: (G - 1) * N).score == 0.5


def test_every_rubric_line_is_tested_by_the_hidden_cases():
    for exercise in registry.all_exercises(include_pending=True):
        if exercise.kind != "function":
            continue
        cases = grader_cases(exercise)
        families = [line for line in exercise.rubric if line.family]
        core = [c for c in cases if not any(line.family.test(c) for line in families)]
        assert core, exercise.name
        for line in families:
            assert any(line.family.test(c) for c in cases), (exercise.name, line.key)


def test_the_defaults_are_documented_in_one_place():
    """docs/rubric.toml is what --rubric-defaults prints, and reads back as the registry's own points."""
    path = ROOT / "docs" / "rubric.toml"
    assert path.read_text() == rubric_file.defaults_toml(), "run: python -m course_grader --rubric-defaults > docs/rubric.toml"
    weights = rubric_file.load_weights(path)
    assert weights == {e.name: {line.key: float(line.points) for line in e.rubric} for e in registry.all_exercises(include_pending=True)}


@pytest.mark.parametrize("text, message", [
    ("[ring]\nvalue = 1\n", "has no rubric line 'value'"),
    ("[rings]\nvalues = 1\n", "Did you mean 'ring'"),
    ("[ring]\nvalues = -1\n", "points must be a number >= 0"),
    ("[ring]\nvalues = true\n", "points must be a number >= 0"),
    ("ring = 3\n", "must be a table of line = points"),
    ("[ring\n", "not valid TOML"),
])
def test_a_rubric_file_that_cannot_be_used_says_why(tmp_path, text, message):
    path = tmp_path / "rubric.toml"
    path.write_text(text)
    with pytest.raises(rubric_file.RubricFileError, match=message):
        rubric_file.load_weights(path)


def test_a_json_rubric_file_reweights_the_result():
    import json
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"traffic_naive": {"per_rank": 3, "all_ranks": 1}}, f)
    weights = rubric_file.load_weights(f.name)
    slip = Result.of_question(registry.get("traffic_naive"), False, "one rank only", ("per_rank",),
                              weights["traffic_naive"])
    assert (slip.score, slip.max_score) == (3, 4)


def test_the_listing_says_what_each_exercise_forbids():
    from course_lib.exercises.tracing import forbidden_description

    for info in exercises.list():
        exercise = registry.get(info.name)
        if exercise.kind == "function":
            assert info.forbids == forbidden_description(exercise.forbidden) and "collectives" in info.forbids
            assert "forbids: " + info.forbids in repr(info)
        else:
            assert info.forbids == ""
    assert registry.get("average_gradients").forbids.endswith("course_lib.training (but not its helpers)")


def test_slips_are_well_formed():
    for exercise in registry.all_exercises(include_pending=True):
        keys = {line.key for line in exercise.rubric}
        for slip in getattr(exercise, "slips", ()):
            assert isinstance(slip, Slip) and set(slip.met) <= keys and set(slip.met) != keys
