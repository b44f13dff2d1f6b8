"""``MORI_DEVICE_FUNCTIONS``: MORI's dictionary view of mori's device-function table.

``{name: {"symbol", "args", "ret", "pure"}}`` with MORI's type strings (pointers as ``uint64``).
"""

from typing import Any

from mori.triton._table import FUNCTIONS, SIGNAL_ADD, SIGNAL_SET

__all__ = ["MORI_DEVICE_FUNCTIONS", "SIGNAL_ADD", "SIGNAL_SET"]

_MORI_TYPES = {
    "i32": "int32",
    "u32": "uint32",
    "i64": "int64",
    "u64": "uint64",
    "f32": "float32",
    "f64": "float64",
    "ptr": "uint64",
}

MORI_DEVICE_FUNCTIONS: dict[str, dict[str, Any]] = {
    f.name: {"symbol": f.symbol, "args": [_MORI_TYPES[t] for _, t in f.args], "ret": _MORI_TYPES[f.ret], "pure": f.pure}
    for f in FUNCTIONS
}
