"""Bad input ends on every rank in an error that says what is wrong: never a hang, never a wrong answer.

Each case is a call every rank makes (possibly with different arguments per rank). The rank function
runs all cases in one launch, catches each exception and returns (type name, message) per case, so
the test can check that EVERY rank raised, with which type, and that the message names the bad
value or the ranks involved. The rank whose own argument is wrong raises TypeError / ValueError; its
partners raise MismatchError instead of waiting for it. After the cases a correct all-reduce checks
that no stray message was left in flight.

Also: the point-to-point wrappers' own checks, errors outside a process group, and one
uncaught error through launch, which must end the launch within seconds.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import course_lib
from conftest import run
from course_lib import MismatchError, allreduce, collectives, p2p

N = 5  # elements in the cases' tensors


def t(n=N, dtype=torch.float32, value=1.0):
    return torch.full((n,), value, dtype=dtype) if dtype.is_floating_point or dtype.is_complex \
        else torch.full((n,), int(value), dtype=dtype)


# Every function that takes one tensor (and possibly an op / root), as f(tensor, op) with defaults.
ONE_TENSOR_REDUCERS = {
    "collectives.all_reduce": lambda x, op="SUM": collectives.all_reduce(x, op=op),
    "collectives.reduce": lambda x, op="SUM": collectives.reduce(x, dst=1, op=op),
    "allreduce.naive": lambda x, op="SUM": allreduce.naive(x, op),
    "allreduce.parameter_server": lambda x, op="SUM": allreduce.parameter_server(x, op, root=1),
    "allreduce.ring": lambda x, op="SUM": allreduce.ring(x, op),
    "allreduce.ring_scatter_reduce": lambda x, op="SUM": allreduce.ring_scatter_reduce(x, op),
}


def _like(x):
    """A tensor shaped like `x` for the lists around it; a plain one when `x` is not a tensor."""
    return torch.ones_like(x) if isinstance(x, torch.Tensor) else torch.ones(N)


def _rank_of(G):
    """name -> call(x, rank, G) for every collective, `x` being this rank's (possibly bad) tensor."""
    return {
        **{name: (lambda f: lambda x, rank, G: f(x))(f) for name, f in ONE_TENSOR_REDUCERS.items()},
        "allreduce.ring_all_gather": lambda x, rank, G: allreduce.ring_all_gather(x),
        "collectives.broadcast": lambda x, rank, G: collectives.broadcast(x, src=1),
        "collectives.reduce_scatter": lambda x, rank, G: collectives.reduce_scatter(x, [_like(x) for _ in range(G)]),
        "collectives.all_gather": lambda x, rank, G: collectives.all_gather([_like(x) for _ in range(G)], x),
        "collectives.gather": lambda x, rank, G: collectives.gather(
            x, [_like(x) for _ in range(G)] if rank == 0 else None, dst=0),
        "collectives.scatter": lambda x, rank, G: collectives.scatter(
            x, [_like(x) for _ in range(G)] if rank == 0 else None, src=0),
    }


