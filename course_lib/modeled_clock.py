"""The modeled clock inside a rank: what `course_lib.clock()` reads under ``launch(fn, G, network=net)``.

A rank reads its clock through `course_lib.runtime` (`clock`, `compute`, `untimed`, ...), which imports
none of this and asks this module's state only while a modeled launch is active. Under such a launch every thread
of a rank that communicates keeps a modeled clock (`course_lib.simulation` says how it moves;
`course_lib._maestro` runs the simulation in the launching process).

What this module does inside a rank: it is a layer of the rank's process group (`course_lib.backend`, which
a modeled launch initialises), so every call that reaches the network passes it: course_lib's p2p, a
learner's raw ``dist.isend``, ``batch_isend_irecv``, ``dist.all_reduce`` and the other collectives (timed as
the schedule NCCL would run, `torch_collectives.collective_time`), and DistributedDataParallel's buckets. For each
call it

* tells the simulation in a small frame, and for a blocking one waits for its answer;
* still moves the data for real, underneath: a send hands gloo a copy of the tensor (the modeled send
  may end before the real one, and the caller may then change the tensor), and a receive is posted to
  gloo when the simulation has matched it, in the order it matched them, so gloo's first-in first-out
  matching agrees with the model's, receives from any source included. A collective runs in gloo at
  once; its `wait()` returns at the model's time, after every member has entered it.

A collective started inside backward (DDP's reducer starts each bucket's all-reduce from C++ and waits for
them in C++ when backward ends) is waited for on the clock in an autograd callback at the end of that
backward: `loss.backward()` ends at the modeled time its last bucket's all-reduce ends.

Threads: a rank's second thread (an async collective's worker, a bucket's communication thread) has a
clock of its own. Work handed from one thread to another carries the giver's clock (`now()` when it is
queued, `catch_up(t)` when it is taken), and a thread that waits for another one says so (`idle`), so
the simulation does not wait for it. Code that waits on a thread of its own without `idle` holds the
modeled clock back (the launch then times out, saying so).
"""

from __future__ import annotations

import queue
import socket
import struct
import threading
import time
import zlib
from dataclasses import dataclass

import torch

from course_lib import _maestro as wire
from course_lib import backend, ops, runtime
from course_lib.runtime import active, catch_up, clock, compute, current_network, idle, now, untimed, wake
from course_lib.simulation import ModeledDeadlock, SimulationError, main_actor

__all__ = ["clock", "compute", "reduction", "now", "catch_up", "idle", "wake", "untimed", "active", "current_network",
           "last_launch", "LaunchStats", "ModeledDeadlock"]

_local = runtime._local


def reduction(nbytes: int) -> None:
    """A reduction of two `nbytes` tensors into one on a network with a `memory_bandwidth`: 3 nbytes /
    memory_bandwidth of compute (read two, write one), as a GPU's reduction kernel is bound by its memory.
    `activate` makes it `ops.charge_reduction`, so `ops.combine_` calls it only on such a network."""
    compute(3 * nbytes / runtime._state.network.memory_bandwidth)


def __getattr__(name):
    if name == "_state":                  # the one copy lives in runtime, which activate() sets
        return runtime._state
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------------------------------
# One thread's link to the simulation
# --------------------------------------------------------------------------------------------------



