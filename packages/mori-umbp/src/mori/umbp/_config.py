"""MORI's UMBP configuration classes: the same names, fields and defaults as its C++ structs
(``include/umbp/common/config.h``), typed as its Python binding types them.

Each class is a dataclass with slots: a field that does not exist raises ``AttributeError``, and a
value of the wrong type raises ``TypeError`` naming the field, as MORI's pybind11 classes do. A
field's type is its default's: ``bool``, an unsigned ``int`` (a negative one is refused), a signed
``int`` (those in ``_SIGNED``), ``float`` (an ``int`` is taken as a float), ``str``, an enum, a
list, or a nested configuration. :func:`validate` is MORI's ``UMBPConfig::Validate`` with its
messages, plus what this implementation cannot serve (SPDK).
"""

from __future__ import annotations

import dataclasses
import enum
import os
from typing import Any, ClassVar

from ._enums import (
    CacheRemoteAdmission,
    UMBPDurabilityMode,
    UMBPIoBackend,
    UMBPMedium,
    UMBPRole,
    UMBPSsdLayoutMode,
)
from ._env import _flag, _float, _int, _raw, _size, _str

GiB = 1 << 30
MiB = 1 << 20

#: Fields typed as signed ints in MORI (``int``); every other int field is unsigned (``size_t``).
_SIGNED = frozenset(
    {
        "prefault_threads",
        "shard_io_threads",
        "tier_io_threads",
        "spdk_mem_size_mb",
        "spdk_io_workers",
        "spdk_proxy_startup_timeout_ms",
        "spdk_proxy_idle_exit_timeout_ms",
        "ssd_staging_buffer_slots",
        "startup_timeout_ms",
        "device",
    }
)
#: Upper bounds of MORI's narrower unsigned fields (``uint16_t`` ports, ``uint32_t`` ids).
_BOUNDS = {
    "port": 0xFFFF,
    "peer_service_port": 0xFFFF,
    "spdk_proxy_tenant_id": 0xFFFFFFFF,
    "spdk_proxy_max_channels": 0xFFFFFFFF,
    "workload_trace_client_id": 0xFFFFFFFF,
}
_U64 = (1 << 64) - 1


def _checked(owner: type, name: str, default: Any, optional_type: type | None, value: Any) -> Any:
    """``value`` as field ``name`` of ``owner`` takes it, or a TypeError naming the field."""
    where = f"{owner.__name__}.{name}"
    if optional_type is not None:
        if value is None or isinstance(value, optional_type):
            return value
        raise TypeError(f"{where} must be a {optional_type.__name__} or None, not {type(value).__name__}")
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        raise TypeError(f"{where} must be a bool, not {type(value).__name__}")
    if isinstance(default, enum.Enum):
        if isinstance(value, type(default)):
            return value
        raise TypeError(f"{where} must be a {type(default).__name__}, not {type(value).__name__}")
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{where} must be an int, not {type(value).__name__}")
        low = -(1 << 31) if name in _SIGNED else 0
        high = (1 << 31) - 1 if name in _SIGNED else _BOUNDS.get(name, _U64)
        if not low <= value <= high:
            raise TypeError(f"{where} must be in [{low}, {high}], got {value}")
        return int(value)
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{where} must be a float, not {type(value).__name__}")
        return float(value)
    if isinstance(default, str):
        if isinstance(value, str):
            return value
        raise TypeError(f"{where} must be a str, not {type(value).__name__}")
    if isinstance(default, list):
        item = int if name == "numa_nodes" else str
        if isinstance(value, (list, tuple)) and all(isinstance(v, item) and not isinstance(v, bool) for v in value):
            return _normalize_numa_nodes(list(value)) if name == "numa_nodes" else list(value)
        raise TypeError(f"{where} must be a list of {item.__name__}, got {value!r}")
    if isinstance(value, type(default)):
        return value
    raise TypeError(f"{where} must be a {type(default).__name__}, not {type(value).__name__}")


