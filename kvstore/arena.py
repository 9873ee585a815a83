"""The host arena: one shared-memory region that same-host clients map by name.

The region is a file under ``/dev/shm`` (POSIX shared memory on Linux), mapped with ``mmap``.
The daemon creates it (``Arena.create``) and unlinks it on ``close``; a client maps an
existing one read-write with ``Arena.attach(name)``, which never unlinks it. We do not use
``multiprocessing.shared_memory``: on Python 3.11 it registers every mapping, attached ones
included, with the ``resource_tracker``, which unlinks the segment when the *client* exits
and starts a tracker process as a side effect of the constructor.

``buf`` is a writable memoryview of the whole region; ``view(offset, size)`` is a slice of
it. Callers must release slices they hold before ``close`` (a still-exported view keeps the
mapping alive until it is garbage collected; the name is unlinked regardless).

Pages of a fresh arena are allocated by the kernel on first touch (tmpfs is sparse), so an
arena costs memory as it fills, not when created.
"""

from __future__ import annotations

import mmap
import os
import secrets

__all__ = ["Arena", "SHM_DIR"]

SHM_DIR = "/dev/shm"


def _path(name: str) -> str:
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"invalid shared-memory name {name!r}: a plain file name, no '/'")
    if not os.path.isdir(SHM_DIR):
        raise OSError(f"{SHM_DIR} is missing: the host arena needs POSIX shared memory (Linux)")
    return os.path.join(SHM_DIR, name)


class Arena:
    """A mapped shared-memory region. Build with ``create`` (owner) or ``attach`` (client)."""

    def __init__(self, name: str, mm: mmap.mmap, size: int, owner: bool) -> None:
        self.name = name
        self.size = size
        self.owner = owner
        self._mmap = mm
        self.buf = memoryview(mm)
        self._closed = False

    @classmethod
    def create(cls, size: int, name: str | None = None) -> "Arena":
        """Create a new region of ``size`` bytes, owned (unlinked on close) by the caller.

        Raises ``FileExistsError`` if ``name`` is taken: pick another name or remove the stale
        ``/dev/shm/<name>`` left by a crashed daemon.
        """
        if size <= 0:
            raise ValueError(f"arena size must be positive, got {size}")
        name = name or f"kvstore-{os.getpid()}-{secrets.token_hex(4)}"
        path = _path(name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        return cls(name, mm, size, owner=True)

    @classmethod
    def attach(cls, name: str) -> "Arena":
        """Map an existing region read-write. Closing it never unlinks the region.

        Raises ``FileNotFoundError`` when no region has that name (daemon gone or on another
        host: use the TCP path).
        """
        fd = os.open(_path(name), os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(name, mm, size, owner=False)

    def view(self, offset: int, size: int) -> memoryview:
        """A writable view of ``[offset, offset + size)``."""
        if offset < 0 or size < 0 or offset + size > self.size:
            raise ValueError(f"range [{offset}, {offset + size}) outside the arena of {self.size} bytes")
        return self.buf[offset : offset + size]

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Unmap (and, for the owner, unlink) the region. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.buf.release()
        try:
            self._mmap.close()
        except BufferError:
            pass  # a caller still holds a slice; the mapping goes when it is collected
        if self.owner:
            try:
                os.unlink(_path(self.name))
            except FileNotFoundError:
                pass

    def __enter__(self) -> "Arena":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        role = "owner" if self.owner else "attached"
        return f"Arena({self.name!r}, size={self.size}, {role}{', closed' if self._closed else ''})"
