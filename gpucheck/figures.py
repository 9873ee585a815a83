"""The figures: store load into the paged cache, decode and prefill tokens/s against transformers.

- ``store_load``: 124 blocks of the default model's KV shape (SmolLM2-135M, float32: 30 layers,
  3 KV heads, head dim 64, block 16; 87 MiB) saved to the check's daemon, then, each the median
  of ``ROUNDS`` after a warm-up: ``ours`` = ``KVStoreConnector.load_blocks`` into a paged cache on
  the device (verify each block where it lies, pinned staging ring, grouped asynchronous copies),
  until the device is done; ``simple`` = the simplest correct way to move the same bytes: the
  client's get into one pinned buffer, every block's checksum verified on the CPU
  (``codec.decode``), then one pinned host-to-device copy of the whole buffer and one
  ``index_copy_`` into the cache; ``bare_copy`` = that one pinned host-to-device copy alone.
  Target: ``simple_ms / ours_ms >= 1``.
- ``decode_tps``: tokens/s of one decode step of every sequence at batch 1, 32 and 128 with 512
  tokens of context, SmolLM2-shaped random model in bfloat16: ours (``ModelRunner.execute``,
  cache filled with random values) against transformers (``forward`` of one token per sequence
  over the cache its real prefill returned). Target: ours / theirs >= 1 at every batch.
- ``prefill_tps``: tokens/s of a 512- and a 4,096-token prompt, same model (transformers with
  ``logits_to_keep=1``, as ours computes the last token's logits only).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from gpucheck import models
from gpucheck.correctness import hf_model
from gpucheck.runner import Ctx
from gpucheck.store import daemon

__all__ = ["store_load", "decode_tps", "prefill_tps"]

ROUNDS = 5


def _sync(ctx: Ctx) -> None:
    if ctx.cuda:
        torch.cuda.synchronize()


def _median_s(ctx: Ctx, fn: Callable[[], object], rounds: int = ROUNDS) -> float:
    fn()
    _sync(ctx)
    times = []
    for _ in range(rounds):
        ctx.check_time()
        t0 = time.perf_counter()
        fn()
        _sync(ctx)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def store_load(ctx: Ctx, rec: dict[str, Any]) -> None:
    import numpy as np

    from engine.kv.connector import KVStoreConnector
    from kvstore import Client, codec
    from kvstore.keys import block_keys, namespace_id

    L, H, D, BS = (2, 3, 64, 16) if ctx.selftest else (30, 3, 64, 16)
    n = 16 if ctx.selftest else 124
    address = daemon(ctx)
    src = torch.randn(L, 2, n, BS, H, D, generator=torch.Generator().manual_seed(3))
    keys = block_keys(namespace_id({"gpu_check": "store_load", "L": L}), list(range(n * BS)), BS)
    with Client(address, timeout=60) as c:
        saver = KVStoreConnector(c, src, save_all=True)
        saver.save_blocks(keys, list(range(n)), request_id="fill")
        assert saver.flush("fill").result(timeout=60).saved_blocks == n
        saver.close()
    payload = L * 2 * BS * H * D * 4
    encoded = codec.HEADER_SIZE + payload
    rec.update(blocks=n, mib=round(n * payload / 2**20, 1), device=ctx.device)
    cache = torch.zeros(L, 2, n + 8, BS, H, D, device=ctx.device)
    ids = list(range(8, 8 + n))[::-1]  # scattered: not the order they were saved in
    pin = ctx.cuda
    landing = torch.empty(n, encoded, dtype=torch.uint8, pin_memory=pin)
    rows = landing.numpy()
    ids_dev = torch.tensor(ids, device=ctx.device)
    client = Client(address, timeout=60)
    conn = KVStoreConnector(client, cache, save_all=False)
    try:
        def ours() -> None:
            got = conn.load_blocks(keys, ids)
            assert got.loaded == n, got

        def simple() -> None:
            assert all(client.get(keys, [rows[i] for i in range(n)]))
            for i in range(n):
                codec.decode(rows[i], expected_key=keys[i])  # raises CorruptBlock
            dev = landing.to(ctx.device, non_blocking=True)
            payloads = dev[:, codec.HEADER_SIZE:].contiguous().view(torch.float32).view(n, L, 2, BS, H, D)
            cache.index_copy_(2, ids_dev, payloads.permute(1, 2, 0, 3, 4, 5))

        bare_src = torch.empty(n * payload, dtype=torch.uint8, pin_memory=pin)
        bare_src.numpy()[:] = np.frombuffer(rows.tobytes()[: n * payload], np.uint8)
        bare_dst = torch.empty(n * payload, dtype=torch.uint8, device=ctx.device)

        def bare() -> None:
            bare_dst.copy_(bare_src, non_blocking=True)

        t = {"ours": _median_s(ctx, ours)}
        assert torch.equal(cache[:, :, ids[0]].cpu(), src[:, :, 0]), "ours: slot holds other bytes"
        cache.zero_()
        t["simple"] = _median_s(ctx, simple)
        assert torch.equal(cache[:, :, ids[-1]].cpu(), src[:, :, n - 1]), "simple: slot holds other bytes"
        t["bare_copy"] = _median_s(ctx, bare)
        for k, v in t.items():
            rec[f"{k}_ms"] = round(v * 1e3, 3)
            rec[f"{k}_gbps"] = round(n * payload / v / 1e9, 2)
        rec["simple_over_ours"] = round(t["simple"] / t["ours"], 2)
        rec["target_met"] = t["simple"] / t["ours"] >= 1.0
        rec["staging_allocations"] = conn.staging_allocations()
        ctx.log(f"  store load {n} blocks: ours {rec['ours_ms']} ms, simple {rec['simple_ms']} ms, "
                f"bare copy {rec['bare_copy_ms']} ms")
    finally:
        conn.close()
        client.close()


def _smollm2(ctx: Ctx):
    return models.shaped(ctx, "smollm2-135m", "float32")


def decode_tps(ctx: Ctx, rec: dict[str, Any]) -> None:
    from engine.model.attention import triton_status
    from engine.model.runner import ModelRunner, StepItem

    dtype = "bfloat16"
    batches, context, steps = ((1, 4), 32, 2) if ctx.selftest else ((1, 32, 128), 512, 20)
    model_dir = _smollm2(ctx)
    per_seq = -(-(context + steps + 2) // 16)
    runner = ModelRunner(model_dir, num_blocks=max(batches) * per_seq, device=ctx.device, dtype=dtype)
    runner.kv_cache.normal_(generator=torch.Generator(device=ctx.device).manual_seed(1))
    rec["model"], rec["context"], rec["steps"] = "smollm2-135m (random)", context, steps
    for b in batches:
        ctx.check_time(f"ours at batch {b}")
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(b)]

        def ours() -> None:
            for s in range(steps):
                runner.execute([StepItem([5 + i], context + s, tables[i]) for i in range(b)])  # noqa: F821 - deleted only after its last call

        rec[f"ours_b{b}_tps"] = round(b * steps / _median_s(ctx, ours, 3), 1)
    rec["decode_path"] = triton_status() if ctx.cuda else "native or torch"
    del runner
    hf = hf_model(model_dir, getattr(torch, dtype), ctx.device)
    for b in batches:
        ctx.check_time(f"transformers at batch {b}")
        gen = torch.Generator(device=ctx.device).manual_seed(b)
        ids = torch.randint(3, 500, (b, context), device=ctx.device, generator=gen)
        times = []
        with torch.inference_mode():
            for _ in range(4):  # the first round warms up; each decodes from a fresh prefill
                ctx.check_time(f"transformers at batch {b}")
                out = hf(input_ids=ids, use_cache=True, logits_to_keep=1)
                cache, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                _sync(ctx)
                t0 = time.perf_counter()
                for _ in range(steps):
                    out = hf(input_ids=tok, past_key_values=cache, use_cache=True)
                    cache, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                _sync(ctx)
                times.append(time.perf_counter() - t0)
        rec[f"transformers_b{b}_tps"] = round(b * steps / statistics.median(times[1:]), 1)
        rec[f"ratio_b{b}"] = round(rec[f"ours_b{b}_tps"] / rec[f"transformers_b{b}_tps"], 2)
        ctx.log(f"  decode batch {b}: ours {rec[f'ours_b{b}_tps']} tok/s, transformers "
                f"{rec[f'transformers_b{b}_tps']} tok/s")
    rec["target_met"] = all(rec[f"ratio_b{b}"] >= 1.0 for b in batches)


def prefill_tps(ctx: Ctx, rec: dict[str, Any]) -> None:
    from engine.model.runner import ModelRunner, StepItem

    dtype = "bfloat16"
    lengths = (32, 64) if ctx.selftest else (512, 4096)
    model_dir = _smollm2(ctx)
    runner = ModelRunner(model_dir, num_blocks=max(lengths) // 16 + 1, device=ctx.device, dtype=dtype)
    g = torch.Generator().manual_seed(2)
    prompts = {n: torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths}
    for n in lengths:
        ctx.check_time(f"ours at {n} tokens")
        table = list(range(n // 16 + 1))
        item = StepItem(prompts[n], 0, table)
        rec[f"ours_{n}_tps"] = round(n / _median_s(ctx, lambda: runner.execute([item]), 3), 1)  # noqa: F821 - as above
    del runner
    hf = hf_model(model_dir, getattr(torch, dtype), ctx.device)
    for n in lengths:
        ctx.check_time(f"transformers at {n} tokens")
        ids = torch.tensor([prompts[n]], device=ctx.device)
        with torch.inference_mode():
            seconds = _median_s(ctx, lambda: hf(input_ids=ids, logits_to_keep=1), 3)
        rec[f"transformers_{n}_tps"] = round(n / seconds, 1)
        rec[f"ratio_{n}"] = round(rec[f"ours_{n}_tps"] / rec[f"transformers_{n}_tps"], 2)
        ctx.log(f"  prefill {n} tokens: ours {rec[f'ours_{n}_tps']} tok/s, transformers "
                f"{rec[f'transformers_{n}_tps']} tok/s")
    rec["target_met"] = all(rec[f"ratio_{n}"] >= 1.0 for n in lengths)
