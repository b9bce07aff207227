"""Find symbols used with a meaning other than docs/notation.md's, where a pattern can tell (issue 27).

    python tools/check_notation.py                  # every notebook, README.md and the model's modules
    python tools/check_notation.py notebooks/10_measure_it.ipynb

Each rule is a pattern that only a sentence using a symbol against the table can match, with what to
write instead. It reads markdown cells and the comments and strings of code cells (where formulas are
printed), the README, and the docstrings of course_lib's network, cost, simulation and schedules
modules. It cannot tell every misuse (a P that means something else in a sentence of its own); what it
checks it checks everywhere. tests/test_notation.py runs it.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

# (pattern, what is wrong, what to write). Patterns are matched case-sensitively on text with LaTeX dollar
# signs and backslash-commands' braces left in, so `$N$ bytes` and `N bytes` both match.
RULES = [
    (r"\$?\bN\$?\s+bytes\b", "N is a number of elements", "S bytes (S = N x bytes per element)"),
    (r"\bN\s*=\s*(the\s+)?bytes\b", "N is a number of elements", "S = bytes"),
    (r"\$?\bS\$?\s+elements\b", "S is a number of bytes", "N elements"),
    (r"(?<![\w.])[abc]\(G\)", "a(G), b(G), c(G) were the step-count model's counts; a is a latency",
     "steps(G), traffic(G), reduction(G)"),
    (r"\bplain binary tree\b", "the course's tree is binomial", "binomial tree"),
    (r"\bP\s*=\s*(ceil|⌈|\\lceil)", "P is the largest power of two <= G", "ceil(N/G) written out"),
    (r"\bP\s*=\s*M\s*Q\b|\bP\s*=\s*MQ\b", "P is the largest power of two <= G", "name PowerSGD's factors without P"),
    (r"\bmatrix rank r\b|\brank[- ]r approximation\b", "r is a rank's index", "rho (PowerSGD's approximation rank)"),
    (r"\bthe master(?= all-reduce| algorithm| variant)", "the algorithm is the parameter server",
     "the parameter server (the seeds' master is the rank it runs on)"),
]


def _notebook_text(path: pathlib.Path) -> list:
    """(where, text) of every markdown cell and every code cell's comments and string literals."""
    cells = json.loads(path.read_text())["cells"]
    out = []
    for index, cell in enumerate(cells):
        source = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            out.append((f"{path.name} cell {index}", source))
        elif cell["cell_type"] == "code":
            comments = [line.split("#", 1)[1] for line in source.splitlines() if "#" in line]
            strings = re.findall(r"(?:f|r|fr|rf)?\"(?:[^\"\\\n]|\\.)*\"|(?:f|r|fr|rf)?'(?:[^'\\\n]|\\.)*'", source)
            out.append((f"{path.name} cell {index} (code)", "\n".join(comments + strings)))
    return out


def _module_text(path: pathlib.Path) -> list:
    import ast

    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                name = getattr(node, "name", path.stem)
                out.append((f"{path.relative_to(ROOT)} {name}", doc))
    return out


def texts(paths=None) -> list:
    if paths:
        chosen = [pathlib.Path(p) for p in paths]
    else:
        chosen = (sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")) + [ROOT / "README.md"]
                  + [ROOT / "course_lib" / f"{name}.py" for name in ("network", "cost", "simulation", "schedules")])
    out = []
    for path in chosen:
        if path.suffix == ".ipynb":
            out += _notebook_text(path)
        elif path.suffix == ".py":
            out += _module_text(path)
        else:
            out.append((path.name, path.read_text()))
    return out


def problems(paths=None) -> list:
    """(where, the text matched, what is wrong, what to write)."""
    found = []
    for where, text in texts(paths):
        for pattern, wrong, instead in RULES:
            for match in re.finditer(pattern, text):
                found.append((where, match.group(0), wrong, instead))
    return found


def main(argv=None) -> int:
    found = problems((argv if argv is not None else sys.argv[1:]) or None)
    for where, text, wrong, instead in found:
        print(f"{where}: '{text}': {wrong}; write {instead}")
    if not found:
        print("no symbol used against docs/notation.md (where a pattern can tell)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
