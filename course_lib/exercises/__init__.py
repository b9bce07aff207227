"""Exercises: the learner writes the algorithm, the check runs it on real ranks and says what went wrong.

    from course_lib import exercises
    result = exercises.check("ring_scatter_reduce", ring_scatter_reduce)   # runs it on 1..8 ranks
    result.score, result.max_score, result.passed, result.feedback
    exercises.list()                                                       # every exercise

`check(name, answer)` returns a `Result`: in a notebook it shows as a report (the
first problem, in the learner's terms, read from what the ranks really sent; the rubric, each line met or
missed with its points; a table of the cases; for the ring a picture of the step that went wrong); its text
form is short and stable. Points are split over rubric lines (the schedule, the values, the return value,
uneven lengths, ...: `rubric.py`), so code with one systematic slip keeps the points of what it got right.
The cases it runs are the exercise's visible ones (`Exercise.cases()`). The grader's hidden cases (more world
sizes, lengths, roots, seeds) are not in course_lib: they are the instructor's, in the `course_grader` package
(``course_grader.check(name, answer)`` runs them with the visible ones).

`check` runs everything in the learner's own process: it is for learning. Grading
(``python -m course_grader``) runs the learner's code in a sandbox and judges the data that comes
back in a process that never ran it (see course_grader/).

Function exercises (the learner writes an SPMD function; `answer` is that function):

    name                 notebook  signature                           what it must do
    pass_token           00        pass_token(token) -> list           pass a 1-D tensor to the right G-1 times,
                                                                       passing on what arrived; return the G
                                                                       tokens held, own first
    broadcast            02        broadcast(tensor, src=0)            every rank gets src's tensor, in place
    all_gather           02        all_gather(tensor_list, tensor)     tensor_list[j] = rank j's tensor
    naive                03        naive(tensor)                       all-reduce (sum) by full exchange
    parameter_server     03        parameter_server(tensor, root=0)    all-reduce (sum) through `root`
    ring_scatter_reduce  04        ring_scatter_reduce(tensor) -> int  step k: rank r sends chunk (r-k) mod G
                                                                       to r+1, adds what arrives; returns
                                                                       (r+1) mod G
    ring_all_gather      05        ring_all_gather(tensor)             step k: rank r sends chunk (r+1-k) mod G
                                                                       to r+1, the receiver overwrites
    ring                 05        ring(tensor)                        the two phases: the whole all-reduce
    average_gradients    07        average_gradients(model)            after backward: every .grad becomes the
                                                                       mean over the ranks
    ring_hook            09        ring_hook(state, bucket) -> Future  DDP communication hook: average the bucket
                                                                       with your own ring; DDP then trains like
                                                                       one process
    fit_alpha_beta       10        fit_alpha_beta(sizes, times)        (alpha, beta) of t = alpha + beta n, least
                                                                       squares weighted by relative error
    tree                 11        tree(tensor)                        binomial-tree reduce to rank 0, then the
                                                                       sum back down the same tree
    halving_doubling     11        halving_doubling(tensor)            recursive halving (partner r XOR d), then
                                                                       doubling back; fold when G != 2^m
    overlapped_buckets   11        overlapped_buckets(buckets,         gradient hooks start each bucket's
                                   start_allreduce) -> finish          all-reduce when it is ready; finish()
                                                                       waits, before the step
    zero1_step           11        zero1_step(flat_params, momentum)   ZeRO-1: reduce-scatter, update your shard
                                   -> (step, state)                    (its momentum only), all-gather
    beat_the_ring        11        beat_the_ring(tensor, link)         the capstone: any all-reduce, timed on two
                                                                       modeled links, scored per size against
                                                                       the best of four schedules
    hierarchical_allreduce 13      hierarchical_allreduce(tensor,      reduce-scatter inside each node, ring
                                   node_size)                          all-reduce of the shard across the nodes
                                                                       on its rail, all-gather inside; a smaller
                                                                       last node folds in; timed on two clusters

Tensors are 1-D float32, results in place, rank and world size from ``torch.distributed``, sum only;
chunks are ``torch.tensor_split(tensor, G)``. Use `course_lib.p2p` or torch.distributed's own
send / recv / isend / irecv; chunk labels are optional, the check reads the data. Calling a built-in
collective (``dist.all_reduce``, ``broadcast``, ``all_gather``, ``batch_isend_irecv``, ...) scores 0 for
that case in every exercise; so does course_lib's own implementation where the exercise is to write it:
`course_lib.collectives`, `course_lib.allreduce` and `course_lib.fast_allreduce` for all but
average_gradients, `course_lib.training` for average_gradients (which may use the all-reduces).
`exercises.list()` says it per exercise.

Questions (`answer` is a value, or a function of G and N for a formula):

    batch_size_quiz                01  "A", "B" or "C": the 4-GPU quiz
    batches_per_epoch              01  a number: 128 samples, 16 per GPU, 8 GPUs
    batch_per_gpu                  01  a number: effective batch 256 on 8 GPUs
    shard_weights                  01  two numbers: averaging weights for shards of 10 and 30 samples
    traffic_naive                  03  formula: elements all ranks send, naive exchange      G(G-1)N
    traffic_naive_per_rank         03  formula: elements one rank sends, naive exchange
    traffic_parameter_server       03  formula: elements all ranks send, parameter server
    traffic_parameter_server_root  03  formula: elements that leave the root
    naive_vs_master_ranks          03  a number: from how many ranks the naive sends >= 10x the master
    traffic_ring                   06  formula: elements all ranks send, ring
    traffic_ring_per_rank          06  formula: elements one rank sends, ring (N divisible by G)
    ring_steps                     06  formula: steps of the ring all-reduce
    straggler_staleness            08  a number: mean staleness of the straggler's gradients in a recorded run
    stable_step_size               08  a number: the largest stable step size for staleness s and curvature λ

A formula is a string such as "G*(G-1)*N" (also "G(G-1)N", "2(G-1)N/G"; parsed with `ast`, never
executed) or a Python function ``lambda G, N: ...``.

An answer not written yet (a function that raises NotImplementedError, as the student notebooks
have it, or ``...``) scores 0 with "not done yet", never an error. Whatever the learner's code does
(raise, deadlock, loop forever, print megabytes), a check ends within about 60 s with feedback, and
leaves no process behind; a deadlock is found and explained about a second into its case.
"""

