"""router_bench: a tiny --quick run prints the JSON it promises, and the optimized hot path
(KvIndex.match, PrefillPolicy.choose) agrees with plain reference implementations."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from benchmarks.serving.router_bench import build_workload, make_index, make_workers
from router.placement.cost import estimate_prefill
from router.placement.prefill import NEAR_REL, NEAR_S, PrefillPolicy


def test_quick_run_prints_one_json_line_with_every_field(tmp_path: Path, procs) -> None:
    out = procs.run(
        [sys.executable, "-m", "benchmarks.serving.router_bench", "--quick", "--out", str(tmp_path),
         "--sizes", "200", "600", "--prompts", "256", "512", "--queries", "20", "--rounds", "2"],
        timeout=120, check=True)
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1
    res = json.loads(lines[0])
    assert res["bench"] == "router" and res["workers"] == 8 and res["block_size"] == 16
    assert res["machine"]["cpu_count"] >= 1 and res["machine"]["platform"]
    assert res["peer"] is None
    assert res["index_table"] == "native" or res["index_table"].startswith("python (")
    assert [(c["index_blocks"], c["prompt_tokens"]) for c in res["cells"]] == [
        (200, 256), (200, 512), (600, 256), (600, 512)]
    for c in res["cells"]:
        assert c["queries"] == 20
        for what in ("decision_us", "lookup_us"):
            assert 0 < c["ours"][what]["p50"] <= c["ours"][what]["p99"]
        assert 0 <= c["match"]["mean_best_fraction"] <= 1
    for size in ("200", "600"):
        ing = res["ingest"][size]
        assert ing["distinct_blocks"] >= 0.7 * int(size)
        assert ing["ours"]["stored"]["blocks"] > 0 and ing["ours"]["removed"]["blocks"] > 0
    for length in ("256", "512"):
        assert res["prep"][length]["hash_us"]["p50"] > 0
    t = res["target"]
    assert t["p99_under_1ms"] == (t["decision_p99_ms_max"] < 1.0)
    assert (tmp_path / "router_bench.png").stat().st_size > 0 and res["plot"].endswith(".png")


def _reference_match(index, keys) -> dict[str, int]:
    """Leading blocks of ``keys`` each worker holds, one key at a time."""
    out = {}
    for wid in index.workers:
        n = 0
        while n < len(keys) and wid in index.holders(keys[n]):
            n += 1
        out[wid] = n
    return out


def test_match_and_choice_agree_with_plain_references() -> None:
    wl = build_workload(800, seed=3, max_tokens=1024)
    index, _ = make_index(wl)
    workers = make_workers(4)
    rng = random.Random(5)
    convs = [c for c in wl.convs if c.keys]
    for policy_name in ("kv-aware", "least-loaded"):
        policy = PrefillPolicy(policy_name, index)
        for _ in range(60):
            keys = rng.choice(convs).keys
            keys = keys[: rng.randint(0, len(keys))]
            assert index.match(keys) == _reference_match(index, keys)
            cands = rng.sample(workers, rng.randint(1, len(workers)))
            n, store = len(keys) * 16 + rng.randint(0, 15), rng.randint(0, len(keys))
            depth = _reference_match(index, keys)
            ests = sorted((estimate_prefill(w, n, depth.get(w.worker_id, 0), store) for w in cands),
                          key=lambda e: e.worker_id)
            load = {w.worker_id: w.load for w in cands}
            if policy_name == "kv-aware":   # near-equal estimates: the most device hits first
                low = min(e.ttft_s for e in ests)
                near = [e for e in ests if e.ttft_s <= low + max(NEAR_S, NEAR_REL * low)]
                best = min((-e.device_hit_tokens, load[e.worker_id]) for e in near)
                wants = [e for e in near if (-e.device_hit_tokens, load[e.worker_id]) == best]  # in turns
            else:
                wants = [min(ests, key=lambda e: (load[e.worker_id], e.ttft_s))]
            chosen, est = policy.choose(cands, keys, n, store)
            assert est in wants and chosen.worker_id == est.worker_id


def _cell(size: int, lookup: float, decision: float, dyn: float) -> dict:
    ours = {"lookup_us": {"p50": lookup, "p99": 2 * lookup},
            "decision_us": {"p50": decision, "p99": 2 * decision}}
    d = {"p50": dyn, "p99": 2 * dyn}
    return {"index_blocks": size, "prompt_tokens": 512, "ours": ours,
            "dynamo": {"find_matches_us": d}, "dynamo_mismatches": 0,
            "ratio_vs_dynamo": {f"{w}_{p}": round(ours[f"{w}_us"][p] / d[p], 2)
                                for w in ("lookup", "decision") for p in ("p50", "p99")}}


def test_report_takes_the_median_of_runs_and_judges_the_targets(tmp_path: Path, procs) -> None:
    from benchmarks.serving.router_report import median_cells, table, targets

    runs = [{"cells": [_cell(1000, lk, dec, 10.0)], "target": {}}
            for lk, dec in ((5.0, 11.0), (20.0, 13.0), (6.0, 12.0))]   # one disturbed run
    (cell,) = median_cells(runs)
    assert cell["ours"]["lookup_us"] == {"p50": 6.0, "p99": 12.0}
    assert cell["ratio_vs_dynamo"]["lookup_p99"] == 0.6
    assert cell["ratio_vs_dynamo"]["decision_p99"] == 1.2
    t = targets([cell], True)
    assert t["lookup_at_or_below_dynamo"] and t["decision_p99_within_1_25x_of_dynamo"]
    assert not targets([_cell(1000, 11.0, 13.0, 10.0)], True)["lookup_at_or_below_dynamo"]
    assert not targets([_cell(1000, 5.0, 13.0, 10.0)], True)["decision_p99_within_1_25x_of_dynamo"]
    assert "| 1,000 | 512 | 6.00 | 12.00 |" in table([cell])
    for i, run in enumerate(runs):
        (tmp_path / f"run{i}.json").write_text(json.dumps(run))
    out = procs.run([sys.executable, "-m", "benchmarks.serving.router_report", "--from",
                     *(str(tmp_path / f"run{i}.json") for i in range(3))], timeout=60, check=True)
    res = json.loads(out.stdout)
    assert res["runs"] == 3 and res["cells"] == [cell] and res["target"] == t
