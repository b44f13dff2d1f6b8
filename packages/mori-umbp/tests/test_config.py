"""MORI's configuration classes, enums and UMBP_* variables: names, defaults, types, errors."""

from __future__ import annotations

import pytest

import mori.umbp as umbp
from mori.umbp import (
    UMBPConfig,
    UMBPDistributedConfig,
    UMBPDurabilityMode,
    UMBPIoBackend,
    UMBPRole,
    UMBPStandaloneProcessConfig,
)
from mori.umbp._config import validate

GiB, MiB = 1 << 30, 1 << 20


def test_defaults_are_moris() -> None:
    cfg = UMBPConfig()
    assert (cfg.dram.capacity_bytes, cfg.dram.high_watermark, cfg.dram.low_watermark) == (4 * GiB, 0.9, 0.7)
    assert (cfg.dram.use_hugepages, cfg.dram.hugepage_size, cfg.dram.numa_node, cfg.dram.prefault) == (
        False,
        2 * MiB,
        -1,
        True,
    )
    ssd = cfg.ssd
    assert (ssd.enabled, ssd.storage_dir, ssd.capacity_bytes, ssd.segment_size_bytes) == (
        True,
        "/tmp/umbp_ssd",
        32 * GiB,
        256 * MiB,
    )
    assert (ssd.io.backend, ssd.io.queue_depth) == (UMBPIoBackend.IoUring, 4096)
    assert (ssd.durability.mode, ssd.durability.enable_background_gc) == (UMBPDurabilityMode.Strict, True)
    assert (ssd.ssd_backend, ssd.high_watermark, ssd.low_watermark) == ("file", 0.9, 0.7)
    assert (ssd.spdk_proxy_startup_timeout_ms, ssd.spdk_proxy_max_channels, ssd.spdk_proxy_shm_name) == (
        30000,
        8,
        "/umbp_spdk_proxy",
    )
    assert (cfg.eviction.policy, cfg.eviction.candidate_window, cfg.eviction.auto_promote_on_read) == ("lru", 16, True)
    cp = cfg.copy_pipeline
    assert (cp.async_enabled, cp.queue_depth, cp.worker_threads, cp.batch_max_ops) == (True, 4096, 2, 128)
    assert cfg.role == UMBPRole.Standalone and cfg.distributed is None and cfg.standalone_process is None
    dist = UMBPDistributedConfig()
    assert (dist.staging_buffer_size, dist.ssd_staging_buffer_size, dist.ssd_staging_buffer_slots) == (
        64 * MiB,
        256 * MiB,
        16,
    )
    assert (dist.peer_service_port, dist.cache_remote_fetches, dist.dram_page_size, dist.io_engine.port) == (
        0,
        True,
        0,
        0,
    )
    assert (dist.master_config.master_address, dist.master_config.auto_heartbeat, dist.master_config.tags) == (
        "",
        True,
        [],
    )
    sp = UMBPStandaloneProcessConfig()
    assert (sp.address, sp.auto_start, sp.startup_timeout_ms, sp.tags) == ("", False, 30000, [])


def test_enum_values_are_moris() -> None:
    assert [(m.name, m.value) for m in umbp.UMBPTierType] == [("Unknown", 0), ("HBM", 1), ("DRAM", 2), ("SSD", 3)]
    assert [m.name for m in UMBPRole] == ["Standalone", "SharedSSDLeader", "SharedSSDFollower"]
    assert [(m.name, m.value) for m in umbp.UMBPDeploymentMode] == [
        ("Local", 0),
        ("StandaloneProcess", 1),
        ("Distributed", 2),
    ]
    assert [m.name for m in umbp.UMBPHostBufferBacking] == [
        "Anonymous",
        "AnonymousHugetlb",
        "AnonymousShm",
        "AnonymousShmHugetlb",
    ]
    assert [m.name for m in UMBPIoBackend] == ["Posix", "IoUring"]
    assert [m.name for m in UMBPDurabilityMode] == ["Strict", "Relaxed"]