class _Settings:
    """Typed attribute assignment for the dataclasses below (see the module's docstring)."""

    __slots__ = ()
    #: Fields that hold an optional nested configuration (None by default), and its class.
    _OPTIONAL: ClassVar[dict[str, type]] = {}
    _DEFAULTS: ClassVar[dict[str, Any]]

    def __setattr__(self, name: str, value: Any) -> None:
        cls = type(self)
        defaults = cls.__dict__.get("_DEFAULTS")
        if defaults is None:  # first assignment: learn each field's default from a bare instance
            defaults = {
                f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())  # type: ignore[misc,operator]
                for f in dataclasses.fields(cls)  # type: ignore[arg-type]
            }
            type.__setattr__(cls, "_DEFAULTS", defaults)
        if name in defaults:
            value = _checked(cls, name, defaults[name], cls._OPTIONAL.get(name), value)
        object.__setattr__(self, name, value)


def _normalize_numa_nodes(nodes: list[int]) -> list[int]:
    """MORI's ``NormalizeNumaNodes``: sorted, without repeats; -1 (no binding) drops out."""
    if any(n < -1 for n in nodes):
        raise ValueError(f"numa node ids must be >= 0 (or -1 for none), got {nodes}")
    return sorted({n for n in nodes if n >= 0})


@dataclasses.dataclass(slots=True)
class UMBPDramConfig(_Settings):
    """The DRAM tier: host memory that holds pages, and its eviction watermarks."""

    capacity_bytes: int = 4 * GiB
    use_shared_memory: bool = False
    shm_name: str = "/umbp_dram"
    high_watermark: float = 0.9
    low_watermark: float = 0.7
    use_hugepages: bool = False
    hugepage_size: int = 2 * MiB
    numa_nodes: list[int] = dataclasses.field(default_factory=list)
    numa_strict: bool = False
    prefault_threads: int = 0
    prefault: bool = True

    @property
    def numa_node(self) -> int:
        """Deprecated (MORI's): the first of ``numa_nodes``, or -1; setting it replaces the list."""
        return self.numa_nodes[0] if self.numa_nodes else -1

    @numa_node.setter
    def numa_node(self, node: int) -> None:
        self.numa_nodes = _normalize_numa_nodes([node])


@dataclasses.dataclass(slots=True)
class UMBPIoConfig(_Settings):
    """The SSD tier's I/O: which interface (see :class:`UMBPIoBackend`) and how many operations
    may be queued."""

    backend: UMBPIoBackend = UMBPIoBackend.IoUring
    queue_depth: int = 4096


@dataclasses.dataclass(slots=True)
class UMBPDurabilityConfig(_Settings):
    """When a page written to SSD counts as stored (see :class:`UMBPDurabilityMode`)."""

    mode: UMBPDurabilityMode = UMBPDurabilityMode.Strict
    enable_background_gc: bool = True


@dataclasses.dataclass(slots=True)
class UMBPSsdConfig(_Settings):
    """The SSD tier: files in ``storage_dir`` (MORI's ``file`` backend). The ``spdk_*`` fields
    are MORI's and accepted, but SPDK is not implemented here (``ssd_backend`` must be
    ``file``)."""

    enabled: bool = True
    storage_dir: str = "/tmp/umbp_ssd"
    capacity_bytes: int = 32 * GiB
    layout_mode: UMBPSsdLayoutMode = UMBPSsdLayoutMode.SegmentedLog
    segment_size_bytes: int = 256 * MiB
    io: UMBPIoConfig = dataclasses.field(default_factory=UMBPIoConfig)
    durability: UMBPDurabilityConfig = dataclasses.field(default_factory=UMBPDurabilityConfig)
    shard_io_threads: int = 0
    tier_io_threads: int = 4
    direct_io: bool = True
    single_flight_reads: bool = True
    verify_crc: bool = True
    high_watermark: float = 0.9
    low_watermark: float = 0.7
    ssd_backend: str = "file"
    spdk_bdev_name: str = ""
    spdk_reactor_mask: str = "0x1"
    spdk_mem_size_mb: int = 256
    spdk_nvme_pci_addr: str = ""
    spdk_nvme_ctrl_name: str = "NVMe0"
    spdk_io_workers: int = 4
    spdk_proxy_shm_name: str = "/umbp_spdk_proxy"
    spdk_proxy_tenant_id: int = 0
    spdk_proxy_tenant_quota_bytes: int = 0
    spdk_proxy_max_channels: int = 8
    spdk_proxy_data_per_channel_mb: int = 32
    spdk_proxy_bin: str = ""
    spdk_proxy_startup_timeout_ms: int = 30000
    spdk_proxy_auto_start: bool = True
    spdk_proxy_idle_exit_timeout_ms: int = 30000
    spdk_proxy_allow_borrow: bool = False
    spdk_proxy_reserved_shared_bytes: int = 0


