"""The shared-memory index: where each host-tier block lies, so a same-host get needs no round trip.

The daemon publishes, beside its arena, a hash table of its committed host-tier blocks (key ->
arena offset, size) in a second shared-memory region; a client on the same host maps both and
copies a block out of the arena under the slot's seqlock, falling back to the daemon (PIN) for
anything the index does not settle. This docstring is the format's spec.

Region: a file of ``kvstore.node.arena`` (``kvstore-<pid>-<8 hex>`` under ``/dev/shm``, 0600,
flock-owned by the daemon, swept like an arena when its daemon is dead), named with its
instance in the HELLO response (``"index": {"name", "size", "instance", "slots"}``). All
integers are little-endian u64 at 8-byte aligned offsets::

    header (4096 bytes)
    0    magic        b"KVSIDX01"
    8    version      1 (this layout)
    16   instance     random, also in HELLO: the mapping belongs to this one daemon instance
    24   slots        a power of two
    32   slot bytes   64
    40   max probe    slots a lookup looks at, at most
    48   state        1 live; 0 closed (written by the daemon before it goes away)
    56   arena size   bytes of the arena the offsets point into

    slot i, at 4096 + 64 * i
    0    version      seqlock: odd while the daemon changes the slot, even when stable
    8    state        0 empty (never used), 1 live, 2 tombstone (was live)
    16   key          16 bytes
    32   offset       of the block in the arena
    40   size         of the block
    48   reserved     16 bytes, 0

Placement: a key's home slot is its first 8 bytes as a u64 (keys are hashes) masked by
``slots - 1``; it lives in the first slot from home, within ``max probe`` slots, that was not
live when it was published (linear probing). Slots never go back to empty, so a lookup stops at
the first empty slot, at a live slot of its key, or after ``max probe`` slots. A block that
finds no slot in its window is simply not published (gets of it take the PIN path).

The daemon (one writer: every change is made under its store's lock) changes a slot as
``version += 1`` (odd), a release fence, the fields, then ``version += 1`` (even) as a release
store. It publishes a block only once it is committed (its bytes were written, then COMMIT
came, or the daemon wrote them itself) and retracts it (slot: tombstone, version bumped twice)
before its space can be reused or freed: eviction, demotion, delete (also of a pinned block,
which lookups must stop seeing at once), and before the store closes. It writes header state 0
before it unmaps the arena at close.

A reader: checks the header's state (acquire); for each slot of the probe: ``v1 = version``
(acquire; odd: spin and look again), reads state, key, offset and size, and if it is the
key's live slot with the block inside the arena and the destination large enough, copies
``arena[offset:offset+size]`` out; an acquire fence; ``v2 = version``. ``v1 == v2``: the bytes
are the committed block's (any retraction, hence any reuse of the space, would have moved the
version before the new bytes could be written: the reuse is ordered after it, through the
daemon's lock and the socket that hands the space out). Otherwise it retries, a bounded number
of times (``RETRIES``), and then gives up: the caller asks the daemon (PIN), as for a key the
index does not hold (SSD- or GPU-resident blocks are promoted there).

Implementations: the native helper (``kvstore.native.seqlock``, C11 atomics, any CPU) for
both sides; without it a NumPy path that is correct on x86 only, where loads are not reordered
with loads nor stores with stores (TSO), and CPython's separate calls keep program order.
Elsewhere, without the helper, the daemon publishes no index and clients take the PIN path.
Liveness of the daemon is the client's to check (``kvstore.net.connection``): the index is
used only while the connection whose HELLO named it is open, so a daemon that died (SIGKILL
writes no state 0) or restarted is never read through a stale mapping.
"""

from __future__ import annotations

import ctypes
import platform
import secrets
import struct
import sys
from typing import Any

import numpy as np

from kvstore.native import seqlock as native
from kvstore.node.arena import Arena

__all__ = ["SharedIndex", "IndexReader", "MAGIC", "LAYOUT", "HEADER_BYTES", "SLOT_BYTES",
           "MAX_PROBE", "RETRIES", "HIT", "MISS", "BUSY", "SMALL", "CLOSED", "BADBUF", "slots_for",
           "python_path_is_correct"]

MAGIC = b"KVSIDX01"
LAYOUT = 1
HEADER_BYTES = 4096
SLOT_BYTES = 64
MAX_PROBE = 16
RETRIES = 256
EMPTY, LIVE, TOMB = 0, 1, 2
HIT, MISS, BUSY, SMALL, CLOSED, BADBUF = (native.KV_HIT, native.KV_MISS, native.KV_BUSY,
                                          native.KV_SMALL, native.KV_CLOSED, native.KV_BADBUF)
_HEADER = struct.Struct("<8s7Q")
_STATE_WORD = 6  # header u64 index of "state"
_W = SLOT_BYTES // 8  # u64 words per slot


