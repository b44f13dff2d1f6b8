"""What an engine gives its backends (:class:`EngineContext`, the engine's
:class:`~mori.io.backends.BackendContext`), the control ops every engine serves, and how an
engine names itself to its peers (its node id)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mori.core import config as mori_config
from mori.core.host import this_host
from mori.core.inbound import InboundRecords
from mori.core.log import get_logger

from ._clients import ControlClients
from ._control import ControlError, ControlServer
from ._keys import MAX_NONCE, Identity
from ._limits import Limits, io_timeout
from ._registry import CompletionRecord, MemoryRegistry, RemoteEngines, check_notify, notify_bodies
from .backends import BackendContext, ControlHandler
from .types import EngineDesc, StatusCode

__all__ = ["EngineContext", "engine_handlers", "node_id"]

_log = get_logger("io")


def node_id() -> str:
    """This machine's identity, as MORI resolves it: MORI_NODE_ID, else the boot id (else the
    hostname), which is mori.core.host's machine."""
    override = mori_config.get("MORI_NODE_ID")
    return str(override) if override else this_host().machine


class EngineContext(BackendContext):
    """What backends see of their engine: its description, limits and completion records, the
    remote engines registered with it, its control connections and server. Built from those parts,
    not the engine, so that backends holding it never keep the engine alive."""

    def __init__(
        self,
        desc: EngineDesc,
        limits: Limits,
        inbound: InboundRecords,
        remotes: RemoteEngines,
        clients: ControlClients,
        server: ControlServer,
        token: str,
    ) -> None:
        self.engine_key = desc.key
        self.limits = limits
        self.inbound = inbound
        self.host = desc.host
        self.hostname = desc.hostname
        self.log = _log
        self._desc, self._remotes, self._clients, self._server = desc, remotes, clients, server
        self._token = token

    def engine_desc(self) -> EngineDesc:
        return self._desc

    def io_timeout(self) -> float:
        return io_timeout()

    def auth_token(self) -> str:
        return self._token

    def remote_engine(self, key: str) -> EngineDesc:
        desc = self._remotes.get(key)
        if desc is None:
            raise KeyError(f"engine {key!r} is not registered with engine {self.engine_key!r}")
        return desc

    def control_request(self, remote_key: str, op: str, payload: dict[str, Any]) -> dict[str, Any]:
        return self._clients.request(remote_key, op, payload)

    def control_request_to(self, engine: EngineDesc, op: str, payload: dict[str, Any]) -> dict[str, Any]:
        client = self._clients.connect(engine)
        try:
            return client.request(op, payload)
        finally:
            client.close()

    def add_control_handler(self, op: str, handler: ControlHandler) -> None:
        self._server.handlers[op] = handler

    def send_completions(self, remote_key: str, records: Sequence[CompletionRecord]) -> None:
        for body in notify_bodies(records):
            try:
                self._clients.request(remote_key, "notify", body)
            except Exception as err:  # a lost record is logged; it must never keep a transfer from finishing
                self.log.warning(
                    "cannot notify engine %r of %d finished transfer(s): %s", remote_key, len(body["uids"]), err
                )


def engine_handlers(identity: Identity, memory: MemoryRegistry, inbound: InboundRecords) -> dict[str, ControlHandler]:
    """Control ops every engine serves: ping (with a nonce: also the answer that proves this
    engine holds its key, see ``_keys``), memory-descriptor lookup, inbound notifications."""
    my_key = identity.key

    def ping(key: str, body: dict[str, Any]) -> dict[str, Any]:
        nonce = body.get("nonce")
        if isinstance(nonce, str) and 0 < len(nonce) <= MAX_NONCE:
            return {"key": my_key, "answer": identity.answer(key, nonce)}
        return {"key": my_key}

    def lookup_mem(key: str, body: dict[str, Any]) -> dict[str, Any]:
        desc = memory.get(int(body.get("id", -1)))
        if desc is None:
            raise ControlError(StatusCode.ERR_NOT_FOUND, f"memory {body.get('id')!r} is not registered with {my_key!r}")
        return {"desc": desc.pack()}

    def notify(key: str, body: dict[str, Any]) -> dict[str, Any]:
        for record in check_notify(body):  # all checked first: a malformed batch records nothing
            uid, code, message = record
            inbound.record(key, uid, int(code), message)
        return {}

    return {"ping": ping, "lookup_mem": lookup_mem, "notify": notify}
