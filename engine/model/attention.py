"""Attention over the paged KV cache.

A step holds the new tokens of several sequences, flattened: first every *decode* item (one
new token each, the batched fast path), then each *prefill* item's chunk (one or more new
tokens). :class:`AttentionMetadata` describes that layout once per step; every layer reuses it.

Per layer, :func:`paged_attention` (after the caller wrote the step's K/V into the cache):

- decode items: on CPU float32, one call of the native kernel (``engine.model.native``) reads
  each sequence's keys and values from its blocks in place, every KV once, the query heads of
  a KV group together. On CUDA with Triton importable, one launch of the Triton kernel
  (``engine.model.triton_attention``) does the same on the GPU. Elsewhere (other dtypes on
  CPU, no C compiler, no Triton, ``KVENGINE_TRITON=0``) their block tables, padded to the
  longest, gather each sequence's K/V once (``index_select`` of whole blocks) and one
  ``scaled_dot_product_attention`` call covers the batch, with the query heads of a KV group
  laid along the query axis (GQA without a repeat) and a key-padding mask for the shorter
  contexts;
- a prefill chunk that starts a sequence (``start_pos == 0``) attends over its own fresh K/V,
  causally, without touching the cache;
- a chunk that continues a sequence gathers its context from the cache and attends with a
  causal mask offset by ``start_pos`` (query ``i`` sees keys ``0 .. start_pos + i``).

Exact (within float tolerance) against dense causal attention over each sequence's tokens.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.model import native

__all__ = ["DecodeMetadata", "PrefillChunk", "AttentionMetadata", "paged_attention",
           "triton_status"]

log = logging.getLogger(__name__)


@dataclass
class DecodeMetadata:
    """The first ``num_seqs`` tokens of the step: one new token per sequence."""

    num_seqs: int
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks], padded with a valid block id
    context_len: int  # keys to attend over after the gather (max context, <= max_blocks * bs)
    key_mask: torch.Tensor | None  # bool [num_seqs, 1, 1, context_len]; None when all equal
    context_lens: torch.Tensor  # int32 [num_seqs]: keys each sequence attends over


@dataclass
class PrefillChunk:
    """One sequence's chunk of new tokens, ``[token_start, token_end)`` of the step."""

    token_start: int
    token_end: int
    start_pos: int  # tokens of this sequence already in the cache before this chunk
    block_table: torch.Tensor | None  # int64 blocks covering start_pos + chunk (None if start_pos == 0)
    causal_mask: torch.Tensor | None  # bool [chunk, start_pos + chunk] (None if start_pos == 0)


