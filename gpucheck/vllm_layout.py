"""``vllm_layout``: the vLLM connector's data path on the device's caches, without vLLM.

Two attention layouts vLLM gives a connector on CUDA, as tensors of their shapes:
FlashAttention's ``[2, num_blocks, block_size, kv_heads, head_size]`` per layer (K and V two runs
a block) and the head-major ``[num_blocks, kv_heads, block_size, 2 * head_size]`` (one run), in
bfloat16, the default model's shape (30 layers, 3 KV heads, head size 64, block 32). For each,
``n`` blocks are saved through the connector's worker side
(``kvstore.integrations.vllm.transfers.Transfers``: gathered from the device, put to the
check's daemon) and loaded into another cache of the same layout through the staged path
(verified in a pinned host ring, then one copy and one scatter per chunk), bit for bit; then,
the median of ``ROUNDS``: ``load_ms`` (request to the last byte on the device) and
``bare_copy_ms`` (one pinned host-to-device copy of the same bytes). Under ``--cpu-selftest``
the same runs on CPU tensors (the staged path forced), smaller.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from gpucheck.runner import Ctx
from gpucheck.store import daemon

__all__ = ["run"]

ROUNDS = 5


def _layouts(ctx: Ctx, layers: int, blocks: int, dtype: torch.dtype) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    shapes = {"flash_attn": (2, blocks, 32, 3, 64), "head_major": (blocks, 3, 32, 128)}
    return {name: {f"model.layers.{i}.self_attn.attn": torch.randn(*shape, generator=g).to(dtype).to(ctx.device)
                   for i in range(layers)} for name, shape in shapes.items()}


def run(ctx: Ctx, rec: dict[str, Any]) -> None:
    from kvstore.integrations.store_link import StoreLink, StoreSettings
    from kvstore.integrations.vllm.layout import BlockLayout
    from kvstore.integrations.vllm.specs import LoadSpec, SaveSpec
    from kvstore.integrations.vllm.transfers import Transfers
    from kvstore.keys import block_keys, namespace_id

    layers, n, dtype = (2, 8, torch.float32) if ctx.selftest else (30, 64, torch.bfloat16)
    settings = StoreSettings(address=daemon(ctx), timeout=60.0)
    for name, caches in _layouts(ctx, layers, n + 8, dtype).items():
        ctx.check_time()
        dst = {k: torch.zeros_like(v) for k, v in caches.items()}
        src_layout, dst_layout = BlockLayout.from_kv_caches(caches, n + 8), BlockLayout.from_kv_caches(dst, n + 8)
        dname = str(dtype).removeprefix("torch.")
        saver = Transfers(StoreLink(settings), StoreLink(settings), src_layout, dname)
        loader = Transfers(StoreLink(settings), StoreLink(settings), dst_layout, dname, load_path="staged")
        try:
            keys = tuple(block_keys(namespace_id({"gpu_check": "vllm_layout", "layout": name}),
                                    list(range(n * 32)), 32))
            src_ids, dst_ids = tuple(range(n)), tuple(range(8, 8 + n))[::-1]
            saver.save(SaveSpec("fill", keys, src_ids))
            _wait(ctx, saver)
            times = []
            for r in range(ROUNDS + 1):
                t0 = time.perf_counter()
                loader.load(LoadSpec(f"load{r}", keys, dst_ids))
                _wait(ctx, loader)
                if ctx.cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            _, _, failed = loader.poll()
            assert not failed, f"{name}: blocks {sorted(failed)} failed to load"
            for s, d in zip(src_ids, dst_ids):
                for va, vb in zip(src_layout.views, dst_layout.views):
                    assert torch.equal(va[s], vb[d]), f"{name}: block {s} differs after the load"
            payload = n * src_layout.payload_bytes
            host = torch.empty(payload, dtype=torch.uint8, pin_memory=ctx.cuda)
            dev = torch.empty(payload, dtype=torch.uint8, device=ctx.device)
            copies = []
            for _ in range(ROUNDS):
                t0 = time.perf_counter()
                dev.copy_(host, non_blocking=True)
                if ctx.cuda:
                    torch.cuda.synchronize()
                copies.append(time.perf_counter() - t0)
            load_ms, copy_ms = statistics.median(times[1:]) * 1e3, statistics.median(copies) * 1e3
            rec[name] = {"blocks": n, "chunks_per_block": len(src_layout.views), "mib": round(payload / 2**20, 1),
                         "load_ms": round(load_ms, 2), "bare_copy_ms": round(copy_ms, 2),
                         "load_over_copy": round(load_ms / copy_ms, 2)}
            ctx.log(f"  {name}: {n} blocks ({rec[name]['mib']} MiB) loaded in {load_ms:.1f} ms, "
                    f"bare pinned copy {copy_ms:.1f} ms")
        finally:
            saver.close()
            loader.close()


def _wait(ctx: Ctx, t: Any) -> None:
    while not t.idle():
        ctx.check_time()
        time.sleep(0.002)
