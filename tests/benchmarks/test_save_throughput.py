"""``save_overlap_bench --throughput --against REV``: the save path of this tree and of another
commit, each in a child process against one real ``kvstore serve``, on the tiny model's block
shape: one JSON line with both sides' GB/s and CPU-seconds per GB and their ratios."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration


def test_throughput_against_a_commit_reports_both_sides(tmp_path: Path) -> None:
    from engine.model.tiny import make_tiny_checkpoint

    model = make_tiny_checkpoint(tmp_path / "tiny", "llama", seed=0)
    out = subprocess.run([sys.executable, "-m", "benchmarks.store.save_overlap_bench", "--throughput",
                          "--against", "HEAD", "--model", str(model), "--blocks", "16",
                          "--reps", "2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["bench"] == "save_throughput" and report["against"] == "HEAD"
    for side in ("this", "against"):
        assert report[f"{side}_gb_s"] > 0 and report[f"{side}_cpu_s_per_gb"] > 0
    assert report["throughput_ratio"] > 0 and report["cpu_ratio"] > 0
    worktrees = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True,
                               text=True, check=True).stdout
    assert "save-bench-" not in worktrees   # the temporary tree is gone
