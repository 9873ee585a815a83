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

A step with few (sequence, KV head) pairs for the GPU's multiprocessors (batch 1 on a long
context) also splits each context into ``splits`` ranges of whole tiles, one program each
(flash-decoding): each writes its range's running max, sum and weighted values in float32, and a
second small kernel merges the ranges of a pair and writes ``out``. ``splits`` is chosen from the
multiprocessor count (:func:`choose_splits`); one split is the single kernel above.

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

__all__ = ["paged_decode", "supports", "choose_splits", "BLOCK_N"]

BLOCK_N = 64  # context tokens per tile
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _paged_decode_kernel(
    Q, K, V, O, TABLES, LENS, scale, split_len, M, L, ACC,
    stride_qn, stride_qh, stride_kb, stride_kt, stride_kh, stride_on, stride_oh, stride_tn,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BS: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, SPLITS: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
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
    lo = split * split_len  # this program's tokens: [lo, min(ctx, lo + split_len))
    hi = tl.minimum(ctx, lo + split_len)
    for start in range(lo, hi, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        t_mask = t < hi
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
    if SPLITS == 1:
        o = acc / l[:, None]
        tl.store(O + seq * stride_on + heads[:, None] * stride_oh + d[None, :],
                 o.to(O.dtype.element_ty), mask=gd_mask)
    else:  # this range's partial state; a range past the context leaves m = -inf, l = 0
        part = (seq * tl.num_programs(1) + kvh) * SPLITS + split
        tl.store(M + part * G_PAD + g, m)
        tl.store(L + part * G_PAD + g, l)
        tl.store(ACC + (part * G_PAD + g)[:, None] * D_PAD + d[None, :], acc)


@triton.jit
def _merge_splits_kernel(
    O, M, L, ACC, stride_on, stride_oh,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    SPLITS: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.arange(0, SPLITS)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    part = (seq * tl.num_programs(1) + kvh) * SPLITS + sp  # [SPLITS]
    m = tl.load(M + part[:, None] * G_PAD + g[None, :])  # [SPLITS, G_PAD]
    l = tl.load(L + part[:, None] * G_PAD + g[None, :])
    m_max = tl.max(m, 0)  # the first range always holds a token: finite
    w = tl.exp(m - m_max[None, :])  # 0 for a range past the context
    l_all = tl.sum(l * w, 0)
    acc = tl.load(ACC + (part[:, None, None] * G_PAD + g[None, :, None]) * D_PAD + d[None, None, :])
    o = tl.sum(acc * w[:, :, None], 0) / l_all[:, None]
    heads = kvh * GROUP + g
    gd_mask = (g < GROUP)[:, None] & (d < D)[None, :]
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


_SM_COUNT: dict[int, int] = {}


def choose_splits(programs: int, max_tiles: int, device: torch.device) -> int:
    """Ranges per context: doubled (up to 16, each at least 2 tiles) while the ``programs``
    (sequence, KV head) pairs fill less than two waves of the device's multiprocessors."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    splits = 1
    while splits < 16 and programs * splits < 2 * _SM_COUNT[index] and max_tiles >= 4 * splits:
        splits *= 2
    return splits


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                 out: torch.Tensor, splits: int | None = None) -> None:
    """Write the decode attention of ``q``'s ``n`` sequences into ``out`` (module docstring);
    ``splits`` (a power of two) overrides :func:`choose_splits`."""
    n, num_heads, hd = q.shape
    _, bs, kvh, _ = k_cache.shape
    if num_heads % kvh or v_cache.stride() != k_cache.stride() or out.stride(-1) != 1:
        raise ValueError(f"paged_decode: {num_heads} heads over {kvh} KV heads, K strides "
                         f"{k_cache.stride()} V strides {v_cache.stride()}, out {out.stride()}")
    if n == 0:
        return
    group = num_heads // kvh
    g_pad, d_pad = _pow2(group), _pow2(hd)
    max_tiles = triton.cdiv(block_tables.shape[1] * bs, BLOCK_N)
    if splits is None:
        splits = choose_splits(n * kvh, max_tiles, q.device)
    if splits < 1 or splits & (splits - 1):
        raise ValueError(f"paged_decode: splits must be a power of two, got {splits}")
    split_len = triton.cdiv(max_tiles, splits) * BLOCK_N
    if splits == 1:
        m = l = acc = out  # not written
    else:
        m = torch.empty(n * kvh * splits * g_pad, dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)
        acc = torch.empty(n * kvh * splits * g_pad * d_pad, dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(n, kvh, splits)](
        q, k_cache, v_cache, out, block_tables, context_lens, float(scale), split_len, m, l, acc,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=group, G_PAD=g_pad, D=hd, D_PAD=d_pad, BS=bs, BLOCK_N=BLOCK_N,
        IEEE=q.dtype == torch.float32, SPLITS=splits,
    )
    if splits > 1:
        _merge_splits_kernel[(n, kvh)](out, m, l, acc, out.stride(0), out.stride(1), GROUP=group,
                                       G_PAD=g_pad, D=hd, D_PAD=d_pad, SPLITS=splits)
