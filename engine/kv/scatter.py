"""Where a store load writes in our engine's cache: ``PagedCache``, the ``CacheTarget`` of
``kvstore.transfer.loader`` (the addresses ``kvstore.client.scatter`` verifies each
block into, and the copy of host payload rows into blocks).

The cache is ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``: block ``b``'s
slot starts at ``kv_cache[0, 0, b]``, and its payload's ``2 * num_layers`` chunks (one
``[block_size, heads, head_dim]`` run each, in the canonical order) lie ``stride(0)`` and
``stride(1)`` apart from there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["direct", "cache_slots", "PagedCache"]


def direct(kv_cache: torch.Tensor) -> bool:
    """Whether a load can write ``kv_cache``'s slots itself (a contiguous CPU cache)."""
    return not kv_cache.is_cuda and kv_cache.is_contiguous()


def cache_slots(kv_cache: torch.Tensor, block_ids: Sequence[int]) -> tuple[list[int], list[int], int]:
    """(slots, offsets, chunk) of a direct load into ``kv_cache``'s blocks ``block_ids``."""
    item = kv_cache.element_size()
    base = kv_cache.data_ptr()
    slots = [base + int(b) * kv_cache.stride(2) * item for b in block_ids]
    offsets = [layer * kv_cache.stride(0) * item + kv * kv_cache.stride(1) * item
               for layer in range(kv_cache.shape[0]) for kv in range(2)]
    return slots, offsets, kv_cache.stride(2) * item


class PagedCache:
    """Our engine's paged cache as ``kvstore.transfer.loader`` loads into it."""

    def __init__(self, kv_cache: torch.Tensor, block_shape: tuple[int, ...], payload_bytes: int) -> None:
        self.kv_cache, self.block_shape, self.payload_bytes = kv_cache, block_shape, payload_bytes

    @property
    def is_cuda(self) -> bool:
        return self.kv_cache.is_cuda

    def slots(self, block_ids: Sequence[int]) -> tuple[list[int], list[int], int]:
        return cache_slots(self.kv_cache, block_ids)

    def scatter(self, block_ids: Sequence[int], rows: torch.Tensor) -> None:
        """One ``index_copy_``: ``cache[:, :, ids] = rows`` as ``[L, 2, n, bs, H, D]`` (on CUDA
        after one asynchronous host-to-device copy, on the current stream)."""
        n = len(block_ids)
        if not n:
            return
        payload = rows[:n].view(self.kv_cache.dtype).view(n, *self.block_shape)
        device = self.kv_cache.device
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=device)
        if self.kv_cache.is_cuda:
            payload = payload.to(device, non_blocking=True)
        self.kv_cache.index_copy_(2, ids, payload.permute(1, 2, 0, 3, 4, 5))
