"""The OpenAI-compatible request side: parsing and validation of ``/v1/completions`` and
``/v1/chat/completions`` bodies, and OpenAI's error objects.

Every parse failure raises :class:`~router.http.errors.BadRequest` naming the offending field
in ``param`` (what OpenAI and vLLM do), so the app answers ``400 {"error": {"message", "type",
"param", "code"}}``. Fields are read with the worker API's readers (``engine.api.fields``); a
``null`` field is an absent one. Unknown fields are ignored (clients send extras), but fields this server cannot
honour (``echo``, penalties, ``best_of != n``, ``suffix``, tools) are refused rather than
silently dropped. vLLM's extras ``cache_salt``, ``top_k``, ``ignore_eos`` and
``include_stop_str_in_output`` are accepted.

Checks that need the model (prompt + max_tokens within the context) happen in the app, which
knows ``max_model_len``; ``max_tokens=None`` there means "up to the context length".
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from engine.api.fields import (ApiValidationError, is_token_ids, read_bool, read_float, read_int,
                               read_object, read_str, read_token_ids)
from engine.api.generate import MAX_LOGPROBS, SamplingParams
from router.http.errors import BadRequest

__all__ = [
    "RequestOptions",
    "CompletionRequest",
    "ChatRequest",
    "MAX_N",
    "MAX_STOP_STRINGS",
]

MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API allows 0..5


def _nulls_dropped(body: Mapping[str, Any]) -> dict[str, Any]:
    """``body`` without its null fields: clients send ``null`` for "not set"."""
    return {k: v for k, v in body.items() if v is not None}


def _is_token_list(value: Any) -> bool:
    return bool(value) and is_token_ids(value)


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
    model = read_str(body, "model", None)
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
            max_tokens = read_int(body, key, None, lo=1)
            break
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise BadRequest("'stop' must be a string or a list of strings", param="stop")
        if len(stop) > MAX_STOP_STRINGS:
            raise BadRequest(f"'stop' takes at most {MAX_STOP_STRINGS} strings", param="stop")
    stop_ids = read_token_ids(body, "stop_token_ids", [])
    n = read_int(body, "n", 1, lo=1, hi=MAX_N)
    best_of = read_int(body, "best_of", None, lo=1)
    if best_of is not None and best_of != n:
        raise BadRequest("'best_of' other than n is not supported", param="best_of")
    stream = read_bool(body, "stream", False)
    stream_options = read_object(body, "stream_options", None)
    if stream_options is not None and not stream:
        raise BadRequest("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    include_usage = read_bool(_nulls_dropped(stream_options or {}), "include_usage", False,
                              where="stream_options.")
    cache_salt = read_str(body, "cache_salt", None)
    if cache_salt == "":
        raise BadRequest("'cache_salt' must not be empty", param="cache_salt")
    return RequestOptions(
        model=model, max_tokens=max_tokens,
        temperature=read_float(body, "temperature", 1.0, lo=0.0, hi=2.0),
        top_p=read_float(body, "top_p", 1.0, lo=1e-9, hi=1.0),
        top_k=max(0, read_int(body, "top_k", 0, lo=-1)),  # vLLM's -1 = disabled = our 0
        seed=read_int(body, "seed", None, lo=-(2**63), hi=2**64 - 1),
        stop=tuple(dict.fromkeys(s for s in (stop or []) if s)),
        stop_token_ids=tuple(stop_ids),
        ignore_eos=read_bool(body, "ignore_eos", False),
        include_stop_str_in_output=read_bool(body, "include_stop_str_in_output", False),
        n=n, stream=stream, include_usage=include_usage, logprobs=logprobs,
        user=read_str(body, "user", None), cache_salt=cache_salt,
    )


def _body(body: Any) -> dict[str, Any]:
    if not isinstance(body, Mapping):
        raise BadRequest("the request body must be a JSON object")
    return _nulls_dropped(body)


@contextmanager
def _fields() -> Iterator[None]:
    """A field the readers refuse is the client's 400, naming the field."""
    try:
        yield
    except ApiValidationError as exc:
        raise BadRequest(str(exc), param=exc.field) from None


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """``POST /v1/completions``. ``prompts``: one entry per prompt (a string or token ids);
    choice ``i * n + j`` is sample ``j`` of prompt ``i``."""

    prompts: tuple[str | tuple[int, ...], ...]
    options: RequestOptions

    @classmethod
    def parse(cls, body: Any) -> CompletionRequest:
        with _fields():
            return cls._parse(body)

    @classmethod
    def _parse(cls, raw: Any) -> CompletionRequest:
        body = _body(raw)
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
        logprobs = read_int(body, "logprobs", None, lo=0, hi=MAX_COMPLETION_LOGPROBS)
        options = _options(body, ("max_tokens",), logprobs)
        if options.max_tokens is None and "max_tokens" not in raw:   # null: up to the context
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
        with _fields():
            return cls._parse(_body(body))

    @classmethod
    def _parse(cls, body: dict[str, Any]) -> ChatRequest:
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            raise BadRequest("'messages' must be a non-empty list of messages", param="messages")
        messages = tuple(_message(m, i) for i, m in enumerate(raw))
        want = read_bool(body, "logprobs", False)
        top = read_int(body, "top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
        if top is not None and not want:
            raise BadRequest("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
        options = _options(body, ("max_completion_tokens", "max_tokens"), (top or 0) if want else None)
        kwargs = read_object(body, "chat_template_kwargs", {})
        return cls(messages, options, read_bool(body, "add_generation_prompt", True), dict(kwargs))


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
