"""Online fits of one worker's measured costs, and their priors (no I/O, no decisions).

:class:`LinearCost` is ``seconds(n) = overhead_s + n x per_token_s``, fitted to a worker's own
finished requests; :class:`Ewma` smooths the rates a worker reports in its load events;
:class:`RateConfig` holds the priors both start from and how fast they learn. Each worker's
:class:`~router.workers.load.WorkerLoad` owns two fits (prefill, store load); the placement
layer's TTFT estimate (``router.placement.cost``) reads them.

Why a fixed overhead: a prefill's time is per-request and per-step overhead plus a per-token
cost. A rate measured on short prompts is mostly overhead, so a worker that served short
prompts looks many times slower per token than it is, and a worker holding most of a long
prompt's prefix would lose to one that holds nothing. Each worker's two costs are fitted
online to its own finished requests (``prefill_s - store_load_s`` against
``computed_prompt_tokens``; ``store_load_s`` against ``store_hit_tokens``): an exponentially
weighted least-squares line (a sample's weight decays by ``1 - fit_alpha`` per newer
sample) pulled toward the configured priors (ridge, worth ``prior_weight`` samples, with
tokens scaled by ``pivot_tokens``). So samples at one size fix only the line's height
there: samples far below ``pivot_tokens`` tokens move the overhead and keep the prior rate,
samples far above it move the rate and keep the prior overhead, and samples that spread
over sizes fit both. The fit is clamped to overhead >= 0 and a rate in [1, 1e9] tokens/s.

Stalls: once a fit has ``TRUSTED_SAMPLES`` samples, a sample counts for at most
``MAX_JUMP`` times what the fit predicts for its size; before that, when its prior is itself
a measurement (``RateConfig.prefill_prior_measured`` / ``load_prior_measured``: a worker that
joins a warm pool starts from its peers' fits, ``router.workers.load.peer_priors``), at most
``MAX_JUMP`` times what the prior predicts (so that a few stalls in a row, each weighing much
in a young fit, do not compound).
A worker's fit changes only when it finishes a request, and it is sent requests only while its
estimate is competitive, so one stalled sample (a page-fault storm, a noisy neighbour: a
40-token prefill that took 0.6 s instead of 0.02 s in a chaos run; a restarted worker's first
prompts, cold and on a machine busy starting it) must not lift its line so far that it is
never chosen again and never measured again; a worker that really slowed down still gets
there, its fit rising by up to ``fit_alpha x (MAX_JUMP - 1)`` of itself per sample. (The
prefill choice also sends a passed-over idle worker a prompt now and then, whatever lifted
its line: ``router.placement.prefill``.)
The rates a worker reports in its load events are per-step figures that overhead can only
make look slower: one above the configured prior raises the prior rate (a worker known to
be fast before this router sent it anything), never lowers it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["RateConfig", "Ewma", "LinearCost"]


@dataclass(frozen=True, slots=True)
class RateConfig:
    """Priors of the cost models and how fast they learn (see the module docstring).

    ``alpha`` is the EWMA weight of a rate reported in a load event; ``fit_alpha`` how fast
    the time-vs-tokens fits forget (a sample's weight decays by ``1 - fit_alpha`` per newer
    sample); ``prior_weight`` how many samples the priors are worth; ``pivot_tokens`` the
    prompt size below which a sample mostly teaches the overhead, above it the rate.
    ``prefill_prior_measured`` / ``load_prior_measured``: that cost's priors are a measurement
    (its peers' fits), so a stall is capped from the first sample, at ``MAX_JUMP`` x what the
    priors predict until the fit has ``TRUSTED_SAMPLES`` (the module docstring).
    """

    prefill_tokens_per_s: float = 2_000.0
    load_tokens_per_s: float = 50_000.0
    alpha: float = 0.3
    prefill_overhead_s: float = 0.01
    load_overhead_s: float = 0.002
    fit_alpha: float = 0.1
    prior_weight: float = 0.1
    pivot_tokens: float = 256.0
    prefill_prior_measured: bool = False
    load_prior_measured: bool = False

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.load_tokens_per_s <= 0:
            raise ValueError("rate priors must be positive")
        if self.prefill_overhead_s < 0 or self.load_overhead_s < 0:
            raise ValueError("overhead priors must be >= 0")
        for name in ("alpha", "fit_alpha"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if self.prior_weight <= 0 or self.pivot_tokens <= 0:
            raise ValueError("prior_weight and pivot_tokens must be positive")


class Ewma:
    """Exponentially weighted moving average; ``value`` is the prior until the first sample."""

    __slots__ = ("alpha", "prior", "samples", "_value")

    def __init__(self, prior: float, alpha: float) -> None:
        self.alpha, self.prior, self.samples = alpha, prior, 0
        self._value = prior

    @property
    def value(self) -> float:
        return self._value

    def update(self, sample: float) -> None:
        """Add a sample; non-positive or non-finite samples ("not measured") are ignored."""
        if not (sample > 0.0 and math.isfinite(sample)):
            return
        self._value = sample if self.samples == 0 else (
            self.alpha * sample + (1.0 - self.alpha) * self._value
        )
        self.samples += 1


TRUSTED_SAMPLES = 8       # samples before a stalled one is capped
MAX_JUMP = 3.0            # a sample counts for at most this many times the prediction
_MIN_PER_TOKEN_S = 1e-9   # 1e9 tokens/s
_MAX_PER_TOKEN_S = 1.0    # 1 token/s


class LinearCost:
    """``seconds(n) = overhead_s + n * per_token_s``, fitted to (tokens, seconds) samples.

    Exponentially weighted least squares with a ridge pull toward the prior line: minimizes
    ``sum w_i (t_i - a - b n_i)^2 + k ((a - a0)^2 + (N (b - b0))^2)`` where ``w_i`` decays by
    ``1 - alpha`` per newer sample, ``k`` is ``prior_weight`` and ``N`` ``pivot_tokens``.
    The fit is refreshed on every sample (a 2x2 solve), so reading it costs two attribute
    loads. Clamped to ``overhead_s >= 0`` and ``per_token_s`` in [1e-9, 1] s; a sample past
    ``MAX_JUMP`` x the prediction is capped there once ``TRUSTED_SAMPLES`` were seen; before
    that, when ``trusted`` (the prior is a measurement: its peers' fit), at ``MAX_JUMP`` x the
    prior's prediction.
    """

    __slots__ = ("overhead_s", "per_token_s", "samples", "prior_overhead_s", "prior_per_token_s",
                 "_trusted", "_keep", "_k", "_kn2", "_s0", "_sn", "_st", "_snn", "_snt")

    def __init__(self, overhead_s: float, tokens_per_s: float, *, alpha: float = 0.1,
                 prior_weight: float = 0.1, pivot_tokens: float = 256.0, trusted: bool = False) -> None:
        if tokens_per_s <= 0 or overhead_s < 0 or not 0.0 < alpha <= 1.0:
            raise ValueError("LinearCost needs overhead_s >= 0, tokens_per_s > 0, alpha in (0, 1]")
        self.prior_overhead_s, self.prior_per_token_s = overhead_s, 1.0 / tokens_per_s
        self._trusted = trusted
        self._keep, self._k, self._kn2 = 1.0 - alpha, prior_weight, prior_weight * pivot_tokens ** 2
        self._s0 = self._sn = self._st = self._snn = self._snt = 0.0
        self.samples = 0
        self.overhead_s, self.per_token_s = overhead_s, self.prior_per_token_s
        self._fit()

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.per_token_s

    @property
    def mean_tokens(self) -> float | None:
        """The weighted mean size of the samples (None before the first)."""
        return self._sn / self._s0 if self.samples else None

    def seconds(self, tokens: float) -> float:
        return self.overhead_s + tokens * self.per_token_s

    def set_prior_rate(self, tokens_per_s: float) -> None:
        """Move the prior per-token cost (the fit is pulled toward it); ignores non-positive."""
        if tokens_per_s > 0.0 and math.isfinite(tokens_per_s) and 1.0 / tokens_per_s != self.prior_per_token_s:
            self.prior_per_token_s = 1.0 / tokens_per_s
            self._fit()

    def update(self, tokens: float, seconds: float) -> None:
        """Add a measurement; one without tokens or time ("not measured") is ignored."""
        if not (tokens > 0 and seconds > 0.0 and math.isfinite(seconds) and math.isfinite(tokens)):
            return
        if self.samples >= TRUSTED_SAMPLES:   # a stall teaches at most MAX_JUMP x the prediction
            seconds = min(seconds, MAX_JUMP * self.seconds(tokens))
        elif self._trusted:                   # ... a young fit's, the prior's (a measurement)
            seconds = min(seconds, MAX_JUMP * (self.prior_overhead_s + tokens * self.prior_per_token_s))
        keep = self._keep
        self._s0 = self._s0 * keep + 1.0
        self._sn = self._sn * keep + tokens
        self._st = self._st * keep + seconds
        self._snn = self._snn * keep + tokens * tokens
        self._snt = self._snt * keep + tokens * seconds
        self.samples += 1
        self._fit()

    def _fit(self) -> None:
        k, kn2, a0, b0 = self._k, self._kn2, self.prior_overhead_s, self.prior_per_token_s
        if not self.samples:
            self.overhead_s, self.per_token_s = a0, b0
            return
        # Normal equations of the ridge fit: [[s0+k, sn], [sn, snn+kN^2]] [a, b] = [st+k a0, snt+kN^2 b0]
        m00, m01, m11 = self._s0 + k, self._sn, self._snn + kn2
        r0, r1 = self._st + k * a0, self._snt + kn2 * b0
        det = m00 * m11 - m01 * m01
        a, b = (r0 * m11 - m01 * r1) / det, (m00 * r1 - m01 * r0) / det
        if a < 0.0:           # no negative overhead: the best line with a = 0
            a, b = 0.0, r1 / m11
        if not _MIN_PER_TOKEN_S <= b <= _MAX_PER_TOKEN_S:
            b = min(max(b, _MIN_PER_TOKEN_S), _MAX_PER_TOKEN_S)
            a = max(0.0, (r0 - m01 * b) / m00)   # the best overhead for the clamped slope
        self.overhead_s, self.per_token_s = a, b
