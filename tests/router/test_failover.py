"""Failures on real processes: a prefill worker killed mid-request, a decode worker killed
mid-stream, etcd gone. The client must still get transformers' greedy text, and the router
must say (in its request record and metrics) what it did.

To kill a worker *while it holds the request*, the test freezes the candidate workers
(SIGSTOP) before sending, learns from the router's metrics which one it chose, then kills
that one and thaws the others. Freezes stay well under the workers' etcd lease TTL (5 s).
The cluster here starts its own etcd (the launcher's child) so the last test can kill it.

Below them, fast in-process tests: the decode choice on figures alone, and the
orchestrator's resume / abort / give-up logic against fake workers (``fake_worker.py``).
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from engine.api.blocks import blocks_needed
from engine.api.events import LoadFigures
from engine.api.generate import GenerateFinal, GenerateRequest, RequestStats, SamplingParams, WorkerInfo
from engine.api.tokenizer import Tokenizer
from kvstore.keys import BlockKey
from router.cluster.launcher import ChildProcess, LocalCluster
from router.metrics import RouterMetrics
from router.placement.decode import choose_decode, with_room
from router.placement.errors import NoCapacity
from router.placement.orchestrator import Orchestrator
from router.placement.prefill import PrefillPolicy
from router.placement.request_log import RequestLog
from router.placement.serving import ServeRequest
from router.workers.client import WorkerUnavailable
from router.workers.load import WorkerLoad
from router.workers.pool import StaticMembership, WorkerHandle, WorkerPool
from tests.router.cluster_probe import Metrics, random_prompt, record, records, scrape, wait_until, worker_id
from tests.router.fake_worker import FakeWorker

NO_EOS = {"ignore_eos": True}


@dataclass
class Env:
    cluster: LocalCluster
    url: str
    model: str
    log: Path
    tokenizer: Tokenizer
    names: dict[str, str]          # worker id -> child name

    def prompt(self, n: int, seed: int) -> list[int]:
        """``n`` random ids of the whole vocabulary (deterministic in ``seed``)."""
        return random_prompt(n, seed, self.tokenizer.vocab_size)

    def client(self) -> OpenAI:
        return OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def workers(self, role: str) -> dict[str, ChildProcess]:
        return {wid: self.cluster.child(name) for wid, name in self.names.items()
                if name.startswith(role)}

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=5, trust_env=False).json()


@pytest.fixture(scope="module")
def env(cluster_factory, tiny_model_dir: Path) -> Env:
    cluster = cluster_factory(prefill=2, decode=2, mode="disaggregated", etcd=None)
    url = cluster.router_url
    model = httpx.get(f"{url}/v1/models", trust_env=False).json()["data"][0]["id"]
    names = {worker_id(u, cluster.secret): name for name, u in cluster.worker_urls.items()}
    return Env(cluster, url, model, Path(cluster.spec.request_log),
               Tokenizer.from_dir(tiny_model_dir), names)


def _chosen(env: Env, before: Metrics, candidates: dict[str, ChildProcess],
            phase: str) -> Callable[[], str | None]:
    """A poll: the candidate the router has routed one more ``phase`` to since ``before``."""
    name = "kvrouter_routing_decisions_total"

    def poll() -> str | None:
        now = scrape(env.url)
        return next((wid for wid in candidates
                     if now.get(name, worker=wid, phase=phase) > before.get(name, worker=wid, phase=phase)),
                    None)
    return poll


def _thaw(children: dict[str, ChildProcess]) -> None:
    for child in children.values():
        if child.alive():
            child.signal_group(signal.SIGCONT)


@pytest.mark.integration
def test_prefill_worker_killed_mid_request_is_retried_elsewhere(env: Env, oracle) -> None:
    prefill = env.workers("prefill")
    prompt = env.prompt(40, 11)
    before = scrape(env.url)
    for child in prefill.values():
        child.signal_group(signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(env.client().completions.create, model=env.model,
                                  prompt=prompt, max_tokens=8, temperature=0, extra_body=NO_EOS)
            victim = wait_until(_chosen(env, before, prefill, "prefill"), 10, "a prefill decision")
            prefill[victim].signal_group(signal.SIGKILL)     # dies holding the request
            _thaw(prefill)
            r = pending.result(timeout=60)
    finally:
        _thaw(prefill)
    survivor = next(w for w in prefill if w != victim)
    assert r.choices[0].text == env.tokenizer.decode(oracle(prompt, 8))
    rec = record(env.log, r.id)
    assert rec["prefill_retries"] == 1 and rec["prefill_worker"] == survivor
    assert rec["phases"][0]["worker_id"] == victim and not rec["phases"][0]["ok"]
    after = scrape(env.url)
    assert (after.get("kvrouter_failovers_total", kind="prefill_retry")
            - before.get("kvrouter_failovers_total", kind="prefill_retry")) == 1
    # The dead worker leaves the router's view within its lease TTL.
    wait_until(lambda: env.health()["workers"] == 3, 15, "the dead worker to be dropped")


@pytest.mark.integration
def test_decode_worker_killed_mid_stream_resumes_on_another(env: Env, oracle) -> None:
    decode = env.workers("decode")
    prompt, max_tokens = env.prompt(40, 12), 300      # 2 full blocks (32 tokens) + 8
    received: list[str] = []
    before = scrape(env.url)

    def consume() -> None:
        stream = env.client().completions.create(model=env.model, prompt=prompt,
                                                 max_tokens=max_tokens, temperature=0,
                                                 stream=True, extra_body=NO_EOS)
        for chunk in stream:
            received.append(chunk.id)
            received.append(chunk.choices[0].text)

    for child in decode.values():
        child.signal_group(signal.SIGSTOP)
    reader = threading.Thread(target=consume)
    try:
        reader.start()
        victim = wait_until(_chosen(env, before, decode, "decode"), 10, "a decode decision")
        decode[victim].signal_group(signal.SIGCONT)
        wait_until(lambda: len(received) >= 12, 10, "tokens streamed by the first decode worker")
        decode[victim].signal_group(signal.SIGKILL)            # dies mid-stream
        _thaw(decode)
        reader.join(60)
    finally:
        _thaw(decode)
    assert not reader.is_alive()
    survivor = next(w for w in decode if w != victim)
    text = "".join(received[1::2])
    assert text == env.tokenizer.decode(oracle(prompt, max_tokens))

    rec = record(env.log, received[0])
    assert rec["decode_resumes"] == 1 and rec["decode_workers"] == [victim, survivor]
    assert rec["output_tokens"] == max_tokens and rec["finish_reason"] == "length"
    failed, resumed = rec["phases"][1], rec["phases"][2]
    assert failed["worker_id"] == victim and not failed["ok"] and failed["output_tokens"] > 0
    assert resumed["worker_id"] == survivor and resumed["ok"]
    sent_before = 1 + failed["output_tokens"]              # the prefill's token + the victim's
    assert resumed["output_tokens"] == max_tokens - sent_before
    # The survivor loaded the prompt's full blocks from the store and computed only the rest.
    assert resumed["stats"]["store_hit_tokens"] == 32
    assert resumed["stats"]["computed_prompt_tokens"] == 40 + sent_before - 32
    after = scrape(env.url)
    assert (after.get("kvrouter_failovers_total", kind="decode_resume")
            - before.get("kvrouter_failovers_total", kind="decode_resume")) == 1


@pytest.mark.integration
def test_store_down_is_reported_and_requests_prefill_where_they_decode(env: Env, oracle) -> None:
    """/health said "ok" with the store daemon dead, and requests to be disaggregated were
    still labelled so. Now /health is degraded naming the store, and a request is prefilled
    where it decodes, logged as route ``store-down``, with transformers' text."""
    assert env.health()["status"] == "ok"
    env.cluster.child("store").signal_group(signal.SIGKILL)
    health = wait_until(lambda: (h := env.health())["dependencies"]["store"]["status"] == "down"
                        and h, 20, "/health to report the store down")
    assert health["status"] == "degraded" and health["down"] == ["store"]
    prompt = env.prompt(40, 17)
    r = env.client().completions.create(model=env.model, prompt=prompt, max_tokens=6,
                                        temperature=0, extra_body=NO_EOS)
    assert r.choices[0].text == env.tokenizer.decode(oracle(prompt, 6))
    rec = record(env.log, r.id)
    assert rec["mode"] == "store-down" and rec["prefill_worker"] is None
    # Full phases only (a first one may hit the decode worker killed above, not yet expired).
    assert {p["phase"] for p in rec["phases"]} == {"full"} and rec["phases"][-1]["ok"]
    assert rec["decode_workers"][-1] in env.workers("decode")


