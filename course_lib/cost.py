"""The alpha-beta (latency-bandwidth) cost model of all-reduce, fitted to measured times.

Notation as in docs/notation.md. A step of m bytes costs alpha + m * beta: alpha is the fixed price of a
step (the link's latency a plus the software's wake-up and bookkeeping, which does not overlap from step
to step), beta the time per byte (1 / B for a link's bandwidth B). An algorithm that takes steps(G) steps
one after another, and whose busiest rank pushes traffic(G) * S bytes through its link, then takes about

    T = steps(G) * alpha  +  traffic(G) * S * beta  [ +  reduction(G) * S * gamma ]

for a tensor of S bytes on each of G ranks. The optional gamma term is the reduction arithmetic
(reduction(G) * S bytes added up on the busiest rank, gamma seconds per byte); `predict` accepts it, `fit`
folds it into beta (see `fit` for why).

    model               steps(G)          traffic(G)           reduction(G) source of the counts
    naive               G-1               G-1                  G-1        course_lib.allreduce.naive
    parameter_server    2(G-1)            2(G-1)               G-1        the root receives, then sends, G-1 times
    ring                2(G-1)            2(G-1)/G             (G-1)/G    course_lib.allreduce.ring
    ring_pipelined      2(G-1)            2(G-1)/G             (G-1)/G    fast_allreduce: the ring's counts; what
                                                                          changes is the fitted beta (adding hides
                                                                          behind receiving)
    ring_bidirectional  2(G-1)            (G-1)/G              (G-1)/G    fast_allreduce: half the bytes on each of
                                                                          a rank's two links, if they are independent
    recursive_doubling  log2 P + 2f       log2 P + 2f          log2 P+f   swap the whole tensor with partners 2^j
                                                                          apart; folds like halving_doubling
    tree                2 L               2 L                  L          binomial tree: reduce up, broadcast down,
                                                                          the whole tensor at every level
    halving_doubling    2 log2 P + 2f     2(P-1)/P + 2f        (P-1)/P+f  Rabenseifner; P = largest power of two
                                                                          <= G, f = 1 when G is not one (fold, unfold)

(L = log2 G rounded up.) The ring's traffic(G) tends to 2: its time hardly grows with G for large
tensors, which is why NCCL uses it; its steps(G) grow linearly, which is why small tensors and very
many ranks want a tree or halving-doubling instead.

`fit` finds alpha and beta from measured times by least squares; `predict` and
`extrapolate` turn them, or a link's published figures (`Link`), into times for world sizes this
machine cannot run. Those are a model's numbers, not measurements, and are labelled so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from course_lib.network import PRESETS as _PRESETS

__all__ = ["Model", "MODELS", "model_for", "predict", "Fit", "fit", "fit_results", "fit_all", "crossover_bytes",
           "Link", "NVLINK4_H100", "INFINIBAND_NDR", "LINKS", "Prediction", "extrapolate",
           "HierarchicalPrediction", "hierarchical_ring"]


def _log2_up(g):
    return np.ceil(np.log2(np.maximum(g, 1)))


def _log2_down(g):
    return np.floor(np.log2(np.maximum(g, 1)))


def _folds(g):
    """1 where G is not a power of two (halving-doubling folds the extra ranks in first), else 0."""
    g = np.asarray(g, dtype=float)
    return (2.0 ** _log2_down(g) != g).astype(float)


def _hd_traffic(g):
    p = 2.0 ** _log2_down(g)
    return 2 * (p - 1) / p + 2 * _folds(g)


@dataclass(frozen=True)
class Model:
    """The step count steps(G) and per-byte multipliers traffic(G), reduction(G) of one algorithm (the module table)."""

    name: str
    steps: object       # steps(G): latency terms, messages one after another
    traffic: object     # traffic(G): bytes through the busiest rank's link, per byte of the tensor
    reduction: object   # c(G): bytes the busiest rank adds up, per byte of the tensor
    formula: str

    def terms(self, world_size, nbytes):
        """The columns of the design matrix: steps(G), traffic(G) S, reduction(G) S (arrays of the inputs' shape)."""
        g = np.asarray(world_size, dtype=float)
        n = np.asarray(nbytes, dtype=float)
        return self.steps(g) * np.ones_like(n), self.traffic(g) * n, self.reduction(g) * n


MODELS = {
    "naive": Model("naive", lambda g: g - 1, lambda g: g - 1, lambda g: g - 1,
                   "(G-1) alpha + (G-1) S beta"),
    "parameter_server": Model("parameter_server", lambda g: 2 * (g - 1), lambda g: 2 * (g - 1), lambda g: g - 1,
                              "2(G-1) alpha + 2(G-1) S beta"),
    "ring": Model("ring", lambda g: 2 * (g - 1), lambda g: 2 * (g - 1) / g, lambda g: (g - 1) / g,
                  "2(G-1) alpha + 2(G-1)/G S beta"),
    "ring_pipelined": Model("ring_pipelined", lambda g: 2 * (g - 1), lambda g: 2 * (g - 1) / g,
                            lambda g: (g - 1) / g, "2(G-1) alpha + 2(G-1)/G S beta"),
    "ring_bidirectional": Model("ring_bidirectional", lambda g: 2 * (g - 1), lambda g: (g - 1) / g,
                                lambda g: (g - 1) / g, "2(G-1) alpha + (G-1)/G S beta"),
    "recursive_doubling": Model("recursive_doubling", lambda g: _log2_down(g) + 2 * _folds(g),
                                lambda g: _log2_down(g) + 2 * _folds(g), lambda g: _log2_down(g) + _folds(g),
                                "log2(P) alpha + log2(P) S beta (P = largest power of two <= G; +2 alpha + 2 S beta when G != P)"),
    "tree": Model("tree", lambda g: 2 * _log2_up(g), lambda g: 2 * _log2_up(g), lambda g: _log2_up(g),
                  "2 log2(G) alpha + 2 log2(G) S beta"),
    "halving_doubling": Model("halving_doubling", lambda g: 2 * _log2_down(g) + 2 * _folds(g), _hd_traffic,
                              lambda g: _hd_traffic(g) / 2,
                              "2 log2(P) alpha + 2(P-1)/P S beta (P = largest power of two <= G; +2 alpha + 2 S beta when G != P)"),
}
# Other names a result may carry: the master is the parameter server; gloo's built-in all_reduce
# is itself a ring (gloo/allreduce.cc), so it is described by the ring's model.
_ALIASES = {"master": "parameter_server", "builtin": "ring"}


def model_for(name) -> Model:
    """The Model called `name` (a Model is returned unchanged); 'master' and 'builtin' are aliases."""
    if isinstance(name, Model):
        return name
    key = _ALIASES.get(name, name)
    if key not in MODELS:
        raise ValueError(f"no cost model called {name!r}; known: {sorted(MODELS) + sorted(_ALIASES)}")
    return MODELS[key]


def predict(model, world_size, nbytes, alpha: float, beta: float, gamma: float = 0.0):
    """Modelled seconds for `nbytes` per rank on `world_size` ranks (numbers or numpy arrays)."""
    steps, traffic, reduction = model_for(model).terms(world_size, nbytes)
    return steps * alpha + traffic * beta + reduction * gamma


# --------------------------------------------------------------------------------------------------
# Fitting alpha and beta to measurements
# --------------------------------------------------------------------------------------------------


@dataclass
class Fit:
    """Least-squares alpha and beta of one model, and how well they explain the points.

    Attributes:
        model: the model's name.
        alpha: seconds per step.
        beta: seconds per byte on the busiest link (1 / bandwidth).
        world_sizes, nbytes, seconds: the measured points the fit used.
        predicted: the model's seconds at those points.
    """

    model: str
    alpha: float
    beta: float
    world_sizes: np.ndarray
    nbytes: np.ndarray
    seconds: np.ndarray
    predicted: np.ndarray

    @property
    def residuals(self) -> np.ndarray:
        """measured - predicted, seconds."""
        return self.seconds - self.predicted

    @property
    def relative_errors(self) -> np.ndarray:
        """(measured - predicted) / measured for every point."""
        return self.residuals / self.seconds

    @property
    def max_relative_error(self) -> float:
        return float(np.max(np.abs(self.relative_errors)))

    @property
    def median_relative_error(self) -> float:
        return float(np.median(np.abs(self.relative_errors)))

    @property
    def r2(self) -> float:
        """Coefficient of determination of the times (1 = every point on the model)."""
        total = np.sum((self.seconds - self.seconds.mean()) ** 2)
        return float(1 - np.sum(self.residuals ** 2) / total) if total > 0 else float("nan")

    @property
    def r2_log(self) -> float:
        """R² of log(time): fair to small sizes, whose seconds are tiny next to the large ones'."""
        measured, modelled = np.log(self.seconds), np.log(np.maximum(self.predicted, 1e-300))
        total = np.sum((measured - measured.mean()) ** 2)
        return float(1 - np.sum((measured - modelled) ** 2) / total) if total > 0 else float("nan")

    @property
    def bandwidth(self) -> float:
        """1 / beta in bytes per second (inf when beta is 0)."""
        return 1 / self.beta if self.beta > 0 else float("inf")

    def predict(self, world_size, nbytes):
        """This fit's modelled seconds at other points."""
        return predict(self.model, world_size, nbytes, self.alpha, self.beta)

    def __str__(self) -> str:
        text = (f"{self.model}: alpha = {self.alpha * 1e6:.1f} us, beta = {self.beta * 1e9:.3g} ns/byte "
                f"(1/beta = {self.bandwidth / 1e9:.3g} GB/s)")
        return (text + f"; R² = {self.r2:.3f}, R² of log time = {self.r2_log:.3f}, median |relative error| "
                f"{100 * self.median_relative_error:.0f}%, worst {100 * self.max_relative_error:.0f}% "
                f"over {len(self.seconds)} points")


def _nonnegative_lstsq(matrix: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: a negative latency or bandwidth cost means nothing.

    With two or three columns the simplest exact method is enough: solve on every subset of
    columns, keep the best solution whose coefficients are all non-negative.
    """
    n_columns = matrix.shape[1]
    best, best_error = np.zeros(n_columns), np.sum(target ** 2)
    for mask in range(1, 2 ** n_columns):
        columns = [j for j in range(n_columns) if mask >> j & 1]
        solution, *_ = np.linalg.lstsq(matrix[:, columns], target, rcond=None)
        if np.all(solution >= 0):
            error = np.sum((matrix[:, columns] @ solution - target) ** 2)
            if error < best_error - 1e-300:
                best, best_error = np.zeros(n_columns), error
                best[columns] = solution
    return best


def fit(model, world_sizes, nbytes, seconds, weighting: str = "relative") -> Fit:
    """Fit alpha and beta of `model` to measured times by least squares.

    The model is linear in its parameters, T = steps(G) alpha + traffic(G) S beta, so with one row per
    measurement the design matrix is X = [steps(G), traffic(G) S] and `numpy.linalg.lstsq` solves X p = t.

    The reduction's own cost (gamma) is not fitted: in every model here the bytes a rank adds up are
    proportional to the bytes it receives (reduction(G) is a fixed fraction of traffic(G)), so no measurement of one
    algorithm can tell the two apart. The fitted beta is the cost per byte of receiving *and* adding.

    Args:
        model: a model name ('naive', 'parameter_server', 'ring', 'tree', 'halving_doubling',
            'master', 'builtin') or a `Model`.
        world_sizes, nbytes, seconds: one entry per measurement (G, bytes per rank, time).
        weighting: 'relative' divides every row by its measured time, so a 10 us point counts as much
            as a 100 ms one (the default: sizes span many decades); 'absolute' is ordinary least squares.

    Returns:
        A `Fit` with alpha, beta (both kept >= 0), the residuals, R² and relative errors.

    Example::

        >>> g, n = [4, 4, 4], [1e3, 1e6, 1e7]
        >>> t = predict("ring", g, n, alpha=1e-4, beta=1e-9)
        >>> f = fit("ring", g, n, t)
        >>> round(f.alpha * 1e6), round(f.beta * 1e9, 3)
        (100, 1.0)
    """
    m = model_for(model)
    g = np.asarray(world_sizes, dtype=float).ravel()
    n = np.asarray(nbytes, dtype=float).ravel()
    t = np.asarray(seconds, dtype=float).ravel()
    if not (len(g) == len(n) == len(t)):
        raise ValueError(f"world_sizes, nbytes and seconds must have one entry per measurement: "
                         f"got {len(g)}, {len(n)}, {len(t)}")
    if np.any(t <= 0):
        raise ValueError("measured times must be positive")
    steps, traffic, _ = m.terms(g, n)
    matrix = np.column_stack([steps, traffic])
    scale = np.abs(matrix).max(axis=0)  # columns of ~1 and ~1e7 bytes: scale them for a stable solve
    scale[scale == 0] = 1
    if len(t) < 2 or np.linalg.matrix_rank(matrix / scale) < 2:
        raise ValueError(f"alpha and beta of the {m.name} model cannot both be fitted from these points: "
                         "measure at least two different sizes")
    if weighting not in ("relative", "absolute"):
        raise ValueError("weighting must be 'relative' or 'absolute'")
    weights = 1 / t if weighting == "relative" else np.ones_like(t)
    solution = _nonnegative_lstsq(matrix * weights[:, None] / scale, t * weights) / scale
    return Fit(m.name, float(solution[0]), float(solution[1]), g, n, t, matrix @ solution)


def fit_results(results, variant: str, world_size=None, model=None, weighting: str = "relative",
                statistic: str = "median") -> Fit:
    """Fit one variant's records from `course_lib.bench.run` (its model unless `model` is given).

    Args:
        results: `bench.Results` (or any iterable of `bench.Result`).
        variant: which variant's records to use.
        world_size: only records with this many ranks (default: all of them).
        statistic: 'median' or 'min' time of each record.
    """
    rows = [r for r in results if r.variant == variant and (world_size is None or r.world_size == world_size)]
    if not rows:
        raise ValueError(f"no records of variant {variant!r}" + (f" with world_size={world_size}" if world_size else ""))
    times = [getattr(r, statistic) for r in rows]
    return fit(model or variant, [r.world_size for r in rows], [r.nbytes for r in rows], times, weighting=weighting)


def _has_model(variant: str) -> bool:
    try:
        model_for(variant)
    except ValueError:
        return False
    return True


def fit_all(results, variants=None, world_size=None, statistic: str = "median",
            weighting: str = "relative") -> dict:
    """{variant: Fit} for every variant in `results` (or only those named in `variants`) that has a model.

    Each variant gets its own alpha and beta: the same formula fitted to two implementations (ring
    and ring_pipelined) gives two pairs, and their difference is what pipelining changed.
    """
    present = sorted({r.variant for r in results})
    names = [v for v in (variants or present) if v in present and _has_model(v)]
    return {v: fit_results(results, v, world_size=world_size, statistic=statistic, weighting=weighting)
            for v in names}


def _line(model, world_size, alpha, beta, gamma):
    """(seconds at n = 0, seconds per byte) of one model on `world_size` ranks: time = A + n B."""
    steps, traffic, reduction = model_for(model).terms(world_size, 1.0)
    return float(steps * alpha), float(traffic * beta + reduction * gamma)


def crossover_bytes(model_a, model_b, world_size, alpha: float | None = None, beta: float | None = None,
                    gamma: float = 0.0) -> float:
    """The tensor size (bytes per rank) at which two models take the same time on `world_size` ranks.

    Both times are straight lines in n, time = A + n B, so they meet at most once, at
    n* = (A_b - A_a) / (B_a - B_b); below it the line with the smaller A wins, above it the one with
    the smaller B. Returns inf when the lines never meet for n > 0 (e.g.
    naive and ring on 2 ranks: the ring moves the same bytes in twice the steps).

    Args:
        model_a, model_b: model names with one shared `alpha`, `beta` (and `gamma`), or two `Fit`s,
            each bringing its own alpha and beta (measured variants: then alpha/beta are not given).
        world_size: G.

    Example::

        >>> crossover_bytes("naive", "ring", 4, alpha=1e-4, beta=1e-9)   # G alpha / ((G-2) beta)
        200000.0
    """
    lines = []
    for model in (model_a, model_b):
        if isinstance(model, Fit):
            lines.append(_line(model.model, world_size, model.alpha, model.beta, 0.0))
        elif alpha is None or beta is None:
            raise ValueError(f"crossover_bytes: give alpha and beta for model {model!r}, or pass a Fit")
        else:
            lines.append(_line(model, world_size, alpha, beta, gamma))
    (a_fixed, a_per_byte), (b_fixed, b_per_byte) = lines
    latency_gap, per_byte_gap = a_fixed - b_fixed, a_per_byte - b_per_byte  # time_a - time_b = gap + n gap'
    if per_byte_gap == 0 or latency_gap * per_byte_gap >= 0:
        return math.inf
    return -latency_gap / per_byte_gap


# --------------------------------------------------------------------------------------------------
# Extrapolation with published link figures
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    """One rank's connection to the others, described by a latency and a one-way bandwidth.

    Attributes:
        name: what the link is.
        alpha: seconds per message step (an assumption, see `source`).
        bandwidth: bytes per second in one direction.
        source: where the figures come from.
    """

    name: str
    alpha: float
    bandwidth: float
    source: str

    @property
    def beta(self) -> float:
        return 1 / self.bandwidth


# The links of `course_lib.network.PRESETS` (one place for their figures and sources): the bandwidth a copy achieves
# on each, and its latency as alpha. The per-step latencies are round, order-of-magnitude assumptions (no datasheet
# states "one step of a collective"), so treat the small-size end of any plot as rough.
def _from_preset(name: str, title: str) -> "Link":
    preset = _PRESETS[name]
    return Link(name=title, alpha=preset.latency, bandwidth=preset.bandwidth,
                source=f"course_lib.network.PRESETS[{name!r}]: {preset.source}. alpha is its latency, an assumption of "
                       "this course (order of magnitude of a message step), not a datasheet figure.")


NVLINK4_H100 = _from_preset("nvlink4", "NVLink 4 between H100 SXM GPUs, 370 GB/s achieved per direction")
INFINIBAND_NDR = _from_preset("ib_ndr", "InfiniBand NDR, one 400 Gb/s port per GPU (48 GB/s achieved per direction)")
LINKS = {"nvlink4": NVLINK4_H100, "ib_ndr": INFINIBAND_NDR}


@dataclass(frozen=True)
class Prediction:
    """A modelled (not measured) time: `kind` is always 'model' so no plot can pass it off as data."""

    model: str
    world_size: int
    nbytes: int
    seconds: float
    link: str
    kind: str = "model"

    @property
    def algbw(self) -> float:
        """GB/s, as nccl-tests would report it for this time."""
        return self.nbytes / self.seconds / 1e9

    @property
    def busbw(self) -> float:
        return self.algbw * 2 * (self.world_size - 1) / self.world_size


def extrapolate(models, world_sizes, sizes, link: Link | None = None, alpha: float | None = None,
                beta: float | None = None, gamma: float = 0.0) -> list[Prediction]:
    """Model times for every (model, world size, size): from a `Link`'s figures or from given alpha/beta.

    Example::

        >>> p = extrapolate(["ring"], [1024], [2**30], link=INFINIBAND_NDR)[0]
        >>> round(p.seconds, 3)       # 2*1023 steps of 5 us + 2*1023/1024 GiB at 50 GB/s
        0.053
    """
    if link is not None:
        alpha, beta, label = link.alpha, link.beta, link.name
    elif alpha is not None and beta is not None:
        label = f"alpha={alpha:.3g} s, beta={beta:.3g} s/byte"
    else:
        raise ValueError("give a link, or both alpha and beta")
    return [Prediction(model_for(m).name, int(g), int(n), float(predict(m, g, n, alpha, beta, gamma)), label)
            for m in models for g in world_sizes for n in sizes]


# --------------------------------------------------------------------------------------------------
# On paper: a hierarchical ring for nodes of several GPUs
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HierarchicalPrediction:
    """Modelled time of a two-level all-reduce, phase by phase, beside a flat ring over every rank.

    Attributes:
        nodes, gpus_per_node: M and g; the world size is G = M g.
        nbytes: bytes per rank.
        form: 'rs_ar_ag' or 'three_rings' (see `hierarchical_ring`).
        phases: [(name, steps, seconds)] in order.
        seconds: their sum.
        flat_ring_seconds: one ring over all G ranks, every step as slow as the inter-node link.
        kind: always 'model'.
    """

    nodes: int
    gpus_per_node: int
    nbytes: int
    form: str
    phases: tuple
    seconds: float
    flat_ring_seconds: float
    kind: str = "model"

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def steps(self) -> int:
        return int(sum(steps for _, steps, _ in self.phases))

    @property
    def speedup_over_flat_ring(self) -> float:
        return self.flat_ring_seconds / self.seconds


def hierarchical_ring(nodes: int, gpus_per_node: int, nbytes, intra: Link = NVLINK4_H100,
                      inter: Link = INFINIBAND_NDR, form: str = "rs_ar_ag") -> HierarchicalPrediction:
    """Model (on paper) a node x GPU all-reduce built from rings, for world sizes no laptop runs.

    M nodes of K GPUs, S bytes per GPU; inside a node the GPUs are linked by `intra`, nodes by
    `inter` (one port per GPU, as in DGX-class machines). Two standard forms:

    form='rs_ar_ag' (reduce-scatter / all-reduce / all-gather, as NCCL and Horovod's hierarchical
    all-reduce do it):

        1. ring reduce-scatter inside each node      (K-1) alpha_in + (K-1)/K S beta_in
        2. K ring all-reduces across nodes at once,  2(M-1) alpha_out + 2(M-1)/M (S/K) beta_out
           one per local GPU index, on its shard of S/K bytes
        3. ring all-gather inside each node          (K-1) alpha_in + (K-1)/K S beta_in

    form='three_rings' (ring inside, ring across, ring inside again, through one leader GPU per node):

        1. ring all-reduce inside each node          2(K-1) alpha_in + 2(K-1)/K S beta_in
        2. ring all-reduce across the M leaders      2(M-1) alpha_out + 2(M-1)/M S beta_out
        3. leader broadcasts inside the node (ring)  (K-1) alpha_in + S beta_in   (pipelined broadcast)

    A flat ring over all G = M K ranks takes 2(G-1) steps, each as slow as the slowest link it
    crosses (inter-node): 2(G-1) alpha_out + 2(G-1)/G S beta_out. The hierarchy wins twice: far fewer
    slow steps (2(M-1) instead of 2(G-1)), and in 'rs_ar_ag' only S/K bytes per GPU cross the network.
    (On the modeled clock, `Network.cluster(...).predict("hierarchical", ...)` times the rs_ar_ag form with
    the links' own sides, and notebook 13 runs it on 64 ranks.)

    Args:
        nodes: M (>= 1); gpus_per_node: K (>= 1).
        nbytes: bytes per GPU (a number).
        intra, inter: `Link`s (defaults: NVLink 4 inside, InfiniBand NDR across).
        form: 'rs_ar_ag' or 'three_rings'.

    Returns:
        A `HierarchicalPrediction` (kind 'model': numbers from formulas, not measurements).

    Example::

        >>> p = hierarchical_ring(128, 8, 2**30)          # 1024 GPUs, 1 GiB each
        >>> p.world_size, p.steps, round(p.speedup_over_flat_ring, 1)
        (1024, 268, 4.9)
    """
    if int(nodes) != nodes or int(gpus_per_node) != gpus_per_node or nodes < 1 or gpus_per_node < 1:
        raise ValueError(f"nodes and gpus_per_node must be whole numbers >= 1, got {nodes} and {gpus_per_node}")
    if form not in ("rs_ar_ag", "three_rings"):
        raise ValueError(f"form must be 'rs_ar_ag' or 'three_rings', got {form!r}")
    m, g, n = int(nodes), int(gpus_per_node), float(nbytes)
    if form == "rs_ar_ag":
        phases = (("reduce_scatter inside nodes", g - 1, (g - 1) * intra.alpha + (g - 1) / g * n * intra.beta),
                  ("all_reduce across nodes", 2 * (m - 1),
                   2 * (m - 1) * inter.alpha + 2 * (m - 1) / m * (n / g) * inter.beta),
                  ("all_gather inside nodes", g - 1, (g - 1) * intra.alpha + (g - 1) / g * n * intra.beta))
    else:
        phases = (("all_reduce inside nodes", 2 * (g - 1),
                   2 * (g - 1) * intra.alpha + 2 * (g - 1) / g * n * intra.beta),
                  ("all_reduce across node leaders", 2 * (m - 1),
                   2 * (m - 1) * inter.alpha + 2 * (m - 1) / m * n * inter.beta),
                  ("broadcast inside nodes", g - 1, ((g - 1) * intra.alpha + n * intra.beta) if g > 1 else 0.0))
    world = m * g
    flat = float(predict("ring", world, n, inter.alpha, inter.beta))
    return HierarchicalPrediction(m, g, int(n), form, phases, float(sum(t for _, _, t in phases)), flat)
