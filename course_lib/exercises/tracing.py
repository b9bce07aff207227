"""Watch a learner's function from inside a rank: every message it sent, and what the message carried.

The check cannot trust the learner's own labels (chunk=, phase, step), so it traces one level lower,
in the rank's process group: a `Tracer` is a layer of course_lib's torch.distributed backend
(`course_lib.backend`), which the check's launch uses. While it is active on a rank:

* every send and receive passes it, however it was made: `course_lib.p2p`, ``dist.send / recv / isend /
  irecv``, a name imported with ``from torch.distributed import send``. A send is logged with a copy of
  the data it carried, taken at send time; a receive with its peer and size. The layer also writes the
  rank's status line (`course_lib.runtime`), so a deadlock in a raw ``dist.recv`` is explained like one
  in `p2p.recv`, and it adds ``case * TAG_STRIDE`` to the tag: a message a broken case left behind can
  never be received by the next case.
* the built-in collectives (``dist.all_reduce``, ``broadcast``, ``all_gather``, ...), the calls made of
  messages that an exercise asks the learner to write (``batch_isend_irecv``, the object calls), and
  course_lib's own implementations (`course_lib.collectives`, `course_lib.allreduce`,
  `course_lib.fast_allreduce`, and for the training exercise `course_lib.training`) raise `ForbiddenCall`:
  an exercise is to write them. A collective is refused when it reaches the process group, whichever
  name it was called by; a course_lib implementation is refused by name and, reached any other way,
  by its messages: the layer looks at the call stack.
* what the learner prints goes to a `CappedWriter` (kept up to a limit, counted beyond it).

Nothing in ``torch.distributed`` is replaced.

Everything is undone when the tracer exits. Outside a launched rank nothing here is used.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import linecache
import os
import sys
import threading
from dataclasses import dataclass

import torch

import course_lib
from course_lib import backend, runtime

__all__ = ["Message", "ForbiddenCall", "CappedWriter", "Tracer", "learner_frame", "describe_line", "is_learner_file", "TAG_STRIDE",
           "FORBIDDEN_BUILTINS", "forbidden_description"]

P2P_CALLS = ("send", "recv", "isend", "irecv")
# Built-ins that compute what the exercises ask the learner to compute (barrier and the queries
# get_rank / get_world_size stay allowed: they move no data).
FORBIDDEN_BUILTINS = (
    "all_reduce", "all_reduce_coalesced", "broadcast", "all_gather", "all_gather_into_tensor",
    "all_gather_coalesced", "all_gather_single", "reduce", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_single", "all_to_all", "all_to_all_single", "gather", "scatter", "batch_isend_irecv",
    "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
    "send_object_list", "recv_object_list",
)
TAG_STRIDE = 1_000_000  # gloo tags are 32-bit: room for 4000 cases of a million tags each
# Public functions of the forbidden course_lib modules that compute nothing an exercise asks for:
# helpers a learner may use.
HELPERS = {"chunk_sizes", "owned_chunk", "make_mlp", "make_spirals", "make_regression", "progress_bar",
           "flat_parameters", "shard_indices", "split_batches", "steps_per_epoch", "global_batches",
           "simulate_stale_sgd", "split_sequential", "train_single_process",
           "segments_per_chunk", "expected_traffic", "expected_steps"}      # fast_allreduce's arithmetic



def forbidden_description(modules) -> str:
    """What an exercise with these forbidden course_lib modules refuses, in one line (for `exercises.list()`).

    Example::

        >>> forbidden_description(("training",))
        'torch.distributed collectives; course_lib.training (but not its helpers)'
    """
    modules = ", ".join(f"course_lib.{m}" for m in modules)
    return "torch.distributed collectives" + (f"; {modules} (but not their helpers)" if "," in modules else
                                              f"; {modules} (but not its helpers)" if modules else "")


_COURSE_LIB_DIR = os.path.dirname(os.path.abspath(course_lib.__file__)) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_STDLIB_DIR = os.path.dirname(os.path.abspath(contextlib.__file__)) + os.sep


class ForbiddenCall(BaseException):
    """The learner's function called something the exercise asks them to write themselves.

    A BaseException, so that a learner's ``except Exception`` cannot swallow it.
    """

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


@dataclass
class Message:
    """One point-to-point call as the rank that made it saw it.

    Attributes:
        op: 'send', 'isend', 'recv' or 'irecv'.
        peer: the other rank (for a receive from any source, the rank it came from; None for an
            irecv from any source).
        numel: elements in the message.
        data: for sends, a copy of what was sent (taken when the call was made); None for receives.
        tag: the tag the learner passed.
    """

    op: str
    peer: int | None
    numel: int
    data: torch.Tensor | None = None
    tag: int = 0

    @property
    def is_send(self) -> bool:
        return self.op in ("send", "isend")


class CappedWriter:
    """A text stream that keeps the first `limit` characters written to it and counts the rest."""

    def __init__(self, limit: int = 4000):
        self.limit, self.size, self._kept = limit, 0, []

    def write(self, text) -> int:
        text = str(text)
        room = self.limit - sum(len(t) for t in self._kept)
        if room > 0:
            self._kept.append(text[:room])
        self.size += len(text)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    @property
    def text(self) -> str:
        return "".join(self._kept)


def is_learner_file(path: str) -> bool:
    """True for code the learner wrote: not course_lib's, torch's, the standard library's or a package's."""
    path = os.path.abspath(path) if path and not path.startswith("<") else (path or "")
    return not (path.startswith(_COURSE_LIB_DIR) or path.startswith(_TORCH_DIR) or path.startswith(_STDLIB_DIR)
                or "site-packages" in path or path.startswith("<frozen"))


def learner_frame(frame) -> str:
    """'line 12 in ring_scatter_reduce: dist.recv(buf, left)' for the innermost frame of the learner's
    own code at or above `frame` (a frame object or a traceback's frame list), or ''."""
    while frame is not None:
        code = frame.f_code
        if is_learner_file(code.co_filename) and code.co_name != "<module>":
            return describe_line(code, frame.f_lineno)
        frame = frame.f_back
    return ""


def describe_line(code, lineno: int) -> str:
    """'line 12 in ring_scatter_reduce: dist.recv(buf, left)' (the line number within the cell)."""
    line = linecache.getline(code.co_filename, lineno).strip()
    return f"line {lineno} in {code.co_name}" + (f": {line}" if line else "")


def _course_lib_function(forbidden_modules) -> str | None:
    """The outermost course_lib function of a forbidden module on the current call stack, if any."""
    found = None
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_COURSE_LIB_DIR):
            module = os.path.relpath(path, _COURSE_LIB_DIR).replace(os.sep, ".").removesuffix(".py")
            if module.split(".")[0] in forbidden_modules:
                found = f"course_lib.{module}.{frame.f_code.co_name}"
        frame = frame.f_back
    return found


