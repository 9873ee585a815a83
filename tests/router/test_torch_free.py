"""The router and the shared engine modules it uses never import torch."""

from __future__ import annotations

import subprocess
import sys


def test_router_does_not_import_torch() -> None:
    code = (
        "import sys, router, router.http.app, router.placement.orchestrator, router.workers.pool, "
        "engine.api.tokenizer, engine.api.generate, engine.api.events\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