def test_nested_fields_are_set_in_place_as_sglang_does() -> None:
    cfg = UMBPConfig()
    cfg.ssd.io.queue_depth = 64
    cfg.ssd.durability.mode = UMBPDurabilityMode.Relaxed
    cfg.copy_pipeline.worker_threads = 1
    cfg.distributed = UMBPDistributedConfig()
    cfg.distributed.master_config.tags = ["sgl_role=prefill"]
    assert cfg.ssd.io.queue_depth == 64 and cfg.distributed.master_config.tags == ["sgl_role=prefill"]
    assert hasattr(cfg.ssd, "spdk_proxy_bin") and not hasattr(cfg.ssd, "spdk_nonsense")


@pytest.mark.parametrize(
    ("obj", "field", "value", "message"),
    [
        ("dram", "capacity_bytes", -1, r"UMBPDramConfig.capacity_bytes must be in \[0, "),
        ("dram", "capacity_bytes", 1.5, "UMBPDramConfig.capacity_bytes must be an int"),
        ("dram", "capacity_bytes", True, "must be an int"),
        ("ssd", "enabled", 1, "UMBPSsdConfig.enabled must be a bool"),
        ("ssd", "storage_dir", 3, "UMBPSsdConfig.storage_dir must be a str"),
        ("eviction", "policy", None, "UMBPEvictionConfig.policy must be a str"),
        ("dram", "high_watermark", "0.9", "must be a float"),
        ("ssd", "io", 3, "UMBPSsdConfig.io must be a UMBPIoConfig"),
    ],
)
def test_a_wrong_type_is_a_type_error_naming_the_field(obj: str, field: str, value: object, message: str) -> None:
    cfg = UMBPConfig()
    before = getattr(getattr(cfg, obj), field)
    with pytest.raises(TypeError, match=message):
        setattr(getattr(cfg, obj), field, value)
    assert getattr(getattr(cfg, obj), field) == before


def test_narrow_fields_and_optional_blocks() -> None:
    dist = UMBPDistributedConfig()
    with pytest.raises(TypeError, match="peer_service_port must be in"):
        dist.peer_service_port = 70000
    cfg = UMBPConfig()
    with pytest.raises(TypeError, match="UMBPConfig.distributed must be a UMBPDistributedConfig or None"):
        cfg.distributed = UMBPStandaloneProcessConfig()  # type: ignore[assignment]
    with pytest.raises(AttributeError):
        cfg.not_a_field = 1  # type: ignore[attr-defined]
    cfg.dram.high_watermark = 1  # an int is a float field's value, as in pybind11
    assert cfg.dram.high_watermark == 1.0 and isinstance(cfg.dram.high_watermark, float)
    cfg.dram.numa_nodes = [3, 1, 3]
    assert (cfg.dram.numa_nodes, cfg.dram.numa_node) == ([1, 3], 1)
    cfg.dram.numa_node = -1
    assert cfg.dram.numa_nodes == []


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: setattr(c.dram, "capacity_bytes", 0), "dram.capacity_bytes must be > 0"),
        (lambda c: setattr(c.ssd, "capacity_bytes", 0), "ssd.capacity_bytes must be > 0"),
        (lambda c: setattr(c.ssd, "segment_size_bytes", 0), "ssd.segment_size_bytes must be > 0"),
        (lambda c: setattr(c.ssd, "segment_size_bytes", 5000), "multiple of 4096"),
        (lambda c: setattr(c.ssd, "low_watermark", 0.95), "ssd watermarks must satisfy"),
        (lambda c: setattr(c.dram, "low_watermark", 0.0), "dram watermarks must satisfy"),
        (lambda c: setattr(c.ssd, "ssd_backend", "nvme"), "ssd.ssd_backend must be one of"),
        (lambda c: setattr(c.ssd, "ssd_backend", "spdk"), "SPDK is out of scope"),
        (lambda c: setattr(c.copy_pipeline, "worker_threads", 0), "copy_pipeline.worker_threads must be > 0"),
        (lambda c: setattr(c.eviction, "policy", "fifo"), "eviction.policy must be 'lru'"),
        (lambda c: setattr(c, "distributed", UMBPDistributedConfig()), "node_id must not be empty"),
        (
            lambda c: setattr(c, "standalone_process", UMBPStandaloneProcessConfig()),
            "standalone_process.address must not be empty",
        ),
    ],
)
def test_validate_names_the_first_setting_that_cannot_work(change, message: str) -> None:
    cfg = UMBPConfig()
    validate(cfg)
    change(cfg)
    with pytest.raises(ValueError, match=message):
        validate(cfg)


