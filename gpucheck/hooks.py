"""Hook sections filled in by other modules: the CUDA IPC check, the planner's profile.

- ``cuda_ipc``: runs ``gpucheck.ipc.run(ctx, rec)`` when that module exists (the
  transports issue adds it: CUDA tensors between two processes through the store without a
  host copy). Until then the section is ``not-implemented``. A machine that cannot map another
  process's CUDA memory (IPC inside some VMs) should raise ``Unsupported`` from there: its own
  result, neither pass nor fail.
- ``profile``: ``kvengine profile --quick --device cuda`` (``python -m engine.worker.cli
  profile``) on the SmolLM2-shaped random checkpoint, then, if the section's time still allows,
  on a Llama-3-8B-shaped one (written in bfloat16 here, 16 GB); each profile file is written
  into the check's output directory. A profile cut off by the cap is skipped-for-time.
"""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpucheck import models
from gpucheck.runner import Ctx, NotImplementedHook, OutOfTime
from gpucheck.store import REPO

__all__ = ["cuda_ipc", "profile", "profile_argv"]

LLAMA3_8B_MIN_S = 150.0  # generating, writing and profiling the 8B shape takes about this long


def cuda_ipc(ctx: Ctx, rec: dict[str, Any]) -> None:
    if importlib.util.find_spec("gpucheck.ipc") is None:
        raise NotImplementedHook("no CUDA IPC check: "
                                 "gpucheck/ipc.py is missing with run(ctx, rec)")
    importlib.import_module("gpucheck.ipc").run(ctx, rec)


def profile_argv(model_dir: Path, device: str, out: Path, selftest: bool) -> list[str]:
    """The ``kvengine profile`` command the section runs."""
    argv = [sys.executable, "-m", "engine.worker.cli", "profile", "--model", str(model_dir),
            "--device", device, "--quick", "--no-progress", "--out", str(out)]
    return argv + (["--chunk", "32"] if selftest else [])


def _profile_one(ctx: Ctx, rec: dict[str, Any], name: str, dtype: str) -> None:
    model_dir = models.shaped(ctx, name, dtype)
    out = ctx.out / f"profile_{name}.json"
    argv = profile_argv(model_dir, ctx.device, out, ctx.selftest)
    t0 = time.monotonic()
    try:
        r = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=max(1.0, ctx.left()))
    except subprocess.TimeoutExpired:
        rec[name] = {"status": "skipped-for-time", "seconds": round(time.monotonic() - t0, 1)}
        raise OutOfTime(f"kvengine profile of {name} did not finish in the cap") from None
    rec[name] = {"returncode": r.returncode, "seconds": round(time.monotonic() - t0, 1),
                 "summary": r.stdout.strip().splitlines()[-12:], "profile": str(out)}
    if r.returncode != 0:
        rec[name]["stderr"] = r.stderr[-3000:]
        raise RuntimeError(f"kvengine profile of {name} exited with {r.returncode}")
    ctx.log(f"  profile {name}: {rec[name]['seconds']} s, wrote {out.name}")


def profile(ctx: Ctx, rec: dict[str, Any]) -> None:
    _profile_one(ctx, rec, "smollm2-135m", "float32")
    if ctx.selftest:
        rec["llama3-8b"] = "not run under --cpu-selftest"
        return
    if ctx.left() < LLAMA3_8B_MIN_S:
        rec["llama3-8b"] = f"skipped-for-time: {ctx.left():.0f} s left, needs about {LLAMA3_8B_MIN_S:.0f}"
        return
    _profile_one(ctx, rec, "llama3-8b", "bfloat16")
