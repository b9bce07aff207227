"""Pictures of every rank's buffer: one row per rank, one cell per element or chunk.

A cell is coloured by the ranks whose data it holds. A value that came from one rank gets that
rank's colour and hatching; a reduced value holds several ranks' contributions and is drawn as
stripes, one per contributing rank, with a label such as "a+b+c". Ranks are named by letters,
rank 0 = a, rank 1 = b, ..., the way the ring diagrams name GPU-0's data a, GPU-1's data b.
Colours alone never carry the meaning: every cell has a text label too.

Where do the labels come from? From the numbers the ranks really computed. `tag` gives every
(rank, piece) a number whose sums can be read back:

    tag(rank, piece, G) = 2**rank + piece * 2**G

Adding the tags of a set S of ranks for the same piece gives  sum(2**r for r in S) + |S| * piece * 2**G.
The low G bits are a bitmask of S, the rest says which piece it is, so `decode_tag` recovers
"which ranks contributed to this value" from the value alone. With G = 4: rank 2's piece 1 is
4 + 16 = 20, and a+b+c+d of piece 1 is 15 + 4 * 16 = 79.

Example::

    >>> from course_lib import viz
    >>> viz.tag(rank=2, piece=1, world_size=4)
    20.0
    >>> viz.decode_tag(79.0, world_size=4)
    (frozenset({0, 1, 2, 3}), 1)
    >>> viz.provenance_label({0, 1, 2, 3}, world_size=4)
    'a+b+c+d'
"""

from __future__ import annotations

import contextlib
import io
import re
import string
import struct

import torch

from course_lib.allreduce import chunk_sizes

__all__ = [
    "rank_name", "rank_names", "rank_color", "rank_hatch", "provenance_label",
    "tag", "tagged_tensor", "decode_tag", "decode_chunks",
    "draw_cells", "draw_buffers", "draw_chunks", "draw_before_after",
]

# Okabe & Ito's palette, built to stay distinguishable with the common colour-vision deficiencies.
PALETTE = ["#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7", "#999999"]
# A second cue that survives greyscale printing and colour blindness. Seven patterns against eight
# colours, so ranks 0..55 never share both.
HATCHES = ["", "//", "++", "\\\\", "xx", "--", "||"]  # no dots: a dotted hatch is 60 KB in an SVG
EMPTY_COLOR = "#f2f2f2"
_SUBSCRIPTS = str.maketrans("0123456789", "₀₁₂₃₄₅₆₇₈₉")


# --------------------------------------------------------------------------------------------------
# Names, colours, labels
# --------------------------------------------------------------------------------------------------


def rank_name(rank: int) -> str:
    """The letter for `rank`: 0 -> 'a', 1 -> 'b', ..., 25 -> 'z', 26 -> 'a1', ..."""
    letter, lap = string.ascii_lowercase[rank % 26], rank // 26
    return letter if lap == 0 else f"{letter}{lap}"


def rank_names(world_size: int) -> list[str]:
    """The letters for ranks 0 .. world_size - 1."""
    return [rank_name(r) for r in range(world_size)]


def rank_color(rank: int) -> str:
    return PALETTE[rank % len(PALETTE)]


def rank_hatch(rank: int) -> str:
    return HATCHES[rank % len(HATCHES)]


def _ring_order(ranks: frozenset, world_size: int) -> list[int]:
    """The ranks in ring order starting where a contiguous run starts (e.g. {3, 0, 1} -> 3, 0, 1)."""
    ordered = sorted(ranks)
    if world_size and len(ranks) < world_size:
        for start in ordered:
            run = [(start + k) % world_size for k in range(len(ranks))]
            if set(run) == set(ranks):
                return run
    return ordered


