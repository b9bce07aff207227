"""What a launch's ranks leave in its folder for the launcher, and the errors the launcher raises.

Every rank of a `launch` writes its stdout, stderr, result, blocked-call status and (on a timeout) its
Python stack to files in the launch's temporary folder; the launcher (`course_lib.launch`) and its
failure report (`course_lib.launch_diagnosis`) read them back from here.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass

__all__ = ["LaunchError", "RankFailedError", "LaunchTimeoutError"]


class LaunchError(RuntimeError):
    """Base class of everything `launch` raises about the ranks it ran."""


class RankFailedError(LaunchError):
    """A rank raised an exception or died; the other ranks were stopped.

    Attributes:
        rank: the rank that failed first.
        exc_type: name of the exception class it raised ('' if it died without one).
        rank_traceback: that rank's formatted traceback ('' if it died without one).
        exitcode: the process exit code; negative means killed by signal ``-exitcode``.
        stderr_tail: the last lines the rank wrote to stderr.
    """

    def __init__(self, message, *, rank, exc_type="", rank_traceback="", exitcode=None, stderr_tail=""):
        super().__init__(message)
        self.rank = rank
        self.exc_type = exc_type
        self.rank_traceback = rank_traceback
        self.exitcode = exitcode
        self.stderr_tail = stderr_tail


class LaunchTimeoutError(LaunchError, TimeoutError):
    """The ranks did not finish within `timeout` seconds.

    Attributes:
        blocked: dict rank -> what that rank was doing when time ran out, e.g.
            "recv(src=1, shape=(4,), dtype=torch.float32)".
    """

    def __init__(self, message, *, blocked):
        super().__init__(message)
        self.blocked = blocked


_FINISHED = "finished"  # status line of a rank that returned and waits for the others


@dataclass
class _RankFiles:
    """Paths one rank uses to talk back to the launcher: every one lives in the launch's temp dir."""

    workdir: str
    rank: int

    def path(self, kind: str) -> str:
        return os.path.join(self.workdir, f"{kind}.{self.rank}")

    @property
    def stdout(self):
        return self.path("stdout")

    @property
    def stderr(self):
        return self.path("stderr")

    @property
    def result(self):
        return self.path("result")

    @property
    def status(self):
        return self.path("status")

    @property
    def network(self):
        return os.path.join(self.workdir, "clock.sock")  # the modeled clock's coordinator listens here (one per launch)

    @property
    def stack(self):
        return self.path("stack")


def _read_result(workdir, rank):
    path = _RankFiles(workdir, rank).result
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


def _stop_all(processes) -> None:
    for process in processes:
        if process.exitcode is None:
            try:
                process.kill()
            except (OSError, ValueError):
                pass
    for process in processes:
        process.join(timeout=5)
