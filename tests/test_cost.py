"""The alpha-beta model: formulas, the least-squares fit, crossovers and extrapolation."""

import math

import numpy as np
import pytest

from course_lib.network import Network
from course_lib import cost

WORLD_SIZES = [2, 3, 4, 5, 8]
SIZES = [2**k for k in range(8, 27, 2)]  # 256 B .. 64 MiB


def _grid():
    g, n = np.meshgrid(WORLD_SIZES, SIZES, indexing="ij")
    return g.ravel(), n.ravel()


def test_model_counts_match_the_design_table():
    # (G-1) steps for the naive exchange, 2(G-1) for master and ring; the ring's busiest link
    # carries 2(G-1)/G of the tensor, the master's 2(G-1) times it.
    for g in WORLD_SIZES:
        assert cost.predict("naive", g, 1000, alpha=1, beta=0) == g - 1
        assert cost.predict("parameter_server", g, 1000, alpha=1, beta=0) == 2 * (g - 1)
        assert cost.predict("ring", g, 1000, alpha=1, beta=0) == 2 * (g - 1)
        assert cost.predict("naive", g, 1000, alpha=0, beta=1) == (g - 1) * 1000
        assert cost.predict("master", g, 1000, alpha=0, beta=1) == 2 * (g - 1) * 1000
        assert cost.predict("ring", g, 1000, alpha=0, beta=1) == pytest.approx(2 * (g - 1) / g * 1000)
    # Trees and halving-doubling take 2 ceil(log2 G) steps.
    assert cost.predict("tree", 8, 1, alpha=1, beta=0) == 6
    assert cost.predict("halving_doubling", 1024, 1, alpha=1, beta=0) == 20
    assert cost.predict("tree", 5, 1, alpha=1, beta=0) == 6


@pytest.mark.parametrize("model", sorted(cost.MODELS))
def test_fit_recovers_alpha_and_beta_from_noisy_model_times(model):
    alpha, beta = 3.7e-5, 2.3e-9
    g, n = _grid()
    rng = np.random.default_rng(sorted(cost.MODELS).index(model))
    exact = cost.predict(model, g, n, alpha, beta)
    measured = exact * (1 + 0.03 * rng.standard_normal(exact.shape))  # 3% noise on every point
    fitted = cost.fit(model, g, n, measured)
    assert fitted.alpha == pytest.approx(alpha, rel=0.1)
    assert fitted.beta == pytest.approx(beta, rel=0.05)
    assert fitted.r2 > 0.99
    assert 0.005 < fitted.median_relative_error < 0.06
    np.testing.assert_allclose(fitted.residuals, measured - fitted.predict(g, n))
    assert fitted.bandwidth == pytest.approx(1 / fitted.beta)
    # Ordinary least squares is ruled by the largest times: it still finds beta.
    assert cost.fit(model, g, n, measured, weighting="absolute").beta == pytest.approx(beta, rel=0.05)


def test_fit_without_noise_is_exact_and_str_reports_it():
    g, n = _grid()
    t = cost.predict("ring", g, n, 1e-4, 1e-9)
    fitted = cost.fit("ring", g, n, t)
    assert fitted.alpha == pytest.approx(1e-4, rel=1e-9)
    assert fitted.beta == pytest.approx(1e-9, rel=1e-9)
    assert fitted.max_relative_error < 1e-9 and fitted.r2 == pytest.approx(1.0) and fitted.r2_log == pytest.approx(1.0)
    assert "alpha = 100.0 us" in str(fitted) and "1 GB/s" in str(fitted)


def test_relative_weighting_keeps_small_sizes_accurate():
    # A tiny alpha hidden under huge bandwidth times: ordinary least squares gets it wrong by far
    # more than the relative fit does, which is why "relative" is the default.
    g = np.array([4] * 6)
    n = np.array([64, 256, 1024, 2**24, 2**25, 2**26])
    exact = cost.predict("ring", g, n, 2e-5, 1e-9)
    noisy = exact * np.array([1.0, 1.0, 1.0, 1.02, 0.98, 1.01])
    relative = cost.fit("ring", g, n, noisy, weighting="relative")
    absolute = cost.fit("ring", g, n, noisy, weighting="absolute")
    assert relative.alpha == pytest.approx(2e-5, rel=0.02)
    assert abs(absolute.alpha - 2e-5) > 10 * abs(relative.alpha - 2e-5)


