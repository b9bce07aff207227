"""Notebooks 00 and 02: a token round the ring, broadcast and all-gather.

    pass_token(token) -> list        pass `token` (a 1-D tensor) to the right G - 1 times, each time
                                     passing on what just arrived; return the G tokens held, own first
    broadcast(tensor, src=0)         every rank's tensor becomes src's, in place
    all_gather(tensor_list, tensor)  every rank's tensor_list[j] becomes rank j's tensor, in place

All three only copy data, so the check identifies what a rank holds or sent by comparing it with
every rank's input: "rank 3 holds rank 0's values", "step 1: rank 2 passed on its own token again". A value
a rank ends with must be its own or one some message brought it (`data.unexplained_values`).
"""

from __future__ import annotations

import torch

from course_lib.exercises import data
from course_lib.exercises.cases import VISIBLE_SIZES, clone, portable, standard_cases
from course_lib.exercises.registry import Case, FunctionExercise, Problem, register
from course_lib.exercises.rubric import OTHER_ROOTS, SINGLE_RANK, RubricLine

__all__ = ["PassToken", "Broadcast", "AllGather"]


def _whose(values, inputs, world_size, tagged, sentinel=None) -> str:
    """'its own values', "rank 0's values", 'a sum of a+c', ... for what a tensor holds."""
    if sentinel is not None and data.same_values(values, sentinel):
        return "never written"
    owner = data.which_input(values, inputs)
    if owner is not None:
        return f"rank {owner}'s values"
    if tagged:
        holds = data.decode_whole(values, world_size)
        if holds is not None and len(holds) > 1:
            names = [str(r) for r in sorted(holds)]
            return f"a sum of the values of ranks {', '.join(names[:-1])} and {names[-1]}"
    return "values that are no rank's input"


def _unexplained(rank, what: str) -> Problem:
    """Rank `rank`'s `what` holds values neither its input nor any message it received carried: it costs every line."""
    return Problem(f"rank {rank}'s {what} holds values that no message it received carried (and its own input does "
                   "not hold them either): they did not come through the point-to-point messages the check traces.",
                   order=(-1, rank))


# --------------------------------------------------------------------------------------------------
# 00: a token round the ring
# --------------------------------------------------------------------------------------------------


def pass_token_cases(sizes: tuple = VISIBLE_SIZES) -> list[Case]:
    """For every G in `sizes`: a token of one tagged element (100 + rank, easy to follow), then for G > 1 one of
    three random elements."""
    cases = []
    for G in sorted(sizes):
        cases.append(Case(G, 1, "tagged"))
        if G > 1:
            cases.append(Case(G, 3, "random", 1))
    return cases


class PassToken(FunctionExercise):
    observed = ("returned",)

    def cases(self):
        return pass_token_cases()

    def inputs(self, case):
        if case.data == "tagged":
            return [torch.full((1,), 100.0 + rank) for rank in range(case.world_size)]
        return [data.make_input(case, rank) for rank in range(case.world_size)]

    def oracle(self, case, inputs):
        return [{"start": token.clone(), "everyone": [t.clone() for t in inputs]} for token in inputs]

    def run_case(self, call, case, rank, world_size, inputs):
        returned = call(inputs.clone())
        return {"returned": portable(returned)}

    def judge(self, case, records, complete=True):
        G = case.world_size
        tokens = records[0]["everyone"] if complete else None
        problems = []
        for rank, record in enumerate(records):
            sends = [m for m in record["messages"] if m.is_send]
            right = (rank + 1) % G
            for step, message in enumerate(sends[:G - 1]):
                if message.peer != right:
                    problems.append(Problem(
                        f"step {step}: rank {rank} sent to rank {message.peer}; pass the token to the right "
                        f"neighbour, (rank + 1) % world_size = {right}.", order=(0, step, rank), line="messages"))
                    continue
                if tokens is None:
                    continue
                owner, want = data.which_input(message.data, tokens), (rank - step) % G
                if owner == want:
                    continue
                if owner == rank and step > 0:
                    text = (f"step {step}: rank {rank} passed on its own token again; pass on the token it received "
                            f"in step {step - 1} (rank {want}'s).")
                elif owner is not None:
                    text = (f"step {step}: rank {rank} passed rank {owner}'s token; in step {step} it should pass "
                            f"rank {want}'s" + (", the one it received in the step before." if step else ", its own."))
                else:
                    text = f"step {step}: rank {rank} sent values that are nobody's token."
                problems.append(Problem(text, order=(0, step, rank), line="passes"))
            if complete and len(sends) != G - 1:
                problems.append(Problem(
                    f"rank {rank} sent {len(sends)} message{'s' if len(sends) != 1 else ''}; passing the token round "
                    f"G = {G} ranks takes G - 1 = {G - 1} steps, one message each.", order=(0, len(sends), rank, 1),
                    line="messages"))
        if not complete:
            return problems
        for rank, record in enumerate(records):
            returned = record["returned"]
            if not isinstance(returned, (list, tuple)):
                problems.append(Problem(
                    f"rank {rank} returned {type(returned).__name__}; pass_token returns the list of the {G} tokens "
                    "the rank held, its own first.", order=(1, rank), line="returned"))
                continue
            if len(returned) != G:
                problems.append(Problem(
                    f"rank {rank} returned {len(returned)} token{'s' if len(returned) != 1 else ''}; after G - 1 "
                    f"passes it has held G = {G} (its own and one per step).", order=(1, rank), line="returned"))
                continue
            received = data.received_by(records, rank)
            if any(data.unexplained_values(item, record["start"], received) for item in returned):
                problems.append(_unexplained(rank, "returned list"))
                continue
            for k, item in enumerate(returned):
                want = (rank - k) % G
                if data.same_values(item, tokens[want]):
                    continue
                owner = next((p for p, t in enumerate(tokens) if data.same_values(item, t)), None)
                held = f"rank {owner}'s token" if owner is not None else "no rank's token"
                problems.append(Problem(
                    f"rank {rank}'s list: item {k} is {held}; it should be rank {want}'s, the token from {k} "
                    f"place{'s' if k != 1 else ''} to the left.", order=(1, rank, k), line="returned"))
                break
        return problems


