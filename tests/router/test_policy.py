"""Routing policies: the learned TTFT model (overhead + tokens / rate, fitted per worker),
prefix affinity against queued work, decode fit."""

from __future__ import annotations

import pytest

from engine.api.blocks import blocks_needed
from engine.api.events import LoadFigures, Snapshot
from engine.api.generate import RequestStats, WorkerInfo
from kvstore.keys import block_keys
from router.placement.cost import PrefillEstimate
from router.placement.decode import Balance, choose_decode
from router.placement.prefill import PROBE_AFTER, PrefillPolicy, prefer_local
from router.workers.fit import MAX_JUMP, LinearCost, RateConfig
from router.workers.kv_index import KvIndex
from router.workers.load import WorkerLoad, peer_priors
from router.workers.pool import WorkerHandle

NS = bytes(16)
BS = 16
PROMPT = list(range(1000, 1000 + 20 * BS + 5))  # 20 full blocks + 5 tokens
KEYS = block_keys(NS, PROMPT, BS)
RATES = RateConfig(prefill_tokens_per_s=1000.0, load_tokens_per_s=10_000.0)


def _worker(wid: str, role: str = "prefill", capacity: int = 1000, rates: RateConfig = RATES) -> WorkerLoad:
    info = WorkerInfo(wid, f"http://{wid}:1", role, "m", NS, BS, capacity, 4096)  # type: ignore[arg-type]
    return WorkerLoad(info, rates)


def _index_with(holdings: dict[str, int], keys: list[bytes] = KEYS) -> KvIndex:
    index = KvIndex()
    for wid, n in holdings.items():
        index.reset(wid, Snapshot(0, tuple(keys[:n]), LoadFigures()))
    return index


def _estimate(policy: PrefillPolicy, w: WorkerLoad, keys: list[bytes], num_tokens: int,
              store_blocks: int = 0) -> PrefillEstimate:
    """``w``'s estimate: the choice among ``w`` alone."""
    chosen = policy.choose([w], keys, num_tokens, store_blocks)
    assert chosen is not None and chosen[0] is w
    return chosen[1]


def _prefill(tokens: int, seconds: float) -> RequestStats:
    return RequestStats(computed_prompt_tokens=tokens, prefill_s=seconds)


# --- the cost model --------------------------------------------------------------------------

def test_linear_cost_fits_overhead_and_rate_from_spread_samples() -> None:
    c = LinearCost(0.01, 1000.0)
    assert (c.overhead_s, c.tokens_per_s, c.mean_tokens) == (0.01, 1000.0, None)
    for _ in range(20):
        for n in (32, 256, 1024, 4096):
            c.update(n, 0.05 + n / 8000)
    assert c.overhead_s == pytest.approx(0.05, rel=0.05)
    assert c.tokens_per_s == pytest.approx(8000, rel=0.02)
    # Samples without tokens or time are "not measured".
    before = (c.overhead_s, c.per_token_s, c.samples)
    for tokens, seconds in ((0, 1.0), (10, 0.0), (10, -1.0), (10, float("inf")), (10, float("nan"))):
        c.update(tokens, seconds)
    assert (c.overhead_s, c.per_token_s, c.samples) == before


def test_linear_cost_without_spread_keeps_the_prior_it_cannot_measure() -> None:
    # All samples tiny: they fix the time near 8 tokens, and that is overhead; the rate stays
    # at the prior (nothing measured it).
    tiny = LinearCost(0.01, 1000.0)
    for _ in range(30):
        tiny.update(8, 0.03 + 8 / 5000)
    assert tiny.seconds(8) == pytest.approx(0.0316, rel=0.02)
    assert tiny.tokens_per_s == pytest.approx(1000.0, rel=0.01)
    assert tiny.overhead_s == pytest.approx(0.0316 - 8 / 1000, rel=0.05)
    # All samples long: they teach the rate; the overhead stays near the prior.
    long = LinearCost(0.01, 1000.0)
    for _ in range(30):
        long.update(4000, 0.01 + 4000 / 5000)
    assert long.tokens_per_s == pytest.approx(5000, rel=0.02)
    assert 0.0 <= long.overhead_s <= 0.02


