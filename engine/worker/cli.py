"""``kvengine serve``: one worker process (engine thread + HTTP API + etcd registration).

Once it accepts connections it prints one readiness line on stdout::

    kvengine ready address=http://127.0.0.1:8100 worker_id=<id> role=<role> namespace=<hex>

Role changes at run time: ``POST /role`` (``engine.worker.role``): drained first, then the
registration says the new role; a line ``kvengine role worker_id=ID role=R previous=OLD
drain_s=S`` is printed when it took effect.

Lifecycle: SIGTERM (or SIGINT) starts a drain: the registration says ``"draining": true``
(routers send it nothing new), 0.2 s later new ``/generate`` requests get 503 and
``/health`` says "draining"; running requests finish (up to ``--drain-timeout``); then the
worker deregisters from etcd, closes its event streams and exits 0. Start-up problems (no
checkpoint, unreachable store or etcd, an unreadable secret file, a non-loopback ``--host``
without a cluster secret or ``--insecure``) exit 2 with one line naming the problem.

The cluster secret (``kvstore.secret``: ``--cluster-secret-file``, ``--cluster-secret``,
``$KVCACHE_CLUSTER_SECRET``, ``$KVCACHE_CLUSTER_SECRET_FILE``, first found wins) guards the
worker API and is what the store client authenticates with; without one the store client
reads ``$KVSTORE_AUTH_TOKEN`` as before.

TLS (``kvstore.tls``: ``--tls-cert``/``--tls-key``/``--tls-ca``, else ``$KVCACHE_TLS_*``): the
worker API is served over HTTPS and requires a client certificate of the CA (the router's);
its address (the ready line, etcd, ``/info``) is then ``https://``; the store client and the
etcd client use the same certificate.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from engine.api.paths import resolve_model_dir
from engine.worker.config import WorkerConfig
from kvstore import tls as tls_settings
from kvstore.net.address import advertised_host, join_host_port
from kvstore.secret import add_secret_flags, is_loopback, resolve

if TYPE_CHECKING:  # imported lazily at run time: `kvengine --help` stays fast
    import torch
    from fastapi import FastAPI

    from engine.api.generate import WorkerInfo
    from engine.worker.worker import EngineWorker
    from kvstore.client.api import StoreClient

__all__ = ["main", "build_parser", "config_from_args", "serve"]

log = logging.getLogger("kvengine")

_STOP_SETTLE_S = 0.2   # on SIGTERM, between "draining" in etcd and refusing (routers catch up)


def build_parser() -> argparse.ArgumentParser:
    d = WorkerConfig()
    from kvstore.version import installed_version

    p = argparse.ArgumentParser(prog="kvengine", description=(__doc__ or "").split("\n")[0])
    p.add_argument("--version", action="version", version=f"%(prog)s {installed_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run one engine worker")
    s.add_argument("--role", choices=["prefill", "decode", "colocated"], default=d.role,
                   help=f"what the router sends it; every role can prefill (default {d.role})")
    s.add_argument("--model", default=d.model,
                   help="checkpoint directory, or 'default' for the converted SmolLM2-135M-Instruct")
    s.add_argument("--host", default=d.host, help=f"address to bind (default {d.host})")
    s.add_argument("--port", type=int, default=d.port, help=f"0 binds a free port (default {d.port})")
    s.add_argument("--advertise-address", "--advertise-host", dest="advertise_host", default=None,
                   metavar="ADDR", help="the address other hosts reach this worker at (its etcd "
                   "registration and /info); default: --host, or this host's primary "
                   "non-loopback address when --host is a wildcard")
    s.add_argument("--worker-id", default=None, help="its name in etcd and in events (default: ROLE-<random>)")
    s.add_argument("--store", default=None, help="a kvstore node host:port")
    s.add_argument("--etcd", default=None,
                   help="etcd URL: register there, and find the store nodes there unless --store")
    s.add_argument("--store-transport", choices=("auto", "tcp", "shm", "ucx"), default=d.store_transport,
                   help="the data path to the store nodes: 'auto' (shared memory on this host, UCX to "
                        "a node on another host that serves it, else TCP; kvstore.client.transport) "
                        f"or one forced (default {d.store_transport})")
    s.add_argument("--cluster", default=d.cluster, help=f"cluster name (etcd key prefix, default {d.cluster})")
    s.add_argument("--num-blocks", type=int, default=d.num_blocks,
                   help=f"blocks of the paged KV cache (default {d.num_blocks})")
    s.add_argument("--block-size", type=int, default=d.block_size,
                   help=f"tokens per KV block, also the kvstore block (default {d.block_size})")
    s.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help=f"most requests running at once (default {d.max_num_seqs})")
    s.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help=f"token budget of one step, decodes + prefill chunks (default {d.max_num_batched_tokens})")
    s.add_argument("--kv-load-timeout", type=float, default=d.kv_load_timeout_s, metavar="SECONDS",
                   help="a store load not done by then is abandoned and its request computes "
                        f"instead (default {d.kv_load_timeout_s:g})")
    s.add_argument("--max-model-len", type=int, default=None,
                   help="context window in tokens (default: the model's max_position_embeddings)")
    s.add_argument("--no-chunked-prefill", action="store_true",
                   help="prefill each prompt whole in one step (it must fit --max-num-batched-tokens)")
    s.add_argument("--no-prefix-caching", action="store_true",
                   help="do not reuse device KV blocks across requests")
    s.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: per device)")
    s.add_argument("--device", default=None, help="cpu | cuda[:N] (default: cuda if available)")
    s.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    save = s.add_mutually_exclusive_group()
    save.add_argument("--save-all", dest="save_all", action="store_true", default=None,
                      help="save every new full block to the store (default unless --role decode)")
    save.add_argument("--no-save", dest="save_all", action="store_false",
                      help="save only for phase=prefill requests")
    s.add_argument("--kv-handoff", choices=["local", "owners"], default=d.kv_handoff,
                   help="where a prefill's blocks go: 'local', this host's store node, read from "
                        "there by the decode worker (one network hop) and copied on to their "
                        "owners in the background; or 'owners', their rendezvous owners "
                        f"(default {d.kv_handoff})")
    s.add_argument("--load-interval", type=float, default=d.load_interval_s,
                   help="seconds between load reports on the event stream")
    s.add_argument("--drain-timeout", type=float, default=d.drain_timeout_s,
                   help=f"seconds running requests get to finish on SIGTERM (default {d.drain_timeout_s:g})")
    s.add_argument("--step-trace", default=None, metavar="FILE",
                   help="append one JSON line per engine step to FILE ({role} and {pid} are "
                        "replaced): its time, the model's share and its items (what "
                        "planner.sim.costs is checked against)")
    s.add_argument("--log-level", default="warning", help="debug, info, warning or error (default warning)")
    add_secret_flags(s)
    tls_settings.add_tls_flags(s)
    _add_profile_parser(sub)
    return p


def _add_profile_parser(sub: argparse._SubParsersAction) -> None:
    pr = sub.add_parser("profile", help="measure this engine on this hardware into a profile file",
                        description="Measure prefill (against prompt and cached prefix, chunked "
                        "and not), decode steps (against batch and context) and store load/save "
                        "bandwidth, fit each curve, write one profile file (engine.profile.format).")
    pr.add_argument("--model", default="default",
                    help="checkpoint directory, or 'default' for the converted SmolLM2-135M-Instruct")
    pr.add_argument("--tiny", action="store_true",
                    help="profile the tiny generated llama checkpoint instead (tests; ignores --model)")
    pr.add_argument("--out", default="profile.json", help="the profile file to write (default profile.json)")
    pr.add_argument("--plots", default=None, metavar="DIR",
                    help="also write one PNG per curve into DIR (default: none)")
    pr.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default: torch's own choice)")
    pr.add_argument("--seed", type=int, default=0, help="seed of prompts, cache contents and keys (default 0)")
    pr.add_argument("--quick", action="store_true",
                    help="a smaller grid and one repeat per point (about 3 minutes for the default model "
                         "on 2 busy cores)")
    pr.add_argument("--chunk", type=int, default=None,
                    help="chunk size of the chunked prefill points (default 512; --quick 128)")
    pr.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where the model runs (default cpu; cuda needs torch.cuda.is_available())")
    pr.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _profile(args: argparse.Namespace) -> int:
    import tempfile
    from pathlib import Path

    from engine.profile.format import save
    from engine.profile.measure import ProfileSettings, run_profile

    with tempfile.TemporaryDirectory(prefix="kvengine-tiny-") as tmp:
        if args.tiny:
            from engine.model.tiny import make_tiny_checkpoint

            model_dir, name = make_tiny_checkpoint(Path(tmp) / "tiny-llama", "llama"), "tiny-llama"
        else:
            try:
                model_dir = resolve_model_dir(args.model)
            except FileNotFoundError as exc:
                raise _StartupError(str(exc)) from exc
            name = model_dir.name
        t0 = time.monotonic()
        prof = run_profile(ProfileSettings(
            model_dir=model_dir, model_name=name, device=args.device, threads=args.threads,
            seed=args.seed, quick=args.quick, chunk=args.chunk, progress=not args.no_progress))
    out = save(prof, args.out)
    plots = []
    if args.plots:
        from engine.profile.plot import plot_profile

        plots = plot_profile(prof, args.plots)
    print(_profile_summary(prof, time.monotonic() - t0))
    print(f"wrote {out}" + (f" and {len(plots)} plots in {args.plots}" if plots else ""))
    return 0


def _profile_summary(prof, seconds: float) -> str:
    h, m = prof.hardware, prof.model
    c = prof.extra.get("chunk", 0)
    lines = [f"kvengine profile: {m.name} ({m.num_layers} layers, {m.num_heads}/{m.num_kv_heads} "
             f"heads, head_dim {m.head_dim}, {m.dtype}, block {m.block_size}) on {h.device_name} "
             f"({h.device}, {h.threads} threads, torch {h.torch_version}) in {seconds:.0f} s"]
    for n in (128, 512, 2048):
        lines.append(f"  prefill {n:5d} tok: {prof.prefill_s(n) * 1e3:8.1f} ms, 90% cached "
                     f"{prof.prefill_s(n - n * 9 // 10, n * 9 // 10) * 1e3:8.1f} ms, chunk {c} "
                     f"{prof.prefill_s(n, 0, c) * 1e3:8.1f} ms")
    for b in (1, 8, 32):
        lines.append(f"  decode batch {b:2d}: ctx 512 {prof.decode_step_s(b, 512) * 1e3:7.1f} ms/step, "
                     f"ctx 2048 {prof.decode_step_s(b, 2048) * 1e3:7.1f} ms/step")
    lines.append(f"  store load {prof.bandwidth('store_load') / 1e9:.2f} GB/s, save "
                 f"{prof.bandwidth('store_save') / 1e9:.2f} GB/s ({prof.store.transport})")
    lines.append("  fit max rel. error: " + ", ".join(
        f"{k} {v.fit.max_rel_error:.1%}" for k, v in prof.curves.items()))
    return "\n".join(lines)


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    """The worker's config from its flags (the secret resolved: file > value > environment)."""
    return WorkerConfig(
        model=args.model, role=args.role, host=args.host, port=args.port,
        advertise_host=args.advertise_host, worker_id=args.worker_id, store=args.store,
        etcd=args.etcd, cluster=args.cluster, num_blocks=args.num_blocks,
        block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=not args.no_chunked_prefill,
        enable_prefix_caching=not args.no_prefix_caching, max_model_len=args.max_model_len,
        dtype=args.dtype, device=args.device, threads=args.threads, save_all=args.save_all,
        kv_handoff=args.kv_handoff, kv_load_timeout_s=args.kv_load_timeout,
        load_interval_s=args.load_interval, drain_timeout_s=args.drain_timeout,
        cluster_secret=resolve(args.cluster_secret, args.cluster_secret_file),
        insecure=args.insecure, step_trace=args.step_trace, store_transport=args.store_transport,
    )


