"""The one table of mori's device functions that Triton (and LLVM IR) kernels can call.

Every row names a C symbol of ``libmori_shmem_device.bc`` (MORI's ``mori_shmem_*`` ABI), its
arguments, its return type, whether it is pure, and the C++ device-API call its wrapper makes.
From this table come the ``extern "C"`` wrapper file (``mori/triton/csrc/mori_shmem_wrappers.cu``), the
Triton ``@core.extern`` functions of :mod:`mori.triton.shmem`, their type stub, MORI's
``mori.ir.ops.MORI_DEVICE_FUNCTIONS`` view and the reference table in the docs.

Types are short strings: ``i32 u32 i64 u64 f32 f64`` and ``ptr``. A ``ptr`` crosses the C
boundary as a 64-bit integer (``int64`` in Triton, ``i64`` in LLVM), because Triton's
``extern_elementwise`` rejects pointer arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

from mori.core.codes import Cmp, SignalOp

__all__ = ["SIGNAL_SET", "SIGNAL_ADD", "CMP", "TYPES", "DeviceFunction", "FUNCTIONS", "by_name"]

# Signal ops and comparison codes as plain ints (Triton constants), from their one definition.
SIGNAL_SET, SIGNAL_ADD = (op.value for op in SignalOp)
CMP = {c.name: c.value for c in Cmp}
# Type string -> C type of the wrapper's parameter.
TYPES = {
    "i32": "int32_t",
    "u32": "uint32_t",
    "i64": "int64_t",
    "u64": "uint64_t",
    "f32": "float",
    "f64": "double",
    "ptr": "uint64_t",
}


@dataclass(frozen=True)
class DeviceFunction:
    """One device function: ``mori_shmem_<name>(args) -> ret``.

    ``call`` is the C++ statement or expression (in ``mori::device``) the wrapper evaluates, with
    ``{arg}`` placeholders; ``returns`` says whether that expression is the wrapper's result
    (otherwise the wrapper returns 0, as MORI's void-like wrappers do).
    """

    name: str
    args: tuple[tuple[str, str], ...]
    ret: str
    call: str
    doc: str
    pure: bool = False
    returns: bool = False

    @property
    def symbol(self) -> str:
        """The C symbol in the bitcode."""
        return f"mori_shmem_{self.name}"


def _f(
    name: str, args: str, ret: str, call: str, doc: str, *, pure: bool = False, returns: bool = False
) -> DeviceFunction:
    # args: "dest:ptr source:ptr bytes:u64" -> (("dest","ptr"), ...)
    parsed = tuple(tuple(a.split(":")) for a in args.split())
    return DeviceFunction(name, parsed, ret, call, doc, pure, returns)  # type: ignore[arg-type]


_SCOPES = ("thread", "warp", "block")
# (table name, C element type, C++ name fragment) of the typed RMA variants: the device API's types
# (MORI's eleven plus half and bfloat16, which move as 16-bit storage).
_RMA_TYPES = (
    ("uint8", "uint8_t", "Uint8"),
    ("int8", "int8_t", "Int8"),
    ("schar", "signed char", "Schar"),
    ("uint16", "uint16_t", "Uint16"),
    ("int16", "int16_t", "Int16"),
    ("uint32", "uint32_t", "Uint32"),
    ("int32", "int32_t", "Int32"),
    ("uint64", "uint64_t", "Uint64"),
    ("int64", "int64_t", "Int64"),
    ("float", "float", "Float"),
    ("double", "double", "Double"),
    ("half", "uint16_t", "Half"),
    ("bfloat16", "uint16_t", "Bfloat16"),
)
# (table name, value type string, C type) of the scalar p/g and wait functions.
_SCALARS = (
    ("int32", "i32", "int32_t"),
    ("int64", "i64", "int64_t"),
    ("uint32", "u32", "uint32_t"),
    ("uint64", "u64", "uint64_t"),
    ("float", "f32", "float"),
    ("double", "f64", "double"),
)
_ATOMIC_TYPES = _SCALARS[:4]


def _query() -> list[DeviceFunction]:
    return [
        _f("my_pe", "", "i32", "ShmemMyPe()", "This PE's number.", pure=True, returns=True),
        _f("n_pes", "", "i32", "ShmemNPes()", "Number of PEs.", pure=True, returns=True),
        _f(
            "ptr_p2p",
            "ptr:ptr my_pe:i32 dest_pe:i32",
            "ptr",
            "ShmemPtrP2p({ptr}, {my_pe}, {dest_pe})",
            "Address of symmetric `ptr` as mapped for `dest_pe` (0: not P2P reachable).",
            pure=True,
            returns=True,
        ),
        _f(
            "ptr",
            "dest:ptr pe:i32",
            "ptr",
            "(uint64_t)ShmemPtr((const void*){dest}, {pe})",
            "Directly addressable copy of symmetric `dest` on `pe`, or 0.",
            pure=True,
            returns=True,
        ),
    ]


def _sync() -> list[DeviceFunction]:
    # P2P transport: the per-PE and per-QP forms order the same stores as the global ones.
    return [
        _f("quiet_thread", "", "i32", "ShmemQuietThread()", "Complete every put this thread issued."),
        _f("quiet_thread_pe", "pe:i32", "i32", "ShmemQuietThread()", "Complete this thread's puts to `pe`."),
        _f(
            "quiet_thread_pe_qp",
            "pe:i32 qp_id:i32",
            "i32",
            "ShmemQuietThread()",
            "Complete this thread's puts to `pe` on queue pair `qp_id`.",
        ),
        _f("quiet_block", "", "i32", "ShmemQuietBlock()", "Complete every put of the block (whole block calls)."),
        _f("fence_thread", "", "i32", "ShmemFenceThread()", "Order this thread's puts per destination PE."),
        _f("fence_thread_pe", "pe:i32", "i32", "ShmemFenceThread()", "Order this thread's puts to `pe`."),
        _f(
            "fence_thread_pe_qp",
            "pe:i32 qp_id:i32",
            "i32",
            "ShmemFenceThread()",
            "Order this thread's puts to `pe` on `qp_id`.",
        ),
        _f(
            "barrier_all_thread",
            "",
            "i32",
            "ShmemBarrierAllThread()",
            "Barrier of all PEs, called by one thread per PE.",
        ),
        _f(
            "barrier_all_block",
            "",
            "i32",
            "ShmemBarrierAllBlock()",
            "Barrier of all PEs, called by the whole block (one block per PE).",
        ),
    ]


def _rma() -> list[DeviceFunction]:
    rows = []
    for op, verb in (("put", "Put"), ("get", "Get")):
        what = "to" if op == "put" else "from"
        for nbi in (True, False):
            suffix, cxx_nbi = ("_nbi", "Nbi") if nbi else ("", "")
            kind = "non-blocking" if nbi else "blocking"
            for scope in _SCOPES:
                sc = scope.capitalize()
                rows.append(
                    _f(
                        f"{op}mem{suffix}_{scope}",
                        "dest:ptr source:ptr bytes:u64 pe:i32 qp_id:i32",
                        "i32",
                        f"Shmem{verb}Mem{cxx_nbi}{sc}((void*){{dest}}, (const void*){{source}}, {{bytes}}, {{pe}})",
                        f"{scope}-scope {kind} copy of `bytes` bytes {what} `pe`.",
                    )
                )
                for tname, ctype, cxx in _RMA_TYPES:
                    rows.append(
                        _f(
                            f"{op}_{tname}{suffix}_{scope}",
                            "dest:ptr source:ptr nelems:u64 pe:i32 qp_id:i32",
                            "i32",
                            f"Shmem{verb}{cxx}{cxx_nbi}{sc}(({ctype}*){{dest}}, (const {ctype}*){{source}}, {{nelems}}, {{pe}})",
                            f"{scope}-scope {kind} copy of `nelems` {tname} elements {what} `pe`.",
                        )
                    )
    for scope in _SCOPES:
        rows.append(
            _f(
                f"putmem_nbi_signal_{scope}",
                "dest:ptr source:ptr bytes:u64 sig_addr:ptr sig_value:u64 sig_op:i32 pe:i32 qp_id:i32",
                "i32",
                f"ShmemPutMemNbiSignal{scope.capitalize()}((void*){{dest}}, (const void*){{source}}, {{bytes}}, "
                f"(uint64_t*){{sig_addr}}, {{sig_value}}, {{sig_op}}, {{pe}})",
                f"{scope}-scope put, then SIGNAL_SET/SIGNAL_ADD of `sig_value` on `sig_addr` at `pe` after the data.",
            )
        )
    return rows


def _scalar() -> list[DeviceFunction]:
    rows = [
        _f(
            "int_p",
            "dest:ptr value:i32 pe:i32 qp_id:i32",
            "i32",
            "ShmemP<int32_t>((int32_t*){dest}, {value}, {pe})",
            "Store one int at `dest` on `pe`.",
        ),
        _f(
            "put_size_imm_nbi_thread",
            "dest:ptr value:ptr bytes:u64 pe:i32 qp_id:i32",
            "i32",
            "ShmemPutSizeImmNbiThread((void*){dest}, (const void*){value}, {bytes}, {pe})",
            "Store the `bytes` (1, 2, 4, 8 or 16) bytes at `value` to `dest` on `pe`, one store.",
        ),
    ]
    for tname, t, ctype in _SCALARS:
        rows.append(
            _f(
                f"{tname}_p",
                f"dest:ptr value:{t} pe:i32 qp_id:i32",
                "i32",
                f"ShmemP<{ctype}>(({ctype}*){{dest}}, {{value}}, {{pe}})",
                f"Store one {tname} at `dest` on `pe`.",
            )
        )
        rows.append(
            _f(
                f"{tname}_g",
                "source:ptr pe:i32 qp_id:i32",
                t,
                f"ShmemG<{ctype}>((const {ctype}*){{source}}, {{pe}})",
                f"Load one {tname} from `source` on `pe`.",
                returns=True,
            )
        )
    return rows


# (table op, C++ op) of the non-fetching atomics that take a value, and of the fetching ones.
_AMO_NONFETCH = (("add", "Add"), ("and", "And"), ("or", "Or"), ("xor", "Xor"), ("set", "Set"))
_AMO_FETCH = (("add", "Add"), ("and", "And"), ("or", "Or"), ("xor", "Xor"))


def _atomics() -> list[DeviceFunction]:
    rows = []
    for tname, t, ctype in _ATOMIC_TYPES:
        d = f"({ctype}*){{dest}}"
        for op, cxx in _AMO_NONFETCH:
            rows.append(
                _f(
                    f"{tname}_atomic_{op}_thread",
                    f"dest:ptr value:{t} pe:i32 qp_id:i32",
                    "i32",
                    f"ShmemAtomic{cxx}<{ctype}>({d}, {{value}}, {{pe}})",
                    f"Atomic {op} of `value` at `dest` on `pe`.",
                )
            )
        rows.append(
            _f(
                f"{tname}_atomic_fetch_thread",
                "dest:ptr pe:i32 qp_id:i32",
                t,
                f"ShmemG<{ctype}>({d}, {{pe}})",
                "Atomic (relaxed, system-scope) load of `dest` on `pe`.",
                returns=True,
            )
        )
        rows.append(
            _f(
                f"{tname}_atomic_inc_thread",
                "dest:ptr pe:i32 qp_id:i32",
                "i32",
                f"ShmemAtomicInc<{ctype}>({d}, {{pe}})",
                "Atomic increment at `dest` on `pe`.",
            )
        )
        for op, cxx in _AMO_FETCH:
            rows.append(
                _f(
                    f"{tname}_atomic_fetch_{op}_thread",
                    f"dest:ptr value:{t} pe:i32 qp_id:i32",
                    t,
                    f"ShmemAtomicFetch{cxx}<{ctype}>({d}, {{value}}, {{pe}})",
                    f"Atomic {op} at `dest` on `pe`; returns the old value.",
                    returns=True,
                )
            )
        rows.append(
            _f(
                f"{tname}_atomic_fetch_inc_thread",
                "dest:ptr pe:i32 qp_id:i32",
                t,
                f"ShmemAtomicFetchInc<{ctype}>({d}, {{pe}})",
                "Atomic increment; returns the old value.",
                returns=True,
            )
        )
        rows.append(
            _f(
                f"{tname}_atomic_swap_thread",
                f"dest:ptr value:{t} pe:i32 qp_id:i32",
                t,
                f"ShmemAtomicSwap<{ctype}>({d}, {{value}}, {{pe}})",
                "Atomic swap; returns the old value.",
                returns=True,
            )
        )
        rows.append(
            _f(
                f"{tname}_atomic_compare_swap_thread",
                f"dest:ptr compare:{t} value:{t} pe:i32 qp_id:i32",
                t,
                f"ShmemAtomicCompareSwap<{ctype}>({d}, {{compare}}, {{value}}, {{pe}})",
                "Store `value` if `dest` holds `compare`; returns the old value.",
                returns=True,
            )
        )
    # MORI's generic forms: the operation is an `amo_type` value (MORI's atomicType numbering).
    for tname, t, ctype in _ATOMIC_TYPES:
        d = f"({ctype}*){{dest}}"
        rows.append(
            _f(
                f"atomic_{tname}_nonfetch_thread",
                f"dest:ptr value:{t} amo_type:i32 pe:i32 qp_id:i32",
                "i32",
                f"ShmemAtomicNonFetchThread<{ctype}>({d}, {{value}}, {{amo_type}}, {{pe}})",
                "Atomic `amo_type` (inc, set, add, and, or, xor, signal set/add) of `value` at `dest` on `pe`.",
            )
        )
        rows.append(
            _f(
                f"atomic_{tname}_fetch_thread",
                f"dest:ptr value:{t} compare:{t} amo_type:i32 pe:i32 qp_id:i32",
                t,
                f"ShmemAtomicFetchThread<{ctype}>({d}, {{value}}, {{compare}}, {{amo_type}}, {{pe}})",
                "Atomic `amo_type` (fetch, fetch-inc/add/and/or/xor, swap, compare-swap) at `dest` on `pe`; "
                "returns the old value.",
                returns=True,
            )
        )
    rows.append(
        _f(
            "atomic_size_nonfetch_thread",
            "dest:ptr value:ptr bytes:u64 amo_type:i32 pe:i32 qp_id:i32",
            "i32",
            "ShmemAtomicSizeNonFetchThread((void*){dest}, (const void*){value}, {bytes}, {amo_type}, {pe})",
            "Atomic `amo_type` of the `bytes`-wide (4 or 8) operand at `value` on `dest` at `pe`.",
        )
    )
    return rows


def _waits() -> list[DeviceFunction]:
    rows = []
    for tname, t, ctype in _SCALARS[:4]:
        a = f"({ctype}*){{addr}}"
        rows.append(
            _f(
                f"{tname}_wait_until_equals",
                f"addr:ptr value:{t}",
                "i32",
                f"ShmemWaitUntil<{ctype}>({a}, {CMP['EQ']}, {{value}})",
                "Spin until `*addr == value`.",
            )
        )
        rows.append(
            _f(
                f"{tname}_wait_until_greater_than",
                f"addr:ptr value:{t}",
                t,
                f"ShmemWaitUntil<{ctype}>({a}, {CMP['GT']}, {{value}})",
                "Spin until `*addr > value`; returns the value seen.",
                returns=True,
            )
        )
        rows.append(
            _f(
                f"{tname}_wait_until",
                f"addr:ptr cmp:i32 value:{t}",
                t,
                f"ShmemWaitUntil<{ctype}>({a}, {{cmp}}, {{value}})",
                "Spin until `*addr <cmp> value` (CMP_EQ..CMP_LE); returns the value seen.",
                returns=True,
            )
        )
        rows.append(
            _f(
                f"{tname}_test",
                f"addr:ptr cmp:i32 value:{t}",
                "i32",
                f"ShmemTest<{ctype}>({a}, {{cmp}}, {{value}})",
                "1 if `*addr <cmp> value` now, else 0.",
                returns=True,
            )
        )
    return rows


FUNCTIONS: tuple[DeviceFunction, ...] = tuple(_query() + _sync() + _rma() + _scalar() + _atomics() + _waits())

_BY_NAME = {f.name: f for f in FUNCTIONS}
assert len(_BY_NAME) == len(FUNCTIONS), "duplicate device function names in the table"


def by_name(name: str) -> DeviceFunction:
    """The table row called ``name`` (KeyError naming it when there is none)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name!r} is not a mori device function") from None
