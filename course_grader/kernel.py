"""The sandbox's side of grading: run a submission's cells and its learner's functions, answer with data.

    python -m course_grader.kernel --in FD --out FD

The warden (`_warden.py`) starts this as the unprivileged sandbox user when the judge runs as root, always in
a session of its own. It runs an IPython shell (the same cell semantics as a Jupyter kernel: magics,
``display``, ``_``), minus what grading does not read: displays compute only text, never pictures.

Then it answers the judge's requests, one frame each way (`channel`):

    {"op": "cell", "source": ...}                 run one cell -> {"status": "ok"} or {"status": "error", "error": text}
    {"op": "value", "name": ..., "formula": bool, "grid": [[G, N], ...]}
                                                  a question's answer -> its value as data, or for a formula
                                                  given as a function, its values at every (G, N) of the grid
    {"op": "run", "exercise": ..., "answer": ..., "world_size": G, "cases": [...], "inputs": [...],
     "first": k, "case_timeout": s}               one batch of cases on the learner's function, on ranks forked
                                                  from here (`runner.run_batch`) -> every rank's record

After the first cell has run, everything in this process belongs to the submission: it may have replaced any
object here, this module and course_lib included, and may write anything to the judge's pipe. That is why
the judge trusts none of it: it decodes each reply as data (`wire`), computes the cases, inputs, oracle and
points itself, and checks that what the ranks report hangs together.
"""

from __future__ import annotations

import io
import os
import signal
import sys

__all__ = ["main"]

_MISSING = object()
_OUTPUT_LIMIT = 200_000


class _Sink(io.TextIOBase):
    """Where the submission's printing goes: the first characters are kept for nobody, the rest dropped."""

    def __init__(self):
        self.size = 0

    def write(self, text) -> int:
        self.size += len(text)
        return len(text)

    def writable(self) -> bool:
        return True


def _shell():
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance(colors="NoColor")
    # Grading reads no pictures: displays and results compute their text form only, and %matplotlib inline
    # registers no hook that would render every figure after every cell.
    shell.display_formatter.active_types = ["text/plain"]
    shell.enable_matplotlib = lambda gui=None: (gui, "agg")
    return shell


def _run_cell(shell, source: str) -> dict:
    result = shell.run_cell(source, store_history=True)
    error = result.error_before_exec or result.error_in_exec
    if error is None:
        return {"status": "ok"}
    return {"status": "error", "error": f"{type(error).__name__}: {error}"[:300]}


def _number(value):
    """A value a formula returned, as exact data: int, float, [numerator, denominator], None (not a finite number),
    or {'other': type name}."""
    from fractions import Fraction

    if isinstance(value, bool):
        return {"other": "bool"}
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, Fraction):
        return {"fraction": [value.numerator, value.denominator]}
    if hasattr(value, "item"):
        try:
            return _number(value.item())
        except Exception:  # noqa: BLE001
            pass
    return {"other": type(value).__name__}


def _plain(value, depth=0):
    """A question's answer as data: text, numbers, sequences of them; anything else by its type name and repr."""
    from fractions import Fraction

    if value is None or isinstance(value, (bool, str, int, float)):
        return value if not isinstance(value, str) else value[:10_000]
    if value is Ellipsis:
        return {"ellipsis": True}
    if isinstance(value, Fraction):
        return {"fraction": [value.numerator, value.denominator]}
    if isinstance(value, (list, tuple)) and depth < 2 and len(value) <= 100:
        return {"sequence": [_plain(v, depth + 1) for v in value]}
    item = getattr(value, "item", None)       # a 0-d tensor, a numpy scalar
    if callable(item):
        try:
            return _plain(item(), depth)
        except Exception:  # noqa: BLE001 - more than one element: not a number
            pass
    return {"other": type(value).__name__, "repr": repr(value)[:300]}


def _value(namespace, request) -> dict:
    answer = namespace.get(request["name"], _MISSING)
    if answer is _MISSING:
        return {"kind": "missing"}
    try:
        if request.get("formula") and callable(answer) and not isinstance(answer, str):
            values = []
            for G, N in request["grid"]:
                try:
                    values.append(_number(answer(G, N)))
                except NotImplementedError:
                    return {"kind": "not_done"}
                except ZeroDivisionError:
                    values.append(None)
                except Exception as exc:  # noqa: BLE001 - the learner's function
                    values.append({"error": [type(exc).__name__, str(exc)[:300]]})
            return {"kind": "table", "values": values}
        if callable(answer) and not request.get("formula"):
            answer = answer()
        return {"kind": "value", "value": _plain(answer)}
    except NotImplementedError:
        return {"kind": "not_done"}
    except Exception as exc:  # noqa: BLE001
        return {"kind": "error", "error": f"{type(exc).__name__}: {exc}"[:300]}


def _run(namespace, request) -> dict:
    from course_lib.exercises import runner
    from course_lib.exercises.registry import Case

    fn = namespace.get(request["answer"], _MISSING)
    if fn is _MISSING:
        return {"kind": "missing"}
    if fn is None or fn is Ellipsis:
        return {"kind": "not_done"}
    if not callable(fn):
        return {"kind": "not_callable", "type": type(fn).__name__}
    cases = [Case(**case) for case in request["cases"]]
    batch = runner.run_batch(request["exercise"], fn, request["world_size"], cases, request["inputs"],
                             request["first"], request["case_timeout"])
    return {"kind": "batch", "records": {str(k): v for k, v in batch.records.items()},
            "stuck": {str(k): v for k, v in batch.stuck.items()}, "launch_error": batch.launch_error}


def _answer(shell, request) -> dict:
    op = request.get("op") if isinstance(request, dict) else None
    if op == "cell":
        return _run_cell(shell, request["source"])
    if op == "value":
        return _value(shell.user_ns, request)
    if op == "run":
        return _run(shell.user_ns, request)
    return {"kind": "error", "error": f"unknown request {op!r}"}


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m course_grader.kernel")
    parser.add_argument("--in", dest="fd_in", type=int, required=True)
    parser.add_argument("--out", dest="fd_out", type=int, required=True)
    args = parser.parse_args(argv)
    os.makedirs(os.environ.get("TMPDIR", "/tmp"), exist_ok=True)
    from course_grader import channel

    from course_lib.exercises import registry, wire

    # Every exercise module imported once, here: the ranks are forked from this process, and a module each
    # rank imported for itself would cost every rank of every launch its import time again.
    registry.all_exercises()
    shell = _shell()
    sys.stdout = sys.stderr = _Sink()
    channel.send(args.fd_out, {"ready": True})
    while True:
        try:
            request = channel.receive(args.fd_in, limit=wire.MAX_BYTES)      # the judge's own requests
        except channel.ChannelClosed:
            return 0
        except KeyboardInterrupt:        # an interrupt meant for a cell that had already finished
            continue
        try:
            reply = _answer(shell, request)
        except KeyboardInterrupt:
            reply = {"status": "error", "error": "KeyboardInterrupt"}
        except Exception as exc:  # noqa: BLE001 - a request the submission's changes broke
            reply = {"kind": "error", "error": f"{type(exc).__name__}: {exc}"[:300]}
        try:
            channel.send(args.fd_out, reply)
        except Exception as exc:  # noqa: BLE001 - e.g. a record holding something that is not data
            channel.send(args.fd_out, {"kind": "error", "error": f"the reply could not be sent: {exc}"[:300]})


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(main())
