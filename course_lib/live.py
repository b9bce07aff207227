"""Live progress in a notebook while something long runs, instead of a silent cell.

Two things use it:

* `launch`: once its ranks have run for `DELAY` seconds, the cell shows one line per rank, refreshed
  twice a second: how far the rank's loop has got (`progress` inside the rank), the last line it
  printed, and the send or recv it is blocked in. Nothing changes for a launch that ends sooner;
* `progress(iterable)`, for a loop in the notebook itself (a sweep over world sizes), shows a bar
  once the loop has run for `DELAY` seconds; inside a rank it tells the launcher instead;
* `running(what)`, for anything else that blocks (a torchrun subprocess): "what · 12 s".

    for world_size in course_lib.progress([2, 3, 4, 8], desc="world size"):
        results[world_size] = course_lib.launch(fn, world_size)

All of it is shown only in a Jupyter kernel with ipywidgets, and removed when the work ends: what
stays in the cell's output is exactly what it would be without it, so stored notebook outputs and
nbval's comparison do not depend on how long anything took. (The live line is an ipywidgets view
and nothing else; nbval does not compare widget views, and at the end the view is replaced by an
empty one, which `tools/execute_notebooks.py` drops from the stored notebook.)
"""

from __future__ import annotations

import contextvars
import html
import os
import threading
import time
from typing import Callable, Iterable

from course_lib import runtime
from course_lib._util import progress_bar

__all__ = ["progress", "running", "LaunchStatus", "DELAY"]

DELAY = 2.0       # seconds of silence before a live line appears
REFRESH = 0.5     # seconds between refreshes
_WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def in_jupyter_kernel() -> bool:
    """True when running in a Jupyter kernel (JupyterLab, Colab, nbclient, nbval) with ipywidgets."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    if shell is None or getattr(shell, "kernel", None) is None:
        return False
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


def _view(model_id: str) -> dict:
    # A display of nothing but a widget view: nbval compares no widget views, so it sees no output.
    return {_WIDGET_VIEW: {"version_major": 2, "version_minor": 0, "model_id": model_id}}


class LiveLine:
    """An HTML line in the running cell, refreshed from `render()` by a background thread.

    Nothing for the first `delay` seconds (a quick cell stays exactly as it was), then the line
    appears and is refreshed every `REFRESH` seconds; at the end of the `with` block it is removed.
    Outside a Jupyter kernel it does nothing. A failure while showing progress never reaches the work.
    """

    def __init__(self, render: Callable[[], str], delay: float = DELAY):
        self.render, self.delay = render, delay
        self._thread = self._widget = self._handle = None
        self._stop = threading.Event()
        self._lock = threading.Lock()

    def __enter__(self) -> "LiveLine":
        if in_jupyter_kernel():
            # The copied context carries the kernel's idea of the running cell, so the line appears
            # in this cell even though a thread displays it.
            context = contextvars.copy_context()
            self._thread = threading.Thread(target=context.run, args=(self._run,), daemon=True,
                                            name="course_lib-live")
            self._thread.start()
        return self

    def refresh(self) -> None:
        """Redraw now (if the line is showing): for loops that know when something changed."""
        with self._lock:
            if self._widget is not None:
                self._widget.value = self.render()

    def _run(self) -> None:
        try:
            if self._stop.wait(self.delay):
                return
            import ipywidgets as widgets
            from IPython.display import display

            with self._lock:
                self._widget = widgets.HTML(self.render())
                self._handle = display(_view(self._widget.model_id), raw=True, display_id=True)
            while not self._stop.wait(REFRESH):
                self.refresh()
        except Exception:  # noqa: BLE001 - progress is a courtesy: never let it break the work
            pass

    def __exit__(self, *exc_info) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        if self._widget is not None:
            try:
                # An empty view: JupyterLab hides it, and the saved notebook shows nothing there.
                self._handle.update(_view(""), raw=True)
                self._widget.close()
            except Exception:  # noqa: BLE001
                pass


# --------------------------------------------------------------------------------------------------
# A loop
# --------------------------------------------------------------------------------------------------


def _bar(done: int, total: int | None) -> str:
    # The live line's thread calls this. It must import nothing: a launch that forks while another
    # thread is inside an import leaves that import's lock held in the ranks, and a rank that then
    # imports the same module waits forever. So the bar comes from course_lib._util, imported already.
    return f"{done} done" if total is None else progress_bar(done, total)


def progress(iterable: Iterable, desc: str = "", total: int | None = None, delay: float = DELAY):
    """Yield the items of `iterable`, showing how far the loop has got.

    In a notebook: a line "desc [#####-------] 3/8 · 12 s" appears once the loop has run for
    `delay` seconds, and goes when the loop ends. Inside a rank started by `launch`: the rank's
    progress line, which the launcher shows live ("epoch 3/10"). Anywhere else (a script, torchrun,
    pytest) the items pass through and nothing is shown.

    Args:
        iterable: what to loop over.
        desc: what one item is, e.g. "world size" or "epoch".
        total: the number of items, when `len(iterable)` does not say.
        delay: seconds before the line appears.

    Example::

        for world_size in course_lib.progress([2, 3, 4, 8], desc="world size"):
            ...
    """
    if total is None:
        try:
            total = len(iterable)
        except TypeError:
            total = None
    label = f"{desc} " if desc else ""
    if runtime.has_slot():                      # inside a launched rank: tell the launcher
        try:
            for done, item in enumerate(iterable):
                runtime.set_progress(f"{label}{_bar(done, total)}")
                yield item
        finally:
            runtime.set_progress("")
        return
    state = {"done": 0, "item": None, "started": time.monotonic()}

    def render():
        elapsed = time.monotonic() - state["started"]
        now = "" if state["item"] is None else f" · now: {html.escape(desc or 'item')} {html.escape(str(state['item']))}"
        return (f"<code>{html.escape(label)}{html.escape(_bar(state['done'], total))}{now} · "
                f"{elapsed:.0f} s</code>")

    with LiveLine(render, delay) as line:
        for item in iterable:
            state["item"] = item
            line.refresh()
            yield item
            state["done"] += 1


def running(what: str, delay: float = DELAY) -> LiveLine:
    """A `with` block that, in a notebook, shows "what · 12 s" once it has run for `delay` seconds.

    For work that is neither a launch nor a loop, e.g. a torchrun subprocess::

        with course_lib.live.running("torchrun: 2 ranks training"):
            subprocess.run(command, capture_output=True)
    """
    started = time.monotonic()
    return LiveLine(lambda: f"<code>{html.escape(what)} · {time.monotonic() - started:.0f} s</code>", delay)


# --------------------------------------------------------------------------------------------------
# A launch
# --------------------------------------------------------------------------------------------------


def _last_line(path: str, limit: int = 4096) -> str:
    """The last non-empty line of a text file (read from its end), or ''."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    return next((line.strip() for line in reversed(lines) if line.strip()), "")


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


