"""Batched sampling: penalties, bias, greedy, temperature, min-p, top-k, top-p; randomness a
function of (seed, position).

:class:`SamplingParams` is the worker API's own validated type (``engine.api.generate``, torch-free
and shared with the router), re-exported here so there is one definition of its defaults.

Determinism contract: the token sampled for a row depends only on that row's logits, its
parameters and ``(seed, position)``, where ``position`` is the index the sampled token will
take in the sequence (``len(prompt) + len(outputs so far)``). It does not depend on the batch,
the worker, the device, or how the request got there, so a request continued on another worker
at position ``p`` (given its outputs up front) samples the same token.

Order of application (vLLM V1's, ``vllm/v1/sample/sampler.py``):

0. The processors that change greedy too (``engine.core.logits_processors``): ``min_tokens``,
   ``logit_bias``, ``repetition_penalty``, then ``frequency_penalty`` / ``presence_penalty``.
   Greedy rows take the argmax of these logits and pay for nothing else.
1. Temperature: the sampled rows' logits are scaled by ``1 / temperature``.
2. ``min_p`` (on the scaled distribution, as vLLM and transformers' ``MinPLogitsWarper``):
   tokens whose probability is below ``min_p`` times the best token's are out. In weights
   ``w = exp((x - max) / T)`` (the best weighs 1) that is ``w < min_p``, and since ``w`` grows
   with ``x`` it too is one threshold logit per row (the smallest logit kept).
3. Top-k, then top-p over what is left (see below); then the draw.

Implementation (all sampled rows at once, in a few whole-batch tensor passes):

1. Filter: each row's min-p, top-k and top-p become one *threshold* logit; tokens below it are out.
   Top-k's threshold is the k-th largest value (``topk``); top-p's is the smallest logit of the
   nucleus (keep tokens, best first, while the mass before them is below ``top_p``), found
   among the row's best 64 tokens, else its best 512, else by sorting the row (a flat row).
   A threshold is a value, so ties at it stay in, and the result depends neither on how
   ``topk`` orders ties nor on the batch. ``top_p == 1.0`` is off (no float cumsum cut).
2. Draw: inverse-CDF sampling in token-id order with ONE uniform per row,
   ``u = xxh3_64(seed, position) / 2**64`` (53 bits): the token is the first whose cumulative
   weight exceeds ``u * total`` (never a token of weight 0). The CDF is two-level (sums of
   256-token chunks, accumulated in float64, then a cumulative sum inside the one chunk that
   holds the target), so a step costs one ``exp`` and one sum over the batch. This replaces
   Gumbel-max over per-row ``torch.Generator`` noise, which drew ``vocab`` numbers per row
   (about 35 ms a step at batch 32, vocab 49152, on one CPU thread; now about 5 ms): one
   counter-based number per row is all inverse-CDF needs, and the hash is the same on every
   device.

Requests without a seed get one at admission (:func:`with_seed`), and it is reported back.

The token sampled for a row also depends on its history (prompt and output tokens) when it
uses penalties or ``min_tokens``; :func:`sample` takes the rows' histories for that, and
output tokens given up front count as output, so the determinism contract holds for a
request continued elsewhere.

Log-probabilities are those of the distribution actually sampled from: ``log_softmax`` of the
*processed* logits (after step 0, scaled by temperature, with tokens outside min-p/top-k/top-p
at ``-inf``). Greedy rows (temperature 0) report ``log_softmax`` of the logits after step 0.
"""

from __future__ import annotations

import dataclasses
import secrets
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import xxhash

from engine.api.generate import SamplingParams, TokenLogprob
from engine.core import logits_processors
from engine.core.logits_processors import History, TokenHistory

__all__ = ["SamplingParams", "SamplerOutput", "History", "TokenHistory", "sample", "with_seed",
           "row_uniform"]

_MAX_SEED = 2**63 - 1
_CHUNK = 256          # tokens per first-level CDF chunk
_CANDIDATES = (64, 512)  # top-p: best tokens looked at before sorting the whole row


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


