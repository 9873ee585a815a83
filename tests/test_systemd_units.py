"""The systemd units of deploy/systemd/, rendered with this checkout's .venv by
deploy/render_units.py, pass ``systemd-analyze verify`` (which also checks that every
ExecStart= binary exists), keep their hardening (``systemd-analyze security --offline``), and
the example env files hold flags the commands accept. Skips only where systemd-analyze is
missing (Debian's ``systemd`` package, installed by scripts/setup.sh), and fails then under
CI=true."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RENDER = REPO / "deploy" / "render_units.py"
ENV_DIR = REPO / "deploy" / "systemd" / "env"
UNITS = ("kvstore.service", "kvengine@.service", "kvrouter.service")
ANALYZE = shutil.which("systemd-analyze")


def _need_analyze() -> str:
    if ANALYZE is None:
        reason = "no systemd-analyze (Debian's systemd package; scripts/setup.sh installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return ANALYZE


def _render(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(RENDER), "--out", str(out), *args],
                          capture_output=True, text=True, timeout=30, cwd=REPO)


@pytest.fixture
def rendered(tmp_path: Path, procs) -> Path:
    r = _render(tmp_path, "--prefix", sys.prefix)
    assert r.returncode == 0, r.stderr
    return tmp_path


def test_rendered_units_pass_systemd_analyze_verify(rendered: Path):
    analyze = _need_analyze()
    # A template is verified as itself and as an instance, the way systemctl starts it.
    shutil.copy(rendered / "kvengine@.service", rendered / "kvengine@prefill-0.service")
    for name in (*UNITS, "kvengine@prefill-0.service"):
        text = (rendered / name).read_text()
        assert not re.search(r"@[A-Z_]+@", text), name
        exe = re.search(r"^ExecStart=(\S+)", text, re.M)
        assert exe and Path(exe.group(1)).is_file() and exe.group(1).startswith(sys.prefix), name
        r = subprocess.run([analyze, "verify", str(rendered / name)], capture_output=True,
                           text=True, timeout=60)
        # Unknown keys or bad values are warnings with exit 0: any output at all fails.
        assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), (name, r.stdout + r.stderr)


@pytest.mark.usefixtures("procs")  # starts processes: the integration tier
def test_verify_catches_a_missing_binary(tmp_path: Path):
    analyze = _need_analyze()
    prefix = tmp_path / "venv"
    (prefix / "bin").mkdir(parents=True)
    r = _render(tmp_path / "units", "--prefix", str(prefix))
    assert r.returncode == 2 and "no kvstore, kvengine, kvrouter" in r.stderr
    assert _render(tmp_path / "units", "--prefix", str(prefix), "--no-check").returncode == 0
    r = subprocess.run([analyze, "verify", str(tmp_path / "units" / "kvstore.service")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "not executable" in r.stdout + r.stderr


def test_units_keep_their_hardening(rendered: Path):
    analyze = _need_analyze()
    shutil.copy(rendered / "kvengine@.service", rendered / "kvengine@prefill-0.service")
    for name, most in (("kvstore.service", 2.5), ("kvengine@prefill-0.service", 3.5),
                       ("kvrouter.service", 2.5)):
        r = subprocess.run([analyze, "security", "--offline=yes", str(rendered / name)],
                           capture_output=True, text=True, timeout=60)
        m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", r.stdout + r.stderr)
        assert m, r.stdout[-2000:] + r.stderr[-2000:]
        assert float(m.group(1)) <= most, (name, m.group(1))
        text = (rendered / name).read_text()
        for line in ("NoNewPrivileges=yes", "ProtectSystem=strict", "Restart=on-failure",
                     "LimitNOFILE=65536", "CapabilityBoundingSet=", "User=kvcache",
                     "LoadCredential=cluster-secret:/etc/kvcache/cluster-secret"):
            assert f"\n{line}\n" in text, (name, line)


@pytest.mark.usefixtures("procs")  # starts processes: the integration tier
def test_prefix_under_home_is_read_only_not_hidden(tmp_path: Path):
    r = _render(tmp_path, "--prefix", "/home/someone/venv", "--no-check", "--user", "svc")
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "kvstore.service").read_text()
    assert "\nProtectHome=read-only\n" in text and "\nUser=svc\nGroup=svc\n" in text
    assert "\nExecStart=/home/someone/venv/bin/kvstore serve $KVSTORE_ARGS\n" in text


def _args(env_file: str, var: str) -> list[str]:
    text = (ENV_DIR / env_file).read_text()
    m = re.search(rf'^{var}="([^"]*)"$', text, re.M)
    assert m, (env_file, var)
    return shlex.split(m.group(1))


def test_example_env_files_hold_flags_the_commands_take():
    from engine.worker.cli import build_parser as engine_parser
    from kvstore.daemon.cli import build_parser as store_parser
    from router.cli import build_parser as router_parser

    store = store_parser().parse_args(["serve", *_args("kvstore.env", "KVSTORE_ARGS")])
    assert store.host == "0.0.0.0" and "," in store.etcd
    for name in ("kvengine-prefill-0.env", "kvengine-decode-0.env"):
        worker = engine_parser().parse_args(["serve", "--worker-id", "h-x",
                                             *_args(name, "KVENGINE_ARGS")])
        assert worker.role in name and worker.advertise_host
    router = router_parser().parse_args(["serve", *_args("kvrouter.env", "KVROUTER_ARGS")])
    assert router.port == 8000


def _flags(parser) -> set[str]:
    import argparse

    out: set[str] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= _flags(sub)
        out |= {o for o in action.option_strings if o.startswith("--")}
    return out


def test_every_flag_in_docs_deployment_exists():
    """docs/deployment.md names only flags some command takes (ours, the renderer's, the
    benchmark's, or those of etcd, useradd, systemctl... in its examples)."""
    import importlib.util

    from benchmarks.store.store_bench import build_parser as bench_parser
    from engine.worker.cli import build_parser as engine_parser
    from kvstore.daemon.cli import build_parser as store_parser
    from router.cli import build_parser as router_parser

    spec = importlib.util.spec_from_file_location("render_units", RENDER)
    assert spec and spec.loader
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    known = set().union(*(_flags(p()) for p in (store_parser, engine_parser, router_parser,
                                                 bench_parser, render.build_parser)))
    others = {"--name", "--data-dir", "--listen-client-urls", "--advertise-client-urls",  # etcd
              "--system", "--home-dir", "--shell",                                       # useradd
              "--now", "--offline",                                 # systemctl, systemd-analyze
              "--default"}                                          # python -m engine.model.convert
    text = (REPO / "docs" / "deployment.md").read_text()
    used = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))
    assert sorted(used - known - others) == []
