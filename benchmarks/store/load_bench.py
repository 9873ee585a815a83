"""Store-hit load benchmark: the engine connector's load of N blocks into the paged cache,
beside a memcpy of the same bytes and the store's own get of the same blocks, in one run.

    .venv/bin/python -m benchmarks.store.load_bench [--blocks 16 124 512] [--rounds 7] [--out DIR]

One ``kvstore serve`` (a subprocess, shared memory and TCP on loopback) holds 512 blocks of
the default model's cache shape (SmolLM2-135M: 30 layers, 3 KV heads, head dim 64, block
size 16, float32: 720 KiB of payload a block), saved through ``KVStoreConnector`` itself.
For each transport (``shm``, ``tcp``), thread count (1, 2) and N, each round times, in turn:

- ``load``: ``KVStoreConnector.load_blocks`` of N blocks into N free slots of a paged cache
  ``[30, 2, num_blocks, 16, 3, 64]`` (verified, then in the cache; the figure the engine
  sees), the connector's ``load_threads`` set to the thread count;
- ``memcpy``: copying the same N payloads between two already touched buffers (NumPy; with 2
  threads, each copies half at the same time);
- ``get``: the store client's plain batched get of the same N blocks into an already touched
  buffer (one client, no verification, no scatter): the transport's own cost.

Every figure is the median over rounds; targets: ``load / memcpy`` at most 2 over
shared memory, ``load / get`` at most 1.3 over TCP. Seeded; one JSON line on stdout, the same
JSON and a PNG in ``--out``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path
from statistics import median

import numpy as np
import torch
from tqdm import tqdm

from benchmarks import lifecycle
from benchmarks.lifecycle import REPO
from benchmarks.report import emit, machine_info, pyplot, save_figure
from kvstore.daemon.local import start_local

L, H, D, BS = 30, 3, 64, 16  # SmolLM2-135M-Instruct's KV cache, block size 16
TARGET_SHM_VS_MEMCPY, TARGET_TCP_VS_GET = 2.0, 1.3


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.store.load_bench",
                                description=(__doc__ or "").split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, nargs="+", default=[16, 124, 512],
                   help="batch sizes N to load (default: 16 124 512)")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds per cell (default: 7)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                   help="loader thread counts (default: 1 2)")
    p.add_argument("--transports", nargs="+", default=["shm", "tcp"], choices=["shm", "tcp"],
                   help="client paths to measure (default: shm tcp)")
    p.add_argument("--seed", type=int, default=0, help="seed of the block contents (default: 0)")
    p.add_argument("--out", type=Path, default=None, help="write load_bench.json and .png here")
    return p


def _start_daemon(memory: str) -> tuple[subprocess.Popen, str]:
    try:
        return start_local(memory, popen=lifecycle.popen, cwd=REPO)
    except RuntimeError as e:
        raise SystemExit(str(e)) from None


def _cache(num_blocks: int, seed: int | None) -> torch.Tensor:
    shape = (L, 2, num_blocks, BS, H, D)
    if seed is None:
        return torch.zeros(shape)  # touched: every page faulted in once, before timing
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _parallel(fns: list) -> float:
    """Run ``fns`` at once (one thread each; the calls release the GIL); seconds for all."""
    if len(fns) == 1:
        t0 = time.perf_counter()
        fns[0]()
        return time.perf_counter() - t0
    threads = [threading.Thread(target=f) for f in fns]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def _halves(n: int, k: int) -> list[slice]:
    step = -(-n // k)
    return [slice(i, min(n, i + step)) for i in range(0, n, step)]


def measure(address: str, transport: str, threads: int, blocks: list[int], rounds: int,
            keys: list, payload_bytes: int, encoded: int, progress) -> list[dict]:
    from engine.kv.connector import KVStoreConnector
    from kvstore import Client

    n_max = max(blocks)
    client = Client(address, transport="shm" if transport == "shm" else "tcp", timeout=60)
    dst = _cache(n_max + 8, None)
    conn = KVStoreConnector(client, dst, save_all=False, load_threads=threads)
    src_mem = [np.ones(payload_bytes * n_max, np.uint8) for _ in range(threads)]
    dst_mem = [np.zeros(payload_bytes * n_max, np.uint8) for _ in range(threads)]
    get_buf = np.zeros((n_max, encoded), np.uint8)
    out = []
    try:
        for n in blocks:
            parts = _halves(n, threads)
            ids = list(range(8, 8 + n))[::-1]  # scattered: not the order they were saved in

            def load() -> list:
                return [lambda: results.append(conn.load_blocks(keys[:n], ids))]

            def memcpy() -> list:
                return [lambda t=t, sl=sl: np.copyto(dst_mem[t][:payload_bytes * (sl.stop - sl.start)],
                                                     src_mem[t][:payload_bytes * (sl.stop - sl.start)])
                        for t, sl in enumerate(parts)]

            def get() -> list:
                return [lambda: client.get(keys[:n], list(get_buf[:n]))]

            results: list = []
            _parallel(load())  # warm: the pooled staging buffer, the mapping, the kernel
            _parallel(get())
            times: dict[str, list[float]] = {"load": [], "memcpy": [], "get": []}
            for _ in range(rounds):
                results.clear()
                times["load"].append(_parallel(load()))
                if sum(r.loaded for r in results) != n:
                    raise SystemExit(f"a load of {n} blocks over {transport} loaded "
                                     f"{sum(r.loaded for r in results)}: {results}")
                times["memcpy"].append(_parallel(memcpy()))
                times["get"].append(_parallel(get()))
                progress.update(1)
            for i, b in zip(ids[:3], range(3)):  # the slots hold the saved blocks' bytes
                src_block = _cache_block(b)
                if not torch.equal(dst[:, :, i], src_block):
                    raise SystemExit(f"slot {i} does not hold block {b} after the load")
            med = {k: median(v) for k, v in times.items()}
            out.append({
                "transport": transport, "threads": threads, "blocks": n,
                "mb": round(n * payload_bytes / 1e6, 1),
                "load_ms": round(med["load"] * 1e3, 2), "memcpy_ms": round(med["memcpy"] * 1e3, 2),
                "get_ms": round(med["get"] * 1e3, 2),
                "load_gbps": round(n * payload_bytes / med["load"] / 1e9, 2),
                "load_vs_memcpy": round(med["load"] / med["memcpy"], 2),
                "load_vs_get": round(med["load"] / med["get"], 2),
            })
    finally:
        conn.close()
        client.close()
    return out


_SRC: torch.Tensor | None = None


def _cache_block(b: int) -> torch.Tensor:
    assert _SRC is not None
    return _SRC[:, :, b]


def _plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4))
    for (tr, th) in sorted({(r["transport"], r["threads"]) for r in rows}):
        sel = [r for r in rows if r["transport"] == tr and r["threads"] == th]
        ax.plot([r["blocks"] for r in sel], [r["load_vs_memcpy"] for r in sel], marker="o",
                label=f"{tr}, {th} thread{'s' if th > 1 else ''}")
    ax.axhline(TARGET_SHM_VS_MEMCPY, ls="--", c="grey", label="target over shm")
    ax.set_xscale("log")
    ax.set_xlabel("blocks loaded (720 KiB each)")
    ax.set_ylabel("load time / memcpy of the same bytes")
    ax.set_title("Store-hit load into the paged cache")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    global _SRC
    args = build_parser().parse_args(argv)
    torch.set_num_threads(1)
    from engine.kv.connector import KVStoreConnector
    from kvstore import Client, codec
    from kvstore.client.scatter import scatter_kernel
    from kvstore.keys import block_keys

    n_max = max(args.blocks)
    payload = L * 2 * BS * H * D * 4
    encoded = codec.HEADER_SIZE + payload
    memory = f"{(n_max * encoded * 5 // 4) >> 20}MiB"
    daemon, address = _start_daemon(memory)
    try:
        _SRC = _cache(n_max, args.seed)
        keys = block_keys(bytes(16), list(range(n_max * BS)), BS)
        with Client(address, timeout=60) as c:
            saver = KVStoreConnector(c, _SRC)
            for sl in _halves(n_max, max(1, n_max // 64)):
                saver.save_blocks(keys[sl], list(range(sl.start, sl.stop)), request_id="fill")
            res = saver.flush("fill").result(timeout=600)
            saver.close()
        if res.saved_blocks != n_max:
            raise SystemExit(f"saved {res.saved_blocks} of {n_max} blocks: {res}")
        kernel = "native" if scatter_kernel() is not None else "staged (no kernel)"
        rows: list[dict] = []
        cells = len(args.transports) * len(args.threads) * len(args.blocks) * args.rounds
        with tqdm(total=cells, desc="load_bench", file=sys.stderr) as bar:
            for tr in args.transports:
                for th in args.threads:
                    rows += measure(address, tr, th, args.blocks, args.rounds, keys, payload,
                                    encoded, bar)
    finally:
        lifecycle.stop(daemon)
    result = {
        "bench": "load_bench", "kernel": kernel, "block_bytes": payload, "rounds": args.rounds,
        "rows": rows,
        "targets": {"shm_load_vs_memcpy": TARGET_SHM_VS_MEMCPY, "tcp_load_vs_get": TARGET_TCP_VS_GET},
        "machine": machine_info(torch=torch.__version__),
    }
    emit(result, args.out / "load_bench.json" if args.out is not None else None)
    if args.out is not None:
        _plot(rows, args.out / "load_bench.png")
    return 0


if __name__ == "__main__":
    sys.exit(lifecycle.run_main(main))
