"""What may cross from the learner's processes to the judge: data, checked, never code.

The grader runs a submission's cells and the learner's functions in processes of their own; what those
processes send back travels as JSON, in which a tensor is ``{"__tensor__": [dtype, shape, base64]}`` and a
tuple ``{"__tuple__": [...]}``. Decoding builds plain Python values and fresh CPU tensors and nothing else:
unlike pickle it can construct no object whose methods the judge would later call, and it runs none of
the sender's code. Sizes are capped, so a flood of data is refused instead of filling the judge's memory.

Decoded records are then *cleaned* (`clean_record`): only the fields an exercise reads survive, each of the
type the judge expects (a status from a fixed set, messages as `tracing.Message`, the exercise's
`observed` values as numbers, strings, tensors and lists of them). A record that does not fit is treated
as a rank that sent no report: the case fails and says so.

What a clean record *says* is still only what the learner's processes claim; the exercises compare it with
the judge's own oracle and check that it hangs together (every result made of what the rank received).
"""

from __future__ import annotations

import base64
import json

import torch

from course_lib.exercises.tracing import P2P_CALLS, Message

__all__ = ["encode", "decode", "clean_record", "clean_value", "message_to_dict", "WireError", "MAX_BYTES"]

MAX_BYTES = 64 * 2**20          # one reply from a submission's process
MAX_TENSOR_ELEMENTS = 2**22     # one tensor
MAX_ITEMS = 10_000              # one list
MAX_TEXT = 4000                 # one string kept from a record
MAX_MESSAGES = 4096             # one rank's trace in one case
# Parsed JSON costs far more memory than its text: 30 MB of "{}," is 10 million dicts, 1.4 GB. Counted before
# parsing (every bracket and comma, those inside strings too, so the counts are upper bounds): the largest
# reply a complete grading sends has about 10,000 objects and lists and 22,000 items.
MAX_CONTAINERS = 200_000        # objects and lists in one reply
MAX_ELEMENTS = 1_000_000        # items (commas) in one reply
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "int64": torch.int64,
           "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_STATUSES = ("ok", "forbidden", "not_done", "error", "stuck")
_STUCK_CALLS = P2P_CALLS + ("isend.wait", "irecv.wait")


class WireError(ValueError):
    """Data from a submission's process that is not what the protocol allows."""


# --------------------------------------------------------------------------------------------------
# Encoding (in the sender) and decoding (in the judge)
# --------------------------------------------------------------------------------------------------


def _to_json(value, depth=0):
    if depth > 12:
        raise WireError("nested too deeply")
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else {"__float__": repr(value)}
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        if tensor.dtype not in _NAMES:
            tensor = tensor.double()
        return {"__tensor__": [_NAMES[tensor.dtype], list(tensor.shape),
                               base64.b64encode(tensor.numpy().tobytes()).decode("ascii")]}
    if isinstance(value, tuple):
        return {"__tuple__": [_to_json(v, depth + 1) for v in value]}
    if isinstance(value, list):
        return [_to_json(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return {str(k): _to_json(v, depth + 1) for k, v in value.items()}
    if isinstance(value, Message):
        return _to_json(message_to_dict(value), depth + 1)
    raise WireError(f"cannot send a {type(value).__name__}")


def encode(value) -> bytes:
    """`value` (None, bool, int, float, str, tensors, and lists, tuples, dicts of them) as bytes for `decode`."""
    return json.dumps(_to_json(value), separators=(",", ":")).encode()


def _tensor(spec) -> torch.Tensor:
    if not (isinstance(spec, list) and len(spec) == 3 and spec[0] in _DTYPES and isinstance(spec[1], list)
            and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d for d in spec[1])
            and isinstance(spec[2], str)):
        raise WireError("a malformed tensor")
    dtype, shape = _DTYPES[spec[0]], spec[1]
    count = 1
    for d in shape:
        count *= d
    if count > MAX_TENSOR_ELEMENTS or len(shape) > 8:
        raise WireError(f"a tensor of {count} elements is more than the check ever sends")
    raw = base64.b64decode(spec[2].encode("ascii"), validate=True)
    if len(raw) != count * torch.tensor([], dtype=dtype).element_size():
        raise WireError("a tensor whose data does not match its shape")
    if count == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape).clone()


