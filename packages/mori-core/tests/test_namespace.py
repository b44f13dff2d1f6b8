"""mori-core's namespace hook (``src/_mori_namespace.py``, which ``mori_core.pth`` runs at start-up):
``import mori`` alone then reaches MORI's lazy submodules and ``mori.__version__``, as MORI's own
package does, and a submodule whose distribution is missing is an AttributeError naming it.

Each check runs in a fresh interpreter started with ``-S`` (no site processing, so no installed
copy of the hook runs first) whose path holds this checkout's package sources and the
environment's site-packages (the installed distributions' metadata)."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

PACKAGES = Path(__file__).resolve().parents[2]


def _run(code: str, packages: tuple[str, ...]) -> dict[str, object]:
    path = [str(PACKAGES / p / "src") for p in packages] + [sysconfig.get_paths()["purelib"]]
    prog = f"import sys; sys.path[:0] = {path!r}; import _mori_namespace\nimport json, mori\n{code}"
    out = subprocess.run([sys.executable, "-S", "-c", prog], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_import_mori_reaches_cpp_ir_and_the_version() -> None:
    seen = _run(
        "import mori.io\n"
        "print(json.dumps({'version': mori.__version__, 'cpp': mori.cpp.TransferStatus is mori.io.TransferStatus,\n"
        "                  'ir': mori.ir.SIGNAL_SET == mori.triton.SIGNAL_SET, 'umbp': mori.umbp.__name__,\n"
        "                  'dir': dir(mori)}))",
        ("mori-core", "mori-io", "mori-shmem", "mori-triton", "mori-umbp"),
    )
    version = (PACKAGES / "version.py").read_text().split('__version__ = "')[1].split('"')[0]
    assert seen["version"] == version
    assert seen["cpp"] is True and seen["ir"] is True and seen["umbp"] == "mori.umbp"
    assert {"core", "cpp", "io", "ir", "ops", "shmem", "triton", "umbp", "__version__"} <= set(seen["dir"])  # type: ignore[arg-type]


def test_a_submodule_whose_distribution_is_missing_names_it() -> None:
    seen = _run(
        "try:\n"
        "    mori.cpp\n"
        "    why = 'found'\n"
        "except AttributeError as exc:\n"
        "    why = str(exc)\n"
        "print(json.dumps({'why': why, 'has_ir': hasattr(mori, 'ir'), 'nothing': hasattr(mori, 'nothing'),\n"
        "                  'core': mori.core.__name__}))",
        ("mori-core",),
    )
    assert seen["why"] == (
        "module 'mori' has no attribute 'cpp': mori.cpp comes with the mori-io distribution (pip install mori-io)"
    ), seen
    assert seen["has_ir"] is False and seen["nothing"] is False and seen["core"] == "mori.core"
