"""benchmarks/planner/autoscale_bench.py without clusters (a real run starts five of them for minutes;
the mechanics it measures are tests/router/test_autoscale.py's): the workload turns from
decode-heavy to prefill-heavy at the half, seeded; the autoscaled cluster's router gets its
objectives from the SLOs; the verdict compares against the best static configuration; the
timeline is read relative to the workload's start; the plot is drawn."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from benchmarks.planner.autoscale_bench import (
    PHASES,
    Probe,
    build_parser,
    calibrate,
    given,
    plot,
    probe,
    read_timeline,
    shifting_workload,
    simulate,
    slots,
    up_flags,
    verdict,
)
from engine.profile import format as pf
from planner.metrics import Slo
from planner.workloads import TokenSpace
from tests.benchmarks.fake_openai import FakeOpenAI
from tests.planner.test_sim import profile


def _args(*extra: str):
    return build_parser().parse_args(["--phase-seconds", "60", *extra])


def test_the_workload_shifts_at_the_half() -> None:
    args = _args("--decode-rate", "1", "--prefill-rate", "1", "--prefill-share", "0.5")
    wl = shifting_workload(args, TokenSpace())
    first = [r for r in wl.requests if r.tag == PHASES[0]]
    second = [r for r in wl.requests if r.tag == PHASES[1]]
    assert first and second and all(r.arrival_s < 60 for r in first)
    assert all(60 <= r.arrival_s < 120 for r in second)
    assert all(r.max_tokens == args.decode_output and len(r.prompt) < 2 * args.decode_prompt for r in first)
    huge = [r for r in second if len(r.prompt) > 2 * args.decode_prompt]
    assert 0.25 < len(huge) / len(second) < 0.75 and min(len(r.prompt) for r in huge) >= 0.75 * args.prefill_prompt
    def prompt_per_output(rs):
        return sum(len(r.prompt) for r in rs) / sum(r.max_tokens for r in rs)
    assert prompt_per_output(second) > 5 * prompt_per_output(first)    # prefill-heavy after decode-heavy
    assert sum(len(r.prompt) for r in second) > 2 * sum(len(r.prompt) for r in first)
    assert len({r.request_id for r in wl.requests}) == len(wl.requests)
    again = shifting_workload(args, TokenSpace())
    assert [r.prompt for r in again.requests] == [r.prompt for r in wl.requests]


def test_the_load_and_objectives_follow_the_probe_and_the_router_aims_at_them() -> None:
    args = _args("--num-blocks", "96", "--decode-prompt", "96", "--decode-output", "192",
                 "--prefill-prompt", "640", "--prefill-share", "0.6", "--prefill-load", "0.7",
                 "--tpot-slo-mult", "2", "--decode-load", "1.3", "--itl-target-share", "0.8")
    decode_rate, prefill_rate, slo = calibrate(args, Probe(ttft_short_s=0.8, tpot_s=0.15, ttft_long_s=4.0,
                                                           tpot_full_s=0.25))
    # One worker's cache holds 96 // ceil((96 x 1.25 + 192) / 16) = 4 requests; each lives
    # 192 x 0.25 (the full-cache TPOT) + 0.8 s; 1.3x that: one decode worker cannot keep up, two can.
    assert slots(args) == 4
    assert decode_rate == pytest.approx(1.3 * 4 / (192 * 0.25 + 0.8))
    assert prefill_rate == pytest.approx(0.7 / 4.0 / 0.6)
    assert (slo.ttft_s, slo.tpot_s) == (pytest.approx(4.0), pytest.approx(0.3))
    assert slo.ttft_objective(640) == pytest.approx(20.0)
    flags = up_flags("autoscaled", args, slo).split()
    assert flags[flags.index("--scale-itl-target") + 1] == "0.2400"
    assert float(flags[flags.index("--scale-ttft-target") + 1]) == pytest.approx(20.0, abs=1e-3)
    assert "--autoscale" in flags and "--max-workers" in flags
    assert f"--worker-arg=--num-blocks={2 * args.num_blocks}" in up_flags("colocated_1x2", args, slo).split()
    assert "--threads-per-worker" not in up_flags("colocated_1x2", args, slo).split()[3:]
    fixed = calibrate(_args("--tpot-slo-ms", "250", "--decode-rate", "0.5"), Probe(0.8, 0.15, 4.0, 0.25))
    assert fixed[0] == 0.5 and fixed[2].tpot_s == 0.25
    assert not given(_args("--tpot-slo-ms", "250", "--decode-rate", "0.5"))
    repeat = _args("--decode-rate", "0.6", "--prefill-rate", "0.7", "--ttft-slo-ms", "1900",
                   "--ttft-slo-per-token-ms", "16", "--tpot-slo-ms", "180")
    assert given(repeat)   # a repeat needs no probe: nothing of the probe reaches the plan
    assert calibrate(repeat, Probe(0.0, 0.0, 0.0, 0.0)) == calibrate(repeat, Probe(0.8, 0.15, 4.0, 0.25))


def test_the_probe_warms_then_measures_alone_then_with_both_caches_full() -> None:
    args = _args("--num-blocks", "32", "--decode-prompt", "16", "--decode-output", "12", "--prefill-prompt", "64",
                 "--probes", "2")
    assert slots(args) == 32 // 2   # 16 x 1.25 + 12 = 32 tokens: 2 blocks a request
    with FakeOpenAI(ttft_s=0.05, tpot_s=0.01) as server:
        got = asyncio.run(probe(server.url, server.model, args, TokenSpace()))
        sent = [(t, len(b["prompt"]), b["max_tokens"]) for t, b in server.received]
    assert [(n, out) for _, n, out in sent[:6]] == [(16, 4), (64, 2), (16, 32), (16, 32), (64, 2), (64, 2)]
    assert all(b[0] >= a[0] + 0.05 for a, b in zip(sent[:6], sent[1:6]))   # warm and lone probes: one at a time
    full = sent[6:]
    assert len(full) == 2 * slots(args) and all((n, out) == (16, 12) for _, n, out in full)
    assert max(t for t, _, _ in full) - min(t for t, _, _ in full) < 0.05   # all at once
    assert got.ttft_short_s == pytest.approx(0.05, abs=0.03) and got.ttft_long_s == pytest.approx(0.05, abs=0.03)
    assert got.tpot_s == pytest.approx(0.01, abs=0.005) and got.tpot_full_s == pytest.approx(0.01, abs=0.005)


def test_verdict_is_against_the_best_static() -> None:
    configs = {"disagg_1p1d": {"whole": {"goodput": 0.10}}, "colocated_2x1": {"whole": {"goodput": 0.14}},
               "auto_1p1d": {"error": "did not start"}, "autoscaled": {"whole": {"goodput": 0.15}}}
    v = verdict(configs)
    assert v["best_static"] == "colocated_2x1" and v["met"] is True
    assert abs(v["autoscaled_over_best_static"] - 0.15 / 0.14) < 1e-9
    configs["autoscaled"]["whole"]["goodput"] = 0.13
    assert verdict(configs)["met"] is False


def test_timeline_and_plot(tmp_path: Path) -> None:
    t0 = 1000.0
    lines = [{"t_unix": t0 + t, "kind": "signals", "prefill": p, "decode": d,
              "pools": {"prefill": {"pressure": 0.1}, "decode": {"pressure": 1.5}}}
             for t, p, d in ((-2, 1, 1), (10, 1, 1), (20, 0, 2), (70, 1, 1))]
    lines.insert(2, {"t_unix": t0 + 19, "kind": "action", "action": "role", "worker": "worker-0",
                     "from": "prefill", "to": "decode", "seconds": 3.2, "started_unix": t0 + 15.8})
    path = tmp_path / "autoscale.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    timeline = read_timeline(path, t0)
    assert [x["t"] for x in timeline] == [-2, 10, 19, 20, 70] and timeline[2]["started"] == 15.8
    requests = [{"t": t, "tag": PHASES[t >= 60], "met": t % 3 > 0} for t in range(0, 120, 2)]
    whole = {"goodput": 0.5}
    phases = {p: {"goodput": 0.4} for p in PHASES}
    record = {"workload": {"phase_seconds": 60}, "verdict": {"best_static": "colocated_2x1"},
              "configs": {"colocated_2x1": {"whole": whole, "phases": phases, "requests": requests},
                          "autoscaled": {"whole": whole, "phases": phases, "requests": requests,
                                         "actions": [timeline[2]],
                                         "timeline": [{"t": x["t"], "prefill": x["prefill"], "decode": x["decode"],
                                                       "pressure": {"prefill": 0.1, "decode": 1.5}}
                                                      for x in timeline if x["kind"] == "signals"]}}}
    plot(record, tmp_path / "autoscale.png")
    assert (tmp_path / "autoscale.png").stat().st_size > 10_000


def test_profiles_put_the_simulators_prediction_beside_each_configuration(tmp_path: Path) -> None:
    # --profile: every configuration simulated from its own flags on the measured workload and
    # objectives (here a synthetic profile's; the real run's are measured).
    pf.save(profile(1), tmp_path / "p1.json")
    args = _args("--phase-seconds", "30", "--decode-rate", "0.5", "--prefill-rate", "0.5",
                 "--profile", str(tmp_path / "p1.json"))
    wl = shifting_workload(args, TokenSpace())
    slo = Slo(ttft_s=3.0, tpot_s=0.5, ttft_per_token_s=0.002, ref_prompt_tokens=96)
    out = simulate(["colocated_2x1", "autoscaled"], args, wl, slo)
    for name in ("colocated_2x1", "autoscaled"):
        assert out[name]["whole"]["issued"] == len(wl.requests)
        assert set(out[name]["phases"]) == set(PHASES) and out[name]["whole"]["good"] > 0
    assert out["colocated_2x1"]["actions"] == []
    assert all(a["action"] in ("role", "start", "stop") for a in out["autoscaled"]["actions"])
