"""One side of the network-namespace test, run as a script inside a namespace.

``python _netns_peer.py target HOST SHM SIZE`` / ``... initiator HOST SHM SIZE``: prints its
packed engine (and memory) descriptors as hex lines, then follows commands read from stdin.
"""

from __future__ import annotations

import sys

from _peer import SharedBuffer

from mori.io import BackendType, EngineDesc, IOEngine, IOEngineConfig, MemoryDesc, MemoryLocationType


def main() -> None:
    role, host, shm, size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    engine = IOEngine(role, IOEngineConfig(host=host, port=0))
    engine.create_backend(BackendType.TCP)
    buf = SharedBuffer(size, shm)
    mem = engine.register_memory(buf.addr, size, -1, MemoryLocationType.CPU)
    print(engine.get_engine_desc().pack().hex(), mem.pack().hex(), flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "register":
            engine.register_remote_engine(EngineDesc.unpack(bytes.fromhex(args[0])))
            print("ok", flush=True)
        elif cmd in ("write", "read"):
            remote = MemoryDesc.unpack(bytes.fromhex(args[0]))
            half = size // 2
            offs = list(range(0, half, 65536))
            uid = engine.allocate_transfer_uid()
            fn = engine.batch_write if cmd == "write" else engine.batch_read
            l_offs = offs if cmd == "write" else [o + half for o in offs]
            st = fn(mem, l_offs, remote, offs, [65536] * len(offs), uid)
            st.WaitFor(60)
            print(st.Code().name, st.Message().replace("\n", " ") or "-", flush=True)
        elif cmd == "quit":
            break
    engine.close()


if __name__ == "__main__":
    main()
