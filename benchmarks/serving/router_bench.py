"""Router benchmark: the cost of one routing decision as the block index grows.

One command, seeded, one JSON line on stdout, a PNG plot in ``--out``::

    .venv/bin/python -m benchmarks.serving.router_bench --out benchmarks/results [--quick] [--peer dynamo]

Eight prefill workers, block size 16. For each index size (distinct block keys in
:class:`~router.workers.kv_index.KvIndex`: 1k, 10k, 100k) a seeded chat workload fills the workers'
device caches through the same ordered ``stored``/``removed`` events the workers publish:

- 16 system prompts (256 to 2,048 tokens, at most a quarter of the longest prompt;
  Zipf-popular); conversations start on one of them and grow turn by turn (assistant reply +
  user message) up to the longest prompt (8k tokens);
- each turn is served by the conversation's usual worker (75%) or another one, which stores
  the prompt's blocks it lacked (a ``stored`` event). Once the index holds the size asked
  for, every worker's cache is full at the size it reached, and half as many turns again run
  with each store evicting least recently used blocks (``removed`` events). A prompt touches
  its blocks tail to head, so a worker's blocks stay prefix-closed and matches are partial
  and differ by worker.

Queries of 512, 2k and 8k tokens (32/128/512 keys) are drawn from the same workload: 60%
continue a known conversation with a new user message, 30% start a new conversation on a
known system prompt, 10% share nothing; a continued conversation is one at least half the
prompt's length where there is one. A *decision* is ``PrefillPolicy("kv-aware").choose``
over the 8 workers on precomputed keys (the index walk: leading match per worker, plus the
TTFT estimate of each worker); the *lookup* is ``KvIndex.match`` alone. Reported separately:
hashing a prompt's keys (``kvstore.keys.block_keys``), tokenizing its text (SmolLM2's
tokenizer, when the default model is cached), and event ingestion (``KvIndex.apply``).

``--peer dynamo`` runs NVIDIA Dynamo's radix-tree indexer (``dynamo.llm.RadixTree``) on the
same events and the same queries in the same run: a driver
(``benchmarks/peers/dynamo_driver.py``) runs in Dynamo's own virtual environment
(``--dynamo-python``; create it with ``python3.11 -m venv ~/.cache/kvcache-store/dynamo-venv
&& ~/.cache/kvcache-store/dynamo-venv/bin/pip install ai-dynamo-runtime``). A block's Dynamo
hash is the first 8 bytes of its key (little-endian), used as both its ``tokens_hash`` and
``block_hash``; every query's per-worker match from ``find_matches`` is checked against ours.

Latencies are per call (``perf_counter_ns``), ``--rounds`` rounds of every query, ours and
Dynamo's taking turns within a round; each figure is the median over rounds of that round's
p50 / p99. Every query is a distinct prompt and nothing is cached across queries. The index's
table (native C or the Python dict, ``KvIndex.backend``) is reported. Targets, in
every cell, in the median of 3 runs (``python -m benchmarks.serving.router_report``): our lookup at or
below Dynamo's ``find_matches`` at p50 and p99, and the whole decision within 1.25x of
``find_matches`` at p99; and a decision's p99 under 1 ms.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from benchmarks import lifecycle
from benchmarks.lifecycle import REPO
from benchmarks.report import emit, machine_info
from benchmarks.serving.router_report import plot_cells, targets
from engine.api.events import BlockEvent, LoadFigures, Snapshot
from engine.api.generate import WorkerInfo
from kvstore.keys import block_keys, extend_block_keys
from router.placement.prefill import PrefillPolicy
from router.workers.kv_index import KvIndex
from router.workers.kv_native import native_status
from router.workers.load import WorkerLoad

BLOCK = 16
WORKERS = 8
VOCAB = 49_152
NS = bytes(range(16))
DYNAMO_DRIVER = REPO / "benchmarks" / "peers" / "dynamo_driver.py"
DYNAMO_PYTHON_DEFAULT = Path.home() / ".cache" / "kvcache-store" / "dynamo-venv" / "bin" / "python"
MODEL_DIR = Path.home() / ".cache" / "kvcache-store" / "models" / "SmolLM2-135M-Instruct"


# --- workload ---------------------------------------------------------------------------------

@dataclass
class Conversation:
    tokens: list[int]
    keys: list[bytes]
    worker: int


@dataclass
class Workload:
    events: list[tuple[int, str, list[bytes], bytes | None]] = field(default_factory=list)
    system: list[list[int]] = field(default_factory=list)
    convs: list[Conversation] = field(default_factory=list)
    stored_ever: set[bytes] = field(default_factory=set)
    distinct: int = 0


def build_workload(target_blocks: int, seed: int, max_tokens: int) -> Workload:
    """Events that leave about ``target_blocks`` distinct keys in the index: turns until the
    index holds that many, then half as many turns again with every worker's cache full at the
    size it reached (each store evicts), so ingestion sees ``removed`` events at that size."""
    rng = np.random.default_rng(seed)
    wl = Workload()
    sys_blocks = [min(int(rng.integers(16, 129)), max_tokens // (4 * BLOCK)) for _ in range(16)]
    wl.system = [rng.integers(0, VOCAB, n * BLOCK).tolist() for n in sys_blocks]
    popularity = 1.0 / np.arange(1, 17)
    popularity /= popularity.sum()
    lru: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(WORKERS)]
    capacity = [1 << 62] * WORKERS
    holders: dict[bytes, int] = {}
    active: list[Conversation] = []
    turns, steady = 0, None
    while steady is None or turns < steady:
        if steady is None and (len(holders) >= target_blocks or turns >= 50 * target_blocks):
            steady = turns + turns // 2
            capacity = [max(len(c), 2 * max_tokens // BLOCK) for c in lru]
        turns += 1
        if not active or rng.random() < 0.3:
            sys_tokens = wl.system[int(rng.choice(16, p=popularity))]
            conv = Conversation(sys_tokens + _msg(rng, 32, 512), [], int(rng.integers(WORKERS)))
            active.append(conv)
            wl.convs.append(conv)
        else:
            conv = active[int(rng.integers(len(active)))]
            conv.tokens += _msg(rng, 32, 256) + _msg(rng, 32, 512)  # reply, then user message
        conv.tokens = conv.tokens[:max_tokens]
        if len(conv.tokens) >= max_tokens:
            active.remove(conv)
        conv.keys = extend_block_keys(NS, conv.keys, conv.tokens, BLOCK)
        w = conv.worker if rng.random() < 0.75 else int(rng.integers(WORKERS))
        _serve(wl, lru[w], w, conv.keys, capacity[w], holders)
    wl.distinct = len(holders)
    return wl


def _msg(rng: np.random.Generator, lo: int, hi: int) -> list[int]:
    return rng.integers(0, VOCAB, int(rng.integers(lo, hi + 1))).tolist()


def _serve(wl: Workload, cache: OrderedDict, w: int, keys: list[bytes], capacity: int,
           holders: dict[bytes, int]) -> None:
    held = 0
    while held < len(keys) and keys[held] in cache:
        held += 1
    if held < len(keys):
        wl.events.append((w, "stored", keys[held:], keys[held - 1] if held else None))
        for k in keys[held:]:
            holders[k] = holders.get(k, 0) + 1
        wl.stored_ever.update(keys[held:])
    for k in reversed(keys):  # tail to head: a block's parent is always more recent
        cache[k] = None
        cache.move_to_end(k)
    removed = []
    while len(cache) > capacity:
        k, _ = cache.popitem(last=False)
        removed.append(k)
        holders[k] -= 1
        if not holders[k]:
            del holders[k]
    if removed:
        wl.events.append((w, "removed", removed, None))


def build_queries(wl: Workload, length: int, n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    # a long prompt continues a long conversation: those at least half its length, else the
    # longest tenth
    by_len = sorted(wl.convs, key=lambda c: len(c.tokens))
    long = [c for c in by_len if len(c.tokens) >= length // 2] or by_len[-max(1, len(by_len) // 10):]
    out = []
    for _ in range(n):
        u = rng.random()
        new = int(rng.integers(32, 513))
        if u < 0.6:
            base = long[int(rng.integers(len(long)))].tokens[: max(0, length - new)]
        elif u < 0.9:
            base = wl.system[int(rng.integers(16))][:length]
        else:
            base = []
        out.append(base + rng.integers(0, VOCAB, length - len(base)).tolist())
    return out


def dynamo_hash(key: bytes) -> int:
    return int.from_bytes(key[:8], "little")


# --- our side ---------------------------------------------------------------------------------

def make_index(wl: Workload) -> tuple[KvIndex, dict]:
    index = KvIndex()
    ids = [f"w{i}" for i in range(WORKERS)]
    for wid in ids:
        index.reset(wid, Snapshot(0, (), LoadFigures()))
    seqs = [0] * WORKERS
    events = []
    for w, kind, keys, _parent in wl.events:
        seqs[w] += 1
        events.append((ids[w], BlockEvent(seqs[w], kind, tuple(keys))))
    clock, times = time.perf_counter_ns, []
    gc.collect()
    for wid, ev in events:
        t0 = clock()
        index.apply(wid, ev)
        times.append(clock() - t0)
    return index, _ingest_summary(times, wl.events)


def _ingest_summary(event_ns: list[int], events: list) -> dict:
    """Per event kind: events, blocks, time per block, per-event p50/p99."""
    out = {}
    for kind in ("stored", "removed"):
        ns = [t for t, e in zip(event_ns, events) if e[1] == kind]
        blocks = sum(len(e[2]) for e in events if e[1] == kind)
        out[kind] = {"events": len(ns), "blocks": blocks,
                     "ns_per_block": round(sum(ns) / max(1, blocks), 1), "event_us": _pcts(ns)}
    out["total_s"] = round(sum(event_ns) / 1e9, 4)
    return out


def make_workers(seed: int) -> list[WorkerLoad]:
    rng = np.random.default_rng(seed)
    workers = []
    for i in range(WORKERS):
        info = WorkerInfo(f"w{i}", f"http://127.0.0.1:{9000 + i}", "prefill", "bench", NS,
                          BLOCK, 65_536, 32_768)
        w = WorkerLoad(info)
        w.observe_load(LoadFigures(prefill_tokens_per_s=float(rng.uniform(5e3, 2e4)),
                                   load_tokens_per_s=float(rng.uniform(5e4, 2e5))))
        w.assign(int(rng.integers(0, 8192)))
        workers.append(w)
    return workers


def time_calls(fn, args_list: list) -> list[int]:
    clock, out = time.perf_counter_ns, []
    for args in args_list:
        t0 = clock()
        fn(*args)
        out.append(clock() - t0)
    return out


def _pcts(ns: list[int] | np.ndarray) -> dict:
    a = np.asarray(ns, dtype=float) / 1e3
    if not a.size:
        return {"p50": None, "p99": None}
    return {"p50": round(float(np.percentile(a, 50)), 2), "p99": round(float(np.percentile(a, 99)), 2)}


def _median_rounds(rounds: list[dict]) -> dict:
    return {k: round(float(np.median([r[k] for r in rounds])), 2) for k in ("p50", "p99")}


# --- Dynamo -----------------------------------------------------------------------------------

class DynamoPeer:
    """The driver subprocess in Dynamo's venv, spoken to one JSON line at a time."""

    def __init__(self, python: Path, workdir: Path) -> None:
        if not Path(python).is_file():
            raise SystemExit(
                f"--peer dynamo: no Python at {python}. Create Dynamo's environment with "
                f"`python3.11 -m venv {Path(python).parents[1]} && {Path(python).parent}/pip install "
                f"ai-dynamo-runtime` or pass --dynamo-python")
        self.workdir = workdir
        self.proc = lifecycle.popen([str(python), str(DYNAMO_DRIVER)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=open(workdir / "dynamo.log", "w"),
                                     text=True)
        hello = self._read()
        if not hello.get("ready"):
            raise SystemExit(f"--peer dynamo: the driver could not load dynamo.llm.RadixTree: "
                             f"{hello.get('error', hello)} (log: {workdir / 'dynamo.log'})")
        self.version = hello["version"]

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise SystemExit(f"--peer dynamo: the driver exited (code {self.proc.poll()}); "
                                 f"see {self.workdir / 'dynamo.log'}")
            if line.startswith("{"):
                return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=30)

    def write(self, name: str, payload: dict) -> Path:
        path = self.workdir / f"{name}.json"
        path.write_text(json.dumps(payload))
        return path

    def call(self, op: str, path: Path, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, "path": str(path), **kw}) + "\n")
        self.proc.stdin.flush()
        out = self._read()
        if "error" in out:
            raise SystemExit(f"--peer dynamo: {op} failed: {out['error']}")
        return out


