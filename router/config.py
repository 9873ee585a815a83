"""The router's configuration: one typed object, validated once, defaults in one place.

The CLI (``kvrouter serve`` / ``up``), the environment and files all build a
:class:`RouterConfig`; nothing else holds router defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from router.placement.balance import Balance
from router.placement.prefill import PREFILL_POLICIES, PrefillPolicyName
from router.placement.route import MODES, Mode
from router.scaling.policy import ScalingConfig
from router.workers.fit import RateConfig

__all__ = ["RouterConfig"]


@dataclass(frozen=True)
class RouterConfig:
    """Everything the router needs to start.

    ``model_dir``: the checkpoint whose tokenizer and chat template the router uses (it never
    loads weights). ``served_model_name``: the name clients send as ``model`` (default: the
    name the workers register). ``etcd``/``cluster``: where workers are discovered.
    ``mode``: ``disaggregated`` (prefill pool → store → decode pool), ``colocated`` (one
    worker does both; the rollback path) or ``auto`` (requests whose uncached part is shorter
    than ``auto_threshold_tokens`` prefill on their decode worker). ``balance``: colocated mode's
    load guard (``router.placement.decode.Balance``). ``max_inflight_requests``:
    admission control; past it requests get 429. ``api_key``: when set, every path but
    ``/health`` and ``/metrics`` requires ``Authorization: Bearer <api_key>`` (the public
    endpoint's key). ``cluster_secret``: the cluster's internal secret (``kvstore.secret``),
    sent on every call to a worker and to the store; never printed. ``max_body_bytes``: a
    request body past it gets 413 without being parsed. ``store_probe_interval_s``: how often
    the store is asked whether it is up (``/health``, and placement avoids it while down).
    ``scaling``: the objectives and hysteresis of the per-pool scaling signals and desired
    counts (``router.scaling``; ``GET /admin/scaling``, the ``kvrouter_pool_*`` gauges).
    """

    model_dir: str
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    etcd: str | None = None
    cluster: str = "kvstore"
    store: str | None = None              # kvstore address for store prefix lookups (None: via etcd)
    mode: Mode = "disaggregated"
    policy: PrefillPolicyName = "kv-aware"
    auto_threshold_tokens: int = 256
    balance: Balance = field(default_factory=Balance)
    max_inflight_requests: int = 512
    api_key: str | None = None
    request_log: str | None = None        # JSONL path for per-request records
    worker_timeout_s: float = 5.0         # connect / unary calls to workers
    stream_timeout_s: float = 300.0       # silence allowed between streamed tokens
    rates: RateConfig = field(default_factory=RateConfig)
    cluster_secret: str | None = field(default=None, repr=False)
    max_body_bytes: int = 16 * 1024 * 1024
    store_probe_interval_s: float = 1.0
    scaling: ScalingConfig = field(default_factory=ScalingConfig)

    def __post_init__(self) -> None:
        if not self.model_dir:
            raise ValueError("model_dir is required: the checkpoint directory holding tokenizer.json")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.policy not in PREFILL_POLICIES:
            raise ValueError(f"policy must be one of {PREFILL_POLICIES}, got {self.policy!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.auto_threshold_tokens < 0:
            raise ValueError("auto_threshold_tokens must be >= 0")
        if self.max_inflight_requests < 1:
            raise ValueError("max_inflight_requests must be >= 1")
        if self.worker_timeout_s <= 0 or self.stream_timeout_s <= 0:
            raise ValueError("timeouts must be positive")
        if not self.cluster or "/" in self.cluster:
            raise ValueError(f"cluster must be a non-empty name without '/', got {self.cluster!r}")
        if self.api_key == "":
            raise ValueError("api_key must not be empty (use None to disable authentication)")
        if self.cluster_secret == "":
            raise ValueError("cluster_secret must not be empty (use None for no secret)")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.store_probe_interval_s <= 0:
            raise ValueError("store_probe_interval_s must be positive")
