"""The TCP transport: :class:`TcpBackend` (``backend``) over mori-core's native data plane, which
moves host memory directly and stages GPU memory itself (:mod:`mori.core.staging`)."""

from .backend import TcpBackend

__all__ = ["TcpBackend"]
