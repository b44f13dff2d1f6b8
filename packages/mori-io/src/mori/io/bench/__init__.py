"""The mori-io benchmark (``mori-io-bench`` / ``python -m mori.io.bench``). It runs on a plain
mori-io install; the ``bench`` extra (``pip install 'mori-io[bench]'``: tqdm, matplotlib, numpy)
adds the progress bar, ``--plot`` and the peers' buffers."""

from ._cli import main, parse_args, run_peer

__all__ = ["main", "parse_args", "run_peer"]
