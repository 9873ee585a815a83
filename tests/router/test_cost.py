"""The cost model against its documented arithmetic (``router.placement.cost``), written out
here again on random books, and ``PrefillPolicy.choose`` against every candidate's estimate:
it picks what sorting them would pick, near ties included."""

from __future__ import annotations

import random

import pytest

from engine.api.events import LoadFigures, Snapshot
from engine.api.generate import RequestStats, WorkerInfo
from kvstore.keys import block_keys
from router.placement.cost import estimate_prefill
from router.placement.prefill import NEAR_REL, NEAR_S, PrefillPolicy
from router.workers.fit import RateConfig
from router.workers.kv_index import KvIndex
from router.workers.load import WorkerLoad

NS = bytes(16)


def _random_worker(rng: random.Random, i: int, block_size: int | None = None) -> WorkerLoad:
    bs = rng.choice([1, 4, 16, 32]) if block_size is None else block_size
    info = WorkerInfo(f"w{i}", f"http://w{i}:1", "prefill", "m", NS, bs, 4096, 32768)
    w = WorkerLoad(info, RateConfig(prefill_tokens_per_s=rng.uniform(500, 20_000),
                                    load_tokens_per_s=rng.uniform(1e4, 2e5),
                                    prefill_overhead_s=rng.choice([0.0, 0.01, 0.03])))
    if rng.random() < 0.7:
        w.observe_load(LoadFigures(waiting=rng.randint(0, 6), running=rng.randint(0, 3),
                                   prefill_tokens_per_s=rng.uniform(0, 3e4),
                                   load_tokens_per_s=rng.uniform(0, 3e5)))
    for _ in range(rng.randint(0, 12)):   # a fitted cost (and a mean sample size) or the prior
        n = rng.randint(1, 4000)
        w.observe_stats(RequestStats(computed_prompt_tokens=n, prefill_s=0.01 + n / 9000,
                                     store_hit_tokens=rng.choice([0, n]), store_load_s=n / 1e5))
    for _ in range(rng.randint(0, 3)):
        w.assign(rng.choice([0, rng.randint(1, 5000)]), rng.randint(0, 10))
    return w


def test_the_estimate_is_the_documented_arithmetic() -> None:
    rng = random.Random(7)
    for _ in range(1000):
        w = _random_worker(rng, 0)
        num_tokens = rng.choice([0, 1, 15, 16, 17, rng.randint(1, 9000)])
        device, store = rng.choice([0, 1, rng.randint(0, 600)]), rng.choice([0, rng.randint(0, 600)])
        c, lc, bs = w.prefill_cost, w.load_cost, w.info.block_size
        queue = w.pending_prefill_tokens * c.per_token_s + w.pending_prefills * c.overhead_s
        if w.figures.waiting > w.pending_prefills:   # other routers' requests: the mean size
            mean = c.mean_tokens if c.mean_tokens is not None else w.rates.pivot_tokens
            queue += (w.figures.waiting - w.pending_prefills) * (c.overhead_s + mean * c.per_token_s)
        last = max(num_tokens - 1, 0)                # the last prompt token is always computed
        dev_hit = min(device * bs, last)
        store_hit = min(store * bs, last) - dev_hit if store > device else 0
        uncached = num_tokens - dev_hit - store_hit
        e = estimate_prefill(w, num_tokens, device, store)
        assert (e.worker_id, e.device_hit_tokens, e.store_hit_tokens, e.uncached_tokens) == (
            "w0", dev_hit, store_hit, uncached)
        assert e.queue_s == pytest.approx(queue, rel=1e-12, abs=1e-15)
        assert e.compute_s == pytest.approx(c.overhead_s + uncached * c.per_token_s, rel=1e-12)
        assert e.load_s == (pytest.approx(lc.overhead_s + store_hit * lc.per_token_s, rel=1e-12)
                            if store_hit else 0.0)


@pytest.mark.parametrize("policy_name", ["kv-aware", "least-loaded"])
def test_choose_is_the_minimum_of_every_estimate_near_ties_included(policy_name: str) -> None:
    rng = random.Random(3)
    keys = block_keys(NS, list(range(16 * 40)), 16)
    for trial in range(150):
        n = rng.randint(1, 6)
        if trial % 3 == 0:   # identical books: equal estimates, decided by load then id
            workers = [_random_worker(random.Random(trial), i, 16) for i in range(n)]
            for w in workers[: rng.randint(0, n)]:
                w.inflight_requests += 1   # more load, the same estimate
        else:
            workers = [_random_worker(rng, i, 16) for i in range(n)]
        rng.shuffle(workers)
        index, held = KvIndex(), {}
        for w in workers:
            held[w.worker_id] = 0 if trial % 3 == 0 else rng.randint(0, len(keys))
            index.reset(w.worker_id, Snapshot(0, tuple(keys[:held[w.worker_id]]), LoadFigures()))
        policy = PrefillPolicy(policy_name, index)  # type: ignore[arg-type]
        num_tokens, store = len(keys) * 16 + rng.randint(0, 15), rng.randint(0, len(keys))
        ests = [estimate_prefill(w, num_tokens, held[w.worker_id], store) for w in workers]
        load = {w.worker_id: w.load for w in workers}
        if policy_name == "kv-aware":   # near-equal estimates: the most device hits first
            low = min(e.ttft_s for e in ests)
            near = [e for e in ests if e.ttft_s <= low + max(NEAR_S, NEAR_REL * low)]
            best = min((-e.device_hit_tokens, load[e.worker_id]) for e in near)
            wants = [e for e in near if (-e.device_hit_tokens, load[e.worker_id]) == best]  # they take turns
        else:
            wants = [min(ests, key=lambda e: (load[e.worker_id], e.ttft_s, e.worker_id))]
        chosen = policy.choose(workers, keys, num_tokens, store)
        assert chosen is not None
        assert chosen[1] in wants and chosen[0].worker_id == chosen[1].worker_id


def test_idle_workers_a_little_apart_take_turns() -> None:
    """Two idle workers whose learned costs differ by less than the slack (one slower by a
    restart's cold first prompt) both get prompts: the lower estimate does not take them all,
    so the other's costs keep being learned."""
    workers = []
    for i, prefill_s in enumerate((0.020, 0.026)):
        info = WorkerInfo(f"w{i}", f"http://w{i}:1", "prefill", "m", NS, 16, 4096, 32768)
        w = WorkerLoad(info, RateConfig(prefill_tokens_per_s=4000.0, load_tokens_per_s=1e5,
                                        prefill_overhead_s=0.01))
        for _ in range(4):
            w.observe_stats(RequestStats(computed_prompt_tokens=40, prefill_s=prefill_s))
        workers.append(w)
    policy = PrefillPolicy("kv-aware", KvIndex())
    ests = [policy.choose([w], [], 40)[1].ttft_s for w in workers]   # type: ignore[index]
    assert ests[0] < ests[1] <= min(ests) + NEAR_S
    chosen = [policy.choose(workers, [], 40)[0].worker_id for _ in range(6)]  # type: ignore[index]
    assert chosen.count("w0") == chosen.count("w1") == 3, chosen
