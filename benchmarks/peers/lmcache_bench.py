"""LMCache store/retrieve through our storage plugin vs LMCache's lm:// server and its Mooncake backend.

    bash benchmarks/peers/setup_lmcache_peers.sh      # once: LMCache 0.5.6 + Mooncake's non-CUDA store
    python -m benchmarks.peers.lmcache_bench [--rounds 7] [--quick] [--markdown]    # one JSON line

It runs in the set-up's bench environment (``--python``; from another Python it runs itself
there). Each configuration is LMCache's own engine (``LMCacheEngineBuilder``, its paged vLLM
connector on host tensors: ``benchmarks/peers/lmcache_engine.py``, as the tests drive it) in a worker
process, all alive at once and timed in turn, ``local_cpu: False`` (LMCache's CPU memory only
its allocator: every retrieve is served by the remote store, not LMCache's hot cache):
``kvstore_shm`` / ``kvstore_tcp``, our plugin against one ``kvstore serve`` on loopback,
transport ``auto`` (shared memory) / ``tcp``; ``lm``, LMCache's server (``python -m
lmcache.v1.server 127.0.0.1 PORT cpu``); ``mooncake``, LMCache's ``mooncakestore://`` backend, a
pure client over ``tcp`` with ``save_chunk_meta: False`` (zero-copy ``batch_put_from`` /
``batch_get_into``) of ``mooncake_master`` (HTTP metadata server on) and a storage process
holding ``--memory`` (``benchmarks/peers/mooncake_driver.py storage``).

Workload: the default model's cache (SmolLM2-135M: 30 layers, 3 KV heads, head dim 64, float32
as our engine runs on CPU), chunks of 256 tokens (11.25 MiB), prompts of 2,048 and 8,192 tokens.
Per round (the configurations' order rotating) and prompt, fresh token ids: *store* = ``store``
until its last chunk is in the store; *retrieve* = ``retrieve`` into zeroed slots, hits and every
byte checked after the timing. The connector's copies (``batched_from_gpu`` / ``batched_to_gpu``,
the same code in every configuration) are timed too: ``*_ex`` is each op less them, the part
the store decides. Figures: p50/p99 of the rounds, GB/s = KV bytes / p50; ratios of each
kvstore configuration over ``lm`` and ``mooncake`` in this run. Targets: retrieve >= 2x ``lm``
and ahead of ``mooncake`` at every prompt (store too), end to end and ``_ex``.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import json
import os
import re
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks import lifecycle
from benchmarks.lifecycle import REPO
from benchmarks.report import emit, machine_info, write_json
from kvstore.daemon.config import parse_size
from kvstore.daemon.local import start_local
from kvstore.proc import free_port

BENCH_PYTHON = Path.home() / ".cache" / "kvcache-store" / "lmcache-bench-venv" / "bin" / "python"
MOONCAKE_DRIVER = REPO / "benchmarks" / "peers" / "mooncake_driver.py"
CONFIGS = ("kvstore_shm", "kvstore_tcp", "lm", "mooncake")
OURS = ("kvstore_shm", "kvstore_tcp")
PEERS = ("lm", "mooncake")
OPS = ("retrieve", "retrieve_ex", "store", "store_ex")
CHUNK = 256


# --------------------------------------------------------------------------- the peers

def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with code {proc.returncode} before listening")
        if lifecycle.port_in_use(port):
            return
        time.sleep(0.1)
    raise SystemExit(f"{what} did not listen on 127.0.0.1:{port} within {timeout:.0f} s")


def start_daemon(memory: str, log_dir: Path) -> str:
    """A ``kvstore serve`` on loopback (as store_bench starts one); its address."""
    try:
        return start_local(memory, popen=lifecycle.popen, cwd=REPO,
                           stderr=open(log_dir / "kvstore_daemon.log", "w"))[1]
    except RuntimeError as e:
        raise SystemExit(f"{e} (see {log_dir}/kvstore_daemon.log)") from None


def start_lm_server(log_dir: Path, timeout: float) -> int:
    """LMCache's own server, ``python -m lmcache.v1.server HOST PORT cpu``; its port."""
    port = free_port()
    proc = lifecycle.popen([sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(port), "cpu"],
                           stdout=open(log_dir / "lm_server.log", "w"), stderr=subprocess.STDOUT,
                           env=dict(os.environ, LMCACHE_LOG_LEVEL="WARNING"))
    _wait_port(port, proc, "LMCache's lm:// server", timeout)
    return port


