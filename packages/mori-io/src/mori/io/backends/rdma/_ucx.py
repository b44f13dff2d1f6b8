"""UCX through ctypes: the libucp/libuct calls and structures the RDMA backend uses, nothing more.

Why ctypes (docs/architecture.md says more): mori-io stays a pure-Python wheel that installs and
imports without UCX or a compiler; UCX is found at run time (the ``libucx`` wheel of the ``rdma``
extra, or the system's UCX). The structures below follow UCX 1.x's public headers;
``tests/test_ucx_layout.py`` compiles a C file against the headers the wheel ships and checks
every size, offset and constant used here, so a layout change in UCX fails CI, not a transfer.
"""

from __future__ import annotations

import ctypes as C
import threading
from typing import Any

__all__ = ["Ucx", "UcxError", "load", "RDMA_COMPONENTS", "status_ptr"]

# ---- constants (checked against the headers by tests/test_ucx_layout.py) -------------------------
UCS_OK = 0
UCS_INPROGRESS = 1
UCS_ERR_BUSY = -15
UCS_ERR_LAST = -100

UCP_FEATURE_RMA = 1 << 1
UCP_FEATURE_WAKEUP = 1 << 4
UCP_FEATURE_AM = 1 << 6
UCP_PARAM_FIELD_FEATURES = 1 << 0
UCP_PARAM_FIELD_MT_WORKERS_SHARED = 1 << 5
UCP_PARAM_FIELD_NAME = 1 << 8

UCS_THREAD_MODE_SERIALIZED = 1
UCP_WORKER_PARAM_FIELD_THREAD_MODE = 1 << 0
UCP_WORKER_PARAM_FIELD_EVENTS = 1 << 2
UCP_WAKEUP_RMA = 1 << 0
UCP_WAKEUP_TX = 1 << 10
UCP_WAKEUP_RX = 1 << 11

UCP_EP_PARAM_FIELD_REMOTE_ADDRESS = 1 << 0
UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE = 1 << 1
UCP_EP_PARAM_FIELD_ERR_HANDLER = 1 << 2
UCP_ERR_HANDLING_MODE_PEER = 1
UCP_EP_CLOSE_FLAG_FORCE = 1 << 0

UCP_MEM_MAP_PARAM_FIELD_ADDRESS = 1 << 0
UCP_MEM_MAP_PARAM_FIELD_LENGTH = 1 << 1
UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE = 1 << 4
UCS_MEMORY_TYPE_HOST = 0
UCS_MEMORY_TYPE_CUDA = 1

UCP_OP_ATTR_FIELD_FLAGS = 1 << 4
UCP_OP_ATTR_FIELD_MEMH = 1 << 8
UCP_AM_SEND_FLAG_EAGER = 1 << 1
UCP_AM_SEND_FLAG_COPY_HEADER = 1 << 3
UCP_AM_HANDLER_PARAM_FIELD_ID = 1 << 0
UCP_AM_HANDLER_PARAM_FIELD_CB = 1 << 2

UCT_COMPONENT_ATTR_FIELD_NAME = 1 << 0
UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT = 1 << 1
UCT_COMPONENT_ATTR_FIELD_MD_RESOURCES = 1 << 2
UCT_COMPONENT_NAME_MAX = 16
UCT_MD_NAME_MAX = 16

# UCX components whose memory domains are RDMA NICs (verbs: InfiniBand, RoCE, EFA).
RDMA_COMPONENTS = ("ib",)


# ---- structures ----------------------------------------------------------------------------------
class UcpParams(C.Structure):
    _fields_ = [("field_mask", C.c_uint64), ("features", C.c_uint64), ("request_size", C.c_size_t),
                ("request_init", C.c_void_p), ("request_cleanup", C.c_void_p), ("tag_sender_mask", C.c_uint64),
                ("mt_workers_shared", C.c_int), ("estimated_num_eps", C.c_size_t),
                ("estimated_num_ppn", C.c_size_t), ("name", C.c_char_p), ("node_local_id", C.c_size_t)]


class UcpWorkerParams(C.Structure):
    _fields_ = [("field_mask", C.c_uint64), ("thread_mode", C.c_int), ("cpu_mask", C.c_ulong * 16),
                ("events", C.c_uint), ("user_data", C.c_void_p), ("event_fd", C.c_int), ("flags", C.c_uint64),
                ("name", C.c_char_p), ("am_alignment", C.c_size_t), ("client_id", C.c_uint64)]


ERR_HANDLER = C.CFUNCTYPE(None, C.c_void_p, C.c_void_p, C.c_int8)  # (arg, ep, status)
AM_RECV = C.CFUNCTYPE(C.c_int8, C.c_void_p, C.c_void_p, C.c_size_t, C.c_void_p, C.c_size_t, C.c_void_p)


class UcsSockAddr(C.Structure):
    _fields_ = [("addr", C.c_void_p), ("addrlen", C.c_uint)]


