"""The LLVM IR path: kernels written as LLVM IR text that call ``@mori_shmem_*``.

No clang is needed: Triton's own LLVM (``triton._C.libtriton.llvm``) links the device bitcode and
emits PTX, Triton's ``ptxas`` makes the cubin, and :class:`IrModule` loads it with the CUDA driver
and writes mori's device state into it with ``shmem_module_init``.

Linking: Triton's linker pulls in only the library functions a module references, so the library
part is produced from a declaration-only module (one ``llvm.func`` per symbol the kernel
declares, from the device-function table), then the kernel's definitions are appended as text.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._bitcode import DEFAULT_ARCH, BitcodeError, find_bitcode
from ._table import FUNCTIONS

__all__ = ["declarations", "compile_ir", "IrModule"]

_TRIPLE = "nvptx64-nvidia-cuda"
_LLVM_TYPES = {"i32": "i32", "u32": "i32", "i64": "i64", "u64": "i64", "f32": "float", "f64": "double", "ptr": "i64"}
_BY_SYMBOL = {f.symbol: f for f in FUNCTIONS}
_CALLED_RE = re.compile(r"@(mori_shmem_\w+)")
_DECLARE_RE = re.compile(r"^\s*declare\b[^\n]*@(mori_shmem_\w+)\([^\n]*$", re.MULTILINE)


def declarations(symbols: Sequence[str] | None = None) -> str:
    """LLVM ``declare`` lines for ``symbols`` (default: every function of the table)."""
    chosen = [_BY_SYMBOL[s] for s in symbols] if symbols is not None else list(FUNCTIONS)
    lines = []
    for f in chosen:
        params = ", ".join(_LLVM_TYPES[t] for _, t in f.args)
        lines.append(f"declare {_LLVM_TYPES[f.ret]} @{f.symbol}({params})")
    return "\n".join(lines) + "\n"


def _mlir_declarations(symbols: Sequence[str]) -> str:
    decls = []
    for s in symbols:
        f = _BY_SYMBOL[s]
        params = ", ".join(_LLVM_TYPES[t].replace("float", "f32").replace("double", "f64") for _, t in f.args)
        ret = _LLVM_TYPES[f.ret].replace("float", "f32").replace("double", "f64")
        decls.append(f"  llvm.func @{s}({params}) -> {ret}")
    return "module {\n" + "\n".join(decls) + "\n}\n"


def _library_ir(symbols: Sequence[str], arch: str, bitcode: str) -> str:
    from triton._C.libtriton import ir, llvm

    context = ir.context()
    ir.load_dialects(context)
    with tempfile.TemporaryDirectory(prefix="mori-ir-") as tmp:
        path = Path(tmp) / "decls.mlir"
        path.write_text(_mlir_declarations(symbols))
        mlir_module = ir.parse_mlir_module(str(path), context)
    llvm.init_targets()
    llvm_context = llvm.context()
    module = llvm.to_module(mlir_module, llvm_context)
    llvm.attach_datalayout(module, _TRIPLE, arch, "")
    llvm.link_extern_libs(module, [bitcode])
    return str(module)


def _capability(arch: str) -> int:
    return int(arch.removeprefix("sm_").rstrip("a"))


def _ptx_features(arch: str) -> str:
    from triton.backends.nvidia.compiler import get_ptxas, ptx_get_version

    # As Triton does: the PTX version its ptxas supports, capped at what its LLVM knows (8.6).
    return f"+ptx{min(86, ptx_get_version(get_ptxas(_capability(arch)).version))}"


def compile_ir(kernel_ir: str, arch: str = DEFAULT_ARCH, bitcode: str | None = None) -> tuple[str, bytes]:
    """Links ``kernel_ir`` (LLVM IR text defining ``ptx_kernel`` functions) with the device bitcode.

    Returns ``(ptx, cubin)``. Every ``@mori_shmem_*`` the text calls must be in the table; its own
    ``declare`` lines for them are optional (they are replaced by the definitions).
    """
    from triton.backends.nvidia.compiler import get_ptxas

    called = sorted(set(_CALLED_RE.findall(kernel_ir)))
    unknown = [s for s in called if s not in _BY_SYMBOL]
    if unknown:
        raise BitcodeError(f"kernel IR calls symbols the device library does not define: {', '.join(unknown)}")
    library = _library_ir(called, arch, bitcode or find_bitcode())
    body = _DECLARE_RE.sub("", kernel_ir)
    # LLVM aborts the process on malformed IR: translate in a child so the caller gets an error.
    done = subprocess.run([sys.executable, "-m", "mori.triton._llvm_ir", arch, _ptx_features(arch)],
                          input=library + "\n" + body, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise BitcodeError(f"LLVM could not compile the kernel IR:\n{done.stderr.strip()[-4000:]}")
    ptx = done.stdout
    ptxas = get_ptxas(_capability(arch)).path
    with tempfile.TemporaryDirectory(prefix="mori-ptxas-") as tmp:
        src, out = Path(tmp) / "kernel.ptx", Path(tmp) / "kernel.cubin"
        src.write_text(str(ptx))
        done = subprocess.run([ptxas, f"--gpu-name={arch}", str(src), "-o", str(out)],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise BitcodeError(f"ptxas failed ({done.returncode}): {done.stderr.strip()}")
        return str(ptx), out.read_bytes()


def _check(result: Any, what: str) -> Any:
    from cuda.bindings import driver

    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {err}")
    return rest[0] if len(rest) == 1 else rest


class IrModule:
    """A cubin loaded into the current CUDA context with mori's device state written into it."""

    def __init__(self, cubin: bytes) -> None:
        from cuda.bindings import driver

        import mori.shmem

        self.module = _check(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
        mori.shmem.shmem_module_init(int(self.module))

    def launch(self, name: str, grid: int, block: int, args: Sequence[tuple[int, str]], stream: int = 0) -> None:
        """Launches kernel ``name`` with ``args`` given as ``(value, ctype)``, ctype in i32/i64."""
        import ctypes

        from cuda.bindings import driver

        function = _check(driver.cuModuleGetFunction(self.module, name.encode()), f"cuModuleGetFunction({name})")
        ctypes_of = {"i32": ctypes.c_int32, "i64": ctypes.c_int64}
        values = tuple(v for v, _ in args)
        types = tuple(ctypes_of[t] for _, t in args)
        _check(driver.cuLaunchKernel(function, grid, 1, 1, block, 1, 1, 0, stream, (values, types), 0),
               f"cuLaunchKernel({name})")

    def unload(self) -> None:
        """Unloads the module."""
        from cuda.bindings import driver

        _check(driver.cuModuleUnload(self.module), "cuModuleUnload")


def _translate_main(argv: list[str]) -> int:
    """Child side of :func:`compile_ir`: LLVM IR on stdin -> PTX on stdout (argv: arch, features)."""
    from triton._C.libtriton import llvm

    arch, features = argv
    llvm.init_targets()
    sys.stdout.write(str(llvm.translate_to_asm(sys.stdin.read(), _TRIPLE, arch, features, [], False, False)))
    return 0


if __name__ == "__main__":
    raise SystemExit(_translate_main(sys.argv[1:]))
