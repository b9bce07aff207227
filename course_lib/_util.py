"""A text progress bar, alone in a module that imports nothing heavy (see `progress_bar`)."""

from __future__ import annotations


def progress_bar(done: int, total: int, width: int = 24) -> str:
    """A text progress bar, e.g. ``[######------]  3/6``: deterministic, so notebook outputs compare.

    It lives here, beside nothing heavy, because `course_lib.progress` draws it from a background
    thread: that thread must not be the first to import anything (see `course_lib.live._bar`).
    """
    filled = round(width * done / total) if total else width
    return f"[{'#' * filled}{'-' * (width - filled)}] {done:>{len(str(total))}}/{total}"
