"""The mori-io benchmark (``mori-io-bench`` / ``python -m mori.io.bench``)."""

from ._cli import main, parse_args

__all__ = ["main", "parse_args"]
