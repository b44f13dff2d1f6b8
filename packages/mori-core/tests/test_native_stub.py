"""The stubs of mori.core._native (``_native/*.pyi``, one a submodule) describe the compiled
module exactly: the same submodules, the same public names, the same parameter names."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from mori.core import _native

STUBS = Path(_native.__file__).with_name("_native")  # installed beside the module, as type checkers look
SUBMODULES = ["atomics", "batch", "codes", "gpu", "inbound", "memory", "tcp", "ucx"]


def _stub(name: str) -> tuple[dict[str, ast.AST], dict[str, ast.FunctionDef]]:
    tree = ast.parse((STUBS / f"{name}.pyi").read_text())
    top: dict[str, ast.AST] = {}
    members: dict[str, ast.FunctionDef] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            top[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            top[node.target.id] = node
        elif isinstance(node, ast.ImportFrom) and node.module is None:  # from . import x as x
            top.update({a.asname or a.name: node for a in node.names})
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    members.setdefault(f"{node.name}.{item.name}", item)  # an overload's first form
    return top, members


def _public(obj: Any) -> set[str]:
    return {n for n in dir(obj) if not n.startswith("_")}


def _params(doc: str, name: str) -> list[str]:
    """Parameter names of pybind11's first signature line ``name(a: T, b: U) -> R``."""
    first = doc.strip().splitlines()[0]
    match = re.match(rf"(?:\d+\. )?{re.escape(name)}\((.*)\) ->", first)
    assert match, doc
    names = [p.split(":")[0].strip() for p in re.split(r",\s*(?![^\[]*\])", match.group(1)) if p.strip()]
    return [n for n in names if n != "self"]


def test_every_submodule_and_public_name_is_in_the_stubs_and_back() -> None:
    top, _ = _stub("__init__")
    assert _public(_native) == {n for n in top if not n.startswith("_")} == {"ABI_VERSION", *SUBMODULES}
    for sub in SUBMODULES:
        assert isinstance(getattr(_native, sub), ModuleType)
        names, members = _stub(sub)
        module = getattr(_native, sub)
        assert _public(module) == {n for n in names if not n.startswith("_")}, sub
        for cls in (n for n, node in names.items() if isinstance(node, ast.ClassDef) and not n.startswith("_")):
            if issubclass(getattr(module, cls), BaseException):  # an exception: Python's own members
                continue
            assert _public(getattr(module, cls)) == {
                k.split(".")[1] for k in members if k.startswith(f"{cls}.") and not k.split(".")[1].startswith("_")
            }


def test_submodules_import_by_their_full_names() -> None:
    import importlib

    for sub in SUBMODULES:
        assert importlib.import_module(f"mori.core._native.{sub}") is getattr(_native, sub)


def _signatures(
    module: ModuleType, top: dict[str, ast.AST], members: dict[str, ast.FunctionDef]
) -> Iterator[tuple[str, Any, ast.AST]]:
    """(name, the callable, its stub) for each function, method and constructor of ``module``."""
    for name in sorted(_public(module)):
        member = getattr(module, name)
        if isinstance(member, type) and not issubclass(member, BaseException):
            for method in sorted(_public(member) | {"__init__"}):
                key = f"{name}.{method}"
                if key in members and callable(getattr(member, method)):  # properties are not
                    yield key, getattr(member, method), members[key]
        elif callable(member) and not isinstance(member, type):
            yield name, member, top[name]


@pytest.mark.parametrize("sub", SUBMODULES)
def test_parameter_names_match(sub: str) -> None:
    top, members = _stub(sub)
    for name, member, stub in _signatures(getattr(_native, sub), top, members):
        assert isinstance(stub, ast.FunctionDef), name
        want = [a.arg for a in stub.args.args if a.arg != "self"]
        assert _params(member.__doc__ or "", name.split(".")[-1]) == want, f"{sub}.{name}"
