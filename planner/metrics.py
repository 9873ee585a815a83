"""Per-request serving latencies and their summary: TTFT, TPOT, ITL, E2E, percentiles, goodput.

Definitions (those of vLLM's ``benchmark_serving.py`` and DistServe):

- TTFT: the request's send -> its first streamed token.
- TPOT: ``(E2E - TTFT) / (output_tokens - 1)``, the mean time per output token after the first.
  Undefined (``None``) for a one-token output; such a request meets any TPOT objective.
- ITL: the gaps between consecutive streamed token chunks.
- E2E: the request's send -> the end of its stream.
- Goodput: requests that finished without error and met both ``TTFT <= ttft_s`` and
  ``TPOT <= tpot_s``, per second of benchmark duration. Attainment: that count over the
  requests issued (failed ones count against it).
- Send lag: ``sent_s - scheduled_s``, how late the client itself was; a large lag means the
  load generator, not the server, limited the offered rate.
- Cached fraction: ``usage.prompt_tokens_details.cached_tokens`` over prompt tokens, summed
  over the completed requests that report it (``None`` when none does).
- Percentiles: linear interpolation between closest ranks (NumPy's default), so the p50 of
  ``[1, 2, 3, 4]`` is 2.5 and the p90 of ``0..10`` is 9.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "RequestResult", "Slo", "Unloaded", "Distribution", "Summary",
    "percentile", "distribution", "summarize", "attainment_at_scales", "summarize_by_tag",
    "max_rate_meeting", "misses", "summary_stat", "SLO_SCALES",
]

# The scales of the SLO-scale curve, the measured sweep's (benchmarks.serving.sweep) and the simulated
# one's (planner.sim.sweep): one list, so that their curves compare point for point.
SLO_SCALES = [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0]


@dataclass
class RequestResult:
    """What the client saw of one request. Times are seconds; ``sent_s`` is relative to the
    benchmark's start and ``scheduled_s`` is when the workload asked for it to be sent."""

    request_id: str
    tag: str = ""
    prompt_tokens: int = 0
    max_tokens: int = 0
    scheduled_s: float = 0.0
    sent_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if reported
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft_s is not None and self.e2e_s is not None

    @property
    def tpot_s(self) -> float | None:
        if self.error is not None or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["tpot_s"] = self.tpot_s
        return d


@dataclass(frozen=True)
class Slo:
    """A pair of latency objectives (seconds).

    With ``ttft_per_token_s`` > 0 the TTFT objective depends on the prompt's length:
    ``ttft_s + ttft_per_token_s * (prompt_tokens - ref_prompt_tokens)``, a line through the
    objective at ``ref_prompt_tokens``. For traces whose prompts range from a few tokens to
    thousands, where one objective for all lengths is either unreachable for the long prompts
    or meaningless for the short ones."""

    ttft_s: float
    tpot_s: float
    ttft_per_token_s: float = 0.0
    ref_prompt_tokens: int = 0

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"SLO objectives must be positive, got {self}")
        if self.ttft_per_token_s < 0 or self.ref_prompt_tokens < 0:
            raise ValueError(f"the TTFT objective's slope and reference length must be >= 0, got {self}")
        if self.ttft_s - self.ttft_per_token_s * self.ref_prompt_tokens <= 0:
            raise ValueError(f"the TTFT objective must stay positive down to a 0-token prompt, got {self}")

    def scaled(self, k: float) -> "Slo":
        return Slo(self.ttft_s * k, self.tpot_s * k, self.ttft_per_token_s * k, self.ref_prompt_tokens)

    def ttft_objective(self, prompt_tokens: int) -> float:
        return self.ttft_s + self.ttft_per_token_s * (prompt_tokens - self.ref_prompt_tokens)

    def met(self, r: RequestResult) -> bool:
        if not r.ok or r.ttft_s is None or r.ttft_s > self.ttft_objective(r.prompt_tokens):
            return False
        tpot = r.tpot_s
        return tpot is None or tpot <= self.tpot_s


@dataclass(frozen=True)
class Unloaded:
    """Median latency of requests sent one at a time on an idle endpoint."""

    prompt_tokens: int
    max_tokens: int
    ttft_s: float
    tpot_s: float
    samples: int
    long_prompt_tokens: int = 0  # a second, longer probe (0: none): TTFT objectives per length
    long_ttft_s: float = 0.0

    def slo(self, ttft_mult: float, tpot_mult: float) -> Slo:
        """``ttft_mult`` x the unloaded TTFT (at each prompt length, when a long probe was
        measured: the line through both probes, never below one unloaded decode step at a
        0-token prompt) and ``tpot_mult`` x the unloaded TPOT."""
        if self.long_prompt_tokens <= self.prompt_tokens:
            return Slo(self.ttft_s * ttft_mult, self.tpot_s * tpot_mult)
        slope = max((self.long_ttft_s - self.ttft_s) / (self.long_prompt_tokens - self.prompt_tokens), 0.0)
        intercept = max(self.ttft_s - slope * self.prompt_tokens, self.tpot_s)
        return Slo((intercept + slope * self.prompt_tokens) * ttft_mult, self.tpot_s * tpot_mult,
                   slope * ttft_mult, self.prompt_tokens)


