"""The benchmarks fail loudly: a configuration that does not start is an error in the results,
never a measurement of whatever answers on its port; and a benchmark stopped by SIGTERM stops
everything it started (real processes: the sweep, compare, a tiny ``kvrouter up`` cluster)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.serving import sweep
from kvstore.proc import free_port
from tests.benchmarks.fake_openai import FakeOpenAI
from tests.procs import descendants, running

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = str(Path(sys.executable).parent)


@pytest.mark.usefixtures("procs")  # starts processes: the integration tier
def test_sweep_does_not_measure_a_server_it_did_not_start(tmp_path: Path, capsys) -> None:
    with FakeOpenAI(ttft_s=0.01, tpot_s=0.001) as other:   # e.g. an earlier run's cluster
        port = int(other.url.rsplit(":", 1)[1])
        with pytest.raises(SystemExit, match="did not run: mine"):
            sweep.main(["--launch", f"mine={sys.executable} -m tests.benchmarks.fake_openai --port {port}",
                        "--rates", "8", "--point-seconds", "0.5", "--unloaded-samples", "1", "--no-progress",
                        "--out", str(tmp_path)])
        assert other.received == []
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "already in use before the launch" in rec["failed"]["mine"] and rec["configs"] == {}


def test_compare_reports_a_configuration_that_did_not_start_as_an_error(tmp_path: Path, procs) -> None:
    with FakeOpenAI(ttft_s=0.01, tpot_s=0.001) as other:
        port = other.url.rsplit(":", 1)[1]
        done = procs.run([sys.executable, "-m", "benchmarks.serving.compare", "--quick", "--configs", "disagg",
                          "--port", port, "--out", str(tmp_path)], timeout=60)
        assert other.received == []
    assert done.returncode == 1, done.stderr
    rec = json.loads((tmp_path / "compare.json").read_text())
    assert "already in use" in rec["configs"]["disagg"]["error"]
    assert rec["configs"]["disagg"]["parts"] == {} and len(rec["errors"]) == 1


def test_compare_stopped_by_sigterm_stops_its_sweep_and_its_cluster(tmp_path: Path, procs) -> None:
    from engine.model.tiny import make_tiny_checkpoint

    model = make_tiny_checkpoint(tmp_path / "tiny", "llama", seed=0)
    env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}"}
    proc = procs.popen([sys.executable, "-m", "benchmarks.serving.compare", "--quick", "--configs", "disagg",
                        "--model", str(model), "--mixed-extra", "--vocab-size 500", "--port", str(free_port()),
                        "--out", str(tmp_path / "out")],
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    started: set[int] = set()
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 90
        for line in proc.stderr:   # "[compare] disagg mixed: ..." once its cluster is up
            if line.startswith("[compare] disagg mixed:") or time.monotonic() > deadline:
                break
        time.sleep(1.0)            # the sweep under way
        up_log = (tmp_path / "out" / "disagg" / "up.log").read_text()
        assert "The router is up at" in up_log, up_log
        started = descendants(proc.pid)
        assert len(started) >= 6          # kvrouter up, etcd, store, 2 workers, router, the sweep
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert code == 128 + signal.SIGTERM
    deadline = time.monotonic() + 10
    while [p for p in started if running(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in started if running(p)]
    rec = json.loads((tmp_path / "out" / "compare.json").read_text())
    assert rec["interrupted"] == "interrupted by SIGTERM"
    assert "mixed" not in rec["configs"]["disagg"]["parts"]   # the stopped sweep is no measurement
