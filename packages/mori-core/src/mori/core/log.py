"""mori's loggers: one per package (``mori.core``, ``mori.shmem``, ``mori.io``, ``mori.triton``, ``mori.umbp``).

``set_log_level("debug")`` sets all of them; ``set_log_level("info", module="io")`` one. The
default comes from ``MORI_LOG_LEVEL``. ``trace`` is a level below ``debug`` as in MORI.
"""

from __future__ import annotations

import logging

from . import config

__all__ = ["TRACE", "MODULES", "get_logger", "set_log_level"]

TRACE = 5
logging.addLevelName(TRACE, "TRACE")
MODULES = ("core", "shmem", "io", "triton", "umbp")
_LEVELS = {
    "trace": TRACE,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}
_configured = False


def _configure_once() -> None:
    global _configured
    if _configured:
        return
    _configured = True
    root = logging.getLogger("mori")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[mori %(name)s %(levelname)s pid=%(process)d] %(message)s"))
    root.addHandler(handler)
    root.propagate = False
    root.setLevel(_LEVELS[config.get("MORI_LOG_LEVEL")])


def get_logger(module: str) -> logging.Logger:
    """The logger of one mori module (``core``, ``shmem``, ``io``, ``triton``, ``umbp``) or a child of it."""
    _configure_once()
    return logging.getLogger(f"mori.{module}")


def set_log_level(level: str | int, module: str | None = None) -> None:
    """Sets the level of every mori logger, or of one module's (``core``, ``shmem``, ``io``, ``triton``, ``umbp``)."""
    _configure_once()
    if isinstance(level, str):
        try:
            level = _LEVELS[level.lower()]
        except KeyError:
            raise ValueError(f"unknown log level {level!r}; expected one of {', '.join(_LEVELS)}") from None
    if module is None:
        logging.getLogger("mori").setLevel(level)
        for m in MODULES:
            logging.getLogger(f"mori.{m}").setLevel(logging.NOTSET)
        return
    if module not in MODULES:
        raise ValueError(f"unknown mori module {module!r}; expected one of {', '.join(MODULES)}")
    logging.getLogger(f"mori.{module}").setLevel(level)
