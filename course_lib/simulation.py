"""The modeled network's clock: an event-driven simulation of the link model, in modeled time.

`course_lib.network` says what a link costs (bytes / bandwidth on a side of a link, plus a latency).
This module is where that cost becomes time. Every thread of a rank that communicates is an *actor*
with its own clock. An actor's operations (send, receive, wait, compute, a built-in collective) are
events in modeled time; the simulator processes them in time order, so a message's time depends on
the model's equations and the schedule alone: not on this machine, not on its load, not on which
rank the operating system happened to run first. SimGrid's SMPI times MPI programs the same way.

Three users, one set of equations:

* a modeled launch (`launch(fn, G, network=...)`): the ranks run for real, their messages move for
  real, and every call asks the simulator (in the launcher, `course_lib._maestro`) what time it is;
* `replay(events_by_rank, network)`: a recorded schedule (the capstone of notebook 11 records the
  learner's sends and receives) timed without running it again;
* `course_lib.torch_collectives`: torch.distributed's built-in collectives under a modeled launch take the
  time of the schedule NCCL would run, simulated here on an idle network (a launch's `Simulator` is given
  its `collective_time` as `collective_cost`).

The equations (docs/notation.md: B the route's bandwidth, a its latency, m the message's bytes):

    a message leaves the sender's outgoing side when it is free:   start = max(issued, out_free)
                                                                  out_free = start + m/B
    (a blocking send, or an isend's wait, completes then: the data has left the rank)
    it enters the receiver's incoming side when that is free:      in_start = max(start, in_free)
                                                                  in_free = in_start + m/B
    and arrives a after its last byte:                             arrival = in_start + m/B + a

Each side serves its messages in the order they reach it in modeled time (first come, first served;
ties by rank and then by the order the rank issued them). Which sides a message uses is the
network's `route(src, dst)`: a switch gives every rank one outgoing and one incoming side, a full mesh
one side per ordered pair (no incoming side), a cluster NVLink sides inside a node and network-card
sides between nodes (one card per GPU, or one per node shared by its GPUs).

A receive is matched when its message arrives, to the earliest posted receive that accepts it (its
source, or any source; process group; tag), as MPI does; a message that arrives before its receive is
posted waits, and the receive then completes when it is posted. A receive completes at its match;
`wait` returns at max(the caller's clock, the completion).

Time moves only through events. Compute between messages costs nothing unless the actor says so
(`compute`): modeled compute (`course_lib.compute`, `training.ComputeDelay`), or the rank's own CPU
time under `Network(..., count_cpu=True)`.

How events are processed in order while ranks run for real: an event at time T is processed only
when every running actor's clock is past T (a running actor may still issue an event at its clock,
and events at equal times are taken in a fixed order: lower rank first).
Actors that wait (for a message, a collective, another thread) do not hold the simulation back: they
resume only through events the simulator itself processes, at or after the time of that event. When
no actor runs and no event is left but some actor still waits, nothing can ever wake it: a deadlock,
reported with what every rank waits for.
"""

from __future__ import annotations

import heapq
import math
import textwrap
from dataclasses import dataclass, field



__all__ = ["Simulator", "SimulationError", "ModeledDeadlock", "ScheduleError", "replay", "replay_threads", "Timing",
           "RUNNING", "BLOCKED", "PARKED", "DONE"]

RUNNING, BLOCKED, PARKED, DONE = "running", "blocked", "parked", "done"

# Event kinds, in the order they are processed at equal times: a side booked at T before a receive posted at
# T, and that before a message arriving at T (so it finds the receive).
_ISSUE, _ENTER, _POST, _ARRIVE = range(4)


class SimulationError(RuntimeError):
    """An operation the modeled clock cannot time (a wrong handle, a mismatched collective)."""


class ModeledDeadlock(SimulationError):
    """Every actor waits and no event is left that could wake any of them."""


class ScheduleError(ValueError):
    """A recorded schedule that cannot be replayed (a receive no one sent to, a wait on nothing)."""


# --------------------------------------------------------------------------------------------------
# What the simulator keeps
# --------------------------------------------------------------------------------------------------


