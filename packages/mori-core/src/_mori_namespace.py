"""Makes ``import mori`` followed by ``mori.shmem.…`` or ``mori.io.…`` work, as MORI's own package does.

``mori`` is a PEP 420 namespace shared by four distributions, so it has no ``__init__`` that could
import its subpackages. mori-core, which every other package depends on, ships this module and
``mori_core.pth``, which imports it at interpreter start; it gives the namespace module a PEP 562
``__getattr__`` that imports ``mori.<name>`` on first use (so ``import mori; mori.io.IOEngine``
works with mori-io alone). Nothing heavy is imported at start-up.
"""

import importlib

_SUBPACKAGES = ("core", "shmem", "ops", "io", "triton")


def _install() -> None:
    try:
        namespace = importlib.import_module("mori")
    except ImportError:  # mori is not on sys.path in this interpreter
        return
    if "__getattr__" in vars(namespace):
        return

    def __getattr__(name: str) -> object:
        if name in _SUBPACKAGES:
            return importlib.import_module(f"mori.{name}")
        raise AttributeError(f"module 'mori' has no attribute {name!r}")

    setattr(namespace, "__getattr__", __getattr__)  # noqa: B010 - a module attribute, set by name


_install()
