"""What an exercise is: a name, a notebook, rubric lines worth points, and either cases to run on ranks
or a question.

Two kinds:

* `FunctionExercise`: the learner writes an SPMD function (``ring_scatter_reduce(tensor) -> int``).
  It is run on real ranks for every `Case` (a world size, a length, tagged or random data, a root),
  and judged from what came back *and* from the messages it sent.
* `Question` (see `questions.py`): the learner gives a number, a letter, or a formula in G and N.

A function exercise is split along the line a grader must not cross (see docs/architecture.md):

    judge side (never runs the learner's code)        rank side (the learner's processes)
    cases()              which cases run               run_case(call, case, rank, G, inputs)
    inputs(case)         every rank's input data          builds the arguments from `inputs`,
    oracle(case, inputs) what each rank must end with     calls the learner's function, returns
    judge(case, records) the problems, each tagged        what it produced (only the keys named
                         with the rubric line it costs    in `observed`)

Every exercise registers itself under its name when its module is imported (`course_lib.exercises`
imports them all, so any import of this module has them); `get(name)` finds it.
A new exercise registers rubric lines the same way the course's do:

    register(MyExercise(name="tree_reduce", notebook="09_trees", points=10,
                        signature="tree_reduce(tensor, root=0) -> None", summary="...",
                        rubric=(RubricLine("messages", "...", 4), RubricLine("values", "...", 4),
                                RubricLine("uneven", "...", 2, family=UNEVEN_LENGTHS))))

and tags each `Problem` its `judge` finds with the line it costs (``Problem(text, line="values")``).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import ClassVar

from course_lib.exercises.cases import Case, standard_cases
from course_lib.exercises.rubric import RubricLine, single_line

__all__ = ["Case", "Problem", "Exercise", "FunctionExercise", "RubricLine", "register", "get", "all_exercises",
           "is_pending", "PENDING_NOTEBOOKS"]


@dataclass
class Problem:
    """One thing that went wrong in a case, in the learner's terms.

    Attributes:
        message: the sentence shown to the learner.
        order: sort key, earliest first: (phase, step, rank, ...); the first problem is the one shown.
        step, phase: where in the schedule it happened, for the picture (None when not a step).
        line: the key of the rubric line this problem costs; None costs every line the case tests
            (an exception, a hang, a result no message explains).
    """

    message: str
    order: tuple = (0,)
    step: int | None = None
    phase: str | None = None
    line: str | None = None


@dataclass
class Exercise:
    """Base of both kinds.

    Attributes:
        name: what `check` is called with.
        notebook: the notebook the exercise belongs to ('04_ring_scatter_reduce').
        points: the exercise's maximum score: the sum of its rubric lines' points.
        signature: what the learner writes, e.g. 'ring_scatter_reduce(tensor) -> int'.
        summary: one line: what it must do.
        answer_name: the name the learner's answer has in the notebook (the grader looks it up);
            by default the exercise's name.
        rubric: the lines the points are split over (`rubric.RubricLine`); an exercise registered
            without any gets one line, "every case passes", worth all its points.
        checks: for an exercise without a rubric, what is checked, one line each (shown, not scored);
            with a rubric, the lines' texts.
    """

    name: str
    notebook: str
    points: float
    signature: str
    summary: str
    answer_name: str = ""
    rubric: tuple = ()
    checks: tuple = ()
    kind: str = field(default="function", init=False)

    def __post_init__(self):
        self.answer_name = self.answer_name or self.name
        if not self.rubric:
            self.rubric = (single_line(self.points),)
        else:
            self.checks = tuple(line.text for line in self.rubric)
        total = sum(line.points for line in self.rubric)
        if abs(total - self.points) > 1e-9:
            raise ValueError(f"exercise {self.name!r}: its rubric lines add up to {total:g} points, not {self.points:g}")
        if len({line.key for line in self.rubric}) != len(self.rubric):
            raise ValueError(f"exercise {self.name!r}: two rubric lines have the same key")

    @property
    def forbids(self) -> str:
        """What calling scores 0, in words (`exercises.list()` and the README show it)."""
        return ""


@dataclass
class FunctionExercise(Exercise):
    """An SPMD function the learner writes; subclasses define the cases and how to judge them.

    Subclasses implement (judge side: computed where the grader runs, never from what a rank says):
        cases() -> list[Case]    (optional: by default `cases.standard_cases()`)
            The cases the learner's check runs. The grader runs more (course_grader's hidden cases),
            built from these: course_lib has no hidden case.
        inputs(case) -> list           (optional: by default one tensor per rank, `data.make_input`)
            Rank r's input for the case; it travels to the ranks as data.
        oracle(case, inputs) -> list[dict]   (optional: by default the all-reduce's: start, expected, abs_sum)
            What the judge needs to know about rank r beyond what it produced: its input, the result
            it must end with. Merged over the rank's record (the oracle's keys win).
        judge(case, records, complete=True) -> list[Problem]
            `records[r]` holds rank r's `observed` keys, 'messages' (what it sent and received, see
            `tracing.Message`) and the oracle's keys. With complete=False (the case hung) only the
            messages of the ranks are there: report only what those show. Tag each Problem with
            the rubric line it costs.
    and (rank side: the learner's processes):
        run_case(call, case, rank, world_size, inputs) -> dict
            Build the arguments from `inputs` (this rank's), call the learner's function through
            ``call(...)`` (traced) and return what it produced: only the keys named in `observed`
            come back to the judge.

    Attributes:
        observed: the keys of run_case's record the judge reads (anything else is dropped).
        root_name: what the case's root is called in labels ('src', 'root').
        forbidden: course_lib modules the learner must not call (built-in collectives are always refused).
    """

    root_name: str = "root"
    forbidden: tuple = ("collectives", "allreduce", "fast_allreduce")
    observed: ClassVar[tuple] = ("after", "returned")   # a class attribute: subclasses set their own
    ring_picture: bool = False  # draw the failing step of a ring schedule
    time_factor: float = 1.0    # the case timeout and the check's budget are multiplied by this (large tensors)

    def tracer_options(self, case: Case) -> dict:
        """Extra `tracing.Tracer` arguments for `case` (the capstone keeps only message sizes for its large cases)."""
        return {}

    def report_lines(self, case_results) -> list:
        """Lines the report adds after the verdict (the capstone's table of where the time went); none by default."""
        return []

    def cases(self) -> list[Case]:
        """The check's cases: the standard ones (world sizes, lengths, tagged and random data); exercises that
        need roots or other sizes override this."""
        return standard_cases()

    def inputs(self, case: Case) -> list:
        """Every rank's input tensor for `case` (tagged or seeded random data, see `data.make_input`)."""
        from course_lib.exercises import data
        return [data.make_input(case, rank) for rank in range(case.world_size)]

    def oracle(self, case: Case, inputs: list) -> list[dict]:
        """What an all-reduce (sum) leaves on every rank: start, expected, and abs_sum for the float tolerance."""
        from course_lib.exercises import data
        return data.all_reduce_oracle(inputs)

    def run_case(self, call, case: Case, rank: int, world_size: int, inputs) -> dict:  # pragma: no cover
        raise NotImplementedError

    def judge(self, case: Case, records: list, complete: bool = True) -> list[Problem]:  # pragma: no cover
        raise NotImplementedError

    @property
    def forbids(self) -> str:
        from course_lib.exercises.tracing import forbidden_description
        return forbidden_description(self.forbidden)


_REGISTRY: dict[str, Exercise] = {}


def register(exercise: Exercise) -> Exercise:
    if exercise.name in _REGISTRY:
        raise ValueError(f"two exercises are called {exercise.name!r}")
    _REGISTRY[exercise.name] = exercise
    return exercise


def get(name: str) -> Exercise:
    """The exercise called `name`; a clear error (with the closest names) if there is none."""
    if not isinstance(name, str):
        raise TypeError(f"exercise names are strings, got {type(name).__name__}: call check('ring', ring)")
    try:
        return _REGISTRY[name]
    except KeyError:
        close = difflib.get_close_matches(name, list(_REGISTRY), n=3)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(f"there is no exercise called {name!r}.{hint} exercises.list() shows them all.") from None


# Notebooks whose exercises are written and checkable (`get`, `exercises.check`, the rubric file) but whose
# exercise and check cells are not placed in the notebook yet. Grading, the student copies and the README's
# assignment table leave their exercises out until the notebook is taken off this list.
PENDING_NOTEBOOKS: frozenset = frozenset()   # every notebook's exercises are placed


def all_exercises(include_pending: bool = False) -> list[Exercise]:
    """Every exercise, in notebook order; with `include_pending`, also those whose notebook has no cells for them
    yet (`PENDING_NOTEBOOKS`)."""
    return sorted((e for e in _REGISTRY.values() if include_pending or e.notebook not in PENDING_NOTEBOOKS),
                  key=lambda e: (e.notebook, _ORDER.index(e.name) if e.name in _ORDER else 99))


def is_pending(exercise: Exercise) -> bool:
    """True for an exercise whose notebook does not have its cells yet."""
    return exercise.notebook in PENDING_NOTEBOOKS


# The order the exercises come in within their notebooks.
_ORDER = ["pass_token", "batch_size_quiz", "batches_per_epoch", "batch_per_gpu", "shard_weights",
          "broadcast", "all_gather", "naive", "parameter_server", "traffic_naive", "traffic_naive_per_rank",
          "traffic_parameter_server", "traffic_parameter_server_root", "naive_vs_master_ranks",
          "ring_scatter_reduce", "ring_all_gather", "ring", "traffic_ring", "traffic_ring_per_rank",
          "ring_steps", "average_gradients", "straggler_staleness", "stable_step_size", "ring_hook",
          "fit_alpha_beta", "tree", "halving_doubling", "overlapped_buckets", "zero1_step", "beat_the_ring"]