@pytest.mark.integration
def test_etcd_unreachable_keeps_serving_with_last_membership(env: Env, oracle) -> None:
    env.cluster.child("etcd").signal_group(signal.SIGKILL)
    health = wait_until(lambda: "etcd unreachable" in (h := env.health())["membership"] and h, 20,
                        "/health to report etcd unreachable")
    assert health["status"] == "degraded" and health["dependencies"]["etcd"]["status"] == "down"
    prompt = env.prompt(24, 13)
    r = env.client().completions.create(model=env.model, prompt=prompt, max_tokens=5,
                                        temperature=0, extra_body=NO_EOS)
    assert r.choices[0].text == env.tokenizer.decode(oracle(prompt, 5))


# --- the decode choice, on figures alone ---------------------------------------------------


def _handle(wid: str, capacity: int, free: int, running: int = 0) -> WorkerHandle:
    info = WorkerInfo(wid, f"http://{wid}", "decode", "m", BlockKey(bytes(16)), 16, capacity, 4096)
    load = WorkerLoad(info)
    load.observe_load(LoadFigures(running=running, kv_free_blocks=free, kv_total_blocks=capacity))
    return WorkerHandle(info, client=None, load=load, events_task=None)  # type: ignore[arg-type]


def test_decode_choice_prefers_room_then_least_loaded() -> None:
    busy_roomy, idle_roomy, full = _handle("a", 64, 40, 3), _handle("b", 64, 40, 1), _handle("c", 64, 1)
    # 100 + 200 tokens = 19 blocks: a and b have room, b is less loaded.
    assert choose_decode([busy_roomy, idle_roomy, full], 100, 200) is idle_roomy
    assert with_room([busy_roomy, idle_roomy, full], 100, 200) == [busy_roomy, idle_roomy]