class _Actor:
    __slots__ = ("id", "rank", "clock", "state", "woken", "parked_at", "waiting", "hops", "seq", "deadline")

    def __init__(self, actor_id: int, rank: int, clock: float, state: str = RUNNING):
        self.id, self.rank, self.clock, self.state = actor_id, rank, clock, state
        self.woken = 0          # how many wake-ups other threads have sent it
        self.parked_at = -1     # the wake-up count it parked at
        self.waiting = None     # the request (or collective) it is blocked on
        self.hops = 0           # messages one after another that led to its clock (the critical path)
        self.seq = 0            # its operations so far (ties between equal times)
        self.deadline = None    # a test(): the clock time it asks about


class _Message:
    __slots__ = ("id", "src", "dst", "group", "tag", "nbytes", "issued", "start", "sent", "arrival", "wire",
                 "latency", "in_port", "hops", "request", "order")

    def __init__(self, id, src, dst, group, tag, nbytes, issued, hops, request, order):
        self.id, self.src, self.dst, self.group, self.tag, self.nbytes = id, src, dst, group, tag, nbytes
        self.issued, self.hops, self.request, self.order = issued, hops, request, order
        self.start = self.sent = self.arrival = self.wire = self.latency = self.in_port = None


class _Request:
    """A send, a receive or a collective one actor started; `done` is its completion time once known."""
    __slots__ = ("id", "kind", "actor", "rank", "peer", "group", "tag", "nbytes", "posted", "done", "message",
                 "source", "order", "what")

    def __init__(self, request_id, kind, actor, rank, peer, group, tag, nbytes, posted, order, what=""):
        self.id, self.kind, self.actor, self.rank, self.peer = request_id, kind, actor, rank, peer
        self.group, self.tag, self.nbytes, self.posted, self.order = group, tag, nbytes, posted, order
        self.done = None
        self.message = None
        self.source = None
        self.what = what


@dataclass
class _Collective:
    members: tuple
    kind: str
    entries: dict = field(default_factory=dict)   # rank -> (clock, nbytes, root, request)


# --------------------------------------------------------------------------------------------------
# The simulator
# --------------------------------------------------------------------------------------------------


