"""``kvengine profile`` end to end (tiny model, --quick, a real loopback kvstore daemon) and
the profile format's load/save/evaluate."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from engine.profile import format as pf

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, module_procs) -> tuple[Path, Path, str]:
    tmp = tmp_path_factory.mktemp("profile")
    out, plots = tmp / "profile.json", tmp / "plots"
    proc = module_procs.run(
        [sys.executable, "-m", "engine.worker.cli", "profile", "--tiny", "--quick", "--threads", "1",
         "--seed", "3", "--out", str(out), "--plots", str(plots)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, plots, proc.stdout


def test_profile_file_has_every_curve_and_its_facts(run: tuple[Path, Path, str]) -> None:
    out, _, stdout = run
    prof = pf.load(out)
    assert prof.schema_version == pf.SCHEMA_VERSION and prof.seed == 3 and prof.quick
    assert set(prof.curves) == set(pf.CURVES)
    h, m = prof.hardware, prof.model
    assert h.device == "cpu" and h.threads == 1 and h.torch_version and h.device_name
    assert (m.name, m.num_layers, m.num_heads, m.num_kv_heads, m.hidden_size) == ("tiny-llama", 3, 4, 2, 64)
    assert m.block_bytes == m.kv_bytes_per_token * m.block_size == 3 * 2 * 2 * 16 * 4 * 16
    assert prof.store.transport in ("shm", "tcp")
    pre = prof.curves["prefill"].points
    assert {p.chunk for p in pre} == {0, prof.extra["chunk"]}
    assert any(p.cached_tokens > 0 for p in pre) and all(p.seconds > 0 for p in pre)
    assert {p.batch for p in prof.curves["decode"].points} == set(prof.extra["decode_batches"])
    assert "kvengine profile: tiny-llama" in stdout and "fit max rel. error" in stdout


def test_fits_reproduce_their_points_within_the_recorded_error(run: tuple[Path, Path, str]) -> None:
    prof = pf.load(run[0])
    for name, curve in prof.curves.items():
        assert all(c >= 0 for c in curve.fit.coefficients), name
        for p in curve.points:
            args = {k: v for k, v in vars(p).items() if k not in ("seconds", "bytes")}
            rel = abs(prof.evaluate(name, **args) - p.seconds) / p.seconds
            assert rel <= curve.fit.max_rel_error + 1e-9, (name, p)


def test_fitted_model_is_monotonic(run: tuple[Path, Path, str]) -> None:
    prof = pf.load(run[0])
    chunk = prof.extra["chunk"]
    for lo, hi in ((64, 256), (256, 1024), (512, 2048)):
        assert prof.prefill_s(hi) > prof.prefill_s(lo)
        assert prof.prefill_s(hi, 0, chunk) > prof.prefill_s(lo, 0, chunk)
    for total in (256, 1024):  # the same prompt with 90 % of it cached costs less
        assert prof.prefill_s(total // 10, total - total // 10) < prof.prefill_s(total)
    assert prof.decode_step_s(16, 512) > prof.decode_step_s(1, 512)
    assert prof.decode_step_s(8, 2048) >= prof.decode_step_s(8, 128)
    for name in ("store_load", "store_save"):
        assert prof.evaluate(name, blocks=64) > prof.evaluate(name, blocks=1)
        assert 0 < prof.bandwidth(name)


def test_plots_written(run: tuple[Path, Path, str]) -> None:
    for name in pf.CURVES:
        png = run[1] / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_save_load_round_trip_and_version_refusal(run: tuple[Path, Path, str], tmp_path: Path) -> None:
    prof = pf.load(run[0])
    again = pf.load(pf.save(prof, tmp_path / "copy.json"))
    assert again == prof
    obj = json.loads(run[0].read_text())
    for bad, what in (({**obj, "schema_version": pf.SCHEMA_VERSION + 1}, "schema_version"),
                      ({**obj, "schema": "other"}, "schema"),
                      ({**obj, "curves": {k: v for k, v in obj["curves"].items() if k != "decode"}},
                       "lacks")):
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=what):
            pf.load(tmp_path / "bad.json")


def test_fit_recovers_a_known_model() -> None:
    pts = [pf.DecodePoint(b, c, 1e-3 + 2e-4 * b + 3e-8 * b * (c + 1))
           for b in (1, 4, 16) for c in (128, 1024)]
    fit = pf.fit_curve("decode", pts)
    assert fit.max_rel_error < 1e-9
    assert fit.coefficients == pytest.approx((1e-3, 2e-4, 3e-8), rel=1e-6)
    # A term the data push negative is dropped, not kept negative.
    fit = pf.fit_curve("store_load", [pf.TransferPoint(n, n * 1000, 1e-3 - 1e-7 * n) for n in (1, 10, 100)])
    assert min(fit.coefficients) >= 0


def test_help_names_every_flag() -> None:
    from engine.worker.cli import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices["profile"]  # type: ignore[union-attr]
    for action in sub._actions:
        assert action.help, action.option_strings