@dataclass(frozen=True)
class Distribution:
    n: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) by linear interpolation; ``None`` for no values."""
    if len(values) == 0:
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def distribution(values: Iterable[float | None]) -> Distribution | None:
    xs = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if xs.size == 0:
        return None
    p50, p90, p99 = np.percentile(xs, [50, 90, 99])
    return Distribution(int(xs.size), float(xs.mean()), float(p50), float(p90), float(p99), float(xs.max()))


@dataclass(frozen=True)
class Summary:
    issued: int
    completed: int
    failed: int
    duration_s: float
    request_throughput: float  # completed requests per second
    output_throughput: float  # output tokens per second
    total_token_throughput: float  # (prompt + output) tokens of completed requests per second
    ttft_s: Distribution | None
    tpot_s: Distribution | None
    itl_s: Distribution | None
    e2e_s: Distribution | None
    send_lag_s: Distribution | None = None
    cached_fraction: float | None = None
    slo: Slo | None = None
    good: int | None = None
    goodput: float | None = None  # good requests per second
    attainment: float | None = None  # good / issued

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize(results: Sequence[RequestResult], duration_s: float, slo: Slo | None = None) -> Summary:
    """Summarize one run. ``duration_s``: the benchmark's wall time (start -> last completion)."""
    if duration_s <= 0 and results:
        raise ValueError(f"duration_s must be positive, got {duration_s}")
    done = [r for r in results if r.ok]
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    out_tokens = sum(r.output_tokens for r in done)
    good = sum(slo.met(r) for r in results) if slo is not None else None
    reporting = [r for r in done if r.cached_tokens is not None]
    prompt_reporting = sum(r.prompt_tokens for r in reporting)
    return Summary(
        issued=len(results),
        completed=len(done),
        failed=len(results) - len(done),
        duration_s=duration_s,
        request_throughput=len(done) * per_s,
        output_throughput=out_tokens * per_s,
        total_token_throughput=(out_tokens + sum(r.prompt_tokens for r in done)) * per_s,
        ttft_s=distribution(r.ttft_s for r in done),
        tpot_s=distribution(r.tpot_s for r in done),
        itl_s=distribution(x for r in done for x in r.itl_s),
        e2e_s=distribution(r.e2e_s for r in done),
        send_lag_s=distribution(r.sent_s - r.scheduled_s for r in results),
        cached_fraction=sum(r.cached_tokens or 0 for r in reporting) / prompt_reporting if prompt_reporting else None,
        slo=slo,
        good=good,
        goodput=None if good is None else good * per_s,
        attainment=None if good is None else (good / len(results) if results else 0.0),
    )


def summarize_by_tag(results: Sequence[RequestResult], duration_s: float,
                     slo: Slo | None = None) -> dict[str, Summary]:
    """One summary per request tag (e.g. ``short`` and ``long`` of the mixed workload)."""
    tags = sorted({r.tag for r in results})
    return {t: summarize([r for r in results if r.tag == t], duration_s, slo) for t in tags}


def attainment_at_scales(results: Sequence[RequestResult], slo: Slo,
                         scales: Sequence[float]) -> list[float]:
    """DistServe's SLO-scale curve: the attained fraction with both objectives times each scale."""
    if not results:
        return [0.0 for _ in scales]
    return [sum(slo.scaled(k).met(r) for r in results) / len(results) for k in scales]


def misses(results: Sequence[RequestResult], slo: Slo) -> dict[str, int]:
    """How many of ``results`` finished but missed the TTFT objective, the TPOT one, or failed,
    out of those ``issued``: why a point's attainment fell short."""
    return {"ttft": sum(1 for r in results if r.ok and r.ttft_s is not None
                        and r.ttft_s > slo.ttft_objective(r.prompt_tokens)),
            "tpot": sum(1 for r in results if r.ok and r.tpot_s is not None and r.tpot_s > slo.tpot_s),
            "failed": sum(1 for r in results if not r.ok), "issued": len(results)}


def summary_stat(summary: dict[str, Any] | None, metric: str, stat: str) -> float | None:
    """``stat`` (``p50``, ``p99``, ``mean``...) of ``metric`` (``ttft_s``...) in a summary as
    JSON has it (``asdict(Summary)``); None where the summary, the metric or its values are not
    there."""
    d = (summary or {}).get(metric)
    return None if not d else d[stat]


def max_rate_meeting(points: list[dict[str, Any]], target: float = 0.9) -> dict[str, float | None]:
    """The highest rate, rising from the lowest, before attainment first drops below ``target``
    (``tested``), and the rate where the attainment curve crosses ``target`` by linear
    interpolation to the first failing point (``interpolated``); ``None`` if even the lowest fails."""
    tested = None
    for i, p in enumerate(points):
        att = p["summary"]["attainment"]
        if att < target:
            if tested is None:
                return {"tested": None, "interpolated": None}
            prev = points[i - 1]
            a0, a1 = prev["summary"]["attainment"], att
            frac = (a0 - target) / (a0 - a1) if a0 != a1 else 0.0
            return {"tested": tested, "interpolated": prev["rate"] + frac * (p["rate"] - prev["rate"])}
        tested = p["rate"]
    return {"tested": tested, "interpolated": tested}