def test_linear_cost_clamps() -> None:
    # Time falling with size (noise, or a cache warming up) would fit a negative rate.
    c = LinearCost(0.01, 1000.0)
    for _ in range(30):
        c.update(100, 0.5)
        c.update(5000, 0.1)
    assert c.per_token_s >= 1e-9 and c.overhead_s >= 0.0
    assert c.seconds(100) > 0.0
    # Time proportional to size with a tiny prior overhead would fit a negative overhead.
    c = LinearCost(0.0, 1000.0)
    for _ in range(30):
        c.update(100, 0.01)
        c.update(1000, 0.2)
    assert c.overhead_s == 0.0 and c.per_token_s > 0.0
    with pytest.raises(ValueError):
        LinearCost(0.01, 0.0)
    with pytest.raises(ValueError, match="fit_alpha"):
        RateConfig(fit_alpha=0.0)


# --- (1) overhead-dominated measurements do not mis-rank the worker holding the prefix -------

def test_worker_measured_on_tiny_prompts_still_wins_the_long_prompt_it_holds() -> None:
    # Both workers really cost 20 ms + n / 4000 s. "small" has only served tiny prompts, so
    # its measured rate (what its load events report, and n / prefill_s) is 200-500 tokens/s;
    # "big" has served long ones and measures ~3600 tokens/s.
    def true_s(n: int) -> float:
        return 0.02 + n / 4000

    prompt = list(range(2000))                       # 125 blocks
    keys = block_keys(NS, prompt, BS)
    small, big = _worker("small", rates=RateConfig()), _worker("big", rates=RateConfig())
    for _ in range(5):
        for n in range(4, 13):
            small.observe_stats(_prefill(n, true_s(n)))
            small.observe_load(LoadFigures(prefill_tokens_per_s=n / true_s(n)))
        for n in range(1500, 2501, 125):
            big.observe_stats(_prefill(n, true_s(n)))
            big.observe_load(LoadFigures(prefill_tokens_per_s=n / true_s(n)))
    assert small.prefill_rate.value < 500 and big.prefill_rate.value > 3500
    policy = PrefillPolicy("kv-aware", _index_with({"small": 110, "big": 0}, keys))
    # small holds 110 of the 125 blocks: 240 tokens to compute, against 2000 on big.
    # A rate-only model (tokens / measured rate) would send it to big: 240/450 s > 2000/3600 s.
    assert 240 / small.prefill_rate.value > 2000 / big.prefill_rate.value
    worker, est = policy.choose([small, big], keys, len(prompt))
    assert worker is small and est.uncached_tokens == 240
    # The learned model is close to the truth where it was measured: small's overhead is
    # what its tiny prompts showed, big's rate is its real rate.
    assert small.prefill_cost.overhead_s == pytest.approx(0.02, rel=0.25)
    assert big.prefill_cost.tokens_per_s == pytest.approx(4000, rel=0.05)
    by_id = {w.worker_id: _estimate(policy, w, keys, len(prompt)) for w in (small, big)}
    assert by_id["big"].ttft_s == pytest.approx(true_s(2000), rel=0.05)
    assert by_id["small"].ttft_s < true_s(2000) / 3


# --- (2) the estimate follows a change in load: rates and queue ------------------------------

