"""mori.core.gpu's driver calls, scripted (no GPU): a fake ``cuda.bindings.driver`` answers by name
and records the calls. StreamPool grows only while busy and hands streams out round-robin;
EventPool keeps a bounded number idle; Completion tracks fired events, reports a failed copy and
times out; BatchMemcpy falls back to one copy each. The same pieces on a GPU: test_gpu_device.py."""

from __future__ import annotations

import types
from typing import Any

import pytest

from mori.core import cuda, gpu

NOT_READY, ILLEGAL_ADDRESS = 600, 700


class _Driver:
    """The driver calls mori.core.gpu makes, answered from scripted state."""

    CUstream_flags = types.SimpleNamespace(
        CU_STREAM_DEFAULT=types.SimpleNamespace(value=0), CU_STREAM_NON_BLOCKING=types.SimpleNamespace(value=1)
    )
    CUevent_flags = types.SimpleNamespace(CU_EVENT_DISABLE_TIMING=types.SimpleNamespace(value=2))
    CUdriverProcAddress_flags = types.SimpleNamespace(CU_GET_PROC_ADDRESS_DEFAULT=0)
    CUresult = int

    def __init__(self, version: int = 13000) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.busy: set[str] = set()  # streams with work queued
        self.events: dict[str, int] = {}  # event -> what cuEventQuery answers
        self.version = version
        self.created = 0

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("cu"):
            raise AttributeError(name)

        def call(*args: Any) -> tuple[Any, ...]:
            self.calls.append((name, *args))
            return self._answer(name, *args)

        return call

    def _answer(self, name: str, *args: Any) -> tuple[Any, ...]:
        if name in (
            "cuInit",
            "cuCtxSetCurrent",
            "cuStreamSynchronize",
            "cuStreamDestroy",
            "cuEventDestroy",
            "cuEventRecord",
            "cuMemcpyAsync",
        ):
            return (0,)
        answers = {
            "cuDeviceGetCount": 1,
            "cuDeviceGet": 0,
            "cuDevicePrimaryCtxRetain": "ctx0",
            "cuCtxGetCurrent": "callers-ctx",
            "cuDriverGetVersion": self.version,
        }
        if name in answers:
            return (0, answers[name])
        if name in ("cuStreamCreate", "cuEventCreate"):
            self.created += 1
            return (0, f"{'s' if name == 'cuStreamCreate' else 'e'}{self.created}")
        if name == "cuStreamQuery":
            return (NOT_READY if args[0] in self.busy else 0,)
        if name == "cuEventQuery":
            return (self.events.get(args[0], 0),)
        if name == "cuGetProcAddress":
            return (0, 0xBA7C4, 0)
        if name == "cuGetErrorString":
            return (0, b"scripted error")
        raise AssertionError(f"unexpected driver call {name}")

    def named(self, name: str) -> list[tuple[Any, ...]]:
        return [c for c in self.calls if c[0] == name]


@pytest.fixture
def drv(monkeypatch: pytest.MonkeyPatch) -> _Driver:
    fake = _Driver()
    monkeypatch.setattr(cuda, "driver", lambda: fake)
    monkeypatch.setattr(cuda, "_contexts", {})
    return fake


def test_on_device_restores_the_callers_context(drv: _Driver) -> None:
    with gpu.on_device(0) as ctx:
        assert ctx == "ctx0" and drv.calls[-1] == ("cuCtxSetCurrent", "ctx0")
    assert drv.calls[-1] == ("cuCtxSetCurrent", "callers-ctx")
    with pytest.raises(RuntimeError), gpu.on_device(0):
        raise RuntimeError("the block failed")
    assert drv.calls[-1] == ("cuCtxSetCurrent", "callers-ctx")  # restored on failure too
    with pytest.raises(ValueError, match="device 3 does not exist"), gpu.on_device(3):
        pass


def test_stream_pool_grows_only_while_busy_and_goes_round_robin(drv: _Driver) -> None:
    pool = gpu.StreamPool(0, 3)
    assert pool.take() == ["s1"] and pool.take() == ["s1"]  # idle: reused, nothing created
    drv.busy.add("s1")
    assert pool.take() == ["s2"] and len(pool) == 2  # the one it would hand out is busy: a new one
    drv.busy.add("s2")
    assert pool.take(2) == ["s3", "s1"] and len(pool) == 3  # at most 3, then round-robin busy or not
    assert pool.take() == ["s2"] and pool.take(5) == ["s3", "s1", "s2"]
    assert all(c[1] == 0 for c in drv.named("cuStreamCreate"))  # blocking streams (CU_STREAM_DEFAULT)
    pool.synchronize(["s1"])
    assert drv.named("cuStreamSynchronize") == [("cuStreamSynchronize", "s1")]
    pool.close()
    assert sorted(c[1] for c in drv.named("cuStreamDestroy")) == ["s1", "s2", "s3"] and len(pool) == 0
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="max_streams"):
            gpu.StreamPool(0, bad)  # type: ignore[arg-type]
    polls = gpu.StreamPool(0, 1, blocking=False)
    assert polls.take() == polls.take() and drv.named("cuStreamCreate")[-1][1] == 1  # CU_STREAM_NON_BLOCKING


