"""What a client's calls go to: a pool in this process (:class:`LocalPool`, below), a node of a
cluster (``_cluster.ClusterNode``) or a standalone server (``_standalone.StandaloneConnection``).
Each takes checked arguments and answers per key."""

from __future__ import annotations

from typing import Protocol

from ._enums import UMBPDeploymentMode
from ._store import LocalStore


class Pool(Protocol):
    """The calls every kind of pool serves; arguments are checked by the client already."""

    def put(self, keys: list[str], ptrs: list[int], sizes: list[int], depths: list[int]) -> list[bool]: ...

    def get(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[bool]: ...

    def exists(self, keys: list[str]) -> list[bool]: ...

    def clear(self) -> bool: ...

    def flush(self) -> bool: ...

    def register(self, ptr: int, size: int) -> bool: ...

    def deregister(self, ptr: int) -> None: ...

    def backend_mode(self) -> UMBPDeploymentMode: ...

    def close(self) -> None: ...


class LocalPool:
    """A pool in this process: the store itself."""

    def __init__(self, store: LocalStore) -> None:
        self.store = store

    def put(self, keys: list[str], ptrs: list[int], sizes: list[int], depths: list[int]) -> list[bool]:
        return [self.store.write(k, p, s, d) for k, p, s, d in zip(keys, ptrs, sizes, depths)]

    def get(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[bool]:
        return self.store.read(keys, ptrs, sizes) if keys else []

    def exists(self, keys: list[str]) -> list[bool]:
        return self.store.contains_many(keys)

    def clear(self) -> bool:
        self.store.clear()
        return True

    def flush(self) -> bool:
        return self.store.flush()

    def register(self, ptr: int, size: int) -> bool:
        return True  # puts and gets copy from and to any address of this process

    def deregister(self, ptr: int) -> None:
        pass

    def backend_mode(self) -> UMBPDeploymentMode:
        return UMBPDeploymentMode.Distributed

    def close(self) -> None:
        self.store.close()
