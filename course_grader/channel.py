"""Frames between the judge and a sandbox: a 4-byte length, then `wire.encode`d data.

The judge reads with a time limit and a size limit, so a sandbox that floods, stalls, or writes garbage
costs that request and nothing else (`ChannelError`, `ChannelTimeout`, `ChannelClosed`).
"""

from __future__ import annotations

import os
import select
import struct
import time

from course_lib.exercises import wire

__all__ = ["send", "receive", "ChannelError", "ChannelClosed", "ChannelTimeout", "REPLY_LIMIT"]

_HEADER = struct.Struct(">I")
# The judge's limit on one reply from a sandbox: the largest a complete grading sends is under 1 MB (notebook 11's
# batches), and a reply is held three times over while it is decoded.
REPLY_LIMIT = 8 * 2**20


class ChannelError(RuntimeError):
    """What came through the pipe is not a frame the protocol allows."""


class ChannelClosed(ChannelError):
    """The other side closed its end: the sandbox ended (or was killed)."""


class ChannelTimeout(ChannelError):
    """No complete frame within the time allowed."""


def send(fd: int, value) -> None:
    data = wire.encode(value)
    payload = _HEADER.pack(len(data)) + data
    view = memoryview(payload)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _read_exactly(fd: int, count: int, deadline: float | None) -> bytes:
    chunks, left = [], count
    while left:
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([fd], [], [], wait)
        if not ready:
            raise ChannelTimeout("no answer in time")
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise ChannelClosed("the other side closed the channel")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def receive(fd: int, timeout: float | None = None, limit: int = REPLY_LIMIT):
    """The next value from `fd`, decoded as data only.

    Raises:
        ChannelTimeout: nothing complete within `timeout` seconds.
        ChannelClosed: the other side is gone.
        ChannelError: a frame larger than `limit`, or one `wire.decode` refuses.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    (length,) = _HEADER.unpack(_read_exactly(fd, _HEADER.size, deadline))
    if length > limit:
        raise ChannelError(f"a reply of {length:,} bytes, more than the {limit:,} allowed")
    try:
        return wire.decode(_read_exactly(fd, length, deadline))
    except wire.WireError as exc:
        raise ChannelError(f"a reply that is not data the judge accepts: {exc}") from None
