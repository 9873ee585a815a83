"""Sections, their time caps, and the report (the statuses and format are in the package docstring).

A section is a function ``run(ctx, rec)`` that fills the dict ``rec`` with what it found as it
goes (so a section stopped part way still reports what it measured) and returns normally
(pass), or raises :class:`Unsupported`, :class:`NotImplementedHook`, :class:`OutOfTime` (its
own cap reached: skipped-for-time, with ``rec`` as far as it got), or anything else (fail, with
the exception). Caps are cooperative (``ctx.check_time()`` between units of work); a section
that hangs past its cap by ``GRACE_S`` is ended by the watchdog, which writes the report with
that section failed and the rest skipped-for-time, then exits the process with status 3.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Section", "Ctx", "Unsupported", "NotImplementedHook", "OutOfTime", "run_sections",
           "STATUSES"]

STATUSES = ("pass", "fail", "unsupported", "skipped-for-time", "not-implemented")
GRACE_S = 20.0


class Unsupported(Exception):
    """The machine cannot do this (no CUDA; CUDA IPC inside a VM): its own result."""


class NotImplementedHook(Exception):
    """A hook section whose owner has not filled it in yet."""


class OutOfTime(Exception):
    """The section's cap (or the run's budget) is reached."""


@dataclass
class Ctx:
    """What every section gets: where it runs, scratch space, shared state and the clock."""

    device: str  # "cuda" or "cpu"
    selftest: bool  # tiny sizes on CPU (--cpu-selftest)
    work: Path  # scratch: generated checkpoints, daemon files
    out: Path  # the report, the log, files sections write
    log_file: Any
    shared: dict[str, Any] = field(default_factory=dict)  # checkpoints, the store daemon
    cleanups: list[Callable[[], None]] = field(default_factory=list)
    deadline: float = 0.0  # this section's (monotonic)

    def log(self, msg: str) -> None:
        line = f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def check_time(self, what: str = "") -> None:
        if self.left() <= 0:
            raise OutOfTime(f"cap reached{': ' + what if what else ''}")

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


@dataclass
class Section:
    name: str
    cap_s: float
    run: Callable[[Ctx, dict[str, Any]], None]
    cuda_only: bool = False  # on CPU: unsupported, no CUDA
    doc: str = ""


class _Report:
    def __init__(self, path: Path, head: dict[str, Any], sections: list[Section]) -> None:
        self.path, self.head = path, head
        self.rows: list[dict[str, Any]] = [
            {"name": s.name, "status": "skipped-for-time", "cap_s": s.cap_s, "seconds": 0.0,
             "reason": "not reached", "doc": s.doc, "details": {}} for s in sections]
        self.lock = threading.Lock()
        self.t0 = time.monotonic()

    def set(self, i: int, **kw: Any) -> None:
        with self.lock:
            self.rows[i].update(kw)
            self.write()

    def write(self) -> None:
        counts = {s: sum(r["status"] == s for r in self.rows) for s in STATUSES}
        doc = {**self.head, "elapsed_s": round(time.monotonic() - self.t0, 1),
               "summary": counts, "sections": self.rows}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=2, default=str) + "\n")
        os.replace(tmp, self.path)


def _watchdog(report: _Report, ctx: Ctx, current: list[int], stop: threading.Event,
              hard_deadline: float) -> None:
    while not stop.wait(1.0):
        now = time.monotonic()
        if current[0] >= 0 and (now > ctx.deadline + GRACE_S or now > hard_deadline):
            i = current[0]
            report.set(i, status="fail", reason=f"hung past its cap by {GRACE_S:.0f} s: ended "
                       "by the watchdog", seconds=round(now - report.t0, 1))
            ctx.log(f"section {report.rows[i]['name']} hung past its cap; writing the report, exiting")
            for fn in reversed(ctx.cleanups):
                try:
                    fn()
                except Exception:  # noqa: BLE001 - exiting anyway
                    pass
            os._exit(3)


def run_sections(sections: list[Section], ctx: Ctx, budget_s: float,
                 head: dict[str, Any]) -> dict[str, Any]:
    """Run ``sections`` in order within ``budget_s``; the report (also written to
    ``ctx.out/gpu_check.json`` after every section)."""
    head = {**head, "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "budget_s": budget_s}
    report = _Report(ctx.out / "gpu_check.json", head, sections)
    report.write()
    end = time.monotonic() + budget_s
    current = [-1]
    stop = threading.Event()
    ctx.deadline = end
    dog = threading.Thread(target=_watchdog, args=(report, ctx, current, stop, end + GRACE_S),
                           daemon=True, name="gpu-check-watchdog")
    dog.start()
    try:
        for i, s in enumerate(sections):
            left = end - time.monotonic()
            rec: dict[str, Any] = {}
            if s.cuda_only and not ctx.cuda:
                report.set(i, status="unsupported", reason="no CUDA on this machine")
                ctx.log(f"{s.name}: unsupported (no CUDA)")
                continue
            if left < min(s.cap_s, 5.0):
                report.set(i, status="skipped-for-time", reason=f"{left:.0f} s of the budget left")
                ctx.log(f"{s.name}: skipped for time ({left:.0f} s left)")
                continue
            cap = min(s.cap_s, left)
            ctx.deadline = time.monotonic() + cap
            current[0] = i
            ctx.log(f"{s.name}: start (cap {cap:.0f} s)")
            t0 = time.monotonic()
            status, reason = "pass", ""
            try:
                s.run(ctx, rec)
            except Unsupported as e:
                status, reason = "unsupported", str(e)
            except NotImplementedHook as e:
                status, reason = "not-implemented", str(e)
            except OutOfTime as e:
                status, reason = "skipped-for-time", str(e)
            except Exception as e:  # noqa: BLE001 - a failed section is a result, not the end
                status, reason = "fail", f"{type(e).__name__}: {e}"
                rec["traceback"] = traceback.format_exc(limit=12)
            current[0] = -1
            seconds = round(time.monotonic() - t0, 1)
            report.set(i, status=status, reason=reason, seconds=seconds, cap_s=round(cap, 1),
                       details=rec)
            ctx.log(f"{s.name}: {status} in {seconds} s{' (' + reason + ')' if reason else ''}")
            if status == "fail" and "traceback" in rec:
                ctx.log(rec["traceback"])
    finally:
        stop.set()
        for fn in reversed(ctx.cleanups):
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - report and go on cleaning
                ctx.log(f"cleanup failed: {e}")
        report.write()
    return json.loads(report.path.read_text())
