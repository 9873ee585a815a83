"""Which decode attention a step takes (engine.model.attention): the Triton kernel where it
applies (CUDA), the gather path when its first launch fails, and an error once it has run.

The kernel's selection is driven here with a stand-in kernel on CPU tensors (no GPU, no Triton):
``_triton_kernel`` is what checks for CUDA, so the test replaces it."""

from __future__ import annotations

import pytest
import torch

from engine.model import attention, native
from engine.model.attention import AttentionMetadata, DecodeMetadata, paged_attention


def _step():
    g = torch.Generator().manual_seed(0)
    bs, kvh, heads, hd, lens = 4, 2, 4, 8, [5, 9]
    k_cache, v_cache = torch.randn(16, bs, kvh, hd, generator=g), torch.randn(16, bs, kvh, hd, generator=g)
    tables = torch.tensor([[3, 7, 0], [1, 2, 4]], dtype=torch.int32)
    mask = (torch.arange(9)[None, :] < torch.tensor(lens)[:, None]).view(2, 1, 1, 9)
    dm = DecodeMetadata(2, tables, 9, mask, torch.tensor(lens, dtype=torch.int32))
    q, k = torch.randn(2, heads, hd, generator=g), torch.randn(2, kvh, hd, generator=g)
    meta = AttentionMetadata(slot_mapping=torch.tensor([0, 1]), decode=dm)
    return (q, k, k.clone(), k_cache, v_cache, meta, hd ** -0.5)


@pytest.fixture
def kernel(monkeypatch):
    """A stand-in Triton kernel taken for every step; the native CPU kernel kept out."""
    state = attention._TritonKernel(tried=True, supports=lambda q, kc: True)
    monkeypatch.setattr(attention, "_triton", state)
    monkeypatch.setattr(attention, "_triton_kernel", lambda q, kc: state.fn)
    monkeypatch.setattr(native, "supports", lambda *a: False)
    return state


def _gathered(args) -> torch.Tensor:
    fn = attention._triton.fn
    attention._triton.fn = None
    try:
        return paged_attention(*args)
    finally:
        attention._triton.fn = fn


def test_a_step_the_kernel_takes_is_its_output(kernel):
    calls = []

    def fake(q, k_cache, v_cache, tables, lens, scale, out):
        calls.append((q.shape, tables.tolist(), lens.tolist()))
        out.fill_(7.0)

    kernel.fn = fake
    out = paged_attention(*_step())
    assert calls == [((2, 4, 8), [[3, 7, 0], [1, 2, 4]], [5, 9])]
    assert torch.equal(out, torch.full((2, 32), 7.0))
    assert kernel.proven and attention.triton_status() == "triton"


def test_a_failed_first_launch_falls_back_to_the_gather_for_good(kernel):
    def broken(*args):
        raise RuntimeError("ptxas fatal: unsupported target")

    kernel.fn = broken
    args = _step()
    want = _gathered(args)
    out = paged_attention(*args)
    assert torch.equal(out, want)
    assert kernel.fn is None and not kernel.proven
    assert attention.triton_status() == "first launch failed: ptxas fatal: unsupported target"


def test_a_failure_after_the_kernel_has_run_is_an_error(kernel):
    def flaky(q, k_cache, v_cache, tables, lens, scale, out):
        if kernel.proven:
            raise RuntimeError("illegal memory access")
        out.zero_()

    kernel.fn = flaky
    paged_attention(*_step())
    with pytest.raises(RuntimeError, match="illegal memory access"):
        paged_attention(*_step())


def test_a_cpu_step_without_the_native_kernel_gathers(monkeypatch):
    """Not CUDA: no Triton import is tried, the gather path computes the step."""
    monkeypatch.setattr(attention, "_triton", attention._TritonKernel())
    monkeypatch.setattr(native, "supports", lambda *a: False)
    out = paged_attention(*_step())
    assert out.shape == (2, 32) and torch.isfinite(out).all()
    assert not attention._triton.tried
