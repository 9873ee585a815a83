"""Our router against vLLM's own router in front of the same colocated vLLM instances:

    python -m benchmarks.serving.vllm_routing [--repeats 3] [--parts multi_turn,mixed] [--out DIR]

One cluster, started once in this process as ``kvrouter up --engine vllm --mode colocated
--colocated 2`` starts it (``LocalCluster``):
etcd, a store daemon, two vLLM OpenAI servers (the default model, float32, one thread each,
block size 32, each with the store's KV connector and vLLM's own KV events) and our router
(``--policy kv-aware``). Beside it, on the very same two instances, ``vllm-router`` (PyPI's
``vllm-router``, from ``.venv-loadgen``; ``scripts/setup_loadgen.sh``) with its KV-event-aware
policy (``--policy kv_aware``), subscribed to the same ZMQ event sockets and replay endpoints.

Each run drives one router with one seeded workload (``benchmarks.serving.load_client``, open loop,
token-id prompts, streaming): ``multi_turn`` (chat sessions whose every turn extends the
last: the turns of a session hit the instance that holds its history, or recompute it) and
``mixed`` (short decode-heavy requests with rare huge prefills: placement by load). The two
routers take turns: repeat ``r`` runs every part on ours then theirs, or theirs then ours on
odd ``r``, with the same workload (seed ``--seed + r``). Before every run both instances'
prefix caches are emptied (``POST /reset_prefix_cache``, vLLM's dev-mode endpoint; both
routers get vLLM's ``AllBlocksCleared`` event) and the store daemon is stopped and started
again, empty (the connectors find the new one in etcd), so no run inherits another's
cache. The workload carries no ``cache_salt``: vllm-router's index skips blocks with extra
keys.

Per run: TTFT and TPOT p50/p99, goodput (requests meeting the objectives per second of the
run; objectives from unloaded probes through our router once at the start: TTFT 5x, TPOT 2x,
the same for both routers), and from the instances' own Prometheus counters (deltas over the
run, summed over instances): the device prefix-cache hit rate (``vllm:prefix_cache_hits`` over
``vllm:prefix_cache_queries``, in tokens), the share loaded through the connector
(``vllm:external_prefix_cache_hits``), and each instance's share of the requests. Figures:
the median over repeats with the min-max spread. Target: ours ahead on goodput and
p99 TTFT by more than the repeats' spread, level or better on the hit rate. One JSON line on
stdout; ``OUT/vllm_routing.json`` and ``OUT/vllm_routing.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks import lifecycle
from benchmarks.lifecycle import REPO
from benchmarks.report import emit, machine_info, pyplot, save_figure, write_json
from benchmarks.serving.load_client import ClientConfig, fetch_model
from benchmarks.serving.serve_bench import measure_unloaded, run_point
from engine.api.generate import WorkerInfo
from planner.metrics import Slo
from planner.workloads import ChatSpec, MixedSpec, TokenSpace, Workload

VLLM_ROUTER = REPO / ".venv-loadgen" / "bin" / "vllm-router"
PARTS = ("multi_turn", "mixed")
ROUTERS = ("ours", "vllm_router")
COUNTERS = ("prefix_cache_hits", "prefix_cache_queries", "external_prefix_cache_hits", "request_success")


def workload(part: str, args: argparse.Namespace, seed: int) -> Workload:
    space = TokenSpace(max_context=8192)
    if part == "multi_turn":
        return ChatSpec(users=args.users, turns=args.turns, first_message=args.first_message,
                        system_prompt=args.system_prompt, reply=32, message=64,
                        think_time_s=1.0).build(args.chat_rate, seed, space)
    return MixedSpec(short_prompt=128, short_output=48, long_prompt=args.long_prompt, long_output=8,
                     long_share=0.08).build(args.mixed_requests, args.mixed_rate, seed, space)


def prometheus_sums(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Each ``vllm:NAME_total`` in a Prometheus text page, summed over its label sets."""
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith("vllm:"):
            continue
        metric, _, value = line.rpartition(" ")
        name = metric.split("{", 1)[0].removeprefix("vllm:").removesuffix("_total")
        if name in out:
            out[name] += float(value)
    return out


