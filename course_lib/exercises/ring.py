"""Notebooks 04 and 05: the ring all-reduce, phase by phase.

    ring_scatter_reduce(tensor) -> int   rank r sends chunk (r - k) mod G to r + 1 in step k = 0..G-2,
                                         adds what it receives from r - 1; returns (r + 1) mod G,
                                         the chunk it then holds complete
    ring_all_gather(tensor)              starts from what a real scatter-reduce leaves; rank r sends
                                         chunk (r + 1 - k) mod G to r + 1 in step k, the receiver
                                         overwrites its copy; afterwards every chunk is complete
    ring(tensor)                         ring_scatter_reduce, then ring_all_gather

Chunks are ``torch.tensor_split(tensor, G)``. The check reads the schedule from the messages the
ranks really sent: the k-th message a rank sends is its step k, and with tagged data the values of
a message say which chunk it is and which ranks' contributions it holds (`data.decode`), whatever
the learner's labels say. A result may only hold contributions that its input or a received message
held (`data.unexplained_contributors`).

Every input, the sums every GPU must end with, and the state a real scatter-reduce leaves (the
all-gather's input, `simulate_scatter_reduce`) are computed where the judge runs, not on the ranks.
"""

from __future__ import annotations

import torch

from course_lib import viz
from course_lib.exercises import data
from course_lib.exercises.cases import clone, portable
from course_lib.exercises.registry import FunctionExercise, Problem, register
from course_lib.exercises.rubric import SINGLE_RANK, UNEVEN_LENGTHS, RubricLine

__all__ = ["RingScatterReduce", "RingAllGather", "Ring", "ring_picture", "simulate_scatter_reduce"]

SCATTER_REDUCE, ALL_GATHER = "scatter_reduce", "all_gather"
PHASE_NAMES = {SCATTER_REDUCE: "scatter-reduce", ALL_GATHER: "all-gather"}


def gpu(rank: int) -> str:
    return f"GPU-{rank}"


def expected_chunk(phase: str, rank: int, step: int, world_size: int) -> int:
    """The chunk rank `rank` sends in step `step` (k): (r - k) mod G, or (r + 1 - k) mod G in the all-gather."""
    return (rank - step) % world_size if phase == SCATTER_REDUCE else (rank + 1 - step) % world_size


def expected_holds(phase: str, rank: int, step: int, world_size: int) -> frozenset:
    """Whose contributions that chunk holds when it is sent: r, r-1, ..., r-s; in the all-gather, all."""
    if phase == ALL_GATHER:
        return data.everyone(world_size)
    return frozenset((rank - k) % world_size for k in range(step + 1))


def _formula(phase, rank, step, world_size) -> str:
    c = expected_chunk(phase, rank, step, world_size)
    if phase == SCATTER_REDUCE:
        return f"j = r - k mod G = {rank} - {step} mod {world_size} = {c}"
    return f"j = r + 1 - k mod G = {rank} + 1 - {step} mod {world_size} = {c}"


def _sizes_text(numel, world_size) -> str:
    sizes = data.chunk_sizes(numel, world_size)
    return (f"torch.tensor_split(tensor, G) cuts N = {numel} into chunks of {', '.join(map(str, sizes))} elements "
            f"(the first N mod G = {numel % world_size} one longer)")


def simulate_scatter_reduce(inputs) -> list:
    """What the ring's scatter-reduce (sum) leaves on every rank, computed in this process from `inputs`.

    Step k: rank r sends chunk (r - k) mod G to r + 1, which adds it into its own copy of that chunk; the
    additions happen in the ring's order, so the result is bit for bit what the ranks' ring leaves.
    """
    G = len(inputs)
    state = [t.clone() for t in inputs]
    for step in range(G - 1):
        sent = [torch.tensor_split(state[r], G)[(r - step) % G].clone() for r in range(G)]
        for rank in range(G):
            left = (rank - 1) % G
            torch.tensor_split(state[rank], G)[(left - step) % G].add_(sent[left])
    return state


