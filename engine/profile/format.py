"""The engine profile file: what ``kvengine profile`` writes and a simulator reads.

Spec (``schema_version`` 1). One JSON object, UTF-8. Units everywhere: **seconds** for times,
**tokens** for lengths, **bytes** for sizes, **bytes per second** for bandwidths. Keys::

    {
      "schema": "kvengine-profile", "schema_version": 1,
      "created": ISO-8601 UTC time, "seed": int, "quick": bool, "repeats": int,
      "hardware": {device "cpu" | "cuda", device_name (CPU model or GPU name), cpu_count,
                   threads (torch intra-op threads used), torch_version, platform,
                   native_attention (the decode attention path: "native" | "torch" | ...)},
      "model":    {name, architecture, num_layers, num_heads, num_kv_heads, head_dim,
                   hidden_size, intermediate_size, vocab_size, dtype, block_size,
                   kv_bytes_per_token, block_bytes (one block's payload, all layers, K and V)},
      "store":    {transport ("shm" | "tcp"), how (what was measured, in words)},
      "curves": {
        "prefill":    {points: [{new_tokens, cached_tokens, chunk, seconds}], fit},
        "decode":     {points: [{batch, context, seconds}], fit},
        "store_load": {points: [{blocks, bytes, seconds}], fit},
        "store_save": {points: [{blocks, bytes, seconds}], fit}
      },
      "serving": optional, absent until ``python -m benchmarks.planner.stack_profile`` adds it:
                 {created, how (the stack measured, in words), prompt_tokens, hop_s, step_s,
                  token_s, ttft_measured_s, ttft_simulated_s, prefill_factor, prefill_steps,
                  points: [{batch, prompt_tokens, output_tokens, measured_gap_s, simulated_gap_s}],
                  prefill_points: [{prompt_tokens, decoding, measured_ttft_s, simulated_ttft_s,
                                    engine_prefill_s}]}
    }

Each ``fit`` is ``{form, terms, coefficients, max_rel_error, rms_rel_error}``: the curve's time
is ``sum(coefficients[i] * feature_i)`` over the named ``terms``; coefficients are
non-negative (a least-squares fit weighted by 1 / seconds, i.e. of relative error, over the
subsets of terms whose coefficients come out non-negative and that keep the curve's
``REQUIRED`` term: tokens, batch, bytes), so each fitted curve grows with every argument and
strictly with what it measures. ``max_rel_error`` is ``max |fit - measured| / measured`` over the points.

Features (``evaluate`` below computes them; a simulator may too):

- ``prefill``: ``new_tokens`` computed after ``cached_tokens`` already in the paged cache, in
  chunks of ``chunk`` tokens (``chunk`` = 0: one step, unchunked). Step ``j`` computes ``k_j``
  tokens starting at position ``p_j``. Terms: ``steps`` (count of chunks: per-step overhead),
  ``tokens`` (``new_tokens``: the linear layers), ``attention`` (``sum_j k_j * (p_j + (k_j +
  1) / 2)``: query-key pairs, the quadratic attention term). ``prefill_s(n, c, chunk)``.
- ``decode``: one step of ``batch`` sequences, each with ``context`` tokens already cached
  (the step attends over ``context + 1``). Terms: ``step`` (1), ``batch``, ``batch_context``
  (``batch * (context + 1)``). ``decode_step_s(batch, context)``.
- ``store_load`` / ``store_save``: moving ``blocks`` full KV blocks between a ``kvstore serve``
  daemon and the paged cache through ``engine.kv.connector.KVStoreConnector``. Terms: ``call``
  (1, the per-call latency), ``bytes`` (``blocks * block_bytes``: 1 / bandwidth).
  ``load_s(blocks)``, ``save_s(blocks)``; ``bandwidth(curve)`` = 1 / the ``bytes`` coefficient.

``serving`` is what the serving stack (router, HTTP, streaming client, store and etcd, on the
same machine) adds to the engine's own times, as a simulator of the engine alone would miss
it: ``hop_s`` per message (client -> router, router -> worker, worker -> router -> client;
a colocated request's first token is three of them), and per decode step ``step_s +
token_s * batch`` (the stack's CPU for each streamed token). Measured by sending the same
requests to the real stack and to the simulator with none of it: ``hop_s`` is a third of the
median unloaded TTFT difference, and ``step_s``, ``token_s`` the non-negative line through the
difference of the steady inter-token gaps at each batch (``points``). ``prefill_factor``
multiplies the engine's prefill work (each chunk's time, and a prefill-only step's overhead)
while other requests stream: the stack's CPU slows a prefill down too, not only the decode
steps. It is the median, over ``prefill_steps`` traced steps that computed prompt tokens while
other requests streamed, of the worker's forward-pass time over the curves' price for the
same items (1.0 when absent). ``prefill_points`` keep those prompts' TTFTs, measured and
simulated with the hop, step and token costs, for reference.

``load(path)`` / ``save(path)`` read and write the file (``load`` refuses another schema
or a newer version); ``Profile.evaluate(curve, **args)`` evaluates a curve's fit anywhere.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "SCHEMA", "SCHEMA_VERSION", "CURVES", "Hardware", "ModelShape", "StoreInfo", "Fit",
    "PrefillPoint", "DecodePoint", "TransferPoint", "Curve", "Serving", "ServingPoint", "ServingPrefillPoint",
    "Profile", "fit_curve", "nonneg_lstsq", "features", "load", "save",
]

SCHEMA = "kvengine-profile"
SCHEMA_VERSION = 1
TERMS: dict[str, tuple[str, ...]] = {
    "prefill": ("steps", "tokens", "attention"),
    "decode": ("step", "batch", "batch_context"),
    "store_load": ("call", "bytes"),
    "store_save": ("call", "bytes"),
}
CURVES = tuple(TERMS)
# The term each fit keeps whatever the noise says, so every curve grows with what it measures
# (time per token, per sequence, per byte); a fit of a constant alone would be flat.
REQUIRED = {"prefill": "tokens", "decode": "batch", "store_load": "bytes", "store_save": "bytes"}
FORMS = {
    "prefill": "a*steps + b*new_tokens + c*sum_chunks(k*(p + (k+1)/2))",
    "decode": "a + b*batch + c*batch*(context+1)",
    "store_load": "a + b*bytes",
    "store_save": "a + b*bytes",
}


@dataclass(frozen=True)
class Hardware:
    device: str
    device_name: str
    cpu_count: int
    threads: int
    torch_version: str
    platform: str
    native_attention: str


@dataclass(frozen=True)
class ModelShape:
    name: str
    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    dtype: str
    block_size: int
    kv_bytes_per_token: int
    block_bytes: int


@dataclass(frozen=True)
class StoreInfo:
    transport: str
    how: str


@dataclass(frozen=True)
class PrefillPoint:
    new_tokens: int
    cached_tokens: int
    chunk: int  # 0: unchunked
    seconds: float


@dataclass(frozen=True)
class DecodePoint:
    batch: int
    context: int
    seconds: float


@dataclass(frozen=True)
class TransferPoint:
    blocks: int
    bytes: int
    seconds: float


@dataclass(frozen=True)
class ServingPoint:
    batch: int
    prompt_tokens: int
    output_tokens: int
    measured_gap_s: float  # the steady inter-token gap through the stack (median)
    simulated_gap_s: float  # the same requests' gap from the engine's curves alone


@dataclass(frozen=True)
class ServingPrefillPoint:
    prompt_tokens: int
    decoding: int  # requests streaming while it was sent
    measured_ttft_s: float  # through the stack
    simulated_ttft_s: float  # the simulator with hop, step and token costs (factor 1)
    engine_prefill_s: float  # the engine's own time for this prefill, from the curves


@dataclass(frozen=True)
class Serving:
    """What the serving stack adds to the engine's times (see the module docstring)."""

    how: str
    prompt_tokens: int  # of the unloaded TTFT requests
    hop_s: float
    step_s: float
    token_s: float
    ttft_measured_s: float
    ttft_simulated_s: float
    points: tuple[ServingPoint, ...] = ()
    created: str = ""
    prefill_factor: float = 1.0  # prefill work under streaming load / the engine's curves
    prefill_steps: int = 0  # traced steps prefill_factor is the median of
    prefill_points: tuple[ServingPrefillPoint, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "points": [asdict(p) for p in self.points],
                "prefill_points": [asdict(p) for p in self.prefill_points]}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Serving:
        return cls(**{**obj, "points": tuple(ServingPoint(**p) for p in obj.get("points", ())),
                      "prefill_points": tuple(ServingPrefillPoint(**p) for p in obj.get("prefill_points", ()))})


