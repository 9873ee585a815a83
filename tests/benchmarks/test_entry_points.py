"""Every runnable module of ``benchmarks/`` and ``gpucheck/`` runs one way, ``python -m NAME``
from the repository root, answers ``--help`` with its usage, and has a help text on every flag;
every command and module the docs name exists (no old name left behind, no shim)."""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("benchmarks", "gpucheck")
# Runnable, but not commands: drivers run as files by another project's Python (their own
# venvs; benchmarks/peers/__init__.py), and a section's child that the section starts itself.
NOT_COMMANDS = {"benchmarks.peers.mooncake_driver", "benchmarks.peers.dynamo_driver", "gpucheck.ucx_cuda"}
MAIN_GUARD = re.compile(r'^if __name__ == "__main__":', re.M)


def _modules() -> dict[str, Path]:
    """Every module of the packages (a package by its ``__init__.py``), name -> file."""
    mods = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            if not all((REPO / Path(*parts[:i]) / "__init__.py").exists() for i in range(1, len(parts))):
                continue   # not inside a package
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


MODULES = _modules()
RUNNABLE = sorted(
    name.removesuffix(".__main__") if name.endswith(".__main__") else name
    for name, path in MODULES.items()
    if (name.endswith(".__main__") or MAIN_GUARD.search(path.read_text())) and name not in NOT_COMMANDS)

# Each module under runpy in one child process (one interpreter start and one import of torch
# for all of them, not one per module): its ``--help``, and the flags of its ``build_parser()``
# that have no help text.
_CHECK_ALL = r"""
import contextlib, importlib, io, json, runpy, sys, warnings
from tests.cli_help import flags_without_help
warnings.simplefilter("ignore")
out = {}
for name in sys.argv[1:]:
    buf = io.StringIO()
    sys.argv = [name, "--help"]
    code = 0
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
            runpy.run_module(name, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:
        code, buf = -1, io.StringIO(f"{type(e).__name__}: {e}")
    module = importlib.import_module(name)
    parser = getattr(module, "build_parser", None)
    out[name] = {"code": code, "help": buf.getvalue(),
                 "no_help": flags_without_help(parser()) if parser else None}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def checked(module_procs) -> dict[str, dict]:
    r = module_procs.run([sys.executable, "-c", _CHECK_ALL, *RUNNABLE], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_runnable_modules_are_found():
    assert {"benchmarks.store.store_bench", "benchmarks.serving.router_bench", "benchmarks.serving.serve_bench",
            "benchmarks.serving.sweep", "benchmarks.serving.compare", "benchmarks.chaos.chaos_bench",
            "benchmarks.planner.sim_fidelity", "benchmarks.peers.lmcache_bench", "gpucheck"} <= set(RUNNABLE)
    assert NOT_COMMANDS <= set(MODULES), "a module of NOT_COMMANDS was moved or removed: update it"
    # Nothing runnable is left at the top of benchmarks/: every benchmark belongs to a subject.
    assert [n for n in RUNNABLE if n.count(".") == 1 and n.startswith("benchmarks.")] == []


@pytest.mark.parametrize("name", RUNNABLE)
def test_help_the_documented_way(checked, name):
    got = checked[name]
    assert got["code"] == 0, got["help"][-2000:]
    assert got["help"].startswith(f"usage: python -m {name}"), got["help"][:300]


@pytest.mark.parametrize("name", RUNNABLE)
def test_every_flag_has_help(checked, name):
    assert checked[name]["no_help"] in (None, [])


# ----------------------------------------------------------------------------- the docs
# A module named in prose or a command: benchmarks.x.y / gpucheck.x (not vllm.benchmarks.serve,
# nor tests/benchmarks/, nor docs/benchmarks.md).
DOTTED = re.compile(r"(?<![\w./-])((?:benchmarks|gpucheck)(?:\.\w+)+)")
COMMAND = re.compile(r"python3?\s+-m\s+((?:benchmarks|gpucheck)(?:\.\w+)*)")
PATH = re.compile(r"(?<![\w./-])((?:benchmarks|gpucheck)/[\w/.-]*?\.(?:py|sh))\b")
# A benchmark run as a file path (python benchmarks/x.py), the form that fails for some of them.
PATH_FORM = re.compile(r"python3?\s+(?:\S*/)?benchmarks/[\w/]+\.py")
NOT_NAMES = {"md", "json", "jsonl", "png", "py", "sh", "txt"}


def _docs() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "scripts").glob("*.sh")),
            *sorted((REPO / "benchmarks").rglob("*.sh"))]


def _sources() -> list[Path]:
    return [p for d in ("benchmarks", "gpucheck", "kvstore", "engine", "router", "planner", "tests", "deploy")
            for p in sorted((REPO / d).rglob("*")) if p.suffix in (".py", ".md", ".sh", ".yaml", ".yml")
            and p != Path(__file__).resolve()]


def _top_names(path: Path) -> set[str]:
    """The names a module defines at its top level (without importing it)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _resolves(dotted: str) -> bool:
    """``dotted`` is a module of the packages, or a module and a name it defines."""
    parts = dotted.split(".")
    if parts[-1] in NOT_NAMES or parts[-1].isupper():
        return True   # a file name (docs/benchmarks.md) or a placeholder (benchmarks.SUBJECT.NAME)
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        if module in MODULES:
            return i == len(parts) or parts[i] in _top_names(MODULES[module])
    return False


def test_every_command_in_the_docs_names_a_module_that_runs():
    named = {str(p.relative_to(REPO)): COMMAND.findall(p.read_text()) for p in _docs()}
    assert sum(map(len, named.values())) > 50
    wrong = {f: sorted({m for m in ms if m not in RUNNABLE and not m.rpartition(".")[2].isupper()})
             for f, ms in named.items()}
    assert {f: ms for f, ms in wrong.items() if ms} == {}


def test_every_module_and_file_named_exists():
    wrong: dict[str, list[str]] = {}
    for p in _docs() + _sources():
        text = p.read_text()
        bad = {m for m in DOTTED.findall(text) if not _resolves(m)}
        bad |= {f for f in PATH.findall(text) if not (REPO / f).exists()}
        if bad:
            wrong[str(p.relative_to(REPO))] = sorted(bad)
    assert wrong == {}


def test_docs_show_the_module_form():
    found = {str(p.relative_to(REPO)): PATH_FORM.findall(p.read_text()) for p in _docs() + _sources()}
    assert {k: v for k, v in found.items() if v} == {}


def test_the_package_lists_every_benchmark():
    listed = (REPO / "benchmarks" / "__init__.py").read_text()
    benchmarks = [n for n in RUNNABLE if n.startswith("benchmarks.")]
    assert [n for n in benchmarks if f"python -m {n} " not in listed] == []
