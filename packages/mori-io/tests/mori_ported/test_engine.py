# Copyright © Advanced Micro Devices, Inc. All rights reserved.
#
# MIT License
#
# Permission is hereby granted, free of charge, to any person obtaining a copy
# of this software and associated documentation files (the "Software"), to deal
# in the Software without restriction, including without limitation the rights
# to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
# copies of the Software, and to permit persons to whom the Software is
# furnished to do so, subject to the following conditions:
#
# The above copyright notice and this permission notice shall be included in all
# copies or substantial portions of the Software.
#
# THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
# IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
# FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
# AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
# LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
# OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE
# SOFTWARE.
# Ported to mori (CPU CI): see README.md in this folder for every change made to MORI's file.
import pytest
import os
import time
from contextlib import contextmanager
import torch
from mori.io import (
    IOEngineConfig,
    BackendType,
    IOEngine,
    EngineDesc,
    MemoryDesc,
    StatusCode,
    MemoryLocationType,
    RdmaBackendConfig,
    TcpBackendConfig,
    set_log_level,
)


def create_connected_engine_pair(
    name_prefix,
    qp_per_transfer,
    post_batch_size,
    num_worker_threads,
    enable_notification=True,
):
    config = IOEngineConfig(
        host="127.0.0.1",
        port=0,
    )
    initiator = IOEngine(key=f"{name_prefix}_initiator", config=config)
    target = IOEngine(key=f"{name_prefix}_target", config=config)

    config = TcpBackendConfig(
        enable_notification=enable_notification,
    )
    with temporary_env("MORI_DISABLE_AUTO_XGMI", "1"):
        initiator.create_backend(BackendType.TCP, config)
        target.create_backend(BackendType.TCP, config)

    initiator_desc = initiator.get_engine_desc()
    target_desc = target.get_engine_desc()

    initiator.register_remote_engine(target_desc)
    target.register_remote_engine(initiator_desc)

    return initiator, target


@contextmanager
def temporary_env(env_name: str, value: str):
    old_value = os.environ.get(env_name)
    os.environ[env_name] = value
    try:
        yield
    finally:
        if old_value is None:
            os.environ.pop(env_name, None)
        else:
            os.environ[env_name] = old_value


@pytest.fixture(scope="module")
def pre_connected_engine_pair():
    set_log_level("info")
    initiator, target = create_connected_engine_pair(
        "normal", qp_per_transfer=2, post_batch_size=-1, num_worker_threads=1
    )
    multhd_initiator, multhd_target = create_connected_engine_pair(
        "multhd", qp_per_transfer=2, post_batch_size=-1, num_worker_threads=2
    )
    no_notif_initiator, no_notif_target = create_connected_engine_pair(
        "no_notif",
        qp_per_transfer=2,
        post_batch_size=-1,
        num_worker_threads=1,
        enable_notification=False,
    )

    engines = {
        "normal": (initiator, target),
        "multhd": (multhd_initiator, multhd_target),
        "no_notif": (no_notif_initiator, no_notif_target),
    }
    yield engines

    del initiator, target


def test_engine_desc():
    config = IOEngineConfig(
        host="127.0.0.1",
        port=0,
    )
    engine = IOEngine(key="engine", config=config)
    engine.create_backend(BackendType.TCP)

    desc = engine.get_engine_desc()
    assert desc.node_id != ""
    assert desc.pid > 0

    packed_desc = desc.pack()
    unpacked_desc = EngineDesc.unpack(packed_desc)
    assert desc == unpacked_desc


def test_engine_desc_port_zero_auto_bind():
    config = IOEngineConfig(
        host="127.0.0.1",
        port=0,
    )
    engine = IOEngine(key="engine_port0", config=config)
    engine.create_backend(BackendType.TCP)

    desc = engine.get_engine_desc()
    assert desc.port > 0
    assert desc.node_id != ""
    assert desc.pid > 0

    packed_desc = desc.pack()
    unpacked_desc = EngineDesc.unpack(packed_desc)
    assert desc == unpacked_desc


def test_engine_desc_node_id_env_override(monkeypatch):
    monkeypatch.setenv("MORI_NODE_ID", "node-id-test")
    config = IOEngineConfig(
        host="127.0.0.1",
        port=0,
    )
    engine = IOEngine(key="engine_node_id", config=config)
    desc = engine.get_engine_desc()
    assert desc.node_id == "node-id-test"


