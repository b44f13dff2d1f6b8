"""A mori.umbp node of the benchmark, in a process (and a network namespace) of its own:
``python -m mori.umbp.bench._node ROLE CONFIG_JSON``.

``store``: the storage node. A DRAM tier that takes every page of the run and an SSD tier
behind it; answers the driver's ``to_ssd`` requests (each key leaves DRAM for SSD, or, when it
is on SSD already, stays there; a page still leased to a reader waits for it) until stdin closes.
``client``: the node that puts and gets. Its DRAM tier is the smallest, so the master routes
every put to the storage node, and every get reads from there, over TCP between namespaces; it
runs the points (:func:`._measure.run`) and exits.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from mori.umbp import UMBPClient, UMBPConfig, UMBPDistributedConfig, UMBPTierType

from . import _measure

CLIENT_DRAM = 4 << 20
#: The longest the storage node waits for a reader's lease on a page it is to move to SSD.
LEASE_WAIT_S = 5.0


def _config(args: dict[str, Any], role: str) -> UMBPConfig:
    cfg = UMBPConfig()
    cfg.dram.capacity_bytes = args["capacity"] if role == "store" else CLIENT_DRAM
    cfg.dram.prefault = role == "store"  # the storage node's pages are touched once, before timing
    cfg.ssd.enabled = role == "store" and bool(args.get("ssd_dir"))
    if cfg.ssd.enabled:
        cfg.ssd.storage_dir = args["ssd_dir"]
        cfg.ssd.capacity_bytes = args["ssd_capacity"]
        cfg.ssd.segment_size_bytes = 64 << 20
    dist = UMBPDistributedConfig()
    dist.master_config.master_address = args["master"]
    dist.master_config.node_id = f"bench-{role}"
    dist.master_config.node_address = args["address"]
    dist.io_engine.host = args["address"]
    dist.staging_buffer_size = 1 << 20
    dist.cache_remote_fetches = False  # every get crosses to the storage node (MORI's advice for benchmarks)
    cfg.distributed = dist
    return cfg


class _Client:
    """The adapter :func:`._measure.run` drives."""

    ssd = True

    def __init__(self, client: UMBPClient, ssd: bool) -> None:
        self.client, self.ssd = client, ssd

    def register(self, ptr: int, size: int) -> None:
        self.client.register_memory(ptr, size)

    def put(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[bool]:
        return self.client.batch_put_from_ptr(keys, ptrs, sizes)

    def get(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[bool]:
        return self.client.batch_get_into_ptr(keys, ptrs, sizes)

    def exists(self, keys: list[str]) -> list[bool]:
        return self.client.batch_exists(keys)

    def to_ssd(self, keys: list[str]) -> int:
        return _measure.ask_storage_node_to_ssd(keys)


def _to_ssd(client: UMBPClient, keys: list[str]) -> int:
    """Leaves ``keys`` on the storage node's SSD tier only; how many are. Pages there already
    are left alone (a peer's get of one reads it without staging it into DRAM). A page a reader still
    holds a read lease on stays in DRAM (the reader's release comes after its get returned):
    it is asked again until the lease is released or ends."""
    store = client._store  # the storage node's own tiers: the benchmark puts pages back on SSD
    assert store is not None
    deadline = time.monotonic() + LEASE_WAIT_S
    todo = [key for key in keys if (store.lookup(key) or (None,))[0] == UMBPTierType.DRAM]
    while todo:
        for key in todo:
            store.demote(key)  # of a page on SSD only, demote would remove it: those are left
        if not client.flush():  # the moves to SSD are done, and the master has their events
            raise RuntimeError("the storage node's flush failed")
        todo = [key for key in todo if (store.lookup(key) or (None,))[0] == UMBPTierType.DRAM]
        if time.monotonic() > deadline:
            break
        if todo:
            time.sleep(0.001)
    return sum(1 if (store.lookup(key) or (None,))[0] == UMBPTierType.SSD else 0 for key in keys)


def _serve(client: UMBPClient) -> None:
    _measure.send({"ready": True})
    while (msg := _measure.receive()) is not None:
        _measure.send({"moved": _to_ssd(client, msg["keys"])})


def main(argv: list[str] | None = None) -> None:
    role, raw = (argv if argv is not None else sys.argv[1:])[:2]
    args = json.loads(raw)
    with UMBPClient(_config(args, role)) as client:
        if role == "store":
            _serve(client)
            return
        _measure.run(_Client(client, args["ssd"]), "mori", args)
        _measure.send({"done": True})


if __name__ == "__main__":
    main()
