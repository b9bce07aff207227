"""Every assert in the notebooks can fail (issue 27): none is constant arithmetic, none compares an expression with
itself, and no cell prints, right after asserting it, a value that can then only read True.

`tools/assert_margins.py` finds them (and, run on a notebook, prints every assert with the values it compared and
its margin, for a reviewer).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("assert_margins", ROOT / "tools" / "assert_margins.py")
assert_margins = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(assert_margins)

NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_assert_that_cannot_fail(path):
    problems = assert_margins.static_problems(json.loads(path.read_text()))
    assert not problems, "\n".join(f"cell {cell}, line {line}: {kind}: {source}" for cell, line, kind, source in problems)


def test_the_checks_find_what_they_are_for():
    notebook = {"cells": [{"cell_type": "code", "source": [
        "gap = abs(x - y)\n",
        "assert 2 * 1023 / 1024 < 2\n",
        "assert gap == gap\n",
        "assert gap < 1e-5 and ok\n",
        "print(f'equal: {gap < 1e-5}')\n",
        "assert gap < 2e-5\n",
        "print('gap', gap)\n"]}]}
    kinds = sorted(kind for _cell, _line, kind, _source in assert_margins.static_problems(notebook))
    assert kinds == ["constant", "printed after its own assert", "self-comparison"]
    assert assert_margins.margin("LtE", 1.0, 1.05) == pytest.approx(0.05 / 1.05)
    assert assert_margins.margin("Gt", 3.0, 2.0) == pytest.approx(1 / 3)
    assert assert_margins.margin("Eq", 1.0, 1.0) is None
