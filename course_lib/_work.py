"""``async_op=True``: a work handle, and one background thread per rank that runs collectives in call order.

    work = collectives.all_reduce(grad, op="avg", async_op=True)   # returns at once
    ...                                                            # compute while it runs
    work.wait()                                                    # now grad holds the result

Like torch.distributed, an asynchronous collective makes progress in the background while your
code goes on, its results land in your tensors by the time `wait()` returns, and any error it
raised comes out of `wait()`. How course_lib keeps that safe:

* **One worker thread, one queue.** The first async call starts a daemon thread in this rank; every
  async collective is queued and the thread runs them one after the other, in call order.
* **Synchronous calls wait their turn.** Every course_lib collective and all-reduce variant starts
  with `runtime.prepare`, which first calls `runtime.drain()`: a synchronous call made while async work is
  queued runs after it. So every rank runs its collectives in the order it called them, whatever
  mix of sync and async, and the point-to-point messages of two collectives never interleave.
  That matters because gloo matches messages by (peer, tag) in FIFO order, and every course_lib
  algorithm sends with tag 0: two collectives running at once between the same ranks would read
  each other's messages.
* **Checked like the caller asked.** A job runs without autograd, like torch's; the caller wraps it so
  that it runs with the argument check on or off as it was when it was queued
  (`course_lib.unchecked()` is per thread; `collectives._start` does this).
* **On a modeled clock** (`launch(..., network=)`) the worker has a clock of its own: a job starts no
  earlier than the caller's clock when it was queued, and `wait()` moves the caller's clock to the
  job's end (`course_lib.clock`: `now`, `catch_up`; a thread that waits says so with `idle`/`wake`).

The rank's traffic labels, its recordings and its launcher status line stay process-wide (see
docs/architecture.md, "Asynchronous collectives"): `traffic.record()` waits for queued work when it
opens and when it closes, so a recording holds an async collective's messages exactly when the call
was made inside it.

Left to you: while an async collective is in flight, call ``wait()`` before you exchange your own
``p2p`` messages on tag 0 with its ranks (they would match its messages), before torch.distributed's
own collectives (their order across ranks would depend on timing), and before ``traffic.phase()``.
"""

from __future__ import annotations

import collections
import datetime
import os
import threading

import torch

from course_lib import runtime

__all__ = ["Work", "submit", "drain", "finish", "pending"]


class Work:
    """Handle of one asynchronous collective, as returned by ``collectives.X(..., async_op=True)``.

    The same methods as torch.distributed's Work: `wait`, `is_completed`, `is_success`,
    `exception`, `result`, `get_future`.
    """

    def __init__(self, call: str, outputs: list):
        self.call = call                      # 'all_reduce', ...: for messages
        self._outputs = outputs               # the tensors the collective writes, for result()
        self._done = threading.Event()
        self._exception: BaseException | None = None
        self._observed = False                # has anyone been shown the exception?
        self._future = None
        self._lock = threading.Condition(threading.Lock())
        self._end = 0.0                       # the worker's clock when it finished (a modeled clock's time)
        self._waiters: set = set()            # threads waiting in wait(): woken on the modeled clock when done

    def __repr__(self) -> str:
        state = ("running" if not self._done.is_set()
                 else f"failed: {type(self._exception).__name__}" if self._exception is not None else "completed")
        return f"<course_lib Work: {self.call}, {state}>"

    def wait(self, timeout=None) -> bool:
        """Block until the collective has finished; its results are then in your tensors.

        Args:
            timeout: None (or 0, or ``timedelta(0)``, torch's "no timeout") waits as long as it takes;
                otherwise seconds or a `datetime.timedelta`.

        Returns:
            True, like torch.

        Raises:
            The collective's own exception, if it failed (every later `wait()` raises it again).
            TimeoutError if `timeout` passed first; the collective goes on, and you may wait again.
        """
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        if threading.current_thread() is runtime._async_worker:
            raise RuntimeError(f"wait() on an async {self.call} from inside another async collective would wait forever")
        if not self._wait_done(seconds):
            raise TimeoutError(f"async {self.call} did not finish within {seconds:g} s (it is still running; "
                               "wait() again to keep waiting)")
        if self._exception is not None:
            self._observed = True
            raise self._exception
        return True

    def _wait_done(self, seconds=None) -> bool:
        """Wait until the job is done; on a modeled clock this thread's clock then reads at least its end."""
        if not runtime.active():
            return self._done.wait(None if not seconds else seconds)
        me = threading.current_thread()
        with self._lock:
            self._waiters.add(me)
            try:
                runtime.idle(self._lock, self._done.is_set)
            finally:
                self._waiters.discard(me)
        runtime.catch_up(self._end)
        return True

    def is_completed(self) -> bool:
        """True once the collective has finished, successfully or not. Never blocks. (On a modeled clock:
        finished, and this thread's clock has reached its end; a True answer moves the clock there.)"""
        if not self._done.is_set():
            return False
        runtime.catch_up(self._end)
        return True

    def is_success(self) -> bool:
        """False if the collective failed. As in torch, True while it is still running."""
        return self._exception is None

    def exception(self) -> BaseException | None:
        """The exception the collective raised, or None (also while it is still running)."""
        if self._exception is not None:
            self._observed = True
        return self._exception

    def result(self) -> list:
        """Wait, then return the tensors the collective wrote (the ones you passed, in place)."""
        self.wait()
        return list(self._outputs)

    def get_future(self) -> torch.futures.Future:
        """A `torch.futures.Future` completed with `result()` (or with the collective's exception)."""
        with self._lock:
            if self._future is None:
                self._future = torch.futures.Future()
                if self._done.is_set():
                    self._complete_future()
            return self._future

    # -- called by the worker thread --------------------------------------------------------------

    def _finish(self, exception: BaseException | None) -> None:
        with self._lock:
            self._exception = exception
            self._end = runtime.now()
            self._done.set()
            for waiter in self._waiters:
                runtime.wake(waiter)
            self._lock.notify_all()
            if self._future is not None:
                self._complete_future()

    def _complete_future(self) -> None:
        if self._exception is not None:
            self._observed = True
            self._future.set_exception(self._exception)
        else:
            self._future.set_result(list(self._outputs))


