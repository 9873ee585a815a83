"""The logits processors that act before temperature (so greedy rows feel them too).

In vLLM V1's order (``vllm/v1/sample/sampler.py``: non-argmax-invariant processors, then the
penalties), each over the rows that use it, in a few whole-batch tensor passes:

1. ``min_tokens``: while a row has fewer than ``min_tokens`` output tokens, its stop ids (the
   model's EOS ids unless ``ignore_eos``, and ``stop_token_ids``) are ``-inf``
   (transformers' ``MinNewTokensLengthLogitsProcessor``).
2. ``logit_bias``: ``logits[id] += bias`` (transformers' ``SequenceBiasLogitsProcessor`` for
   single-token sequences).
3. ``repetition_penalty`` over every token of prompt + output: a seen token's logit is
   divided by the penalty if positive, multiplied if negative (transformers'
   ``RepetitionPenaltyLogitsProcessor``, the same arithmetic, so the same bits).
4. ``frequency_penalty`` and ``presence_penalty`` over output tokens only (vLLM's and OpenAI's
   definition): ``logits -= frequency_penalty * count``, then
   ``logits -= presence_penalty * (count > 0)``.

Temperature, ``min_p``, top-k and top-p follow in ``engine.core.sampling``.

"Output tokens" are ``token_ids[num_prompt_tokens:]`` of the row's history: they include the
tokens a request arrived with (``output_token_ids``: a handoff or a resume), so a request
continued on another worker after ``k`` tokens is processed exactly as if it had not moved.

Cost: with no row using a processor (``SamplingParams.uses_processors`` false, or only
``min_tokens`` already reached) :func:`apply` returns its input untouched. Otherwise it copies
the logits once and changes only the entries the histories, stop ids and biases name (the
penalties gather, recompute and scatter those ``(row, token)`` entries, as transformers'
``gather``/``scatter`` does), so the work grows with the rows' token counts, never with the
vocabulary: the histories are read into index tensors each step (NumPy, about 20 ns a token),
as vLLM rebuilds its token tensors each step.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from engine.api.generate import SamplingParams

__all__ = ["TokenHistory", "History", "apply", "needs_history"]


class TokenHistory(Protocol):
    """A row's tokens so far: prompt, then outputs (``engine.core.request.Request`` is one)."""

    @property
    def token_ids(self) -> Sequence[int]: ...
    @property
    def num_prompt_tokens(self) -> int: ...


@dataclass(frozen=True, slots=True)
class History:
    """A plain :class:`TokenHistory` (tests, scripts)."""

    token_ids: Sequence[int]
    num_prompt_tokens: int


def needs_history(p: SamplingParams) -> bool:
    """Whether ``p`` reads the row's tokens (penalties, ``min_tokens``)."""
    return (p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
            or p.presence_penalty != 0.0 or p.min_tokens > 0)


def _active(p: SamplingParams, h: TokenHistory | None) -> bool:
    if not p.uses_processors:
        return False
    if p.logit_bias is not None or p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 \
            or p.presence_penalty != 0.0:
        return True
    assert h is not None  # min_tokens only: on while outputs are fewer
    return len(h.token_ids) - h.num_prompt_tokens < p.min_tokens


def apply(logits: torch.Tensor, params: Sequence[SamplingParams],
          histories: Sequence[TokenHistory] | None, eos_token_ids: Iterable[int] = ()
          ) -> torch.Tensor:
    """``logits`` ``[rows, vocab]`` (float32) with every row's processors applied: a new
    tensor (the input is never written), or the input itself when no row uses any."""
    if not any(p.uses_processors for p in params):
        return logits
    if histories is None:
        if any(needs_history(p) for p in params):
            raise ValueError("rows use penalties or min_tokens: pass their token histories")
    elif len(histories) != len(params):
        raise ValueError(f"{len(params)} params but {len(histories)} histories")
    hist: Sequence[TokenHistory | None] = histories if histories is not None else [None] * len(params)
    rows = [i for i, (p, h) in enumerate(zip(params, hist)) if _active(p, h)]
    if not rows:
        return logits
    x = logits.clone()
    _min_tokens(x, rows, params, hist, tuple(eos_token_ids))
    _logit_bias(x, rows, params)
    _penalties(x, rows, params, hist)
    return x