Point = PrefillPoint | DecodePoint | TransferPoint
_POINT_TYPES: dict[str, type] = {"prefill": PrefillPoint, "decode": DecodePoint,
                                 "store_load": TransferPoint, "store_save": TransferPoint}


@dataclass(frozen=True)
class Fit:
    form: str
    terms: tuple[str, ...]
    coefficients: tuple[float, ...]
    max_rel_error: float
    rms_rel_error: float

    def value(self, feats: dict[str, float]) -> float:
        return float(sum(c * feats[t] for t, c in zip(self.terms, self.coefficients)))


@dataclass(frozen=True)
class Curve:
    points: tuple[Any, ...]
    fit: Fit


def _prefill_features(new_tokens: float, cached_tokens: float, chunk: float) -> dict[str, float]:
    n, c = int(new_tokens), int(cached_tokens)
    size = int(chunk) if chunk and chunk > 0 else max(n, 1)
    steps, pairs, p = 0, 0.0, c
    done = 0
    while done < n:
        k = min(size, n - done)
        pairs += k * (p + (k + 1) / 2)
        p += k
        done += k
        steps += 1
    return {"steps": float(steps), "tokens": float(n), "attention": pairs}


def features(curve: str, block_bytes: int = 0, **args: float) -> dict[str, float]:
    """The fit's features of ``curve`` at ``args`` (see the module docstring)."""
    if curve == "prefill":
        return _prefill_features(args["new_tokens"], args.get("cached_tokens", 0),
                                 args.get("chunk", 0))
    if curve == "decode":
        b, ctx = float(args["batch"]), float(args["context"])
        return {"step": 1.0, "batch": b, "batch_context": b * (ctx + 1)}
    if curve in ("store_load", "store_save"):
        nbytes = args.get("bytes")
        if nbytes is None:
            nbytes = float(args["blocks"]) * block_bytes
        return {"call": 1.0, "bytes": float(nbytes)}
    raise KeyError(f"unknown curve {curve!r}; one of {CURVES}")


