"""Every assert of a notebook with the values it compared in a run, and the ones that cannot fail.

    python tools/assert_margins.py notebooks/06_ring_cost.ipynb          # run it, print the margin table
    python tools/assert_margins.py --static notebooks/*.ipynb             # only the checks that need no run
    python tools/assert_margins.py notebooks/10_measure_it.ipynb --markdown margins.md

The run: a copy of the notebook is executed in a fresh kernel with every `assert` in a code cell rewritten to
first record the values it compares (each side of a comparison, each part of an `and`), then assert as
before. The table lists, per assert, the cell, its source, the values, and the margin: how far the compared
quantity was from making the assert fail, relative to the bound (`x <= 1.05` with x = 1.00 has a margin of
4.8%; an equality is marked exact). An assert that never ran in the run (a branch not taken at this WORLD_SIZE) is listed
as such. Printing the margin table of every notebook is how a reviewer sees which asserts hold with room
and which barely hold.

The static checks (also run by tests/test_notebook_asserts.py, on every notebook):

* constant: an assert whose test reads no name at all (`assert 2 * 1023 / 1024 < 2`): it cannot fail;
* self-comparison: both sides of a comparison are the same expression;
* printed after its own assert: a cell prints (in a call or an f-string) an expression it has just asserted
  true, so the printed value can only read True.
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent

_RECORDER = '''
import json as _am_json, math as _am_math
_AM_PATH = {path!r}
def _am_value(v):
    try:
        import torch as _t
        if isinstance(v, _t.Tensor) and v.numel() == 1:
            v = v.item()
    except Exception:
        pass
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, (int, float)):
        return v if _am_math.isfinite(v) else str(v)
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."
def _am_record(cell, line, parts):
    with open(_AM_PATH, "a") as f:
        f.write(_am_json.dumps({{"cell": cell, "line": line, "parts": [[op, _am_value(a), _am_value(b)]
                                                                       for op, a, b in parts]}}) + "\\n")
'''


# --------------------------------------------------------------------------------------------------
# Finding asserts
# --------------------------------------------------------------------------------------------------


def _parse(source: str):
    """The cell's AST, or None for a cell Python cannot parse (IPython magics, shell lines)."""
    lines = [line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))]
    try:
        return ast.parse("\n".join(lines))
    except SyntaxError:
        return None


def _reads_a_name(node) -> bool:
    return any(isinstance(n, (ast.Name, ast.Attribute, ast.Call, ast.Subscript)) for n in ast.walk(node))


def static_problems(notebook: dict) -> list:
    """(cell index, line, kind, source) of asserts that cannot fail, over every code cell."""
    problems = []
    for index, cell in enumerate(notebook["cells"]):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        tree = _parse(source)
        if tree is None:
            continue
        asserted = []
        for node in ast.walk(tree):
            if not isinstance(node, ast.Assert):
                continue
            text = ast.get_source_segment("\n".join(l for l in source.splitlines()
                                                    if not l.lstrip().startswith(("%", "!"))), node) or ""
            if not _reads_a_name(node.test):
                problems.append((index, node.lineno, "constant", text))
            for compare in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
                sides = [compare.left] + compare.comparators
                if any(ast.dump(a) == ast.dump(b) for a, b in zip(sides, sides[1:])):
                    problems.append((index, node.lineno, "self-comparison", text))
            parts = node.test.values if isinstance(node.test, ast.BoolOp) and isinstance(node.test.op, ast.And) else []
            for part in [node.test, *parts]:
                asserted.append((node.lineno, ast.dump(part)))
        for node in ast.walk(tree):
            if isinstance(node, ast.FormattedValue) or (isinstance(node, ast.Call) and
                                                      getattr(node.func, "id", "") == "print"):
                shown = [node.value] if isinstance(node, ast.FormattedValue) else node.args
                for value in shown:
                    if any(ast.dump(value) == dump and getattr(value, "lineno", 0) > line for line, dump in asserted):
                        problems.append((index, value.lineno, "printed after its own assert", ast.unparse(value)))
    return problems


class _Instrument(ast.NodeTransformer):
    """assert T, msg  ->  _am_record(cell, line, [(op, left, right), ...]); assert T, msg (values computed once)."""

    def __init__(self, cell: int):
        self.cell = cell

    def visit_Assert(self, node):
        parts = []
        names = []
        tests = node.test.values if isinstance(node.test, ast.BoolOp) and isinstance(node.test.op, ast.And) \
            else [node.test]
        for test in tests:
            if isinstance(test, ast.Compare):
                sides = [test.left] + test.comparators
                for op, a, b in zip(test.ops, sides, sides[1:]):
                    parts.append(ast.Tuple([ast.Constant(type(op).__name__), a, b], ast.Load()))
            else:
                parts.append(ast.Tuple([ast.Constant("truth"), test, ast.Constant(None)], ast.Load()))
        record = ast.Expr(ast.Call(ast.Name("_am_record", ast.Load()),
                                   [ast.Constant(self.cell), ast.Constant(node.lineno), ast.List(parts, ast.Load())],
                                   []))
        guarded = ast.Try(body=[record], handlers=[ast.ExceptHandler(ast.Name("Exception", ast.Load()), None,
                                                                      [ast.Pass()])], orelse=[], finalbody=[])
        del names
        return [guarded, node]


