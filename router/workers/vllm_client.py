"""A client for a vLLM server as a worker: :class:`WorkerClient`'s interface over vLLM's
OpenAI-compatible HTTP API (checked against vLLM 0.32), so the router drives vLLM instances as
it drives its own workers. Neither vLLM nor torch is imported.

- ``generate(request)`` is one ``POST /v1/completions`` with the prompt as token ids: vLLM
  continues from a prompt, so ``prompt_token_ids + output_token_ids`` (tokens produced
  elsewhere) is the prompt it gets, and ``max_tokens`` is ``sampling.max_tokens`` less the
  tokens already produced. It streams (``stream``, ``stream_options.include_usage``) and asks
  for the new tokens' ids in every chunk (``return_token_ids``); each chunk with tokens becomes
  a :class:`GenerateChunk`, and the stream ends with exactly one :class:`GenerateFinal`
  (vLLM's ``finish_reason``, the stats from ``usage`` and ``metrics``).
- A ``phase="prefill"`` request asks for one token and is *not* streamed: vLLM 0.32 returns a
  connector's ``kv_transfer_params`` only in a whole response (its stream chunks have no such
  field), and the prefill's final line must carry them for its decode
  (``GenerateFinal.kv_transfer_params``). A request carrying ``kv_transfer_params`` (a decode)
  passes them to vLLM as they are.
- ``abort(request_id)``: vLLM aborts a request when its connection closes, so the client keeps
  each in-flight response by request id and closes it; the stream then ends with a
  ``GenerateFinal(finish_reason="abort")``. True if one was open.
- ``health()``: ``GET /health`` (:class:`WorkerClient`'s).
- ``follow_events(index, on_load)``: vLLM publishes its KV cache events over ZMQ, not on
  ``/events``. With an ``events`` source (:class:`VllmEventSource`, e.g. :func:`zmq_kv_events`
  for ``router.workers.vllm_events.VllmKvEvents``) it keeps ``index`` in step from them,
  starting over after ``retry_interval`` if following fails; without one it only registers
  the worker in the index. Either way it runs until cancelled. vLLM publishes no load figures
  there: ``on_load`` is not called.

Sampling (``SamplingParams`` → vLLM's ``CompletionRequest``): ``temperature``, ``top_p``,
``top_k`` (0 is "off" in both), ``min_p``, ``seed`` (left out when None), ``stop_token_ids``,
``ignore_eos``, ``repetition_penalty``, ``frequency_penalty``, ``presence_penalty``,
``logit_bias`` (decimal-string keys), ``min_tokens`` (less the tokens already produced: ours
count them, vLLM's count its own) and ``logprobs`` (with ``return_tokens_as_token_ids``, so the
top alternatives come back as ``token_id:N``; each token's ``top`` is the ``logprobs`` best,
best first). ``cache_salt`` is passed when set. What the translation has to refuse
(:class:`WorkerRejected`, HTTP status 400, not sent; see :func:`completion_body`): nothing left
to generate, and penalties over tokens produced elsewhere that vLLM cannot reproduce exactly.
Its penalties count only the outputs it generated itself, so the client adds a frequency
penalty's share of those tokens as ``logit_bias``: exact unless a ``repetition_penalty`` is on
too (vLLM applies it after the bias) or a bias would pass vLLM's ±100 clamp. A presence
penalty cannot be carried that way: vLLM would charge it again once a token produced elsewhere
recurs in its own output, so a presence penalty with tokens produced elsewhere is refused.

Differences to know (not refused): vLLM's seeded sampling is a generator stream per request,
so a request continued on another instance draws differently from an uninterrupted one (our
workers' draws are a function of ``(seed, position)``); vLLM's logprobs are those its server's
``--logprobs-mode`` names (by default the raw model's, before penalties and temperature; ours
are the processed distribution's); vLLM still detokenizes (its completions API has no switch
for that; only ``--skip-tokenizer-init`` on the server turns it off), the text is ignored here.

Stats: ``usage.prompt_tokens_details.cached_tokens`` (served with
``--enable-prompt-tokens-details``) is vLLM's count of prompt tokens not computed: its device
prefix-cache hits *and* the tokens its KV connector loaded, which the API does not tell apart.
They are reported as ``device_hit_tokens`` and ``computed_prompt_tokens`` is the rest of
``usage.prompt_tokens``. ``metrics`` (served with ``--enable-per-request-metrics``) gives
``queue_s`` (``queue_time_ms``) and ``prefill_s`` (``time_to_first_token_ms``, from scheduling);
``first_token_s`` is their sum, or without them the time from sending to the first token.

Errors, as :class:`WorkerClient`'s: a connection failure, a broken stream, a malformed message
and HTTP 5xx are :class:`WorkerUnavailable`; HTTP 4xx is :class:`WorkerRejected` with vLLM's
message (``error.message``). vLLM checks some fields only once its stream has begun and then
sends the error as a stream event with its code: 4xx there is a :class:`WorkerRejected` too,
any other code a :class:`WorkerUnavailable`. Every call carries ``headers``
(the cluster secret's ``Authorization: Bearer``, which a vLLM server started with
``--api-key <secret>`` requires on ``/v1``) and ``X-KV-Worker-Id``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import httpx

from engine.api.events import LoadFigures, Snapshot, WorkerEvent
from engine.api.generate import (
    MAX_LOGIT_BIAS,
    FinishReason,
    GenerateChunk,
    GenerateFinal,
    GenerateRequest,
    RequestStats,
    TokenLogprob,
    WorkerInfo,
)
from kvstore import tls as tls_settings
from router.workers.client import WorkerClient, WorkerRejected, WorkerUnavailable
from router.workers.kv_index import KvIndex

__all__ = ["VllmWorkerClient", "VllmEventSource", "VllmUnsupported", "completion_body",
           "zmq_kv_events", "COMPLETIONS_PATH"]

log = logging.getLogger(__name__)

COMPLETIONS_PATH = "/v1/completions"
TOKEN_ID_PREFIX = "token_id:"  # vLLM's token strings under ``return_tokens_as_token_ids``

# vLLM's finish reasons (``vllm.v1.engine.FinishReason``) as ours. "error" never reaches a
# client as a finish reason (vLLM turns it into an error); "repetition" (its repetition
# detection, which this client never asks for) is a stop.
_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort",
                                    "repetition": "stop"}


class VllmEventSource(Protocol):
    """What keeps a :class:`KvIndex` in step with one vLLM instance: ``follow`` runs until
    cancelled (``router.workers.vllm_events.VllmKvEvents`` is one)."""

    async def follow(self, index: KvIndex, worker_id: str) -> None: ...


def zmq_kv_events(info: WorkerInfo, endpoint: str, replay_endpoint: str | None = None,
                  topic: str = "", **kw: Any) -> VllmEventSource:
    """A follower of the vLLM instance's ZMQ KV events (its ``--kv-events-config``
    ``endpoint``, ``replay_endpoint`` and ``topic``) keyed in ``info``'s namespace and block
    size. Needs the router's ``pyzmq`` and ``msgspec``."""
    from router.workers.vllm_events import VllmKvEvents

    return VllmKvEvents(endpoint, replay_endpoint, bytes(info.namespace), info.block_size, topic, **kw)


