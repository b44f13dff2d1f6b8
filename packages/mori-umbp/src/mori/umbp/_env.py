"""The ``UMBP_*`` environment variables: MORI's ``UMBPConfig::FromEnvironment`` overlay, and its
runtime knobs (timeouts, leases, intervals) with MORI's resolution rules."""

from __future__ import annotations

import logging
import os
import threading

from ._config import UMBPConfig, _normalize_numa_nodes
from ._enums import UMBPDurabilityMode, UMBPRole

_log = logging.getLogger("mori.umbp")


def _raw(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value is not None and value.strip() != "" else None


def _size(name: str, default: int) -> int:
    """A byte count or count: decimal digits. MORI's ``std::stoull`` throws on garbage; so does
    this, naming the variable."""
    raw = _raw(name)
    if raw is None:
        return default
    text = raw.strip()
    if not text.isdigit():
        raise ValueError(f"{name}={raw!r}: expected a non-negative integer")
    return int(text)


def _int(name: str, default: int) -> int:
    raw = _raw(name)
    if raw is None:
        return default
    try:
        return int(raw.strip(), 10)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected an integer") from None


def _flag(name: str, default: bool) -> bool:
    """MORI reads flags as integers (0 off, anything else on); ``true``/``false`` etc. are taken
    too. Anything else is an error naming the variable (MORI's ``atoi`` would read it as 0)."""
    raw = _raw(name)
    if raw is None:
        return default
    text = raw.strip().lower()
    if text in ("true", "yes", "on"):
        return True
    if text in ("false", "no", "off"):
        return False
    try:
        return int(text, 10) != 0
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected 0/1 (or true/false)") from None


def _float(name: str, default: float) -> float:
    raw = _raw(name)
    if raw is None:
        return default
    try:
        return float(raw.strip())
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a number") from None


def _str(name: str, default: str) -> str:
    value = os.environ.get(name)
    return default if value is None else value


def config_from_environment() -> UMBPConfig:
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
    ssd.spdk_proxy_tenant_quota_bytes = _size("UMBP_SPDK_PROXY_TENANT_QUOTA_BYTES",
                                              ssd.spdk_proxy_tenant_quota_bytes)
    channels = "UMBP_SPDK_PROXY_MAX_CHANNELS" if "UMBP_SPDK_PROXY_MAX_CHANNELS" in os.environ \
        else "UMBP_SPDK_PROXY_MAX_RANKS"
    ssd.spdk_proxy_max_channels = _size(channels, ssd.spdk_proxy_max_channels)
    data_mb = "UMBP_SPDK_PROXY_DATA_PER_CHANNEL_MB" if "UMBP_SPDK_PROXY_DATA_PER_CHANNEL_MB" in os.environ \
        else "UMBP_SPDK_PROXY_DATA_MB"
    ssd.spdk_proxy_data_per_channel_mb = _size(data_mb, ssd.spdk_proxy_data_per_channel_mb)
    ssd.spdk_proxy_bin = _str("UMBP_SPDK_PROXY_BIN", ssd.spdk_proxy_bin)
    ssd.spdk_proxy_startup_timeout_ms = _int("UMBP_SPDK_PROXY_TIMEOUT_MS", ssd.spdk_proxy_startup_timeout_ms)
    ssd.spdk_proxy_auto_start = _flag("UMBP_SPDK_PROXY_AUTO_START", ssd.spdk_proxy_auto_start)
    ssd.spdk_proxy_idle_exit_timeout_ms = _int("UMBP_SPDK_PROXY_IDLE_EXIT_TIMEOUT_MS",
                                               ssd.spdk_proxy_idle_exit_timeout_ms)
    ssd.spdk_proxy_allow_borrow = _flag("UMBP_SPDK_PROXY_ALLOW_BORROW", ssd.spdk_proxy_allow_borrow)
    ssd.spdk_proxy_reserved_shared_bytes = _size("UMBP_SPDK_PROXY_RESERVED_SHARED_BYTES",
                                                 ssd.spdk_proxy_reserved_shared_bytes)

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


_warned: set[str] = set()
_warned_lock = threading.Lock()


def runtime_int(name: str, default: int, min_allowed: int = 0) -> int:
    """A runtime knob (``UMBP_*_MS``, ``_SEC``, counts) by MORI's rules: unset or empty gives the
    default silently; a value that is not a base-10 integer, or is below ``min_allowed``, gives
    the default and one warning per name and process."""
    raw = _raw(name)
    if raw is None:
        return default
    text = raw.lstrip()
    try:
        value = int(text, 10)
        if text != text.rstrip() or value < min_allowed:
            raise ValueError
    except ValueError:
        with _warned_lock:
            first = name not in _warned
            _warned.add(name)
        if first:
            _log.warning("%s=%r is not an integer >= %d; using the default %d", name, raw, min_allowed, default)
        return default
    return value