def test_distributed_and_standalone_are_exclusive() -> None:
    cfg = UMBPConfig()
    cfg.distributed = UMBPDistributedConfig()
    cfg.distributed.master_config.node_id, cfg.distributed.master_config.node_address = "n0", "127.0.0.1"
    validate(cfg)
    cfg.standalone_process = UMBPStandaloneProcessConfig(address="unix:///tmp/x.sock")
    with pytest.raises(ValueError, match="mutually exclusive"):
        validate(cfg)
    cfg.ssd.enabled = False
    cfg.ssd.ssd_backend = "spdk"  # not checked while the tier is off, as in MORI
    cfg.standalone_process = None
    validate(cfg)


def test_from_environment_overlays_umbp_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "UMBP_DRAM_CAPACITY": str(64 * MiB),
        "UMBP_SSD_ENABLED": "0",
        "UMBP_SSD_DIR": "/var/tmp/kv",
        "UMBP_SSD_CAPACITY": str(GiB),
        "UMBP_EVICTION_POLICY": "lru",
        "UMBP_DRAM_HIGH_WM": "0.8",
        "UMBP_DRAM_LOW_WM": "0.5",
        "UMBP_SSD_HIGH_WM": "0.95",
        "UMBP_SSD_LOW_WM": "0.6",
        "UMBP_SSD_DURABILITY": "relaxed",
        "UMBP_DRAM_NUMA_NODE": "1,0",
        "UMBP_SPDK_PROXY_MAX_RANKS": "4",
        "UMBP_ROLE": "follower",
    }.items():
        monkeypatch.setenv(name, value)
    cfg = UMBPConfig.from_environment()
    assert (cfg.dram.capacity_bytes, cfg.ssd.enabled, cfg.ssd.storage_dir, cfg.ssd.capacity_bytes) == (
        64 * MiB,
        False,
        "/var/tmp/kv",
        GiB,
    )
    assert (cfg.dram.high_watermark, cfg.dram.low_watermark, cfg.ssd.high_watermark, cfg.ssd.low_watermark) == (
        0.8,
        0.5,
        0.95,
        0.6,
    )
    assert cfg.ssd.durability.mode == UMBPDurabilityMode.Relaxed
    assert cfg.dram.numa_nodes == [0, 1] and cfg.ssd.spdk_proxy_max_channels == 4
    assert cfg.role == UMBPRole.SharedSSDFollower


def test_from_environment_role_from_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UMBP_ROLE", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert UMBPConfig.from_environment().role == UMBPRole.SharedSSDLeader
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert UMBPConfig.from_environment().role == UMBPRole.SharedSSDFollower
    monkeypatch.delenv("LOCAL_RANK")
    assert UMBPConfig.from_environment().role == UMBPRole.Standalone


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("UMBP_DRAM_CAPACITY", "4G"),
        ("UMBP_DRAM_CAPACITY", "-1"),
        ("UMBP_SSD_ENABLED", "maybe"),
        ("UMBP_DRAM_HIGH_WM", "high"),
        ("UMBP_DRAM_NUMA_NODE", "a,b"),
        ("UMBP_DRAM_PREFAULT_THREADS", "17"),
    ],
)
def test_from_environment_names_a_bad_variable(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        UMBPConfig.from_environment()


def test_runtime_knobs_fall_back_to_the_default(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from mori.umbp._env import runtime_int

    monkeypatch.delenv("UMBP_TEST_KNOB_MS", raising=False)
    assert runtime_int("UMBP_TEST_KNOB_MS", 500, 1) == 500
    monkeypatch.setenv("UMBP_TEST_KNOB_MS", "  250")
    assert runtime_int("UMBP_TEST_KNOB_MS", 500, 1) == 250
    for bad in ("10abc", "0", "-5", "250 "):
        monkeypatch.setenv("UMBP_TEST_KNOB_MS", bad)
        assert runtime_int("UMBP_TEST_KNOB_MS", 500, 1) == 500
