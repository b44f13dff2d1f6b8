"""Installing mori-core and mori-io into a fresh virtual environment pulls nothing heavy, and the
TCP backend moves bytes there (no numpy).

The wheels are built from copies of the package sources with this environment's build tools
(hatchling, pybind11, the C++ compiler), then installed into a new venv without system site
packages; only msgpack comes from the package index.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

PACKAGES = Path(__file__).resolve().parents[2]
HEAVY = {"torch", "triton", "cuda-bindings", "cuda-python", "nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc-cu12", "numpy"}

CHECK = r"""
import json, sys
import mori.core, mori.io
from mori.core import atomics, cuda, nvrtc
from mori.core.memory import HostSegment, cuda_vmm
inc = nvrtc.device_include_dir()
with HostSegment.create(4096) as seg:
    atomics.fetch_add(seg.addr, 41)
    value = atomics.fetch_add(seg.addr, 1) + 1
try:
    cuda_vmm.granularity(0)
    hint = "no error"
except cuda.CudaUnavailableError as err:
    hint = str(err)
# mori-io's TCP path without numpy: two engines, host memory as bytearrays, one batch.
import ctypes
from mori.io import BackendType, IOEngine, IOEngineConfig, MemoryLocationType, StatusCode
a, b = IOEngine("a", IOEngineConfig("127.0.0.1", 0)), IOEngine("b", IOEngineConfig("127.0.0.1", 0))
for e in (a, b):
    e.create_backend(BackendType.TCP)
a.register_remote_engine(b.get_engine_desc())
src, dst = bytearray(range(256)) * 256, bytearray(65536)
def addr(buf):
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
ms = a.register_memory(addr(src), len(src), -1, MemoryLocationType.CPU)
md = b.register_memory(addr(dst), len(dst), -1, MemoryLocationType.CPU)
offs = list(range(0, 65536, 512))
st = a.batch_write(ms, offs[::-1], md, offs, [512] * len(offs), a.allocate_transfer_uid())
moved = st.WaitFor(30000) == StatusCode.SUCCESS and all(
    dst[o:o + 512] == src[r:r + 512] for o, r in zip(offs, offs[::-1]))
# MORI's idiom on the namespace package: mori-core's start-up hook, with no mori-shmem installed.
import subprocess
hook = subprocess.run([sys.executable, "-c", "import mori; print(mori.io.IOEngine.__name__)"],
                      capture_output=True, text=True).stdout.strip()
print(json.dumps({"include": str(inc), "value": value, "hint": hint, "core": mori.core.__file__, "hook": hook,
                  "native": mori.core._native.__file__, "prefix": sys.prefix, "moved": moved,
                  "numpy": "numpy" in sys.modules}))
"""


def _run(*cmd: str | Path, timeout: float = 240) -> str:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _copy_sources(name: str, dest: Path) -> Path:
    ignore = shutil.ignore_patterns("build", "dist", "*.so", "*.o", "__pycache__", "*.egg-info", ".*cache*")
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(PACKAGES / "version.py", dest / "version.py")  # the one version, beside the packages
    copied = Path(shutil.copytree(PACKAGES / name, dest / name, ignore=ignore))
    # The native objects of this checkout's build (setup.sh's editable install compiled every one
    # with the same build hook): copied with their times, the hook recompiles only what is out of
    # date, so the wheel build here links instead of spending two minutes of CPU compiling again.
    objects = PACKAGES / name / "build" / "native"
    if objects.is_dir():
        shutil.copytree(objects, copied / "build" / "native")
    return copied


@pytest.mark.slow
def test_fresh_venv_gets_core_and_io_without_torch_triton_or_cuda(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    sources = [_copy_sources(n, tmp_path / "src") for n in ("mori-core", "mori-io")]
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "-w", wheels, *sources)

    (core_wheel,) = wheels.glob("mori_core-*.whl")
    version = (PACKAGES / "version.py").read_text().split('__version__ = "')[1].split('"')[0]
    assert (
        core_wheel.name.startswith(f"mori_core-{version}-")
        and (wheels / f"mori_io-{version}-py3-none-any.whl").exists()
    )
    names = zipfile.ZipFile(core_wheel).namelist()
    assert any(n.startswith("mori/core/_native") and n.endswith(".so") for n in names), names
    assert "mori/core/include/mori/device/shmem.cuh" in names
    assert "mori/core/py.typed" in names
    assert {"mori/core/_native/__init__.pyi", "mori/core/_native/batch.pyi", "mori/core/_native/tcp.pyi"} <= set(names)
    assert {"_mori_namespace.py", "mori_core.pth"} <= set(names)  # the namespace hook ships with mori-core
    assert not [n for n in names if n == "mori/__init__.py"], "mori must stay a namespace package"
    assert not core_wheel.name.endswith("-none-any.whl"), "the native module makes the wheel platform specific"

    env = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", env)
    py = env / "bin" / "python"
    assert "include-system-site-packages = false" in (env / "pyvenv.cfg").read_text()
    _run(
        py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--find-links", wheels, "mori-core", "mori-io"
    )

    installed = {p["name"].lower() for p in json.loads(_run(py, "-m", "pip", "list", "--format=json"))}
    assert {"mori-core", "mori-io", "msgpack"} <= installed
    assert not installed & HEAVY, f"heavy packages were installed: {sorted(installed & HEAVY)}"

    report = json.loads(_run(py, "-c", CHECK).strip().splitlines()[-1])
    site = Path(report["prefix"]).resolve()
    assert Path(report["core"]).resolve().is_relative_to(site), "mori.core came from outside the fresh venv"
    assert Path(report["native"]).resolve().is_relative_to(site)
    include = Path(report["include"]).resolve()
    assert include.is_relative_to(site) and (include / "mori" / "device" / "shmem.cuh").is_file()
    assert report["value"] == 42
    assert report["moved"] and not report["numpy"], "mori-io's TCP path must move bytes without numpy"
    assert "mori-core[cuda]" in report["hint"]
    assert report["hook"] == "IOEngine", "import mori; mori.io... must work with mori-core and mori-io alone"
