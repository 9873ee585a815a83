"""The OpenAI-compatible response side: bodies, SSE chunks, usage and logprobs.

One :class:`ResponseFormatter` per request fixes the id, ``created`` and model, and the kind
(``"completion"`` → ``text_completion`` objects, ``"chat"`` → ``chat.completion[.chunk]``),
so the app only says *what* happened (text for choice i, a finish, usage). Shapes follow the
OpenAI API reference, which the official ``openai`` client parses:

- completions: ``choices[i] = {index, text, logprobs, finish_reason}``; logprobs in the legacy
  shape ``{tokens, token_logprobs, top_logprobs, text_offset}``.
- chat: ``choices[i] = {index, message: {role, content}, logprobs, finish_reason}``; stream
  deltas start with ``{"role": "assistant", "content": ""}``; logprobs are
  ``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``.
- streams are ``data: <json>\\n\\n`` events ending with ``data: [DONE]``; with
  ``stream_options.include_usage`` a last chunk carries ``usage`` and empty ``choices``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from engine.api.generate import TokenLogprob
from engine.api.tokenizer import Tokenizer

__all__ = ["ResponseFormatter", "sse", "SSE_DONE", "usage_json", "ResponseKind"]

ResponseKind = Literal["completion", "chat"]
SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def usage_json(prompt_tokens: int, completion_tokens: int,
               cached_tokens: int | None = None) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return usage


def _with_ids(choice: dict[str, Any], token_ids: Sequence[int] | None) -> dict[str, Any]:
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    return choice


class ResponseFormatter:
    """Builds one request's response objects (see the module docstring)."""

    def __init__(self, kind: ResponseKind, model: str, tokenizer: Tokenizer,
                 request_id: str | None = None) -> None:
        self.kind = kind
        self.model = model
        self._tok = tokenizer
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        self.id = request_id or prefix + uuid.uuid4().hex
        self.created = int(time.time())
        self._object = "chat.completion" if kind == "chat" else "text_completion"

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    # --- whole responses ------------------------------------------------------------------

    def response(self, choices: Sequence[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
        """The non-streaming body; ``choices`` from :meth:`choice`."""
        body = self._envelope(self._object, sorted(choices, key=lambda c: c["index"]))
        body["usage"] = usage
        if self.kind == "completion":
            body["system_fingerprint"] = None
        return body

    def choice(self, index: int, text: str, finish_reason: str | None,
               logprobs: dict[str, Any] | None = None, token_ids: Sequence[int] | None = None
               ) -> dict[str, Any]:
        """``token_ids`` (vLLM's ``return_token_ids``): the generated ids, when given."""
        if self.kind == "chat":
            out = {"index": index, "message": {"role": "assistant", "content": text},
                   "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            out = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return _with_ids(out, token_ids)

    # --- stream chunks --------------------------------------------------------------------

    def role_chunk(self, index: int) -> dict[str, Any]:
        """The first chunk of a chat choice (``delta.role``); completions have none."""
        return self._envelope("chat.completion.chunk", [
            {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
             "finish_reason": None}])

    def chunk(self, index: int, text: str, finish_reason: str | None = None,
              logprobs: dict[str, Any] | None = None, token_ids: Sequence[int] | None = None
              ) -> dict[str, Any]:
        """``token_ids``: this chunk's generated ids, when given (as :meth:`choice`)."""
        if self.kind == "chat":
            delta = {"content": text} if text or finish_reason is None else {}
            return self._envelope("chat.completion.chunk", [_with_ids(
                {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason},
                token_ids)])
        return self._envelope("text_completion", [_with_ids(
            {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}, token_ids)])

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body = self._envelope(obj, [])
        body["usage"] = usage
        return body

    # --- logprobs -------------------------------------------------------------------------

    def logprobs(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob],
                 text_offset: int = 0) -> dict[str, Any]:
        """Logprobs of these output tokens in this kind's shape. ``text_offset``: where the
        first token's text starts in the choice's text (completions only)."""
        if self.kind == "chat":
            return {"content": [self._chat_entry(t, lp) for t, lp in zip(token_ids, logprobs, strict=True)]}
        tokens = [self._token_text(t) for t in token_ids]
        offsets = []
        for text in tokens:
            offsets.append(text_offset)
            text_offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{self._token_text(t): v for t, v in lp.top} for lp in logprobs],
            "text_offset": offsets,
        }

    def _chat_entry(self, token_id: int, lp: TokenLogprob) -> dict[str, Any]:
        text = self._token_text(token_id)
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {"token": (s := self._token_text(t)), "logprob": v, "bytes": list(s.encode("utf-8"))}
                    for t, v in lp.top]}

    def _token_text(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)