def test_estimate_follows_a_change_in_rate() -> None:
    w = _worker("a")
    policy = PrefillPolicy("kv-aware", _index_with({"a": 0}))
    n = len(PROMPT)

    def compute_s() -> float:
        return _estimate(policy, w, KEYS, n).compute_s

    assert compute_s() == pytest.approx(RATES.prefill_overhead_s + n / 1000.0)  # the priors
    sizes = (64, 256, 1024)
    for _ in range(30):                                   # idle: 20 ms + n / 4000
        for s in sizes:
            w.observe_stats(_prefill(s, 0.02 + s / 4000))
    idle = compute_s()
    assert idle == pytest.approx(0.02 + n / 4000, rel=0.05)
    # It gets busy: 40 ms + n / 2000. The estimate moves toward it, smoothed, and gets there.
    busy_truth = 0.04 + n / 2000
    history = []
    for _ in range(30):
        for s in sizes:
            w.observe_stats(_prefill(s, 0.04 + s / 2000))
        history.append(compute_s())
    assert idle < history[0] < (idle + busy_truth) / 2 + 0.01   # not jumping to the newest
    assert all(x <= y + 1e-12 for x, y in zip(history, history[1:]))
    assert history[-1] == pytest.approx(busy_truth, rel=0.05)
    # Store loads happen inside prefill_s; the compute sample leaves them out.
    before = w.prefill_cost.samples
    w.observe_stats(RequestStats(computed_prompt_tokens=256, prefill_s=0.5, store_hit_tokens=1000,
                                 store_load_s=0.5))  # all of it was loading: no compute sample
    w.observe_stats(_prefill(0, 1.0))                # nothing computed: no sample
    assert w.prefill_cost.samples == before and w.load_cost.samples == 1
    # A rate reported in a load event raises the prior of a worker not measured yet; a
    # reported rate is never lower than the overhead-free one, so it never lowers the prior.
    fresh = _worker("f")
    prior = _estimate(policy, fresh, KEYS, n).compute_s
    fresh.observe_load(LoadFigures(prefill_tokens_per_s=250.0))
    assert _estimate(policy, fresh, KEYS, n).compute_s == pytest.approx(prior)
    fresh.observe_load(LoadFigures(prefill_tokens_per_s=8000.0))
    assert fresh.prefill_rate.value > 1000.0
    assert _estimate(policy, fresh, KEYS, n).compute_s < prior
    fresh.observe_load(LoadFigures(prefill_tokens_per_s=0.0))   # 0.0: not measured
    assert fresh.prefill_rate.samples == 2


def test_estimate_follows_a_change_in_queue() -> None:
    rates = RateConfig(prefill_tokens_per_s=1000.0, prefill_overhead_s=0.02)
    w = _worker("a", rates=rates)
    for _ in range(10):
        w.observe_stats(_prefill(200, 0.02 + 200 / 1000))   # on the prior line: fit exact
    policy = PrefillPolicy("kv-aware", _index_with({"a": 0}))
    n = len(PROMPT)

    def queue_s() -> float:
        return _estimate(policy, w, KEYS, n).queue_s

    assert queue_s() == 0.0
    # This router books prefills there: their tokens and their overheads queue.
    first, second = w.assign(prefill_tokens=500), w.assign(prefill_tokens=100)
    assert queue_s() == pytest.approx(2 * 0.02 + 600 / 1000)
    first.prefill_done()
    assert queue_s() == pytest.approx(0.02 + 100 / 1000)
    # The worker reports 3 waiting (ours plus 2 from other routers, of unknown size: costed
    # at the mean measured prefill, 200 tokens).
    w.observe_load(LoadFigures(waiting=3))
    assert queue_s() == pytest.approx(0.02 + 100 / 1000 + 2 * (0.02 + 200 / 1000))
    second.release()
    w.observe_load(LoadFigures(waiting=0))
    assert queue_s() == 0.0 and w.pending_prefills == 0 and w.pending_prefill_tokens == 0


def test_one_stalled_prefill_does_not_starve_a_worker() -> None:
    # Seen in the chaos run: two equal prefill workers at 4 requests in flight; one 40-token
    # prefill took 0.6 s instead of ~0.02 s (a stall), its worker's line rose above the other's
    # estimate even with a request queued there, it was never chosen again, and so never
    # measured again. A stall is capped at MAX_JUMP x the prediction.
    a, b = _worker("a"), _worker("b")
    for _ in range(50):
        for w in (a, b):
            w.observe_stats(_prefill(40, 0.02))
    a.observe_stats(_prefill(40, 0.6))
    policy = PrefillPolicy("kv-aware", _index_with({"a": 0, "b": 0}))
    prompt = PROMPT[:40]
    keys = block_keys(NS, prompt, BS)
    booked = b.assign(prefill_tokens=40)                 # b is busy with one prefill
    chosen = policy.choose([a, b], keys, len(prompt))
    assert chosen is not None and chosen[0] is a
    booked.release()
    assert a.prefill_cost.seconds(40) < 1.5 * 0.02
    # A worker that really slowed down (10x) is still followed, stall cap or not.
    for _ in range(60):
        a.observe_stats(_prefill(40, 0.2))
    assert a.prefill_cost.seconds(40) == pytest.approx(0.2, rel=0.05)


