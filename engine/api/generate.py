"""Request and stream types of the worker HTTP API (torch-free; shared with the router).

The wire format is JSON; streams are NDJSON (one object a line). Every type has
``to_json() -> dict`` (a JSON-ready dict, exactly what goes on the wire) and
``from_json(obj) -> instance`` that validates and raises :class:`ApiValidationError` naming the
offending field. Block keys travel as 32-character hex strings and are :class:`BlockKey` here.

- ``POST /generate``: body :class:`GenerateRequest`; answer: NDJSON :class:`GenerateChunk`
  lines, then one :class:`GenerateFinal` (``{"finished": true, ...}``), whose ``stats`` is a
  :class:`RequestStats` (its docstring says what each figure is). Use
  :func:`parse_generate_line` to tell them apart.
- ``GET /info``: :class:`WorkerInfo` (also the worker's etcd value, see docs/architecture.md).
- ``GET /events`` and ``GET /snapshot``: their types are in ``engine.api.events``.
- Every call may carry ``X-KV-Worker-Id`` (:data:`WORKER_ID_HEADER`): the worker it is meant
  for. Another worker answers 421 (a registration that outlived its worker, whose port a
  replacement now holds).

A token's logprob on the wire is ``{"logprob": float, "top": [[token_id, logprob], ...]}``
(``top`` holds the ``sampling.logprobs`` most likely tokens, best first; empty when 0).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from engine.api.fields import (
    ApiValidationError,
    json_object,
    read_bool,
    read_figures,
    read_float,
    read_int,
    read_keys,
    read_object,
    read_str,
    read_token_ids,
)
from kvstore.keys import BlockKey

__all__ = [
    "ApiValidationError",
    "Phase",
    "FinishReason",
    "WorkerRole",
    "WorkerEngine",
    "SamplingParams",
    "GenerateRequest",
    "TokenLogprob",
    "GenerateChunk",
    "RequestStats",
    "GenerateFinal",
    "parse_generate_line",
    "WorkerInfo",
    "WORKER_ID_HEADER",
]

WORKER_ID_HEADER = "X-KV-Worker-Id"

Phase = Literal["prefill", "decode", "full"]
FinishReason = Literal["stop", "length", "abort"]
WorkerRole = Literal["prefill", "decode", "colocated"]
WorkerEngine = Literal["kvengine", "vllm"]
PHASES: tuple[str, ...] = ("prefill", "decode", "full")
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")
WORKER_ROLES: tuple[str, ...] = ("prefill", "decode", "colocated")
WORKER_ENGINES: tuple[str, ...] = ("kvengine", "vllm")
MAX_LOGPROBS = 20


# --- POST /generate --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample. ``temperature == 0`` is greedy. ``top_k == 0`` disables top-k.

    Randomness is a function of ``(seed, position)``, so a request continued on another worker
    samples the same tokens; ``seed=None`` lets the worker pick one. ``logprobs``: None for no
    logprobs, otherwise the number of top alternatives to report per token (0..20).

    Logits processors (``engine.core.sampling`` has the order and the exact definitions; every
    default is "off" and costs nothing):

    - ``repetition_penalty`` (> 0, 1 = off): transformers' / vLLM's, over prompt + output.
    - ``frequency_penalty``, ``presence_penalty`` (each in [-2, 2]): OpenAI's / vLLM's, over
      output tokens only.
    - ``min_p`` (in [0, 1]): drop tokens less likely than ``min_p`` times the best one.
    - ``min_tokens`` (0 .. ``max_tokens``): the stop ids (EOS unless ``ignore_eos``, and
      ``stop_token_ids``) cannot be sampled before that many output tokens exist.
    - ``logit_bias``: token id -> bias in [-100, 100] added to its logit (ids are checked
      against the vocabulary by the worker); on the wire a JSON object with decimal-string keys.

    "Output tokens" include ``GenerateRequest.output_token_ids`` (tokens produced elsewhere),
    so a request continued on another worker is penalized exactly as if it had not moved.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        # Validate constructed instances exactly as parsed ones are (and keep them alike: the
        # tuple, a private copy of the bias map, an empty map as None).
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _read_logit_bias(
            {"logit_bias": _bias_to_json(self.logit_bias)}, "sampling."))
        SamplingParams.from_json(self.to_json())

    @property
    def uses_processors(self) -> bool:
        """Whether any logits processor that acts before temperature is on (penalties,
        ``min_tokens``, ``logit_bias``): a row without them skips that work entirely."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0 or self.min_tokens > 0
                or self.logit_bias is not None)

    def to_json(self) -> dict[str, Any]:
        return {
            "max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
            "top_k": self.top_k, "seed": self.seed, "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos, "logprobs": self.logprobs,
            "repetition_penalty": self.repetition_penalty,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty, "min_p": self.min_p,
            "min_tokens": self.min_tokens, "logit_bias": _bias_to_json(self.logit_bias),
        }

    @classmethod
    def from_json(cls, obj: Any) -> SamplingParams:
        w = "sampling."
        obj = json_object(obj, "sampling")
        logprobs = read_int(obj, "logprobs", None, lo=0, where=w)
        if logprobs is not None and logprobs > MAX_LOGPROBS:
            raise ApiValidationError(w + "logprobs", f"must be <= {MAX_LOGPROBS}, got {logprobs}")
        params = object.__new__(cls)
        for name, value in (
            ("max_tokens", read_int(obj, "max_tokens", 16, lo=1, where=w)),
            ("temperature", read_float(obj, "temperature", 1.0, lo=0.0, where=w)),
            ("top_p", read_float(obj, "top_p", 1.0, lo=0.0, hi=1.0, where=w)),
            ("top_k", read_int(obj, "top_k", 0, lo=0, where=w)),
            ("seed", read_int(obj, "seed", None, where=w)),
            ("stop_token_ids", tuple(read_token_ids(obj, "stop_token_ids", [], where=w))),
            ("ignore_eos", read_bool(obj, "ignore_eos", False, where=w)),
            ("logprobs", logprobs),
            ("repetition_penalty", read_float(obj, "repetition_penalty", 1.0, lo=0.0, where=w)),
            ("frequency_penalty", read_float(obj, "frequency_penalty", 0.0, lo=-2.0, hi=2.0, where=w)),
            ("presence_penalty", read_float(obj, "presence_penalty", 0.0, lo=-2.0, hi=2.0, where=w)),
            ("min_p", read_float(obj, "min_p", 0.0, lo=0.0, hi=1.0, where=w)),
            ("min_tokens", read_int(obj, "min_tokens", 0, lo=0, where=w)),
            ("logit_bias", _read_logit_bias(obj, w)),
        ):
            object.__setattr__(params, name, value)
        if params.top_p == 0.0:
            raise ApiValidationError(w + "top_p", "must be > 0")
        if params.repetition_penalty == 0.0:
            raise ApiValidationError(w + "repetition_penalty", "must be > 0")
        if params.min_tokens > params.max_tokens:
            raise ApiValidationError(w + "min_tokens", f"must be <= max_tokens "
                                     f"({params.max_tokens}), got {params.min_tokens}")
        return params


