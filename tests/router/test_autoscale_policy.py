"""The scaling arithmetic without processes: per-pool signals from real ``WorkerLoad`` books,
the desired-count state machine driven by a fake clock (its hysteresis under a load that
hovers at a threshold, against the same load without hysteresis, which flaps), the recent
window, and the layout/actions rule of ``kvrouter up --autoscale``."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine.api.events import LoadFigures
from engine.api.generate import WorkerInfo
from kvstore.keys import BlockKey
from router.metrics import RecentWindow
from router.scaling.plan import Action, Layout, WorkerState, actions, fit_budget
from router.scaling.policy import Planner, PoolPolicy, ScalingConfig, pressures
from router.scaling.signals import PoolSignals, pool_signals
from router.workers.load import WorkerLoad

NS = BlockKey(bytes(16))


def _load(wid: str, role: str, *, queued: int = 0, waiting: int = 0, running: int = 0,
          free: int = 100, total: int = 100, draining: bool = False) -> WorkerLoad:
    info = WorkerInfo(wid, f"http://127.0.0.1:1/{wid}", role, "m", NS, 16, total, 2048,  # type: ignore[arg-type]
                      draining=draining)
    w = WorkerLoad(info)
    w.observe_load(LoadFigures(waiting=waiting, running=running, kv_free_blocks=free, kv_total_blocks=total))
    if queued:
        w.assign(prefill_tokens=queued)
    return w


def _signals(pre_n: int, dec_n: int, *, ttft: float = 0.0, itl: float | None = None,
             kv: float = 0.0, dec_ttft: float = 0.0, pre_busy: float | None = None,
             dec_busy: float | None = None) -> dict:
    def s(pool, n, t, i, k, busy):
        return PoolSignals(pool, n, 0, 0.0, 1.0, t, k, i, 0, 0, prefill_busy=busy)
    return {"prefill": s("prefill", pre_n, ttft, None, 0.0, pre_busy),
            "decode": s("decode", dec_n, dec_ttft, itl, kv, dec_busy)}


# --- signals ---------------------------------------------------------------------------------

def test_pool_signals_from_the_books() -> None:
    a = _load("p0", "prefill", queued=2000)                 # admitted: computing its prompt
    b = _load("p1", "prefill", queued=500, waiting=1)       # booked, but waiting for room
    d = _load("d0", "decode", running=3, free=25, total=100)
    c = _load("c0", "colocated", free=75, total=100)
    leaving = _load("d1", "decode", draining=True, free=0)
    s = pool_signals([a, b, d, c, leaving], itl_s=0.2)
    pre, dec = s["prefill"], s["decode"]
    assert (pre.workers, pre.draining, dec.workers, dec.draining) == (2, 0, 2, 1)
    # Nothing measured yet: each worker's rate is the prior (2000 tok/s), so the pool's is 4000;
    # p1's one waiting request is this router's booking, not another's.
    assert pre.queued_prompt_tokens == 2500 and pre.prefill_tokens_per_s == pytest.approx(4000)
    typical = a.prefill_cost.seconds(a.rates.pivot_tokens)
    assert pre.predicted_ttft_s == pytest.approx(2500 / 4000 + typical)
    assert pre.itl_s is None and dec.itl_s == 0.2
    assert dec.kv_utilization == pytest.approx((75 + 25) / 200)    # the draining worker not counted
    assert dec.running == 3 and (pre.prefilling, dec.prefilling) == (1, 0)


def test_requests_another_router_queued_count_at_the_mean_prompt() -> None:
    w = _load("p0", "prefill", waiting=3)          # none of them booked by this router
    for _ in range(10):
        w.observe_stats(_stats(500, 0.25))
    s = pool_signals([w], None)["prefill"]
    assert s.queued_prompt_tokens == pytest.approx(3 * w.prefill_cost.mean_tokens)


def _stats(tokens: int, seconds: float):
    from engine.api.generate import RequestStats
    return RequestStats(computed_prompt_tokens=tokens, prefill_s=seconds)


def test_recent_window_keeps_the_last_seconds_only() -> None:
    now = [100.0]
    w = RecentWindow(horizon_s=60, clock=lambda: now[0])
    for x in (1.0, 3.0):
        w.add(x)
    now[0] = 110.0
    w.add(5.0)
    assert w.mean(20) == pytest.approx(3.0) and w.mean(5) == pytest.approx(5.0)
    now[0] = 200.0
    assert w.mean(20) is None and w.stats(1000) == (3, 9.0)
    w.add(7.0)
    assert w.stats(1000) == (1, 7.0)                           # older buckets left the 60 s horizon


# --- the state machine --------------------------------------------------------------------

def test_more_only_after_the_pressure_stood_up_for_and_then_a_cooldown() -> None:
    cfg = ScalingConfig(up_for_s=10, down_for_s=30, cooldown_s=30)
    p = PoolPolicy("decode", cfg, min_workers=1)
    assert p.step(0, 1, 0.5).desired == 1
    for t in range(1, 11):
        d = p.step(t, 1, 1.4)
        assert d.desired == 1 or t == 11, t
    d = p.step(11, 1, 1.4)
    assert (d.desired, d.state) == (2, "changed")
    # Still 1 worker (the launcher has not acted): the same proposal is steady, no more is asked.
    assert p.step(12, 1, 1.4).desired == 2
    # The pool grows: a cool-down starts, so an even higher pressure moves nothing for 30 s.
    for t in range(13, 43):
        assert p.step(t, 2, 2.0).desired == 2
    assert "waiting up" in p.step(44, 2, 2.0).state
    assert p.step(55, 2, 2.0).desired == 4                     # ceil(2 x 2.0)
    # A worker of the pool dies: the desired count is what is left, until the signals say more.
    d = p.step(60, 1, 0.7)
    assert (d.desired, d.state) == (1, "cooldown 30.0 s")


def test_fewer_needs_the_pool_well_below_the_objective_without_one_worker() -> None:
    cfg = ScalingConfig(up_for_s=10, down_for_s=30, cooldown_s=0)
    p = PoolPolicy("decode", cfg, min_workers=1)
    for t in range(0, 100):
        assert p.step(t, 2, 0.45).desired == 2                 # 0.45 x 2 / 1 = 0.9 > 0.6
    for t in range(100, 130):
        assert p.step(t, 2, 0.29).desired == 2                 # 0.58 <= 0.6, waiting 30 s
    assert p.step(130, 2, 0.29).desired == 1
    assert p.step(500, 1, 0.0).desired == 1                    # never below min_workers


def _hovering_run(cfg: ScalingConfig, seconds: int = 1800, seed: int = 3) -> list[int]:
    """A closed loop: a load of ~1 worker's worth hovering at the scale-up threshold
    (+-6%, noisy, crossing it every few seconds), a pool whose pressure is load / workers, a
    launcher that applies a new desired count 15 s later. The desired count over time."""
    rng = np.random.default_rng(seed)
    p = PoolPolicy("decode", cfg, min_workers=1)
    workers, pending, history = 1, None, []
    for t in range(seconds):
        load = 1.0 + 0.06 * math.sin(t / 7.0) + rng.normal(0, 0.03)
        d = p.step(float(t), workers, load / workers)
        history.append(d.desired)
        if d.desired != workers and pending is None:
            pending = (t + 15, d.desired)
        if pending is not None and t >= pending[0]:
            workers, pending = pending[1], None
    return history


def _changes(history: list[int]) -> int:
    return sum(a != b for a, b in zip(history, history[1:]))


def test_hysteresis_holds_under_a_load_hovering_at_the_threshold() -> None:
    history = _hovering_run(ScalingConfig())
    assert _changes(history) <= 1, history      # at most the one step up, never back and forth
    assert history == sorted(history)


def test_without_hysteresis_the_same_load_flaps() -> None:
    # The control: no band, no sustain times, no cool-down. The same load then moves the
    # count back and forth, which is what the test above rules out.
    flappy = ScalingConfig(down_ratio=0.99, up_for_s=0, down_for_s=0, cooldown_s=0)
    assert _changes(_hovering_run(flappy)) >= 10


def test_a_threshold_crossed_for_less_than_up_for_never_scales() -> None:
    p = PoolPolicy("decode", ScalingConfig(up_for_s=10), min_workers=1)
    for t in range(600):
        pressure = 1.05 if (t // 8) % 2 else 0.95      # 8 s above, 8 s below, for 10 minutes
        assert p.step(float(t), 1, pressure).desired == 1


def test_the_colocated_state_and_back() -> None:
    cfg = ScalingConfig(up_for_s=5, down_for_s=20, cooldown_s=10, ttft_target_s=2.0, itl_target_s=0.1)
    plan = Planner(cfg, colocated_ok=True)
    # A lone prefill worker, idle (TTFT 0.4 s of 2 s): after 20 s it is not wanted any more.
    out = {}
    for t in range(21):
        out = plan.evaluate(float(t), _signals(1, 1, ttft=0.4, itl=0.05))
    assert out["prefill"].desired == 0 and out["decode"].desired == 1
    # Colocated now; the decode workers' own prefills put its TTFT over 2 s: a prefill worker again
    # (after the cool-down the change of count started, and 5 s standing).
    for t in range(21, 60):
        out = plan.evaluate(float(t), _signals(0, 2, dec_ttft=3.0, itl=0.05))
    assert out["prefill"].desired == 1
    # Colocated, TTFT fine, but prefill takes 45% of the decode workers' time (share objective
    # 30%) and their ITL is 3x its objective: the stalls are the cause, so a prefill pool of its
    # own is wanted. The same share while the decodes keep their objective is no reason to split.
    plan = Planner(cfg, colocated_ok=True)
    for t in range(60):
        out = plan.evaluate(float(t), _signals(0, 2, dec_ttft=0.5, itl=0.3, dec_busy=0.45))
    assert out["prefill"].desired == 1 and out["prefill"].pressure == pytest.approx(1.5)
    plan = Planner(cfg, colocated_ok=True)
    for t in range(60):
        out = plan.evaluate(float(t), _signals(0, 2, dec_ttft=0.5, itl=0.08, dec_busy=0.45))
    assert out["prefill"].desired == 0 and out["prefill"].pressure == pytest.approx(0.8)
    # Split and idle by TTFT, but the prefill worker is busy 80% of the time: merged, the two
    # would spend 40% prefilling, over 0.6 x 30%: no going back to colocated.
    plan = Planner(cfg, colocated_ok=True)
    for t in range(100):
        out = plan.evaluate(float(t), _signals(1, 1, ttft=0.4, itl=0.05, pre_busy=0.8, dec_busy=0.0))
    assert out["prefill"].desired == 1
    # Disaggregated mode never goes colocated.
    strict = Planner(cfg, colocated_ok=False)
    for t in range(100):
        out = strict.evaluate(float(t), _signals(1, 1, ttft=0.1, itl=0.05))
    assert out["prefill"].desired == 1


def test_pressures() -> None:
    cfg = ScalingConfig(ttft_target_s=2.0, itl_target_s=0.1, kv_target=0.8)
    p = pressures(_signals(1, 1, ttft=3.0, itl=0.05, kv=0.6), cfg)
    assert p == {"prefill": pytest.approx(1.5), "decode": pytest.approx(0.75)}
    assert pressures(_signals(0, 2, dec_ttft=1.0, itl=None), cfg)["prefill"] == pytest.approx(0.5)
    assert pressures(_signals(0, 2, dec_ttft=1.0, dec_busy=0.6, itl=0.3), cfg)["prefill"] == pytest.approx(2.0)
    assert pressures(_signals(0, 2, dec_ttft=1.0, dec_busy=0.6, itl=0.12), cfg)["prefill"] == pytest.approx(1.2)


def test_config_refuses_a_band_that_is_not_one() -> None:
    with pytest.raises(ValueError, match="hysteresis band"):
        ScalingConfig(down_ratio=1.0)


# --- the layout within a budget, and the steps to it -------------------------------------

def test_fit_budget() -> None:
    pr = {"prefill": 0.5, "decode": 2.0}
    assert fit_budget(Layout(1, 1), {"prefill": 0, "decode": 2}, pr, 2) == Layout(0, 2)
    # Over budget from the colocated state: the split first, decode gets the rest, when prefill's
    # share of the workers' time explains the decodes' stalls (the colocated prefill pressure
    # then reaches the decode pressure) ...
    stalls = {"prefill": 2.0, "decode": 2.0}
    assert fit_budget(Layout(0, 2), {"prefill": 1, "decode": 3}, stalls, 2) == Layout(1, 1)
    # ... but not when the decodes are the more short: over capacity for decodes, a split would
    # take a decode worker away (autoscale_bench: split 19 s into the decode-heavy half).
    assert fit_budget(Layout(0, 2), {"prefill": 1, "decode": 3}, {"prefill": 1.2, "decode": 1.6}, 2) == Layout(0, 2)
    # Over budget otherwise: nobody loses what it still wants; the rest to the higher pressure.
    assert fit_budget(Layout(1, 1), {"prefill": 2, "decode": 2}, pr, 3) == Layout(1, 2)
    assert fit_budget(Layout(1, 1), {"prefill": 2, "decode": 2}, {"prefill": 3.0, "decode": 1.1}, 3) == Layout(2, 1)
    # A decode worker always; a prefill worker when colocation is not allowed.
    assert fit_budget(Layout(1, 1), {"prefill": 0, "decode": 0}, pr, 4, min_prefill=1) == Layout(1, 1)


def test_actions_change_roles_first_then_stop_or_start() -> None:
    ws = [WorkerState("w0", "prefill", 0), WorkerState("w1", "decode", 5), WorkerState("w2", "decode", 1)]
    assert actions(ws, Layout(2, 1)) == [Action("role", "prefill", "w2")]      # the least loaded
    assert actions(ws, Layout(0, 3)) == [Action("role", "decode", "w0")]
    assert actions(ws, Layout(0, 2)) == [Action("stop", "prefill", "w0")]     # no change needed
    assert actions(ws, Layout(2, 2)) == [Action("start", "prefill")]
    assert actions(ws, Layout(1, 2)) == []
    assert str(Layout(0, 2)) == "colocated x2" and str(Layout(1, 2)) == "1P+2D"