def _cases(G):
    """name -> (call(rank, G), expect(rank, G) -> (exception type name, [substrings of the message]))."""
    cases = {}
    bad_rank = 1  # the rank that gets the odd argument when only one does

    def everyone(type_name, *words):
        return lambda rank, G: (type_name, list(words))

    def only_bad_rank(type_name, *words):
        """The bad rank raises `type_name`; the others a MismatchError naming it."""
        return lambda rank, G: ((type_name, list(words)) if rank == bad_rank
                                else ("MismatchError", [f"[{bad_rank}]", "invalid arguments"]))

    # --- a root outside the group ------------------------------------------------------------------
    for bad in (G, -1):
        words = (f"rank {bad} is not in the group", f"0..{G - 1}")
        cases[f"broadcast src={bad}"] = (lambda rank, G, b=bad: collectives.broadcast(t(), src=b),
                                         everyone("ValueError", *words))
        cases[f"scatter src={bad}"] = (lambda rank, G, b=bad: collectives.scatter(t(), None, src=b),
                                       everyone("ValueError", *words))
        cases[f"gather dst={bad}"] = (lambda rank, G, b=bad: collectives.gather(t(), None, dst=b),
                                      everyone("ValueError", *words))
        cases[f"reduce dst={bad}"] = (lambda rank, G, b=bad: collectives.reduce(t(), dst=b),
                                      everyone("ValueError", *words))
        cases[f"parameter_server root={bad}"] = (lambda rank, G, b=bad: allreduce.parameter_server(t(), root=b),
                                                 everyone("ValueError", *words))
        cases[f"broadcast src={bad} on rank {bad_rank} only"] = (
            lambda rank, G, b=bad: collectives.broadcast(t(), src=b if rank == bad_rank else 0),
            only_bad_rank("ValueError", *words))
    cases["broadcast src=True"] = (lambda rank, G: collectives.broadcast(t(), src=True),
                                   everyone("ValueError", "rank True is not in the group"))
    cases["broadcast, ranks disagree about src"] = (
        lambda rank, G: collectives.broadcast(t(), src=1 if rank == 1 else 0),
        everyone("MismatchError", "disagree about root", "ranks 0, 2", ": 0;", "rank 1: 1"))
    cases["reduce, ranks disagree about dst"] = (
        lambda rank, G: collectives.reduce(t(), dst=0 if rank else G - 1),
        everyone("MismatchError", "disagree about root", f"rank 0: {G - 1}"))

    # --- not a tensor ------------------------------------------------------------------------------
    calls = _rank_of(G)
    for name, call in calls.items():
        cases[f"{name}(list) on every rank"] = (
            lambda rank, G, call=call: call([1.0] * N, rank, G),
            everyone("TypeError", "torch.Tensor", "list"))
        cases[f"{name}(list) on rank {bad_rank} only"] = (
            lambda rank, G, call=call: call([1.0] * N if rank == bad_rank else t(), rank, G),
            only_bad_rank("TypeError", "torch.Tensor", "list"))
    cases["scatter_list entry that is not a tensor"] = (
        lambda rank, G: collectives.scatter(t(), [t(), 3.0] + [t()] * (G - 2) if rank == bad_rank else None,
                                            src=bad_rank),
        only_bad_rank("TypeError", "scatter_list[1]", "float"))
    cases["gather_list too short"] = (
        lambda rank, G: collectives.gather(t(), [t()] * (G - 1) if rank == bad_rank else None, dst=bad_rank),
        only_bad_rank("ValueError", "gather_list", f"world_size={G}", f"{G - 1} entries"))
    cases["all_gather tensor_list of the wrong size on one rank"] = (
        lambda rank, G: collectives.all_gather([t(N + (rank == bad_rank)) for _ in range(G)], t()),
        only_bad_rank("ValueError", "tensor_list[0]", f"{N + 1} elements", f"has {N}"))
    cases["all_to_all input list that is not a list"] = (
        lambda rank, G: collectives.all_to_all([t() for _ in range(G)], t() if rank == bad_rank else [t()] * G),
        only_bad_rank("ValueError", "input_tensor_list", "list", f"world_size={G}"))

    # --- lengths that differ between ranks ---------------------------------------------------------
    for name, call in calls.items():
        cases[f"{name}, rank {bad_rank} has {N + 1} elements"] = (
            lambda rank, G, call=call: call(t(N + (rank == bad_rank)), rank, G),
            everyone("MismatchError", "disagree about numel", f"rank {bad_rank}: {N + 1}", f": {N}"))
    cases["all_to_all, a piece of the wrong size"] = (  # rank 1 sends rank 0 one element more than it expects
        lambda rank, G: collectives.all_to_all([t() for j in range(G)],
                                               [t(N + (rank == 1 and j == 0)) for j in range(G)]),
        everyone("MismatchError", f"rank 1's input_tensor_list[0] has {N + 1} elements",
                 f"rank 0's output_tensor_list[1] has room for {N}"))

    # --- an op the dtype does not support, or no op at all ----------------------------------------
    for name, call in ONE_TENSOR_REDUCERS.items():
        cases[f"{name} AVG on int64"] = (lambda rank, G, call=call: call(t(dtype=torch.int64), "AVG"),
                                         everyone("TypeError", "AVG", "torch.int64", "float"))
        cases[f"{name} MAX on complex64"] = (lambda rank, G, call=call: call(t(dtype=torch.complex64), "MAX"),
                                             everyone("TypeError", "MAX", "complex"))
        cases[f"{name} op='mean'"] = (lambda rank, G, call=call: call(t(), "mean"),
                                      everyone("ValueError", "unsupported reduce op 'mean'", "ReduceOp.SUM"))
        cases[f"{name} op=None"] = (lambda rank, G, call=call: call(t(), None),
                                    everyone("ValueError", "unsupported reduce op None"))
        cases[f"{name}, ranks disagree about the op"] = (
            lambda rank, G, call=call: call(t(), "MIN" if rank == bad_rank else "SUM"),
            everyone("MismatchError", "disagree about op", f"rank {bad_rank}: MIN", "SUM"))
        cases[f"{name} AVG on int64 on rank {bad_rank} only"] = (
            lambda rank, G, call=call: call(t(dtype=torch.int64), "AVG" if rank == bad_rank else "SUM"),
            only_bad_rank("TypeError", "AVG", "torch.int64"))
    cases["reduce_scatter AVG on int64"] = (
        lambda rank, G: collectives.reduce_scatter(t(dtype=torch.int64), [t(dtype=torch.int64)] * G, op="AVG"),
        everyone("TypeError", "AVG", "torch.int64"))
    cases["reduce_scatter MIN on complex128"] = (
        lambda rank, G: collectives.reduce_scatter(t(dtype=torch.complex128), [t(dtype=torch.complex128)] * G,
                                                   op=dist.ReduceOp.MIN),
        everyone("TypeError", "MIN", "complex"))

    # --- dtypes that differ between ranks ----------------------------------------------------------
    for name, call in calls.items():
        cases[f"{name}, rank {bad_rank} passes float64"] = (
            lambda rank, G, call=call: call(t(dtype=torch.float64 if rank == bad_rank else torch.float32), rank, G),
            everyone("MismatchError", "disagree about dtype", f"rank {bad_rank}: torch.float64", "torch.float32"))
    cases["all_to_all, rank 1 passes int64"] = (
        lambda rank, G: collectives.all_to_all([t(dtype=torch.int64 if rank == bad_rank else torch.float32)] * G,
                                               [t(dtype=torch.int64 if rank == bad_rank else torch.float32)] * G),
        everyone("MismatchError", "disagree about dtype", f"rank {bad_rank}: torch.int64"))
    cases["all_to_all, input and output dtypes differ"] = (
        lambda rank, G: collectives.all_to_all([t(dtype=torch.float64)] * G, [t()] * G),
        everyone("TypeError", "same dtype", "torch.float32", "torch.float64"))

    # --- a missing root, or a root given twice: at once, never a receive from "anyone" ---------------
    cases["broadcast src=None"] = (lambda rank, G: collectives.broadcast(t(), src=None),
                                   everyone("ValueError", "broadcast: src=None", "which rank holds the data"))
    cases["broadcast with no src at all"] = (lambda rank, G: collectives.broadcast(t()),
                                             everyone("ValueError", "broadcast: src=None"))
    cases["reduce dst=None"] = (lambda rank, G: collectives.reduce(t(), dst=None),
                                everyone("ValueError", "reduce: dst=None", "receives the result"))
    cases[f"broadcast src=None on rank {bad_rank} only"] = (
        lambda rank, G: collectives.broadcast(t(), src=None if rank == bad_rank else 0),
        only_bad_rank("ValueError", "broadcast: src=None"))
    cases["reduce dst=torch.tensor(0)"] = (lambda rank, G: collectives.reduce(t(), dst=torch.tensor(0)),
                                           everyone("ValueError", "reduce: dst=tensor(0) is a Tensor", "Python int"))
    cases["broadcast src and group_src"] = (lambda rank, G: collectives.broadcast(t(), src=0, group_src=0),
                                            everyone("ValueError", "pass src or group_src, not both"))
    cases["gather dst and group_dst on one rank"] = (
        lambda rank, G: collectives.gather(t(), [t()] * G if rank == 0 else None, dst=0,
                                           group_dst=0 if rank == bad_rank else None),
        only_bad_rank("ValueError", "pass dst or group_dst, not both"))
    cases["scatter_list on a rank other than src"] = (
        lambda rank, G: collectives.scatter(t(), [t()] * G if rank in (0, bad_rank) else [], src=0),
        only_bad_rank("ValueError", "scatter_list must be None or [] on ranks other than src=0"))

    # --- what course_lib deliberately leaves out: the error says so, and what to use -------------
    cases["all_reduce op=BAND"] = (lambda rank, G: collectives.all_reduce(t(dtype=torch.int64), op=dist.ReduceOp.BAND),
                                   everyone("ValueError", "unsupported reduce op ReduceOp.BAND", "deliberately",
                                            "torch.distributed.all_reduce(tensor, op=ReduceOp.BAND)"))
    cases["reduce_scatter op=BOR"] = (
        lambda rank, G: collectives.reduce_scatter(t(dtype=torch.int64), [t(dtype=torch.int64)] * G,
                                                   op=dist.ReduceOp(dist.ReduceOp.BOR)),
        everyone("ValueError", "unsupported reduce op ReduceOp.BOR", "deliberately"))
    cases["all_reduce PREMUL_SUM"] = (lambda rank, G: collectives.all_reduce(t(), op=dist._make_nccl_premul_sum(2.0)),
                                      everyone("ValueError", "ReduceOp.PREMUL_SUM", "deliberately", "then reduce with SUM"))
    cases["all_reduce SUM on bool"] = (lambda rank, G: collectives.all_reduce(t(dtype=torch.bool), op="sum"),
                                       everyone("TypeError", "bool", "deliberately refuses", "MAX (logical or)"))

    # --- async_op=True: the same errors, from wait(), on every rank --------------------------------
    cases[f"async all_reduce, rank {bad_rank} has {N + 1} elements"] = (
        lambda rank, G: collectives.all_reduce(t(N + (rank == bad_rank)), async_op=True).wait(),
        everyone("MismatchError", "disagree about numel"))
    cases["async broadcast src=None"] = (lambda rank, G: collectives.broadcast(t(), src=None, async_op=True).wait(),
                                         everyone("ValueError", "broadcast: src=None"))
    cases[f"async reduce AVG on int64 on rank {bad_rank} only"] = (
        lambda rank, G: collectives.reduce(t(dtype=torch.int64), dst=0, op="AVG" if rank == bad_rank else "SUM",
                                           async_op=True).wait(),
        only_bad_rank("TypeError", "AVG", "torch.int64"))
    cases[f"all_to_all async on rank {bad_rank} only, a piece of the wrong size"] = (
        lambda rank, G: (lambda w: w and w.wait())(collectives.all_to_all(
            [t() for j in range(G)], [t(N + (rank == 1 and j == 0)) for j in range(G)], async_op=rank == bad_rank)),
        everyone("MismatchError", f"rank 1's input_tensor_list[0] has {N + 1} elements"))

    # --- the agreement check off: a rank's own mistake is still reported -------------------------
    cases["unchecked(): a list on every rank"] = (
        lambda rank, G: _unchecked(lambda: allreduce.ring([1.0, 2.0])),
        everyone("TypeError", "torch.Tensor", "list"))
    return cases


