"""Prefill time with the kvstore connector saving every full block vs. no connector.

The target (issue 3): saving overlaps compute, so prefill with saving on stays within 10% of
saving off. One seeded workload, run alternately in both modes (medians of ``--reps``) on one
ModelRunner, against a real ``kvstore serve`` daemon on this host (shared memory path).
Fresh prompts every run, so nothing hits a cache. Prints one JSON line:

- ``off_s`` / ``on_s``: median wall time from submission to the last first token;
- ``on_acked_s``: ... until the store also acknowledged every full block (the prefill
  handoff point);
- ``overhead`` = on_s / off_s - 1, ``acked_overhead`` = on_acked_s / off_s - 1 (medians);
- ``min_overhead`` / ``min_acked_overhead``: the same over each mode's fastest run;
- ``engine_cpu_overhead``: CPU time of the engine thread (what saving adds to the critical
  path: the staging copy), and ``process_cpu_overhead``: CPU time of the whole process (the
  saver thread included). On a shared machine, where other load swings wall times by more
  than the effect, these are the figures to read.

    .venv/bin/python -m benchmarks.save_overlap_bench --model default --prompt-len 512
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import lifecycle
from kvstore.daemon.local import start_local

REPO = Path(__file__).resolve().parents[1]


def _start_store(memory: str) -> tuple[subprocess.Popen, str]:
    try:
        return start_local(memory, popen=lifecycle.popen, cwd=REPO, log_level="INFO")
    except RuntimeError as e:
        raise SystemExit(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.save_overlap_bench",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default", help="checkpoint directory, or 'default'")
    ap.add_argument("--prompt-len", type=int, default=512, help="tokens per prompt (default 512)")
    ap.add_argument("--prompts", type=int, default=1, help="prompts per run (default 1)")
    ap.add_argument("--chunk", type=int, default=128, help="max_num_batched_tokens (default 128)")
    ap.add_argument("--reps", type=int, default=8, help="runs per mode, medians taken (default 8)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    import torch

    import kvstore
    from engine.api.generate import SamplingParams
    from engine.kv.connector import KVStoreConnector
    from engine.core.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    from engine.model.runner import ModelRunner
    from engine.worker.config import resolve_model_dir

    torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(args.model)
    bs = 16
    blocks = args.prompts * (-(-(args.prompt_len + 1) // bs)) + 8
    cfg = EngineConfig(num_blocks=blocks, block_size=bs, max_num_batched_tokens=args.chunk)
    runner = ModelRunner(model_dir, num_blocks=blocks, block_size=bs)
    block_bytes = runner.kv_cache[:, :, 0].numel() * runner.kv_cache.element_size()
    memory = f"{max(64, 2 * args.reps * args.prompts * blocks * block_bytes >> 20)}M"
    store, address = _start_store(memory)
    rng = random.Random(args.seed)
    vocab = runner.config.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    try:
        conn = KVStoreConnector(kvstore.connect(address), runner.kv_cache,
                                save_client=kvstore.connect(address), save_all=True)
        engines = {"off": LLMEngine(runner, cfg), "on": LLMEngine(runner, cfg, connector=conn)}

        cpu: dict[str, list[float]] = {"off": [], "on": []}

        def run(mode: str, rep: int) -> tuple[float, float]:
            engine = engines[mode]
            prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)]
                       for _ in range(args.prompts)]
            ids = [f"{mode}-{rep}-{i}" for i in range(args.prompts)]
            t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
            for rid, p in zip(ids, prompts):
                engine.add_request(rid, p, params)
            while engine.has_unfinished():
                engine.step()
            computed = time.perf_counter() - t0
            engine_cpu = time.thread_time() - c0
            if mode == "on":
                for rid in ids:
                    conn.flush(rid).result(timeout=120)
            if rep >= 0:
                cpu[mode].append(engine_cpu)
                cpu.setdefault(mode + "_process", []).append(time.process_time() - p0)
            return computed, time.perf_counter() - t0

        run("off", -1)  # warm-up (allocations, kernels)
        run("on", -1)
        times: dict[str, list[float]] = {"off": [], "on": [], "on_acked": []}
        for rep in range(args.reps):
            for mode in ("off", "on") if rep % 2 == 0 else ("on", "off"):
                computed, acked = run(mode, rep)
                times[mode].append(computed)
                if mode == "on":
                    times["on_acked"].append(acked)
        stats = conn.stats_snapshot()
        conn.close()
    finally:
        store.terminate()
        store.wait(10)
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    print(json.dumps({
        "bench": "save_overlap", "model": model_dir.name, "prompt_len": args.prompt_len,
        "prompts": args.prompts, "chunk": args.chunk, "reps": args.reps, "threads": args.threads,
        "off_s": round(med["off"], 4), "on_s": round(med["on"], 4),
        "on_acked_s": round(med["on_acked"], 4),
        "overhead": round(med["on"] / med["off"] - 1, 4),
        "acked_overhead": round(med["on_acked"] / med["off"] - 1, 4),
        "min_off_s": round(best["off"], 4), "min_on_acked_s": round(best["on_acked"], 4),
        "min_overhead": round(best["on"] / best["off"] - 1, 4),
        "min_acked_overhead": round(best["on_acked"] / best["off"] - 1, 4),
        "engine_cpu_overhead": round(statistics.median(cpu["on"]) / statistics.median(cpu["off"]) - 1, 4),
        "process_cpu_overhead": round(statistics.median(cpu["on_process"])
                                      / statistics.median(cpu["off_process"]) - 1, 4),
        "saved_blocks": stats.saved_blocks, "saved_mib": round(stats.saved_bytes / 2**20, 1),
        "save_busy_s": round(stats.save_s, 3),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, {platform.platform()}",
    }))


if __name__ == "__main__":
    sys.exit(lifecycle.run_main(main))