def _from_json(value):
    if isinstance(value, dict):
        if set(value) == {"__tensor__"}:
            return _tensor(value["__tensor__"])
        if set(value) == {"__tuple__"} and isinstance(value["__tuple__"], list):
            return tuple(_from_json(v) for v in value["__tuple__"])
        if set(value) == {"__float__"} and value["__float__"] in ("nan", "inf", "-inf"):
            return float(value["__float__"])
        return {k: _from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        if len(value) > MAX_ITEMS * 10:
            raise WireError("a list longer than the check ever sends")
        return [_from_json(v) for v in value]
    return value


def decode(data: bytes):
    """The value `encode` made, rebuilt from plain JSON: no code runs, no object but data is built.

    Raises:
        WireError: more than MAX_BYTES, MAX_CONTAINERS or MAX_ELEMENTS, not JSON, or a tensor that does not fit
            its description.
    """
    if len(data) > MAX_BYTES:
        raise WireError(f"{len(data):,} bytes is more than the {MAX_BYTES:,} a reply may have")
    containers, elements = data.count(b"{") + data.count(b"["), data.count(b",")
    if containers > MAX_CONTAINERS or elements > MAX_ELEMENTS:
        raise WireError(f"{containers:,} objects and lists, {elements:,} items: more than a reply of the check has "
                        f"({MAX_CONTAINERS:,} and {MAX_ELEMENTS:,} at most)")
    try:
        parsed = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise WireError(f"not JSON: {exc}") from None
    try:
        return _from_json(parsed)
    except RecursionError:
        raise WireError("nested too deeply") from None
    except (ValueError, TypeError) as exc:
        raise WireError(str(exc)) from None


# --------------------------------------------------------------------------------------------------
# Cleaning a rank's record
# --------------------------------------------------------------------------------------------------


def message_to_dict(message: Message) -> dict:
    return {"op": message.op, "peer": message.peer, "numel": message.numel, "data": message.data, "tag": message.tag}


def _int(value, allow_none=False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or abs(value) > 2**62:
        raise WireError(f"expected a whole number, got {type(value).__name__}")
    return value


def _text(value, allow_none=False):
    if value is None and allow_none:
        return None
    if not isinstance(value, str):
        raise WireError(f"expected text, got {type(value).__name__}")
    return value[:MAX_TEXT]


def _clean_message(raw) -> Message:
    if isinstance(raw, Message):
        raw = message_to_dict(raw)
    if not isinstance(raw, dict) or raw.get("op") not in P2P_CALLS:
        raise WireError("a message that is no send or receive")
    data = raw.get("data")
    if data is not None and not isinstance(data, torch.Tensor):
        raise WireError("a message whose data is no tensor")
    if data is not None:
        data = data.detach().cpu().reshape(-1).clone()
    numel = _int(raw.get("numel"))
    if numel < 0:
        raise WireError("a message with fewer than no elements")
    return Message(raw["op"], _int(raw.get("peer"), allow_none=True), numel, data, _int(raw.get("tag", 0)))


def clean_value(value, depth: int = 0):
    """What a learner's function produced, kept only as numbers, text, CPU tensors and lists/tuples of them."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str):
        return value[:MAX_TEXT]
    if isinstance(value, torch.Tensor):
        if value.numel() > MAX_TENSOR_ELEMENTS:
            raise WireError("a tensor larger than any the check makes")
        return value.detach().cpu().clone()
    if isinstance(value, (list, tuple)) and depth < 3:
        if len(value) > MAX_ITEMS:
            raise WireError("a list longer than any the check makes")
        return type(value)(clean_value(v, depth + 1) for v in value)
    raise WireError(f"a value of type {type(value).__name__}")


def clean_record(raw, observed=()) -> dict | None:
    """Rank record `raw` (decoded data, or the dict a rank wrote) reduced to what the judge reads, or None
    when it does not fit (the judge then treats the rank as one that sent no report).

    Args:
        observed: the exercise's `observed` keys, kept from records whose status is 'ok'.
    """
    try:
        if not isinstance(raw, dict) or raw.get("status") not in _STATUSES:
            return None
        status = raw["status"]
        messages = raw.get("messages", [])
        if not isinstance(messages, (list, tuple)) or len(messages) > MAX_MESSAGES:
            return None
        printed = raw.get("printed", (0, ""))
        if not isinstance(printed, (list, tuple)) or len(printed) != 2:
            return None
        record = {"status": status, "messages": [_clean_message(m) for m in messages],
                  "printed": (_int(printed[0]), _text(printed[1]))}
        if status == "ok":
            for key in observed:
                record[key] = clean_value(raw.get(key))
        elif status == "forbidden":
            record["what"] = _text(raw.get("what"))
        elif status == "not_done":
            record["function"] = _text(raw.get("function", ""))
        elif status == "error":
            record.update(type=_text(raw.get("type")), message=_text(raw.get("message", "")),
                          where=_text(raw.get("where", "")))
        else:  # stuck
            call = raw.get("call")
            if call is not None and call not in _STUCK_CALLS:
                return None
            record.update(in_learner=bool(raw.get("in_learner")), deadlock=raw.get("deadlock") is True, call=call,
                          peer=_int(raw.get("peer"), allow_none=True), where=_text(raw.get("where", "")))
        return record
    except (WireError, TypeError, ValueError, AttributeError, RuntimeError):
        return None
