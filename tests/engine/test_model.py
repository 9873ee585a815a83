"""ModelRunner greedy output against HF transformers (the oracle), chunked prefill, batching."""

from __future__ import annotations

import random

import pytest
import torch

from engine.model.runner import ModelRunner, StepError, StepItem
from tests.engine.hf_oracle import assert_same_greedy, hf_greedy, runner_greedy

MAX_NEW = 40


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 7, 16, 33, 70]  # single token, partial block, exact block, multi-block
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.fixture(params=["llama", "qwen2", "qwen3"])
def tiny_dir(request: pytest.FixtureRequest):
    return request.getfixturevalue(f"tiny_{request.param}_dir")


def test_greedy_equals_transformers(tiny_dir) -> None:
    runner = ModelRunner(tiny_dir, num_blocks=64, block_size=16, device="cpu")
    prompts = _prompts(runner.config.vocab_size)
    ours = runner_greedy(runner, prompts, MAX_NEW)
    near_ties = 0
    for prompt, tokens in zip(prompts, ours):
        theirs, margins = hf_greedy(tiny_dir, prompt, MAX_NEW)
        near_ties += assert_same_greedy(tokens, theirs, margins)
    print(f"{tiny_dir.name}: {len(prompts)} prompts x {MAX_NEW} tokens, near-tie divergences: {near_ties}")
    assert near_ties <= 1


@pytest.mark.parametrize("chunk", [1, 5, 16, 24])
def test_chunked_prefill_equals_unchunked(tiny_llama_dir, chunk: int) -> None:
    runner = ModelRunner(tiny_llama_dir, num_blocks=64, block_size=16, device="cpu")
    prompt = _prompts(runner.config.vocab_size, seed=1)[-1]
    whole = runner.execute([StepItem(prompt, 0, list(range(5)))])
    for s in range(0, len(prompt), chunk):  # into other blocks: nothing leaks from the first run
        chunked = runner.execute([StepItem(prompt[s : s + chunk], s, list(range(10, 15)))])
    torch.testing.assert_close(chunked, whole, atol=1e-4, rtol=1e-4)
    assert runner_greedy(runner, [prompt], 16, chunk_size=chunk) == runner_greedy(runner, [prompt], 16)


def test_mixed_batch_equals_each_alone(tiny_qwen3_dir) -> None:
    runner = ModelRunner(tiny_qwen3_dir, num_blocks=128, block_size=16, device="cpu")
    prompts = _prompts(runner.config.vocab_size, seed=2)
    alone = [runner_greedy(runner, [p], 12)[0] for p in prompts]
    assert runner_greedy(runner, prompts, 12) == alone
    # One step mixing decodes, a fresh prefill and a continuing chunk, in scrambled order.
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(prompts))]
    for i, p in enumerate(prompts[:3]):
        runner.execute([StepItem(p, 0, tables[i])])
    long = prompts[4]
    runner.execute([StepItem(long[:20], 0, tables[4])])
    items = [
        StepItem(long[20:], 20, tables[4]),  # continuing chunk, starts mid-block
        StepItem([alone[0][0]], len(prompts[0]), tables[0]),  # decode
        StepItem(prompts[3], 0, tables[3]),  # fresh prefill
        StepItem([alone[2][0]], len(prompts[2]), tables[2]),  # decode
        StepItem([alone[1][0]], len(prompts[1]), tables[1]),  # decode
    ]
    got = runner.execute(items).argmax(-1).tolist()
    assert got == [alone[4][0], alone[0][1], alone[3][0], alone[2][1], alone[1][1]]


def test_bad_step_items_raise_and_touch_nothing(tiny_llama_dir) -> None:
    runner = ModelRunner(tiny_llama_dir, num_blocks=8, block_size=16, device="cpu")
    before = runner.kv_cache.clone()
    vocab, max_pos = runner.config.vocab_size, runner.config.max_position_embeddings
    bad = {
        "no token ids": StepItem([], 0, [0]),
        "outside the vocabulary": StepItem([1, vocab], 0, [0]),
        "need 2 blocks": StepItem([1] * 17, 0, [0]),
        "block id outside": StepItem([1], 0, [8]),
        "beyond the model's context": StepItem([1], max_pos, [0] * 200),
    }
    for message, item in bad.items():
        with pytest.raises(StepError, match=message):
            runner.execute([StepItem([1, 2], 0, [1]), item])
    with pytest.raises(StepError):
        runner.execute([])
    assert torch.equal(runner.kv_cache, before)


def test_kv_cache_shape_and_facts(tiny_qwen3_dir) -> None:
    runner = ModelRunner(tiny_qwen3_dir, num_blocks=8, block_size=4, device="cpu")
    c = runner.config
    assert runner.kv_cache.shape == (c.num_layers, 2, 8, 4, c.num_kv_heads, c.head_dim)
    assert runner.kv_cache.dtype == torch.float32
    runner.execute([StepItem([5, 6, 7, 8, 9], 0, [3, 6])])  # slots 12..15, 24
    written = runner.kv_cache.abs().sum(dim=(0, 1, 4, 5)) != 0  # [blocks, offsets]
    assert written.nonzero().tolist() == [[3, 0], [3, 1], [3, 2], [3, 3], [6, 0]]
    facts = runner.facts()
    assert facts["block_size"] == 4 and facts["dtype"] == "float32"
    assert facts["config"]["head_dim"] == 32 and len(facts["weights"]) == 32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_greedy_equals_transformers(tiny_llama_dir) -> None:
    runner = ModelRunner(tiny_llama_dir, num_blocks=64, block_size=16, device="cuda", dtype="float32")
    assert runner.kv_cache.is_cuda
    prompts = _prompts(runner.config.vocab_size)
    ours = runner_greedy(runner, prompts, MAX_NEW)
    near_ties = sum(
        assert_same_greedy(tokens, *hf_greedy(tiny_llama_dir, prompt, MAX_NEW))
        for prompt, tokens in zip(prompts, ours)
    )
    assert near_ties <= 1
    bf16 = ModelRunner(tiny_llama_dir, num_blocks=64, device="cuda")  # the CUDA default dtype
    assert bf16.dtype in (torch.bfloat16, torch.float16)
    assert bf16.execute([StepItem(prompts[2], 0, [0])]).dtype == torch.float32


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 7, 16, 17, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_small_row_linear_is_f_linear(rows: int, bias: bool) -> None:
    from engine.model.layers import linear

    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 48, generator=g), torch.randn(96, 48, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    ours, ref = linear(x, w, b), torch.nn.functional.linear(x, w, b)
    assert ours.shape == ref.shape == (rows, 96) and ours.is_contiguous()
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    # other dtypes go to F.linear unchanged
    assert torch.equal(linear(x.double(), w.double()), torch.nn.functional.linear(x.double(), w.double()))
