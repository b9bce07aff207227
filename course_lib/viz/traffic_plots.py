"""Traffic pictures: who sent how much, and how that grows with the number of ranks.

Everything is drawn from `course_lib.traffic` recordings that the ranks returned from a launch::

    def step(rank, world_size):
        grad = torch.randn(1000)
        with traffic.record() as rec:
            allreduce.parameter_server(grad)
        return rec

    recs = course_lib.launch(step, world_size=4)        # one Recording per rank
    plot_rank_traffic(recs, highlight={0: "master"})    # bars: bytes sent / received per rank

    runs = {"naive": {2: recs_g2, 3: recs_g3, ...}, "ring": {...}}   # recordings per variant and G
    plot_traffic_vs_world_size(runs, numel=1000)        # measured points on top of the formulas

The formulas the course teaches (G ranks, N elements per rank) live here too, in `FORMULAS`, and
`expected_traffic` gives the exact per-rank counts the algorithms in `course_lib.allreduce` must
produce (the ring's chunks differ by one element when G does not divide N).

Every function returns a matplotlib Figure (closed for pyplot, so a notebook shows it once, where it
is returned). Figures have a white background and tell series apart by marker, hatching, line
style and direct labels as well as by colour (the Okabe-Ito palette), so they read in dark themes
and without colour vision.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

from course_lib.allreduce import chunk_sizes
from course_lib.bench import format_bytes

__all__ = [
    "FORMULAS",
    "QUANTITIES",
    "VARIANT_STYLE",
    "formula",
    "rank_totals",
    "measure",
    "expected_traffic",
    "traffic_table",
    "plot_rank_traffic",
    "plot_master_vs_others",
    "plot_traffic_vs_world_size",
    "plot_message_timeline",
    "plot_cost_model",
]

# Okabe & Ito (2008): distinguishable with every common colour-vision deficiency.
_BLUE, _ORANGE, _GREEN, _VERMILLION, _PURPLE, _SKY = "#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9"

# One look per all-reduce variant, used by every plot: colour + marker + line style + name.
VARIANT_STYLE = {
    "naive": dict(color=_VERMILLION, marker="^", linestyle="-", label="naive exchange"),
    "parameter_server": dict(color=_BLUE, marker="s", linestyle="--", label="master (parameter server)"),
    "ring": dict(color=_GREEN, marker="o", linestyle="-.", label="ring"),
}
_ALIASES = {"master": "parameter_server", "ps": "parameter_server"}

# --------------------------------------------------------------------------------------------------
# Formulas: elements, for G ranks each holding N elements
# --------------------------------------------------------------------------------------------------

QUANTITIES = {
    "total_sent": "elements sent, all ranks together",
    "busiest": "busiest rank: sent + received",
    "max_sent": "most any one rank sent",
}

# (variant, quantity) -> (function of G and N, the formula as the course writes it)
FORMULAS: dict[tuple[str, str], tuple[Callable[[float, float], float], str]] = {
    ("naive", "total_sent"): (lambda G, N: G * (G - 1) * N, "G(G-1)N"),
    ("naive", "busiest"): (lambda G, N: 2 * (G - 1) * N, "2(G-1)N"),
    ("naive", "max_sent"): (lambda G, N: (G - 1) * N, "(G-1)N"),
    ("parameter_server", "total_sent"): (lambda G, N: 2 * (G - 1) * N, "2(G-1)N"),
    ("parameter_server", "busiest"): (lambda G, N: 2 * (G - 1) * N, "2(G-1)N"),
    ("parameter_server", "max_sent"): (lambda G, N: (G - 1) * N, "(G-1)N"),
    ("ring", "total_sent"): (lambda G, N: 2 * (G - 1) * N, "2(G-1)N"),
    ("ring", "busiest"): (lambda G, N: 4 * (G - 1) * N / G, "4(G-1)N/G"),
    ("ring", "max_sent"): (lambda G, N: 2 * (G - 1) * N / G, "2(G-1)N/G"),
}


def _variant(name: str) -> str:
    name = _ALIASES.get(name, name)
    if name not in VARIANT_STYLE:
        raise ValueError(f"unknown all-reduce variant {name!r}; choose one of {sorted(VARIANT_STYLE)} or 'master'")
    return name


def formula(variant: str, quantity: str, world_size: float, numel: float) -> float:
    """The textbook count of elements for `variant` and `quantity` (a key of `QUANTITIES`).

    Example::

        >>> formula("ring", "max_sent", world_size=4, numel=1000)
        1500.0
    """
    key = (_variant(variant), quantity)
    if key not in FORMULAS:
        raise ValueError(f"unknown quantity {quantity!r}; choose one of {sorted(QUANTITIES)}")
    return FORMULAS[key][0](world_size, numel)


def expected_traffic(variant: str, world_size: int, numel: int, root: int = 0) -> dict[str, list[int]]:
    """Exact per-rank counts that `course_lib.allreduce.<variant>` must record, from its schedule.

    Unlike the textbook formulas these hold for any N: the ring's chunks are
    ``chunk_sizes(N, G)``, and rank r sends every chunk except (r+1) mod G in the scatter-reduce and
    every chunk except (r+2) mod G in the all-gather; it receives all but chunk r, then all but (r+1).

    Returns:
        dict with lists (index = rank) 'elements_sent', 'elements_received', 'messages_sent',
        'messages_received'.
    """
    variant, G, N = _variant(variant), world_size, numel
    ranks = range(G)
    if variant == "naive":
        sent = received = [(G - 1) * N for _ in ranks]
        msgs_sent = msgs_received = [G - 1 for _ in ranks]
    elif variant == "parameter_server":
        sent = received = [(G - 1) * N if r == root else N for r in ranks]
        msgs_sent = msgs_received = [G - 1 if r == root else 1 for r in ranks]
    else:
        c = chunk_sizes(N, G)
        sent = [2 * N - c[(r + 1) % G] - c[(r + 2) % G] for r in ranks]
        received = [2 * N - c[r] - c[(r + 1) % G] for r in ranks]
        msgs_sent = msgs_received = [2 * (G - 1) for _ in ranks]
    if G == 1:  # a lone rank talks to nobody
        sent = received = msgs_sent = msgs_received = [0]
    return {"elements_sent": list(sent), "elements_received": list(received),
            "messages_sent": list(msgs_sent), "messages_received": list(msgs_received)}


# --------------------------------------------------------------------------------------------------
# Reading recordings
# --------------------------------------------------------------------------------------------------

_UNITS = ("bytes", "elements", "messages")


def rank_totals(recordings: Sequence, unit: str = "bytes") -> tuple[list[int], list[int]]:
    """(sent, received) per rank, in `unit` ('bytes', 'elements' or 'messages').

    Args:
        recordings: one `traffic.Recording` per rank, index = rank (what a launch returns).
    """
    if unit not in _UNITS:
        raise ValueError(f"unit must be one of {_UNITS}, not {unit!r}")
    sent = [getattr(rec, f"{unit}_sent") for rec in recordings]
    received = [getattr(rec, f"{unit}_received") for rec in recordings]
    return sent, received


def measure(recordings: Sequence, quantity: str, unit: str = "elements") -> int:
    """One number from one run's recordings, measured the way `FORMULAS[(variant, quantity)]` counts.

    'total_sent': sum over ranks of what they sent; 'busiest': the largest sent + received of any
    rank; 'max_sent': the largest amount any rank sent.
    """
    sent, received = rank_totals(recordings, unit)
    if quantity == "total_sent":
        return sum(sent)
    if quantity == "busiest":
        return max(s + r for s, r in zip(sent, received))
    if quantity == "max_sent":
        return max(sent)
    raise ValueError(f"unknown quantity {quantity!r}; choose one of {sorted(QUANTITIES)}")


def _bytes_per_element(recordings: Sequence) -> int:
    for rec in recordings:
        for event in rec.events:
            if event.numel:
                return event.nbytes // event.numel
    return 4


def traffic_table(recordings: Sequence, highlight: Mapping[int, str] | None = None) -> str:
    """What every rank sent and received, as a text table (one row per rank, then the totals).

    Example::

        rank        msgs sent  msgs recv  bytes sent  bytes recv
        0 (master)          3          3       12000       12000
        1                   1          1        4000        4000
    """
    names = [f"{r}" + (f" ({highlight[r]})" if highlight and r in highlight else "") for r in range(len(recordings))]
    width = max([len("total")] + [len(n) for n in names])
    columns = ("msgs sent", "msgs recv", "bytes sent", "bytes recv")
    rows = [(name, rec.messages_sent, rec.messages_received, rec.bytes_sent, rec.bytes_received)
            for name, rec in zip(names, recordings)]
    rows.append(("total", *(sum(row[i] for row in rows) for i in range(1, 5))))
    lines = [f"{'rank':<{width}}" + "".join(f"  {c:>10}" for c in columns)]
    lines += [f"{row[0]:<{width}}" + "".join(f"  {v:>10}" for v in row[1:]) for row in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Drawing helpers
# --------------------------------------------------------------------------------------------------


def _figure(width: float, height: float, ncols: int = 1):
    """A figure that pyplot does not hold on to: returned and displayed once, never twice."""
    import matplotlib.pyplot as plt       # here, not at the top: the graders import viz's tags, not its plots

    fig, axes = plt.subplots(1, ncols, figsize=(width, height), squeeze=False, layout="constrained")
    plt.close(fig)
    fig.set_facecolor("white")  # a white card: dark text stays readable in a dark notebook theme
    for ax in axes.ravel():
        ax.set_facecolor("white")
        ax.grid(True, axis="y", color="0.85", linewidth=0.8)
        ax.set_axisbelow(True)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    return fig, list(axes.ravel())


def _human(value: float, unit: str) -> str:
    """480 -> '480', 12_000 -> '12k', 3_500_000 -> '3.5M' (short enough to sit on a bar)."""
    if unit == "messages" or abs(value) < 10_000:
        return f"{value:g}" if isinstance(value, float) else f"{value:d}"
    for factor, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g}{suffix}"
    return f"{value:g}"


# --------------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------------


def plot_rank_traffic(recordings: Sequence, unit: str = "bytes", title: str | None = None,
                      highlight: Mapping[int, str] | None = None):
    """Bars of what every rank sent and received in one run.

    Sent bars are blue with '//' hatching, received bars orange with '..' hatching, and every bar
    carries its value, so nothing depends on telling the colours apart.

    Args:
        recordings: one `traffic.Recording` per rank (index = rank).
        unit: 'bytes', 'elements' or 'messages'.
        title: the figure's title.
        highlight: rank -> label written under that rank, e.g. ``{0: "master"}``.

    Returns:
        The Figure. ``fig.axes[0].containers`` holds the two bar groups, labelled 'sent' and
        'received', whose heights are exactly `rank_totals(recordings, unit)`.
    """
    sent, received = rank_totals(recordings, unit)
    G = len(recordings)
    fig, (ax,) = _figure(max(5.0, 1.5 + 1.0 * G), 3.4)
    width = 0.38
    xs = list(range(G))
    bars_sent = ax.bar([x - width / 2 for x in xs], sent, width, label="sent", color=_BLUE,
                       hatch="//", edgecolor="black", linewidth=0.6)
    bars_received = ax.bar([x + width / 2 for x in xs], received, width, label="received", color=_ORANGE,
                           hatch="..", edgecolor="black", linewidth=0.6)
    for bars, values in ((bars_sent, sent), (bars_received, received)):
        ax.bar_label(bars, labels=[_human(v, unit) for v in values], padding=2, fontsize=7)
    names = [f"rank {r}" + (f"\n({highlight[r]})" if highlight and r in highlight else "") for r in xs]
    ax.set_xticks(xs, names)
    ax.set_ylabel(f"{unit} per rank")
    ax.set_ylim(0, max(sent + received + [1]) * 1.18)  # room for the value labels
    ax.legend(loc="upper right", frameon=False, ncols=2)
    ax.set_title(title or f"what each of {G} ranks sent and received ({unit})", fontsize=11)
    return fig


def plot_master_vs_others(runs: Mapping[int, Sequence], root: int = 0, unit: str = "bytes",
                          numel: int | None = None, title: str | None = None):
    """The master's load against every other rank's, as the number of ranks G grows.

    Load = sent + received by one rank in one all-reduce through the master (parameter server).

    Args:
        runs: G -> the recordings (one per rank) of a parameter-server all-reduce on G ranks.
        root: the master's rank.
        unit: 'bytes', 'elements' or 'messages'.
        numel: N, the elements per rank; when given, the formulas 2(G-1)N (master) and 2N (any other
            rank) are drawn as lines under the measured points (scaled to bytes when unit='bytes').

    Returns:
        The Figure. Its lines labelled 'master (measured)' and 'other ranks, largest (measured)'
        hold the plotted points.
    """
    sizes = sorted(runs)
    master, others = [], []
    for G in sizes:
        sent, received = rank_totals(runs[G], unit)
        loads = [s + r for s, r in zip(sent, received)]
        master.append(loads[root])
        others.append(max(load for r, load in enumerate(loads) if r != root))
    fig, (ax,) = _figure(5.6, 3.6)
    if numel is not None and unit != "messages":
        scale = _bytes_per_element(runs[sizes[0]]) if unit == "bytes" else 1
        letter = "S" if unit == "bytes" else "N"   # S bytes, N elements (docs/notation.md)
        dense = _dense(sizes)
        ax.plot(dense, [2 * (G - 1) * numel * scale for G in dense], color=_BLUE, linestyle="--",
                linewidth=1.2, label=f"master, formula 2(G-1){letter}")
        ax.plot(dense, [2 * numel * scale for _ in dense], color=_ORANGE, linestyle=":", linewidth=1.5,
                label=f"other rank, formula 2{letter}")
    elif unit == "messages":
        dense = _dense(sizes)
        ax.plot(dense, [2 * (G - 1) for G in dense], color=_BLUE, linestyle="--", linewidth=1.2,
                label="master, formula 2(G-1)")
        ax.plot(dense, [2 for _ in dense], color=_ORANGE, linestyle=":", linewidth=1.5,
                label="other rank, formula 2")
    ax.plot(sizes, master, color=_BLUE, marker="s", markersize=8, linestyle="none", label="master (measured)")
    ax.plot(sizes, others, color=_ORANGE, marker="o", markersize=7, markerfacecolor="white",
            markeredgewidth=2, linestyle="none", label="other ranks, largest (measured)")
    # Name the series at their right ends too: readable in greyscale.
    ax.annotate(f"master: {_human(master[-1], unit)}", (sizes[-1], master[-1]), textcoords="offset points",
                xytext=(-8, 8), ha="right", fontsize=9)
    ax.annotate(f"each other rank: {_human(others[-1], unit)}", (sizes[-1], others[-1]),
                textcoords="offset points", xytext=(-8, 8), ha="right", fontsize=9)
    ax.set_xticks(sizes)
    ax.set_xlabel("number of ranks G")
    ax.set_ylabel(f"{unit} sent + received by one rank")
    ax.set_ylim(0, max(master + others) * 1.15)
    ax.legend(loc="upper left", frameon=False, fontsize=8)
    ax.set_title(title or "the master carries the whole conversation", fontsize=11)
    return fig


def _dense(sizes: Sequence[int]) -> list[float]:
    """Points between the smallest and largest G, so a formula draws as a smooth line."""
    lo, hi = min(sizes), max(sizes)
    steps = max(1, 20 * (hi - lo))
    return [lo + (hi - lo) * i / steps for i in range(steps + 1)]


def plot_traffic_vs_world_size(runs: Mapping[str, Mapping[int, Sequence]], numel: int,
                               quantity: str = "max_sent", unit: str = "elements", title: str | None = None,
                               log_y: bool = False):
    """Measured traffic of each all-reduce variant against G, over the formula it should follow.

    Each variant gets one colour, one marker and one line style; the measured points are markers,
    the formula a line, and the formula's text is written at the line's end.

    Args:
        runs: variant name ('naive', 'parameter_server' or 'master', 'ring') -> {G: recordings of one
            all-reduce of `numel` elements on G ranks}.
        numel: N, elements per rank (the formulas need it).
        quantity: a key of `QUANTITIES`: 'max_sent', 'busiest' or 'total_sent'.
        unit: 'elements' or 'bytes'.
        log_y: logarithmic y axis (useful for 'total_sent', where naive grows as G squared).

    Returns:
        The Figure. For each variant, the line labelled '<label> (measured)' holds the measured
        points `measure(runs[variant][G], quantity, unit)`, and '<label>: <formula>' the formula.
    """
    if unit not in ("elements", "bytes"):
        raise ValueError("unit must be 'elements' or 'bytes' (the formulas count elements)")
    if quantity not in QUANTITIES:
        raise ValueError(f"unknown quantity {quantity!r}; choose one of {sorted(QUANTITIES)}")
    fig, (ax,) = _figure(6.4, 4.0)
    all_sizes, tops = set(), []
    line_ends: dict = {}  # (x, y) where a formula line ends -> the texts to write there
    for name, by_size in runs.items():
        variant = _variant(name)
        style = VARIANT_STYLE[variant]
        sizes = sorted(by_size)
        all_sizes.update(sizes)
        scale = _bytes_per_element(by_size[sizes[0]]) if unit == "bytes" else 1
        measured = [measure(by_size[G], quantity, unit) for G in sizes]
        function, text = FORMULAS[(variant, quantity)]
        dense = _dense(sizes)
        predicted = [function(G, numel) * scale for G in dense]
        ax.plot(dense, predicted, color=style["color"], linestyle=style["linestyle"], linewidth=1.4,
                label=f"{style['label']}: {text}")
        ax.plot(sizes, measured, linestyle="none", label=f"{style['label']} (measured)", **_marker(variant))
        line_ends.setdefault((dense[-1], predicted[-1]), []).append(f"{style['label']}: {text}")
        tops += measured + predicted
    if quantity == "max_sent" and "ring" in {_variant(name) for name in runs}:
        limit = 2 * numel * (_bytes_per_element(next(iter(runs["ring"].values()))) if unit == "bytes" else 1)
        ax.axhline(limit, color="0.35", linestyle=":", linewidth=1.2, label="2N: the ring's limit as G grows")
        tops.append(limit)
    # Variants whose lines coincide (naive and master for 'max_sent') share one label.
    for (x, y), texts in line_ends.items():
        ax.annotate("\n".join(texts), (x, y), textcoords="offset points", xytext=(6, 0), va="center", fontsize=8)
    ax.set_xticks(sorted(all_sizes))
    ax.set_xlim(min(all_sizes) - 0.3, max(all_sizes) + 0.3 + 0.45 * (max(all_sizes) - min(all_sizes) + 1))
    ax.set_xlabel("number of ranks G")
    ax.set_ylabel(f"{unit}: {QUANTITIES[quantity]}")
    if log_y:
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: _human(int(round(value)), unit)))
        ax.yaxis.set_minor_formatter(NullFormatter())
    else:
        ax.set_ylim(0, max(tops) * 1.12)
    ax.legend(loc="upper left", frameon=False, fontsize=8)
    ax.set_title(title or f"{QUANTITIES[quantity]}, N = {numel} elements per rank", fontsize=11)
    return fig


def _marker(variant: str) -> dict:
    """Marker style of a variant's measured points. Sizes differ so that coinciding points stay
    visible: a small filled triangle inside a large hollow square inside a ring of circles."""
    style = VARIANT_STYLE[variant]
    sizes = {"naive": 6, "parameter_server": 12, "ring": 8}
    filled = variant != "parameter_server"
    return dict(color=style["color"], marker=style["marker"], markersize=sizes[variant],
                markerfacecolor=style["color"] if filled else "none",
                markeredgecolor="black" if filled else style["color"], markeredgewidth=0.7 if filled else 2.0)


def plot_message_timeline(recordings: Sequence, title: str | None = None, show_chunks: bool = True):
    """Every message of one run as an arrow from sender to receiver, one column per step.

    Ranks are horizontal lanes. Columns follow the phases the algorithm labelled ('reduce',
    'broadcast', 'scatter_reduce', ...), left to right in the order they happened; within a phase a
    message sits at its `step` (or, unlabelled, at its position among that rank's sends). Phases are
    named above the plot and drawn with different line styles, not only colours.

    Returns:
        The Figure; ``fig.axes[0].patches`` holds one arrow per message sent.
    """
    G = len(recordings)
    phases: list = []
    placed = []  # (phase, column within phase, sender, event)
    for rank, rec in enumerate(recordings):
        # Phase order = order of first appearance in any rank's events, received ones included
        # (a parameter server's root receives in 'reduce' before it sends anything).
        for event in rec.events:
            if event.phase not in phases:
                phases.append(event.phase)
        counter: dict = {}
        for event in rec.sends:
            index = counter.get(event.phase, 0)
            counter[event.phase] = index + 1
            placed.append((event.phase, event.step if event.step is not None else index, rank, event))
    widths = {p: 1 + max(col for ph, col, _, _ in placed if ph == p) for p in phases}
    offsets, start = {}, 0
    for p in phases:
        offsets[p] = start
        start += widths[p]
    columns = max(start, 1)
    fig, (ax,) = _figure(max(5.0, 1.6 + 0.9 * columns), max(2.6, 0.55 * G + 1.4))
    ax.grid(False)
    colours = [_BLUE, _VERMILLION, _GREEN, _PURPLE, _ORANGE, _SKY]
    linestyles = ["-", "--", "-.", ":"]
    for i, p in enumerate(phases):
        if i % 2:
            ax.axvspan(offsets[p] - 0.5, offsets[p] + widths[p] - 0.5, color="0.93", zorder=0)
        ax.text(offsets[p] + widths[p] / 2 - 0.5, 1.0, p or "(no phase)", transform=ax.get_xaxis_transform(),
                ha="center", va="bottom", fontsize=9, fontweight="bold")
    for r in range(G):
        ax.axhline(r, color="0.6", linewidth=0.8, zorder=1)
    for phase_name, col, sender, event in placed:
        i = phases.index(phase_name)
        x = offsets[phase_name] + col
        # Several messages can share a column (everyone sends at step 0): nudge by sender.
        x += (sender - (G - 1) / 2) * min(0.6 / max(G, 1), 0.12)
        ax.annotate("", xy=(x, event.peer), xytext=(x, sender),
                    arrowprops=dict(arrowstyle="-|>", color=colours[i % len(colours)],
                                    linestyle=linestyles[i % len(linestyles)], linewidth=1.3, shrinkA=2, shrinkB=2))
        ax.plot([x], [sender], marker="o", markersize=3.5, color="black", zorder=3)
        if show_chunks and event.chunk is not None:
            ax.text(x + 0.05, (sender + event.peer) / 2, f"c{event.chunk}", fontsize=7, va="center")
    ax.set_yticks(range(G), [f"rank {r}" for r in range(G)])
    ax.set_ylim(G - 0.4, -0.6)  # rank 0 on top
    ax.set_xlim(-0.6, columns - 0.4)
    ax.set_xticks(range(columns), [str(c - offsets[p]) for p in phases for c in range(offsets[p], offsets[p] + widths[p])]
                  if phases else [])
    labelled = show_chunks and any(event.chunk is not None for *_, event in placed)
    ax.set_xlabel("step within phase (arrow: sender -> receiver" + ("; c3 = chunk 3)" if labelled else ")"))
    ax.set_title(title or f"messages of one run on {G} ranks", fontsize=11, pad=18)
    return fig


def plot_cost_model(world_size: int, alpha: float, beta: float, variants: Sequence[str] = ("naive", "ring"),
                    sizes: Sequence[float] | None = None, measured=None, title: str | None = None):
    """Modelled time of each variant against the message size (alpha-beta model), crossovers marked.

    Lines are `course_lib.cost.predict` (model, not measurement, and labelled so); where two
    variants' lines cross, a vertical line marks `course_lib.cost.crossover_bytes`. Measured medians
    (`course_lib.bench.Results`) can be drawn on top as markers.

    Args:
        world_size: G.
        alpha: seconds per step; beta: seconds per byte.
        variants: names known to `course_lib.cost` ('naive', 'parameter_server', 'ring', ...).
        sizes: bytes per rank for the x axis (default: 8 B to 1 GiB).
        measured: optional `bench.Results`; the records of these variants on `world_size` ranks are drawn.

    Returns:
        The Figure. Lines labelled '<variant> (model)' hold the modelled seconds; the crossover lines
        are labelled 'crossover <a> / <b>' and sit at x = the crossover size.
    """
    import math

    from course_lib import cost

    sizes = list(sizes) if sizes is not None else [2.0 ** k for k in range(3, 31)]
    fig, (ax,) = _figure(6.4, 4.0)
    slowest = 0.0
    for i, name in enumerate(variants):
        variant = _variant(name)
        style = VARIANT_STYLE[variant]
        seconds = [float(cost.predict(variant, world_size, n, alpha, beta)) for n in sizes]
        slowest = max(slowest, *seconds)
        ax.plot(sizes, seconds, color=style["color"], linestyle=style["linestyle"], linewidth=1.6,
                label=f"{variant} (model)")
        ax.annotate(f"{style['label']}\n{cost.model_for(variant).formula}", (sizes[-1], seconds[-1]),
                    textcoords="offset points", xytext=(4, 10 - 20 * (i % 2)), va="center", fontsize=7)
        if measured is not None:
            rows = sorted((r for r in measured if r.variant == variant and r.world_size == world_size),
                          key=lambda r: r.nbytes)
            if rows:
                ax.plot([r.nbytes for r in rows], [r.median for r in rows], linestyle="none",
                        label=f"{variant} (measured median)", **_marker(variant))
    for i, a in enumerate(variants):
        for b in variants[i + 1:]:
            n = cost.crossover_bytes(_variant(a), _variant(b), world_size, alpha, beta)
            if math.isfinite(n) and sizes[0] <= n <= sizes[-1]:
                ax.axvline(n, color="black", linestyle=":", linewidth=1.0, label=f"crossover {_variant(a)} / {_variant(b)}")
                ax.annotate(f"crossover\n{format_bytes(n)}", (n, 1.0), xycoords=ax.get_xaxis_transform(),
                            xytext=(3, -3), textcoords="offset points", va="top", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    low, high = math.ceil(math.log2(sizes[0])), math.floor(math.log2(sizes[-1]))
    ticks = [2.0 ** k for k in range(low, high + 1, max(1, (high - low) // 6))]
    ax.set_xticks(ticks, [format_bytes(t) for t in ticks], fontsize=8)
    ax.grid(True, which="major", axis="both", color="0.88", linewidth=0.7)
    ax.set_xlabel("bytes per rank (log scale)")
    ax.set_ylabel("seconds per all-reduce (log scale)")
    ax.set_xlim(sizes[0], sizes[-1] * 64)  # room for the line labels
    ax.set_ylim(top=slowest * 6)
    ax.legend(loc="upper left", frameon=False, fontsize=7)
    bandwidth = f"{1 / beta / 1e9:.3g} GB/s" if beta > 0 else "unlimited"
    ax.set_title(title or f"alpha-beta model, G = {world_size}: alpha = {alpha * 1e6:.3g} us, 1/beta = {bandwidth}",
                 fontsize=10)
    return fig
