"""MORI's UMBP enums, with its member names and values (``include/umbp/common/config.h``,
``distributed/types.h``, ``umbp_client.h``, ``local/host_mem_allocator.h``)."""

from __future__ import annotations

import enum


class UMBPRole(enum.IntEnum):
    """The shared-SSD role of a client. Kept for MORI's callers (SGLang sets ``Standalone``);
    a shared pool is a deployment (a master, or a standalone process), not a role."""

    Standalone = 0
    SharedSSDLeader = 1
    SharedSSDFollower = 2


class UMBPTierType(enum.IntEnum):
    """A storage tier: where a block lives (``HBM`` GPU memory, ``DRAM`` host memory, ``SSD``)."""

    Unknown = 0
    HBM = 1
    DRAM = 2
    SSD = 3


class UMBPIoBackend(enum.IntEnum):
    """How the SSD tier issues its I/O. Both are served by the same worker threads here: the
    tier's reads and writes are large and aligned, and run off the caller's thread either way."""

    Posix = 0
    IoUring = 1


class UMBPDurabilityMode(enum.IntEnum):
    """``Strict``: a put that lands on SSD is on the device (``fdatasync``) before it reports
    success. ``Relaxed``: it is in the page cache, and the kernel writes it back."""

    Strict = 0
    Relaxed = 1


class UMBPSsdLayoutMode(enum.IntEnum):
    """The SSD tier's on-disk layout: segment files that records are appended to."""

    SegmentedLog = 1


class UMBPDeploymentMode(enum.IntEnum):
    """What a client is. ``Distributed``: the pool lives in this process (a node of a cluster when
    a master address is set, else an embedded one-node pool, as MORI's embedded client reports).
    ``StandaloneProcess``: the pool lives in a server process on this host. ``Local`` is kept at
    0 for MORI's callers; no client reports it."""

    Local = 0
    StandaloneProcess = 1
    Distributed = 2


class UMBPHostBufferBacking(enum.IntEnum):
    """The pages behind a host buffer from :class:`UMBPHostMemAllocator`."""

    Anonymous = 0
    AnonymousHugetlb = 1
    AnonymousShm = 2
    AnonymousShmHugetlb = 3


class UMBPMedium(enum.IntEnum):
    """The one medium a cluster node serves (``UMBPDistributedConfig.medium``)."""

    DRAM = 0
    HBM = 1
    SSD = 2


class CacheRemoteAdmission(enum.IntEnum):
    """Whether a block fetched from a peer is also cached in this node's DRAM tier."""

    SIZE = 0
    NEVER = 1
    ALWAYS = 2
