"""EngineConfig: the engine's scheduling and cache knobs, validated once, defaults in one place.

The model side (dtype, device) is passed through to the ModelRunner when the engine builds one
from a checkpoint directory; when a runner is given, its own ``num_blocks`` and ``block_size``
are the truth and must agree with this config.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EngineConfig"]


@dataclass(frozen=True)
class EngineConfig:
    """Scheduling and KV-cache configuration of one engine.

    - ``num_blocks`` / ``block_size``: the paged KV cache (``block_size`` tokens per block; it is
      also the kvstore block size, so it is part of the namespace id).
    - ``max_num_seqs``: most requests running at once.
    - ``max_num_batched_tokens``: the per-step token budget (decodes + prefill chunks).
    - ``enable_chunked_prefill``: False is the "colocated without chunked prefill" baseline: a
      prompt is prefilled whole in one step, so it must fit the budget on its own.
    - ``enable_prefix_caching``: reuse device blocks under their kvstore keys.
    - ``max_model_len``: context window; None means the model's ``max_position_embeddings``.
    - ``kv_load_timeout_s``: a store load not done by then is abandoned and its request
      computes instead (``engine.core.scheduler``).
    """

    num_blocks: int = 512
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    dtype: str | None = None
    device: str | None = None
    kv_load_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"EngineConfig.{name} must be a positive integer, got {value!r}")
        if isinstance(self.kv_load_timeout_s, bool) or not (
                isinstance(self.kv_load_timeout_s, (int, float)) and self.kv_load_timeout_s > 0):
            raise ValueError(f"EngineConfig.kv_load_timeout_s must be a positive number of seconds, "
                             f"got {self.kv_load_timeout_s!r}")
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len <= 0
        ):
            raise ValueError(
                f"EngineConfig.max_model_len must be a positive integer or None, "
                f"got {self.max_model_len!r}"
            )
