"""``kvrouter``: the OpenAI-compatible router, and the one-command local cluster.

- ``kvrouter serve --etcd URL --cluster C --port 8000 --mode disaggregated|colocated|auto
  --policy kv-aware|least-loaded|round-robin --auto-threshold N --api-key KEY --model DIR``:
  the router alone, discovering workers in etcd; ``--balance-abs N --balance-rel X``:
  colocated mode's load guard (``router.placement.decode.Balance``). The API key may come from the
  ``KVROUTER_API_KEY`` environment variable instead (keeps it out of ``ps``). The cluster
  secret its calls to workers and to the store carry: ``--cluster-secret-file``,
  ``--cluster-secret``, ``$KVCACHE_CLUSTER_SECRET`` or ``$KVCACHE_CLUSTER_SECRET_FILE``
  (``kvstore.secret``).
- ``kvrouter up [--port 8000] [--prefill N] [--decode N] [--mode M] [--model default|DIR]``:
  etcd (a child on free ports, unless ``--etcd``), a store daemon, the workers and the router,
  each reported as it becomes ready by its own ready line; then a ``curl`` line and an
  ``openai`` snippet that work as printed. A cluster secret (``--cluster-secret-file``, else
  generated) goes to ``LOG_DIR/cluster-secret`` (0600) and to every child through
  ``$KVCACHE_CLUSTER_SECRET_FILE``. A child that exits unexpectedly is restarted with backoff
  (console line, ``kvrouter_up_child_restarts_total`` on ``--metrics-port``). Only Ctrl-C or
  SIGTERM stops the cluster: every child (process groups), then exit 0.
- ``kvrouter up --autoscale --max-workers N``: the same, and the launcher acts on the
  router's per-pool desired counts within N workers (``router.cluster.autoscaler``): role
  changes first (drained first), then starts or stops; the router runs in ``auto`` mode
  unless ``--mode`` says otherwise, so "no prefill worker" (colocated) is one of its states.
  ``--scale-*`` (also on ``serve``) set the objectives and the hysteresis (``router.scaling``).

TLS (``kvstore.tls``): ``--tls-cert``/``--tls-key``/``--tls-ca`` (or ``$KVCACHE_TLS_*``) on
``serve`` put the router's calls to workers, the store and etcd on TLS with mutual
certificates; its public endpoint takes its own ``--public-tls-cert``/``--public-tls-key``
(HTTPS without client certificates: the API key authenticates callers). On ``up`` the same
flags, or ``--tls-dir DIR`` (a CA and a node certificate made there unless present:
``kvstore.certs``), put etcd (``https://``, client certificates required), the store, the
workers and the router's internal calls on TLS; the router's public endpoint stays HTTP.

Every flag feeds one typed config (``RouterConfig`` / ``ClusterSpec``), validated once.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.cluster.autoscaler import Autoscaler, AutoscaleSpec
    from router.cluster.launcher import ClusterSpec, LocalCluster
    from router.cluster.supervisor import Supervisor
    from router.placement.balance import Balance
    from router.scaling.policy import ScalingConfig

__all__ = ["main", "build_parser"]

log = logging.getLogger("kvrouter")


class _Stop(BaseException):
    """Raised from the signal handler to unwind ``kvrouter up`` wherever it is."""


def build_parser() -> argparse.ArgumentParser:
    from kvstore.secret import add_secret_flags
    from router.config import RouterConfig
    from router.placement.prefill import PREFILL_POLICIES
    from router.placement.route import MODES

    d = RouterConfig(model_dir="default")
    from kvstore.tls import add_tls_flags
    from kvstore.version import installed_version

    p = argparse.ArgumentParser(prog="kvrouter", description=(__doc__ or "kvrouter").split("\n")[0])
    p.add_argument("--version", action="version", version=f"%(prog)s {installed_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    mode_help = ("disaggregated: prefill pool -> store -> decode pool; colocated: one worker does both "
                 "(the rollback); auto: short uncached prompts prefill on their decode worker")
    policy_help = "how a prefill worker is chosen: by cached prefix and load, by load alone, or in turn"

    s = sub.add_parser("serve", help="run the router (workers are discovered in etcd)")
    s.add_argument("--etcd", required=True, help="etcd URL, e.g. http://127.0.0.1:2379")
    s.add_argument("--cluster", default=d.cluster,
                   help=f"cluster name the workers registered under (etcd key prefix, default {d.cluster})")
    s.add_argument("--host", default=d.host, help=f"address to bind (default {d.host})")
    s.add_argument("--port", type=int, default=d.port, help=f"port to listen on (default {d.port})")
    s.add_argument("--mode", choices=MODES, default=d.mode, help=f"{mode_help} (default {d.mode})")
    s.add_argument("--policy", choices=PREFILL_POLICIES, default=d.policy, help=f"{policy_help} (default {d.policy})")
    s.add_argument("--auto-threshold", type=int, default=d.auto_threshold_tokens,
                   help="auto mode: uncached prompt tokens below which the decode worker prefills "
                        f"(default {d.auto_threshold_tokens})")
    _add_balance_flags(s)
    s.add_argument("--model", default="default",
                   help="checkpoint directory whose tokenizer the router uses, or 'default'")
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the name the workers register)")
    s.add_argument("--store", default=None, help="a kvstore node host:port (default: via etcd)")
    s.add_argument("--api-key", default=os.environ.get("KVROUTER_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $KVROUTER_API_KEY, else off)")
    s.add_argument("--max-inflight", type=int, default=d.max_inflight_requests,
                   help=f"requests admitted at once; past it, 429 (default {d.max_inflight_requests})")
    s.add_argument("--request-log", default=None, help="append one JSON line per request here")
    s.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help="request bodies past this size get 413 without being parsed "
                        f"(default {d.max_body_bytes})")
    s.add_argument("--log-level", default="info", help="debug, info, warning or error (default info)")
    add_secret_flags(s, server=False)
    add_tls_flags(s)
    s.add_argument("--public-tls-cert", default=None, metavar="PEM",
                   help="serve the public API over HTTPS with this certificate (with "
                        "--public-tls-key; no client certificate asked; default: plain HTTP)")
    s.add_argument("--public-tls-key", default=None, metavar="PEM", help="its private key")
    _add_scaling_flags(s)

    u = sub.add_parser("up", help="run etcd, a store, workers and the router locally")
    u.add_argument("--port", type=int, default=8000, help="the router's port (0: a free one)")
    u.add_argument("--host", default="127.0.0.1", help="the router's bind address (default 127.0.0.1)")
    u.add_argument("--prefill", type=int, default=1, help="prefill workers (default 1)")
    u.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    u.add_argument("--colocated", type=int, default=1,
                   help="with --mode colocated: colocated workers, the router choosing among them by "
                        "cache hits and load (default 1)")
    u.add_argument("--mode", choices=MODES, default=None,
                   help=f"{mode_help} (default disaggregated; auto with --autoscale)")
    u.add_argument("--policy", choices=PREFILL_POLICIES, default="kv-aware", help=f"{policy_help} (default kv-aware)")
    u.add_argument("--auto-threshold", type=int, default=None,
                   help="the router's --auto-threshold (default: its default, "
                        f"{d.auto_threshold_tokens})")
    _add_balance_flags(u)
    u.add_argument("--model", default="default", help="'default' or a checkpoint directory")
    u.add_argument("--etcd", default=None, help="use this etcd instead of starting one")
    u.add_argument("--cluster", default="kvlocal", help="cluster name in etcd (default kvlocal)")
    u.add_argument("--threads-per-worker", type=int, default=1, help="torch threads of each worker (default 1)")
    u.add_argument("--store-memory", default="512M", help="the store daemon's host arena, e.g. 2G (default 512M)")
    u.add_argument("--api-key", default=os.environ.get("KVROUTER_API_KEY"),
                   help="the router requires 'Authorization: Bearer KEY' (default: $KVROUTER_API_KEY, else off)")
    u.add_argument("--request-log", default=None, help="the router appends one JSON line per request here")
    u.add_argument("--log-dir", default=None,
                   help="children's logs, the cluster secret file and cluster.json (default: a temp dir)")
    add_secret_flags(u, server=False)
    add_tls_flags(u)
    u.add_argument("--tls-dir", default=None, metavar="DIR",
                   help="TLS with mutual certificates between every part (etcd included): a CA "
                        "and a node certificate in DIR, made there unless present (instead of "
                        "--tls-cert/--tls-key/--tls-ca)")
    u.add_argument("--no-cluster-secret", action="store_true",
                   help="start the children without a cluster secret (default: use the one given, "
                        "else generate one for this cluster)")
    u.add_argument("--metrics-port", type=int, default=0,
                   help="port of the launcher's own Prometheus /metrics (restarts of children) on "
                        "127.0.0.1 (default 0: a free port, printed; -1: none)")
    u.add_argument("--engine", choices=("kvengine", "vllm"), default="kvengine",
                   help="what serves as each worker: kvengine (ours, default) or vllm (vLLM's OpenAI server "
                        "with the store's KV connector, from --vllm-python; docs/integrations.md)")
    u.add_argument("--vllm-python", default="",
                   help="the Python whose vLLM --engine vllm runs (default: the repository's .venv-vllm, "
                        "made by scripts/setup_vllm.sh)")
    u.add_argument("--vllm-kv-cache", default="1G",
                   help="each vLLM instance's KV cache, e.g. 4G (default 1G; --engine vllm)")
    u.add_argument("--vllm-block-size", type=int, default=32,
                   help="vLLM's block size in tokens (default 32: its CPU attention takes multiples of 32)")
    u.add_argument("--worker-arg", action="append", default=[],
                   help="extra flag for every `kvengine serve` (repeatable), e.g. --worker-arg=--num-blocks=256; "
                        "with --engine vllm, for every vLLM server, e.g. --worker-arg=--max-num-seqs=8")
    u.add_argument("--store-arg", action="append", default=[],
                   help="extra flag for every `kvstore serve` (repeatable), e.g. --store-arg=--ssd-dir=/data")
    u.add_argument("--ucx", action="store_true",
                   help="the store daemons also serve UCX (`kvstore serve --ucx`): workers and daemons "
                        "on another host move blocks over it, same-host ones keep shared memory "
                        "(kvstore.client.transport); not with --tls (UCX is unencrypted)")
    u.add_argument("--ready-timeout", type=float, default=180.0,
                   help="seconds each child has to become ready (default 180)")
    u.add_argument("--hosts", type=int, default=0, metavar="N",
                   help="spread the cluster over N local hosts (network namespaces on a bridge, "
                        "each with its own /dev/shm; needs root): a store and workers on each, etcd "
                        "and the router on host 0 (router.cluster.multihost); default 0: one host")
    u.add_argument("--host-roles", default=None, metavar="LIST",
                   help="with --hosts: the workers of each host, e.g. prefill,decode,decode (the "
                        "default: prefill on host 0, decode on the others; prefill+decode for two on "
                        "one host); --prefill/--decode are then ignored")
    for role in ("prefill", "decode", "colocated"):
        u.add_argument(f"--{role}-cpus", default=None, metavar="CPUS",
                       help=f"pin every {role} worker to these CPUs (e.g. 0 or 0,1 or 0-3)")
    a = u.add_argument_group("autoscaling (router.cluster.autoscaler)")
    a.add_argument("--autoscale", action="store_true",
                   help="act on the router's per-pool desired worker counts: role changes first "
                        "(drained first), then starting and stopping workers within --max-workers; "
                        "workers are named worker-N; --prefill/--decode give the first layout")
    a.add_argument("--max-workers", type=int, default=None, metavar="N",
                   help="with --autoscale: the most workers running, draining or starting at once "
                        "(default: --prefill + --decode)")
    a.add_argument("--autoscale-interval", type=float, default=2.0, metavar="S",
                   help="with --autoscale: seconds between reads of the router's signals (default 2)")
    _add_scaling_flags(u)
    return p


def _add_scaling_flags(p: argparse.ArgumentParser) -> None:
    from router.scaling.policy import SCALING_FLAGS, ScalingConfig

    d = ScalingConfig()
    g = p.add_argument_group("scaling signals (router.scaling: GET /admin/scaling, kvrouter_pool_* gauges)")
    for flag, name, text in SCALING_FLAGS:
        g.add_argument(flag, type=float, default=None, dest=name, metavar="S" if name.endswith("_s") else "X",
                       help=f"{text} (default {getattr(d, name):g})")


def _scaling_config(args: argparse.Namespace) -> "ScalingConfig":
    from router.scaling.policy import SCALING_FLAGS, ScalingConfig

    return ScalingConfig(**{name: getattr(args, name) for _f, name, _h in SCALING_FLAGS
                            if getattr(args, name) is not None})


def _scaling_argv(args: argparse.Namespace) -> tuple[str, ...]:
    """The ``--scale-*`` and ``--balance-*`` flags given to ``up``, for its router's command line."""
    balance = tuple(x for flag, name in (("--balance-abs", "balance_abs"), ("--balance-rel", "balance_rel"))
                    if getattr(args, name) is not None for x in (flag, str(getattr(args, name))))
    from router.scaling.policy import SCALING_FLAGS

    return balance + tuple(x for flag, name, _h in SCALING_FLAGS if getattr(args, name) is not None
                           for x in (flag, repr(getattr(args, name))))