def _pairs(dev: torch.device, rows: Sequence[int], per_row: Sequence[Sequence[int]]
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token id) index tensors of every token ``per_row`` lists for ``rows`` (NumPy
    reads the lists: about 20 ns a token, where ``torch.tensor`` of a list takes 150)."""
    lengths = np.fromiter((len(t) for t in per_row), dtype=np.int64, count=len(per_row))
    flat = np.fromiter(itertools.chain.from_iterable(per_row), dtype=np.int64, count=int(lengths.sum()))
    r = np.repeat(np.asarray(rows, dtype=np.int64), lengths)
    return torch.from_numpy(r).to(dev), torch.from_numpy(flat).to(dev)


def _num_outputs(h: TokenHistory | None) -> int:
    assert h is not None
    return len(h.token_ids) - h.num_prompt_tokens


def _min_tokens(x: torch.Tensor, rows: list[int], params: Sequence[SamplingParams],
                hist: Sequence[TokenHistory | None], eos: tuple[int, ...]) -> None:
    vocab = x.shape[1]
    on = [i for i in rows if params[i].min_tokens and params[i].min_tokens > _num_outputs(hist[i])]
    if not on:
        return
    banned = [[t for t in {*(() if params[i].ignore_eos else eos), *params[i].stop_token_ids}
               if t < vocab] for i in on]
    x.index_put_(_pairs(x.device, on, banned), torch.tensor(float("-inf"), device=x.device))


def _logit_bias(x: torch.Tensor, rows: list[int], params: Sequence[SamplingParams]) -> None:
    on = [i for i in rows if params[i].logit_bias is not None]
    if not on:
        return
    maps = [params[i].logit_bias or {} for i in on]
    bias = torch.tensor([b for m in maps for b in m.values()], dtype=x.dtype, device=x.device)
    x.index_put_(_pairs(x.device, on, [list(m) for m in maps]), bias, accumulate=True)  # x += bias


def _penalties(x: torch.Tensor, rows: list[int], params: Sequence[SamplingParams],
               hist: Sequence[TokenHistory | None]) -> None:
    """Both touch only the (row, token) entries of the histories, never the whole vocabulary."""
    dev = x.device
    rep = [params[i].repetition_penalty != 1.0 for i in rows]
    fp = [params[i].frequency_penalty != 0.0 or params[i].presence_penalty != 0.0 for i in rows]
    pen = [i for i, a, b in zip(rows, rep, fp) if a or b]
    if not pen:
        return
    # Every history token once, read once for both penalties: (row, token, is it an output).
    per_row = [_tokens(hist[i]) for i in pen]
    r, t = _pairs(dev, pen, per_row)
    lengths = np.fromiter((len(ts) for ts in per_row), dtype=np.int64, count=len(pen))
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    prompt = np.repeat(np.fromiter((_prompt_len(hist[i]) for i in pen), dtype=np.int64,
                                   count=len(pen)), lengths)
    is_output = torch.from_numpy(np.arange(int(lengths.sum())) - starts >= prompt).to(dev)
    if any(rep):
        use = torch.tensor([p.repetition_penalty != 1.0 for p in params], device=dev)[r]
        rr, rt = r[use], t[use]
        penalty = torch.tensor([p.repetition_penalty for p in params], device=dev)[rr]
        score = x[rr, rt]   # a token seen twice is gathered twice and written twice, the same value
        x[rr, rt] = torch.where(score < 0, score * penalty, score / penalty)
    if any(fp):
        vocab = x.shape[1]
        use = torch.tensor([p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params],
                           device=dev)[r] & is_output
        seen, counts = torch.unique(r[use] * vocab + t[use], return_counts=True)
        fr, ft = seen // vocab, seen % vocab
        freq = torch.tensor([p.frequency_penalty for p in params], device=dev)[fr]
        pres = torch.tensor([p.presence_penalty for p in params], device=dev)[fr]
        # The dense definition's arithmetic on the entries it changes (elsewhere it is x - 0 - 0).
        x[fr, ft] = x[fr, ft] - freq * counts.to(x.dtype) - pres


def _tokens(h: TokenHistory | None) -> Sequence[int]:
    assert h is not None
    return h.token_ids


def _prompt_len(h: TokenHistory | None) -> int:
    assert h is not None
    return h.num_prompt_tokens