class _Link:
    """A thread's connection to the coordinator, and its clock."""

    def __init__(self, state: "_RankState", actor_id: int, clock_value: float = 0.0):
        self.state, self.id, self.clock = state, actor_id, clock_value
        self.sock: socket.socket | None = None
        self.closed = False
        self.woken = 0
        self.notices: dict = {}        # request -> when that send left (told before anyone waited on it)
        self.skip: set = set()         # waits answered from a notice: their replies are skipped
        self.cpu_mark = time.thread_time() if state.network.count_cpu else 0.0

    def now(self) -> float:
        if self.state.network.count_cpu and self.sock is not None:
            self._count_cpu()
        return self.clock

    def _count_cpu(self) -> None:
        mark = time.thread_time()
        self.clock += max(0.0, mark - self.cpu_mark)
        self.cpu_mark = mark

    def _connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(self.state.path)
        self.sock = sock

    def send(self, op, request=0, a=0, b=0, c=0, x=0.0, payload=b"") -> None:
        if self.sock is None:
            if self.closed:
                raise SimulationError(f"rank {self.state.rank}: this rank has left the modeled clock")
            self._connect()
        if self.state.network.count_cpu:
            self._count_cpu()
        self.sock.sendall(wire.REQUEST.pack(op, self.id, request, a, b, c, self.clock, x, len(payload)) + payload)

    def call(self, op, request=0, x=0.0) -> int:
        """A blocking operation: send, wait for the simulation's answer; returns its detail.

        A wait on a send the simulation has already said has left (a NOTICE read earlier) does not wait: the
        frame still goes (the simulation then knows the thread went on), and its answer is skipped when it comes."""
        if op == wire.WAIT and request in self.notices:
            self.send(op, request)
            self.clock = max(self.clock, self.notices.pop(request))
            self.skip.add(request)
            if self.state.network.count_cpu:
                self.cpu_mark = time.thread_time()
            return -1
        self.send(op, request, x=x)
        while True:
            kind, matches, detail, clock_value, about = wire.REPLY.unpack(self._receive(wire.REPLY.size))
            if kind == wire.FAILED:
                message = self._receive(detail).decode()
                if self.state.network.count_cpu:
                    self.cpu_mark = time.thread_time()
                raise (ModeledDeadlock if message.startswith("deadlock") else SimulationError)(
                    f"rank {self.state.rank}: {message}")
            if matches:
                body = self._receive(matches * wire.MATCH.size)
                self.state.post_matched([wire.MATCH.unpack_from(body, i * wire.MATCH.size) for i in range(matches)])
            if kind == wire.NOTICE:
                self.notices[about] = clock_value
                continue
            if about in self.skip:               # the answer to a wait that did not wait
                self.skip.discard(about)
                continue
            break
        self.clock = max(self.clock, clock_value)
        if self.state.network.count_cpu:
            self.cpu_mark = time.thread_time()   # the clock machinery's own time is not the rank's compute
        return detail

    def _receive(self, size: int) -> bytes:
        data = bytearray()
        while len(data) < size:
            chunk = self.sock.recv(size - len(data))
            if not chunk:
                raise SimulationError(f"rank {self.state.rank}: the modeled clock's coordinator went away (the "
                                      "launch is ending)")
            data += chunk
        return bytes(data)

    def close(self) -> None:
        self.closed = True
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
            self.sock = None


class _ThreadEnd:
    """Kept only in a thread's local storage, so it goes when the thread ends: the simulation then stops
    waiting for that thread (a thread that ended while it counted as running would hold the clock back)."""

    def __init__(self, link: _Link):
        self.link = link

    def __del__(self):
        link = self.link
        if link.id == main_actor(link.state.rank) or link.closed or runtime._state is not link.state:
            return
        try:
            link.send(wire.DONE_ACTOR)
        except (OSError, SimulationError):
            pass
        link.close()


class _Receive:
    """A receive torch has not been asked for yet: posted (`post`, the layers below the clock's) when the
    simulation matches it."""
    __slots__ = ("tensor", "group", "tag", "post", "work", "source")

    def __init__(self, tensor, group, tag, post):
        self.tensor, self.group, self.tag, self.post = tensor, group, tag, post
        self.work = None
        self.source = None