def provenance_label(ranks, world_size: int | None = None, piece: int | None = None) -> str:
    """A short text for "the sum of these ranks' contributions".

    Up to four ranks are spelled out ("d+a+b", in ring order when they form a run round the ring);
    more are shortened to "first+…+last". `piece`, if given, is added as a subscript: "c₂", "(a+b)₂".
    An empty set gives "".
    """
    ranks = frozenset(ranks)
    if not ranks:
        return ""
    order = _ring_order(ranks, world_size or 0)
    names = [rank_name(r) for r in order]
    text = "+".join(names) if len(names) <= 4 else f"{names[0]}+…+{names[-1]}"
    if piece is None:
        return text
    sub = str(piece).translate(_SUBSCRIPTS)
    return f"{text}{sub}" if len(names) == 1 else f"({text}){sub}"


# --------------------------------------------------------------------------------------------------
# Values that say where they came from
# --------------------------------------------------------------------------------------------------


def tag(rank: int, piece: int, world_size: int) -> float:
    """The number rank `rank` puts in piece `piece`: 2**rank + piece * 2**world_size.

    Sums of tags over ranks stay readable by `decode_tag`. Exact in float32 while the sum stays
    below 2**24 (world_size <= 8 with up to 64 pieces, for example).
    """
    return float(2 ** rank + piece * 2 ** world_size)


def tagged_tensor(rank: int, world_size: int, numel: int, *, device=None, dtype=torch.float32) -> torch.Tensor:
    """A 1-D tensor of `numel` elements cut like the ring cuts it (torch.tensor_split into world_size
    chunks); every element of chunk c holds tag(rank, c, world_size)."""
    tensor = torch.empty(numel, device=device, dtype=dtype)
    for index, chunk in enumerate(torch.tensor_split(tensor, world_size)):
        chunk.fill_(tag(rank, index, world_size))
    return tensor


def decode_tag(value, world_size: int):
    """Read a sum of tags back: returns (frozenset of contributing ranks, piece index).

    Returns (frozenset(), None) for 0, which the pictures draw as an empty slot.

    A tag cannot catch everything: a contribution added twice can read as another rank's
    (a + a = b for piece 0). Compare with the replay of the recorded messages
    (`viz.chunk_history`), which counts every message once.

    Raises:
        ValueError: if `value` is not a sum of tags of distinct ranks for one piece.
    """
    number = float(value)
    if number == 0:
        return frozenset(), None
    if number != int(number) or number < 0:
        raise ValueError(f"{value!r} is not a sum of course_lib.viz.tag values (not a non-negative integer).")
    number = int(number)
    mask, rest = number % 2 ** world_size, number // 2 ** world_size
    ranks = frozenset(r for r in range(world_size) if mask >> r & 1)
    if not ranks or rest % len(ranks):
        raise ValueError(f"{value!r} is not a sum of course_lib.viz.tag values for world_size={world_size}: "
                         f"its low bits name ranks {sorted(ranks)} but the rest, {rest}, is not a multiple of "
                         f"{len(ranks)}.")
    return ranks, rest // len(ranks)


def decode_chunks(tensor, world_size: int) -> list[frozenset]:
    """Which ranks' contributions each ring chunk of `tensor` holds, read from its values.

    `tensor` is cut into world_size chunks with torch.tensor_split, as the ring cuts it. Every
    element of chunk c must decode to the same set of ranks and to piece c (as `tagged_tensor`
    made it); anything else means data ended up in the wrong place, and raises ValueError.

    Returns:
        One frozenset of ranks per chunk; None for an empty chunk (fewer elements than ranks),
        which has no values to read.
    """
    flat = torch.as_tensor(tensor).detach().reshape(-1).cpu()
    result = []
    for index, chunk in enumerate(torch.tensor_split(flat, world_size)):
        decoded = {decode_tag(v, world_size) for v in chunk.tolist()}
        if not decoded:
            result.append(None)
            continue
        if len(decoded) > 1:
            raise ValueError(f"chunk {index} mixes values from different sources: "
                             f"{sorted((sorted(r), p) for r, p in decoded)}")
        ranks, piece = decoded.pop()
        if piece not in (index, None):
            raise ValueError(f"chunk {index} holds piece {piece}: data landed in the wrong chunk.")
        result.append(ranks)
    return result


