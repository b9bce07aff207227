"""What the algorithms send, from `traffic.record()` recordings, against the formulas.

* Totals for G = 2..6 and lengths that G divides and does not divide: naive sends (G-1) N in G-1
  messages per rank; the parameter server's root receives and sends (G-1) N, the others send and
  receive N; the ring sends 2 (G-1) chunks per rank, 2 (G-1) N / G elements when G divides N and
  the exact torch.tensor_split chunk sizes when not. Bytes = elements x element size. Every send is
  matched by exactly one receive on the peer.
* The ring's schedule step by step: pinned literally for G = 4, by formula for G = 2..6, together
  with what each rank holds after the scatter-reduce phase.
* The recorder itself: recordings pickle through launch, nest, record nothing when none is open,
  and a receive from any source records the rank that really sent.
"""

from __future__ import annotations

import collections
import pickle

import pytest
import torch
import torch.distributed as dist

from conftest import make_input, run
import course_lib
from course_lib import allreduce, collectives, p2p, traffic

ITEMSIZE = {str(d): torch.empty(0, dtype=d).element_size() for d in
            (torch.float32, torch.float64, torch.int64, torch.bfloat16)}
DTYPE_CYCLE = (torch.float32, torch.float64, torch.bfloat16, torch.int64)


def split_sizes(numel, world_size):
    """Chunk sizes as torch.tensor_split makes them (the test's own oracle, not allreduce.chunk_sizes)."""
    return [c.numel() for c in torch.tensor_split(torch.empty(numel), world_size)]


