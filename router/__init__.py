"""kvrouter: the OpenAI-compatible front of the cluster. Never imports torch.

Building blocks, one noun a module::

    http/       openai_types, openai_responses: the OpenAI API (pydantic request models,
                responses, SSE); errors: OpenAI errors and the one mapping of failures to
                statuses; choices: one choice's text; app: the FastAPI app
    placement/  serving: the Serving contract (ServeRequest -> token stream); route: Route,
                Plan, Mode; cost: the TTFT estimate; prefill / decode: the two choices;
                orchestrator: plan + the serving loop; failover: one choice's state, retries,
                resumes; request_log: the per-request record and its sink; errors: NoCapacity
    workers/    client, pool: the worker HTTP API, the etcd-fed set of live workers; kv_index:
                which worker holds which block keys; load, fit: the books on each worker;
                store: the KV store as the router sees it (lookups, probes, up or down)
    text/       detokenizer: token ids -> stable text, stop strings
    cluster/    launcher: ``kvrouter up``
    metrics, config   Prometheus collectors and RecentWindow; RouterConfig

Usage::

    from router import RouterConfig, create_app
    app = create_app(RouterConfig(model_dir="~/ckpt", etcd="http://127.0.0.1:2379"))
    # uvicorn.run(app, port=8000)   (or: kvrouter serve / kvrouter up)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from router.config import RouterConfig
    from router.http.app import create_app

__all__ = ["RouterConfig", "create_app"]


def __getattr__(name: str) -> Any:
    # Lazy, so that `router.workers.kv_index` (benchmarks, tools) does not pull in FastAPI,
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
