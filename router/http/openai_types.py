"""The OpenAI-compatible request side: parsing and validation of ``/v1/completions`` and
``/v1/chat/completions`` bodies, and OpenAI's error objects.

Every parse failure raises :class:`BadRequest` naming the offending field in ``param`` (what
OpenAI and vLLM do), so the app answers ``400 {"error": {"message", "type", "param",
"code"}}``. Other statuses: :class:`ModelNotFound` (404), :class:`Unauthorized` (401),
:class:`TooManyRequests` (429, admission control), :class:`ServiceUnavailable` (503, no
worker). Unknown fields are ignored (clients send extras), but fields this server cannot
honour (``echo``, penalties, ``best_of != n``, ``suffix``, tools) are refused rather than
silently dropped. vLLM's extras ``cache_salt``, ``top_k``, ``ignore_eos`` and
``include_stop_str_in_output`` are accepted.

Checks that need the model (prompt + max_tokens within the context) happen in the app, which
knows ``max_model_len``; ``max_tokens=None`` there means "up to the context length".
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from engine.api.generate import MAX_LOGPROBS, SamplingParams

__all__ = [
    "OpenAIError",
    "BadRequest",
    "Unauthorized",
    "ModelNotFound",
    "TooManyRequests",
    "ServiceUnavailable",
    "RequestOptions",
    "CompletionRequest",
    "ChatRequest",
    "MAX_N",
    "MAX_STOP_STRINGS",
]

MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API allows 0..5


class OpenAIError(Exception):
    """An error answered in OpenAI's shape with HTTP ``status``."""

    status = 500
    type = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code

    def to_json(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class BadRequest(OpenAIError):
    status, type = 400, "invalid_request_error"


class Unauthorized(OpenAIError):
    status, type = 401, "invalid_request_error"

    def __init__(self, message: str = "invalid or missing API key (Authorization: Bearer <key>)") -> None:
        super().__init__(message, code="invalid_api_key")


class ModelNotFound(OpenAIError):
    status, type = 404, "invalid_request_error"

    def __init__(self, model: str, served: list[str]) -> None:
        super().__init__(f"the model {model!r} does not exist; this server serves {served}",
                         param="model", code="model_not_found")


class TooManyRequests(OpenAIError):
    status, type = 429, "rate_limit_error"


class ServiceUnavailable(OpenAIError):
    status, type = 503, "service_unavailable"


# --- field readers -----------------------------------------------------------------------------


def _get(body: Mapping[str, Any], key: str, kind: type | tuple[type, ...], default: Any,
         what: str) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise BadRequest(f"'{key}' must be {what}, got {value!r}", param=key)
    if not isinstance(value, kind):
        raise BadRequest(f"'{key}' must be {what}, got {value!r}", param=key)
    return value


def _number(body: Mapping[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    value = float(_get(body, key, (int, float), default, "a number"))
    if not math.isfinite(value) or not lo <= value <= hi:
        raise BadRequest(f"'{key}' must be between {lo} and {hi}, got {value}", param=key)
    return value


def _integer(body: Mapping[str, Any], key: str, default: Any, lo: int, hi: int | None = None) -> Any:
    value = _get(body, key, int, default, "an integer")
    if value is not None and (value < lo or (hi is not None and value > hi)):
        rng = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise BadRequest(f"'{key}' must be {rng}, got {value}", param=key)
    return value


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        type(t) is int and 0 <= t < 2**32 for t in value
    )


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """What both endpoints share: sampling, stop strings, fan-out and streaming."""

    model: str
    max_tokens: int | None          # None: up to the context length (the app decides)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None     # top alternatives per token; None = no logprobs
    user: str | None = None
    cache_salt: str | None = None

    def sampling(self, max_tokens: int, choice: int = 0) -> SamplingParams:
        """The worker's sampling params for choice ``choice`` of ``n``: each choice gets its
        own seed (``seed + choice``) so ``n > 1`` samples differ yet stay reproducible.

        A request without a seed gets a random one here, at the router, so that every worker
        a choice touches (prefill, decode, a resume after a failure) samples from the same
        ``(seed, position)`` stream and a continued request samples what it would have."""
        seed = secrets.randbits(63) if self.seed is None else self.seed + choice
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, seed=seed, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, logprobs=self.logprobs,
        )


def _options(body: Mapping[str, Any], max_tokens_keys: tuple[str, ...],
             logprobs: int | None) -> RequestOptions:
    model = _get(body, "model", str, None, "a string")
    if not model:
        raise BadRequest("'model' is required", param="model")
    for key, neutral in (("presence_penalty", 0), ("frequency_penalty", 0)):
        if body.get(key) not in (None, neutral):
            raise BadRequest(f"'{key}' is not supported by this server", param=key)
    for key in ("tools", "functions", "response_format", "logit_bias", "suffix"):
        if body.get(key):
            raise BadRequest(f"'{key}' is not supported by this server", param=key)
    max_tokens = None
    for key in max_tokens_keys:
        if body.get(key) is not None:
            max_tokens = _integer(body, key, None, 1)
            break
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise BadRequest("'stop' must be a string or a list of strings", param="stop")
        if len(stop) > MAX_STOP_STRINGS:
            raise BadRequest(f"'stop' takes at most {MAX_STOP_STRINGS} strings", param="stop")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(type(t) is int and t >= 0 for t in stop_ids):
        raise BadRequest("'stop_token_ids' must be a list of token ids", param="stop_token_ids")
    n = _integer(body, "n", 1, 1, MAX_N)
    best_of = _integer(body, "best_of", None, 1)
    if best_of is not None and best_of != n:
        raise BadRequest("'best_of' other than n is not supported", param="best_of")
    stream = _get(body, "stream", bool, False, "a boolean")
    stream_options = _get(body, "stream_options", dict, None, "an object")
    if stream_options is not None and not stream:
        raise BadRequest("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    include_usage = _get(stream_options or {}, "include_usage", bool, False, "a boolean")
    cache_salt = _get(body, "cache_salt", str, None, "a string")
    if cache_salt == "":
        raise BadRequest("'cache_salt' must not be empty", param="cache_salt")
    return RequestOptions(
        model=model, max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        top_k=max(0, _integer(body, "top_k", 0, -1)),  # vLLM's -1 = disabled = our 0
        seed=_integer(body, "seed", None, -(2**63), 2**64 - 1),
        stop=tuple(dict.fromkeys(s for s in (stop or []) if s)),
        stop_token_ids=tuple(stop_ids),
        ignore_eos=_get(body, "ignore_eos", bool, False, "a boolean"),
        include_stop_str_in_output=_get(body, "include_stop_str_in_output", bool, False, "a boolean"),
        n=n, stream=stream, include_usage=include_usage, logprobs=logprobs,
        user=_get(body, "user", str, None, "a string"), cache_salt=cache_salt,
    )


def _body(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise BadRequest("the request body must be a JSON object")
    return body


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """``POST /v1/completions``. ``prompts``: one entry per prompt (a string or token ids);
    choice ``i * n + j`` is sample ``j`` of prompt ``i``."""

    prompts: tuple[str | tuple[int, ...], ...]
    options: RequestOptions

    @classmethod
    def parse(cls, body: Any) -> CompletionRequest:
        body = _body(body)
        if body.get("echo"):
            raise BadRequest("'echo' is not supported by this server", param="echo")
        prompt = body.get("prompt")
        if isinstance(prompt, str) or _is_token_list(prompt):
            prompts: list[Any] = [prompt]
        elif isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or _is_token_list(p) for p in prompt
        ):
            prompts = prompt
        else:
            raise BadRequest(
                "'prompt' must be a string, a list of token ids, or a non-empty list of either",
                param="prompt",
            )
        if any(p == "" for p in prompts):
            raise BadRequest("'prompt' must not be empty", param="prompt")
        logprobs = _integer(body, "logprobs", None, 0, MAX_COMPLETION_LOGPROBS)
        options = _options(body, ("max_tokens",), logprobs)
        if options.max_tokens is None and "max_tokens" not in body:
            options = replace(options, max_tokens=16)  # OpenAI's default for completions
        return cls(tuple(p if isinstance(p, str) else tuple(p) for p in prompts), options)


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """``POST /v1/chat/completions``. ``messages`` are normalized for the chat template:
    text content parts are joined into one string (what vLLM does for string templates)."""

    messages: tuple[dict[str, Any], ...]
    options: RequestOptions
    add_generation_prompt: bool = True
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, body: Any) -> ChatRequest:
        body = _body(body)
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            raise BadRequest("'messages' must be a non-empty list of messages", param="messages")
        messages = tuple(_message(m, i) for i, m in enumerate(raw))
        want = _get(body, "logprobs", bool, False, "a boolean")
        top = _integer(body, "top_logprobs", None, 0, MAX_LOGPROBS)
        if top is not None and not want:
            raise BadRequest("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
        options = _options(body, ("max_completion_tokens", "max_tokens"), (top or 0) if want else None)
        kwargs = _get(body, "chat_template_kwargs", dict, {}, "an object")
        return cls(messages, options, _get(body, "add_generation_prompt", bool, True, "a boolean"),
                   dict(kwargs))


def _message(m: Any, i: int) -> dict[str, Any]:
    param = f"messages[{i}]"
    if not isinstance(m, Mapping):
        raise BadRequest(f"{param} must be an object with 'role' and 'content'", param=param)
    role = m.get("role")
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise BadRequest(f"{param}.role must be system, developer, user, assistant or tool, got {role!r}",
                         param=f"{param}.role")
    content = m.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, Mapping) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise BadRequest(f"{param}.content: only text parts are supported", param=f"{param}.content")
            texts.append(part["text"])
        content = "\n".join(texts)
    elif content is not None and not isinstance(content, str):
        raise BadRequest(f"{param}.content must be a string or a list of text parts",
                         param=f"{param}.content")
    if content is None and role != "assistant":
        raise BadRequest(f"{param}.content is required", param=f"{param}.content")
    out = {k: v for k, v in m.items() if isinstance(k, str) and v is not None}
    out["content"] = content if content is not None else ""
    return out
