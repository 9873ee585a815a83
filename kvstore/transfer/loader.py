"""The load every engine's connector shares: a batch of store blocks, each verified before any of
its bytes reach an engine's paged cache (our engine's ``engine.kv.connector`` and the vLLM
connector, ``kvstore.integrations.vllm``, both load through ``BlockLoader``).

An engine's cache is a ``CacheTarget``: the bytes of one block's payload (the codec's canonical
layout, ``kvstore.codec``) and two ways in. ``slots`` gives the addresses a load may write
itself (a CPU cache: the block's slot, and each payload chunk's offset from it);
``scatter`` copies host payload rows into blocks (any cache; on CUDA asynchronous on the
current stream).

``BlockLoader.load(get, keys, block_ids)`` returns ``(loaded, missing, corrupt)``: the leading
run of verified blocks written, and whether a missing (1) or corrupt (1) block ended it. What
follows the run is left for the engine to recompute (its slots may hold verified bytes of later
blocks, which the recompute overwrites); unverified bytes never reach the cache. ``get`` is the
store's batch get (``StoreClient.get``, or a caller's wrapper that tries a handoff's node
first); its ``KVStoreError`` propagates (the caller counts it as a miss). Three paths:

- *direct* (the native kernel, a cache ``slots`` can address): one ``Sink`` per block
  (``kvstore.client.scatter``) verifies the block where it lies (the daemon's arena on shared
  memory, a reused landing row over TCP) and copies it straight into its slot;
- *staged* (the kernel, a CUDA cache): the same sinks write a pooled host ring (pinned on
  CUDA), and every group of the verified leading run goes on to the cache with ``scatter``
  while the next group is verified; the ring is handed out again once its copies are done;
- *python* (no kernel): ``get`` into pooled encoded rows, ``verify_rows``, then ``scatter``.

Buffers are pooled (``StagingPool``): a warm loader allocates nothing per load. One load at a
time per loader (each connector runs its loads on one thread).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import torch

from kvstore import codec
from kvstore.client.scatter import ScatterLoad, ring_slots, scatter_kernel, verify_rows
from kvstore.native.blocks import VERIFY_CODES
from kvstore.transfer.staging import StagingPool

__all__ = ["CacheTarget", "BlockLoader"]

log = logging.getLogger(__name__)

Get = Callable[[list[Any], list[Any]], list[bool]]


class CacheTarget(Protocol):
    """An engine's paged cache as a load sees it (module docstring)."""

    @property
    def payload_bytes(self) -> int: ...

    @property
    def is_cuda(self) -> bool: ...

    def slots(self, block_ids: Sequence[int]) -> tuple[list[int], list[int], int]:
        """(slots, offsets, chunk): block ``b``'s payload chunk ``c`` (``chunk`` bytes) goes
        to ``slots[i] + offsets[c]``."""
        ...

    def scatter(self, block_ids: Sequence[int], rows: torch.Tensor) -> None:
        """Copy host payload rows (``[n, payload_bytes]`` uint8) into blocks ``block_ids``."""
        ...


class BlockLoader:
    """Verified loads into one ``CacheTarget`` (module docstring). ``path``: ``auto`` (direct
    on a CPU cache, staged on CUDA; python without the kernel), or one forced; ``threads``: how
    many threads a shared-memory load verifies and copies on."""

    def __init__(self, target: CacheTarget, dtype_name: str, block_shape: tuple[int, ...], *,
                 path: Literal["auto", "direct", "staged", "python"] = "auto",
                 threads: int = 1) -> None:
        self.target, self.dtype_name, self.block_shape = target, dtype_name, tuple(block_shape)
        self.threads = threads
        self.kernel = scatter_kernel() if path != "python" else None
        self.direct = (not target.is_cuda) if path == "auto" else path == "direct"
        self.template = codec.header_template(dtype_name, self.block_shape)
        self.encoded_bytes = codec.HEADER_SIZE + target.payload_bytes
        # Landing rows (TCP, or the python path's encoded rows) and the staged path's ring.
        self._rows = StagingPool((self.encoded_bytes,), torch.uint8, pin=target.is_cuda,
                                 keep_per_size=1)
        self._ring = StagingPool((target.payload_bytes,), torch.uint8, pin=target.is_cuda,
                                 keep_per_size=1)

    @property
    def allocations(self) -> int:
        """Host buffers allocated so far (they stop growing once each size was seen)."""
        return self._rows.allocations + self._ring.allocations

    def load(self, get: Get, keys: Sequence[bytes], block_ids: Sequence[int]) -> tuple[int, int, int]:
        """(loaded, missing, corrupt) of ``keys`` into ``block_ids`` (module docstring)."""
        if len(keys) != len(block_ids):
            raise ValueError(f"{len(keys)} keys for {len(block_ids)} blocks")
        if not keys:
            return 0, 0, 0
        rows = self._rows.take(len(keys))
        try:
            if self.kernel is not None:
                return self._scatter(get, keys, block_ids, rows)
            return self._python(get, keys, block_ids, rows)
        finally:
            self._rows.give(rows, self._copied())

    def _copied(self) -> torch.cuda.Event | None:
        """On CUDA, an event after the copies queued so far (a buffer is reused once it is done)."""
        if not self.target.is_cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _scatter(self, get: Get, keys: Sequence[bytes], block_ids: Sequence[int],
                 rows: torch.Tensor) -> tuple[int, int, int]:
        assert self.kernel is not None
        n = len(keys)
        ring: torch.Tensor | None = None
        send = None
        if self.direct:
            slots, offsets, chunk = self.target.slots(block_ids)
        else:
            ring = staged = self._ring.take(n)
            slots, offsets, chunk = ring_slots(ring.data_ptr(), self.target.payload_bytes, n)

            def send_rows(a: int, b: int) -> None:   # a verified group goes on to the cache
                self.target.scatter(block_ids[a:b], staged[a:b])

            send = send_rows

        load = ScatterLoad(self.kernel, self.template, keys, slots, offsets, chunk, rows.numpy(),
                           threads=self.threads, copy_rows=send)
        try:
            found = get(list(keys), list(load.sinks))
            good, bad = load.leading_run(found)
            load.finish(good)
        finally:
            if ring is not None:
                self._ring.give(ring, self._copied())
        if bad < 0:
            return good, 0, 0
        if not found[bad]:
            return good, 1, 0
        log.warning("block %s failed verification (%s), recomputing it", bytes(keys[bad]).hex(),
                    VERIFY_CODES.get(load.status[bad], load.status[bad]))
        return good, 0, 1

    def _python(self, get: Get, keys: Sequence[bytes], block_ids: Sequence[int],
                rows: torch.Tensor) -> tuple[int, int, int]:
        n = len(keys)
        arr = rows.numpy()
        found = get(list(keys), [arr[i] for i in range(n)])
        good, missing, corrupt = verify_rows(arr, keys, found, self.dtype_name, self.block_shape)
        if good:
            self.target.scatter(block_ids[:good], rows[:good, codec.HEADER_SIZE:])
        return good, missing, corrupt
