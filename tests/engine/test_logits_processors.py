"""Penalties, logit_bias, min_tokens and min_p against transformers' own processors (and vLLM's
frequency/presence definition), batched with mixed settings per row; then through the engine:
greedy with penalties against a transformers loop, and a run split into prefill + decode on
two engines, or resumed after k tokens, equal to the uninterrupted run."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TopPLogitsWarper,
)

from engine.core import logits_processors
from engine.core.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.sampling import History, SamplingParams, _filter, sample
from tests.engine.hf_oracle import NEAR_TIE, _hf_model

VOCAB = 512
EOS = (2, 0)


def _vllm_freq_presence(x: torch.Tensor, output: list[int], freq: float, pres: float) -> torch.Tensor:
    """vLLM's (and OpenAI's) definition, over output tokens only."""
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=x.shape[-1]).to(x.dtype)
    x = x - freq * counts
    return x - pres * (counts > 0).to(x.dtype)


def _reference(x: torch.Tensor, p: SamplingParams, h: History,
               eos: tuple[int, ...] = EOS) -> torch.Tensor:
    """One row ``[1, vocab]`` through transformers' processors in vLLM's order."""
    ids = torch.tensor([list(h.token_ids)])
    n_out = len(h.token_ids) - h.num_prompt_tokens
    if p.min_tokens:
        stops = [*(() if p.ignore_eos else eos), *p.stop_token_ids]
        x = MinNewTokensLengthLogitsProcessor(h.num_prompt_tokens, p.min_tokens, stops)(ids, x)
    if p.logit_bias:
        x = SequenceBiasLogitsProcessor({(t,): b for t, b in p.logit_bias.items()})(ids, x)
    if p.repetition_penalty != 1.0:
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, x)
    if p.frequency_penalty or p.presence_penalty:
        x = _vllm_freq_presence(x, list(h.token_ids[h.num_prompt_tokens:]), p.frequency_penalty,
                                p.presence_penalty)
    assert n_out >= 0
    return x


def _history(rng: random.Random, prompt: int, out: int) -> History:
    # Few distinct ids, so tokens repeat (counts > 1) and prompt and output overlap.
    return History([rng.randrange(40) for _ in range(prompt + out)], prompt)


MIXED = [
    SamplingParams(temperature=0.0),                                          # default: untouched
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.7, temperature=0.0),
    SamplingParams(frequency_penalty=0.8, presence_penalty=-0.4),
    SamplingParams(presence_penalty=2.0, repetition_penalty=2.0),
    SamplingParams(logit_bias={5: 7.5, 30: -100.0, 511: 0.25}),
    SamplingParams(min_tokens=8, stop_token_ids=(9,)),                        # not reached: masked
    SamplingParams(min_tokens=3, stop_token_ids=(9,)),                        # reached: untouched
    SamplingParams(min_tokens=9, ignore_eos=True, stop_token_ids=(4,), frequency_penalty=-1.5,
                   logit_bias={2: 3.0}),
    SamplingParams(),                                                         # default: untouched
]


def test_batched_mixed_rows_equal_transformers_processors_bit_for_bit() -> None:
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(MIXED), VOCAB, generator=gen) * 4
    logits[:, :40] += torch.randn(len(MIXED), 40, generator=gen).abs() * 3  # seen ids often > 0
    before = logits.clone()
    hs = [_history(rng, rng.randrange(1, 30), rng.randrange(0, 7)) for _ in MIXED]
    got = logits_processors.apply(logits, MIXED, hs, EOS)
    assert torch.equal(logits, before), "the input was written"
    for i, (p, h) in enumerate(zip(MIXED, hs)):
        want = _reference(logits[i : i + 1].clone(), p, h)[0]
        assert torch.equal(got[i], want), f"row {i} ({p})"
    for i in (0, 7, 9):
        assert torch.equal(got[i], logits[i])
    # Each row alone is processed as in the batch.
    for i in range(len(MIXED)):
        alone = logits_processors.apply(logits[i : i + 1], MIXED[i : i + 1], hs[i : i + 1], EOS)
        assert torch.equal(alone[0], got[i])


def test_rows_without_processors_cost_nothing() -> None:
    logits = torch.randn(4, VOCAB)
    plain = [SamplingParams(), SamplingParams(temperature=0.0, min_p=0.2), SamplingParams(top_k=3),
             SamplingParams(top_p=0.5)]
    assert logits_processors.apply(logits, plain, None, EOS) is logits  # not even a copy
    # min_tokens already reached: nothing to do either.
    row = logits[:1]
    assert logits_processors.apply(row, [SamplingParams(min_tokens=2)], [History([1, 2, 3], 1)], EOS) is row
    with pytest.raises(ValueError, match="histories"):
        logits_processors.apply(logits[:1], [SamplingParams(repetition_penalty=1.2)], None, EOS)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_min_p_keeps_exactly_transformers_set_after_temperature(temperature: float) -> None:
    gen = torch.Generator().manual_seed(3)
    rows = 6
    x = torch.randn(rows, VOCAB, generator=gen) * 3
    min_p = [0.0, 0.05, 0.2, 0.5, 0.9, 1.0]
    inv_t = torch.full((rows, 1), 1.0 / temperature)
    weights = (x - x.amax(-1, keepdim=True)).mul_(inv_t).exp_()
    out = _filter(x, weights, inv_t, [0] * rows, [1.0] * rows, min_p)
    assert out is not None
    for i, m in enumerate(min_p):
        scaled = x[i : i + 1] / temperature
        want = MinPLogitsWarper(m)(None, scaled).isinf()[0] if m > 0 else torch.zeros(VOCAB, dtype=torch.bool)
        assert torch.equal(out[i], want), f"min_p={m}: {int((out[i] != want).sum())} tokens differ"
        assert torch.equal(weights[i] == 0, want)
    # min_p, then top-p over what min_p left (vLLM's order): transformers' chain in that order.
    weights = (x - x.amax(-1, keepdim=True)).mul_(inv_t).exp_()
    out = _filter(x, weights, inv_t, [0] * rows, [0.7] * rows, [0.02] * rows)
    assert out is not None
    want = TopPLogitsWarper(0.7)(None, MinPLogitsWarper(0.02)(None, x / temperature)).isinf()
    assert torch.equal(out, want)


def test_sampled_tokens_respect_min_p_and_greedy_sees_the_penalties() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(64, VOCAB, generator=gen) * 3
    params = [SamplingParams(seed=s, min_p=0.3) for s in range(64)]
    tokens = sample(x, params, [7] * 64).token_ids
    probs = torch.softmax(x, -1)
    for i, t in enumerate(tokens):
        assert probs[i, t] >= 0.3 * probs[i].max()
    # Greedy: the argmax of the penalized logits; its logprobs are of them too.
    h = History([int(x[0].argmax())] * 3, 1)
    p = SamplingParams(temperature=0.0, presence_penalty=2.0, logprobs=0,
                       logit_bias={int(x[0].argmax()): -100.0})
    out = sample(x[:1], [p], [3], [h], EOS)
    processed = logits_processors.apply(x[:1], [p], [h], EOS)
    assert out.token_ids == [int(processed[0].argmax())] != [int(x[0].argmax())]
    lp = out.logprobs[0]
    assert lp is not None
    assert lp.logprob == pytest.approx(float(torch.log_softmax(processed[0], -1)[out.token_ids[0]]))


# --- through the engine ------------------------------------------------------------------------


def _hf_processed_greedy(model_dir, prompt: list[int], n: int, p: SamplingParams,
                         eos: tuple[int, ...]) -> tuple[list[int], list[float]]:
    """transformers' model, greedy over its processors (vLLM's order), full forward each step."""
    model = _hf_model(str(model_dir))
    seq = list(prompt)
    margins = []
    with torch.inference_mode():
        for _ in range(n):
            x = model(torch.tensor([seq])).logits[:, -1].float()
            x = _reference(x, p, History(seq, len(prompt)), eos)
            top2 = x[0].topk(2).values
            margins.append(float(top2[0] - top2[1]))
            seq.append(int(x[0].argmax()))
    return seq[len(prompt):], margins


PENALIZED = [
    SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=1.5, ignore_eos=True),
    SamplingParams(max_tokens=20, temperature=0.0, frequency_penalty=1.0, presence_penalty=0.5,
                   ignore_eos=True),
    SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=0.8, presence_penalty=1.0,
                   logit_bias={7: 5.0, 100: 8.0}, ignore_eos=True),
]


def test_greedy_with_penalties_equals_transformers(tiny_llama_dir) -> None:
    engine = LLMEngine(tiny_llama_dir, EngineConfig(num_blocks=64, block_size=16))
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (9, 23, 17)]
    done = engine.generate(prompts, PENALIZED)
    eos = engine.model_config.eos_token_ids
    for prompt, p, c in zip(prompts, PENALIZED, done, strict=True):
        theirs, margins = _hf_processed_greedy(tiny_llama_dir, prompt, p.max_tokens, p, eos)
        for step, (a, b) in enumerate(zip(c.token_ids, theirs, strict=True)):
            if a != b:
                assert margins[step] < NEAR_TIE, f"{p}: diverged at step {step}"
                break
    # The penalties change the output (the test is not vacuous).
    plain = engine.generate(prompts, [dataclasses.replace(p, repetition_penalty=1.0,
                                                          frequency_penalty=0.0, presence_penalty=0.0,
                                                          logit_bias=None) for p in PENALIZED])
    assert all(a.token_ids != b.token_ids for a, b in zip(done, plain))


def test_min_tokens_holds_eos_back_through_the_engine(tiny_llama_dir) -> None:
    engine = LLMEngine(tiny_llama_dir, EngineConfig(num_blocks=64, block_size=16))
    eos = engine.model_config.eos_token_ids[0]
    prompt = [5, 17, 33]
    # A huge EOS bias makes EOS the argmax at every step; min_tokens holds it back until then.
    bias = {eos: 100.0}
    c = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, min_tokens=6,
                                                  logit_bias=bias))[0]
    assert c.finish_reason == "stop" and len(c.token_ids) == 7 and c.token_ids[-1] == eos
    assert eos not in c.token_ids[:6]
    # Resumed after 4 tokens on another engine: the given tokens count as produced.
    other = LLMEngine(tiny_llama_dir, EngineConfig(num_blocks=64, block_size=16))
    other.add_request("r", prompt, SamplingParams(max_tokens=12, temperature=0.0, min_tokens=6,
                                                  logit_bias=bias), output_token_ids=c.token_ids[:4])
    rest = []
    while other.has_unfinished():
        for out in other.step():
            rest += out.new_token_ids
    assert c.token_ids[:4] + rest == c.token_ids


def _run(engine: LLMEngine, rid: str, prompt: list[int], p: SamplingParams,
         given: list[int] = ()) -> list[int]:
    engine.add_request(rid, prompt, p, output_token_ids=list(given))
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


@pytest.mark.parametrize("p", [
    SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.4, frequency_penalty=0.7,
                   presence_penalty=0.6, min_tokens=10, ignore_eos=False),
    SamplingParams(max_tokens=24, temperature=0.9, seed=11, min_p=0.05, repetition_penalty=1.2,
                   frequency_penalty=0.5, top_k=40, top_p=0.95, min_tokens=5),
], ids=["greedy", "sampled"])
def test_handoff_and_resume_equal_the_uninterrupted_run(tiny_llama_dir, p) -> None:
    cfg = EngineConfig(num_blocks=64, block_size=16)
    a, b = LLMEngine(tiny_llama_dir, cfg), LLMEngine(tiny_llama_dir, cfg)
    prompt = [random.Random(2).randrange(3, 512) for _ in range(21)]
    whole = _run(a, "whole", prompt, p)
    assert len(whole) >= 11
    # Prefill (one token, as a prefill worker runs it) on a, decode on b.
    first = _run(a, "pre", prompt, dataclasses.replace(p, max_tokens=1, min_tokens=min(p.min_tokens, 1)))
    assert first == whole[:1]
    assert first + _run(b, "dec", prompt, p, first) == whole
    for k in (3, 10):  # a resume after k tokens (before and after min_tokens)
        assert whole[:k] + _run(b, f"resume-{k}", prompt, p, whole[:k]) == whole


def test_logit_bias_ids_are_checked_against_the_vocabulary(tiny_llama_dir) -> None:
    engine = LLMEngine(tiny_llama_dir, EngineConfig(num_blocks=16, block_size=16))
    vocab = engine.model_config.vocab_size
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request("r", [1, 2], SamplingParams(logit_bias={vocab: 1.0}))
    assert not engine.has_unfinished()
    engine.add_request("ok", [1, 2], SamplingParams(logit_bias={vocab - 1: 1.0}))