def test_event_pool_reuses_up_to_its_bound(drv: _Driver) -> None:
    pool = gpu.EventPool(0, 2)
    events = [pool.take() for _ in range(3)]
    assert events == ["e1", "e2", "e3"] and all(c[1] == 2 for c in drv.named("cuEventCreate"))  # no timing
    pool.give(events)
    assert pool.idle == 2 and drv.named("cuEventDestroy") == [("cuEventDestroy", "e3")]
    ev = pool.record("s9")
    assert ev in ("e1", "e2") and drv.named("cuEventRecord") == [("cuEventRecord", ev, "s9")]
    assert len(drv.named("cuEventCreate")) == 3  # reused
    pool.close()
    assert pool.idle == 0 and len(drv.named("cuEventDestroy")) == 2
    with pytest.raises(ValueError, match="max_idle"):
        gpu.EventPool(0, -1)


def test_a_failed_record_raises_and_keeps_the_event(drv: _Driver, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = gpu.EventPool(0, 4)
    monkeypatch.setattr(pool, "_record", lambda ev, stream: (ILLEGAL_ADDRESS,))
    with pytest.raises(cuda.CudaError, match="cuEventRecord failed.*device 0"):
        pool.record("s1")
    assert pool.idle == 1


def test_completion_tracks_fired_events_and_reports_errors(drv: _Driver) -> None:
    pool = gpu.EventPool(0, 4)
    done = pool.completion(["a", "b", "c"], "copy X")
    drv.events.update(a=0, b=NOT_READY, c=NOT_READY)
    assert not done.poll() and done.fired == 1 and not done.done
    drv.events["b"] = 0
    assert not done.poll() and done.fired == 2
    queried = len(drv.named("cuEventQuery"))
    drv.events["c"] = 0
    assert done.poll() and done.done and len(drv.named("cuEventQuery")) == queried + 1  # only c asked again
    assert done.poll() and done.wait(0.0)
    failed = pool.completion(["x"], "copy Y")
    drv.events["x"] = ILLEGAL_ADDRESS
    with pytest.raises(cuda.CudaError, match=r"cuEventQuery failed: .*\(700\).*copy Y"):
        failed.wait(1.0)
    late = pool.completion(["y"])
    drv.events["y"] = NOT_READY
    assert not late.wait(0.02, spin=0.005, pause=1e-3, max_pause=2e-3)
    assert gpu.Completion([]).poll()  # nothing recorded: done at once


def test_batch_memcpy_uses_one_call_then_falls_back(drv: _Driver, monkeypatch: pytest.MonkeyPatch) -> None:
    answers = [0, 801, 0]
    batches: list[tuple[Any, ...]] = []

    def memcpy_batch(entry: int, dsts: Any, srcs: Any, sizes: Any, stream: int) -> int:
        batches.append((entry, list(dsts), list(srcs), list(sizes), stream))
        return answers.pop(0)

    monkeypatch.setattr(gpu, "_native_gpu", types.SimpleNamespace(memcpy_batch=memcpy_batch))
    batch = gpu.BatchMemcpy()
    assert batch.batched
    batch.copy([10, 20], [1, 2], [5, 6], 7)  # one batch call
    assert batches == [(0xBA7C4, [10, 20], [1, 2], [5, 6], 7)] and not drv.named("cuMemcpyAsync")
    batch.copy([30], [3], [8], 7)  # one copy: no batch call
    assert drv.named("cuMemcpyAsync") == [("cuMemcpyAsync", 30, 3, 8, 7)]
    batch.copy([40, 50], [4, 5], [9, 1], 7)  # refused (NOT_SUPPORTED): copied one by one ...
    assert not batch.batched and drv.named("cuMemcpyAsync")[1:] == [
        ("cuMemcpyAsync", 40, 4, 9, 7),
        ("cuMemcpyAsync", 50, 5, 1, 7),
    ]
    batch.copy([60, 70], [6, 7], [2, 3], 7)  # ... and from then on without asking again
    assert len(batches) == 2 and len(drv.named("cuMemcpyAsync")) == 5
    failing = gpu.BatchMemcpy()
    monkeypatch.setattr(gpu, "_native_gpu", types.SimpleNamespace(memcpy_batch=lambda *a: ILLEGAL_ADDRESS))
    with pytest.raises(cuda.CudaError, match="cuMemcpyBatchAsync failed.*(700).*two blocks"):
        failing.copy([1, 2], [3, 4], [5, 6], 7, "two blocks")


def test_batch_memcpy_before_cuda_13_copies_one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _Driver(version=12080)
    monkeypatch.setattr(cuda, "driver", lambda: fake)
    monkeypatch.setattr(fake, "cuMemcpyAsync", lambda *a: (ILLEGAL_ADDRESS,), raising=False)  # looked up once
    batch = gpu.BatchMemcpy()
    assert not batch.batched and not fake.named("cuGetProcAddress")
    with pytest.raises(cuda.CudaError, match=r"cuMemcpyAsync failed.*blocks: 8 bytes 0x3 -> 0x1"):
        batch.copy([1, 2], [3, 4], [8, 8], 7, "blocks")
