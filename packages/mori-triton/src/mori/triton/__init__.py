"""mori.triton: Triton kernels on mori symmetric memory.

- :mod:`mori.triton.shmem` -- mori's device API as Triton externs (``from mori.triton import shmem as ms``),
  generated from one table (:data:`DEVICE_FUNCTIONS`);
- :func:`find_bitcode` / :func:`get_extern_libs` -- the device library ``libmori_shmem_device.bc``;
- :func:`install_hook` / :func:`jit` -- module initialisation and launching without ``extern_libs``;
- :func:`compile_ir` / :class:`IrModule` -- kernels written as LLVM IR text;
- :func:`all_reduce` -- a one-launch NVLink all-reduce for bf16/fp16/fp32 tensors
  (:func:`default_all_reduce_config` and :func:`all_reduce_sweep` when tuning it).
"""

from importlib import metadata as _metadata

from . import shmem
from ._all_reduce import AllReduce, AllReduceConfig, all_reduce, all_reduce_sweep, default_all_reduce_config
from ._bitcode import BitcodeError, build_bitcode, find_bitcode
from ._llvm_ir import IrModule, compile_ir, declarations
from ._runtime import MoriKernel, get_extern_libs, init_loaded_modules, install_hook, jit, uninstall_hook
from ._table import FUNCTIONS as DEVICE_FUNCTIONS
from ._table import SIGNAL_ADD, SIGNAL_SET, DeviceFunction

__version__ = _metadata.version("mori-triton")

__all__ = [
    "AllReduce",
    "AllReduceConfig",
    "BitcodeError",
    "DEVICE_FUNCTIONS",
    "DeviceFunction",
    "IrModule",
    "MoriKernel",
    "SIGNAL_ADD",
    "SIGNAL_SET",
    "__version__",
    "all_reduce",
    "all_reduce_sweep",
    "build_bitcode",
    "compile_ir",
    "declarations",
    "default_all_reduce_config",
    "find_bitcode",
    "get_extern_libs",
    "init_loaded_modules",
    "install_hook",
    "jit",
    "shmem",
    "uninstall_hook",
]
