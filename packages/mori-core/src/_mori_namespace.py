"""Makes ``import mori`` followed by ``mori.shmem.…``, ``mori.io.…``, ``mori.cpp``, ``mori.ir`` or
``mori.__version__`` work, as MORI's own package does.

``mori`` is a PEP 420 namespace shared by four distributions, so it has no ``__init__`` that could
import its subpackages. mori-core, which every other package depends on, ships this module and
``mori_core.pth``, which imports it at interpreter start; it gives the namespace module a PEP 562
``__getattr__`` (and ``__dir__``) that imports ``mori.<name>`` on first use (so ``import mori;
mori.io.IOEngine`` works with mori-io alone), as MORI's ``__init__`` does for its lazy submodules.
Nothing heavy is imported at start-up.
"""

import importlib

# MORI's lazy submodules that mori has, and the distribution that ships each.
_SUBPACKAGES = {
    "core": "mori-core",
    "shmem": "mori-shmem",
    "ops": "mori-shmem",
    "io": "mori-io",
    "cpp": "mori-io",
    "triton": "mori-triton",
    "ir": "mori-triton",
    "umbp": "mori-umbp",
}


def _install() -> None:
    try:
        namespace = importlib.import_module("mori")
    except ImportError:  # mori is not on sys.path in this interpreter
        return
    if "__getattr__" in vars(namespace):
        return

    def __getattr__(name: str) -> object:
        if name == "__version__":
            # The four distributions are released together, at one version; mori-core is always here.
            from importlib.metadata import version

            return version("mori-core")
        if name not in _SUBPACKAGES:
            raise AttributeError(f"module 'mori' has no attribute {name!r}")
        try:
            return importlib.import_module(f"mori.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"mori.{name}":
                raise  # mori.<name> is there and something it imports is not
            raise AttributeError(
                f"module 'mori' has no attribute {name!r}: mori.{name} comes with the "
                f"{_SUBPACKAGES[name]} distribution (pip install {_SUBPACKAGES[name]})"
            ) from None

    def __dir__() -> list[str]:
        return sorted({*vars(namespace), *_SUBPACKAGES, "__version__"})

    setattr(namespace, "__getattr__", __getattr__)  # noqa: B010 - a module attribute, set by name
    setattr(namespace, "__dir__", __dir__)  # noqa: B010


_install()
