"""Name each collective of a training step in its trace, so `viz.draw_schedule` can draw the whole step.

Every course_lib collective labels its messages with its own phase ('all_gather', 'reduce_scatter',
the ring's 'scatter_reduce' then 'all_gather') and steps 0, 1, ..., so a step that makes several
collectives (ZeRO-3 gathers every layer twice, PowerSGD all-reduces three buffers) records the same
labels several times, and a drawing would stack them in one column. The collectives of one rank never
overlap in time (`course_lib._work` runs them in call order), so a rank's recording is the calls'
messages one call after the other; knowing how many messages each call sends (and receives: the same
number in every collective used here), `name_calls` cuts the recording into calls and relabels each
message with its call's name and its step inside the call::

    calls = [("gather L0", G - 1), ("gather L1", G - 1), ("reduce-scatter L1", G - 1), ...]
    named = [name_calls(recording, calls) for recording in recordings]     # one per rank
    viz.draw_schedule(named, title="ZeRO-3, one step")

`ring_messages(G)` and `collective_messages(G)` give the counts of course_lib's ring all-reduce and of
its all_gather / reduce_scatter / all_to_all.
"""

from __future__ import annotations

import dataclasses

from course_lib import traffic

__all__ = ["name_calls", "ring_messages", "collective_messages"]


def ring_messages(world_size: int) -> int:
    """Messages each rank sends (and receives) in course_lib's ring all-reduce: 2 (G-1)."""
    return 2 * (world_size - 1)


def collective_messages(world_size: int) -> int:
    """Messages each rank sends (and receives) in course_lib's all_gather, reduce_scatter and all_to_all: G - 1."""
    return world_size - 1


def name_calls(recording: traffic.Recording, calls) -> traffic.Recording:
    """A copy of `recording` whose messages carry their call's name as phase, and their step inside it.

    Args:
        recording: one rank's recording of a sequence of collectives.
        calls: (name, messages) per collective, in call order; messages = what this rank sends in it
            (it receives as many).

    Returns:
        A new `traffic.Recording` (same rank and world size).

    Raises:
        ValueError: if the recording does not hold exactly those messages.
    """
    sends = [e for e in recording.events if e.kind == "send"]
    recvs = [e for e in recording.events if e.kind == "recv"]
    expected = sum(count for _, count in calls)
    if len(sends) != expected or len(recvs) != expected:
        raise ValueError(f"the recording holds {len(sends)} sends and {len(recvs)} receives, but the calls add up to "
                         f"{expected} of each: pass every collective of the recording, in order, with its count.")
    out = traffic.Recording(rank=recording.rank, world_size=recording.world_size)
    position = {"send": 0, "recv": 0}
    boundaries, at = [], 0
    for name, count in calls:
        boundaries.append((at, at + count, name))
        at += count
    steps_seen: dict = {}
    for event in recording.events:
        index = position[event.kind]
        position[event.kind] += 1
        call = next(i for i, (start, stop, _) in enumerate(boundaries) if start <= index < stop)
        name = boundaries[call][2]
        # The step inside the call: the order in which (phase, step) labels first appear in it.
        order = steps_seen.setdefault((call, event.kind), {})
        key = (event.phase, event.step)
        if key not in order:
            order[key] = len(order)
        out.events.append(dataclasses.replace(event, phase=name, step=order[key]))
    return out
