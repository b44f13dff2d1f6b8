"""``mori.ir.bitcode.find_bitcode()``: path of ``libmori_shmem_device.bc`` (MORI's spelling)."""

from mori.triton._bitcode import find_bitcode

__all__ = ["find_bitcode"]