def row_uniform(seed: int, position: int) -> float:
    """The uniform in [0, 1) of one (seed, position): a pure function of the two."""
    digest = xxhash.xxh3_64_intdigest(struct.pack("<qq", seed, position))
    return (digest >> 11) * 2.0**-53


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int],
    histories: Sequence[TokenHistory] | None = None, eos_token_ids: Sequence[int] = (),
) -> SamplerOutput:
    """Sample one token per row of ``logits`` ``[rows, vocab]`` (float32; never written).

    ``histories`` (one per row: its prompt and output tokens so far) are needed only when a
    row uses penalties or ``min_tokens``; ``eos_token_ids`` are what ``min_tokens`` holds back
    (with each row's ``stop_token_ids``) unless the row says ``ignore_eos``."""
    rows, _ = logits.shape
    if len(params) != rows or len(positions) != rows:
        raise ValueError(f"{rows} logit rows but {len(params)} params and {len(positions)} positions")
    logits = logits_processors.apply(logits.float(), params, histories, eos_token_ids)
    dev = logits.device
    random_rows = [i for i, p in enumerate(params) if p.temperature > 0.0]
    greedy_rows = [i for i, p in enumerate(params) if p.temperature == 0.0]
    tokens = torch.empty(rows, dtype=torch.long, device=dev)
    if greedy_rows:
        if random_rows:
            g = torch.tensor(greedy_rows, device=dev)
            tokens.index_copy_(0, g, logits.index_select(0, g).argmax(dim=-1))
        else:
            tokens = logits.argmax(dim=-1)
    processed = logits
    if random_rows:
        chosen = [params[i] for i in random_rows]
        seeds = [p.seed for p in chosen]
        if None in seeds:
            raise ValueError("a sampled row needs a seed; admit requests through with_seed()")
        idx = None if len(random_rows) == rows else torch.tensor(random_rows, device=dev)
        x = logits if idx is None else logits.index_select(0, idx)
        inv_t = torch.tensor([1.0 / p.temperature for p in chosen], device=dev)[:, None]
        # Unnormalized probabilities: exp((x - max) / T), in place on one new tensor.
        weights = (x - x.amax(dim=-1, keepdim=True)).mul_(inv_t).exp_()
        out = _filter(x, weights, inv_t, [p.top_k for p in chosen], [p.top_p for p in chosen],
                      [p.min_p for p in chosen])
        u = torch.tensor([row_uniform(seed, positions[i])
                          for seed, i in zip(seeds, random_rows) if seed is not None],
                         dtype=torch.float64, device=dev)
        drawn = _inverse_cdf(weights, u)
        tokens = drawn if idx is None else tokens.index_copy_(0, idx, drawn)
        if any(p.logprobs is not None for p in chosen):
            scaled = x * inv_t
            if out is not None:
                scaled.masked_fill_(out, float("-inf"))
            processed = scaled if idx is None else logits.index_copy(0, idx, scaled)
    token_list = tokens.tolist()
    return SamplerOutput(token_list, _logprobs(processed, token_list, params))


