"""Deterministic tiny random checkpoints for fast tests: ``make_tiny_checkpoint(path, arch)``.

Writes a complete Hugging Face checkpoint directory (``config.json``,
``generation_config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``
with a ChatML chat template). The same ``(arch, seed)`` gives the same bytes, in well under a
second: weights come from a seeded ``torch.Generator`` on CPU, the tokenizer is a byte-level
BPE trained with the ``tokenizers`` library on a fixed built-in corpus.

Initialization keeps activations at unit scale (weights ~ N(0, 1/fan_in)) and makes the LM
head large (logit std ~ 4), so greedy decoding meets clear winners rather than near-ties.
With a tied head the layers' outputs are scaled up so they, not the input token's own
embedding, decide the next token.

CLI: ``python -m engine.model.tiny OUT_DIR [--arch llama|qwen2|qwen3] [--seed N]``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

__all__ = ["TINY_ARCHS", "make_tiny_checkpoint"]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_CORPUS = """\
The quick brown fox jumps over the lazy dog while the cache keeps every block it has seen.
A prefill worker computes the prompt once; a decode worker streams one token at a time.
Blocks of sixteen tokens are named by a chained hash of their parent and their token ids.
Memory is a hierarchy: registers, caches, device memory, host memory, and solid state disks.
def attention(query, key, value): return softmax(query @ key.T / sqrt(d)) @ value
for i in range(10): print(i, i * i, "squares and cubes", i ** 3)
Once upon a time there was a small model that learned to count: one, two, three, four, five.
Rain fell on the city; the servers hummed; the router sent each request where its prefix lived.
Hello, world! How are you today? I am fine, thank you. What would you like to talk about?
Numbers 0123456789 and symbols {}[]()<>+-*/=_.,;:!?'"#$%&@ appear in code and prose alike.
"""

TINY_ARCHS: dict[str, dict[str, Any]] = {
    "llama": {  # untied head, GQA 4:2, llama3 RoPE scaling
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False,
        "rope_theta": 10000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    },
    "qwen2": {  # q/k/v bias, tied head
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True,
        "rope_theta": 1000000.0, "use_sliding_window": False,
    },
    "qwen3": {  # q/k norms, head_dim 32 != 64 / 4, tied head
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "tie_word_embeddings": True, "rope_theta": 1000000.0, "use_sliding_window": False,
    },
}
VOCAB_SIZE = 512
MAX_POSITIONS = 2048


def _train_tokenizer(vocab_size: int):  # -> tokenizers.Tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines() * 4, trainer=trainer)
    return tok


def _weights(config: dict[str, Any], seed: int, device: str = "cpu", dtype: Any = None) -> dict[str, Any]:
    """Random weights of ``config``'s shape, drawn on ``device`` (a GPU draws an 8B model in
    seconds) and returned on the CPU in ``dtype`` (default float32)."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads, kvh = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or h // heads
    v = config["vocab_size"]

    def normal(*shape: int, std: float) -> "torch.Tensor":
        t = torch.randn(*shape, generator=g, device=device) * std
        return t if dtype is None and device == "cpu" else t.to(dtype or torch.float32).cpu()

    def norm(dim: int) -> "torch.Tensor":
        return (1.0 + torch.randn(dim, generator=g, device=device) * 0.1).to(dtype or torch.float32).cpu()

    tied = config["tie_word_embeddings"]
    kind = config.get("model_type", "llama")
    # A tied head scores a token by its embedding: keep the embedding small in the residual
    # stream (and the layers' outputs large) or the model only repeats its input token.
    out_scale = 8.0 if tied else 1.0
    out = {"model.embed_tokens.weight": normal(v, h, std=0.5 if tied else 1.0)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = norm(h)
        out[p + "post_attention_layernorm.weight"] = norm(h)
        for name, rows in (("q_proj", heads * hd), ("k_proj", kvh * hd), ("v_proj", kvh * hd)):
            out[p + f"self_attn.{name}.weight"] = normal(rows, h, std=h**-0.5)
            if kind == "qwen2":
                out[p + f"self_attn.{name}.bias"] = normal(rows, std=0.1)
        out[p + "self_attn.o_proj.weight"] = normal(h, heads * hd, std=out_scale * (heads * hd) ** -0.5)
        if kind == "qwen3":
            out[p + "self_attn.q_norm.weight"] = norm(hd)
            out[p + "self_attn.k_norm.weight"] = norm(hd)
        out[p + "mlp.gate_proj.weight"] = normal(inter, h, std=h**-0.5)
        out[p + "mlp.up_proj.weight"] = normal(inter, h, std=h**-0.5)
        out[p + "mlp.down_proj.weight"] = normal(h, inter, std=out_scale * inter**-0.5)
    out["model.norm.weight"] = norm(h)
    if not tied:
        out["lm_head.weight"] = normal(v, h, std=4.0 * h**-0.5)
    return {k: t.contiguous() for k, t in out.items()}


def make_tiny_checkpoint(path: str | Path, arch: str = "llama", seed: int = 0) -> Path:
    """Write a tiny random checkpoint of ``arch`` (one of :data:`TINY_ARCHS`) into ``path``."""
    from safetensors.torch import save_file

    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from {sorted(TINY_ARCHS)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer(VOCAB_SIZE)
    eos = tok.token_to_id("<|im_end|>")
    config = {
        **TINY_ARCHS[arch],
        "vocab_size": VOCAB_SIZE, "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "torch_dtype": "float32",
        "bos_token_id": tok.token_to_id("<|im_start|>"), "eos_token_id": eos,
    }
    save_file(_weights(config, seed), str(path / "model.safetensors"), metadata={"format": "pt"})
    _write_json(path / "config.json", config)
    _write_json(path / "generation_config.json", {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": [eos, tok.token_to_id("<|endoftext|>")],
    })
    tok.save(str(path / "tokenizer.json"))
    _write_json(path / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "unk_token": None, "add_bos_token": False, "model_max_length": MAX_POSITIONS,
        "chat_template": CHAT_TEMPLATE,
    })
    return path


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engine.model.tiny", description=(__doc__ or "").split("\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--arch", default="llama", choices=sorted(TINY_ARCHS))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(make_tiny_checkpoint(args.out_dir, args.arch, args.seed))


if __name__ == "__main__":
    main()
