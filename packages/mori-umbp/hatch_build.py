"""Builds ``mori.umbp._grpc_native``, the optional gRPC C++ transport, where gRPC C++ is installed.

Run by hatchling for wheels and editable installs; ``python hatch_build.py`` rebuilds it in place
for development. The module is a speedup, not a requirement: where ``pkg-config`` finds no
``grpc++`` and ``libxxhash`` (Debian: ``apt-get install libgrpc++-dev libxxhash-dev``), or ``MORI_UMBP_NATIVE_BUILD=0`` is set,
the build says so and mori-umbp installs pure Python, its gRPC calls going through grpcio. A module
built here needs the system's gRPC C++ libraries at run time; where they are missing it does not
load and mori.umbp uses grpcio (``mori.umbp._grpc`` decides).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent
CSRC = HERE / "csrc"
#: The module's sources; its headers are in the same folder.
SOURCES = [CSRC / "grpc_native.cpp", CSRC / "peer_ssd.cpp"]
OUT_DIR = HERE / "src" / "mori" / "umbp"


class NativeBuildError(RuntimeError):
    """The module could not be built; the message says why (the command and the tool's output)."""


def _library_flags() -> list[str]:
    """Compiler and linker flags of gRPC C++ and xxHash (the SSD reads' checksums), by pkg-config."""
    pkg_config = shutil.which("pkg-config")
    if pkg_config is None:
        raise NativeBuildError("no pkg-config (Debian/Ubuntu: apt-get install pkg-config)")
    for package, debian in (("grpc++", "libgrpc++-dev"), ("libxxhash", "libxxhash-dev")):
        if subprocess.run([pkg_config, "--exists", package]).returncode != 0:
            raise NativeBuildError(f"pkg-config finds no {package} (Debian/Ubuntu: apt-get install {debian})")
    out = subprocess.run(
        [pkg_config, "--cflags", "--libs", "grpc++", "libxxhash"], capture_output=True, text=True, check=True
    )
    return shlex.split(out.stdout)


def build_native() -> Path:
    """Compiles and links the module into ``src/mori/umbp`` (skipped when it is up to date)."""
    import pybind11

    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        raise NativeBuildError("no C++17 compiler (Debian/Ubuntu: apt-get install g++), or set CXX")
    libraries = _library_flags()
    target = OUT_DIR / f"_grpc_native{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    newest = max(p.stat().st_mtime for p in CSRC.iterdir() if p.suffix in (".cpp", ".h"))
    if target.exists() and target.stat().st_mtime >= newest:
        return target
    cmd = [
        cxx,
        "-std=c++17",
        "-O2",
        "-fPIC",
        "-shared",
        "-fvisibility=hidden",
        "-Wall",
        "-Wextra",
        "-Wno-unused-parameter",
        f"-I{pybind11.get_include()}",
        f"-I{sysconfig.get_paths()['include']}",
        *map(str, SOURCES),
        "-o",
        str(target),
        *libraries,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise NativeBuildError(f"{shlex.join(cmd)}\n{(proc.stderr or proc.stdout).strip()}")
    return target


try:
    from hatchling.builders.hooks.plugin.interface import BuildHookInterface
except ImportError:  # run as a script without hatchling installed
    BuildHookInterface = object  # type: ignore[assignment,misc]


class NativeBuildHook(BuildHookInterface):  # type: ignore[misc,valid-type]
    """Hatchling hook: build the module where gRPC C++ is installed, else leave the package pure."""

    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict) -> None:
        if self.target_name not in ("wheel", "editable"):
            return
        if os.environ.get("MORI_UMBP_NATIVE_BUILD", "").strip() == "0":
            print("mori-umbp: MORI_UMBP_NATIVE_BUILD=0, the gRPC C++ transport is not built", file=sys.stderr)
            return
        try:
            target = build_native()
        except NativeBuildError as err:
            print(f"mori-umbp: the gRPC C++ transport is not built, gRPC goes through grpcio: {err}", file=sys.stderr)
            return
        build_data["force_include"][str(target)] = f"mori/umbp/{target.name}"
        build_data["pure_python"] = False
        build_data["infer_tag"] = True


if __name__ == "__main__":
    try:
        print(build_native())
    except NativeBuildError as err:
        sys.exit(f"error: {err}")