# --------------------------------------------------------------------------------------------------
# Drawing
# --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _style():
    """Black on white whatever the notebook's theme or matplotlib style: the PNG carries its own
    opaque background, so it reads the same in light and dark Jupyter themes."""
    import matplotlib

    with matplotlib.rc_context({
        "figure.facecolor": "white", "axes.facecolor": "white", "savefig.facecolor": "white",
        "text.color": "black", "axes.labelcolor": "black", "axes.edgecolor": "black",
        "xtick.color": "black", "ytick.color": "black", "font.size": 9, "hatch.linewidth": 0.6,
        "figure.dpi": 80,
        # The cells are axis-aligned rectangles: without antialiasing they look the same and the
        # PNG stored in the notebook is about a third smaller.
        "patch.antialiased": False,
    }):
        yield


# Jupyter shows a figure's PNG at one PNG pixel per CSS pixel. On a high-density screen (device
# pixel ratio 2) that is a low-resolution raster scaled up: blurry text. So the figures drawn here
# render at PIXEL_RATIO times their size and tell the notebook the size to display them at.
PIXEL_RATIO = 2

_figure_class = None


def _sharp_figure_class():
    """matplotlib's Figure, shown in Jupyter as a PNG at PIXEL_RATIO x its pixel size (made on first use,
    so importing course_lib.viz does not import matplotlib)."""
    global _figure_class
    if _figure_class is None:
        from matplotlib.figure import Figure

        class SharpFigure(Figure):
            """A Figure whose notebook picture stays sharp on high-density screens.

            Same text/plain as any Figure ("<Figure size 640x480 with 1 Axes>"), so stored notebook
            outputs compare as before; the PNG has PIXEL_RATIO times the pixels, and its width and
            height metadata say how large to show it (IPython's "retina" format, for these figures only).
            """

            def __repr__(self):
                return super().__repr__().replace(type(self).__name__, "Figure", 1)

        _figure_class = SharpFigure
    _register_png_formatter(_figure_class)
    return _figure_class


