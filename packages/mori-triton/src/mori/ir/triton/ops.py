"""``mori.ir.triton.ops``: the generated externs (MORI's module path)."""

from mori.triton.shmem import *  # noqa: F403 - the generated externs are this module's API
from mori.triton.shmem import __all__ as __all__  # noqa: PLC0414