class _StartupError(Exception):
    """A start-up problem the user can fix; its message says what."""


def _connect_store(cfg: WorkerConfig) -> tuple[StoreClient, StoreClient, StoreClient]:
    """Clients for the connector's loads, saves and lookups (each on a thread of its own)."""
    import kvstore
    from kvstore.errors import KVStoreError

    # The resolved secret goes explicitly; None lets the client find its own ($KVSTORE_AUTH_TOKEN).
    token, how = cfg.cluster_secret, cfg.store_transport
    try:
        if cfg.store is not None:
            return tuple(kvstore.connect(cfg.store, auth_token=token, transport=how)  # type: ignore[return-value]
                         for _ in range(3))
        return tuple(kvstore.connect(etcd=cfg.etcd, cluster=cfg.cluster, auth_token=token,  # type: ignore[return-value]
                                     transport=how) for _ in range(3))
    except KVStoreError as exc:
        where = cfg.store or f"etcd {cfg.etcd} cluster {cfg.cluster!r}"
        raise _StartupError(f"cannot reach the kvstore at {where}: {exc} "
                            "(start `kvstore serve` first, or run without --store)") from exc


@contextlib.contextmanager
def _worker_parts(cfg: WorkerConfig, sock: socket.socket
                  ) -> Iterator[tuple[EngineWorker, FastAPI, WorkerInfo]]:
    """Model, connector, engine, worker thread and app; everything torn down on exit."""
    import torch

    from engine.api.generate import WorkerInfo
    from engine.core.llm_engine import LLMEngine
    from engine.kv.connector import KVStoreConnector
    from engine.model.runner import ModelRunner
    from engine.worker.events import EventStream
    from engine.worker.metrics import WorkerMetrics
    from engine.worker.role import RoleChanger
    from engine.worker.server import create_app
    from engine.worker.worker import EngineWorker, MeasuredRunner

    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    try:
        model_dir = resolve_model_dir(cfg.model)
    except FileNotFoundError as exc:
        raise _StartupError(str(exc)) from exc
    runner = MeasuredRunner(ModelRunner(model_dir, num_blocks=cfg.num_blocks,
                                        block_size=cfg.block_size, dtype=cfg.dtype,
                                        device=cfg.device))
    clients = _connect_store(cfg) if cfg.uses_store else ()
    connector = (KVStoreConnector(clients[0], runner.kv_cache, save_client=clients[1],
                                  lookup_client=clients[2], save_all=cfg.saves_all)
                 if clients else None)
    events = EventStream(cfg.event_capacity)
    metrics = WorkerMetrics()
    trace = (open(cfg.step_trace.replace("{role}", cfg.role).replace("{pid}", str(os.getpid())),
                  "a", buffering=1) if cfg.step_trace else None)
    engine = LLMEngine(runner, cfg.engine_config(), connector=connector,
                       on_kv_event=events.on_kv_event)
    worker = EngineWorker(engine, runner, events, metrics, connector=connector,
                          handoff=cfg.kv_handoff == "local",
                          load_interval_s=cfg.load_interval_s, step_trace=trace)
    host, port = sock.getsockname()[:2]
    scheme = "https" if tls_settings.current() else "http"
    info = WorkerInfo(
        worker_id=cfg.resolved_worker_id(),
        address=f"{scheme}://{join_host_port(advertised_host(host, cfg.advertise_host), port)}",
        role=cfg.role, model=model_dir.name, namespace=engine.namespace,
        block_size=cfg.block_size, kv_capacity_blocks=cfg.num_blocks,
        max_model_len=engine.max_model_len,
    )
    roles = RoleChanger(info, in_flight=lambda: worker.in_flight,
                        apply=lambda role: worker.set_save_all(cfg.saves_all_as(role)),
                        settle_s=cfg.role_settle_s, timeout_s=cfg.drain_timeout_s)
    app = create_app(worker, info, events, metrics, secret=cfg.cluster_secret, roles=roles)
    worker.start()
    try:
        yield worker, app, info
    finally:
        worker.stop()
        for c in clients:
            c.close()
        if trace is not None:
            trace.close()


