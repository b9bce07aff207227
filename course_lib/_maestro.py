"""The modeled clock's coordinator: a thread in the launching process that runs the simulation.

Every communicating thread of every rank (an *actor*) connects to it over a Unix socket and sends a
small fixed-size frame for each operation (`modeled_clock.py` is the other side). Non-blocking operations
(isend, irecv, compute, a thread handing another work) get no answer; blocking ones (wait, test) get
the actor's new clock once `course_lib.simulation` can tell it. The coordinator applies the frames in
the order each actor sent them and processes events in modeled-time order (`Simulator.run`), so what
the clocks read never depends on which process this machine happened to schedule first.

When every actor waits and no event can wake any of them, the program has a deadlock in modeled time:
after a short grace (a thread may be about to start), every waiting actor gets an error that says what
each rank waits for, instead of hanging until the launch's timeout.
"""

from __future__ import annotations

import os
import selectors
import socket
import struct
import threading
import time

from course_lib import torch_collectives
from course_lib.simulation import ModeledDeadlock, SimulationError, Simulator, actor_rank, main_actor

# One request: op, actor, request id, a, b, c, clock, x, length of what follows.
REQUEST = struct.Struct("<B3xiqqqqddI4x")
# One message to an actor: kind (REPLIED, FAILED, NOTICE), matches that follow, detail (a source rank, a test's
# answer; for FAILED the length of the message text that follows), clock, the request it is about.
REPLY = struct.Struct("<iiqdq")
REPLIED, FAILED, NOTICE = 0, 1, 2   # NOTICE: a send the actor is not waiting on has left, at `clock`
MATCH = struct.Struct("<qq")

ISEND, IRECV, WAIT, TEST, COLLECTIVE, PARK, WAKE, CLOCK, DONE_ACTOR, DONE_RANK = range(1, 11)
BLOCKING = (WAIT, TEST)

DEADLOCK_GRACE = 0.5   # seconds of no frames, everyone waiting, before a deadlock is declared


class _Connection:
    __slots__ = ("sock", "buffer", "actor", "outbox")

    def __init__(self, sock):
        self.sock, self.buffer, self.actor, self.outbox = sock, bytearray(), None, bytearray()