_CHECKS_FILE = os.path.join(_COURSE_LIB_DIR, "runtime.py")


def _called_from_checks() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename == _CHECKS_FILE:
            return True
        frame = frame.f_back
    return False


def _elements(numel: int) -> str:
    return f"{numel} element{'s' if numel != 1 else ''}"


def _deliver(landing, tensor) -> None:
    """Copy what arrived in a landing buffer into the learner's receive buffer (no-op without one)."""
    if landing is not None:
        tensor.view(-1).copy_(landing[: tensor.numel()])


class _TracedWork(backend.Work):
    """The Work a traced send or receive returns: `wait()` sets the status line, and a receive's message is
    copied from its landing buffer into the learner's tensor once it has arrived."""

    def __init__(self, under, tracer, call, peer, description, landing=None, tensor=None, event=None, match=None,
                 arrived=None):
        super().__init__(under)
        self._tracer, self._blocked = tracer, (call, peer, description, match)
        self._landing, self._tensor = landing, tensor
        self._event, self._on_arrival = event, arrived

    def _arrived(self):
        _deliver(self._landing, self._tensor)
        self._landing = None  # once: gloo hangs on a second wait, and a later copy would undo the learner's edits
        if self._event is not None:   # the first wait (or completed poll) is when the program learnt it was done
            self._tracer.events.append(("wait", self._event))
            self._event = None
        if self._on_arrival is not None:
            arrived, self._on_arrival = self._on_arrival, None
            arrived(self)

    def wait(self, timeout=None):
        with self._tracer.failures_unmatch(), self._tracer.blocked_in(*self._blocked):
            result = super().wait(timeout)
        self._arrived()
        return result

    def is_completed(self):
        done = super().is_completed()
        if done:
            self._arrived()
        return done