def test_fit_keeps_parameters_non_negative():
    # Pure bandwidth data with noise would give a slightly negative alpha to plain least squares.
    g = np.array([4, 4, 4, 4])
    n = np.array([1e6, 2e6, 4e6, 8e6])
    t = cost.predict("ring", g, n, 0.0, 1e-9) * np.array([0.95, 1.0, 1.0, 1.01])
    unconstrained = np.linalg.lstsq(np.column_stack([np.full(4, 6.0), 1.5 * n]) / t[:, None], np.ones(4), rcond=None)[0]
    assert unconstrained[0] < 0  # the situation the constraint is for
    fitted = cost.fit("ring", g, n, t)
    assert fitted.alpha == 0.0 and fitted.beta > 0


def test_fit_refuses_what_it_cannot_determine():
    with pytest.raises(ValueError, match="two different sizes"):
        cost.fit("ring", [4, 4, 4], [1000, 1000, 1000], [1e-3, 1.1e-3, 0.9e-3])
    with pytest.raises(ValueError, match="one entry per measurement"):
        cost.fit("ring", [4, 4], [1, 2, 3], [1, 2, 3])
    with pytest.raises(ValueError, match="positive"):
        cost.fit("ring", [4, 4], [1, 2], [1, 0])
    with pytest.raises(ValueError, match="no cost model"):
        cost.model_for("butterfly")