def test_decode_choice_waits_on_a_busy_worker_rather_than_failing() -> None:
    a, b = _handle("a", 64, 2, 5), _handle("b", 64, 3, 9)
    # Nobody has 19 free blocks now, but both caches could hold it: queue at the least loaded.
    assert choose_decode([a, b], 100, 200) is a
    # 2000 tokens = 125 blocks fit in no cache at all: nowhere to go.
    assert choose_decode([a, b], 1000, 1000) is None and with_room([a, b], 1000, 1000) == []


def test_decode_choice_books_what_the_engine_admits() -> None:
    # 17 + 16 tokens hold KV for 32 (the last sampled token is never fed back): 2 blocks of
    # 16, as engine.core.llm_engine counts them (engine.api.blocks), not 3.
    assert blocks_needed(17, 16, 16) == 2
    tight = _handle("a", 2, 2)
    assert with_room([tight], 17, 16) == [tight] and choose_decode([tight], 17, 16) is tight
    assert choose_decode([tight], 17, 17) is None


# --- the orchestrator's failover logic against fake workers (in-process, fast) -----------


def _run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))


async def _fake_router(tmp_path: Path, *fakes: FakeWorker,
                       mode: str = "colocated") -> tuple[Orchestrator, WorkerPool, Path]:
    pool = await WorkerPool(StaticMembership([f.info for f in fakes])).start()
    log_path = tmp_path / "requests.jsonl"
    orch = Orchestrator(pool, PrefillPolicy("least-loaded", pool.index), RouterMetrics(),
                        mode=mode, request_log=RequestLog(str(log_path)))  # type: ignore[arg-type]
    return orch, pool, log_path