def test_a_worker_joining_from_its_peers_costs_caps_a_stall_from_its_first_sample() -> None:
    # The chaos test's failure, reproduced by stalling the first model steps of prefill-0's
    # replacement (priced from its twin, peer_priors) by 0.4 s, as a cold process on a machine
    # busy starting it may be: uncapped (fewer than TRUSTED_SAMPLES samples), its one sample of
    # 0.42 s priced it at 0.38 s against ~6 ms, and it got 1 of the 648 prompts that followed.
    twin = _worker("twin")
    for _ in range(50):
        twin.observe_stats(_prefill(40, 0.005))
    new = _worker("new", rates=peer_priors(RATES, [twin]))
    for _ in range(3):   # stalls in a row do not compound in its young fit either
        new.observe_stats(_prefill(40, 0.4))
        assert new.prefill_cost.seconds(40) <= MAX_JUMP * twin.prefill_cost.seconds(40)
    for _ in range(10):  # and its own samples take over
        new.observe_stats(_prefill(40, 0.005))
    assert new.prefill_cost.seconds(40) == pytest.approx(twin.prefill_cost.seconds(40), rel=0.5)
    # Generic priors are no measurement: their first samples are not capped.
    cold = _worker("cold")
    cold.observe_stats(_prefill(40, 0.4))
    assert cold.prefill_cost.seconds(40) > 0.3


def test_an_idle_worker_priced_out_is_probed_and_comes_back() -> None:
    # b's fit is stalled (3 uncapped samples of 0.5 s): its estimate is far past a's, every
    # prompt went to a and b was never measured again. An idle worker holding as much of the
    # prompt as the choice, passed over PROBE_AFTER times running, gets the next one.
    a, b = _worker("a"), _worker("b")
    for _ in range(50):
        a.observe_stats(_prefill(40, 0.005))
    for _ in range(3):
        b.observe_stats(_prefill(40, 0.5))
    policy = PrefillPolicy("kv-aware", _index_with({"a": 0, "b": 0}))
    keys, n = block_keys(NS, PROMPT[:40], BS), 40
    chosen = [policy.choose([a, b], keys, n)[0].worker_id for _ in range(3 * (PROBE_AFTER + 1))]  # type: ignore[index]
    assert chosen == (["a"] * PROBE_AFTER + ["b"]) * 3
    # Its probes measure it: back at its real cost, it takes turns with a.
    for _ in range(20):
        b.observe_stats(_prefill(40, 0.005))
    assert [policy.choose([a, b], keys, n)[0].worker_id for _ in range(4)].count("b") == 2  # type: ignore[index]
    # A busy worker is not probed (it is working), nor one holding less of the prompt than
    # the choice (the prompt would move off the cache that holds it).
    policy = PrefillPolicy("kv-aware", _index_with({"a": 2, "b": 0}))
    keys = KEYS[:2]
    assert {policy.choose([a, b], keys, 40)[0].worker_id for _ in range(2 * PROBE_AFTER)} == {"a"}  # type: ignore[index]
    policy = PrefillPolicy("kv-aware", _index_with({"a": 0, "b": 0}))
    held = b.assign(prefill_tokens=40)
    keys = block_keys(NS, PROMPT[:40], BS)
    assert {policy.choose([a, b], keys, 40)[0].worker_id for _ in range(2 * PROBE_AFTER)} == {"a"}  # type: ignore[index]
    held.release()


# --- (3) the trade-off between a cached prefix and a queue -----------------------------------

