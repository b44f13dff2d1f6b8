"""``from mori.ir import triton as mori_shmem_device``: the externs plus the runtime helpers (MORI's spelling)."""

from mori.triton._runtime import get_extern_libs, install_hook
from mori.triton.shmem import *  # noqa: F403 - the generated externs are this module's API
from mori.triton.shmem import __all__ as _externs

__all__ = [*_externs, "get_extern_libs", "install_hook"]
