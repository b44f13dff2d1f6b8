"""mori.core.cuda.poll, the one completion wait of the GPU code (no GPU needed: ready() is any check)."""

from __future__ import annotations

import pytest

from mori.core import cuda


def _ready_after(n: int) -> tuple[list[int], object]:
    calls = [0]

    def ready() -> bool:
        calls[0] += 1
        return calls[0] > n

    return calls, ready


@pytest.mark.parametrize("yield_while_spinning", [False, True])
def test_returns_true_at_the_first_ready_call(yield_while_spinning: bool) -> None:
    calls, ready = _ready_after(5)
    assert cuda.poll(
        ready,
        10.0,
        spin=1.0,
        pause=1e-4,
        max_pause=1e-3,  # type: ignore[arg-type]
        yield_while_spinning=yield_while_spinning,
    )
    assert calls[0] == 6


def test_after_the_spin_it_sleeps_and_still_finishes() -> None:
    calls, ready = _ready_after(3)
    assert cuda.poll(ready, 10.0, spin=0.0, pause=1e-5, max_pause=1e-4)  # type: ignore[arg-type]
    assert calls[0] == 4


def test_gives_up_at_the_timeout() -> None:
    calls, ready = _ready_after(10**9)
    assert not cuda.poll(ready, 0.05, spin=0.01, pause=1e-3, max_pause=4e-3)  # type: ignore[arg-type]
    assert calls[0] > 1
    calls, ready = _ready_after(0)
    assert cuda.poll(ready, 0.0, spin=0.0, pause=1e-3, max_pause=1e-3)  # type: ignore[arg-type]  # ready at once
