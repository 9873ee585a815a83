"""The OpenAI-compatible request side: pydantic models of the ``/v1/completions`` and
``/v1/chat/completions`` bodies, and what the app takes from them (:class:`RequestOptions`).

The models are the declaration (``/docs`` shows them): types are strict (``"5"`` is not an
integer, ``1e30`` not a boolean), ranges are ``Field`` bounds, every string must be valid
Unicode (a lone UTF-16 surrogate such as ``"\\ud800"`` is refused: it cannot be encoded, so
the tokenizer would fail on it). A JSON ``null`` is an absent field (clients send it for
"not set"), except a completion's ``max_tokens: null``, which means "up to the context".

Fields are treated as vLLM treats them (``vllm/entrypoints/openai/protocol.py``):

- the sampling fields vLLM supports map onto the workers' ``SamplingParams``:
  ``temperature``, ``top_p``, ``top_k`` (``-1`` = off), ``min_p``, ``seed``,
  ``repetition_penalty``, ``frequency_penalty``, ``presence_penalty``, ``min_tokens``,
  ``logit_bias`` (OpenAI's string token-id keys become ints), ``stop_token_ids``,
  ``ignore_eos``, ``logprobs``; ``stop`` and ``include_stop_str_in_output`` are applied by the
  router; ``cache_salt`` salts the prompt's block keys; ``stream_options.include_usage`` and
  ``continuous_usage_stats`` (with ``include_usage``: usage so far in every chunk); chat's
  ``max_completion_tokens`` wins over its deprecated ``max_tokens``; ``return_token_ids``
  adds each choice's generated ids (``token_ids``, per chunk when streamed) as vLLM does;
- fields vLLM knows that this server does not implement (``echo``, ``suffix``, ``best_of``
  other than ``n``, tools, ``response_format`` other than text, guided decoding, beam
  search, ...) are refused with 400 naming the field, unless they hold their neutral value
  (``echo: false``, ``tools: []``);
- fields nobody here knows are ignored, and named in a warning on this module's logger
  (vLLM logs them too); :attr:`ParsedBody.ignored` lists them.

Every refusal is a :class:`~router.http.errors.BadRequest` whose ``param`` names the field
(``messages[0].content``), what OpenAI and vLLM do. Checks that need the model (token ids
within the vocabulary, prompt + ``max_tokens`` within the context, ``min_tokens`` within
``max_tokens``) happen in the app; ``max_tokens=None`` there means "up to the context length".
"""

from __future__ import annotations

import json
import logging
import secrets
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from engine.api.generate import MAX_LOGPROBS, SamplingParams
from router.http.errors import BadRequest

__all__ = [
    "RequestOptions",
    "CompletionRequest",
    "ChatRequest",
    "CompletionBody",
    "ChatBody",
    "TokenizeBody",
    "DetokenizeBody",
    "MAX_N",
    "MAX_STOP_STRINGS",
    "unicode_problem",
]

log = logging.getLogger(__name__)

MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API allows 0..5


# --- field types ---------------------------------------------------------------------------


def unicode_problem(value: Any) -> str | None:
    """Why ``value`` (any JSON value) cannot be encoded as UTF-8, or None: a string holding a
    lone UTF-16 surrogate, which JSON's ``\\ud800`` escapes can produce. Iterative, so any
    nesting the JSON parser accepted is walked without recursion."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError as exc:
                    return (f"holds a lone UTF-16 surrogate ({v[exc.start]!r} at character "
                            f"{exc.start}); send valid Unicode")
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return None


def _valid_unicode(value: Any) -> Any:
    if (problem := unicode_problem(value)) is not None:
        raise ValueError(problem)
    return value


Text = Annotated[str, AfterValidator(_valid_unicode)]
"""A string that is valid Unicode (encodable as UTF-8)."""
JsonValue = Annotated[Any, AfterValidator(_valid_unicode)]
"""Any JSON value whose strings are valid Unicode (handed to the chat template)."""
TokenId = Annotated[int, Field(ge=0)]
Stop = Text | Annotated[list[Text], Field(max_length=MAX_STOP_STRINGS)]


def _same(value: Any, neutral: Any) -> bool:
    """``value == neutral`` without Python's ``False == 0 == 0.0`` mixing: JSON types differ."""
    if isinstance(neutral, bool) or isinstance(value, bool):
        return value is neutral
    if isinstance(neutral, (int, float)):
        return isinstance(value, (int, float)) and value == neutral
    return type(value) is type(neutral) and value == neutral


