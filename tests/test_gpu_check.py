"""The GPU check's driver (gpucheck), here without a GPU.

The runner's statuses and caps on fake sections (in-process); then the real driver
under ``--cpu-selftest`` (tiny sizes on CPU) over the sections that need neither transformers
nor worker processes, which run in seconds: the CUDA-only ones must say unsupported, the others
pass, and the report and log must be written. The rest (greedy against transformers, the
figures against transformers, the disaggregated workers, the profile) take 20 s to minutes
here; their selftest runs by hand: ``python -m gpucheck --cpu-selftest``. The
``ucx_cuda`` section runs on its own under the selftest (a child process, ucxx over host
memory), as does the ``--ucx`` wheel list of scripts/gpu_wheels.sh.
"""

from __future__ import annotations

import ast
import json
import subprocess
import time
from pathlib import Path

import pytest

# Imported here, not in the tests: torch's import runs ldconfig (ctypes.util.find_library),
# which a fast-tier test may not start (tests/conftest.py).
from engine.worker.cli import build_parser as kvengine_parser
from gpucheck import ucx_cuda
from gpucheck.hooks import profile_argv
from gpucheck.runner import Ctx, NotImplementedHook, OutOfTime, Section, Unsupported, run_sections
from tests.cli_help import flags_without_help

REPO = Path(__file__).resolve().parents[1]
FAST = ["env", "triton_kernel", "staging", "gpu_tier", "client_cuda", "store_load", "vllm_layout", "cuda_ipc"]


def _ctx(tmp_path: Path, device: str = "cpu") -> Ctx:
    return Ctx(device=device, selftest=True, work=tmp_path, out=tmp_path,
               log_file=open(tmp_path / "gpu_check.log", "w"))


def test_the_runner_records_every_status_and_keeps_partial_results(tmp_path):
    cleaned: list[str] = []

    def ok(ctx, rec):
        rec["x"] = 1

    def bad(ctx, rec):
        rec["before"] = True
        assert 1 == 2, "it broke"

    def cannot(ctx, rec):
        raise Unsupported("CUDA IPC is not mapped in this VM")

    def hook(ctx, rec):
        raise NotImplementedHook("nobody filled this in")

    def slow(ctx, rec):
        rec["first"] = "measured"
        time.sleep(0.3)
        ctx.check_time("second half")
        rec["second"] = "never"

    ctx = _ctx(tmp_path)
    ctx.cleanups.append(lambda: cleaned.append("daemon"))
    sections = [Section("ok", 5, ok), Section("bad", 5, bad), Section("cannot", 5, cannot),
                Section("hook", 5, hook), Section("slow", 0.2, slow),
                Section("cuda_only", 5, ok, cuda_only=True), Section("late", 60, ok)]
    report = run_sections(sections, ctx, budget_s=10.0, head={"mode": "test"})
    rows = {r["name"]: r for r in report["sections"]}
    assert {n: r["status"] for n, r in rows.items()} == {
        "ok": "pass", "bad": "fail", "cannot": "unsupported", "hook": "not-implemented",
        "slow": "skipped-for-time", "cuda_only": "unsupported", "late": "pass"}
    assert rows["ok"]["details"] == {"x": 1}
    assert rows["bad"]["details"]["before"] and "it broke" in rows["bad"]["reason"]
    assert "traceback" in rows["bad"]["details"]
    assert rows["slow"]["details"] == {"first": "measured"} and "second half" in rows["slow"]["reason"]
    assert rows["cuda_only"]["reason"] == "no CUDA on this machine"
    assert report["summary"] == {"pass": 2, "fail": 1, "unsupported": 2, "skipped-for-time": 1,
                                 "not-implemented": 1}
    assert cleaned == ["daemon"]
    assert json.loads((tmp_path / "gpu_check.json").read_text())["sections"] == report["sections"]


def test_a_section_that_no_longer_fits_the_budget_is_skipped(tmp_path):
    def eat(ctx, rec):
        time.sleep(0.6)

    report = run_sections([Section("eat", 5, eat), Section("next", 5, eat)], _ctx(tmp_path),
                          budget_s=5.3, head={})
    assert [r["status"] for r in report["sections"]] == ["pass", "skipped-for-time"]
    assert "budget left" in report["sections"][1]["reason"]


def test_out_of_time_is_raised_only_past_the_deadline(tmp_path):
    ctx = _ctx(tmp_path)
    ctx.deadline = time.monotonic() + 10
    ctx.check_time()
    ctx.deadline = time.monotonic() - 0.01
    with pytest.raises(OutOfTime, match="cap reached: here"):
        ctx.check_time("here")


