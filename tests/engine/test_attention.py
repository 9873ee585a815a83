"""Paged attention against a dense causal reference: random shapes, several sequences,
chunks that start mid-block, scattered block tables, GQA, mixed decode and prefill; decode
through the native kernel and through the torch fallback."""

from __future__ import annotations

import pytest
import torch

from engine.model import native
from engine.model.attention import AttentionMetadata, DecodeMetadata, PrefillChunk, paged_attention
from engine.model.kv_cache import write_kv


def _dense(q, k, v, start_pos, scale):
    """Reference: query i (absolute position start_pos + i) over keys 0 .. start_pos + i."""
    h, kvh = q.shape[1], k.shape[1]
    k = k.repeat_interleave(h // kvh, dim=1)
    v = v.repeat_interleave(h // kvh, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    qpos = torch.arange(q.shape[0])[:, None] + start_pos
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).reshape(q.shape[0], -1)


@pytest.fixture(params=["native", "torch"])
def decode_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run decode attention through the native kernel, or force the gather + SDPA fallback."""
    if request.param == "native":
        assert native.native_status() == "native", "the C kernel must build here (gcc is set up)"
    else:
        monkeypatch.setattr(native, "supports", lambda *a: False)
    return request.param


@pytest.mark.parametrize("seed", range(6))
def test_paged_matches_dense(seed: int, decode_path: str) -> None:
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randint(*s, generator=g).tolist()  # noqa: E731
    bs = [1, 4, 16][seed % 3]
    kvh, group, hd = rnd(1, 3, (1,))[0], rnd(1, 4, (1,))[0], 8 * rnd(1, 3, (1,))[0]
    heads, num_blocks, scale = kvh * group, 256, hd**-0.5
    k_cache = torch.randn(num_blocks, bs, kvh, hd, generator=g)  # garbage where unwritten
    v_cache = torch.randn(num_blocks, bs, kvh, hd, generator=g)
    free = torch.randperm(num_blocks, generator=g).tolist()  # scattered physical blocks

    # Sequences: (total context, new tokens); new == 1 are decodes, start_pos 0 ones start fresh.
    seqs = [(37, 1), (5, 1), (23, 1), (29, 29), (40, 7), (33, 16)]
    if seed % 2:
        seqs = [(n, 1) for n, _ in seqs[:3]]  # a decode-only step
    full_k = [torch.randn(n, kvh, hd, generator=g) for n, _ in seqs]
    full_v = [torch.randn(n, kvh, hd, generator=g) for n, _ in seqs]
    tables = []
    for (n, new), ks, vs in zip(seqs, full_k, full_v):
        table = [free.pop() for _ in range(-(-n // bs))]
        tables.append(table)
        old = torch.tensor([table[p // bs] * bs + p % bs for p in range(n - new)], dtype=torch.long)
        write_kv(k_cache, v_cache, ks[: n - new], vs[: n - new], old)  # the cached context

    decodes = [i for i, (_, new) in enumerate(seqs) if new == 1]
    prefills = [i for i, (_, new) in enumerate(seqs) if new > 1]
    q_parts, k_parts, v_parts, slots, chunks = [], [], [], [], []
    for i in decodes + prefills:
        n, new = seqs[i]
        q_parts.append(torch.randn(new, heads, hd, generator=g))
        k_parts.append(full_k[i][n - new :])
        v_parts.append(full_v[i][n - new :])
        slots += [tables[i][p // bs] * bs + p % bs for p in range(n - new, n)]
    a = len(decodes)
    for i in prefills:
        n, new = seqs[i]
        p0 = n - new
        table = torch.tensor(tables[i]) if p0 else None
        mask = (torch.arange(n)[None, :] <= torch.arange(p0, n)[:, None]) if p0 else None
        chunks.append(PrefillChunk(a, a + new, p0, table, mask))
        a += new
    decode_meta = None
    if decodes:
        lens = [seqs[i][0] for i in decodes]
        nblk = -(-max(lens) // bs)
        bt = torch.tensor([tables[i] + [0] * (nblk - len(tables[i])) for i in decodes], dtype=torch.int32)
        mask = (torch.arange(max(lens))[None, :] < torch.tensor(lens)[:, None]).view(len(lens), 1, 1, -1)
        decode_meta = DecodeMetadata(len(decodes), bt, max(lens), mask, torch.tensor(lens, dtype=torch.int32))
    q, k, v = torch.cat(q_parts), torch.cat(k_parts), torch.cat(v_parts)
    meta = AttentionMetadata(torch.tensor(slots, dtype=torch.long), decode_meta, chunks)
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, scale)

    row = 0
    for j, i in enumerate(decodes + prefills):
        n, new = seqs[i]
        ref = _dense(q_parts[j], full_k[i], full_v[i], n - new, scale)
        torch.testing.assert_close(out[row : row + new].double(), ref, atol=1e-5, rtol=1e-5)
        row += new


def test_write_kv_lands_in_the_named_slots() -> None:
    k_cache = torch.zeros(4, 4, 1, 2)
    v_cache = torch.zeros(4, 4, 1, 2)
    k = torch.arange(6.0).view(3, 1, 2)
    write_kv(k_cache, v_cache, k, -k, torch.tensor([13, 2, 7]))  # block 3 off 1, block 0 off 2, block 1 off 3
    assert k_cache[3, 1, 0].tolist() == [0.0, 1.0]
    assert k_cache[0, 2, 0].tolist() == [2.0, 3.0]
    assert v_cache[1, 3, 0].tolist() == [-4.0, -5.0]
    assert int((k_cache != 0).sum()) == 5  # only those slots (one of the six values is 0)


@pytest.mark.parametrize("bs,kvh,group,hd", [(16, 3, 3, 64), (16, 8, 4, 128), (32, 2, 16, 256), (1, 1, 1, 8)])
def test_native_decode_long_contexts(bs: int, kvh: int, group: int, hd: int) -> None:
    """The kernel against the dense reference at real model shapes and contexts of 1..2k keys."""
    g = torch.Generator().manual_seed(bs * 1000 + hd)
    lens = [1, bs, bs + 1, 700, 2048]
    num_blocks = sum(-(-n // bs) for n in lens) + 7
    k_cache = torch.randn(num_blocks, bs, kvh, hd, generator=g)
    v_cache = torch.randn(num_blocks, bs, kvh, hd, generator=g)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in lens]
    nblk = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (nblk - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(len(lens), kvh * group, hd, generator=g)
    out = native.paged_decode(q, k_cache, v_cache, bt, torch.tensor(lens, dtype=torch.int32), hd**-0.5)
    for i, n in enumerate(lens):
        flat = torch.tensor([tables[i][p // bs] * bs + p % bs for p in range(n)])
        ks, vs = k_cache.view(-1, kvh, hd)[flat], v_cache.view(-1, kvh, hd)[flat]
        ref = _dense(q[i : i + 1], ks, vs, n - 1, hd**-0.5)
        torch.testing.assert_close(out[i].reshape(1, -1).double(), ref, atol=1e-5, rtol=1e-5)


def test_native_decode_refuses_what_it_cannot_read() -> None:
    k_cache = torch.zeros(4, 16, 2, 8)
    q = torch.zeros(1, 4, 8)
    bt, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    assert native.supports(q, k_cache)
    assert not native.supports(q.double(), k_cache.double())
    assert not native.supports(q, k_cache.transpose(0, 1))
    with pytest.raises(TypeError, match="int32"):
        native.paged_decode(q, k_cache, k_cache, bt.long(), lens, 1.0)
    with pytest.raises(ValueError, match="v_cache"):
        native.paged_decode(q, k_cache, torch.zeros(4, 16, 2, 4), bt, lens, 1.0)