class Maestro:
    """Runs the simulation for one launch. `start()` after the ranks are forked; `stop()` when they are done."""

    def __init__(self, network, world_size: int, path: str):
        self.network, self.world_size, self.path = network, world_size, path
        self.sim = Simulator(network, world_size, collective_cost=torch_collectives.collective_time)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(max(128, 4 * world_size))
        self.listener.setblocking(False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.sockets: dict = {}          # actor id -> its connection (for its replies)
        self.errors: dict = {}           # actor id -> a message for its next blocking call
        self.thread: threading.Thread | None = None
        self.stopping = threading.Event()
        self.deadlocked: str | None = None
        self.failure: BaseException | None = None
        self._quiet_since = None

    # -- lifetime ----------------------------------------------------------------------------------

    def start(self) -> None:
        self.thread = threading.Thread(target=self._serve, name="course_lib-clock", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(timeout=5)
        for key in list(self.selector.get_map().values()):
            try:
                key.fileobj.close()
            except OSError:
                pass
        self.selector.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def clocks(self) -> list:
        """Every rank's main thread's clock (seconds of modeled time)."""
        return [self.sim.actors[main_actor(r)].clock for r in range(self.world_size)]

    def describe(self) -> str:
        """What the simulation waits for (for a launch that timed out)."""
        running = sorted({a.rank for a in self.sim.running()})
        text = self.sim.deadlock()
        if text:
            return text
        if running:
            return (f"on the modeled clock, rank{'s' if len(running) > 1 else ''} {', '.join(map(str, running))} "
                    "ran code that waited for something the clock does not see (a real blocking call outside "
                    "send/recv and torch.distributed's collectives, e.g. DistributedDataParallel's C++ all-reduce, or "
                    "a thread that waits without course_lib.clock.idle), while the others waited for modeled time")
        return ""

    # -- the loop ----------------------------------------------------------------------------------

    def _serve(self) -> None:
        try:
            while not self.stopping.is_set():
                events = self.selector.select(timeout=0.1)
                got_frames = False
                for key, mask in events:
                    if key.fileobj is self.listener:
                        self._accept()
                        continue
                    if mask & selectors.EVENT_WRITE:
                        self._flush(key.data)
                    if mask & selectors.EVENT_READ:
                        got_frames |= self._read(key.data)
                self._progress()
                self._watch_for_deadlock(got_frames)
        except BaseException as exc:  # noqa: BLE001 - report to every waiting actor, then stop
            self.failure = exc
            self._fail_everyone(f"the modeled clock's coordinator failed: {type(exc).__name__}: {exc}")

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except BlockingIOError:
                return
            sock.setblocking(False)      # written through an outbox: a full socket never stalls the simulation
            self.selector.register(sock, selectors.EVENT_READ, _Connection(sock))

    def _read(self, connection: _Connection) -> bool:
        try:
            data = connection.sock.recv(1 << 16)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        if not data:
            self._closed(connection)
            return True
        buffer = connection.buffer
        buffer += data
        offset, size = 0, REQUEST.size
        while len(buffer) - offset >= size:
            fields = REQUEST.unpack_from(buffer, offset)
            length = fields[-1]
            if len(buffer) - offset < size + length:
                break
            payload = bytes(buffer[offset + size: offset + size + length])
            offset += size + length
            if connection.actor is None:
                connection.actor = fields[1]
                self.sockets[fields[1]] = connection
            self._apply(fields, payload)
        del buffer[:offset]
        return True

    def _closed(self, connection: _Connection) -> None:
        if connection.sock.fileno() < 0:
            return
        self.selector.unregister(connection.sock)
        connection.sock.close()
        if connection.actor is not None:
            self.sockets.pop(connection.actor, None)
            if connection.actor == main_actor(actor_rank(connection.actor)):
                self.sim.finish_rank(actor_rank(connection.actor))   # the rank ended (or died)
            else:
                self.sim.finish(connection.actor)

    def _apply(self, fields, payload: bytes) -> None:
        op, actor, request, a, b, c, clock, x, _length = fields
        sim = self.sim
        try:
            if op == ISEND:
                sim.isend(actor, clock, request, a, int(x), b, c)
            elif op == IRECV:
                sim.irecv(actor, clock, request, None if a < 0 else a, int(x), b, c)
            elif op == WAIT:
                if self._pending_error(actor):
                    return
                sim.wait(actor, clock, request)
            elif op == TEST:
                if self._pending_error(actor):
                    return
                sim.test(actor, clock, request, x)
            elif op == COLLECTIVE:
                kind, _, element = payload[:24].rstrip(b"\0").decode().partition(":")
                members = struct.unpack(f"<{(len(payload) - 24) // 4}i", payload[24:])
                sim.collective(actor, clock, request, b, members, a, kind, int(x), None if c < 0 else c,
                               int(element or 1))
            elif op == PARK:
                sim.park(actor, clock, a)
            elif op == WAKE:
                sim.wake(actor, clock, a, c)
            elif op == CLOCK:
                sim.sync_clock(actor, clock)
            elif op == DONE_ACTOR:
                sim.finish(actor)
            elif op == DONE_RANK:
                sim.finish_rank(actor_rank(actor))
            else:
                raise SimulationError(f"unknown operation {op}")
        except SimulationError as exc:
            self.errors[actor] = str(exc)
            if op in BLOCKING:
                self._pending_error(actor)

    def _pending_error(self, actor: int) -> bool:
        message = self.errors.pop(actor, None)
        if message is None:
            return False
        self._send_error(actor, message)
        return True

    def _progress(self) -> None:
        for actor, _request, clock, detail in self.sim.run():
            matches = self.sim.matched(actor)
            if isinstance(detail, bool):
                detail = int(detail)
            elif detail is None:
                detail = -1
            reply = (REPLY.pack(REPLIED, len(matches), detail, clock, _request)
                     + b"".join(MATCH.pack(h, s) for h, s in matches))
            self._send(actor, reply)
        notices, self.sim.notices = self.sim.notices, []
        for actor, request, clock in notices:
            self._send(actor, REPLY.pack(NOTICE, 0, -1, clock, request))

    def _send(self, actor: int, data: bytes) -> None:
        connection = self.sockets.get(actor)
        if connection is None:
            return
        pending = bool(connection.outbox)
        connection.outbox += data
        if not pending:
            self._flush(connection)

    def _flush(self, connection: _Connection) -> None:
        """Write what the socket takes now; wait for it to take the rest (never block the simulation)."""
        try:
            sent = connection.sock.send(connection.outbox)
        except BlockingIOError:
            sent = 0
        except OSError:
            connection.outbox.clear()
            return
        del connection.outbox[:sent]
        wanted = selectors.EVENT_READ | (selectors.EVENT_WRITE if connection.outbox else 0)
        try:
            if self.selector.get_key(connection.sock).events != wanted:
                self.selector.modify(connection.sock, wanted, connection)
        except (KeyError, ValueError):
            pass

    def _send_error(self, actor: int, message: str) -> None:
        text = message.encode()
        self._send(actor, REPLY.pack(FAILED, 0, len(text), 0.0, 0) + text)

    def _watch_for_deadlock(self, got_frames: bool) -> None:
        text = self.sim.deadlock()
        if text is None or got_frames:
            self._quiet_since = None if text is None else time.monotonic()
            return
        if self._quiet_since is None:
            self._quiet_since = time.monotonic()
            return
        if time.monotonic() - self._quiet_since < DEADLOCK_GRACE:
            return
        self.deadlocked = text
        message = (f"deadlock on the modeled clock: {text}. No message or collective left in flight can wake any "
                   "of them: check that every receive has a matching send (peer, tag, order) and that every rank "
                   "calls the same collectives in the same order.")
        for actor in [a.id for a in self.sim.actors.values() if a.state == "blocked"]:
            self.sim.finish(actor)
            self._send_error(actor, message)
        self._quiet_since = None

    def _fail_everyone(self, message: str) -> None:
        for actor in list(self.sockets):
            self._send_error(actor, message)


__all__ = ["Maestro", "ModeledDeadlock"]