class Simulator:
    """The modeled clocks of one launch (or one replay): actors, the sides of the links, messages.

    Args:
        network: a `course_lib.Network` (or a cluster): what `route(src, dst)` a message takes.
        world_size: G; actor `main_actor(r)` of every rank exists from the start, running at clock 0.

    Operations take an actor id and are applied in the order that actor issued them. `wait`, `test`
    and `collective` may block the actor; `run()` processes every event that is safe to process and
    returns the actors it woke as (actor id, request id, time, detail).
    """

    def __init__(self, network, world_size: int, collective_cost=None):
        self.network, self.world_size = network, world_size
        self.collective_cost = collective_cost   # (network, kind, nbytes, members, root, element_size) -> seconds
        self.actors: dict = {}
        self.requests: dict = {}
        self.free: dict = {}                 # a side of a link -> when it is free
        self.events: list = []
        self.counter = 0
        self.unexpected: dict = {}           # rank -> messages arrived before any receive accepted them
        self.posted: dict = {}               # rank -> receives posted and not matched, in post order
        self.collectives: dict = {}          # (group, seq) -> _Collective
        self.streams: dict = {}              # group -> when its last collective ends
        self.woken: list = []                # (actor, request, time, detail) to hand back from run()
        self.matches: dict = {}              # actor -> [(request, source)] of its receives matched since last asked
        self.notices: list = []              # (actor, request, time): sends that left while nobody waited on them
        self.messages = 0
        self.bytes_out = [0] * world_size
        self.bytes_in = [0] * world_size
        self.routes: dict = {}
        self.horizon = 0.0                   # the time of the last event processed
        self._running: set = set()           # ids of the actors that run (they hold the simulation back)
        self._clocks: list = []              # (clock, id) of running actors; stale entries are skipped
        self._testing: set = set()           # actors blocked in test()
        for rank in range(world_size):
            self._note(self.actors.setdefault(main_actor(rank), _Actor(main_actor(rank), rank, 0.0)))

    # -- actors ----------------------------------------------------------------------------------

    def actor(self, actor_id: int, clock: float | None = None) -> _Actor:
        """The actor, created running (a thread's first operation) if it is new."""
        actor = self.actors.get(actor_id)
        if actor is None:
            rank = actor_rank(actor_id)
            if not 0 <= rank < self.world_size:
                raise SimulationError(f"actor {actor_id} belongs to no rank of {self.world_size}")
            # a thread that starts communicating now cannot start before what has already happened
            actor = self.actors[actor_id] = _Actor(actor_id, rank, max(self.horizon, clock or 0.0))
            self._note(actor)
        return actor

    def _note(self, actor: _Actor) -> None:
        """Keep the set of running actors and their clocks up to date after `actor` changed."""
        if actor.state == RUNNING:
            self._running.add(actor.id)
            heapq.heappush(self._clocks, (actor.clock, actor.id))
        else:
            self._running.discard(actor.id)

    def sync_clock(self, actor_id: int, clock: float) -> _Actor:
        """The actor's clock as it counts it (its compute since its last operation added): never backwards."""
        actor = self.actor(actor_id, clock)
        if actor.state == DONE:
            raise SimulationError(f"rank {actor.rank}: an operation after this thread finished")
        if actor.state == PARKED:          # its first operation after another thread handed it work
            actor.state = RUNNING
        if clock > actor.clock:
            actor.clock = clock
        if actor.clock < self.horizon:     # cannot happen for an actor the simulation waited for; be safe
            actor.clock = self.horizon
        actor.seq += 1
        self._note(actor)
        return actor

    def park(self, actor_id: int, clock: float, seen: int) -> None:
        """The actor waits for another thread of its rank (its queue is empty): it holds nothing back.

        `seen` is how many wake-ups it had seen when it decided to wait; a wake-up the simulator already
        has beyond that means the work is there, and the actor stays running."""
        actor = self.sync_clock(actor_id, clock)
        if actor.woken <= seen:
            actor.state, actor.parked_at = PARKED, seen
            self._note(actor)

    def wake(self, giver_id: int, clock: float, target_id: int, count: int) -> None:
        """Thread `giver` handed thread `target` work (its `count`-th wake-up): the target runs from the
        giver's clock on, if it was waiting."""
        giver = self.sync_clock(giver_id, clock)
        target = self.actors.get(target_id)
        if target is None:
            target = self.actor(target_id, giver.clock)
        target.woken = max(target.woken, count)
        if target.state == PARKED and count > target.parked_at:
            target.state = RUNNING
            target.clock = max(target.clock, giver.clock)
            self._note(target)

    def finish(self, actor_id: int) -> None:
        actor = self.actors.get(actor_id)
        if actor is not None:
            actor.state, actor.waiting = DONE, None
            self._note(actor)
            self._testing.discard(actor.id)

    def finish_rank(self, rank: int) -> None:
        """Every thread of `rank` is done (its function returned, or it failed)."""
        for actor in self.actors.values():
            if actor.rank == rank:
                actor.state, actor.waiting = DONE, None
                self._note(actor)
                self._testing.discard(actor.id)

    # -- messages --------------------------------------------------------------------------------

    def isend(self, actor_id: int, clock: float, request_id, dst: int, nbytes: int, group: int = 0, tag: int = 0):
        """Start sending `nbytes` to rank `dst`; the request completes when the message has left."""
        actor = self.sync_clock(actor_id, clock)
        self._check_peer(actor, dst, "send to")
        request = self._request(request_id, "send", actor, dst, group, tag, nbytes)
        self.counter += 1
        message = _Message(self.counter, actor.rank, dst, group, tag, int(nbytes), actor.clock, actor.hops + 1,
                           request, (actor.rank, actor.seq))
        request.message = message
        self.messages += 1
        self._push(actor.clock, _ISSUE, message.order, message)
        return request

    def irecv(self, actor_id: int, clock: float, request_id, src: int | None, nbytes: int = 0, group: int = 0,
              tag: int = 0):
        """Post a receive from `src` (None: from any source)."""
        actor = self.sync_clock(actor_id, clock)
        if src is not None:
            self._check_peer(actor, src, "receive from")
        request = self._request(request_id, "recv", actor, src, group, tag, nbytes)
        self._push(actor.clock, _POST, (actor.rank, actor.seq), request)
        return request

    def wait(self, actor_id: int, clock: float, request_id) -> None:
        """Block the actor until the request completes (at once, in `run()`, if it already has)."""
        actor = self.sync_clock(actor_id, clock)
        request = self._own(actor, request_id)
        actor.state, actor.waiting = BLOCKED, request
        self._note(actor)
        if request.done is not None:
            self._wake(actor, request)

    def test(self, actor_id: int, clock: float, request_id, poll: float = 1e-6) -> None:
        """Block the actor until the simulator can say whether the request is complete at the actor's clock;
        the answer (detail True/False) comes from `run()`. A False answer costs `poll` seconds of the actor's
        clock, so a loop that only polls still moves forward in modeled time."""
        actor = self.sync_clock(actor_id, clock)
        request = self._own(actor, request_id)
        actor.state, actor.waiting, actor.deadline = BLOCKED, request, (actor.clock, poll)
        self._note(actor)
        self._testing.add(actor.id)

    def collective(self, actor_id: int, clock: float, request_id, group, members, seq: int, kind: str,
                   nbytes: int = 0, root: int | None = None, element_size: int = 1):
        """Enter a built-in collective (`seq`-th on `group`, over global ranks `members`); its request completes,
        on every member, `collective_cost` after it starts (`torch_collectives.collective_time` in a launch):
        when the last member has entered it and the group's previous collective has ended (a communicator runs
        its collectives one after another, as NCCL runs them in order on one stream). Kind 'sync' costs nothing and waits for nothing but the members."""
        actor = self.sync_clock(actor_id, clock)
        members = tuple(members)
        if actor.rank not in members:
            raise SimulationError(f"rank {actor.rank} entered a {kind} of a group it is not in {members}")
        request = self._request(request_id, "collective", actor, None, group, 0, nbytes, what=kind)
        key = (group, seq)
        entry = self.collectives.get(key)
        if entry is None:
            entry = self.collectives[key] = _Collective(members, kind)
        if entry.kind != kind:
            raise SimulationError(
                f"mismatched collectives: rank {actor.rank} called {kind} where rank {next(iter(entry.entries), '?')} "
                f"called {entry.kind} (call number {seq + 1} on this group): every rank must call the same "
                "collectives in the same order")
        if actor.rank in entry.entries:
            raise SimulationError(f"rank {actor.rank} entered collective {seq} on group {group} twice")
        entry.entries[actor.rank] = (actor.clock, nbytes, root, request)
        if len(entry.entries) == len(members):
            del self.collectives[key]
            start = max(clock for clock, *_ in entry.entries.values())
            cost = 0.0
            if kind != "sync":
                start = max(start, self.streams.get(group, 0.0))
                if self.collective_cost is None:
                    raise SimulationError(f"this simulation has no model for built-in collectives ({kind})")
                cost = self.collective_cost(self.network, kind, nbytes, members, root, element_size=element_size)
                self.streams[group] = start + cost
            for _, _, _, other in entry.entries.values():
                self._complete(other, start + cost)
        return request

    def matched(self, actor_id: int) -> list:
        """The (request id, source rank) of the actor's receives matched since the last call, in match order.

        Per actor, not per rank: the thread that posted a receive is the one that reads its match (with the answer
        to its next blocking call), so a match never waits in the socket of a thread that is not reading."""
        return self.matches.pop(actor_id, [])

    # -- processing ------------------------------------------------------------------------------

    def run(self) -> list:
        """Process every event no running actor can still precede; return the actors woken meanwhile."""
        bound = self._bound()
        events = self.events
        # Strictly before the bound: a running actor at clock T may still issue an event at T, and events at
        # equal times must be taken in their tie order (lower rank first), whatever order they were learnt in.
        while events and events[0][0] < bound:
            time, kind, _, _, item = heapq.heappop(events)
            self.horizon = time
            if kind == _ISSUE:
                self._issue(item)
            elif kind == _ENTER:
                self._enter(item, time)
            elif kind == _POST:
                self._post(item, time)
            else:
                self._arrive(item, time)
            if self.woken:
                bound = min(bound, self._bound())
        self._answer_tests(bound)
        woken, self.woken = self.woken, []
        return woken

    def next_event(self) -> float:
        return self.events[0][0] if self.events else math.inf

    def running(self) -> list:
        return [self.actors[i] for i in self._running]

    def deadlock(self) -> str | None:
        """A description of what every waiting actor waits for, if nothing can ever wake any of them."""
        if self.events or self._running:
            return None
        waiting = [a for a in self.actors.values() if a.state == BLOCKED]
        if not waiting:
            return None
        lines = []
        for actor in sorted(waiting, key=lambda a: (a.rank, a.id)):
            lines.append(f"rank {actor.rank}{'' if actor.id == main_actor(actor.rank) else ' (a second thread)'} "
                         f"waits in {self._describe(actor.waiting)} since {_format_seconds(actor.clock)} "
                         "(modeled time)")
        done = sorted({a.rank for a in self.actors.values() if a.state == DONE}
                      - {a.rank for a in self.actors.values() if a.state != DONE})
        if done:
            lines.append(f"rank{'s' if len(done) > 1 else ''} {', '.join(map(str, done))} "
                         f"{'have' if len(done) > 1 else 'has'} finished")
        return "; ".join(lines)

    # -- inside ----------------------------------------------------------------------------------

    def _bound(self) -> float:
        """The least clock of a running actor (infinity when none runs)."""
        clocks, actors = self._clocks, self.actors
        while clocks:
            clock, actor_id = clocks[0]
            actor = actors[actor_id]
            if actor.state == RUNNING and actor.clock == clock:
                return clock
            heapq.heappop(clocks)
        return math.inf

    def _push(self, time, kind, order, item):
        self.counter += 1
        heapq.heappush(self.events, (time, kind, order, self.counter, item))

    def _route(self, src, dst):
        route = self.routes.get((src, dst))
        if route is None:
            route = self.routes[(src, dst)] = self.network.route(src, dst)
        return route

    def _issue(self, message: _Message) -> None:
        bandwidth, latency, out_port, in_port = self._route(message.src, message.dst)
        wire = message.nbytes / bandwidth
        start = max(message.issued, self.free.get(out_port, 0.0))
        self.free[out_port] = message.sent = start + wire
        message.start, message.wire, message.latency, message.in_port = start, wire, latency, in_port
        self.bytes_out[message.src] += message.nbytes
        self._complete(message.request, message.sent)
        if in_port is None:
            message.arrival = message.sent + latency
            self._push(message.arrival, _ARRIVE, message.order, message)
        else:
            self._push(start, _ENTER, message.order, message)

    def _enter(self, message: _Message, time: float) -> None:
        in_start = max(time, self.free.get(message.in_port, 0.0))
        self.free[message.in_port] = in_start + message.wire
        message.arrival = in_start + message.wire + message.latency
        self._push(message.arrival, _ARRIVE, message.order, message)

    def _post(self, request: _Request, time: float) -> None:
        waiting = self.unexpected.get(request.rank)
        if waiting:
            for i, message in enumerate(waiting):
                if _accepts(request, message):
                    del waiting[i]
                    self._match(request, message, time)
                    return
        self.posted.setdefault(request.rank, []).append(request)

    def _arrive(self, message: _Message, time: float) -> None:
        self.bytes_in[message.dst] += message.nbytes
        posted = self.posted.get(message.dst)
        if posted:
            for i, request in enumerate(posted):
                if _accepts(request, message):
                    del posted[i]
                    self._match(request, message, time)
                    return
        self.unexpected.setdefault(message.dst, []).append(message)

    def _match(self, request: _Request, message: _Message, time: float) -> None:
        request.message, request.source = message, message.src
        self.matches.setdefault(request.actor.id, []).append((request.id, message.src))
        self._complete(request, time)

    def _complete(self, request: _Request, time: float) -> None:
        request.done = time
        actor = request.actor
        if actor.state == BLOCKED and actor.waiting is request and actor.deadline is None:
            self._wake(actor, request)
        elif request.kind == "send":
            # told at once, so a later wait on it need not ask (a rank's wait on its send then costs no round trip)
            self.notices.append((actor.id, request.id, time))

    def _wake(self, actor: _Actor, request: _Request) -> None:
        if request.done > actor.clock:
            actor.clock = request.done
            if request.message is not None and request.kind == "recv":
                actor.hops = request.message.hops
        actor.state, actor.waiting = RUNNING, None
        self._note(actor)
        self.requests.pop(request.id, None)
        self.woken.append((actor.id, request.id, actor.clock, request.source))

    def _answer_tests(self, bound: float) -> None:
        if not self._testing:
            return
        horizon = min(bound, self.next_event())
        for actor in [self.actors[i] for i in sorted(self._testing)]:
            if actor.state != BLOCKED or actor.deadline is None:
                self._testing.discard(actor.id)
                continue
            request, (when, poll) = actor.waiting, actor.deadline
            if request.done is not None and request.done <= when:
                answer = True
            elif request.done is not None or horizon > when:
                answer = False       # known to finish later, or nothing left that could finish it by then
            else:
                continue
            actor.deadline = None
            self._testing.discard(actor.id)
            actor.state, actor.waiting = RUNNING, None
            if not answer:
                actor.clock = when + poll
            else:
                self.requests.pop(request.id, None)
            self._note(actor)
            self.woken.append((actor.id, request.id, actor.clock, answer))

    def _request(self, request_id, kind, actor, peer, group, tag, nbytes, what=""):
        if request_id in self.requests:
            raise SimulationError(f"request {request_id} of rank {actor.rank} started twice")
        request = _Request(request_id, kind, actor, actor.rank, peer, group, tag, nbytes, actor.clock,
                           (actor.rank, actor.seq), what)
        self.requests[request_id] = request
        return request

    def _own(self, actor: _Actor, request_id) -> _Request:
        request = self.requests.get(request_id)
        if request is None or request.rank != actor.rank:
            raise SimulationError(f"rank {actor.rank} waits on request {request_id}, which it never started "
                                  "(or already waited for)")
        return request

    def _check_peer(self, actor, peer, what):
        if not isinstance(peer, int) or not 0 <= peer < self.world_size or peer == actor.rank:
            raise SimulationError(f"rank {actor.rank} cannot {what} rank {peer!r} (ranks 0..{self.world_size - 1})")

    def _describe(self, request) -> str:
        if request is None:
            return "nothing"
        if request.kind == "recv":
            source = "any source" if request.peer is None else f"rank {request.peer}"
            return f"a receive from {source} (tag {request.tag}) that no message matches"
        if request.kind == "collective":
            group = self.collectives
            waiting_for = [key for key, c in group.items() if request in [e[3] for e in c.entries.values()]]
            missing = ""
            if waiting_for:
                entry = group[waiting_for[0]]
                missing = f": ranks {sorted(set(entry.members) - set(entry.entries))} never entered it"
            return f"a {request.what}{missing}"
        return f"a send to rank {request.peer}"


