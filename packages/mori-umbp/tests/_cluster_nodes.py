"""Nodes of a cluster for the tests: a node's configuration, and a node in a process of its own
that stores pages made from a seed, says so on stdout, and serves them until it is killed."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from mori.umbp import UMBPClient, UMBPConfig, UMBPDistributedConfig

KiB = 1 << 10
#: The master's timing in these tests: a node silent for 2 s is dead; heartbeats every 0.5 s.
FAST_MASTER = {"UMBP_HEARTBEAT_TTL_SEC": "1", "UMBP_MAX_MISSED_HEARTBEATS": "2", "UMBP_REAPER_INTERVAL_SEC": "1"}


def node_config(
    master: str,
    node_id: str,
    ssd_dir: Path | None,
    dram: int = 4 << 20,
    address: str = "127.0.0.1",
    cache_remote_fetches: bool = False,
) -> UMBPConfig:
    """A node ``node_id`` of the cluster at ``master``, reachable at ``address``; pages it reads
    from peers are not kept unless ``cache_remote_fetches`` (so that reads stay remote)."""
    cfg = UMBPConfig()
    cfg.dram.capacity_bytes = dram
    cfg.dram.prefault = False
    cfg.ssd.enabled = ssd_dir is not None
    if ssd_dir is not None:
        cfg.ssd.storage_dir = str(ssd_dir)
        cfg.ssd.capacity_bytes = 64 << 20
        cfg.ssd.segment_size_bytes = 8 << 20
    dist = UMBPDistributedConfig()
    dist.master_config.master_address = master
    dist.master_config.node_id = node_id
    dist.master_config.node_address = address
    dist.io_engine.host = address
    dist.staging_buffer_size = 1 << 20
    dist.cache_remote_fetches = cache_remote_fetches
    cfg.distributed = dist
    return cfg


def row_ptrs(pages: np.ndarray) -> list[int]:
    """The address of each row (page) of a page array."""
    return [int(pages.ctypes.data) + i * pages.shape[1] for i in range(pages.shape[0])]


def seeded_pages(seed: int, count: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, size), dtype=np.uint8)


def main() -> None:
    """``python _cluster_nodes.py CONFIG_JSON``: puts ``count`` pages of ``size`` bytes made from
    ``seed`` as ``prefix-i``, flushes, prints ``ready``, then serves until killed."""
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    args = json.loads(parser.parse_args().config)
    ssd = Path(args["ssd_dir"]) if args.get("ssd_dir") else None
    cfg = node_config(args["master"], args["node_id"], ssd, args.get("dram", 4 << 20), args.get("address", "127.0.0.1"))
    client = UMBPClient(cfg)
    pages = seeded_pages(args["seed"], args["count"], args["size"])
    client.register_memory(int(pages.ctypes.data), pages.nbytes)
    keys = [f"{args['prefix']}-{i}" for i in range(args["count"])]
    ptrs = [int(pages.ctypes.data) + i * args["size"] for i in range(args["count"])]
    ok = client.batch_put_from_ptr(keys, ptrs, [args["size"]] * args["count"])
    assert all(ok), ok
    assert client.flush()
    print("ready", flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main())
