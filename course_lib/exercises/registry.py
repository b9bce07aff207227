"""What an exercise is: a name, a notebook, points, and either cases to run on ranks or a question.

Two kinds:

* `FunctionExercise`: the learner writes an SPMD function (``ring_scatter_reduce(tensor) -> int``).
  It is run on real ranks for every `Case` (a world size, a length, tagged or random data, a root),
  and judged from what came back *and* from the messages it sent.
* `Question` (see `questions.py`): the learner gives a number, a letter, or a formula in G and N.

Every exercise registers itself under its name when its module is imported; `get(name)` finds it.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

__all__ = ["Case", "Problem", "Exercise", "FunctionExercise", "register", "get", "all_exercises"]


@dataclass(frozen=True)
class Case:
    """One run of a learner's function on `world_size` ranks.

    Attributes:
        world_size: G, the number of ranks.
        numel: N, elements per rank.
        data: 'tagged' (every value says which ranks and which chunk it came from, see
            `course_lib.viz.tag`: exact, readable feedback) or 'random' (floats like a gradient,
            compared with a tolerance for summation order).
        seed: varies the random data.
        root: src / root for rooted exercises, else None.
        hidden: a case only the grader runs (``check(..., hidden=True)``).
    """

    world_size: int
    numel: int
    data: str = "tagged"
    seed: int = 0
    root: int | None = None
    hidden: bool = False

    def label(self, root_name: str = "root") -> str:
        text = f"G={self.world_size}, N={self.numel}, {self.data}"
        if self.root is not None:
            text += f", {root_name}={self.root}"
        return text


@dataclass
class Problem:
    """One thing that went wrong in a case, in the learner's terms.

    Attributes:
        message: the sentence shown to the learner.
        order: sort key, earliest first: (phase, step, rank, ...); the first problem is the one shown.
        step, phase: where in the schedule it happened, for the picture (None when not a step).
    """

    message: str
    order: tuple = (0,)
    step: int | None = None
    phase: str | None = None


@dataclass
class Exercise:
    """Base of both kinds.

    Attributes:
        name: what `check` is called with.
        notebook: the notebook the exercise belongs to ('04_ring_scatter_reduce').
        points: the exercise's maximum score, spread evenly over its cases.
        signature: what the learner writes, e.g. 'ring_scatter_reduce(tensor) -> int'.
        summary: one line: what it must do.
        answer_name: the name the learner's answer has in the notebook (the grader looks it up);
            by default the exercise's name.
    """

    name: str
    notebook: str
    points: float
    signature: str
    summary: str
    answer_name: str = ""
    kind: str = field(default="function", init=False)

    def __post_init__(self):
        self.answer_name = self.answer_name or self.name


@dataclass
class FunctionExercise(Exercise):
    """An SPMD function the learner writes; subclasses define the cases and how to judge them.

    Subclasses implement:
        cases(hidden) -> list[Case]    (optional: by default `cases.standard_cases(hidden)`)
        run_case(call, case, rank, world_size) -> dict     (on each rank)
            Build this rank's inputs, compute the built-in's answer, call the learner's function
            through ``call(...)`` (traced), and return what the parent needs to judge.
        judge(case, records, complete=True) -> list[Problem]   (in the notebook process)
            `records[r]` is rank r's dict from run_case, plus 'messages' (what it sent and
            received, see `tracing.Message`). With complete=False (the case hung) only the
            messages of the ranks are there: report only what those show.
        checks: lines saying what is checked, for the report.
        root_name: what the case's root is called in labels ('src', 'root').
        forbidden: course_lib modules the learner must not call.
    """

    checks: tuple = ()
    root_name: str = "root"
    forbidden: tuple = ("collectives", "allreduce")
    ring_picture: bool = False  # draw the failing step of a ring schedule

    def cases(self, hidden: bool = False) -> list[Case]:
        """The usual cases (world sizes, lengths, tagged and random data); exercises that need roots or
        other sizes override this."""
        from course_lib.exercises.cases import standard_cases  # cases.py imports this module's Case
        return standard_cases(hidden)

    def run_case(self, call, case: Case, rank: int, world_size: int) -> dict:  # pragma: no cover - abstract
        raise NotImplementedError

    def judge(self, case: Case, records: list, complete: bool = True) -> list[Problem]:  # pragma: no cover
        raise NotImplementedError


_REGISTRY: dict[str, Exercise] = {}


def register(exercise: Exercise) -> Exercise:
    if exercise.name in _REGISTRY:
        raise ValueError(f"two exercises are called {exercise.name!r}")
    _REGISTRY[exercise.name] = exercise
    return exercise


def get(name: str) -> Exercise:
    """The exercise called `name`; a clear error (with the closest names) if there is none."""
    _load_all()
    if not isinstance(name, str):
        raise TypeError(f"exercise names are strings, got {type(name).__name__}: call check('ring', ring)")
    try:
        return _REGISTRY[name]
    except KeyError:
        close = difflib.get_close_matches(name, list(_REGISTRY), n=3)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(f"there is no exercise called {name!r}.{hint} exercises.list() shows them all.") from None


def all_exercises() -> list[Exercise]:
    """Every exercise, in notebook order."""
    _load_all()
    return sorted(_REGISTRY.values(), key=lambda e: (e.notebook, _ORDER.index(e.name) if e.name in _ORDER else 99))


# The order the exercises come in within their notebooks.
_ORDER = ["pass_token", "batch_size_quiz", "batches_per_epoch", "batch_per_gpu", "shard_weights",
          "broadcast", "all_gather", "naive", "parameter_server", "traffic_naive", "traffic_naive_per_rank",
          "traffic_parameter_server", "traffic_parameter_server_root", "naive_vs_master_ranks",
          "ring_scatter_reduce", "ring_all_gather", "ring", "traffic_ring", "traffic_ring_per_rank",
          "ring_steps", "average_gradients"]


def _load_all() -> None:
    # The exercise modules register themselves on import.
    from course_lib.exercises import allreduce_variants, basics, questions, ring, training_step  # noqa: F401
