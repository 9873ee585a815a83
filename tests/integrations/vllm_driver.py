"""One vLLM instance (offline ``LLM``, run by ``.venv-vllm``'s Python) with the store's
connector, driven over stdin/stdout: one JSON command a line, one JSON answer a line (after
``MARK``; vLLM writes its logs to stdout too).

Started as ``python -m tests.integrations.vllm_driver CONFIG_JSON``; the config names ``model``,
``address`` (the daemon), ``secret_file``, ``kv_role``, ``block_size``, ``prefix_caching``,
``handoff_wait_s``. It answers ``{"ready": true}`` once vLLM is up, then per command
``{"prompts": [[ids...], ...], "max_tokens": n, "kv_transfer_params": {...} | null}``: each
prompt's greedy token ids, generated one prompt at a time, the seconds each took, and vLLM's
own counters of where the prompt tokens came from (``prompt_tokens_by_source``: computed,
device prefix-cache hits, loaded through the connector). End of input ends it.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

MARK = "@@vllm-driver "  # vLLM logs to stdout too: answers are the lines that start so


def _counters(llm: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name == "vllm:prompt_tokens_by_source":
            out[m.labels.get("source", "?")] = float(m.value)
        elif m.name in ("vllm:external_prefix_cache_hits", "vllm:prefix_cache_hits",
                        "vllm:prompt_tokens"):
            out[m.name.removeprefix("vllm:")] = float(m.value)
    return out


def main() -> None:
    cfg = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    extra = {k: cfg[k] for k in ("address", "secret_file", "timeout", "handoff_wait_s") if k in cfg}
    ktc = KVTransferConfig(kv_connector="KVStoreConnector",
                           kv_connector_module_path="kvstore.integrations.vllm.connector",
                           kv_role=cfg.get("kv_role", "kv_both"), kv_load_failure_policy="recompute",
                           kv_connector_extra_config=extra)
    llm = LLM(model=cfg["model"], dtype="float32", block_size=cfg.get("block_size", 32),
              max_model_len=cfg.get("max_model_len", 8192), enforce_eager=True,
              enable_prefix_caching=cfg.get("prefix_caching", True), kv_transfer_config=ktc,
              max_num_seqs=4, kv_cache_memory_bytes=cfg.get("kv_cache_bytes", 1 << 30), seed=0,
              disable_log_stats=False)
    print(MARK + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        extra_args = ({"kv_transfer_params": cmd["kv_transfer_params"]}
                      if cmd.get("kv_transfer_params") else None)
        sp = SamplingParams(temperature=0, max_tokens=cmd.get("max_tokens", 16), ignore_eos=True,
                            extra_args=extra_args)
        tokens, seconds = [], []
        for ids in cmd["prompts"]:
            t0 = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)
            seconds.append(time.perf_counter() - t0)
            tokens.append(list(out[0].outputs[0].token_ids))
        print(MARK + json.dumps({"tokens": tokens, "seconds": seconds, "counters": _counters(llm)}), flush=True)


if __name__ == "__main__":
    main()
