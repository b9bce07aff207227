"""course_lib.viz.buffers: tags that say where a value came from, and pictures drawn from real values.

The tags are checked exhaustively against their definition; the pictures are drawn from what
course_lib's hand-written collectives really left in every rank's buffer, and the labels read back
from the figure must match what torch.distributed's built-in collective computes on the same
tagged inputs (the oracle), for G = 2..6 and, for the figure size, G = 8.
"""

import itertools

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import course_lib  # noqa: E402
from course_lib import collectives, viz  # noqa: E402

SIZES = range(2, 7)


# --------------------------------------------------------------------------------------------------
# Tags and labels, without any launch
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 8])
def test_any_sum_of_tags_decodes_to_its_ranks_and_piece(world_size):
    everyone = range(world_size)
    for size in range(1, world_size + 1):
        for ranks in itertools.combinations(everyone, size):
            for piece in (0, 1, world_size - 1, 2 * world_size + 1):
                total = sum(viz.tag(r, piece, world_size) for r in ranks)
                # float32 holds these sums exactly: that is what the ranks will exchange
                total = torch.tensor(total, dtype=torch.float32).item()
                assert viz.decode_tag(total, world_size) == (frozenset(ranks), piece)


def test_decode_rejects_what_no_sum_of_tags_can_be():
    assert viz.decode_tag(0.0, 4) == (frozenset(), None)
    # not whole, negative, no rank bits, pieces that differ (17 + 34: ranks a, b but 3 x 16 left over)
    for bad in (0.5, -1.0, 16.0, viz.tag(0, 1, 4) + viz.tag(1, 2, 4)):
        with pytest.raises(ValueError):
            viz.decode_tag(bad, 4)


def test_labels_name_ranks_by_letter_in_ring_order():
    assert viz.rank_names(4) == ["a", "b", "c", "d"]
    assert viz.provenance_label({2}, 4) == "c"
    assert viz.provenance_label({3, 0}, 4) == "d+a"              # the run d, a round the ring
    assert viz.provenance_label({2, 3, 0}, 4) == "c+d+a"
    assert viz.provenance_label({0, 2}, 4) == "a+c"              # not a run: rank order
    assert viz.provenance_label(range(8), 8) == "a+…+h"
    assert viz.provenance_label({6, 7, 0, 1, 2}, 8) == "g+…+c"
    assert viz.provenance_label({2}, 4, piece=3) == "c₃"
    assert viz.provenance_label({0, 1}, 4, piece=12) == "(a+b)₁₂"
    assert viz.provenance_label(set(), 4) == ""


@pytest.mark.parametrize("world_size, numel", [(3, 7), (4, 4), (5, 3)])
def test_tagged_tensor_fills_each_ring_chunk_with_its_tag(world_size, numel):
    tensor = viz.tagged_tensor(2 % world_size, world_size, numel)
    chunks = torch.tensor_split(tensor, world_size)
    for index, chunk in enumerate(chunks):
        assert chunk.tolist() == [viz.tag(2 % world_size, index, world_size)] * chunk.numel()
    expected = [frozenset({2 % world_size}) if c.numel() else None for c in chunks]
    assert viz.decode_chunks(tensor, world_size) == expected


def test_decode_chunks_notices_data_in_the_wrong_chunk():
    tensor = viz.tagged_tensor(1, 4, 8)
    tensor[0:2], tensor[2:4] = tensor[2:4].clone(), tensor[0:2].clone()    # swap chunks 0 and 1
    with pytest.raises(ValueError, match="wrong chunk"):
        viz.decode_chunks(tensor, 4)
    mixed = viz.tagged_tensor(1, 4, 8)
    mixed[0] = viz.tag(2, 0, 4)                                              # half of chunk 0 from rank 2
    with pytest.raises(ValueError, match="mixes"):
        viz.decode_chunks(mixed, 4)


# --------------------------------------------------------------------------------------------------
# Pictures of real runs
# --------------------------------------------------------------------------------------------------