def python_path_is_correct() -> bool:
    """The NumPy seqlock is correct on x86 (TSO) little-endian machines only."""
    return sys.byteorder == "little" and platform.machine().lower() in (
        "x86_64", "amd64", "i386", "i686", "x86")


def _native() -> ctypes.CDLL | None:
    return native.library() if sys.byteorder == "little" else None


def slots_for(arena_bytes: int) -> int:
    """Slots for an arena: one per 2 KiB of it (load under 0.5 with 4 KiB blocks), a power
    of two between 1024 and 2**24 (a slot costs memory only once a page of them is touched)."""
    want = max(1024, arena_bytes // 2048)
    return min(1 << 24, 1 << (want - 1).bit_length())


def _home(key: bytes) -> int:
    return int.from_bytes(key[:8], "little")


class SharedIndex:
    """The daemon's side: the region, and publish/retract under the store's lock (not
    thread-safe by itself: one writer). ``create`` returns None where no correct writer
    exists (no native helper and not x86)."""

    def __init__(self, region: Arena, slots: int, arena_size: int, lib: ctypes.CDLL | None) -> None:
        self.region = region
        self.slots = slots
        self.mask = slots - 1
        self.instance = secrets.randbits(63)
        self._lib = lib
        self._base = np.frombuffer(region.buf, np.uint8)
        self._u64 = self._base.view("<u8")
        self._addr = self._base.ctypes.data
        self._slot_of: dict[bytes, int] = {}
        self.published = 0
        self.overflow = 0  # blocks that found no slot in their window (served by PIN)
        region.buf[:_HEADER.size] = _HEADER.pack(MAGIC, LAYOUT, self.instance, slots, SLOT_BYTES,
                                                 MAX_PROBE, 0, arena_size)
        self._set_state(1)

    @classmethod
    def create(cls, arena_size: int, slots: int | None = None) -> "SharedIndex | None":
        lib = _native()
        if lib is None and not python_path_is_correct():
            return None
        slots = slots or slots_for(arena_size)
        if slots & (slots - 1) or slots < 1:
            raise ValueError(f"index slots must be a power of two, got {slots}")
        region = Arena.create(HEADER_BYTES + slots * SLOT_BYTES)
        return cls(region, slots, arena_size, lib)

    def info(self) -> dict[str, Any]:
        """What HELLO tells a client (``"index"``)."""
        return {"name": self.region.name, "size": self.region.size, "instance": self.instance,
                "slots": self.slots}

    def __contains__(self, key: bytes) -> bool:
        return key in self._slot_of

    def publish(self, key: bytes, offset: int, size: int) -> bool:
        """Make a committed block findable; False when its probe window is full."""
        if key in self._slot_of:
            self.retract(key)
        h, u = _home(key), self._u64
        for p in range(MAX_PROBE):
            i = (h + p) & self.mask
            if u[(HEADER_BYTES // 8) + i * _W + 1] != LIVE:
                self._write(i, LIVE, key, offset, size)
                self._slot_of[key] = i
                self.published += 1
                return True
        self.overflow += 1
        return False

    def retract(self, key: bytes) -> None:
        """Make a block unfindable (before its space is reused or freed). Absent: no-op."""
        i = self._slot_of.pop(key, None)
        if i is not None:
            self._write(i, TOMB, None, 0, 0)
            self.published -= 1

    def close(self) -> None:
        """Mark the index closed (readers fall back) and unlink it. Idempotent."""
        if self.region.closed:
            return
        self._set_state(0)
        self._slot_of.clear()
        self._base = self._u64 = np.empty(0, np.uint8)
        self.region.close()

    def _set_state(self, state: int) -> None:
        if self._lib is not None:
            self._lib.kv_seq_set_state(self._addr, state)
        else:
            self._u64[_STATE_WORD] = state

    def _write(self, i: int, state: int, key: bytes | None, offset: int, size: int) -> None:
        if self._lib is not None:
            self._lib.kv_seq_write(self._addr + HEADER_BYTES + i * SLOT_BYTES, state, key, offset, size)
            return
        w = HEADER_BYTES // 8 + i * _W  # x86 only (python_path_is_correct): stores stay in order
        u = self._u64
        v = int(u[w])
        u[w] = v + 1
        u[w + 1] = state
        if key is not None:
            b = HEADER_BYTES + i * SLOT_BYTES
            self._base[b + 16: b + 32] = np.frombuffer(key, np.uint8)
            u[w + 4] = offset
            u[w + 5] = size
        u[w] = v + 2


class IndexReader:
    """A client's mapping of one daemon's index, beside its mapped arena. Not thread-safe
    (``Client`` serializes calls)."""

    def __init__(self, region: Arena, arena: np.ndarray, slots: int, lib: ctypes.CDLL | None) -> None:
        self.region = region
        self.mask = slots - 1
        self._lib = lib
        self._base = np.frombuffer(region.buf, np.uint8)
        self._u64 = self._base.view("<u8")
        self._addr = self._base.ctypes.data
        self._arena = arena
        self._arena_addr = arena.ctypes.data
        self._arena_size = arena.nbytes
        self._handle = (lib.kv_reader_new(self._addr, self.mask, MAX_PROBE, self._arena_addr,
                                          self._arena_size, RETRIES) if lib is not None else None)
        self._read = lib.kv_read if lib is not None else None
        py = native.py_library() if lib is not None else None
        self._read_obj = py.kv_read_obj if py is not None else None

    @classmethod
    def attach(cls, info: Any, arena: np.ndarray, *, native_only: bool = False) -> "IndexReader | None":
        """Map the index HELLO named (``info``) if it is that instance's, live, and over this
        arena; None otherwise (or where no correct reader exists: no helper and not x86)."""
        lib = _native()
        if lib is None and (native_only or not python_path_is_correct()):
            return None
        try:
            name, instance, slots = str(info["name"]), int(info["instance"]), int(info["slots"])
            region = Arena.attach(name)
        except (KeyError, TypeError, ValueError, OSError):
            return None
        ok = region.size >= HEADER_BYTES + slots * SLOT_BYTES
        if ok:
            magic, layout, inst, n, slot_bytes, probe, state, arena_size = _HEADER.unpack_from(region.buf)
            ok = (magic == MAGIC and layout == LAYOUT and inst == instance and n == slots
                  and slot_bytes == SLOT_BYTES and probe == MAX_PROBE and state == 1
                  and arena_size == arena.nbytes and slots & (slots - 1) == 0)
        if not ok:
            region.close()
            return None
        return cls(region, arena, slots, lib)

    @property
    def native(self) -> bool:
        return self._lib is not None

    @property
    def live(self) -> bool:
        """The daemon has not closed the index."""
        return self._u64.size > _STATE_WORD and int(self._u64[_STATE_WORD]) == 1

    @property
    def reads_objects(self) -> bool:
        """Whether ``read_obj`` is there (the Python-API build of the helper)."""
        return self._read_obj is not None and self._handle is not None

    def get_into(self, key: bytes, dst: np.ndarray) -> tuple[int, int]:
        """(status, size): HIT copied the block into ``dst`` (a flat writable uint8 array,
        C-contiguous); SMALL: ``dst`` is smaller than ``size``; MISS, BUSY, CLOSED: ask the
        daemon."""
        if len(key) != 16:
            return MISS, 0
        if self._read is not None and self._handle is not None:
            k = key if isinstance(key, bytes) else bytes(key)
            return native.unfold(self._read(self._handle, k, dst.ctypes.data, dst.nbytes))
        return self._get_python(key, dst)

    def read_obj(self, key: bytes, buf: Any) -> int:
        """``get_into`` for any writable C-contiguous buffer object (``reads_objects`` only),
        its answer folded into one integer: >= 0 a HIT of that many bytes, else as
        ``kvstore.native.seqlock.unfold`` says (BADBUF: not such a buffer)."""
        assert self._read_obj is not None and self._handle is not None
        if len(key) != 16:
            return -1 - MISS
        return self._read_obj(self._handle, key if isinstance(key, bytes) else bytes(key), buf)

    def _get_python(self, key: bytes, dst: np.ndarray) -> tuple[int, int]:
        """The seqlock in NumPy (x86 only, see the module docstring)."""
        u, base = self._u64, self._base
        if int(u[_STATE_WORD]) != 1:
            return CLOSED, 0
        h = _home(key)
        for p in range(MAX_PROBE):
            i = (h + p) & self.mask
            w, b = HEADER_BYTES // 8 + i * _W, HEADER_BYTES + i * SLOT_BYTES
            for _ in range(RETRIES):
                v1 = int(u[w])
                if v1 & 1:
                    continue
                state, off, size = int(u[w + 1]), int(u[w + 4]), int(u[w + 5])
                mine = state == LIVE and base[b + 16: b + 32].tobytes() == key
                if not mine:
                    if int(u[w]) != v1:
                        continue
                    if state == EMPTY:
                        return MISS, 0
                    break
                fits = size <= dst.nbytes and off + size <= self._arena_size
                if fits:
                    np.copyto(dst[:size], self._arena[off: off + size])
                if int(u[w]) == v1:
                    if fits:
                        return HIT, size
                    return (BUSY if size <= dst.nbytes else SMALL), size
            else:
                return BUSY, 0
        return MISS, 0

    def close(self) -> None:
        if self._handle is not None and self._lib is not None:
            self._lib.kv_reader_free(self._handle)
        self._handle = self._read = self._read_obj = None
        self._base = self._u64 = np.empty(0, np.uint8)
        self._arena = np.empty(0, np.uint8)
        self.region.close()
