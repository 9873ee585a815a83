"""The correctness sections: each CUDA path against its oracle (the package docstring lists them).

Greedy equality uses the CPU oracle tests' rule (``tests.engine.hf_oracle``): ours and
transformers' greedy tokens must agree, a divergence allowed only at a step where transformers'
own top-2 logit margin is a near-tie, and at most one such near-tie per model and dtype. The
near-tie is ``NEAR_TIE`` (1e-4) in float32; in bfloat16 both sides round every activation to 8
bits of mantissa, so it is :data:`BF16_NEAR_TIE` (one bfloat16 step at a logit of 16 to 32).
"""

from __future__ import annotations

import platform
import random
import sys
from pathlib import Path
from typing import Any

import torch

from gpucheck import models
from gpucheck.runner import Ctx
from tests.engine.hf_oracle import NEAR_TIE, runner_greedy

__all__ = ["env", "triton_kernel", "engine_greedy", "staging", "gpu_tier", "client_cuda",
           "hf_model", "BF16_NEAR_TIE"]

BF16_NEAR_TIE = 0.125


def env(ctx: Ctx, rec: dict[str, Any]) -> None:
    """The machine, the versions, and which kernels this process can use."""
    import numpy

    from engine.model.native import native_status
    from kvstore.native.blocks import LIBRARY
    from kvstore.version import installed_version

    rec.update(python=sys.version.split()[0], platform=platform.platform(), torch=torch.__version__,
               numpy=numpy.__version__, kvcache_store=installed_version(),
               cuda_available=torch.cuda.is_available(), native_decode=native_status(),
               store_native=LIBRARY.why or "built")
    from importlib import metadata, util

    for mod, dists in (("triton", ["triton"]), ("transformers", ["transformers"]),
                       ("fastapi", ["fastapi"]), ("uvicorn", ["uvicorn"]), ("lmdb", ["lmdb"]),
                       ("cupy", ["cupy-cuda13x", "cupy-cuda12x", "cupy"])):
        rec[mod] = "missing"  # read from the metadata: importing them all would take seconds
        if util.find_spec(mod) is not None:
            for dist in dists:
                try:
                    rec[mod] = metadata.version(dist)
                    break
                except metadata.PackageNotFoundError:
                    rec[mod] = "installed, version unknown"
    if ctx.cuda:
        p = torch.cuda.get_device_properties(0)
        rec.update(gpu=p.name, capability=f"{p.major}.{p.minor}",
                   gpu_memory_gib=round(p.total_memory / 2**30, 1),
                   multiprocessors=p.multi_processor_count, torch_cuda=torch.version.cuda)
        ctx.log(f"device: {p.name} (sm {p.major}.{p.minor}, {rec['gpu_memory_gib']} GiB), "
                f"torch {torch.__version__}")


def triton_kernel(ctx: Ctx, rec: dict[str, Any]) -> None:
    """The Triton decode kernel compiled on CUDA against the dense reference (the CPU test's
    cases, tests/engine/test_triton_attention.py)."""
    from tests.engine import test_triton_attention as cases

    errors = cases.run_cases("cuda")
    rec["max_abs_error"] = errors
    bad = {n: e for n, e in errors.items() if n in cases.CASES and e >= cases.TOLERANCE[cases.CASES[n][-1]]}
    if errors["strided"] >= cases.TOLERANCE["float32"]:
        bad["strided"] = errors["strided"]
    assert not bad, f"over tolerance: {bad}"
    ctx.check_time("the timing")
    rec["timing"] = [_decode_attention_timing(ctx.device, b) for b in (1, 128)]
    for t in rec["timing"]:
        ctx.log(f"  decode attention, batch {t['batch']} x 2048 tokens, bf16: triton {t['triton_us']} us "
                f"({t['splits']} split(s)), gather + SDPA {t['gather_us']} us")