class _RankState:
    def __init__(self, network, path: str, rank: int, world_size: int):
        self.network, self.path, self.rank, self.world_size = network, path, rank, world_size
        self.lock = threading.RLock()
        self.posting = threading.Condition(threading.Lock())
        self.links: dict = {}              # thread -> _Link
        self.next_actor = 1
        self.next_request = 0
        self.receives: dict = {}           # request id -> _Receive
        self.unsent = queue.SimpleQueue()  # (torch work, the copy it reads), for `_wait_for_sends` to wait on
        threading.Thread(target=_wait_for_sends, args=(self.unsent,), name="course_lib-sends", daemon=True).start()
        self.sequences: dict = {}          # group code -> collectives called on it so far
        self.main = threading.current_thread()

    def link(self) -> _Link:
        link = getattr(_local, "link", None)
        if link is None or link.state is not self:
            link = _local.link = self.link_for(threading.current_thread())
            _local.guard = _ThreadEnd(link)
        return link

    def link_for(self, thread: threading.Thread) -> _Link:
        with self.lock:
            link = self.links.get(thread)
            if link is None:
                if thread is self.main:
                    actor = main_actor(self.rank)
                else:
                    actor = main_actor(self.rank) | self.next_actor
                    self.next_actor += 1
                # a new thread starts at its creator's clock, as far as this thread knows it
                start = getattr(_local, "link", None)
                link = self.links[thread] = _Link(self, actor, start.clock if start is not None else 0.0)
            return link

    # what runtime's clock functions do on the modeled clock
    def now(self) -> float:
        return self.link().now()

    def compute(self, seconds: float) -> None:
        link = self.link()
        link.clock += seconds
        if seconds > 0:
            link.send(wire.CLOCK)

    def catch_up(self, moment: float) -> None:
        link = self.link()
        if moment > link.clock:
            link.clock = moment

    def idle(self, condition: threading.Condition, predicate, timeout: float) -> None:
        link = self.link()
        while not predicate():
            if runtime._state is not self:      # the rank left the modeled clock meanwhile
                condition.wait_for(predicate)
                return
            link.send(wire.PARK, a=link.woken)
            condition.wait(timeout)

    def wake(self, thread: threading.Thread) -> None:
        target = self.link_for(thread)
        with self.lock:
            target.woken += 1
            count = target.woken
        self.link().send(wire.WAKE, a=target.id, c=count)

    def request_id(self) -> int:
        with self.lock:
            self.next_request += 1
            return (self.rank << 40) | self.next_request

    def keep_send(self, work, copy) -> None:
        """Keep torch's send and the copy it reads alive until torch has sent it.

        The modeled wait on a send returns at the model's time, without waiting for torch; and gloo loses a send
        whose handle is dropped before the receiver posts, while its `is_completed()` stays False until someone
        waits. So a thread of the rank's own waits on torch's sends, in order, and then lets them go: the rank never
        holds more than the sends still in flight. That thread never reads the clock, so the simulation never waits
        for it. (Scanning a list of every send with `is_completed()` instead cost time quadratic in the sends.)"""
        self.unsent.put((work, copy))

    def post_matched(self, matches) -> None:
        """Post to torch, in the simulation's match order, the receives it matched."""
        with self.posting:
            for request, source in matches:
                pending = self.receives.get(request)
                if pending is None or pending.work is not None:
                    continue
                pending.source = source
                pending.work = pending.post(pending.tensor, pending.group.global_ranks.index(source), pending.tag)
            self.posting.notify_all()

    def posted(self, request: int) -> _Receive:
        """A matched receive, once posted to torch (by whichever of this rank's threads heard of the match)."""
        with self.posting:
            if not self.posting.wait_for(lambda: self.receives[request].work is not None, timeout=30):
                raise SimulationError(f"rank {self.rank}: a receive the simulation answered was never posted")
            return self.receives.pop(request)

    def next_sequence(self, code: int) -> int:
        with self.lock:
            seq = self.sequences.get(code, 0)
            self.sequences[code] = seq + 1
            return seq


def _wait_for_sends(unsent: queue.SimpleQueue) -> None:
    """The body of a rank's `course_lib-sends` thread (`_RankState.keep_send`): torch's wait on each send, in order."""
    while True:
        work, _copy = unsent.get()
        if work is None:
            return
        try:
            work.wait()
        except Exception:  # noqa: BLE001 - a send that failed fails its receiver too, which reports it
            pass
        del work, _copy



