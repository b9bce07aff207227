"""What this rank is doing right now, readable by the launcher from outside the process.

When `course_lib.launch` starts a rank it gives it a small shared file (one per rank). The
point-to-point wrappers in `course_lib.p2p` write one line into it before every call that can block
("recv(src=1, shape=(4,), dtype=float32)") and clear it afterwards. If the launch times out, the
parent reads every rank's line and can say who was waiting for whom: that is how a deadlock gets
explained instead of just killed.

A second, shorter line after it holds the rank's progress ("epoch 3/10"), set by
`course_lib.progress` inside the rank; while a launch runs in a notebook, the launcher shows both
lines live (`course_lib.live`).

Outside a launched rank (plain Python, torchrun) nothing is set up and every call here is a no-op.
"""

from __future__ import annotations

import mmap
import os

SLOT_BYTES = 512       # the blocked-call line
PROGRESS_BYTES = 256   # the progress line, right after it
_FILE_BYTES = SLOT_BYTES + PROGRESS_BYTES

_slot: mmap.mmap | None = None


def create_slot_file(path: str) -> None:
    """Make the zero-filled file a rank will map (called by the launcher, before the rank starts)."""
    with open(path, "wb") as f:
        f.write(b"\0" * _FILE_BYTES)


def attach(path: str) -> None:
    """Map this rank's slot file; from now on `set_blocked` writes into it."""
    global _slot
    fd = os.open(path, os.O_RDWR)
    try:
        _slot = mmap.mmap(fd, _FILE_BYTES)
    finally:
        os.close(fd)


def detach() -> None:
    global _slot
    if _slot is not None:
        _slot.close()
        _slot = None


def is_active() -> bool:
    return _slot is not None


def set_blocked(description: str) -> None:
    """Record the call this rank is about to block in (a no-op when not under the launcher)."""
    if _slot is None:
        return
    data = description.encode("utf-8", "replace")[: SLOT_BYTES - 1]
    _slot[: len(data) + 1] = data + b"\0"


def clear() -> None:
    if _slot is not None:
        _slot[0:1] = b"\0"


def read_slot_file(path: str) -> str:
    """The line a rank last wrote, or '' when it was not inside a blocking call."""
    try:
        with open(path, "rb") as f:
            raw = f.read(SLOT_BYTES)
    except OSError:
        return ""
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


def set_progress(text: str) -> None:
    """Record how far this rank's own loop has got, e.g. "epoch 3/10" ('' clears it; no-op outside a launch)."""
    if _slot is None:
        return
    data = text.encode("utf-8", "replace")[: PROGRESS_BYTES - 1]
    _slot[SLOT_BYTES: SLOT_BYTES + len(data) + 1] = data + b"\0"


def read_progress(path: str) -> str:
    """The progress line a rank last set, or ''."""
    try:
        with open(path, "rb") as f:
            f.seek(SLOT_BYTES)
            raw = f.read(PROGRESS_BYTES)
    except OSError:
        return ""
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")
