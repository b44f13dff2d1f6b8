"""mori.umbp's two gRPC transports: grpcio, and gRPC C++ (``_grpc_native``) where it is built.

A grpcio call crosses several Python layers, and a grpcio server hands each call between its
polling thread and a handler thread three times: 0.4 to 0.5 ms a call on a loaded 2-core machine
before any work. The C++ transport's server threads take calls from one completion queue, and
the one that takes a call serves it to its answer, taking the GIL once to run the same Python
handler on the request's bytes; a client call waits for its answer without the GIL. Both carry the same messages over the same wire, so a client of either kind talks to a
server of either kind (MORI's included).

``MORI_UMBP_GRPC`` picks: ``auto`` (the default: the C++ transport where it loads, else grpcio),
``python`` (grpcio always) or ``native`` (the C++ transport, or ImportError saying why not).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from mori.core.log import get_logger

log = get_logger("umbp.grpc")

_CODES = {code.value[0]: code for code in grpc.StatusCode}
_CHOICES = ("auto", "python", "native")


@functools.cache
def _load_native() -> ModuleType | ImportError:
    try:
        from . import _grpc_native
    except ImportError as e:
        return e
    return _grpc_native


def native() -> ModuleType | None:
    """The C++ transport's module, or None where grpcio is to be used (see the module's doc)."""
    choice = os.environ.get("MORI_UMBP_GRPC", "").strip().lower() or "auto"
    if choice not in _CHOICES:
        raise ValueError(f"MORI_UMBP_GRPC={choice!r} is not one of {', '.join(_CHOICES)}")
    if choice == "python":
        return None
    module = _load_native()
    if isinstance(module, ImportError):
        if choice == "native":
            raise ImportError(
                f"MORI_UMBP_GRPC=native, but mori.umbp._grpc_native does not load ({module}); it is built "
                "where pkg-config finds grpc++ (apt-get install libgrpc++-dev, then reinstall mori-umbp)"
            ) from module
        return None
    return module


def transport_name() -> str:
    """``"grpc++"`` or ``"grpcio"``: what :func:`native` picks now (for logs)."""
    return "grpc++" if native() is not None else "grpcio"


# ---- the packed key form ------------------------------------------------------------------
#: No bound on a key's length, for :func:`pack_keys` (the master checks lengths).
_ANY_LENGTH = 1 << 62


def split_keys(packed: bytes, max_keys: int, max_key_bytes: int) -> list[str] | None:
    """Keys packed as UTF-8 each followed by NUL, split in C: at most ``max_keys``, each of 1 to
    ``max_key_bytes`` bytes. None when they are not all so (the caller then finds what is wrong
    and says it) or where the C++ transport is not used."""
    module = native()
    return None if module is None else module.split_keys(packed, max_keys, max_key_bytes)


def pack_keys(keys: list[str]) -> bytes | None:
    """``keys`` packed (UTF-8, each followed by NUL) in C; None when one is not a str, is empty
    or holds NUL, or where the C++ transport is not used."""
    module = native()
    return None if module is None else module.pack_keys(keys, _ANY_LENGTH)


# ---- client -------------------------------------------------------------------------------


class RpcFailure(Exception):
    """A call through :class:`NativeChannel` ended with a status other than OK."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


def response_types(pb: ModuleType, service: str) -> dict[str, Any]:
    """Each RPC of ``service`` (in the generated module ``pb``) → its response message class."""
    methods = pb.DESCRIPTOR.services_by_name[service].methods
    return {m.name: getattr(pb, m.output_type.name) for m in methods}