def phase_problems(case, sends_by_rank, phase: str, complete: bool, phase_index: int = 0, prefix: str = "",
                   chunk_line: str = "chunks", message_line: str = "messages") -> list:
    """Everything wrong with one phase of the ring, read from the messages each rank sent in it.

    Args:
        sends_by_rank: sends_by_rank[r] = rank r's sends in this phase, in order (step k = the k-th).
        complete: False when the case hung: then a rank that sent fewer messages is not a problem by itself.
        phase_index, prefix: order and wording when a check covers both phases ('scatter-reduce ').
        chunk_line, message_line: the rubric lines a wrong chunk, and a wrong neighbour or count, cost.
    """
    G, N = case.world_size, case.numel
    tagged = case.data == "tagged"
    sizes = data.chunk_sizes(N, G)
    steps = G - 1
    problems = []

    def add(step, rank, text, kind=0, line=chunk_line):
        problems.append(Problem(text, order=(phase_index, step, rank, kind), step=step, phase=phase, line=line))

    for rank, sends in enumerate(sends_by_rank):
        right, left = (rank + 1) % G, (rank - 1) % G
        for step, message in enumerate(sends[:steps]):
            where = f"{prefix}step {step}: {gpu(rank)}"
            chunk = expected_chunk(phase, rank, step, G)
            if message.peer != right:
                turn = f" ({gpu(message.peer)} is its left neighbour: the ring turns the other way)" \
                    if message.peer == left and G > 2 else ""
                add(step, rank, f"{where} sent to {gpu(message.peer)}; in the ring every GPU sends only to its right "
                                f"neighbour, {gpu(right)} = (r + 1) mod G{turn}.", line=message_line)
                continue
            if not tagged:
                if message.numel != sizes[chunk]:
                    add(step, rank, f"{where} sent {message.numel} elements to {gpu(right)}; the ring sends chunk "
                                    f"{chunk} ({_formula(phase, rank, step, G)}), which has {sizes[chunk]}. "
                                    + _sizes_text(N, G) + ".")
                continue
            status, holds, piece = data.decode(message.data, G)
            if status == "empty" and sizes[chunk] == 0:
                continue
            if status == "mixed":
                add(step, rank, f"{where} sent {message.numel} elements that are not one chunk: they hold parts of "
                                f"chunks {', '.join(map(str, piece))}. " + _sizes_text(N, G) + ".")
            elif status in ("bad", "empty"):
                add(step, rank, f"{where} sent values that are no chunk of any sum of distinct GPUs' data "
                                + ("(was something added twice?)" if phase == SCATTER_REDUCE else
                                   "(did it add what it received instead of overwriting its copy?)") + ".")
            elif piece != chunk:
                add(step, rank, f"{where} sent chunk {piece} to {gpu(right)}; the ring sends chunk {chunk} "
                                f"({_formula(phase, rank, step, G)}).")
            elif message.numel != sizes[chunk]:
                add(step, rank, f"{where} sent {message.numel} of chunk {chunk}'s {sizes[chunk]} elements. "
                                + _sizes_text(N, G) + ".")
            else:
                want = expected_holds(phase, rank, step, G)
                if holds != want:
                    add(step, rank, _contents_problem(phase, where, rank, step, chunk, holds, want, G))
        if complete and len(sends) != steps:
            plural = lambda n, word: f"{n} {word}{'' if n == 1 else 's'}"  # noqa: E731
            name = PHASE_NAMES[phase]
            if len(sends) < steps:
                add(len(sends), rank, f"{gpu(rank)} sent only {plural(len(sends), 'message')} in the {name}; it takes "
                                      f"G - 1 = {plural(steps, 'step')}, one message per step.", kind=1,
                    line=message_line)
            else:
                add(steps, rank, f"{gpu(rank)} sent {plural(len(sends), 'message')} in the {name}; it takes exactly "
                                 f"G - 1 = {plural(steps, 'step')}, one message each.", kind=1, line=message_line)
    return problems


