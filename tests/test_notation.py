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
    found = [(where.split(" cell ")[1], text) for where, text, _wrong, _instead in check_notation.pattern_problems([notebook])]
    assert sorted(found) == sorted([("0", "$N$ bytes"), ("0", "a(G)"), ("0", "b(G)"), ("0", "plain binary tree"),
                                    ("1 (code)", "S elements"), ("1 (code)", "P = ceil")])
    assert (ROOT / "docs" / "notation.md").exists()


def test_every_symbol_needs_a_row_for_its_notebook(tmp_path):
    notebook = tmp_path / "05_x.ipynb"
    notebook.write_text(json.dumps({"cells": [
        {"cell_type": "markdown", "source": ["Rank $p$ sends to $q$ on $G$ ranks; $\\omega$ is new."]},
        {"cell_type": "markdown", "source": ["$T = \\alpha_q + \\beta_{q} S$ and $\\text{busbw} = S/T$: labels and words"]},
        {"cell_type": "code", "source": ["x = '$\\omega$'  # code cells are not read for symbols\n"]}]}))
    found = sorted((where.split(" cell ")[1], symbol) for where, symbol, _w, _i in
                   check_notation.table_problems([notebook]) if where.startswith(notebook.name))
    assert found == [("0", "omega"), ("0", "p"), ("0", "q")]    # p, q are 04's; omega has no row; G is everyone's


def test_one_row_per_symbol(tmp_path):
    table = tmp_path / "notation.md"
    table.write_text("| symbol | meaning | where |\n| --- | --- | --- |\n| G | ranks | all |\n"
                     "| x, y | floats | 05 |\n| ξ (xi), x | another x | 08 |\n\n| symbol | unit |\n| --- | --- |\n"
                     "| G | not a symbol table: no 'where' column |\n")
    rows, trouble = check_notation.symbol_table(table)
    assert rows == {"G": "all", "x": {"08"}, "y": {"05"}, "xi": {"08"}}
    assert [symbol for _where, symbol, _w, _i in trouble] == ["x"]
