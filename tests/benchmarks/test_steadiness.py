"""``benchmarks.planner.steadiness``: its summary arithmetic, and a short real run on the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.planner import steadiness

REPO = Path(__file__).resolve().parents[2]


def test_the_summary_is_each_modes_median_of_block_medians_and_their_spread() -> None:
    args = steadiness.build_parser().parse_args(["--batches", "1,8", "--cpus", "0"])
    blocks = [{"mode": "free", "median_ms": {1: 100.0, 8: 200.0}},
              {"mode": "pinned", "median_ms": {1: 90.0, 8: 210.0}},
              {"mode": "free", "median_ms": {1: 120.0, 8: 220.0}},
              {"mode": "pinned", "median_ms": {1: 110.0, 8: 190.0}},
              {"mode": "free", "median_ms": {1: 110.0, 8: 230.0}}]
    out = steadiness.summarize(blocks, args)
    one, eight = out["batches"]["1"], out["batches"]["8"]
    assert (one["free_ms"] == 110.0 and one["pinned_ms"] == 100.0
            and one["pinned_over_free"] == pytest.approx(0.909, abs=1e-3))
    assert one["free_spread"] == pytest.approx(1.2) and one["pinned_spread"] == pytest.approx(110 / 90, abs=1e-3)
    assert eight["free_ms"] == 220.0 and eight["pinned_ms"] == 200.0
    assert out["blocks"] == 5 and out["per_block_ms"][1] == ["pinned", {"1": 90.0, "8": 210.0}]


def test_bad_flags_are_refused() -> None:
    with pytest.raises(SystemExit):
        steadiness.build_parser().parse_args(["--cpus", "999"])
    with pytest.raises(SystemExit):
        steadiness.build_parser().parse_args(["--batches", "0"])


@pytest.mark.integration
def test_a_short_run_on_the_tiny_model(tmp_path: Path) -> None:
    from engine.model.tiny import make_tiny_checkpoint

    model = make_tiny_checkpoint(tmp_path / "tiny", "llama", seed=0)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.planner.steadiness", "--model", str(model), "--cpus", "0",
                           "--blocks", "2", "--block-seconds", "0.2", "--batches", "1,2", "--context", "32",
                           "--no-progress"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["blocks"] == 2 and out["cpus"] == [0]
    for b in ("1", "2"):
        row = out["batches"][b]
        assert row["free_ms"] > 0 and row["pinned_ms"] > 0 and row["pinned_over_free"] > 0
    assert [m for m, _ in out["per_block_ms"]] == ["free", "pinned"]
