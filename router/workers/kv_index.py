"""The router's view of which worker holds which block keys in its device cache.

Fed by each worker's ordered event stream (``stored`` / ``removed`` / ``load``, one sequence
for all three) and by snapshots; asked, on the hot path of every routing decision, "how many
leading blocks of this prompt does each worker hold".

Layout: one dict ``key -> bitmask of workers`` (each worker gets a bit slot), plus each
worker's own key set so that a worker can be dropped or resynchronized without scanning the
whole index. A match walks the prompt's keys once, AND-ing masks until no worker is left:
O(matched blocks) dict lookups whatever the number of workers (runs of equal masks walked at
C speed, see ``match``), the flat equivalent of Dynamo's radix-tree ``find_matches`` (keys are
chained prefix hashes, so a key already names its whole prefix and a tree adds nothing to the
lookup).

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

from collections.abc import Iterable, Sequence
from itertools import groupby, repeat

from engine.api.events import BlockEvent, LoadEvent, Snapshot, WorkerEvent

__all__ = ["KvIndex"]


class _Worker:
    __slots__ = ("slot", "bit", "keys", "seq")

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.bit = 1 << slot
        self.keys: set[bytes] = set()
        self.seq: int | None = None  # None: unsynced, waiting for a snapshot


class KvIndex:
    """Block key → workers holding it; longest leading match per worker."""

    def __init__(self) -> None:
        self._holders: dict[bytes, int] = {}
        self._workers: dict[str, _Worker] = {}
        self._by_slot: dict[int, str] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0

    # --- membership -----------------------------------------------------------------------

    def add_worker(self, worker_id: str) -> None:
        """Start tracking ``worker_id`` (unsynced until its first ``reset``). Idempotent."""
        if worker_id in self._workers:
            return
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            slot, self._next_slot = self._next_slot, self._next_slot + 1
        self._workers[worker_id] = _Worker(slot)
        self._by_slot[slot] = worker_id

    def remove_worker(self, worker_id: str) -> None:
        """Forget ``worker_id`` and every block it held. Idempotent."""
        w = self._workers.pop(worker_id, None)
        if w is None:
            return
        self._drop_keys(w, w.keys)
        del self._by_slot[w.slot]
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
                self._add_keys(w, [k for k in event.keys if k not in w.keys])
            else:
                self._drop_keys(w, [k for k in event.keys if k in w.keys])
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
        if workers is None:
            active = 0
            for w in self._workers.values():
                active |= w.bit
            result: dict[str, int] = {}
        else:
            active = 0
            result = {}
            for wid in workers:
                w = self._workers.get(wid)
                if w is None:
                    result[wid] = 0
                else:
                    active |= w.bit
        by_slot = self._by_slot
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
                    result[by_slot[low.bit_length() - 1]] = depth
                    lost ^= low
                active = held
                if not active:
                    break
            depth += len(list(run))
        while active:
            low = active & -active
            result[by_slot[low.bit_length() - 1]] = depth
            active ^= low
        return result

    def holders(self, key: bytes) -> list[str]:
        mask = self._holders.get(key, 0)
        return [wid for wid, w in self._workers.items() if mask & w.bit]

    def num_blocks(self, worker_id: str) -> int:
        w = self._workers.get(worker_id)
        return 0 if w is None else len(w.keys)

    def __len__(self) -> int:
        """Distinct keys held by any worker."""
        return len(self._holders)

    # --- internals ------------------------------------------------------------------------

    def _add_keys(self, w: _Worker, keys: Iterable[bytes]) -> None:
        holders, bit = self._holders, w.bit
        for k in keys:
            holders[k] = holders.get(k, 0) | bit
            w.keys.add(k)

    def _drop_keys(self, w: _Worker, keys: Iterable[bytes]) -> None:
        holders, clear = self._holders, ~w.bit
        for k in list(keys):
            mask = holders.get(k, 0) & clear
            if mask:
                holders[k] = mask
            else:
                holders.pop(k, None)
            w.keys.discard(k)