def _neutral(*neutral: Any) -> AfterValidator:
    """A field vLLM knows and this server does not implement (``Annotated[Any, _neutral(...)]``):
    accepted only at a neutral value (``echo: false``), otherwise the client's 400 naming it."""
    shown = " or ".join(json.dumps(n) for n in neutral)
    why = f"not supported by this server (accepted only as {shown})" if neutral else \
        "not supported by this server"

    def check(value: Any) -> Any:
        if not any(_same(value, n) for n in neutral):
            raise ValueError(why)
        return value

    return AfterValidator(check)


class _Strict(BaseModel):
    """Strict types; unknown fields kept aside (``model_extra``) for the warning."""

    model_config = ConfigDict(strict=True, extra="allow")

    keep_null: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_absent(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k in cls.keep_null}
        return data


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(
        False, description="with include_usage: every chunk carries its choice's usage so far")


class _Common(_Strict):
    """The fields both endpoints share (OpenAI's, then vLLM's extras)."""

    model: Annotated[Text, Field(min_length=1)]
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: Stop | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[Text, float] | None = Field(
        None, description="token id (a decimal string) -> bias in [-100, 100] added to its logit")
    best_of: int | None = Field(None, ge=1, description="accepted only when equal to n")
    response_format: Annotated[Any, _neutral({"type": "text"})] = None
    # vLLM's sampling extras
    top_k: int = Field(0, ge=-1, description="0 or -1: off")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    cache_salt: Annotated[Text, Field(min_length=1)] | None = None
    return_token_ids: bool = False
    # vLLM knows these; this server does not implement them
    use_beam_search: Annotated[Any, _neutral(False)] = None
    length_penalty: Annotated[Any, _neutral(1.0)] = None
    skip_special_tokens: Annotated[Any, _neutral(True)] = None
    spaces_between_special_tokens: Annotated[Any, _neutral(True)] = None
    truncate_prompt_tokens: Annotated[Any, _neutral()] = None
    prompt_logprobs: Annotated[Any, _neutral()] = None
    allowed_token_ids: Annotated[Any, _neutral([])] = None
    bad_words: Annotated[Any, _neutral([])] = None
    guided_json: Annotated[Any, _neutral()] = None
    guided_regex: Annotated[Any, _neutral()] = None
    guided_choice: Annotated[Any, _neutral()] = None
    guided_grammar: Annotated[Any, _neutral()] = None
    guided_decoding_backend: Annotated[Any, _neutral()] = None
    guided_whitespace_pattern: Annotated[Any, _neutral()] = None
    structured_outputs: Annotated[Any, _neutral()] = None
    logits_processors: Annotated[Any, _neutral()] = None
    return_tokens_as_token_ids: Annotated[Any, _neutral(False)] = None
    priority: Annotated[Any, _neutral(0)] = None
    request_id: Annotated[Any, _neutral()] = None
    kv_transfer_params: Annotated[Any, _neutral()] = None
    vllm_xargs: Annotated[Any, _neutral()] = None

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_token_ids(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"keys must be token ids as decimal strings, got {key!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"biases must be in [-100, 100], got {value} for token {key}")
        return bias

    def options(self, max_tokens: int | None, logprobs: int | None) -> RequestOptions:
        """The app's view; the checks that span fields (each naming its field)."""
        if self.best_of is not None and self.best_of != self.n:
            raise BadRequest("'best_of' other than n is not supported", param="best_of")
        if self.stream_options is not None and not self.stream:
            raise BadRequest("'stream_options' is only allowed when 'stream' is true",
                             param="stream_options")
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise BadRequest(f"'min_tokens' ({self.min_tokens}) must not exceed max_tokens "
                             f"({max_tokens})", param="min_tokens")
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        # vLLM: continuous_usage_stats counts only with include_usage
        so = self.stream_options
        include_usage = so is not None and so.include_usage
        continuous_usage = so is not None and so.include_usage and so.continuous_usage_stats
        return RequestOptions(
            model=self.model, max_tokens=max_tokens, temperature=self.temperature,
            top_p=self.top_p, top_k=max(0, self.top_k), seed=self.seed,
            stop=tuple(dict.fromkeys(s for s in stop if s)),
            stop_token_ids=tuple(self.stop_token_ids), ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output, n=self.n,
            stream=self.stream,
            include_usage=include_usage,
            continuous_usage=continuous_usage,
            logprobs=logprobs, user=self.user, cache_salt=self.cache_salt,
            return_token_ids=self.return_token_ids,
            repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
            min_p=self.min_p, min_tokens=self.min_tokens,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
        )


class CompletionBody(_Common):
    """``POST /v1/completions``."""

    keep_null: ClassVar[frozenset[str]] = frozenset({"max_tokens"})

    prompt: Text | list[TokenId] | list[Text | list[TokenId]] = Field(
        description="a string, a list of token ids, or a non-empty list of either")
    max_tokens: int | None = Field(16, ge=1, description="null: up to the context length")
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: Annotated[Any, _neutral(False)] = None
    suffix: Annotated[Any, _neutral("")] = None
    add_special_tokens: Annotated[Any, _neutral(True)] = None
    prompt_embeds: Annotated[Any, _neutral()] = None

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, prompt: Any) -> Any:
        if prompt == "" or prompt == [] or (isinstance(prompt, list)
                                           and any(p == "" or p == [] for p in prompt)):
            raise ValueError("must not be empty")
        return prompt