@dataclasses.dataclass(slots=True)
class UMBPEvictionConfig(_Settings):
    """How the DRAM tier picks pages to move to SSD: ``lru`` (least recently used first, pages
    put with a larger depth first among equals), looking at ``candidate_window`` pages at a
    time; with ``auto_promote_on_read`` an SSD hit is staged back into DRAM."""

    policy: str = "lru"
    candidate_window: int = 16
    auto_promote_on_read: bool = True


@dataclasses.dataclass(slots=True)
class UMBPCopyPipelineConfig(_Settings):
    """The workers that copy pages between DRAM and SSD off the caller's thread."""

    async_enabled: bool = True
    queue_depth: int = 4096
    worker_threads: int = 2
    batch_max_ops: int = 128


@dataclasses.dataclass(slots=True)
class UMBPMasterClientConfig(_Settings):
    """A cluster node's identity and its master (``host:port``)."""

    master_address: str = ""
    node_id: str = ""
    node_address: str = ""
    auto_heartbeat: bool = True
    tags: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(slots=True)
class UMBPIoEngineConfig(_Settings):
    """Where a node's mori-io engine listens (``port`` 0: one the system picks)."""

    host: str = ""
    port: int = 0


@dataclasses.dataclass(slots=True)
class UMBPHbmConfig(_Settings):
    """A node's GPU-memory pool, when ``UMBPDistributedConfig.medium`` is ``HBM``."""

    device: int = 0
    capacity_bytes: int = 0


@dataclasses.dataclass(slots=True)
class UMBPDistributedConfig(_Settings):
    """A node of a cluster: its master and identity (``master_config``), its mori-io engine
    (``io_engine``), its peer service's port, and how it caches what it fetches from peers."""

    master_config: UMBPMasterClientConfig = dataclasses.field(default_factory=UMBPMasterClientConfig)
    io_engine: UMBPIoEngineConfig = dataclasses.field(default_factory=UMBPIoEngineConfig)
    staging_buffer_size: int = 64 * MiB
    ranged_scratch_size: int = 0
    ssd_staging_buffer_size: int = 256 * MiB
    ssd_staging_buffer_slots: int = 16
    ssd_staging_use_hugepages: bool = False
    ssd_staging_hugepage_size: int = 2 * MiB
    peer_service_port: int = 0
    cache_remote_fetches: bool = True
    ranged_locality_prefetch: bool = True
    local_first: bool = True
    cache_remote_admission: CacheRemoteAdmission = CacheRemoteAdmission.SIZE
    admission_max_block_bytes: int = 16 * MiB
    dram_page_size: int = 0
    medium: UMBPMedium = UMBPMedium.DRAM
    hbm: UMBPHbmConfig = dataclasses.field(default_factory=UMBPHbmConfig)
    backend_policy_path: str = ""
    workload_trace_path: str = ""
    workload_trace_client_id: int = 0
    workload_trace_seed: int = 0


@dataclasses.dataclass(slots=True)
class UMBPStandaloneProcessConfig(_Settings):
    """The pool in a server process on this host, reached at ``address`` (``unix://PATH`` or
    ``HOST:PORT``); with ``auto_start`` the client starts the server when none answers."""

    address: str = ""
    auto_start: bool = False
    startup_timeout_ms: int = 30000
    worker_node_id: str = ""
    worker_node_address: str = ""
    tags: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(slots=True)