def test_fit_results_uses_bench_records():
    from course_lib.bench import Result

    alpha, beta = 1e-4, 5e-10
    records = []
    for g in (2, 4):
        for n in (1024, 2**20, 2**24):
            t = float(cost.predict("naive", g, n, alpha, beta))
            records.append(Result("naive", g, n, n // 4, "float32", "gloo", times=[t * 0.99, t, t * 1.5]))
            records.append(Result("ring", g, n, n // 4, "float32", "gloo", times=[1.0, 1.0, 1.0]))
    fitted = cost.fit_results(records, "naive")
    assert (fitted.alpha, fitted.beta) == (pytest.approx(alpha), pytest.approx(beta))
    assert len(fitted.seconds) == 6
    only_four = cost.fit_results(records, "naive", world_size=4, statistic="min")
    assert set(only_four.world_sizes) == {4} and only_four.alpha == pytest.approx(0.99 * alpha)
    with pytest.raises(ValueError, match="no records"):
        cost.fit_results(records, "tree")


@pytest.mark.parametrize("g", [3, 4, 5, 8, 64])
def test_naive_ring_crossover(g):
    alpha, beta = 2e-5, 1e-9
    n_star = cost.crossover_bytes("naive", "ring", g, alpha, beta)
    assert n_star == pytest.approx(g * alpha / ((g - 2) * beta))
    t = lambda m, n: float(cost.predict(m, g, n, alpha, beta))  # noqa: E731
    assert t("naive", n_star) == pytest.approx(t("ring", n_star))
    assert t("naive", n_star / 2) < t("ring", n_star / 2)  # small tensors: fewer steps win
    assert t("naive", n_star * 2) > t("ring", n_star * 2)  # large ones: fewer bytes win
    assert cost.crossover_bytes("ring", "naive", g, alpha, beta) == pytest.approx(n_star)


def test_no_crossover_on_two_ranks_or_between_parallel_lines():
    # On 2 ranks the ring sends as many bytes as the naive exchange, in twice the steps: it never wins.
    assert cost.crossover_bytes("naive", "ring", 2, 1e-5, 1e-9) == math.inf
    # Master vs naive: the master is slower in steps and in bytes for every G >= 2.
    assert cost.crossover_bytes("naive", "master", 4, 1e-5, 1e-9) == math.inf


def test_extrapolation_uses_the_stated_link_and_is_labelled_a_model():
    link = cost.INFINIBAND_NDR
    # the links are the network presets' (one place for their figures): the rate a copy achieves on them
    assert link.bandwidth == Network.preset("ib_ndr").bandwidth == 48e9 and link.beta == pytest.approx(1 / 48e9)
    assert cost.NVLINK4_H100.bandwidth == Network.preset("nvlink4").bandwidth
    assert "datasheet" in cost.NVLINK4_H100.source and "assumption" in link.source
    predictions = cost.extrapolate(["ring", "naive", "tree"], [64, 1024], [2**20, 2**30], link=link)
    assert len(predictions) == 12 and {p.kind for p in predictions} == {"model"}
    ring_1024 = next(p for p in predictions if p.model == "ring" and p.world_size == 1024 and p.nbytes == 2**30)
    assert ring_1024.seconds == pytest.approx(2 * 1023 * 5e-6 + 2 * 1023 / 1024 * 2**30 / 48e9)
    # With latency ignored, the ring's busbw is exactly the link bandwidth: that is busbw's point.
    no_latency = cost.extrapolate(["ring"], [1024], [2**30], alpha=0.0, beta=link.beta)[0]
    assert no_latency.busbw == pytest.approx(48.0)
    with pytest.raises(ValueError):
        cost.extrapolate(["ring"], [4], [1], alpha=1e-6)


# -------------------------------------------------------------------------------------------------
# The faster variants (course_lib.fast_allreduce), fitted crossovers, the hierarchical ring on paper
# -------------------------------------------------------------------------------------------------


def test_fast_variant_models_count_what_the_algorithms_do():
    from course_lib import fast_allreduce

    for g in (2, 3, 4, 5, 6, 8, 64):
        # Steps: the model's a(G) is the number of steps the algorithm's trace shows.
        for name in fast_allreduce.VARIANTS:
            assert cost.predict(name, g, 1, alpha=1, beta=0) == sum(fast_allreduce.expected_steps(name, g).values())
        # Bytes: the busiest rank's elements sent, per element of the tensor (N divisible by everything).
        n = 2**10 * 3 * 5 * 7
        busiest = lambda name: max(fast_allreduce.expected_traffic(name, n, g, r)["elements_sent"]  # noqa: E731
                                   for r in range(g)) / n
        assert cost.predict("ring_pipelined", g, 1, alpha=0, beta=1) == pytest.approx(busiest("ring_pipelined"))
        # bidirectional: the same bytes, half on each of two links
        assert cost.predict("ring_bidirectional", g, 1, alpha=0, beta=1) == pytest.approx(busiest("ring_bidirectional") / 2)
        # halving-doubling: sends then receives N more around the fold when G is not a power of two
        p = 1 << (g.bit_length() - 1)
        assert cost.predict("halving_doubling", g, 1, alpha=0, beta=1) == \
            pytest.approx(2 * (p - 1) / p + (2 if p != g else 0))
        assert cost.predict("tree", g, 1, alpha=0, beta=1) == pytest.approx(2 * busiest("tree") if g > 1 else 0)
        # recursive doubling: the whole tensor at every step, sent and received, N more around the fold
        assert cost.predict("recursive_doubling", g, 1, alpha=0, beta=1) == \
            pytest.approx(busiest("recursive_doubling") + (1 if p != g else 0))


def test_crossover_of_two_fitted_models():
    # Two variants with their own (alpha, beta): the tree (4 steps, 4 n bytes on 4 ranks) and the ring
    # (6 steps, 1.5 n). Fitted from noiseless synthetic times, the crossover is where the lines meet.
    g, sizes = [4] * 6, [2**k for k in range(8, 26, 3)]
    tree = cost.fit("tree", g, sizes, cost.predict("tree", g, sizes, alpha=30e-6, beta=1.0e-9))
    ring = cost.fit("ring", g, sizes, cost.predict("ring", g, sizes, alpha=80e-6, beta=0.8e-9))
    assert (tree.alpha, tree.beta) == (pytest.approx(30e-6), pytest.approx(1.0e-9))
    n_star = cost.crossover_bytes(tree, ring, 4)
    assert n_star == pytest.approx((6 * 80e-6 - 4 * 30e-6) / (4 * 1.0e-9 - 1.5 * 0.8e-9))
    assert tree.predict(4, n_star) == pytest.approx(ring.predict(4, n_star))
    assert tree.predict(4, n_star / 2) < ring.predict(4, n_star / 2)
    assert tree.predict(4, n_star * 2) > ring.predict(4, n_star * 2)
    assert cost.crossover_bytes(ring, tree, 4) == pytest.approx(n_star)
    # A fitted model that is better on both counts never crosses.
    worse = cost.fit("ring", g, sizes, cost.predict("ring", g, sizes, alpha=90e-6, beta=0.9e-9))
    assert cost.crossover_bytes(ring, worse, 4) == math.inf
    with pytest.raises(ValueError, match="alpha and beta"):
        cost.crossover_bytes("tree", ring, 4)


@pytest.mark.parametrize("model", ["ring_pipelined", "ring_bidirectional", "halving_doubling", "tree"])
def test_fit_all_recovers_each_variants_own_parameters(model):
    from course_lib.bench import Result

    truth = {"ring": (50e-6, 1e-9), model: (20e-6, 3e-9)}
    records = []
    for name, (alpha, beta) in truth.items():
        for n in (4096, 2**16, 2**20, 2**24, 2**26):
            t = float(cost.predict(name, 4, n, alpha, beta))
            records.append(Result(name, 4, n, n // 4, "float32", "gloo", times=[t, t * 1.01, t * 0.99]))
    fits = cost.fit_all(records)
    assert set(fits) == set(truth)
    for name, (alpha, beta) in truth.items():
        assert (fits[name].alpha, fits[name].beta) == (pytest.approx(alpha, rel=1e-6), pytest.approx(beta, rel=1e-6))


def test_hierarchical_ring_formulas():
    intra, inter = cost.Link("in", 1e-6, 100e9, "test"), cost.Link("out", 10e-6, 10e9, "test")
    n = 2**28
    for m, g in ((8, 8), (128, 8), (1, 8), (16, 1)):
        p = cost.hierarchical_ring(m, g, n, intra, inter)
        assert p.world_size == m * g and p.kind == "model"
        expected = (2 * (g - 1) * (1e-6 + n / g / 100e9)
                    + 2 * (m - 1) * (10e-6 + n / g / m / 10e9))
        assert p.seconds == pytest.approx(expected)
        assert p.steps == 2 * (g - 1) + 2 * (m - 1)
        assert p.flat_ring_seconds == pytest.approx(float(cost.predict("ring", m * g, n, 10e-6, 1 / 10e9)))
        three = cost.hierarchical_ring(m, g, n, intra, inter, form="three_rings")
        assert three.seconds == pytest.approx(2 * (g - 1) * (1e-6 + n / g / 100e9) + 2 * (m - 1) * (10e-6 + n / m / 10e9)
                                              + ((g - 1) * 1e-6 + n / 100e9 if g > 1 else 0))
        assert three.steps == 3 * (g - 1) + 2 * (m - 1)
    # One node of one GPU per node: nothing crosses anything but the single level.
    assert cost.hierarchical_ring(16, 1, n, intra, inter).seconds == pytest.approx(cost.hierarchical_ring(16, 1, n, intra, inter).flat_ring_seconds)
    # 64 and 1024 GPUs in nodes of 8: the hierarchy beats a flat ring, by more at 1024.
    s64, s1024 = (cost.hierarchical_ring(m, 8, 2**30).speedup_over_flat_ring for m in (8, 128))
    assert 1 < s64 < s1024
    with pytest.raises(ValueError, match="form"):
        cost.hierarchical_ring(8, 8, n, form="mesh")
    with pytest.raises(ValueError, match="whole numbers"):
        cost.hierarchical_ring(0, 8, n)
