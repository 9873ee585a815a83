"""The router's view of which worker holds which block keys in its device cache.

Fed by each worker's ordered event stream (``stored`` / ``removed`` / ``load``, one sequence
for all three) and by snapshots; asked, on the hot path of every routing decision, "how many
leading blocks of this prompt does each worker hold".

Layout: one table ``key -> bitmask of workers`` (each worker gets a bit slot), plus each
worker's own key set (the truth the table is derived from) so that a worker can be dropped or
resynchronized without scanning the whole index. A match walks the prompt's keys once,
AND-ing masks until no worker is left: O(matched blocks) lookups whatever the number of
workers, the flat equivalent of Dynamo's radix-tree ``find_matches`` (keys are chained prefix
hashes, so a key already names its whole prefix and a tree adds nothing to the lookup).

The table is native where it can be built (``router/csrc/kv_index.c`` through
:mod:`router.workers.kv_native`: open addressing over the keys' 16 bytes and a 64-bit mask,
the walk one C call that prefetches a few keys ahead), else a Python dict walked with
``map``/``groupby`` (runs of equal masks at C speed). Both give the same answers; the index
moves to the dict for good if a 65th worker slot or a key that is not 16 bytes turns up.

Sequence contract, per worker:
- Until its first snapshot a worker is *unsynced*: events are ignored, ``apply`` returns False.
- ``apply`` of event ``seq == last + 1`` applies it; ``seq <= last`` is a duplicate (ignored,
  returns True); ``seq > last + 1`` is a gap: the worker becomes unsynced and ``apply``
  returns False: the caller fetches ``GET /snapshot`` and calls ``reset``.
- While unsynced its last known blocks stay in the index (a slightly stale hint beats none);
  ``reset`` replaces them wholesale.

Not thread-safe: the router drives it from its event loop.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from itertools import groupby, repeat
from typing import Any

from engine.api.events import BlockEvent, LoadEvent, Snapshot, WorkerEvent
from router.workers.kv_native import native_status, table_type

__all__ = ["KvIndex"]

log = logging.getLogger(__name__)

NATIVE_SLOTS = 64  # the native table's masks are 64-bit: worker slot 64 moves the index to Python


class _Worker:
    __slots__ = ("slot", "bit", "keys", "seq")

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.bit = 1 << slot
        self.keys: set[bytes] = set()
        self.seq: int | None = None  # None: unsynced, waiting for a snapshot


class KvIndex:
    """Block key → workers holding it; longest leading match per worker.

    ``native``: None (default) uses the native table where it can be built, else the Python
    dict; False always the dict; True requires the native table (RuntimeError without it)."""

    def __init__(self, native: bool | None = None) -> None:
        table_cls = table_type() if native is not False else None
        if native and table_cls is None:
            raise RuntimeError(f"the native index table is unavailable: {native_status()}")
        self._table: Any = table_cls() if table_cls is not None else None
        self._holders: dict[bytes, int] = {}  # the Python path's table (while _table is None)
        self._workers: dict[str, _Worker] = {}
        self._names: list[str | None] = []    # worker id by slot (None: a free slot)
        self._all = 0                         # every worker's bit
        self._free_slots: list[int] = []

    @property
    def backend(self) -> str:
        """``"native"`` (the C table) or ``"python"`` (the dict)."""
        return "python" if self._table is None else "native"

    # --- membership -----------------------------------------------------------------------

    def add_worker(self, worker_id: str) -> None:
        """Start tracking ``worker_id`` (unsynced until its first ``reset``). Idempotent."""
        if worker_id in self._workers:
            return
        if self._free_slots:
            slot = self._free_slots.pop()
            self._names[slot] = worker_id
        else:
            slot = len(self._names)
            self._names.append(worker_id)
        if slot >= NATIVE_SLOTS and self._table is not None:
            self._to_python(f"worker slot {slot} does not fit a 64-bit mask")
        w = self._workers[worker_id] = _Worker(slot)
        self._all |= w.bit

    def remove_worker(self, worker_id: str) -> None:
        """Forget ``worker_id`` and every block it held. Idempotent."""
        w = self._workers.pop(worker_id, None)
        if w is None:
            return
        self._drop_keys(w, list(w.keys))
        self._names[w.slot] = None
        self._all &= ~w.bit
        self._free_slots.append(w.slot)

    @property
    def workers(self) -> list[str]:
        return list(self._workers)

    # --- events ---------------------------------------------------------------------------

    def reset(self, worker_id: str, snapshot: Snapshot) -> None:
        """Replace ``worker_id``'s blocks with the snapshot's; events resume at ``seq + 1``."""
        self.add_worker(worker_id)
        w = self._workers[worker_id]
        new = set(snapshot.blocks)
        self._drop_keys(w, w.keys - new)
        self._add_keys(w, new - w.keys)
        w.seq = snapshot.seq

    def apply(self, worker_id: str, event: WorkerEvent) -> bool:
        """Apply one event in order. False means "resync me": unsynced, unknown, or a gap."""
        w = self._workers.get(worker_id)
        if w is None or w.seq is None:
            return False
        if event.seq <= w.seq:
            return True
        if event.seq != w.seq + 1:
            w.seq = None
            return False
        w.seq = event.seq
        if isinstance(event, BlockEvent):
            if event.type == "stored":
                self._add_keys(w, set(event.keys).difference(w.keys))
            else:
                self._drop_keys(w, w.keys.intersection(event.keys))
        else:
            assert isinstance(event, LoadEvent)
        return True

    def is_synced(self, worker_id: str) -> bool:
        w = self._workers.get(worker_id)
        return w is not None and w.seq is not None

    def last_seq(self, worker_id: str) -> int | None:
        """The last applied sequence number (None while unsynced): resume with ``since=``."""
        w = self._workers.get(worker_id)
        return None if w is None else w.seq

    # --- queries (hot path) ---------------------------------------------------------------

    def match(self, keys: Sequence[bytes], workers: Iterable[str] | None = None) -> dict[str, int]:
        """For each worker (all, or those named), the number of leading ``keys`` it holds."""
        result: dict[str, int] = {}
        if workers is None:
            active = self._all
        else:
            active = 0
            get = self._workers.get
            for wid in workers:
                w = get(wid)
                if w is None:
                    result[wid] = 0
                else:
                    active |= w.bit
        if self._table is not None:
            # One C call: walks the keys (prefetching ahead) and fills ``result``.
            self._table.match(keys, active, self._names, result)
            return result
        names = self._names
        depth = 0
        # The masks are looked up lazily (map) and consumed a run of equal masks at a time
        # (groupby): a run is walked at C speed, Python only runs where the mask changes, and
        # lookups stop with the run in which the last active worker drops out.
        for mask, run in groupby(map(self._holders.get, keys, repeat(0))) if active else ():
            held = mask & active
            if held != active:
                lost = active & ~held
                while lost:
                    low = lost & -lost
                    result[names[low.bit_length() - 1]] = depth  # type: ignore[index]
                    lost ^= low
                active = held
                if not active:
                    break
            depth += len(list(run))
        while active:
            low = active & -active
            result[names[low.bit_length() - 1]] = depth  # type: ignore[index]
            active ^= low
        return result

    def holders(self, key: bytes) -> list[str]:
        mask = self._holders.get(key, 0) if self._table is None else self._table.get(key)
        return [wid for wid, w in self._workers.items() if mask & w.bit]

    def num_blocks(self, worker_id: str) -> int:
        w = self._workers.get(worker_id)
        return 0 if w is None else len(w.keys)

    def __len__(self) -> int:
        """Distinct keys held by any worker."""
        return len(self._holders) if self._table is None else len(self._table)

    # --- internals ------------------------------------------------------------------------
    # Each worker's key set is the truth; the table (native, or the dict) is derived from them.

    def _add_keys(self, w: _Worker, keys: Iterable[bytes]) -> None:
        keys = list(keys)
        if self._table is not None:
            try:
                self._table.add(keys, w.bit)
            except ValueError as e:  # a key that is not 16 bytes: the dict takes any bytes
                self._to_python(str(e))
        if self._table is None:
            holders, bit = self._holders, w.bit
            for k in keys:
                holders[k] = holders.get(k, 0) | bit
        w.keys.update(keys)

    def _drop_keys(self, w: _Worker, keys: Iterable[bytes]) -> None:
        keys = list(keys)
        w.keys.difference_update(keys)
        if self._table is not None:
            try:
                self._table.drop(keys, w.bit)
                return
            except ValueError as e:
                self._to_python(str(e))   # rebuilt from the key sets: the keys are gone already
                return
        holders, clear = self._holders, ~w.bit
        for k in keys:
            mask = holders.get(k, 0) & clear
            if mask:
                holders[k] = mask
            else:
                holders.pop(k, None)

    def _to_python(self, why: str) -> None:
        """Move to the Python dict for good (rebuilt from the workers' key sets)."""
        log.warning("KvIndex: native table left for the Python dict: %s", why)
        holders: dict[bytes, int] = {}
        for w in self._workers.values():
            bit = w.bit
            for k in w.keys:
                holders[k] = holders.get(k, 0) | bit
        self._holders, self._table = holders, None
