"""A Mooncake Store node of the benchmark, run as a script under ``--peer-python`` (an
interpreter with ``mooncake-transfer-engine-non-cuda``; mori is not installed there):
``python _mooncake_node.py ROLE CONFIG_JSON``.

``store``: a client of Mooncake Store that gives the pool a global segment big enough for
every page of the run, and serves it until stdin closes. With ``ssd_dir`` it is also the owner
of a local-disk tier there (``enable_ssd_offload``; the master runs with ``--enable_offload``):
each object put into its segment is queued for it at the put's end, and its offload heartbeat
writes the queued objects to disk and tells the master, which adds a ``LOCAL_DISK`` replica.
``client``: a client that gives no segment (``global_segment_size`` 0), so every put lands in
the storage node's segment and every get reads from there over the ``tcp`` transport; it
registers its buffers (zero-copy ``batch_put_from``/``batch_get_into``), runs the points and
exits. Metadata goes through the master's own HTTP metadata server.

A get of an object whose one replica is ``LOCAL_DISK`` asks the owner's offload RPC server,
which reads the object from disk into its staging buffer, and then reads that buffer over the
transfer engine. Mooncake has no call that moves an object to disk; the client leaves one there
only by clearing its memory replica (``batch_replica_clear`` on the storage node's segment: the
object's owner may, once its lease is over; the master gives leases of 1 ms in this run).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _measure  # noqa: E402

LOCAL_BUFFER = 16 << 20
START_TIMEOUT_S = 60.0
OFFLOAD_TIMEOUT_S = 30.0  # for the offload heartbeat (every second here) to write a batch


def _offload_environment(args: dict[str, Any]) -> dict[str, str]:
    """The storage node's local-disk tier (Mooncake reads these at setup): its default bucket
    backend, a bucket of one batch (a bucket is written only once it is full:
    ``BucketStorageBackend::GroupOffloadingKeysByBucket`` keeps a partial one for a later
    heartbeat), a heartbeat each second (10 s by default), and io_uring, whose reads are O_DIRECT
    as mori's SSD tier's are (without it the files are read through the page cache)."""
    largest_batch = args["pages"] * max(args["sizes"])
    return {
        "MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR": "bucket_storage_backend",
        "MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT": str(args["pages"]),
        "MOONCAKE_OFFLOAD_BUCKET_SIZE_LIMIT_BYTES": str(max(largest_batch, 256 << 20)),
        "MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS": "1",
        "MOONCAKE_OFFLOAD_USE_URING": "true",
        "MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES": str(max(2 * largest_batch, 64 << 20)),
    }


def _wait_for(host: str, port: int) -> None:
    """Until the master listens at ``host:port`` (it is started just before)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            socket.create_connection((host, port), timeout=2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"Mooncake's master at {host}:{port} did not come up in {START_TIMEOUT_S} s"
                ) from None
            time.sleep(0.2)


def _store(args: dict[str, Any], role: str) -> Any:
    from mooncake.store import MooncakeDistributedStore

    host, rpc, http = args["master_host"], args["rpc_port"], args["http_port"]
    _wait_for(host, rpc)
    _wait_for(host, http)
    store = MooncakeDistributedStore()
    segment = args["capacity"] if role == "store" else 0
    ssd_dir = args.get("ssd_dir", "") if role == "store" else ""
    if ssd_dir:
        os.environ.update(_offload_environment(args))
    rc = store.setup(
        args["address"],
        f"http://{host}:{http}/metadata",
        segment,
        LOCAL_BUFFER,
        "tcp",
        "",
        f"{host}:{rpc}",
        enable_ssd_offload=bool(ssd_dir),
        ssd_offload_path=ssd_dir,
    )
    if rc != 0:
        raise RuntimeError(f"Mooncake Store setup ({role}) failed: {rc}")
    return store


class _Client:
    """The adapter :func:`_measure.run` drives; Mooncake's calls answer a count of bytes or 0 per
    key for success, a negative error code for failure."""

    def __init__(self, store: Any, ssd: bool) -> None:
        self.store, self.ssd = store, ssd

    def register(self, ptr: int, size: int) -> None:
        if self.store.register_buffer(ptr, size) != 0:
            raise RuntimeError(f"Mooncake register_buffer of {size} bytes failed")

    def put(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[bool]:
        return [rc == 0 for rc in self.store.batch_put_from(keys, ptrs, sizes)]

    def get(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[bool]:
        return [rc == size for rc, size in zip(self.store.batch_get_into(keys, ptrs, sizes), sizes)]

    def exists(self, keys: list[str]) -> list[bool]:
        return [rc == 1 for rc in self.store.batch_is_exist(keys)]

    def _replicas(self, keys: list[str]) -> dict[str, list[Any]]:
        found = self.store.batch_get_replica_desc(keys)
        return {key: list(found.get(key, [])) for key in keys}

    def to_ssd(self, keys: list[str]) -> int:
        """Waits until every key has its ``LOCAL_DISK`` replica, clears the memory replicas
        left (there are none after the first time: a read from disk does not bring one back,
        the master's ``--promotion_on_hit`` being off), and answers how many keys are on disk
        only. A clear skips a key under lease (each replica query takes one, of 1 ms here), so
        it is tried again until none is left."""
        deadline = time.monotonic() + OFFLOAD_TIMEOUT_S
        while True:
            replicas = self._replicas(keys)
            on_disk = all(any(r.is_local_disk_replica() for r in rs) for rs in replicas.values())
            by_segment: dict[str, list[str]] = {}
            for key, rs in replicas.items():
                for r in rs:
                    if r.is_memory_replica():
                        segment = r.get_memory_descriptor().buffer_descriptor.transport_endpoint
                        by_segment.setdefault(segment, []).append(key)
            if on_disk and not by_segment:
                return sum(bool(rs) and all(r.is_local_disk_replica() for r in rs) for rs in replicas.values())
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"Mooncake did not leave {len(keys)} objects on disk only in {OFFLOAD_TIMEOUT_S} s "
                    f"(on disk: {on_disk}; memory replicas left: {sum(map(len, by_segment.values()))})"
                )
            if on_disk:
                time.sleep(0.002)  # past the lease the query above took
                for segment, held in by_segment.items():
                    self.store.batch_replica_clear(held, segment)
            else:
                time.sleep(0.05)


def main() -> None:
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ.setdefault("GLOG_minloglevel", "2")
    role, args = sys.argv[1], json.loads(sys.argv[2])
    store = _store(args, role)
    try:
        if role == "store":
            _measure.send({"ready": True})
            while _measure.receive() is not None:  # no requests: it serves its segment until told to stop
                _measure.send({"moved": 0})
            return
        _measure.run(_Client(store, "ssd" in args["groups"]), "mooncake", args)
        _measure.send({"done": True})
    finally:
        store.close()


if __name__ == "__main__":
    main()
