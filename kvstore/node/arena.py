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

Stale arenas. A daemon killed with SIGKILL (or crashing) never unlinks its arena, and tmpfs
keeps those pages until someone does, so ``kvstore serve`` calls ``remove_stale_arenas()``
on start. The scheme:

- A generated name is ``kvstore-<owner pid>-<8 hex digits>``; only names of exactly that form
  are ever considered (an explicit ``shm_name`` of another form is never touched).
- The owner holds an exclusive ``flock`` on the arena file from creation until ``close``
  (after the unlink). The kernel drops it when the owner dies, however it dies.
- An arena is stale when (1) its lock can be taken, so no live process holds it, and
  (2) its owner pid is dead, or is alive but started after the arena was created (the pid was
  reused: start time from ``/proc/<pid>/stat`` against the file's ctime, which a dead owner
  can no longer move). (2) covers the instant between ``O_EXCL`` create and ``flock``, when a
  live owner holds no lock yet, and arenas of older daemons that never took the lock.
- The sweeper holds the lock while it unlinks, so two daemons starting at once remove each
  stale arena once; a process that cannot open or unlink a file (another user's) skips it.

A client that still maps a removed arena keeps its pages until it unmaps them; only the
name goes.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import secrets

__all__ = ["Arena", "SHM_DIR", "remove_stale_arenas"]

SHM_DIR = "/dev/shm"
_GENERATED = re.compile(r"kvstore-([0-9]+)-[0-9a-f]{8}")
_START_SLACK_S = 1.0  # /proc start times are whole-second boot time + clock ticks

log = logging.getLogger(__name__)


def _path(name: str) -> str:
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"invalid shared-memory name {name!r}: a plain file name, no '/'")
    if not os.path.isdir(SHM_DIR):
        raise OSError(f"{SHM_DIR} is missing: the host arena needs POSIX shared memory (Linux)")
    return os.path.join(SHM_DIR, name)


class Arena:
    """A mapped shared-memory region. Build with ``create`` (owner) or ``attach`` (client)."""

    def __init__(self, name: str, mm: mmap.mmap, size: int, owner: bool,
                 lock_fd: int | None = None) -> None:
        self.name = name
        self.size = size
        self.owner = owner
        self._lock_fd = lock_fd  # the owner's open, flock'ed descriptor (see the module doc)
        self._mmap = mm
        self.buf = memoryview(mm)
        self._closed = False

    @classmethod
    def create(cls, size: int, name: str | None = None) -> "Arena":
        """Create a new region of ``size`` bytes, owned (unlinked on close) by the caller.

        The caller holds the arena's lock (module doc, "Stale arenas") until ``close``.
        Raises ``FileExistsError`` if ``name`` is taken: pick another name, or remove the
        stale ``/dev/shm/<name>`` of a crashed daemon (``kvstore serve`` does that on start
        for generated names whose owner is dead).
        """
        if size <= 0:
            raise ValueError(f"arena size must be positive, got {size}")
        name = name or f"kvstore-{os.getpid()}-{secrets.token_hex(4)}"
        path = _path(name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # blocks only while a sweeper looks at it
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.unlink(path)
            os.close(fd)
            raise
        return cls(name, mm, size, owner=True, lock_fd=fd)

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
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # after the unlink: a live arena is never unlocked
            self._lock_fd = None

    def __enter__(self) -> "Arena":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        role = "owner" if self.owner else "attached"
        return f"Arena({self.name!r}, size={self.size}, {role}{', closed' if self._closed else ''})"


def remove_stale_arenas(directory: str = SHM_DIR) -> list[str]:
    """Unlink the arenas of dead owners in ``directory`` (see the module doc); their names.

    Never raises for a single file it cannot judge or remove: it leaves that file alone.
    """
    removed = []
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return removed
    for name in names:
        m = _GENERATED.fullmatch(name)
        if m is None:
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue  # gone already, or not ours to open
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # a live process holds it
        try:
            if _owner_alive(int(m.group(1)), os.fstat(fd).st_ctime):
                continue
            os.unlink(path)
            removed.append(name)
        except OSError as exc:
            log.debug("cannot remove stale arena %s: %s", path, exc)
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d stale arena(s) of dead daemons from %s", len(removed), directory)
    return removed


def _owner_alive(pid: int, created: float) -> bool:
    """Whether ``pid`` can be the live process that created a file at ``created`` (epoch s).

    Alive and started no later than the file (give or take the clock's slack) counts; so does
    anything this process cannot judge, since keeping a stale arena only costs memory.
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    started = _process_start_time(pid)
    return started is None or started <= created + _START_SLACK_S


def _process_start_time(pid: int) -> float | None:
    """When ``pid`` started (epoch seconds) from ``/proc``, or None if that cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        with open("/proc/stat", "rb") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
        ticks = int(stat[stat.rindex(b")") + 2 :].split()[19])  # field 22, starttime
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None
