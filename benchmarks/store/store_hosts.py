"""``store_bench --hosts 2``: the store between two hosts, against a raw socket on the same link.

Two hosts from the multi-host harness (``router.cluster.hosts.Hosts``: a network namespace
each, a veth into a bridge, a private ``/dev/shm``): host 1 runs a real ``kvstore serve``
(bound to ``0.0.0.0``, the cluster secret from a file) and a raw TCP server; host 0 runs the
client, which times, for every block size and batch of ``store_bench``:

- ``get``: ``Client.get`` of the batch into preallocated buffers (TCP: the daemon is on
  another host, so no arena is mapped; the client checks ``map_attempts == 0``);
- ``put``: ``Client.put`` of the batch (the keys deleted, untimed, before each one);
- ``raw_get``: a 24-byte request to the raw server, which ``sendmsg``s the batch as one
  iovec from preallocated memory, received with ``recvmsg_into`` into the same buffers;
- ``raw_put``: the batch as one ``sendmsg`` iovec behind a 24-byte header, received into
  preallocated buffers, then an 8-byte answer.

Both sides of the raw socket are set up as the client's and the daemon's
(``sockio.tune_socket``), so the raw pair is the link with a free protocol: the limit. The
four are timed interleaved (one of each per round, ``--iters`` rounds after a warm-up); each
figure is the best round, with the median ratio beside it. Ratios are ours / raw.

The handoff: a 2,032-token prompt's KV (127 blocks of 16 tokens, 46,080 bytes a token for
SmolLM2-135M in float32, plus the codec's 64-byte header: 737,344 bytes a block) saved as the
engine connector saves it (puts of at most 64 MiB) and loaded in one get, both across the
link: the prefill and decode workers on hosts other than the store's. Beside it, the raw
socket moving the same bytes in the same pattern.

With ``--transport ucx`` the daemon serves UCX (``kvstore serve --ucx``) and the timed client
is a UCX one (``Client(transport="ucx")``: block bytes as tagged UCX messages,
``kvstore.net.ucx``); a TCP client of the same daemon is timed in the same rounds
(``tcp_get``/``tcp_put``, ``*_vs_tcp``). Every row then also has the CPU-seconds per GB moved
of the process serving each (the daemon for ours, the raw server for the raw socket;
``/proc/PID/stat``, summed over the timed calls): ``*_cpu_s_per_gb``. Where NIXL imports
(``nixl-cu12``), the same rounds also time its UCX backend's one-sided transfers of the same
bytes between the same hosts (``nixl_get``: a READ of the batch from a NIXL target on the
store's host into the client's buffers; ``nixl_put``: a WRITE; ``*_vs_nixl``; the target's
CPU-seconds per GB beside them; ``benchmarks.peers.nixl_peer``), the reads checked bit-exact.

With ``--tls`` the daemon and client speak TLS (``kvstore.tls``, certificates from
``kvstore.certs``) and the raw pair stays plain, so ``get_vs_raw`` is what TLS costs on the
link; a second raw pair speaks TLS with the same certificates and the same socket helpers
(``raw_tls_*``, ``*_vs_raw_tls``): Python's TLS with a free protocol.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.lifecycle import REPO

KiB, MiB = 1 << 10, 1 << 20
STORE_PORT, RAW_PORT = 7700, 7701
HANDOFF_TOKENS, BLOCK_TOKENS, TOKEN_BYTES, CODEC_HEADER = 2032, 16, 46_080, 64
CONNECTOR_BATCH_BYTES = 64 << 20  # engine/kv/connector.py's _MAX_BATCH_BYTES
_HDR = np.dtype("<u8")
OP_GET, OP_PUT, OP_QUIT = 1, 2, 3
_SECRET_ENV = ("KVSTORE_AUTH_TOKEN", "KVCACHE_CLUSTER_SECRET", "KVCACHE_CLUSTER_SECRET_FILE")
_ROLE = "import sys; from benchmarks.store.store_hosts import role; role(sys.argv[1:])"


# --- inside the hosts ------------------------------------------------------------------------


def role(argv: list[str]) -> None:
    """Entry of the processes started inside the hosts: ``raw-server PORT MAX_BYTES``,
    ``nixl-server MAX_BYTES`` or ``client CONFIG_JSON``."""
    if argv[0] == "nixl-server":
        from benchmarks.peers import nixl_peer

        nixl_peer.serve(int(argv[1]))
    elif argv[0] == "raw-server":
        _raw_server(int(argv[1]), int(argv[2]), tls=argv[3:] == ["tls"])
    elif argv[0] == "client":
        print(json.dumps(_client(json.loads(argv[1]))), flush=True)
    else:
        raise SystemExit(f"unknown role {argv[0]!r}")


def _raw_server(port: int, max_bytes: int, tls: bool = False) -> None:
    """One connection: GET -> send COUNT x SIZE bytes in one iovec; PUT -> receive them into
    preallocated buffers, answer 8 bytes. Both sockets tuned as the daemon's; with ``tls``
    wrapped in TLS (the settings of ``$KVCACHE_TLS_*``, as the daemon's), moved by the same
    helpers the daemon uses on TLS sockets."""
    from kvstore.net.sockio import recv_buffers, send_buffers, tune_socket

    src = np.random.default_rng(1).integers(0, 256, max_bytes, dtype=np.uint8)
    dst = np.ones(max_bytes, np.uint8)
    lsock = socket.create_server(("0.0.0.0", port))
    print("listening", flush=True)
    conn, _ = lsock.accept()
    lsock.close()
    tune_socket(conn, None)
    if tls:
        from kvstore import tls as tls_settings

        config = tls_settings.current()
        assert config is not None, "raw-server tls: no $KVCACHE_TLS_* settings"
        conn = config.server_context().wrap_socket(conn, server_side=True)
    hdr = memoryview(bytearray(24))
    ack = b"\0" * 8
    with conn:
        while True:
            try:
                recv_buffers(conn, [hdr])
            except ConnectionError:
                return
            op, size, count = np.frombuffer(hdr, _HDR).tolist()
            if op == OP_GET:
                send_buffers(conn, [src[i * size: (i + 1) * size] for i in range(count)])
            elif op == OP_PUT:
                recv_buffers(conn, [dst[i * size: (i + 1) * size] for i in range(count)])
                conn.sendall(ack)
            else:
                return


class _Raw:
    """Host 0's end of the raw socket."""

    def __init__(self, address: str, tls: bool = False) -> None:
        from kvstore.net.sockio import tune_socket

        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        tune_socket(self.sock, None)
        if tls:
            from kvstore import tls as tls_settings

            config = tls_settings.current()
            assert config is not None, "raw tls: no $KVCACHE_TLS_* settings"
            self.sock = config.client_context().wrap_socket(self.sock, server_hostname=host)
        self._ack = memoryview(bytearray(8))

    def get(self, bufs: list[np.ndarray]) -> None:
        from kvstore.net.sockio import recv_buffers

        self.sock.sendall(np.array([OP_GET, bufs[0].nbytes, len(bufs)], _HDR).tobytes())
        recv_buffers(self.sock, bufs)

    def put(self, bufs: list[np.ndarray]) -> None:
        from kvstore.net.sockio import recv_buffers, send_buffers

        head = np.array([OP_PUT, bufs[0].nbytes, len(bufs)], _HDR).tobytes()
        send_buffers(self.sock, [head, *bufs])
        recv_buffers(self.sock, [self._ack])

    def close(self) -> None:
        try:
            self.sock.sendall(np.array([OP_QUIT, 0, 0], _HDR).tobytes())
        finally:
            self.sock.close()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (the hosts share the pid namespace)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rounds(fns: dict[str, Any], before: Any, iters: int,
            cpu: dict[str, Any] | None = None) -> dict[str, list[float]]:
    """One warm-up round, then ``iters`` rounds of each of ``fns`` in turn (``before`` runs
    untimed ahead of every round); seconds per call. With ``cpu`` ({name: pid}), the CPU
    seconds that pid spent over the timed calls of each name are added to ``cpu["spent"]``."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    spent: dict[str, float] = cpu.setdefault("spent", {}) if cpu is not None else {}
    for r in range(iters + 1):
        before()
        for name, fn in fns.items():
            pid = cpu.get(name) if cpu is not None and r else None
            c0 = _cpu_seconds(pid) if pid else 0.0
            t0 = time.perf_counter()
            fn()
            if r:
                times[name].append(time.perf_counter() - t0)
            if pid:
                spent[name] = spent.get(name, 0.0) + _cpu_seconds(pid) - c0
    return times


def _client(cfg: dict[str, Any]) -> dict[str, Any]:
    from kvstore import Client
    from kvstore.keys import BlockKey

    rng = np.random.default_rng(cfg["seed"])
    transport = cfg.get("transport", "tcp")
    client = Client(cfg["store"], timeout=60, transport=transport)  # TLS (--tls): $KVCACHE_TLS_*
    assert client.transport == transport and client.map_attempts == 0, \
        "the client must reach the daemon over the link, with no arena mapped"
    tcp = Client(cfg["store"], timeout=60, transport="tcp") if transport != "tcp" else None
    if cfg["tls"]:
        assert getattr(client, "tls", None) is not None, "--tls: the client has no TLS settings"
    raw = _Raw(cfg["raw"])
    raw_tls = _Raw(cfg["raw_tls"], tls=True) if cfg["tls"] else None
    nixl = None
    if cfg.get("nixl"):
        from benchmarks.peers.nixl_peer import Initiator

        nixl = Initiator(cfg["nixl"])
        expected = np.random.default_rng(1).integers(0, 256, cfg["max_bytes"], dtype=np.uint8)
    iters = cfg["iters"]
    rows = []
    try:
        for size, batch in cfg["cases"]:
            keys = [BlockKey(rng.bytes(16)) for _ in range(batch)]
            src = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(batch)]
            dst = [np.ones(size, np.uint8) for _ in range(batch)]
            fns = {"put": lambda: client.put(keys, src), "raw_put": lambda: raw.put(src),
                   "get": lambda: client.get(keys, dst), "raw_get": lambda: raw.get(dst)}
            if raw_tls is not None:
                fns |= {"raw_tls_put": lambda: raw_tls.put(src),
                        "raw_tls_get": lambda: raw_tls.get(dst)}
            tkeys = [BlockKey(rng.bytes(16)) for _ in range(batch)] if tcp is not None else []  # its own
            if tcp is not None:
                fns |= {"tcp_put": lambda: tcp.put(tkeys, src), "tcp_get": lambda: tcp.get(tkeys, dst)}
            ndst = [np.ones(size, np.uint8) for _ in range(batch)] if nixl is not None else []
            if nixl is not None:
                nixl.register(src + ndst)
                fns |= {"nixl_put": lambda: nixl.write(src), "nixl_get": lambda: nixl.read(ndst)}
            cpu: dict[str, Any] | None = None
            if cfg.get("pids"):
                cpu = {n: cfg["pids"][n.split("_")[0] if n.startswith(("raw", "nixl")) else "store"]
                       for n in fns}
            t = _rounds(fns, lambda: client.delete(keys + tkeys), iters, cpu)
            if nixl is not None:
                nixl.release()
                assert all(np.array_equal(d, expected[i * size:(i + 1) * size])
                           for i, d in enumerate(ndst)), "NIXL read wrong bytes"
            assert all(client.get(keys, dst)) and np.array_equal(dst[-1], src[-1]), \
                "wrong bytes read back"
            client.delete(keys + tkeys)
            rows.append(_row(size, batch, t, cpu))
        handoff = _handoff(client, raw, rng, iters) if cfg["handoff"] else None
    finally:
        raw.close()
        if raw_tls is not None:
            raw_tls.close()
        client.close()
        if tcp is not None:
            tcp.close()
    return {"results": rows, "handoff": handoff, "transport": transport}


def _row(size: int, batch: int, t: dict[str, list[float]],
         cpu: dict[str, Any] | None = None) -> dict[str, Any]:
    nbytes = size * batch
    row: dict[str, Any] = {"block_bytes": size, "batch": batch}
    for name, ts in t.items():
        row[f"{name}_gbps"] = nbytes / min(ts) / 1e9
        if cpu is not None:  # CPU seconds of the serving process per GB moved by its calls
            row[f"{name}_cpu_s_per_gb"] = cpu["spent"].get(name, 0.0) / (nbytes * len(ts) / 1e9)
    for op in ("get", "put"):
        row[f"{op}_vs_raw"] = min(t[f"raw_{op}"]) / min(t[op])
        row[f"{op}_vs_raw_median"] = statistics.median(t[f"raw_{op}"]) / statistics.median(t[op])
        if f"raw_tls_{op}" in t:
            row[f"{op}_vs_raw_tls"] = min(t[f"raw_tls_{op}"]) / min(t[op])
        if f"tcp_{op}" in t:
            row[f"{op}_vs_tcp"] = min(t[f"tcp_{op}"]) / min(t[op])
        if f"nixl_{op}" in t:
            row[f"{op}_vs_nixl"] = min(t[f"nixl_{op}"]) / min(t[op])
    return {k: _round(v) if isinstance(v, float) else v for k, v in row.items()}


def _round(v: float) -> float:
    """Three decimals, or three significant digits below 1: a NIXL WRITE of one 4 KiB block
    between hosts (0.0004 GB/s in CI) must not be written as zero."""
    return round(v, 3) if abs(v) >= 1 or v == 0 else float(f"{v:.3g}")


def _handoff(client: Any, raw: _Raw, rng: np.random.Generator, iters: int) -> dict[str, Any]:
    from kvstore.keys import BlockKey

    n = HANDOFF_TOKENS // BLOCK_TOKENS
    size = BLOCK_TOKENS * TOKEN_BYTES + CODEC_HEADER
    per_put = max(1, CONNECTOR_BATCH_BYTES // size)
    keys = [BlockKey(rng.bytes(16)) for _ in range(n)]
    src = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]
    dst = [np.ones(size, np.uint8) for _ in range(n)]
    parts = [slice(i, min(n, i + per_put)) for i in range(0, n, per_put)]

    def save() -> None:
        for p in parts:
            client.put(keys[p], src[p])

    def raw_save() -> None:
        for p in parts:
            raw.put(src[p])

    t = _rounds({"save": save, "raw_save": raw_save,
                 "load": lambda: client.get(keys, dst), "raw_load": lambda: raw.get(dst)},
                lambda: client.delete(keys), iters)
    assert all(client.get(keys, dst)) and np.array_equal(dst[0], src[0]), "wrong bytes read back"
    client.delete(keys)
    best = {k: min(v) for k, v in t.items()}
    med = {k: statistics.median(v) for k, v in t.items()}
    return {
        "tokens": HANDOFF_TOKENS, "blocks": n, "block_bytes": size, "bytes": n * size,
        "puts": len(parts),
        "save_ms": round(best["save"] * 1e3, 2), "load_ms": round(best["load"] * 1e3, 2),
        "transfer_ms": round((best["save"] + best["load"]) * 1e3, 2),
        "raw_save_ms": round(best["raw_save"] * 1e3, 2),
        "raw_load_ms": round(best["raw_load"] * 1e3, 2),
        "raw_transfer_ms": round((best["raw_save"] + best["raw_load"]) * 1e3, 2),
        "transfer_vs_raw": round((best["raw_save"] + best["raw_load"])
                                 / (best["save"] + best["load"]), 3),
        "transfer_ms_median": round((med["save"] + med["load"]) * 1e3, 2),
        "transfer_vs_raw_median": round((med["raw_save"] + med["raw_load"])
                                        / (med["save"] + med["load"]), 3),
    }


# --- the orchestrator, in the root namespace ----------------------------------------------------


def _readline(proc: subprocess.Popen, what: str, timeout: float = 60.0) -> str:
    from kvstore.proc import read_line

    try:
        return read_line(proc, what, timeout)
    except RuntimeError as e:
        raise SystemExit(f"store_bench --hosts: {e}") from None


def _tls(tmp: Path, store_address: str) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """The daemon's TLS flags, its environment (for the raw TLS server) and the client's: a
    fresh CA and one certificate each (``kvstore.certs``), the daemon's naming the address the
    client connects to."""
    try:
        certs = importlib.import_module("kvstore.certs")
    except ImportError:
        raise SystemExit("store_bench --hosts --tls: this checkout has no kvstore.certs / "
                         "kvstore.tls (TLS support)") from None
    made = certs.make_certs(tmp / "tls", names=("store", "client"), ips=(store_address,))
    return made["store"].args(), made["store"].environ(), made["client"].environ()


def run(sizes: list[int], batches: list[int], *, iters: int, cap: int, memory: str, seed: int,
        handoff: bool = True, tls: bool = False, transport: str = "tcp") -> dict[str, Any]:
    """Start two hosts, the daemon and raw server on host 1, the client on host 0; the
    client's results with the link's description. ``transport`` "ucx": the daemon serves
    UCX and the timed client uses it, a TCP client beside it (module docstring)."""
    if transport == "ucx" and tls:
        raise SystemExit("store_bench --hosts: --transport ucx does not go with --tls (UCX is unencrypted)")
    from kvstore.daemon.config import parse_size
    from router.cluster.hosts import Hosts, HostsError

    cases = list(dict.fromkeys((s, max(1, min(b, cap // s))) for s in sizes for b in batches))
    max_bytes = max(s * b for s, b in cases)
    if handoff:
        max_bytes = max(max_bytes, CONNECTOR_BATCH_BYTES + BLOCK_TOKENS * TOKEN_BYTES,
                        (HANDOFF_TOKENS // BLOCK_TOKENS) * (BLOCK_TOKENS * TOKEN_BYTES + CODEC_HEADER))
    arena = parse_size(memory)
    shm_size = f"{(arena + 128 * MiB) // MiB}M"
    env = {k: v for k, v in os.environ.items()
           if k not in _SECRET_ENV and not k.startswith("KVCACHE_TLS_")}
    with tempfile.TemporaryDirectory(prefix="store-hosts-") as tmpdir:
        tmp = Path(tmpdir)
        secret = tmp / "cluster-secret"
        secret.write_text(os.urandom(24).hex())
        secret.chmod(0o600)
        env["KVCACHE_CLUSTER_SECRET_FILE"] = str(secret)
        try:
            hosts = Hosts(2, shm_size=shm_size).__enter__()
        except HostsError as e:
            raise SystemExit(f"store_bench --hosts: cannot make the hosts: {e}") from None
        try:
            client_host, store_host = hosts[0], hosts[1]
            tls_args, store_env, client_env = _tls(tmp, store_host.address) if tls else ([], {}, {})
            daemon = store_host.popen(
                [sys.executable, "-m", "kvstore.daemon.cli", "serve", "--host", "0.0.0.0",
                 "--port", str(STORE_PORT), "--memory", memory,
                 "--max-conn-reserve", str(min(arena, max(max_bytes, arena // 4))),
                 "--log-level", "WARNING", *tls_args, *(["--ucx"] if transport == "ucx" else [])],
                env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            ready = _readline(daemon, "the store daemon")
            assert f"address={store_host.address}:{STORE_PORT}" in ready, ready
            raw = store_host.popen([sys.executable, "-c", _ROLE, "raw-server", str(RAW_PORT),
                                    str(max_bytes)], env=env, cwd=REPO, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
            _readline(raw, "the raw socket server")
            nixl_info, nixl_pid = None, None
            if transport == "ucx":
                from benchmarks.peers import nixl_peer

                if nixl_peer.available() is None:
                    nixl_srv = store_host.popen(
                        [sys.executable, "-c", _ROLE, "nixl-server", str(max_bytes)], env=env,
                        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                    line = _readline(nixl_srv, "the NIXL target")
                    if not line.startswith(nixl_peer.MARK):
                        raise SystemExit(f"store_bench --hosts: the NIXL target printed {line!r}")
                    nixl_info = json.loads(line.removeprefix(nixl_peer.MARK))
                    nixl_pid = nixl_srv.pid
                else:
                    print(f"store_bench --hosts: no NIXL rows: {nixl_peer.available()}", file=sys.stderr)
            if tls:
                raw_tls = store_host.popen(
                    [sys.executable, "-c", _ROLE, "raw-server", str(RAW_PORT + 1), str(max_bytes),
                     "tls"], env={**env, **store_env}, cwd=REPO, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True)
                _readline(raw_tls, "the raw TLS socket server")
            mtu = int(client_host.run(["cat", "/sys/class/net/eth0/mtu"]).stdout.strip() or 0)
            cfg = {"store": f"{store_host.address}:{STORE_PORT}",
                   "raw": f"{store_host.address}:{RAW_PORT}",
                   "raw_tls": f"{store_host.address}:{RAW_PORT + 1}", "cases": cases, "iters": iters,
                   "seed": seed, "handoff": handoff, "tls": tls, "transport": transport,
                   "pids": {"store": daemon.pid, "raw": raw.pid, "nixl": nixl_pid} if transport == "ucx" else None,
                   "nixl": nixl_info, "max_bytes": max_bytes}
            client = client_host.popen([sys.executable, "-c", _ROLE, "client", json.dumps(cfg)],
                                       env={**env, **client_env}, cwd=REPO, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
            out, err = client.communicate(timeout=1800)
            if client.returncode != 0:
                raise SystemExit(f"store_bench --hosts: the client failed "
                                 f"(exit {client.returncode}): {err.strip()[-3000:]}")
            result = json.loads(out.strip().splitlines()[-1])
        finally:
            hosts.close()
    result["link"] = {"kind": "veth pair into a Linux bridge, one network namespace a host",
                      "mtu": mtu, "store_host": store_host.address,
                      "client_host": client_host.address, "tls": tls}
    return result