def instrumented(notebook: dict, path: str) -> dict:
    """A copy of the notebook whose asserts record their values to `path` (JSON lines)."""
    copy = json.loads(json.dumps(notebook))
    cells = copy["cells"]
    for cell in cells:
        if isinstance(cell.get("source"), list):
            cell["source"] = "".join(cell["source"])
    first_code = next(i for i, c in enumerate(cells) if c["cell_type"] == "code")
    for index, cell in enumerate(cells):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        tree = _parse(source)
        if tree is None or not any(isinstance(n, ast.Assert) for n in ast.walk(tree)):
            continue
        if any(line.lstrip().startswith(("%", "!")) for line in source.splitlines()):
            continue
        tree = ast.fix_missing_locations(_Instrument(index).visit(tree))
        cell["source"] = ast.unparse(tree)
    cells[first_code]["source"] = _RECORDER.format(path=path) + "\n" + "".join(cells[first_code]["source"])
    return copy


def collect(notebook: dict) -> list:
    """(cell, line, source) of every assert in the notebook's code cells, in order."""
    out = []
    for index, cell in enumerate(notebook["cells"]):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        tree = _parse(source)
        if tree is None:
            continue
        clean = "\n".join(l for l in source.splitlines() if not l.lstrip().startswith(("%", "!")))
        for node in ast.walk(tree):
            if isinstance(node, ast.Assert):
                text = ast.get_source_segment(clean, node.test) or ""
                out.append((index, node.lineno, " ".join(text.split())))
    return sorted(out)


# --------------------------------------------------------------------------------------------------
# Margins
# --------------------------------------------------------------------------------------------------


def margin(op: str, left, right):
    """How far the comparison was from failing, relative to the bound; None when it has no size."""
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (left, right)):
        return None
    scale = max(abs(left), abs(right)) or 1.0
    if op in ("Lt", "LtE"):
        return (right - left) / scale
    if op in ("Gt", "GtE"):
        return (left - right) / scale
    return None


def run(path: pathlib.Path, timeout: int = 600) -> list:
    """Execute an instrumented copy; return one row per assert: (cell, line, source, [records])."""
    import nbformat
    from nbclient import NotebookClient

    notebook = json.loads(path.read_text())
    with tempfile.TemporaryDirectory() as folder:
        log = pathlib.Path(folder) / "asserts.jsonl"
        copy = nbformat.from_dict(instrumented(notebook, str(log)))
        NotebookClient(copy, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(path.parent)}}).execute()
        records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    rows = []
    for cell, line, source in collect(notebook):
        mine = [r["parts"] for r in records if r["cell"] == cell and r["line"] == line]
        rows.append((cell, line, source, mine))
    return rows


def _format(value) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def table(rows) -> str:
    lines = ["| cell | assert | values (last run) | least margin | runs |", "| --- | --- | --- | --- | --- |"]
    for cell, _line, source, records in rows:
        if not records:
            lines.append(f"| {cell} | `{source[:90]}` | never ran | - | 0 |")
            continue
        last = records[-1]
        shown = "; ".join(f"{_format(a)} {op} {_format(b)}" if op != "truth" else f"{_format(a)}"
                          for op, a, b in last)
        margins = [m for parts in records for op, a, b in parts if (m := margin(op, a, b)) is not None]
        exact = all(op == "Eq" for parts in records for op, _a, _b in parts)
        least = f"{100 * min(margins):.3g}%" if margins else ("exact (==)" if exact else "-")
        lines.append(f"| {cell} | `{source[:90]}` | {shown[:120]} | {least} | {len(records)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="+")
    parser.add_argument("--static", action="store_true", help="only the checks that need no run")
    parser.add_argument("--markdown", default=None, help="also write the tables to this file")
    args = parser.parse_args(argv)
    out, failed = [], False
    for name in args.notebooks:
        path = pathlib.Path(name)
        notebook = json.loads(path.read_text())
        problems = static_problems(notebook)
        out.append(f"## {path.name}\n")
        for cell, line, kind, source in problems:
            out.append(f"- cell {cell}, line {line}: {kind}: `{source}`")
            failed = True
        if not args.static:
            out.append("")
            out.append(table(run(path)))
        out.append("")
    text = "\n".join(out)
    print(text)
    if args.markdown:
        pathlib.Path(args.markdown).write_text(text + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
