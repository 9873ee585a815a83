"""The four commands as a new user meets them: ``--version`` on each, and a help text on every
flag of every subcommand (parsers built without side effects)."""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_help import flags_without_help

REPO = Path(__file__).resolve().parents[1]
COMMANDS = {"kvstore": "kvstore.daemon.cli", "kvengine": "engine.worker.cli", "kvrouter": "router.cli",
            "kvplan": "planner.cli"}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_of_every_subcommand_has_help(command):
    import importlib

    module = importlib.import_module(COMMANDS[command])
    handlers, sigterm = list(logging.getLogger().handlers), signal.getsignal(signal.SIGTERM)
    parser = module.build_parser()
    assert (list(logging.getLogger().handlers), signal.getsignal(signal.SIGTERM)) == (handlers, sigterm)
    assert parser.prog == command
    assert flags_without_help(parser) == []
    # Every subcommand's --help renders (a stray '%' in a help text makes argparse raise).
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for sub in (p for a in subs for p in a.choices.values()):
        assert "--help" in sub.format_help()


@pytest.mark.usefixtures("procs")  # starts processes: the integration tier
@pytest.mark.parametrize("command", COMMANDS)
def test_version(command):
    from importlib.metadata import version

    script = Path(sys.executable).with_name(command)  # the console script pip installed
    argv = [str(script)] if script.exists() else [sys.executable, "-m", COMMANDS[command]]
    r = subprocess.run([*argv, "--version"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == f"{command} {version('kvcache-store')}"


def test_flags_without_help_finds_them():
    import argparse

    p = argparse.ArgumentParser(prog="x")
    p.add_argument("--documented", help="yes")
    sub = p.add_subparsers(dest="cmd")
    s = sub.add_parser("run")
    s.add_argument("--bare")
    s.add_argument("target")
    assert flags_without_help(p) == ["x run (the subcommand)", "x run --bare", "x run target"]


@pytest.mark.usefixtures("procs")  # starts processes: the integration tier
@pytest.mark.parametrize("command", ["stats", "bench"])
def test_kvstore_timeout_bounds_a_silent_daemon(command):
    # A listener that never answers the handshake: --timeout, not the 5 s default, ends the wait.
    import socket
    import time

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "kvstore.daemon.cli", command, address, "--timeout", "0.5"],
                           capture_output=True, text=True, timeout=60, cwd=REPO)
        elapsed = time.monotonic() - t0
    assert r.returncode == 1 and "StoreUnavailable" in r.stderr, r.stderr[-2000:]
    assert elapsed < 4.0
