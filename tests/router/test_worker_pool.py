"""WorkerClient and WorkerPool against a fake worker, and discovery through a real etcd."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

from engine.api.events import LoadFigures
from engine.api.generate import GenerateFinal, GenerateRequest, SamplingParams
from kvstore.keys import block_keys
from router.workers.client import WorkerClient, WorkerRejected, WorkerUnavailable
from router.workers.pool import StaticMembership, WorkerPool
from tests.router.fake_worker import NS, FakeWorker

KEYS = block_keys(NS, list(range(64)), 4)


async def _until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


def _run(coro: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(coro(), 30))


def test_generate_streams_until_final_and_reports_failures() -> None:
    async def body() -> None:
        fake = await FakeWorker().start()
        client = WorkerClient(fake.info)
        try:
            req = GenerateRequest("r1", [10, 11], SamplingParams(max_tokens=3, temperature=0.0))
            items = [x async for x in client.generate(req)]
            assert [x.token_ids for x in items[:-1]] == [[12], [13], [14]]
            assert isinstance(items[-1], GenerateFinal) and items[-1].finish_reason == "length"
            assert fake.requests[0].to_json() == req.to_json()
            fake.break_after = 1
            with pytest.raises(WorkerUnavailable, match="before its final line"):
                _ = [x async for x in client.generate(req)]
            bad = GenerateRequest("r2", [1])
            bad.prompt_token_ids = []  # invalid on the wire: the worker answers 400
            with pytest.raises(WorkerRejected) as info:
                _ = [x async for x in client.generate(bad)]
            assert info.value.status == 400
            assert await client.abort("r1") and fake.aborted == ["r1"]
        finally:
            await client.aclose()
            await fake.stop()
        dead = WorkerClient(fake.info, timeout=0.5)
        with pytest.raises(WorkerUnavailable):
            _ = [x async for x in dead.generate(GenerateRequest("r3", [1]))]
        assert not await dead.abort("r3")
        await dead.aclose()

    _run(body)


def test_pool_follows_events_resyncs_on_gap_and_tracks_load() -> None:
    async def body() -> None:
        fake = await FakeWorker().start()
        await fake.publish("stored", KEYS[:2])
        pool = await WorkerPool(StaticMembership([fake.info])).start()
        try:
            idx = pool.index
            await _until(lambda: idx.is_synced("w0"))
            assert idx.match(KEYS) == {"w0": 2}
            await fake.publish("stored", KEYS[2:5])
            await fake.publish("load", load=LoadFigures(waiting=2, kv_free_blocks=40, kv_total_blocks=100,
                                                        prefill_tokens_per_s=123.0))
            await _until(lambda: idx.match(KEYS) == {"w0": 5})
            handle = pool.get("w0")
            await _until(lambda: handle.load.figures.waiting == 2)
            assert handle.load.prefill_rate.value == 123.0 and handle.load.free_blocks == 40
            # A gap in the sequence: the pool fetches a fresh snapshot and catches up.
            snaps = fake.snapshots
            await fake.publish("removed", KEYS[1:2], skip=1)
            await _until(lambda: fake.snapshots > snaps and idx.is_synced("w0"))
            assert idx.match(KEYS) == {"w0": 1}
            assert pool.health()["membership"] == "ok" and pool.health()["synced"] == 1
            assert [w.worker_id for w in pool.decode_workers("tiny")] == ["w0"]
            assert pool.prefill_workers("other-model") == []
        finally:
            await pool.close()
            await fake.stop()
        assert idx.workers == []

    _run(body)


@pytest.mark.integration
def test_pool_discovers_workers_through_etcd(etcd_server, unique_prefix: str) -> None:
    from kvstore.coord.registration import register

    server = etcd_server()
    cluster = unique_prefix.strip("/")

    async def body() -> None:
        fake = await FakeWorker("wa").start()
        pool = await WorkerPool.from_etcd(server.url, cluster).start()
        try:
            assert pool.workers() == [] and pool.etcd_healthy
            value = fake.info.to_etcd_value()
            reg = await asyncio.to_thread(
                lambda: register(server.url, cluster, "workers", "wa", value, ttl=2.0))
            t0 = time.monotonic()
            await _until(lambda: pool.get("wa") is not None, timeout=5)
            assert time.monotonic() - t0 < 1.0, "a registered worker is used within a second"
            await _until(lambda: pool.index.is_synced("wa"))
            await asyncio.to_thread(reg.close)
            await _until(lambda: pool.get("wa") is None, timeout=5)
            # etcd goes away: the last membership is kept, and health says so.
            reg = await asyncio.to_thread(
                lambda: register(server.url, cluster, "workers", "wa", value, ttl=2.0))
            await _until(lambda: pool.get("wa") is not None)
            await asyncio.to_thread(server.stop)
            await _until(lambda: not pool.etcd_healthy, timeout=10)
            assert pool.get("wa") is not None
            assert "unreachable" in pool.health()["membership"]
            await asyncio.to_thread(reg.close)
        finally:
            await pool.close()
            await fake.stop()

    _run(body)


def test_a_worker_joining_at_a_held_address_supersedes_the_stale_registration(
        etcd_server, unique_prefix: str) -> None:
    # A killed worker's key lives until its lease ends; its replacement binds the same port and
    # registers under a new id. The pool must not keep both: they are one process.
    from kvstore.coord.registration import register

    server = etcd_server()
    cluster = unique_prefix.strip("/")

    async def body() -> None:
        fake = await FakeWorker("old").start()
        value = fake.info.to_etcd_value()
        pool = await WorkerPool.from_etcd(server.url, cluster).start()
        regs = []
        try:
            regs.append(await asyncio.to_thread(
                lambda: register(server.url, cluster, "workers", "old", value, ttl=30.0)))
            await _until(lambda: pool.get("old") is not None)
            regs.append(await asyncio.to_thread(
                lambda: register(server.url, cluster, "workers", "new", value, ttl=30.0)))
            await _until(lambda: pool.get("new") is not None)
            assert pool.get("old") is None and [w.worker_id for w in pool.workers()] == ["new"]
            await asyncio.sleep(0.3)                       # later syncs do not bring it back
            assert pool.get("old") is None
            client = pool.get("new").client
            assert client._http.headers["X-KV-Worker-Id"] == "new"
        finally:
            for reg in regs:
                await asyncio.to_thread(reg.close)
            await pool.close()
            await fake.stop()

    _run(body)


def test_a_worker_joining_a_warm_pool_starts_from_its_peers_costs_and_is_chosen(
        etcd_server, unique_prefix: str) -> None:
    # A restarted worker joins next to one that learned it prefills 40 tokens in 2 ms. Priced at
    # the generic priors (10 ms + 40 tokens at 2,000/s = 30 ms), the kv-aware choice would keep
    # picking the warm one even with a prefill booked there, and the newcomer never measured.
    from engine.api.generate import RequestStats
    from kvstore.coord.registration import register
    from router.placement.prefill import PrefillPolicy

    server = etcd_server()
    cluster = unique_prefix.strip("/")

    async def body() -> None:
        warm, fresh = await FakeWorker("warm").start(), await FakeWorker("fresh").start()
        pool = await WorkerPool.from_etcd(server.url, cluster).start()
        regs = []
        try:
            regs.append(await asyncio.to_thread(lambda: register(
                server.url, cluster, "workers", "warm", warm.info.to_etcd_value(), ttl=30.0)))
            await _until(lambda: pool.get("warm") is not None)
            for n in (40, 40, 80, 40, 120):
                pool.get("warm").load.observe_stats(RequestStats(computed_prompt_tokens=n,
                                                                 prefill_s=0.001 + n * 2.5e-5))
            learned = pool.get("warm").load.prefill_cost
            regs.append(await asyncio.to_thread(lambda: register(
                server.url, cluster, "workers", "fresh", fresh.info.to_etcd_value(), ttl=30.0)))
            await _until(lambda: pool.get("fresh") is not None)
            cost = pool.get("fresh").load.prefill_cost
            assert cost.samples == 0
            assert cost.seconds(40) == pytest.approx(learned.seconds(40), rel=1e-6)
            pool.get("warm").load.assign(prefill_tokens=40)     # one prefill booked on the warm one
            chosen = PrefillPolicy("kv-aware", pool.index).choose(
                [pool.get("warm").load, pool.get("fresh").load], KEYS[:10], 40)
            assert chosen is not None and chosen[0].worker_id == "fresh"
        finally:
            for reg in regs:
                await asyncio.to_thread(reg.close)
            await pool.close()
            await warm.stop()
            await fresh.stop()

    _run(body)


def test_worker_info_etcd_value_round_trips() -> None:
    from engine.api.generate import WorkerInfo

    info = FakeWorker("wz", "decode").info
    value = info.to_etcd_value()
    assert "worker_id" not in value and value["namespace"] == NS.hex()
    assert WorkerInfo.from_etcd_value("wz", value) == info