def _collectives_on_tags(rank, world_size):
    """all_to_all, reduce_scatter and all_reduce on tagged pieces, hand-written and built-in."""
    G = world_size
    piece = lambda r, j: torch.tensor([viz.tag(r, j, G)])  # noqa: E731
    out = {}
    for name, api in (("hand", collectives), ("torch", dist)):
        inputs = [piece(rank, j) for j in range(G)]
        outputs = [torch.zeros(1) for _ in range(G)]
        api.all_to_all(outputs, inputs)
        mine = torch.zeros(1)
        api.reduce_scatter(mine, [piece(rank, j) for j in range(G)])
        # 2G + 1 elements: chunks of different lengths
        whole = viz.tagged_tensor(rank, G, 2 * G + 1)
        api.all_reduce(whole)
        out[name] = {"all_to_all": (torch.cat(inputs), torch.cat(outputs)),
                     "reduce_scatter": (torch.cat(inputs), mine),
                     "all_reduce": (viz.tagged_tensor(rank, G, 2 * G + 1), whole)}
    return out


def _cell_labels(ax):
    """The first line of every cell label drawn in `ax`, in drawing order (row by row)."""
    return [text.get_text().split("\n")[0] for text in ax.texts if text.get_gid() == "cell"]


def _labels(ax, gid):
    return [text.get_text() for text in ax.texts if text.get_gid() == gid]


def _expected_labels(tensors, world_size, show_pieces=True):
    labels = []
    for tensor in tensors:
        for value in tensor.tolist():
            ranks, piece = viz.decode_tag(value, world_size)
            labels.append(viz.provenance_label(ranks, world_size, piece if show_pieces else None))
    return labels


@pytest.fixture(scope="module")
def runs():
    return {g: course_lib.launch(_collectives_on_tags, world_size=g, backend="gloo") for g in SIZES}


@pytest.mark.parametrize("world_size", SIZES)
def test_before_after_pictures_show_what_torch_computes(runs, world_size):
    G = world_size
    results = runs[G]
    for name in ("all_to_all", "reduce_scatter"):
        before = [results[r]["hand"][name][0] for r in range(G)]
        after = [results[r]["hand"][name][1] for r in range(G)]
        oracle = [results[r]["torch"][name][1] for r in range(G)]
        for ours, reference in zip(after, oracle):
            assert torch.equal(ours, reference), name
        fig = viz.draw_before_after(before, after, G, title=name)
        left, right = fig.axes
        # The labels come from the values: the "after" panel says what torch's result says.
        assert _cell_labels(left) == _expected_labels(before, G)
        assert _cell_labels(right) == _expected_labels(oracle, G)
    # and in words: all_to_all transposes, reduce_scatter gives rank r the sum of piece r
    all_to_all = [[viz.decode_tag(v, G) for v in results[r]["hand"]["all_to_all"][1].tolist()] for r in range(G)]
    assert all_to_all == [[(frozenset({j}), r) for j in range(G)] for r in range(G)]
    scattered = [viz.decode_tag(results[r]["hand"]["reduce_scatter"][1].item(), G) for r in range(G)]
    assert scattered == [(frozenset(range(G)), r) for r in range(G)]


@pytest.mark.parametrize("world_size", SIZES)
def test_chunk_picture_reads_the_real_all_reduce_result(runs, world_size):
    G = world_size
    results = [runs[G][r]["hand"]["all_reduce"][1] for r in range(G)]
    oracle = [runs[G][r]["torch"]["all_reduce"][1] for r in range(G)]
    for ours, reference in zip(results, oracle):
        assert torch.equal(ours, reference)
    assert all(viz.decode_chunks(t, G) == [frozenset(range(G))] * G for t in results)
    fig = viz.draw_chunks(results, G, title="after")
    labels = _cell_labels(fig.axes[0])
    assert labels == [viz.provenance_label(range(G), G)] * (G * G)
    sizes = [len(c) for c in torch.tensor_split(results[0], G)]
    assert _labels(fig.axes[0], "column label") == [f"chunk {c}\n({n} el.)" for c, n in enumerate(sizes)]
    assert _labels(fig.axes[0], "row label") == [f"rank {r} · {viz.rank_name(r)}" for r in range(G)]