class VllmUnsupported(ValueError):
    """A request vLLM cannot serve as asked (see :func:`completion_body`)."""


def completion_body(request: GenerateRequest, model: str) -> dict[str, Any]:
    """The ``POST /v1/completions`` body for ``request`` on the model vLLM serves as
    ``model`` (see the module docstring). Raises :class:`VllmUnsupported` for what vLLM
    cannot do:

    - ``output_token_ids`` already as many as ``sampling.max_tokens``: nothing to generate
      (vLLM needs ``max_tokens >= 1``).
    - ``frequency_penalty`` with ``output_token_ids``: vLLM's penalties count only the tokens
      it generated, so those tokens' share goes into ``logit_bias`` (``-frequency_penalty *
      count`` per distinct token, added to the request's own bias). That is exact unless
      ``repetition_penalty != 1`` (vLLM applies the bias before the repetition penalty, ours
      after) or a resulting bias passes vLLM's ±100 clamp: then it is refused.
    - ``presence_penalty`` with ``output_token_ids``: refused. A bias would charge a token
      produced elsewhere once, and vLLM would charge it again when it recurs in vLLM's output.
    """
    s = request.sampling
    done = len(request.output_token_ids)
    left = s.max_tokens - done
    if left < 1:
        raise VllmUnsupported(f"output_token_ids ({done}) already reach sampling.max_tokens "
                              f"({s.max_tokens}): nothing left to generate")
    prefill = request.phase == "prefill"
    max_tokens = 1 if prefill else left
    bias = dict(s.logit_bias or {})
    if done and s.presence_penalty:
        raise VllmUnsupported(
            "vLLM cannot apply presence_penalty to output_token_ids (tokens produced elsewhere) exactly: "
            "it would charge a token again when it recurs in vLLM's own output")
    if done and s.frequency_penalty:
        if s.repetition_penalty != 1.0:
            raise VllmUnsupported(
                "vLLM cannot apply frequency_penalty to output_token_ids (tokens produced elsewhere) "
                "together with repetition_penalty != 1")
        for token, count in Counter(request.output_token_ids).items():
            b = bias.get(token, 0.0) - s.frequency_penalty * count
            if abs(b) > MAX_LOGIT_BIAS:
                raise VllmUnsupported(
                    f"vLLM cannot apply frequency_penalty to output_token_ids "
                    f"(tokens produced elsewhere) here: token {token}'s penalty as a logit bias "
                    f"({b:g}) passes vLLM's bound of ±{MAX_LOGIT_BIAS:g}")
            bias[token] = b
    body: dict[str, Any] = {
        "model": model,
        "prompt": [*request.prompt_token_ids, *request.output_token_ids],
        "max_tokens": max_tokens,
        "min_tokens": min(max(0, s.min_tokens - done), max_tokens),
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "min_p": s.min_p,
        "repetition_penalty": s.repetition_penalty,
        "frequency_penalty": s.frequency_penalty,
        "presence_penalty": s.presence_penalty,
        "stop_token_ids": list(s.stop_token_ids),
        "ignore_eos": s.ignore_eos,
        "n": 1,
        "echo": False,
        "return_token_ids": True,
        "request_id": request.request_id,
        "stream": not prefill,
    }
    if not prefill:
        body["stream_options"] = {"include_usage": True}
    if s.seed is not None:
        body["seed"] = s.seed
    if bias:
        body["logit_bias"] = {str(t): b for t, b in bias.items()}
    if s.logprobs is not None:
        body["logprobs"] = s.logprobs
        body["return_tokens_as_token_ids"] = True
    if request.cache_salt:
        body["cache_salt"] = request.cache_salt
    if request.kv_transfer_params is not None:
        body["kv_transfer_params"] = request.kv_transfer_params
    return body