# The queue and its thread. Module globals are right here: one rank is one process, and only the
# thread that calls the collectives (normally the main thread) submits and drains.
_queue: collections.deque = collections.deque()
_ready = threading.Condition()          # the worker thread itself is runtime._async_worker (drain reads it)
_unobserved: list = []                    # finished Works whose error nobody has looked at yet


def submit(call: str, job, outputs: list) -> Work:
    """Queue `job()` (a collective's body) to run on this rank's worker thread; return its Work.

    Args:
        call: the collective's name, for messages.
        job: a function of no arguments that runs the whole collective, checks included.
        outputs: the tensors it writes (what `Work.result()` returns).
    """
    work = Work(call, outputs)
    with _ready:
        if runtime._async_worker is None:
            worker = threading.Thread(target=_run_jobs, args=(torch.get_num_threads(),),
                                      name="course_lib-async", daemon=True)
            worker.start()
            runtime._async_worker = worker
        _queue.append((work, job, runtime.now()))
        runtime._newest_async = work        # what runtime.drain() waits for
        runtime.wake(runtime._async_worker)
        _ready.notify()
    return work


def pending() -> bool:
    """True while some submitted async collective has not finished."""
    newest = runtime._newest_async
    return newest is not None and not newest._done.is_set()


drain = runtime.drain  # wait for every queued async collective (it lives beside the checks that call it)


def finish() -> None:
    """Wait for every async collective; raise if one failed and no `wait()` ever saw its error.

    The launcher calls this when a rank's function returns, before it sends back the results: the
    results are complete, and an error nobody waited for is reported instead of lost.
    """
    drain()
    missed = [work for work in _unobserved if not work._observed]
    _unobserved.clear()
    if missed:
        first = missed[0]
        raise RuntimeError(
            f"{len(missed)} async collective(s) failed and no wait() collected the error; the first, "
            f"{first.call}, raised {type(first._exception).__name__}: {first._exception}. Call .wait() on the "
            "handle that async_op=True returns: it raises the collective's error where you can handle it."
        ) from first._exception


def _run_jobs(threads: int) -> None:
    """The worker thread: run queued jobs one at a time, in the order they were submitted."""
    torch.set_num_threads(threads)  # the rank's intra-op thread budget (the launcher's choice)
    while True:
        with _ready:
            runtime.idle(_ready, lambda: bool(_queue))
            work, job, queued_at = _queue[0]
        runtime.catch_up(queued_at)       # a job cannot start before it was queued
        exception = None
        try:
            with torch.no_grad():
                job()
        except BaseException as exc:  # noqa: BLE001 - every failure goes to the caller's wait()
            exception = exc
        with _ready:
            _queue.popleft()
        if exception is not None:
            _unobserved.append(work)
        work._finish(exception)


def _forget_after_fork() -> None:
    """A forked child has no worker thread: start from an empty queue (runtime forgets the thread itself)."""
    _queue.clear()
    _unobserved.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