class TextPart(_Strict):
    type: str = Field(description="only 'text' is supported")
    text: Text | None = None


class ChatMessage(_Strict):
    """One message; other fields (``name``, ``tool_calls``, ...) reach the chat template."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = Field(None, validate_default=True)

    @field_validator("content")
    @classmethod
    def _text_only(cls, content: str | list[TextPart] | None,
                   info: ValidationInfo) -> str | list[TextPart] | None:
        if isinstance(content, list):
            if not all(p.type == "text" and p.text is not None for p in content):
                raise ValueError("only text parts ({\"type\": \"text\", \"text\": ...}) are supported")
        elif content is None and info.data.get("role", "assistant") != "assistant":
            raise ValueError("is required")
        return content

    @model_validator(mode="after")
    def _extras_valid_unicode(self) -> ChatMessage:
        if (problem := unicode_problem(self.model_extra)) is not None:
            raise ValueError(problem)
        return self

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template sees it: text parts joined into one string
        (what vLLM does for string templates), absent content as ""."""
        if isinstance(self.content, list):
            content = "\n".join(p.text or "" for p in self.content)
        else:
            content = self.content or ""
        return {**(self.model_extra or {}), "role": self.role, "content": content}


class ChatBody(_Common):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1, description="deprecated: max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[Text, JsonValue] = Field(default_factory=dict)
    tools: Annotated[Any, _neutral([])] = None
    tool_choice: Annotated[Any, _neutral("none", "auto")] = None
    functions: Annotated[Any, _neutral([])] = None
    function_call: Annotated[Any, _neutral("none", "auto")] = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Annotated[Any, _neutral()] = None
    include_reasoning: bool | None = None
    echo: Annotated[Any, _neutral(False)] = None
    continue_final_message: Annotated[Any, _neutral(False)] = None
    add_special_tokens: Annotated[Any, _neutral(False)] = None
    documents: Annotated[Any, _neutral()] = None
    chat_template: Annotated[Any, _neutral()] = None
    mm_processor_kwargs: Annotated[Any, _neutral({})] = None


class TokenizeBody(_Strict):
    """``POST /tokenize`` (vLLM's): a ``prompt``, or chat ``messages`` rendered by the chat
    template, to token ids. ``add_special_tokens`` defaults as vLLM's: true for a prompt,
    false for messages (the template has them)."""

    model: Annotated[Text, Field(min_length=1)] | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    chat_template_kwargs: dict[Text, JsonValue] = Field(default_factory=dict)
    continue_final_message: Annotated[Any, _neutral(False)] = None
    chat_template: Annotated[Any, _neutral()] = None
    tools: Annotated[Any, _neutral([])] = None

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeBody:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give one of 'prompt' (a string) and 'messages' (a chat)")
        return self

    @classmethod
    def parse(cls, body: Any) -> TokenizeBody:
        req = _validate(cls, body)
        _ignored(req)
        return req


class DetokenizeBody(_Strict):
    """``POST /detokenize`` (vLLM's): token ids back to text."""

    model: Annotated[Text, Field(min_length=1)] | None = None
    tokens: list[TokenId]

    @classmethod
    def parse(cls, body: Any) -> DetokenizeBody:
        req = _validate(cls, body)
        _ignored(req)
        return req


