"""_native.pyi describes mori.core._native exactly: the same public names, the same parameter names."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest

from mori.core import _native

STUB = Path(_native.__file__).with_name("_native.pyi")  # installed beside the module, as type checkers look


def _stub() -> tuple[dict[str, ast.AST], dict[str, ast.FunctionDef]]:
    tree = ast.parse(STUB.read_text())
    top: dict[str, ast.AST] = {}
    classes: dict[str, ast.FunctionDef] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            top[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            top[node.target.id] = node
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    classes[f"{node.name}.{item.name}"] = item
    return top, classes


def _public(obj: Any) -> set[str]:
    return {n for n in dir(obj) if not n.startswith("_")}


def _params(doc: str, name: str) -> list[str]:
    """Parameter names of pybind11's first signature line ``name(a: T, b: U) -> R``."""
    match = re.match(rf"{re.escape(name)}\((.*)\) ->", doc.strip().splitlines()[0])
    assert match, doc
    names = [p.split(":")[0].strip() for p in re.split(r",\s*(?![^\[]*\])", match.group(1)) if p.strip()]
    return [n for n in names if n != "self"]


def test_every_public_name_is_in_the_stub_and_back() -> None:
    top, classes = _stub()
    assert _public(_native) == {n for n in top if not n.startswith("_")}
    assert _public(_native.atomics) == {k.split(".")[1] for k in classes if k.startswith("_Atomics.")}
    for cls in ("GatherLauncher", "TcpPeer", "TcpTarget", "TcpTransfer", "UcxEngine", "UcxPeer", "UcxTransfer"):
        assert _public(getattr(_native, cls)) == {k.split(".")[1] for k in classes
                                                   if k.startswith(f"{cls}.") and not k.endswith(".__init__")}


@pytest.mark.parametrize("owner", ["", "atomics", "GatherLauncher", "TcpPeer", "TcpTarget", "TcpTransfer", "UcxEngine",
                                   "UcxPeer", "UcxTransfer"])
def test_parameter_names_match(owner: str) -> None:
    top, classes = _stub()
    obj = getattr(_native, owner) if owner else _native
    stub_owner = "_Atomics" if owner == "atomics" else owner
    for name in sorted(_public(obj) | ({"__init__"} if owner.startswith(("Gather", "TcpP", "TcpTa", "UcxE")) else set())):
        member = getattr(obj, name)
        if not callable(member) or isinstance(member, type):
            continue
        stub = classes[f"{stub_owner}.{name}"] if stub_owner else top[name]
        assert isinstance(stub, ast.FunctionDef), name
        want = [a.arg for a in stub.args.args if a.arg != "self"]
        assert _params(member.__doc__ or "", name) == want, f"{owner}.{name}"