@dataclass
class _Progress:
    """One request's stream as read so far."""

    top_n: int = 0            # alternatives per token asked for (sampling.logprobs)
    start: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    finish_reason: str | None = None
    usage: Mapping[str, Any] | None = None
    metrics: Mapping[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None


class VllmWorkerClient(WorkerClient):
    """One vLLM server's OpenAI-compatible API as a worker (see the module docstring). Takes
    :class:`WorkerClient`'s arguments, and ``events``: what follows the instance's KV cache
    events (None: ``follow_events`` only registers the worker). Close with ``aclose``."""

    def __init__(self, info: WorkerInfo, *, timeout: float = 5.0,
                 stream_read_timeout: float | None = 300.0, max_connections: int = 1024,
                 headers: Mapping[str, str] | None = None,
                 tls: tls_settings.TLSConfig | Literal[False] | None = None,
                 events: VllmEventSource | None = None) -> None:
        super().__init__(info, timeout=timeout, stream_read_timeout=stream_read_timeout,
                         max_connections=max_connections, headers=headers, tls=tls)
        self.kv_events = events
        self._open: dict[str, httpx.Response] = {}   # in-flight responses by request id
        self._aborted: set[int] = set()              # id()s of the responses abort closed

    # --- requests -------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerateChunk | GenerateFinal, None]:
        """Stream one request's output; the last item is always a :class:`GenerateFinal`."""
        rid = request.request_id
        try:
            body = completion_body(request, self.info.model)
        except VllmUnsupported as exc:
            raise WorkerRejected(self.worker_id, 400, f"not sent to vLLM: {exc}") from None
        progress = _Progress(top_n=request.sampling.logprobs or 0)
        resp: httpx.Response | None = None
        try:
            with self._failures(f"generate {rid}"):
                async with self._http.stream("POST", COMPLETIONS_PATH, json=body,
                                             timeout=self._stream_timeout) as resp:
                    self._open[rid] = resp
                    await self._check(resp)
                    items = (self._read_stream(resp, progress) if body["stream"]
                             else self._read_whole(resp, progress))
                    async for item in items:
                        yield item
                        if isinstance(item, GenerateFinal):
                            return
            raise WorkerUnavailable(self.worker_id,
                                    f"generate {rid}: stream ended before its final chunk")
        except Exception:
            if resp is None or id(resp) not in self._aborted:
                raise
            yield GenerateFinal("abort", self._stats(progress))   # abort() closed it
        finally:
            if resp is not None:
                self._aborted.discard(id(resp))
                if self._open.get(rid) is resp:
                    del self._open[rid]

    async def abort(self, request_id: str) -> bool:
        """Close ``request_id``'s connection (vLLM then aborts it); False if none was open."""
        resp = self._open.pop(request_id, None)
        if resp is None:
            return False
        self._aborted.add(id(resp))
        try:
            await resp.aclose()
        except Exception as exc:  # noqa: BLE001 - best effort, like WorkerClient.abort
            log.info("abort %s: closing its stream failed: %r", request_id, exc)
        return True

    async def snapshot(self) -> Snapshot:
        """vLLM has no ``/snapshot``: its KV events come over ZMQ (see ``follow_events``)."""
        raise NotImplementedError("a vLLM server has no /snapshot; see follow_events")

    async def events(self, since: int) -> AsyncGenerator[WorkerEvent, None]:
        """vLLM has no ``/events``: its KV events come over ZMQ (see ``follow_events``)."""
        raise NotImplementedError("a vLLM server has no /events; see follow_events")
        yield  # pragma: no cover - makes this an async generator, as WorkerClient's

    async def follow_events(self, index: KvIndex, on_load: Callable[[LoadFigures], None],
                            *, retry_interval: float = 0.5) -> None:
        """Keep ``index`` in step with this instance until cancelled (see the module
        docstring); ``on_load`` is not called (vLLM publishes no load figures)."""
        wid = self.worker_id
        index.add_worker(wid)
        if self.kv_events is None:
            await asyncio.Event().wait()   # nothing to follow: wait to be cancelled
            return
        while True:
            try:
                await self.kv_events.follow(index, wid)
            except Exception as exc:  # noqa: BLE001 - any failure: start over, as WorkerClient
                log.info("worker %s: vLLM KV events failed (%r); following again", wid, exc)
            await asyncio.sleep(retry_interval)

    # --- vLLM's answers -------------------------------------------------------------------

    async def _read_stream(self, resp: httpx.Response, progress: _Progress
                           ) -> AsyncIterator[GenerateChunk | GenerateFinal]:
        """Server-sent events: ``data: <CompletionStreamResponse>`` lines, then ``data:
        [DONE]``. Chunks with tokens, then the final once the usage chunk (or ``[DONE]``)
        came after a finish reason."""
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue   # blank separators, ": keep-alive" comments
            data = line[5:].strip()
            if data == "[DONE]":
                break
            msg = self._message(data)
            for choice in msg.get("choices") or ():
                chunk = self._chunk(choice, progress)
                if chunk is not None:
                    yield chunk
            if msg.get("usage") is not None:
                progress.usage = msg["usage"]
                progress.metrics = msg.get("metrics")
                if progress.finish_reason is not None:
                    yield self._final(progress)
                    return
        if progress.finish_reason is None:
            raise WorkerUnavailable(self.worker_id, "the stream ended without a finish reason")
        yield self._final(progress)

    async def _read_whole(self, resp: httpx.Response, progress: _Progress
                          ) -> AsyncIterator[GenerateChunk | GenerateFinal]:
        """One ``CompletionResponse`` (a prefill): its tokens, then the final with vLLM's
        ``kv_transfer_params``."""
        await resp.aread()
        msg = self._message(resp.text)
        choices = msg.get("choices")
        if not isinstance(choices, list) or len(choices) != 1:
            raise WorkerUnavailable(self.worker_id, f"expected one choice, got {str(choices)[:200]}")
        chunk = self._chunk(choices[0], progress)
        if chunk is not None:
            yield chunk
        if progress.finish_reason is None:
            raise WorkerUnavailable(self.worker_id, "a response without a finish reason")
        progress.usage = msg.get("usage")
        progress.metrics = msg.get("metrics")
        params = msg.get("kv_transfer_params")
        progress.kv_transfer_params = params if isinstance(params, dict) else None
        yield self._final(progress)

    def _message(self, data: str) -> dict[str, Any]:
        msg = self._json(data)
        if not isinstance(msg, dict):
            raise WorkerUnavailable(self.worker_id, f"not a JSON object: {data[:200]!r}")
        if "error" in msg:
            # An error inside an accepted stream: vLLM validates some fields (logit_bias's
            # token ids, ...) only once the stream has begun, and classifies the exception:
            # 4xx is the request's fault, anything else the worker's.
            err = msg["error"]
            code = err.get("code") if isinstance(err, dict) else None
            if isinstance(code, int) and 400 <= code < 500:
                raise WorkerRejected(self.worker_id, code, _error_message(msg))
            raise WorkerUnavailable(self.worker_id, f"vLLM: {_error_message(msg)}")
        return msg

    def _chunk(self, choice: Any, progress: _Progress) -> GenerateChunk | None:
        """One choice's new tokens (None if it has none); notes its finish reason."""
        if not isinstance(choice, dict):
            raise WorkerUnavailable(self.worker_id, f"bad choice: {str(choice)[:200]}")
        reason = choice.get("finish_reason")
        if reason is not None:
            progress.finish_reason = str(reason)
        ids = choice.get("token_ids") or []
        if not isinstance(ids, list) or not all(type(t) is int for t in ids):
            raise WorkerUnavailable(self.worker_id, f"bad token_ids: {str(ids)[:200]}")
        if not ids:
            return None
        if progress.first_token is None:
            progress.first_token = time.perf_counter()
        logprobs = choice.get("logprobs")
        return GenerateChunk(ids, None if logprobs is None
                             else self._logprobs(ids, logprobs, progress.top_n))

    def _logprobs(self, ids: list[int], raw: Any, top_n: int) -> list[TokenLogprob]:
        """vLLM's ``CompletionLogProbs`` (tokens as ``token_id:N``) as ours: per token its
        logprob and the ``logprobs`` best alternatives, best first (vLLM's map also holds the
        sampled token, which may not be among them)."""
        try:
            lps, tops = raw["token_logprobs"], raw["top_logprobs"]
            if len(lps) != len(ids) or len(tops) != len(ids):
                raise ValueError("one entry per token expected")
            out: list[TokenLogprob] = []
            for lp, top in zip(lps, tops):
                pairs = sorted(((_token_id(k), float(v)) for k, v in (top or {}).items()),
                               key=lambda p: -p[1])
                out.append(TokenLogprob(float(lp), tuple(pairs[:top_n])))
            return out
        except (KeyError, TypeError, ValueError) as exc:
            raise WorkerUnavailable(self.worker_id, f"bad logprobs ({exc}): {str(raw)[:200]}") from None

    def _final(self, progress: _Progress) -> GenerateFinal:
        reason = progress.finish_reason
        if reason not in _FINISH:
            raise WorkerUnavailable(self.worker_id, f"unknown finish reason {reason!r}")
        return GenerateFinal(_FINISH[reason], self._stats(progress),
                             kv_transfer_params=progress.kv_transfer_params)

    def _stats(self, progress: _Progress) -> RequestStats:
        usage = progress.usage or {}
        prompt = _number(usage.get("prompt_tokens"))
        details = usage.get("prompt_tokens_details")
        cached = _number(details.get("cached_tokens")) if isinstance(details, dict) else 0
        metrics = progress.metrics if isinstance(progress.metrics, dict) else {}
        queue_ms, ttft_ms = metrics.get("queue_time_ms"), metrics.get("time_to_first_token_ms")
        stats = RequestStats(computed_prompt_tokens=int(max(0, prompt - cached)),
                             device_hit_tokens=int(cached))
        if isinstance(queue_ms, (int, float)) and isinstance(ttft_ms, (int, float)):
            stats.queue_s, stats.prefill_s = queue_ms / 1e3, ttft_ms / 1e3
            stats.first_token_s = stats.queue_s + stats.prefill_s
        elif progress.first_token is not None:
            stats.first_token_s = progress.first_token - progress.start
        return stats

    async def _check(self, resp: httpx.Response) -> None:
        """4xx: :class:`WorkerRejected` with vLLM's ``error.message``; 5xx: unavailable."""
        if resp.status_code < 400:
            return
        await resp.aread()
        try:
            message = _error_message(resp.json())
        except ValueError:
            message = resp.text[:500]
        if resp.status_code >= 500:
            raise WorkerUnavailable(self.worker_id, f"HTTP {resp.status_code}: {message}")
        raise WorkerRejected(self.worker_id, resp.status_code, message)


def _error_message(obj: Any) -> str:
    """vLLM's ``ErrorResponse`` (``{"error": {"message": ...}}``) or FastAPI's ``detail``."""
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])[:1000]
        if isinstance(err, str):   # its API-key check: {"error": "Unauthorized"}
            return err[:1000]
        if "message" in obj:
            return str(obj["message"])[:1000]
        if "detail" in obj:
            return str(obj["detail"])[:1000]
    return str(obj)[:500]


def _token_id(token: str) -> int:
    if not token.startswith(TOKEN_ID_PREFIX):
        raise ValueError(f"expected {TOKEN_ID_PREFIX}N, got {token!r}")
    return int(token[len(TOKEN_ID_PREFIX):])


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0