def test_final_stats_are_how_the_prompt_was_served_plus_every_phase_s_transfers(tmp_path: Path) -> None:
    """serving.py's contract: token and latency figures from the first phase (the decode
    phase loads the same prompt again), KV bytes and store seconds summed over the phases."""
    async def body() -> None:
        p, d = await FakeWorker("p", "prefill").start(), await FakeWorker("d", "decode").start()
        p.stats = RequestStats(computed_prompt_tokens=4, device_hit_tokens=16, store_hit_tokens=0,
                               kv_bytes_saved=100, store_save_s=0.5, queue_s=0.01,
                               prefill_s=0.2, first_token_s=0.25)
        d.stats = RequestStats(computed_prompt_tokens=5, store_hit_tokens=16, kv_bytes_loaded=100,
                               store_load_s=0.125, queue_s=0.02, prefill_s=0.1, first_token_s=0.3)
        orch, pool, log_path = await _fake_router(tmp_path, p, d, mode="disaggregated")
        try:
            items = [x async for x in orch.serve(ServeRequest("r6", "tiny", list(range(1, 21)),
                                                              SamplingParams(max_tokens=3)))]
            assert [t for x in items[:-1] for t in x.token_ids] == [21, 22, 23]
            assert [r.phase for r in p.requests + d.requests] == ["prefill", "decode"]
            assert items[-1].stats == RequestStats(
                computed_prompt_tokens=4, device_hit_tokens=16, store_hit_tokens=0,
                kv_bytes_saved=100, kv_bytes_loaded=100, store_save_s=0.5, store_load_s=0.125,
                queue_s=0.01, prefill_s=0.2, first_token_s=0.25)
            # The request log keeps each side's own figures, in the same names.
            rec = records(log_path)[0]
            assert rec["prefill_stats"] == p.stats.to_json() and rec["decode_stats"] == d.stats.to_json()
        finally:
            await pool.close()
            await p.stop()
            await d.stop()
    _run(body())


def test_a_prefill_s_token_is_handed_on_as_it_arrives(tmp_path: Path) -> None:
    """The worker sends a prefill's token once its blocks are stored, right before its final
    line; the router hands it on as it comes, not after the final line."""
    async def body() -> None:
        p, d = await FakeWorker("p", "prefill").start(), await FakeWorker("d", "decode").start()
        p.token_delay = 2.0                        # the prefill's final line comes 2 s later
        orch, pool, log_path = await _fake_router(tmp_path, p, d, mode="disaggregated")
        try:
            stream = orch.serve(ServeRequest("r9", "tiny", [1, 2], SamplingParams(max_tokens=3)))
            async with aclosing(stream):
                first = await anext(stream)
                assert first.token_ids == [3] and "r9" in p.in_progress   # no final line yet
                rest = [x async for x in stream]
            assert [t for x in rest[:-1] for t in x.token_ids] == [4, 5]
            assert isinstance(rest[-1], GenerateFinal) and rest[-1].finish_reason == "length"
            assert [(r.phase, r.output_token_ids) for r in d.requests] == [("decode", [3])]
            rec = records(log_path)[0]
            assert [(x["phase"], x["output_tokens"], x["ok"]) for x in rec["phases"]] == [
                ("prefill", 1, True), ("decode", 2, True)]
            tl = rec["timeline"]
            assert tl["prefill_start"] <= tl["prefill_end"] <= tl["first_token"] < tl["decode_end"]
        finally:
            await pool.close()
            await p.stop()
            await d.stop()
    _run(body())


