"""How a benchmark reports: the machine it ran on, its record, its figures.

- :func:`machine_info`: the ``"machine"`` of every record (platform, Python, processor, CPU
  count, the CPUs this process may run on), plus what a benchmark adds (torch threads, device);
- :func:`emit`: the record as one JSON line on stdout, and in full as a JSON file when a path
  is given (a benchmark may print a brief of it, the file keeping everything);
- :func:`pyplot` / :func:`save_figure`: matplotlib on its Agg backend (no display), imported
  only when a figure is drawn, and a figure written as a PNG and closed.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

__all__ = ["machine_info", "write_json", "emit", "pyplot", "save_figure"]


def machine_info(**extra: Any) -> dict[str, Any]:
    """Where the benchmark ran; ``extra`` adds to it."""
    return {"platform": _platform(), "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "client_cpus": sorted(os.sched_getaffinity(0)),
            "processor": _processor(), **extra}


def _platform() -> str:
    """``platform.platform()``'s string (e.g. ``Linux-6.1.0-x86_64-with-glibc2.36``), built
    without asking ``platform.uname()`` for its processor: on Linux that runs ``uname -p``, a
    child process (so would ``platform.processor()``)."""
    u = os.uname()
    libc, version = platform.libc_ver()
    return "-".join(x for x in (u.sysname, u.release, u.machine) if x) + (f"-with-{libc}{version}" if libc else "")


def _processor() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else the machine type (see :func:`_platform`)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.machine()


def write_json(path: Path | str, record: Any) -> None:
    """``record`` as indented JSON at ``path``, its directory made."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")


def emit(record: dict[str, Any], path: Path | str | None = None, line: dict[str, Any] | None = None) -> None:
    """Write ``record`` to ``path`` (if given), then print one JSON line: ``line`` (a brief of
    the record) or the record itself."""
    if path is not None:
        write_json(path, record)
    print(json.dumps(record if line is None else line), flush=True)


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path | str, dpi: int = 110) -> None:
    """Write ``fig`` to ``path`` (PNG) and close it."""
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