def _unchecked(call):
    with course_lib.unchecked():
        call()


def _bad_input_rank(rank, G):
    outcomes = {}
    for name, (call, _) in _cases(G).items():
        try:
            call(rank, G)
        except Exception as exc:  # noqa: BLE001 - the point is to see every error
            outcomes[name] = (type(exc).__name__, str(exc))
        else:
            outcomes[name] = ("no error", "")
        dist.barrier()  # the cases stay apart even if one of them went wrong
    # Nothing was left in flight: a correct all-reduce after all that still gives the right answer.
    x = torch.arange(7, dtype=torch.float32) + rank
    collectives.all_reduce(x)
    healthy = torch.equal(x, G * torch.arange(7, dtype=torch.float32) + G * (G - 1) / 2)
    return outcomes, healthy


@pytest.mark.parametrize("G", [3, 4])
def test_bad_input_fails_on_every_rank_with_a_clear_message(G):
    started = time.monotonic()
    per_rank = run(_bad_input_rank, G, timeout=90)
    elapsed = time.monotonic() - started
    cases = _cases(G)
    assert len(cases) > 80
    problems = []
    for name, (_, expect) in cases.items():
        for rank, (outcomes, _) in enumerate(per_rank):
            got_type, message = outcomes[name]
            want_type, words = expect(rank, G)
            if got_type != want_type:
                problems.append(f"{name}: rank {rank} raised {got_type} ({message[:150]!r}), expected {want_type}")
                continue
            missing = [w for w in words if w not in message]
            if missing:
                problems.append(f"{name}: rank {rank}'s message lacks {missing}: {message!r}")
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems[:40])
    assert all(healthy for _, healthy in per_rank), "after the bad calls a correct all_reduce went wrong"
    assert elapsed < 60, f"{len(cases)} bad calls took {elapsed:.1f} s: something waited for a timeout"