def _contents_problem(phase, where, rank, step, chunk, holds, want, G) -> str:
    got, should = data.label(holds, G), data.label(want, G)
    if phase == ALL_GATHER:
        return (f"{where} sent chunk {chunk} holding only {got}, a partial sum; in the all-gather only complete "
                f"chunks ({should}) travel. It should have received the complete chunk {chunk} from "
                f"{gpu((rank - 1) % G)} in step {step - 1} and kept it." if step > 0 else
                f"{where} sent chunk {chunk} holding only {got}; in step 0 a GPU sends the chunk it completed in "
                f"the scatter-reduce, (r + 1) mod G, which holds {should}.")
    if holds == {rank}:
        return (f"{where} sent chunk {chunk} holding only its own values ({got}); by step {step} it should hold "
                f"{should}: add what arrives from the left into that chunk before sending it on.")
    if rank not in holds and holds == want - {rank}:
        return (f"{where} sent chunk {chunk} holding {got}, without {gpu(rank)}'s own values: it overwrote its chunk "
                f"with what arrived instead of adding to it (chunk += received).")
    return f"{where} sent chunk {chunk} holding {got}; at step {step} it should hold {should}."


def result_problems(case, records, chunks_of=None, phase_index: int = 9, what: str = "the result",
                    copying: bool = False, own: str = "start") -> list:
    """Compare every rank's tensor (all chunks, or `chunks_of(rank)`) with the sum the judge computed.

    Wrong values cost the 'values' line. With tagged data, a rank whose tensor holds contributions that
    neither its input (`record[own]`) nor any message it received held costs every line.
    """
    G = case.world_size
    problems = []
    for rank, record in enumerate(records):
        after, expected, start = record["after"], record["expected"], record["start"]
        if case.data == "tagged":
            extra = data.unexplained_contributors(after, record[own], data.received_by(records, rank), G)
            if extra:
                problems.append(Problem(
                    f"after {what}, {gpu(rank)} holds the values of {', '.join(gpu(r) for r in sorted(extra))}, but no "
                    f"message it received carried them: they did not come through the point-to-point messages the "
                    "check traces.", order=(-1, rank)))
                continue
        tol = None if case.data == "tagged" else data.tolerance(record["abs_sum"], G)
        wanted = range(G) if chunks_of is None else chunks_of(rank)
        pieces = lambda t: torch.tensor_split(t.reshape(-1), G)  # noqa: E731
        for chunk in wanted:
            got, exp = pieces(after)[chunk], pieces(expected)[chunk]
            tol_c = None if tol is None else pieces(tol)[chunk]
            diff = data.first_difference(got, exp, tol_c)
            if diff is None:
                continue
            if data.same_values(got, pieces(start)[chunk]) and not data.same_values(exp, pieces(start)[chunk]):
                text = (f"{gpu(rank)}'s chunk {chunk} was not changed: write the result into `tensor` itself, "
                        "in place (tensor[...] += ..., .add_(), .copy_()), not into a new tensor.")
            elif case.data == "tagged":
                status, holds, _ = data.decode(got, G)
                if status == "ok" and holds == data.everyone(G) - {rank} and not copying:
                    text = (f"after {what}, {gpu(rank)}'s chunk {chunk} holds {data.label(holds, G)}, without "
                            f"{gpu(rank)}'s own values: it overwrote its chunk with what arrived instead of adding to "
                            "it (chunk += received).")
                elif status == "ok":
                    text = (f"after {what}, {gpu(rank)}'s chunk {chunk} holds {data.label(holds, G)}; it should hold "
                            f"{data.label(data.everyone(G), G)}, the sum over every GPU (as torch.distributed.all_reduce gives).")
                elif copying:
                    text = (f"after {what}, {gpu(rank)}'s chunk {chunk} holds values that are no sum of distinct GPUs' "
                            "data: did it add what it received instead of overwriting its copy? In the all-gather "
                            "a received chunk replaces the partial sum.")
                else:
                    text = (f"after {what}, {gpu(rank)}'s chunk {chunk} holds values that are no sum of distinct GPUs' "
                            "data (a contribution added twice, or data from the wrong chunk).")
            else:
                index, value, wanted_value = diff
                text = (f"after {what}, {gpu(rank)}'s chunk {chunk} differs from the all-reduce (the sum over every "
                        f"GPU) at its element {index}: {value:.6g} instead of {wanted_value:.6g}.")
            problems.append(Problem(text, order=(phase_index, rank, chunk), line="values"))
            break
    return problems


