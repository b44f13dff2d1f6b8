"""Marks the ported cases that cannot pass reliably over TCP (README.md says why) and the one
that times a wait to tens of milliseconds (``quiet``: run alone), and makes MORI's example take
the ``fixed_ports`` lock, leaving MORI's test files as MORI wrote them apart from the
substitutions listed there."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

_RACE = ("MORI's check compares the whole buffer after waiting for the first of 64 separate transfers; "
         "it holds on MORI only when RDMA has finished the other 63 by then (timing, not an API guarantee)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.name == "test_wait_for_blocks_and_releases_gil" and item.path.parent == HERE:
            item.add_marker(pytest.mark.quiet)  # asserts 0.03 s < a 0.05 s wait < 0.30 s
        params = getattr(item, "callspec", None)
        if item.originalname == "test_rdma_backend_ops" and params is not None \
                and not params.params["enable_batch"] and params.params["batch_size"] > 1:
            item.add_marker(pytest.mark.xfail(reason=_RACE, strict=False))


@pytest.fixture(autouse=True)
def _example_takes_turns_on_its_ports(request: pytest.FixtureRequest) -> None:
    """MORI's example listens on ports 8080 and 8081: it holds the ``fixed_ports`` lock while it runs."""
    if request.path.name == "test_example.py":
        request.getfixturevalue("fixed_ports")
