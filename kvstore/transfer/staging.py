"""Reusable host staging buffers for the connectors' loads and saves (our engine's and vLLM's;
see :class:`StagingPool`); on CUDA pinned, and handed out again only after their copy is done."""

from __future__ import annotations

import threading

import torch

__all__ = ["StagingPool"]


class StagingPool:
    """Reusable host staging buffers ``[capacity, *row_shape]``, capacities powers of two.

    Fresh large allocations are page-faulted on first touch (and on CUDA pinned, a slow
    ``cudaHostAlloc``) on the engine thread; reusing warm buffers keeps the synchronous part
    of a save to one strided copy and a load to the store's read. Bounded: at most
    ``keep_per_size`` buffers are kept per capacity, so at most about twice the largest
    request's bytes per buffer kept. Thread-safe (the engine thread takes save buffers, the
    saver thread gives them back).

    A buffer given back with ``ready`` (a CUDA event recorded after the last asynchronous copy
    out of it) is handed out again only once that copy is done.
    """

    def __init__(self, row_shape: tuple[int, ...], dtype: torch.dtype, pin: bool,
                 keep_per_size: int = 4) -> None:
        self.row_shape, self.dtype, self.pin = row_shape, dtype, pin
        self.keep_per_size = keep_per_size
        self.allocations = 0
        self._free: dict[int, list[tuple[torch.Tensor, torch.cuda.Event | None]]] = {}
        self._lock = threading.Lock()

    def take(self, n: int) -> torch.Tensor:
        """A buffer of at least ``n`` rows (slice ``[:n]``); give it back when done."""
        cap = 1 << max(0, n - 1).bit_length()
        with self._lock:
            free = self._free.get(cap)
            entry = free.pop() if free else None
        if entry is not None:
            buf, ready = entry
            if ready is not None:
                ready.synchronize()
            return buf
        with self._lock:
            self.allocations += 1
        return torch.empty((cap, *self.row_shape), dtype=self.dtype, pin_memory=self.pin)

    def give(self, buf: torch.Tensor, ready: torch.cuda.Event | None = None) -> None:
        with self._lock:
            free = self._free.setdefault(buf.shape[0], [])
            if len(free) < self.keep_per_size:
                free.append((buf, ready))

    @property
    def kept_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() * b.element_size() for free in self._free.values() for b, _ in free)