MAX_LOGIT_BIAS = 100.0


def _bias_to_json(bias: dict[int, float] | None) -> dict[str, float] | None:
    return None if bias is None else {str(t): b for t, b in bias.items()}


def _read_logit_bias(obj: Any, where: str) -> dict[int, float] | None:
    """``logit_bias``: a JSON object of token id (a decimal string) -> bias in [-100, 100];
    null, absent or empty is None."""
    name = where + "logit_bias"
    raw = read_object(obj, "logit_bias", None, where=where)
    if not raw:
        return None
    out: dict[int, float] = {}
    for key in raw:
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and int(key) < 2**32):
            raise ApiValidationError(name, f"keys must be token ids (decimal strings of integers "
                                     f"in [0, 2**32)), got {key!r}")
        out[int(key)] = read_float(raw, key, lo=-MAX_LOGIT_BIAS, hi=MAX_LOGIT_BIAS, where=name + ".")
    return out


@dataclass(slots=True)
class GenerateRequest:
    """``POST /generate``. ``output_token_ids`` are tokens already produced elsewhere (a
    prefill→decode handoff or a resume after a failure); the worker continues after them and
    counts them against ``sampling.max_tokens``.

    ``block_keys`` (optional; hex on the wire): the keys of the prompt's full blocks as the
    prefill worker computed them (its final line's ``block_keys``). A worker given them checks
    they equal its own keys for ``prompt_token_ids`` under its namespace salted by
    ``cache_salt`` and refuses the request (HTTP 409) otherwise: the two workers disagree on
    the model or the KV layout, and loading the other's blocks would be wrong.

    ``kv_source`` (optional): the store node the prefill handed the prompt's blocks to (its
    final line's ``kv_node``); the worker reads them from that node first, the rest from
    their owners (``engine.kv.handoff``).

    ``kv_transfer_params`` (optional, a JSON object): a vLLM prefill's ``kv_transfer_params``
    (its final line's), handed to a vLLM decode as they are; our workers ignore them."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    output_token_ids: list[int] = field(default_factory=list)
    cache_salt: str | None = None
    phase: Phase = "full"
    block_keys: list[BlockKey] | None = None
    kv_source: str | None = None
    kv_transfer_params: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        out = {
            "request_id": self.request_id, "prompt_token_ids": self.prompt_token_ids,
            "output_token_ids": self.output_token_ids, "sampling": self.sampling.to_json(),
            "cache_salt": self.cache_salt, "phase": self.phase,
            "block_keys": None if self.block_keys is None else [k.hex() for k in self.block_keys],
            "kv_source": self.kv_source,
        }
        if self.kv_transfer_params is not None:
            out["kv_transfer_params"] = self.kv_transfer_params
        return out

    @classmethod
    def from_json(cls, obj: Any) -> GenerateRequest:
        obj = json_object(obj, "body")
        request_id = read_str(obj, "request_id")
        if not request_id:
            raise ApiValidationError("request_id", "must not be empty")
        prompt = read_token_ids(obj, "prompt_token_ids")
        if not prompt:
            raise ApiValidationError("prompt_token_ids", "must not be empty")
        return cls(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling=SamplingParams.from_json(obj.get("sampling", {})),
            output_token_ids=read_token_ids(obj, "output_token_ids", []),
            cache_salt=read_str(obj, "cache_salt", None),
            phase=read_str(obj, "phase", "full", choices=PHASES),
            block_keys=read_keys(obj, "block_keys", optional=True),
            kv_source=read_str(obj, "kv_source", None) or None,
            kv_transfer_params=_read_params(obj),
        )


def _read_params(obj: Mapping[str, Any]) -> dict[str, Any] | None:
    """``kv_transfer_params``: absent, null, or a JSON object passed on as it is."""
    raw = obj.get("kv_transfer_params")
    if raw is not None and not isinstance(raw, dict):
        raise ApiValidationError("kv_transfer_params", f"expected an object, got {type(raw).__name__}")
    return raw


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The sampled token's logprob and the top alternatives as ``(token_id, logprob)``."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"logprob": self.logprob, "top": [[t, lp] for t, lp in self.top]}

    @classmethod
    def from_json(cls, obj: Any) -> TokenLogprob:
        obj = json_object(obj, "logprobs[]")
        lp = obj.get("logprob")
        if isinstance(lp, bool) or not isinstance(lp, (int, float)):
            raise ApiValidationError("logprobs[].logprob", f"expected a number, got {lp!r}")
        try:
            top = tuple((int(t), float(v)) for t, v in obj.get("top", ()))
        except (TypeError, ValueError):
            raise ApiValidationError("logprobs[].top", "expected [[token_id, logprob], ...]") from None
        return cls(float(lp), top)


@dataclass(slots=True)
class GenerateChunk:
    """One stream line: new tokens (usually one), with their logprobs when asked for."""

    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"token_ids": self.token_ids}
        if self.logprobs is not None:
            out["logprobs"] = [lp.to_json() for lp in self.logprobs]
        return out

    @classmethod
    def from_json(cls, obj: Any) -> GenerateChunk:
        obj = json_object(obj, "chunk")
        ids = read_token_ids(obj, "token_ids")
        raw = obj.get("logprobs")
        if raw is None:
            return cls(ids)
        if not isinstance(raw, list) or len(raw) != len(ids):
            raise ApiValidationError("logprobs", "expected one entry per token id")
        return cls(ids, [TokenLogprob.from_json(x) for x in raw])


@dataclass(slots=True)
class RequestStats:
    """What one request did on one worker, in its final line's ``stats`` (tokens, bytes, seconds).

    How its prompt was served (its initial tokens: the prompt, plus any output tokens it
    arrived with): ``computed_prompt_tokens`` the worker computed, ``device_hit_tokens`` found
    in its own prefix cache, ``store_hit_tokens`` loaded from the store. What moved:
    ``kv_bytes_loaded`` from the store in ``store_load_s`` busy seconds, ``kv_bytes_saved`` to
    it in ``store_save_s``. When: ``queue_s`` (arrival to first scheduled), ``prefill_s``
    (first scheduled to first token, the store loads it waited on included), ``first_token_s``
    (arrival to first token). Token counters sum over admissions (a preempted request is
    admitted again). These names are the same everywhere the facts appear: the engine's
    ``RequestProgress``, the router's request log (``prefill_stats``, ``decode_stats``, each
    phase's ``stats``) and the benchmarks that read it."""

    computed_prompt_tokens: int = 0
    device_hit_tokens: int = 0
    store_hit_tokens: int = 0
    kv_bytes_loaded: int = 0
    kv_bytes_saved: int = 0
    store_load_s: float = 0.0
    store_save_s: float = 0.0
    queue_s: float = 0.0
    prefill_s: float = 0.0
    first_token_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Any) -> RequestStats:
        return cls(**read_figures(cls, json_object(obj, "stats"), "stats."))

    @classmethod
    def total(cls, stats: Iterable[RequestStats]) -> RequestStats:
        """Every field summed over ``stats`` (zeros when there is none)."""
        out = cls()
        for s in stats:
            for f in fields(cls):
                setattr(out, f.name, getattr(out, f.name) + getattr(s, f.name))
        return out


