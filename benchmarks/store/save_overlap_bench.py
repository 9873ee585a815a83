"""Prefill time with the kvstore connector saving every full block vs. no connector.

The target: saving overlaps compute, so prefill with saving on stays within 10% of
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

    .venv/bin/python -m benchmarks.store.save_overlap_bench --model default --prompt-len 512

``--throughput``: the connector's save path alone, and, with ``--against REV``, the same
against the connector of another commit (checked out in a temporary worktree), in one run.
Each side is a child process (this tree's, or REV's on ``PYTHONPATH``) holding a paged cache
of the model's block shape (random values, no model run) and a ``KVStoreConnector`` to one
``kvstore serve`` on this host (shared memory); it saves ``--blocks`` blocks under fresh keys
(``save_blocks`` then ``flush``) ``--reps`` times after four untimed saves (the store holds
three saves, so every timed put recycles arena pages already touched: a full store's steady
state), the sides interleaved, and reports per
side the medians of ``gb_s`` (payload GB acknowledged per second of wall time, queue to
acknowledgement) and ``cpu_s_per_gb`` (the child's CPU seconds per payload GB: the engine
thread's copy out of the cache, the saver's encoding, the client's copy into the arena), and
``throughput_ratio`` / ``cpu_ratio``: this tree over REV::

    .venv/bin/python -m benchmarks.store.save_overlap_bench --throughput --against 0123abc
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import lifecycle
from benchmarks.lifecycle import REPO
from benchmarks.report import emit, machine_info
from kvstore.daemon.local import start_local


def _start_store(memory: str) -> tuple[subprocess.Popen, str]:
    try:
        return start_local(memory, popen=lifecycle.popen, cwd=REPO, log_level="INFO")
    except RuntimeError as e:
        raise SystemExit(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.store.save_overlap_bench",
                                 description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--model", default="default", help="checkpoint directory, or 'default'")
    ap.add_argument("--prompt-len", type=int, default=512, help="tokens per prompt (default 512)")
    ap.add_argument("--prompts", type=int, default=1, help="prompts per run (default 1)")
    ap.add_argument("--chunk", type=int, default=128, help="max_num_batched_tokens (default 128)")
    ap.add_argument("--reps", type=int, default=8, help="runs per mode, medians taken (default 8)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    ap.add_argument("--throughput", action="store_true",
                    help="time the save path alone (GB/s, CPU-seconds per GB) instead")
    ap.add_argument("--against", metavar="REV", default=None,
                    help="with --throughput: also time the connector of git revision REV, "
                         "interleaved, and report this tree over it")
    ap.add_argument("--blocks", type=int, default=128,
                    help="with --throughput: blocks per save (default 128: a 2k-token prompt)")
    return ap


# One side of --throughput, run with a tree's connector on sys.path: argv = address, model
# directory, blocks, reps; prints one JSON line per rep.
_THROUGHPUT_CHILD = r"""
import json, sys, time, uuid
import torch
import kvstore
from engine.kv.connector import KVStoreConnector
from engine.model.config import ModelConfig
from kvstore.keys import block_keys, namespace_id

address, model_dir, blocks, reps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(1)
cfg = ModelConfig.from_dir(model_dir)
bs = 16
cache = torch.randn(cfg.num_layers, 2, blocks, bs, cfg.num_kv_heads, cfg.head_dim)
conn = KVStoreConnector(kvstore.connect(address), cache, save_client=kvstore.connect(address),
                        save_all=True)
payload = cache[:, :, 0].numel() * cache.element_size()
WARM = 4  # untimed saves first: the store's arena (3 saves' worth) is touched, then recycled
for rep in range(WARM + reps):
    keys = block_keys(namespace_id({"bench": "save", "run": uuid.uuid4().hex}),
                      list(range(blocks * bs)), bs)
    t0, c0 = time.perf_counter(), time.process_time()
    conn.save_blocks(keys, list(range(blocks)), request_id="r")
    result = conn.flush("r").result(timeout=300)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert result.saved_blocks == blocks and not result.failed_blocks, result
    if rep >= WARM:
        gb = blocks * payload / 1e9
        print(json.dumps({"gb_s": gb / wall, "cpu_s_per_gb": cpu / gb}), flush=True)
conn.close()
"""


def _block_bytes(model_dir: Path) -> int:
    from engine.model.config import ModelConfig

    cfg = ModelConfig.from_dir(model_dir)
    return 64 + cfg.num_layers * 2 * 16 * cfg.num_kv_heads * cfg.head_dim * 4


def throughput(args: argparse.Namespace) -> None:
    """``--throughput`` (module docstring)."""
    import tempfile

    from engine.api.paths import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    trees = {"this": REPO}
    with contextlib.ExitStack() as stack:
        if args.against:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="save-bench-")))
            old = tmp / "tree"
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(old),
                            args.against], check=True, capture_output=True)
            stack.callback(subprocess.run, ["git", "-C", str(REPO), "worktree", "remove",
                                            "--force", str(old)], capture_output=True)
            trees["against"] = old
        # Three saves' worth: after the warm-up every put recycles arena pages already touched
        # (a full store's steady state), so first-touch page faults of a fresh arena, the
        # store's cost and not the save path's, stay out of the figures.
        block_bytes = _block_bytes(model_dir)
        store, address = _start_store(f"{max(16, 3 * args.blocks * block_bytes >> 20)}M")
        stack.callback(store.wait, 10)
        stack.callback(store.terminate)
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
        order = list(trees)
        for rep in range(args.reps):
            for name in order if rep % 2 == 0 else order[::-1]:
                env = {**os.environ, "PYTHONPATH": str(trees[name])}
                out = subprocess.run([sys.executable, "-c", _THROUGHPUT_CHILD, address,
                                      str(model_dir), str(args.blocks), "1"],
                                     env=env, cwd=trees[name], check=True, capture_output=True,
                                     text=True, timeout=600)
                runs[name] += [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    med = {name: {k: statistics.median(r[k] for r in rows) for k in ("gb_s", "cpu_s_per_gb")}
           for name, rows in runs.items()}
    report: dict[str, object] = {
        "bench": "save_throughput", "model": model_dir.name, "blocks": args.blocks,
        "reps": args.reps, "against": args.against,
        **{f"{name}_{k}": round(v, 4) for name, m in med.items() for k, v in m.items()},
        "machine": machine_info(),
    }
    if "against" in med:
        report["throughput_ratio"] = round(med["this"]["gb_s"] / med["against"]["gb_s"], 3)
        report["cpu_ratio"] = round(med["this"]["cpu_s_per_gb"] / med["against"]["cpu_s_per_gb"], 3)
    emit(report)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.throughput:
        throughput(args)
        return

    import torch

    import kvstore
    from engine.api.generate import SamplingParams
    from engine.api.paths import resolve_model_dir
    from engine.core.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    from engine.kv.connector import KVStoreConnector
    from engine.model.runner import ModelRunner

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
    emit({
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
        "machine": machine_info(),
    })


if __name__ == "__main__":
    sys.exit(lifecycle.run_main(main))