def _add_balance_flags(p: argparse.ArgumentParser) -> None:
    from router.placement.balance import Balance

    d = Balance()
    p.add_argument("--balance-abs", type=int, default=None, metavar="N",
                   help="colocated mode: leave out workers with more than N queued+running requests "
                        f"above the least loaded one (and past --balance-rel times it; default {d.abs_requests})")
    p.add_argument("--balance-rel", type=float, default=None, metavar="X",
                   help="colocated mode: ... and more than X times the least loaded one's load "
                        f"(default {d.rel:g})")


def _balance(args: argparse.Namespace) -> "Balance":
    from router.placement.balance import Balance

    d = Balance()
    return Balance(d.abs_requests if args.balance_abs is None else args.balance_abs,
                   d.rel if args.balance_rel is None else args.balance_rel)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    return _up(args)


# --- kvrouter serve ------------------------------------------------------------------------

def _serve(args: argparse.Namespace) -> int:
    from engine.api.paths import resolve_model_dir
    from kvstore import tls
    from kvstore.secret import SecretError, resolve
    from router.config import RouterConfig
    from router.server_main import run_router

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        model_dir = resolve_model_dir(args.model)
        config = RouterConfig(
            model_dir=str(model_dir), served_model_name=args.served_model_name, host=args.host,
            port=args.port, etcd=args.etcd, cluster=args.cluster, store=args.store,
            mode=args.mode, policy=args.policy, auto_threshold_tokens=args.auto_threshold,
            balance=_balance(args),
            max_inflight_requests=args.max_inflight, api_key=args.api_key or None,
            request_log=args.request_log, max_body_bytes=args.max_body_bytes,
            cluster_secret=resolve(args.cluster_secret, args.cluster_secret_file),
            scaling=_scaling_config(args))
        tls.configure(tls.from_args(args))   # its calls to workers, the store and etcd
        public_tls = _public_tls(args)
    except (FileNotFoundError, SecretError, ValueError) as exc:   # TLSError is a ValueError
        print(f"kvrouter: {exc}", file=sys.stderr)
        return 2
    return run_router(config, log_level=args.log_level, public_tls=public_tls)


