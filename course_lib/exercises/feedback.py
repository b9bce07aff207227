"""Sentences for what went wrong when a case did not even finish: an exception, a deadlock, an endless
loop, a forbidden call, too much printing, an exercise not written yet.

Everything here reads what the ranks reported about themselves (their error, the call their
tracer says they were blocked in, the line of the learner's code they were at), never the
learner's labels.
"""

from __future__ import annotations

import textwrap

from course_lib.exercises.tracing import describe_line, is_learner_file

__all__ = ["describe_exception", "readable", "explain_errors", "explain_stuck", "explain_forbidden", "NOT_DONE",
           "PRINT_LIMIT", "explain_printing", "ranks_text"]

# More than this many characters printed by one rank in one case fails the case: in a notebook it
# would bury everything else (and usually means a print inside a loop over the elements).
PRINT_LIMIT = 100_000

NOT_DONE = ("not done yet: {function} still raises NotImplementedError. Write it in its cell, run that "
            "cell, then run the check again.")


def ranks_text(ranks, world_size: int | None = None) -> str:
    """'rank 2', 'ranks 0 and 1', 'ranks 0, 1 and 3'; 'every rank' when that is all `world_size` of them."""
    ranks = sorted(ranks)
    if world_size is not None and world_size > 1 and ranks == list(range(world_size)):
        return "every rank"
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def describe_exception(exc: BaseException) -> dict:
    """The parts of an exception a learner needs: type, message, the line of their code it came from."""
    where = ""
    tb = exc.__traceback__
    while tb is not None:  # the innermost frame of the learner's own code wins
        code = tb.tb_frame.f_code
        if is_learner_file(code.co_filename) and code.co_name != "<module>":
            where = describe_line(code, tb.tb_lineno)
        tb = tb.tb_next
    return {"type": type(exc).__name__, "message": readable(str(exc)), "where": where}


LONG = 300      # characters: a message longer than this is wrapped and cut (`readable`)


def readable(text: str, limit: int = 800, width: int = 100, lines: int = 12) -> str:
    """A long message (a 64-rank schedule error is kilobytes on one line) made readable: wrapped at `width`
    characters, cut to `lines` lines and `limit` characters, with what was left out said. Shorter ones are kept
    as they are."""
    text = str(text)
    if len(text) <= LONG and "\n" not in text:
        return text
    out = []
    for line in text.splitlines() or [""]:
        indent = line[:len(line) - len(line.lstrip())]
        out += textwrap.wrap(line, width, subsequent_indent=indent + "  ", break_long_words=True) or [""]
    kept, size = [], 0
    for line in out:
        if len(kept) >= lines or size + len(line) > limit:
            break
        kept.append(line)
        size += len(line) + 1
    if len(kept) < len(out):
        left = len(text) - sum(len(line.strip()) for line in kept)
        kept.append(f"  ... (cut: about {max(left, 0):,} more characters)")
    return "\n".join(kept)


def explain_errors(errors: dict, function: str, world_size: int | None = None) -> str:
    """One paragraph for the ranks that raised: {rank: describe_exception(...)}."""
    by_error: dict = {}
    for rank, error in sorted(errors.items()):
        by_error.setdefault((error["type"], error["message"], error["where"]), []).append(rank)
    parts = []
    for (kind, message, where), ranks in by_error.items():
        who = ranks_text(ranks, world_size)
        text = f"{who} raised {kind}: {message}" if message else f"{who} raised {kind}"
        if where:
            text += f" ({where})"
        parts.append(text)
    return "; ".join(parts) + ". The case stopped there."


def explain_forbidden(what: dict, function: str, world_size: int | None = None) -> str:
    """{rank: 'torch.distributed.all_reduce'} -> why that scores 0."""
    names = sorted(set(what.values()))
    ranks = sorted(what)
    return (f"{function} called {', '.join(names)} ({ranks_text(ranks, world_size)}): the exercise is to write this "
            "yourself from point-to-point messages (torch.distributed send/recv/isend/irecv, or course_lib.p2p). "
            "0 points for this case.")


def explain_printing(printed: dict) -> str | None:
    """{rank: characters printed} -> a sentence when a rank printed more than PRINT_LIMIT."""
    loud = {rank: size for rank, size in printed.items() if size > PRINT_LIMIT}
    if not loud:
        return None
    rank, size = max(loud.items(), key=lambda item: (item[1], -item[0]))
    return (f"{ranks_text(loud)} printed too much: rank {rank} wrote {size:,} characters in this one case "
            f"(the limit is {PRINT_LIMIT:,}). Take the print out of the loop, or print only a summary.")


def _direction(call: str) -> str:
    return "send" if call.startswith(("send", "isend")) else "recv"


def _what(state) -> str:
    call, peer = state["call"], state["peer"]
    if call is None:
        return "running"
    towards = "to" if _direction(call) == "send" else "from"
    who = "any rank" if peer is None else f"rank {peer}"
    name = {"send": "send", "recv": "recv", "isend.wait": "wait() of an isend", "irecv.wait": "wait() of an irecv"}.get(call, call)
    return f"blocked in {name} {towards} {who}"


