"""Every benchmark runs one way, ``python -m benchmarks.NAME`` from the repository root, and the
docs show that way; every flag of every benchmark has a help text."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_help import flags_without_help

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = sorted(p.stem for p in (REPO / "benchmarks").glob("*.py")
                    if 'if __name__ == "__main__":' in p.read_text())
# A benchmark run as a file path (python benchmarks/x.py), the form that fails for some of them.
PATH_FORM = re.compile(r"python3?\s+(?:\S*/)?benchmarks/\w+\.py")


def test_the_benchmarks_are_found():
    assert {"store_bench", "router_bench", "engine_bench", "serve_bench", "sweep", "compare"} <= set(BENCHMARKS)


@pytest.mark.parametrize("name", BENCHMARKS)
def test_help_the_documented_way(name):
    r = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "--help"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith(f"usage: python -m benchmarks.{name}")


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_flag_has_help(name):
    module = importlib.import_module(f"benchmarks.{name}")
    assert flags_without_help(module.build_parser()) == []


def test_docs_show_the_module_form():
    docs = [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "benchmarks").rglob("*.py"),
            *(REPO / "benchmarks").rglob("*.sh"), *(REPO / "scripts").glob("*.sh")]
    found = {str(p.relative_to(REPO)): PATH_FORM.findall(p.read_text()) for p in docs}
    assert {k: v for k, v in found.items() if v} == {}
    listed = (REPO / "benchmarks" / "__init__.py").read_text()
    assert [n for n in BENCHMARKS if f"python -m benchmarks.{n} " not in listed] == []
