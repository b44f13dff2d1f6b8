"""Fixtures: ``make_client``, small pools closed after the test."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from _pool import small_config

from mori.umbp import UMBPClient, UMBPConfig


@pytest.fixture()
def make_client(tmp_path) -> Iterator[Callable[..., UMBPClient]]:
    """``make_client(**small_config kwargs)``: a client, closed after the test."""
    clients: list[UMBPClient] = []

    def make(cfg: UMBPConfig | None = None, **kwargs) -> UMBPClient:
        client = UMBPClient(cfg if cfg is not None else small_config(tmp_path, **kwargs))
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()