def test_the_errors_are_the_documented_classes():
    assert issubclass(MismatchError, ValueError)  # one `except ValueError` catches a disagreement too


def test_torch_also_refuses_avg_on_int64():
    """Our AVG-on-int64 error mirrors torch's own refusal (the oracle of the other tests)."""

    def fn(rank, G):
        try:
            dist.all_reduce(torch.ones(3, dtype=torch.int64), op=dist.ReduceOp.AVG)
        except Exception as exc:  # noqa: BLE001
            return type(exc).__name__
        return "no error"

    assert "no error" not in run(fn, 2)


# -------------------------------------------------------------------------------------------------
# One uncaught mistake ends the whole launch quickly
# -------------------------------------------------------------------------------------------------


def _one_rank_passes_a_list(rank, G):
    x = [1.0, 2.0] if rank == G - 1 else torch.ones(2)
    allreduce.ring(x)
    return "finished"


def test_one_bad_rank_ends_the_launch_in_seconds():
    started = time.monotonic()
    with pytest.raises(course_lib.RankFailedError) as info:
        run(_one_rank_passes_a_list, 4, timeout=30)
    assert time.monotonic() - started < 15
    text = str(info.value)
    assert "allreduce.ring" in text
    assert ("expects a torch.Tensor, got list" in text) or ("rank(s) [3] passed invalid arguments" in text)