def test_every_flag_has_help():
    from gpucheck.cli import build_parser

    assert flags_without_help(build_parser()) == []


@pytest.mark.integration  # starts the driver, which starts a store daemon
def test_the_cpu_selftest_runs_the_driver_end_to_end(tmp_path):
    """scripts/gpu_check.sh as a person runs it (here --cpu-selftest uses .venv: no wheels)."""
    out = tmp_path / "out"
    r = subprocess.run(["bash", "scripts/gpu_check.sh", "--cpu-selftest", "--out", str(out),
                        "--budget", "120", "--sections", *FAST], cwd=REPO, capture_output=True,
                       text=True, timeout=240)
    report = json.loads((out / "gpu_check.json").read_text())
    status = {s["name"]: s["status"] for s in report["sections"]}
    assert r.returncode == 0, (status, r.stdout[-4000:], r.stderr[-4000:])
    assert report["mode"] == "cpu-selftest" and list(status) == FAST
    assert status == {**{n: "pass" for n in FAST}, "triton_kernel": "unsupported", "cuda_ipc": "unsupported"}
    rows = {s["name"]: s["details"] for s in report["sections"]}
    assert rows["staging"]["auto"]["allocations_after_warmup"] == 0
    assert rows["store_load"]["ours_ms"] > 0 and rows["store_load"]["blocks"] == 16
    assert rows["client_cuda"]["tcp"] == {"found": [True] * 4, "equal": True}
    assert {rows["vllm_layout"][k]["chunks_per_block"] for k in ("flash_attn", "head_major")} == {4, 2}
    assert "summary: pass 6, unsupported 2" in (out / "gpu_check.log").read_text()
    assert ".venv/bin/python" in r.stdout  # the script's own line, before the driver's


