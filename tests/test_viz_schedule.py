"""viz.schedule / draw_schedule: the schedule read from real recordings, against each algorithm's own rule."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest
import torch

from conftest import run
from course_lib import allreduce, p2p, traffic, viz


def _record(rank, world_size, variant, numel):
    tensor = torch.arange(numel, dtype=torch.float32) * (rank + 1)
    with traffic.record() as recording:
        allreduce.get(variant)(tensor)
    return recording


@pytest.mark.parametrize("world_size", [3, 4])
def test_ring_schedule_is_right_neighbour_every_step(world_size):
    numel = 4 * world_size + 1
    recordings = run(_record, world_size, "ring", numel)
    transfers = viz.schedule(recordings)
    columns = viz.schedule_columns(recordings)
    assert columns == [(p, s) for p in ("scatter_reduce", "all_gather") for s in range(world_size - 1)]
    assert len(transfers) == 2 * (world_size - 1) * world_size
    sizes = allreduce.chunk_sizes(numel, world_size)
    for t in transfers:
        assert t.dst == (t.src + 1) % world_size and t.messages == 1
        chunk = (t.src - t.step) % world_size if t.phase == "scatter_reduce" else (t.src + 1 - t.step) % world_size
        assert t.elements == sizes[chunk], t
    # Every element any rank sent is in the table exactly once.
    assert sum(t.elements for t in transfers) == sum(r.elements_sent for r in recordings)
    fig = viz.draw_schedule(recordings, title="ring")
    assert len(fig.axes) == 1 and len(fig.axes[0].texts) >= 2   # two phase names


def test_phases_ordered_across_ranks_when_rank_0_skips_some():
    # halving_doubling on 6 ranks: rank 0 only folds and unfolds; the middle phases come from other ranks.
    recordings = run(_record, 6, "halving_doubling", 25)
    phases = list(dict.fromkeys(p for p, _ in viz.schedule_columns(recordings)))
    assert phases == ["fold", "reduce_scatter", "all_gather", "unfold"]
    assert sum(t.elements for t in viz.schedule(recordings)) == sum(r.elements_sent for r in recordings)


def _unlabelled(rank, world_size):
    with traffic.record() as recording:
        tensor = torch.zeros(2)
        if rank == 0:
            p2p.send(tensor, 1)
        else:
            p2p.recv(tensor, 0)
    return recording


def test_unlabelled_messages_are_refused_with_advice():
    recordings = run(_unlabelled, 2)
    with pytest.raises(ValueError, match="traffic.phase"):
        viz.schedule(recordings)
