"""The seed's "Example: Basic Read/Write", unmodified except the backend (TCP instead of RDMA)
and the tensors' device (CPU instead of cuda:0/cuda:1)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the seed example uses torch tensors (torch is in ci/requirements-dev.txt)")


@pytest.mark.usefixtures("fixed_ports")  # the seed's ports, 8080 and 8081
def test_seed_basic_read_write():
    from mori.io import (
        BackendType,
        IOEngine,
        IOEngineConfig,
        TcpBackendConfig,
    )

    # Create engines on initiator and target
    config = IOEngineConfig(host="127.0.0.1", port=8080)
    initiator = IOEngine(key="initiator", config=config)
    config.port = 8081
    target = IOEngine(key="target", config=config)

    # Create TCP backends (the seed: RDMA)
    tcp_config = TcpBackendConfig()
    initiator.create_backend(BackendType.TCP, tcp_config)
    target.create_backend(BackendType.TCP, tcp_config)

    # Exchange and register engine descriptors
    initiator_desc = initiator.get_engine_desc()
    target_desc = target.get_engine_desc()
    initiator.register_remote_engine(target_desc)
    target.register_remote_engine(initiator_desc)

    # Register CPU tensors (the seed: GPU tensors)
    size = 1024 * 1024  # 1 MB
    src_tensor = torch.randint(0, 256, (size,), device="cpu", dtype=torch.uint8)
    dst_tensor = torch.zeros(size, device="cpu", dtype=torch.uint8)
    initiator_mem = initiator.register_torch_tensor(dst_tensor)
    target_mem = target.register_torch_tensor(src_tensor)

    # Read: copy from target (remote) to initiator (local)
    uid = initiator.allocate_transfer_uid()
    status = initiator.read(initiator_mem, 0, target_mem, 0, size, uid)

    # Wait for completion
    while status.InProgress():
        pass
    assert status.Succeeded()

    # With sessions (lower overhead for repeated transfers)
    sess = initiator.create_session(initiator_mem, target_mem)
    uid = sess.allocate_transfer_uid()
    status = sess.read(0, 0, size, uid)
    while status.InProgress():
        pass

    # Checks beyond the seed: the bytes arrived.
    assert status.Succeeded()
    assert torch.equal(src_tensor, dst_tensor)
    initiator.close()
    target.close()