class UcpEpParams(C.Structure):
    _fields_ = [("field_mask", C.c_uint64), ("address", C.c_void_p), ("err_mode", C.c_int),
                ("err_handler_cb", ERR_HANDLER), ("err_handler_arg", C.c_void_p), ("user_data", C.c_void_p),
                ("flags", C.c_uint), ("sockaddr", UcsSockAddr), ("conn_request", C.c_void_p),
                ("name", C.c_char_p), ("local_sockaddr", UcsSockAddr)]


class UcpMemMapParams(C.Structure):
    _fields_ = [("field_mask", C.c_uint64), ("address", C.c_void_p), ("length", C.c_size_t), ("flags", C.c_uint),
                ("prot", C.c_uint), ("memory_type", C.c_int), ("exported_memh_buffer", C.c_void_p)]


class UcpRequestParam(C.Structure):
    _fields_ = [("op_attr_mask", C.c_uint32), ("flags", C.c_uint32), ("request", C.c_void_p), ("cb", C.c_void_p),
                ("datatype", C.c_uint64), ("user_data", C.c_void_p), ("reply_buffer", C.c_void_p),
                ("memory_type", C.c_int), ("recv_info", C.c_void_p), ("memh", C.c_void_p),
                ("remote_datatype", C.c_uint64), ("remote", C.c_void_p), ("remote_count", C.c_size_t)]


class UcpAmHandlerParam(C.Structure):
    _fields_ = [("field_mask", C.c_uint64), ("id", C.c_uint), ("flags", C.c_uint32), ("cb", AM_RECV),
                ("arg", C.c_void_p)]


class UctMdResourceDesc(C.Structure):
    _fields_ = [("md_name", C.c_char * UCT_MD_NAME_MAX)]


class UctComponentAttr(C.Structure):
    _fields_ = [("field_mask", C.c_uint64), ("name", C.c_char * UCT_COMPONENT_NAME_MAX),
                ("md_resource_count", C.c_uint), ("md_resources", C.POINTER(UctMdResourceDesc)),
                ("flags", C.c_uint64)]


class UcxError(RuntimeError):
    """A UCX call failed; ``status`` is its ucs_status_t."""

    def __init__(self, what: str, status: int, text: str) -> None:
        super().__init__(f"UCX {what} failed: {text} ({status})")
        self.status = status


def status_ptr(value: int | None) -> tuple[int, int | None]:
    """(status, request) of a ``ucs_status_ptr_t``: (0, None) done, (1, ptr) in progress, (<0, None) error."""
    if not value:
        return UCS_OK, None
    if value >= (1 << 64) + UCS_ERR_LAST:
        return value - (1 << 64), None
    return UCS_INPROGRESS, value


_P = C.c_void_p
_STATUS = C.c_int8  # ucs_status_t is a packed enum: one signed byte
_PP = C.POINTER(C.c_void_p)
_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "ucp_get_version": (None, [C.POINTER(C.c_uint)] * 3),
    "ucp_config_read": (_STATUS, [C.c_char_p, C.c_char_p, _PP]),
    "ucp_config_modify": (_STATUS, [_P, C.c_char_p, C.c_char_p]),
    "ucp_config_release": (None, [_P]),
    "ucp_init_version": (_STATUS, [C.c_uint, C.c_uint, C.POINTER(UcpParams), _P, _PP]),
    "ucp_cleanup": (None, [_P]),
    "ucp_worker_create": (_STATUS, [_P, C.POINTER(UcpWorkerParams), _PP]),
    "ucp_worker_destroy": (None, [_P]),
    "ucp_worker_get_address": (_STATUS, [_P, _PP, C.POINTER(C.c_size_t)]),
    "ucp_worker_release_address": (None, [_P, _P]),
    "ucp_worker_progress": (C.c_uint, [_P]),
    "ucp_worker_get_efd": (_STATUS, [_P, C.POINTER(C.c_int)]),
    "ucp_worker_arm": (_STATUS, [_P]),
    "ucp_worker_set_am_recv_handler": (_STATUS, [_P, C.POINTER(UcpAmHandlerParam)]),
    "ucp_ep_create": (_STATUS, [_P, C.POINTER(UcpEpParams), _PP]),
    "ucp_ep_close_nbx": (_P, [_P, C.POINTER(UcpRequestParam)]),
    "ucp_ep_flush_nbx": (_P, [_P, C.POINTER(UcpRequestParam)]),
    "ucp_mem_map": (_STATUS, [_P, C.POINTER(UcpMemMapParams), _PP]),
    "ucp_mem_unmap": (_STATUS, [_P, _P]),
    "ucp_rkey_pack": (_STATUS, [_P, _P, _PP, C.POINTER(C.c_size_t)]),
    "ucp_rkey_buffer_release": (None, [_P]),
    "ucp_ep_rkey_unpack": (_STATUS, [_P, _P, _PP]),
    "ucp_rkey_destroy": (None, [_P]),
    "ucp_put_nbx": (_P, [_P, _P, C.c_size_t, C.c_uint64, _P, C.POINTER(UcpRequestParam)]),
    "ucp_get_nbx": (_P, [_P, _P, C.c_size_t, C.c_uint64, _P, C.POINTER(UcpRequestParam)]),
    "ucp_am_send_nbx": (_P, [_P, C.c_uint, _P, C.c_size_t, _P, C.c_size_t, C.POINTER(UcpRequestParam)]),
    "ucp_request_check_status": (_STATUS, [_P]),
    "ucp_request_free": (None, [_P]),
}
_UCT_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "uct_query_components": (_STATUS, [C.POINTER(C.POINTER(C.c_void_p)), C.POINTER(C.c_uint)]),
    "uct_component_query": (_STATUS, [_P, C.POINTER(UctComponentAttr)]),
    "uct_release_component_list": (None, [C.POINTER(C.c_void_p)]),
}


