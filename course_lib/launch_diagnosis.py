"""Why a launch failed, in the learner's words: the rank that failed first, or what every rank waited in.

`launch` calls `failure_error` when a rank raised or died, and `timeout_error` when the ranks did
not finish in time; both stop the ranks and return the error to raise. A timeout's report reads each
rank's blocked-call status (`course_lib.runtime`) and its Python stack (faulthandler, on SIGUSR1),
and ends with one sentence on what the states suggest (`diagnose`): a receive with no matching send,
a torch collective some rank never called, a deadlock of receivers.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

from course_lib import runtime
from course_lib.launch_files import (_FINISHED, LaunchTimeoutError, RankFailedError, _RankFiles, _read_result,
                                     _stop_all)

__all__ = ["failure_error", "timeout_error", "diagnose"]


_STDERR_TAIL_LINES = 20


def _stderr_tail(workdir, rank, lines=_STDERR_TAIL_LINES) -> str:
    """The rank's last stderr lines, without the frames a forked child inherits from the launcher."""
    try:
        with open(_RankFiles(workdir, rank).stderr, encoding="utf-8", errors="replace") as f:
            text = f.readlines()
    except OSError:
        return ""
    return "".join(_without_inherited_frames(text)[-lines:])


def _without_inherited_frames(lines: list[str]) -> list[str]:
    """Drop the stack frames a forked rank inherited from the caller (faulthandler prints them).

    faulthandler lists the innermost frame first; everything from the launcher's `_rank_main`
    frame down is the caller's own stack (a notebook kernel's or pytest's), not the rank's story,
    and it would push gloo's actual reason out of the tail.
    """
    kept, skipping = [], False
    for line in lines:
        if line.lstrip().startswith("File ") and "in _rank_main" in line:
            skipping = True
        elif skipping and not line.lstrip().startswith("File "):
            skipping = False
        if not skipping and not line.startswith("Extension modules:"):
            kept.append(line)
    return kept


def _death_time(workdir, rank, first_seen) -> float:
    """When a rank that left no report (killed by a signal, or exited) failed, as far as can be told: the last time
    it wrote to stderr, if it wrote anything (gloo's abort writes its reason as it dies, before its sockets close
    and its partners' calls fail with reports of their own); else first, if its exit was seen first, or last."""
    try:
        info = os.stat(_RankFiles(workdir, rank).stderr)
        if info.st_size > 0:
            return info.st_mtime
    except OSError:
        pass
    return 0.0 if rank == first_seen else float("inf")


def failure_error(processes, workdir, first_seen):
    """Stop everyone, then describe the rank that failed first (by its own clock)."""
    time.sleep(0.05)  # let a rank that failed at the same moment finish writing its report
    _stop_all(processes)
    failures = []  # (when, rank, record)
    for rank, process in enumerate(processes):
        record = _read_result(workdir, rank)
        if record is not None and record[0] == "error":
            failures.append((record[4], rank, record))
        elif rank == first_seen or (process.exitcode not in (0, None, -signal.SIGKILL)):
            failures.append((_death_time(workdir, rank, first_seen), rank, None))
    failures.sort(key=lambda item: (item[0], item[1]))
    _, rank, record = failures[0]
    world = len(processes)
    same = [r for _, r, rec in failures[1:] if rec is not None and record is not None and rec[1:3] == record[1:3]]
    later = [r for _, r, _ in failures[1:] if r not in same]
    also = ""
    if same:
        also += f"\nRank(s) {sorted(same)} raised the same error."
    if later:
        also += f"\nRank(s) {sorted(later)} failed afterwards, probably as a consequence."
    if record is not None:
        _, exc_type, message, rank_tb, _ = record
        text = (
            f"rank {rank} of {world} raised {exc_type}: {message}\n\n"
            f"--- traceback of rank {rank} ---\n{rank_tb.rstrip()}\n---{also}\nThe other ranks were stopped."
        )
        return RankFailedError(text, rank=rank, exc_type=exc_type, rank_traceback=rank_tb,
                               exitcode=processes[rank].exitcode, stderr_tail=_stderr_tail(workdir, rank))
    exitcode = processes[rank].exitcode
    tail = _stderr_tail(workdir, rank)
    if exitcode is not None and exitcode < 0:
        how = f"was killed by signal {signal.Signals(-exitcode).name}"
        if -exitcode == signal.SIGABRT:
            how += (" (an abort: gloo does this when a message is longer than the receive buffer, "
                    "i.e. the ranks disagree about a tensor's size)")
    else:
        how = f"exited with code {exitcode} without raising a Python exception"
    text = (f"rank {rank} of {world} {how}.\n\n--- last lines rank {rank} wrote to stderr ---\n"
            f"{tail.rstrip() or '(nothing)'}\n---{also}\nThe other ranks were stopped.")
    return RankFailedError(text, rank=rank, exitcode=exitcode, stderr_tail=tail)


