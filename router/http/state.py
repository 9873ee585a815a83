"""``AppState``: everything a request handler of the router's HTTP app needs (``router.http.app``
builds it; ``router.http.respond`` answers with it)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.api.tokenizer import Tokenizer
from router.config import RouterConfig
from router.metrics import RouterMetrics
from router.placement.prefill import PrefillPolicy
from router.placement.serving import Serving
from router.workers.pool import WorkerPool
from router.workers.store import StoreView

__all__ = ["AppState"]


@dataclass(eq=False)
class AppState:
    """Everything a request handler needs."""

    config: RouterConfig
    tokenizer: Tokenizer
    pool: WorkerPool
    policy: PrefillPolicy
    metrics: RouterMetrics
    orchestrator: Serving
    store: StoreView | None = None
    in_flight: int = 0
