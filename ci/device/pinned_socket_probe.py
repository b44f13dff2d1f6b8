"""Does a socket move bytes out of and into pinned host memory as fast as into pageable memory?

The TCP plane stages GPU memory through pinned host memory (cuMemHostAlloc) and sends or receives
it there; this sends ``--total`` bytes over loopback in ``--chunk`` pieces between two processes,
for each kind of buffer at each end, and prints GB/s:
- ``pageable``: an ordinary anonymous mapping (what host-memory transfers use);
- ``pinned``: cuMemHostAlloc through PyTorch (``pin_memory=True``), as the staging pool's;
- ``registered``: an anonymous mapping with transparent huge pages asked for, then page-locked
  with cudaHostRegister (pinned memory the kernel maps in 2 MiB pages where it can);
- ``pinned-touched``: ``pinned``, written by the CPU before it is timed;
- ``pageable-cuda``: ``pageable`` in a process with a CUDA context (whether the context, not the
  memory, is what slows a socket down).

With ``--threads N`` each process runs N threads, each its own connection and buffer (as the TCP
plane's connections are), and the GB/s printed is their sum: whether one process's threads scale
with pinned memory as they do with pageable memory.

Usage: python ci/device/pinned_socket_probe.py [--total 2G] [--chunk 1M] [--kinds pageable,pinned,registered]
       [--threads 1,4]
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import queue
import socket
import threading
import time

import torch

KINDS = ("pageable", "pinned", "registered", "pinned-touched", "pageable-cuda")


def _buffer(kind: str, nbytes: int):  # noqa: ANN202 - a memoryview that keeps its owner alive
    if kind.startswith("pinned"):
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if kind == "pinned-touched":
            t.fill_(1)
        return memoryview(t.numpy()), t
    if kind == "pageable-cuda":
        torch.empty(1, device="cuda")  # the process's CUDA context
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if kind == "registered":
        m.madvise(mmap.MADV_HUGEPAGE)
    view = memoryview(m)
    view[:] = b"\x01" * nbytes  # touched: pages exist before they are registered or timed
    if kind == "registered":
        t = torch.frombuffer(m, dtype=torch.uint8)
        rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 1)  # cudaHostRegisterPortable
        assert int(rc) == 0, f"cudaHostRegister: {rc}"
        return view, (m, t)
    return view, m


def _receive(kind: str, chunk: int, total: int, srv: socket.socket, short: list[int]) -> None:
    view, keep = _buffer(kind, chunk * 8)
    try:
        conn, _ = srv.accept()
    except TimeoutError:
        short.append(total)
        return
    got, slot = 0, 0
    while got < total:
        n = conn.recv_into(view[slot * chunk : (slot + 1) * chunk])
        if n == 0:
            break
        got += n
        if n == chunk or got % chunk == 0:
            slot = (slot + 1) % 8
    if got < total:
        short.append(total - got)
    del keep


def _receiver(kind: str, chunk: int, total: int, threads: int, port_q, out_q) -> None:
    servers = []
    for _ in range(threads):
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        srv.settimeout(60)  # a sender that failed never connects: the run goes on without it
        servers.append(srv)
    port_q.put([srv.getsockname()[1] for srv in servers])
    short: list[int] = []
    workers = [threading.Thread(target=_receive, args=(kind, chunk, total, srv, short)) for srv in servers]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    out_q.put(None if short else time.perf_counter())


def _send(kind: str, chunk: int, total: int, port: int, ready: threading.Barrier) -> None:
    view, keep = _buffer(kind, chunk * 8)
    s = socket.create_connection(("127.0.0.1", port))
    ready.wait()
    for i in range(total // chunk):
        s.sendall(view[(i % 8) * chunk : (i % 8 + 1) * chunk])
    s.close()
    del keep


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--total", default="2G")
    p.add_argument("--chunk", default="1M")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--threads", default="1")
    a = p.parse_args()
    kinds = a.kinds.split(",")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    total, chunk = (int(x[:-1]) * units[x[-1]] for x in (a.total, a.chunk))
    ctx = mp.get_context("spawn")
    print(f"{'threads':>7} {'send from':>11} {'receive into':>13} {'GB/s':>6}")
    for threads in (int(n) for n in a.threads.split(",")):
        for send_kind in kinds:
            for recv_kind in kinds:
                port_q, out_q = ctx.Queue(), ctx.Queue()
                rx = ctx.Process(target=_receiver, args=(recv_kind, chunk, total, threads, port_q, out_q))
                rx.start()
                ports = port_q.get(timeout=60)
                ready = threading.Barrier(threads + 1, timeout=60)
                senders = [
                    threading.Thread(target=_send, args=(send_kind, chunk, total, port, ready)) for port in ports
                ]
                for t in senders:
                    t.start()
                ready.wait()
                start = time.perf_counter()
                for t in senders:
                    t.join()
                try:
                    ended = out_q.get(timeout=120)
                except queue.Empty:
                    ended = None
                gbs = "failed" if ended is None else f"{threads * total / (ended - start) / 1e9:6.2f}"
                rx.join(timeout=30)
                if rx.is_alive():
                    rx.kill()
                print(f"{threads:>7} {send_kind:>11} {recv_kind:>13} {gbs:>6}", flush=True)


if __name__ == "__main__":
    main()