def split_phases(records, G):
    """Rank r's sends: [scatter-reduce sends (the first G-1), all-gather sends (the rest)]."""
    sends = [[m for m in record["messages"] if m.is_send] for record in records]
    return [s[:G - 1] for s in sends], [s[G - 1:] for s in sends]


def _run_all_reduce_case(call, case, rank, world_size, inputs):
    """The learner's call on this rank's input (a copy), for the all-reduce exercises: what it left and returned."""
    tensor = inputs.clone()
    returned = call(tensor)
    return {"after": clone(tensor), "returned": portable(returned)}


class RingScatterReduce(FunctionExercise):
    def run_case(self, call, case, rank, world_size, inputs):
        return _run_all_reduce_case(call, case, rank, world_size, inputs)

    def judge(self, case, records, complete=True):
        G = case.world_size
        sends = [[m for m in record["messages"] if m.is_send] for record in records]
        problems = phase_problems(case, sends, SCATTER_REDUCE, complete)
        if not complete:
            return problems
        for rank, record in enumerate(records):
            owned, returned = (rank + 1) % G, record["returned"]
            if isinstance(returned, bool) or not isinstance(returned, int):
                problems.append(Problem(
                    f"{gpu(rank)} returned {_short(returned)}; ring_scatter_reduce returns the index of the chunk the "
                    f"GPU now holds complete, an int: (r + 1) mod G = {owned}.", order=(8, rank), line="returned"))
            elif returned != owned:
                problems.append(Problem(
                    f"{gpu(rank)} returned {returned}; the chunk it holds complete after the scatter-reduce is "
                    f"(r + 1) mod G = {owned}.", order=(8, rank), line="returned"))
        problems += result_problems(case, records, chunks_of=lambda r: [(r + 1) % G], what="the scatter-reduce")
        return problems

    def picture(self, case, records, problem):
        return ring_picture(case, records, problem, [SCATTER_REDUCE])


class RingAllGather(FunctionExercise):
    def inputs(self, case):
        # Start from what a real scatter-reduce leaves: one complete chunk, partial sums elsewhere.
        return simulate_scatter_reduce([data.make_input(case, rank) for rank in range(case.world_size)])

    def oracle(self, case, inputs):
        start = [data.make_input(case, rank) for rank in range(case.world_size)]
        return [{**facts, "middle": middle.clone()} for facts, middle in zip(data.all_reduce_oracle(start), inputs)]

    def run_case(self, call, case, rank, world_size, inputs):
        return _run_all_reduce_case(call, case, rank, world_size, inputs)

    def judge(self, case, records, complete=True):
        sends = [[m for m in record["messages"] if m.is_send] for record in records]
        problems = phase_problems(case, sends, ALL_GATHER, complete)
        if complete:
            problems += result_problems(case, records, what="the all-gather", copying=True, own="middle")
        return problems

    def picture(self, case, records, problem):
        return ring_picture(case, records, problem, [ALL_GATHER])


class Ring(FunctionExercise):
    def run_case(self, call, case, rank, world_size, inputs):
        return _run_all_reduce_case(call, case, rank, world_size, inputs)

    def judge(self, case, records, complete=True):
        G, N = case.world_size, case.numel
        first, second = split_phases(records, G)
        problems = phase_problems(case, first, SCATTER_REDUCE, complete, 0, "scatter-reduce ", chunk_line="scatter_reduce")
        problems += phase_problems(case, second, ALL_GATHER, complete, 1, "all-gather ", chunk_line="all_gather")
        if not complete:
            return problems
        sizes = data.chunk_sizes(N, G)
        for rank, record in enumerate(records):
            sent = sum(m.numel for m in record["messages"] if m.is_send)
            want = 0 if G == 1 else 2 * N - sizes[(rank + 1) % G] - sizes[(rank + 2) % G]
            if sent != want:
                problems.append(Problem(
                    f"{gpu(rank)} sent {sent} elements in all; the ring sends 2N - |chunk r+1| - |chunk r+2| = {want} "
                    f"(about 2(G-1)N/G: every chunk but one in each phase).", order=(2, rank), line="messages"))
        problems += result_problems(case, records, what="the ring")
        if not problems and case.data == "random":
            first_result = records[0]["after"]
            for rank, record in enumerate(records[1:], start=1):
                if not torch.equal(record["after"], first_result):
                    problems.append(Problem(
                        f"{gpu(0)} and {gpu(rank)} hold different bits: the ring sums each chunk once, on its way "
                        "round, and then only copies it, so every GPU should hold exactly the same result.",
                        order=(10, rank), line="values"))
                    break
        return problems

    def picture(self, case, records, problem):
        return ring_picture(case, records, problem, [SCATTER_REDUCE, ALL_GATHER])


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# --------------------------------------------------------------------------------------------------
# The picture of the step that went wrong
# --------------------------------------------------------------------------------------------------


