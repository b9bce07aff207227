"""Point-to-point messages: the only way course_lib's algorithms talk to each other.

`send`, `recv`, `isend` and `irecv` take the same arguments as the `torch.distributed` functions
of the same names and call them. On top they:

* check the arguments and say plainly what is wrong (a peer outside the group, sending to
  yourself, something that is not a tensor), before gloo turns the mistake into a hang or a crash;
* log the message into every active `course_lib.traffic` recording;
* tell the launcher which call this rank is blocked in, so a deadlock can be explained;
* turn the process group's timeout into an error that names the call that never completed.

The keyword-only `chunk=` argument is extra: it only labels the message in a traffic recording.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib import runtime, traffic
from course_lib.runtime import not_a_rank

__all__ = ["send", "recv", "isend", "irecv", "Request"]


# (default group, group) -> (rank, world size). Both are fixed for a group's lifetime, and asking
# torch.distributed for them costs about a microsecond per call, on every message.
_world_cache: dict = {}


def _world(group):
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "no torch.distributed process group is running in this process. Call course_lib "
            "functions inside a function started by course_lib.launch(fn, world_size) "
            "(or after torch.distributed.init_process_group under torchrun)."
        )
    key = (id(dist.group.WORLD), id(group))
    known = _world_cache.get(key)
    if known is None:
        known = _world_cache[key] = (dist.get_rank(group), dist.get_world_size(group))
    return known


def _check(call: str, tensor, peer_name: str, peer, group, allow_any_source=False):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{call} expects a torch.Tensor as `tensor`, got {type(tensor).__name__}. "
                        "Wrap your data first, e.g. torch.tensor(values).")
    rank, world_size = _world(group)
    problem = None if peer is None and allow_any_source else not_a_rank(peer_name, peer, world_size)
    if problem is not None:
        raise ValueError(f"{call}: {problem}")
    if peer == rank:
        raise ValueError(f"{call}: rank {rank} cannot exchange a message with itself ({peer_name}={peer}). "
                         "Copy the tensor locally instead.")
    if not tensor.is_contiguous():
        raise ValueError(f"{call} needs a contiguous tensor, and this one (shape {tuple(tensor.shape)}) is a "
                         "strided view. Send tensor.contiguous(), or receive into a contiguous buffer and copy.")


def _describe(call, peer_name, peer, tensor, chunk) -> str:
    text = f"{call}({peer_name}={peer}, shape={tuple(tensor.shape)}, dtype={tensor.dtype}"
    labels = traffic._labels  # read, not copied: this runs before every blocking call
    if labels["phase"] is not None:
        text += f", phase={labels['phase']!r}"
    if labels["step"] is not None:
        text += f", step={labels['step']}"
    if chunk is not None:
        text += f", chunk={chunk}"
    return text + ")"


def _blocking(call, peer_name, peer, tensor, chunk, run):
    """Run a blocking torch call with the launcher told about it and timeouts explained."""
    if runtime.has_slot():
        runtime.set_blocked(_describe(call, peer_name, peer, tensor, chunk))
    try:
        return run()
    except RuntimeError as err:
        if "timed out" in str(err).lower() or "timeout" in str(err).lower():
            raise TimeoutError(
                f"rank {dist.get_rank()}: {_describe(call, peer_name, peer, tensor, chunk)} did not complete "
                "before the process group's timeout. Its partner never made the matching call: "
                "check that both sides agree on peer, order and size."
            ) from err
        raise
    finally:
        runtime.clear_blocked()


def send(tensor: torch.Tensor, dst: int | None = None, group=None, tag: int = 0, *, chunk: int | None = None) -> None:
    """Send `tensor` to rank `dst` and return once it is handed over (like `torch.distributed.send`).

    Under gloo the call blocks the process until the receiver has taken the message; under NCCL it returns once
    the send is queued on the GPU's stream, and only the stream waits (PyTorch's "Synchronous and asynchronous
    collective operations").

    Args:
        tensor: the data to send (contiguous).
        dst: rank to send to.
        group, tag: as in `torch.distributed.send`.
        chunk: optional chunk index, recorded in the traffic trace only.
    """
    _check("send", tensor, "dst", dst, group)
    if traffic._active:
        traffic.log("send", dst, tensor, chunk)
    _blocking("send", "dst", dst, tensor, chunk, lambda: dist.send(tensor, dst, group=group, tag=tag))


def recv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0, *, chunk: int | None = None) -> int:
    """Receive into `tensor` (in place) from rank `src`, or from anyone if `src` is None.

    Returns:
        The rank the message came from.
    """
    _check("recv", tensor, "src", src, group, allow_any_source=True)
    sender = _blocking("recv", "src", src, tensor, chunk, lambda: dist.recv(tensor, src, group=group, tag=tag))
    if traffic._active:
        traffic.log("recv", sender, tensor, chunk)
    return sender


class Request:
    """Handle of an `isend` / `irecv` in flight; `wait()` blocks until it completes.

    Wraps the `torch.distributed` Work object so the launcher can see what a rank is waiting for.
    """

    def __init__(self, work, call, peer_name, peer, tensor, chunk):
        self._work = work
        self._what = (call, peer_name, peer, tensor, chunk)
        self._done = False

    def wait(self, timeout=None) -> bool:
        """Block until the message has gone out (isend) or arrived (irecv). Waiting again is a no-op:
        gloo hangs on a second wait of the same receive, so we remember the first."""
        if self._done:
            return True
        call, peer_name, peer, tensor, chunk = self._what
        run = (lambda: self._work.wait()) if timeout is None else (lambda: self._work.wait(timeout))
        result = _blocking(call + ".wait", peer_name, peer, tensor, chunk, run)
        self._done = True
        return result

    def is_completed(self) -> bool:
        return self._done or self._work.is_completed()


def isend(tensor: torch.Tensor, dst: int | None = None, group=None, tag: int = 0, *, chunk: int | None = None) -> Request:
    """Start sending `tensor` to `dst` and return at once; call `.wait()` before reusing `tensor`."""
    _check("isend", tensor, "dst", dst, group)
    if traffic._active:
        traffic.log("send", dst, tensor, chunk)
    return Request(dist.isend(tensor, dst, group=group, tag=tag), "isend", "dst", dst, tensor, chunk)


def irecv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0, *, chunk: int | None = None) -> Request:
    """Start receiving into `tensor` from `src` and return at once; `.wait()` before reading it."""
    _check("irecv", tensor, "src", src, group)
    if traffic._active:
        traffic.log("recv", src, tensor, chunk)
    return Request(dist.irecv(tensor, src, group=group, tag=tag), "irecv", "src", src, tensor, chunk)
