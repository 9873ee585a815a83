"""Random checkpoints generated where the check runs: no model file travels.

``tiny(ctx, arch)`` is ``engine.model.tiny``'s checkpoint (llama, qwen2, qwen3). ``shaped(ctx,
name, dtype)`` writes a Llama checkpoint of a real model's shape (:data:`SHAPES`: SmolLM2-135M,
Llama-3-8B) with random weights drawn on the check's device (seconds, for 8B too) by tiny's
recipe: weights ~ N(0, 1/fan_in), norms near 1, a tied head's layers scaled up so greedy
decoding meets clear winners rather than near-ties. The tokenizer is tiny's (the shaped models
are driven by token ids; their vocabulary is larger than the tokenizer's). Under
``--cpu-selftest`` a shape keeps its heads, head dim and tying but has 2 layers, a 512-token
vocabulary and a narrow MLP, so the same code runs in seconds.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from engine.model.tiny import _weights
from gpucheck.runner import Ctx

__all__ = ["SHAPES", "tiny", "shaped"]

SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "vocab_size": 49152, "max_position_embeddings": 8192, "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    },
    "llama3-8b": {
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    },
}
SELFTEST = {"num_hidden_layers": 2, "vocab_size": 512, "intermediate_size": 256,
            "max_position_embeddings": 2048}


def tiny(ctx: Ctx, arch: str = "llama") -> Path:
    """tiny's ``arch`` checkpoint, made once per run."""
    from engine.model.tiny import make_tiny_checkpoint

    key = f"tiny-{arch}"
    if key not in ctx.shared:
        ctx.shared[key] = make_tiny_checkpoint(ctx.work / key, arch)
    return ctx.shared[key]


def shaped(ctx: Ctx, name: str, dtype: str = "bfloat16", seed: int = 0) -> Path:
    """A random checkpoint of :data:`SHAPES` ``name``'s shape stored in ``dtype``, made once per
    run (module docstring)."""
    from safetensors.torch import save_file

    key = f"{name}-{dtype}"
    if key in ctx.shared:
        return ctx.shared[key]
    shape = {**SHAPES[name], **(SELFTEST if ctx.selftest else {})}
    path = ctx.work / key
    path.mkdir(parents=True, exist_ok=True)
    tok_dir = tiny(ctx, "llama")
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tok_dir / f, path / f)
    tiny_cfg = json.loads((tok_dir / "config.json").read_text())
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "torch_dtype": dtype,
        "bos_token_id": tiny_cfg["bos_token_id"], "eos_token_id": tiny_cfg["eos_token_id"],
        **shape,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    weights = _weights(config, seed, device=ctx.device, dtype=getattr(torch, dtype))
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    ctx.shared[key] = path
    return path
