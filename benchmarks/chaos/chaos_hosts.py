"""Chaos across hosts: ``python -m benchmarks.chaos.chaos_bench --hosts 3 --kills host-store [--replicas R]``.

``kvrouter up --hosts N`` (router.cluster.multihost: a store and a worker on every host, one
prefill worker on host 0 and decode workers on the others, etcd and the router on host 0),
with device prefix caching off in every worker (``--no-prefix-caching``), so that every
reuse of a prefix is a store hit and a lost store copy shows as a miss. The replica count R
is the cluster's setting in etcd (``kvstore config set replicas R``, before any request).

Workload: ``--conversations`` conversations of ``--turns`` turns with no per-request salt:
turn t of conversation c is a shared 24-token system prefix, then c's first t+1 segments of
32 tokens (a prompt grows by one segment a turn, so each turn reuses the previous turn's
blocks and every conversation the system prefix). The greedy output of every (c, t) is
recorded one at a time first (this also fills the store), then ``--concurrency`` loops send
them in turn for ``--duration`` seconds; at ``--first-kill-at`` the store daemon of host
``--kill-host`` (default the last) gets SIGKILL and the launcher brings it back (empty: no
SSD tier).

Reported (one JSON line, also ``OUT/chaos_hosts.json``): requests failed (target 0), outputs
differing from the recorded ones (target 0), the store hit rate before the kill, in the
``--during`` seconds after it and after that (store-hit prompt tokens of the prefill phase,
and of the decode phase's load, over the prompt's reusable tokens, its full blocks short of
the last token), the seconds until the store was back (registered with a new node id) and
until every block of the workload was held by R live nodes again (``copies_restored_s``:
each node asked with ``contains`` twice a second; null if that did not happen before the
run ended).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from benchmarks import lifecycle
from benchmarks.chaos.chaos_common import Cluster, launcher_restarts, read_records
from benchmarks.report import machine_info

SYSTEM_TOKENS, SEGMENT_TOKENS, BLOCK = 24, 32, 16


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--hosts runs (benchmarks.chaos.chaos_hosts)")
    g.add_argument("--hosts", type=int, default=0,
                   help="run kvrouter up --hosts N (a store and a worker per host) and the multi-turn "
                        "workload; --kills then takes host-store (default 0: the one-host bench)")
    g.add_argument("--replicas", type=int, default=None,
                   help="the cluster's replica count R, set in etcd before any request (default: unset, R=1)")
    g.add_argument("--kill-host", type=int, default=None, help="host whose store is killed (default: the last)")
    g.add_argument("--conversations", type=int, default=6, help="conversations (default 6)")
    g.add_argument("--turns", type=int, default=4, help="turns per conversation (default 4)")
    g.add_argument("--during", type=float, default=10.0,
                   help="seconds after the kill counted as 'during' for the hit rate (default 10)")


def prompts(args: argparse.Namespace, vocab: int) -> dict[tuple[int, int], list[int]]:
    rng = random.Random(args.seed)
    system = [rng.randrange(3, vocab) for _ in range(SYSTEM_TOKENS)]
    out: dict[tuple[int, int], list[int]] = {}
    for c in range(args.conversations):
        segs = [[rng.randrange(3, vocab) for _ in range(SEGMENT_TOKENS)] for _ in range(args.turns)]
        for t in range(args.turns):
            out[(c, t)] = system + [tok for s in segs[: t + 1] for tok in s]
    return out


def reusable(n: int) -> int:
    return (n - 1) // BLOCK * BLOCK


async def complete(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                   max_tokens: int) -> tuple[str, str]:
    r = await client.post(f"{url}/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}", r.text[:300])
    body = r.json()
    return body["choices"][0]["text"], body["id"]


class Copies:
    """Counts, twice a second, how many live store nodes hold each block of the workload."""

    def __init__(self, cluster: Any, keys: list[bytes], replicas: int) -> None:
        self.cluster, self.keys, self.replicas = cluster, keys, replicas
        self.clients: dict[str, Any] = {}
        self.killed_at: float | None = None
        self.restored_at: float | None = None
        self.before: dict[str, Any] | None = None
        self.last: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def count(self) -> dict[str, Any]:
        from kvstore import Client

        state = self.cluster.state()
        held = [0] * len(self.keys)
        live = 0
        for name, c in state["children"].items():
            if c["kind"] != "store" or c["state"] != "running":
                continue
            try:
                client = self.clients.get(name)
                if client is None:
                    client = self.clients[name] = Client(c["address"], auth_token=self.cluster.secret,
                                                         timeout=2.0)
                found = client.contains(self.keys)
            except Exception:  # noqa: BLE001 - a node down or restarting: holds nothing now
                old = self.clients.pop(name, None)
                if old is not None:
                    try:
                        old.close()
                    except Exception:  # noqa: BLE001
                        pass
                continue
            live += 1
            held = [h + bool(f) for h, f in zip(held, found)]
        want = min(self.replicas, live)
        return {"live_nodes": live, "keys": len(self.keys), "min_copies": min(held, default=0),
                "below_r": sum(h < want for h in held), "want": want}

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            snap = self.count()
            self.last = snap
            if (self.killed_at is not None and self.restored_at is None
                    and time.time() > self.killed_at + 1.0 and snap["live_nodes"] == self.nodes
                    and snap["below_r"] == 0):
                self.restored_at = time.time()

    def start(self, nodes: int) -> None:
        self.nodes = nodes
        self.before = self.count()
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for c in self.clients.values():
            try:
                c.close()
            except Exception:  # noqa: BLE001
                pass


def _set_replicas(cluster: Any, r: int) -> str | None:
    """``kvstore config set replicas R``; None when done, else why not."""
    done = subprocess.run([sys.executable, "-m", "kvstore.daemon.cli", "config", "set", "replicas", str(r),
                           "--etcd", cluster.etcd, "--cluster", cluster.name],
                          capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        return f"`kvstore config set replicas {r}` failed ({done.returncode}): {(done.stderr or done.stdout)[-300:]}"
    return None


def _rate(recs: list[dict[str, Any]]) -> dict[str, Any]:
    total = sum(reusable(r["prompt_tokens"]) for r in recs)
    pre = [r.get("prefill_stats") or {} for r in recs]
    dec = [r.get("decode_stats") or {} for r in recs]
    return {"requests": len(recs), "reusable_tokens": total,
            "prefill": round(sum(s.get("store_hit_tokens", 0) for s in pre) / total, 4) if total else None,
            "decode": round(sum(s.get("store_hit_tokens", 0) for s in dec) / total, 4) if total else None,
            "device_hit_tokens": sum(s.get("device_hit_tokens", 0) for s in pre + dec)}


async def run(args: argparse.Namespace, out: Path, model: str) -> dict[str, Any]:
    from kvstore.keys import block_keys

    cluster = Cluster(args, out, model)
    notes: list[str] = []
    copies: Copies | None = None
    try:
        r = args.replicas or 1
        if args.replicas is not None and (why := _set_replicas(cluster, args.replicas)):
            notes.append(why)
            r = 1
        state = cluster.state()
        served = httpx.get(f"{cluster.router}/v1/models", timeout=5, trust_env=False).json()["data"][0]["id"]
        vocab = int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
        work = prompts(args, vocab)
        order = [(c, t) for t in range(args.turns) for c in range(args.conversations)]
        reference: dict[tuple[int, int], str] = {}
        async with httpx.AsyncClient(timeout=args.request_timeout, trust_env=False) as client:
            for key in order:                 # one at a time: the greedy reference, and a warm store
                reference[key] = (await complete(client, cluster.router, served, work[key], args.max_tokens))[0]
        from kvstore.coord import layout
        from kvstore.coord.etcd import EtcdClient
        with EtcdClient(cluster.etcd, timeout=2.0) as etcd:
            members, _ = etcd.get_prefix(layout.prefix(cluster.name, "workers"))
        namespace = bytes.fromhex(json.loads(next(iter(members.values())))["namespace"])
        keys = sorted({bytes(k) for p in work.values() for k in block_keys(namespace, p, BLOCK)})
        stores = sorted(n for n, c in state["children"].items() if c["kind"] == "store")
        copies = Copies(cluster, keys, r)
        copies.start(len(stores))
        kill_host = args.kill_host if args.kill_host is not None else args.hosts - 1
        victim = f"store-{kill_host}"
        t0 = time.time()
        results: list[dict[str, Any]] = []
        counter = iter(range(10 ** 9))
        kill: dict[str, Any] = {"child": victim, "host": kill_host}

        async def loop(client: httpx.AsyncClient) -> None:
            while time.time() < t0 + args.duration:
                key = order[next(counter) % len(order)]
                rec: dict[str, Any] = {"key": key, "start": time.time() - t0}
                try:
                    text, rid = await complete(client, cluster.router, served, work[key], args.max_tokens)
                    rec.update(ok=True, differs=text != reference[key], id=f"{rid}-0")
                except httpx.HTTPError as e:
                    rec.update(ok=False, status=type(e).__name__, detail=str(e)[:300])
                except RuntimeError as e:
                    rec.update(ok=False, status=e.args[0], detail=e.args[1])
                rec["end"] = time.time() - t0
                results.append(rec)

        async def chaos() -> None:
            await asyncio.sleep(max(0.0, t0 + args.first_kill_at - time.time()))
            old = cluster.state()["children"][victim]
            assert copies is not None
            kill["copies_at_kill"] = await asyncio.to_thread(copies.count)
            kill.update(old_pid=old["pid"], old_id=old["id"], at_s=round(time.time() - t0, 3))
            assert copies is not None
            copies.killed_at = time.time()
            lifecycle.kill_pid(old["pid"])
            print(f"[chaos] {time.time() - t0:6.1f} s: SIGKILL {victim} (pid {old['pid']})",
                  file=sys.stderr, flush=True)
            while time.time() < t0 + args.duration + args.settle:
                now = cluster.state()["children"][victim]
                if "back_s" not in kill and now["state"] == "running" and now["id"] and now["id"] != old["id"]:
                    kill["back_s"] = round(time.time() - copies.killed_at, 3)
                if copies.restored_at is not None and "back_s" in kill and time.time() > t0 + args.duration:
                    return
                await asyncio.sleep(0.25)

        async with httpx.AsyncClient(timeout=args.request_timeout, trust_env=False) as client:
            await asyncio.gather(chaos(), *(loop(client) for _ in range(args.concurrency)))
        restarts = launcher_restarts(cluster.metrics_url)
    finally:
        if copies is not None:
            copies.close()
        cluster.stop()
    killed = copies.killed_at if copies else None
    kill["back_s"] = kill.get("back_s")
    kill["copies_restored_s"] = (round(copies.restored_at - killed, 3)
                                 if copies and copies.restored_at and killed else None)
    kill["copies_after_warmup"], kill["copies_at_end"] = (copies.before, copies.last) if copies else (None, None)
    log = {r["request_id"]: r for r in read_records(cluster.request_log, 0)[0]}
    ok = [dict(log[x["id"]], _start=x["start"]) for x in results if x.get("ok") and x["id"] in log]
    at = kill.get("at_s", float("inf"))
    windows = {"before": [r for r in ok if r["_start"] < at],
               "during": [r for r in ok if at <= r["_start"] < at + args.during],
               "after": [r for r in ok if r["_start"] >= at + args.during]}
    failed = [x for x in results if not x["ok"]]
    return {
        "bench": "chaos_hosts", "model": served, "hosts": args.hosts,
        "layout": [h["roles"] for h in state.get("hosts", [])], "replicas": r, "notes": notes,
        "workload": {"conversations": args.conversations, "turns": args.turns, "system_tokens": SYSTEM_TOKENS,
                     "segment_tokens": SEGMENT_TOKENS, "max_tokens": args.max_tokens, "salted": False,
                     "device_prefix_caching": False, "blocks": len(keys)},
        "concurrency": args.concurrency, "duration_s": args.duration, "sent": len(results),
        "succeeded": len(results) - len(failed), "failed": len(failed),
        "failed_by_status": dict(Counter(x["status"] for x in failed)),
        "failed_examples": [{k: x[k] for k in ("start", "end", "status", "detail")} for x in failed[:5]],
        "differing_outputs": sum(1 for x in results if x["ok"] and x["differs"]),
        "differing_by_window": {w: sum(1 for x in results if x["ok"] and x["differs"] and lo <= x["start"] < hi)
                                for w, (lo, hi) in {"before": (0, at), "during": (at, at + args.during),
                                                    "after": (at + args.during, float("inf"))}.items()},
        "differing_examples": [{"conversation": x["key"][0], "turn": x["key"][1], "start": round(x["start"], 2),
                                "request_id": x["id"]} for x in results if x["ok"] and x["differs"]][:8],
        "store_hit_rate": {w: _rate(v) for w, v in windows.items()},
        "during_window_s": args.during, "kill": kill, "launcher_restarts": restarts,
        "routes": dict(Counter(str(r.get("mode")) for r in log.values())),
        "targets": {"no_failed": not failed, "no_differing": not any(x["ok"] and x["differs"] for x in results)},
        "machine": machine_info(), "out": str(out),
    }
