"""Run-time role changes and the autoscaler on real processes: etcd, a store, workers of the
tiny checkpoint (one torch thread each) and a router in ``auto`` mode, under a stream of
streaming requests that never stops while the cluster changes.

- A role change drains first and loses no request: the worker leaves every pool the moment
  its registration says draining (no decode is sent to it after the router shows it), the
  requests it was decoding finish on it, the change takes effect only after they did, no
  request fails or fails over, and the router then sends it the new role's work.
- The autoscaler, reading the router's real signals, acts within its budget: role changes
  first (prefill -> decode when the decode pool is under pressure and the prefill pool
  idles), a stop when the load goes (which the supervisor leaves stopped), a start when it
  comes back (the stopped worker again, in its new role); each a console line, a metric and
  a timeline line; no request lost throughout.
- ``kvrouter up``'s refusals of what it cannot autoscale.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from kvstore.secret import bearer_headers
from router.cluster.autoscaler import Autoscaler, AutoscaleSpec
from router.cluster.launcher import LocalCluster
from router.cluster.levers import Levers
from router.cluster.supervisor import Supervisor
from tests.router.cluster_probe import random_prompt, records, scrape, wait_until

pytestmark = pytest.mark.integration

# ITL always over its objective under load, TTFT never; the colocated state's prefill share
# target high, so that a busy machine's slow prefills never hold the prefill pool up.
FAST_SCALING = ("--scale-ttft-target", "1000", "--scale-itl-target", "0.0001", "--scale-prefill-share", "0.9",
                "--scale-up-for", "0.3",
                "--scale-down-for", "0.5", "--scale-cooldown", "0.5", "--scale-window", "1",
                "--scale-interval", "0.2")
MAX_TOKENS = 120
LONG_TOKENS = 1500  # seconds on the tiny model even on a quiet machine: it outlives the role change's 1 s settle


@dataclass
class Load:
    """``clients`` threads each sending streaming completions back to back until ``stop()``."""

    url: str
    model: str
    clients: int = 4
    results: list[dict] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> "Load":
        self._stop.clear()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True)
                         for i in range(self.clients)]
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> list[dict]:
        self._stop.set()
        for t in self._threads:
            t.join(60)
        return self.results

    def _client(self, i: int) -> None:
        n = 0
        with httpx.Client(timeout=60, trust_env=False) as http:
            while not self._stop.is_set():
                n += 1
                self.results.append(stream(http, self.url, self.model, 1000 * i + n, MAX_TOKENS))


def stream(http: httpx.Client, url: str, model: str, seed: int, max_tokens: int) -> dict:
    """One streaming completion: its times (unix), tokens, error."""
    body = {"model": model, "prompt": random_prompt(24, seed, 512), "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    out = {"start": time.time(), "tokens": 0, "error": None, "max_tokens": max_tokens}
    try:
        with http.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                out["error"] = f"HTTP {resp.status_code}"
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out["error"] = json.dumps(chunk["error"])
                if chunk.get("usage"):
                    out["tokens"] = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        out["error"] = repr(exc)
    out["end"] = time.time()
    return out


def _all_served(results: list[dict]) -> None:
    bad = [r for r in results if r["error"] or r["tokens"] != r["max_tokens"]]
    assert results and not bad, bad[:3]


@pytest.fixture(scope="module")
def cluster(cluster_factory) -> LocalCluster:
    # Two decode workers in auto mode, no prefill worker: the colocated state.
    return cluster_factory(prefill=0, decode=2, mode="auto", auto_threshold=0, workers_by_index=True,
                           router_args=FAST_SCALING)


def _model(cluster: LocalCluster) -> str:
    return httpx.get(f"{cluster.router_url}/v1/models", trust_env=False).json()["data"][0]["id"]


def _scaling(cluster: LocalCluster) -> dict:
    resp = httpx.get(f"{cluster.router_url}/admin/scaling", trust_env=False,
                     headers=bearer_headers(cluster.secret))
    resp.raise_for_status()
    return resp.json()


def test_admin_scaling_needs_the_cluster_secret_and_metrics_carry_the_pools(cluster: LocalCluster) -> None:
    assert httpx.get(f"{cluster.router_url}/admin/scaling", trust_env=False).status_code == 401
    report = _scaling(cluster)
    assert report["mode"] == "auto" and set(report["pools"]) == {"prefill", "decode"}
    assert report["pools"]["prefill"]["workers"] == 0 and report["pools"]["decode"]["workers"] == 2
    m = scrape(cluster.router_url)
    assert m.get("kvrouter_pool_workers", pool="decode") == 2
    assert m.get("kvrouter_pool_desired_workers", pool="prefill") == 0


def test_role_change_drains_first_and_loses_no_request(cluster: LocalCluster) -> None:
    log = Path(cluster.spec.request_log)
    model = _model(cluster)
    http = httpx.Client(timeout=60, trust_env=False)
    # A long request first, on an idle cluster: the worker it lands on is the one to change.
    long: dict = {}
    runner = threading.Thread(target=lambda: long.update(stream(http, cluster.router_url, model, 7, LONG_TOKENS)))
    runner.start()
    busy = wait_until(lambda: [w["worker_id"] for w in _scaling(cluster)["workers"] if w["load"] > 0],
                      30, "the long request to be placed")
    wid = busy[0]
    decoder = next(c for c in cluster.children if c.member_id == wid)
    # Like every worker call but /health and /metrics, a role change needs the cluster secret.
    assert http.post(f"{decoder.address}/role", json={"role": "prefill"}).status_code == 401
    load = Load(cluster.router_url, model, clients=3).start()
    levers = Levers(cluster)
    try:
        t_post = time.time()
        changer = threading.Thread(target=levers.change_role, args=(decoder.name, "prefill"))
        changer.start()
        wait_until(lambda: http.get(f"{cluster.router_url}/health").json()["draining"] == 1,
                   10, "the router to see the worker draining")
        before = scrape(cluster.router_url)
        changer.join(60)
        runner.join(60)
        role = http.get(f"{decoder.address}/role",
                        headers={**bearer_headers(cluster.secret), "X-KV-Worker-Id": wid}).json()
        after_change = scrape(cluster.router_url)
        wait_until(lambda: scrape(cluster.router_url).get("kvrouter_routing_decisions_total",
                                                          worker=wid, phase="prefill")
                   > after_change.get("kvrouter_routing_decisions_total", worker=wid, phase="prefill"),
                   30, "a prefill on the worker in its new role")
    finally:
        results = load.stop()
        levers.close()
        http.close()
    _all_served(results + [long])
    assert scrape(cluster.router_url).total("kvrouter_failovers_total") == 0
    # From the moment the router showed it draining until its new role, no decode went to it.
    for phase in ("decode", "full"):   # (auto mode with no prefill worker: its requests ran "full")
        assert (after_change.get("kvrouter_routing_decisions_total", worker=wid, phase=phase)
                == before.get("kvrouter_routing_decisions_total", worker=wid, phase=phase))
    # It drained first: the change took effect only once the long request, still running well
    # after the change was asked for, had finished there (not merely after the 1 s settle).
    assert role["role"] == "prefill" and role["state"] == "serving"
    done_at = role["last"]["finished_unix"]
    assert long["end"] - t_post > 1.5, "the long request outlived the settle"
    assert long["end"] - 0.3 <= done_at, (long["end"], done_at)
    held = [r for r in records(log) if r["decode_workers"] == [wid]
            and r["arrival_unix"] < t_post < r["arrival_unix"] + r["timeline"]["end"]]
    assert held and all(r["status"] == "ok" and r["decode_resumes"] == 0 for r in held)
    health = httpx.get(f"{cluster.router_url}/health", trust_env=False).json()
    assert health["roles"] == {"prefill": 1, "decode": 1} and health["draining"] == 0
    assert decoder.kind == "prefill" and decoder.argv[decoder.argv.index("--role") + 1] == "prefill"


def test_autoscaler_acts_within_its_budget(cluster: LocalCluster) -> None:
    # From 1 prefill + 1 decode (the test above), with ITL far over its objective under load
    # and an idle prefill pool: a role change to decode (colocated x2, the budget); the load
    # gone: a stop; back: a start.
    if not any(c.kind == "prefill" for c in cluster.children):   # run alone: the layout of the test above
        levers = Levers(cluster)
        levers.change_role("worker-1", "prefill")
        levers.close()
    lines: list[str] = []
    supervisor = Supervisor(cluster, lines.append)
    scaler = Autoscaler(cluster, AutoscaleSpec(max_workers=2, interval_s=0.3), lines.append)
    load = Load(cluster.router_url, _model(cluster), clients=3)

    def run_until(kind: str, timeout: float) -> dict:
        def seen() -> dict | None:
            scaler.step()
            supervisor.poll()
            return next((a for a in scaler.actions_done if a["action"] == kind), None)
        try:
            return wait_until(seen, timeout, f"an autoscaler {kind}")
        except AssertionError as exc:   # say what the autoscaler saw
            rounds = scaler.timeline.read_text().splitlines() if scaler.timeline.exists() else []
            raise AssertionError(f"{exc}; its lines: {lines[-5:]}; its last rounds: {rounds[-2:]}") from None

    results: list[dict] = []
    try:
        load.start()
        # The scaler reads the router only once the router's decode pool asks for more workers
        # (its ITL over the objective for --scale-up-for). The idle prefill pool asks for none
        # on a timer of its own (--scale-down-for once it is seen idle); read before the decode
        # pool asks for more, the budget's layout is colocated x1: the prefill worker is stopped
        # instead of changing role (then a start follows, and no role change ever comes).
        # Served requests are no sign of it: three of them take less than that sustain.
        wait_until(lambda: _scaling(cluster)["pools"]["decode"]["desired"] > 1, 60,
                   "the router's decode pool to ask for more workers")
        role = run_until("role", 40)
        assert (role["from"], role["to"]) == ("prefill", "decode")
        results += load.stop()
        stop = run_until("stop", 40)
        supervisor.poll()
        assert supervisor.states()[stop["worker"]] == "stopped"
        load.results = []
        load.start()
        start = run_until("start", 60)
        supervisor.poll()
        assert start["worker"] == stop["worker"] and start["to"] == "decode"
        assert supervisor.states()[start["worker"]] == "running"
    finally:
        results += load.stop()
        scaler.close()
    _all_served(results)
    assert scrape(cluster.router_url).total("kvrouter_failovers_total") == 0
    for kind in ("role", "stop", "start"):
        assert scaler.metrics.registry.get_sample_value(
            "kvrouter_up_autoscale_actions_total", {"action": kind, "role": "decode"}) >= 1
    assert any(f"autoscale: {stop['worker']} stopped" in line for line in lines)
    timeline = [json.loads(x) for x in scaler.timeline.read_text().splitlines()]
    assert {"role", "stop", "start"} <= {t.get("action") for t in timeline if t["kind"] == "action"}
    assert all(t["prefill"] + t["decode"] <= 2 for t in timeline if t["kind"] == "signals")


def test_up_refuses_what_it_cannot_autoscale(capsys: pytest.CaptureFixture[str]) -> None:
    from router.cli import main

    for args, says in ((["--autoscale", "--mode", "colocated"], "one pool"),
                       (["--max-workers", "3"], "needs --autoscale"),
                       (["--autoscale", "--prefill", "2", "--decode", "2", "--max-workers", "3"], "more than"),
                       (["--autoscale", "--scale-down-ratio", "1.5"], "hysteresis band")):
        assert main(["up", *args]) == 2
        assert says in capsys.readouterr().err, args
