"""The grader's cases: every function exercise's visible cases (course_lib's `exercise.cases()`) and the hidden ones.

The hidden cases are the instructor's: they are here, in course_grader, and nowhere in course_lib, which is all a
learner installs. Each exercise's list is built from its visible list, so the grader always runs every case the
learner's check runs, in the same order, with its own cases between and after them (`Case.hidden` is True on
those). The rules, one function per kind of exercise below (`RULES` says which exercise follows which):

    standard        G = 6 and 7 as well (the visible rule at those G); for every G > 1: tagged N = G - 1 (fewer
                    elements than ranks: one chunk is empty) after the random case, random N = 1 and N = 200 + G
                    (seeds 2 and 3) at the end. Rooted exercises (broadcast, parameter server) put the root at
                    G // 2 for N = G - 1 and N = 200 + G and at G - 1 for N = 1: a solution that always uses rank 0
                    or the last rank is caught.
    pass_token      G = 6 and 7 as well.
    training        G = 5..8 as well; at every G > 1 the other model (123 or 63 parameters) after the visible one.
    fit_alpha_beta  another exact and two more noisy timings, and a ping-pong measured over a modeled link.
    beat_the_ring   the standard hidden cases on both links, and the timed cases at G = 8 (the check times G = 4).
    hierarchical    G = 6 and 7 as well; N = G - 1 and N = 200 + G on the visible node size; tagged data on node
                    sizes 1, the smallest proper divisor of G and G itself, and on the largest size that leaves a
                    smaller last node; random data on the smallest such size; on one rank a node size of 2; a
                    timed case on 4 nodes of 2.

    from course_grader import check
    check("ring", ring)                 # course_lib's check with the grader's cases
    grader_cases("ring")                # the list itself: exercises.check("ring", ring, cases=...) runs it
"""

from __future__ import annotations

import dataclasses

from course_lib import exercises
from course_lib.exercises import capstone, hierarchical, registry
from course_lib.exercises.basics import pass_token_cases
from course_lib.exercises.cases import Case, standard_cases, standard_cases_at
from course_lib.exercises.training_step import training_cases

__all__ = ["check", "grader_cases", "HIDDEN_SIZES", "RULES"]

HIDDEN_SIZES = (6, 7)                       # world sizes only the grader runs (the check runs 1..5 and 8)
TRAINING_HIDDEN_SIZES = (5, 6, 7, 8)         # the training exercises' check runs G = 1..4


def check(name: str, answer):
    """course_lib's `exercises.check(name, answer)` with the grader's cases: the visible ones and the hidden ones.
    A question has no cases: it is checked as the learner's check does."""
    exercise = registry.get(name)
    cases = grader_cases(exercise) if exercise.kind == "function" else None
    return exercises.check(name, answer, cases=cases)


def grader_cases(exercise) -> list[Case]:
    """Every case the grader runs for the function exercise `exercise` (or the exercise of that name): its visible
    cases and the hidden ones."""
    if isinstance(exercise, str):
        exercise = registry.get(exercise)
    try:
        rule = RULES[exercise.name]
    except KeyError:
        raise KeyError(f"course_grader has no hidden cases for {exercise.name!r}: add its rule to "
                       "course_grader/hidden_cases.py's RULES") from None
    return rule(exercise.cases())


def _hidden(cases) -> list[Case]:
    return [dataclasses.replace(case, hidden=True) for case in cases]


def _by_world_size(cases) -> list[Case]:
    """`cases` ordered by G, each G's cases in the order they came (the visible ones first)."""
    return sorted(cases, key=lambda case: case.world_size)


# --------------------------------------------------------------------------------------------------
# The rules
# --------------------------------------------------------------------------------------------------


def standard(visible, rooted: bool = False) -> list[Case]:
    """The standard cases at G = 6 and 7 as well; for every G > 1 the three hidden lengths among them."""
    cases = _by_world_size(visible + _hidden(c for G in HIDDEN_SIZES for c in standard_cases_at(G, rooted)))
    out = []
    for G in sorted({case.world_size for case in cases}):
        out += _standard_at(G, [case for case in cases if case.world_size == G], rooted)
    return out


