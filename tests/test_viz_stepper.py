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
    assert ax.get_title() == "after scatter_reduce step 1"
    arrows = [t for t in ax.texts if isinstance(t, matplotlib.text.Annotation)]
    labels = [t.get_text() for t in ax.texts if t.get_gid() == "cell"]
    expected = [viz.provenance_label(cell, G) for row in scatter_reduce.states[2] for cell in row]
    assert labels == expected
    wraps = sum(1 for m in scatter_reduce.messages[1] if m.dst < m.src)
    assert len(arrows) == G + wraps                     # one arrow per message, two for the wrap-around
    with pytest.raises(ValueError):
        viz.draw_step(scatter_reduce, G)


def test_stepper_widget_steps_and_reloads(runs):
    pytest.importorskip("ipywidgets")
    scatter_reduce, all_gather = viz.ring_histories([run["recording"] for run in runs[3]])
    loaded = []

    def load(world_size):
        loaded.append(world_size)
        return viz.ring_histories([run["recording"] for run in runs[world_size]])[0]

    stepper = viz.Stepper(scatter_reduce, choices=[2, 3, 4], load=load)
    assert stepper.slider.max == stepper.play.max == 2 and stepper.chooser.value == 3
    first = stepper.image.value
    stepper.slider.value = 2
    assert bytes(stepper.image.value) != bytes(first) and bytes(stepper.image.value).startswith(b"\x89PNG")
    assert "scatter_reduce step 1" in stepper.caption.value
    stepper.chooser.value = 4
    assert loaded == [4] and stepper.slider.value == 0 and stepper.slider.max == 3
    text = stepper._repr_mimebundle_()["text/plain"]
    assert text == "Stepper over 3 steps (4 ranks); run the notebook to use the slider."


def test_figures_build_for_eight_ranks():
    results = course_lib.launch(_ring_on_tags, world_size=8, args=(19,), backend="gloo")
    scatter_reduce, all_gather = viz.ring_histories([run["recording"] for run in results])
    for rank, run in enumerate(results):
        assert viz.decode_chunks(run["middle"], 8) == scatter_reduce.final[rank]
    fig = viz.draw_steps(scatter_reduce.then(all_gather), title="8 ranks")
    assert len(fig.axes) == 14
    fig.canvas.draw()