class _Server:
    """uvicorn without its own signal handling (the worker drains first, then stops it);
    HTTPS with required client certificates under the process's TLS settings."""

    def __init__(self, app: FastAPI, log_level: str) -> None:
        import uvicorn

        tls = tls_settings.current()

        class Quiet(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                yield

        self.server = Quiet(uvicorn.Config(app, log_level=log_level, lifespan="off",
                                           timeout_graceful_shutdown=5, access_log=False,
                                           **(tls.uvicorn_kwargs() if tls else {})))


def _attention_path(kv_cache: torch.Tensor) -> str:
    """Which decode attention this worker runs: the native CPU kernel or the torch ops."""
    import torch

    from engine.model.native import native_status

    if kv_cache.device.type == "cpu" and kv_cache.dtype == torch.float32:
        return native_status().split(" ")[0]
    return "torch"


async def _serve_async(cfg: WorkerConfig, sock: socket.socket, worker: EngineWorker,
                       app: FastAPI, info: WorkerInfo, log_level: str) -> int:
    from kvstore.coord.registration import register

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = _Server(app, log_level).server
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    deadline = time.monotonic() + 30
    while not server.started:
        if serving.done() or time.monotonic() > deadline:
            await serving
            raise _StartupError("the HTTP server did not start")
        await asyncio.sleep(0.01)
    registration = None
    if cfg.etcd is not None:
        value = app.state.roles.info.to_etcd_value()
        try:
            registration = await asyncio.to_thread(
                register, cfg.etcd, cfg.cluster, "workers", info.worker_id, value,
                ttl=cfg.registration_ttl_s)
        except Exception as exc:  # EtcdError and transport errors alike
            server.should_exit = True
            await serving
            raise _StartupError(f"cannot register in etcd at {cfg.etcd}: {exc}") from exc
        reg = registration
        app.state.roles.publish = lambda new: reg.update(new.to_etcd_value())   # POST /role
    print(f"kvengine ready address={info.address} worker_id={info.worker_id} role={info.role} "
          f"namespace={info.namespace.hex()} decode_attention={_attention_path(worker.runner.kv_cache)}", flush=True)

    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({serving, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if serving.done():  # the server died on its own
        stopper.cancel()
        await serving
        return 1
    log.warning("draining: refusing new requests, finishing %s", "running ones")
    roles = app.state.roles
    await roles.cancel()   # a role change under way ends here; the drain goes on
    if registration is not None:   # routers stop sending it work first (router.workers.pool)
        try:
            await asyncio.to_thread(registration.update,
                                    dataclasses.replace(roles.info, draining=True).to_etcd_value())
            await asyncio.sleep(_STOP_SETTLE_S)
        except Exception as exc:  # noqa: BLE001 - etcd away: the 503s below still turn requests away
            log.warning("could not mark the registration draining: %s", exc)
    worker.drain()
    drain_deadline = time.monotonic() + cfg.drain_timeout_s
    while not worker.idle and time.monotonic() < drain_deadline:
        await asyncio.sleep(0.02)
    if registration is not None:  # after the drain (kvstore.coord.registration)
        await asyncio.to_thread(registration.close)
    app.state.closing.set()
    server.should_exit = True
    await serving
    return 0 if worker.idle else 1


def serve(cfg: WorkerConfig, log_level: str = "warning") -> int:
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not cfg.cluster_secret and not is_loopback(cfg.host):
        log.warning("--insecure: serving the worker API on %s without authentication: anyone "
                    "who reaches the port can generate and abort requests", cfg.host or "*")
    sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((cfg.host, cfg.port))
    except OSError as exc:
        raise _StartupError(f"cannot bind {cfg.host}:{cfg.port}: {exc}") from exc
    sock.listen(1024)
    sock.setblocking(False)
    with sock, _worker_parts(cfg, sock) as (worker, app, info):
        return asyncio.run(_serve_async(cfg, sock, worker, app, info, log_level))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "profile":
        try:
            return _profile(args)
        except (_StartupError, ValueError) as exc:
            print(f"kvengine profile: {exc}", file=sys.stderr)
            return 2
    try:
        cfg = config_from_args(args)
        tls_settings.configure(tls_settings.from_args(args))  # every connection it makes
        return serve(cfg, args.log_level)
    except (_StartupError, ValueError) as exc:
        print(f"kvengine {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