def _daemon(target: Any, *args: Any) -> None:
    import threading

    threading.Thread(target=target, args=args, daemon=True).start()


def _republish(ipc: str, tcp: str) -> None:
    import zmq

    ctx = zmq.Context.instance()
    sub, xpub = ctx.socket(zmq.SUB), ctx.socket(zmq.XPUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(ipc)
    xpub.bind(tcp)
    zmq.proxy(sub, xpub)


def _relay_replay(tcp: str, ipc: str) -> None:
    """vLLM's replay socket takes ``[identity, b"", start_seq]`` and answers several
    ``[identity, b"", seq, payload]`` messages: one DEALER towards it, the answers handed to
    whoever asked last (vllm-router, alone on this bridge)."""
    import zmq

    ctx = zmq.Context.instance()
    front, back = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    front.bind(tcp)
    back.connect(ipc)
    poller = zmq.Poller()
    poller.register(front, zmq.POLLIN)
    poller.register(back, zmq.POLLIN)
    asker = b""
    while True:
        for sock, _ in poller.poll():
            if sock is front:
                asker, *request = front.recv_multipart()
                back.send_multipart(request if request[:1] == [b""] else [b"", *request])
            else:
                front.send_multipart([asker, *back.recv_multipart()])


def bridge_events(ipc: str) -> str:
    """vllm-router takes ``tcp://HOST:PORT`` event sources only, where our instances publish on
    unix sockets (their events carry prompts' token ids): a loopback TCP republisher of one
    (a ZMQ proxy in this process, microseconds a message)."""
    from kvstore.proc import free_port

    tcp = f"tcp://127.0.0.1:{free_port()}"
    _daemon(_republish, ipc, tcp)
    return tcp


def bridge_replay(ipc: str) -> str:
    """The same for a replay endpoint (:func:`_relay_replay`)."""
    from kvstore.proc import free_port

    tcp = f"tcp://127.0.0.1:{free_port()}"
    _daemon(_relay_replay, tcp, ipc)
    return tcp


class Cluster:
    """``kvrouter up``'s :class:`~router.cluster.launcher.LocalCluster` (our router and the
    instances), run in this process, and ``vllm-router`` beside it."""

    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        from kvstore.proc import free_port
        from router.cluster.launcher import ClusterSpec, LocalCluster

        os.environ["VLLM_SERVER_DEV_MODE"] = "1"   # the instances serve POST /reset_prefix_cache
        spec = ClusterSpec(port=0, mode="colocated", colocated=2, policy="kv-aware", engine="vllm",
                           vllm_kv_cache=args.kv_cache, vllm_block_size=32, store_memory="2G",
                           log_dir=str(out / "cluster"), ready_timeout=300.0)
        self.cluster = LocalCluster(spec, on_status=lambda line: print(f"[vllm_routing] {line}", file=sys.stderr))
        self.their_proc: Any = None
        try:
            self.cluster.start()
            assert self.cluster.router_url is not None and self.cluster.secret is not None
            self.router: str = self.cluster.router_url
            self.auth = {"Authorization": f"Bearer {self.cluster.secret}"}
            self.workers = self._workers()
            self.theirs = self._vllm_router(out, free_port(), free_port())
        except BaseException:
            self.stop()
            raise

    def _workers(self) -> list[WorkerInfo]:
        from kvstore.coord import layout
        from kvstore.coord.etcd import EtcdClient

        assert self.cluster.etcd_url is not None
        with EtcdClient(self.cluster.etcd_url, timeout=2.0) as etcd:
            items = etcd.get_prefix(layout.prefix(self.cluster.spec.cluster, "workers"))[0]
        workers = [WorkerInfo.from_etcd_value(k.rsplit("/", 1)[1], json.loads(v)) for k, v in items.items()]
        if len(workers) != 2 or any(w.engine != "vllm" or not w.kv_events for w in workers):
            raise RuntimeError(f"expected two vLLM workers with KV events in etcd, found {workers}")
        return sorted(workers, key=lambda w: w.address)

    def _vllm_router(self, out: Path, port: int, metrics_port: int) -> str:
        if not VLLM_ROUTER.exists():
            raise SystemExit(f"{VLLM_ROUTER} is missing: run scripts/setup_loadgen.sh")
        w0 = self.workers[0]
        assert self.cluster.secret is not None
        argv = [str(VLLM_ROUTER), "--host", "127.0.0.1", "--port", str(port), "--policy", "kv_aware",
                "--worker-urls", *[w.address for w in self.workers], "--api-key", self.cluster.secret,
                "--kv-event-block-size", str(w0.block_size), "--kv-event-model", w0.model,
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
                "--health-check-interval-secs", "5"]
        for w in self.workers:
            assert w.kv_events is not None
            argv += ["--kv-event-source", f"{w.address}={bridge_events(w.kv_events)}"]
            if w.kv_events_replay:
                argv += ["--kv-event-replay-source", f"{w.address}={bridge_replay(w.kv_events_replay)}"]
        self.their_log = open(out / "vllm_router.log", "w")
        self.their_proc = lifecycle.popen(argv, stdout=self.their_log, stderr=self.their_log)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.their_proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited; see {out / 'vllm_router.log'}")
            try:
                if httpx.get(f"{url}/v1/models", headers=self.auth, timeout=2).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vllm-router did not serve /v1/models; see {out / 'vllm_router.log'}")

    def counters(self) -> list[dict[str, float]]:
        return [prometheus_sums(httpx.get(f"{w.address}/metrics", timeout=10).text, COUNTERS) for w in self.workers]

    def reset(self) -> None:
        """Empty both device prefix caches and restart the store daemon empty."""
        for w in self.workers:
            r = httpx.post(f"{w.address}/reset_prefix_cache", headers=self.auth, timeout=60)
            r.raise_for_status()
        store = self.cluster.child("store")
        self.cluster.stop_child("store")
        self.cluster.respawn(store)
        deadline = time.monotonic() + 90
        while not self.cluster.is_ready(store):
            if time.monotonic() > deadline:
                raise RuntimeError("the store daemon did not come back")
            time.sleep(0.3)
        time.sleep(3.0)   # the connectors' next lookup finds it through etcd

    def stop(self) -> None:
        if self.their_proc is not None:
            lifecycle.stop(self.their_proc, 10)
            self.their_log.close()
        self.cluster.stop()


def delta(before: list[dict[str, float]], after: list[dict[str, float]]) -> dict[str, Any]:
    per = [{k: a[k] - b[k] for k in COUNTERS} for b, a in zip(before, after)]
    queries = sum(p["prefix_cache_queries"] for p in per)
    requests = sum(p["request_success"] for p in per)
    return {"device_hit_rate": sum(p["prefix_cache_hits"] for p in per) / queries if queries else None,
            "store_hit_rate": sum(p["external_prefix_cache_hits"] for p in per) / queries if queries else None,
            "reuse_rate": sum(p["prefix_cache_hits"] + p["external_prefix_cache_hits"] for p in per) / queries
            if queries else None,
            "prompt_tokens": queries,
            "instance_share": [p["request_success"] / requests if requests else None for p in per]}


def _spread(values: list[float | None]) -> dict[str, float | None]:
    xs = [v for v in values if v is not None]
    if not xs:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def _paired(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Ours minus theirs within each repeat (the same workload, minutes apart): the machine's
    speed drifts between repeats more than between the two runs of one."""
    def p99(r: dict[str, Any]) -> float | None:
        return r["summary"]["ttft_s"]["p99"] if r["summary"]["ttft_s"] else None

    by = {(r["repeat"], r["router"]): r for r in runs}
    reps = sorted({r["repeat"] for r in runs if (r["repeat"], "ours") in by and (r["repeat"], "vllm_router") in by})
    good = [by[k, "ours"]["summary"]["good"] - by[k, "vllm_router"]["summary"]["good"] for k in reps]
    ttft = [(a - b) if a is not None and b is not None else None
            for a, b in ((p99(by[k, "ours"]), p99(by[k, "vllm_router"])) for k in reps)]
    return {"good": good, "ttft_p99_s": ttft,
            "ahead_in_every_repeat": {"goodput": bool(good) and all(g > 0 for g in good),
                                      "ttft_p99": bool(ttft) and all(t is not None and t < 0 for t in ttft)}}


def summarize_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per part and router: median and min-max over repeats; per part, whether ours is ahead."""
    table: dict[str, Any] = {}
    for part in sorted({r["part"] for r in runs}):
        row: dict[str, Any] = {}
        for router in ROUTERS:
            rs = [r for r in runs if r["part"] == part and r["router"] == router]
            s = [r["summary"] for r in rs]
            row[router] = {
                "goodput": _spread([x["goodput"] for x in s]),
                "good": _spread([x["good"] for x in s]),
                "ttft_p50": _spread([x["ttft_s"]["p50"] if x["ttft_s"] else None for x in s]),
                "ttft_p99": _spread([x["ttft_s"]["p99"] if x["ttft_s"] else None for x in s]),
                "tpot_p50": _spread([x["tpot_s"]["p50"] if x["tpot_s"] else None for x in s]),
                "tpot_p99": _spread([x["tpot_s"]["p99"] if x["tpot_s"] else None for x in s]),
                "device_hit_rate": _spread([r["cache"]["device_hit_rate"] for r in rs]),
                "store_hit_rate": _spread([r["cache"]["store_hit_rate"] for r in rs]),
                "reuse_rate": _spread([r["cache"]["reuse_rate"] for r in rs]),
                "failed": sum(x["failed"] for x in s), "repeats": len(rs)}
        ours, theirs = row["ours"], row["vllm_router"]
        if ours["repeats"] and theirs["repeats"]:
            def ahead(metric: str, higher: bool) -> bool | None:
                a, b = row["ours"][metric], row["vllm_router"][metric]
                if a["median"] is None or b["median"] is None:
                    return None
                # "by more than the spread": our worst repeat beats their best one
                return a["min"] > b["max"] if higher else a["max"] < b["min"]
            row["ahead"] = {"goodput": ahead("goodput", True), "ttft_p99": ahead("ttft_p99", False),
                            "hit_rate_level_or_better": (ours["device_hit_rate"]["median"] or 0)
                            >= (theirs["device_hit_rate"]["median"] or 0) - 0.02}
            row["paired"] = _paired([r for r in runs if r["part"] == part])
        table[part] = row
    return table


def plot(table: dict[str, Any], path: Path) -> None:
    plt = pyplot()

    metrics = (("goodput", "goodput (req/s)"), ("ttft_p99", "TTFT p99 (s)"), ("device_hit_rate", "device hit rate"))
    parts = list(table)
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.6))
    for ax, (metric, label) in zip(axes, metrics):
        for j, router in enumerate(ROUTERS):
            xs = [i + (j - 0.5) * 0.38 for i in range(len(parts))]
            cells = [table[p][router][metric] for p in parts]
            med = [c["median"] or 0 for c in cells]
            err = [[m - (c["min"] or 0) for m, c in zip(med, cells)], [(c["max"] or 0) - m for m, c in zip(med, cells)]]
            ax.bar(xs, med, 0.36, yerr=err, capsize=3, label={"ours": "kvrouter (ours)",
                                                              "vllm_router": "vllm-router kv_aware"}[router])
        ax.set_xticks(range(len(parts)), parts)
        ax.set_title(label)
    axes[0].legend(fontsize=8)
    fig.suptitle("the same two vLLM instances behind each router (median, min-max over repeats)", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)


