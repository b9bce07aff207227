"""Notebook 03: the naive exchange and the parameter server.

    naive(tensor)                     every rank sends its whole tensor to each of the G - 1 others and
                                      sums what it has: (G - 1) N elements sent per rank
    parameter_server(tensor, root=0)  every rank sends its tensor to `root`, which sums them and sends
                                      the result back: all traffic goes through the root it was given

Both end with every rank's tensor equal to torch.distributed.all_reduce's. The check also reads who
sent what to whom: a naive exchange that sends twice, or a parameter server that always uses rank 0,
computes the right numbers and still fails.
"""

from __future__ import annotations

from collections import Counter

from course_lib.exercises import data
from course_lib.exercises.cases import standard_cases
from course_lib.exercises.registry import FunctionExercise, Problem, register
from course_lib.exercises.rubric import OTHER_ROOTS, RubricLine
from course_lib.exercises.ring import _run_all_reduce_case

__all__ = ["Naive", "ParameterServer"]


def _content(message, inputs, case):
    """What a message carried: ('own', rank), ('sum', ranks) or ('other', None)."""
    owner = data.which_input(message.data, inputs)
    if owner is not None:
        return "own", owner
    if case.data == "tagged":
        holds = data.decode_whole(message.data, case.world_size)
        if holds is not None:
            return "sum", holds
    return "other", None


def _result_problems(case, records, name):
    """Every rank's tensor against the judge's sum ('values'); with tagged data, a result holding contributions no
    received message carried costs every line."""
    G = case.world_size
    problems = []
    for rank, record in enumerate(records):
        if case.data == "tagged":
            extra = data.unexplained_contributors(record["after"], record["start"], data.received_by(records, rank), G)
            if extra:
                problems.append(Problem(
                    f"after {name}, rank {rank} holds the values of rank{'s' if len(extra) > 1 else ''} "
                    f"{', '.join(map(str, sorted(extra)))}, but no message it received carried them: they did not come "
                    "through the point-to-point messages the check traces.", order=(-1, rank)))
                continue
        tol = None if case.data == "tagged" else data.tolerance(record["abs_sum"], G)
        diff = data.first_difference(record["after"], record["expected"], tol)
        if diff is None:
            continue
        if data.same_values(record["after"], record["start"]):
            text = (f"rank {rank}'s tensor was not changed: write the sum into `tensor` itself, in place "
                    "(tensor.copy_(total), tensor += ...), not into a new tensor.")
        elif case.data == "tagged" and data.decode_whole(record["after"], G) is not None:
            holds = data.decode_whole(record["after"], G)
            missing = sorted(set(range(G)) - holds)
            held = f"the sum of ranks {', '.join(map(str, sorted(holds)))}" if holds else "none of the ranks' values"
            text = (f"after {name}, rank {rank} holds {held}"
                    + (f": {'rank' if len(missing) == 1 else 'ranks'} {', '.join(map(str, missing))}'s values "
                       "are missing." if missing else "."))
        else:
            index, value, want = diff
            text = (f"after {name}, rank {rank}'s element {index} is {value:.6g}; the all-reduce (the sum over every "
                    f"rank) is {want:.6g}.")
        problems.append(Problem(text, order=(9, rank), line="values"))
    return problems


class Naive(FunctionExercise):
    def run_case(self, call, case, rank, world_size, inputs):
        return _run_all_reduce_case(call, case, rank, world_size, inputs)

    def judge(self, case, records, complete=True):
        G, N = case.world_size, case.numel
        inputs = [record.get("start") for record in records]
        problems = []
        for rank, record in enumerate(records):
            sends = [m for m in record["messages"] if m.is_send]
            per_peer = Counter(m.peer for m in sends)
            for peer, count in sorted(per_peer.items()):
                if count > 1:
                    problems.append(Problem(
                        f"rank {rank} sent {count} messages to rank {peer}; the naive exchange sends its tensor once to "
                        f"each of the G - 1 others: (G - 1) N = {(G - 1) * N} elements per rank, rank {rank} sent "
                        f"{sum(m.numel for m in sends)}.", order=(0, rank, peer), line="traffic"))
                    break
            for m in sends:
                if m.numel != N:
                    problems.append(Problem(f"rank {rank} sent {m.numel} elements to rank {m.peer}; send the whole "
                                            f"tensor (N = {N} elements).", order=(0, rank, m.peer, 1), line="traffic"))
                    break
                if inputs[0] is None or N == 0:
                    continue
                kind, what = _content(m, inputs, case)
                if kind == "own" and what == rank:
                    continue
                if kind == "sum":
                    text = (f"rank {rank} sent rank {m.peer} the sum of ranks {', '.join(map(str, sorted(what)))}: send "
                            "your own input, unchanged (keep a copy before you add into it).")
                elif kind == "own":
                    text = f"rank {rank} sent rank {m.peer} rank {what}'s values: each rank sends its own tensor."
                else:
                    text = (f"rank {rank} sent rank {m.peer} values that are not its input: send your own tensor, "
                            "unchanged.")
                problems.append(Problem(text, order=(0, rank, m.peer, 2), line="own_tensor"))
                break
            if complete:
                missing = [peer for peer in range(G) if peer != rank and peer not in per_peer]
                if missing:
                    problems.append(Problem(
                        f"rank {rank} sent nothing to rank {missing[0]}; in the naive exchange every rank sends its "
                        "whole tensor to every other rank.", order=(0, rank, missing[0], 3), line="traffic"))
        if complete:
            problems += _result_problems(case, records, "the naive exchange")
        return problems


