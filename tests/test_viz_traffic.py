"""course_lib.viz.traffic_plots on real recordings: the pictures show what the ranks really sent.

One launch per world size G = 2..6 runs all three all-reduce variants on a length that G does not
always divide (61) and on one every G divides (60), with rank-dependent random inputs checked against
torch.distributed.all_reduce. The plots' data are then read back from the figures and compared with
the recordings, and the recordings with the formulas.
"""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import course_lib  # noqa: E402
from course_lib import allreduce, traffic  # noqa: E402
from course_lib.viz import traffic_plots as tp  # noqa: E402

SIZES = range(2, 7)
VARIANTS = ("naive", "parameter_server", "ring")
UNEVEN, EVEN = 61, 60  # 61 is prime: the ring's chunks differ by one element for every G here


def _run_all_variants(rank, world_size, lengths):
    """Every variant on every length; returns {(variant, N): Recording}. Checks results on the way."""
    recordings = {}
    for numel in lengths:
        generator = torch.Generator().manual_seed(1000 * rank + numel)
        mine = torch.randn(numel, generator=generator, dtype=torch.float64)
        expected = mine.clone()
        dist.all_reduce(expected)
        for variant in VARIANTS:
            tensor = mine.clone()
            with traffic.record() as rec:
                allreduce.get(variant)(tensor)
            # (torch.testing.assert_close would cost a 2 s lazy import in every rank)
            assert torch.allclose(tensor, expected, rtol=1e-12, atol=1e-12), (variant, numel)
            recordings[variant, numel] = rec
    return recordings


@pytest.fixture(scope="module")
def runs():
    """{(variant, N): {G: [Recording of rank 0, 1, ...]}} for G = 2..6."""
    out = {}
    for G in SIZES:
        per_rank = course_lib.launch(_run_all_variants, world_size=G, args=((UNEVEN, EVEN),), backend="gloo")
        for key in per_rank[0]:
            out.setdefault(key, {})[G] = [ranks[key] for ranks in per_rank]
    return out


def _bar_heights(fig, label):
    (container,) = [c for c in fig.axes[0].containers if c.get_label() == label]
    return [bar.get_height() for bar in container]


def _line(fig, label):
    (line,) = [line for line in fig.axes[0].lines if line.get_label() == label]
    return list(line.get_xdata()), list(line.get_ydata())


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("numel", (UNEVEN, EVEN))
def test_recordings_match_exact_schedule(runs, variant, numel):
    for G, recs in runs[variant, numel].items():
        expected = tp.expected_traffic(variant, G, numel)
        for quantity, values in expected.items():
            assert [getattr(rec, quantity) for rec in recs] == values, (variant, G, quantity)
        assert all(rec.bytes_sent == 8 * rec.elements_sent for rec in recs)  # float64


@pytest.mark.parametrize("variant", VARIANTS)
def test_textbook_formulas_hold_when_g_divides_n(runs, variant):
    for G, recs in runs[variant, EVEN].items():
        for quantity in tp.QUANTITIES:
            assert tp.measure(recs, quantity) == tp.formula(variant, quantity, G, EVEN), (variant, G, quantity)