def _point_features(curve: str, p: Any) -> dict[str, float]:
    if curve == "prefill":
        return features(curve, new_tokens=p.new_tokens, cached_tokens=p.cached_tokens, chunk=p.chunk)
    if curve == "decode":
        return features(curve, batch=p.batch, context=p.context)
    return features(curve, bytes=p.bytes)


def nonneg_lstsq(x: np.ndarray, y: np.ndarray, w: np.ndarray, need: int | None = None) -> np.ndarray | None:
    """Coefficients ``c >= 0`` minimising ``sum(((x @ c - y) * w) ** 2)``: of the column subsets
    (holding column ``need``, if given) whose unconstrained least squares comes out
    non-negative, the best, the other coefficients 0; None when no subset does."""
    n = x.shape[1]
    best: tuple[float, np.ndarray] | None = None
    for r in range(1, n + 1):
        for subset in itertools.combinations(range(n), r):
            cols = list(subset)
            if need is not None and need not in cols:
                continue
            a = x[:, cols] * w[:, None]
            scale = np.maximum(np.abs(a).max(axis=0), 1e-300)  # conditioning
            sol, *_ = np.linalg.lstsq(a / scale, y * w, rcond=None)
            sol = sol / scale
            if np.any(sol < 0):
                continue
            coef = np.zeros(n)
            coef[cols] = sol
            sse = float(np.sum(((x @ coef - y) * w) ** 2))
            if best is None or sse < best[0] - 1e-15:
                best = (sse, coef)
    return None if best is None else best[1]


def fit_curve(curve: str, points: Sequence[Any]) -> Fit:
    """Least squares of relative error with non-negative coefficients (best subset of terms
    that holds the curve's ``REQUIRED`` term)."""
    terms = TERMS[curve]
    if not points:
        raise ValueError(f"no points to fit for {curve}")
    x = np.array([[_point_features(curve, p)[t] for t in terms] for p in points], dtype=np.float64)
    y = np.array([p.seconds for p in points], dtype=np.float64)
    w = 1.0 / np.maximum(y, 1e-12)
    coef = nonneg_lstsq(x, y, w, terms.index(REQUIRED[curve]))
    assert coef is not None  # the required term alone always fits non-negatively (y > 0)
    rel = np.abs(x @ coef - y) * w
    return Fit(form=FORMS[curve], terms=terms, coefficients=tuple(float(c) for c in coef),
               max_rel_error=float(rel.max()), rms_rel_error=float(math.sqrt(np.mean(rel**2))))