# --------------------------------------------------------------------------------------------------
# torch.distributed's calls, on the modeled clock: a layer of course_lib's backend
# --------------------------------------------------------------------------------------------------


class _ModeledRequest(backend.Work):
    """What a modeled send or receive returns: `wait()` waits for the model's time, then for torch."""

    def __init__(self, request: int, kind: str, group):
        super().__init__(None)
        self._request, self._kind, self._group = request, kind, group
        self._done = False
        self._source = None        # a receive's sender (global rank)

    def wait(self, timeout=None) -> bool:
        if self._done:
            return True
        state = runtime._state
        detail = state.link().call(wire.WAIT, self._request)
        self._finish(state, detail, timeout)
        return True

    def _finish(self, state, detail, timeout=None):
        self._done = True
        if self._kind == "recv":
            pending = state.posted(self._request)
            pending.work.wait() if timeout is None else pending.work.wait(timeout)
            self._source = pending.source if detail < 0 else detail

    def is_completed(self) -> bool:
        if self._done:
            return True
        state = runtime._state
        if state is None:
            return False
        answer = state.link().call(wire.TEST, self._request, x=_POLL_SECONDS)
        if answer:
            self._finish(state, self._source if self._source is not None else -1)
        return bool(answer)

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def _source_rank(self) -> int:
        """The sender's rank in the receive's group (as torch's Work)."""
        if self._kind != "recv":
            raise RuntimeError("source_rank() is only for receives")
        self.wait()
        return self._group.global_ranks.index(self._source)

    def result(self):
        self.wait()
        return []


_POLL_SECONDS = 1e-6   # is_completed() that answers False moves the caller's clock on by this much


class _ModeledCollective(backend.Work):
    """What a collective returns: `wait()` waits for the model's time (every member has entered it, plus what
    its schedule takes), then for torch's collective, which has been running meanwhile."""

    def __init__(self, request: int, under):
        super().__init__(under)
        self._request, self._done = request, False

    def modeled_wait(self) -> None:
        if not self._done:
            self._done = True
            runtime._state.link().call(wire.WAIT, self._request)

    def wait(self, timeout=None) -> bool:
        self.modeled_wait()
        return super().wait(timeout)

    def is_completed(self) -> bool:
        if not self._done:
            if not runtime._state.link().call(wire.TEST, self._request, x=_POLL_SECONDS):
                return False
            self._done = True
        return super().is_completed()


def _wait_at_end_of_backward(work: _ModeledCollective) -> None:
    """A collective started inside backward (DistributedDataParallel's buckets, from its C++ reducer) is waited for
    by the reducer when backward ends, in C++, where the clock cannot see it. So the modeled wait happens in an
    autograd callback at the end of that backward instead: every collective this thread started in it, in order."""
    task = torch._C._current_graph_task_id()
    pending = getattr(_local, "backward_pending", None)
    if pending is None or _local.backward_task != task:
        pending = _local.backward_pending = []
        _local.backward_task = task

        def finish():
            for started in pending:
                started.modeled_wait()
            pending.clear()
            _local.backward_pending = None

        torch.autograd.Variable._execution_engine.queue_callback(finish)
    pending.append(work)


