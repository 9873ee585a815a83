"""The package metadata a new user installs from: Pythons and torch it admits, its extras, one
version that ``--version`` and ``__version__`` report, and a wheel that installs and imports
with ``--no-deps`` (as on a GPU machine whose torch and CUDA are already there)."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def requirements(extra: str | None = None) -> dict[str, Requirement]:
    reqs = PROJECT["dependencies"] if extra is None else PROJECT["optional-dependencies"][extra]
    return {r.name: r for r in map(Requirement, reqs)}


def test_python_311_and_newer():
    spec = SpecifierSet(PROJECT["requires-python"])
    assert all(v in spec for v in ("3.11", "3.12", "3.13", "3.14")) and "3.10" not in spec


def test_no_exact_pins_in_the_metadata():
    # The CPU torch pin of the test machines is scripts/setup.sh's business, not the package's.
    groups = [None, *PROJECT["optional-dependencies"]]
    pinned = [str(r) for g in groups for r in requirements(g).values()
              if any(s.operator in ("==", "===") for s in r.specifier)]
    assert pinned == []


def test_torch_of_the_gpu_machines_and_of_setup():
    torch = requirements("engine")["torch"]
    assert torch.specifier.contains("2.11.0") and torch.specifier.contains("2.13.0")
    assert 'torch==2.13.0' in (REPO / "scripts" / "setup.sh").read_text()


def test_cuda_12_and_13_extras():
    extras = PROJECT["optional-dependencies"]
    assert set(requirements("ucx-cu12")) == {"ucxx-cu12"} and set(requirements("ucx-cu13")) == {"ucxx-cu13"}
    assert set(requirements("cuda12")) == {"cupy-cuda12x"} and set(requirements("cuda13")) == {"cupy-cuda13x"}
    assert "ucx" not in extras and "cuda" not in extras


def test_the_checkers_come_with_the_test_extra():
    assert {"pyright", "import-linter"} <= set(requirements("test"))


def test_one_version_everywhere():
    from importlib.metadata import version

    import engine
    import kvstore
    import router

    assert kvstore.__version__ == engine.__version__ == router.__version__ == version("kvcache-store")
    assert kvstore.__version__ == PROJECT["version"]


@pytest.mark.usefixtures("procs")  # starts processes: the integration tier
def test_wheel_installs_without_deps_and_imports(tmp_path):
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(wheels), str(REPO)], check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("kvcache_store-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                    str(wheel)], check=True, capture_output=True, timeout=300)
    code = ("import sys, kvstore, engine, router; "
            "assert 'torch' not in sys.modules and 'fastapi' not in sys.modules, sorted(sys.modules); "
            "assert kvstore.__file__.startswith(sys.argv[1]), kvstore.__file__; "
            "print(kvstore.__version__, engine.__version__, router.__version__)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(target)}
    r = subprocess.run([sys.executable, "-c", code, str(target)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == [PROJECT["version"]] * 3
    # the engine's C kernel source travels with it (engine/model/native.py builds it on first use)
    assert (target / "engine" / "model" / "csrc" / "paged_decode.c").is_file()
    # the planner's data: the Mooncake trace with its licence, the GPU profiles with their sources
    assert (target / "planner" / "data" / "mooncake_synthetic_trace.jsonl").is_file()
    assert (target / "planner" / "data" / "LICENSE").is_file()
    assert (target / "planner" / "profiles" / "a100_vidur_llama3_8b.json").is_file()
    assert (target / "planner" / "profiles" / "LICENSE.vidur").is_file()
