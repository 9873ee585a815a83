"""Load a Hugging Face safetensors checkpoint into :class:`engine.model.llama.CausalLM`.

A checkpoint directory holds ``config.json`` and either ``model.safetensors`` or shards listed
by ``model.safetensors.index.json``. Problems raise :class:`CheckpointError` naming the file.

dtype and device: float32 on CPU by default; on CUDA bfloat16 where supported, else float16.

The weights digest (for the KV namespace id) is a *full* xxh3_128 over every safetensors file
in name order (header and data: any changed weight changes the namespace). xxh3 runs at memory
speed, so this costs a fraction of the load; it is memoized per process by (path, size, mtime).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from engine.model.config import ModelConfig
from engine.model.kv_cache import KV_LAYOUT
from engine.model.llama import CausalLM, WeightError
from kvstore.weights import files_digest

__all__ = [
    "CheckpointError",
    "resolve_device",
    "resolve_dtype",
    "checkpoint_files",
    "load_model",
    "weights_digest",
    "model_facts",
]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint's weight files are missing, malformed or do not match its config."""


def resolve_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} requested but CUDA is not available")
    return device


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """float32 on CPU; bf16 (or fp16 where bf16 is unsupported) on CUDA; or as given."""
    if dtype is None:
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if isinstance(dtype, str):
        names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                 "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
        if dtype not in names:
            raise ValueError(f"dtype {dtype!r} unsupported; use one of {sorted(names)}")
        return names[dtype]
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype {dtype} unsupported; use float32, bfloat16 or float16")
    return dtype


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint, in name order; CheckpointError if absent."""
    model_dir = Path(model_dir)
    index = model_dir / _INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index}: malformed shard index ({exc})") from exc
        files = [model_dir / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{model_dir}: shards listed in {_INDEX} are missing: {missing}")
        return files
    single = model_dir / _SINGLE
    if single.is_file():
        return [single]
    raise CheckpointError(
        f"{model_dir}: no {_SINGLE} or {_INDEX}; only safetensors checkpoints are supported"
    )


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except SafetensorError as exc:
            raise CheckpointError(f"{path}: not a valid safetensors file ({exc})") from exc


def load_model(
    model_dir: str | Path,
    config: ModelConfig | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
) -> CausalLM:
    """Build the model from ``config.json`` and fill it from the checkpoint's safetensors."""
    config = config or ModelConfig.from_dir(model_dir)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    files = checkpoint_files(model_dir)
    with torch.device(dev):
        model = CausalLM(config)
    for param in model.parameters():  # still uninitialized: retype without copying
        param.data = torch.empty_like(param, dtype=dt)
    try:
        model.load_weights(_iter_tensors(files))
    except WeightError as exc:
        raise CheckpointError(f"{model_dir}: {exc}") from exc
    return model.eval()


def weights_digest(model_dir: str | Path) -> str:
    """Hex XXH3-128 over every safetensors file (``kvstore.weights.files_digest``)."""
    return files_digest(checkpoint_files(model_dir))


def model_facts(
    model_dir: str | Path,
    config: ModelConfig,
    *,
    dtype: torch.dtype,
    block_size: int,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> dict[str, Any]:
    """Everything that changes the KV bytes, for ``kvstore.keys.namespace_id``."""
    return {
        "config": config.to_facts(),
        "weights": weights_digest(model_dir),
        "dtype": str(dtype).removeprefix("torch."),
        "block_size": block_size,
        "kv_layout": KV_LAYOUT,
        "tp_rank": tp_rank,
        "tp_size": tp_size,
    }