def test_rdma_backend_config_chunking_fields():
    default_config = RdmaBackendConfig()
    assert default_config.chunk_bytes == 65536

    config = RdmaBackendConfig(
        qp_per_transfer=4,
        post_batch_size=-1,
        num_worker_threads=2,
        enable_notification=True,
        notif_per_qp=2048,
        enable_transfer_chunking=True,
        chunk_bytes=65536,
        max_chunks_per_transfer=32,
        num_nics_per_transfer=2,
    )

    assert config.qp_per_transfer == 4
    assert config.post_batch_size == -1
    assert config.num_worker_threads == 2
    assert config.enable_notification is True
    assert config.notif_per_qp == 2048
    assert config.enable_transfer_chunking is True
    assert config.chunk_bytes == 65536
    assert config.max_chunks_per_transfer == 32
    assert config.num_nics_per_transfer == 2


def test_mem_desc():
    config = IOEngineConfig(
        host="127.0.0.1",
        port=0,
    )
    engine = IOEngine(key="engine", config=config)
    engine.create_backend(BackendType.TCP)

    # Test cpu tensor
    tensor = torch.ones([1, 2, 34, 56])
    mem_desc = engine.register_torch_tensor(tensor)

    assert mem_desc.engine_key == "engine"
    assert mem_desc.device_id == -1
    assert mem_desc.device_bus_id == ""
    assert mem_desc.data == tensor.data_ptr()
    assert mem_desc.size == tensor.nelement() * tensor.element_size()
    assert mem_desc.loc == MemoryLocationType.CPU
    assert mem_desc.numa_node >= -1

    # TODO: test mem_desc pack / unpack
    packed_desc = mem_desc.pack()
    unpacked_desc = MemoryDesc.unpack(packed_desc)
    assert mem_desc == unpacked_desc


def wait_status(status):
    while status.InProgress():
        pass


def wait_inbound_status(engine, remote_engine_key, remote_transfer_uid):
    while True:
        target_side_status = engine.pop_inbound_transfer_status(
            remote_engine_key, remote_transfer_uid
        )
        if target_side_status:
            return target_side_status


def wait_inbound_status_with_timeout(
    engine, remote_engine_key, remote_transfer_uid, timeout_s=2.0
):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        target_side_status = engine.pop_inbound_transfer_status(
            remote_engine_key, remote_transfer_uid
        )
        if target_side_status:
            return target_side_status
        time.sleep(0.001)
    return None


def alloc_and_register_mem(engine_pair, shape):
    initiator, target = engine_pair

    # register memory buffer
    device1 = torch.device("cpu")
    device2 = torch.device("cpu")
    tensor1 = torch.randint(1, 256, shape, dtype=torch.uint8, device=device1)
    tensor2 = torch.randint(1, 256, shape, dtype=torch.uint8, device=device2)

    initiator_mem = initiator.register_torch_tensor(tensor1)
    target_mem = target.register_torch_tensor(tensor2)
    return tensor1, tensor2, initiator_mem, target_mem


def check_transfer_result(
    engine_pair,
    initiator_status,
    initiator_tensor,
    initiator_tensor_copy,
    target_tensor,
    target_tensor_copy,
    transfer_uid,
    op_type,
    enable_notification=True,
):
    initiator, target = engine_pair
    wait_status(initiator_status)
    assert initiator_status.Succeeded()

    # Only check target inbound status when notification is enabled
    if enable_notification:
        target_status = wait_inbound_status(
            target, initiator.get_engine_desc().key, transfer_uid
        )
        assert target_status.Succeeded()
    else:
        time.sleep(0.001)

    # Verify data correctness
    assert torch.equal(initiator_tensor.cpu(), target_tensor.cpu())

    if op_type == "read":
        assert not torch.equal(initiator_tensor.cpu(), initiator_tensor_copy.cpu())
    else:
        assert not torch.equal(target_tensor.cpu(), target_tensor_copy.cpu())