def _history(world_size, start, messages_per_step, reducing, phase, observed=False):
    """Replay messages from `start`. With `observed`, a sender's cell is set to what its message carried
    (read from its values): what the sender really held, even where the replay assumed otherwise."""
    states = [[list(row) for row in start]]
    for messages in messages_per_step:
        after = [list(row) for row in states[-1]]
        if observed:
            for m in messages:
                after[m.src][m.chunk] = m.carries
        for m in messages:
            after[m.dst][m.chunk] = (after[m.dst][m.chunk] | m.carries) if reducing else m.carries
        states.append(after)
    names = [f"{PHASE_NAMES[phase]} step {s}" for s in range(len(messages_per_step))]
    return viz.ChunkHistory(world_size, states, list(messages_per_step), names)


def _ideal(world_size, phase, start):
    """The schedule as it should be, replayed from `start`."""
    state, steps = [list(row) for row in start], []
    for step in range(world_size - 1):
        messages = []
        for rank in range(world_size):
            chunk = expected_chunk(phase, rank, step, world_size)
            messages.append(viz.Message(step, rank, (rank + 1) % world_size, chunk, 0, state[rank][chunk]))
        for m in messages:
            state[m.dst][m.chunk] = (state[m.dst][m.chunk] | m.carries) if phase == SCATTER_REDUCE else m.carries
        steps.append(messages)
    return _history(world_size, start, steps, phase == SCATTER_REDUCE, phase)


def _learner(world_size, phase, start, sends_by_rank):
    """What the learner's messages, read from their values, did to the chunks."""
    steps = max((len(s) for s in sends_by_rank), default=0)
    per_step = []
    for step in range(steps):
        messages = []
        for rank, sends in enumerate(sends_by_rank):
            if step >= len(sends):
                continue
            m = sends[step]
            status, holds, piece = data.decode(m.data, world_size)
            if status == "ok" and piece is not None and isinstance(m.peer, int) and 0 <= m.peer < world_size:
                messages.append(viz.Message(step, rank, m.peer, piece, m.numel, holds))
        per_step.append(messages)
    return _history(world_size, start, per_step, phase == SCATTER_REDUCE, phase, observed=True)


def ring_picture(case, records, problem, phases):
    """Two tables side by side: the chunks after the learner's failing step, and after the ring's.

    Returns a matplotlib Figure, or None when there is nothing to draw (random data, no step).
    """
    if case.data != "tagged" or problem.step is None or problem.phase not in phases or records is None:
        return None
    G = case.world_size
    if problem.step > G - 2 or any("messages" not in r for r in records):
        return None
    if len(phases) == 2:
        first, second = split_phases(records, G)
        sends = first if problem.phase == SCATTER_REDUCE else second
    else:
        sends = [[m for m in r["messages"] if m.is_send] for r in records]
    if problem.phase == SCATTER_REDUCE:
        start = [[frozenset({r}) for _ in range(G)] for r in range(G)]
    elif "middle" in records[0] and len(phases) == 1:
        start = [viz.decode_chunks(r["middle"], G) for r in records]
    else:
        start = _ideal(G, SCATTER_REDUCE, [[frozenset({r}) for _ in range(G)] for r in range(G)]).final
    if any(cell is None for row in start for cell in row):   # empty chunks: nothing to draw in them
        start = [[cell or frozenset() for cell in row] for row in start]
    mine, ideal = _learner(G, problem.phase, start, sends), _ideal(G, problem.phase, start)
    if problem.step >= mine.steps:
        return None
    import matplotlib
    import matplotlib.pyplot as plt

    k = problem.step + 1
    with matplotlib.rc_context({"figure.facecolor": "white", "savefig.facecolor": "white", "font.size": 8}):
        fig, axes = plt.subplots(1, 2, figsize=(2.6 + 1.7 * G, 1.3 + 0.45 * G))
        plt.close(fig)
        viz.draw_step(mine, k, ax=axes[0])
        axes[0].set_title(f"yours, after {PHASE_NAMES[problem.phase]} step {problem.step}", fontsize=9)
        viz.draw_step(ideal, k, ax=axes[1])
        axes[1].set_title(f"the ring's, after step {problem.step}", fontsize=9)
        fig.tight_layout()
    return fig


