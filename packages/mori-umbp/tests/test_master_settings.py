"""The master's settings from MORI's UMBP_* variables: MORI's defaults, and MORI's rules for a
value that does not parse (the default, and one warning per variable)."""

from __future__ import annotations

import logging

import pytest

from mori.umbp import _env as env_module
from mori.umbp._master import settings as settings_module
from mori.umbp._master.settings import MasterSettings


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("UMBP_"):
            monkeypatch.delenv(name)
    monkeypatch.setattr(settings_module, "_warned", set())
    monkeypatch.setattr(env_module, "_warned", set())


def test_defaults_are_mori_s():
    s = MasterSettings.from_environment()
    assert (s.listen_address, s.metrics_port) == ("0.0.0.0:50051", 9091)
    assert (s.heartbeat_ttl_s, s.max_missed_heartbeats, s.reaper_interval_s, s.expiry_s) == (10, 3, 5, 30)
    assert (s.heartbeat_interval_divisor, s.heartbeat_interval_ms) == (2, 5000)
    assert (s.eviction_check_interval_s, s.lease_duration_s, s.evictkey_deadline_ms) == (5, 2, 1000)
    assert (s.eviction_high_watermark, s.eviction_low_watermark, s.evict_batch_size) == (0.9, 0.7, 32)
    assert (s.hit_index_ttl_s, s.hit_index_gc_interval_s, s.hit_query_max_batch) == (7200, 60, 4096)
    assert (s.route_put_select_algo, s.route_put_node_affinity) == ("most_available", "none")
    assert (s.metadata_backend, s.redis_namespace, s.redis_cluster) == ("inmemory", "default", False)
    assert (s.redis_connect_timeout_ms, s.redis_socket_timeout_ms, s.max_message_bytes) == (1000, 1000, 64 << 20)


def test_values_are_read(monkeypatch):
    for name, value in {
        "UMBP_HEARTBEAT_TTL_SEC": "4",
        "UMBP_MAX_MISSED_HEARTBEATS": "+2",
        "UMBP_REAPER_INTERVAL_SEC": "  7",
        "UMBP_ROUTE_PUT_SELECT_ALGO": "random",
        "UMBP_ROUTE_PUT_NODE_AFFINITY": "local",
        "UMBP_METADATA_BACKEND": "redis",
        "UMBP_REDIS_URI": "tcp://10.0.0.5:6379",
        "UMBP_REDIS_CLUSTER": "1",
        "UMBP_MASTER_LISTEN": "127.0.0.1:15558",
        "UMBP_MASTER_MAX_KEYS_PER_CLIENT": "1000",
    }.items():
        monkeypatch.setenv(name, value)
    s = MasterSettings.from_environment()
    assert (s.heartbeat_ttl_s, s.max_missed_heartbeats, s.reaper_interval_s, s.expiry_s) == (4, 2, 7, 8)
    assert (s.route_put_select_algo, s.route_put_node_affinity) == ("random", "local")
    assert (s.metadata_backend, s.redis_uri, s.redis_cluster) == ("redis", "tcp://10.0.0.5:6379", True)
    assert (s.listen_address, s.max_keys_per_client) == ("127.0.0.1:15558", 1000)


@pytest.mark.parametrize("raw", ["10abc", "0x10", "-5", "123 ", "1.5", "0"])
def test_a_malformed_value_gives_the_default_and_one_warning(monkeypatch, caplog, raw):
    monkeypatch.setenv("UMBP_HEARTBEAT_TTL_SEC", raw)  # min 1: "0" is below it
    monkeypatch.setenv("UMBP_ROUTE_PUT_SELECT_ALGO", "fastest")
    with caplog.at_level(logging.WARNING, logger="mori.umbp.master"):
        first = MasterSettings.from_environment()
        second = MasterSettings.from_environment()
    assert first.heartbeat_ttl_s == second.heartbeat_ttl_s == 10
    assert first.route_put_select_algo == "most_available"
    warnings = [r.getMessage() for r in caplog.records]
    assert len([w for w in warnings if w.startswith("UMBP_HEARTBEAT_TTL_SEC=")]) == 1
    assert (
        len([w for w in warnings if "UMBP_ROUTE_PUT_SELECT_ALGO='fastest' is not one of most_available, random" in w])
        == 1
    )
