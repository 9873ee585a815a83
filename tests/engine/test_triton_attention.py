"""The Triton paged decode kernel (engine.model.triton_attention) against the dense reference.

Here it runs on CPU tensors under Triton's interpreter, in one child process: the interpreter
takes effect only when ``TRITON_INTERPRET=1`` is set before Triton is first imported, and a
process that imported Triton so could not compile kernels for a GPU afterwards. On CUDA the
same cases run compiled (the ``gpu`` test here, and ``scripts/gpu_check.sh``). The engine's CPU
decode never takes the kernel (native kernel, else the gather): checked last.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="needs triton (scripts/setup.sh installs it)")

REPO = Path(__file__).resolve().parents[2]
# name: (seed, context lengths, heads, kv heads, head dim, block size, dtype)
CASES = {
    "tiny-llama": (1, [1, 17, 40, 130], 4, 2, 16, 16, "float32"),  # a context past two tiles
    "smollm2-heads": (2, [5, 64, 65], 9, 3, 64, 16, "float32"),      # tile edges at 64
    "mha-small-blocks": (3, [3, 33], 2, 2, 32, 4, "float32"),        # a tile spans many blocks
    "mqa-hd80": (4, [20], 6, 1, 80, 8, "float32"),                   # head dim not a power of 2
    "fp16": (7, [12, 50], 4, 2, 32, 16, "float16"),   # the low-precision path (p cast down)
    "bf16": (7, [12, 50], 4, 2, 32, 16, "bfloat16"),
}
TOLERANCE = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 0.05}
# Triton 3.6's interpreter keeps bfloat16 as uint16 and its tl.dot multiplies those bits (a
# max error of 8e8 here): bfloat16 is checked compiled, on CUDA only.
NOT_INTERPRETED = {"bf16"}
SPLIT_CASES = [("tiny-llama", 2), ("tiny-llama", 4), ("smollm2-heads", 2), ("mqa-hd80", 2),
               ("fp16", 2), ("bf16", 4)]


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


def _max_error(kernel, case: tuple, device: str = "cpu", splits: int | None = None) -> float:
    seed, lens, heads, kvh, hd, bs, dtype = case
    q, kc, vc, tables, ctx = _case(seed, lens, heads, kvh, hd, bs, getattr(torch, dtype))
    scale = hd ** -0.5
    dev = [t.to(device) for t in (q, kc, vc, tables, ctx)]
    out = torch.full_like(dev[0], float("nan"))
    kernel.paged_decode(*dev, scale, out, splits=splits)
    ref = _reference(q.float(), kc.float(), vc.float(), tables, ctx, scale)
    assert out.dtype == q.dtype
    return float((out.cpu().double() - ref).abs().max())


def _strided_error(kernel, device: str = "cpu") -> float:
    """q as the runner has it (rows of a wider projection), the cache as one layer's view."""
    q, kc, vc, tables, ctx = _case(3, [9, 31], 4, 2, 16, 4)
    wide = torch.zeros(2, 4 * 16 + 8, device=device)
    q_view = wide[:, : 4 * 16].view(2, 4, 16)  # made on the device: .to() would compact it
    q_view.copy_(q)
    assert not q_view.is_contiguous() and q_view.stride(0) == 72
    full = torch.stack([torch.stack([kc, vc])] * 2).to(device)  # [layers, 2, blocks, bs, kvh, hd]
    out = torch.empty(2, 4, 16, device=device)
    kernel.paged_decode(q_view, full[1, 0], full[1, 1], tables.to(device), ctx.to(device), 0.25, out)
    return float((out.cpu().double() - _reference(q, kc, vc, tables, ctx, 0.25)).abs().max())


def _refusal(kernel) -> str:
    q, kc, vc, tables, ctx = _case(1, [4], 3, 2, 16, 4)
    try:
        kernel.paged_decode(q, kc, vc, tables, ctx, 0.25, torch.empty_like(q))
    except ValueError as e:
        return str(e)
    return "accepted"