class NativeChannel:
    """A channel of the C++ transport to ``address``; :meth:`unary` makes one call. With
    ``bdp_probe``, answers of more than 64 KiB do not wait for a window update (see
    ``csrc/grpc_native.cpp``), at the cost of a ping after answers."""

    def __init__(
        self, module: ModuleType, address: str, max_receive_message_bytes: int, bdp_probe: bool = False
    ) -> None:
        self._channel: Any = module.Channel(address, max_receive_message_bytes, bdp_probe)

    def unary(self, method: str, request: Any, response_type: Any, timeout_s: float) -> Any:
        """Calls ``method`` (``/package.Service/Rpc``) with ``request`` within ``timeout_s``;
        returns the decoded answer or raises :class:`RpcFailure`."""
        channel = self._channel
        if channel is None:
            raise RpcFailure(grpc.StatusCode.CANCELLED, "the channel is closed")
        code, details, body = channel.call(method, request.SerializeToString(), timeout_s)
        if code != 0:
            raise RpcFailure(_CODES.get(code, grpc.StatusCode.UNKNOWN), details)
        try:
            return response_type.FromString(body)
        except DecodeError as e:
            raise RpcFailure(grpc.StatusCode.INTERNAL, f"the answer to {method} does not decode: {e}") from None

    def close(self) -> None:
        """Later calls fail with CANCELLED; the connection closes once no call uses it."""
        self._channel = None


# ---- server -------------------------------------------------------------------------------


class _Aborted(Exception):
    pass


class _Context:
    """The part of ``grpc.ServicerContext`` that mori's servicers use: a status to answer with."""

    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None
        self.details = ""

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details
        raise _Aborted

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


class _MethodTable:
    """Stands in for a grpc.Server to a generated ``add_*Servicer_to_server``: keeps its handlers."""

    def __init__(self) -> None:
        self.handlers: dict[str, Any] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # the same handlers come through add_registered_method_handlers

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self.handlers.update({f"/{service}/{name}": h for name, h in handlers.items()})


Answer = tuple[int, str, bytes]


class NativeServer:
    """A gRPC server of the C++ transport for the servicers that ``add(servicer, server)`` (a
    generated ``add_*Servicer_to_server``) registers. ``workers`` threads serve one call each at a
    time; a connection carries at most ``max_streams`` calls at once. Errors are answered as
    grpcio answers them: an unknown method UNIMPLEMENTED, a request that does not decode
    INTERNAL, a handler's abort with its status, a handler's exception UNKNOWN (logged). A peer
    service's ``ssd_reads`` (``PeerSsdReads``) answers the resolves and releases it takes in C++."""

    def __init__(
        self,
        module: ModuleType,
        address: str,
        servicers: list[tuple[Callable[[Any, Any], None], Any]],
        *,
        workers: int,
        max_message_bytes: int,
        max_streams: int,
        ssd_reads: Any = None,
    ) -> None:
        table = _MethodTable()
        for add, servicer in servicers:
            add(servicer, table)
        self._handlers = table.handlers
        try:
            self._server = module.Server(address, self._dispatch, workers, max_message_bytes, max_streams, ssd_reads)
        except RuntimeError as e:
            raise OSError(str(e)) from None
        self.port: int = self._server.port

    def stop(self, grace_s: float) -> None:
        """Calls in flight get ``grace_s`` to finish, then are cancelled; returns when the
        workers have ended (a handler running then is let finish)."""
        self._server.stop(grace_s)

    def _dispatch(self, method: str, body: bytes) -> Answer:
        handler = self._handlers.get(method)
        if handler is None:
            return grpc.StatusCode.UNIMPLEMENTED.value[0], "Method not found!", b""
        try:
            request = handler.request_deserializer(body)
        except DecodeError:
            return grpc.StatusCode.INTERNAL.value[0], "Exception deserializing request!", b""
        context = _Context()
        try:
            response = handler.unary_unary(request, context)
        except _Aborted:
            assert context.code is not None
            return context.code.value[0], context.details, b""
        except Exception as e:
            if context.code is None:
                log.exception("Exception calling application %s", method)
            code = context.code or grpc.StatusCode.UNKNOWN
            return code.value[0], context.details or f"Exception calling application: {e}", b""
        return 0, "", handler.response_serializer(response)