# -------------------------------------------------------------------------------------------------
# Point-to-point checks: raised before anything is sent, so each rank can try them on its own
# -------------------------------------------------------------------------------------------------


def _p2p_rank(rank, G):
    other = (rank + 1) % G
    strided = torch.zeros(4, 2)[:, 0]
    attempts = {
        "send to self": lambda: p2p.send(torch.ones(2), rank),
        "isend to self": lambda: p2p.isend(torch.ones(2), rank),
        "send dst=G": lambda: p2p.send(torch.ones(2), G),
        "send dst=-1": lambda: p2p.send(torch.ones(2), -1),
        "send dst=None": lambda: p2p.send(torch.ones(2)),
        "send dst=True": lambda: p2p.send(torch.ones(2), True),
        "send dst=1.0": lambda: p2p.send(torch.ones(2), 1.0),
        "recv src=G": lambda: p2p.recv(torch.ones(2), G),
        "recv from self": lambda: p2p.recv(torch.ones(2), rank),
        "irecv src=None": lambda: p2p.irecv(torch.ones(2), None),
        "irecv src=-1": lambda: p2p.irecv(torch.ones(2), -1),
        "send non-contiguous": lambda: p2p.send(strided, other),
        "isend non-contiguous": lambda: p2p.isend(strided, other),
        "recv into non-contiguous": lambda: p2p.recv(strided, other),
        "irecv into non-contiguous": lambda: p2p.irecv(strided, other),
        "send a list": lambda: p2p.send([1.0, 2.0], other),
        "recv into a numpy array": lambda: p2p.recv(torch.ones(2).numpy(), other),
    }
    outcomes = {}
    for name, attempt in attempts.items():
        try:
            attempt()
        except Exception as exc:  # noqa: BLE001
            outcomes[name] = (type(exc).__name__, str(exc))
        else:
            outcomes[name] = ("no error", "")
    return outcomes


