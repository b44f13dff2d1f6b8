"""Builds ``mori.core._native`` from ``csrc/**/*.cpp`` with the system C++ compiler.

Run by hatchling for wheels and editable installs; ``python hatch_build.py`` rebuilds the
extension in place for development. No CUDA toolkit is needed: the native module holds only
host code (TCP data plane, UCX engine with UCX opened at run time, host atomics).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
CSRC = HERE / "csrc"
INCLUDE = HERE / "include"
OUT_DIR = HERE / "src" / "mori" / "core"
BUILD_DIR = HERE / "build" / "native"  # objects go in a folder per Python ABI (see build_native)


class NativeBuildError(RuntimeError):
    """The C++ compiler failed; the message holds the command and the compiler's own output."""


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        raise NativeBuildError(
            "mori-core needs a C++17 compiler to build its native module and found none: "
            "install one (Debian/Ubuntu: apt-get install g++) or set CXX."
        )
    return cxx


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise NativeBuildError(
            "building mori.core._native failed\n  command: "
            + shlex.join(cmd)
            + "\n  compiler output:\n"
            + (proc.stderr or proc.stdout).strip()
        )


def build_native() -> Path:
    """Compiles every ``csrc/**/*.cpp`` (in parallel, skipping up-to-date objects) and links the module."""
    import pybind11

    cxx = _compiler()
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    target = OUT_DIR / f"_native{suffix}"
    # Objects are compiled against one Python's headers: never reuse them for another.
    build_dir = BUILD_DIR / suffix.strip(".").removesuffix(".so")
    build_dir.mkdir(parents=True, exist_ok=True)
    flags = [
        "-std=c++17",
        "-O2",
        "-fPIC",
        "-fvisibility=hidden",
        "-Wall",
        "-Wextra",
        "-Wno-unused-parameter",
        f"-I{pybind11.get_include()}",
        f"-I{sysconfig.get_paths()['include']}",
        f"-I{CSRC}",
        f"-I{INCLUDE}",
    ]
    sources = sorted(CSRC.rglob("*.cpp"))
    headers = [
        *CSRC.rglob("*.hpp"),
        INCLUDE / "mori" / "device" / "proxy_ring.cuh",
    ]  # the layout shared with device code
    newest_header = max((h.stat().st_mtime for h in headers), default=0.0)

    def compile_one(src: Path) -> Path:
        # A plane's folder is part of the name: csrc/gpu/staging.cpp -> gpu.staging.o
        obj = build_dir / (".".join(src.relative_to(CSRC).with_suffix("").parts) + ".o")
        if not obj.exists() or obj.stat().st_mtime < max(src.stat().st_mtime, newest_header):
            _run([cxx, *flags, "-c", str(src), "-o", str(obj)])
        return obj

    jobs = int(os.environ.get("MORI_BUILD_JOBS", os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        objects = list(pool.map(compile_one, sources))
    _run([cxx, "-shared", *[str(o) for o in objects], "-o", str(target), "-pthread", "-ldl"])
    return target


try:
    from hatchling.builders.hooks.plugin.interface import BuildHookInterface
except ImportError:  # run as a script without hatchling installed
    BuildHookInterface = object  # type: ignore[assignment,misc]


class NativeBuildHook(BuildHookInterface):  # type: ignore[misc,valid-type]
    """Hatchling hook: build the extension and mark the wheel as platform specific."""

    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict) -> None:
        if self.target_name not in ("wheel", "editable"):
            return
        try:
            target = build_native()
        except NativeBuildError as err:
            print(f"\nerror: {err}\n", file=sys.stderr)
            raise SystemExit(1) from None
        # Only this interpreter's extension goes into the wheel, not others left in src/ by
        # builds for other Pythons.
        build_data["force_include"][str(target)] = f"mori/core/{target.name}"
        build_data["pure_python"] = False
        build_data["infer_tag"] = True


if __name__ == "__main__":
    print(build_native())