class Tracer:
    """Trace, police and quieten one learner call on this rank (a context manager).

    A layer of course_lib's torch.distributed backend (`course_lib.backend`): the launch must have made the
    process group with it (``launch(..., backend="course_lib")``, as the exercise checks do).

    Args:
        case_index: which case of the launch this is; offsets the tags.
        forbidden_modules: course_lib modules the learner must not call ('collectives', 'allreduce',
            'training').
        namespaces: dicts (e.g. the learner function's ``__globals__``) in which names bound to forbidden
            course_lib functions are swapped for refusals while the tracer is active.
        print_limit: characters of the learner's printing to keep.

    After the block: ``messages`` (list of `Message`), ``printed`` (a `CappedWriter`), ``events`` (every call in
    program order, waits included: what `capstone.replay` times).
    """

    def __init__(self, case_index: int = 0, forbidden_modules=("collectives", "allreduce"), namespaces=(),
                 print_limit: int = 4000, largest_message: int = 0, keep_data: bool = True, landing: bool = True):
        self.case_index = case_index
        self.largest_message = largest_message
        # keep_data=False keeps only sizes (the capstone's 64 MiB cases: a copy of every message would double
        # the memory); landing=False receives straight into the learner's buffer (see _landing)
        self.keep_data, self.use_landing = keep_data, landing
        # Every call in program order, for replaying the schedule on a modeled link (the capstone):
        # ("send" | "isend" | "recv" | "irecv", peer, bytes, tag) and ("wait", index of the isend / irecv)
        self.events: list[tuple] = []
        self.forbidden_modules = tuple(forbidden_modules)
        self.namespaces = [ns for ns in namespaces if isinstance(ns, dict)]
        self.messages: list[Message] = []
        self.printed = CappedWriter(print_limit)
        # (call, peer, description, learner line, entry number, match) of the call this rank is blocked in, read by
        # the watchdog as one tuple (one assignment, so another thread never sees half of it). `match` is
        # ("send" | "recv", peer, tag, k): this is the k-th call of its direction to or from `peer` with `tag`,
        # the k-th of the pair that gloo matches with the k-th of the other side (None where that cannot be said).
        self.blocked: tuple | None = None
        self._entries = 0
        # ("send" | "recv", peer, tag) -> how many such calls this rank has posted (made, blocking or not)
        self.posted: collections.Counter = collections.Counter()
        # which send meets which receive is not known (a receive from any source, a call on a subgroup or from another
        # thread, a tag beyond the case's range, a call that failed): the watchdog's deadlock rule stays out of it
        self.unmatched = False
        self._thread = threading.get_ident()
        self._undo: list = []
        self._exit_stack = None

    # -- status ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def blocked_in(self, call: str, peer, description: str, match=None):
        """Mark this rank as blocked in `call` for the block. If the call fails (a peer died, the case
        is being stopped), the mark stays: it is what the watchdog reports."""
        if threading.get_ident() != self._thread:
            self.unmatched = True     # one slot for one thread: a second thread's wait would hide the first's state
        self._entries += 1
        self.blocked = (call, peer, description, learner_frame(sys._getframe(2)), self._entries, match)
        if runtime.has_slot():
            runtime.set_blocked(description)
        yield
        self.blocked = None
        runtime.clear_blocked()

    @contextlib.contextmanager
    def failures_unmatch(self):
        """A call that raises inside the block (its message may never have been posted, or a wait was given up)
        leaves the pairing of sends with receives unknown: `unmatched`."""
        try:
            yield
        except BaseException:
            self.unmatched = True
            raise

    # -- the backend layer ------------------------------------------------------------------------

    def _landing(self, tensor):
        """A zeroed buffer with room for the largest message of the case, for a receive into `tensor`.

        gloo aborts the whole process when a message is longer than the receive buffer, which is the
        usual result of sending the wrong chunk when chunks differ in size: the rank would die with a
        C++ message and take its trace with it. Received into a buffer with room to spare, the message
        lands, the learner's buffer gets its first `tensor.numel()` elements (zeros where the message
        was shorter), the result goes wrong, and the check explains the wrong step from the trace.
        None (receive as asked) where a landing buffer cannot help: not a contiguous tensor (torch
        refuses it with its own message), or no message of the case can be longer than the buffer.
        """
        if not self.use_landing or not isinstance(tensor, torch.Tensor) or not tensor.is_contiguous():
            return None
        room = max(self.largest_message, *(m.numel for m in self.messages if m.is_send), 0)
        if room <= tensor.numel():
            return None
        return torch.zeros(room, dtype=tensor.dtype, device=tensor.device)

    def _post(self, direction: str, peer, tag, group):
        """Count a send or receive as posted; returns its `match` (see `blocked`), or None when the pairing of sends
        with receives cannot be known (see `unmatched`)."""
        if (peer is None or not 0 <= tag < TAG_STRIDE or threading.get_ident() != self._thread or group.code != 0):
            self.unmatched = True
            return None
        self.posted[(direction, peer, tag)] += 1
        return direction, peer, tag, self.posted[(direction, peer, tag)]

    def _refuse_forbidden(self, called: str) -> None:
        """ForbiddenCall if the learner reached this message or collective through something the exercise forbids."""
        if called in FORBIDDEN_BUILTINS and not _called_from_checks():
            raise ForbiddenCall(f"torch.distributed.{called}")
        name = _course_lib_function(self.forbidden_modules)
        if name is not None:
            raise ForbiddenCall(name)

    def send(self, group, tensor, dst, tag, proceed):
        called = backend.caller() or "isend"
        self._refuse_forbidden(called)
        name = "send" if called == "send" else "isend"
        peer = dst if group.code == 0 else group.global_ranks[dst]
        numel, nbytes = tensor.numel(), tensor.numel() * tensor.element_size()
        match = self._post("send", peer, tag, group)
        with self.failures_unmatch():           # counted above: if it fails, the count may be wrong
            data = tensor.detach().clone().cpu() if self.keep_data else None
            self.messages.append(Message(name, peer, numel, data, tag))
            event = len(self.events)
            self.events.append((name, peer, nbytes, tag))
            work = proceed(tensor, dst, tag + self.case_index * TAG_STRIDE)
        description = f"{name}(dst={peer}, {_elements(numel)}" + (f", tag={tag}" if tag else "") + ")"
        if name == "isend":
            return _TracedWork(work, self, "isend.wait", peer, f"isend.wait(dst={peer}, {_elements(numel)})",
                               event=event, match=match)
        return _TracedWork(work, self, "send", peer, description, match=match)

    def recv(self, group, tensor, src, tag, proceed):
        called = backend.caller() or "irecv"
        self._refuse_forbidden(called)
        name = "recv" if called == "recv" else "irecv"
        peer = None if src is None else (src if group.code == 0 else group.global_ranks[src])
        numel, nbytes = tensor.numel(), tensor.numel() * tensor.element_size()
        match = self._post("recv", peer, tag, group)
        with self.failures_unmatch():
            landing = self._landing(tensor)
            event = len(self.events)
            if name == "irecv":
                self.events.append(("irecv", peer, nbytes, tag))
                self.messages.append(Message("irecv", peer, numel, None, tag))
            work = proceed(tensor if landing is None else landing, src, tag + self.case_index * TAG_STRIDE)
        if name == "irecv":
            return _TracedWork(work, self, "irecv.wait", peer, f"irecv.wait(src={peer}, {_elements(numel)})",
                               landing=landing, tensor=tensor, event=event, match=match)

        def arrived(traced):           # a blocking receive is logged once it knows its sender
            sender = peer
            if sender is None:
                sender = traced._source_rank()
                sender = sender if group.code == 0 else group.global_ranks[sender]
            self.messages.append(Message("recv", sender, numel, None, tag))
            self.events.append(("recv", sender, nbytes, tag))

        description = f"recv(src={peer}, {_elements(numel)}" + (f", tag={tag}" if tag else "") + ")"
        return _TracedWork(work, self, "recv", peer, description, landing=landing, tensor=tensor, match=match,
                           arrived=arrived)

    def collective(self, group, call, proceed):
        if call.kind == "barrier" or _called_from_checks():     # a barrier moves no data: an exercise may use it
            return proceed()
        called = backend.caller()
        raise ForbiddenCall(f"torch.distributed.{called}" if called else f"the process group's {call.kind}")

    # -- context manager --------------------------------------------------------------------------

    @staticmethod
    def _refusal(what):
        def refuse(*args, **kwargs):
            raise ForbiddenCall(what)

        refuse.__name__ = what.rsplit(".", 1)[-1]
        return refuse

    def _swap(self, owner, name, value):
        if isinstance(owner, dict):
            self._undo.append((owner, name, owner[name]))
            owner[name] = value
        else:
            self._undo.append((owner, name, getattr(owner, name)))
            setattr(owner, name, value)

    def __enter__(self):
        if not backend.active():
            raise RuntimeError("Tracer watches the calls of course_lib's torch.distributed backend: launch the ranks "
                               "with launch(..., backend='course_lib')")
        self._thread = threading.get_ident()
        import importlib

        # Forbidden course_lib functions are refused by name (their messages would be refused anyway, by the
        # stack the layer reads; a name refuses at once, even a call that sends nothing).
        replacements = {}  # id(original object) -> replacement
        for module_name in self.forbidden_modules:
            module = importlib.import_module(f"course_lib.{module_name}")
            for name in getattr(module, "__all__", ()):
                value = getattr(module, name, None)
                if inspect.isfunction(value) and name not in HELPERS:
                    replacement = self._refusal(f"course_lib.{module_name}.{name}")
                    replacements[id(value)] = replacement
                    self._swap(module, name, replacement)
        for namespace in self.namespaces:
            for name, value in list(namespace.items()):
                if id(value) in replacements and not isinstance(value, (int, str)):
                    self._swap(namespace, name, replacements[id(value)])
        backend.install(self, outermost=True)
        self._exit_stack = contextlib.ExitStack()
        self._exit_stack.callback(backend.remove, self)
        self._exit_stack.enter_context(contextlib.redirect_stdout(self.printed))
        self._exit_stack.enter_context(contextlib.redirect_stderr(self.printed))
        return self

    def __exit__(self, *exc):
        self._exit_stack.close()
        for owner, name, value in reversed(self._undo):
            if isinstance(owner, dict):
                owner[name] = value
            else:
                setattr(owner, name, value)
        self._undo.clear()
        return False

    # -- reading the trace ------------------------------------------------------------------------

    @property
    def sends(self) -> list[Message]:
        return [m for m in self.messages if m.is_send]
