"""The SSD tier: blocks in LMDB on local disk, capped in bytes, LRU, served again after restart.

Layout: one LMDB environment at ``path`` with two named databases written in the same
transaction, so a block is either wholly there or absent (also after ``kill -9``):

- ``data``: key (16 bytes) -> the block's bytes, exactly as put.
- ``meta``: key -> ``<QQQ`` = xxh3_64 checksum of the bytes, their length, last-use stamp.

The checksum sits in ``meta`` rather than in front of the bytes so that a write hands LMDB
the arena slice as is (no concatenation copy); it protects the same thing. A read verifies
length and checksum against ``meta``; a mismatch is a miss and the record is deleted, never
returned.

On open the in-memory index (key -> size, checksum, in LRU order) is rebuilt from ``meta``
alone (small records; no block is read), ordered by the stamps. Stamps are a counter that
grows with every write and continues from the largest stamp found, so the LRU order of
demotion survives restarts. A read moves the block to the recent end in memory only (no
write transaction on the read path); after a restart such a block ranks by its write stamp.

Capacity counts block bytes. A write batch first evicts least-recently-used blocks, in the
same transaction, until it fits; a block larger than the whole capacity is not written.
``map_size`` is sized from the capacity with headroom for LMDB's page rounding, B-tree and
free pages that readers still hold.

Files are the owner's only: the directory is made 0700, LMDB's files 0600 (an existing
directory is tightened to that), like the shared-memory arena.

Damage: when LMDB cannot open the environment or read its index (a corrupted header page,
``MDB_INVALID``, ``MDB_CORRUPTED``, a version mismatch), ``on_corrupt="move-aside"`` (the
default) renames the directory to ``{path}.corrupt-<UTC time>`` (logged; ``moved_aside``
names it), starts an empty tier in a fresh directory at ``path`` and carries over the
directory's other files (``node_id``: the node keeps its identity). It is a cache: what was
on it is a miss. ``on_corrupt="fail"`` raises the ``lmdb.Error``, as before.

Thread safety: the index has its own lock (held only for dict work); writes are serialized by
a write lock; reads run concurrently in their own read transactions.
"""

from __future__ import annotations

import logging
import os
import shutil
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import lmdb
import xxhash

from kvstore.keys import BlockKey

__all__ = ["SsdTier", "SsdRecord", "checksum", "CorruptSsdPolicy"]

log = logging.getLogger(__name__)

CorruptSsdPolicy = Literal["move-aside", "fail"]
_LMDB_FILES = ("data.mdb", "lock.mdb")

_META = struct.Struct("<QQQ")
_MIB = 1 << 20


