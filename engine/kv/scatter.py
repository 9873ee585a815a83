"""Where a store load writes in our engine's cache: the addresses ``kvstore.client.scatter``
takes (it verifies each block and copies it straight into them).

The cache is ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``: block ``b``'s
slot starts at ``kv_cache[0, 0, b]``, and its payload's ``2 * num_layers`` chunks (one
``[block_size, heads, head_dim]`` run each, in the canonical order) lie ``stride(0)`` and
``stride(1)`` apart from there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["direct", "cache_slots"]


def direct(kv_cache: torch.Tensor) -> bool:
    """Whether a load can write ``kv_cache``'s slots itself (a contiguous CPU cache)."""
    return not kv_cache.is_cuda and kv_cache.is_contiguous()


def cache_slots(kv_cache: torch.Tensor, block_ids: Sequence[int]) -> tuple[list[int], list[int], int]:
    """(slots, offsets, chunk) of a direct load into ``kv_cache``'s blocks ``block_ids``."""
    item = kv_cache.element_size()
    base = kv_cache.data_ptr()
    slots = [base + int(b) * kv_cache.stride(2) * item for b in block_ids]
    offsets = [l * kv_cache.stride(0) * item + kv * kv_cache.stride(1) * item
               for l in range(kv_cache.shape[0]) for kv in range(2)]
    return slots, offsets, kv_cache.stride(2) * item
