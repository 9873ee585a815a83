"""Routing policies: TTFT estimates that follow measured rates, prefix affinity, decode fit."""

from __future__ import annotations

import pytest

from engine.api_types import LoadFigures, RequestStats, Snapshot, WorkerInfo
from kvstore.keys import block_keys
from router.kv_index import KvIndex
from router.policy import (
    PrefillPolicy,
    RateConfig,
    WorkerLoad,
    blocks_needed,
    choose_decode,
    prefer_local,
)

NS = bytes(16)
BS = 16
PROMPT = list(range(1000, 1000 + 20 * BS + 5))  # 20 full blocks + 5 tokens
KEYS = block_keys(NS, PROMPT, BS)


def _worker(wid: str, role: str = "prefill", capacity: int = 1000) -> WorkerLoad:
    info = WorkerInfo(wid, f"http://{wid}:1", role, "m", NS, BS, capacity, 4096)  # type: ignore[arg-type]
    return WorkerLoad(info, RateConfig(prefill_tokens_per_s=1000.0, load_tokens_per_s=10_000.0))


def _index_with(holdings: dict[str, int]) -> KvIndex:
    index = KvIndex()
    for wid, n in holdings.items():
        index.reset(wid, Snapshot(0, tuple(KEYS[:n]), LoadFigures()))
    return index


def test_estimate_follows_measured_prefill_rate() -> None:
    w = _worker("a")
    policy = PrefillPolicy("kv-aware", _index_with({"a": 0}))
    n = len(PROMPT)
    (before,) = policy.estimates([w], KEYS, n)
    assert before.uncached_tokens == n and before.compute_s == pytest.approx(n / 1000.0)
    # The worker reports a slower prefill (it got busy): the estimate moves toward it.
    history = []
    for _ in range(10):
        w.observe_load(LoadFigures(running=4, prefill_tokens_per_s=250.0))
        history.append(policy.estimates([w], KEYS, n)[0].compute_s)
    assert history[0] == pytest.approx(n / 250.0)  # the first measurement replaces the prior
    w.observe_load(LoadFigures(prefill_tokens_per_s=500.0))
    after = policy.estimates([w], KEYS, n)[0].compute_s
    assert n / 500.0 < after < n / 250.0  # smoothed, not jumping to the latest sample
    # "0.0" means not measured: it does not move the average.
    w.observe_load(LoadFigures(prefill_tokens_per_s=0.0))
    assert policy.estimates([w], KEYS, n)[0].compute_s == pytest.approx(after)
    # Finished requests' stats are samples too.
    w.observe_stats(RequestStats(computed_prompt_tokens=4000, prefill_s=1.0))
    assert policy.estimates([w], KEYS, n)[0].compute_s < after


def test_kv_aware_prefers_the_worker_holding_the_prefix_until_it_is_busy() -> None:
    a, b = _worker("a"), _worker("b")
    policy = PrefillPolicy("kv-aware", _index_with({"a": 0, "b": 16}))
    worker, est = policy.choose([a, b], KEYS, len(PROMPT))
    assert worker is b and est.device_hit_tokens == 16 * BS
    assert est.uncached_tokens == len(PROMPT) - 16 * BS
    # Queue b with enough pending prefill that recomputing on a is faster.
    booking = b.assign(prefill_tokens=2000)
    assert policy.choose([a, b], KEYS, len(PROMPT))[0] is a
    booking.release()
    booking.release()  # idempotent
    assert b.pending_prefill_tokens == 0 and b.inflight_requests == 0
    assert policy.choose([a, b], KEYS, len(PROMPT))[0] is b


def test_store_hits_count_at_the_load_rate() -> None:
    a = _worker("a")
    policy = PrefillPolicy("kv-aware", _index_with({"a": 4}))
    est = policy.estimates([a], KEYS, len(PROMPT), store_blocks=20)[0]
    assert est.device_hit_tokens == 4 * BS and est.store_hit_tokens == 16 * BS
    assert est.uncached_tokens == 5
    assert est.load_s == pytest.approx(16 * BS / 10_000.0)
    # A fully cached prompt still computes its last token.
    full = list(range(2 * BS))
    est = policy.estimates([a], block_keys(NS, full, BS), len(full), store_blocks=2)[0]
    assert est.uncached_tokens == 1


def test_least_loaded_and_round_robin() -> None:
    a, b, c = _worker("a"), _worker("b"), _worker("c")
    index = _index_with({"a": 20, "b": 0, "c": 0})
    a.observe_load(LoadFigures(waiting=3, running=2))
    b.assign()
    assert PrefillPolicy("least-loaded", index).choose([a, b, c], KEYS, len(PROMPT))[0] is c
    rr = PrefillPolicy("round-robin", index)
    assert [rr.choose([c, a, b], KEYS, 1)[0].worker_id for _ in range(4)] == ["a", "b", "c", "a"]
    assert rr.choose([], KEYS, 1) is None
    with pytest.raises(ValueError, match="unknown prefill policy"):
        PrefillPolicy("random", index)  # type: ignore[arg-type]


def test_decode_choice_needs_free_blocks_then_least_load() -> None:
    small, big, busy = _worker("small", "decode", 10), _worker("big", "decode", 100), _worker("busy", "decode", 100)
    busy.observe_load(LoadFigures(running=5, kv_free_blocks=90, kv_total_blocks=100))
    assert blocks_needed(100, 100, BS) == 13
    assert choose_decode([small, big, busy], 100, 100) is big
    big.assign(blocks=95)  # this router already promised most of big
    assert choose_decode([small, big, busy], 100, 100) is busy
    assert choose_decode([small, big, busy], 100, 10_000) is None
    assert choose_decode([small], 50, 50) is small


def test_auto_mode_threshold() -> None:
    a = _worker("a", "colocated")
    policy = PrefillPolicy("kv-aware", _index_with({"a": 20}))
    est = policy.estimates([a], KEYS, len(PROMPT))[0]
    assert prefer_local(est, threshold_tokens=64)
    est = policy.estimates([a], KEYS[:1], 10 * BS + 7)[0]
    assert not prefer_local(est, threshold_tokens=64)
