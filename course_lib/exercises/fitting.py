"""Notebook 10: fit the alpha-beta model to measured times.

    fit_alpha_beta(sizes, times) -> (alpha, beta)

`sizes[i]` is a message's size in bytes and `times[i]` the seconds one message of that size took (lists of
floats, same length). The model is

    t(S) = alpha + beta S          alpha: seconds per message (latency), beta: seconds per byte (1 / bandwidth)

and the exercise asks for the least-squares fit **weighted by relative error**: minimise

    sum_i ((alpha + beta S_i - t_i) / t_i)^2

i.e. divide every row of X = [1, S_i] and t_i by t_i and solve with `numpy.linalg.lstsq` (as `cost.fit` does).
Why not plain least squares: the sizes span 4 KiB to 64 MiB, so the times span 5 ms to 70 ms and more. Plain
least squares minimises absolute errors, which the largest messages dominate: 1% noise on a 70 ms point is
0.7 ms, and the fit moves alpha by that much to absorb it. Weighted by 1/t_i every point counts as much as
every other, and alpha comes from the small messages, where it is the whole time.

Cases (one rank: the function does arithmetic, no messages):
    exact      timings straight from the model (any correct least squares recovers alpha and beta exactly)
    noisy      the model times (1 + e), e ~ 2% seeded noise, on the bandwidth-bound link (20 us, 100 MB/s)
    measured   (the grader's cases only) a ping-pong over course_lib.Network("1 GB/s", "5 ms") (5 ms and 1e-9 s/B), recorded on
               this machine's clock (time.perf_counter) by an earlier course_lib whose link slept until each
               message was due: this machine's own cost per message and its noise are in the times (today's
               modeled clock would give a + S/B exactly, with nothing to test the weighting on)

Every timing, the reference fit and the slips' values are computed on the judge's side; the ranks only
return the two numbers. `course_lib.cost` is off limits (its `fit` is the answer).
"""

from __future__ import annotations

import math

import numpy as np

from course_lib.exercises.registry import Case, FunctionExercise, Problem, register
from course_lib.exercises.rubric import Family, RubricLine

__all__ = ["FitAlphaBeta", "relative_fit", "plain_fit", "MEASURED", "LINKS"]

SIZES = tuple(4096 * 4 ** k for k in range(8))          # 4 KiB, 16 KiB, ..., 64 MiB
# (latency s, bandwidth B/s): a latency-bound link (5 ms, 1 GB/s) and a bandwidth-bound one (20 us, 100 MB/s)
LINKS = ((5e-3, 1e9), (20e-6, 100e6), (150e-6, 12.5e9))
# One-way times (half a round trip, median of 5) of a ping-pong between two ranks over
# course_lib.Network("1 GB/s", "5 ms") on this machine, after two warm-up messages: sizes 4 KiB .. 64 MiB. Recorded
# with time.perf_counter by the course_lib before the modeled clock, whose link slept until each message was due, so
# they carry this machine's cost per message (0.09 to 0.15 ms above 5 ms + S/B at every size) and its noise; kept.
MEASURED = (0.005122833999848808, 0.005153499500011094, 0.005180364500120049, 0.005353247001039563,
            0.0061727445008727955, 0.00932229749923863, 0.02191679799943813, 0.07225363799989282)
MEASURED_LINK = (5e-3, 1e9)
TOLERANCE = 0.02          # 2% on each parameter (noisy cases); exact cases must be within 0.1%

NOISY = Family("noisy timings (2% noise; a run measured over a modeled link)",
               lambda case: case.data in ("noisy", "measured"))


def _design(sizes, times, weighted: bool):
    X = np.column_stack([np.ones(len(sizes)), np.asarray(sizes, dtype=float)])
    t = np.asarray(times, dtype=float)
    w = 1 / t if weighted else np.ones_like(t)
    scale = np.array([1.0, float(np.max(sizes))])        # columns of ~1 and ~1e7: scaled for a stable solve
    return X * w[:, None] / scale, t * w, scale


def relative_fit(sizes, times) -> tuple[float, float]:
    """(alpha, beta) minimising sum ((alpha + beta S - t) / t)^2: the answer."""
    X, t, scale = _design(sizes, times, weighted=True)
    solution, *_ = np.linalg.lstsq(X, t, rcond=None)
    alpha, beta = solution / scale
    return float(alpha), float(beta)


