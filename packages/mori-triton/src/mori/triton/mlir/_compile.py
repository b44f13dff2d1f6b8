"""MLIR module -> checked -> LLVM IR linked with the device bitcode -> PTX and cubin.

The module is checked with MLIR's own bindings first (parse, verify, every ``mori_shmem_*``
declaration against the device-function table, at least one ``nvvm.kernel``), so a malformed
module fails here with MLIR's diagnostics. Translation, linking and code generation are path 3's
(:mod:`mori.triton._llvm_ir`): Triton's MLIR and LLVM, in a child process.
"""

from __future__ import annotations

from typing import Any

from .._bitcode import DEFAULT_ARCH, BitcodeError, find_bitcode
from .._llvm_ir import compile_mlir_text
from ._build import bindings, function_type

__all__ = ["compile_mlir", "check_module"]


def _parse(text: str) -> Any:
    ir, _ = bindings()
    with ir.Context():
        try:
            return ir.Module.parse(text)
        except ir.MLIRError as e:
            raise BitcodeError(f"the MLIR text does not parse: {e}") from None


def check_module(module: Any) -> list[str]:
    """Verifies ``module`` and its ``mori_shmem_*`` declarations; returns the names of its kernels.

    Raises :class:`~mori.triton.BitcodeError` naming what is wrong.
    """
    ir, _ = bindings()
    try:
        module.operation.verify()
    except ir.MLIRError as e:
        raise BitcodeError(f"the MLIR module does not verify: {e}") from None
    kernels, problems = [], []
    for op in module.body.operations:
        if op.operation.name != "llvm.func":
            continue
        name = ir.StringAttr(op.attributes["sym_name"]).value
        if "nvvm.kernel" in op.attributes:
            kernels.append(name)
        if not name.startswith("mori_shmem_"):
            continue
        declared = str(op.attributes["function_type"])
        try:
            expected = function_type(name)
        except ValueError as e:
            problems.append(str(e))
            continue
        if len(op.regions[0].blocks):
            problems.append(f"{name} has a body here, but the device library defines it")
        elif declared != expected:
            problems.append(
                f"{name} is declared {declared}, the device library defines {expected} "
                "(pointers cross as i64: llvm.ptrtoint; mori.triton.mlir.declare writes it)"
            )
    if problems:
        raise BitcodeError("the MLIR module's mori_shmem_* declarations are wrong:\n  " + "\n  ".join(problems))
    if not kernels:
        raise BitcodeError("the MLIR module has no kernel: mark the entry llvm.func with the nvvm.kernel attribute")
    return kernels


def compile_mlir(module: Any, arch: str = DEFAULT_ARCH, bitcode: str | None = None) -> tuple[str, bytes]:
    """Compiles an MLIR module (an ``mlir.ir.Module`` or its text) that calls ``mori_shmem_*``.

    The module uses the ``llvm`` (and ``nvvm``) dialects; its kernels are ``llvm.func`` ops marked
    ``nvvm.kernel``. It is checked (:func:`check_module`), translated to LLVM IR, linked with the
    device bitcode (``bitcode``, default :func:`~mori.triton.find_bitcode`) so every ``mori_shmem_*``
    call is inlined, and compiled for ``arch``. Returns ``(ptx, cubin)``; load the cubin with
    :class:`~mori.triton.IrModule`. Raises :class:`~mori.triton.BitcodeError` on a malformed module.
    """
    if isinstance(module, str):
        module = _parse(module)
    check_module(module)
    return compile_mlir_text(str(module), arch, bitcode or find_bitcode())