def timeout_error(processes, workdir, timeout):
    """Read what every rank is blocked in, stop them, and explain."""
    blocked = {}
    for rank, process in enumerate(processes):
        if process.exitcode is not None:
            blocked[rank] = "finished"
            continue
        what = runtime.read_slot_file(_RankFiles(workdir, rank).status)
        if what == _FINISHED:
            blocked[rank] = "finished: returned from fn and waits for the other ranks"
            continue
        blocked[rank] = f"blocked in {what}" if what else "running Python code, not inside a course_lib send/recv"
        if hasattr(signal, "SIGUSR1"):
            try:
                os.kill(process.pid, signal.SIGUSR1)  # faulthandler dumps its Python stack
            except OSError:
                pass
    time.sleep(0.2)
    stacks = {}
    for rank in blocked:
        if blocked[rank].startswith("finished"):
            continue
        main_thread = _main_thread(_read_stacks(_RankFiles(workdir, rank).stack))
        frame = _user_frames(main_thread)
        stacks[rank] = f"at {frame}" if frame else ""
        if any(f.endswith(" in finish") and f"{os.sep}_work.py" in f for f in main_thread):
            stacks[rank] = "fn has returned; the rank waits for its unfinished async collectives"
            if not blocked[rank].startswith("blocked in"):
                blocked[rank], stacks[rank] = "fn has returned and waits for its unfinished async collectives", ""
        collective = _torch_collective(main_thread)
        if collective and not blocked[rank].startswith("blocked in"):
            blocked[rank] = f"blocked in {collective}, torch's own collective (not a course_lib send/recv)"
    _stop_all(processes)
    lines = [f"the ranks did not finish within {timeout:g} s. What each rank was doing:"]
    for rank, what in blocked.items():
        where = f"   ({stacks[rank]})" if stacks.get(rank) else ""
        lines.append(f"  rank {rank}: {what}{where}")
    lines.append(diagnose(blocked))
    return LaunchTimeoutError("\n".join(lines), blocked=blocked)


def diagnose(blocked: dict) -> str:
    """One sentence on what the ranks' states suggest."""
    finished = {rank for rank, what in blocked.items() if what.startswith("finished")}
    receiving = {rank: what for rank, what in blocked.items()
                 if what.startswith(("blocked in recv", "blocked in irecv.wait"))}
    orphans = [(rank, int(m.group(1))) for rank, what in receiving.items()
               if (m := re.search(r"src=(\d+)", what)) and int(m.group(1)) in finished]
    if orphans:
        rank, src = orphans[0]
        return (f"Rank {rank} waits for a message from rank {src}, which has already returned: a recv with no "
                "matching send. Check that both sides make the same number of calls, with matching peers.")
    in_torch = {rank: m.group(1) for rank, what in blocked.items()
                if (m := re.match(r"blocked in (torch\.distributed\.\w+)", what))}
    if in_torch:
        names = sorted(set(in_torch.values()))
        return (f"Rank(s) {sorted(in_torch)} wait inside {' / '.join(names)}: a torch.distributed collective returns "
                "only when every rank has called it, in the same order, with tensors of the same size and dtype. "
                "torch does not check that, so a rank that called something else, returned early, or passed a tensor "
                "of another size leaves the others waiting. If every rank did call it and the work is only slow, "
                "give launch a longer `timeout=` (seconds).")
    if receiving and len(receiving) == len(blocked) - len(finished):
        return ("Every running rank is waiting to receive, so nobody sends: a deadlock. "
                "Make one side send first, or post the send with isend before the recv.")
    return ("A rank that waits for a message no rank sends will wait forever: check that every recv has a "
            "matching send (same peer, same size), or raise `timeout` if the work is just slow.")


def _read_stacks(stack_path) -> list[list[str]]:
    """Every thread's Python stack from the rank's faulthandler dump: its 'File ...' lines, innermost first."""
    try:
        with open(stack_path, encoding="utf-8", errors="replace") as f:
            lines = [line.strip() for line in f]
    except OSError:
        return []
    stacks: list[list[str]] = []
    for line in lines:
        if line.startswith(("Thread 0x", "Current thread 0x", "Stack (most recent")):
            stacks.append([])
        elif line.startswith("File ") and stacks:
            stacks[-1].append(line)
    return stacks


def _main_thread(stacks: list[list[str]]) -> list[str]:
    """The stack of the thread running the learner's function (not course_lib's async worker)."""
    for frames in stacks:
        if any(frame.endswith(" in _rank_main") for frame in frames):
            return frames
    return stacks[0] if stacks else []


def _inside_torch(frame: str) -> bool:
    return ("site-packages" in frame and f"{os.sep}torch{os.sep}" in frame) or "torch/distributed/" in frame


def _torch_collective(frames: list[str]) -> str:
    """'torch.distributed.all_reduce' when the innermost frames are inside that torch collective, else ''.

    The name is the outermost public function of distributed_c10d.py the rank is in (the one its
    code called: all_gather_object, not the all_gather inside it).
    """
    names = []
    for frame in frames:  # innermost first
        if not _inside_torch(frame):
            break
        if "distributed_c10d.py" in frame:
            name = frame.rsplit(" in ", 1)[-1]
            if not name.startswith("_"):
                names.append(name)
    return f"torch.distributed.{names[-1]}" if names else ""


def _user_frames(frames: list[str]) -> str:
    """The innermost frame of the rank's code that is not inside course_lib, torch or threading."""
    # faulthandler lists the innermost frame first; from the launcher's own _rank_main outwards the
    # frames are the launcher's and, after a fork, the caller's: never the rank's code.
    for frame in frames:
        if frame.endswith(" in _rank_main"):
            break
        if ("site-packages/torch" in frame or os.sep + "course_lib" + os.sep in frame
                or f'"{threading.__file__}"' in frame):  # Work.wait() waits on a threading.Event
            continue
        return frame.replace('File "', "").replace('", line ', ":")
    return ""