from __future__ import annotations

import builtins
from dataclasses import dataclass

from course_lib.exercises import registry, runner
from course_lib.exercises.report import Result, format_points
# Every exercise registers itself when its module is imported; importing the package imports them all, so
# `registry.get` and `registry.all_exercises` know every exercise, whoever imported the registry first.
from course_lib.exercises import (allreduce_variants, basics, capstone, ddp_hook, fast_variants,  # noqa: F401
                                  fitting, hierarchical, overlap_zero, questions, ring, stale_questions,
                                  training_step)

__all__ = ["check", "list", "list_exercises", "Result", "ExerciseInfo"]

QUESTION_NOT_DONE = "not done yet: give your answer in the cell above, then run the check."


HIDDEN_CASES_MOVED = (
    "check({name!r}, ..., hidden=True): the hidden cases are the instructor's, and they are not in course_lib any "
    "more: they live in the grader's own package, course_grader (installed from a clone of the course's repository "
    "with `python -m pip install -e ./course_grader`, see README.md, 'Teaching with it'). Call "
    "exercises.check({name!r}, {answer}) for the visible cases; where course_grader can be imported, "
    "`from course_grader import check` and check({name!r}, {answer}) runs its hidden cases as well.")


def check(name: str, answer, *, cases=None, hidden: bool = False) -> Result:
    """Check the learner's `answer` to exercise `name`.

    Args:
        name: the exercise (see `list()`).
        answer: for a function exercise, the learner's function; for a question, the answer (a number,
            a letter, a formula string, or a function of G and N).
        cases: the cases to run (function exercises only); default the exercise's visible cases,
            `registry.get(name).cases()`. The grader passes its own (`course_grader.check`); the report says
            "hidden cases included" when one of them is a hidden case.
        hidden: only False, what older notebooks pass; True is an error that says where the hidden cases went.

    Returns:
        A `Result`: ``.score``, ``.max_score``, ``.passed``, ``.feedback``; shown as a report in a notebook.

    Example::

        >>> def ring_scatter_reduce(tensor):
        ...     raise NotImplementedError("your code here")
        >>> exercises.check("ring_scatter_reduce", ring_scatter_reduce).score
        0.0
    """
    exercise = registry.get(name)
    if hidden:
        raise ValueError(HIDDEN_CASES_MOVED.format(name=name, answer=exercise.answer_name))
    if cases is not None and exercise.kind != "function":
        raise TypeError(f"check({name!r}, ..., cases=...): {name} is a question, it has no cases to run")
    if exercise.kind == "question":
        try:
            if callable(answer) and exercise.answer_kind != "formula":
                answer = answer()
            right, message, met = exercise.assess(answer)
        except NotImplementedError:
            return Result.not_done(exercise, QUESTION_NOT_DONE)
        return Result.of_question(exercise, right, message, met)
    if answer is None or answer is Ellipsis:
        return Result.not_done(exercise, runner.feedback.NOT_DONE.format(function=exercise.answer_name))
    if not callable(answer):
        raise TypeError(f"check({name!r}, ...) needs your function {exercise.signature}, not a "
                        f"{type(answer).__name__}: pass the function itself, without calling it.")
    cases = exercise.cases() if cases is None else builtins.list(cases)   # `list` here is list_exercises
    outcome = runner.run_function(exercise, answer, cases=cases)
    if outcome.not_done is not None:
        return Result.not_done(exercise, outcome.not_done)
    return Result.of_cases(exercise, outcome.cases, hidden=any(case.hidden for case in cases))


@dataclass(frozen=True)
class ExerciseInfo:
    """One line of `list()`: the exercise, its points, and what calling scores 0 (`forbids`, '' for questions)."""

    name: str
    notebook: str
    points: float
    kind: str
    signature: str
    summary: str
    forbids: str = ""
    rubric: tuple = ()
    pending: bool = False   # checkable, but its cells are not in the notebook yet (not graded with it)

    def __repr__(self) -> str:
        text = f"{self.notebook[:2]}  {self.name:<30} {format_points(self.points):>4} pt  {self.signature}"
        text += f"\n{'':<36}(not in the notebook yet)" if self.pending else ""
        return text + (f"\n{'':<36}forbids: {self.forbids}" if self.forbids else "")


class _Listing(builtins.list):
    def __repr__(self) -> str:
        return "\n".join(repr(info) for info in self)


def list_exercises(notebook: str | None = None) -> builtins.list:
    """Every exercise (name, notebook, points, kind, signature, summary), in course order.

    Args:
        notebook: only this notebook's ('04', or '04_ring_scatter_reduce').
    """
    infos = [ExerciseInfo(e.name, e.notebook, e.points, e.kind, e.signature, e.summary, e.forbids,
                          tuple((line.key, line.points, line.text) for line in e.rubric), registry.is_pending(e))
             for e in registry.all_exercises(include_pending=True)
             if notebook is None or e.notebook.startswith(str(notebook))]
    return _Listing(infos)


list = list_exercises  # noqa: A001 - exercises.list() reads well; builtins.list is used above