def test_ring_total_is_exact_and_per_rank_within_one_chunk_rounding(runs):
    for G, recs in runs["ring", UNEVEN].items():
        assert tp.measure(recs, "total_sent") == tp.formula("ring", "total_sent", G, UNEVEN)
        # 2(G-1) messages of floor(N/G) or ceil(N/G) elements each
        low, high = 2 * (G - 1) * (UNEVEN // G), 2 * (G - 1) * -(-UNEVEN // G)
        assert all(low <= rec.elements_sent <= high for rec in recs)
        if G > 2:  # (with two ranks each sends both halves once: N either way)
            assert len({rec.elements_sent for rec in recs}) > 1  # uneven chunks really were exercised


@pytest.mark.parametrize("unit", ("bytes", "elements", "messages"))
@pytest.mark.parametrize("variant", VARIANTS)
def test_rank_bars_equal_recordings(runs, variant, unit):
    for G, recs in runs[variant, UNEVEN].items():
        fig = tp.plot_rank_traffic(recs, unit=unit, highlight={0: "master"})
        assert _bar_heights(fig, "sent") == [getattr(rec, f"{unit}_sent") for rec in recs]
        assert _bar_heights(fig, "received") == [getattr(rec, f"{unit}_received") for rec in recs]
        assert fig.axes[0].get_xticklabels()[0].get_text() == "rank 0\n(master)"


@pytest.mark.parametrize("unit", ("bytes", "elements", "messages"))
def test_master_versus_others_plots_measured_loads(runs, unit):
    by_size = runs["parameter_server", UNEVEN]
    fig = tp.plot_master_vs_others(by_size, unit=unit, numel=UNEVEN)
    xs, master = _line(fig, "master (measured)")
    _, others = _line(fig, "other ranks, largest (measured)")
    assert xs == list(SIZES)
    for G, recs in by_size.items():
        loads = [getattr(r, f"{unit}_sent") + getattr(r, f"{unit}_received") for r in recs]
        assert master[xs.index(G)] == loads[0]
        assert others[xs.index(G)] == max(loads[1:])
    # The formula lines pass through the measured points (N elements of 8 bytes, or 1 message).
    per = {"bytes": 8 * UNEVEN, "elements": UNEVEN, "messages": 1}[unit]
    assert master == [2 * (G - 1) * per for G in SIZES]
    assert others == [2 * per for _ in SIZES]
    formula_label = "master, formula 2(G-1)" + {"messages": "", "bytes": "S"}.get(unit, "N")   # S bytes, N elements
    fx, fy = _line(fig, formula_label)
    assert fx[0] == 2 and fx[-1] == 6 and fy[-1] == master[-1]


@pytest.mark.parametrize("quantity", sorted(tp.QUANTITIES))
@pytest.mark.parametrize("unit", ("elements", "bytes"))
def test_traffic_versus_world_size_points_and_formulas(runs, quantity, unit):
    chosen = {variant: runs[variant, EVEN] for variant in VARIANTS}
    fig = tp.plot_traffic_vs_world_size(chosen, numel=EVEN, quantity=quantity, unit=unit)
    scale = 8 if unit == "bytes" else 1
    for variant, by_size in chosen.items():
        label = tp.VARIANT_STYLE[variant]["label"]
        xs, ys = _line(fig, f"{label} (measured)")
        assert xs == list(SIZES)
        assert ys == [tp.measure(by_size[G], quantity, unit) for G in SIZES]
        text = tp.FORMULAS[variant, quantity][1]
        fx, fy = _line(fig, f"{label}: {text}")
        # The formula line goes through every measured point (G divides 60 for G = 2..6).
        for G, y in zip(xs, ys):
            assert fy[fx.index(G)] == pytest.approx(y) == tp.formula(variant, quantity, G, EVEN) * scale


def test_master_is_the_bottleneck_and_ring_is_flat(runs):
    """The lesson of the plots, measured: the master's load grows with G, a ring rank's stays < 2N."""
    ps, ring = runs["parameter_server", EVEN], runs["ring", EVEN]
    master_loads = [tp.measure(ps[G], "busiest") for G in SIZES]
    assert master_loads == sorted(master_loads) and master_loads[-1] == 5 * master_loads[0]
    assert all(tp.measure(ring[G], "max_sent") < 2 * EVEN for G in SIZES)


@pytest.mark.parametrize("variant", VARIANTS)
def test_message_timeline_draws_one_arrow_per_message(runs, variant):
    recs = runs[variant, UNEVEN][4]
    fig = tp.plot_message_timeline(recs)
    arrows = [t for t in fig.axes[0].texts if getattr(t, "arrow_patch", None) is not None]
    assert len(arrows) == sum(rec.messages_sent for rec in recs)
    phases = {t.get_text() for t in fig.axes[0].texts if t.get_text()} & {"exchange", "reduce", "broadcast",
                                                                          "scatter_reduce", "all_gather"}
    assert phases == {e.phase for rec in recs for e in rec.events}


def test_helpful_errors():
    with pytest.raises(ValueError, match="unit"):
        tp.rank_totals([], unit="kilobytes")
    with pytest.raises(ValueError, match="variant"):
        tp.formula("tree", "total_sent", 4, 10)
    with pytest.raises(ValueError, match="quantity"):
        tp.formula("ring", "fastest", 4, 10)
    assert tp.formula("master", "busiest", 4, 10) == 60


def test_traffic_table_lists_every_rank_and_the_totals(runs):
    recs = runs["parameter_server", UNEVEN][5]
    lines = tp.traffic_table(recs, highlight={0: "master"}).splitlines()
    assert lines[1].split()[:2] == ["0", "(master)"]
    for rank, rec in enumerate(recs):
        numbers = [int(word) for word in lines[1 + rank].split() if word.isdigit()][1:]
        assert numbers == [rec.messages_sent, rec.messages_received, rec.bytes_sent, rec.bytes_received]
    totals = [int(word) for word in lines[-1].split()[1:]]
    assert totals == [sum(getattr(r, name) for r in recs)
                      for name in ("messages_sent", "messages_received", "bytes_sent", "bytes_received")]


@pytest.mark.parametrize("world_size", (2, 3, 4, 8))
def test_cost_model_plot_draws_the_model_and_its_crossover(world_size):
    from course_lib import cost

    alpha, beta = 5e-6, 1 / 50e9
    sizes = [2.0 ** k for k in range(3, 31)]
    fig = tp.plot_cost_model(world_size, alpha, beta, variants=("naive", "ring"), sizes=sizes)
    for variant in ("naive", "ring"):
        xs, ys = _line(fig, f"{variant} (model)")
        assert xs == sizes
        assert ys == pytest.approx([cost.predict(variant, world_size, n, alpha, beta) for n in sizes])
    crossings = [line for line in fig.axes[0].lines if line.get_label() == "crossover naive / ring"]
    if world_size == 2:  # same bytes, twice the steps: the ring never catches up
        assert crossings == []
    else:
        (line,) = crossings
        expected = world_size * alpha / ((world_size - 2) * beta)  # (G-1)a + (G-1)nb = 2(G-1)a + 2(G-1)/G nb
        assert line.get_xdata()[0] == pytest.approx(expected)