def test_a_prefill_broken_after_its_token_resumes_as_a_decode(tmp_path: Path) -> None:
    """The token was handed on: the prefill is not retried (that would send it twice); the
    decode continues from it, without the final line's block keys, each token once."""
    async def body() -> None:
        p1, p2 = await FakeWorker("p1", "prefill").start(), await FakeWorker("p2", "prefill").start()
        d = await FakeWorker("d", "decode").start()
        p1.break_after = p2.break_after = 1        # either prefill: its token, no final line
        orch, pool, log_path = await _fake_router(tmp_path, p1, p2, d, mode="disaggregated")
        try:
            items = [x async for x in orch.serve(ServeRequest("r10", "tiny", [1, 2],
                                                              SamplingParams(max_tokens=4)))]
            assert [t for x in items[:-1] for t in x.token_ids] == [3, 4, 5, 6]
            assert len(p1.requests) + len(p2.requests) == 1        # no prefill retry
            resumed = d.requests[0]
            assert (resumed.phase, resumed.output_token_ids, resumed.block_keys) == ("decode", [3], None)
            rec = records(log_path)[0]
            assert rec["prefill_retries"] == 0 and rec["decode_resumes"] == 1
            assert [(x["phase"], x["output_tokens"], x["ok"]) for x in rec["phases"]] == [
                ("prefill", 1, False), ("decode", 3, True)]
            assert rec["output_tokens"] == 4 and rec["status"] == "ok"
            # No prefill finished: its side is zeros; the decode side is the decode's stats.
            assert rec["prefill_stats"] == RequestStats().to_json()
            assert rec["decode_stats"] == rec["phases"][1]["stats"]
        finally:
            await pool.close()
            for w in (p1, p2, d):
                await w.stop()
    _run(body())


def test_a_broken_stream_resumes_with_the_tokens_already_sent(tmp_path: Path) -> None:
    async def body() -> None:
        wa, wb = await FakeWorker("wa").start(), await FakeWorker("wb").start()
        wa.break_after = 3                          # wa's stream breaks after 3 tokens
        orch, pool, log_path = await _fake_router(tmp_path, wa, wb)
        try:
            req = ServeRequest("r1", "tiny", [10, 11, 12, 13, 14], SamplingParams(max_tokens=8))
            items = [x async for x in orch.serve(req)]
            tokens = [t for x in items[:-1] for t in x.token_ids]
            assert tokens == list(range(15, 23))    # each token once, in order, across the break
            assert isinstance(items[-1], GenerateFinal) and items[-1].finish_reason == "length"
            resumed = wb.requests[0]
            assert (resumed.phase, resumed.output_token_ids) == ("decode", [15, 16, 17])
            assert wa.aborted == ["r1"]             # the broken worker is told to free it
            rec = records(log_path)[0]
            assert rec["decode_resumes"] == 1 and rec["decode_workers"] == ["wa", "wb"]
            assert [p["ok"] for p in rec["phases"]] == [False, True]
        finally:
            await pool.close()
            await wa.stop()
            await wb.stop()
    _run(body())


def test_closing_the_stream_early_aborts_the_request_on_its_worker(tmp_path: Path) -> None:
    async def body() -> None:
        wa = await FakeWorker("wa").start()
        wa.token_delay = 0.05
        orch, pool, log_path = await _fake_router(tmp_path, wa)
        try:
            stream = orch.serve(ServeRequest("r2", "tiny", [1, 2], SamplingParams(max_tokens=100)))
            async with aclosing(stream):
                got = [await anext(stream), await anext(stream)]
            assert [x.token_ids for x in got] == [[3], [4]]
            await _until(lambda: wa.aborted == ["r2"])
            assert records(log_path)[0]["status"] == "closed"
        finally:
            await pool.close()
            await wa.stop()
    _run(body())