def _public_tls(args: argparse.Namespace) -> tuple[str, str] | None:
    cert, key = args.public_tls_cert, args.public_tls_key
    if not cert and not key:
        return None
    if not (cert and key):
        raise ValueError("--public-tls-cert and --public-tls-key go together")
    for path, flag in ((cert, "--public-tls-cert"), (key, "--public-tls-key")):
        if not os.access(path, os.R_OK):
            raise ValueError(f"cannot read {flag} {path!r}")
    return cert, key


# --- kvrouter up ---------------------------------------------------------------------------

def _say(line: str) -> None:
    print(f"[up {time.strftime('%H:%M:%S')}] {line}", flush=True)


def usage_banner(url: str, model: str, api_key: str | None) -> str:
    """The ``curl`` line and ``openai`` snippet printed once the cluster is up."""
    body = json.dumps({"model": model, "prompt": "The capital of France is", "max_tokens": 16,
                       "temperature": 0})
    auth = f" -H 'Authorization: Bearer {api_key}'" if api_key else ""
    return "\n".join([
        "",
        f"The router is up at {url} (OpenAI API under {url}/v1). Try:",
        "",
        f"curl -s {url}/v1/completions -H 'Content-Type: application/json'{auth} -d '{body}'",
        "",
        "python - <<'EOF'",
        "from openai import OpenAI",
        f"client = OpenAI(base_url={url + '/v1'!r}, api_key={api_key or 'none'!r})",
        f"reply = client.chat.completions.create(model={model!r}, max_tokens=32, temperature=0,",
        "    messages=[{'role': 'user', 'content': 'What is the capital of France?'}])",
        "print(reply.choices[0].message.content)",
        "EOF",
        "",
        "Ctrl-C stops everything.",
    ])


