"""Fails when mori's modules import each other in a cycle, typing-only and deferred imports included.

Every ``*.py`` under ``packages/*/src/`` is a module (``mori/io/_context.py`` is ``mori.io._context``);
each import in it, wherever it stands (at the top, under ``if TYPE_CHECKING:``, inside a function),
is an edge to the module it names (``from . import x`` names the submodule ``x``). A module's
imports of the packages above it (``mori.io`` from ``mori.io.engine``) are not edges: a package's
``__init__`` importing its own modules is how packages are made. Prints each cycle as its modules,
with the line of one import per edge; exit 1 when any. ``--root DIR`` checks another tree.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of every distribution's sources."""
    found = {}
    for path in sorted(root.glob("packages/*/src/mori/**/*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts[3:])  # packages/<dist>/src/mori/...
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def edges(name: str, path: Path, known: dict[str, Path]) -> dict[str, int]:
    """The modules ``name`` imports (not its own packages), each with the line of its first import."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                out.setdefault(target, node.lineno)
    return out


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    work.append((nxt, iter(graph[nxt])))
                elif nxt in stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", type=Path, default=ROOT, help="the tree to check (default: this checkout)")
    root = ap.parse_args(argv).root.resolve()
    known = modules(root)
    graph = {name: edges(name, path, known) for name, path in known.items()}
    found = cycles(graph)
    for component in found:
        print("import cycle: " + ", ".join(component))
        for name in component:
            for target, line in sorted(graph[name].items()):
                if target in component:
                    print(f"  {known[name].relative_to(root)}:{line}: {name} imports {target}")
    if found:
        return 1
    print(f"{len(known)} modules: no import cycles (typing-only and deferred imports counted)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
