"""The check's command line: which sections, where, for how long (package docstring)."""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import tempfile
from pathlib import Path

from gpucheck.runner import Ctx, Section, run_sections

__all__ = ["SECTIONS", "build_parser", "main"]


def _sections() -> list[Section]:
    from gpucheck import correctness as c
    from gpucheck import disagg, figures, hooks, ucx_cuda, vllm_layout

    def doc(fn) -> str:
        return (fn.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")

    return [
        Section("env", 20, c.env, doc=doc(c.env)),
        Section("triton_kernel", 40, c.triton_kernel, cuda_only=True, doc=doc(c.triton_kernel)),
        Section("engine_greedy", 80, c.engine_greedy, doc=doc(c.engine_greedy)),
        Section("staging", 20, c.staging, doc=doc(c.staging)),
        Section("gpu_tier", 15, c.gpu_tier, doc=doc(c.gpu_tier)),
        Section("client_cuda", 15, c.client_cuda, doc=doc(c.client_cuda)),
        Section("disagg", 70, disagg.disagg, doc="prefill worker -> store -> decode worker equals "
                "the colocated worker; corrupt and missing blocks are recomputed"),
        Section("store_load", 30, figures.store_load, doc="store load into the paged cache vs CPU "
                "verify + one pinned copy, and the bare pinned copy"),
        Section("vllm_layout", 30, vllm_layout.run, doc="the vLLM connector's saves and staged loads on "
                "FlashAttention- and head-major-shaped device caches, bit-exact, vs a bare pinned copy"),
        Section("decode_tps", 50, figures.decode_tps, doc="decode tokens/s, ours vs transformers"),
        Section("prefill_tps", 30, figures.prefill_tps, doc="prefill tokens/s, ours vs transformers"),
        Section("cuda_ipc", 30, hooks.cuda_ipc, cuda_only=True, doc="hook: the "
                "CUDA IPC check"),
        Section("ucx_cuda", 40, ucx_cuda.run, doc="124 KV blocks from CUDA tensors in a child "
                "process into this one's as ucxx tagged messages vs an in-process copy; its own "
                "device run (scripts/gpu_wheels.sh --ucx)"),
        Section("profile", 240, hooks.profile, doc="hook: kvengine profile on SmolLM2- and "
                "Llama-3-8B-shaped random models, with the time left"),
    ]


# The names, in order, without importing the sections (torch, transformers) for --help.
SECTIONS = ["env", "triton_kernel", "engine_greedy", "staging", "gpu_tier", "client_cuda", "disagg",
            "store_load", "vllm_layout", "decode_tps", "prefill_tps", "cuda_ipc", "ucx_cuda", "profile"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gpucheck",
                                description="Check every CUDA path and measure the GPU figures in "
                                "capped sections; write gpu_check.json and gpu_check.log.")
    p.add_argument("--out", type=Path, default=Path("results/gpu_check"),
                   help="directory for gpu_check.json, gpu_check.log and profiles (default results/gpu_check)")
    p.add_argument("--budget", type=float, default=300.0,
                   help="seconds for the whole run; sections that no longer fit are skipped-for-time (default 300)")
    p.add_argument("--cpu-selftest", action="store_true",
                   help="run the same driver on CPU with tiny sizes (CUDA-only sections: unsupported)")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=None, metavar="NAME",
                   help=f"run only these sections, in the usual order (default all: {' '.join(SECTIONS)})")
    p.add_argument("--skip", nargs="+", choices=SECTIONS, default=[], metavar="NAME",
                   help="leave these sections out")
    p.add_argument("--work", type=Path, default=None,
                   help="scratch directory for generated checkpoints (default: a temporary one, removed)")
    p.add_argument("--list", action="store_true", help="print the sections with their caps and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sections = _sections()
    assert [s.name for s in sections] == SECTIONS
    if args.list:
        for s in sections:
            print(f"{s.name:14s} {s.cap_s:5.0f} s  {'(CUDA only) ' if s.cuda_only else ''}{s.doc}")
        return 0
    chosen = [s for s in sections if (args.sections is None or s.name in args.sections)
              and s.name not in args.skip]
    import torch

    if args.cpu_selftest:
        device = "cpu"
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    elif torch.cuda.is_available():
        device = "cuda"
    else:
        raise SystemExit("gpu_check: torch.cuda.is_available() is False; on a machine without a "
                         "GPU run --cpu-selftest")
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    with open(args.out / "gpu_check.log", "w") as log_file:
        ctx = Ctx(device=device, selftest=args.cpu_selftest, work=work, out=args.out, log_file=log_file)
        if args.work is None:
            ctx.cleanups.insert(0, lambda: shutil.rmtree(work, ignore_errors=True))
        head = {"check": "gpu_check", "mode": "cpu-selftest" if args.cpu_selftest else "cuda",
                "device": torch.cuda.get_device_name(0) if device == "cuda" else platform.processor()
                or platform.machine(), "host": platform.node()}
        ctx.log(f"mode {head['mode']} on {head['device']}; sections: {' '.join(s.name for s in chosen)}")
        report = run_sections(chosen, ctx, args.budget, head)
        ctx.log("summary: " + ", ".join(f"{k} {v}" for k, v in report["summary"].items() if v)
                + f"; {report['elapsed_s']} s; report {args.out / 'gpu_check.json'}")
    return 1 if report["summary"]["fail"] else 0
