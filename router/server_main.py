"""Assembles and runs one router process: app, placement, store lookups, etcd registration.

``build_app(config)`` gives ``router.http.app.create_app`` (whose orchestrator does disaggregated /
colocated / auto placement with failover) the router's view of the store
(``router.workers.store.StoreView``: store-hit lookups for the ``kv-aware`` policy and
``auto`` mode, probes for ``/health`` and for placement, which avoids a store that is down)
and the per-request JSONL log. The store client and the worker calls carry
``config.cluster_secret``.
``run_router(config)`` serves it with uvicorn and registers the router in etcd under
``/{cluster}/routers/{id}`` (lease-kept; gone within the TTL when the process dies). SIGTERM
or SIGINT stop it gracefully (uvicorn's own handling); the registration, the store client and
the request log are closed on the way out.

TLS: the router's internal calls (workers, the store, etcd) use the process's settings
(``kvstore.tls.current()``, from ``--tls-*``). Its public endpoint is separate: plain HTTP
unless ``public_tls`` (``--public-tls-cert``/``--public-tls-key``) gives it a certificate;
public clients are authenticated by the API key, not by certificates, so none is asked of
them. Its etcd registration then says ``https://``.

Exit codes: 0 after a clean stop, 2 when it cannot start (tokenizer missing, etcd
unreachable, the app's start-up failing: uvicorn then returns without having started), with
one line naming the problem.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI

from kvstore.errors import KVStoreError
from router.config import RouterConfig
from router.placement.request_log import RequestLog
from router.workers.store import StoreLookup, StoreView

__all__ = ["RouterParts", "build_app", "run_router"]

log = logging.getLogger("kvrouter")


@dataclass(eq=False)
class RouterParts:
    """What ``build_app`` made, for the caller to close."""

    app: FastAPI
    request_log: RequestLog
    store: StoreView | None = None
    closers: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        for close in reversed(self.closers):
            try:
                close()
            except Exception:  # closing must go on
                log.exception("closing a router part failed")
        self.request_log.close()


def _store_view(config: RouterConfig) -> StoreView | None:
    """The store the router asks (``--store``, else the nodes registered in etcd), with the
    cluster secret. A client that cannot be built now is built again by the view's probe;
    meanwhile routing counts device hits only and avoids the store."""
    import kvstore

    if not config.store and not config.etcd:
        return None

    def connect() -> StoreLookup:
        if config.store:
            return kvstore.connect(config.store, auth_token=config.cluster_secret)
        assert config.etcd is not None
        return kvstore.connect(etcd=config.etcd, cluster=config.cluster,
                               auth_token=config.cluster_secret)

    where = config.store or f"the store nodes of cluster {config.cluster!r} in etcd"
    view = StoreView(connect, probe_interval=config.store_probe_interval_s, where=where)
    if view.up is False:
        log.warning("no store client yet (%s): routing counts device hits only until it "
                    "answers", view.health()["detail"])
    return view


def build_app(config: RouterConfig) -> RouterParts:
    """The router's FastAPI app with this package's orchestrator (see the module docstring)."""
    from router.http.app import create_app

    request_log = RequestLog(config.request_log)
    store = _store_view(config)
    try:
        app = create_app(config, store=store, request_log=request_log)
    except BaseException:   # the store client is not handed on: close it here
        if store is not None:
            store.close()
        request_log.close()
        raise
    return RouterParts(app, request_log, store, [store.close] if store is not None else [])


def _uvicorn_server(config: Any) -> Any:
    """uvicorn whose SIGTERM/SIGINT handling ends ``run`` normally (uvicorn itself re-raises
    the signal after shutting down, which would skip our clean-up and exit -15)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            def on_signal(_sig: int, _frame: Any) -> None:
                if self.should_exit:          # a second signal: stop waiting for requests
                    self.force_exit = True
                self.should_exit = True

            previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

    return Server(config)


def run_router(config: RouterConfig, *, log_level: str = "info",
               public_tls: tuple[str, str] | None = None) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit code. ``public_tls``: (certificate, key)
    files of the public endpoint's HTTPS (module docstring)."""
    import uvicorn

    from kvstore.coord.registration import register

    try:
        parts = build_app(config)
    except (OSError, ValueError) as exc:
        print(f"kvrouter: cannot start: {exc}", file=sys.stderr)
        return 2
    registration = None
    try:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((config.host, config.port))
        host, port = sock.getsockname()[:2]
        scheme = "https" if public_tls else "http"
        if config.etcd:
            router_id = f"router-{uuid.uuid4().hex[:8]}"
            registration = register(config.etcd, config.cluster, "routers", router_id, {
                "address": f"{scheme}://{host}:{port}", "mode": config.mode, "policy": config.policy,
                "model_dir": config.model_dir})
        ssl: dict[str, Any] = {"ssl_certfile": public_tls[0], "ssl_keyfile": public_tls[1]} if public_tls else {}
        server = _uvicorn_server(uvicorn.Config(parts.app, log_level=log_level.lower(),
                                                access_log=False, timeout_graceful_shutdown=5, **ssl))
        log.info("serving on %s://%s:%d (mode %s, policy %s)", scheme, host, port, config.mode,
                 config.policy)
        try:
            server.run(sockets=[sock])
        except SystemExit as exc:   # uvicorn exits (3) when the app's start-up fails
            if server.started:
                raise
            log.debug("uvicorn exited with %s before it started", exc.code)
        if not server.started:      # the start-up failed (logged above), or a signal came first
            print("kvrouter: cannot start: the app did not start (its start-up failed; the log "
                  "above says why)", file=sys.stderr)
            return 2
        return 0
    except (OSError, ValueError, KVStoreError) as exc:  # ValueError: a malformed --cluster
        print(f"kvrouter: cannot start: {exc}", file=sys.stderr)
        return 2
    finally:
        if registration is not None:
            registration.close()
        parts.close()
