"""The ``cuda_ipc`` section (``hooks.cuda_ipc`` calls ``run``): CUDA tensors from one process
to another through the store's GPU tier over CUDA IPC, with no host copy.

A daemon with a GPU tier (``kvstore serve --gpu-memory``), a writer process that puts
``BLOCKS`` blocks of the default model's KV shape (SmolLM2-135M: 30 layers, 3 KV heads, head
dim 64, 16-token blocks, bfloat16; ``engine.model.kv_cache.kv_block_bytes``) from CUDA tensors
with ``Client.put_cuda``, and this process getting them into CUDA tensors with
``Client.get_cuda``: bit-exact against the writer's bytes, and timed against a
device-to-device copy of the same bytes within one process. A machine whose CUDA cannot map
another process's memory (IPC inside some VMs) is ``Unsupported``, its own result.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

from gpucheck import models
from gpucheck.runner import Ctx, OutOfTime, Unsupported
from gpucheck.store import REPO

__all__ = ["run", "BLOCKS", "block_bytes"]

BLOCKS = 124
BLOCK_TOKENS = 16
SEED = 16
REPEATS = 5
EXIT_UNSUPPORTED = 3

_WRITER = r"""
import json, sys, time, torch
from kvstore import Client
from kvstore.errors import Unsupported
from gpucheck.ipc import blocks
address, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
keys, vals = blocks(n, size)
src = [v.cuda() for v in vals]
torch.cuda.synchronize()
try:
    with Client(address, timeout=30) as c:
        t0 = time.perf_counter()
        held = c.put_cuda(keys, src)
        put_s = time.perf_counter() - t0
        gpu = c.stats()["store"]["gpu"]
except Unsupported as e:
    print("UNSUPPORTED", e, flush=True)
    sys.exit(3)
print(json.dumps({"put_s": put_s, "stored": sum(held), "gpu_blocks": gpu["blocks"]}), flush=True)
"""


def block_bytes() -> int:
    """One SmolLM2-135M block in bfloat16, as the engine sizes it."""
    import torch

    from engine.model.kv_cache import kv_block_bytes

    shape = models.SHAPES["smollm2-135m"]
    config = SimpleNamespace(num_layers=shape["num_hidden_layers"],
                             num_kv_heads=shape["num_key_value_heads"], head_dim=shape["head_dim"])
    return kv_block_bytes(config, BLOCK_TOKENS, torch.bfloat16)  # type: ignore[arg-type]


def blocks(n: int, size: int) -> tuple[list, list]:
    """The keys and (CPU uint8) values both processes derive from ``SEED``."""
    import torch

    from kvstore.keys import block_keys, namespace_id

    keys = block_keys(namespace_id({"gpu_check": "cuda_ipc", "seed": SEED}), list(range(n * BLOCK_TOKENS)),
                      BLOCK_TOKENS)
    g = torch.Generator().manual_seed(SEED)
    return keys, [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g) for _ in range(n)]


def _median_s(fn, sync) -> float:
    times = []
    for _ in range(REPEATS):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(ctx: Ctx, rec: dict[str, Any]) -> None:
    if not ctx.cuda:
        raise Unsupported("no CUDA on this machine: CUDA IPC maps GPU memory between processes")
    import torch

    from kvstore import Client
    from kvstore.daemon.local import start_local, stop_local
    from kvstore.errors import Unsupported as StoreUnsupported

    size = block_bytes()
    total = BLOCKS * size
    rec.update(blocks=BLOCKS, block_bytes=size, total_mb=round(total / 1e6, 1))
    gpu_memory = f"{max(64, 4 * total >> 20)}M"  # a reservation may take half the tier
    proc, address = start_local("128M", extra=["--gpu-memory", gpu_memory], cwd=REPO,
                                popen=lambda argv, **kw: subprocess.Popen(argv, start_new_session=True, **kw))
    ctx.cleanups.append(lambda: stop_local(proc))
    ctx.log(f"  daemon at {address} with a {gpu_memory} GPU tier")
    try:
        w = subprocess.run([sys.executable, "-c", _WRITER, address, str(BLOCKS), str(size)], cwd=REPO,
                           capture_output=True, text=True, timeout=max(1.0, ctx.left()))
    except subprocess.TimeoutExpired:
        raise OutOfTime("the writer process did not finish in the cap") from None
    if w.returncode == EXIT_UNSUPPORTED:
        raise Unsupported(w.stdout.strip() or w.stderr[-500:])
    if w.returncode != 0:
        raise RuntimeError(f"the writer exited with {w.returncode}: {w.stderr[-2000:]}")
    rec["writer"] = json.loads(w.stdout.strip().splitlines()[-1])
    assert rec["writer"]["gpu_blocks"] >= BLOCKS, rec["writer"]
    ctx.check_time("after the put")
    keys, want = blocks(BLOCKS, size)
    dst = [torch.zeros(size, dtype=torch.uint8, device="cuda") for _ in range(BLOCKS)]
    with Client(address, timeout=30) as c:
        try:
            found = c.get_cuda(keys, dst)  # the first maps the tier buffer
        except StoreUnsupported as e:
            raise Unsupported(str(e)) from None
        assert found == [True] * BLOCKS, f"{found.count(False)} blocks missing"
        hits0 = c.stats()["store"]["gpu"]["hits"]
        rec["bit_exact"] = all(torch.equal(d.cpu(), v) for d, v in zip(dst, want))
        assert rec["bit_exact"], "a block read over CUDA IPC differs from what the writer put"
        ctx.check_time("after the check")
        get_s = _median_s(lambda: c.get_cuda(keys, dst), torch.cuda.synchronize)
        rec["gpu_hits_per_get"] = (c.stats()["store"]["gpu"]["hits"] - hits0) / REPEATS
    src = [v.cuda() for v in want]
    d2d_s = _median_s(lambda: [d.copy_(s) for d, s in zip(dst, src)], torch.cuda.synchronize)
    rec.update(get_ipc_s=round(get_s, 6), get_ipc_gbps=round(total / get_s / 1e9, 2),
               d2d_s=round(d2d_s, 6), d2d_gbps=round(total / d2d_s / 1e9, 2),
               ipc_over_d2d=round(get_s / d2d_s, 2))
    ctx.log(f"  get_cuda {rec['get_ipc_gbps']} GB/s vs in-process copy {rec['d2d_gbps']} GB/s "
            f"({total / 1e6:.1f} MB in {BLOCKS} blocks)")
