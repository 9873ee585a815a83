"""A store load that verifies each block where it lies and copies it straight into its cache slot.

Shared by every engine's loader (``engine.kv.connector``, ``kvstore.integrations.vllm``): the
caller says where a block's bytes go as addresses (a slot per block, and the offset of each of
the payload's chunks from it), so this module knows no tensor library.

``ScatterLoad`` makes one ``kvstore.net.buffers.Sink`` per block for ``StoreClient.get``. The
client hands a sink its block in the daemon's arena, pinned (shared memory), or in the sink's
staging row right after the block's bytes arrive (TCP; the rows are a reused, already touched
buffer). The sink calls ``kv_verify_scatter`` (``kvstore.native.blocks``), which checks the
header against this cache's template with the block's own key and the payload's XXH3-64
against the header's checksum, and only then copies the payload's ``2 * num_layers`` chunks
into the block's slot (chunk ``c`` to ``slot + offsets[c]``: for our engine's cache the
``2 * num_layers`` runs of ``kv_cache[:, :, block_id]``): one pass over the bytes, no
intermediate buffer on shared memory, nothing written for a block that fails. After the first block that fails,
later blocks are not consumed (the engine recomputes them: only the leading run counts). On
shared memory the pinned blocks of one get are spread over ``threads`` threads (a load runs on
its connector's loader thread; these help it).

Staged (a CUDA cache, ``copy_rows`` given): the slot is row ``i`` of a pinned, contiguous
``[n, payload]`` staging ring instead (``ring_slots``), and every ``group`` blocks of the verified leading
run go to the device at once (``copy_rows(a, b)``: one asynchronous host-to-device copy and one
``index_copy_``), so the DMA of one group overlaps the verification of the next; the
connector sends the rest and records the event that frees the ring.

Without the kernel (no compiler) a connector takes the Python path: ``get`` into encoded rows,
``verify_rows`` (``codec.decode`` of each, the leading run), then its own tensor copy.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import cast

import numpy as np

from kvstore import codec
from kvstore.errors import CorruptBlock
from kvstore.native import blocks as native_blocks
from kvstore.net.buffers import Sink

__all__ = ["ScatterLoad", "scatter_kernel", "ring_slots", "verify_rows"]

log = logging.getLogger(__name__)

MISSING = -1  # a block's status until a sink consumes it

_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _pool(workers: int) -> ThreadPoolExecutor:
    """The process's pool of ``workers`` helper threads for loads (made on first use)."""
    with _pools_lock:
        pool = _pools.get(workers)
        if pool is None:
            pool = _pools[workers] = ThreadPoolExecutor(workers, thread_name_prefix="kv-load")
        return pool


def scatter_kernel() -> Callable[..., int] | None:
    """The kernel (None when it cannot be built). It serves any cache: the caller decides
    whether it writes the cache's slots itself or a staging ring (``ring_slots``)."""
    return native_blocks.verify_scatter()


def ring_slots(base: int, row_bytes: int, n: int) -> tuple[list[int], list[int], int]:
    """(slots, offsets, chunk) of a staged load: row ``i`` of a contiguous ring at ``base``
    takes block ``i``'s whole payload in one run."""
    return [base + i * row_bytes for i in range(n)], [0], row_bytes


class _BlockSink(Sink):
    __slots__ = ("load", "i")

    def __init__(self, load: "ScatterLoad", i: int, staging: np.ndarray) -> None:
        super().__init__(staging)
        self.load, self.i = load, i

    def consume(self, block: np.ndarray) -> None:
        self.load.consume(self.i, block)

    @classmethod
    def consume_all(cls, work: list[tuple[Sink, np.ndarray]]) -> None:
        load = cast(_BlockSink, work[0][0]).load
        load.consume_many([(cast(_BlockSink, s).i, block) for s, block in work])


