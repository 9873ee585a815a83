"""One choice's walk from token stream to text: placement → detokenizer → stop strings →
:class:`ChoiceDelta` s, with the latency metrics measured where the client sees them.

``run_choice`` is an async generator of :class:`ChoiceDelta`; the last one has ``finish_reason``.
It stops consuming (and so closes the orchestrator's stream, which aborts the request on its
workers) as soon as a stop string matched; its caller does the same by closing it when the
client goes away.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field

from engine.api.generate import GenerateChunk, RequestStats, TokenLogprob
from engine.api.tokenizer import Tokenizer
from router.http.openai_types import RequestOptions
from router.metrics import RouterMetrics
from router.placement.serving import ServeRequest, Serving
from router.text.detokenizer import IncrementalDetokenizer

__all__ = ["ChoiceDelta", "ChoiceResult", "run_choice", "collect_choice"]


@dataclass(slots=True)
class ChoiceDelta:
    """New text of one choice, the ids it came from (with logprobs when asked), and the
    finish reason on the last delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    text_offset: int = 0          # where ``text`` starts in the choice's text
    stats: RequestStats | None = None


@dataclass(slots=True)
class ChoiceResult:
    index: int
    text: str = ""
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    stats: RequestStats | None = None


async def run_choice(
    serving: Serving, tokenizer: Tokenizer, metrics: RouterMetrics,
    request: ServeRequest, options: RequestOptions, index: int, arrival: float,
) -> AsyncGenerator[ChoiceDelta, None]:
    """Serve one choice; see the module docstring. ``arrival``: ``time.monotonic()`` at arrival."""
    detok = IncrementalDetokenizer(
        tokenizer, request.prompt_token_ids, stop=options.stop,
        include_stop_str_in_output=options.include_stop_str_in_output,
    )
    first: float | None = None
    last = arrival
    produced = 0
    offset = 0
    async with aclosing(serving.serve(request)) as stream:
        async for item in stream:
            now = time.monotonic()
            if isinstance(item, GenerateChunk):
                if not item.token_ids:
                    continue
                if first is None:
                    first = now
                    metrics.ttft.observe(now - arrival)
                else:
                    metrics.itl.observe(now - last)
                last = now
                delta = detok.push(item.token_ids)
                used = delta.num_tokens
                produced += used
                lps = item.logprobs[:used] if item.logprobs is not None else None
                yield ChoiceDelta(index, delta.text, item.token_ids[:used], lps,
                                  "stop" if delta.stopped else None, offset)
                offset += len(delta.text)
                if delta.stopped:
                    break
            else:
                tail = detok.flush()  # a stop string can still match in the flushed rest
                reason = "stop" if detok.stopped else item.finish_reason
                yield ChoiceDelta(index, tail, [], None, reason, offset, item.stats)
                break
    end = time.monotonic()
    metrics.generation_tokens.inc(produced)
    metrics.e2e.observe(end - arrival)
    if first is not None and produced > 1:
        metrics.tpot.observe((end - first) / (produced - 1))


async def collect_choice(deltas: AsyncGenerator[ChoiceDelta, None], index: int, want_logprobs: bool) -> ChoiceResult:
    """Drain ``run_choice`` into one non-streaming result."""
    result = ChoiceResult(index, logprobs=[] if want_logprobs else None)
    parts: list[str] = []
    async with aclosing(deltas) as stream:
        async for d in stream:
            parts.append(d.text)
            result.token_ids.extend(d.token_ids)
            if result.logprobs is not None and d.logprobs:
                result.logprobs.extend(d.logprobs)
            if d.finish_reason is not None:
                result.finish_reason = d.finish_reason
            if d.stats is not None:
                result.stats = d.stats
    result.text = "".join(parts)
    return result
