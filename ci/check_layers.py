"""Fails when code crosses a layer through a private name.

1. A private name stays in the distribution that ships it. A name under ``mori.<pkg>`` is
   private when a part of its dotted path after ``mori.<pkg>`` starts with ``_`` (dunders such as
   ``__version__`` excepted): ``mori.io._control``, ``from mori.shmem import _state``,
   ``from mori.triton._all_reduce import sweep``, and ``m._y`` on a name bound by an import to
   anything of mori. Only files of the distribution that ships ``mori.<pkg>`` may reach it: those
   under ``packages/<dist>/`` (its sources, its tests and its build script). So a package's tests
   may use that package's own private names (mori-shmem ships ``mori.shmem`` and ``mori.ops``,
   mori-io ``mori.io`` and ``mori.cpp``, mori-triton ``mori.triton`` and ``mori.ir``), never another
   package's; everything outside ``packages/`` (``ci/``, ``ci/device/``, ``docs/conf.py``) uses
   public names only. Which distribution ships which ``mori.<pkg>`` is read from
   ``packages/*/src/mori/``. Checked in every ``*.py`` of the tree that git tracks or would track
   (``git ls-files --cached --others --exclude-standard``), or in the files and folders given.
2. mori-io's backends reach the engine only through ``backends/base.py`` (``BackendContext``):
   a backend module other than ``base.py`` imports nothing of the ``mori.io`` package above
   ``backends`` but ``types`` (the public value types).
3. No backend reaches another backend's files: each transport is a folder of ``backends/``
   (``tcp/``, ``nvlink/``, ``rdma/``), and a module in one imports nothing of another; the shared
   modules directly in ``backends/`` (``base.py``, the connector) import no transport, except
   ``backends/__init__.py``, whose factory table loads them.

Prints each offence as ``path:line: what``; exit 1 when any. ``--root DIR`` checks another tree
(the tests plant offences in a temporary one).
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = "packages/mori-io/src/mori/io/backends"


def _private_part(dotted: str) -> bool:
    """Whether ``dotted`` (``mori.<pkg>.…``) names something private to its distribution."""
    parts = dotted.split(".")
    return parts[0] == "mori" and any(p.startswith("_") and not p.startswith("__") for p in parts[2:])


def shipped_by(root: Path) -> dict[str, str]:
    """``mori.<pkg>`` top-level name -> the distribution (``packages/<dist>``) that ships it."""
    owners = {}
    for entry in sorted(root.glob("packages/*/src/mori/*")):
        if entry.name != "__pycache__" and (entry.is_dir() or entry.suffix == ".py"):
            owners[entry.stem] = entry.parts[-4]
    return owners


def _module_of(rel: Path) -> list[str] | None:
    """The dotted package a source file under ``packages/<dist>/src`` sits in, else None."""
    parts = rel.parts
    if len(parts) < 4 or parts[0] != "packages" or parts[2] != "src":
        return None
    return list(parts[3:-1])


def _imports(tree: ast.AST, package: list[str] | None) -> tuple[dict[str, str], list[tuple[int, str, list[str]]]]:
    """Local names bound by imports (-> dotted target), and each import as (line, module, names)
    (``names`` empty for ``import module``)."""
    bound: dict[str, str] = {}
    imports = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                imports.append((node.lineno, alias.name, []))
                top = alias.name.split(".")[0]
                bound[alias.asname or top] = alias.name if alias.asname else top
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolvable only inside a package's sources
                if package is None or node.level > len(package):
                    continue
                module = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names = [alias.name for alias in node.names if alias.name != "*"]
            imports.append((node.lineno, module, names))
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{module}.{alias.name}"
    return bound, imports


def _dotted(node: ast.expr, bound: dict[str, str]) -> str | None:
    """``a.b.c`` with ``a`` replaced by what its import bound it to; None if ``a`` is no import."""
    if isinstance(node, ast.Name):
        return bound.get(node.id)
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value, bound)
        return None if inner is None else f"{inner}.{node.attr}"
    return None


def offences(path: Path, root: Path = ROOT, owners: dict[str, str] | None = None) -> list[str]:
    """The private names of other distributions that ``path`` reaches, one line each."""
    owners = shipped_by(root) if owners is None else owners
    rel = path.resolve().relative_to(root.resolve())
    home = rel.parts[1] if rel.parts[0] == "packages" and len(rel.parts) > 2 else None
    tree = ast.parse(path.read_text(), str(path))
    bound, imports = _imports(tree, _module_of(rel))

    def foreign(dotted: str) -> bool:
        return _private_part(dotted) and owners.get(dotted.split(".")[1]) != home

    found = set()
    for line, module, names in imports:
        if foreign(module):
            found.add((line, f"from {module} import {', '.join(names)}" if names else f"import {module}"))
        else:
            found |= {(line, f"from {module} import {name}") for name in names if foreign(f"{module}.{name}")}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            target = _dotted(node.value, bound)
            if target is not None and not _private_part(target) and foreign(f"{target}.{node.attr}"):
                found.add((node.lineno, f"{ast.unparse(node)} (a private name of {target})"))
    return [f"{rel}:{line}: {what}" for line, what in sorted(found)]


def _absolute(node: ast.ImportFrom, package: list[str] | None) -> str:
    """The absolute module an ``import from`` names (relative ones resolved inside ``package``)."""
    if not node.level:
        return node.module or ""
    if package is None or node.level > len(package):
        return ""
    return ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))


def backend_offences(path: Path, root: Path = ROOT) -> list[str]:
    """What a mori-io backend module imports past ``base.py`` (engine internals) or of another
    transport's folder, one line each."""
    rel = path.relative_to(root)
    below = rel.relative_to(BACKENDS).parts
    own = below[0] if len(below) > 1 else None  # the transport folder holding this file; None: shared
    transports = {d.name for d in (root / BACKENDS).iterdir() if d.is_dir() and d.name != "__pycache__"}
    package = _module_of(rel)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [(alias.name, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node, package)
            shown = "." * node.level + (node.module or "")
            targets = [(module, shown)] + [(f"{module}.{a.name}", shown) for a in node.names if a.name != "*"]
        else:
            continue
        for module, shown in targets:
            parts = module.split(".")
            if parts[:2] != ["mori", "io"] or len(parts) < 3:
                continue
            if parts[2] not in ("types", "backends") and below != ("base.py",):
                found.append(
                    f"{rel}:{node.lineno}: from {shown} import ... "
                    "(a backend reaches the engine through backends/base.py)"
                )
                break
            if (
                parts[2] == "backends"
                and len(parts) > 3
                and parts[3] in transports
                and parts[3] != own
                and below != ("__init__.py",)
            ):
                found.append(
                    f"{rel}:{node.lineno}: {module} (a backend reaches no other backend's files; "
                    "shared pieces live in backends/)"
                )
                break
    return found


def python_files(root: Path) -> list[Path]:
    """Every ``*.py`` of the tree at ``root`` that git tracks or would track (ignored files skipped)."""
    out = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", "*.py"],
        check=True,
        capture_output=True,
    ).stdout
    return sorted({root / p for p in out.decode().split("\0") if p and (root / p).is_file()})


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", type=Path, default=ROOT, help="the tree to check (default: this checkout)")
    ap.add_argument("paths", nargs="*", type=Path, help="files or folders to check (default: the whole tree)")
    args = ap.parse_args(argv)
    root = args.root.resolve()
    if args.paths:
        given = [(p if p.is_absolute() else root / p).resolve() for p in args.paths]
        files = sorted({f for p in given for f in ([p] if p.is_file() else p.rglob("*.py"))})
    else:
        files = python_files(root)
    owners = shipped_by(root)
    bad = [line for path in files for line in offences(path, root, owners)]
    backends = root / BACKENDS
    bad += [line for path in files if backends in path.parents for line in backend_offences(path, root)]
    for line in bad:
        print(line)
    if bad:
        print(
            f"{len(bad)} layer offence(s): outside the distribution that ships it, use a package's public API; "
            "in mori-io's backends, BackendContext and no other backend's files"
        )
        return 1
    print(
        f"{len(files)} Python files: no private name used outside the distribution that ships it; "
        "mori-io's backends import only types and base of mori.io, and no other backend's files"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
