"""``mori.umbp.bench``: the pool against Mooncake Store between network namespaces over TCP
(``mori-umbp-bench``; see docs/benchmarks.md)."""

from ._cli import main

__all__ = ["main"]
