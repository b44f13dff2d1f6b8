"""``mori.ir.bitcode``: where ``libmori_shmem_device.bc`` is (MORI's module path and names).

``find_bitcode(cov=...)`` as MORI calls it, ``find_bitcode(arch=...)`` as mori.triton does, and
``get_bitcode_path``, MORI's alias.
"""

from mori.triton._bitcode import find_bitcode

__all__ = ["find_bitcode", "get_bitcode_path"]


def get_bitcode_path(*, cov: int | None = None) -> str:
    """The same as :func:`find_bitcode` (MORI's alias)."""
    return find_bitcode(cov=cov)