class UMBPConfig(_Settings):
    """Everything a :class:`UMBPClient` is built from. ``distributed`` makes the client a node of a
    cluster; ``standalone_process`` makes it a client of a pool in a server process; neither: a
    pool in this process."""

    _OPTIONAL: ClassVar[dict[str, type]] = {}  # filled below, once the nested classes exist

    dram: UMBPDramConfig = dataclasses.field(default_factory=UMBPDramConfig)
    ssd: UMBPSsdConfig = dataclasses.field(default_factory=UMBPSsdConfig)
    eviction: UMBPEvictionConfig = dataclasses.field(default_factory=UMBPEvictionConfig)
    copy_pipeline: UMBPCopyPipelineConfig = dataclasses.field(default_factory=UMBPCopyPipelineConfig)
    role: UMBPRole = UMBPRole.Standalone
    follower_mode: bool = False
    force_ssd_copy_on_write: bool = False
    distributed: UMBPDistributedConfig | None = None
    standalone_process: UMBPStandaloneProcessConfig | None = None

    @staticmethod
    def from_environment() -> UMBPConfig:
        """The defaults with the ``UMBP_*`` variables of this process's environment laid over
        them (MORI's ``UMBPConfig::FromEnvironment``; the table is in the guide)."""
        return _from_environment()


UMBPConfig._OPTIONAL = {"distributed": UMBPDistributedConfig, "standalone_process": UMBPStandaloneProcessConfig}

#: SSD backends MORI names. Only "file" is implemented here: SPDK is out of scope.
SSD_BACKENDS = ("file", "spdk", "spdk_proxy", "dummy_storage")


def validate(cfg: UMBPConfig) -> None:
    """MORI's ``UMBPConfig::Validate``: raises ValueError with its message for the first setting
    that cannot work, and for what this implementation does not serve."""
    if not isinstance(cfg, UMBPConfig):
        raise TypeError(f"config must be a UMBPConfig, not {type(cfg).__name__}")
    dram, ssd = cfg.dram, cfg.ssd
    if dram.capacity_bytes == 0:
        raise ValueError("dram.capacity_bytes must be > 0")
    if not (0.0 < dram.low_watermark < dram.high_watermark <= 1.0):
        raise ValueError("dram watermarks must satisfy 0 < low_watermark < high_watermark <= 1")
    if ssd.enabled:
        if ssd.ssd_backend not in SSD_BACKENDS:
            raise ValueError("ssd.ssd_backend must be one of: file, spdk, spdk_proxy, dummy_storage")
        if ssd.ssd_backend != "file":
            raise ValueError(
                f"ssd.ssd_backend {ssd.ssd_backend!r} is not supported by mori.umbp (SPDK is out of scope): use 'file'"
            )
        if ssd.capacity_bytes == 0:
            raise ValueError("ssd.capacity_bytes must be > 0")
        if ssd.segment_size_bytes == 0:
            raise ValueError("ssd.segment_size_bytes must be > 0")
        if ssd.segment_size_bytes % 4096 != 0:
            raise ValueError("ssd.segment_size_bytes must be a multiple of 4096")
        if not (0.0 < ssd.low_watermark < ssd.high_watermark <= 1.0):
            raise ValueError("ssd watermarks must satisfy 0 < low_watermark < high_watermark <= 1")
        if not ssd.storage_dir.strip():
            raise ValueError("ssd.storage_dir must not be empty")
    if dram.use_hugepages and dram.hugepage_size & (dram.hugepage_size - 1):
        raise ValueError("dram.hugepage_size must be a power of two")
    if cfg.eviction.policy != "lru":
        raise ValueError(f"eviction.policy must be 'lru', got {cfg.eviction.policy!r}")
    for name in ("queue_depth", "worker_threads", "batch_max_ops"):
        if getattr(cfg.copy_pipeline, name) == 0:
            raise ValueError(f"copy_pipeline.{name} must be > 0")
    if ssd.spdk_proxy_max_channels == 0:
        raise ValueError("ssd.spdk_proxy_max_channels must be > 0")
    dist = cfg.distributed
    if dist is not None:
        if not dist.master_config.node_id:
            raise ValueError("distributed.master_config.node_id must not be empty")
        if not dist.master_config.node_address:
            raise ValueError("distributed.master_config.node_address must not be empty")
        if dist.medium != UMBPMedium.DRAM:
            raise ValueError(
                f"distributed.medium {dist.medium.name} is not supported by mori.umbp: "
                "a node serves DRAM (with its SSD tier behind it)"
            )
    if dist is not None and cfg.standalone_process is not None:
        raise ValueError("distributed and standalone_process are mutually exclusive")
    sp = cfg.standalone_process
    if sp is not None:
        if not sp.address:
            raise ValueError("standalone_process.address must not be empty")
        if sp.startup_timeout_ms <= 0:
            raise ValueError("standalone_process.startup_timeout_ms must be > 0")