def _decode_attention_timing(device: str, b: int = 128, context: int = 2048) -> dict[str, Any]:
    """One layer's decode attention, SmolLM2's heads, bf16: the kernel against the path it
    replaced (gather every sequence's blocks, then SDPA), microseconds a call."""
    import time

    import torch.nn.functional as F

    from engine.model import triton_attention
    from engine.model.attention import _gather

    heads, kvh, hd, bs = 9, 3, 64, 16
    per = context // bs
    g = torch.Generator(device=device).manual_seed(0)
    k_cache = torch.randn(b * per, bs, kvh, hd, device=device, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(b * per, bs, kvh, hd, device=device, generator=g).to(torch.bfloat16)
    tables = torch.randperm(b * per, device=device, generator=g).view(b, per).int()
    lens = torch.full((b,), context, dtype=torch.int32, device=device)
    q = torch.randn(b, heads, hd, device=device, generator=g).to(torch.bfloat16)
    out = torch.empty_like(q)

    def kernel() -> None:
        triton_attention.paged_decode(q, k_cache, v_cache, tables, lens, hd ** -0.5, out)

    def gather() -> torch.Tensor:
        kc = _gather(k_cache, tables).transpose(1, 2)
        vc = _gather(v_cache, tables).transpose(1, 2)
        return F.scaled_dot_product_attention(q.view(b, kvh, heads // kvh, hd), kc, vc, scale=hd ** -0.5)

    def per_call_us(fn, n: int = 20) -> float:
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n * 1e6

    t_kernel, t_gather = per_call_us(kernel), per_call_us(gather)
    diff = float((out.float() - gather().reshape(b, heads, hd).float()).abs().max())
    kv_bytes = 2 * b * context * kvh * hd * 2
    splits = triton_attention.choose_splits(b * kvh, per * bs // triton_attention.BLOCK_N, q.device)
    return {"batch": b, "context": context, "splits": splits,
            "triton_us": round(t_kernel, 1), "gather_us": round(t_gather, 1),
            "speedup": round(t_gather / t_kernel, 2), "triton_kv_gbps": round(kv_bytes / t_kernel / 1e3, 1),
            "max_abs_diff": diff}


def hf_model(model_dir: Path, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    model = model.to(device).eval()
    model.generation_config.eos_token_id = None  # run the full length, as our loop does
    return model


def _hf_greedy(model, prompt: list[int], n: int, device: str) -> tuple[list[int], list[float]]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt], device=device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
            do_sample=False, max_new_tokens=n, pad_token_id=0, output_logits=True,
            return_dict_in_generate=True)
    margins = []
    for step_logits in out.logits:
        top2 = step_logits[0].float().topk(2).values
        margins.append(float(top2[0] - top2[1]))
    return out.sequences[0, len(prompt):].tolist(), margins


def _compare(ours: list[int], theirs: list[int], margins: list[float], tie: float) -> dict[str, Any]:
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a != b:
            return {"diverged_at": step, "margin": margins[step], "near_tie": margins[step] < tie}
    return {"diverged_at": None}


def engine_greedy(ctx: Ctx, rec: dict[str, Any]) -> None:
    """ModelRunner's greedy == transformers' on the same device and dtype, per model and dtype."""
    from engine.model.attention import triton_status
    from engine.model.runner import ModelRunner

    archs = ("llama",) if ctx.selftest else ("llama", "qwen2", "qwen3")
    cases: list[tuple[str, Path]] = [(f"tiny-{a}", models.tiny(ctx, a)) for a in archs]
    cases.append(("smollm2-135m", models.shaped(ctx, "smollm2-135m", "float32")))
    n_new = 8 if ctx.selftest else 16
    failures = []
    for name, model_dir in cases:
        # --cpu-selftest: one dtype a model (tiny float32, the shaped one bfloat16).
        dtypes = (["float32", "bfloat16"] if not ctx.selftest
                  else ["float32" if name.startswith("tiny") else "bfloat16"])
        for dt in dtypes:
            ctx.check_time(f"before {name} {dt}")
            runner = ModelRunner(model_dir, num_blocks=64, block_size=16, device=ctx.device, dtype=dt)
            vocab = runner.config.vocab_size
            rng = random.Random(len(name))
            prompts = [[rng.randrange(3, min(vocab, 512)) for _ in range(n)] for n in (7, 23, 40)]
            ours = runner_greedy(runner, prompts, n_new)
            hf = hf_model(model_dir, getattr(torch, dt), ctx.device)
            tie = NEAR_TIE if dt == "float32" else BF16_NEAR_TIE
            rows = [_compare(o, *_hf_greedy(hf, p, n_new, ctx.device), tie) for p, o in zip(prompts, ours)]
            diverged = [r for r in rows if r["diverged_at"] is not None]
            near = sum(r["near_tie"] for r in diverged)
            ok = all(r["near_tie"] for r in diverged) and near <= 1
            rec[f"{name}/{dt}"] = {"ok": ok, "near_ties": near, "prompts": rows,
                                   "decode_path": triton_status() if ctx.cuda else "native or torch"}
            ctx.log(f"  {name} {dt}: {'ok' if ok else 'DIFFERS'} ({near} near-tie(s))")
            if not ok:
                failures.append(f"{name}/{dt}")
            del runner, hf
            if ctx.cuda:
                torch.cuda.empty_cache()
    assert not failures, f"greedy differs from transformers beyond a near-tie: {failures}"


def _blocks(n: int, nbytes: int, seed: int) -> tuple[list, list]:
    from kvstore.keys import block_keys, namespace_id

    ns = namespace_id({"gpu_check": seed})
    keys = block_keys(ns, list(range(n * 16)), 16)
    g = torch.Generator().manual_seed(seed)
    return keys, [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g) for _ in range(n)]


def staging(ctx: Ctx, rec: dict[str, Any]) -> None:
    """The connector on a cache of this device: loads and saves reuse pooled (on CUDA pinned)
    staging buffers, so many requests allocate nothing once warm; loaded bytes are the saved ones."""
    from engine.kv.connector import KVStoreConnector
    from gpucheck.store import daemon
    from kvstore import Client

    address = daemon(ctx)
    cache = torch.randn(3, 2, 32, 16, 2, 16, generator=torch.Generator().manual_seed(0)).to(ctx.device)
    keys, _ = _blocks(5, 1, seed=1)
    rounds = 20
    for path in ("auto", "python"):
        client = Client(address, timeout=30)
        conn = KVStoreConnector(client, cache, save_all=True, load_path=path)
        try:
            warm = 0
            for r in range(rounds + 1):
                conn.save_blocks(keys, [0, 1, 2, 3, 4], request_id=f"{path}-{r}")
                conn.flush(f"{path}-{r}").result(timeout=30)
                for n, first in ((1, 8), (3, 9), (5, 12)):
                    got = conn.load_blocks(keys[:n], list(range(first, first + n)))
                    assert got.loaded == n, (path, r, got)
                if r == 0:
                    warm = conn.staging_allocations()
            allocs = conn.staging_allocations()
            pinned = [b.is_pinned() for free in conn._pool._free.values() for b, _ in free]
            if ctx.cuda:
                torch.cuda.synchronize()
            same = all(torch.equal(cache[:, :, s], cache[:, :, b]) for s, b in ((8, 0), (11, 2), (16, 4)))
            rec[path] = {"allocations_after_warmup": allocs - warm, "warm_allocations": warm,
                         "rounds": rounds, "pinned": all(pinned) if pinned else None, "bytes_equal": same}
            assert allocs == warm, f"{path}: {allocs - warm} staging allocations after warm-up"
            assert same, f"{path}: loaded blocks differ from the saved ones"
            assert not ctx.cuda or all(pinned), f"{path}: a staging buffer on CUDA is not pinned"
        finally:
            conn.close()
            client.close()


def gpu_tier(ctx: Ctx, rec: dict[str, Any]) -> None:
    """The store's GPU tier on this device: host demotes into it, its LRU spills to SSD, gets
    come back through it (tests/kvstore/test_gpu_tier.py's scenario)."""
    import kvstore.node.gpu_tier as gt
    from kvstore.keys import BlockKey
    from kvstore.node.store import BlockStore, StoreConfig

    B = 4096
    K = lambda i: BlockKey(i.to_bytes(16, "little"))  # noqa: E731
    V = lambda i: (i.to_bytes(16, "little") * (B // 16))[:B]  # noqa: E731
    saved, gt.DEFAULT_DEVICE = gt.DEFAULT_DEVICE, ctx.device
    try:
        cfg = StoreConfig(memory_bytes=20 * B, gpu_memory_bytes=4 * B, ssd_path=str(ctx.work / "ssd"),
                          ssd_capacity_bytes=100 * B, high_watermark=0.5, low_watermark=0.25)
        with BlockStore(cfg) as store:
            assert store._gpu is not None and store._gpu._buf.device.type == ctx.device
            for i in range(11):
                store.put(K(i), V(i))
            st = store.stats()
            rec["after_puts"] = {"host_demotions": st.host.demotions, "gpu_blocks": st.gpu.blocks,
                                 "gpu_demotions": st.gpu.demotions, "ssd_blocks": st.ssd.blocks}
            assert (st.host.demotions, st.gpu.blocks, st.gpu.demotions, st.ssd.blocks) == (6, 4, 2, 2)
            assert all(store.get(K(i)) == V(i) for i in range(11)), "a block came back different"
            st = store.stats()
            rec["gpu_hits"] = st.gpu.hits
            assert st.gpu.hits == 4
    finally:
        gt.DEFAULT_DEVICE = saved


def client_cuda(ctx: Ctx, rec: dict[str, Any]) -> None:
    """The client puts and gets tensors of this device through the daemon (shm and TCP)."""
    from gpucheck.store import daemon
    from kvstore import Client

    address = daemon(ctx)
    for transport in ("shm", "tcp"):
        keys, vals = _blocks(4, 1 << 16, seed=7 if transport == "shm" else 8)
        src = [v.view(torch.float16).to(ctx.device) for v in vals]
        with Client(address, transport=transport, timeout=30) as c:
            assert c.put(keys, src) == [True] * 4
            dst = [torch.zeros_like(s) for s in src]
            found = c.get(keys, dst)
            same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(src, dst))
            rec[transport] = {"found": found, "equal": same}
            assert found == [True] * 4 and rec[transport]["equal"], rec[transport]
            c.delete(keys)
    rec["device"] = ctx.device
