"""Import cycles in course_lib and course_grader: every import, at a module's top or inside a function, is an edge.

    python tools/import_cycles.py          # prints each cycle (its modules); exits 1 if there is one

Imports under ``if TYPE_CHECKING:`` do not count (they never run). An import of a package's submodule
counts as an edge to that submodule, not to the package. Tarjan's strongly connected components: a
component of more than one module is a cycle.
"""

from __future__ import annotations

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


PACKAGES = ("course_lib", "course_grader")      # the learner's package, and the instructor's beside it


def modules(package: str | tuple = PACKAGES) -> dict[str, pathlib.Path]:
    if isinstance(package, tuple):
        return {name: path for one in package for name, path in modules(one).items()}
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def _edges(name: str, path: pathlib.Path, known: dict) -> set[str]:
    is_package = path.name == "__init__.py"
    targets: set[str] = set()

    def add(target: str) -> None:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            targets.add(target)

    def base(level: int, module: str | None) -> str:
        if level == 0:
            return module or ""
        parts = name.split(".") if is_package else name.split(".")[:-1]
        parts = parts[: len(parts) - (level - 1)]
        return ".".join(parts + ([module] if module else []))

    def visit(node) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            start = base(node.level, node.module)
            for alias in node.names:
                full = f"{start}.{alias.name}"
                add(full if full in known else start)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return targets


def cycles(package: str | tuple = PACKAGES) -> list[list[str]]:
    """Every strongly connected component of more than one module, sorted."""
    known = modules(package)
    graph = {name: _edges(name, path, known) for name, path in known.items()}
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(found)


def main() -> int:
    found = cycles()
    lines = sum(len(path.read_text().splitlines()) for path in modules().values())
    print(f"{len(modules())} modules, {lines:,} lines; {len(found)} import cycle(s)")
    for component in found:
        print(f"  {len(component)} modules: {', '.join(component)}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
