"""mori's device API as Triton ``@core.extern`` functions, generated from the device-function table.

Use inside ``@triton.jit`` kernels::

    from mori.triton import shmem as ms

    @triton.jit
    def ring(buf, nbytes):
        pe = ms.my_pe()
        ms.putmem_nbi_block(buf, buf, nbytes, (pe + 1) % ms.n_pes())   # qp_id defaults to 0
        ms.quiet_thread()

Pointers may be passed as Triton pointers or as int64 addresses. A scalar extern call runs on
every thread of the program: ``*_block`` functions expect the whole block, ``*_warp`` a full
warp; the library elects the thread that must act alone. Link the bitcode with
``extern_libs=get_extern_libs()`` or launch through :func:`mori.triton.jit`.
"""

from __future__ import annotations

from typing import Any

import triton.language as tl
from triton.language import core

from ._table import CMP, FUNCTIONS, SIGNAL_ADD, SIGNAL_SET, DeviceFunction

LIB_NAME = "libmori_shmem_device"

_TL_TYPES = {
    "i32": tl.int32,
    "u32": tl.uint32,
    "i64": tl.int64,
    "u64": tl.uint64,
    "f32": tl.float32,
    "f64": tl.float64,
    "ptr": tl.int64,
}


def _argument(value: Any, kind: str, semantic: Any) -> Any:
    tensor = semantic.to_tensor(value)
    if kind == "ptr" and not tensor.dtype.is_ptr() and not tensor.dtype.is_int():
        raise TypeError(f"expected a pointer or an int64 address, got {tensor.dtype}")
    return tl.cast(tensor, _TL_TYPES[kind], _semantic=semantic)


def _make_extern(fn: DeviceFunction) -> Any:
    arg_types = tuple(_TL_TYPES[t] for _, t in fn.args)
    names = [n for n, _ in fn.args]
    optional_qp = bool(names) and names[-1] == "qp_id"
    ret = _TL_TYPES[fn.ret]

    def extern(*args: Any, _semantic: Any = None) -> Any:
        if optional_qp and len(args) == len(arg_types) - 1:
            args = (*args, 0)
        if len(args) != len(arg_types):
            raise TypeError(f"ms.{fn.name}({', '.join(names)}) takes {len(arg_types)} arguments, got {len(args)}")
        cast = []
        for value, (name, kind) in zip(args, fn.args):
            try:
                cast.append(_argument(value, kind, _semantic))
            except (TypeError, ValueError) as exc:
                raise TypeError(f"ms.{fn.name}: argument {name!r}: {exc}") from None
        return core.extern_elementwise(
            LIB_NAME, "", cast, {arg_types: (fn.symbol, ret)}, is_pure=fn.pure, _semantic=_semantic
        )

    extern.__name__ = extern.__qualname__ = fn.name
    extern.__doc__ = f"``{fn.symbol}({', '.join(f'{n}: {t}' for n, t in fn.args)}) -> {fn.ret}``: {fn.doc}"
    return core.extern(extern)


_EXTERNS = {fn.name: _make_extern(fn) for fn in FUNCTIONS}
globals().update(_EXTERNS)
globals().update({f"CMP_{k}": v for k, v in CMP.items()})

__all__ = ["LIB_NAME", "SIGNAL_SET", "SIGNAL_ADD", *(f"CMP_{k}" for k in CMP), *_EXTERNS]