@pytest.mark.parametrize("engine_type", ("normal", "multhd", "no_notif"))
@pytest.mark.parametrize(
    "enable_sess",
    (
        True,
        False,
    ),
)
@pytest.mark.parametrize(
    "enable_batch",
    (
        True,
        False,
    ),
)
@pytest.mark.parametrize(
    "op_type",
    (
        "write",
        "read",
    ),
)
@pytest.mark.parametrize(
    "batch_size",
    (
        1,
        64,
    ),
)
@pytest.mark.parametrize(
    "buffer_size",
    (
        8,
        8192,
    ),
)
def test_rdma_backend_ops(
    pre_connected_engine_pair,
    engine_type,
    enable_sess,
    enable_batch,
    op_type,
    batch_size,
    buffer_size,
):
    engine_pair = pre_connected_engine_pair[engine_type]
    initiator, target = engine_pair
    initiator_tensor, target_tensor, initiator_mem, target_mem = alloc_and_register_mem(
        engine_pair, [batch_size, buffer_size]
    )
    initiator_tensor_copy = initiator_tensor.clone()
    target_tensor_copy = target_tensor.clone()

    sess = initiator.create_session(initiator_mem, target_mem)
    offsets = [i * buffer_size for i in range(batch_size)]
    sizes = [buffer_size for _ in range(batch_size)]
    uid_status_list = []

    if enable_batch:
        if enable_sess:
            transfer_uid = sess.allocate_transfer_uid()
            func = sess.batch_read if op_type == "read" else sess.batch_write
            transfer_status = func(offsets, offsets, sizes, transfer_uid)
        else:
            transfer_uid = initiator.allocate_transfer_uid()
            func = initiator.batch_read if op_type == "read" else initiator.batch_write
            transfer_status = func(
                [initiator_mem],
                [offsets],
                [target_mem],
                [offsets],
                [sizes],
                [transfer_uid],
            )[0]
        uid_status_list.append((transfer_uid, transfer_status))
    else:
        for i in range(batch_size):
            if enable_sess:
                transfer_uid = sess.allocate_transfer_uid()
                func = sess.read if op_type == "read" else sess.write
                transfer_status = func(offsets[i], offsets[i], sizes[i], transfer_uid)
            else:
                transfer_uid = initiator.allocate_transfer_uid()
                func = initiator.read if op_type == "read" else initiator.write
                transfer_status = func(
                    initiator_mem,
                    offsets[i],
                    target_mem,
                    offsets[i],
                    sizes[i],
                    transfer_uid,
                )
            uid_status_list.append((transfer_uid, transfer_status))

    enable_notification = engine_type != "no_notif"
    for uid, status in uid_status_list:
        check_transfer_result(
            engine_pair,
            status,
            initiator_tensor,
            initiator_tensor_copy,
            target_tensor,
            target_tensor_copy,
            uid,
            op_type,
            enable_notification,
        )


def test_err_out_of_range(pre_connected_engine_pair):
    engine_pair = pre_connected_engine_pair["normal"]
    initiator, target = engine_pair
    initiator_tensor, target_tensor, initiator_mem, target_mem = alloc_and_register_mem(
        engine_pair,
        (
            2,
            32,
        ),
    )

    sess = initiator.create_session(initiator_mem, target_mem)
    offsets = (0, 32)
    sizes = (32, 34)

    transfer_uid = sess.allocate_transfer_uid()
    transfer_status = sess.batch_read(offsets, offsets, sizes, transfer_uid)

    assert transfer_status.Failed()
    assert transfer_status.Code() == StatusCode.ERR_INVALID_ARGS


def test_notification_disabled():
    """Test that when notification is disabled, pop_inbound_transfer_status doesn't work."""
    initiator, target = create_connected_engine_pair(
        "notif_test",
        qp_per_transfer=1,
        post_batch_size=-1,
        num_worker_threads=1,
        enable_notification=False,
    )

    initiator_tensor, target_tensor, initiator_mem, target_mem = alloc_and_register_mem(
        (initiator, target), [1, 64]
    )

    transfer_uid = initiator.allocate_transfer_uid()
    transfer_status = initiator.write(initiator_mem, 0, target_mem, 0, 64, transfer_uid)

    wait_status(transfer_status)
    assert transfer_status.Succeeded()

    # Verify data was transferred correctly
    assert torch.equal(initiator_tensor.cpu(), target_tensor.cpu())

    # pop_inbound_transfer_status should not work (returns None)
    time.sleep(0.1)
    inbound_status = target.pop_inbound_transfer_status(
        initiator.get_engine_desc().key, transfer_uid
    )
    assert inbound_status is None  # No notification received


