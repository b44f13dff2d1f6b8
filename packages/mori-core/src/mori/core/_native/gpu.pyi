# mori.core._native.gpu (csrc/gpu_copy.cpp): the host side of GPU batch copies.
from typing import SupportsIndex

from numpy.typing import ArrayLike

_Int = SupportsIndex

def memcpy_batch(entry: _Int, dsts: ArrayLike, srcs: ArrayLike, sizes: ArrayLike, stream: _Int) -> int: ...

class GatherLauncher:
    def __init__(self, cu_launch_kernel: _Int, cu_memcpy_htod_async: _Int, cu_event_record: _Int, function: _Int,
                 threads: _Int, max_blocks: _Int) -> None: ...
    def grid(self, warps: _Int) -> int: ...
    def launch(self, stream: _Int, table_host: _Int, table_dev: _Int, rows: _Int, per_row: _Int, piece: _Int,
               src0: _Int, dst0: _Int, bytes0: _Int, single_piece: _Int, event: _Int) -> tuple[int, str]: ...