# --------------------------------------------------------------------------------------------------
# 02: broadcast and all-gather
# --------------------------------------------------------------------------------------------------


class Broadcast(FunctionExercise):
    observed = ("after",)

    def cases(self):
        return standard_cases(rooted=True)

    def oracle(self, case, inputs):
        return [{"start": t.clone(), "expected": inputs[case.root].clone()} for t in inputs]

    def run_case(self, call, case, rank, world_size, inputs):
        tensor = inputs.clone()
        call(tensor, src=case.root)
        return {"after": clone(tensor)}

    def judge(self, case, records, complete=True):
        G, src = case.world_size, case.root
        if not complete:
            return []
        problems = []
        inputs = [record["start"] for record in records]
        source = records[src]
        if data.first_difference(source["after"], source["expected"]) is None:
            pass
        elif (owner := data.which_input(source["after"], inputs)) is not None:
            problems.append(Problem(
                f"broadcast from rank {src}: the source, rank {src}, ended with rank {owner}'s values, so your code "
                f"broadcast from rank {owner}; use the src it was given (src={src}).", order=(0, -1), line="values"))
        else:
            problems.append(Problem(
                f"broadcast from rank {src} changed the source's own tensor (it now holds "
                f"{_whose(source['after'], inputs, G, case.data == 'tagged')}): src only sends.", order=(0, -1),
                line="values"))
        for rank, record in enumerate(records):
            if rank == src:
                continue
            if data.first_difference(record["after"], record["expected"]) is None:
                if data.unexplained_values(record["after"], record["start"], data.received_by(records, rank)):
                    problems.append(_unexplained(rank, "tensor"))
                continue
            holds = _whose(record["after"], inputs, G, case.data == "tagged")
            if holds == f"rank {rank}'s values":
                text = f"after broadcast from rank {src}, rank {rank} still holds its own values."
            elif holds.startswith("a sum"):
                text = (f"after broadcast from rank {src}, rank {rank} holds {holds}: broadcast copies src's tensor, "
                        "it does not add.")
            else:
                text = (f"after broadcast from rank {src}, rank {rank} holds {holds}; it should hold rank {src}'s "
                        f"(src={src}).")
            problems.append(Problem(text, order=(0, rank), line="values"))
        for rank, record in enumerate(records):
            received = sum(m.numel for m in record["messages"] if not m.is_send)
            want = 0 if rank == src else case.numel
            if received != want:
                text = (f"the source, rank {src}, received {received} elements: in a broadcast src only sends."
                        if rank == src else
                        f"rank {rank} received {received} elements; it needs src's N = {case.numel} elements once.")
                problems.append(Problem(text, order=(1, rank), line="traffic"))
        return problems


def _fill(case) -> float:
    """What an all-gather slot holds before the learner's function runs: a value no rank's input has."""
    return -1.0 if case.data == "tagged" else float("nan")