def _filter(x: torch.Tensor, weights: torch.Tensor, inv_t: torch.Tensor, top_k: list[int],
            top_p: list[float], min_p: list[float] | None = None) -> torch.Tensor | None:
    """Zero the ``weights`` of tokens outside each row's min-p and top-k, then top-p (of what
    those left), by one threshold logit per row; return the mask of tokens out (None: no
    filter). ``weights`` are ``exp((x - max) * inv_t)``: the best token weighs 1."""
    rows, vocab = x.shape
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    use_k = any(k < vocab for k in ks)
    use_p = any(p < 1.0 for p in top_p)
    use_min_p = min_p is not None and any(m > 0.0 for m in min_p)
    if not (use_k or use_p or use_min_p):
        return None
    dev = x.device
    thr = torch.full((rows,), float("-inf"), device=dev)
    if use_min_p:
        assert min_p is not None
        m = torch.tensor(min_p, device=dev)
        # prob < min_p * max_prob  <=>  weight < min_p; the smallest logit kept is the cut.
        kept_min = torch.where(weights >= m[:, None], x, float("inf")).amin(-1)
        thr = torch.where(m > 0.0, kept_min, thr)
    if use_k:
        kmax = max(k for k in ks if k < vocab)
        kth = x.topk(kmax, dim=-1).values.gather(
            1, torch.tensor([[min(k, kmax) - 1] for k in ks], device=dev)).squeeze(1)
        thr = torch.where(torch.tensor([k < vocab for k in ks], device=dev),
                          torch.maximum(kth, thr), thr)
    if use_k or use_min_p:
        weights.masked_fill_(x < thr[:, None], 0.0)
    if use_p:
        todo = [i for i, p in enumerate(top_p) if p < 1.0]
        total = weights.sum(-1, keepdim=True)
        # A fixed schedule, so a row's cut never depends on the rows batched with it.
        for n in (*(c for c in _CANDIDATES if c < vocab), vocab):
            if not todo:
                break
            sub = torch.tensor(todo, device=dev)
            found, cut = _nucleus_cut(x.index_select(0, sub), thr.index_select(0, sub),
                                      total.index_select(0, sub), inv_t.index_select(0, sub),
                                      torch.tensor([top_p[i] for i in todo], device=dev), n)
            found |= torch.tensor([ks[i] <= n for i in todo], device=dev) | (n >= vocab)
            cut = torch.where(found, cut, float("-inf"))              # unresolved: no cut yet
            thr.index_copy_(0, sub, torch.maximum(thr.index_select(0, sub), cut))
            todo = [i for i, ok in zip(todo, found.tolist()) if not ok]
    out = x < thr[:, None]
    if use_p:
        weights.masked_fill_(out, 0.0)
    return out


def _nucleus_cut(x: torch.Tensor, thr: torch.Tensor, total: torch.Tensor, inv_t: torch.Tensor,
                 p: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p over each row's ``n`` best tokens: (boundary among them, smallest logit kept).
    ``total`` is the row's weight after top-k; tokens below ``thr`` (top-k) weigh nothing."""
    top = x.topk(n, dim=-1).values                                   # best first
    w = ((top - top[:, :1]) * inv_t).exp_().masked_fill_(top < thr[:, None], 0.0) / total
    keep = (w.cumsum(-1) - w) < p[:, None]                          # the first is always kept
    last = keep.sum(-1, keepdim=True) - 1
    return ~keep.all(-1), top.gather(1, last).squeeze(1)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative weight exceeds ``u * total`` (never one of
    weight 0). Two levels: chunk sums, then a cumulative sum inside the chosen chunk."""
    rows, vocab = weights.shape
    pad = -vocab % _CHUNK
    if pad:
        weights = F.pad(weights, (0, pad))
    chunks = weights.view(rows, -1, _CHUNK)
    sums = chunks.sum(-1)                                           # [rows, n_chunks]
    cdf = sums.cumsum(-1, dtype=torch.float64)
    target = (u * cdf[:, -1]).unsqueeze(1)
    j = torch.minimum(torch.searchsorted(cdf, target, right=True), _last_nonzero(sums))
    before = torch.where(j > 0, cdf.gather(1, (j - 1).clamp_(min=0)), 0.0)
    inner = chunks.gather(1, j.unsqueeze(-1).expand(rows, 1, _CHUNK)).squeeze(1)   # [rows, CHUNK]
    i = torch.searchsorted(inner.double().cumsum(-1), target - before, right=True)
    i = torch.minimum(i, _last_nonzero(inner))
    return (j * _CHUNK + i).squeeze(1)


def _last_nonzero(x: torch.Tensor) -> torch.Tensor:
    """Per row, the index of the last positive entry, as ``[rows, 1]``."""
    pos = torch.arange(x.shape[-1], device=x.device)
    return torch.where(x > 0, pos, -1).amax(-1, keepdim=True)


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
    top_vals: list[list[float]] = [[] for _ in want]
    top_ids: list[list[int]] = [[] for _ in want]
    if max_top:
        vals, ids = logp.topk(max_top, dim=-1)
        top_vals, top_ids = vals.tolist(), ids.tolist()
    for j, i in enumerate(want):
        n = params[i].logprobs or 0
        top = tuple(zip(top_ids[j][:n], top_vals[j][:n], strict=True))
        out[i] = TokenLogprob(chosen_list[j], top)
    return out
