# The gRPC C++ transport (csrc/grpc_native.cpp), built where gRPC C++ is installed.
from collections.abc import Callable

class Server:
    def __init__(
        self,
        address: str,
        dispatch: Callable[[str, bytes], tuple[int, str, bytes]],
        workers: int,
        max_message_bytes: int,
        max_streams: int,
    ) -> None: ...
    @property
    def port(self) -> int: ...
    def stop(self, grace_s: float) -> None: ...

class Channel:
    def __init__(self, address: str, max_receive_message_bytes: int) -> None: ...
    def call(self, method: str, request: bytes, timeout_s: float) -> tuple[int, str, bytes]: ...
