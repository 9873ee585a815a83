"""Chaos: a local cluster under load while its processes are killed, one kind at a time.

    python -m benchmarks.chaos.chaos_bench --out results/chaos                 # tiny model, ~2 min
    python -m benchmarks.chaos.chaos_bench --model default --out results/chaos_real
    python -m benchmarks.chaos.chaos_bench --hosts 3 --replicas 2 --out results/chaos_hosts
                                                                               # benchmarks.chaos.chaos_hosts

One command: ``kvrouter up`` (2 prefill + 2 decode workers by default; the tiny deterministic
checkpoint unless ``--model``), then the greedy outputs of a fixed set of prompts recorded one
at a time, then those prompts driven at a fixed concurrency for ``--duration`` seconds while,
at spaced moments (``--first-kill-at``, then every ``--kill-every``), SIGKILL takes each kind
of process in ``--kills``: a prefill worker, a decode worker, the store daemon, etcd.

Reported (one JSON line, also ``OUT/chaos.json``): requests sent, succeeded, failed (counted
by status, with the first error bodies), outputs that differ from the recorded text, and for
each kill the seconds until full capacity is back:

- a worker: its replacement is registered (``kvrouter up``'s ``cluster.json`` shows a new
  process, ready by its own ready line, with a new ``worker_id``) and the router's request log
  shows a request phase that the new worker served, ended;
- the store: the replacement is registered (a new ``node_id``) and a request that arrived
  after that was served disaggregated again, its KV handed over through the store (bytes
  saved and loaded; every request has a ``cache_salt`` of its own unless ``--no-salt``, so
  every one computes its prompt and hands it over), and ended;
- etcd: the replacement answers ``/health``, every current worker and store is registered in
  it again, and every current worker has served a request phase that arrived after that
  (the router's view of the whole fleet back; ``not_routed_to`` lists those still missing).

Each return is seen in requests served, so the load goes on past ``--duration`` while a kill
is not yet back, for at most ``--settle`` seconds more; ``back_s`` is null when it did not
come back by then. Targets: 0 failed, 0 differing outputs, every ``back_s`` <= 15. The cluster
secret is read from the file ``kvrouter up`` writes (``cluster.json``'s ``secret_file``),
``Cluster.secret``, for calls to workers or the store; the bench makes none today: it talks
to the router (the public API) and reads etcd. ``OUT/chaos_timeline.png``: completions and
failures per second, kills and returns marked. Every process started is stopped however the
bench ends (``benchmarks.lifecycle``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from benchmarks import lifecycle
from benchmarks.chaos.chaos_common import Cluster, launcher_restarts, read_records
from benchmarks.chaos.chaos_plot import plot_timeline
from benchmarks.report import emit, machine_info

KINDS = ("prefill", "decode", "store", "etcd")
HOST_KINDS = ("host-store",)   # --hosts N: one host's store daemon (benchmarks.chaos.chaos_hosts)
WORKER_KINDS = ("prefill", "decode", "colocated")
TARGET_BACK_S = 15.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.chaos.chaos_bench", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="results/chaos", help="run directory (default %(default)s)")
    p.add_argument("--model", default="tiny",
                   help="'tiny' (a deterministic random checkpoint made in OUT), 'default' (SmolLM2-135M) "
                        "or a checkpoint directory (default tiny)")
    p.add_argument("--prefill", type=int, default=2, help="prefill workers (default 2)")
    p.add_argument("--decode", type=int, default=2, help="decode workers (default 2)")
    p.add_argument("--duration", type=float, default=100.0, help="seconds of load (default 100)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight at once (default 4)")
    p.add_argument("--prompts", type=int, default=16, help="distinct prompts (default 16)")
    p.add_argument("--prompt-tokens", type=int, default=40, help="tokens per prompt (default 40)")
    p.add_argument("--max-tokens", type=int, default=12, help="tokens generated per request (default 12)")
    p.add_argument("--no-salt", action="store_true",
                   help="send no per-request cache_salt (default: one each, so that every request computes "
                        "its prompt and hands its KV over through the store, which the store kill then tests)")
    p.add_argument("--kills", default=",".join(KINDS),
                   help=f"kinds killed, in order (default {','.join(KINDS)})")
    p.add_argument("--first-kill-at", type=float, default=10.0,
                   help="seconds into the load of the first kill (default 10)")
    p.add_argument("--kill-every", type=float, default=20.0, help="seconds between kills (default 20)")
    p.add_argument("--settle", type=float, default=20.0,
                   help="at most this many seconds past --duration the load goes on while a kill's "
                        "return is not yet measured (default 20)")
    p.add_argument("--request-timeout", type=float, default=60.0, help="seconds one request may take (default 60)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts (default 0)")
    p.add_argument("--ready-timeout", type=float, default=300.0,
                   help="seconds the cluster has to come up (default 300)")
    from benchmarks.chaos.chaos_hosts import add_flags
    add_flags(p)
    return p


# --- load ------------------------------------------------------------------------------------

_sent = iter(range(10 ** 9))


async def complete(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int,
                   salt: str | None) -> str:
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True}
    if salt is not None:   # a salt of its own: no prefix reuse, every prompt computed and handed over
        body["cache_salt"] = f"{salt}-{next(_sent)}"
    r = await client.post(f"{url}/v1/completions", json=body)
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}", r.text[:300])
    return r.json()["choices"][0]["text"]


async def drive(cluster: Cluster, args: argparse.Namespace, model: str, prompts: list[list[int]],
                reference: list[str], t0: float, all_back: asyncio.Event) -> list[dict[str, Any]]:
    """``--concurrency`` loops sending the prompts in turn until ``--duration`` ends, then on
    until ``all_back`` (every kill's return measured: it is seen in requests served) or
    ``--settle`` seconds more."""
    results: list[dict[str, Any]] = []
    stop_at, settle_end = t0 + args.duration, t0 + args.duration + args.settle
    counter = iter(range(10 ** 9))
    salt = None if args.no_salt else f"chaos{args.seed}"

    def going() -> bool:
        now = time.time()
        return now < stop_at or (now < settle_end and not all_back.is_set())

    async def loop(client: httpx.AsyncClient) -> None:
        while going():
            i = next(counter) % len(prompts)
            rec: dict[str, Any] = {"prompt": i, "start": time.time() - t0}
            try:
                text = await complete(client, cluster.router, model, prompts[i], args.max_tokens, salt)
                rec.update(ok=True, differs=text != reference[i])
            except httpx.TimeoutException:
                rec.update(ok=False, status="timeout", detail="")
            except httpx.HTTPError as e:
                rec.update(ok=False, status=type(e).__name__, detail=str(e)[:300])
            except RuntimeError as e:
                rec.update(ok=False, status=e.args[0], detail=e.args[1])
            rec["end"] = time.time() - t0
            results.append(rec)

    async with httpx.AsyncClient(timeout=args.request_timeout, trust_env=False) as client:
        await asyncio.gather(*(loop(client) for _ in range(args.concurrency)))
    return results


# --- kills and returns -----------------------------------------------------------------------

class Watch:
    """One kill: what was killed, and when capacity was back (module docstring)."""

    def __init__(self, kind: str, child: str, old: dict[str, Any], at: float) -> None:
        self.kind, self.child, self.old, self.at = kind, child, old, at
        self.registered: float | None = None
        self.back: float | None = None
        self.new_id: str | None = None
        self.pending: set[str] | None = None   # etcd: workers not yet routed to since its return

    def report(self, t0: float) -> dict[str, Any]:
        rel = lambda t: None if t is None else round(t - t0, 3)  # noqa: E731
        return {"kind": self.kind, "child": self.child, "at_s": rel(self.at), "old_pid": self.old["pid"],
                "new_id": self.new_id, "registered_s": rel(self.registered), "back_at_s": rel(self.back),
                "back_s": None if self.back is None else round(self.back - self.at, 3),
                **({"not_routed_to": sorted(self.pending)} if self.pending else {})}


def check(w: Watch, cluster: Cluster, state: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """Move ``w`` on: registered, then back (module docstring)."""
    now = state["children"][w.child]
    if w.registered is None:
        if now["pid"] == w.old["pid"] or now["state"] != "running":
            return
        if w.kind == "etcd":
            try:
                want = {c["id"] for c in state["children"].values() if c["id"]}
                if not want <= cluster.registered():
                    return
            except Exception:  # noqa: BLE001 - etcd still coming back
                return
        elif not now["id"] or now["id"] == w.old["id"]:
            return
        w.registered, w.new_id = time.time(), now["id"]
    for r in records:
        if r.get("status") != "ok":
            continue
        end = r["arrival_unix"] + r["timeline"]["end"]
        if w.kind in WORKER_KINDS:
            served = any(p.get("worker_id") == w.new_id and p.get("ok") for p in r.get("phases", []))
        elif w.kind == "store":
            sides = [r.get("prefill_stats") or {}, r.get("decode_stats") or {}]
            served = (r["arrival_unix"] >= w.registered and r.get("mode") == "disaggregated"
                      and sum(s.get("kv_bytes_saved", 0) for s in sides) > 0
                      and sum(s.get("kv_bytes_loaded", 0) for s in sides) > 0)
        else:   # etcd: every current worker routed to again (the router's view of the fleet back)
            w.pending = (w.pending if w.pending is not None else
                         {c["id"] for c in state["children"].values() if c["kind"] in WORKER_KINDS and c["id"]})
            if r["arrival_unix"] >= w.registered:
                w.pending -= {p.get("worker_id") for p in r.get("phases", []) if p.get("ok")}
            served = not w.pending
        if served:
            w.back = end
            return


async def chaos(cluster: Cluster, args: argparse.Namespace, t0: float, done: asyncio.Event,
                all_back: asyncio.Event) -> list[Watch]:
    """Kill each kind at its moment; follow every kill until it is back (then ``all_back``) or
    the run ends."""
    kinds = [k for k in args.kills.split(",") if k]
    plan = [(t0 + args.first_kill_at + i * args.kill_every, k) for i, k in enumerate(kinds)]
    watches: list[Watch] = []
    records: list[dict[str, Any]] = []
    offset, last_look = 0, False
    while True:
        load_ended = done.is_set()   # then the records read below hold every request but the last few
        state = cluster.state()
        while plan and time.time() >= plan[0][0]:
            _, kind = plan.pop(0)
            name = kind if kind in ("store", "etcd") else f"{kind}-0"
            old = dict(state["children"][name])
            watches.append(Watch(kind, name, old, time.time()))
            lifecycle.kill_pid(old["pid"])
            print(f"[chaos] {time.time() - t0:6.1f} s: SIGKILL {name} (pid {old['pid']})", file=sys.stderr, flush=True)
        new, offset = read_records(cluster.request_log, offset)
        records += new
        for w in watches:
            if w.back is None:
                await asyncio.to_thread(check, w, cluster, state, records)
                if w.back is not None:
                    print(f"[chaos] {w.child} back {w.back - w.at:.1f} s after its kill", file=sys.stderr, flush=True)
        if not plan and all(w.back is not None for w in watches):
            all_back.set()
        if load_ended and (all_back.is_set() or time.time() > t0 + args.duration + args.settle):
            if last_look:   # one more read after the load ended: the router logs a request as it ends
                return watches
            last_look = True
        await asyncio.sleep(0.25)


# --- the run ---------------------------------------------------------------------------------

def _final_view(cluster: Cluster) -> dict[str, Any]:
    """At the end: the workers the launcher runs, those registered in etcd, the router's count."""
    state = cluster.state()
    view: dict[str, Any] = {"running": sorted(c["id"] for c in state["children"].values()
                                              if c["kind"] in WORKER_KINDS and c["id"])}
    try:
        view["registered"] = sorted(cluster.registered() & set(view["running"]))
        health = httpx.get(f"{cluster.router}/health", timeout=5, trust_env=False).json()
        view["router_workers"], view["router_down"] = health.get("workers"), health.get("down")
    except Exception as e:  # noqa: BLE001 - a report, not a check
        view["error"] = f"{type(e).__name__}: {e}"
    return view


async def run(args: argparse.Namespace, out: Path, model: str) -> dict[str, Any]:
    cluster = Cluster(args, out, model)
    try:
        served = httpx.get(f"{cluster.router}/v1/models", timeout=5, trust_env=False).json()["data"][0]["id"]
        rng = random.Random(args.seed)
        vocab = int(json.loads((Path(_model_dir(model)) / "config.json").read_text())["vocab_size"])
        prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]
        reference: list[str] = []
        async with httpx.AsyncClient(timeout=args.request_timeout, trust_env=False) as client:
            for p in prompts:                       # one at a time, before any kill
                reference.append(await complete(client, cluster.router, served, p, args.max_tokens,
                                                None if args.no_salt else f"ref{args.seed}"))
        t0 = time.time()
        done, all_back = asyncio.Event(), asyncio.Event()

        async def load() -> list[dict[str, Any]]:
            try:
                return await drive(cluster, args, served, prompts, reference, t0, all_back)
            finally:
                done.set()
        results, watches = await asyncio.gather(load(), chaos(cluster, args, t0, done, all_back))
        restarts = launcher_restarts(cluster.metrics_url)
        final = _final_view(cluster)
    finally:
        cluster.stop()
    failed = [r for r in results if not r["ok"]]
    kills = [w.report(t0) for w in watches]
    backs = [k["back_s"] for k in kills]
    plot_timeline(results, kills, out / "chaos_timeline.png",
                  f"chaos: {args.prefill}P+{args.decode}D, concurrency {args.concurrency}, "
                  f"{machine_info()['cpu_count']} CPUs")
    return {
        "bench": "chaos", "model": served, "workers": {"prefill": args.prefill, "decode": args.decode},
        "concurrency": args.concurrency, "duration_s": args.duration, "prompts": args.prompts,
        "max_tokens": args.max_tokens, "salted": not args.no_salt,
        "routes": dict(Counter(str(r.get("mode")) for r in read_records(cluster.request_log, 0)[0])),
        "sent": len(results), "succeeded": len(results) - len(failed),
        "failed": len(failed), "failed_by_status": dict(Counter(r["status"] for r in failed)),
        "failed_examples": [{k: r[k] for k in ("start", "end", "status", "detail")} for r in failed[:5]],
        "differing_outputs": sum(1 for r in results if r["ok"] and r["differs"]),
        "kills": kills, "launcher_restarts": restarts, "final_view": final,
        "targets": {"no_failed": not failed, "no_differing": not any(r["ok"] and r["differs"] for r in results),
                    f"back_within_{TARGET_BACK_S:g}s": all(b is not None and b <= TARGET_BACK_S for b in backs)},
        "machine": machine_info(), "out": str(out),
    }


def _model_dir(model: str) -> str:
    if model == "default":
        from engine.api.paths import resolve_model_dir
        return str(resolve_model_dir("default"))
    return model


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    kinds = HOST_KINDS if args.hosts else KINDS
    if args.hosts and args.kills == ",".join(KINDS):
        args.kills = "host-store"
    bad = [k for k in args.kills.split(",") if k and k not in kinds]
    if bad or (args.hosts and args.kills != "host-store"):
        sys.exit(f"chaos_bench: --kills takes {','.join(kinds)}"
                 f"{' (one kill with --hosts)' if args.hosts else ''}; got {args.kills}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model == "tiny":
        from engine.model.tiny import make_tiny_checkpoint
        model = str(make_tiny_checkpoint(out / "tiny-model", "llama", seed=0))
    if args.hosts:
        from benchmarks.chaos import chaos_hosts
        record = asyncio.run(chaos_hosts.run(args, out, model))
        emit(record, out / "chaos_hosts.json")
        return
    record = asyncio.run(run(args, out, model))
    emit(record, out / "chaos.json")


if __name__ == "__main__":
    sys.exit(lifecycle.run_main(main))