# --- the run ----------------------------------------------------------------------------------

def leading_in(keys: list[bytes], held: set[bytes]) -> int:
    n = 0
    while n < len(keys) and keys[n] in held:
        n += 1
    return n


def run_cell(size: int, length: int, wl: Workload, index: KvIndex, peer: DynamoPeer | None,
             args: argparse.Namespace) -> dict:
    tokens = build_queries(wl, length, args.queries, args.seed + length)
    keys = [block_keys(NS, t, BLOCK) for t in tokens]
    workers = make_workers(args.seed)
    policy = PrefillPolicy("kv-aware", index)
    decision_args = [(workers, k, length, leading_in(k, wl.stored_ever)) for k in keys]
    lookup_args = [(k,) for k in keys]
    matches = [index.match(k) for k in keys]
    best = [max(m.values()) / len(k) for m, k in zip(matches, keys)]
    cell = {"index_blocks": size, "distinct_blocks": len(index), "prompt_tokens": length,
            "queries": len(keys),
            "match": {"mean_best_fraction": round(float(np.mean(best)), 3),
                      "any_hit_fraction": round(float(np.mean([b > 0 for b in best])), 3),
                      "mean_workers_hit": round(float(np.mean(
                          [sum(v > 0 for v in m.values()) for m in matches])), 2),
                      "mean_distinct_depths": round(float(np.mean(
                          [len(set(m.values())) for m in matches])), 2)}}
    dyn_path = peer.write("queries", {"queries": [[dynamo_hash(x) for x in k] for k in keys]}) if peer else None
    rounds: dict[str, list[dict]] = {"decision": [], "lookup": [], "dynamo": []}
    for r in range(args.rounds):
        gc.collect()
        rounds["decision"].append(_pcts(time_calls(policy.choose, decision_args)))
        rounds["lookup"].append(_pcts(time_calls(index.match, lookup_args)))
        if peer:
            out = peer.call("query", dyn_path)
            rounds["dynamo"].append(_pcts(out["ns"]))
            if r == 0:
                ours = [{str(int(w[1:])): n for w, n in m.items() if n} for m in matches]
                theirs = [{w: n for w, n in s.items() if n} for s in out["scores"]]
                cell["dynamo_mismatches"] = sum(a != b for a, b in zip(ours, theirs))
    cell["ours"] = {"decision_us": _median_rounds(rounds["decision"]),
                    "lookup_us": _median_rounds(rounds["lookup"])}
    if peer:
        d = cell["dynamo"] = {"find_matches_us": _median_rounds(rounds["dynamo"])}
        cell["ratio_vs_dynamo"] = {
            f"{what}_{p}": round(cell["ours"][f"{what}_us"][p] / d["find_matches_us"][p], 2)
            for what in ("decision", "lookup") for p in ("p50", "p99")}
    return cell


