"""Config parsing and checkpoint loading: every supported spelling, every bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.model.config import ConfigError, ModelConfig
from engine.model.loader import CheckpointError, load_model, resolve_dtype, weights_digest
from engine.model.runner import ModelRunner, StepItem


def _copy(src, tmp_path):
    return shutil.copytree(src, tmp_path / "ckpt")


def _edit_config(model_dir, **changes) -> None:
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


def test_tiny_configs_parse(tiny_llama_dir, tiny_qwen2_dir, tiny_qwen3_dir) -> None:
    llama = ModelConfig.from_dir(tiny_llama_dir)
    assert llama.architecture == "llama" and not llama.tie_word_embeddings
    assert llama.rope_scaling is not None and llama.rope_scaling.rope_type == "llama3"
    assert llama.eos_token_ids == (2, 0)  # config's, then generation_config's extra
    qwen2 = ModelConfig.from_dir(tiny_qwen2_dir)
    assert qwen2.qkv_bias and not qwen2.o_bias and not qwen2.qk_norm
    qwen3 = ModelConfig.from_dir(tiny_qwen3_dir)
    assert qwen3.qk_norm and qwen3.head_dim == 32 and qwen3.q_size == 128 != qwen3.hidden_size


def test_transformers5_rope_parameters_spelling(tiny_llama_dir) -> None:
    v4 = json.loads((tiny_llama_dir / "config.json").read_text())
    v5 = dict(v4)
    v5["rope_parameters"] = {"rope_theta": v5.pop("rope_theta"), **v5.pop("rope_scaling")}
    assert ModelConfig.from_dict(v5) == ModelConfig.from_dict(v4)
    assert ModelConfig.from_dict(v5).rope_scaling.original_max_position_embeddings == 256


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"),
        ({"architectures": None}, "'architectures' must name one of"),
        ({"hidden_size": "64"}, "'hidden_size' must be a positive integer"),
        ({"num_hidden_layers": None}, "'num_hidden_layers' must be a positive integer"),
        ({"num_key_value_heads": 3}, "must divide num_attention_heads"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' unsupported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "RoPE scaling type 'yarn' unsupported"),
        ({"rope_theta": -1}, "rope_theta must be a positive number"),
        ({"eos_token_id": "x"}, "eos_token_id must be an int"),
    ],
)
def test_malformed_config(tiny_llama_dir, tmp_path, changes, message) -> None:
    d = _copy(tiny_llama_dir, tmp_path)
    _edit_config(d, **changes)
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dir(d)


def test_missing_or_invalid_config_json(tmp_path) -> None:
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_dir(tmp_path)


def test_missing_and_malformed_weights(tiny_llama_dir, tmp_path) -> None:
    d = _copy(tiny_llama_dir, tmp_path)
    (d / "model.safetensors").rename(d / "elsewhere.bin")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(d)
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage}")
    with pytest.raises(CheckpointError, match="not a valid safetensors file"):
        load_model(d)


def test_missing_and_misshapen_tensors(tiny_llama_dir, tmp_path) -> None:
    d = _copy(tiny_llama_dir, tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"lacks tensors for: layers\.1\.self_attn\.qkv_proj\.weight"):
        load_model(d)
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"k_proj.weight: shape \(3, 3\)"):
        load_model(d)


def test_sharded_checkpoint_equals_single(tiny_qwen3_dir, tmp_path) -> None:
    d = _copy(tiny_qwen3_dir, tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(d / shard))
        weight_map.update({k: shard for k in keys})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    prompt = list(range(10, 40))
    item = StepItem(prompt, 0, [0, 1])
    sharded = ModelRunner(d, num_blocks=4, device="cpu").execute([item])
    single = ModelRunner(tiny_qwen3_dir, num_blocks=4, device="cpu").execute([item])
    assert torch.equal(sharded, single)

    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shards listed in .* are missing"):
        load_model(d)
    (d / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(CheckpointError, match="malformed shard index"):
        load_model(d)


def test_weights_digest_tracks_content(tiny_llama_dir, tmp_path) -> None:
    d = _copy(tiny_llama_dir, tmp_path)
    assert weights_digest(d) == weights_digest(tiny_llama_dir)
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.norm.weight"][7] += 1e-3
    save_file(tensors, str(d / "model.safetensors"))
    assert weights_digest(d) != weights_digest(tiny_llama_dir)


def test_dtype_and_device_resolution() -> None:
    assert resolve_dtype(None, torch.device("cpu")) == torch.float32
    assert resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ValueError, match="dtype 'int8' unsupported"):
        resolve_dtype("int8", torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            ModelRunner("/nonexistent", num_blocks=1, device="cuda")


def test_bfloat16_runs_close_to_float32(tiny_llama_dir) -> None:
    item = StepItem(list(range(20, 60)), 0, [0, 1, 2])
    f32 = ModelRunner(tiny_llama_dir, num_blocks=4, device="cpu").execute([item])
    bf16 = ModelRunner(tiny_llama_dir, num_blocks=4, dtype="bfloat16", device="cpu")
    assert bf16.kv_cache.dtype == torch.bfloat16
    out = bf16.execute([item])
    assert out.dtype == torch.float32 and (out - f32).abs().max() < 0.25 * f32.abs().max()
