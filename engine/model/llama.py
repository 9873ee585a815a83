"""Llama / Qwen2 / Qwen3 decoder over the paged KV cache.

``CausalLM.forward`` takes a step's flattened new tokens (see ``engine.model.attention``), writes
each token's K/V into the cache at its slot, and returns float32 logits of the requested
token rows only (each sequence's last token), so the vocabulary projection costs one row
per sequence rather than one per token.

Weights use Hugging Face names; q/k/v and gate/up projections are fused into one matmul each,
and :meth:`CausalLM.load_weights` splices HF tensors into the fused parameters.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.model.attention import AttentionMetadata, paged_attention
from engine.model.config import ModelConfig
from engine.model.kv_cache import write_kv
from engine.model.layers import Linear, RMSNorm, RotaryEmbedding, SwiGLU, linear

__all__ = ["CausalLM", "WeightError"]


class WeightError(ValueError):
    """A checkpoint's tensors do not fit the model: missing, unexpected or misshapen."""


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size, self.kv_size = c.q_size, c.kv_size
        self.scale = c.head_dim**-0.5
        self.qkv_proj = Linear(c.hidden_size, c.q_size + 2 * c.kv_size, c.qkv_bias)
        self.o_proj = Linear(c.q_size, c.hidden_size, c.o_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.rope = rope

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(positions, q), self.rope(positions, k)
        k_cache, v_cache = kv_layer[0], kv_layer[1]
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj(o)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, rope)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), kv_layer, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    """The decoder stack plus the LM head (tied to the embedding when the config says so)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        rope = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=torch.empty(
            config.vocab_size, config.hidden_size))
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(config, rope) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Float32 logits ``[len(logits_indices), vocab]`` of the chosen token rows."""
        x = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(positions, x, kv_cache[i], meta)
        x = self.norm(x.index_select(0, logits_indices))
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return linear(x, w).float()

    # -- weights ----------------------------------------------------------------------------

    _FUSED = {  # HF name fragment -> (our fragment, shard index)
        ".q_proj.": (".qkv_proj.", 0),
        ".k_proj.": (".qkv_proj.", 1),
        ".v_proj.": (".qkv_proj.", 2),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }

    def _shard(self, fused: str, index: int) -> tuple[int, int]:
        c = self.config
        if ".qkv_proj." in fused:
            sizes = (c.q_size, c.kv_size, c.kv_size)
        else:
            sizes = (c.intermediate_size, c.intermediate_size)
        return sum(sizes[:index]), sizes[index]

    @torch.no_grad()
    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the parameters; every parameter must be covered once.

        Raises :class:`WeightError` listing missing/misshapen tensors. Unknown tensors that
        the model does not use (``rotary_emb.inv_freq``, a tied ``lm_head``) are ignored;
        other unknown names are an error.
        """
        params = dict(self.named_parameters())
        filled: dict[str, int] = {}  # param name -> rows filled
        for hf_name, tensor in tensors:
            name = hf_name.removeprefix("model.")
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            target, rows = name, None
            for frag, (fused, idx) in self._FUSED.items():
                if frag in name:
                    target = name.replace(frag, fused)
                    rows = self._shard(fused, idx)
                    break
            param = params.get(target)
            if param is None:
                raise WeightError(f"checkpoint tensor {hf_name!r} has no place in the model")
            dest = param if rows is None else param.narrow(0, rows[0], rows[1])
            if tuple(dest.shape) != tuple(tensor.shape):
                raise WeightError(
                    f"{hf_name}: shape {tuple(tensor.shape)} but the config implies {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            filled[target] = filled.get(target, 0) + dest.shape[0]
        missing = [n for n, p in params.items() if filled.get(n, 0) != p.shape[0]]
        if missing:
            shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
            raise WeightError(f"checkpoint lacks tensors for: {shown}")
