"""Host shared-memory segments: anonymous memory files (``memfd``) mapped by several processes.

A segment is created by one process and attached by others after its file descriptor was
passed to them (``send_fds``/``FdExchange``): no names in ``/dev/shm`` to clean up, and the
memory goes away when the last mapping and descriptor close. The creator seals the size, so no
process can shrink the file under another's mapping (which would turn its reads into SIGBUS).
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import stat

from ._fdpass import check_fd

__all__ = ["HostSegment"]


def check_size(size: int, what: str = "segment size") -> int:
    """``size`` if it is an int > 0 (bytes), else ``TypeError``/``ValueError`` naming ``what``."""
    if not isinstance(size, int) or isinstance(size, bool):
        raise TypeError(f"{what} must be an int, got {type(size).__name__}")
    if size <= 0:
        raise ValueError(f"{what} must be > 0 bytes, got {size}")
    return size


class HostSegment:
    """A shared host-memory region; ``addr`` is its address in this process.

    Create with :meth:`create`, map another process's with :meth:`attach`. ``view()`` gives a
    writable :class:`memoryview`; ``addr`` is what :mod:`mori.core.atomics` takes. Close with
    :meth:`close` (or use it as a context manager); closing while views of it are alive raises
    :class:`BufferError`, because unmapping would leave them pointing at nothing.
    """

    def __init__(self, fd: int, size: int, mm: mmap.mmap, owner: bool):
        self._fd, self._size, self.owner = fd, size, owner
        self._mm: mmap.mmap | None = mm
        # The address is read through a temporary ctypes view that is dropped at once, so it
        # holds no export on the mmap and close() stays possible.
        self._addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))

    @classmethod
    def create(cls, size: int, name: str = "mori") -> HostSegment:
        """Creates a zero-filled segment of ``size`` bytes (``name`` shows in ``/proc/<pid>/maps``)."""
        check_size(size)
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, size, mm, owner=True)

    @classmethod
    def attach(cls, fd: int, size: int) -> HostSegment:
        """Maps the first ``size`` bytes of a segment received from another process as ``fd``.

        The caller keeps ownership of ``fd`` (it may close it right after); the segment holds
        its own duplicate. Raises :class:`ValueError` when ``fd`` is not a regular memory file
        or is smaller than ``size``.
        """
        check_size(size)
        st = os.fstat(check_fd(fd, "HostSegment.attach"))
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"attach: fd {fd} is not a shared-memory file (mode {stat.filemode(st.st_mode)})")
        if st.st_size < size:
            raise ValueError(f"attach: fd {fd} holds {st.st_size} bytes, fewer than the {size} requested")
        own = os.dup(fd)
        try:
            os.set_inheritable(own, False)
            mm = mmap.mmap(own, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(own)
            raise
        return cls(own, size, mm, owner=False)

    @property
    def addr(self) -> int:
        """Address of the first byte in this process."""
        self._check_open()
        return self._addr

    @property
    def size(self) -> int:
        """Size in bytes."""
        return self._size

    @property
    def fd(self) -> int:
        """The segment's file descriptor, owned by the segment: pass it on, do not close it."""
        self._check_open()
        return self._fd

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._mm is None

    def view(self) -> memoryview:
        """A writable byte view of the whole segment (release it before :meth:`close`)."""
        self._check_open()
        assert self._mm is not None
        return memoryview(self._mm)

    def close(self) -> None:
        """Unmaps the segment and closes its descriptor. Idempotent."""
        if self._mm is None:
            return
        try:
            self._mm.close()
        except BufferError:
            raise BufferError(
                "HostSegment.close: views of this segment are still alive (memoryview/numpy arrays "
                "from view()); release them first"
            ) from None
        self._mm = None
        os.close(self._fd)
        self._fd = -1

    def _check_open(self) -> None:
        if self._mm is None:
            raise ValueError("HostSegment is closed")

    def __enter__(self) -> HostSegment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._mm is None:
            return f"HostSegment(size={self._size}, closed)"
        return f"HostSegment(addr=0x{self._addr:x}, size={self._size}, fd={self._fd}, owner={self.owner})"