def test_every_worker_failing_ends_in_503(tmp_path: Path) -> None:
    async def body() -> None:
        wa, wb = await FakeWorker("wa").start(), await FakeWorker("wb").start()
        wa.break_after = wb.break_after = 1
        orch, pool, log_path = await _fake_router(tmp_path, wa, wb)
        try:
            with pytest.raises(NoCapacity, match="no decode worker"):
                _ = [x async for x in orch.serve(ServeRequest("r3", "tiny", [1, 2],
                                                              SamplingParams(max_tokens=9)))]
            rec = records(log_path)[0]
            assert rec["status"] == "error" and rec["output_tokens"] == 2
        finally:
            await pool.close()
            await wa.stop()
            await wb.stop()
    _run(body())


def test_a_worker_dropped_by_the_pool_mid_request_fails_over(tmp_path: Path) -> None:
    """The pool closes a dropped worker's client; a request already routed there must see
    WorkerUnavailable (and fail over), not httpx's "client has been closed" RuntimeError."""
    async def body() -> None:
        wa, wb = await FakeWorker("wa").start(), await FakeWorker("wb").start()
        orch, pool, log_path = await _fake_router(tmp_path, wa, wb)
        try:
            handles = {h.worker_id: h for h in pool.workers()}
            with pytest.raises(WorkerUnavailable, match="client is closed"):
                await handles["wa"].client.aclose()
                _ = [x async for x in handles["wa"].client.generate(
                    GenerateRequest("r0", [1], SamplingParams(max_tokens=2)))]
            assert not await handles["wa"].client.abort("r0")      # never raises either
            # Whichever worker the request is routed to first, it gets its tokens.
            items = [x async for x in orch.serve(ServeRequest("r4", "tiny", [1, 2],
                                                              SamplingParams(max_tokens=3)))]
            assert [t for x in items[:-1] for t in x.token_ids] == [3, 4, 5]
            assert [r.request_id for r in wb.requests] == ["r4"] and not wa.requests
            # Every worker gone that way: a 503, not an internal error.
            await handles["wb"].client.aclose()
            with pytest.raises(NoCapacity):
                _ = [x async for x in orch.serve(ServeRequest("r5", "tiny", [1, 2],
                                                              SamplingParams(max_tokens=3)))]
            failed = records(log_path)[-1]["phases"]
            assert failed and all("client is closed" in p["error"] for p in failed)
        finally:
            await pool.close()
            await wa.stop()
            await wb.stop()
    _run(body())


async def _until(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def test_a_request_no_worker_can_take_is_logged_unplaced(tmp_path: Path) -> None:
    async def body() -> None:
        orch, pool, log_path = await _fake_router(tmp_path)
        try:
            with pytest.raises(NoCapacity, match="no decode-capable worker"):
                _ = [x async for x in orch.serve(ServeRequest("r7", "tiny", [1, 2],
                                                              SamplingParams(max_tokens=3)))]
            rec = records(log_path)[0]
            assert rec["status"] == "error" and rec["mode"] is None and rec["phases"] == []
        finally:
            await pool.close()
    _run(body())


def test_route_is_the_log_mode_and_the_metric_kind(tmp_path: Path) -> None:
    async def body() -> None:
        p, d = await FakeWorker("p", "prefill").start(), await FakeWorker("d", "decode").start()
        orch, pool, log_path = await _fake_router(tmp_path, p, d, mode="disaggregated")
        try:
            _ = [x async for x in orch.serve(ServeRequest("r8", "tiny", [1, 2],
                                                          SamplingParams(max_tokens=2)))]
            assert records(log_path)[0]["mode"] == "disaggregated"
            text = orch.metrics.render().decode()
            assert 'kvrouter_route_kind_total{kind="disaggregated"} 1.0' in text
        finally:
            await pool.close()
            await p.stop()
            await d.stop()
    _run(body())
