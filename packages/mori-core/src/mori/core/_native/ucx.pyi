# mori.core._native.ucx (csrc/ucx/, csrc/same_host/, csrc/proxy/): mori-core's UCX engine and its remote atomics.
from collections.abc import Callable
from typing import SupportsFloat, SupportsIndex

from .batch import Batch
from .gpu import Stager
from .inbound import InboundRecords
from .memory import LiveRanges

_Int = SupportsIndex

class UcxLoadError(RuntimeError): ...

def ucx_load(candidates: list[tuple[str, str]]) -> dict[str, object]: ...
def ucx_library() -> dict[str, object]: ...
def ucx_components() -> list[tuple[str, list[str]]]: ...
def ucx_finished() -> UcxTransfer: ...

class UcxTransfer:
    def code(self) -> int: ...
    def message(self) -> str: ...
    def wait(self, timeout: SupportsFloat) -> bool: ...

class UcxLane:
    @property
    def start(self) -> Callable[[_Int, _Int, _Int, _Int, _Int], UcxTransfer | None]: ...

class UcxPeer:
    @property
    def key(self) -> str: ...
    def submit(
        self,
        op: _Int,
        local_id: _Int,
        batch: Batch,
        remote_id: _Int,
        uid: _Int = 0,
        notify: bool = False,
        remote_gpu: bool = False,
    ) -> UcxTransfer: ...
    def lane(self, local_id: _Int, remote_id: _Int, notify: bool, remote_gpu: bool, refused: str) -> UcxLane: ...
    def run_one(
        self,
        op: _Int,
        local_id: _Int,
        src: _Int,
        dst: _Int,
        bytes: _Int,
        remote_id: _Int,
        remote_gpu: bool,
        timeout: SupportsFloat,
    ) -> tuple[int, str]: ...
    @property
    def same_host(self) -> bool: ...
    @property
    def same_host_refusal(self) -> str: ...
    @property
    def same_host_path(self) -> str: ...
    def healthy(self) -> bool: ...
    def failure(self) -> str: ...
    def describe(self) -> str: ...
    def fail(self, why: str) -> None: ...
    def close(self) -> None: ...

UCX_STAGING_BYTES: int

class UcxHeapWindow:
    def __init__(
        self,
        engine: UcxEngine,
        live: LiveRanges,
        base: _Int,
        size: _Int,
        reserved: _Int,
        chunk: _Int,
        first_id: _Int,
        gpu: bool,
        peers: list[UcxPeer | None],
        timeout: SupportsFloat,
    ) -> None: ...
    def grow(self, end: _Int) -> None: ...
    @property
    def registered(self) -> int: ...
    def register_buffer(self, addr: _Int, bytes: _Int, gpu: bool) -> None: ...
    def deregister_buffer(self, addr: _Int) -> bool: ...
    def put(
        self, pe: int, offset: _Int, local: _Int, bytes: _Int, local_gpu: bool = False
    ) -> tuple[int, str] | None: ...
    def get(
        self, pe: int, offset: _Int, local: _Int, bytes: _Int, local_gpu: bool = False
    ) -> tuple[int, str] | None: ...
    def put_signal(
        self, pe: int, offset: _Int, local: _Int, bytes: _Int, local_gpu: bool, sig_offset: _Int, op: int, value: _Int
    ) -> tuple[int, str] | None: ...
    def atomic(
        self, pe: int, op: int, offset: _Int, value: _Int, compare: _Int, width: int
    ) -> int | tuple[int, str]: ...
    def quick_put(self, dest: int, src: _Int, nbytes: _Int, pe: int) -> bool | tuple[int, str] | None: ...
    def stats(self) -> dict[str, int]: ...
    def close(self) -> None: ...

MAX_EAGER_BYTES: int

class UcxEngine:
    def __init__(
        self,
        name: str = "mori",
        settings: list[tuple[str, str]] = [],
        workers: _Int = 1,
        lanes: _Int = 1,
        polling: bool = True,
        timeout: SupportsFloat = 30.0,
        timeout_setting: str = "timeout",
        rma: bool = False,
        max_inbound: _Int = 1048576,
        inbound_ttl: SupportsFloat = 3600.0,
        max_tickets: _Int = 65536,
        inbound: InboundRecords | None = None,
        same_host: bool = True,
        send_queue: _Int = 0,
        send_queue_wait: SupportsFloat = 5.0,
        round_robin: bool = True,
        stand_aside: bool = True,
        same_host_direct: bool = True,
    ) -> None: ...
    @property
    def addresses(self) -> list[bytes]: ...
    @property
    def same_host_address(self) -> bytes: ...
    @property
    def cuda_supported(self) -> bool: ...
    @property
    def eager_bytes(self) -> int: ...
    @eager_bytes.setter
    def eager_bytes(self, value: _Int) -> None: ...
    @property
    def settings(self) -> list[tuple[str, str]]: ...
    def register_memory(self, mem_id: _Int, addr: _Int, size: _Int, gpu: bool = False) -> bytes: ...
    def deregister_memory(self, mem_id: _Int) -> bool: ...
    def store_mark(self) -> int: ...
    def next_store(self, addr: _Int, width: _Int, since: _Int, timeout: float) -> tuple[int | None, int, bool]: ...
    def admit(self, key: str) -> int: ...
    def connect(
        self, key: str, addresses: list[bytes], ticket: _Int, same_host: bytes = b"", stages_gpu: bool = False
    ) -> UcxPeer: ...
    def fail_peer(self, key: str, why: str) -> None: ...
    def pop_inbound(self, key: str, uid: _Int) -> int | None: ...
    def inbound_count(self) -> int: ...
    def stats(self) -> dict[str, int]: ...
    def describe(self) -> str: ...
    def close(self) -> None: ...

def ucx_atomic(
    engine: UcxEngine,
    peer: UcxPeer,
    op: _Int,
    mem_id: _Int,
    offset: _Int,
    value: _Int,
    compare: _Int,
    width: _Int,
    timeout: SupportsFloat,
) -> int: ...

UCX_MAX_SIGNAL_PUT_BYTES: int

def ucx_signal_put(
    engine: UcxEngine,
    peer: UcxPeer,
    mem_id: _Int,
    offset: _Int,
    src: _Int,
    size: _Int,
    sig_mem_id: _Int,
    sig_offset: _Int,
    op: _Int,
    value: _Int,
    timeout: SupportsFloat,
) -> None: ...

UCX_GPU_ENTRY_POINTS: tuple[str, ...]

def ucx_serve_gpu(
    engine: UcxEngine,
    context: _Int,
    function: _Int,
    stream: _Int,
    result: _Int,
    result_dev: _Int,
    entry_points: dict[str, int],
    bounce: _Int,
    bounce_bytes: _Int,
    stage: bool,
) -> None: ...
def ucx_stage_gpu(engine: UcxEngine, stager: Stager) -> None: ...
def ucx_stop_serving_gpu(engine: UcxEngine) -> None: ...

PROXY_SLOTS: int
PROXY_SLOT_BYTES: int
PROXY_HEADER_BYTES: int

class UcxProxy:
    def __init__(self, window: UcxHeapWindow, ring: _Int, bounce: _Int) -> None: ...
    def wait_idle(self, timeout: SupportsFloat) -> bool: ...
    def failure(self) -> str: ...
    def executed(self) -> int: ...
    def stop(self) -> None: ...