class Ucx:
    """The loaded UCX libraries: ``ucp``, ``uct`` and ``ucs`` (ctypes handles with typed functions)."""

    def __init__(self, ucs: Any, uct: Any, ucp: Any, where: str) -> None:
        self.ucs, self.uct, self.ucp, self.where = ucs, uct, ucp, where
        for lib, table in ((ucp, _SIGNATURES), (uct, _UCT_SIGNATURES)):
            for name, (restype, argtypes) in table.items():
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = restype, argtypes
        ucs.ucs_status_string.restype, ucs.ucs_status_string.argtypes = C.c_char_p, [_STATUS]
        major, minor, release = C.c_uint(), C.c_uint(), C.c_uint()
        ucp.ucp_get_version(C.byref(major), C.byref(minor), C.byref(release))
        self.version = (major.value, minor.value, release.value)

    def status_text(self, status: int) -> str:
        """UCX's words for a status code."""
        return (self.ucs.ucs_status_string(status) or b"?").decode()

    def check(self, what: str, status: int) -> None:
        """Raises :class:`UcxError` unless ``status`` is UCS_OK."""
        if status != UCS_OK:
            raise UcxError(what, status, self.status_text(status))

    def rdma_devices(self) -> list[str]:
        """The RDMA NICs UCX can use here (memory domains of its verbs component), e.g. ``mlx5_0``."""
        comps, count = C.POINTER(C.c_void_p)(), C.c_uint()
        self.check("uct_query_components", self.uct.uct_query_components(C.byref(comps), C.byref(count)))
        found: list[str] = []
        try:
            for i in range(count.value):
                attr = UctComponentAttr(field_mask=UCT_COMPONENT_ATTR_FIELD_NAME
                                        | UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT)
                self.check("uct_component_query", self.uct.uct_component_query(comps[i], C.byref(attr)))
                if attr.name.decode() not in RDMA_COMPONENTS or attr.md_resource_count == 0:
                    continue
                mds = (UctMdResourceDesc * attr.md_resource_count)()
                attr.field_mask = UCT_COMPONENT_ATTR_FIELD_MD_RESOURCES
                attr.md_resources = C.cast(mds, C.POINTER(UctMdResourceDesc))
                self.check("uct_component_query", self.uct.uct_component_query(comps[i], C.byref(attr)))
                found += [md.md_name.decode() for md in mds]
        finally:
            self.uct.uct_release_component_list(comps)
        return found


_loaded: Ucx | None = None
_load_lock = threading.Lock()


def load() -> Ucx:
    """Loads UCX once: the ``libucx`` wheel's libraries (``pip install 'mori-io[rdma]'``; with
    ``RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true`` the wheel prefers a system UCX), else the system's
    ``libucp.so.0``. Raises ``RuntimeError`` saying how to install UCX when neither exists."""
    global _loaded
    with _load_lock:
        if _loaded is not None:
            return _loaded
        try:
            import libucx  # type: ignore[import-not-found]

            ucs, _signal, uct, ucp = libucx.load_library()
            where = f"libucx wheel {getattr(libucx, '__version__', '')} ({libucx.__file__})"
        except ImportError:
            try:
                mode = C.RTLD_GLOBAL
                ucs, uct, ucp = (C.CDLL(n, mode) for n in ("libucs.so.0", "libuct.so.0", "libucp.so.0"))
                where = "system UCX (libucp.so.0)"
            except OSError as err:
                raise RuntimeError(
                    "BackendType.RDMA needs UCX: install mori-io's rdma extra (pip install 'mori-io[rdma]', the "
                    f"libucx-cu13 wheel) or a system UCX (libucp.so.0); none was found ({err})") from None
        if ucp is None or uct is None or ucs is None:
            raise RuntimeError("the libucx wheel is installed but its libraries did not load")
        _loaded = Ucx(ucs, uct, ucp, where)
        return _loaded