def _accepts(request: _Request, message: _Message) -> bool:
    return ((request.peer is None or request.peer == message.src) and request.group == message.group
            and request.tag == message.tag)


# Actor ids: a rank's main thread is rank << 16; its other threads rank << 16 | 1, 2, ...
def main_actor(rank: int) -> int:
    return rank << 16


def actor_rank(actor_id: int) -> int:
    return actor_id >> 16


def _format_seconds(value: float) -> str:
    for unit, size in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if value >= size:
            return f"{value / size:.4g} {unit}"
    return f"{value * 1e9:.4g} ns"


# --------------------------------------------------------------------------------------------------
# Replaying a recorded schedule
# --------------------------------------------------------------------------------------------------


@dataclass
class Timing:
    """One replay: `seconds` the schedule took (the last rank's clock), `latencies` on its critical path (messages
    one after another that led to that clock), `busiest_bytes` through the busiest rank's link (sent or received),
    and every rank's clock at the end (`per_rank`)."""

    seconds: float
    latencies: int
    busiest_bytes: int
    per_rank: list


def replay(events_by_rank, network) -> Timing:
    """Time a recorded schedule on `network`, with compute free: the time its messages alone take.

    `events_by_rank[r]` is rank r's calls in program order, as `exercises.tracing.Tracer` records them:
    ('send' | 'isend' | 'recv' | 'irecv', peer, nbytes, tag) and ('wait', index of the isend/irecv in that
    list). A blocking send ends when its message has left; a receive when it has arrived. Requests never
    waited for still have to finish before the rank is done.

    Raises:
        ScheduleError: a receive that no send matches, a wait on something that is not a request.
    """
    return replay_threads([[events] for events in events_by_rank], network)