@dataclass
class AttentionMetadata:
    """Everything attention needs about a step's layout, built once by the runner."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]: where each new token's K/V goes
    decode: DecodeMetadata | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)


@dataclass
class _TritonKernel:
    """The process's Triton decode kernel: loaded on the first CUDA decode step, dropped (with
    one warning) if the import or its first launch fails, trusted after a launch succeeds."""

    tried: bool = False
    proven: bool = False
    fn: Callable[..., None] | None = None
    supports: Callable[[torch.Tensor, torch.Tensor], bool] | None = None
    why: str = "not tried (no CUDA decode step yet)"


_triton = _TritonKernel()


def _triton_kernel(q: torch.Tensor, k_cache: torch.Tensor) -> Callable[..., None] | None:
    """The Triton decode kernel for this step, or None (not CUDA, no Triton, or unsupported)."""
    if not q.is_cuda:
        return None
    if not _triton.tried:
        _triton.tried = True
        if os.environ.get("KVENGINE_TRITON", "1") == "0":
            _triton.why = "disabled by KVENGINE_TRITON=0"
        else:
            try:
                from engine.model import triton_attention
            except Exception as e:  # noqa: BLE001 - no Triton (or a broken one): the torch path
                _triton.why = f"triton unavailable: {e}"
                log.warning("Triton paged decode unavailable, gathering blocks instead: %s", e)
            else:
                _triton.fn, _triton.supports = triton_attention.paged_decode, triton_attention.supports
                _triton.why = "loaded, not launched yet"
    if _triton.fn is None or _triton.supports is None or not _triton.supports(q, k_cache):
        return None
    return _triton.fn


def triton_status() -> str:
    """``"triton"`` once the kernel has run in this process, else why it has not."""
    return "triton" if _triton.proven else _triton.why


def _triton_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   dm: DecodeMetadata, scale: float, out: torch.Tensor) -> bool:
    """The decode items through the Triton kernel: False where it does not take them (not
    CUDA, no Triton, unsupported) or its first launch failed (then dropped for good)."""
    fn = _triton_kernel(q, k_cache)
    if fn is None:
        return False
    n = dm.num_seqs
    try:
        fn(q[:n], k_cache, v_cache, dm.block_tables, dm.context_lens, scale,
           out[:n].view(n, q.shape[1], q.shape[2]))
    except Exception as e:  # a first launch that fails: the torch path for good
        if _triton.proven:
            raise
        _triton.fn, _triton.why = None, f"first launch failed: {e}"
        log.warning("Triton paged decode failed to launch, gathering blocks instead: %s", e)
        return False
    _triton.proven = True
    return True


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """``cache[block_table]`` as ``[*block_table.shape[:-1], blocks * block_size, kvh, hd]``."""
    _, bs, kvh, hd = cache.shape
    out = cache.index_select(0, block_table.reshape(-1))
    return out.view(*block_table.shape[:-1], block_table.shape[-1] * bs, kvh, hd)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention output ``[T, heads * head_dim]`` for the step's new tokens.

    ``q`` ``[T, heads, hd]``, ``k``/``v`` ``[T, kv_heads, hd]`` (already written to the cache);
    ``k_cache``/``v_cache`` one layer's ``[num_blocks, block_size, kv_heads, hd]``.
    """
    num_tokens, num_heads, hd = q.shape
    kvh = k.shape[1]
    group = num_heads // kvh
    out = q.new_empty(num_tokens, num_heads * hd)

    dm = meta.decode
    if dm is not None and native.supports(q, k_cache):
        n = dm.num_seqs
        native.paged_decode(q[:n], k_cache, v_cache, dm.block_tables, dm.context_lens, scale,
                            out=out[:n].view(n, num_heads, hd))
    elif dm is not None and not _triton_decode(q, k_cache, v_cache, dm, scale, out):
        n, s = dm.num_seqs, dm.context_len
        kc = _gather(k_cache, dm.block_tables)[:, :s].transpose(1, 2)  # [n, kvh, s, hd]
        vc = _gather(v_cache, dm.block_tables)[:, :s].transpose(1, 2)
        qd = q[:n].view(n, kvh, group, hd)  # a KV group's query heads along the query axis
        o = F.scaled_dot_product_attention(qd, kc, vc, attn_mask=dm.key_mask, scale=scale)
        out[:n] = o.reshape(n, num_heads * hd)

    for chunk in meta.prefills:
        a, b = chunk.token_start, chunk.token_end
        qc = q[a:b].transpose(0, 1).unsqueeze(0)  # [1, heads, L, hd]
        if chunk.block_table is None:
            kc = k[a:b].transpose(0, 1).unsqueeze(0)
            vc = v[a:b].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qc, kc, vc, is_causal=True, scale=scale, enable_gqa=group > 1
            )
        else:
            ctx = chunk.start_pos + (b - a)
            kc = _gather(k_cache, chunk.block_table)[:ctx].transpose(0, 1).unsqueeze(0)
            vc = _gather(v_cache, chunk.block_table)[:ctx].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qc, kc, vc, attn_mask=chunk.causal_mask, scale=scale, enable_gqa=group > 1
            )
        out[a:b] = o[0].transpose(0, 1).reshape(b - a, num_heads * hd)
    return out