@dataclass(slots=True)
class GenerateFinal:
    """The last stream line: why the request ended, and its stats.

    ``block_keys`` (a ``phase="prefill"`` request's final line only; hex on the wire): the keys
    of the prompt's full blocks, every one of them acknowledged by the store. The router
    passes them on in the decode request (``GenerateRequest.block_keys``).

    ``kv_node`` (a prefill's final line, when it handed its blocks off): the store node that
    holds them, passed on as the decode request's ``kv_source``.

    ``kv_transfer_params`` (a vLLM prefill's final line): what vLLM returned for its decode,
    passed on as the decode request's ``kv_transfer_params``."""

    finish_reason: FinishReason
    stats: RequestStats = field(default_factory=RequestStats)
    block_keys: list[BlockKey] | None = None
    kv_node: str | None = None
    kv_transfer_params: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"finished": True, "finish_reason": self.finish_reason, "stats": self.stats.to_json()}
        if self.block_keys is not None:
            out["block_keys"] = [k.hex() for k in self.block_keys]
        if self.kv_node is not None:
            out["kv_node"] = self.kv_node
        if self.kv_transfer_params is not None:
            out["kv_transfer_params"] = self.kv_transfer_params
        return out

    @classmethod
    def from_json(cls, obj: Any) -> GenerateFinal:
        obj = json_object(obj, "final")
        return cls(
            finish_reason=read_str(obj, "finish_reason", choices=FINISH_REASONS),
            stats=RequestStats.from_json(obj.get("stats", {})),
            block_keys=read_keys(obj, "block_keys", optional=True),
            kv_node=read_str(obj, "kv_node", None) or None,
            kv_transfer_params=_read_params(obj),
        )


