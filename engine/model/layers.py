"""Building blocks of a Llama-family decoder: linear, RMSNorm, rotary embedding, SwiGLU MLP.

Parameters are allocated with ``torch.empty`` (no random init: the loader fills them), and the
arithmetic follows Hugging Face transformers' order of operations (RMSNorm in float32, RoPE
frequencies in float32) so that greedy output matches it on the same checkpoint and dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.config import RopeScaling

__all__ = ["Linear", "RMSNorm", "RotaryEmbedding", "SwiGLU", "linear", "rope_inv_freq"]

# Up to this many rows (a decode step's batch), a float32 CPU product
# ``x W^T`` is computed as ``(W x^T)^T``. MKL's GEMM for the first form with a few rows is slow
# and erratic on this project's CPUs: one row (a GEMV) reads SmolLM2's 113 MB vocabulary
# projection at ~11 GB/s where the second form reads it at ~40 GB/s, and 2, 3, 6 or 7 rows take
# 1.3-2x as long as 4 or 8. Measured on the whole model: decode steps of 1-8 sequences 1.2-2.6x
# faster, and step time grows with the batch again (docs/engine.md, "Small-batch matmuls").
# From 24 rows on the two forms were level or the first faster, so larger products keep it.
SMALL_ROWS = 16


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T (+ b)`` for ``x`` ``[rows, in]``, ``W`` ``[out, in]``: ``F.linear``'s result."""
    rows = x.shape[0]
    if (x.dim() != 2 or rows > SMALL_ROWS or rows == 0 or x.device.type != "cpu"
            or x.dtype != torch.float32):
        return F.linear(x, weight, bias)
    xt = (x.repeat(2, 1) if rows == 1 else x).t()  # one row: GEMM of two, not MKL's GEMV
    y = torch.mm(weight, xt) if bias is None else torch.addmm(bias.unsqueeze(1), weight, xt)
    return y.t()[:rows].contiguous()


class Linear(nn.Module):
    """``y = x W^T (+ b)``; ``W`` is ``[out_features, in_features]`` as in HF checkpoints."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """RMSNorm over the last axis, computed in float32 as transformers does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """RoPE inverse frequencies ``[head_dim / 2]`` (float32), with llama3/linear scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # "llama3": keep high frequencies, divide low ones by factor, interpolate in between.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a precomputed cos/sin table over every position."""

    cos: torch.Tensor  # buffers (nn.Module types registered ones as Tensor | Module)
    sin: torch.Tensor

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None
    ) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)  # [max_pos, hd/2]
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, heads, hd]`` rotated by ``positions`` ``[T]``."""
        cos = self.cos.index_select(0, positions).to(x.dtype).unsqueeze(1)
        sin = self.sin.index_select(0, positions).to(x.dtype).unsqueeze(1)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias)
        self.down_proj = Linear(intermediate, hidden, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)
