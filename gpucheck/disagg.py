"""Prefill worker -> store -> decode worker on this device, against a colocated worker.

Three ``kvengine serve`` processes (``tests.engine.worker_procs``) on the tiny llama checkpoint,
with the check's store daemon as their ``--store`` (a direct address: no etcd), their KV caches on
the check's device in float32 (the dtype in which prefill-then-load and compute-it-all agree bit
for bit, as tests/engine/test_disagg.py asserts on CPU):

- ``handoff``: for prompts of 37, 32 and 50 tokens, the prefill worker's first token plus the
  decode worker's continuation equal the colocated worker's greedy tokens; the decode worker
  loaded every full prompt block from the store and computed only the partial last block;
- ``recompute``: a damaged (checksum) and a missing store block are recomputed by the decode
  worker, counted (a corrupt one on read), and change nothing in its output.
"""

from __future__ import annotations

import random
import threading
from typing import Any

from gpucheck import models
from gpucheck.runner import Ctx
from gpucheck.store import daemon

__all__ = ["disagg", "BS"]

BS = 16
MAX_TOKENS = 24


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


def _start(ctx: Ctx, address: str) -> dict[str, Any]:
    from tests.engine.worker_procs import start_worker

    model = models.tiny(ctx, "llama")
    common = ["--num-blocks", "96", "--block-size", str(BS), "--max-num-batched-tokens", "64",
              "--device", ctx.device, "--dtype", "float32"]
    roles = {"prefill": ["--role", "prefill", "--store", address],
             "decode": ["--role", "decode", "--store", address],
             "colocated": ["--role", "colocated"]}
    started: dict[str, Any] = {}
    errors: dict[str, str] = {}

    def one(name: str, flags: list[str]) -> None:
        try:
            started[name] = start_worker(model, ctx.work / f"worker-{name}", *common, *flags,
                                         timeout=max(10.0, ctx.left()))
        except Exception as e:  # noqa: BLE001 - reported below with the others
            errors[name] = str(e)[-2000:]

    threads = [threading.Thread(target=one, args=item) for item in roles.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for w in started.values():
        ctx.cleanups.append(w.kill)
    if errors:
        raise RuntimeError(f"workers failed to start: {errors}")
    return started


def disagg(ctx: Ctx, rec: dict[str, Any]) -> None:
    import kvstore
    from kvstore.keys import BlockKey, block_keys
    from tests.engine.worker_procs import generate, greedy, metric

    address = daemon(ctx)
    w = _start(ctx, address)
    prefill, decode, colocated = w["prefill"], w["decode"], w["colocated"]
    rec["workers_ready"] = True
    client = kvstore.connect(address, timeout=30)
    try:
        for n in (37, 32, 50):
            ctx.check_time(f"handoff of {n} tokens")
            prompt = _prompt(n, n)
            first, pre = generate(prefill.address, greedy(f"pd-{n}", prompt, MAX_TOKENS, "prefill"))
            body = greedy(f"pd-{n}", prompt, MAX_TOKENS, "decode", output=first)
            body["block_keys"] = pre["block_keys"]
            rest, dec = generate(decode.address, body)
            baseline, _ = generate(colocated.address, greedy(f"co-{n}", prompt, MAX_TOKENS))
            full = n // BS * BS
            row = {"equal": first + rest == baseline, "store_hit_tokens": dec["stats"]["store_hit_tokens"],
                   "computed_prompt_tokens": dec["stats"]["computed_prompt_tokens"], "full_block_tokens": full}
            rec[f"handoff-{n}"] = row
            assert row["equal"], f"prompt {n}: disaggregated tokens differ from the colocated ones"
            assert row["store_hit_tokens"] == full and row["computed_prompt_tokens"] == n - full + 1, row
        for damage in ("corrupt", "missing"):
            ctx.check_time(f"recompute of a {damage} block")
            n = 3 * BS + 5
            prompt = _prompt({"corrupt": 101, "missing": 102}[damage], n)
            first, _ = generate(prefill.address, greedy(f"{damage}-p", prompt, MAX_TOKENS, "prefill"))
            key = block_keys(BlockKey.from_hex(prefill.namespace), prompt, BS)[1]
            if damage == "corrupt":
                value = bytearray(client.get_bytes([key])[0])
                value[-1] ^= 0x5A  # one payload byte: the checksum no longer matches
                client.delete([key])
                client.put([key], [bytes(value)])
            else:
                assert client.delete([key]) == 1
            name = f'kvengine_store_blocks_recomputed_total{{reason="{damage}"}}'
            before = metric(decode.address, name)
            rest, final = generate(decode.address, greedy(f"{damage}-d", prompt, MAX_TOKENS, "decode",
                                                          output=first))
            after = metric(decode.address, name)
            baseline, _ = generate(colocated.address, greedy(f"{damage}-c", prompt, MAX_TOKENS))
            row = {"equal": first + rest == baseline, "store_hit_tokens": final["stats"]["store_hit_tokens"],
                   "recomputed_counted": after - before}
            rec[f"recompute-{damage}"] = row
            assert row["equal"], f"{damage} block: output differs from the colocated one"
            assert row["store_hit_tokens"] == BS, row  # block 0 only; block 1 on are recomputed
            assert row["recomputed_counted"] == (1 if damage == "corrupt" else 0), row
    finally:
        client.close()
        for proc in w.values():
            proc.kill()