class LaunchStatus(LiveLine):
    """While a launch runs: one live line per rank, read from the files the ranks write anyway.

    For each rank: its progress line (`progress` inside the rank), else the last line it printed
    (the launcher shows everything the ranks print, in order, when they are done), and the send or
    recv it is blocked in, from the status line `p2p` writes before every blocking call.

    Args:
        world_size: the number of ranks.
        status_file: status_file(rank) is the path of that rank's slot file (`course_lib.runtime`).
        stdout_file: stdout_file(rank) is the path of the file its output goes to.
    """

    def __init__(self, world_size: int, status_file: Callable[[int], str], stdout_file: Callable[[int], str],
                 delay: float = DELAY):
        self.world_size, self.status_file, self.stdout_file = world_size, status_file, stdout_file
        self.started = time.monotonic()
        super().__init__(self._render, delay)

    def rank_line(self, rank: int) -> str:
        """What rank `rank` is doing, in one line of text."""
        blocked = runtime.read_slot_file(self.status_file(rank))
        doing = runtime.read_progress(self.status_file(rank)) or _last_line(self.stdout_file(rank))
        if blocked == "finished":
            state = "finished, waits for the others"
        elif blocked:
            state = f"in {blocked}"
        else:
            state = "running"
        return " · ".join(part for part in (f"rank {rank}", _short(doing, 60), _short(state, 110)) if part)

    def _render(self) -> str:
        lines = [f"{self.world_size} rank{'s' if self.world_size != 1 else ''} running for "
                 f"{time.monotonic() - self.started:.0f} s (their output follows when they finish)"]
        lines += [self.rank_line(rank) for rank in range(self.world_size)]
        return ("<pre style='margin:0; font-size:0.85em; line-height:1.3'>"
                + html.escape("\n".join(lines)) + "</pre>")