def test_cached_prefix_worker_loses_exactly_when_its_queue_outweighs_the_prefix() -> None:
    # Both workers: 20 ms + n / 1000 s (the priors, and the samples on that line, so the fit
    # is exact). The prompt is 325 tokens; b holds 16 blocks (256 tokens) on device.
    #   a: 0.020 + 325 / 1000           = 0.345 s
    #   b: queue + 0.020 + 69 / 1000    = queue + 0.089 s
    # so b is slower once its queue is over 0.256 s, and loses once it is slower by more than
    # the near-tie slack (10% of a's 0.345 s: 0.0345 s), over 0.2905 s. One booked prefill of
    # k tokens queues 0.020 + k / 1000 s: b loses past k = 270. A waiting request of another
    # router's is costed at the mean measured size (200 tokens): 0.220 s, so one is fine, two
    # are not.
    rates = RateConfig(prefill_tokens_per_s=1000.0, prefill_overhead_s=0.02)
    a, b = _worker("a", rates=rates), _worker("b", rates=rates)
    for w in (a, b):
        for _ in range(10):
            w.observe_stats(_prefill(200, 0.02 + 200 / 1000))
    policy = PrefillPolicy("kv-aware", _index_with({"a": 0, "b": 16}))
    n = len(PROMPT)
    worker, est = policy.choose([a, b], KEYS, n)
    assert worker is b and est.device_hit_tokens == 256 and est.uncached_tokens == 69
    assert est.ttft_s == pytest.approx(0.089)
    assert _estimate(policy, a, KEYS, n).ttft_s == pytest.approx(0.345)
    for k, winner in ((265, b), (276, a)):
        booking = b.assign(prefill_tokens=k)
        assert policy.choose([a, b], KEYS, n)[0] is winner, k
        booking.release()
    for waiting, winner in ((1, b), (2, a)):
        b.observe_load(LoadFigures(waiting=waiting))
        assert policy.choose([a, b], KEYS, n)[0] is winner, waiting
    b.observe_load(LoadFigures())
    booking = b.assign(prefill_tokens=2000)
    booking.release()
    booking.release()  # idempotent
    assert b.pending_prefill_tokens == 0 and b.pending_prefills == 0 and b.inflight_requests == 0
    assert policy.choose([a, b], KEYS, n)[0] is b


# --- store hits, other policies, decode choice, auto mode -----------------------------------

def test_store_hits_cost_load_overhead_plus_tokens_at_the_load_rate() -> None:
    a = _worker("a")
    policy = PrefillPolicy("kv-aware", _index_with({"a": 4}))
    est = _estimate(policy, a, KEYS, len(PROMPT), store_blocks=20)
    assert est.device_hit_tokens == 4 * BS and est.store_hit_tokens == 16 * BS
    assert est.uncached_tokens == 5
    assert est.load_s == pytest.approx(RATES.load_overhead_s + 16 * BS / 10_000.0)
    assert _estimate(policy, a, KEYS, len(PROMPT)).load_s == 0.0  # no store hit, no cost
    # Learned like the prefill cost, from finished requests' store loads.
    for _ in range(30):
        for s in (64, 512, 2048):
            a.observe_stats(RequestStats(store_hit_tokens=s, store_load_s=0.005 + s / 100_000))
    est = _estimate(policy, a, KEYS, len(PROMPT), store_blocks=20)
    assert est.load_s == pytest.approx(0.005 + 16 * BS / 100_000, rel=0.05)
    # A fully cached prompt still computes its last token.
    full = list(range(2 * BS))
    est = _estimate(policy, a, block_keys(NS, full, BS), len(full), store_blocks=2)
    assert est.uncached_tokens == 1


def test_least_loaded_and_round_robin() -> None:
    a, b, c = _worker("a"), _worker("b"), _worker("c")
    index = _index_with({"a": 20, "b": 0, "c": 0})
    a.observe_load(LoadFigures(waiting=3, running=2))
    b.assign()
    assert PrefillPolicy("least-loaded", index).choose([a, b, c], KEYS, len(PROMPT))[0] is c
    rr = PrefillPolicy("round-robin", index)
    assert [rr.choose([c, a, b], KEYS, 1)[0].worker_id for _ in range(4)] == ["a", "b", "c", "a"]
    assert rr.choose([c], KEYS, 1)[0] is c                 # one candidate: the rotation stays
    assert [rr.choose([c, a, b], KEYS, 1)[0].worker_id for _ in range(2)] == ["b", "c"]
    assert rr.choose([], KEYS, 1) is None
    with pytest.raises(ValueError, match="unknown prefill policy"):
        PrefillPolicy("random", index)  # type: ignore[arg-type]


