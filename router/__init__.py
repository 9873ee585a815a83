"""kvrouter: the OpenAI-compatible front of the cluster. Never imports torch.

Building blocks, one noun a module::

    openai_types / openai_responses   the OpenAI API: parse + validate bodies, errors, responses, SSE
    detokenizer                       token ids -> stable text, stop strings
    kv_index                          which worker holds which block keys (from their event streams)
    policy                            TTFT estimates, prefill / decode choice, auto-mode decision
    worker_client / worker_pool       the worker HTTP API; the etcd-fed set of live workers
    serving                           the Orchestrator contract (ServeRequest -> token stream)
    orchestrator / failover           placement (disaggregated, colocated, auto); retries, resumes
    choices / app                     one choice's text; the FastAPI app
    metrics / config                  Prometheus collectors; RouterConfig

Usage::

    from router import RouterConfig, create_app
    app = create_app(RouterConfig(model_dir="~/ckpt", etcd="http://127.0.0.1:2379"))
    # uvicorn.run(app, port=8000)   (or: kvrouter serve / kvrouter up)
"""

from __future__ import annotations

from typing import Any

__all__ = ["RouterConfig", "create_app"]


def __getattr__(name: str) -> Any:
    # Lazy, so that `router.placement.kv_index` (benchmarks, tools) does not pull in FastAPI,
    # and the version lookup (kvstore/version.py) only when `__version__` is asked for.
    if name == "__version__":
        from kvstore.version import installed_version

        return installed_version()
    if name == "RouterConfig":
        from router.config import RouterConfig

        return RouterConfig
    if name == "create_app":
        from router.http.app import create_app

        return create_app
    raise AttributeError(f"module 'router' has no attribute {name!r}")
