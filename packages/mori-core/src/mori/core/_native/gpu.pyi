# mori.core._native.gpu (csrc/gpu/): the host side of GPU batch copies and GPU staging.
from typing import SupportsIndex

from numpy.typing import ArrayLike

_Int = SupportsIndex

BATCH_REFUSALS: tuple[int, ...]

def memcpy_batch(entry: _Int, dsts: ArrayLike, srcs: ArrayLike, sizes: ArrayLike, stream: _Int) -> int: ...

class GatherLauncher:
    def __init__(
        self,
        cu_launch_kernel: _Int,
        cu_memcpy_htod_async: _Int,
        cu_event_record: _Int,
        function: _Int,
        threads: _Int,
        max_blocks: _Int,
    ) -> None: ...
    def grid(self, warps: _Int) -> int: ...
    def launch(
        self,
        stream: _Int,
        table_host: _Int,
        table_dev: _Int,
        rows: _Int,
        per_row: _Int,
        piece: _Int,
        src0: _Int,
        dst0: _Int,
        bytes0: _Int,
        single_piece: _Int,
        event: _Int,
    ) -> tuple[int, str]: ...

STAGING_ENTRY_POINTS: tuple[str, ...]
STAGING_OPTIONAL_ENTRY_POINTS: tuple[str, ...]
STAGING_CACHE_BYTES: int

class Staged:
    @property
    def address(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def pinned(self) -> bool: ...
    def copied(self) -> bool: ...
    def wait(self) -> None: ...
    def release(self) -> None: ...

class Stager:
    def __init__(
        self,
        context: _Int,
        streams: list[int],
        entry_points: dict[str, int],
        timeout: float,
        timeout_setting: str = "timeout",
        cache_bytes: _Int = ...,
        owner: str = "mori",
    ) -> None: ...
    def to_host(self, src: _Int, nbytes: _Int, wait: bool = True) -> Staged: ...
    def landing(self, nbytes: _Int) -> Staged: ...
    def to_device(self, dst: _Int, staged: Staged, wait: bool = True) -> None: ...
    def to_device_then_store(self, dst: _Int, staged: Staged, word: _Int, value: _Int, wait: bool = True) -> None: ...
    def gather_to_host(self, ranges: list[tuple[int, int]], wait: bool = True) -> Staged: ...
    def scatter_to_device(self, ranges: list[tuple[int, int]], staged: Staged, wait: bool = True) -> None: ...
    def stats(self) -> dict[str, int]: ...
    def check_device_memory(self, addr: _Int, nbytes: _Int) -> None: ...
    @property
    def cache_bytes(self) -> int: ...
    @property
    def lanes(self) -> int: ...
    @property
    def batched(self) -> bool: ...
    def close(self) -> None: ...

def host_standin_stager(timeout: float = 30.0, cache_bytes: _Int = ...) -> Stager: ...
def host_standin_knobs(
    fail_copy_in: _Int = -1,
    fail_pinning: bool = False,
    delay: float = 0.0,
    hang: bool = False,
    fail_later: bool = False,
    refuse_batch: bool = False,
) -> None: ...
def host_standin_counters() -> dict[str, int]: ...
def host_standin_make_current() -> None: ...
