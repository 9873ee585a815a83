"""The P→D handoff across hosts: one hop (``--kv-handoff local``) against rendezvous placement.

    python -m benchmarks.store.handoff_bench                  # 3 hosts, a 2,032-token prompt, ~1 min
    python -m benchmarks.store.handoff_bench --hosts 4 --iters 8 --out docs/results

Hosts from the multi-host harness (``router.cluster.hosts``): etcd on host 0, a store daemon
(``kvstore serve``, registered in etcd, R = 1) on every host. The prefill side runs on host 0,
the decode side on host 1, each a process with the engine's real ``KVStoreConnector`` over a
``ClusterClient`` and a paged KV cache of SmolLM2-135M's shape (30 layers, 3 KV heads, head dim
64, float32, 16-token blocks: 737,344 bytes a block with the codec's header). Per round and
mode, a fresh 2,032-token prompt's 127 blocks are

- saved as a prefill saves them: ``save_blocks`` then ``flush`` until the store acknowledged
  every block (``local``: to host 0's node over shared memory; ``owners``: to each block's
  rendezvous owner, a third of them on each host);
- then loaded as the decode loads them: one ``load_blocks`` (``local``: from the source node
  the save reported, over TCP; ``owners``: from each owner, host 1's own over shared memory).

Reported per mode: the best and median save, load and total (save + load) milliseconds over
``--iters`` rounds (the modes alternate each round), the KV bytes that crossed the network on
the request path (TCP bytes sent by the save plus received by the load) in blocks' worth
(``hops``: 1.0 for one hop; 4/3 for rendezvous on 3 hosts, approaching 2 with more), and the
ratios local / owners. In ``local`` the background copy to the owners (the ``Placer``) starts
a second after the save, as in serving; a round starts once the last one's copies are done,
and their blocks are counted separately (``placed_blocks``), off the request path. One JSON
line; ``--out DIR`` also writes ``DIR/handoff.json`` (docs/results/handoff_hosts.json is one).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.lifecycle import REPO
from benchmarks.report import emit, machine_info
from kvstore.proc import read_line

STORE_PORT, ETCD_PORT = 7700, 2379
LAYERS, KV_HEADS, HEAD_DIM, BLOCK_TOKENS = 30, 3, 64, 16
_ROLE = "import sys; from benchmarks.store.handoff_bench import role; role(sys.argv[1:])"
_SECRET_ENV = ("KVSTORE_AUTH_TOKEN", "KVCACHE_CLUSTER_SECRET", "KVCACHE_CLUSTER_SECRET_FILE")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.store.handoff_bench",
                                description=(__doc__ or "").split("\n")[0])
    p.add_argument("--hosts", type=int, default=3, help="hosts, each a store node (>= 2; default 3)")
    p.add_argument("--tokens", type=int, default=2032, help="prompt tokens handed off (default 2032)")
    p.add_argument("--iters", type=int, default=5, help="rounds per mode (default 5)")
    p.add_argument("--memory", default="1G", help="each store node's memory (default 1G)")
    p.add_argument("--out", default=None, help="also write OUT/handoff.json")
    return p


# --- the two sides (run inside a host) ------------------------------------------------------

def _tcp_bytes(cc: Any) -> tuple[int, int]:
    """(sent, received) over TCP by this process's per-node clients: the network's share."""
    sent = recv = 0
    for node in cc.nodes:
        client = cc.node_client(node)
        if client is not None and client.transport == "tcp":
            sent, recv = sent + client.bytes_sent, recv + client.bytes_received
    return sent, recv


def role(argv: list[str]) -> None:
    """``prefill ETCD CLUSTER BLOCKS`` or ``decode ETCD CLUSTER BLOCKS``: a line protocol on
    stdin/stdout, one JSON object a line, until stdin closes."""
    import torch

    from engine.kv.connector import KVStoreConnector
    from kvstore.client.cluster import ClusterClient
    from kvstore.keys import block_keys, namespace_id

    torch.set_num_threads(1)
    side, etcd, cluster, nblocks = argv[0], argv[1], argv[2], int(argv[3])
    cc = ClusterClient(etcd, cluster)
    cc.wait_for_nodes(int(argv[4]), 20.0)
    shape = (LAYERS, 2, nblocks, BLOCK_TOKENS, KV_HEADS, HEAD_DIM)
    cache = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) if side == "prefill"
             else torch.zeros(shape))
    conn = KVStoreConnector(cc, cache, save_all=False)
    ids = list(range(nblocks))
    print(json.dumps({"ready": side, "local": cc.local_node_id}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        deadline = time.monotonic() + 60
        while not conn.placer_idle and time.monotonic() < deadline:   # the last round's copies
            time.sleep(0.05)
        keys = block_keys(namespace_id({"bench": "handoff", "round": cmd["round"]}),
                          list(range(nblocks * BLOCK_TOKENS)), BLOCK_TOKENS)
        sent0, recv0 = _tcp_bytes(cc)
        t0 = time.perf_counter()
        if side == "prefill":
            rid = f"r{cmd['round']}"
            node = cc.local_node_id if cmd["mode"] == "local" else None
            conn.save_blocks(keys, ids, request_id=rid, node=node)
            result = conn.flush(rid).result(timeout=120)
            ms = (time.perf_counter() - t0) * 1e3
            sent1, _ = _tcp_bytes(cc)
            print(json.dumps({"ms": ms, "node": result.node, "saved": result.saved_blocks,
                              "tcp_bytes": sent1 - sent0,
                              "placed": conn.stats_snapshot().placed_blocks}), flush=True)
        else:
            loaded = conn.load_blocks(keys, ids, source=cmd.get("source"))
            ms = (time.perf_counter() - t0) * 1e3
            _, recv1 = _tcp_bytes(cc)
            ok = bool(torch.equal(cache, torch.randn(shape, generator=torch.Generator().manual_seed(0))))
            print(json.dumps({"ms": ms, "loaded": loaded.loaded, "tcp_bytes": recv1 - recv0,
                              "equal": ok}), flush=True)
    conn.close()
    cc.close()


# --- the driver ---------------------------------------------------------------------------

def _read_json(proc: subprocess.Popen[str], what: str, timeout: float = 120.0) -> dict[str, Any]:
    return json.loads(read_line(proc, what, timeout))


def _ask(proc: subprocess.Popen[str], cmd: dict[str, Any], what: str) -> dict[str, Any]:
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(cmd) + "\n")
    proc.stdin.flush()
    return _read_json(proc, what)


def _summary(rows: list[dict[str, Any]], block_bytes: int, nblocks: int) -> dict[str, Any]:
    total = [r["save_ms"] + r["load_ms"] for r in rows]
    net = statistics.median(r["net_bytes"] for r in rows)
    return {"save_ms": round(min(r["save_ms"] for r in rows), 1),
            "load_ms": round(min(r["load_ms"] for r in rows), 1),
            "total_ms": round(min(total), 1), "total_ms_median": round(statistics.median(total), 1),
            "net_bytes": int(net), "hops": round(net / (block_bytes * nblocks), 3)}


def run(n_hosts: int, tokens: int, iters: int, memory: str) -> dict[str, Any]:
    from kvstore import codec
    from kvstore.daemon.config import parse_size
    from router.cluster.hosts import Hosts

    if n_hosts < 2:
        raise SystemExit("--hosts must be >= 2 (the prefill and decode sides on different hosts)")
    nblocks = tokens // BLOCK_TOKENS
    block_bytes = codec.encoded_size("float32", (LAYERS, 2, BLOCK_TOKENS, KV_HEADS, HEAD_DIM))
    env = {k: v for k, v in os.environ.items() if k not in _SECRET_ENV}
    cluster = f"handoff{os.getpid()}"
    with tempfile.TemporaryDirectory(prefix="handoff-bench-") as tmpdir, \
            Hosts(n_hosts, shm_size=f"{parse_size(memory) // (1 << 20) + 256}M") as hosts:
        secret = Path(tmpdir) / "cluster-secret"
        secret.write_text(os.urandom(24).hex())
        secret.chmod(0o600)
        env["KVCACHE_CLUSTER_SECRET_FILE"] = str(secret)
        a0 = hosts[0].address
        etcd_url, peer = f"http://{a0}:{ETCD_PORT}", f"http://{a0}:{ETCD_PORT + 1}"
        etcd = hosts[0].popen([shutil.which("etcd") or "/usr/bin/etcd", "--name", "hb",
                               "--data-dir", f"{tmpdir}/etcd", "--listen-client-urls", etcd_url,
                               "--advertise-client-urls", etcd_url, "--listen-peer-urls", peer,
                               "--initial-advertise-peer-urls", peer, "--initial-cluster",
                               f"hb={peer}", "--log-level", "error"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        daemons = []
        for h in hosts:
            daemons.append(h.popen(
                [sys.executable, "-m", "kvstore.daemon.cli", "serve", "--host", h.address,
                 "--port", str(STORE_PORT), "--memory", memory, "--etcd", etcd_url,
                 "--cluster", cluster, "--repair-rate", "0", "--log-level", "WARNING"],
                env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        for i, d in enumerate(daemons):
            assert d.stdout is not None
            line = d.stdout.readline()
            if "kvstore ready" not in line:
                raise RuntimeError(f"store on host {i} did not start: {line} "
                                   f"{d.stderr.read() if d.stderr else ''}"[-2000:])
        sides = {}
        for name, host in (("prefill", hosts[0]), ("decode", hosts[1])):
            sides[name] = host.popen([sys.executable, "-c", _ROLE, name, etcd_url, cluster,
                                      str(nblocks), str(n_hosts)],
                                     env=env, cwd=REPO, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        hello = {name: _read_json(p, f"the {name} side") for name, p in sides.items()}
        rows: dict[str, list[dict[str, Any]]] = {"local": [], "owners": []}
        placed = 0
        for rnd in range(iters + 1):                     # round 0 warms both sides up
            for mode in (("local", "owners") if rnd % 2 else ("owners", "local")):
                tag = rnd * 2 + (mode == "local")
                saved = _ask(sides["prefill"], {"round": tag, "mode": mode}, "the prefill side")
                source = saved["node"] if mode == "local" else None
                loaded = _ask(sides["decode"], {"round": tag, "source": source}, "the decode side")
                if saved["saved"] != nblocks or loaded["loaded"] != nblocks or not loaded["equal"]:
                    raise RuntimeError(f"round {rnd} {mode}: saved {saved}, loaded {loaded}")
                if mode == "local" and source != hello["prefill"]["local"]:
                    raise RuntimeError(f"the save named node {source}, not host 0's")
                placed = saved["placed"]
                if rnd:
                    rows[mode].append({"save_ms": saved["ms"], "load_ms": loaded["ms"],
                                       "net_bytes": saved["tcp_bytes"] + loaded["tcp_bytes"]})
        for p in sides.values():
            assert p.stdin is not None
            p.stdin.close()
            p.wait(30)
        etcd.terminate()
    local, owners = (_summary(rows[m], block_bytes, nblocks) for m in ("local", "owners"))
    return {
        "bench": "handoff", "hosts": n_hosts, "tokens": tokens, "blocks": nblocks,
        "block_bytes": block_bytes, "iters": iters, "local": local, "owners": owners,
        "local_vs_owners_total": round(local["total_ms"] / owners["total_ms"], 3),
        "local_vs_owners_net_bytes": round(local["net_bytes"] / max(1, owners["net_bytes"]), 3),
        "placed_blocks": placed,
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rec = run(args.hosts, args.tokens, args.iters, args.memory)
    rec["machine"] = machine_info()
    emit(rec, Path(args.out) / "handoff.json" if args.out else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