def time_prep(lengths: list[int], n: int, seed: int, peer: DynamoPeer | None) -> dict:
    """Hashing (ours and Dynamo's) and tokenizing, per prompt length."""
    rng = np.random.default_rng(seed)
    tok = None
    if (MODEL_DIR / "tokenizer.json").is_file():
        from engine.api.tokenizer import Tokenizer
        tok = Tokenizer.from_dir(MODEL_DIR)
    out = {}
    for length in lengths:
        prompts = [rng.integers(0, VOCAB, length).tolist() for _ in range(n)]
        row = {"hash_us": _pcts(time_calls(lambda t: block_keys(NS, t, BLOCK), [(p,) for p in prompts]))}
        if peer:
            path = peer.write("hash", {"block_size": BLOCK, "prompts": prompts})
            row["dynamo_hash_us"] = _pcts(peer.call("hash", path)["ns"])
        if tok is not None:
            texts = [tok.decode(p[: length]) for p in prompts[: max(1, n // 4)]]
            row["tokenize_us"] = _pcts(time_calls(tok.encode, [(t,) for t in texts]))
        else:
            row["tokenize_us"] = None
        out[str(length)] = row
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.serving.router_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results",
                    help="directory for router_bench.png (default %(default)s)")
    ap.add_argument("--quick", action="store_true", help="smaller sizes, fewer queries (< 1 min)")
    ap.add_argument("--sizes", type=int, nargs="+", help="index sizes in distinct blocks")
    ap.add_argument("--prompts", type=int, nargs="+", help="prompt lengths in tokens")
    ap.add_argument("--queries", type=int, help="queries per cell")
    ap.add_argument("--rounds", type=int, help="timed rounds per cell (median of rounds)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the workload")
    ap.add_argument("--peer", choices=["dynamo"], help="also run NVIDIA Dynamo's RadixTree")
    ap.add_argument("--dynamo-python", type=Path, default=DYNAMO_PYTHON_DEFAULT,
                    help="Python of Dynamo's own venv (default %(default)s)")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.sizes = args.sizes or ([1_000, 10_000] if args.quick else [1_000, 10_000, 100_000])
    args.prompts = args.prompts or ([512, 2048] if args.quick else [512, 2048, 8192])
    args.queries = args.queries or (200 if args.quick else 1000)
    args.rounds = args.rounds or (3 if args.quick else 5)
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="router_bench_") as tmp:
        peer = DynamoPeer(args.dynamo_python, Path(tmp)) if args.peer == "dynamo" else None
        try:
            cells, ingest = [], {}
            steps = tqdm(total=len(args.sizes) * (1 + len(args.prompts)), desc="router_bench",
                         file=sys.stderr)
            for size in args.sizes:
                wl = build_workload(size, args.seed + size, max(args.prompts))
                index, ing = make_index(wl)
                ingest[str(size)] = {
                    "distinct_blocks": len(index),
                    "worker_blocks": sum(index.num_blocks(w) for w in index.workers),
                    "removed_blocks": sum(len(e[2]) for e in wl.events if e[1] == "removed"),
                    "ours": ing}
                if peer:
                    path = peer.write("events", {"events": [
                        [w, kind, [dynamo_hash(k) for k in keys],
                         dynamo_hash(parent) if parent is not None else None]
                        for w, kind, keys, parent in wl.events]})
                    d = peer.call("load", path)
                    ingest[str(size)]["dynamo"] = _ingest_summary(d["event_ns"], wl.events)
                    ingest[str(size)]["dynamo"]["total_with_barrier_s"] = d["total_s"]
                steps.update()
                for length in args.prompts:
                    cells.append(run_cell(size, length, wl, index, peer, args))
                    steps.update()
            steps.close()
            prep = time_prep(args.prompts, min(args.queries, 200), args.seed + 1, peer)
            version = peer.version if peer else None
        finally:
            if peer:
                peer.close()
    target = targets(cells, bool(args.peer))
    plot = args.out / "router_bench.png"
    plot_cells(cells, plot, bool(args.peer), BLOCK, WORKERS)
    emit({
        "bench": "router", "workers": WORKERS, "block_size": BLOCK, "seed": args.seed,
        "quick": args.quick, "rounds": args.rounds, "queries_per_cell": args.queries,
        "machine": machine_info(),
        "peer": {"name": "dynamo", "package": "ai-dynamo-runtime", "version": version} if args.peer else None,
        "index_table": native_status(),
        "cells": cells, "ingest": ingest, "prep": prep, "target": target,
        "plot": str(plot), "wall_s": round(time.monotonic() - t_start, 1)})


if __name__ == "__main__":
    sys.exit(lifecycle.run_main(main))
