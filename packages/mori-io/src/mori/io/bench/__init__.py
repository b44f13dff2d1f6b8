"""The mori-io benchmark (``mori-io-bench`` / ``python -m mori.io.bench``); needs the ``bench``
extra (``pip install 'mori-io[bench]'``: numpy, tqdm, matplotlib)."""

try:
    from ._cli import main, parse_args
except ImportError as err:  # a missing extra: say which one
    raise ImportError(f"mori-io-bench needs the 'bench' extra (pip install 'mori-io[bench]'): {err}") from err

__all__ = ["main", "parse_args"]
