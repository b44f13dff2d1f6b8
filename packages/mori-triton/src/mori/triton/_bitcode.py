"""Finding and building ``libmori_shmem_device.bc``, the device library Triton kernels link.

The bitcode is built on a machine with clang-19 (the GPU machines have none) from mori-core's
device headers and the generated wrapper file, and shipped inside the wheel. Both inputs ship in
the wheels too (mori-core's headers, ``mori/triton/csrc/``), so an installed mori-triton can
rebuild it: ``python -m mori.triton._bitcode``. Beside it lies
``libmori_shmem_device.json``: the sha256 of every input (wrapper, headers, flags), the defined
symbols and the compiler that built it, so a test can tell whether the committed file is stale
without demanding byte-identical output from another clang build.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from mori.core import config, nvrtc

from ._gen import WRAPPER_PATH

__all__ = [
    "BitcodeError",
    "DEFAULT_ARCH",
    "find_bitcode",
    "bundled_bitcode",
    "device_include_dir",
    "input_digest",
    "build_bitcode",
    "defined_functions",
]

DEFAULT_ARCH = "sm_90"
_LIB_DIR = Path(__file__).resolve().parent / "lib"
_NAME = "libmori_shmem_device"
CLANG_FLAGS = (
    "-x",
    "cuda",
    "-nocudainc",
    "-nocudalib",
    "--cuda-device-only",
    "-std=c++17",
    "-fgpu-flush-denormals-to-zero",
    "-O3",
    "-emit-llvm",
    "-Wno-unknown-cuda-version",
)
# The state TU: defines `globalGpuStates` once, visible to Triton's module and to shmem_module_init.
_STATE_SOURCE = "#define MORI_DEVICE_DEFINE_STATE\n#include <mori/device/shmem.cuh>\n"


class BitcodeError(RuntimeError):
    """The device bitcode is missing, stale, or could not be built."""


def bundled_bitcode(arch: str = DEFAULT_ARCH) -> Path:
    """Path of the packaged bitcode for ``arch`` (``sm_90`` is ``libmori_shmem_device.bc``)."""
    name = f"{_NAME}.bc" if arch == DEFAULT_ARCH else f"{_NAME}_{arch}.bc"
    return _LIB_DIR / name


def find_bitcode(arch: str = DEFAULT_ARCH, *, cov: int | None = None) -> str:
    """Path of the device bitcode to link: ``MORI_SHMEM_BC`` if set, else the packaged one for ``arch``.

    ``cov`` is MORI's keyword (the AMDGPU code-object version, 5 for Triton, 6 for FlyDSL): CUDA
    bitcode has no code-object version, so any int (or None) gives the same file.
    """
    if cov is not None and (isinstance(cov, bool) or not isinstance(cov, int) or cov < 1):
        raise ValueError(f"cov must be a positive int (an AMDGPU code-object version) or None, got {cov!r}")
    override = config.get("MORI_SHMEM_BC")
    if override:
        if not Path(override).is_file():
            raise BitcodeError(f"MORI_SHMEM_BC={override!r} is not a file")
        return str(override)
    path = bundled_bitcode(arch)
    if not path.is_file():
        raise BitcodeError(
            f"no packaged device bitcode for {arch} at {path}; build it with "
            f"`python -m mori.triton._bitcode --arch {arch}` or set MORI_SHMEM_BC"
        )
    return str(path)


def device_include_dir() -> Path:
    """mori-core's device-header directory (the one containing ``mori/device/shmem.cuh``): inside
    its installed wheel, or its source tree in an editable install."""
    return Path(nvrtc.device_include_dir())


def input_digest(arch: str = DEFAULT_ARCH, include_dir: Path | None = None) -> str:
    """sha256 over the wrapper source, every device header, the flags and the arch."""
    include_dir = include_dir or device_include_dir()
    h = hashlib.sha256()
    h.update(" ".join((*CLANG_FLAGS, arch)).encode())
    h.update(_STATE_SOURCE.encode())
    h.update(WRAPPER_PATH.read_bytes())
    for header in sorted((include_dir / "mori" / "device").rglob("*")):
        if header.is_file():
            h.update(header.relative_to(include_dir).as_posix().encode())
            h.update(header.read_bytes())
    return h.hexdigest()


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise BitcodeError(f"{name} not found on PATH; install clang-19 and llvm-19 (ci/setup.sh does)")
    return path


def _run(cmd: list[str], cwd: Path) -> str:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise BitcodeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr.strip()}")
    return done.stdout


_DEFINE_RE = re.compile(r"^define\b[^@]*?(\w+|\{[^}]*\})\s+@(\w+)\(([^)]*)\)", re.MULTILINE)


def defined_functions(bitcode: str | Path) -> dict[str, tuple[str, tuple[str, ...]]]:
    """``{symbol: (LLVM return type, (LLVM parameter types...))}`` of the functions a bitcode defines."""
    text = _run([_tool("llvm-dis-19"), str(bitcode), "-o", "-"], Path.cwd())
    found = {}
    for ret, name, params in _DEFINE_RE.findall(text):
        types = tuple(p.strip().split()[0] for p in params.split(",") if p.strip())
        found[name] = (ret, types)
    return found


def build_bitcode(out: str | Path | None = None, arch: str = DEFAULT_ARCH, include_dir: Path | None = None) -> Path:
    """Compiles wrapper + state with clang-19, links them with llvm-link-19, writes the sidecar.

    Returns the path written (default: the packaged location for ``arch``).
    """
    if not re.fullmatch(r"sm_\d+a?", arch):
        raise BitcodeError(f"arch {arch!r} is not a CUDA arch such as 'sm_90'")
    include_dir = include_dir or device_include_dir()
    if not (include_dir / "mori" / "device" / "shmem.cuh").is_file():
        raise BitcodeError(f"device headers not found: {include_dir}/mori/device/shmem.cuh")
    out_path = Path(out) if out is not None else bundled_bitcode(arch)
    clang, link = _tool("clang-19"), _tool("llvm-link-19")
    with tempfile.TemporaryDirectory(prefix="mori-bc-") as tmp:
        work = Path(tmp)
        # Fixed file names and relative paths keep the output independent of where the build runs.
        (work / "wrappers.cu").write_bytes(WRAPPER_PATH.read_bytes())
        (work / "state.cu").write_text(_STATE_SOURCE)
        for unit in ("wrappers", "state"):
            _run(
                [
                    clang,
                    *CLANG_FLAGS,
                    f"--cuda-gpu-arch={arch}",
                    "-I",
                    str(include_dir),
                    "-c",
                    f"{unit}.cu",
                    "-o",
                    f"{unit}.bc",
                ],
                work,
            )
        _run([link, "wrappers.bc", "state.bc", "-o", "linked.bc"], work)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(work / "linked.bc", out_path)
    # The ABI: mori_shmem_* (the device API's own out-of-line helpers are C++-mangled, not listed).
    functions = {k: v for k, v in defined_functions(out_path).items() if k.startswith("mori_shmem_")}
    sidecar: dict[str, Any] = {
        "arch": arch,
        "input_sha256": input_digest(arch, include_dir),
        "compiler": _run([clang, "--version"], Path.cwd()).splitlines()[0],
        "functions": {k: [ret, list(params)] for k, (ret, params) in sorted(functions.items())},
    }
    out_path.with_suffix(".json").write_text(json.dumps(sidecar, indent=1, sort_keys=True) + "\n")
    return out_path


def main(argv: list[str] | None = None) -> int:
    """``python -m mori.triton._bitcode [--arch sm_90] [--out PATH]``: rebuild the device bitcode."""
    parser = argparse.ArgumentParser(prog="python -m mori.triton._bitcode", description=main.__doc__)
    parser.add_argument("--arch", default=DEFAULT_ARCH, help="CUDA arch, e.g. sm_90")
    parser.add_argument("--out", default=None, help="output path (default: the packaged location)")
    args = parser.parse_args(argv)
    print(f"wrote {build_bitcode(args.out, args.arch)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