def _interpreter_numpy_shim() -> None:
    """Triton 3.6's interpreter turns a scalar (a one-element array there) into a loop bound
    with ``int(array)``, which NumPy 2.4 refuses for arrays of one dimension; convert its one
    element instead. Only the interpreter is patched, and only in the child."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch


def run_cases(device: str = "cpu") -> dict:
    """Every case's max abs error against the reference (in the child, or on CUDA)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if interpreted:
        _interpreter_numpy_shim()
    from engine.model import triton_attention as kernel

    out = {name: _max_error(kernel, case, device) for name, case in CASES.items()
           if not (interpreted and name in NOT_INTERPRETED)}
    # The context split in ranges (flash-decoding), ranges past a short sequence's end included.
    for name, splits in SPLIT_CASES:
        if not (interpreted and name in NOT_INTERPRETED):
            out[f"{name}/splits{splits}"] = _max_error(kernel, CASES[name], device, splits)
    out["strided"] = _strided_error(kernel, device)
    out["refusal"] = _refusal(kernel)
    return out


@pytest.fixture(scope="module")
def interpreted(module_procs) -> dict:
    code = "import json, tests.engine.test_triton_attention as t; print(json.dumps(t.run_cases()))"
    r = module_procs.run([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "1"},
                         timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", sorted(set(CASES) - NOT_INTERPRETED))
def test_interpreted_kernel_equals_the_dense_reference(interpreted, name):
    assert interpreted[name] < TOLERANCE[CASES[name][-1]], interpreted[name]


@pytest.mark.parametrize("name, splits", [c for c in SPLIT_CASES if c[0] not in NOT_INTERPRETED])
def test_interpreted_split_context_equals_the_dense_reference(interpreted, name, splits):
    assert interpreted[f"{name}/splits{splits}"] < TOLERANCE[CASES[name][-1]]


def test_interpreted_kernel_takes_a_strided_query_and_a_layer_view(interpreted):
    assert interpreted["strided"] < TOLERANCE["float32"]


def test_mismatched_heads_are_refused(interpreted):
    assert "3 heads over 2 KV heads" in interpreted["refusal"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_kernel_on_cuda_equals_the_dense_reference():
    errors = run_cases("cuda")
    for name, case in CASES.items():
        assert errors[name] < TOLERANCE[case[-1]], (name, errors[name])
    for name, splits in SPLIT_CASES:
        assert errors[f"{name}/splits{splits}"] < TOLERANCE[CASES[name][-1]], (name, splits)
    assert errors["strided"] < TOLERANCE["float32"]


def test_the_cpu_decode_never_takes_the_triton_kernel():
    from engine.model import attention

    q = torch.randn(2, 4, 16)
    kc = torch.randn(8, 4, 2, 16)
    assert attention._triton_kernel(q, kc) is None
    assert not attention._triton.tried  # nothing imported for a CPU step


def test_supports_takes_the_engine_dtypes_and_refuses_what_it_cannot_tile():
    from engine.model.triton_attention import supports

    q, kc = torch.empty(2, 4, 64), torch.empty(8, 16, 2, 64)
    assert supports(q, kc) and supports(q.bfloat16(), kc.bfloat16())
    assert not supports(q.double(), kc.double())           # not a cache dtype
    assert not supports(q, kc.bfloat16())                  # the cache's dtype differs
    assert not supports(torch.empty(2, 4, 512), torch.empty(8, 16, 2, 512))  # head dim > 256
    assert not supports(torch.empty(2, 3, 64), kc)         # heads not a multiple of KV heads


def test_splits_fill_the_multiprocessors_only_where_pairs_are_few(monkeypatch):
    from engine.model import triton_attention as ta

    assert ta.choose_splits(3, 32, torch.device("cpu")) == 1
    monkeypatch.setattr(ta, "_SM_COUNT", {0: 132})
    cuda = torch.device("cuda", 0)
    assert ta.choose_splits(3, 32, cuda) == 16       # batch 1 of SmolLM2, 2,048 tokens: 32 tiles
    assert ta.choose_splits(3, 200, cuda) == 16      # at most 16
    assert ta.choose_splits(3, 8, cuda) == 4         # each range at least 2 tiles
    assert ta.choose_splits(3, 3, cuda) == 1         # a short context stays whole
    assert ta.choose_splits(384, 32, cuda) == 1      # batch 128: the pairs fill two waves
    assert ta.choose_splits(96, 32, cuda) == 4       # batch 32: until two waves