def _standard_at(G: int, cases: list, rooted: bool) -> list[Case]:
    """One world size's cases: the visible three (tagged 2G + 1, random 3G + 2, tagged 4G), with tagged N = G - 1
    after the random one and random N = 1 and N = 200 + G at the end."""
    if G == 1:
        return cases
    root = (lambda r: r) if rooted else (lambda r: None)
    odd, random, even = cases
    return [odd, random, Case(G, G - 1, "tagged", 0, root(G // 2), hidden=True), even,
            Case(G, 1, "random", 2, root(G - 1), hidden=True), Case(G, 200 + G, "random", 3, root(G // 2), hidden=True)]


def rooted(visible) -> list[Case]:
    """`standard` with the roots of rooted exercises."""
    return standard(visible, rooted=True)


def pass_token(visible) -> list[Case]:
    """The visible rule at G = 6 and 7 as well."""
    return _by_world_size(visible + _hidden(pass_token_cases(HIDDEN_SIZES)))


def training(visible) -> list[Case]:
    """The visible model at G = 5..8 as well; for every G > 1 the other model after it."""
    model = visible[0].data
    other = {"tagged": "random", "random": "tagged"}[model]
    cases = []
    for case in _by_world_size(visible + _hidden(training_cases(model, TRAINING_HIDDEN_SIZES))):
        cases.append(case)
        if case.world_size > 1:
            cases += _hidden(training_cases(other, (case.world_size,)))
    return cases


def fit_alpha_beta(visible) -> list[Case]:
    """After the visible timings: another exact one (seed 2: the third link), two more noisy ones on the
    bandwidth-bound link (seeds 7 and 10), and the ping-pong measured over a modeled link."""
    n = visible[0].numel
    return visible + _hidden([Case(1, n, "exact", 2), Case(1, n, "noisy", 7), Case(1, n, "noisy", 10),
                              Case(1, n, "measured", 0)])


def beat_the_ring(visible) -> list[Case]:
    """The standard hidden cases on both links, and the timed cases at the other world sizes (G = 8)."""
    small = [case for case in standard(standard_cases()) if case.hidden]
    return capstone.in_check_order(visible + capstone.on_every_link(small)
                                   + _hidden(capstone.timed_cases(capstone.WORLD_SIZES[1:])))


def hierarchical_allreduce(visible) -> list[Case]:
    """The visible rule at G = 6 and 7 as well; for every G the node sizes and lengths of `_hierarchical_at`; a timed
    case on 4 nodes of 2."""
    extra = _hidden(hierarchical.hierarchical_cases(HIDDEN_SIZES))
    for G in sorted({case.world_size for case in visible + extra if case.data != "timed"}):
        extra += _hierarchical_at(G)
    extra.append(dataclasses.replace(hierarchical.timed_case(8, 2), hidden=True))
    return hierarchical.in_check_order(visible + extra)


def _hierarchical_at(G: int) -> list[Case]:
    """The hidden cases of G ranks beyond the visible rule's: on one rank a node size of 2; for G > 1, on the visible
    node size that divides G, tagged N = G - 1 and random N = 200 + G; tagged data on the other node sizes that
    divide G (1, the smallest proper divisor when it is not the largest, G itself when a proper one exists); random
    data on the visible partial node size, and tagged on the largest partial one."""
    if G == 1:
        return _hidden([Case(1, 3, "tagged", 0, 2)])
    sizes = hierarchical.node_sizes_for(G)
    main = sizes["divides"][0]
    proper = [K for K in range(2, G) if G % K == 0]
    others = [K for K in dict.fromkeys([1] + proper[:1] + ([G] if proper else [])) if K != main]
    even = hierarchical.even_numel
    cases = [Case(G, G - 1, "tagged", 0, main), Case(G, 200 + G, "random", 3, main)]
    cases += [Case(G, even(G, K, 2), "tagged", 0, K) for K in others]
    partial = [K for K in range(2, G) if G % K]
    if partial:
        cases.append(Case(G, even(G, partial[0], 4), "random", 4, partial[0]))
        if partial[-1] != partial[0]:
            cases.append(Case(G, even(G, partial[-1], 2), "tagged", 0, partial[-1]))
    return _hidden(cases)


RULES = {
    "pass_token": pass_token, "broadcast": rooted, "all_gather": standard,
    "naive": standard, "parameter_server": rooted,
    "ring_scatter_reduce": standard, "ring_all_gather": standard, "ring": standard,
    "average_gradients": training, "ring_hook": training,
    "fit_alpha_beta": fit_alpha_beta,
    "tree": standard, "halving_doubling": standard, "overlapped_buckets": training, "zero1_step": training,
    "beat_the_ring": beat_the_ring,
    "hierarchical_allreduce": hierarchical_allreduce,
}