def _lengths(G):
    return sorted({0, 1, G - 1, G + 1, 3 * G, 4 * G + 1, 6 * G + G // 2 + 1})


# -------------------------------------------------------------------------------------------------
# 1. Totals per variant
# -------------------------------------------------------------------------------------------------


def _record_variants(rank, G):
    """{(variant, N, dtype): Recording} for every variant and length; the Recordings travel back pickled."""
    recordings = {}
    for i, n in enumerate(_lengths(G)):
        dtype = DTYPE_CYCLE[i % len(DTYPE_CYCLE)]
        for variant, call in (("naive", lambda t: allreduce.naive(t)),
                              ("ps0", lambda t: allreduce.parameter_server(t)),
                              ("ps_last", lambda t: allreduce.parameter_server(t, root=G - 1)),
                              ("ring", lambda t: allreduce.ring(t)),
                              ("all_reduce", lambda t: collectives.all_reduce(t))):
            x = make_input(i, rank, (n,), dtype)
            with traffic.record() as rec:
                call(x)
            recordings[(variant, n, str(dtype))] = rec
    return recordings


def _check_event_bytes(rec, dtype):
    for e in rec.events:
        assert e.dtype == dtype
        assert e.nbytes == e.numel * ITEMSIZE[dtype], e
    assert rec.bytes_sent == rec.elements_sent * ITEMSIZE[dtype]
    assert rec.bytes_received == rec.elements_received * ITEMSIZE[dtype]
    assert rec.messages_sent == len(rec.sends) == sum(e.kind == "send" for e in rec.events)
    assert rec.messages_received == len(rec.recvs) == sum(e.kind == "recv" for e in rec.events)
    assert rec.messages_sent + rec.messages_received == len(rec.events)


def _check_sends_match_receives(recordings):
    """Across ranks: every (sender, receiver, size, phase, step, chunk) sent is received exactly once."""
    sent, received = collections.Counter(), collections.Counter()
    for rank, rec in enumerate(recordings):
        for e in rec.events:
            if e.kind == "send":
                sent[(rank, e.peer, e.numel, e.phase, e.step, e.chunk)] += 1
            else:
                received[(e.peer, rank, e.numel, e.phase, e.step, e.chunk)] += 1
    assert sent == received


@pytest.mark.parametrize("G", [2, 3, 4, 5, 6])
def test_traffic_equals_the_formulas(G):
    per_rank = run(_record_variants, G)
    for (variant, n, dtype) in per_rank[0]:
        recordings = [per_rank[rank][(variant, n, dtype)] for rank in range(G)]
        where = f"{variant} N={n} {dtype} G={G}"
        _check_sends_match_receives(recordings)
        sizes = split_sizes(n, G)
        for rank, rec in enumerate(recordings):
            assert isinstance(rec, traffic.Recording) and (rec.rank, rec.world_size) == (rank, G), where
            _check_event_bytes(rec, dtype)
            others = sorted(set(range(G)) - {rank})
            if variant == "naive":
                assert rec.messages_sent == rec.messages_received == G - 1, where
                assert rec.elements_sent == rec.elements_received == (G - 1) * n, where
                assert sorted(e.peer for e in rec.sends) == others == sorted(e.peer for e in rec.recvs), where
                assert {e.phase for e in rec.events} == {"exchange"}, where
            elif variant in ("ps0", "ps_last"):
                root = 0 if variant == "ps0" else G - 1
                if rank == root:
                    assert rec.messages_received == rec.messages_sent == G - 1, where
                    assert rec.elements_received == rec.elements_sent == (G - 1) * n, where
                    assert sorted(e.peer for e in rec.recvs) == others == sorted(e.peer for e in rec.sends), where
                else:
                    assert rec.messages_sent == rec.messages_received == 1, where
                    assert rec.elements_sent == rec.elements_received == n, where
                    assert {e.peer for e in rec.events} == {root}, where
                assert all(e.phase == ("broadcast" if rank == root else "reduce") for e in rec.sends), where
                assert all(e.phase == ("reduce" if rank == root else "broadcast") for e in rec.recvs), where
            else:  # ring, and collectives.all_reduce which is the ring
                assert rec.messages_sent == rec.messages_received == 2 * (G - 1), where
                assert all(e.numel == sizes[e.chunk] for e in rec.events), where
                # sends every chunk but (r+1) in scatter-reduce and every chunk but (r+2) in all-gather
                assert rec.elements_sent == 2 * n - sizes[(rank + 1) % G] - sizes[(rank + 2) % G], where
                assert rec.elements_received == 2 * n - sizes[rank] - sizes[(rank + 1) % G], where
                if n % G == 0:
                    assert rec.elements_sent == rec.elements_received == 2 * (G - 1) * n // G, where
                assert {e.peer for e in rec.sends} == {(rank + 1) % G}, where
                assert {e.peer for e in rec.recvs} == {(rank - 1) % G}, where
    # The lengths really include divisible and non-divisible ones.
    assert any(n % G == 0 and n > 0 for _, n, _ in per_rank[0]) and any(n % G for _, n, _ in per_rank[0])


def _record_collectives(rank, G, n):
    """One recording per collective, for the totals each collective's docstring states."""
    dev_dtype = torch.float64
    x = make_input(0, rank, (n,), dev_dtype)
    out = {}
    root = G - 1
    calls = {
        "broadcast": lambda: collectives.broadcast(x.clone(), src=root),
        "scatter": lambda: collectives.scatter(torch.empty(n, dtype=dev_dtype),
                                               [x.clone() for _ in range(G)] if rank == root else None, src=root),
        "gather": lambda: collectives.gather(x.clone(), [torch.empty(n, dtype=dev_dtype) for _ in range(G)]
                                             if rank == root else None, dst=root),
        "all_gather": lambda: collectives.all_gather([torch.empty(n, dtype=dev_dtype) for _ in range(G)], x),
        "all_to_all": lambda: collectives.all_to_all([torch.empty(n, dtype=dev_dtype) for _ in range(G)],
                                                     [x.clone() for _ in range(G)]),
        "reduce": lambda: collectives.reduce(x.clone(), dst=root),
        "reduce_scatter": lambda: collectives.reduce_scatter(torch.empty(n, dtype=dev_dtype),
                                                             [x.clone() for _ in range(G)]),
    }
    for name, call in calls.items():
        with traffic.record() as rec:
            call()
        out[name] = rec
    return out


@pytest.mark.parametrize("G", [2, 5])
def test_collectives_traffic(G):
    n = 3 * G + 1
    per_rank = run(_record_collectives, G, n)
    root = G - 1
    for name in per_rank[0]:
        recordings = [r[name] for r in per_rank]
        _check_sends_match_receives(recordings)
        for rank, rec in enumerate(recordings):
            _check_event_bytes(rec, "torch.float64")
            assert {e.phase for e in rec.events} == {name}, (name, rank)
            assert all(e.numel == n for e in rec.events), (name, rank)  # every message is one whole piece
            if name in ("broadcast", "scatter"):  # the root sends G-1 pieces, everyone else receives one
                expect_sent, expect_received = (G - 1, 0) if rank == root else (0, 1)
            elif name in ("gather", "reduce"):
                expect_sent, expect_received = (0, G - 1) if rank == root else (1, 0)
            else:  # all_gather, all_to_all, reduce_scatter: every rank sends and receives G-1 pieces
                expect_sent, expect_received = G - 1, G - 1
            assert (rec.messages_sent, rec.messages_received) == (expect_sent, expect_received), (name, rank)


# -------------------------------------------------------------------------------------------------
# 2. The ring's schedule
# -------------------------------------------------------------------------------------------------


def _ring_steps_rank(rank, G, n):
    """Run the ring's two phases separately on positive integers, recording each and the state between."""
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randint(1, 100, (n,), generator=gen, dtype=torch.int64)
    full = x.clone()
    dist.all_reduce(full)  # the oracle
    t = x.clone()
    with traffic.record() as rec:
        owned = allreduce.ring_scatter_reduce(t, "sum")
        after_scatter_reduce = t.clone()
        allreduce.ring_all_gather(t)
    return dict(input=x, full=full, owned=owned, after_scatter_reduce=after_scatter_reduce, result=t, rec=rec)


def _check_ring(per_rank, G, n):
    sizes = split_sizes(n, G)
    inputs = [r["input"] for r in per_rank]
    for rank, r in enumerate(per_rank):
        rec = r["rec"]
        right, left = (rank + 1) % G, (rank - 1) % G
        sr, ag = rec.in_phase("scatter_reduce"), rec.in_phase("all_gather")
        assert len(sr) + len(ag) == len(rec.events) == 4 * (G - 1)
        for phase_events, name in ((sr, "scatter_reduce"), (ag, "all_gather")):
            # step by step: the receive from the left is posted, then the send to the right
            assert [(e.kind, e.step) for e in phase_events] == \
                [(kind, s) for s in range(G - 1) for kind in ("recv", "send")], name
            assert all(e.peer == (right if e.kind == "send" else left) for e in phase_events), name
            assert all(e.numel == sizes[e.chunk] for e in phase_events), name
        for s in range(G - 1):
            (recv_sr, send_sr), (recv_ag, send_ag) = sr[2 * s: 2 * s + 2], ag[2 * s: 2 * s + 2]
            assert send_sr.chunk == (rank - s) % G and recv_sr.chunk == (rank - s - 1) % G, (rank, s)
            assert send_ag.chunk == (rank + 1 - s) % G and recv_ag.chunk == (rank - s) % G, (rank, s)
        # After scatter-reduce: chunk c on rank r holds x_c + x_{c+1} + ... + x_r, (r - c) mod G + 1
        # contributions, so only the owned chunk (r + 1) mod G is complete.
        assert r["owned"] == (rank + 1) % G
        state = torch.tensor_split(r["after_scatter_reduce"], G)
        full = torch.tensor_split(r["full"], G)
        for c in range(G):
            contributors = [(c + k) % G for k in range((rank - c) % G + 1)]
            partial = sum(torch.tensor_split(inputs[j], G)[c] for j in contributors)
            assert torch.equal(state[c], partial), (rank, c)
            if c == r["owned"]:
                assert torch.equal(state[c], full[c]), (rank, c)
            elif state[c].numel():  # positive inputs: a partial sum is strictly below the full one
                assert bool((state[c] < full[c]).all()), (rank, c)
        assert torch.equal(r["result"], r["full"])


def test_ring_schedule_g4_pinned():
    """G = 4, N = 10 (chunks of 3, 3, 2, 2): the schedule of the ring diagram in allreduce.py, literally."""
    G, n = 4, 10
    per_rank = run(_ring_steps_rank, G, n)
    scatter_reduce_send = [[0, 1, 2, 3], [3, 0, 1, 2], [2, 3, 0, 1]]  # [step][rank] -> chunk sent
    scatter_reduce_recv = [[3, 0, 1, 2], [2, 3, 0, 1], [1, 2, 3, 0]]
    all_gather_send = [[1, 2, 3, 0], [0, 1, 2, 3], [3, 0, 1, 2]]
    all_gather_recv = [[0, 1, 2, 3], [3, 0, 1, 2], [2, 3, 0, 1]]
    right, left = [1, 2, 3, 0], [3, 0, 1, 2]
    chunk_size = [3, 3, 2, 2]
    assert [r["owned"] for r in per_rank] == [1, 2, 3, 0]
    for rank, r in enumerate(per_rank):
        rec = r["rec"]
        for phase, sends, recvs in (("scatter_reduce", scatter_reduce_send, scatter_reduce_recv),
                                    ("all_gather", all_gather_send, all_gather_recv)):
            expected = []
            for step in range(3):
                expected.append(("recv", left[rank], chunk_size[recvs[step][rank]], phase, step, recvs[step][rank]))
                expected.append(("send", right[rank], chunk_size[sends[step][rank]], phase, step, sends[step][rank]))
            got = [(e.kind, e.peer, e.numel, e.phase, e.step, e.chunk) for e in rec.in_phase(phase)]
            assert got == expected, (rank, phase)
        assert rec.bytes_sent == 8 * (20 - chunk_size[(rank + 1) % 4] - chunk_size[(rank + 2) % 4])
    _check_ring(per_rank, G, n)


@pytest.mark.parametrize("G", [2, 3, 4, 5, 6])
def test_ring_schedule_by_formula(G):
    for n in (4 * G + 3, 2 * G):  # chunks of different sizes, then equal chunks
        _check_ring(run(_ring_steps_rank, G, n), G, n)


# -------------------------------------------------------------------------------------------------
# 3. The recorder
# -------------------------------------------------------------------------------------------------


def _recorder_rank(rank, G):
    out = {}
    t = torch.full((5,), float(rank))
    assert not traffic.is_recording()
    # Outside any recording: messages are sent, nothing is recorded anywhere.
    before = traffic.Recording()
    allreduce.ring(t.clone())
    out["unrecorded"] = before
    # Nested: the inner recording sees its messages, the outer sees all of them, also after the inner ends.
    with traffic.record() as outer:
        with traffic.record() as inner:
            allreduce.naive(t.clone())
        inner_count = len(inner.events)
        allreduce.naive(t.clone())
    out["outer"], out["inner"], out["inner_count"] = outer, inner, inner_count
    # A finished recording stays as it was.
    allreduce.naive(t.clone())
    out["outer_after"] = len(outer.events)
    out["still_recording"] = traffic.is_recording()
    # Receive from any source: the event names the rank that really sent (the payload says who).
    with traffic.record() as anysrc:
        if rank == 0:
            senders = []
            for _ in range(G - 1):
                buffer = torch.empty(3)
                sender = p2p.recv(buffer, None, chunk=7)
                senders.append((sender, int(buffer[0])))
            out["senders"] = senders
        else:
            p2p.send(torch.full((3,), float(rank)), 0, chunk=7)
    out["anysrc"] = anysrc
    dist.barrier()  # a later message to rank 0 must not be taken for one of these by recv(src=None)
    # isend / irecv are recorded too, with the labels set around them.
    with traffic.record() as async_rec, traffic.phase("demo"):
        for step in traffic.steps(2):
            request = p2p.isend(torch.zeros(2, dtype=torch.float64), (rank + 1) % G, chunk=step)
            p2p.irecv(torch.empty(2, dtype=torch.float64), (rank - 1) % G, chunk=step).wait()
            request.wait()
    out["labels_after"] = traffic.current_labels()
    out["async"] = async_rec
    out["pickled_here"] = pickle.loads(pickle.dumps(outer)) == outer
    return out


@pytest.mark.parametrize("G", [3])
def test_recorder(G):
    per_rank = run(_recorder_rank, G)
    for rank, out in enumerate(per_rank):
        assert out["unrecorded"].events == []
        # naive: G-1 sends and G-1 receives per call
        per_call = 2 * (G - 1)
        assert out["inner_count"] == len(out["inner"].events) == per_call
        assert len(out["outer"].events) == out["outer_after"] == 2 * per_call
        assert out["outer"].events[:per_call] == out["inner"].events
        assert not out["still_recording"]
        assert isinstance(out["outer"], traffic.Recording) and out["pickled_here"]
        assert out["outer"].rank == rank and out["outer"].world_size == G
        anysrc = out["anysrc"]
        if rank == 0:
            assert sorted(s for s, _ in out["senders"]) == list(range(1, G))
            assert all(sender == payload for sender, payload in out["senders"])
            assert [e.peer for e in anysrc.recvs] == [s for s, _ in out["senders"]]
            assert all(e.chunk == 7 and e.numel == 3 and e.phase is None and e.step is None for e in anysrc.recvs)
        else:
            assert [(e.kind, e.peer, e.chunk) for e in anysrc.events] == [("send", 0, 7)]
        got = [(e.kind, e.peer, e.phase, e.step, e.chunk, e.nbytes) for e in out["async"].events]
        assert got == [("send", (rank + 1) % G, "demo", 0, 0, 16), ("recv", (rank - 1) % G, "demo", 0, 0, 16),
                       ("send", (rank + 1) % G, "demo", 1, 1, 16), ("recv", (rank - 1) % G, "demo", 1, 1, 16)]
        assert out["labels_after"] == {"phase": None, "step": None}


def test_labels_nest_and_restore_without_a_process_group():
    assert traffic.current_labels() == {"phase": None, "step": None}
    with traffic.phase("outer"):
        for step in traffic.steps(3):
            assert traffic.current_labels() == {"phase": "outer", "step": step}
            with traffic.phase("inner"):
                assert traffic.current_labels() == {"phase": "inner", "step": None}
            assert traffic.current_labels() == {"phase": "outer", "step": step}
        assert traffic.current_labels() == {"phase": "outer", "step": None}
    assert traffic.current_labels() == {"phase": None, "step": None}
    with traffic.record() as rec:  # no process group: the recording works, rank unknown
        pass
    assert (rec.rank, rec.world_size, rec.events) == (None, None, [])


def test_nested_recordings_with_identical_contents_close_cleanly():
    """Regression: two nested recordings with equal events used to make record() remove the wrong one."""
    with traffic.record() as outer:
        with traffic.record() as inner:
            pass
        assert outer == inner  # equal contents, different recordings
        assert traffic.is_recording()
        assert traffic._active == [outer] and traffic._active[0] is outer
    assert not traffic.is_recording()


def _wait_twice(rank, world_size):
    from course_lib import p2p

    buffer = torch.zeros(3)
    if rank == 0:
        request = p2p.isend(torch.arange(3.0), dst=1)
    else:
        request = p2p.irecv(buffer, src=0)
    request.wait()
    request.wait()  # a second wait must return at once, not hang
    return buffer.tolist(), request.is_completed()


def test_waiting_twice_on_a_request_returns_at_once():
    results = course_lib.launch(_wait_twice, world_size=2, timeout=20)
    assert results[1] == ([0.0, 1.0, 2.0], True)