def test_multithread_batch_error_path_is_recoverable():
    """Regression for callback meta ownership on error paths.

    Repeatedly trigger failing multithread batch calls, then verify a valid
    transfer still completes end-to-end with notification.
    """

    initiator, target = create_connected_engine_pair(
        "regress_cbmeta",
        qp_per_transfer=2,
        post_batch_size=-1,
        num_worker_threads=2,
        enable_notification=True,
    )

    initiator_tensor, target_tensor, initiator_mem, target_mem = alloc_and_register_mem(
        (initiator, target), (2, 64)
    )

    bad_offsets = [0, 64]
    bad_sizes = [64, 65]  # out-of-range for the second element

    # Run multiple failures to stress repeated cleanup/release behavior.
    for _ in range(20):
        transfer_uid = initiator.allocate_transfer_uid()
        status = initiator.batch_read(
            [initiator_mem],
            [bad_offsets],
            [target_mem],
            [bad_offsets],
            [bad_sizes],
            [transfer_uid],
        )[0]
        wait_status(status)
        assert status.Failed()
        assert status.Code() == StatusCode.ERR_INVALID_ARGS

    # Verify subsequent valid transfer still works.
    transfer_uid = initiator.allocate_transfer_uid()
    full_size = initiator_tensor.numel() * initiator_tensor.element_size()
    status = initiator.write(initiator_mem, 0, target_mem, 0, full_size, transfer_uid)
    wait_status(status)
    assert status.Succeeded(), status.Message()

    inbound = wait_inbound_status_with_timeout(
        target, initiator.get_engine_desc().key, transfer_uid, timeout_s=3.0
    )
    assert (
        inbound is not None
    ), "Expected inbound notification after successful transfer"
    assert inbound.Succeeded()
    assert torch.equal(initiator_tensor.cpu(), target_tensor.cpu())


def test_successful_writes_always_have_inbound_notification_under_pressure():
    """Regression for notify all-or-none behavior.

    Under low SQ timeout and high-frequency writes, every successful write must
    still produce a corresponding inbound completion notification.
    """

    with temporary_env("MORI_IO_SQ_BACKOFF_TIMEOUT_US", "100"):
        initiator, target = create_connected_engine_pair(
            "regress_notify",
            qp_per_transfer=4,
            post_batch_size=1,
            num_worker_threads=1,
            enable_notification=True,
        )

        initiator_tensor, target_tensor, initiator_mem, target_mem = (
            alloc_and_register_mem((initiator, target), (1, 128))
        )

        initiator_key = initiator.get_engine_desc().key

        for i in range(50):
            transfer_uid = initiator.allocate_transfer_uid()
            status = initiator.write(initiator_mem, 0, target_mem, 0, 128, transfer_uid)
            wait_status(status)

            if status.Succeeded():
                inbound = wait_inbound_status_with_timeout(
                    target, initiator_key, transfer_uid, timeout_s=2.0
                )
                assert (
                    inbound is not None
                ), f"Missing inbound notification for successful transfer {i}"
                assert inbound.Succeeded()
            else:
                # Failed transfers may legitimately miss notification; they
                # should not poison future successful transfers.
                assert status.Code() in (
                    StatusCode.ERR_RDMA_OP,
                    StatusCode.ERR_BAD_STATE,
                )

        assert torch.equal(initiator_tensor.cpu(), target_tensor.cpu())


def test_no_backend():
    config = IOEngineConfig(
        host="127.0.0.1",
        port=0,
    )
    initiator = IOEngine(key="no_be_initiator", config=config)
    target = IOEngine(key="no_be_target", config=config)

    initiator_desc = initiator.get_engine_desc()
    target_desc = target.get_engine_desc()

    initiator.register_remote_engine(target_desc)
    target.register_remote_engine(initiator_desc)

    initiator_tensor, target_tensor, initiator_mem, target_mem = alloc_and_register_mem(
        (initiator, target),
        (32,),
    )

    offsets = (0, 16)
    sizes = (16, 16)

    transfer_uid = initiator.allocate_transfer_uid()
    transfer_status = initiator.batch_read(
        [initiator_mem], [offsets], [target_mem], [offsets], [sizes], [transfer_uid]
    )[0]

    assert transfer_status.Failed()
    assert transfer_status.Code() == StatusCode.ERR_BAD_STATE

    sess = initiator.create_session(initiator_mem, target_mem)
    assert sess is None
