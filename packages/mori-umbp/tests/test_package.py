"""The distribution's shape: its version and its public names."""

from __future__ import annotations

from importlib import metadata

import mori.umbp


def test_version_is_the_distributions() -> None:
    assert mori.umbp.__version__ == metadata.version("mori-umbp")


def test_every_public_name_is_exported() -> None:
    for name in mori.umbp.__all__:
        assert hasattr(mori.umbp, name), name