def start_mooncake(memory: int, log_dir: Path, timeout: float) -> dict:
    """``mooncake_master`` (HTTP metadata server on) and a storage process holding ``memory``
    bytes of the pool; the extra_config LMCache's mooncakestore connector needs to reach them."""
    env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1")
    if not (master := shutil.which("mooncake_master", path=str(Path(sys.executable).parent))):
        raise SystemExit(f"no mooncake_master beside {sys.executable}: run benchmarks/peers/setup_lmcache_peers.sh")
    meta, rpc, metrics = free_port(), free_port(), free_port()
    proc = lifecycle.popen(
        [master, "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
         f"--http_metadata_server_port={meta}", "--rpc_address=127.0.0.1", f"--rpc_port={rpc}",
         f"--metrics_port={metrics}", "--enable_metric_reporting=false",
         # room for a whole 8k prompt's batch while it evicts; a 1 s lease (10 s by default) lets
         # the rounds' older objects go: else a full pool refuses puts ("insufficient space")
         "--eviction_high_watermark_ratio=0.7", "--eviction_ratio=0.2", "--default_kv_lease_ttl=1000"],
        stdout=open(log_dir / "mooncake_master.log", "w"), stderr=subprocess.STDOUT, env=env)
    _wait_port(rpc, proc, "mooncake_master", timeout)
    _wait_port(meta, proc, "mooncake_master's HTTP metadata server", timeout)
    addrs = {"metadata": f"http://127.0.0.1:{meta}/metadata", "master": f"127.0.0.1:{rpc}"}
    storage = lifecycle.popen([sys.executable, str(MOONCAKE_DRIVER), "storage", "--memory", str(memory),
                               "--config", json.dumps(addrs)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=open(log_dir / "mooncake_storage.log", "w"), env=env, text=True)
    line = storage.stdout.readline() if storage.stdout else ""
    if "storage_ready" not in line:
        raise SystemExit(f"Mooncake's storage process did not start: {line!r} "
                         f"(see {log_dir}/mooncake_storage.log)")
    return {"local_hostname": "127.0.0.1", "metadata_server": addrs["metadata"], "protocol": "tcp",
            # LMCache 0.5.6 names the master `master_server_address`; Mooncake 0.3.13's dict
            # setup() reads `master_server_addr` (LMCache forwards `mooncake_*` keys stripped)
            "master_server_address": addrs["master"], "mooncake_master_server_addr": addrs["master"],
            "global_segment_size": 0, "local_buffer_size": 16 << 20, "save_chunk_meta": False,
            "transfer_timeout": 60}


def lmcache_config(name: str, peer: dict, local_cpu_gb: float) -> dict:
    """The LMCache engine config of one configuration."""
    cfg: dict = {"chunk_size": CHUNK, "local_cpu": False, "max_local_cpu_size": local_cpu_gb,
                 "save_unfull_chunk": False}
    if name in OURS:
        key = "storage_plugin.kvstore."
        cfg.update(storage_plugins=["kvstore"], extra_config={
            key + "module_path": "kvstore.integrations.lmcache_plugin", key + "class_name": "KVStorePlugin",
            key + "address": peer["address"], key + "transport": "auto" if name == "kvstore_shm" else "tcp"})
    elif name == "lm":
        cfg.update(remote_url=f"lm://127.0.0.1:{peer['port']}", remote_serde="naive")
    else:
        cfg.update(remote_url=f"mooncakestore://{peer['master_server_address']}/", remote_serde="naive",
                   extra_config=peer)
    return cfg


# --------------------------------------------------------------------------- the workers

class Worker:
    """One LMCache engine in a process of its own, one JSON request and answer a line."""

    def __init__(self, name: str, config: dict, max_tokens: int, log_dir: Path, timeout: float) -> None:
        self.name, self.timeout, self.log = name, timeout, log_dir / f"worker_{name}.log"
        spec = json.dumps({"name": name, "config": config, "max_tokens": max_tokens})
        env = dict(os.environ, PYTHONHASHSEED="0", LMCACHE_LOG_LEVEL="WARNING", MC_TCP_BIND_ADDRESS="127.0.0.1")
        self.proc = lifecycle.popen([sys.executable, "-m", "benchmarks.peers.lmcache_bench", "--worker", spec],
                                    cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=open(self.log, "w"), text=True, env=env)
        self.hello: dict = {}

    def ready(self) -> "Worker":
        """Wait for the engine (workers start in parallel, then each is waited for)."""
        self.hello = self.ask()
        if "error" in self.hello:
            text = re.sub(r"\x1b\[[0-9;]*m", "", self.log.read_text(errors="replace"))
            errors = [ln.strip() for ln in text.splitlines() if "ERROR" in ln or ln.startswith("E")]
            why = f"; its log's last error: {errors[-1][-400:]}" if errors else ""
            raise SystemExit(f"{self.name}: {self.hello['error']}{why} (see {self.log})")
        return self

    def ask(self, wait: float | None = None, **req) -> dict:
        """Send ``req`` (if any), then read the answer line within ``wait`` s."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if req:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], wait or self.timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise SystemExit(f"{self.name}: the worker gave no answer within {wait or self.timeout:.0f} s "
                             f"(exit code {self.proc.poll()}); see {self.log}")
        return json.loads(line)

    def close(self) -> None:
        try:   # the engine closes itself first: a SIGTERM in the middle leaves its threads hanging
            self.ask(60, op="quit")
            self.proc.wait(30)
        except (OSError, SystemExit, subprocess.TimeoutExpired):
            pass
        lifecycle.stop(self.proc, 10)


def _worker_main(spec: dict) -> None:
    """In the worker: build the engine, answer ``round`` requests until ``quit`` (or EOF)."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # LMCache's and Mooncake's own prints must not interleave with the answers
    try:
        bench = _EngineRounds(spec["config"], spec["max_tokens"], spec["name"])
    except Exception as e:  # noqa: BLE001 - the parent reports it with the worker's log
        print(json.dumps({"error": f"engine did not start: {type(e).__name__}: {e}"}), file=out)
        os._exit(0)  # LMCache's and Mooncake's threads would keep the interpreter from exiting
    print(json.dumps({"ready": True, **bench.hello}), file=out)
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "quit":
            break
        try:
            res = bench.round(req["tokens"], req["seed"], req["timeout"])
        except Exception as e:  # noqa: BLE001
            res = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(res), file=out)
    bench.close()
    print(json.dumps({"bye": True}), file=out)
    os._exit(0)