def _from_environment() -> UMBPConfig:
    """MORI's ``UMBPConfig::FromEnvironment``: the defaults, with each ``UMBP_*`` variable that
    is set laid over them."""
    cfg = UMBPConfig()
    dram, ssd = cfg.dram, cfg.ssd
    dram.capacity_bytes = _size("UMBP_DRAM_CAPACITY", dram.capacity_bytes)
    ssd.enabled = _flag("UMBP_SSD_ENABLED", ssd.enabled)
    ssd.storage_dir = _str("UMBP_SSD_DIR", ssd.storage_dir)
    ssd.capacity_bytes = _size("UMBP_SSD_CAPACITY", ssd.capacity_bytes)
    ssd.shard_io_threads = _int("UMBP_SSD_SHARD_IO_THREADS", ssd.shard_io_threads)
    ssd.tier_io_threads = _int("UMBP_SSD_TIER_IO_THREADS", ssd.tier_io_threads)
    ssd.direct_io = _flag("UMBP_SSD_DIRECT_IO", ssd.direct_io)
    ssd.single_flight_reads = _flag("UMBP_SSD_SINGLE_FLIGHT", ssd.single_flight_reads)
    ssd.verify_crc = _flag("UMBP_SSD_VERIFY_CRC", ssd.verify_crc)
    durability = _raw("UMBP_SSD_DURABILITY")
    # MORI keeps the configured mode for any other value; so does this.
    if durability in ("relaxed", "RELAXED"):
        ssd.durability.mode = UMBPDurabilityMode.Relaxed
    elif durability in ("strict", "STRICT"):
        ssd.durability.mode = UMBPDurabilityMode.Strict
    cfg.eviction.policy = _str("UMBP_EVICTION_POLICY", cfg.eviction.policy)
    dram.high_watermark = _float("UMBP_DRAM_HIGH_WM", dram.high_watermark)
    dram.low_watermark = _float("UMBP_DRAM_LOW_WM", dram.low_watermark)
    ssd.high_watermark = _float("UMBP_SSD_HIGH_WM", ssd.high_watermark)
    ssd.low_watermark = _float("UMBP_SSD_LOW_WM", ssd.low_watermark)
    dram.use_hugepages = _flag("UMBP_DRAM_USE_HUGEPAGES", dram.use_hugepages)
    dram.hugepage_size = _size("UMBP_DRAM_HUGEPAGE_SIZE", dram.hugepage_size)
    nodes = _raw("UMBP_DRAM_NUMA_NODE")
    if nodes is not None:
        try:
            dram.numa_nodes = _normalize_numa_nodes([int(n, 10) for n in nodes.split(",") if n.strip()])
        except ValueError:
            raise ValueError(f"UMBP_DRAM_NUMA_NODE={nodes!r}: expected node ids, comma-separated") from None
    dram.numa_strict = _flag("UMBP_DRAM_NUMA_STRICT", False)
    dram.prefault_threads = _int("UMBP_DRAM_PREFAULT_THREADS", 0)
    if not 0 <= dram.prefault_threads <= 16:
        raise ValueError("UMBP_DRAM_PREFAULT_THREADS must be between 0 and 16")
    dram.prefault = _flag("UMBP_DRAM_PREFAULT", dram.prefault)

    ssd.ssd_backend = _str("UMBP_SSD_BACKEND", ssd.ssd_backend)
    if ssd.ssd_backend == "file" and "UMBP_SSD_BACKEND" not in os.environ and "UMBP_SPDK_NVME_PCI" in os.environ:
        ssd.ssd_backend = "spdk"
    ssd.spdk_bdev_name = _str("UMBP_SPDK_BDEV", ssd.spdk_bdev_name)
    ssd.spdk_reactor_mask = _str("UMBP_SPDK_REACTOR_MASK", ssd.spdk_reactor_mask)
    ssd.spdk_mem_size_mb = _int("UMBP_SPDK_MEM_MB", ssd.spdk_mem_size_mb)
    ssd.spdk_nvme_pci_addr = _str("UMBP_SPDK_NVME_PCI", ssd.spdk_nvme_pci_addr)
    ssd.spdk_nvme_ctrl_name = _str("UMBP_SPDK_NVME_CTRL", ssd.spdk_nvme_ctrl_name)
    ssd.spdk_io_workers = _int("UMBP_SPDK_IO_WORKERS", ssd.spdk_io_workers)
    ssd.spdk_proxy_shm_name = _str("UMBP_SPDK_PROXY_SHM", ssd.spdk_proxy_shm_name)
    ssd.spdk_proxy_tenant_id = _size("UMBP_SPDK_PROXY_TENANT_ID", ssd.spdk_proxy_tenant_id)
    ssd.spdk_proxy_tenant_quota_bytes = _size("UMBP_SPDK_PROXY_TENANT_QUOTA_BYTES", ssd.spdk_proxy_tenant_quota_bytes)
    channels = (
        "UMBP_SPDK_PROXY_MAX_CHANNELS" if "UMBP_SPDK_PROXY_MAX_CHANNELS" in os.environ else "UMBP_SPDK_PROXY_MAX_RANKS"
    )
    ssd.spdk_proxy_max_channels = _size(channels, ssd.spdk_proxy_max_channels)
    data_mb = (
        "UMBP_SPDK_PROXY_DATA_PER_CHANNEL_MB"
        if "UMBP_SPDK_PROXY_DATA_PER_CHANNEL_MB" in os.environ
        else "UMBP_SPDK_PROXY_DATA_MB"
    )
    ssd.spdk_proxy_data_per_channel_mb = _size(data_mb, ssd.spdk_proxy_data_per_channel_mb)
    ssd.spdk_proxy_bin = _str("UMBP_SPDK_PROXY_BIN", ssd.spdk_proxy_bin)
    ssd.spdk_proxy_startup_timeout_ms = _int("UMBP_SPDK_PROXY_TIMEOUT_MS", ssd.spdk_proxy_startup_timeout_ms)
    ssd.spdk_proxy_auto_start = _flag("UMBP_SPDK_PROXY_AUTO_START", ssd.spdk_proxy_auto_start)
    ssd.spdk_proxy_idle_exit_timeout_ms = _int(
        "UMBP_SPDK_PROXY_IDLE_EXIT_TIMEOUT_MS", ssd.spdk_proxy_idle_exit_timeout_ms
    )
    ssd.spdk_proxy_allow_borrow = _flag("UMBP_SPDK_PROXY_ALLOW_BORROW", ssd.spdk_proxy_allow_borrow)
    ssd.spdk_proxy_reserved_shared_bytes = _size(
        "UMBP_SPDK_PROXY_RESERVED_SHARED_BYTES", ssd.spdk_proxy_reserved_shared_bytes
    )

    role = _str("UMBP_ROLE", "")
    if role == "leader":
        cfg.role = UMBPRole.SharedSSDLeader
    elif role == "follower":
        cfg.role = UMBPRole.SharedSSDFollower
    elif role == "standalone":
        cfg.role = UMBPRole.Standalone
    elif role == "":
        for name in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID"):
            if name in os.environ:
                rank = _int(name, 0)
                cfg.role = UMBPRole.SharedSSDLeader if rank == 0 else UMBPRole.SharedSSDFollower
                break
    return cfg
