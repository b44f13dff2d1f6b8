"""GpuTransfer.wait (the NVLink backend's completion) over mori.core.gpu.Completion, with the event
query replaced by a scripted one: the GPU runs of this path are test_nvlink_gpu.py (ci/device)."""

from __future__ import annotations

import time
import types
from typing import Any

from mori.core.gpu import Completion
from mori.io.backends.nvlink._queues import GpuTransfer
from mori.io.types import StatusCode

NOT_READY = 600  # CUDA_ERROR_NOT_READY


def _transfer(results: list[int], deadline: float) -> tuple[GpuTransfer, list[Any]]:
    """A transfer of two events whose queries answer ``results`` in turn (then 0, fired)."""
    answers = iter(results)
    queries: list[Any] = []

    def query(event: Any) -> tuple[int]:
        queries.append(event)
        return (next(answers, 0),)

    queues = types.SimpleNamespace(device=3)
    done: list[GpuTransfer] = []
    completion = Completion(["ev0", "ev1"], query, "NVLink copy on device 3")
    return GpuTransfer(queues, completion, [], deadline, done.append), done  # type: ignore[arg-type]


def test_wait_ends_when_every_event_fired_and_runs_on_done_once() -> None:
    t, done = _transfer([NOT_READY, NOT_READY, 0, NOT_READY], time.monotonic() + 60)
    assert t.wait(10.0)
    assert t.code() == StatusCode.SUCCESS and t.message() == "" and done == [t]
    assert t.wait(10.0) and done == [t]


def test_a_failed_event_ends_the_transfer_with_the_error() -> None:
    t, done = _transfer([NOT_READY, 700], time.monotonic() + 60)  # 700: CUDA_ERROR_ILLEGAL_ADDRESS
    assert t.wait(10.0)
    assert t.code() == StatusCode.ERR_GPU_OP and "NVLink copy failed on device 3" in t.message()


def test_the_transfer_deadline_fails_it_and_a_short_wait_only_returns() -> None:
    t, done = _transfer([NOT_READY] * 10**6, time.monotonic() + 3600)
    assert not t.wait(0.02) and t.code() == StatusCode.IN_PROGRESS and done == []
    t, done = _transfer([NOT_READY] * 10**6, time.monotonic() - 1)
    assert t.wait(10.0)
    assert t.code() == StatusCode.ERR_GPU_OP and "did not complete in time (MORI_IO_TIMEOUT)" in t.message()
    assert done == [t] and t.abandoned