def test_rows_of_different_lengths_and_untagged_values():
    # gather-like: the root holds G cells, the others one; 0 is an empty slot; 0.5 is no tag
    G = 3
    buffers = [torch.tensor([viz.tag(j, 0, G) for j in range(G)]), torch.tensor([0.0]), torch.tensor([0.5])]
    fig = viz.draw_buffers(buffers, G, show_pieces=False, show_values=False)
    assert _cell_labels(fig.axes[0]) == ["a", "b", "c", "0.5"]
    assert _labels(fig.axes[0], "row label") == ["rank 0 · a", "rank 1 · b", "rank 2 · c"]


def test_pictures_build_for_eight_ranks():
    G = 8
    before = [viz.tagged_tensor(r, G, G) for r in range(G)]
    after = [sum(before)] * G
    fig = viz.draw_before_after(before, after, G, title="all_reduce on 8 ranks")
    assert len(fig.axes) == 2 and len(_cell_labels(fig.axes[1])) == G * G
    assert set(_cell_labels(fig.axes[1])) == {f"(a+…+h){str(c).translate(str.maketrans('01234567', '₀₁₂₃₄₅₆₇'))}"
                                              for c in range(G)}
    fig.canvas.draw()   # lays out every artist: catches what only rendering would


def test_notebook_pictures_are_sharp_on_high_density_screens():
    """A notebook shows a PNG at one pixel per CSS pixel unless told otherwise: in a real kernel,
    course_lib's figures come out with PIXEL_RATIO times the pixels and the size to show them at,
    and the same text/plain as any matplotlib Figure (which nbval compares)."""
    pytest.importorskip("ipykernel")
    import base64
    import struct

    from jupyter_client.manager import start_new_kernel

    code = """
import matplotlib.pyplot as plt, course_lib.viz as viz
G = 3
fig = viz.draw_buffers([viz.tagged_tensor(r, G, G) for r in range(G)], G, title="before")
plain = plt.figure(figsize=fig.get_size_inches(), dpi=fig.dpi); plain.add_subplot(); plt.close(plain)
assert repr(fig) == repr(plain), (repr(fig), repr(plain))
print(len(viz.buffers.figure_png(fig)))
fig
"""
    messages = []
    manager, client = start_new_kernel(kernel_name="python3")
    try:
        reply = client.execute_interactive(code, timeout=60, output_hook=messages.append)
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    assert reply["content"]["status"] == "ok", messages
    result = next(m["content"] for m in messages if m["msg_type"] == "execute_result")
    assert result["data"]["text/plain"].startswith("<Figure size ")
    png = base64.b64decode(result["data"]["image/png"])
    width, height = struct.unpack(">II", png[16:24])
    shown = result["metadata"]["image/png"]
    ratio = viz.buffers.PIXEL_RATIO
    assert ratio >= 2 and (shown["width"], shown["height"]) == (width // ratio, height // ratio)
    assert shown["caption"] == "before"                     # the figure's title, for the book's caption
    one_to_one = int(next(m["content"]["text"] for m in messages if m["msg_type"] == "stream"))
    assert len(png) < 2 * one_to_one     # 256 colours: four times the pixels for less than twice the bytes


def test_svg_is_the_same_on_every_run():
    G = 3
    buffers = [viz.tagged_tensor(r, G, G) for r in range(G)]
    first, second = (viz.buffers.figure_svg(viz.draw_buffers(buffers, G)) for _ in range(2))
    assert first == second and b"<svg" in first
    assert b"<dc:date>" not in first and "a₀".encode() in first     # no date; text kept as text
