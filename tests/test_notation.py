"""One notation for the course (docs/notation.md, issue 27): no notebook, README sentence or docstring of the model's
modules uses a symbol against the table where a pattern can tell (tools/check_notation.py)."""

from __future__ import annotations

import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("check_notation", ROOT / "tools" / "check_notation.py")
check_notation = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_notation)


def test_no_symbol_is_used_against_the_notation_table():
    found = check_notation.problems()
    assert not found, "\n".join(f"{where}: '{text}': {wrong}; write {instead}" for where, text, wrong, instead in found)


def test_the_rules_catch_what_they_are_for(tmp_path):
    notebook = tmp_path / "x.ipynb"
    notebook.write_text(json.dumps({"cells": [
        {"cell_type": "markdown", "source": ["A message of $N$ bytes; time = a(G) alpha + b(G) n beta; a plain binary tree."]},
        {"cell_type": "code", "source": ["print('S elements per rank')  # P = ceil(N / G)\n"]},
        {"cell_type": "markdown", "source": ["N elements, S bytes, steps(G) alpha, a binomial tree: all fine."]}]}))
    found = [(where.split(" cell ")[1], text) for where, text, _wrong, _instead in check_notation.problems([notebook])]
    assert sorted(found) == sorted([("0", "$N$ bytes"), ("0", "a(G)"), ("0", "b(G)"), ("0", "plain binary tree"),
                                    ("1 (code)", "S elements"), ("1 (code)", "P = ceil")])
    assert (ROOT / "docs" / "notation.md").exists()
