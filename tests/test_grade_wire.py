"""What may cross from a submission's processes to the judge: data only, checked and capped (exercises/wire.py)."""

from __future__ import annotations

import pickle

import pytest
import torch

from course_lib.exercises import wire
from course_lib.exercises.tracing import Message


def test_data_makes_the_round_trip():
    value = {"status": "ok", "after": torch.arange(5.0), "returned": (1, 2.5, "x", None, True),
             "messages": [Message("send", 1, 3, torch.ones(3)), Message("recv", 0, 3)], "nan": float("nan")}
    back = wire.decode(wire.encode(value))
    assert torch.equal(back["after"], value["after"]) and back["returned"] == value["returned"]
    assert back["messages"][0] == {"op": "send", "peer": 1, "numel": 3, "data": back["messages"][0]["data"], "tag": 0}
    assert torch.equal(back["messages"][0]["data"], torch.ones(3)) and back["nan"] != back["nan"]


@pytest.mark.parametrize("data", [
    pickle.dumps(Message("send", 1, 3)),                               # a pickle is not data to the judge
    b'{"__tensor__": ["float32", [1000000000], ""]}',                  # a tensor larger than any the check makes
    b'{"__tensor__": ["float32", [4], "AAAA"]}',                       # data that does not fit its shape
    b'{"__tensor__": ["object", [1], "AAAA"]}',                        # a dtype the wire does not know
    b"[" * 100_000 + b"]" * 100_000,                                   # nested beyond reason
])
def test_anything_but_data_is_refused(data):
    with pytest.raises(wire.WireError):
        wire.decode(data)


def test_a_reply_larger_than_the_limit_is_refused_before_it_is_parsed():
    with pytest.raises(wire.WireError, match="more than"):
        wire.decode(b" " * (wire.MAX_BYTES + 1))


def test_a_record_keeps_only_what_the_judge_reads():
    raw = {"status": "ok", "after": torch.ones(2), "returned": 1, "expected": torch.zeros(2), "score": 10,
           "messages": [{"op": "send", "peer": 1, "numel": 2, "data": torch.ones(2), "tag": 0}], "printed": [0, ""]}
    record = wire.clean_record(raw, observed=("after", "returned"))
    assert set(record) == {"status", "messages", "printed", "after", "returned"}     # no 'expected', no 'score'
    assert isinstance(record["messages"][0], Message) and record["messages"][0].peer == 1
    for broken in ({**raw, "status": "passed"}, {**raw, "messages": [{"op": "all_reduce"}]},
                   {**raw, "messages": [{"op": "send", "peer": "1", "numel": 2}]}, {**raw, "printed": "x"},
                   {**raw, "after": object()}, "ok"):
        assert wire.clean_record(broken, observed=("after", "returned")) is None


def test_grading_needs_nothing_the_course_install_lacks():
    """course_grader and course_lib.exercises import only the standard library and requirements/base.txt's packages."""
    import ast
    import pathlib
    import sys

    root = pathlib.Path(__file__).resolve().parent.parent
    provided = {"torch", "numpy", "cloudpickle", "matplotlib", "ipywidgets", "IPython", "course_lib",  # base.txt
                "tomli"}   # optional: Python 3.10 reads TOML rubric files with it if installed, else says to use JSON
    base = (root / "requirements" / "base.txt").read_text()
    assert all(name in base for name in ("torch==", "numpy==", "cloudpickle==", "ipykernel==", "matplotlib=="))
    for folder in ("grade", "exercises"):
        for path in (root / "course_lib" / folder).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
                for name in names:
                    top = name.split(".")[0]
                    assert top in sys.stdlib_module_names or top in provided, f"{path.name} imports {name}"