def parse_generate_line(obj: Any) -> GenerateChunk | GenerateFinal:
    """One decoded NDJSON line of a ``/generate`` stream."""
    obj = json_object(obj, "line")
    return GenerateFinal.from_json(obj) if obj.get("finished") else GenerateChunk.from_json(obj)


# --- GET /info (and the worker's etcd value) -------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What a worker is: ``GET /info`` is ``to_json()``; its etcd value under
    ``/{cluster}/workers/{worker_id}`` is ``to_etcd_value()``, the same without ``worker_id``
    (the key names it), read back with ``from_etcd_value``.

    ``draining``: the worker is changing its role (``POST /role``) and finishes what it holds
    before it registers the new one; the router sends it no new work meanwhile. On the wire
    only while true (``"draining": true``), so other values are as before.

    ``engine``: what serves at ``address``: ``"kvengine"`` (ours, this API) or ``"vllm"`` (a vLLM
    OpenAI server, registered by its KV connector: ``kvstore.integrations.vllm``), whose KV
    events the router follows at ``kv_events`` (vLLM's ZMQ publisher, with its replay socket at
    ``kv_events_replay``). On the wire only when not ours."""

    worker_id: str
    address: str                # "http://host:port"
    role: WorkerRole
    model: str
    namespace: BlockKey         # the model's namespace id (hex on the wire)
    block_size: int
    kv_capacity_blocks: int
    max_model_len: int
    draining: bool = False
    engine: WorkerEngine = "kvengine"
    kv_events: str | None = None
    kv_events_replay: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "worker_id": self.worker_id, "address": self.address, "role": self.role,
            "model": self.model, "namespace": self.namespace.hex(), "block_size": self.block_size,
            "kv_capacity_blocks": self.kv_capacity_blocks, "max_model_len": self.max_model_len,
        }
        if self.draining:
            out["draining"] = True
        if self.engine != "kvengine":
            out["engine"] = self.engine
        for name in ("kv_events", "kv_events_replay"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    def to_etcd_value(self) -> dict[str, Any]:
        """The worker's registration value (``to_json()`` less ``worker_id``, which the key holds)."""
        out = self.to_json()
        del out["worker_id"]
        return out

    @classmethod
    def from_etcd_value(cls, worker_id: str, value: Any) -> WorkerInfo:
        """Parse a registration value; ``worker_id`` is the last part of its key."""
        return cls.from_json(value, worker_id=worker_id)

    @classmethod
    def from_json(cls, obj: Any, worker_id: str | None = None) -> WorkerInfo:
        """Parse ``/info`` (or, with ``worker_id``, an etcd value: see ``from_etcd_value``)."""
        obj = json_object(obj, "worker")
        wid = worker_id if worker_id is not None else read_str(obj, "worker_id")
        try:
            namespace = BlockKey.from_hex(read_str(obj, "namespace"))
        except ValueError as exc:
            raise ApiValidationError("namespace", f"expected 32 hex digits: {exc}") from None
        address = read_str(obj, "address")
        if not address.startswith(("http://", "https://")):
            address = "http://" + address
        return cls(
            worker_id=wid, address=address.rstrip("/"),
            role=read_str(obj, "role", choices=WORKER_ROLES), model=read_str(obj, "model"),
            namespace=namespace, block_size=read_int(obj, "block_size", lo=1),
            kv_capacity_blocks=read_int(obj, "kv_capacity_blocks", lo=0),
            max_model_len=read_int(obj, "max_model_len", lo=1),
            draining=read_bool(obj, "draining", False),
            engine=read_str(obj, "engine", "kvengine", choices=WORKER_ENGINES),
            kv_events=read_str(obj, "kv_events", None) or None,
            kv_events_replay=read_str(obj, "kv_events_replay", None) or None,
        )

    @property
    def can_prefill(self) -> bool:
        """Every worker can prefill; the role says what the router sends it."""
        return self.role in ("prefill", "colocated")

    @property
    def can_decode(self) -> bool:
        return self.role in ("decode", "colocated")
