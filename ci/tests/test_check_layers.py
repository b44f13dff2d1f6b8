"""ci/check_layers.py over planted trees: what it reports, what it lets through, and this checkout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHECK = REPO / "ci" / "check_layers.py"

# A tree shaped like this one: four distributions, each shipping its mori.<pkg> modules.
SHIPPED = {
    "packages/mori-core/src/mori/core/__init__.py": "",
    "packages/mori-core/src/mori/core/_native.py": "",
    "packages/mori-shmem/src/mori/shmem/__init__.py": "",
    "packages/mori-shmem/src/mori/shmem/_state.py": "",
    "packages/mori-shmem/src/mori/ops/__init__.py": "",
    "packages/mori-shmem/src/mori/ops/_config.py": "",
    "packages/mori-io/src/mori/io/__init__.py": "",
    "packages/mori-io/src/mori/io/_control.py": "",
    "packages/mori-io/src/mori/io/backends/__init__.py": "",
    "packages/mori-io/src/mori/io/backends/base.py": "",
    "packages/mori-io/src/mori/cpp.py": "",
    "packages/mori-triton/src/mori/triton/__init__.py": "",
    "packages/mori-triton/src/mori/triton/_all_reduce.py": "",
}


def check(tree: Path, files: dict[str, str]) -> tuple[int, list[str]]:
    for rel, text in {**SHIPPED, **files}.items():
        path = tree / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    if not (tree / ".git").exists():
        subprocess.run(["git", "init", "-q", str(tree)], check=True)
    proc = subprocess.run([sys.executable, str(CHECK), "--root", str(tree)], capture_output=True, text=True, timeout=60)
    assert not proc.stderr, proc.stderr
    return proc.returncode, proc.stdout.splitlines()


def test_private_import_in_ci_is_reported(tmp_path: Path) -> None:
    rc, out = check(tmp_path, {"ci/bench.py": "from mori.io._control import ControlClient\n"})
    assert rc == 1
    assert out[0] == "ci/bench.py:1: from mori.io._control import ControlClient"
    assert out[-1].startswith("1 layer offence(s)")


@pytest.mark.parametrize(
    "source, offence",
    [
        ("from mori.shmem import _state\n", "from mori.shmem import _state"),
        ("import mori.triton._all_reduce as ar\n", "import mori.triton._all_reduce"),
        (
            "from mori.triton._all_reduce import sweep, default_config\n",
            "from mori.triton._all_reduce import sweep, default_config",
        ),
        ("import mori.shmem\nmori.shmem._state.current()\n", "mori.shmem._state (a private name of mori.shmem)"),
        (
            "from mori.io import backends\nbackends._FACTORIES.clear()\n",
            "backends._FACTORIES (a private name of mori.io.backends)",
        ),
        ("from mori.core import _native\n", "from mori.core import _native"),
    ],
)
def test_every_spelling_of_a_private_name_is_reported(tmp_path: Path, source: str, offence: str) -> None:
    rc, out = check(tmp_path, {"ci/device/bench.py": source})
    assert rc == 1
    line = 2 if "\n" in source.rstrip("\n") else 1
    assert f"ci/device/bench.py:{line}: {offence}" in out


def test_a_package_uses_its_own_private_names_and_no_other(tmp_path: Path) -> None:
    rc, out = check(
        tmp_path,
        {
            # mori-shmem ships mori.shmem and mori.ops: its sources and tests may use both.
            "packages/mori-shmem/src/mori/ops/_gpu.py": "from mori.shmem import _state\nfrom ._config import X\n",
            "packages/mori-shmem/tests/test_ops.py": "from mori.ops._config import X\nfrom mori.shmem import _state\n",
            # ... but not mori-io's, nor mori-core's (relative imports are resolved too).
            "packages/mori-shmem/tests/test_io.py": "import os\nfrom mori.io._control import encode_frame\n",
            "packages/mori-io/src/mori/io/engine.py": "from ..core import _native\nfrom ._control import C\n",
            "packages/mori-io/tests/test_cpp.py": "from mori.cpp import IOEngine\nfrom mori.io._control import C\n",
            "docs/conf.py": "import mori.shmem._state\n",
        },
    )
    assert rc == 1
    assert out[:-1] == [
        "docs/conf.py:1: import mori.shmem._state",
        "packages/mori-io/src/mori/io/engine.py:1: from mori.core import _native",
        "packages/mori-shmem/tests/test_io.py:2: from mori.io._control import encode_frame",
    ]


def test_public_names_and_ignored_files_pass(tmp_path: Path) -> None:
    rc, out = check(
        tmp_path,
        {
            ".gitignore": "build/\n",
            "build/lib/old.py": "from mori.io._control import ControlClient\n",  # ignored by git: not checked
            "ci/ok.py": "import mori.shmem as shmem\nfrom mori.io.bench import run_peer\nprint(shmem.__version__)\n",
        },
    )
    assert rc == 0, out
    assert "no private name used outside the distribution that ships it" in out[-1]


@pytest.mark.parametrize(
    "rel, source",
    [
        ("backends/tcp/backend.py", "from ...engine import IOEngine\n"),
        ("backends/_connect.py", "from .._registry import InFlight\n"),
        ("backends/nvlink/_queues.py", "from mori.io import IOEngine\n"),
        ("backends/rdma/backend.py", "from mori.io._control import ControlClient\n"),
    ],
)
def test_a_backend_reaching_past_base_is_reported(tmp_path: Path, rel: str, source: str) -> None:
    rc, out = check(tmp_path, {f"packages/mori-io/src/mori/io/{rel}": source})
    assert rc == 1
    assert out[0].startswith(f"packages/mori-io/src/mori/io/{rel}:1: from ")
    assert out[0].endswith("(a backend reaches the engine through backends/base.py)")


TRANSPORTS = {f"packages/mori-io/src/mori/io/backends/{t}/__init__.py": "" for t in ("tcp", "nvlink", "rdma")}


@pytest.mark.parametrize(
    "rel, source, reached",
    [
        ("tcp/_gpu.py", "from ..nvlink._queues import DeviceQueues\n", "mori.io.backends.nvlink._queues"),
        ("tcp/backend.py", "from .. import rdma\n", "mori.io.backends.rdma"),
        ("nvlink/backend.py", "from mori.io.backends.tcp import _staging\n", "mori.io.backends.tcp"),
        ("rdma/backend.py", "import mori.io.backends.tcp.backend\n", "mori.io.backends.tcp.backend"),
        ("_connect.py", "from .tcp.backend import TcpBackend\n", "mori.io.backends.tcp.backend"),
    ],
)
def test_a_backend_reaching_another_backends_files_is_reported(
    tmp_path: Path, rel: str, source: str, reached: str
) -> None:
    rc, out = check(tmp_path, {**TRANSPORTS, f"packages/mori-io/src/mori/io/backends/{rel}": source})
    assert rc == 1, out
    assert out[0] == (
        f"packages/mori-io/src/mori/io/backends/{rel}:1: {reached} (a backend reaches no other "
        "backend's files; shared pieces live in backends/)"
    )


def test_a_backend_uses_its_own_folder_the_shared_modules_and_the_factory_table_loads_all(tmp_path: Path) -> None:
    rc, out = check(
        tmp_path,
        {
            **TRANSPORTS,
            "packages/mori-io/src/mori/io/backends/tcp/backend.py": "from ...types import MemoryDesc\nfrom .._connect import PeerConnector\nfrom ..base import Backend\n"
            "from ._staging import plan\nfrom mori.io.backends.tcp import _gpu\n",
            "packages/mori-io/src/mori/io/backends/base.py": "from .._control import ControlError\n",
            "packages/mori-io/src/mori/io/backends/__init__.py": "from .tcp import TcpBackend\nfrom .rdma import x\n",
        },
    )
    assert rc == 0, out


def test_this_checkout_passes() -> None:
    proc = subprocess.run([sys.executable, str(CHECK)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