class _EngineRounds:
    """The worker's side: ``LMCacheRig`` (benchmarks/peers/lmcache_engine.py) and its paged cache."""

    def __init__(self, config: dict, max_tokens: int, name: str) -> None:
        import torch

        from benchmarks.peers.lmcache_engine import LMCacheRig

        self.torch, self.name = torch, name
        self.rig = LMCacheRig(config, slots=max_tokens)
        shape = self.rig.shape
        # one chunk's random rows, offset per chunk, layer and round: distinct bytes everywhere
        self.pattern = torch.randn(2, CHUNK, shape.kv_heads * shape.head_dim,
                                   generator=torch.Generator().manual_seed(1)).to(shape.dtype)
        backends = self.rig.engine.storage_manager.storage_backends  # LMCache runs on without
        want = "kvstore" if name in OURS else "RemoteBackend"       # a backend that failed
        if want not in backends or getattr(backends[want], "connection", True) is None:
            raise RuntimeError(f"LMCache has no working {want} backend (it has {list(backends)})")
        self.backend, self.connector_s = backends[want], 0.0
        for meth in ("batched_from_gpu", "batched_to_gpu"):   # the connector's copies, timed
            setattr(self.rig.connector, meth, self._timed(getattr(self.rig.connector, meth)))
        self.hello = {"lmcache": md.version("lmcache"), "torch": torch.__version__,
                      "chunk_bytes": shape.chunk_bytes(CHUNK)}
        self.hello["mooncake"] = md.version("mooncake-transfer-engine-non-cuda") if name == "mooncake" else None
        if name in OURS:   # the transport the plugin's client really uses
            link = getattr(backends[want], "_reader", None)
            self.hello["transport"] = getattr(link.get(), "transport", None) if link else None

    def _timed(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.connector_s += time.perf_counter() - t0
            return out
        return timed

    def _chunks(self, n: int, seed: int):
        """(a layer's cache as [2, slots, width], a chunk's slots, its offset) of every chunk."""
        for layer, cache in enumerate(self.rig.kv_caches):
            flat = cache.view(2, -1, self.pattern.shape[-1])
            for c in range(n // CHUNK):
                yield flat, slice(c * CHUNK, (c + 1) * CHUNK), seed % 997 + layer + 31 * c

    def round(self, n: int, seed: int, timeout: float) -> dict:
        torch = self.torch
        tokens = torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(seed))
        slots = torch.arange(n)
        for flat, chunk, off in self._chunks(n, seed):
            flat[:, chunk] = self.pattern + off
        # stored = the last chunk is in the store (every backend here puts in order, or all at
        # once); one key polled is light beside the puts, a whole lookup is not (GIL, hashing)
        *_, (_, _, last) = self.rig.engine.token_database.process_tokens(tokens=tokens)
        self.connector_s, t0 = 0.0, time.perf_counter()
        self.rig.store(tokens, slots)
        deadline = time.monotonic() + timeout
        while not self.backend.contains(last):
            if time.monotonic() > deadline:
                return {"error": f"store of {n} tokens: its last chunk not found within {timeout:.0f} s"}
            time.sleep(0.0005)
        store_s, store_conn = time.perf_counter() - t0, self.connector_s
        if self.rig.engine.lookup(tokens) != n:
            return {"error": f"store of {n} tokens: the last chunk is there, a lookup finds fewer tokens"}
        for flat, chunk, _ in self._chunks(n, seed):
            flat[:, chunk] = 0
        self.connector_s, t0 = 0.0, time.perf_counter()
        hit = self.rig.retrieve(tokens, slots)
        retrieve_s = time.perf_counter() - t0
        ok = all(torch.equal(flat[:, chunk], self.pattern + off) for flat, chunk, off in self._chunks(n, seed))
        return {"store": store_s, "retrieve": retrieve_s, "store_ex": store_s - store_conn,
                "retrieve_ex": retrieve_s - self.connector_s, "hit_tokens": hit, "bytes_ok": ok}

    def close(self) -> None:
        self.rig.close()


# --------------------------------------------------------------------------- the figures

def summarize(samples: dict, nbytes: dict[int, int]) -> dict:
    """Per configuration, prompt and op: p50/p99 ms and GB/s (the KV bytes / p50)."""
    out: dict = {}
    for name, per in samples.items():
        for n, ops in per.items():
            row = out.setdefault(name, {}).setdefault(str(n), {"kv_bytes": nbytes[n]})
            for op, xs in ops.items():
                p50, p99 = (float(v) for v in np.percentile(xs, [50, 99]))
                row[op] = {"p50_ms": round(p50 * 1e3, 2), "p99_ms": round(p99 * 1e3, 2),
                           "gbps": round(nbytes[n] / p50 / 1e9, 3), "rounds": len(xs)}
    return out


def ratios(results: dict) -> dict:
    """``{kvstore_x}_vs_{peer}``: throughput ratio of every op at every prompt."""
    return {f"{o}_vs_{p}": {n: {op: round(row[op]["gbps"] / results[p][n][op]["gbps"], 2) for op in OPS}
                            for n, row in results[o].items()}
            for o in OURS if o in results for p in PEERS if p in results}


def targets(rat: dict, prompts: list[int]) -> dict:
    """Each target per kvstore configuration, met at every prompt (None: a side did not run)."""
    def every(pair: str, op: str, need: float) -> bool | None:
        cells = [rat.get(pair, {}).get(str(n), {}).get(op) for n in prompts]
        return None if None in cells else all(c >= need for c in cells)  # type: ignore[operator]

    return {f"{op}_{what}": {o: every(f"{o}_vs_{peer}", op, need) for o in OURS}
            for op in OPS for what, peer, need in (("ge_2x_lm", "lm", 2.0), ("ahead_of_mooncake", "mooncake", 1.001))
            if op.startswith("retrieve") or peer == "mooncake"}


def markdown(rec: dict) -> str:
    """The docs' two tables of one run: GB/s (p50 / p99 ms), then the ratios."""
    a = ["| prompt | config | retrieve | retrieve less connector | store | store less connector |",
         "| --- | --- |" + " ---: |" * 4]
    b = ["| prompt | config | " + " | ".join(f"{op} ÷ {p}" for op in OPS for p in PEERS) + " |",
         "| --- | --- |" + " ---: |" * (len(OPS) * len(PEERS))]
    for n in map(str, rec["prompts"]):
        for name in CONFIGS:
            if n in rec["results"].get(name, {}):
                a.append(f"| {int(n):,} | {name} | " + " | ".join(
                    "{gbps:.2f} ({p50_ms:.0f} / {p99_ms:.0f})".format(**rec["results"][name][n][op])
                    for op in OPS) + " |")
            if name in OURS:
                b.append(f"| {int(n):,} | {name} | " + " | ".join(
                    f"{rec['ratios'][f'{name}_vs_{p}'][n][op]:.2f}x" if f"{name}_vs_{p}" in rec["ratios"] else "—"
                    for op in OPS for p in PEERS) + " |")
    return "\n".join(a + [""] + b)


# --------------------------------------------------------------------------- the run

def start_peers(names: list[str], args: argparse.Namespace, log_dir: Path, failed: dict) -> dict:
    """Each configuration's peer process(es); a failure lands in ``failed``."""
    peers: dict[str, dict] = {}
    for name in names:
        try:
            if name in OURS:   # one daemon for both, as store_bench's shm and TCP clients
                mine = next((peers[o] for o in OURS if o in peers), None)
                peers[name] = mine or {"address": start_daemon(args.memory, log_dir)}
            elif name == "lm":
                peers[name] = {"port": start_lm_server(log_dir, args.timeout)}
            else:
                peers[name] = start_mooncake(parse_size(args.memory), log_dir, args.timeout)
        except SystemExit as e:
            failed[name] = str(e)
    return peers


def warm_rounds(names: list[str], prompts: list[int], pool: int) -> dict[str, int]:
    """Untimed rounds: 1, and for a bounded pool (the kvstore daemon, both of ours in it; Mooncake's)
    enough to write it all once: timed stores then land in recycled pages as in a store that has run
    a while, not on first-touch faults (~1.5 ms/MB here; lm:// never reuses memory: always those)."""
    per_round = sum(prompts) // CHUNK * 30 * 2 * CHUNK * 3 * 64 * 4
    ours = [n for n in names if n in OURS]
    return {n: 1 + (-(-pool * 11 // 10 // (per_round * (len(ours) if n in OURS else 1))) if n != "lm" else 0)
            for n in names}


def run(args: argparse.Namespace) -> dict:
    from tqdm import tqdm

    names, prompts, log_dir = [c for c in CONFIGS if c in args.configs], sorted(args.prompts), Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    failed: dict[str, str] = {}
    peers = start_peers(names, args, log_dir, failed)
    started = {n: Worker(n, lmcache_config(n, peers[n], args.local_cpu_gb), max(prompts), log_dir,
                         args.timeout) for n in names if n in peers}
    workers: dict[str, Worker] = {}
    for name, w in started.items():
        try:
            workers[name] = w.ready()
        except SystemExit as e:
            failed[name] = str(e)
            w.close()
    samples: dict = {w: {n: {op: [] for op in OPS} for n in prompts} for w in workers}
    warm = warm_rounds(list(workers), prompts, 0 if args.cold else parse_size(args.memory))
    seed, first = args.seed * 1_000_003, max(warm.values(), default=1)
    bar = tqdm(total=sum(warm[w] + args.rounds for w in workers) * len(prompts), desc="lmcache_bench",
               file=sys.stderr, disable=args.no_progress)
    try:
        for rnd in range(first + args.rounds):   # rounds before `first`: the warm-up
            order = list(workers)[rnd % max(1, len(workers)):] + list(workers)[:rnd % max(1, len(workers))]
            for n in prompts:
                for name in order:
                    seed += 1
                    if rnd < first - warm[name]:
                        continue
                    bar.set_postfix_str(f"{name} {n} tokens")
                    bar.update()
                    if name in failed:
                        continue
                    try:
                        res = workers[name].ask(2 * args.timeout + 30, op="round", tokens=n, seed=seed,
                                                timeout=args.timeout)
                    except SystemExit as e:   # the worker died or hung: the others go on
                        res = {"error": str(e)}
                    if "error" in res or res["hit_tokens"] != n or not res["bytes_ok"]:
                        failed[name] = f"round {rnd}, {n} tokens: " + (res.get("error") or (
                            f"retrieved {res['hit_tokens']} of {n} tokens, bytes "
                            f"{'equal' if res['bytes_ok'] else 'DIFFERENT'}"))
                    elif rnd >= first:
                        for op in OPS:
                            samples[name][n][op].append(res[op])
    finally:
        bar.close()
        for w in workers.values():
            w.close()
    hello = {name: w.hello for name, w in workers.items()}
    chunk = next((h["chunk_bytes"] for h in hello.values()), 30 * 2 * CHUNK * 3 * 64 * 4)
    results = summarize({k: v for k, v in samples.items() if k not in failed}, {n: n // CHUNK * chunk for n in prompts})
    rat = ratios(results)
    return {
        "bench": "lmcache", "rounds": args.rounds, "seed": args.seed, "prompts": prompts, "chunk_tokens": CHUNK,
        "chunk_bytes": chunk, "memory": args.memory, "local_cpu_gb": args.local_cpu_gb, "warm_rounds": warm,
        "model_shape": {"layers": 30, "kv_heads": 3, "head_dim": 64, "dtype": "float32"},
        "versions": {k: next((h[k] for h in hello.values() if h.get(k)), None)
                     for k in ("lmcache", "torch", "mooncake")},
        "transports": {n: hello[n].get("transport") for n in OURS if n in hello},
        "machine": machine_info(load_avg=[round(x, 2) for x in os.getloadavg()]),
        "failed": failed, "targets_met": targets(rat, prompts), "ratios": rat, "results": results,
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.peers.lmcache_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds after the warm-up, each a store and "
                    "a retrieve of every prompt in every configuration (default %(default)s; --quick 2)")
    ap.add_argument("--quick", action="store_true", help="2 rounds, the 2k prompt only, --memory 512M (~1 min)")
    ap.add_argument("--prompts", type=lambda s: [int(x) for x in s.split(",")], default=[2048, 8192],
                    help="prompt lengths in tokens, multiples of 256, comma-separated (default 2048,8192)")
    ap.add_argument("--configs", type=lambda s: s.split(","), default=list(CONFIGS),
                    help=f"configurations to run, comma-separated, of {','.join(CONFIGS)} (default all)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the token ids")
    ap.add_argument("--memory", default=None, help="the kvstore daemon's arena and Mooncake's pool, "
                    "both written once before the timed rounds (default 1536M); lm:// keeps all")
    ap.add_argument("--local-cpu-gb", type=float, default=0.6, help="LMCache's max_local_cpu_size, its "
                    "allocator only (local_cpu is False); holds one prompt (default %(default)s)")
    ap.add_argument("--python", default=os.environ.get("KVSTORE_LMCACHE_PYTHON", str(BENCH_PYTHON)),
                    help="Python of the bench environment (setup_lmcache_peers.sh); started from another "
                         "one the bench runs itself again there (default %(default)s)")
    ap.add_argument("--json", default=str(REPO / "docs" / "results" / "lmcache_bench.json"),
                    help="also write the JSON line here, '-' for stdout only (default %(default)s)")
    ap.add_argument("--log-dir", default=str(REPO / "results" / "lmcache_bench"),
                    help="the peers' and workers' logs (default %(default)s)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds a peer or an engine may take "
                    "to start, and one store or retrieve to finish (default %(default)s)")
    ap.add_argument("--cold", action="store_true", help="no fill before the timed rounds: stores land "
                    "in memory never touched (the first-touch page faults of a store just started)")
    ap.add_argument("--markdown", action="store_true", help="also print the docs' tables to stderr")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--worker", default=None, help="(internal) run one configuration's engine: a JSON spec")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.worker:
        return _worker_main(json.loads(args.worker))
    if importlib.util.find_spec("lmcache") is None:
        py = Path(args.python)
        if not py.exists() or py.absolute() == Path(sys.executable).absolute():
            raise SystemExit(f"no LMCache here ({sys.executable}) nor at {py}: run "
                             "`bash benchmarks/peers/setup_lmcache_peers.sh` (or pass --python)")
        os.execv(str(py), [str(py), "-m", "benchmarks.peers.lmcache_bench", *(sys.argv[1:] if argv is None else argv)])
    args.memory = args.memory or ("512M" if args.quick else "1536M")
    if args.quick:
        args.rounds, args.prompts = 2, [p for p in args.prompts if p <= 2048] or args.prompts[:1]
    if any(p <= 0 or p % CHUNK for p in args.prompts) or args.rounds < 1:
        raise SystemExit(f"--prompts must be positive multiples of {CHUNK}, --rounds at least 1")
    if unknown := set(args.configs) - set(CONFIGS):
        raise SystemExit(f"unknown --configs {sorted(unknown)}; of {', '.join(CONFIGS)}")
    rec = run(args)
    if args.json != "-":
        write_json(args.json, rec)
    if args.markdown:
        print(markdown(rec), file=sys.stderr)
    emit(rec)


if __name__ == "__main__":
    sys.exit(lifecycle.run_main(main))
