"""benchmarks.serving.compare: the router-log figures and the per-run plan (no processes started)."""

import pytest

from benchmarks.serving.compare import CONFIGS, build_parser, build_plan, log_stats, parts, probe_requests


def _record(prompt, out, phases, kv=(0, 0), first=1.0):
    return {"status": "ok", "prompt_tokens": prompt, "output_tokens": out,
            "timeline": {"first_token": first, "transfer_start": first, "decode_first": first + 0.1},
            "prefill_stats": {"kv_bytes_saved": kv[0]}, "decode_stats": {"kv_bytes_loaded": kv[1]}, "phases": phases}


def test_log_stats_skips_probes_and_one_token_requests_and_uses_the_first_phase():
    probe = _record(64, 32, [{"phase": "full", "stats": {"store_hit_tokens": 64}}])
    prewarm = _record(100, 1, [{"phase": "prefill", "stats": {"store_hit_tokens": 100}}])
    split = _record(100, 8, [
        {"phase": "prefill", "stats": {"store_hit_tokens": 32, "device_hit_tokens": 16, "store_save_s": 0.1}},
        {"phase": "decode", "stats": {"store_hit_tokens": 96, "store_load_s": 0.1}}], kv=(1000, 3000), first=2.0)
    stats = log_stats([probe] * 4 + [prewarm, split], skip=4)
    assert stats["records"] == 1
    assert stats["store_hit_rate"] == 0.32 and stats["device_hit_rate"] == 0.16  # decode loads are the handoff
    assert stats["kv_bytes_p2d_p50"] == 3000 and stats["kv_bytes_moved_p50"] == 4000
    assert abs(stats["transfer_share_of_ttft_p50"] - 0.1) < 1e-9


def test_plan_and_configurations_share_one_budget():
    assert [p[1] for p in parts(quick=True)] == ["mixed", "mixed_quiet", "trace"]
    assert [p[1] for p in parts(quick=False)] == ["mixed", "mixed_quiet", "trace", "multi_turn"]
    full_trace = dict((p[1], p[2]) for p in parts(quick=False))["trace"]
    rates = full_trace.split("--rates ")[1].split()[0].split(",")
    seconds = float(full_trace.split("--point-seconds ")[1].split()[0])
    assert len(rates) == 5 and seconds <= 120  # about five rates, at most two minutes a point
    assert probe_requests(full_trace) == 7 and probe_requests(parts(quick=True)[0][2]) == 2
    blocks = {n: sum(int(a.split("=")[-1]) * (2 if "disaggregated" in c["up"] else 1)
                     for a in c["up"].split() if a.startswith("--worker-arg=--num-blocks="))
              for n, c in CONFIGS.items()}
    assert set(blocks.values()) == {512}


def test_part_flags_go_last_on_their_own_part_only():
    args = build_parser().parse_args(["--parts", "mixed,trace,multi_turn", "--point-seconds", "40",
                                      "--mixed-extra", "--rates 0.2,0.3", "--trace-rates", "0.1,0.2",
                                      "--part-flags", "trace=--rates 0.1,0.15 --point-seconds 120",
                                      "--part-flags", "multi_turn=--rates 0.4,0.6"])
    wanted, plan = build_plan(args)
    assert wanted == ["mixed", "trace", "multi_turn"]
    flags = {label: f.split() for _, label, f in plan}
    # The sweep's parser keeps the last of a repeated flag: each part's own extra wins.
    assert flags["trace"][-4:] == ["--rates", "0.1,0.15", "--point-seconds", "120"]
    assert flags["multi_turn"][-2:] == ["--rates", "0.4,0.6"]
    assert flags["mixed"][-4:] == ["--rates", "0.2,0.3", "--point-seconds", "40"]
    assert "0.1,0.15" not in flags["mixed"] and "0.4,0.6" not in flags["trace"]
    with pytest.raises(SystemExit, match="LABEL=FLAGS"):
        build_plan(build_parser().parse_args(["--parts", "trace", "--part-flags", "mixed=--rates 1"]))