MESSAGES = RubricLine("messages", "every GPU sends G - 1 messages per phase, each to its right neighbour (r + 1) mod G", 2)
UNEVEN = RubricLine("uneven", "also right when N does not divide by G, and when N < G (empty chunks)", 1,
                    family=UNEVEN_LENGTHS)
SINGLE = RubricLine("single", "with one GPU (G = 1) it sends nothing and leaves the tensor as it is", 1,
                    family=SINGLE_RANK)

register(RingScatterReduce(
    name="ring_scatter_reduce", notebook="04_ring_scatter_reduce", points=10,
    signature="ring_scatter_reduce(tensor) -> int",
    summary="phase 1 of the ring: in step k rank r sends chunk (r - k) mod G to r + 1 and adds what it receives; "
            "returns the chunk it then holds complete, (r + 1) mod G",
    rubric=(MESSAGES,
            RubricLine("chunks", "step k: GPU-r sends chunk (r - k) mod G holding the sum of GPUs r-k..r (read from "
                                 "the tagged values, not from labels)", 2),
            RubricLine("values", "the chunk each GPU completes, (r + 1) mod G, equals the sum over every GPU", 2),
            RubricLine("returned", "returns the index of that chunk, (r + 1) mod G", 2),
            UNEVEN, SINGLE),
    ring_picture=True))

register(RingAllGather(
    name="ring_all_gather", notebook="05_ring_all_gather", points=10,
    signature="ring_all_gather(tensor) -> None",
    summary="phase 2 of the ring: in step k rank r sends chunk (r + 1 - k) mod G to r + 1, the receiver overwrites "
            "its copy; starts from what a real scatter-reduce leaves",
    rubric=(MESSAGES,
            RubricLine("chunks", "step k: GPU-r sends chunk (r + 1 - k) mod G, complete (the input is what a real "
                                 "scatter-reduce leaves: partial sums in all chunks but one)", 3),
            RubricLine("values", "afterwards every chunk on every GPU equals the sum over every GPU: a received chunk "
                                 "replaces the partial sum", 3),
            UNEVEN, SINGLE),
    ring_picture=True))

register(Ring(
    name="ring", notebook="05_ring_all_gather", points=5,
    signature="ring(tensor) -> None",
    summary="the ring all-reduce: your ring_scatter_reduce, then your ring_all_gather",
    rubric=(RubricLine("messages", "every GPU sends 2(G - 1) messages, each to its right neighbour, "
                                   "2N - |chunk r+1| - |chunk r+2| (about 2(G-1)N/G) elements in all", 1),
            RubricLine("scatter_reduce", "its first G - 1 sends are the scatter-reduce: step k sends chunk (r - k) mod G "
                                         "with the partial sum of GPUs r-k..r", 1.25),
            RubricLine("all_gather", "its last G - 1 sends are the all-gather: step k sends the complete chunk "
                                     "(r + 1 - k) mod G", 1.25),
            RubricLine("values", "every GPU ends with the sum over every GPU; with random data every GPU holds the same "
                                 "bits", 0.5),
            RubricLine("uneven", UNEVEN.text, 0.5, family=UNEVEN_LENGTHS),
            RubricLine("single", SINGLE.text, 0.5, family=SINGLE_RANK)),
    ring_picture=True))
