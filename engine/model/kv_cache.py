"""The paged KV cache: one tensor for every layer, block and slot.

Layout (the contract in docs/architecture.md)::

    kv_cache[layer, 0 | 1, block_id, offset, kv_head, head_dim]     # 0 = K, 1 = V

A token's *slot* is ``block_id * block_size + offset``; ``kv_cache[l, 0].view(-1, kv_heads,
head_dim)[slot]`` is its key in layer ``l``. One block's KV for all layers in the canonical
store layout ``[num_layers, 2, block_size, kv_heads, head_dim]`` is ``kv_cache[:, :, block_id]``.
"""

from __future__ import annotations

import torch

from engine.model.config import ModelConfig

__all__ = ["KV_LAYOUT", "allocate_kv_cache", "kv_block_bytes", "write_kv"]

KV_LAYOUT = "layers,kv,blocks,block_size,kv_heads,head_dim"


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """A zeroed cache tensor ``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]``."""
    if num_blocks <= 0 or block_size <= 0:
        raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
    shape = (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block's KV over all layers (what the store keeps per block)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim * elem


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store ``k``/``v`` ``[T, kv_heads, head_dim]`` of one layer at ``slots`` ``[T]`` (int64).

    ``k_cache``/``v_cache`` are the layer's ``[num_blocks, block_size, kv_heads, head_dim]``
    views of the cache tensor (contiguous, so the flat view aliases the cache).
    """
    kvh, hd = k_cache.shape[-2:]
    k_cache.view(-1, kvh, hd).index_copy_(0, slots, k)
    v_cache.view(-1, kvh, hd).index_copy_(0, slots, v)
