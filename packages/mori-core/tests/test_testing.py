"""mori.core.testing's ProcPool: environment, one-worker calls, and failures with and without keep_on_error."""

from __future__ import annotations

import os

import pytest

from mori.core.testing import ProcPool, WorkerError, context


def _env_and_index(name: str) -> tuple[int, str | None]:
    return context().index, os.environ.get(name)


def _fail_on_odd() -> int:
    if context().index % 2:
        raise KeyError(f"odd {context().index}")
    return context().index


def test_env_run_on_and_errors_that_keep_the_pool() -> None:
    with ProcPool(3, timeout=60, env={"MORI_TEST_MARK": "x"}, label="PE", keep_on_error=True) as pool:
        assert pool.run(_env_and_index, "MORI_TEST_MARK") == [(0, "x"), (1, "x"), (2, "x")]
        assert pool.run_on(2, _env_and_index, "MORI_TEST_MARK") == (2, "x")
        with pytest.raises(WorkerError) as info:
            pool.run(_fail_on_odd)
        assert list(info.value.failures) == [1] and "PE 1: KeyError: 'odd 1'" in str(info.value)
        assert pool.run_on(0, _fail_on_odd) == 0  # still open


def test_an_error_closes_the_pool_by_default() -> None:
    with ProcPool(2, timeout=60) as pool:
        with pytest.raises(WorkerError, match="process 1: KeyError"):
            pool.run(_fail_on_odd)
        with pytest.raises(RuntimeError, match="closed"):
            pool.run(_fail_on_odd)


def test_start_hook_and_pids() -> None:
    started: list[int | None] = []

    def start(proc) -> None:  # runs here, in the parent, in place of proc.start()
        proc.start()
        started.append(proc.pid)

    with ProcPool(2, timeout=60, start=start) as pool:
        assert pool.pids == started and len(set(started)) == 2
        assert pool.run(os.getpid) == started
