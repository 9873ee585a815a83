"""Paged decode attention on CUDA as one Triton kernel, reading the blocks where they lie.

``paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, out)`` has the native CPU
kernel's contract (``engine.model.native.paged_decode``): ``q`` ``[n, heads, hd]`` (one new
token per sequence), one layer's ``k_cache``/``v_cache`` ``[num_blocks, block_size, kv_heads,
hd]``, ``block_tables`` int32 ``[n, max_blocks]``, ``context_lens`` int32 ``[n]`` (keys each
sequence attends over, its new token's included), ``out`` ``[n, heads, hd]``.

One program per (sequence, KV head): it loads the query heads of its KV group once (GQA without
a repeat), then walks the sequence's context in tiles of ``BLOCK_N`` tokens; each token's block
id comes from the block table and its key and value rows are loaded straight from the cache, so
no step gathers a sequence's blocks into a contiguous copy (the torch path's ``index_select``).
Softmax is online (running max and sum in float32), the products ``tl.dot`` on padded tiles
(query heads to 16, head dim to a power of two); float32 inputs multiply in IEEE float32, not
TF32, so the result matches the dense reference to float32 rounding.

This module imports Triton; ``engine.model.attention`` imports it only on the first decode step
of a CUDA cache (``KVENGINE_TRITON=0`` keeps the torch path). With ``TRITON_INTERPRET=1`` set
before the import, the same kernel runs on CPU tensors under Triton's interpreter: how the
tests check it against the dense reference on a machine without a GPU.
"""

# Triton passes the kernel's tl.constexpr parameters as plain Python values (int, bool),
# which pyright's reading of the annotations calls a type error.
# pyright: reportArgumentType=false

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["paged_decode", "supports", "BLOCK_N"]

BLOCK_N = 64  # context tokens per tile
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _paged_decode_kernel(
    Q, K, V, O, TABLES, LENS, scale,
    stride_qn, stride_qh, stride_kb, stride_kt, stride_kh, stride_on, stride_oh, stride_tn,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BS: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    ctx = tl.load(LENS + seq)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    gd_mask = (g < GROUP)[:, None] & (d < D)[None, :]
    heads = kvh * GROUP + g
    q = tl.load(Q + seq * stride_qn + heads[:, None] * stride_qh + d[None, :], mask=gd_mask,
                other=0.0)
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for start in range(0, ctx, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        t_mask = t < ctx
        blk = tl.load(TABLES + seq * stride_tn + t // BS, mask=t_mask, other=0).to(tl.int64)
        rows = blk * stride_kb + (t % BS) * stride_kt + kvh * stride_kh
        kv_mask = t_mask[:, None] & (d < D)[None, :]
        k = tl.load(K + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(t_mask[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(V + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new
    o = acc / l[:, None]
    tl.store(O + seq * stride_on + heads[:, None] * stride_oh + d[None, :],
             o.to(O.dtype.element_ty), mask=gd_mask)


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << max(0, n - 1).bit_length())


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel takes this step: one of :data:`DTYPES`, the cache's dtype, a head dim
    of at most 256 (its tiles live in registers), rows contiguous (the cache's always are)."""
    return (q.dtype in DTYPES and k_cache.dtype == q.dtype and q.stride(-1) == 1
            and k_cache.stride(-1) == 1 and k_cache.shape[-1] == q.shape[-1] <= 256
            and q.shape[1] % k_cache.shape[2] == 0)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                 out: torch.Tensor) -> None:
    """Write the decode attention of ``q``'s ``n`` sequences into ``out`` (module docstring)."""
    n, num_heads, hd = q.shape
    _, bs, kvh, _ = k_cache.shape
    if num_heads % kvh or v_cache.stride() != k_cache.stride() or out.stride(-1) != 1:
        raise ValueError(f"paged_decode: {num_heads} heads over {kvh} KV heads, K strides "
                         f"{k_cache.stride()} V strides {v_cache.stride()}, out {out.stride()}")
    if n == 0:
        return
    group = num_heads // kvh
    _paged_decode_kernel[(n, kvh)](
        q, k_cache, v_cache, out, block_tables, context_lens, float(scale),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=group, G_PAD=_pow2(group), D=hd, D_PAD=_pow2(hd), BS=bs, BLOCK_N=BLOCK_N,
        IEEE=q.dtype == torch.float32,
    )
