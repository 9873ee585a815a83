"""The architecture's rules, checked: the import contracts of pyproject.toml ([tool.importlinter],
static imports, lazy ones included) and, at run time, that the router and the wire layer it
uses load without torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.usefixtures("procs")  # starts processes: the integration tier
def test_import_contracts_hold() -> None:
    proc = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
                           "lint_imports_command()", "--no-cache"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout, proc.stdout


def test_import_contracts_are_not_vacuous() -> None:
    # A contract that names a module that does not exist checks nothing: every layer and
    # source module in the contracts must be a real package or module.
    import importlib.util
    import tomllib

    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    names = {m for c in contracts for m in c.get("layers", []) + c.get("source_modules", [])}
    missing = sorted(n for n in names if importlib.util.find_spec(n) is None)
    assert not missing, missing
    assert not any(c.get("ignore_imports") for c in contracts), "contracts hold without ignore rules"


@pytest.mark.usefixtures("procs")  # starts processes: the integration tier
def test_router_does_not_import_torch() -> None:
    code = (
        "import sys, router, router.http.app, router.placement.orchestrator, router.workers.pool, "
        "router.cluster.launcher, router.server_main, engine.api.tokenizer, engine.api.generate, "
        "engine.api.events, kvstore\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