def _wheel_list(name: str) -> list[str]:
    """The pins of the bash array ``name=( ... )`` in scripts/gpu_wheels.sh."""
    text = (REPO / "scripts" / "gpu_wheels.sh").read_text()
    body = text.split(f"\n{name}=(\n", 1)[1].split("\n)\n", 1)[0]
    return [line.strip() for line in body.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_the_wheel_list_pins_one_version_of_each_missing_package():
    pins = _wheel_list("WHEELS")
    names = [p.split("==")[0] for p in pins]
    assert all("==" in p for p in pins)
    assert len(names) == len(set(names)) and {"fastapi", "uvicorn", "pydantic", "lmdb"} <= set(names)
    assert (REPO / ".gitignore").read_text().count("/.gpu_wheels/") == 1


def test_the_ucx_wheel_list_is_ucxx_cuda13_closure_and_nothing_else():
    """``gpu_wheels.sh --ucx``: the six pinned wheels of ucxx's CUDA 13 closure (~51 MiB, a
    device run of their own), none of the check's other wheels, into their own ignored folder."""
    assert _wheel_list("UCX_WHEELS") == [
        "ucxx-cu13==0.52.0", "libucxx-cu13==0.52.0", "libucx-cu13==1.21.0", "rmm-cu13==26.10.0",
        "librmm-cu13==26.10.0", "rapids-logger==0.3.0"]
    text = (REPO / "scripts" / "gpu_wheels.sh").read_text()
    assert "--ucx) WHEELS=(\"${UCX_WHEELS[@]}\"); DEST=${GPU_WHEELS_DIR:-.gpu_wheels_ucx}" in text
    assert (REPO / ".gitignore").read_text().count("/.gpu_wheels_ucx/") == 1
    from gpucheck.cli import SECTIONS

    assert SECTIONS.index("ucx_cuda") == SECTIONS.index("cuda_ipc") + 1


def test_the_ucx_cuda_section_says_how_to_get_ucxx_where_it_is_missing(tmp_path, monkeypatch):
    import sys

    with pytest.raises(Unsupported, match="no CUDA"):
        ucx_cuda.run(Ctx(device="cpu", selftest=False, work=tmp_path, out=tmp_path, log_file=None), {})
    monkeypatch.setitem(sys.modules, "ucxx._lib.libucxx", None)  # import fails, as in the image
    with pytest.raises(Unsupported, match=r"gpu_wheels\.sh --ucx.*GPU_WHEELS_DIR=\.gpu_wheels_ucx"):
        ucx_cuda.run(_ctx(tmp_path), {})


@pytest.mark.usefixtures("procs")  # starts the sending child process: the integration tier
def test_the_ucx_cuda_section_moves_seeded_blocks_between_processes_under_the_selftest(tmp_path):
    """The whole protocol on host memory with the CUDA 12 ucxx .venv holds: a child, its
    endpoint to this process's worker, tagged messages, the bit-exact check, the timing."""
    from kvstore.net import ucx

    if ucx.available() is not None:
        pytest.skip(ucx.available())
    ctx = _ctx(tmp_path)
    report = run_sections([Section("ucx_cuda", 40, ucx_cuda.run)], ctx, budget_s=60.0, head={})
    row = report["sections"][0]
    assert row["status"] == "pass", (row["reason"], row["details"].get("traceback"))
    rec = row["details"]
    assert rec["blocks"] == ucx_cuda.SELFTEST_BLOCKS and rec["memory"].startswith("host")
    assert rec["bit_exact"] is True and rec["bit_exact_after_timing"] is True
    assert all(rec[k] > 0 for k in ("ucx_s", "ucx_gbps", "d2d_s", "d2d_gbps", "ucx_over_d2d"))
    assert rec["child_exit"] == 0 and rec["ucx_proto_lines"] and rec["ucx_transports"]["host"]


def test_the_ucx_cuda_section_reads_the_transports_from_ucxs_protocol_tables():
    lines = ["| ucp_context_0 intra-node cfg#0 | tagged message by ucp_tag_send* from host memory |",
             "|                 0 | eager short                                | tcp/lo |",
             "|        16353..inf | (?) rendezvous fragmented copy-in copy-out | tcp/lo |",
             "| ucp_context_0 intra-node cfg#1 | tagged message by ucp_tag_send* from cuda/GPU0 |",
             "|            0..8K | eager copy-in | cuda_copy/cuda |",
             "|           8K..inf | rendezvous zero-copy read from remote | 50% on cuda_ipc/cuda and "
             "50% on rc_mlx5/mlx5_0:1 |"]
    assert ucx_cuda._transports(lines) == {"host": ["tcp"], "cuda": ["cuda_copy", "cuda_ipc", "rc_mlx5"]}


# Tests that name CUDA without needing it: they check what happens where CUDA is absent.
NEEDS_NO_GPU = {("tests/engine/test_loader.py", "test_dtype_and_device_resolution"),
                ("tests/test_gpu_check.py", "test_the_profile_hook_runs_kvengine_profile_with_flags_it_takes"),
                # names a CUDA device (torch.device("cuda", 0)) to ask the split heuristic; allocates nothing
                ("tests/engine/test_triton_attention.py",
                 "test_splits_fill_the_multiprocessors_only_where_pairs_are_few")}


def _uses_cuda(node: ast.AST) -> bool:
    """Puts something on CUDA: ``x.cuda()``, ``device="cuda..."``, ``.to("cuda...")``, a
    ``run_cases("cuda")``-style argument, or a ``torch.cuda`` call other than is_available()."""
    def is_cuda(n: ast.AST) -> bool:
        return isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.split(":")[0] == "cuda"

    for n in ast.walk(node):
        if not isinstance(n, ast.Call):
            continue
        f = n.func
        if isinstance(f, ast.Attribute) and f.attr == "cuda":
            return True
        if any(is_cuda(a) for a in n.args) or any(k.arg == "device" and is_cuda(k.value) for k in n.keywords):
            return True
        if (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Attribute) and f.value.attr == "cuda"
                and f.attr != "is_available"):
            return True
    return False


def _marked_gpu(fn: ast.FunctionDef) -> bool:
    return any("mark.gpu" in ast.unparse(d) for d in fn.decorator_list)


def test_every_test_that_uses_cuda_is_marked_gpu():
    """The ``gpu`` marker (pyproject.toml) on every test that touches CUDA, so ``-m gpu`` runs
    them all on a GPU machine and each skips, naming CUDA, elsewhere."""
    unmarked = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        rel = str(path.relative_to(REPO))
        for fn in ast.walk(ast.parse(path.read_text())):
            if (isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_") and _uses_cuda(fn)
                    and not _marked_gpu(fn) and (rel, fn.name) not in NEEDS_NO_GPU):
                unmarked.append(f"{rel}::{fn.name}")
    assert unmarked == []


def test_the_profile_hook_runs_kvengine_profile_with_flags_it_takes(tmp_path):
    argv = profile_argv(tmp_path / "m", "cuda", tmp_path / "p.json", selftest=False)
    assert argv[1:4] == ["-m", "engine.worker.cli", "profile"]
    args = kvengine_parser().parse_args(argv[3:])
    assert (args.model, args.device, args.quick, args.out) == (str(tmp_path / "m"), "cuda", True,
                                                               str(tmp_path / "p.json"))