# --- what the app gets -----------------------------------------------------------------------


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
    continuous_usage: bool = False  # usage in every chunk (vLLM's continuous_usage_stats)
    logprobs: int | None = None     # top alternatives per token; None = no logprobs
    user: str | None = None
    cache_salt: str | None = None
    return_token_ids: bool = False  # vLLM's: the generated ids in every choice (and chunk)
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = field(default=None, hash=False)

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
            repetition_penalty=self.repetition_penalty, frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty, min_p=self.min_p,
            min_tokens=min(self.min_tokens, max_tokens), logit_bias=self.logit_bias,
        )


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """``POST /v1/completions``, parsed. ``prompts``: one entry per prompt (a string or token
    ids); choice ``i * n + j`` is sample ``j`` of prompt ``i``."""

    prompts: tuple[str | tuple[int, ...], ...]
    options: RequestOptions
    ignored: tuple[str, ...] = ()

    @classmethod
    def parse(cls, body: Any) -> CompletionRequest:
        req = _validate(CompletionBody, body)
        p: Any = req.prompt
        items: list[Any] = [p] if isinstance(p, str) or isinstance(p[0], int) else p
        prompts = tuple(x if isinstance(x, str) else tuple(x) for x in items)
        return cls(prompts, req.options(req.max_tokens, req.logprobs), _ignored(req))


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """``POST /v1/chat/completions``, parsed. ``messages`` as the chat template takes them."""

    messages: tuple[dict[str, Any], ...]
    options: RequestOptions
    add_generation_prompt: bool = True
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    ignored: tuple[str, ...] = ()

    @classmethod
    def parse(cls, body: Any) -> ChatRequest:
        req = _validate(ChatBody, body)
        if req.top_logprobs is not None and not req.logprobs:
            raise BadRequest("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
        # vLLM's rule: max_completion_tokens when given, else the deprecated max_tokens.
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        return cls(tuple(m.for_template() for m in req.messages), req.options(max_tokens, logprobs),
                   req.add_generation_prompt, dict(req.chat_template_kwargs), _ignored(req))


# --- validation errors -> BadRequest --------------------------------------------------------

_SHAPES = {
    "prompt": "a string, a list of token ids, or a non-empty list of either",
    "stop": f"a string or a list of at most {MAX_STOP_STRINGS} strings",
    "content": "a string or a list of text parts",
}
_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict"})
_warned: set[tuple[str, ...]] = set()


_M = TypeVar("_M", bound=_Strict)


def _validate(model: type[_M], body: Any) -> _M:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        # A union reports every member's failure; a validator's own words say most.
        raise _bad_request(next((e for e in errors if e["type"] == "value_error"), errors[0])) from None


def _bad_request(error: ErrorDetails) -> BadRequest:
    """One pydantic error as OpenAI's 400: ``param`` the field's path (``messages[0].role``),
    cut before pydantic's union-member tags (``prompt.list[int]``)."""
    path: list[str] = []
    union = False
    for part in error["loc"]:
        if isinstance(part, int):
            path.append(f"[{part}]")
        elif part.isidentifier() and not (path and part in _TAGS):
            path.append(("." if path else "") + part)
        else:   # a union member's tag (``list[int]``, ``function-after[...]``) or a dict key
            union = not part.isdigit()
            break
    param = "".join(path) or None
    ctx = error.get("ctx") or {}
    if error["type"] == "value_error" and "error" in ctx:
        message = str(ctx["error"])
    elif union and param is not None:
        shape = _SHAPES.get(param.rsplit(".", 1)[-1])
        message = f"must be {shape}" if shape else error["msg"]
    else:
        message = error["msg"]
    if param is None:
        return BadRequest(message)
    if error["type"] == "missing":
        return BadRequest(f"'{param}' is required", param=param)
    return BadRequest(f"'{param}': {message[:1].lower()}{message[1:]}", param=param)


def _ignored(req: _Strict) -> tuple[str, ...]:
    """The unknown top-level fields (ignored, as vLLM ignores them), logged once per set."""
    names = tuple(sorted(req.model_extra or ()))
    if names:
        level = logging.DEBUG if names in _warned else logging.WARNING
        if len(_warned) < 1024:
            _warned.add(names)
        log.log(level, "request fields ignored (this server does not know them): %s",
                ", ".join(names))
    return names

