# mori.core._native.tcp (csrc/tcp/): the native TCP data plane.
from typing import SupportsFloat, SupportsIndex

from .batch import Batch
from .gpu import Stager
from .inbound import InboundRecords

_Int = SupportsIndex

class Transfer:
    def code(self) -> int: ...
    def message(self) -> str: ...
    def wait(self, timeout: SupportsFloat) -> bool: ...

class Peer:
    def __init__(
        self,
        name: str,
        host: str,
        port: _Int,
        num_connections: _Int,
        my_key: str,
        token: str,
        ticket: str,
        io_timeout: SupportsFloat,
        timeout_setting: str = "io_timeout",
    ) -> None: ...
    def submit(
        self, op: _Int, batch: Batch, mem_id: _Int, uid: _Int, notify: bool, stripe: _Int, staging: Stager | None = None
    ) -> Transfer: ...
    def submit_one(
        self,
        op: _Int,
        src: _Int,
        dst: _Int,
        bytes: _Int,
        mem_id: _Int,
        uid: _Int,
        notify: bool,
        stripe: _Int,
        staging: Stager | None = None,
    ) -> Transfer | None: ...
    def healthy(self) -> bool: ...
    def close(self) -> None: ...

class Target:
    def __init__(
        self,
        host: str,
        port: _Int,
        token: str,
        io_timeout: SupportsFloat,
        max_connections: _Int = 1024,
        max_handshakes: _Int = 64,
        hello_timeout: SupportsFloat = 10.0,
        max_inbound: _Int = 1048576,
        inbound_ttl: SupportsFloat = 3600.0,
        timeout_setting: str = "io_timeout",
        max_per_key: _Int = 64,
        inbound: InboundRecords | None = None,
    ) -> None: ...
    @property
    def port(self) -> int: ...
    def register_region(self, mem_id: _Int, addr: _Int, size: _Int, staging: Stager | None = None) -> None: ...
    def deregister_region(self, mem_id: _Int) -> bool: ...
    def pop_inbound(self, key: str, uid: _Int) -> int | None: ...
    def issue_ticket(self, key: str, ticket: str | None = None) -> str: ...
    def connection_count(self) -> int: ...
    def inbound_count(self) -> int: ...
    def stats(self) -> dict[str, int]: ...
    def close(self) -> None: ...