def _private_dir(path: str) -> None:
    """Make ``path`` (0700), or tighten an existing one to the owner only."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    if os.stat(path).st_mode & 0o077:
        os.chmod(path, 0o700)


def checksum(data: bytes | memoryview) -> int:
    """The checksum the store keeps for a block: xxh3_64 of its bytes."""
    return xxhash.xxh3_64_intdigest(data)


@dataclass(slots=True)
class SsdRecord:
    size: int
    checksum: int
    stamp: int


class SsdTier:
    """An LMDB-backed block tier. ``capacity_bytes`` 0 means half the disk's free space."""

    def __init__(self, path: str, capacity_bytes: int = 0,
                 on_corrupt: CorruptSsdPolicy = "move-aside") -> None:
        _private_dir(path)
        if capacity_bytes <= 0:
            capacity_bytes = shutil.disk_usage(path).free // 2
        self.path = path
        self.capacity = capacity_bytes
        self.moved_aside: str | None = None  # where a damaged tier went (module docstring)
        self._map_size = (capacity_bytes + capacity_bytes // 2 + 256 * _MIB + 4095) // 4096 * 4096
        self._index: OrderedDict[BlockKey, SsdRecord] = OrderedDict()
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self.used_bytes = 0
        self.corrupt = 0  # records dropped because they failed verification
        try:
            self._stamp = self._open()
        except lmdb.Error as e:
            if on_corrupt == "fail":
                raise
            self._move_aside(e)
            self._stamp = self._open()

    def _open(self) -> int:
        self._env = env = lmdb.open(self.path, map_size=self._map_size, max_dbs=2, metasync=False,
                                    readahead=False, max_readers=512, mode=0o600)
        try:
            for name in _LMDB_FILES:
                p = os.path.join(self.path, name)
                if os.path.exists(p) and os.stat(p).st_mode & 0o077:
                    os.chmod(p, 0o600)
            env.reader_check()  # clear reader slots of killed processes
            self._data = env.open_db(b"data")
            self._meta = env.open_db(b"meta")
            return self._rebuild()
        except BaseException:
            env.close()
            self._index.clear()
            self.used_bytes = 0
            raise

    def _move_aside(self, exc: lmdb.Error) -> None:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        aside = f"{self.path.rstrip(os.sep)}.corrupt-{stamp}"
        n = 1
        while os.path.exists(aside):
            n += 1
            aside = f"{self.path.rstrip(os.sep)}.corrupt-{stamp}-{n}"
        os.rename(self.path, aside)
        _private_dir(self.path)
        for name in os.listdir(aside):  # node_id and the like: the node keeps its identity
            src = os.path.join(aside, name)
            if name not in _LMDB_FILES and os.path.isfile(src):
                shutil.copy2(src, os.path.join(self.path, name))
        self.moved_aside = aside
        log.error("the SSD tier at %s is damaged (%s: %s); moved it to %s and started an empty "
                  "tier (--on-corrupt-ssd fail refuses to start instead)",
                  self.path, type(exc).__name__, exc, aside)

    # -- lookups ------------------------------------------------------------------------

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def size_of(self, key: BlockKey) -> int | None:
        rec = self._index.get(key)
        return None if rec is None else rec.size

    def record(self, key: BlockKey) -> SsdRecord | None:
        return self._index.get(key)

    def lru_keys(self) -> list[BlockKey]:
        with self._lock:
            return list(self._index)

    # -- writes -------------------------------------------------------------------------

    def put_many(self, blocks: Sequence[tuple[BlockKey, int, memoryview | bytes]]) -> list[BlockKey]:
        """Write ``(key, checksum, bytes)`` blocks, oldest first, in one transaction.

        Keys already present are skipped. Least-recently-used blocks are evicted first to make
        room; returns the evicted keys. Raises ``lmdb.Error`` (nothing written) on I/O failure
        or a full map.
        """
        with self._write_lock:
            with self._lock:
                todo = [(k, c, b) for k, c, b in blocks
                        if k not in self._index and 0 < len(b) <= self.capacity]
                incoming = sum(len(b) for _, _, b in todo)
                while incoming > self.capacity:  # keep the most recent part of the batch
                    incoming -= len(todo.pop(0)[2])
                victims: list[BlockKey] = []
                free = self.capacity - self.used_bytes
                it = iter(self._index.items())
                while free < incoming:
                    k, rec = next(it)
                    victims.append(k)
                    free += rec.size
            if not todo:
                return []
            stamp = self._stamp
            records: list[tuple[BlockKey, SsdRecord]] = []
            with self._env.begin(write=True) as txn:
                for k in victims:
                    txn.delete(k, db=self._data)
                    txn.delete(k, db=self._meta)
                for k, c, b in todo:
                    stamp += 1
                    rec = SsdRecord(len(b), c, stamp)
                    txn.put(k, b, db=self._data)
                    txn.put(k, _META.pack(rec.checksum, rec.size, rec.stamp), db=self._meta)
                    records.append((k, rec))
            with self._lock:
                self._stamp = stamp
                for k in victims:
                    rec = self._index.pop(k, None)
                    if rec is not None:
                        self.used_bytes -= rec.size
                for k, rec in records:
                    self._index[k] = rec
                    self.used_bytes += rec.size
            return victims

    def delete(self, keys: Iterable[BlockKey]) -> int:
        """Delete ``keys``; returns how many were present."""
        with self._write_lock:
            with self._lock:
                present = [k for k in keys if k in self._index]
            if not present:
                return 0
            with self._env.begin(write=True) as txn:
                for k in present:
                    txn.delete(k, db=self._data)
                    txn.delete(k, db=self._meta)
            with self._lock:
                for k in present:
                    rec = self._index.pop(k, None)
                    if rec is not None:
                        self.used_bytes -= rec.size
            return len(present)

    # -- reads --------------------------------------------------------------------------

    def read_into(self, key: BlockKey, dst: memoryview) -> bool:
        """Copy ``key``'s verified bytes into ``dst`` (exactly its size) and mark it recently used.

        False on a miss, or when the record fails verification (it is then deleted).
        """
        with self._lock:
            rec = self._index.get(key)
        if rec is None:
            return False
        ok = False
        with self._env.begin(buffers=True) as txn:
            data = txn.get(key, db=self._data)
            if data is not None and len(data) == rec.size == len(dst) and checksum(data) == rec.checksum:
                dst[:] = data
                ok = True
        if not ok:
            self.corrupt += 1
            self.delete([key])
            return False
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        return True

    def get(self, key: BlockKey) -> bytes | None:
        """The verified bytes of ``key``, or None."""
        size = self.size_of(key)
        if size is None:
            return None
        out = bytearray(size)
        return bytes(out) if self.read_into(key, memoryview(out)) else None

    def close(self) -> None:
        with self._write_lock:
            self._env.close()

    # -- internals ----------------------------------------------------------------------

    def _rebuild(self) -> int:
        """Load the index from ``meta`` in stamp order; drop malformed records."""
        found: list[tuple[int, BlockKey, SsdRecord]] = []
        bad: list[bytes] = []
        with self._env.begin() as txn:
            for k, v in txn.cursor(db=self._meta):
                if len(k) != 16 or len(v) != _META.size:
                    bad.append(k)
                    continue
                c, size, stamp = _META.unpack(v)
                found.append((stamp, BlockKey(k), SsdRecord(size, c, stamp)))
        if bad:
            with self._env.begin(write=True) as txn:
                for k in bad:
                    txn.delete(k, db=self._data)
                    txn.delete(k, db=self._meta)
        found.sort(key=lambda t: t[0])
        for _, k, rec in found:
            self._index[k] = rec
            self.used_bytes += rec.size
        return found[-1][0] if found else 0