class ParameterServer(FunctionExercise):
    def cases(self):
        return standard_cases(rooted=True)

    def run_case(self, call, case, rank, world_size, inputs):
        return _run_all_reduce_case(lambda tensor: call(tensor, root=case.root), case, rank, world_size, inputs)

    def judge(self, case, records, complete=True):
        G, N, root = case.world_size, case.numel, case.root
        inputs = [record.get("start") for record in records]
        tagged = case.data == "tagged" and N > 0
        problems = []
        # Who gathered the tensors? In a parameter server, only the root receives from several ranks.
        for rank, record in enumerate(records):
            senders = sorted({m.peer for m in record["messages"] if not m.is_send})
            if rank != root and len(senders) > 1:
                problems.append(Problem(
                    f"rank {rank} received tensors from ranks {', '.join(map(str, senders))}, but the root is rank "
                    f"{root}: the parameter server goes through the root it was given (root={root}).", order=(0, rank),
                    line="workers"))
        sends = [[m for m in record["messages"] if m.is_send] for record in records]
        for rank in range(G):
            if rank == root:
                continue
            stray = next((m for m in sends[rank] if m.peer != root), None)
            if stray is not None:
                problems.append(Problem(
                    f"rank {rank} sent its tensor to rank {stray.peer}, but the root is rank {root}: in the parameter "
                    f"server the workers talk only to the root it was given (root={root}).", order=(1, rank),
                    line="workers"))
        per_peer = Counter(m.peer for m in sends[root])
        for m in sends[root]:
            if not tagged or m.numel != N:
                continue
            holds = data.decode_whole(m.data, G)
            if holds == {root}:
                problems.append(Problem(
                    f"the root (rank {root}) sent rank {m.peer} its own input instead of the sum: the workers send to "
                    f"the root first, and the root it was given (root={root}) sends the result back.", order=(2, m.peer),
                    line="root"))
                break
            if holds is not None and holds != data.everyone(G):
                problems.append(Problem(
                    f"the root (rank {root}) sent rank {m.peer} the sum of ranks {', '.join(map(str, sorted(holds)))}, "
                    "not yet the complete sum: add every worker's tensor before sending the result back.",
                    order=(2, m.peer), line="root"))
                break
        for peer in range(G):
            if peer == root:
                continue
            if per_peer[peer] > 1:
                problems.append(Problem(f"the root (rank {root}) sent {per_peer[peer]} messages to rank {peer}; it "
                                        "sends the result to each worker once.", order=(2, peer), line="root"))
            elif per_peer[peer] == 0 and complete:
                problems.append(Problem(f"the root (rank {root}) sent nothing to rank {peer}: after summing, it sends "
                                        "the result back to every other rank.", order=(2, peer), line="root"))
            mine = [m for m in sends[peer] if m.peer == root]
            if len(mine) > 1:
                problems.append(Problem(f"rank {peer} sent {len(mine)} messages to the root; each worker sends its "
                                        "tensor once.", order=(3, peer), line="workers"))
            elif complete and not mine and not sends[peer]:
                problems.append(Problem(f"rank {peer} sent nothing: every worker sends its tensor to the root, "
                                        f"rank {root}.", order=(3, peer), line="workers"))
            elif mine and mine[0].numel != N:
                problems.append(Problem(f"rank {peer} sent {mine[0].numel} elements; send the whole tensor (N = {N}).",
                                        order=(3, peer), line="workers"))
            elif mine and inputs[0] is not None and N and data.which_input(mine[0].data, inputs) != peer:
                problems.append(Problem(f"rank {peer} sent the root values that are not its own input.",
                                        order=(3, peer), line="workers"))
        if complete:
            problems += _result_problems(case, records, f"the parameter server (root={root})")
        return problems


register(Naive(
    name="naive", notebook="03_naive_and_master_allreduce", points=5,
    signature="naive(tensor) -> None",
    summary="all-reduce by full exchange: send your whole tensor to each other rank, sum what you hold",
    rubric=(RubricLine("values", "every rank ends with the sum over all ranks, in place (exact with tagged data, "
                                 "within float tolerance with random data)", 2),
            RubricLine("own_tensor", "what a rank sends is its own input, unchanged (not a partial sum)", 1.5),
            RubricLine("traffic", "every rank sends its whole tensor exactly once to each other rank: (G - 1) N "
                                  "elements", 1.5))))

register(ParameterServer(
    name="parameter_server", notebook="03_naive_and_master_allreduce", points=5,
    signature="parameter_server(tensor, root=0) -> None",
    summary="all-reduce through one root: everyone sends to root, root sums and sends the result to everyone",
    rubric=(RubricLine("values", "every rank ends with the sum over all ranks, in place", 2),
            RubricLine("workers", "every worker sends its own tensor once, only to the root it was given", 1),
            RubricLine("root", "the root sends the complete sum back to every worker once", 1),
            RubricLine("any_root", "also right when the root is not rank 0 (root = G - 1 and one in between)", 1,
                       family=OTHER_ROOTS))))