def _up(args: argparse.Namespace) -> int:
    import httpx

    from kvstore import secret as cluster_secret
    from kvstore import tls
    from router.cluster.launcher import ClusterSpec, LaunchError
    from router.cluster.supervisor import Supervisor, SupervisorMetrics, serve_metrics

    try:
        secret = None if args.no_cluster_secret else cluster_secret.resolve(
            args.cluster_secret, args.cluster_secret_file)
        tls_config = tls.from_args(args)
        if args.tls_dir:
            if tls_config is not None:
                raise ValueError("--tls-dir or --tls-cert/--tls-key/--tls-ca, not both")
            from kvstore.certs import make_certs

            made = os.path.isfile(os.path.join(args.tls_dir, "node.pem"))
            tls_config = (tls.TLSConfig.from_dir(args.tls_dir).check() if made
                          else make_certs(args.tls_dir)["node"])
        if args.ucx and tls_config is not None:
            raise ValueError("--ucx with TLS: the UCX path is unencrypted and TLS clients never take "
                             "it; drop one of them")
        mode = args.mode or ("auto" if args.autoscale else "disaggregated")
        autoscale = _autoscale_spec(args, mode)
        _scaling_config(args)   # the --scale-* flags are checked here, not in the router's log
        _balance(args)          # and so are the --balance-* ones
        spec = ClusterSpec(
            port=args.port, host=args.host, prefill=args.prefill, decode=args.decode,
            colocated=args.colocated,
            mode=mode, policy=args.policy, auto_threshold=args.auto_threshold,
            model=args.model, etcd=args.etcd, cluster=args.cluster,
            threads_per_worker=args.threads_per_worker, store_memory=args.store_memory,
            api_key=args.api_key or None, cluster_secret=secret, insecure=args.no_cluster_secret,
            request_log=args.request_log, log_dir=args.log_dir,
            ready_timeout=args.ready_timeout, worker_args=tuple(args.worker_arg),
            store_args=tuple(args.store_arg) + (("--ucx",) if args.ucx else ()),
            prefill_cpus=args.prefill_cpus, decode_cpus=args.decode_cpus,
            colocated_cpus=args.colocated_cpus, tls=tls_config, workers_by_index=args.autoscale,
            router_args=_scaling_argv(args), engine=args.engine, vllm_python=args.vllm_python,
            vllm_kv_cache=args.vllm_kv_cache, vllm_block_size=args.vllm_block_size)
        tls.configure(tls_config)   # the launcher's own calls to etcd and the router
    except ValueError as exc:   # SecretError and TLSError are ones
        print(f"kvrouter up: {exc}", file=sys.stderr)
        return 2

    def on_signal(signum: int, _frame: object) -> None:
        raise _Stop(signum)

    try:
        cluster = _make_cluster(args, spec)
    except ValueError as exc:
        print(f"kvrouter up: {exc}", file=sys.stderr)
        return 2
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    close_metrics = None
    autoscaler: "Autoscaler | None" = None
    code = 0
    try:
        metrics = SupervisorMetrics()
        if args.metrics_port >= 0:
            metrics_url, close_metrics = serve_metrics(metrics, args.metrics_port)
            cluster.state_extra["metrics"] = metrics_url
            _say(f"launcher metrics at {metrics_url}")
        cluster.start()
        assert cluster.router_url is not None
        headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
        models = httpx.get(f"{cluster.router_url}/v1/models", headers=headers, timeout=5,
                           trust_env=False).json()
        print(usage_banner(cluster.router_url, models["data"][0]["id"], spec.api_key), flush=True)
        supervisor = Supervisor(cluster, _say, metrics=metrics)
        if autoscale is not None:
            from router.cluster.autoscaler import Autoscaler

            autoscaler = Autoscaler(cluster, autoscale, _say, registry=metrics.registry).start()
            _say(f"autoscaling within {autoscale.max_workers} worker(s); its timeline in "
                 f"{autoscaler.timeline}")
        _supervise(supervisor)
    except _Stop as stop:
        _say(f"{signal.Signals(stop.args[0]).name}: stopping")
    except (LaunchError, OSError) as exc:   # OSError: the metrics port
        print(f"kvrouter up: {exc}", file=sys.stderr)
        code = 1
    finally:
        # A second Ctrl-C while stopping must not leave children behind.
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)
        if autoscaler is not None:   # before the children it acts on go
            autoscaler.close()
        cluster.stop()
        if close_metrics is not None:
            close_metrics()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    _say("all stopped")
    return code


