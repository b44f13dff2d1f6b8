"""Fails when code crosses a layer through a private name.

1. Separately versioned packages may be bound only by mori-core's public API: no import of
   ``mori.core._x`` or ``mori.core.x._y``, no ``from mori.core[.x] import _y``, and no ``m._y`` on
   a name bound to a mori.core module. Checked in every ``*.py`` under the given roots (default:
   every package but mori-core, and ci/).
2. mori-io's backends reach the engine only through ``backends/base.py`` (``BackendContext``):
   a backend module other than ``base.py`` imports nothing of the ``mori.io`` package above
   ``backends`` but ``types`` (the public value types).

Prints each offence as ``path:line: what``; exit 1 when any.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ROOTS = ["packages/mori-shmem", "packages/mori-io", "packages/mori-triton", "ci"]
BACKENDS = ROOT / "packages/mori-io/src/mori/io/backends"


def _private(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[:2] == ["mori", "core"] and any(p.startswith("_") for p in parts[2:])


def offences(path: Path) -> list[str]:
    """The private mori.core names ``path`` reaches, one line each."""
    tree = ast.parse(path.read_text(), str(path))
    core_aliases: set[str] = set()  # local names bound to a mori.core module
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _private(alias.name):
                    found.append((node.lineno, f"import {alias.name}"))
                elif alias.name.startswith("mori.core") and alias.asname:
                    core_aliases.add(alias.asname)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if _private(node.module):
                found.append((node.lineno, f"from {node.module} import ..."))
            elif node.module == "mori.core" or node.module.startswith("mori.core."):
                for alias in node.names:
                    if alias.name.startswith("_"):
                        found.append((node.lineno, f"from {node.module} import {alias.name}"))
                    else:
                        core_aliases.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name) and node.value.id in core_aliases):
            found.append((node.lineno, f"{node.value.id}.{node.attr} (a private name of mori.core)"))
    return [f"{path.relative_to(ROOT)}:{line}: {what}" for line, what in sorted(found)]


def backend_offences(path: Path) -> list[str]:
    """The engine internals a mori-io backend module imports past ``base.py``, one line each."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 2 and node.module != "types":
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: from ..{node.module or ''} import ... "
                         "(a backend reaches the engine through backends/base.py)")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("mori.io") \
                and not (node.module or "").startswith(("mori.io.types", "mori.io.backends")):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {node.module} import ... "
                         "(a backend reaches the engine through backends/base.py)")
    return found


def main(argv: list[str]) -> int:
    roots = [ROOT / r for r in (argv or DEFAULT_ROOTS)]
    bad = [line for root in roots for path in sorted(root.rglob("*.py")) for line in offences(path)]
    if not argv:
        bad += [line for path in sorted(BACKENDS.glob("*.py")) if path.name != "base.py"
                for line in backend_offences(path)]
    for line in bad:
        print(line)
    if bad:
        print(f"{len(bad)} layer offence(s): use mori.core's public API, and BackendContext in mori-io's backends")
        return 1
    print(f"no private mori.core names outside mori-core ({', '.join(argv or DEFAULT_ROOTS)})"
          + ("" if argv else "; mori-io's backends import only types and base of mori.io"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
