"""``kvplan recommend`` on a GPU profile whose every time is known: candidates that are devices,
capacities found by a bounded search, GPU-seconds and KV bytes from the profile and the
workload alone, and the recommended shape where it is known by construction.

Profile ("Test GPU 16GB"): a prefill step costs 20 ms + 0.2 ms a token, a decode step 10 ms +
1 ms a sequence (no context terms); 4 KiB of KV a token. Objectives: TTFT 5x the unloaded
TTFT of one GPU, TPOT fixed per case.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from engine.profile import format as pf
from planner.candidates import Fleet, gpu_colocated, gpu_split, next_splits, split_starts
from planner.capacity import SearchSettings, find_capacity
from planner.cli import build_parser
from planner.recommend import rank, run_recommend
from planner.sim.costs import StepCosts
from planner.sizing import gpu_seconds, kv_bytes, weight_bytes
from planner.workloads import BenchRequest, Workload

KV_TOKEN = 4096


def gpu_profile() -> pf.Profile:
    pre = [pf.PrefillPoint(n, 0, 0, 0.02 + 2e-4 * n) for n in (16, 64, 256, 1024, 4096)]
    dec = [pf.DecodePoint(b, c, 0.01 + 1e-3 * b) for b in (1, 4, 16, 64) for c in (128, 1024, 4096)]
    move = [pf.TransferPoint(n, n * KV_TOKEN * 16, 0.0005 + 1e-5 * n) for n in (1, 4, 16)]
    model = pf.ModelShape("tiny-gpu", "llama", 2, 4, 2, 32, 128, 256, 1000, "bfloat16", 16, KV_TOKEN, KV_TOKEN * 16)
    hw = pf.Hardware("cuda", "Test GPU 16GB", 0, 1, "x", "x", "test")
    curves = {n: pf.Curve(tuple(p), pf.fit_curve(n, p)) for n, p in
              (("prefill", pre), ("decode", dec), ("store_load", move), ("store_save", move))}
    return pf.Profile(hw, model, pf.StoreInfo("rdma", "synthetic"), curves)


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pf.save(gpu_profile(), tmp_path_factory.mktemp("gpu") / "gpu.json")


def recommend(path: Path, devices: int, prompt: int, output: int, tpot_ms: int, requests: int = 300,
              *extra: str) -> dict:
    argv = ["recommend", "--devices", str(devices), "--profile", str(path), "--workload", "mixed",
            "--mixed-long-share", "0", "--mixed-short-prompt", str(prompt), "--mixed-short-output", str(output),
            "--num-requests", str(requests), "--tpot-slo-ms", str(tpot_ms), "--chunks", "512", "--no-progress",
            *extra]
    return run_recommend(build_parser().parse_args(argv))


def test_the_capacity_search_brackets_then_bisects_to_its_precision() -> None:
    for guess in (0.01, 3.0, 7.3, 500.0):
        calls: list[float] = []

        def attains(rate: float) -> float:
            calls.append(rate)
            return 1.0 if rate <= 7.3 else 0.5

        cap = find_capacity(attains, guess, SearchSettings(precision=0.05, max_doublings=12, max_halvings=12))
        assert cap.rate <= 7.3 < cap.upper and cap.upper / cap.rate <= 1.05 + 1e-9, (guess, cap)
        assert cap.uncertainty == pytest.approx(cap.upper / cap.rate - 1)
        assert len(calls) == len(set(calls)) <= 20                       # no rate simulated twice
    never = find_capacity(lambda r: 1.0, 1.0, SearchSettings(max_doublings=3))
    assert (never.rate, never.upper, never.uncertainty) == (8.0, None, None)   # a lower bound, said so
    always = find_capacity(lambda r: 0.0, 1.0, SearchSettings(max_halvings=3))
    assert (always.rate, always.upper) == (0.0, 0.125)


def test_gpu_seconds_and_kv_bytes_follow_the_profile_and_the_workload() -> None:
    costs = StepCosts(gpu_profile())
    reqs = [BenchRequest(f"r{i}", tuple(range(1000 + 1000 * i, 2000 + 1000 * i)), 11) for i in range(4)]
    shared = [BenchRequest(f"s{i}", tuple(range(100, 1100)), 11) for i in range(2)]   # the second reuses all
    gs = gpu_seconds(costs, Workload("w", reqs), chunk=500, tpot_s=0.0305, max_num_seqs=256, kv_tokens_per_device=10**6)
    assert gs.prefill == pytest.approx(2 * 0.02 + 2e-4 * 1000, rel=0.02)       # two chunks of 500
    assert gs.prefill_reused == pytest.approx(gs.prefill)                   # nothing seen twice
    assert gs.decode_batch == 20 and gs.decode_batch_bound == "tpot"         # 10 ms + 1 ms x 20 = 30 ms
    assert gs.decode == pytest.approx(11 * 0.03 / 20, rel=0.02)
    assert gs.ratio == pytest.approx(gs.prefill / gs.decode) and 0 < gs.prefill_share < 1
    reuse = gpu_seconds(costs, Workload("w", shared), 500, 0.0305, 256, 10**6)
    assert reuse.prefill_reused < 0.8 * reuse.prefill
    by_kv = gpu_seconds(costs, Workload("w", reqs), 500, 1.0, 256, kv_tokens_per_device=5000)
    assert (by_kv.decode_batch, by_kv.decode_batch_bound) == (4, "kv_blocks")   # 5000 / ~1005 tokens
    kb = kv_bytes(Workload("w", reqs), KV_TOKEN, link_gbps=8.0)
    assert kb.p50 == kb.p95 == 1000 * KV_TOKEN and kb.transfer_s["p50"] == pytest.approx(1000 * KV_TOKEN / 1e9)
    assert weight_bytes(gpu_profile().model) > 0


def test_gpu_candidates_are_devices_and_the_split_search_climbs_to_the_best_split() -> None:
    fleet = Fleet(True, 32, 1, 5000, 64, 256, 8192, 1 << 30)
    colo = gpu_colocated(fleet, [2048, 512, 0])
    assert [c.name for c in colo] == ["colo32_chunk512", "colo32_chunk2048"]
    split = gpu_split(fleet, 24, 2048)
    assert (split.prefill, split.decode, split.name) == (24, 8, "split24p8d_chunk2048")
    for c in [*colo, split]:
        assert c.workers == 32 and all(s.threads == 1 and s.num_blocks == 5000 for s in c.specs())
    with pytest.raises(ValueError):
        gpu_split(fleet, 32, 2048)
    assert split_starts(32, [0.92, 0.71]) == [23, 29] and split_starts(1, [0.5]) == []

    def climb(capacity: dict[int, float], starts: list[int]) -> list[int]:
        """The prefill counts the search simulates, on a known capacity curve."""
        rows, queue = [], list(starts)
        while queue:
            p = queue.pop(0)
            rows.append({"mode": "disaggregated", "prefill": p, "capacity_per_device": capacity[p]})
            if not queue:
                queue = next_splits(rows, 32)
        return [r["prefill"] for r in rows]

    peak = {p: 1.0 - abs(p - 20) / 32 for p in range(1, 32)}       # best at 20P:12D
    tried = climb(peak, [23, 29])
    assert max(tried, key=peak.__getitem__) == 20 and {19, 21} <= set(tried) and len(tried) <= 10
    flat = {p: 0.5 for p in range(1, 32)}                         # nothing to climb: neighbours, then stop
    assert sorted(climb(flat, [16])) == [14, 15, 16, 17, 18]


def test_equivalent_capacities_go_to_the_simpler_configuration() -> None:
    def row(name: str, mode: str, cap: float, upper: float | None) -> dict:
        return {"name": name, "mode": mode, "devices": 4, "capacity_per_device": cap,
                "capacity_upper_per_device": upper}

    best, runner, ranked = rank([row("split", "disaggregated", 1.02, 1.07), row("colo", "colocated", 1.0, 1.05),
                                 row("far", "disaggregated", 0.5, 0.52)])
    assert best["name"] == "colo" and runner is not None and runner["name"] == "split"
    assert [r["name"] for r in ranked] == ["split", "colo", "far"] and not ranked[2]["equivalent"]
    best, _, _ = rank([row("split", "disaggregated", 1.2, 1.26), row("colo", "colocated", 1.0, 1.05)])
    assert best["name"] == "split"                        # out of the interval: the split wins


@pytest.mark.slow  # simulates dozens of points
def test_a_prefill_bound_workload_under_a_tight_tpot_splits_prefill_heavy(profile_path: Path) -> None:
    # 2,000-token prompts, 4 tokens out, TPOT <= 50 ms: a colocated decode waits out 512-token chunks
    # (122 ms each), so a split wins, and the prefill work wants most of the devices.
    rec = recommend(profile_path, 4, 2000, 4, 50)
    best = rec["best"]
    assert best["mode"] == "disaggregated" and best["prefill"] > best["decode"], rec["verdict"]
    colo = next(r for r in rec["ranked"] if r["mode"] == "colocated")
    assert best["capacity_rps"] > colo["capacity_upper_rps"]
    assert rec["gpu_seconds"]["prefill_share"] > 0.9 and "prefill" in rec["gpu_seconds"]["explanation"]
    assert best["command"] is None and "no CUDA device" in best["note"] and "--device=cuda" in best["note"]
    assert "--model tiny-gpu" in best["note"]


@pytest.mark.slow  # simulates dozens of points
def test_a_decode_bound_workload_keeps_decode_devices_and_splitting_cannot_beat_colocated(profile_path: Path) -> None:
    rec = recommend(profile_path, 4, 64, 200, 30, 120, "--search-requests", "120")
    assert rec["gpu_seconds"]["prefill_share"] < 0.5
    assert rec["best"]["mode"] == "colocated", rec["verdict"]
    splits = [r for r in rec["ranked"] if r["mode"] != "colocated"]
    assert splits and splits[0]["decode"] > splits[0]["prefill"]      # the best split is decode-heavy
    assert rec["runner_up"]["gap"] > 0 and f"{rec['runner_up']['gap']:.0%} lower" in rec["verdict"]


@pytest.mark.slow  # simulates dozens of points
def test_with_nothing_to_decode_colocated_wins_and_capacity_grows_with_devices(profile_path: Path) -> None:
    two, four = (recommend(profile_path, n, 500, 1, 1000) for n in (2, 4))
    for rec, n in ((two, 2), (four, 4)):
        assert rec["best"]["mode"] == "colocated" and rec["best"]["devices"] == n
        assert all(r["devices"] == n for r in rec["ranked"])          # every candidate is the budget's fleet
        for key in ("devices", "capacity_rps", "capacity_per_device", "command"):
            assert key in rec["best"]
        assert {"prefill", "decode", "ratio"} <= set(rec["gpu_seconds"]) and {"p50", "p95", "transfer_s"} <= set(
            rec["kv_bytes"])
        assert rec["objectives"]["tpot"].startswith("fixed") and rec["best"]["uncertainty"] <= 0.05 + 1e-9
    assert four["best"]["capacity_rps"] >= two["best"]["capacity_rps"] * 1.5
    again = recommend(profile_path, 2, 500, 1, 1000)

    def strip(rec: dict) -> str:
        return json.dumps([{k: v for k, v in r.items() if k != "search_seconds"} for r in rec["ranked"]])

    assert strip(again) == strip(two) and again["verdict"] == two["verdict"]     # the same answer twice
    assert math.isfinite(two["best"]["capacity_per_device"])
