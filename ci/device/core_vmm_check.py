"""CUDA VMM memory shared between processes through a POSIX fd passed over a Unix socket.

Process A creates an allocation on GPU 0 (a size that is not a multiple of the granularity),
fills it with seeded random bytes and passes ``export_fd()`` to process B over a Unix socket.
B imports and maps it on its own GPU, reads it back (cuMemcpyDtoH) and compares byte for byte,
then writes a second pattern into the upper half through its mapping; A reads its own memory
and checks that pattern arrived. Runs once with B on GPU 1 (over NVLink) and once with B on
GPU 0 (on a one-GPU machine only the second, and the first is reported as not run). Prints one
line per pair and writes JSON to ``--out``; exits 1 on any mismatch.

Usage: python core_vmm_check.py [--size BYTES] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import socket
import sys
import time
from typing import Any

TIMEOUT = 60.0


def _pattern(seed: int, n: int) -> bytes:
    return random.Random(seed).randbytes(n)


def _mismatch(got: bytes, want: bytes) -> dict[str, Any]:
    if got == want:
        return {"equal": True, "bytes": len(want)}
    first = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b) if len(got) == len(want) else -1
    diff = sum(a != b for a, b in zip(got, want))
    return {"equal": False, "bytes": len(want), "got_len": len(got), "first_mismatch": first, "mismatches": diff}


def exporter(name: str, size: int, seed: int, device: int) -> dict[str, Any]:
    """Process A: create, fill, export, hand over; afterwards check what B wrote."""
    from mori.core.memory import cuda_vmm, send_fds

    alloc = cuda_vmm.VmmAllocation.create(size, device)
    try:
        data = _pattern(seed, alloc.size)
        alloc.write(data)
        fd = alloc.export_fd()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(name)
            listener.listen(1)
            listener.settimeout(TIMEOUT)
            conn, _ = listener.accept()
        with conn:
            send_fds(conn, [fd], json.dumps({"size": alloc.size}).encode(), timeout=TIMEOUT)
            os.close(fd)
            conn.settimeout(TIMEOUT)
            reply = conn.recv(64)
        if reply != b"written":
            raise RuntimeError(f"importer replied {reply!r} instead of 'written'")
        half = alloc.size // 2
        back = alloc.read(alloc.size)
        return {
            "requested": size,
            "allocated": alloc.size,
            "granularity": cuda_vmm.granularity(device),
            "lower_half_kept": _mismatch(back[:half], data[:half]),
            "upper_half_from_importer": _mismatch(back[half:], _pattern(seed + 1, alloc.size - half)),
        }
    finally:
        alloc.free()


def importer(name: str, seed: int, device: int) -> dict[str, Any]:
    """Process B: receive the fd, import and map it on ``device``, read, compare, write back."""
    from mori.core.memory import cuda_vmm, recv_fds

    deadline = time.monotonic() + TIMEOUT
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    while True:
        try:
            sock.connect(name)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise TimeoutError(f"exporter socket {name!r} never appeared") from None
            time.sleep(0.05)
    with sock:
        payload, fds = recv_fds(sock, timeout=TIMEOUT)
        size = json.loads(payload)["size"]
        start = time.perf_counter()
        alloc = cuda_vmm.VmmAllocation.import_fd(fds[0], size, device)
        import_s = time.perf_counter() - start
        os.close(fds[0])
        try:
            start = time.perf_counter()
            got = alloc.read(size)
            read_s = time.perf_counter() - start
            result = _mismatch(got, _pattern(seed, size))
            half = size // 2
            alloc.write(_pattern(seed + 1, size - half), offset=half)
            sock.sendall(b"written")
        finally:
            alloc.free()
    return {
        "device": device,
        "import_ms": round(import_s * 1e3, 2),
        "read_GBps": round(size / read_s / 1e9, 2),
        "read_back": result,
    }


def _role(role: str, args: tuple[Any, ...]) -> dict[str, Any]:
    return exporter(*args) if role == "exporter" else importer(*args)


def run_pair(size: int, importer_device: int) -> dict[str, Any]:
    """Runs A (GPU 0) and B (``importer_device``) as spawned processes; kills both on failure."""
    from mori.core.testing import run_procs

    name = f"\0mori-vmm-check-{secrets.token_hex(8)}"
    seed = secrets.randbits(32)
    exported, imported = run_procs(
        _role, [("exporter", (name, size, seed, 0)), ("importer", (name, seed, importer_device))], timeout=2 * TIMEOUT
    )
    return {"exporter": exported, "importer": imported}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=(64 << 20) + 12345, help="bytes requested (default 64 MiB + 12345)")
    parser.add_argument("--out", default=None, help="write the JSON report here")
    args = parser.parse_args()
    report: dict[str, Any] = {"pairs": [], "not_run": []}
    ok = True
    from mori.core import cuda  # the children import it too; here only to count the GPUs

    cuda.call("cuInit", 0)
    importers = (1, 0) if int(cuda.call("cuDeviceGetCount")) >= 2 else (0,)
    if 1 not in importers:
        print("GPU0 -> GPU1: not run (this machine has one GPU)")
        report["not_run"].append("GPU0 -> GPU1: one GPU")
    for device in importers:
        try:
            pair = run_pair(args.size, device)
            good = (
                pair["importer"]["read_back"]["equal"]
                and pair["exporter"]["lower_half_kept"]["equal"]
                and pair["exporter"]["upper_half_from_importer"]["equal"]
            )
        except Exception as err:
            pair, good = {"error": str(err)}, False
        pair["importer_device"], pair["ok"] = device, good
        ok &= good
        report["pairs"].append(pair)
        if "error" in pair:
            print(f"GPU0 -> GPU{device}: FAILED: {pair['error']}")
        else:
            e, i = pair["exporter"], pair["importer"]
            print(
                f"GPU0 -> GPU{device}: {'ok' if good else 'MISMATCH'}  requested {e['requested']} B, "
                f"allocated {e['allocated']} B (granularity {e['granularity']}), import {i['import_ms']} ms, "
                f"read-back {i['read_GBps']} GB/s; importer wrote {e['allocated'] - e['allocated'] // 2} B "
                f"back: {'ok' if e['upper_half_from_importer']['equal'] else 'MISMATCH'}"
            )
            if not good:
                print(json.dumps(pair, indent=1))
    report["ok"] = ok
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print("core VMM check:", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
