"""Decode attention alone: the native paged kernel against the torch path (gather + SDPA).

One layer of the default model's shapes (9 query heads, 3 KV heads, head_dim 64, blocks of
16), a batch of sequences with 512-544 keys each in scattered blocks; both paths on the same
inputs in one run, medians of 30 calls, the largest difference between their outputs.

    .venv/bin/python -m benchmarks.serving.attention_bench            # a few seconds
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from benchmarks.report import emit
from engine.model import native


def _median_ms(fn, n: int = 30) -> float:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[n // 2] * 1e3


def case(n: int, ctx: int, heads: int = 9, kvh: int = 3, hd: int = 64, bs: int = 16) -> dict:
    g = torch.Generator().manual_seed(n)
    nblk = -(-ctx // bs)
    pool = n * nblk + 64
    kc, vc = torch.randn(pool, bs, kvh, hd, generator=g), torch.randn(pool, bs, kvh, hd, generator=g)
    tables = torch.randperm(pool, generator=g)[: n * nblk].view(n, nblk)
    lens = torch.randint(ctx - 32, ctx + 1, (n,), generator=g)
    q = torch.randn(n, heads, hd, generator=g)
    scale = hd**-0.5
    mask = (torch.arange(ctx)[None] < lens[:, None]).view(n, 1, 1, ctx)

    def torch_path() -> torch.Tensor:
        k = kc.index_select(0, tables.reshape(-1)).view(n, -1, kvh, hd)[:, :ctx].transpose(1, 2)
        v = vc.index_select(0, tables.reshape(-1)).view(n, -1, kvh, hd)[:, :ctx].transpose(1, 2)
        o = F.scaled_dot_product_attention(q.view(n, kvh, heads // kvh, hd), k, v, attn_mask=mask, scale=scale)
        return o.reshape(n, heads, hd)

    bt32, lens32 = tables.to(torch.int32), lens.to(torch.int32)

    def native_path() -> torch.Tensor:
        return native.paged_decode(q, kc, vc, bt32, lens32, scale)

    diff = (torch_path() - native_path()).abs().max().item()
    t_torch, t_native = _median_ms(torch_path), _median_ms(native_path)
    return {"batch": n, "keys": ctx, "torch_ms": t_torch, "native_ms": t_native,
            "speedup": t_torch / t_native, "max_abs_diff": diff}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving.attention_bench", description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="1,8,32", help="comma-separated decode batch sizes (default %(default)s)")
    p.add_argument("--keys", type=int, default=544, help="context length in tokens of every sequence (default 544)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    status = native.native_status()
    if status != "native":
        raise SystemExit(f"attention_bench: the native kernel is not available: {status}")
    rows = [case(int(b), args.keys) for b in args.batches.split(",")]
    emit({"bench": "attention", "threads": torch.get_num_threads(), "cases": rows})


if __name__ == "__main__":
    main()