def notebook_png(fig) -> tuple[bytes, dict]:
    """(PNG bytes at PIXEL_RATIO x the figure's pixels, {"width", "height"} to show it at, and
    "caption": the figure's title): what a notebook stores for a course_lib figure."""
    png = _256_colours(figure_png(fig, PIXEL_RATIO))
    width, height = struct.unpack(">II", png[16:24])  # the PNG's IHDR chunk
    metadata = {"width": width // PIXEL_RATIO, "height": height // PIXEL_RATIO}
    title = _title_of(fig)
    if title:   # the caption tools/build_book.py puts under the figure
        metadata["caption"] = title
    return png, metadata


def _256_colours(png: bytes) -> bytes:
    """The same picture with a palette of 256 colours: these tables and bars have a few dozen, so it
    looks the same, and the twice-as-large PNG costs no more than the old one did."""
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - matplotlib depends on Pillow
        return png
    image = Image.open(io.BytesIO(png)).convert("RGB")
    buffer = io.BytesIO()
    image.quantize(256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(buffer, "PNG", optimize=True)
    return buffer.getvalue()


def _title_of(fig) -> str:
    """The figure's title: its suptitle, else its first Axes title."""
    if fig._suptitle is not None and fig._suptitle.get_text():
        return fig._suptitle.get_text()
    for ax in fig.axes:
        for loc in ("center", "left", "right"):
            if ax.get_title(loc=loc):
                return ax.get_title(loc=loc)
    return ""


def _register_png_formatter(figure_class) -> None:
    """In IPython, show `figure_class` figures with `notebook_png`. (A `_repr_png_` or
    `_repr_mimebundle_` method would not do: the inline backend's formatter for Figure wins over both.)"""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None:
        return
    formatter = shell.display_formatter.formatters["image/png"]
    if formatter.type_printers.get(figure_class) is not notebook_png:
        formatter.for_type(figure_class, notebook_png)


def figure_png(fig, scale: float = 1.0) -> bytes:
    """The figure as PNG bytes at `scale` x its dpi, cropped to what is drawn (as Jupyter crops it)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=fig.dpi * scale, bbox_inches="tight",
                facecolor=fig.get_facecolor(), edgecolor=fig.get_edgecolor())
    return buffer.getvalue()


def figure_svg(fig) -> bytes:
    """The figure as SVG bytes, identical on every run: text kept as text (small, sharp at any zoom),
    no date, and the ids matplotlib invents from a fixed salt instead of a random one."""
    import matplotlib

    buffer = io.BytesIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "course_lib"}):
        fig.savefig(buffer, format="svg", bbox_inches="tight", metadata={"Date": None},
                    facecolor=fig.get_facecolor(), edgecolor=fig.get_edgecolor())
    # Coordinates to 1/100 of a point (matplotlib writes 6 decimals): a third smaller, the same picture.
    return re.sub(rb"(\d\.\d\d)\d+", rb"\1", buffer.getvalue())


def _new_figure(width: float, height: float, nrows: int = 1, ncols: int = 1, *, title: str | None = None,
                **kwargs):
    import matplotlib.pyplot as plt

    if title:  # wide enough for the title (about 11 characters per inch at 10-11 points)
        width = max(width, 0.5 + len(title) / 11)

    fig, axes = plt.subplots(nrows, ncols, figsize=(width, height), squeeze=False,
                             FigureClass=_sharp_figure_class(), **kwargs)
    # Close it at once: pyplot forgets it, so the notebook shows it only when the function's
    # caller displays the returned Figure (no second copy at the end of the cell).
    plt.close(fig)
    return fig, axes


def _cell_text(ranks, world_size, piece, value, show_values):
    label = provenance_label(ranks or (), world_size, piece)
    if show_values and value is not None:
        number = f"{value:g}" if isinstance(value, float) else str(value)
        return f"{label}\n{number}" if label else number
    return label


def draw_cells(ax, cells, world_size: int, *, texts=None, outlined=(), dashed=(), row_labels=None,
               column_labels=None, cell_width: float = 0.8, fontsize: float = 8.0) -> None:
    """Draw a table of provenance cells into `ax` (the building block of every picture here).

    Args:
        ax: a matplotlib Axes; its frame and ticks are switched off.
        cells: cells[r][c] is a set of ranks (whose contributions the cell holds), or None for a
            slot that holds nothing yet. Rows may have different lengths.
        world_size: G, for labels and for marking complete cells (all G ranks) in bold.
        texts: texts[r][c] to write in the cell instead of the provenance label.
        outlined: (row, column) pairs drawn with a thick outline (e.g. changed in this step).
        dashed: (row, column) pairs drawn with a dashed outline (e.g. sent in this step).
        row_labels, column_labels: defaults "rank r · letter" and no column labels.
        cell_width: the part of each column the cell fills; the rest, on the left, is left free
            for arrows.

    The texts it adds carry a gid: 'cell', 'row label' or 'column label' (tests read them back).
    """
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Rectangle

    outlined, dashed = set(outlined), set(dashed)
    ncols = max((len(row) for row in cells), default=0)
    gap, height = 1.0 - cell_width, 0.84
    stripes = {}                         # hatch -> ([rectangles], [colours]): one collection each
    empty, frames, thick, dash = [], [], [], []
    for r, row in enumerate(cells):
        for c, ranks in enumerate(row):
            x0, y0 = c + gap, r + 0.08
            box = lambda: Rectangle((x0, y0), cell_width, height)  # noqa: E731
            if not ranks:
                empty.append(box())
            else:
                members = sorted(ranks)
                width = cell_width / len(members)
                for k, member in enumerate(members):
                    # Hatching tells single ranks apart without colour; a reduced cell's stripes are
                    # narrow and its label names every member, so they stay plain (and the PNG small).
                    hatch = rank_hatch(member) if len(members) == 1 else ""
                    patches, colours = stripes.setdefault(hatch, ([], []))
                    patches.append(Rectangle((x0 + k * width, y0), width, height))
                    colours.append(rank_color(member))
                frames.append(box())
            if (r, c) in outlined:
                thick.append(box())
            if (r, c) in dashed:
                dash.append(box())
            text = texts[r][c] if texts is not None else provenance_label(ranks or (), world_size)
            if text:
                complete = ranks is not None and len(ranks) == world_size and world_size > 1
                size = fontsize if max(len(line) for line in text.split("\n")) <= 5 else fontsize * 0.85
                ax.text(x0 + cell_width / 2, y0 + height / 2, text, ha="center", va="center", gid="cell",
                        fontsize=size, fontweight="bold" if complete else "normal", linespacing=1.0, zorder=3,
                        bbox=dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none"))
    for hatch, (patches, colours) in stripes.items():
        ax.add_collection(PatchCollection(patches, facecolors=colours, edgecolors=(0, 0, 0, 0.35),
                                          linewidths=0, hatch=hatch or None, zorder=1))
    for patches, style in ((empty, dict(facecolors=EMPTY_COLOR, edgecolors="#999999", linewidths=0.6,
                                        linestyles=":")),
                           (frames, dict(facecolors="none", edgecolors="#333333", linewidths=0.6)),
                           (thick, dict(facecolors="none", edgecolors="black", linewidths=2.6)),
                           (dash, dict(facecolors="none", edgecolors="black", linewidths=1.4, linestyles="--"))):
        if patches:
            ax.add_collection(PatchCollection(patches, zorder=2, **style))
    ax.set_xlim(-0.05, max(ncols, 1) + 0.05)
    # Rank 0 at the top, and room above the first row for the column labels.
    label_lines = max((str(name).count("\n") + 1 for name in column_labels or []), default=0)
    ax.set_ylim(len(cells) + 0.05, -0.05 - 0.28 * label_lines)
    ax.axis("off")
    # Labels as plain texts outside the axes (cheaper than ticks); tight_layout makes room for them.
    names = row_labels if row_labels is not None else [f"rank {r} · {rank_name(r)}" for r in range(len(cells))]
    for r, name in enumerate(names):
        ax.text(-0.1, r + 0.5, name, ha="right", va="center", gid="row label", clip_on=False)
    for c, name in enumerate(column_labels or []):
        ax.text(c + gap + cell_width / 2, -0.12, name, ha="center", va="bottom", fontsize=fontsize * 0.9,
                gid="column label", clip_on=False)


def _decoded_rows(buffers, world_size, show_pieces, show_values):
    """Turn each rank's tagged values into (cells, texts)."""
    cells, texts = [], []
    for buffer in buffers:
        if buffer is None:
            cells.append([]), texts.append([])
            continue
        values = torch.as_tensor(buffer).detach().reshape(-1).cpu().tolist()
        row_cells, row_texts = [], []
        for value in values:
            try:
                ranks, piece = decode_tag(value, world_size)
            except ValueError:  # not a tag: show the bare number on a neutral cell
                ranks, piece = None, None
                row_cells.append(None), row_texts.append(f"{value:g}")
                continue
            row_cells.append(ranks or None)
            row_texts.append(_cell_text(ranks, world_size, piece if show_pieces else None,
                                        value if ranks else None, show_values))
        cells.append(row_cells), texts.append(row_texts)
    return cells, texts


def draw_buffers(buffers, world_size: int, *, title: str | None = None, show_pieces: bool = True,
                 show_values: bool = True, column_labels=None, row_labels=None, ax=None):
    """Draw every rank's buffer from the values the ranks really hold.

    Args:
        buffers: buffers[r] is rank r's buffer: a tensor or a list of numbers (one cell per
            element) or None (nothing to show). Values made with `tag` and summed are labelled
            with the ranks they contain ("a+b", with the piece as a subscript); 0 is an empty slot;
            any other number is shown as it is, on a grey cell.
        world_size: G.
        title: drawn above the table.
        show_pieces: add the piece subscript to the labels ("c₂").
        show_values: print the raw number under each label.
        ax: draw into this Axes instead of a new figure.

    Returns:
        The matplotlib Figure.

    Example::

        >>> buffers = [viz.tagged_tensor(r, 3, 3) for r in range(3)]
        >>> fig = viz.draw_buffers(buffers, world_size=3, title="before")
    """
    cells, texts = _decoded_rows(buffers, world_size, show_pieces, show_values)
    ncols = max((len(row) for row in cells), default=1)
    own_figure = ax is None
    with _style():
        if own_figure:
            fig, axes = _new_figure(1.2 + 0.9 * max(ncols, 1), 0.5 + 0.55 * len(cells), title=title)
            ax = axes[0][0]
        draw_cells(ax, cells, world_size, texts=texts, column_labels=column_labels, row_labels=row_labels)
        if title:
            ax.set_title(title, fontsize=10, loc="left", pad=6)
        if own_figure:
            ax.figure.tight_layout()
        return ax.figure


def draw_chunks(tensors, world_size: int, *, title: str | None = None, show_values: bool = True,
                column_labels=None, ax=None):
    """Every rank's tensor cut into the ring's G chunks, one cell per chunk, labelled from its values.

    Args:
        tensors: tensors[r] is rank r's tensor as `tagged_tensor` made it, after any number of
            ring steps; `decode_chunks` reads which ranks each chunk contains.
        world_size: G.
        title: drawn above the table.
        show_values: print a chunk's value (all its elements are equal) under its label.
        column_labels: default "chunk c" with the chunk's length.

    Returns:
        The matplotlib Figure.
    """
    cells, texts = [], []
    for tensor in tensors:
        provenance = decode_chunks(tensor, world_size)
        pieces = torch.tensor_split(torch.as_tensor(tensor).detach().reshape(-1).cpu(), world_size)
        cells.append(provenance)
        texts.append([_cell_text(ranks, world_size, None, float(piece[0]) if piece.numel() else None, show_values)
                      for ranks, piece in zip(provenance, pieces)])
    if column_labels is None:
        sizes = chunk_sizes(torch.as_tensor(tensors[0]).numel(), world_size)
        column_labels = [f"chunk {c}\n({n} el.)" for c, n in enumerate(sizes)]
    own_figure = ax is None
    with _style():
        if own_figure:
            fig, axes = _new_figure(1.2 + 0.9 * world_size, 1.0 + 0.55 * len(cells), title=title)
            ax = axes[0][0]
        draw_cells(ax, cells, world_size, texts=texts, column_labels=column_labels)
        if title:
            ax.set_title(title, fontsize=10, loc="left", pad=6)
        if own_figure:
            ax.figure.tight_layout()
        return ax.figure


def draw_before_after(before, after, world_size: int, *, title: str | None = None, show_pieces: bool = True,
                      show_values: bool = True, labels=("before", "after")):
    """Two tables side by side: every rank's buffer before and after a collective.

    Args:
        before, after: per-rank buffers as for `draw_buffers`.
        world_size: G.
        title: a title over both.
        labels: the two panels' titles.

    Returns:
        The matplotlib Figure.
    """
    widths = [max([len(torch.as_tensor(b).reshape(-1)) for b in side if b is not None] + [1])
              for side in (before, after)]
    with _style():
        # Axes as wide as their number of cells, so a cell has the same size in both panels.
        fig, axes = _new_figure(2.6 + 0.9 * sum(widths), 0.8 + 0.55 * len(before), 1, 2, title=title,
                                gridspec_kw={"width_ratios": [w + 0.1 for w in widths]})
        for ax, side, label, width in zip(axes[0], (before, after), labels, widths):
            draw_buffers(side, world_size, title=label, show_pieces=show_pieces, show_values=show_values, ax=ax)
            ax.set_xlim(-0.05, width + 0.05)
        if title:
            fig.suptitle(title, fontsize=11, x=0.02, ha="left")
        fig.tight_layout()
        return fig