@dataclass(frozen=True)
class Profile:
    hardware: Hardware
    model: ModelShape
    store: StoreInfo
    curves: dict[str, Curve]
    seed: int = 0
    quick: bool = False
    repeats: int = 1
    created: str = ""
    schema_version: int = SCHEMA_VERSION
    extra: dict[str, Any] = field(default_factory=dict)  # settings of the run, free-form
    serving: Serving | None = None  # what the serving stack adds (benchmarks.planner.stack_profile)

    def engine_only(self) -> Profile:
        """This profile without its serving section: the engine's own times."""
        return replace(self, serving=None)

    def evaluate(self, curve: str, **args: float) -> float:
        """Seconds the fitted ``curve`` predicts at ``args`` (its features' names)."""
        c = self.curves[curve]
        return c.fit.value(features(curve, self.model.block_bytes, **args))

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0, chunk: int = 0) -> float:
        return self.evaluate("prefill", new_tokens=new_tokens, cached_tokens=cached_tokens, chunk=chunk)

    def decode_step_s(self, batch: int, context: int) -> float:
        return self.evaluate("decode", batch=batch, context=context)

    def load_s(self, blocks: int) -> float:
        return self.evaluate("store_load", blocks=blocks)

    def save_s(self, blocks: int) -> float:
        return self.evaluate("store_save", blocks=blocks)

    def bandwidth(self, curve: str) -> float:
        """Bytes per second of ``store_load`` / ``store_save`` (inf if the fit has no bytes term)."""
        fit = self.curves[curve].fit
        b = fit.coefficients[fit.terms.index("bytes")]
        return 1.0 / b if b > 0 else math.inf

    def to_json(self) -> dict[str, Any]:
        out = {
            "schema": SCHEMA, "schema_version": self.schema_version, "created": self.created,
            "seed": self.seed, "quick": self.quick, "repeats": self.repeats,
            "hardware": asdict(self.hardware), "model": asdict(self.model),
            "store": asdict(self.store), "extra": self.extra,
            "curves": {name: {"points": [asdict(p) for p in c.points],
                              "fit": {**asdict(c.fit), "terms": list(c.fit.terms),
                                      "coefficients": list(c.fit.coefficients)}}
                       for name, c in self.curves.items()},
        }
        if self.serving is not None:
            out["serving"] = self.serving.to_json()
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Profile:
        if obj.get("schema") != SCHEMA:
            raise ValueError(f"not a {SCHEMA} file (schema={obj.get('schema')!r})")
        version = obj.get("schema_version")
        if not isinstance(version, int) or version > SCHEMA_VERSION or version < 1:
            raise ValueError(f"{SCHEMA} schema_version {version!r} is not supported "
                             f"(this engine reads 1..{SCHEMA_VERSION})")
        curves: dict[str, Curve] = {}
        for name, c in obj["curves"].items():
            if name not in _POINT_TYPES:
                raise ValueError(f"unknown curve {name!r}")
            f = c["fit"]
            fit = Fit(form=f["form"], terms=tuple(f["terms"]),
                      coefficients=tuple(float(v) for v in f["coefficients"]),
                      max_rel_error=float(f["max_rel_error"]), rms_rel_error=float(f["rms_rel_error"]))
            curves[name] = Curve(tuple(_POINT_TYPES[name](**p) for p in c["points"]), fit)
        missing = set(CURVES) - set(curves)
        if missing:
            raise ValueError(f"profile lacks curves {sorted(missing)}")
        return cls(hardware=Hardware(**obj["hardware"]), model=ModelShape(**obj["model"]),
                   store=StoreInfo(**obj["store"]), curves=curves, seed=int(obj["seed"]),
                   quick=bool(obj["quick"]), repeats=int(obj["repeats"]),
                   created=str(obj["created"]), schema_version=version,
                   extra=dict(obj.get("extra", {})),
                   serving=Serving.from_json(obj["serving"]) if obj.get("serving") else None)


def save(profile: Profile, path: str | Path) -> Path:
    """Write ``profile`` as indented JSON; returns the path."""
    path = Path(path)
    if path.parent != Path(""):
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile.to_json(), indent=1) + "\n", encoding="utf-8")
    return path


def load(path: str | Path) -> Profile:
    """Read a profile file (``ValueError`` if it is not one this engine understands)."""
    return Profile.from_json(json.loads(Path(path).read_text(encoding="utf-8")))