def _autoscale_spec(args: argparse.Namespace, mode: str) -> "AutoscaleSpec | None":
    """``--autoscale``'s spec (None without it); ValueError for what it cannot do."""
    if not args.autoscale:
        if args.max_workers is not None:
            raise ValueError("--max-workers needs --autoscale")
        return None
    from router.cluster.autoscaler import AutoscaleSpec

    if mode == "colocated":
        raise ValueError("--autoscale moves workers between the prefill and decode pools; "
                         "--mode colocated has one pool (use --mode auto: no prefill worker is "
                         "its colocated state)")
    if args.hosts:
        raise ValueError("--autoscale runs on one host (not with --hosts)")
    initial = args.prefill + args.decode
    spec = AutoscaleSpec(max_workers=args.max_workers or initial, interval_s=args.autoscale_interval)
    if initial > spec.max_workers:
        raise ValueError(f"--prefill {args.prefill} + --decode {args.decode} is more than "
                         f"--max-workers {spec.max_workers}")
    return spec


def _make_cluster(args: argparse.Namespace, spec: "ClusterSpec") -> "LocalCluster":
    """A ``LocalCluster``, or with ``--hosts N`` a ``MultiHostCluster`` over N hosts."""
    from router.cluster.launcher import LocalCluster

    if not args.hosts:
        if args.host_roles:
            raise ValueError("--host-roles needs --hosts N")
        return LocalCluster(spec, on_status=_say)
    from router.cluster.multihost import MultiHostCluster, default_host_roles, parse_host_roles

    roles = (parse_host_roles(args.host_roles, args.hosts) if args.host_roles
             else default_host_roles(args.hosts))
    return MultiHostCluster(spec, roles, on_status=_say)


def _supervise(supervisor: "Supervisor") -> None:
    """Keep every child alive until a signal ends ``kvrouter up`` (router.cluster.supervisor)."""
    while True:
        time.sleep(0.2)
        supervisor.poll()


if __name__ == "__main__":
    sys.exit(main())