def test_decode_choice_needs_free_blocks_then_least_load() -> None:
    small, big, busy = _worker("small", "decode", 10), _worker("big", "decode", 100), _worker("busy", "decode", 100)
    busy.observe_load(LoadFigures(running=5, kv_free_blocks=90, kv_total_blocks=100))
    assert blocks_needed(100, 100, BS) == 13
    handles = [_handle(w) for w in (small, big, busy)]
    assert choose_decode(handles, 100, 100).load is big
    big.assign(blocks=95)  # this router already promised most of big
    assert choose_decode(handles, 100, 100).load is busy
    assert choose_decode(handles, 100, 10_000) is None
    assert choose_decode(handles[:1], 50, 50).load is small


def test_colocated_balance_leaves_out_the_piled_up_prefix_holder() -> None:
    """The kv-aware choice alone sends every request to the worker caching the shared prefix,
    however many decodes it runs; the balance guard leaves it out once it is loaded past
    both thresholds, and the policy then chooses among the rest."""
    hot, cold1, cold2 = _worker("hot", "colocated"), _worker("cold1", "colocated"), _worker("cold2", "colocated")
    policy = PrefillPolicy("kv-aware", _index_with({"hot": 20}))
    handles = [_handle(w) for w in (hot, cold1, cold2)]
    cold1.observe_load(LoadFigures(running=10))
    cold2.observe_load(LoadFigures(running=12))
    balance = Balance(abs_requests=8, rel=1.5)

    def chosen() -> str:
        fitting = balance.within(handles)
        return policy.choose([h.load for h in fitting], KEYS, len(PROMPT))[0].worker_id

    hot.observe_load(LoadFigures(running=18))      # 10 + 8: still inside the absolute slack
    assert chosen() == "hot"
    hot.observe_load(LoadFigures(running=19))      # past 10 + 8 and past 1.5 x 10
    assert policy.choose([h.load for h in handles], KEYS, len(PROMPT))[0].worker_id == "hot"
    assert chosen() == "cold1"                     # the less loaded of the rest (equal estimates)
    # The relative threshold: at high loads a worker within 1.5x of the least stays in.
    for w, n in ((cold1, 100), (cold2, 100), (hot, 150)):
        w.observe_load(LoadFigures(running=n))
    assert chosen() == "hot"
    hot.observe_load(LoadFigures(running=151))
    assert chosen() == "cold1"
    # This router's own bookings count as load before the worker reports them.
    for w in (hot, cold1, cold2):
        w.observe_load(LoadFigures())
    for _ in range(9):
        hot.assign(prefill_tokens=10)
    assert [h.worker_id for h in balance.within(handles)] == ["cold1", "cold2"]
    assert Balance(abs_requests=10_000).within(handles) == handles  # off
    assert Balance(abs_requests=0, rel=1.0).within(handles[1:]) == handles[1:]  # a tie keeps both
    with pytest.raises(ValueError, match="rel must be >= 1"):
        Balance(rel=0.5)


def _handle(load: WorkerLoad) -> WorkerHandle:
    return WorkerHandle(load.info, client=None, load=load, events_task=None)  # type: ignore[arg-type]


def test_auto_mode_threshold() -> None:
    a = _worker("a", "colocated")
    policy = PrefillPolicy("kv-aware", _index_with({"a": 20}))
    est = _estimate(policy, a, KEYS, len(PROMPT))
    assert prefer_local(est, threshold_tokens=64)
    est = _estimate(policy, a, KEYS[:1], 10 * BS + 7)
    assert not prefer_local(est, threshold_tokens=64)