async def _probe_slo(url: str, model: str, parts: list[str], args: argparse.Namespace) -> dict[str, Slo]:
    cfg = ClientConfig(url, model, progress=False)
    out = {}
    for part in parts:
        wl = workload(part, args, args.seed)
        unloaded = await measure_unloaded(cfg, wl.probe_shape(), TokenSpace(max_context=8192), 3, args.seed,
                                          wl.long_probe_prompt())
        out[part] = unloaded.slo(5.0, 2.0)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = args.parts.split(",")
    cluster = Cluster(args, out)
    runs: list[dict[str, Any]] = []
    try:
        urls = {"ours": cluster.router, "vllm_router": cluster.theirs}
        model = asyncio.run(fetch_model(cluster.router))
        slos = asyncio.run(_probe_slo(cluster.router, model, parts, args))
        for r in range(args.repeats):
            order = ROUTERS if r % 2 == 0 else ROUTERS[::-1]
            for part in parts:
                wl = workload(part, args, args.seed + r)
                for router in order:
                    cluster.reset()
                    cfg = ClientConfig(urls[router], model, max_duration_s=args.max_duration, grace_s=60,
                                       progress=not args.quiet,
                                       headers=cluster.auth if router == "vllm_router" else {})
                    before = cluster.counters()
                    point = asyncio.run(run_point(wl, cfg, slos[part]))
                    time.sleep(1.0)   # the instances' last counters
                    rec = {"router": router, "part": part, "repeat": r, "requests": len(wl.requests),
                           "summary": point.record["summary"], "by_tag": point.record["by_tag"],
                           "errors": point.record["errors"], "cache": delta(before, cluster.counters())}
                    runs.append(rec)
                    with open(out / "runs.jsonl", "a") as f:
                        f.write(json.dumps(rec) + "\n")
                    s = rec["summary"]
                    print(f"[vllm_routing] repeat {r} {part:10s} {router:11s} good {s['good']}/{s['issued']} "
                          f"ttft p99 {s['ttft_s']['p99'] if s['ttft_s'] else float('nan'):.2f}s "
                          f"device hits {rec['cache']['device_hit_rate'] or 0:.1%}", file=sys.stderr)
    finally:
        cluster.stop()
    table = summarize_runs(runs)
    record = {"benchmark": "vllm_routing", "parts": parts, "repeats": args.repeats, "seed": args.seed,
              "kv_cache_per_instance": args.kv_cache, "slo": {p: dataclasses.asdict(s) for p, s in slos.items()},
              "workloads": {p: workload(p, args, args.seed).scaling for p in parts},
              "machine": machine_info(),
              "table": table, "runs": runs}
    write_json(out / "vllm_routing.json", record)
    plot(table, out / "vllm_routing.png")
    return record


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving.vllm_routing",
                                description="our router vs vllm-router (kv_aware) in front of the same two "
                                            "colocated vLLM instances, interleaved repeats (module docstring)")
    p.add_argument("--out", default="benchmarks/results/vllm_routing", help="directory for the JSON, runs and plot")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated of {', '.join(PARTS)}")
    p.add_argument("--repeats", type=int, default=3, help="runs of every part on each router (default 3)")
    p.add_argument("--seed", type=int, default=0, help="workload seed of repeat 0 (repeat r: seed + r)")
    p.add_argument("--kv-cache", default="384M", help="each instance's vLLM KV cache (default 384M)")
    p.add_argument("--users", type=int, default=16, help="multi_turn: chat sessions (default 16)")
    p.add_argument("--turns", type=int, default=4, help="multi_turn: turns per session (default 4)")
    p.add_argument("--first-message", type=int, default=512, help="multi_turn: first message tokens (default 512)")
    p.add_argument("--system-prompt", type=int, default=0, help="multi_turn: shared system prompt tokens (default 0)")
    p.add_argument("--chat-rate", type=float, default=0.6, help="multi_turn: requests/s (default 0.6)")
    p.add_argument("--mixed-requests", type=int, default=50, help="mixed: requests (default 50)")
    p.add_argument("--mixed-rate", type=float, default=0.7, help="mixed: requests/s (default 0.7)")
    p.add_argument("--long-prompt", type=int, default=2048, help="mixed: mean tokens of a huge prefill (default 2048)")
    p.add_argument("--max-duration", type=float, default=240.0, help="send nothing after this many seconds of a run")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--report", default=None, metavar="JSON",
                   help="run nothing: summarize an earlier run's vllm_routing.json again (table and plot into --out)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.report:
        record = json.loads(Path(args.report).read_text())
        record["table"] = summarize_runs(record["runs"])
        out = Path(args.out)
        write_json(out / "vllm_routing.json", record)
        plot(record["table"], out / "vllm_routing.png")
        emit({k: v for k, v in record.items() if k != "runs"})
        return
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    unknown = set(args.parts.split(",")) - set(PARTS)
    if unknown:
        raise SystemExit(f"unknown parts {sorted(unknown)}; choose from {PARTS}")
    record = run(args)
    emit({k: v for k, v in record.items() if k != "runs"})


if __name__ == "__main__":
    sys.exit(lifecycle.run_main(main))
