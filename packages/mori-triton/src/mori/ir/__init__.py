"""MORI's spelling of the Triton integration: ``from mori.ir import triton`` and friends.

Kept so that kernels written for AMD's MORI run with no change beyond the install. The real
implementation is :mod:`mori.triton`.
"""

from mori.triton._table import SIGNAL_ADD, SIGNAL_SET

from .bitcode import find_bitcode, get_bitcode_path
from .ops import MORI_DEVICE_FUNCTIONS

__all__ = ["MORI_DEVICE_FUNCTIONS", "SIGNAL_ADD", "SIGNAL_SET", "find_bitcode", "get_bitcode_path"]
