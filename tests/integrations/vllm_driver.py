"""Runs one vLLM instance (offline ``LLM``, in ``.venv-vllm``) with the store's connector and
prints one JSON line: each prompt's greedy text per round, and what the store saw.

Usage: ``python vllm_driver.py CONFIG_JSON``; the config names ``model``, ``address``,
``prompts`` (token id lists), ``rounds`` (how many times each prompt is generated, in order),
``max_tokens``, ``prefix_caching``, ``kv_role``, ``block_size``, ``handoff_wait_s``.
Used by tests/integrations/test_vllm_connector.py and benchmarks/vllm_bench.py.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    cfg = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    extra = {"address": cfg["address"], "timeout": cfg.get("timeout", 2.0),
             "handoff_wait_s": cfg.get("handoff_wait_s", 10.0)}
    ktc = KVTransferConfig(kv_connector="KVStoreConnector",
                           kv_connector_module_path="kvstore.integrations.vllm.connector",
                           kv_role=cfg.get("kv_role", "kv_both"), kv_load_failure_policy="recompute",
                           kv_connector_extra_config=extra)
    llm = LLM(model=cfg["model"], dtype="float32", block_size=cfg.get("block_size", 32),
              max_model_len=cfg.get("max_model_len", 4096), enforce_eager=True,
              enable_prefix_caching=cfg.get("prefix_caching", True), kv_transfer_config=ktc,
              max_num_seqs=4, kv_cache_memory_bytes=cfg.get("kv_cache_bytes", 1 << 30), seed=0)
    sp = SamplingParams(temperature=0, max_tokens=cfg.get("max_tokens", 16), ignore_eos=True)
    rounds = []
    for _ in range(cfg.get("rounds", 1)):
        texts, seconds = [], []
        for ids in cfg["prompts"]:
            t0 = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)
            seconds.append(time.perf_counter() - t0)
            texts.append(list(out[0].outputs[0].token_ids))
        rounds.append({"tokens": texts, "seconds": seconds})
    print("RESULT " + json.dumps({"rounds": rounds}), flush=True)


if __name__ == "__main__":
    main()
