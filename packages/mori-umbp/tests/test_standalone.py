"""The standalone-process mode: the pool in a server process, clients' pages in shared memory
handed over as descriptors; every byte checked, two clients sharing one pool, memory the server
cannot reach refused, a client that dies, and the server started by the client."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mori.umbp import (
    UMBPClient,
    UMBPConfig,
    UMBPDeploymentMode,
    UMBPHostBufferBacking,
    UMBPHostMemAllocator,
    UMBPStandaloneProcessConfig,
)

PAGE = 16 << 10


def _env(tmp_path: Path) -> dict[str, str]:
    return {
        **os.environ,
        "UMBP_DRAM_CAPACITY": str(256 << 10),
        "UMBP_DRAM_PREFAULT": "0",
        "UMBP_SSD_DIR": str(tmp_path / "ssd"),
        "UMBP_SSD_CAPACITY": str(16 << 20),
        "PYTHONFAULTHANDLER": "1",
    }


@pytest.fixture()
def server(tmp_path):
    """``unix://`` address of a standalone server in a process of its own."""
    address = f"unix://{tmp_path}/umbp.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "mori.umbp._standalone", address],
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("[Standalone] Listening on"), line
    yield address
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)  # PYTHONFAULTHANDLER: every thread's stack, then it dies
        out = proc.communicate(timeout=30)[0]
        pytest.fail(f"the server outlived SIGTERM by 30 s; its threads:\n{out[-12000:]}")


def _client(address: str, **kw) -> UMBPClient:
    cfg = UMBPConfig()
    cfg.standalone_process = UMBPStandaloneProcessConfig(address=address, **kw)
    return UMBPClient(cfg)


def _shared_pages(count: int, seed: int):
    allocator = UMBPHostMemAllocator()
    handle = allocator.alloc(count * PAGE, UMBPHostBufferBacking.AnonymousShm)
    assert handle.actual_backing == UMBPHostBufferBacking.AnonymousShm
    view = np.frombuffer((ctypes.c_byte * (count * PAGE)).from_address(handle.ptr), dtype=np.uint8)
    view[:] = np.random.default_rng(seed).integers(0, 256, count * PAGE, dtype=np.uint8)
    return allocator, handle, view.reshape(count, PAGE)


def test_put_get_through_the_server(server) -> None:
    allocator, handle, src = _shared_pages(48, 1)
    _, out_handle, dst = _shared_pages(48, 2)
    client = _client(server)
    try:
        assert client.get_deployment_mode() == UMBPDeploymentMode.StandaloneProcess and not client.is_distributed()
        assert client.get_backend_mode() == UMBPDeploymentMode.Local and not client.supports_ranged_io()
        assert client.register_memory(handle.ptr, 48 * PAGE) and client.register_memory(out_handle.ptr, 48 * PAGE)
        keys = [f"k{i}" for i in range(48)]
        ptrs = [handle.ptr + i * PAGE for i in range(48)]
        assert client.batch_put_from_ptr_with_depth(keys, ptrs, [PAGE] * 48, list(range(48))) == [True] * 48
        assert client.flush()  # 768 KiB for 256 KiB of DRAM: the server's SSD holds most
        assert client.batch_exists_consecutive(keys + ["nope"]) == 48 and client.exists("k0")
        dst[:] = 0
        got = client.batch_get_into_ptr(keys, [out_handle.ptr + i * PAGE for i in range(48)], [PAGE] * 48)
        assert got == [True] * 48 and np.array_equal(src, dst)
        assert client.get_into_ptr("k5", out_handle.ptr, PAGE) and np.array_equal(dst[0], src[5])
        assert not client.get_into_ptr("absent", out_handle.ptr, PAGE)
        assert client.clear() and not client.exists("k0")
    finally:
        client.close()
        allocator.free(handle)
        allocator.free(out_handle)


def test_two_clients_share_one_pool(server) -> None:
    allocator, handle, src = _shared_pages(4, 3)
    _, out_handle, dst = _shared_pages(4, 4)
    writer, reader = _client(server), _client(server)
    try:
        assert writer.register_memory(handle.ptr, handle.mapped_size)
        assert reader.register_memory(out_handle.ptr, out_handle.mapped_size)
        assert all(writer.batch_put_from_ptr(["a", "b"], [handle.ptr, handle.ptr + PAGE], [PAGE, PAGE]))
        dst[:] = 0
        assert reader.batch_get_into_ptr(["b", "a"], [out_handle.ptr, out_handle.ptr + PAGE], [PAGE, PAGE]) == [
            True,
            True,
        ]
        assert np.array_equal(dst[0], src[1]) and np.array_equal(dst[1], src[0])
        # the reader's pages are its own: a writer's address names nothing for it
        assert reader.get_into_ptr("a", handle.ptr, PAGE) is False
    finally:
        writer.close()
        reader.close()
        allocator.free(handle)
        allocator.free(out_handle)


def test_memory_the_server_cannot_reach_is_refused(server) -> None:
    client = _client(server)
    try:
        private = np.zeros(PAGE, np.uint8)
        assert client.register_memory(int(private.ctypes.data), PAGE) is False
        assert client.put_from_ptr("k", int(private.ctypes.data), PAGE) is False
        assert not client.exists("k")
    finally:
        client.close()


def test_a_client_that_dies_leaves_the_server_serving(server) -> None:
    code = (
        "import sys, numpy as np\n"
        "from mori.umbp import *\n"
        "cfg = UMBPConfig(); cfg.standalone_process = UMBPStandaloneProcessConfig(address=sys.argv[1])\n"
        "c = UMBPClient(cfg)\n"
        "h = UMBPHostMemAllocator().alloc(1 << 16, UMBPHostBufferBacking.AnonymousShm)\n"
        "assert c.register_memory(h.ptr, 1 << 16)\n"
        "assert c.put_from_ptr('from-the-dead', h.ptr, 4096)\n"
        "print('ready', flush=True)\n"
        "import time; time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code, server], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    child.kill()
    child.wait(10)
    client = _client(server)
    try:
        assert client.exists("from-the-dead")  # its pages stay in the pool; its buffers are unmapped
        allocator, handle, _ = _shared_pages(1, 5)
        assert client.register_memory(handle.ptr, PAGE) and client.get_into_ptr("from-the-dead", handle.ptr, 4096)
        allocator.free(handle)
    finally:
        client.close()


def test_the_client_starts_the_server_and_stops_it(tmp_path, monkeypatch) -> None:
    for name, value in _env(tmp_path).items():
        if name.startswith("UMBP_"):
            monkeypatch.setenv(name, value)
    address = f"unix://{tmp_path}/auto.sock"
    with pytest.raises(RuntimeError, match="auto_start is off"):
        _client(address, startup_timeout_ms=300)
    client = _client(address, auto_start=True, startup_timeout_ms=60000)
    allocator, handle, src = _shared_pages(1, 6)
    try:
        assert client.register_memory(handle.ptr, PAGE) and client.put_from_ptr("x", handle.ptr, PAGE)
        assert client.exists("x")
    finally:
        client.close()
        allocator.free(handle)
    deadline = time.monotonic() + 30
    while Path(f"{tmp_path}/auto.sock.fd").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"{tmp_path}/auto.sock.fd").exists()  # the server it started is gone


def test_the_address_must_be_a_unix_socket() -> None:
    with pytest.raises(ValueError, match="unix:///PATH"):
        _client("127.0.0.1:5000")
