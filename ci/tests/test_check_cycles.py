"""ci/check_cycles.py over planted trees: the cycles it reports (typing-only and deferred imports
too), what it lets through, and this checkout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHECK = REPO / "ci" / "check_cycles.py"
PKG = "packages/mori-io/src/mori/io"


def check(tree: Path, files: dict[str, str]) -> tuple[int, str]:
    for rel, text in {f"{PKG}/__init__.py": "from .engine import IOEngine\n", **files}.items():
        path = tree / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    proc = subprocess.run([sys.executable, str(CHECK), "--root", str(tree)], capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stdout


def test_a_package_importing_its_modules_is_no_cycle(tmp_path: Path) -> None:
    rc, out = check(
        tmp_path,
        {
            f"{PKG}/engine.py": "from ._context import EngineContext\nimport mori.io\n",
            f"{PKG}/_context.py": "from . import types\n",
            f"{PKG}/types.py": "",
        },
    )
    assert rc == 0, out
    assert "4 modules: no import cycles" in out


@pytest.mark.parametrize(
    "back",
    [
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .engine import IOEngine\n",
        "def make():\n    from . import engine\n    return engine\n",
        "import mori.io.engine as e\n",
    ],
)
def test_a_cycle_is_reported_however_the_import_is_written(tmp_path: Path, back: str) -> None:
    rc, out = check(
        tmp_path, {f"{PKG}/engine.py": "x = 1\nfrom ._context import EngineContext\n", f"{PKG}/_context.py": back}
    )
    assert rc == 1
    assert "import cycle: mori.io._context, mori.io.engine" in out
    assert f"{PKG}/engine.py:2: mori.io.engine imports mori.io._context" in out


def test_this_checkout_has_none() -> None:
    proc = subprocess.run([sys.executable, str(CHECK)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout
