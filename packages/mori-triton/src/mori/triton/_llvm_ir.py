"""The LLVM IR path (and the MLIR path's back end): kernels that call ``@mori_shmem_*``.

No clang is needed: Triton's own MLIR and LLVM (``triton._C.libtriton``) translate MLIR to LLVM IR,
link the device bitcode and emit PTX, Triton's ``ptxas`` makes the cubin, and :class:`IrModule`
loads it with the CUDA driver and writes mori's device state into it with ``shmem_module_init``.

Linking: Triton's linker pulls in only the library functions a module declares. An MLIR module
(path 2, :mod:`mori.triton.mlir`) is linked as it is. LLVM IR text cannot be parsed into a module
through Triton's bindings, so for it the library part is produced from a declaration-only MLIR
module (one ``llvm.func`` per symbol the kernel calls, from the device-function table), then the
kernel's definitions are appended as text.
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

__all__ = ["declarations", "compile_ir", "compile_mlir_text", "mlir_signature", "IrModule"]

_TRIPLE = "nvptx64-nvidia-cuda"
_LLVM_TYPES = {"i32": "i32", "u32": "i32", "i64": "i64", "u64": "i64", "f32": "float", "f64": "double", "ptr": "i64"}
_MLIR_TYPES = {"i32": "i32", "u32": "i32", "i64": "i64", "u64": "i64", "f32": "f32", "f64": "f64", "ptr": "i64"}
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


def mlir_signature(symbol: str) -> tuple[list[str], str]:
    """``(parameter types, result type)`` of table function ``symbol`` in MLIR's llvm dialect."""
    f = _BY_SYMBOL[symbol]
    return [_MLIR_TYPES[t] for _, t in f.args], _MLIR_TYPES[f.ret]


def _mlir_declarations(symbols: Sequence[str]) -> str:
    decls = []
    for s in symbols:
        params, ret = mlir_signature(s)
        decls.append(f"  llvm.func @{s}({', '.join(params)}) -> {ret}")
    return "module {\n" + "\n".join(decls) + "\n}\n"


def _link_mlir(mlir_text: str, arch: str, bitcode: str) -> str:
    """Translates MLIR text (llvm and nvvm dialects) with Triton's MLIR and links the bitcode into it.

    The linker pulls in only the library functions the module declares; returns LLVM IR text.
    """
    from triton._C.libtriton import ir, llvm, nvidia

    context = ir.context()
    ir.load_dialects(context)
    nvidia.load_dialects(context)  # nvvm ops and the nvvm.kernel marker (-> ptx_kernel) translate
    with tempfile.TemporaryDirectory(prefix="mori-ir-") as tmp:
        path = Path(tmp) / "module.mlir"
        path.write_text(mlir_text)
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
    called = sorted(set(_CALLED_RE.findall(kernel_ir)))
    unknown = [s for s in called if s not in _BY_SYMBOL]
    if unknown:
        raise BitcodeError(f"kernel IR calls symbols the device library does not define: {', '.join(unknown)}")
    library = _link_mlir(_mlir_declarations(called), arch, bitcode or find_bitcode())
    body = _DECLARE_RE.sub("", kernel_ir)
    ptx = _ptx_in_child("llvm", library + "\n" + body, arch, "", "LLVM could not compile the kernel IR")
    return ptx, _assemble(ptx, arch)


def compile_mlir_text(mlir_text: str, arch: str, bitcode: str) -> tuple[str, bytes]:
    """The MLIR path's back end: MLIR text -> LLVM IR -> linked with ``bitcode`` -> ``(ptx, cubin)``."""
    ptx = _ptx_in_child("mlir", mlir_text, arch, bitcode, "MLIR could not translate or compile the module")
    return ptx, _assemble(ptx, arch)


_CHILD = "import sys; from mori.triton._llvm_ir import _translate_main; sys.exit(_translate_main(sys.argv[1:]))"


def _ptx_in_child(mode: str, text: str, arch: str, bitcode: str, what: str) -> str:
    # MLIR and LLVM abort the process on some malformed input: run them in a child so the caller
    # gets an error with their message instead.
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, mode, arch, _ptx_features(arch), bitcode],
        input=text,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0:
        raise BitcodeError(f"{what}:\n{done.stderr.strip()[-4000:]}")
    return done.stdout


def _assemble(ptx: str, arch: str) -> bytes:
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(_capability(arch)).path
    with tempfile.TemporaryDirectory(prefix="mori-ptxas-") as tmp:
        src, out = Path(tmp) / "kernel.ptx", Path(tmp) / "kernel.cubin"
        src.write_text(ptx)
        done = subprocess.run(
            [ptxas, f"--gpu-name={arch}", str(src), "-o", str(out)], capture_output=True, text=True, timeout=300
        )
        if done.returncode != 0:
            raise BitcodeError(f"ptxas failed ({done.returncode}): {done.stderr.strip()}")
        return out.read_bytes()


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
        _check(
            driver.cuLaunchKernel(function, grid, 1, 1, block, 1, 1, 0, stream, (values, types), 0),
            f"cuLaunchKernel({name})",
        )

    def unload(self) -> None:
        """Unloads the module."""
        from cuda.bindings import driver

        _check(driver.cuModuleUnload(self.module), "cuModuleUnload")


# Parameters that Triton's translate_to_asm gained after the seven (llvm_ir, triple, proc, features,
# flags, enable_fp_fusion, is_object) of every supported release, with the value mori passes: Triton
# 3.9 added canonicalize_gep, which its own compiler sets only for its float sanitizer.
_ASM_ADDED = {"canonicalize_gep": False}
_ASM_BASE_ARGS = 7


def _binding_parameters(fn: Any) -> list[tuple[str, bool]]:
    """``[(name, has_default), ...]`` of a pybind11 or nanobind function.

    Neither kind of binding gives :func:`inspect.signature` anything to read; both write the
    signature as the first line of the docstring, ``name(a: T, b: U = x) -> R``, which is parsed here.
    """
    line = (getattr(fn, "__doc__", None) or "").lstrip().split("\n", 1)[0]
    start, end = line.find("("), line.rfind(") ->")
    if start < 0 or end < start:
        raise BitcodeError(f"cannot read the parameters of {fn!r} from its docstring {line!r}")
    params, depth, current = [], 0, ""
    for ch in line[start + 1 : end] + ",":
        if ch == "," and depth == 0:
            if current.strip():
                params.append(current.strip())
            current = ""
            continue
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        current += ch
    return [(p.split(":", 1)[0].split("=", 1)[0].strip(), "=" in p) for p in params]


def _translate_to_asm(llvm: Any, text: str, arch: str, features: str) -> str:
    """Triton's LLVM IR -> PTX, called with the parameters this Triton release takes (read off its signature)."""
    params = _binding_parameters(llvm.translate_to_asm)
    added = [name for name, has_default in params[_ASM_BASE_ARGS:] if not has_default]
    unknown = [name for name in added if name not in _ASM_ADDED]
    if len(params) < _ASM_BASE_ARGS or unknown:
        raise BitcodeError(
            f"this Triton's llvm.translate_to_asm takes parameters mori does not know: "
            f"{llvm.translate_to_asm.__doc__.splitlines()[0]}"
        )
    return str(
        llvm.translate_to_asm(
            text, _TRIPLE, arch, features, [], False, False, **{name: _ASM_ADDED[name] for name in added}
        )
    )


def _translate_main(argv: list[str]) -> int:
    """Child side of :func:`_ptx_in_child` (argv: mode, arch, features, bitcode): stdin -> PTX on stdout.

    Mode ``llvm``: stdin is linked LLVM IR. Mode ``mlir``: stdin is MLIR, translated and linked first.
    """
    from triton._C.libtriton import llvm

    mode, arch, features, bitcode = argv
    text = sys.stdin.read()
    try:
        if mode == "mlir":
            text = _link_mlir(text, arch, bitcode)
        llvm.init_targets()
        ptx = _translate_to_asm(llvm, text, arch, features)
    except (RuntimeError, ValueError) as e:  # MLIR/LLVM printed their diagnostics to stderr already
        print(f"error: {e}", file=sys.stderr)
        return 1
    sys.stdout.write(ptx)
    return 0