def plain_fit(sizes, times) -> tuple[float, float]:
    """(alpha, beta) of ordinary least squares, sum (alpha + beta S - t)^2: the usual slip."""
    X, t, scale = _design(sizes, times, weighted=False)
    solution, *_ = np.linalg.lstsq(X, t, rcond=None)
    alpha, beta = solution / scale
    return float(alpha), float(beta)


def _timings(case) -> tuple[list, list]:
    """The case's sizes and times, made here (never by the ranks)."""
    if case.data == "measured":
        return list(map(float, SIZES)), list(MEASURED)
    latency, bandwidth = LINKS[case.seed % len(LINKS)]
    sizes = [float(n) for n in SIZES]
    times = [latency + n / bandwidth for n in sizes]
    if case.data == "noisy":
        rng = np.random.default_rng(7919 * case.seed + 17)
        spread = 0.01 + 0.01 * (case.seed % 3)
        times = [t * (1 + float(e)) for t, e in zip(times, rng.normal(0, spread, len(times)))]
    return sizes, times


def _relative_gap(value, want) -> float:
    return abs(value - want) / abs(want) if want else abs(value)


def _seconds(value) -> str:
    for unit, size in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9)):
        if abs(value) >= size:
            return f"{value / size:.4g} {unit}"
    return f"{value:.3g} s"


def _per_byte(value) -> str:
    return f"{value:.4g} s/B" + (f" (1/beta = {1 / value / 1e6:.4g} MB/s)" if value > 0 else "")


# Unit slips: (factor the learner's value is off by, what it looks like). alpha in ms or us; beta per kB, MB, GB,
# KiB, MiB, or a bandwidth in B/s, MB/s, GB/s instead of seconds per byte.
_ALPHA_UNITS = ((1e3, "milliseconds"), (1e6, "microseconds"))
_BETA_UNITS = ((1e3, "seconds per kB"), (1e6, "seconds per MB"), (1e9, "seconds per GB"),
               (2.0 ** 10, "seconds per KiB"), (2.0 ** 20, "seconds per MiB"))


def _read_back(alpha, beta, want_alpha, want_beta, tol):
    """What the learner's two numbers are, if they are the fit in another order or unit: (alpha, beta, slip text)."""
    close = lambda value, want: _relative_gap(value, want) <= tol  # noqa: E731
    if close(alpha, want_alpha) and close(beta, want_beta):
        return alpha, beta, None
    if close(beta, want_alpha) and close(alpha, want_beta):
        return beta, alpha, ("the two values are swapped: return (alpha, beta), alpha first (seconds per message, "
                             f"about {_seconds(want_alpha)} here), then beta (seconds per byte, about {want_beta:.3g}).")
    if beta > 0 and close(1 / beta, want_beta) and close(alpha, want_alpha):
        return alpha, 1 / beta, (f"beta = {beta:.4g} is a bandwidth (bytes per second), 1/beta: return beta in seconds "
                                 f"per byte, {want_beta:.4g}.")
    for factor, unit in _ALPHA_UNITS:
        if close(alpha / factor, want_alpha) and close(beta, want_beta):
            return alpha / factor, beta, (f"alpha = {alpha:.4g} is in {unit}: return it in seconds "
                                          f"({want_alpha:.4g} s).")
    for factor, unit in _BETA_UNITS:
        if close(beta / factor, want_beta) and close(alpha, want_alpha):
            return alpha, beta / factor, (f"beta = {beta:.4g} is in {unit}: the sizes are bytes, so beta is seconds "
                                          f"per byte ({want_beta:.4g}).")
    return alpha, beta, None


