"""mori.core: the runtime every mori package stands on.

Configuration (``MORI_*`` variables), logging, the bootstrap network, host and GPU memory,
native host atomics, the NVRTC device-code compiler and the device headers' location.
"""

from .bootstrap import Bootstrap, BootstrapError, BootstrapTimeout, get_unique_id
from .config import ConfigError, parse_size
from .log import get_logger, set_log_level

__version__ = "0.1.0"

__all__ = [
    "Bootstrap",
    "BootstrapError",
    "BootstrapTimeout",
    "ConfigError",
    "__version__",
    "get_logger",
    "get_unique_id",
    "parse_size",
    "set_log_level",
]
