"""``benchmarks.planner.stack_profile``: the serving stack's cost beside the engine's (a profile's
``serving`` section), its arithmetic, and one real run on the tiny model."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.planner import stack_profile as sp
from benchmarks.serving.compare import CONFIGS
from engine.profile import format as pf
from planner.metrics import RequestResult

REPO = Path(__file__).resolve().parents[2]


def result(rid: str, ttft: float, gaps: list[float], sent: float = 0.0) -> RequestResult:
    r = RequestResult(rid, sent_s=sent, ttft_s=ttft, e2e_s=ttft + sum(gaps), itl_s=list(gaps))
    r.output_tokens = len(gaps) + 1
    return r


def test_the_steady_gap_is_taken_while_every_request_decodes() -> None:
    # a: tokens at 1, 2, 3, 4, 5, 6; b: first token at 3.5, then 0.5 s apart up to 5.5.
    a = result("a", 1.0, [1.0] * 5)
    b = result("b", 3.5, [0.5] * 4)
    # Inside [3.5, 5.5]: a's gaps 4->5 (1.0) and b's 3.5->4, 4->4.5, 4.5->5, 5->5.5 (0.5 each).
    assert sp.steady_gap([a, b]) == pytest.approx(0.5)
    assert sp.steady_gap([a]) == pytest.approx(1.0)
    failed = result("c", 1.0, [1.0])
    failed.error = "boom"
    assert sp.steady_gap([a, failed]) is None
    # No overlap at all: no steady window.
    assert sp.steady_gap([result("x", 0.1, [0.1]), result("y", 5.0, [0.1])]) is None


def test_the_line_through_the_differences_is_non_negative() -> None:
    assert sp.fit_line([1, 2, 4, 8], [0.003 + 0.001 * b for b in (1, 2, 4, 8)]) == pytest.approx((0.003, 0.001))
    step, token = sp.fit_line([1, 2, 4, 8], [0.010 - 0.001 * b for b in (1, 2, 4, 8)])
    assert step >= 0 and token == 0.0   # a falling difference fits a constant, never a negative slope
    assert sp.fit_line([1, 4], [-0.01, -0.02]) == (0.0, 0.0)   # the stack never makes a step faster


def test_prefill_steps_are_the_windows_steps_with_prompt_work() -> None:
    class Flat:  # prices every step at 0.1 s
        def step_s(self, decodes: list[int], chunks: list[tuple[int, int]]) -> float:
            return 0.1

    steps = [{"t": 5.0, "execute_s": 0.2, "items": [[256, 0], [1, 40]]},    # mixed: counted
             {"t": 6.0, "execute_s": 0.15, "items": [[128, 256]]},          # prefill: counted
             {"t": 6.5, "execute_s": 0.3, "items": [[1, 40], [1, 50]]},     # decodes only: not
             {"t": 7.0, "execute_s": 0.3, "items": [[8, 0]]},               # under 32 prompt tokens: not
             {"t": 20.0, "execute_s": 0.5, "items": [[256, 0]]}]            # outside the window: not
    assert sp.prefill_steps(Flat(), steps, (4.0, 10.0)) == pytest.approx([2.0, 1.5])  # type: ignore[arg-type]


def test_the_default_layout_fills_the_machine_with_the_profiles_threads() -> None:
    hw = pf.Hardware("cpu", "x", 2, 1, "x", "x", "native")
    base = pf.Profile(hw, None, None, {})  # type: ignore[arg-type]
    assert sp.default_layout(base) == CONFIGS["disagg"]["up"]
    two = dataclasses.replace(base, hardware=dataclasses.replace(hw, threads=2))
    assert sp.default_layout(two) == CONFIGS["colo_chunk"]["up"]


@pytest.mark.integration
def test_a_real_stack_on_the_tiny_model_writes_its_section(tmp_path: Path) -> None:
    from engine.model.tiny import make_tiny_checkpoint

    tiny_model_dir = make_tiny_checkpoint(tmp_path / "tiny-llama", "llama", seed=0)
    prof = tmp_path / "profile.json"
    run = subprocess.run([sys.executable, "-m", "engine.worker.cli", "profile", "--tiny", "--quick", "--threads", "1",
                          "--seed", "3", "--out", str(prof)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    out = tmp_path / "served.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.planner.stack_profile", "--profile", str(prof),
                           "--out", str(out), "--model", str(tiny_model_dir),
                           "--up", "--mode colocated --threads-per-worker 1",
                           "--batches", "1,4", "--rounds", "1", "--hops", "2", "--prompt", "32", "--output", "12",
                           "--probes", "2", "--probe-prompt", "96", "--probe-gap-s", "0.4", "--probe-output", "40",
                           "--no-progress"], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    sv = pf.load(out).serving
    assert sv is not None and pf.load(prof).serving is None   # --out leaves the input alone
    assert [p.batch for p in sv.points] == [1, 4] and line["threads"] == 1
    # HTTP, the router and streaming cost something: the measured first token is later than
    # the engine's alone, and the hop is a third of that difference.
    assert sv.ttft_measured_s > sv.ttft_simulated_s and sv.hop_s > 0
    assert sv.hop_s <= (sv.ttft_measured_s - sv.ttft_simulated_s) / 3 * 1.5
    assert sv.step_s >= 0 and sv.token_s >= 0 and all(p.measured_gap_s > 0 for p in sv.points)
    assert "kvrouter up --mode colocated" in sv.how
    # Prefill under load: both probes measured against the simulator with the stack's costs.
    assert [(p.prompt_tokens, p.decoding) for p in sv.prefill_points] == [(96, 2), (96, 2)]
    assert all(p.measured_ttft_s > 0 and p.simulated_ttft_s > 0 and p.engine_prefill_s > 0 for p in sv.prefill_points)
    assert sv.prefill_factor > 0 and line["prefill_factor"] == pytest.approx(sv.prefill_factor, abs=1e-3)
    assert sv.prefill_steps >= 2 and line["prefill_steps"] == sv.prefill_steps   # each probe's prefill was traced
    assert out.with_suffix(".png").stat().st_size > 5000
