"""``kvstore``: run a store node (``serve``), inspect one (``stats``), measure one (``bench``);
the cluster's nodes, drains and settings (``nodes``, ``drain``, ``config``: ``kvstore.daemon.admin``).

``kvstore serve`` prints one readiness line once it accepts connections::

    kvstore ready address=127.0.0.1:7700 node_id=<hex> arena=<shm name> metrics=<host:port|->

``address`` is the bound address, or, bound to a wildcard (``--host 0.0.0.0``), the advertised
one (``--advertise-address``, else this host's primary address: ``kvstore.net.address``).

It refuses to start (one line, non-zero exit) on a port in use, and on a non-loopback
``--host`` without a cluster secret unless ``--insecure`` (``kvstore.secret``).

On SIGTERM (or SIGINT) it stops accepting, deregisters from etcd, lets in-flight operations
finish, closes the store (LMDB cleanly) and exits 0. Deregistering before the drain rather
than after it keeps clients from picking a node that no longer accepts connections.

With ``--etcd`` it also keeps R copies of what it holds (``kvstore.daemon.repair``) and drains
when asked by ``kvstore drain`` (``kvstore.daemon.drain``), printing
``kvstore drained node_id=<id>`` before it stops the same way and exits 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Sequence

from kvstore import secret, tls
from kvstore.daemon import admin
from kvstore.daemon.config import DEFAULT_PORT, ServerConfig, format_size, parse_size
from kvstore.daemon.store_node import Daemon
from kvstore.net.limits import ServerLimits

if TYPE_CHECKING:  # imported when started, so that `kvstore --help` stays quick
    pass

__all__ = ["main", "build_parser"]

log = logging.getLogger("kvstore")


# --- commands ----------------------------------------------------------------------------------


def _token(args: argparse.Namespace) -> str | None:
    """The cluster secret from the flags, then the environment (``kvstore.secret``), then the
    deprecated ``--auth-token`` and ``$KVSTORE_AUTH_TOKEN``."""
    token = secret.resolve(args.cluster_secret, args.cluster_secret_file)
    if token is None:
        token = args.auth_token or os.environ.get("KVSTORE_AUTH_TOKEN") or None
        if token is not None:
            log.warning("--auth-token and $KVSTORE_AUTH_TOKEN are deprecated: use "
                        "--cluster-secret-file PATH or $%s", secret.ENV)
    return token


def _reserve_cap(text: str) -> tuple[int, float]:
    """``--max-conn-reserve``: a size (bytes) or a percentage of the arena."""
    text = text.strip()
    if text.endswith("%"):
        return 0, float(text[:-1]) / 100
    return parse_size(text), ServerLimits.conn_reserve_fraction


def _serve(args: argparse.Namespace) -> int:
    reserve_bytes, reserve_fraction = _reserve_cap(args.max_conn_reserve)
    limits = ServerLimits(max_connections=args.max_connections, hello_timeout=args.hello_timeout,
                          idle_timeout=args.idle_timeout, frame_timeout=args.frame_timeout,
                          max_conn_reserve=reserve_bytes, conn_reserve_fraction=reserve_fraction,
                          threads=args.threads)
    config = ServerConfig(
        memory_bytes=parse_size(args.memory), host=args.host, port=args.port,
        ssd_path=args.ssd_path, ssd_capacity_bytes=parse_size(args.ssd_capacity or 0),
        gpu_memory_bytes=parse_size(args.gpu_memory or 0), etcd=args.etcd, cluster=args.cluster,
        auth_token=_token(args), insecure=args.insecure, limits=limits,
        on_corrupt_ssd=args.on_corrupt_ssd, shared_index=not args.no_shared_index,
        metrics_port=args.metrics_port, advertise=args.advertise,
        advertise_address=args.advertise_address,
        registration_ttl=args.registration_ttl, tls=tls.current(),
        node_id=args.node_id, replicas=args.replicas, repair_rate=parse_size(args.repair_rate),
        repair_interval=args.repair_interval, repair_settle=args.repair_settle, ucx=args.ucx,
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    daemon = Daemon(config).start()
    try:
        print(daemon.ready_line(), flush=True)
        while not stop.wait(0.1) and not daemon.drained.is_set():
            pass
        if daemon.drained.is_set():
            print(f"kvstore drained node_id={daemon.node_id}", flush=True)
        log.info("stopping")
    finally:
        daemon.stop()
    return 0


def _format_stats(stats: dict[str, Any]) -> str:
    lines = []
    server = stats.get("server", {})
    lines.append(f"node {server.get('node_id')} at {server.get('address')}: "
                 f"{server.get('connections')} connection(s), up {server.get('uptime_s')} s")
    store = stats.get("store", {})
    tiers = {k: v for k, v in store.items() if isinstance(v, dict)}
    if tiers:
        cols = sorted({k for t in tiers.values() for k in t})
        lines.append(f"{'tier':<6}" + "".join(f"{c:>16}" for c in cols))
        for name, t in tiers.items():
            row = []
            for c in cols:
                v = t.get(c, "")
                row.append(format_size(v) if c.endswith("bytes") and isinstance(v, int) else str(v))
            lines.append(f"{name:<6}" + "".join(f"{v:>16}" for v in row))
    for k, v in store.items():
        if not isinstance(v, dict) and v is not None:
            lines.append(f"{k}: {format_size(v) if k.endswith('bytes') and isinstance(v, int) else v}")
    return "\n".join(lines)


def _stats(args: argparse.Namespace) -> int:
    from kvstore.client.node import Client

    with Client(args.address, auth_token=_token(args), timeout=args.timeout) as c:
        stats = c.stats()
    print(json.dumps(stats, indent=None if args.json else 2) if args.json else _format_stats(stats))
    return 0


def _bench(args: argparse.Namespace) -> int:
    import numpy as np

    from kvstore.client.node import Client

    size, batch = parse_size(args.size), args.batch
    rng = np.random.default_rng(args.seed)
    values = [rng.integers(0, 255, size, dtype=np.uint8) for _ in range(batch)]
    bufs = [np.empty(size, np.uint8) for _ in range(batch)]
    result: dict[str, Any] = {"address": args.address, "block_bytes": size, "batch": batch}
    with Client(args.address, auth_token=_token(args), transport=args.transport,
                timeout=args.timeout) as c:
        result["transport"] = c.transport
        put_s, get_s = [], []
        for i in range(args.iters):
            keys = [rng.bytes(16) for _ in range(batch)]
            t0 = time.perf_counter()
            held = c.put(keys, values)
            t1 = time.perf_counter()
            if not all(held):
                print(f"warning: the store kept {sum(held)} of {batch} blocks (full)", file=sys.stderr)
            found = c.get(keys, bufs)
            t2 = time.perf_counter()
            c.delete(keys)
            if not all(found):
                print(f"warning: {found.count(False)} of {batch} blocks were evicted before the get",
                      file=sys.stderr)
            put_s.append(t1 - t0)
            get_s.append(t2 - t1)
    nbytes = size * batch
    result["put_gbps"] = round(nbytes / min(put_s) / 1e9, 3)
    result["get_gbps"] = round(nbytes / min(get_s) / 1e9, 3)
    result["get_p50_ms"] = round(sorted(get_s)[len(get_s) // 2] * 1e3, 3)
    print(json.dumps(result) if args.json else
          f"{args.transport}->{result['transport']}: {batch} x {format_size(size)}: "
          f"put {result['put_gbps']} GB/s, get {result['get_gbps']} GB/s "
          f"(get p50 {result['get_p50_ms']} ms)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from kvstore.version import installed_version

    p = argparse.ArgumentParser(prog="kvstore", description=(__doc__ or "").split("\n")[0])
    p.add_argument("--version", action="version", version=f"%(prog)s {installed_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run a store node")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=DEFAULT_PORT, help="0 picks a free port")
    s.add_argument("--memory", default="1G", help="host arena size, e.g. 512M, 4G (default 1G)")
    s.add_argument("--ssd-path", help="LMDB directory of the SSD tier (and the node's identity)")
    s.add_argument("--ssd-capacity", help="SSD tier cap, e.g. 100G")
    s.add_argument("--gpu-memory", help="optional CUDA tier size, e.g. 8G (needs a GPU)")
    s.add_argument("--etcd", help="etcd endpoints URL to register with, e.g. http://127.0.0.1:2379")
    s.add_argument("--cluster", default="kvstore", help="cluster name (etcd key prefix)")
    secret.add_secret_flags(s)
    tls.add_tls_flags(s)
    s.add_argument("--auth-token", help="deprecated: the cluster secret's old name "
                                        "(--cluster-secret; also $KVSTORE_AUTH_TOKEN)")
    d = ServerLimits()
    s.add_argument("--max-connections", type=int, default=d.max_connections, metavar="N",
                   help="open connections served at once; one more gets an error and is closed "
                        f"(default {d.max_connections})")
    s.add_argument("--threads", type=int, default=d.threads, metavar="N",
                   help="serving threads: connections with a request in progress at once; idle "
                        f"connections hold none (default {d.threads})")
    s.add_argument("--hello-timeout", type=float, default=d.hello_timeout, metavar="SECONDS",
                   help=f"drop a connection that has not said HELLO by then (default {d.hello_timeout:g})")
    s.add_argument("--idle-timeout", type=float, default=d.idle_timeout, metavar="SECONDS",
                   help=f"drop a connection idle that long (default {d.idle_timeout:g})")
    s.add_argument("--frame-timeout", type=float, default=d.frame_timeout, metavar="SECONDS",
                   help="a request must arrive whole within this time of its first byte, else its "
                        f"reservation is released and the connection closed (default {d.frame_timeout:g})")
    s.add_argument("--max-conn-reserve", default=f"{d.conn_reserve_fraction:.0%}", metavar="SIZE|PCT",
                   help="arena space one connection may hold reserved before it has sent the bytes, "
                        "as a size (256M) or a share of --memory (default "
                        f"{d.conn_reserve_fraction:.0%}%); clients split their puts to fit")
    s.add_argument("--on-corrupt-ssd", choices=("move-aside", "fail"), default="move-aside",
                   help="a damaged --ssd-path at start: move it aside and start empty, keeping the "
                        "node id (default), or fail to start")
    s.add_argument("--no-shared-index", action="store_true",
                   help="publish no shared-memory index of the host tier: same-host gets then "
                        "always ask the daemon (PIN), as over TCP they always do")
    s.add_argument("--ucx", action="store_true",
                   help="also move block bytes over UCX (ucxx, the ucx extra) for clients that ask: "
                        "advertised in etcd, chosen by clients on other hosts; not with TLS")
    s.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port")
    s.add_argument("--advertise-address", metavar="ADDR",
                   help="the address other hosts reach this node at: registered in etcd (with the "
                        "bound port) and printed in the ready line; default: --host, or this "
                        "host's primary non-loopback address when --host is a wildcard")
    s.add_argument("--advertise", metavar="HOST:PORT",
                   help="host:port registered in etcd as given (e.g. behind NAT; default: "
                        "--advertise-address with the bound port)")
    s.add_argument("--registration-ttl", type=float, metavar="SECONDS",
                   default=ServerConfig.registration_ttl,
                   help="etcd lease TTL: a dead node leaves etcd within it (whole seconds, "
                        f"at least 1; kept alive every TTL/3; default {ServerConfig.registration_ttl:g})")
    admin.add_serve_flags(s)
    s.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    s.set_defaults(fn=_serve)

    for name, fn, doc in (("stats", _stats, "print a node's statistics"),
                          ("bench", _bench, "quick put/get throughput against a node")):
        c = sub.add_parser(name, help=doc)
        c.add_argument("address", help="host:port of the daemon")
        secret.add_secret_flags(c, server=False)
        tls.add_tls_flags(c)
        c.add_argument("--auth-token", default=None,
                       help="deprecated: the cluster secret's old name (--cluster-secret; also "
                            "$KVSTORE_AUTH_TOKEN)")
        c.add_argument("--json", action="store_true", help="one JSON object instead of text")
        c.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS",
                       help="bound on connecting and on each reply (default 5)")
        c.set_defaults(fn=fn, log_level="WARNING")
        if name == "bench":
            c.add_argument("--size", default="360K", help="block size (default 360K)")
            c.add_argument("--batch", type=int, default=64, help="blocks per put and per get (default 64)")
            c.add_argument("--iters", type=int, default=10,
                           help="put/get rounds; the best is reported (default 10)")
            c.add_argument("--transport", choices=("auto", "tcp", "shm", "ucx"), default="auto",
                           help="auto: shared memory on the daemon's host, else UCX where the daemon "
                                "serves it (--ucx) and ucxx imports here, else TCP; the others force one")
            c.add_argument("--seed", type=int, default=0, help="seed of the block contents and keys")
    from kvstore.certs import add_certs_command

    add_certs_command(sub)
    admin.add_commands(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kvstore.errors import KVStoreError

    try:
        tls.configure(tls.from_args(args))  # every connection of this process (kvstore.tls)
        return args.fn(args)
    except KVStoreError as e:
        print(f"kvstore {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"kvstore {args.command}: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"kvstore {args.command}: {e.strerror or e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