P2P_EXPECTED = {  # name -> (type, substrings); {G} and {rank} are filled in
    "send to self": ("ValueError", ["rank {rank} cannot exchange a message with itself", "dst={rank}"]),
    "isend to self": ("ValueError", ["itself"]),
    "send dst=G": ("ValueError", ["dst={G} is not a rank", "0..{G1}"]),
    "send dst=-1": ("ValueError", ["dst=-1 is not a rank", "0..{G1}"]),
    "send dst=None": ("ValueError", ["dst=None is not a rank"]),
    "send dst=True": ("ValueError", ["dst=True is not a rank"]),
    "send dst=1.0": ("ValueError", ["dst=1.0 is not a rank"]),
    "recv src=G": ("ValueError", ["src={G} is not a rank"]),
    "recv from self": ("ValueError", ["itself", "src={rank}"]),
    "irecv src=None": ("ValueError", ["src=None is not a rank"]),
    "irecv src=-1": ("ValueError", ["src=-1 is not a rank"]),
    "send non-contiguous": ("ValueError", ["contiguous", "shape (4,)", "tensor.contiguous()"]),
    "isend non-contiguous": ("ValueError", ["contiguous"]),
    "recv into non-contiguous": ("ValueError", ["contiguous"]),
    "irecv into non-contiguous": ("ValueError", ["contiguous"]),
    "send a list": ("TypeError", ["torch.Tensor", "list"]),
    "recv into a numpy array": ("TypeError", ["torch.Tensor", "ndarray"]),
}


def test_p2p_checks():
    G = 3
    per_rank = run(_p2p_rank, G)
    for rank, outcomes in enumerate(per_rank):
        assert set(outcomes) == set(P2P_EXPECTED)
        for name, (want_type, words) in P2P_EXPECTED.items():
            got_type, message = outcomes[name]
            assert got_type == want_type, (rank, name, got_type, message)
            for word in words:
                word = word.format(G=G, G1=G - 1, rank=rank)
                assert word in message, (rank, name, word, message)


def test_outside_a_process_group_the_error_says_to_use_launch():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="course_lib.launch"):
        p2p.send(torch.ones(2), 1)
    with pytest.raises(RuntimeError, match="course_lib.launch"):
        collectives.all_reduce(torch.ones(2))
    with pytest.raises(RuntimeError, match="launch"):
        collectives.broadcast(torch.ones(2), src=0)


def _different_collectives(rank, world_size):
    from course_lib import allreduce, collectives

    t = torch.ones(5)
    try:
        if rank == 0:
            allreduce.ring(t)
        elif rank == 1:
            collectives.broadcast(t, src=0)
        else:
            collectives.all_to_all([torch.ones(1)] * world_size, [torch.ones(1)] * world_size)
    except Exception as exc:  # noqa: BLE001 - the test inspects what every rank raised
        return type(exc).__name__, str(exc)
    return None


def test_ranks_calling_different_collectives_all_stop_with_the_calls_named():
    outcomes = course_lib.launch(_different_collectives, world_size=3, timeout=30)
    for outcome in outcomes:
        assert outcome is not None, "a rank went on although the others called another collective"
        kind, message = outcome
        assert kind == "MismatchError"
        assert "allreduce.ring" in message and "broadcast" in message and "all_to_all" in message
