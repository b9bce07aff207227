"""Hold the notebooks, the README and the model's docstrings to docs/notation.md.

    python tools/check_notation.py                  # every notebook, README.md and the model's modules
    python tools/check_notation.py notebooks/10_measure_it.ipynb

Two checks:

- **Every symbol is in the table, for the notebook that uses it.** Each letter or Greek letter in a notebook's
  mathematics (`$...$` in markdown; subscripts are labels and are not read) must have a row in docs/notation.md
  whose "where" column says "all" or names the notebook; one row per symbol, so each has one meaning. A row for a
  notebook that no longer uses the symbol is reported too, so the table stays true.
- **Patterns of known misuse.** Each rule is a pattern that only a sentence using a symbol against the table can
  match (`N bytes`, `a message of S bytes`), with what to write instead. It reads markdown cells and the comments
  and strings of code cells (where formulas are printed), the README, and the docstrings of course_lib's network,
  cost, simulation and schedules modules.

It cannot tell every misuse (a P that means something else in plain text, outside `$...$`); what it checks it
checks everywhere. tests/test_notation.py runs it.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys
import unicodedata

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
    (r"\bmessage of \$?[Sc]\$? bytes", "S is the tensor's bytes and c a chunk's", "a message of m bytes"),
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

GREEK_NAMES = {"alpha", "beta", "gamma", "delta", "epsilon", "varepsilon", "zeta", "eta", "theta", "vartheta",
               "iota", "kappa", "lambda", "mu", "nu", "xi", "pi", "rho", "sigma", "tau", "upsilon", "phi", "varphi",
               "chi", "psi", "omega", "Gamma", "Delta", "Theta", "Lambda", "Xi", "Pi", "Sigma", "Upsilon", "Phi", "Psi",
               "Omega"}


def _greek(character: str):
    """'λ' -> 'lambda', 'Ψ' -> 'Psi' (LaTeX's names); None for anything else."""
    words = unicodedata.name(character, "").split()
    if len(words) == 4 and words[:3] in (["GREEK", "SMALL", "LETTER"], ["GREEK", "CAPITAL", "LETTER"]):
        name = words[3].lower().replace("lamda", "lambda")         # Unicode spells it LAMDA
        return name.capitalize() if words[1] == "CAPITAL" else name
    return None


_MATH = re.compile(r"\$\$(.+?)\$\$|\$([^$\n]+?)\$", re.DOTALL)
_WORDS = re.compile(r"\\(?:text|mathrm|operatorname|mathbf|mathit|texttt|textbf|mbox)\s*\{[^{}]*\}")
_SUBSCRIPT = re.compile(r"_(?:\{[^{}]*\}|\\?[A-Za-z0-9]+)")


def math_symbols(text: str) -> set:
    """The letters and Greek letters (by name: 'alpha') that the `$...$` mathematics of `text` uses as symbols.
    Words set in text (`\\text{busbw}`), subscripts (`t_a`, `h_{NVLink}`) and commands (`\\frac`) are not symbols."""
    found = set()
    for match in _MATH.finditer(text):
        body = _SUBSCRIPT.sub(" ", _WORDS.sub(" ", match.group(1) or match.group(2)))
        found |= {name for name in re.findall(r"\\([A-Za-z]+)", body) if name in GREEK_NAMES}
        found |= set(re.findall(r"(?<![A-Za-z\\])[A-Za-z](?![A-Za-z])", re.sub(r"\\[A-Za-z]+", " ", body)))
    return found


def _symbol_names(cell: str) -> list:
    """'λ (lambda), η (eta)' -> ['lambda', 'eta']; 'M, K' -> ['M', 'K']; 'steps(G)' -> [] (a word, not a symbol)."""
    names = []
    for part in cell.split(","):
        head = part.strip().split(" ")[0].strip("`*")
        if len(head) == 1 and _greek(head):
            names.append(_greek(head))
        elif head in GREEK_NAMES or (len(head) == 1 and head.isalpha()):
            names.append(head)
    return names


def symbol_table(path: pathlib.Path = ROOT / "docs" / "notation.md") -> tuple:
    """({symbol: 'all' or a set of notebook numbers ('04')}, [problems with the table itself]): the rows of every
    table in docs/notation.md whose header has a 'symbol' and a 'where' column."""
    table, trouble, columns = {}, [], None
    for line in path.read_text().splitlines():
        if not line.startswith("|"):
            columns = None
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if columns is None:
            heads = [cell.lower() for cell in cells]
            columns = (heads.index("symbol"), heads.index("where")) if {"symbol", "where"} <= set(heads) else ()
            continue
        if not columns or set(cells[0]) <= set("-: "):
            continue
        where = cells[columns[1]].lower()
        scope = "all" if where == "all" else set(re.findall(r"\b\d\d\b", where))
        for name in _symbol_names(cells[columns[0]]):
            if name in table:
                trouble.append((f"docs/notation.md row '{cells[columns[0]]}'", name, "a second row for one symbol",
                                "one meaning per symbol: merge the rows or rename the symbol in one notebook"))
            table[name] = scope
    return table, trouble


def table_problems(paths=None) -> list:
    """(where, symbol, what is wrong, what to do) for every notebook symbol outside docs/notation.md's rows, and
    every row naming a notebook that does not use its symbol (when all the notebooks are read)."""
    table, found = symbol_table()
    notebooks = [pathlib.Path(p) for p in paths] if paths else sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    used = {}
    for path in (p for p in notebooks if p.suffix == ".ipynb"):
        number = path.name[:2]
        for where, text in _notebook_text(path):
            if where.endswith("(code)"):                           # code cells' strings are not mathematics
                continue
            for name in sorted(math_symbols(text)):
                used.setdefault(name, set()).add(number)
                scope = table.get(name)
                if scope is None:
                    found.append((where, name, "not in docs/notation.md",
                                  "use the table's symbol, or add a row (symbol, meaning, unit, where)"))
                elif scope != "all" and number not in scope:
                    found.append((where, name,
                                  f"docs/notation.md gives it a meaning in {', '.join(sorted(scope))} only",
                                  "use the table's symbol, or add this notebook to the row if the meaning is the same"))
    if not paths:
        for name, scope in sorted(table.items()):
            for number in sorted(scope - used.get(name, set())) if scope != "all" else ():
                found.append((f"docs/notation.md row {name}", name, f"notebook {number} does not use it",
                              f"take {number} out of the row's 'where'"))
    return found


def problems(paths=None) -> list:
    """(where, the text matched, what is wrong, what to write): the table's checks, then the patterns'."""
    return table_problems(paths) + pattern_problems(paths)


def pattern_problems(paths=None) -> list:
    """(where, the text matched, what is wrong, what to write) for every match of a rule of known misuse."""
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
