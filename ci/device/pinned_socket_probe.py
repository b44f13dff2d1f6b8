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
  memory, is what slows a socket down);
- ``pageable-4k`` / ``pageable-2m``: ``pageable`` with transparent huge pages refused / asked for
  (whether the pages' size is what differs).

Before the table, each kind's mapping is described as /proc/self/smaps sees it (its huge pages,
locked bytes, flags), in a process of its own.

With ``--threads N`` each process runs N threads, each its own connection and buffer (as the TCP
plane's connections are), and the GB/s printed is their sum: whether one process's threads scale
with pinned memory as they do with pageable memory.

Usage: python ci/device/pinned_socket_probe.py [--total 2G] [--chunk 1M] [--kinds pageable,pinned,registered]
       [--send KINDS] [--receive KINDS] [--threads 1,4]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import multiprocessing as mp
import os
import queue
import socket
import threading
import time

import torch

KINDS = ("pageable", "pinned", "registered", "pinned-touched", "pageable-cuda", "pageable-4k", "pageable-2m")


class _Registered:
    """A mapping page-locked with cudaHostRegister, unregistered when dropped: a later mapping at
    the same address (the sender's next run) could not be registered otherwise."""

    def __init__(self, m: mmap.mmap, nbytes: int):
        self.m, self.t = m, torch.frombuffer(m, dtype=torch.uint8)
        rc = torch.cuda.cudart().cudaHostRegister(self.t.data_ptr(), nbytes, 1)  # cudaHostRegisterPortable
        assert int(rc) == 0, f"cudaHostRegister: {rc}"

    def __del__(self) -> None:
        torch.cuda.cudart().cudaHostUnregister(self.t.data_ptr())


def _buffer(kind: str, nbytes: int):  # noqa: ANN202 - a memoryview that keeps its owner alive
    if kind.startswith("pinned"):
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if kind == "pinned-touched":
            t.fill_(1)
        return memoryview(t.numpy()), t
    if kind == "pageable-cuda":
        torch.empty(1, device="cuda")  # the process's CUDA context
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if kind in ("registered", "pageable-2m"):
        m.madvise(mmap.MADV_HUGEPAGE)
    elif kind == "pageable-4k":
        m.madvise(mmap.MADV_NOHUGEPAGE)
    view = memoryview(m)
    view[:] = b"\x01" * nbytes  # touched: pages exist before they are registered or timed
    return view, (_Registered(m, nbytes) if kind == "registered" else m)


def _describe(kind: str, nbytes: int, out_q) -> None:  # noqa: ANN001
    view, keep = _buffer(kind, nbytes)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(view)) if not view.readonly else 0
    fields, current = {}, None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                current = lo <= addr < hi
            elif current and head in ("Size:", "Rss:", "AnonHugePages:", "Locked:", "KernelPageSize:", "VmFlags:"):
                fields[head[:-1]] = " ".join(line.split()[1:])
    fields["CPUs allowed"] = str(len(os.sched_getaffinity(0)))
    out_q.put(f"{kind:>14}: " + ", ".join(f"{k} {v}" for k, v in fields.items()))
    del keep


def _receive(view: memoryview, chunk: int, total: int, srv: socket.socket, short: list[int]) -> None:
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


def _receiver(kind: str, chunk: int, total: int, threads: int, port_q, out_q) -> None:
    servers = []
    for _ in range(threads):
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        srv.settimeout(60)  # a sender that failed never connects: the run goes on without it
        servers.append(srv)
    # The buffers exist (a CUDA context created for them, which takes longer than a transfer)
    # before the senders learn the ports: the time measured is the transfer's alone.
    buffers = [_buffer(kind, chunk * 8) for _ in servers]
    port_q.put([srv.getsockname()[1] for srv in servers])
    short: list[int] = []
    workers = [
        threading.Thread(target=_receive, args=(view, chunk, total, srv, short))
        for (view, _), srv in zip(buffers, servers, strict=True)
    ]
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
    p.add_argument("--send", help="kinds to send from (default: --kinds)")
    p.add_argument("--receive", help="kinds to receive into (default: --kinds)")
    p.add_argument("--threads", default="1")
    a = p.parse_args()
    kinds = a.kinds.split(",")
    send_kinds = a.send.split(",") if a.send else kinds
    receive_kinds = a.receive.split(",") if a.receive else kinds
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    total, chunk = (int(x[:-1]) * units[x[-1]] for x in (a.total, a.chunk))
    ctx = mp.get_context("spawn")
    for kind in dict.fromkeys(send_kinds + receive_kinds):
        out_q = ctx.Queue()
        d = ctx.Process(target=_describe, args=(kind, chunk * 8, out_q))
        d.start()
        try:
            print(out_q.get(timeout=60), flush=True)
        except queue.Empty:
            print(f"{kind:>14}: not described", flush=True)
        d.join(timeout=30)
    print(f"{'threads':>7} {'send from':>11} {'receive into':>13} {'GB/s':>6}")
    for threads in (int(n) for n in a.threads.split(",")):
        for send_kind in send_kinds:
            for recv_kind in receive_kinds:
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
