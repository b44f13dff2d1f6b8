"""``mori.ir.triton.runtime``: ``get_extern_libs`` and ``install_hook`` (MORI's module path)."""

from mori.triton._runtime import get_extern_libs, install_hook

__all__ = ["get_extern_libs", "install_hook"]
