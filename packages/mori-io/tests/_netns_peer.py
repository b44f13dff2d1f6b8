"""One side of the network-namespace tests, run as a script inside a namespace.

``python _netns_peer.py ROLE HOST SHM SIZE``: an engine named ROLE on HOST with the backends of
``MORI_TEST_BACKENDS`` (default ``tcp``; e.g. ``rdma``), SIZE bytes of the shared file SHM
registered; prints its packed engine and memory descriptors as hex, then answers commands read
from stdin, one line each.
"""

from __future__ import annotations

import os
import sys
import time

from _peer import SharedBuffer

from mori.io import (
    BackendType,
    EngineDesc,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    MemoryLocationType,
    StatusCode,
)

BACKENDS = {"tcp": BackendType.TCP, "rdma": BackendType.RDMA}


def _report(st) -> None:  # type: ignore[no-untyped-def]
    finished = st.WaitFor(60_000) != StatusCode.IN_PROGRESS
    print(st.Code().name if finished else "HUNG", st.Message().replace("\n", " ") or "-", flush=True)


def main() -> None:
    role, host, shm, size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    engine = IOEngine(role, IOEngineConfig(host=host, port=0))
    for name in os.environ.get("MORI_TEST_BACKENDS", "tcp").split(","):
        engine.create_backend(BACKENDS[name])
    buf = SharedBuffer(size, shm)
    mem = engine.register_memory(buf.addr, size, -1, MemoryLocationType.CPU)
    print(engine.get_engine_desc().pack().hex(), mem.pack().hex(), flush=True)
    half = size // 2
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "register":
            engine.register_remote_engine(EngineDesc.unpack(bytes.fromhex(args[0])))
            print("ok", flush=True)
        elif cmd in ("write", "read"):  # blocks of 64 KiB: write [0, half) there, read it into [half, size)
            remote = MemoryDesc.unpack(bytes.fromhex(args[0]))
            offs = list(range(0, half, 65536))
            uid = int(args[1]) if len(args) > 1 else engine.allocate_transfer_uid()
            fn = engine.batch_write if cmd == "write" else engine.batch_read
            l_offs = offs if cmd == "write" else [o + half for o in offs]
            _report(fn(mem, l_offs, remote, offs, [65536] * len(offs), uid))
        elif cmd == "session":  # one write and one read of a quarter through a session
            sess = engine.create_session(mem, MemoryDesc.unpack(bytes.fromhex(args[0])))
            if sess is None:
                print("NO_SESSION -", flush=True)
                continue
            quarter = size // 4
            st = sess.write(0, quarter, quarter, sess.allocate_transfer_uid())
            st.WaitFor(60_000)
            if not st.Succeeded():
                _report(st)
                continue
            _report(sess.read(3 * quarter, quarter, quarter, sess.allocate_transfer_uid()))
        elif cmd == "inbound":  # KEY UID: the record of a transfer into this engine, within 10 s
            deadline = time.monotonic() + 10
            rec = engine.pop_inbound_transfer_status(args[0], int(args[1]))
            while rec is None and time.monotonic() < deadline:
                time.sleep(0.01)
                rec = engine.pop_inbound_transfer_status(args[0], int(args[1]))
            print("NONE" if rec is None else rec.Code().name, flush=True)
        elif cmd == "quit":
            break
    engine.close()


if __name__ == "__main__":
    main()
