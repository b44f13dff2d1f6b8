"""A Mooncake Store node of the benchmark, run as a script under ``--peer-python`` (an
interpreter with ``mooncake-transfer-engine-non-cuda``; mori is not installed there):
``python _mooncake_node.py ROLE CONFIG_JSON``.

``store``: a client of Mooncake Store that gives the pool a global segment big enough for
every page of the run, and serves it until stdin closes.
``client``: a client that gives no segment (``global_segment_size`` 0), so every put lands in
the storage node's segment and every get reads from there over the ``tcp`` transport; it
registers its buffers (zero-copy ``batch_put_from``/``batch_get_into``), runs the points and
exits. Metadata goes through the master's own HTTP metadata server.
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
    rc = store.setup(
        args["address"], f"http://{host}:{http}/metadata", segment, LOCAL_BUFFER, "tcp", "", f"{host}:{rpc}"
    )
    if rc != 0:
        raise RuntimeError(f"Mooncake Store setup ({role}) failed: {rc}")
    return store


class _Client:
    """The adapter :func:`_measure.run` drives; Mooncake's calls answer a count of bytes or 0 per
    key for success, a negative error code for failure."""

    ssd = False  # see docs/benchmarks.md: no SSD point for Mooncake Store

    def __init__(self, store: Any) -> None:
        self.store = store

    def register(self, ptr: int, size: int) -> None:
        if self.store.register_buffer(ptr, size) != 0:
            raise RuntimeError(f"Mooncake register_buffer of {size} bytes failed")

    def put(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[bool]:
        return [rc == 0 for rc in self.store.batch_put_from(keys, ptrs, sizes)]

    def get(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[bool]:
        return [rc == size for rc, size in zip(self.store.batch_get_into(keys, ptrs, sizes), sizes)]

    def exists(self, keys: list[str]) -> list[bool]:
        return [rc == 1 for rc in self.store.batch_is_exist(keys)]


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
        _measure.run(
            _Client(store), "mooncake", args["sizes"], args["pages"], args["iters"], args["warmup"], args["exists_keys"]
        )
        _measure.send({"done": True})
    finally:
        store.close()


if __name__ == "__main__":
    main()
