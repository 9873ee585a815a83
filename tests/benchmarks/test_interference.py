"""``benchmarks.serving.interference_bench``: its arithmetic (ITL from token times, percentiles, ratios,
the excess cut, the met flags), and one ``--quick`` run on the tiny model against a real
``kvstore serve`` on this host."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.serving import interference_bench as ib
from benchmarks.serving import interference_figures as fig

REPO = Path(__file__).resolve().parents[2]


def test_itl_is_each_streams_gaps_between_consecutive_tokens():
    times = {"a": [0.0, 0.1, 0.25, 0.3], "b": [0.0, 0.1, 0.25], "c": [1.0]}
    assert fig.stream_gaps(times) == pytest.approx([0.1, 0.15, 0.05, 0.1, 0.15])
    # a step that computed an arrival ends gaps in every stream; skipping it drops them all
    assert fig.stream_gaps(times, {0.25}) == pytest.approx([0.1, 0.05, 0.1])
    assert fig.stream_gaps({}) == []


@pytest.mark.parametrize("q", [0, 10, 50, 90, 99, 100])
def test_percentile_is_numpys_linear_one(q):
    xs = list(np.random.default_rng(3).exponential(size=37))
    assert fig.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert fig.percentile([5.0], q) == 5.0


def test_percentile_of_nothing_fails():
    with pytest.raises(ValueError):
        fig.percentile([], 50)


def test_run_figures_in_ms_with_the_in_flight_share():
    gaps = [0.01] * 98 + [0.05, 0.1]
    f = fig.run_figures(gaps, gaps[:98], [0.01] * 50, ttfts=[0.2, 0.4], window_s=2.0, load_s=0.5)
    assert f["p50_itl_ms"] == 10.0 and f["p99_itl_ms"] == pytest.approx(50.5)
    assert f["decode_p99_itl_ms"] == 10.0 and f["decode_gaps"] == 98 and f["gaps"] == 100
    assert f["step_ms"] == 10.0 and f["steps"] == 50
    assert f["ttft_ms"] == pytest.approx(300.0)
    assert f["inflight_frac"] == pytest.approx(0.3) and f["load_frac"] == pytest.approx(0.25)


def test_excess_cut():
    assert fig.excess_cut(1.5, 1.1) == pytest.approx(0.8)
    assert fig.excess_cut(2.0, 1.0) == pytest.approx(1.0)
    assert fig.excess_cut(1.2, 0.9) == pytest.approx(1.5)   # the new path beat the baseline
    assert fig.excess_cut(1.2, 1.5) == pytest.approx(-1.5)  # ... or made it worse
    assert fig.excess_cut(1.0, 1.1) is None and fig.excess_cut(0.9, 1.0) is None


def _run(p50: float, p99: float, ttft: float | None, step: float = 50.0,
         inflight: float = 0.3) -> dict:
    return {"p50_itl_ms": p50, "p99_itl_ms": p99, "decode_p50_itl_ms": p50,
            "decode_p99_itl_ms": p99 * 0.9, "ttft_ms": ttft, "step_ms": step,
            "inflight_frac": inflight}


def test_compare_against_the_baseline_of_the_same_run():
    c = fig.compare(_run(50, 100, 80), _run(55, 200, 300), _run(51, 110, 320))
    assert c["old_p99_itl_ratio"] == 2.0 and c["new_p99_itl_ratio"] == 1.1
    assert c["old_p50_itl_ratio"] == 1.1 and c["new_p50_itl_ratio"] == 1.02
    assert c["excess_old"] == 1.0 and c["excess_new"] == pytest.approx(0.1)
    assert c["excess_cut"] == pytest.approx(0.9)
    assert c["old_decode_p99_itl_ratio"] == 2.0 and c["decode_excess_cut"] == pytest.approx(0.9)
    assert c["ttft_old_ms"] == 300 and c["ttft_new_ms"] == 320
    assert c["ttft_extra_steps"] == pytest.approx(0.4)   # 20 ms over a 50 ms baseline step


def test_summary_targets_and_met_flags():
    runs = {
        "shm": {"n4": {"baseline": _run(50, 100, 80), "old": _run(55, 200, 300),
                       "new": _run(51, 110, 320)},                    # 1.10 <= 1.15, cut 0.9
                "n16": {"baseline": _run(50, 100, 80), "old": _run(55, 200, 300),
                        "new": _run(51, 120, 400)}},                  # 1.20 > 1.15, cut 0.8, +2 steps
        "tcp": {"n4": {"baseline": _run(50, 100, 80), "old": _run(55, 150, 300),
                       "new": _run(51, 125, 300)},                    # 1.25 <= 1.3, cut 0.5
                "n16": {"baseline": _run(50, 100, 80), "old": _run(50, 95, 300),
                        "new": _run(51, 99, 300)}},                   # no old excess, none new
    }
    s = fig.summarize(runs)
    assert s["before"]["shm"]["n4"]["p99_itl_ratio"] == 2.0
    assert s["after"]["shm"]["n4"]["p99_itl_ratio"] == 1.1
    assert s["after"]["tcp"]["n16"]["inflight_frac"] == 0.3
    assert s["targets"] == {"shm_p99_itl_ratio_max": 1.15, "tcp_p99_itl_ratio_max": 1.3,
                            "excess_cut_min": 0.7, "ttft_extra_steps_max": 1.0}
    assert s["met"] == {
        "shm.n4.p99_itl_ratio": True, "shm.n4.excess_cut": True, "shm.n4.ttft_extra_steps": True,
        "shm.n16.p99_itl_ratio": False, "shm.n16.excess_cut": True, "shm.n16.ttft_extra_steps": False,
        "tcp.n4.p99_itl_ratio": True, "tcp.n4.excess_cut": False, "tcp.n4.ttft_extra_steps": True,
        "tcp.n16.p99_itl_ratio": True, "tcp.n16.excess_cut": True, "tcp.n16.ttft_extra_steps": True,
    }
    assert s["all_met"] is False
    # the decode-only p99s are 0.9x the plain ones in every run here: the same ratios and flags
    assert s["met_decode_only"] == {k.replace(".p99", ".decode_p99").replace(".excess", ".decode_excess"): v
                                    for k, v in s["met"].items() if "ttft" not in k}
    assert s["compare"]["tcp"]["n16"]["excess_cut"] is None


def test_segments_interleave_the_three_runs_in_rotating_order():
    order = fig.segment_order(4)
    assert order[:3] == ["baseline", "old", "new"] and order[3:6] == ["old", "new", "baseline"]
    assert order[6:9] == ["new", "baseline", "old"] and order[9:] == ["baseline", "old", "new"]
    assert all(order.count(m) == 4 for m in fig.MODES)


def test_odd_arrivals_are_refused():
    args = ib.build_parser().parse_args(["--quick", "--arrivals", "3"])
    with pytest.raises(SystemExit):
        ib.run(args)


@pytest.mark.integration
def test_quick_run_loads_from_the_store_in_old_and_new_and_hits_the_device_in_baseline(tmp_path):
    r = subprocess.run([sys.executable, "-m", "benchmarks.serving.interference_bench", "--quick",
                        "--out", str(tmp_path), "--no-progress"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    (line,) = r.stdout.strip().splitlines()
    res = json.loads(line)
    assert res["bench"] == "interference" and res["quick"] is True and res["ns"] == [4]
    assert json.loads((tmp_path / "interference.json").read_text()) == res
    assert (tmp_path / "interference.png").stat().st_size > 0
    for when in ("before", "after"):
        assert set(res[when]) == {"shm"} and res[when]["shm"]["n4"]["p99_itl_ratio"] > 0
    assert res["stores"]["shm"]["transport"] == "shm"
    assert res["stores"]["shm"]["preemptions"] == 0 and res["stores"]["shm"]["abandoned_loads"] == 0
    runs = res["runs"]["shm"]["n4"]
    assert set(runs) == {"baseline", "old", "new"}
    for mode, run in runs.items():
        assert run["arrivals"] == 6, mode
        assert run["gaps"] > 0 and run["decode_gaps"] > 0 and run["p99_itl_ms"] > 0
        assert 0 < run["inflight_frac"] < 1.5 and run["ttft_ms"] > 0
    assert runs["baseline"]["device_hits"] == 6 and runs["baseline"]["store_hits"] == 0
    assert runs["baseline"]["load_frac"] == 0
    for mode in ("old", "new"):
        assert runs[mode]["store_hits"] == 6 and runs[mode]["device_hits"] == 0, mode
        assert runs[mode]["load_frac"] > 0 and runs[mode]["load_ms"] > 0
    c = res["compare"]["shm"]["n4"]
    for key in ("old_p99_itl_ratio", "new_p99_itl_ratio", "old_p50_itl_ratio", "new_p50_itl_ratio",
                "excess_old", "excess_new", "ttft_old_ms", "ttft_new_ms", "ttft_extra_steps"):
        assert isinstance(c[key], float), key
    assert set(res["met"]) == {"shm.n4.p99_itl_ratio", "shm.n4.excess_cut", "shm.n4.ttft_extra_steps"}
    assert set(res["met_decode_only"]) == {"shm.n4.decode_p99_itl_ratio", "shm.n4.decode_excess_cut"}
    assert res["all_met"] == all(res["met"].values())

    # --report re-prints (and re-plots) a saved run without running anything
    rep = subprocess.run([sys.executable, "-m", "benchmarks.serving.interference_bench", "--report",
                          str(tmp_path / "interference.json"), "--out", str(tmp_path / "again")],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert rep.returncode == 0, rep.stderr[-3000:]
    assert json.loads(rep.stdout.strip().splitlines()[-1])["compare"] == res["compare"]
    assert (tmp_path / "again" / "interference.png").stat().st_size > 0
    assert "| shm | 4 |" in rep.stderr
