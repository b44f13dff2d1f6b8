"""mori.shmem's own exceptions (one module, so that every private module can raise them)."""

from __future__ import annotations

__all__ = ["ShmemError", "ShmemNotInitializedError"]


class ShmemError(RuntimeError):
    """mori.shmem cannot do what was asked in its current state (e.g. init twice, PEs disagree)."""


class ShmemNotInitializedError(ShmemError):
    """A shmem call was made before ``shmem_init_attr``/``shmem_torch_process_group_init`` (or after finalize)."""
