"""benchmarks/peers/lmcache_bench.py: its figures from samples (no LMCache needed), and one real run of
one configuration (our plugin over shared memory, 256 tokens, ~11 s) in the bench environment
that benchmarks/peers/setup_lmcache_peers.sh makes, or else in .venv-lmcache (scripts/setup.sh),
skipped where neither exists."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from benchmarks.peers import lmcache_bench as lb

REPO = Path(__file__).resolve().parents[2]
# The bench environment when set up, else the LMCache tests' one (our plugin needs no Mooncake).
PYTHON = Path(os.environ.get("KVSTORE_LMCACHE_PYTHON") or next(
    (p for p in (lb.BENCH_PYTHON, REPO / ".venv-lmcache" / "bin" / "python") if p.exists()),
    lb.BENCH_PYTHON))
CHUNK = 30 * 2 * 256 * 3 * 64 * 4  # one 256-token chunk of the default model, float32


def _samples(store_s: float, retrieve_s: float) -> dict:
    return {n: {"retrieve": [retrieve_s * k] * 3, "retrieve_ex": [retrieve_s * k / 2] * 3,
                "store": [store_s * k] * 3, "store_ex": [store_s * k / 2] * 3} for n, k in ((2048, 1), (8192, 4))}


def test_figures_ratios_and_targets_of_one_run() -> None:
    samples = {"kvstore_shm": _samples(0.1, 0.05), "kvstore_tcp": _samples(0.2, 0.2),
               "lm": _samples(0.4, 0.1), "mooncake": _samples(0.2, 0.1)}
    results = lb.summarize(samples, {2048: 8 * CHUNK, 8192: 32 * CHUNK})
    assert results["lm"]["2048"]["retrieve"] == {"p50_ms": 100.0, "p99_ms": 100.0, "rounds": 3,
                                                 "gbps": round(8 * CHUNK / 0.1 / 1e9, 3)}
    rat = lb.ratios(results)
    assert rat["kvstore_shm_vs_lm"]["8192"] == {"retrieve": 2.0, "retrieve_ex": 2.0, "store": 4.0, "store_ex": 4.0}
    assert rat["kvstore_tcp_vs_mooncake"]["2048"]["retrieve"] == 0.5
    met = lb.targets(rat, [2048, 8192])
    assert met["retrieve_ge_2x_lm"] == {"kvstore_shm": True, "kvstore_tcp": False}
    assert met["store_ahead_of_mooncake"] == {"kvstore_shm": True, "kvstore_tcp": False}
    assert "store_ge_2x_lm" not in met   # the 2x target is on retrieves only
    table = lb.markdown({"prompts": [2048, 8192], "results": results, "ratios": rat})
    assert "| 8,192 | kvstore_shm | " in table and "2.00x" in table


def test_a_side_that_did_not_run_is_no_verdict() -> None:
    results = lb.summarize({"kvstore_shm": _samples(0.1, 0.05), "lm": _samples(0.4, 0.1)},
                           {2048: 8 * CHUNK, 8192: 32 * CHUNK})
    met = lb.targets(lb.ratios(results), [2048, 8192])
    assert met["retrieve_ge_2x_lm"]["kvstore_shm"] is True
    assert met["retrieve_ahead_of_mooncake"] == {"kvstore_shm": None, "kvstore_tcp": None}


def test_bounded_pools_are_written_once_before_the_timed_rounds() -> None:
    per_round = (2048 + 8192) // 256 * CHUNK
    warm = lb.warm_rounds(list(lb.CONFIGS), [2048, 8192], 3 * per_round)
    assert warm["lm"] == 1   # it never reuses memory: nothing to warm
    assert warm["mooncake"] * per_round >= 3 * per_round and warm["kvstore_shm"] * 2 * per_round >= 3 * per_round
    assert lb.warm_rounds(list(lb.CONFIGS), [2048], 0) == dict.fromkeys(lb.CONFIGS, 1)


@pytest.mark.integration
@pytest.mark.skipif(not PYTHON.exists(), reason=f"no LMCache environment at {PYTHON} "
                    "(bash scripts/setup_lmcache.sh)")
def test_one_configuration_runs_end_to_end(tmp_path: Path) -> None:
    r = subprocess.run([str(PYTHON), "-m", "benchmarks.peers.lmcache_bench", "--configs", "kvstore_shm", "--prompts",
                        "256", "--rounds", "1", "--cold", "--json", "-", "--no-progress", "--log-dir", str(tmp_path)],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads(r.stdout.strip().splitlines()[-1])
    assert rec["failed"] == {} and rec["transports"] == {"kvstore_shm": "shm"}
    row = rec["results"]["kvstore_shm"]["256"]
    assert row["kv_bytes"] == CHUNK and row["retrieve"]["rounds"] == 1 and row["retrieve"]["gbps"] > 0
