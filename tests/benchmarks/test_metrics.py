"""Statistics of the serving benchmark against hand-computed cases."""

from __future__ import annotations

import pytest

from planner.metrics import (
    RequestResult,
    Slo,
    attainment_at_scales,
    distribution,
    percentile,
    summarize,
    summarize_by_tag,
)


def req(rid: str, ttft: float | None, tpot: float, out: int, error: str | None = None, tag: str = "",
        prompt: int = 100) -> RequestResult:
    e2e = None if ttft is None else ttft + tpot * (out - 1)
    return RequestResult(rid, tag, prompt, out, ttft_s=ttft, e2e_s=e2e, output_tokens=out,
                         itl_s=[tpot] * (out - 1) if ttft is not None else [], error=error)


def test_percentiles_interpolate_linearly():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(11)), 90) == 9.0
    assert percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) is None
    d = distribution([4, None, 1, 3, 2])
    assert (d.n, d.mean, d.p50, d.max) == (4, 2.5, 2.5, 4)
    assert distribution([None]) is None


def test_tpot_is_mean_time_per_token_after_the_first():
    r = RequestResult("a", ttft_s=0.2, e2e_s=1.1, output_tokens=10)
    assert r.tpot_s == pytest.approx(0.1)
    assert RequestResult("b", ttft_s=0.2, e2e_s=0.2, output_tokens=1).tpot_s is None
    assert RequestResult("c", ttft_s=0.2, e2e_s=1.0, output_tokens=5, error="HTTP 500").tpot_s is None


RESULTS = [
    req("a", 0.10, 0.05, 10),            # meets (0.2, 0.06)
    req("b", 0.30, 0.05, 10),            # TTFT too slow
    req("c", 0.10, 0.08, 10),            # TPOT too slow
    req("d", 0.15, 0.0, 1),              # one token: no TPOT, meets
    req("e", None, 0.0, 0, error="HTTP 500"),
]


def test_goodput_counts_requests_meeting_both_objectives():
    s = summarize(RESULTS, duration_s=2.0, slo=Slo(0.2, 0.06))
    assert (s.issued, s.completed, s.failed, s.good) == (5, 4, 1, 2)
    assert s.goodput == pytest.approx(1.0)
    assert s.attainment == pytest.approx(0.4)
    assert s.request_throughput == pytest.approx(2.0)
    assert s.output_throughput == pytest.approx(31 / 2.0)
    assert s.total_token_throughput == pytest.approx((31 + 400) / 2.0)
    assert s.ttft_s.p50 == pytest.approx(0.125)
    assert s.ttft_s.mean == pytest.approx(0.1625)
    assert s.tpot_s.n == 3 and s.tpot_s.max == pytest.approx(0.08)
    assert s.itl_s.n == 27


def test_send_lag_and_cached_fraction():
    a = RequestResult("a", prompt_tokens=100, scheduled_s=1.0, sent_s=1.25, ttft_s=0.1, e2e_s=0.2,
                      output_tokens=2, cached_tokens=64)
    b = RequestResult("b", prompt_tokens=300, scheduled_s=2.0, sent_s=2.05, ttft_s=0.1, e2e_s=0.2,
                      output_tokens=2, cached_tokens=0)
    c = RequestResult("c", prompt_tokens=500, ttft_s=0.1, e2e_s=0.2, output_tokens=2)  # reports nothing
    s = summarize([a, b, c], 1.0)
    assert s.cached_fraction == pytest.approx(64 / 400)
    assert s.send_lag_s.max == pytest.approx(0.25) and s.send_lag_s.p50 == pytest.approx(0.05)
    assert summarize([c], 1.0).cached_fraction is None


def test_no_objectives_no_goodput():
    s = summarize(RESULTS, duration_s=2.0)
    assert s.goodput is None and s.attainment is None and s.good is None


def test_attainment_against_slo_scale():
    att = attainment_at_scales(RESULTS, Slo(0.2, 0.06), [0.5, 1.0, 2.0])
    assert att == pytest.approx([0.0, 0.4, 0.8])  # a failed request never attains
    assert attainment_at_scales([], Slo(1, 1), [1.0]) == [0.0]


def test_summary_by_tag_and_validation():
    tagged = [req("s1", 0.1, 0.01, 5, tag="short"), req("l1", 1.0, 0.01, 2, tag="long")]
    by = summarize_by_tag(tagged, 1.0, Slo(0.5, 0.1))
    assert set(by) == {"long", "short"}
    assert by["short"].good == 1 and by["long"].good == 0
    with pytest.raises(ValueError):
        Slo(0.0, 0.1)
    with pytest.raises(ValueError):
        summarize(tagged, 0.0)


def test_per_length_ttft_objective_is_a_line_through_the_reference():
    slo = Slo(1.0, 0.1, ttft_per_token_s=0.002, ref_prompt_tokens=100)
    assert slo.ttft_objective(100) == pytest.approx(1.0)
    assert slo.ttft_objective(600) == pytest.approx(2.0)
    assert slo.ttft_objective(0) == pytest.approx(0.8)
    assert slo.met(req("long", 1.9, 0.05, 4, prompt=600))       # 1.9 s allowed for 600 tokens
    assert not slo.met(req("short", 0.9, 0.05, 4, prompt=10))   # but not for 10 (0.82 s)
    assert slo.scaled(2).ttft_objective(600) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="0-token"):
        Slo(1.0, 0.1, ttft_per_token_s=0.02, ref_prompt_tokens=100)


def test_unloaded_probes_give_per_length_objectives():
    from planner.metrics import Unloaded

    u = Unloaded(100, 16, ttft_s=0.4, tpot_s=0.05, samples=3, long_prompt_tokens=1100, long_ttft_s=2.4)
    slo = u.slo(5, 2)  # unloaded TTFT(n) = 0.2 + 0.002 n; objective 5x that at every length
    assert slo.ttft_objective(100) == pytest.approx(2.0)
    assert slo.ttft_objective(1100) == pytest.approx(12.0)
    assert slo.tpot_s == pytest.approx(0.1)
    # a fit whose intercept falls under one decode step is held at one decode step
    flat = Unloaded(100, 16, ttft_s=0.1, tpot_s=0.05, samples=3, long_prompt_tokens=200, long_ttft_s=0.4)
    assert flat.slo(5, 2).ttft_objective(0) == pytest.approx(5 * 0.05)
    assert Unloaded(100, 16, 0.4, 0.05, 3).slo(5, 2) == Slo(2.0, 0.1)