class FitAlphaBeta(FunctionExercise):
    observed = ("returned",)

    def cases(self):
        # seed picks the link (seed mod 3) and the noise; the noisy cases are on the bandwidth-bound link, where the
        # largest messages' noise is far larger than alpha (on the others plain least squares comes out near right)
        return [Case(1, len(SIZES), "exact", 0), Case(1, len(SIZES), "exact", 1),
                Case(1, len(SIZES), "noisy", 1), Case(1, len(SIZES), "noisy", 4)]

    def inputs(self, case):
        sizes, times = _timings(case)
        return [{"sizes": sizes, "times": times}]

    def oracle(self, case, inputs):
        sizes, times = inputs[0]["sizes"], inputs[0]["times"]
        link = MEASURED_LINK if case.data == "measured" else LINKS[case.seed % len(LINKS)]
        return [{"fit": relative_fit(sizes, times), "plain": plain_fit(sizes, times), "link": link}]

    def run_case(self, call, case, rank, world_size, inputs):
        from course_lib.exercises.cases import portable

        return {"returned": portable(call(list(inputs["sizes"]), list(inputs["times"])))}

    def judge(self, case, records, complete=True):
        if not complete:
            return []
        record = records[0]
        returned = record["returned"]
        want_alpha, want_beta = record["fit"]
        link_latency, link_bandwidth = record["link"]
        numbers = _two_numbers(returned)
        if numbers is None:
            return [Problem(f"fit_alpha_beta returned {str(returned)[:60]}; return two numbers, (alpha, beta): alpha "
                            "in seconds, beta in seconds per byte.", line="returned")]
        tol = TOLERANCE if case.data != "exact" else 1e-3
        alpha, beta, slip = _read_back(*numbers, want_alpha, want_beta, tol)
        problems = []
        if slip is not None:
            problems.append(Problem(slip, order=(0,), line="returned"))
        off = [(name, value, want, show) for name, value, want, show in
               (("alpha", alpha, want_alpha, _seconds), ("beta", beta, want_beta, _per_byte))
               if not _relative_gap(value, want) <= tol]
        if not off:
            return problems
        link = (f" The link was set to {_seconds(link_latency)} and {link_bandwidth / 1e6:g} MB/s "
                f"(beta = {1 / link_bandwidth:.3g} s/B).")
        parts = []
        for name, value, want, show in off:
            gap = _relative_gap(value, want)
            how = f"{100 * gap:.0f}% too {'high' if value > want else 'low'}" if gap < 10 else f"{value / want:.3g} times the fit's" \
                if want and value / want > 0 else "of the wrong sign"
            parts.append(f"{name} = {show(value)}, the relative least-squares fit gives {show(want)} ({how})")
        right = [name for name in ("alpha", "beta") if name not in {o[0] for o in off}]
        text = "; ".join(parts) + (f"; {right[0]} is right." if right else ".")
        plain_alpha, plain_beta = record["plain"]
        if _relative_gap(alpha, plain_alpha) <= tol / 2 and _relative_gap(beta, plain_beta) <= tol / 2:
            text += (" That is ordinary least squares: the largest messages' absolute errors dominate it. Weight every "
                     "row by 1/t (divide the row [1, n] and t by t) so each point's relative error counts the same.")
        elif beta and abs(alpha) < 1e-3 * abs(want_alpha):
            text += " alpha is about 0: fit the line with an intercept (a column of ones in X), not through the origin."
        problems.append(Problem(text + (link if case.data == "measured" else ""), order=(1,), line="fit"))
        return problems


def _two_numbers(returned):
    if not isinstance(returned, (list, tuple)) or len(returned) != 2:
        return None
    values = []
    for value in returned:
        if hasattr(value, "item") and not isinstance(value, (int, float)):
            try:
                value = value.item()
            except Exception:  # noqa: BLE001
                return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return None
        values.append(float(value))
    return tuple(values)


register(FitAlphaBeta(
    name="fit_alpha_beta", notebook="10_measure_it", points=5,
    signature="fit_alpha_beta(sizes, times) -> (alpha, beta)",
    summary="fit t = alpha + beta S to measured message times by least squares weighted by relative error "
            "(each row divided by its time); alpha in seconds, beta in seconds per byte",
    rubric=(RubricLine("fit", "on timings straight from the model: alpha and beta are the least-squares line (within "
                              "0.1%), whatever the order or unit they come back in", 2),
            RubricLine("returned", "returns (alpha, beta) in that order: alpha in seconds, beta in seconds per byte", 1),
            RubricLine("weighted", "on noisy timings and a run over a modeled link: the fit weighted by relative error "
                                   "(each row / t), within 2% on alpha and on beta (plain least squares is not)", 2,
                       family=NOISY)),
    forbidden=("cost",)))