class _ClockLayer:
    """course_lib's backend layer that times every call (see the module docstring)."""

    def send(self, group, tensor, dst, tag, proceed):
        state = runtime._state
        copy = tensor.detach().clone()        # the modeled send may end before torch has read the tensor
        work = proceed(copy, dst, tag)
        state.keep_send(work, copy)
        request = state.request_id()
        state.link().send(wire.ISEND, request, a=group.global_ranks[dst], b=group.code, c=tag,
                          x=float(tensor.numel() * tensor.element_size()))
        return _ModeledRequest(request, "send", group)

    def recv(self, group, tensor, src, tag, proceed):
        state = runtime._state
        request = state.request_id()
        with state.posting:
            state.receives[request] = _Receive(tensor, group, tag, proceed)
        state.link().send(wire.IRECV, request, a=-1 if src is None else group.global_ranks[src], b=group.code, c=tag,
                          x=float(tensor.numel() * tensor.element_size()))
        return _ModeledRequest(request, "recv", group)

    def collective(self, group, call, proceed):
        state = runtime._state
        timed = not getattr(_local, "untimed", False)
        request = state.request_id()
        payload = (f"{call.kind}:{call.element_size}" if timed else "sync").encode().ljust(24, b"\0") + \
            struct.pack(f"<{len(group.global_ranks)}i", *group.global_ranks)
        root = -1 if call.root is None else group.global_ranks[call.root]
        state.link().send(wire.COLLECTIVE, request, a=state.next_sequence(group.code), b=group.code, c=root,
                          x=float(call.nbytes if timed else 0), payload=payload)
        work = _ModeledCollective(request, proceed())
        if torch._C._current_graph_task_id() != -1:
            _wait_at_end_of_backward(work)
        return work

    def new_group(self, group, ranks, proceed):
        # Making a group connects its members for real: on the modeled clock a collective of its members that costs
        # nothing, so no member's clock waits for one still on its way. Only the members take part: with
        # use_local_synchronization=True torch calls this on them alone (ranks: global ranks).
        state = runtime._state
        members = tuple(sorted(ranks))
        if state.rank in members:
            code = -2 - zlib.crc32(repr(members).encode())        # one sequence per member set, the same on each
            request = state.request_id()
            payload = b"sync".ljust(24, b"\0") + struct.pack(f"<{len(members)}i", *members)
            link = state.link()
            link.send(wire.COLLECTIVE, request, a=state.next_sequence(code), b=code, c=-1, x=0.0, payload=payload)
            link.call(wire.WAIT, request)
        proceed()


_LAYER = _ClockLayer()


def activate(network, path: str, rank: int, world_size: int) -> None:
    """Put this rank on the modeled clock (called on every rank, after the process group exists): the clock
    becomes a layer of the rank's process group, which must be course_lib's (`course_lib.backend`)."""
    if runtime._state is not None:
        raise RuntimeError("a modeled network is already active in this process")
    if not backend.active():
        raise RuntimeError("the modeled clock times calls through course_lib's torch.distributed backend: initialise "
                           "the process group with backend 'course_lib' (launch(..., network=) does)")
    state = _RankState(network, path, rank, world_size)
    runtime._state = state
    state.link()._connect()
    backend.install(_LAYER)
    if getattr(network, "memory_bandwidth", None):
        ops.charge_reduction = reduction


def deactivate() -> None:
    """Take this rank off the modeled clock: tell the simulation it is done, remove the clock's layer."""
    state = runtime._state
    if state is None:
        return
    try:
        state.link().send(wire.DONE_RANK)
    except OSError:
        pass
    state.unsent.put((None, None))         # its sends thread ends once torch has sent what is still queued
    backend.remove(_LAYER)
    for link in list(state.links.values()):
        link.close()
    runtime._state = None
    ops.charge_reduction = None
    _local.__dict__.clear()
# --------------------------------------------------------------------------------------------------
# After a launch
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchStats:
    """What the last launch on a modeled network counted (`last_launch()`, in the launching process).

    Attributes:
        network: the modeled network.
        messages: point-to-point messages sent, all ranks together.
        clocks: every rank's clock when its function returned (modeled seconds).
    """

    network: object
    messages: int
    clocks: tuple

    @property
    def seconds(self) -> float:
        """The last rank's clock: the launch's modeled time."""
        return max(self.clocks, default=0.0)


_last: LaunchStats | None = None


def record_launch(network, maestro) -> LaunchStats:
    global _last
    _last = LaunchStats(network, maestro.sim.messages, tuple(maestro.clocks()))
    return _last


def last_launch() -> LaunchStats | None:
    return _last