def _cycle(states) -> list[int] | None:
    """A cycle of ranks each blocked on the next, if there is one."""
    edges = {r: s["peer"] for r, s in states.items() if s["kind"] == "blocked" and s["peer"] is not None}
    for start in sorted(edges):
        path, rank = [], start
        while rank in edges and rank not in path:
            path.append(rank)
            rank = edges[rank]
        if rank in path:
            return path[path.index(rank):]
    return None


def explain_stuck(states: dict, function: str, timeout: float, certain: bool = False) -> str:
    """Why a case did not finish within `timeout` seconds, or (`certain`) why it never could.

    Args:
        states: rank -> {'kind': 'blocked' | 'running' | 'finished' | 'unknown', 'call': 'recv' | 'send' |
            'irecv.wait' | 'isend.wait' | None, 'peer': int | None, 'where': learner line, 'printed': int}.
        function: the learner's function's name.
        certain: the watchdogs found the deadlock (every rank had returned, or was blocked in a send or recv whose
            matching call no rank had made) and stopped the case at once, instead of waiting `timeout` seconds.
    """
    running = sorted(r for r, s in states.items() if s["kind"] == "running")
    finished = {r for r, s in states.items() if s["kind"] == "finished"}
    blocked = {r: s for r, s in states.items() if s["kind"] == "blocked"}
    headline = None
    if running:
        first = states[running[0]]
        where = f", at {first['where']}" if first["where"] else ""
        headline = (f"{ranks_text(running)} {'was' if len(running) == 1 else 'were'} still running {function} after "
                    f"{timeout:g} s{where}: an endless loop? (A loop whose condition never changes, or a while "
                    "loop waiting for something that is not a message.)")
    else:
        orphans = [(r, s) for r, s in sorted(blocked.items()) if s["peer"] in finished]
        cycle = _cycle(blocked)
        if orphans:
            r, s = orphans[0]
            if _direction(s["call"]) == "recv":
                headline = (f"rank {r} was blocked in recv from rank {s['peer']}, but rank {s['peer']} had already "
                            f"returned from {function}: a recv with no matching send. Both sides must make the same "
                            "number of calls, with matching peers.")
            else:
                headline = (f"rank {r} was blocked sending to rank {s['peer']}, but rank {s['peer']} had already "
                            f"returned from {function}: a send that nobody receives.")
        elif cycle and len(cycle) == 2:
            a, b = sorted(cycle)
            kinds = {_direction(blocked[a]["call"]), _direction(blocked[b]["call"])}
            if kinds == {"recv"}:
                headline = (f"ranks {a} and {b} were both blocked in recv from each other: deadlock. One of them has "
                            "to send first (or post the send with isend before the recv).")
            elif kinds == {"send"}:
                headline = (f"ranks {a} and {b} were both blocked in send to each other: deadlock. A blocking send "
                            "waits until the other side receives: let one of them receive first, or use isend.")
            elif certain:        # (after a timeout the transfer might only have been slow)
                sender = a if _direction(blocked[a]["call"]) == "send" else b
                headline = (f"rank {sender} was sending to rank {a + b - sender} while rank {a + b - sender} was "
                            f"receiving from rank {sender}, but the two calls do not match: a different tag, or one "
                            "side made more calls to the other than the other made back.")
        elif cycle:
            order = " -> ".join(f"rank {r}" for r in cycle + cycle[:1])
            if all(_direction(blocked[r]["call"]) == "recv" for r in cycle):
                headline = (f"every rank in the cycle {order} was blocked in recv from the next one: deadlock, "
                            "nobody sends. Post the send first (isend), or let even and odd ranks take turns.")
            else:
                headline = (f"the ranks {order} each waited for the next one: deadlock. A blocking send waits "
                            "until its receiver receives; post sends with isend, or order the calls so someone "
                            "receives first.")
    if headline is None and certain:
        headline = ("deadlock: every rank had returned, or was blocked in a send or recv that no rank would ever "
                    "match. Check that every send has a matching recv (same peer, same tag, in the same order) and "
                    "vice versa.")
    if headline is None:
        headline = (f"the case did not finish within {timeout:g} s: a rank waited for a message that never came. "
                    "Check that every send has a matching recv (same peer, same size) and vice versa.")
    if certain:
        headline += " (Found at once: no rank could ever move again.)"
    lines = [headline, "What each rank was doing:"]
    for rank in sorted(states):
        state = states[rank]
        if state["kind"] == "finished":
            text = f"had returned from {function}"
        elif state["kind"] == "unknown":
            text = "no report"
        else:
            text = _what(state) + (f", at {state['where']}" if state["where"] else "")
        lines.append(f"  rank {rank}: {text}")
    return "\n".join(lines)
