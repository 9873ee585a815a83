"""The store as vLLM's KV connector, with the real vLLM on the default model: the package's two
vLLM servers (``vllm_pd``: a producer and a consumer in separate processes, one store).

One scenario, in the order a fleet meets it: the producer computes two ~2k-token prompts
(saving their blocks) and generates them again with device prefix-cache hits, the reference;
the consumer, which never saw them, loads every full block of both from the store (vLLM's own
counters and the connector's) and generates exactly the reference. The consumer, handed a
prefill's ``kv_transfer_params`` before the producer computed the prompt, waits for the blocks
instead of recomputing them. Every text is also checked against transformers (the project's
oracle: a divergence only at a near-tie, counted). The store killed under the instances:
``test_vllm_router.py`` (which brings a fresh store back).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest

from tests.integrations.vllm_procs import ROOT, VllmPD, VllmServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_TOKENS = 12


def _prompts(pd: VllmPD) -> list[list[int]]:
    """Prompts cut from this repository's docs (none a block multiple)."""
    ids = pd.tokenizer().encode((ROOT / "docs" / "benchmarks.md").read_text()).ids
    # Two ~1.9k-token prompts, and a shorter one for the decode that waits for its prefill.
    return [ids[9000:10900], ids[11100:13017], ids[13200:14233]]


def _generate(pd: VllmPD, server: VllmServer, prompt: list[int], **extra: Any) -> list[int]:
    resp = httpx.post(server.url + "/v1/completions", headers=pd.headers, timeout=600, json={
        "model": pd.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True, **extra})
    assert resp.status_code == 200, resp.text
    return list(resp.json()["choices"][0]["token_ids"])


def _counts(server: VllmServer) -> dict[str, float]:
    return {**server.prompt_tokens_by_source(),
            **{k: server.metric(f"vllm:kvstore_{k}_total")
               for k in ("loaded_blocks", "failed_blocks", "waited_s", "saved_blocks", "store_errors")}}


def _grew(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def _check_oracle(pd: VllmPD, prompts: list[list[int]], tokens: list[list[int]]) -> int:
    from tests.engine.hf_oracle import assert_same_greedy, hf_greedy

    near_ties = 0
    for p, t in zip(prompts, tokens):
        theirs, margins = hf_greedy(pd.model_dir, p, MAX_TOKENS)
        near_ties += assert_same_greedy(t, theirs, margins)
    return near_ties


def test_two_vllm_instances_share_blocks_through_the_store(vllm_pd: VllmPD) -> None:
    pd, bs = vllm_pd, vllm_pd.block_size
    p = _prompts(pd)
    cold = [_generate(pd, pd.producer, x) for x in p[:2]]
    hits0 = _counts(pd.producer)
    device_hit = [_generate(pd, pd.producer, x) for x in p[:2]]
    assert _grew(hits0, _counts(pd.producer), "local_cache_hit") >= sum((len(x) - 1) // bs * bs for x in p[:2])
    assert device_hit == cold

    # The consumer loads every full block of both from the store and generates the reference.
    before = _counts(pd.consumer)
    hit = [_generate(pd, pd.consumer, x) for x in p[:2]]
    after = _counts(pd.consumer)
    full = sum((len(x) - 1) // bs for x in p[:2])
    assert _grew(before, after, "external_kv_transfer") == full * bs
    assert _grew(before, after, "local_compute") == sum(len(x) for x in p[:2]) - full * bs
    assert _grew(before, after, "loaded_blocks") == full  # the connector's own counter
    assert hit == device_hit

    # A decode handed a prefill's blocks waits for them (the prefill computes them only later).
    handed = {"kvstore": {"blocks": len(p[2]) // bs}}
    result: dict[str, list[int]] = {}
    decode = threading.Thread(target=lambda: result.update(
        tokens=_generate(pd, pd.consumer, p[2], kv_transfer_params=handed)))
    before = _counts(pd.consumer)
    produced = _counts(pd.producer)
    t0 = time.monotonic()
    decode.start()
    time.sleep(1.0)   # the decode is waiting in its load before the prefill starts
    prefill = _generate(pd, pd.producer, p[2])
    t_prefill = time.monotonic() - t0
    decode.join(300)
    after = _counts(pd.consumer)
    seen = (f"prefill done after {t_prefill:.1f} s, decode after {time.monotonic() - t0:.1f} s; "
            f"consumer {before} -> {after}; producer {produced} -> {_counts(pd.producer)}")
    assert _grew(before, after, "local_compute") < bs, seen
    assert result["tokens"] == prefill

    near_ties = _check_oracle(pd, p[:3], [*hit, result["tokens"]])
    print(f"vLLM + kvstore: 3 prompts x {MAX_TOKENS} tokens, near-tie divergences from transformers: {near_ties}")
    assert near_ties <= 1
