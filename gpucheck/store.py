"""One ``kvstore serve`` daemon on loopback for the whole check (direct address, no etcd).

``daemon(ctx)`` starts it on first use (``kvstore.daemon.local.start_local``: a child in its own
session, shared memory and TCP) and registers its stop with the run's cleanups.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from gpucheck.runner import Ctx

__all__ = ["daemon", "REPO"]

REPO = Path(__file__).resolve().parents[1]


def daemon(ctx: Ctx) -> str:
    """The daemon's ``host:port`` (started once per run)."""
    from kvstore.daemon.local import start_local, stop_local

    if "store" not in ctx.shared:
        memory = "96M" if ctx.selftest else "512M"
        proc, address = start_local(
            memory, cwd=REPO,
            popen=lambda argv, **kw: subprocess.Popen(argv, start_new_session=True, **kw))
        ctx.shared["store"] = address
        ctx.cleanups.append(lambda: stop_local(proc))
        ctx.log(f"store daemon at {address} ({memory})")
    return ctx.shared["store"]
