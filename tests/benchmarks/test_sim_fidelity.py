"""The fidelity report's arithmetic: verdicts against repeats, the objectives compare fixed
taken back out of a sweep's argv, the table."""

from __future__ import annotations

import pytest

from benchmarks.planner import sim_fidelity as fid


def test_a_prediction_is_ok_within_15_percent_or_inside_the_repeats_spread() -> None:
    assert fid.judge(1.1, [1.0, 1.02, 0.98])["verdict"] == "ok"          # +10%
    assert fid.judge(1.3, [1.0, 1.02, 0.98])["verdict"] == "off"         # +30%, spread 4%
    wide = fid.judge(1.5, [1.0, 1.6, 0.9])                                # +50%, inside min-max
    assert wide["verdict"] == "ok" and wide["error"] == pytest.approx(0.5)
    assert fid.judge(None, [1.0])["verdict"] == "n/a" and fid.judge(1.0, [])["verdict"] == "n/a"


def test_the_objectives_compare_fixed_are_stripped_from_the_sweep_flags() -> None:
    argv = ["--workload", "mixed", "--rates", "0.4", "--ttft-slo-ms", "1094.7", "--tpot-slo-ms", "122.8",
            "--ttft-slo-per-token-ms", "0.000000", "--ttft-slo-ref-tokens", "0", "--salt-per-request"]
    assert fid._strip_objectives(argv) == ["--workload", "mixed", "--rates", "0.4", "--salt-per-request"]
    assert fid._rate_step([0.1, 0.3, 0.5]) == pytest.approx(0.2) and fid._rate_step([0.4]) == 0.0


def test_each_runs_own_simulation_combines_into_the_median_prediction() -> None:
    def rec(ttft: float, tpot: float | None, att: float, tested: float | None) -> dict:
        summary = {"ttft_s": {"p50": ttft, "p90": 2 * ttft},
                   "tpot_s": None if tpot is None else {"p50": tpot, "p90": tpot}, "attainment": att}
        return {"slo": {"first": ttft}, "points": [{"rate": 0.2, "summary": summary}],
                "max_rate_90": {"tested": tested, "interpolated": tested}}

    one = rec(1.0, 0.1, 1.0, 0.2)
    assert fid.combine([one]) is one
    got = fid.combine([rec(1.0, 0.1, 1.0, 0.2), rec(3.0, 0.3, 0.5, None), rec(2.0, 0.2, 0.9, 0.4)])
    point = got["points"][0]
    assert point["rate"] == 0.2 and point["summary"]["ttft_s"] == {"p50": 2.0, "p90": 4.0}
    assert point["summary"]["tpot_s"]["p90"] == pytest.approx(0.2) and point["summary"]["attainment"] == 0.9
    assert got["max_rate_90"] == {"tested": 0.2, "interpolated": 0.2} and got["slo"] == {"first": 1.0}
    assert fid.combine([rec(1.0, 0.1, 1.0, None), rec(1.0, None, 0.5, None)])["max_rate_90"]["tested"] is None
    assert fid.combine([rec(1.0, 0.1, 1.0, None), rec(1.0, None, 0.5, None)])["points"][0]["summary"]["tpot_s"] is None


def test_the_table_lists_judged_points_and_rates() -> None:
    rec = {"points": [{"config": "c", "part": "trace", "rate": 0.1, "metric": "ttft_p50", "repeats": 3,
                       **fid.judge(1.1, [1.0, 1.0, 1.2])},
                      {"config": "c", "part": "mixed", "rate": 0.4, "metric": "tpot_p90", "repeats": 0,
                       **fid.judge(None, [])}],
           "max_rate_90": [{"config": "c", "part": "trace", "rates": [0.1, 0.3], "measured": [0.1, None, 0.3],
                            "sim": 0.1, "verdict": "ok"}]}
    text = fid.table(rec)
    assert "| c | trace | 0.1 | ttft_p50 | 1.000 [1.000-1.200] | 1.100 | +10% | ok |" in text
    assert "mixed" not in text.split("\n\n")[0]        # n/a rows are left out
    assert "| c | trace | 0.1,0.3 | 0.1, none, 0.3 | 0.1 | ok |" in text


def test_recommend_check_gives_the_planner_the_sweeps_workload_and_compares_budget() -> None:
    from benchmarks.planner import recommend_check as rc

    argv = ["--config", "colo_nochunk=http://127.0.0.1:1", "--out", "x", "--no-progress", "--workload", "trace",
            "--rates", "0.1,0.3,0.5", "--point-seconds", "40", "--ttft-slo-per-length",
            "--ttft-slo-ms", "900", "--tpot-slo-ms", "120"]
    args = rc.recommend_args(argv, ["t1.json", "t2.json"])
    assert (args.workload, args.ttft_slo_per_length) == ("trace", True)
    assert not hasattr(args, "rates")                             # the planner searches the rate itself
    assert args.ttft_slo_ms is None and args.tpot_slo_ms is None    # the planner derives its own
    assert (args.devices, args.max_colocated, args.chunks, args.profile) == (2, 1, "0,256", ["t1.json", "t2.json"])


def test_recommend_check_scores_as_the_planner_ranks_and_calls_noise_ok() -> None:
    from benchmarks.planner import recommend_check as rc

    def pts(*att: float) -> list[dict]:
        return [{"rate": r, "summary": {"attainment": a}} for r, a in zip((0.1, 0.3, 0.5), att)]

    assert rc.score(pts(1.0, 0.95, 0.5)) == (pytest.approx(0.3 + 0.2 * 0.05 / 0.45), 1.0)
    assert rc.score(pts(0.5, 0.4, 0.1)) == (0.0, 0.5)
    runs = {"a": [(0.3, 1.0), (0.5, 1.0), (0.3, 1.0)], "b": [(0.1, 1.0), (0.1, 0.9), (0.1, 1.0)]}
    assert rc.verdict("a", runs) == {"measured_best": "a", "verdict": "ok"}
    assert rc.verdict("b", runs) == {"measured_best": "a", "verdict": "off"}           # every run beaten
    runs["b"][1] = (0.4, 1.0)
    assert rc.verdict("b", runs)["verdict"] == "ok"                                       # within noise
