"""mori.core: the runtime every mori package stands on.

Configuration (``MORI_*`` variables), logging, the bootstrap network, host and GPU memory,
native host atomics, a batch of copies and its planner (``batch``), the native TCP data plane
(``tcp``), per-device streams and events (``gpu``), GPU memory staged through pinned host
memory for data planes that cannot reach it (``staging``), the UCX engine (``ucx``), the NVRTC
device-code compiler and the device headers' location.
"""

from importlib import metadata as _metadata

from . import atomics, batch, codes, gpu, host, memory, nvrtc, staging, tcp, ucx
from .bootstrap import Bootstrap, BootstrapError, BootstrapTimeout, get_unique_id
from .config import ConfigError, parse_size
from .log import get_logger, set_log_level
from .memory import HostSegment

__version__ = _metadata.version("mori-core")

__all__ = [
    "Bootstrap",
    "BootstrapError",
    "BootstrapTimeout",
    "ConfigError",
    "HostSegment",
    "__version__",
    "atomics",
    "batch",
    "codes",
    "get_logger",
    "get_unique_id",
    "gpu",
    "host",
    "memory",
    "nvrtc",
    "parse_size",
    "set_log_level",
    "staging",
    "tcp",
    "ucx",
]
