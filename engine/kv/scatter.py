"""A store load that verifies each block where it lies and copies it straight into its cache slot.

``ScatterLoad`` makes one ``kvstore.net.buffers.Sink`` per block for ``StoreClient.get``. The
client hands a sink its block in the daemon's arena, pinned (shared memory), or in the sink's
staging row right after the block's bytes arrive (TCP; the rows are a reused, already touched
buffer). The sink calls ``kv_verify_scatter`` (``kvstore.native.blocks``), which checks the
header against this cache's template with the block's own key and the payload's XXH3-64
against the header's checksum, and only then copies the payload's ``2 * num_layers`` chunks
into the slot ``kv_cache[:, :, block_id]``: one pass over the bytes, no intermediate buffer on
shared memory, nothing written for a block that fails. After the first block that is missing
or fails, later blocks are not consumed (the engine recomputes them: only the leading run
counts).

For a contiguous CPU cache with the kernel built; the connector keeps its staged path
(``get`` into the buffer, ``codec.decode``, ``index_copy_``) for CUDA caches and machines
without a compiler.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvstore import codec
from kvstore.native import blocks as native_blocks
from kvstore.net.buffers import Sink

__all__ = ["ScatterLoad", "scatter_kernel"]

MISSING = -1  # a block's status until a sink consumes it


def scatter_kernel(kv_cache: torch.Tensor) -> Callable[..., int] | None:
    """The kernel when it can load into ``kv_cache`` (contiguous, on the CPU), else None."""
    if kv_cache.is_cuda or not kv_cache.is_contiguous():
        return None
    return native_blocks.verify_scatter()


class _BlockSink(Sink):
    __slots__ = ("load", "i")

    def __init__(self, load: "ScatterLoad", i: int, staging: np.ndarray) -> None:
        super().__init__(staging)
        self.load, self.i = load, i

    def consume(self, block: np.ndarray) -> None:
        self.load.consume(self.i, block)


class ScatterLoad:
    """One load of ``keys`` into cache blocks ``block_ids`` (module docstring)."""

    def __init__(self, kernel: Callable[..., int], kv_cache: torch.Tensor, template: bytes,
                 keys: Sequence[bytes], block_ids: Sequence[int], staging: np.ndarray) -> None:
        self._kernel, self._template, self._keys = kernel, template, keys
        item = kv_cache.element_size()
        base = kv_cache.data_ptr()
        self._slots = [base + int(b) * kv_cache.stride(2) * item for b in block_ids]
        layers = kv_cache.shape[0]
        offsets = [l * kv_cache.stride(0) * item + kv * kv_cache.stride(1) * item
                   for l in range(layers) for kv in range(2)]
        self._offsets = (ctypes.c_int64 * len(offsets))(*offsets)
        self._nchunks = len(offsets)
        self._chunk = kv_cache.stride(2) * item  # a slot's [block_size, heads, head_dim] run
        self._hash = native_blocks.xxh3_64()
        self.status = [MISSING] * len(keys)   # per block: MISSING, or the kernel's code
        self._stop = len(keys)                # first block known bad: later ones are skipped
        self.sinks = [_BlockSink(self, i, staging[i]) for i in range(len(keys))]

    def consume(self, i: int, block: np.ndarray) -> None:
        if i >= self._stop:
            return
        rc = self._kernel(block.__array_interface__["data"][0], block.nbytes, self._template,
                          self._keys[i], self._hash, self._slots[i], self._offsets,
                          self._nchunks, self._chunk)
        self.status[i] = rc
        if rc != 0:  # sinks of several nodes may run at once (ClusterClient): keep the least
            self._stop = min(self._stop, i)

    def leading_run(self, found: Sequence[bool]) -> tuple[int, int]:
        """(loaded, index of the first block not loaded or -1): verified and found blocks
        from the start."""
        for i, (ok, st) in enumerate(zip(found, self.status)):
            if not ok or st != 0:
                return i, i
        return len(self.status), -1