class AllGather(FunctionExercise):
    observed = ("after", "slots")

    def oracle(self, case, inputs):
        return [{"start": t.clone(), "expected": [u.clone() for u in inputs], "fill": _fill(case)} for t in inputs]

    def run_case(self, call, case, rank, world_size, inputs):
        tensor = inputs.clone()
        tensor_list = [torch.full_like(tensor, _fill(case)) for _ in range(world_size)]
        call(tensor_list, tensor)
        return {"after": clone(tensor), "slots": [clone(t) for t in tensor_list]}

    def judge(self, case, records, complete=True):
        G, N = case.world_size, case.numel
        if not complete:
            return []
        problems = []
        inputs = [record["start"] for record in records]
        for rank, record in enumerate(records):
            sentinel = torch.full((N,), record["fill"])
            slots = list(record["slots"])
            if len(slots) != G:
                problems.append(Problem(f"rank {rank}'s tensor_list has {len(slots)} slots after the call; it had G = "
                                        f"{G}: fill the slots in place, do not add or remove any.", order=(0, rank),
                                        line="others"))
                continue
            received = data.received_by(records, rank)
            for slot, (got, want) in enumerate(zip(slots, record["expected"])):
                line = "own" if slot == rank else "others"
                if data.first_difference(got, want) is None:
                    if slot != rank and data.unexplained_values(got, record["start"], received):
                        problems.append(_unexplained(rank, f"tensor_list[{slot}]"))
                    continue
                holds = _whose(got, inputs, G, case.data == "tagged", sentinel=sentinel if N else None)
                if holds == "never written":
                    text = f"rank {rank}'s tensor_list[{slot}] was never written" + (
                        ": copy the rank's own tensor into its own slot too." if slot == rank else ".")
                else:
                    text = f"rank {rank}'s tensor_list[{slot}] holds {holds}; tensor_list[j] must hold rank j's tensor."
                problems.append(Problem(text, order=(0, rank, slot), line=line))
                if slot != rank:
                    break
            if not data.same_values(record["after"], record["start"]):
                problems.append(Problem(f"rank {rank}'s own tensor changed: all_gather only reads it.", order=(0, rank, G),
                                        line="own"))
        for rank, record in enumerate(records):
            received = sum(m.numel for m in record["messages"] if not m.is_send)
            if received != (G - 1) * N:
                problems.append(Problem(
                    f"rank {rank} received {received} elements; it needs each of the other G - 1 tensors once: "
                    f"(G - 1) N = {(G - 1) * N}.", order=(1, rank), line="traffic"))
                break
        return problems


register(PassToken(
    name="pass_token", notebook="00_hello_ranks", points=5,
    signature="pass_token(token) -> list",
    summary="pass a 1-D tensor to the right G - 1 times, each time passing on what arrived; return the G tokens "
            "held, own first",
    rubric=(RubricLine("messages", "every rank sends G - 1 messages, each to its right neighbour (rank + 1) % "
                                   "world_size", 1.5),
            RubricLine("passes", "in step k a rank passes on rank (r - k)'s token, the one it received in step k - 1",
                       1.5),
            RubricLine("returned", "the returned list holds the tokens of ranks r, r-1, ..., r-G+1, its own first", 1),
            RubricLine("single", "with one rank (G = 1) it returns [its own token] and sends nothing", 1,
                       family=SINGLE_RANK))))

register(Broadcast(
    name="broadcast", notebook="02_collectives", points=5,
    signature="broadcast(tensor, src=0) -> None",
    summary="every rank's tensor becomes a copy of rank src's, in place",
    rubric=(RubricLine("values", "every rank's tensor ends as a copy of src's, in place; src's own is unchanged", 3),
            RubricLine("traffic", "every rank but src receives src's N elements once; src receives nothing", 1),
            RubricLine("any_src", "also right when src is not rank 0 (src = G - 1 and one in between)", 1,
                       family=OTHER_ROOTS)),
    root_name="src"))

register(AllGather(
    name="all_gather", notebook="02_collectives", points=5,
    signature="all_gather(tensor_list, tensor) -> None",
    summary="on every rank, tensor_list[j] becomes a copy of rank j's tensor; tensor is not changed",
    rubric=(RubricLine("own", "tensor_list[rank] holds a copy of the rank's own tensor, which is not changed", 1),
            RubricLine("others", "tensor_list[j] holds rank j's tensor for every other rank j (slots start filled "
                                 "with -1 or NaN, so a slot nobody wrote is caught)", 2),
            RubricLine("traffic", "every rank receives each other rank's tensor once: (G - 1) N elements", 2))))
