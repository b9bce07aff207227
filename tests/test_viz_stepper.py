"""course_lib.viz.stepper: the replay of a recorded trace must agree with the values the ranks hold.

For G = 2..6 the ring runs on tagged tensors (rank r's chunk c holds 2**r + c * 2**G) whose length G
does not divide, so sums can be read back from the numbers: after each phase the provenance that
`chunk_history` computes from the traffic events alone must equal the provenance decoded from the
values, for every chunk of every rank (partial sums included), and the values must equal
torch.distributed.all_reduce. A ring with a different schedule, written here from p2p calls, shows
the replay follows the trace, not a schedule it knows; a trace with a message missing is refused.
"""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import course_lib  # noqa: E402
from course_lib import allreduce, p2p, traffic, viz  # noqa: E402

SIZES = range(2, 7)


def _ring_on_tags(rank, world_size, numel):
    tensor = viz.tagged_tensor(rank, world_size, numel)
    expected = tensor.clone()
    dist.all_reduce(expected)
    with traffic.record() as recording:
        allreduce.ring_scatter_reduce(tensor)
        middle = tensor.clone()
        allreduce.ring_all_gather(tensor)
    return {"middle": middle, "after": tensor, "expected": expected, "recording": recording}


def _shifted_scatter_reduce(tensor, shift):
    """A scatter-reduce whose rank r starts with chunk (r + shift) mod G: still correct, other owners."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    chunks = torch.tensor_split(tensor, world_size)
    with traffic.phase("scatter_reduce"):
        for step in traffic.steps(world_size - 1):
            send, receive = (rank + shift - step) % world_size, (rank + shift - step - 1) % world_size
            request = p2p.isend(chunks[send].clone(), (rank + 1) % world_size, chunk=send)
            incoming = torch.empty_like(chunks[receive])
            p2p.recv(incoming, (rank - 1) % world_size, chunk=receive)
            chunks[receive].add_(incoming)
            request.wait()


def _shifted_on_tags(rank, world_size, numel, shift):
    tensor = viz.tagged_tensor(rank, world_size, numel)
    with traffic.record() as recording:
        _shifted_scatter_reduce(tensor, shift)
    return tensor, recording


@pytest.fixture(scope="module")
def runs():
    return {g: course_lib.launch(_ring_on_tags, world_size=g, args=(2 * g + 1,), backend="gloo") for g in SIZES}


@pytest.mark.parametrize("world_size", SIZES)
def test_replayed_provenance_equals_the_values(runs, world_size):
    G = world_size
    results = runs[G]
    scatter_reduce, all_gather = viz.ring_histories([run["recording"] for run in results])
    assert scatter_reduce.steps == all_gather.steps == G - 1
    for rank, run in enumerate(results):
        assert viz.decode_chunks(run["middle"], G) == scatter_reduce.final[rank]
        assert viz.decode_chunks(run["after"], G) == all_gather.final[rank] == [frozenset(range(G))] * G
        assert torch.equal(run["after"], run["expected"])
    # after scatter-reduce: exactly one complete chunk per rank, the one the library says it owns
    assert scatter_reduce.complete() == {r: [allreduce.owned_chunk(r, G)] for r in range(G)}
    # every step: G messages, each to the right neighbour, and a received partial sum grows by one
    for step, messages in enumerate(scatter_reduce.messages):
        assert sorted((m.src, m.dst) for m in messages) == [(r, (r + 1) % G) for r in range(G)]
        assert {len(scatter_reduce.states[step + 1][m.dst][m.chunk]) for m in messages} == {step + 2}


@pytest.mark.parametrize("world_size, shift", [(3, 1), (5, 2)])
def test_replay_follows_the_trace_not_a_schedule(world_size, shift):
    G = world_size
    results = course_lib.launch(_shifted_on_tags, world_size=G, args=(2 * G + 1, shift), backend="gloo")
    history = viz.chunk_history([recording for _, recording in results], "scatter_reduce")
    for rank, (tensor, _) in enumerate(results):
        assert viz.decode_chunks(tensor, G) == history.final[rank]
    assert history.complete() == {r: [(r + shift + 1) % G] for r in range(G)}
    assert history.complete() != {r: [allreduce.owned_chunk(r, G)] for r in range(G)}


def test_a_trace_with_a_missing_send_is_refused(runs):
    recordings = [run["recording"] for run in runs[3]]
    broken = traffic.Recording(rank=1, world_size=3, events=[e for e in recordings[1].events
                                                             if not (e.kind == "send" and e.step == 1)])
    with pytest.raises(ValueError, match="no such send"):
        viz.chunk_history([recordings[0], broken, recordings[2]], "scatter_reduce")
    with pytest.raises(ValueError, match="adds or copies"):
        viz.chunk_history(recordings, "my_phase")


@pytest.mark.parametrize("world_size", SIZES)
def test_static_fallback_has_one_panel_per_step(runs, world_size):
    G = world_size
    scatter_reduce, all_gather = viz.ring_histories([run["recording"] for run in runs[G]])
    assert len(viz.draw_steps(scatter_reduce).axes) == G - 1
    assert len(viz.draw_steps(all_gather, include_start=True).axes) == G
    whole = scatter_reduce.then(all_gather)
    assert whole.steps == 2 * (G - 1) and whole.final == all_gather.final
    text = viz.messages_text(whole)
    assert len(text.splitlines()) == 2 * (G - 1) * (G + 1)        # a header and G messages per step
    assert viz.messages_text(scatter_reduce, step=0).splitlines()[1].startswith(f"  rank 0 (a) -> rank {1 % G}")


def test_one_panel_shows_the_step_it_was_asked_for(runs):
    G = 4
    scatter_reduce, _ = viz.ring_histories([run["recording"] for run in runs[G]])
    fig = viz.draw_step(scatter_reduce, 2)
    ax = fig.axes[0]
    assert ax.get_title() == "after scatter_reduce step 1" == viz.position_title(scatter_reduce, 2)
    arrows = [t for t in ax.texts if isinstance(t, matplotlib.text.Annotation)]
    labels = [t.get_text() for t in ax.texts if t.get_gid() == "cell"]
    expected = [viz.provenance_label(cell, G) for row in scatter_reduce.states[2] for cell in row]
    assert labels == expected
    wraps = sum(1 for m in scatter_reduce.messages[1] if m.dst < m.src)
    assert len(arrows) == G + wraps                     # one arrow per message, two for the wrap-around
    with pytest.raises(ValueError):
        viz.draw_step(scatter_reduce, G)


def _svg_texts(svg: bytes) -> list[str]:
    """The texts of a course_lib SVG (its text stays text: svg.fonttype 'none')."""
    import xml.etree.ElementTree as ET

    return ["".join(t.itertext()) for t in ET.fromstring(svg).iter("{http://www.w3.org/2000/svg}text")]


def _step_number(text: str) -> int | None:
    """The step number a label or title speaks of: 'after step 1' -> 1, 'start' -> None."""
    return None if text == "start" else int(text.rsplit(" step ", 1)[1])


@pytest.mark.parametrize("world_size", [2, 4, 5])
def test_slider_and_picture_speak_the_same_step(runs, world_size):
    pytest.importorskip("ipywidgets")
    scatter_reduce, all_gather = viz.ring_histories([run["recording"] for run in runs[world_size]])
    for history in (scatter_reduce, scatter_reduce.then(all_gather)):
        stepper = viz.Stepper(history)
        assert stepper.play.max == history.steps and len(stepper.slider.options) == history.steps + 1
        for k in range(history.steps + 1):
            stepper.slider.index = k
            label = stepper.slider.label                          # what the slider's readout shows
            title = viz.position_title(history, k)
            assert title in _svg_texts(bytes(stepper.image.value)), (k, title)
            assert _step_number(label) == _step_number(title) == (None if k == 0 else (k - 1) % (world_size - 1))
            assert f"<b>{title}</b>" in stepper.caption.value
            if k:   # the caption lists exactly the messages of that step
                assert stepper.caption.value.count("rank ") == 2 * len(history.messages[k - 1])
        assert stepper.slider.options[0] == ("start", 0)
    assert viz.position_labels(scatter_reduce)[1:] == [f"after step {s}" for s in range(world_size - 1)]
    assert viz.position_labels(scatter_reduce.then(all_gather))[world_size] == "after all_gather step 0"


def test_stepper_widget_steps_and_reloads(runs):
    pytest.importorskip("ipywidgets")
    scatter_reduce, all_gather = viz.ring_histories([run["recording"] for run in runs[3]])
    loaded = []

    def load(world_size):
        loaded.append(world_size)
        return viz.ring_histories([run["recording"] for run in runs[world_size]])[0]

    stepper = viz.Stepper(scatter_reduce, choices=[2, 3, 4], load=load)
    assert stepper.play.max == 2 and len(stepper.slider.options) == 3 and stepper.chooser.value == 3
    first = bytes(stepper.image.value)
    assert stepper.image.format == "svg+xml" and first.lstrip().startswith(b"<?xml") and b"<svg" in first
    stepper.slider.value = 2
    assert bytes(stepper.image.value) != first and "after scatter_reduce step 1" in stepper.caption.value
    stepper.chooser.value = 4
    assert loaded == [4] and stepper.slider.index == 0 and stepper.play.max == 3
    assert [label for label, _ in stepper.slider.options] == ["start", "after step 0", "after step 1", "after step 2"]
    assert "start" in _svg_texts(bytes(stepper.image.value))
    bundle = stepper._repr_mimebundle_()
    assert bundle["text/plain"] == "Stepper over 3 steps (4 ranks); run the notebook to use the slider."
    assert "application/vnd.jupyter.widget-view+json" in bundle


def test_static_html_carries_every_picture_and_is_the_same_every_run(runs):
    pytest.importorskip("ipywidgets")
    import base64
    import html
    import json
    import re

    G = 4
    history, _ = viz.ring_histories([run["recording"] for run in runs[G]])
    stepper = viz.Stepper(history, interval_ms=500)
    page = stepper._repr_mimebundle_()["text/html"]
    again = viz.Stepper(viz.ring_histories([run["recording"] for run in runs[G]])[0], interval_ms=500).static_html()
    assert page == again                          # nbval compares text/html: no ids, dates or random salts
    pictures = re.findall(r'<img data-position="(\d+)"(?: hidden)? src="data:image/svg\+xml;base64,([^"]+)"', page)
    assert [int(k) for k, _ in pictures] == list(range(history.steps + 1))
    for k, data in pictures:                      # the very pictures the widget shows, titled the same
        assert base64.b64decode(data) == stepper.picture(int(k))
        assert viz.position_title(history, int(k)) in _svg_texts(base64.b64decode(data))
    labels = json.loads(html.unescape(re.search(r'data-labels="([^"]+)"', page).group(1)))
    assert labels == viz.position_labels(history)
    assert f'max="{history.steps}"' in page and 'data-interval="500"' in page and "<script>" in page
    assert page.count(" hidden") == 1 + 2 * history.steps     # controls, and all but the first picture and caption


def test_figures_build_for_eight_ranks():
    results = course_lib.launch(_ring_on_tags, world_size=8, args=(19,), backend="gloo")
    scatter_reduce, all_gather = viz.ring_histories([run["recording"] for run in results])
    for rank, run in enumerate(results):
        assert viz.decode_chunks(run["middle"], 8) == scatter_reduce.final[rank]
    fig = viz.draw_steps(scatter_reduce.then(all_gather), title="8 ranks")
    assert len(fig.axes) == 14
    fig.canvas.draw()
