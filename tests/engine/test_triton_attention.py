"""The Triton paged decode kernel (engine.model.triton_attention) against the dense reference.

Here it runs on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, set before the
module is imported); on CUDA the same kernel runs compiled in ``scripts/gpu_check.sh``. The
engine's CPU decode never takes it (native kernel, else the gather): checked last.
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

pytest.importorskip("triton", reason="needs triton (scripts/setup.sh installs it)")

MODULE = "engine.model.triton_attention"


@pytest.fixture(scope="module")
def kernel():
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")
    sys.modules.pop(MODULE, None)
    try:
        yield importlib.import_module(MODULE)
    finally:
        sys.modules.pop(MODULE, None)  # a later import compiles for a GPU again
        mp.undo()


def _case(seed: int, lens: list[int], heads: int, kvh: int, hd: int, bs: int,
          dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    n = len(lens)
    max_blocks = -(-max(lens) // bs)
    num_blocks = n * max_blocks + 3
    k_cache = torch.randn(num_blocks, bs, kvh, hd, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, bs, kvh, hd, generator=g).to(dtype)
    # Each sequence's blocks scattered over the cache, padded with a valid id (block 0).
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(n, max_blocks, dtype=torch.int32)
    for i, c in enumerate(lens):
        used = -(-c // bs)
        tables[i, :used] = torch.tensor(perm[i * max_blocks : i * max_blocks + used])
    q = torch.randn(n, heads, hd, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


def _reference(q, k_cache, v_cache, tables, lens, scale) -> torch.Tensor:
    """Dense attention of each sequence's one query over its keys, in float64."""
    n, heads, hd = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(n, heads, hd, dtype=torch.float64)
    for i, c in enumerate(lens.tolist()):
        blocks = tables[i, : -(-c // bs)].long()
        k = k_cache[blocks].reshape(-1, kvh, hd)[:c].double()  # [c, kvh, hd]
        v = v_cache[blocks].reshape(-1, kvh, hd)[:c].double()
        for h in range(heads):
            kv = h // (heads // kvh)
            w = torch.softmax(k[:, kv] @ q[i, h].double() * scale, dim=0)
            out[i, h] = w @ v[:, kv]
    return out


@pytest.mark.parametrize("lens, heads, kvh, hd, bs", [
    ([1, 17, 40, 130], 4, 2, 16, 16),   # the tiny llama's shape; a context past two tiles
    ([5, 64, 65], 9, 3, 64, 16),        # SmolLM2's heads; tile edges at 64
    ([3, 33], 2, 2, 32, 4),             # MHA, small blocks: a tile spans many blocks
    ([20], 6, 1, 80, 8),                # MQA, a head dim that is not a power of two
])
def test_float32_equals_the_dense_reference(kernel, lens, heads, kvh, hd, bs):
    q, kc, vc, tables, ctx = _case(len(lens) + hd, lens, heads, kvh, hd, bs)
    scale = hd ** -0.5
    out = torch.full_like(q, float("nan"))
    kernel.paged_decode(q, kc, vc, tables, ctx, scale, out)
    ref = _reference(q, kc, vc, tables, ctx, scale)
    assert torch.allclose(out.double(), ref, atol=2e-5, rtol=1e-5), (out.double() - ref).abs().max()


def test_strided_query_and_a_layer_view_of_the_cache(kernel):
    """q as the runner has it (rows of a wider projection), the cache as one layer's view."""
    q, kc, vc, tables, ctx = _case(3, [9, 31], 4, 2, 16, 4)
    wide = torch.randn(2, 4 * 16 + 8)
    q_view = wide[:, : 4 * 16].view(2, 4, 16)
    q_view.copy_(q)
    assert not q_view.is_contiguous()
    full = torch.stack([torch.stack([kc, vc])] * 2)  # [layers, 2, blocks, bs, kvh, hd]
    out = torch.empty(2, 4, 16)
    kernel.paged_decode(q_view, full[1, 0], full[1, 1], tables, ctx, 0.25, out)
    ref = _reference(q, kc, vc, tables, ctx, 0.25)
    assert torch.allclose(out.double(), ref, atol=2e-5)


def test_bfloat16_is_close_to_the_reference(kernel):
    q, kc, vc, tables, ctx = _case(7, [12, 50], 4, 2, 32, 16, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    kernel.paged_decode(q, kc, vc, tables, ctx, 32 ** -0.5, out)
    ref = _reference(q.float(), kc.float(), vc.float(), tables, ctx, 32 ** -0.5)
    assert out.dtype == torch.bfloat16
    assert (out.double() - ref).abs().max() < 0.05


def test_mismatched_heads_are_refused(kernel):
    q, kc, vc, tables, ctx = _case(1, [4], 3, 2, 16, 4)
    with pytest.raises(ValueError, match="3 heads over 2 KV heads"):
        kernel.paged_decode(q, kc, vc, tables, ctx, 0.25, torch.empty_like(q))


def test_the_cpu_decode_never_takes_the_triton_kernel():
    from engine.model import attention

    q = torch.randn(2, 4, 16)
    kc = torch.randn(8, 4, 2, 16)
    assert attention._triton_kernel(q, kc) is None
    assert not attention._Triton.tried  # nothing imported for a CPU step