class ScatterLoad:
    """One load of ``keys``: block ``i``'s payload goes to ``slots[i]`` (an address), its chunk
    ``c`` of ``chunk`` bytes at ``slots[i] + offsets[c]`` (module docstring)."""

    def __init__(self, kernel: Callable[..., int], template: bytes, keys: Sequence[bytes],
                 slots: Sequence[int], offsets: Sequence[int], chunk: int, staging: np.ndarray,
                 threads: int = 1, copy_rows: Callable[[int, int], None] | None = None,
                 group: int = 16) -> None:
        if len(slots) != len(keys):
            raise ValueError(f"{len(keys)} keys for {len(slots)} slots")
        self._kernel, self._template, self._keys = kernel, template, keys
        self._threads = max(1, threads)
        self._slots, self._chunk = list(slots), int(chunk)
        self._offsets = (ctypes.c_int64 * len(offsets))(*offsets)
        self._nchunks = len(offsets)
        self._hash = native_blocks.xxh3_64()
        self.status = [MISSING] * len(keys)   # per block: MISSING, or the kernel's code
        self._stop = len(keys)                # first block known bad: later ones are skipped
        self._copy_rows, self._group = copy_rows, max(1, group)
        self._lead = self._sent = 0           # verified leading run; rows sent to the device
        self._lock = threading.Lock()
        self.sinks = [_BlockSink(self, i, staging[i]) for i in range(len(keys))]

    def consume_many(self, items: list[tuple[int, np.ndarray]]) -> None:
        """Consume pinned blocks, spread over ``threads`` threads in contiguous runs (the
        kernel releases the GIL); returns once every one is consumed."""
        parts = min(self._threads, len(items))
        if parts <= 1:
            for i, block in items:
                self.consume(i, block)
            return
        step = -(-len(items) // parts)
        runs = [items[k:k + step] for k in range(0, len(items), step)]
        futures = [_pool(parts - 1).submit(self._consume_run, run) for run in runs[1:]]
        self._consume_run(runs[0])
        for f in futures:
            f.result()

    def _consume_run(self, run: list[tuple[int, np.ndarray]]) -> None:
        for i, block in run:
            self.consume(i, block)

    def consume(self, i: int, block: np.ndarray) -> None:
        if i >= self._stop:
            return
        rc = self._kernel(block.__array_interface__["data"][0], block.nbytes, self._template,
                          self._keys[i], self._hash, self._slots[i], self._offsets,
                          self._nchunks, self._chunk)
        self.status[i] = rc
        if rc != 0:  # sinks of several nodes may run at once (ClusterClient): keep the least
            self._stop = min(self._stop, i)
        elif self._copy_rows is not None and self._threads == 1:
            self._advance()

    def _advance(self) -> None:
        """Staged: send each full group of the verified leading run to the device."""
        with self._lock:
            while self._lead < len(self.status) and self.status[self._lead] == 0:
                self._lead += 1
            if self._lead - self._sent >= self._group:
                self._send(self._lead)

    def _send(self, upto: int) -> None:
        assert self._copy_rows is not None
        if upto > self._sent:
            self._copy_rows(self._sent, upto)
            self._sent = upto

    def finish(self, loaded: int) -> None:
        """Staged: send the rest of the ``loaded`` leading blocks (the connector's last step)."""
        if self._copy_rows is not None:
            with self._lock:
                self._send(loaded)

    def leading_run(self, found: Sequence[bool]) -> tuple[int, int]:
        """(loaded, index of the first block not loaded or -1): verified and found blocks
        from the start."""
        for i, (ok, st) in enumerate(zip(found, self.status)):
            if not ok or st != 0:
                return i, i
        return len(self.status), -1


def verify_rows(rows: np.ndarray, keys: Sequence[bytes], found: Sequence[bool], dtype: str,
                block_shape: tuple[int, ...]) -> tuple[int, int, int]:
    """The Python path's check of encoded ``rows`` a ``get`` filled: (the leading run of
    verified blocks, 1 if a missing block ended it, 1 if a corrupt one did). A block is corrupt
    when ``codec.decode`` refuses it (key, checksum, length) or it holds another dtype or
    shape than the cache's."""
    good = 0
    for i in range(len(keys)):
        if not found[i]:
            return good, 1, 0
        try:
            header, _ = codec.decode(rows[i], expected_key=keys[i])
        except CorruptBlock as exc:
            log.warning("block %s failed verification, recomputing it: %s", keys[i].hex(), exc)
            return good, 0, 1
        if header.dtype != dtype or header.shape != tuple(block_shape):
            log.warning("block %s is %s%s, this cache holds %s%s; recomputing it", keys[i].hex(),
                        header.dtype, list(header.shape), dtype, list(block_shape))
            return good, 0, 1
        good += 1
    return good, 0, 0
