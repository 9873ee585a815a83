"""Batched sampling: greedy, temperature, top-k, top-p; randomness a function of (seed, position).

:class:`SamplingParams` is the worker API's own validated type (``engine.api_types``, torch-free
and shared with the router), re-exported here so there is one definition of its defaults.

Determinism contract: the token sampled for a row depends only on that row's logits, its
parameters and ``(seed, position)``, where ``position`` is the index the sampled token will
take in the sequence (``len(prompt) + len(outputs so far)``). It does not depend on the batch,
the worker, the device, or how the request got there, so a request continued on another worker
at position ``p`` (given its outputs up front) samples the same token. Implementation: Gumbel-max
with noise drawn from a CPU ``torch.Generator`` seeded by ``xxh3_64(seed, position)`` per row
(CPU so CUDA and CPU workers agree; only rows with temperature > 0 pay for it).

Requests without a seed get one at admission (:func:`with_seed`), and it is reported back.

Log-probabilities are those of the distribution actually sampled from: ``log_softmax`` of the
*processed* logits (scaled by temperature, with tokens outside top-k/top-p at ``-inf``). Greedy
rows (temperature 0) report ``log_softmax`` of the raw logits.
"""

from __future__ import annotations

import dataclasses
import secrets
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xxhash

from engine.api_types import SamplingParams, TokenLogprob

__all__ = ["SamplingParams", "SamplerOutput", "sample", "with_seed", "row_generator"]

_MAX_SEED = 2**63 - 1


@dataclass
class SamplerOutput:
    """Per row: the sampled token id, and its logprob (None where the row did not ask)."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def with_seed(params: SamplingParams) -> SamplingParams:
    """``params`` with a fresh random seed if it has none (done once, at admission)."""
    if params.seed is not None:
        return params
    return dataclasses.replace(params, seed=secrets.randbelow(_MAX_SEED))


def row_generator(seed: int, position: int) -> torch.Generator:
    """The CPU generator of one (seed, position): a pure function of the two."""
    digest = xxhash.xxh3_64_intdigest(struct.pack("<qq", seed, position))
    return torch.Generator(device="cpu").manual_seed(digest)


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]
) -> SamplerOutput:
    """Sample one token per row of ``logits`` ``[rows, vocab]`` (float32)."""
    rows, vocab = logits.shape
    if len(params) != rows or len(positions) != rows:
        raise ValueError(f"{rows} logit rows but {len(params)} params and {len(positions)} positions")
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    processed = logits
    random_rows = [i for i, p in enumerate(params) if p.temperature > 0.0]
    if random_rows:
        idx = torch.tensor(random_rows, device=logits.device)
        temps = torch.tensor(
            [params[i].temperature for i in random_rows], device=logits.device, dtype=torch.float32
        )
        scaled = _top_k_top_p(
            logits.index_select(0, idx) / temps[:, None],
            [params[i].top_k for i in random_rows],
            [params[i].top_p for i in random_rows],
        )
        noise = torch.empty((len(random_rows), vocab), dtype=torch.float32)
        for j, i in enumerate(random_rows):
            seed = params[i].seed
            if seed is None:
                raise ValueError("a sampled row needs a seed; admit requests through with_seed()")
            torch.rand(vocab, generator=row_generator(seed, positions[i]), out=noise[j])
        gumbel = -torch.log(-torch.log(noise.clamp_(min=1e-20, max=1.0 - 1e-7)))
        tokens = tokens.index_copy(0, idx, (scaled + gumbel.to(logits.device)).argmax(dim=-1))
        processed = logits.index_copy(0, idx, scaled)
    token_list = tokens.tolist()
    return SamplerOutput(token_list, _logprobs(processed, token_list, params))


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Set tokens outside each row's top-k / top-p (nucleus) to -inf. ``top_k == 0``: off."""
    vocab = logits.shape[-1]
    use_k = any(0 < k < vocab for k in top_k)
    use_p = any(p < 1.0 for p in top_p)
    if not (use_k or use_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    mask = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if use_k:
        k = torch.tensor([k if k > 0 else vocab for k in top_k], device=logits.device)
        mask |= ranks >= k[:, None]
    if use_p:
        p = torch.tensor(top_p, device=logits.device, dtype=torch.float32)
        probs = sorted_logits.masked_fill(mask, float("-inf")).softmax(dim=-1)
        # Keep a token while the mass before it is below top_p (the first is always kept).
        mask |= (probs.cumsum(dim=-1) - probs) >= p[:, None]
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _logprobs(
    processed: torch.Tensor, tokens: list[int], params: Sequence[SamplingParams]
) -> list[TokenLogprob | None]:
    out: list[TokenLogprob | None] = [None] * len(tokens)
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not want:
        return out
    idx = torch.tensor(want, device=processed.device)
    logp = torch.log_softmax(processed.index_select(0, idx), dim=-1)
    chosen = logp.gather(1, torch.tensor([[tokens[i]] for i in want], device=logp.device))
    chosen_list = chosen.squeeze(1).tolist()
    max_top = max(params[i].logprobs or 0 for i in want)
    top_vals, top_ids = (logp.topk(max_top, dim=-1) if max_top else (None, None))
    for j, i in enumerate(want):
        n = params[i].logprobs or 0
        top: tuple[tuple[int, float], ...] = ()
        if n:
            top = tuple(zip(top_ids[j, :n].tolist(), top_vals[j, :n].tolist(), strict=False))
        out[i] = TokenLogprob(chosen_list[j], top)
    return out
