"""ModelConfig: the typed, validated view of a Hugging Face ``config.json`` that the engine runs.

Supported architectures (``config.json`` ``architectures[0]``):

- ``LlamaForCausalLM``: Llama 2/3.x (RoPE scaling ``"llama3"`` or ``"linear"``), TinyLlama,
  SmolLM2. Optional ``attention_bias`` (q/k/v/o) and ``mlp_bias``.
- ``Qwen2ForCausalLM``: bias on q/k/v (not o).
- ``Qwen3ForCausalLM``: RMSNorm on each head of q and k before RoPE; ``head_dim`` may differ
  from ``hidden_size / num_attention_heads``.

All of them: grouped-query attention, SwiGLU MLP, RMSNorm, optional tied embeddings. Both
config spellings of RoPE are read: transformers 4.x (``rope_theta`` + ``rope_scaling``) and
5.x (``rope_parameters``). EOS ids are the union of ``config.json`` and
``generation_config.json``. Anything else raises :class:`ConfigError` naming the problem.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ConfigError", "RopeScaling", "ModelConfig", "SUPPORTED_ARCHITECTURES"]

# HF architecture name -> our family name.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_ROPE_TYPES = ("default", "llama3", "linear")


class ConfigError(ValueError):
    """A checkpoint's config.json is missing, malformed or describes an unsupported model."""


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``rope_type`` is ``"llama3"`` or ``"linear"``."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model code needs, validated once. Build with :meth:`from_dir`."""

    architecture: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str = "float32"  # the dtype the checkpoint was saved in
    hf_architecture: str = field(default="", compare=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        """Read ``config.json`` (and ``generation_config.json`` if present) from a checkpoint."""
        model_dir = Path(model_dir)
        path = model_dir / "config.json"
        if not path.is_file():
            raise ConfigError(f"{model_dir}: no config.json; is this a Hugging Face checkpoint?")
        raw = _read_json(path)
        gen_path = model_dir / "generation_config.json"
        gen = _read_json(gen_path) if gen_path.is_file() else None
        return cls.from_dict(raw, generation_config=gen, source=str(path))

    @classmethod
    def from_dict(
        cls,
        raw: dict[str, Any],
        *,
        generation_config: dict[str, Any] | None = None,
        source: str = "config",
    ) -> "ModelConfig":
        """Validate a parsed config.json. Raises :class:`ConfigError` naming the problem."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        archs = raw.get("architectures")
        if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
            raise ConfigError(
                f"{source}: 'architectures' must name one of {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        hf_arch = archs[0]
        family = SUPPORTED_ARCHITECTURES.get(hf_arch)
        if family is None:
            raise ConfigError(
                f"{source}: unsupported architecture {hf_arch!r}; "
                f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )

        def need_int(key: str) -> int:
            value = raw.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{source}: {key!r} must be a positive integer, got {value!r}")
            return value

        hidden = need_int("hidden_size")
        heads = need_int("num_attention_heads")
        kv_heads = raw.get("num_key_value_heads") or heads
        if not isinstance(kv_heads, int) or kv_heads <= 0 or heads % kv_heads:
            raise ConfigError(
                f"{source}: num_key_value_heads={kv_heads!r} must divide num_attention_heads={heads}"
            )
        head_dim = raw.get("head_dim") or hidden // heads
        if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            raise ConfigError(f"{source}: head_dim must be a positive even integer, got {head_dim!r}")
        if family != "qwen3" and raw.get("head_dim") is None and hidden % heads:
            raise ConfigError(f"{source}: hidden_size {hidden} not divisible by {heads} heads")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act {act!r} unsupported (only 'silu')")
        if raw.get("use_sliding_window"):
            raise ConfigError(f"{source}: sliding-window attention is not supported")

        theta, scaling = _parse_rope(raw, source)
        attention_bias = bool(raw.get("attention_bias", False))
        eos = _eos_ids(raw.get("eos_token_id"), source)
        if generation_config:
            eos = eos + tuple(
                e for e in _eos_ids(generation_config.get("eos_token_id"), source) if e not in eos
            )
        bos = raw.get("bos_token_id")
        return cls(
            architecture=family,
            vocab_size=need_int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need_int("intermediate_size"),
            num_layers=need_int("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=need_int("max_position_embeddings"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=True if family == "qwen2" else attention_bias,
            o_bias=False if family == "qwen2" else attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            eos_token_ids=eos,
            bos_token_id=bos if isinstance(bos, int) else None,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            hf_architecture=hf_arch,
        )

    def to_facts(self) -> dict[str, Any]:
        """The fields that change the KV bytes, as plain JSON (for the namespace id)."""
        facts = asdict(self)
        facts.pop("hf_architecture")
        facts["eos_token_ids"] = list(self.eos_token_ids)
        return facts


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from exc


def _eos_ids(value: Any, source: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return tuple(dict.fromkeys(value))
    raise ConfigError(f"{source}: eos_token_id must be an int or a list of ints, got {value!r}")


def _parse_rope(raw: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:  # transformers 5.x
        theta = params.get("rope_theta")
        scaling = params
    else:
        theta = raw.get("rope_theta", 10000.0)
        scaling = raw.get("rope_scaling")
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ConfigError(f"{source}: rope_theta must be a positive number, got {theta!r}")
    if not scaling:
        return float(theta), None
    if not isinstance(scaling, dict):
        raise ConfigError(f"{source}: rope_scaling must be an object, got {scaling!r}")
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in _ROPE_TYPES:
        raise ConfigError(
            f"{source}: RoPE scaling type {rope_type!r} unsupported; supported: {_ROPE_TYPES}"
        )
    if rope_type == "default":
        return float(theta), None
    try:
        rs = RopeScaling(
            rope_type=rope_type,
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                scaling.get("original_max_position_embeddings", 8192)
            ),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: malformed rope scaling {scaling!r} ({exc})") from exc
    return float(theta), rs
