"""The engine's import contracts at run time, where import-linter cannot look: importing a
package's submodule runs the package's ``__init__`` too, and what that pulls in is loaded."""

from __future__ import annotations

import subprocess
import sys

import pytest

# engine.model and engine.core know nothing of HTTP or etcd (pyproject.toml's contract).
_HTTP_OR_ETCD = ("httpx", "aiohttp", "fastapi", "starlette", "uvicorn", "router",
                 "kvstore.coord", "kvstore.daemon", "kvstore.client", "kvstore.net", "engine.kv",
                 "engine.worker")


@pytest.mark.usefixtures("procs")  # starts processes: the integration tier
def test_model_and_core_load_nothing_of_http_or_etcd() -> None:
    code = (
        "import sys, engine.model.runner, engine.model.convert, engine.core.llm_engine\n"
        f"bad = sorted(m for m in sys.modules if m.startswith({_HTTP_OR_ETCD!r}))\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