def replay_threads(threads_by_rank, network) -> Timing:
    """`replay` for ranks that run several threads at once: `threads_by_rank[r]` is a list of scripts, one per
    thread of rank r (each in `replay`'s form, its waits indexing its own list). The threads of a rank share its
    links; a rank is done when all its threads are. (NCCL's tree sends chunks up and down at the same time from
    two groups of threads; `course_lib.nccl` times it this way.)"""
    world_size = len(threads_by_rank)
    sim = Simulator(network, world_size)
    actors = [(rank, index, list(events)) for rank, scripts in enumerate(threads_by_rank)
              for index, events in enumerate(scripts or [[]])]          # a rank with nothing to do is done at once
    ids = [main_actor(rank) | index for rank, index, _ in actors]
    position = [0] * len(actors)
    unwaited = [dict() for _ in actors]   # event index -> request id
    clock = [0.0] * len(actors)
    blocked = [False] * len(actors)
    finished = [False] * len(actors)
    which = {actor_id: k for k, actor_id in enumerate(ids)}
    for k, (rank, index, _) in enumerate(actors):
        if index:
            sim.actor(ids[k], 0.0)

    def step(k) -> None:
        """Run actor k's script until it blocks or ends."""
        rank, thread, script = actors[k]
        actor = ids[k]
        while position[k] < len(script):
            index = position[k]
            event = script[index]
            position[k] += 1
            kind = event[0]
            if kind in ("send", "isend", "recv", "irecv"):
                _, peer, nbytes, tag = event
                request_id = (rank, thread, index)
                try:
                    if kind in ("send", "isend"):
                        sim.isend(actor, clock[k], request_id, peer, nbytes, 0, tag)
                    else:
                        if peer is None:
                            raise ScheduleError(f"rank {rank} received from any source: the timing needs every "
                                                "receive to name its sender (dist.recv(buffer, src))")
                        sim.irecv(actor, clock[k], request_id, peer, nbytes, 0, tag)
                except SimulationError as exc:
                    raise ScheduleError(str(exc)) from None
                if kind in ("send", "recv"):
                    sim.wait(actor, clock[k], request_id)
                    blocked[k] = True
                    return
                unwaited[k][index] = request_id
            elif kind == "wait":
                request_id = unwaited[k].pop(event[1], None)
                if request_id is None:
                    continue          # a wait on a request already waited for, or not a p2p one: nothing to do
                sim.wait(actor, clock[k], request_id)
                blocked[k] = True
                return
            else:
                raise ScheduleError(f"rank {rank}: unknown event {event!r}")
        if unwaited[k]:           # still in flight at the end: the thread is done when they are (oldest first)
            request_id = unwaited[k].pop(next(iter(unwaited[k])))
            sim.wait(actor, clock[k], request_id)
            blocked[k] = True
            return
        finished[k] = True
        sim.finish(actor)

    for k in range(len(actors)):
        step(k)
    while not all(finished):
        woken = sim.run()
        if not woken:
            stuck = sim.deadlock()
            waiting = [k for k in range(len(actors)) if blocked[k]]
            k = waiting[0] if waiting else 0
            rank, _, script = actors[k]
            event = script[position[k] - 1] if position[k] else None
            peer = event[1] if event and event[0] in ("recv", "irecv") else None
            if event and event[0] == "wait":
                peer = script[event[1]][1]
            raise ScheduleError(f"rank {rank} waits for a message from rank {peer if peer is not None else '?'} that "
                                f"was never sent in the recorded schedule{_listed(stuck)}")
        for actor_id, _request, when, _detail in sorted(woken):
            k = which[actor_id]
            clock[k] = max(clock[k], when)
            blocked[k] = False
            step(k)
    per_rank = [0.0] * world_size
    for k, (rank, _, _) in enumerate(actors):
        per_rank[rank] = max(per_rank[rank], clock[k])
    last = max(range(len(actors)), key=lambda k: clock[k]) if actors else 0
    hops = sim.actors[ids[last]].hops if actors else 0
    busiest = max((max(o, i) for o, i in zip(sim.bytes_out, sim.bytes_in)), default=0)
    return Timing(max(per_rank, default=0.0), hops, busiest, per_rank)


def _listed(stuck, shown: int = 6, width: int = 110) -> str:
    """What every blocked rank waits for (`Simulator.deadlock`), one rank a line, the first `shown` of them: on 64
    ranks the whole list is kilobytes on one line."""
    if not stuck:
        return " (nothing left to run)."
    parts = stuck.split("; ")
    finished = [p for p in parts if not p.startswith("rank ") or p.endswith(" finished")]
    waiting = [p for p in parts if p not in finished]
    lines = [textwrap.shorten(p, width) for p in waiting[:shown]]
    if len(waiting) > shown:
        lines.append(f"... and {len(waiting) - shown} more ranks waiting")
    for part in finished:
        if len(part) > width:          # 'ranks 0, 1, ..., 63 have finished': the first few and the count
            done = part.split(" have finished")[0].removeprefix("ranks ").split(", ")
            part = f"ranks {', '.join(done[:8])}, ... ({len(done)} ranks in all) have finished"
        lines.append(part)
    return ":\n  " + "\n  ".join(lines)
