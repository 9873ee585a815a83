"""One vLLM instance (offline ``LLM``, run by ``.venv-vllm``'s Python) with a KV connector,
driven over stdin/stdout: one JSON command a line, one JSON answer a line (after ``MARK``;
vLLM writes its logs to stdout too). Used by tests/integrations/test_vllm_connector.py and
benchmarks/serving/vllm_bench.py.

Started as ``python -m benchmarks.serving.vllm_driver CONFIG_JSON``; the config names ``model``,
``connector`` (``kvstore``, the default; ``example``, vLLM's ``ExampleConnector`` over
``storage_path``; ``none``), ``address`` (the daemon), ``secret_file``, ``kv_role``,
``block_size``, ``prefix_caching``, ``handoff_wait_s``, ``max_model_len``, ``kv_cache_bytes``,
``max_num_batched_tokens``. It answers ``{"ready": true}`` once vLLM is up, then per command
``{"prompts": [[ids...], ...], "max_tokens": n, "kv_transfer_params": {...} | null}``: each
prompt's greedy token ids, generated one prompt at a time, the seconds each took, and vLLM's
own counters of where the prompt tokens came from (``prompt_tokens_by_source``: computed,
device prefix-cache hits, loaded through the connector); ``{"reset_prefix_cache": true}``
empties the device prefix cache. End of input ends it.
"""

# pyright: reportMissingImports=false
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import argparse

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv-vllm" / "bin" / "python"  # scripts/setup_vllm.sh builds it

MARK = "@@vllm-driver "  # vLLM logs to stdout too: answers are the lines that start so


def _counters(llm: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name == "vllm:prompt_tokens_by_source":
            out[m.labels.get("source", "?")] = float(m.value)
        elif m.name in ("vllm:external_prefix_cache_hits", "vllm:prefix_cache_hits",
                        "vllm:prompt_tokens") or m.name.startswith("vllm:kvstore_"):
            out[m.name.removeprefix("vllm:")] = float(m.value)
    return out


class Instance:
    """The parent's side: one vLLM process running this module; its stderr, and the stdout
    lines that are not answers, go to ``log``."""

    def __init__(self, log: Path, max_tokens: int = 16, **cfg: Any) -> None:
        self.max_tokens = max_tokens
        self.counters: dict[str, float] = {}
        env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_LOGGING_LEVEL": "WARNING",
               "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        self._log = log.open("w")
        self.proc = subprocess.Popen([str(PYTHON), "-m", "benchmarks.serving.vllm_driver", json.dumps(cfg)],
                                     cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True)

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
            self._log.write(line)
        raise AssertionError(f"the vLLM driver died; its log: {self._log.name}")

    def ready(self) -> None:
        assert self._read() == {"ready": True}

    def send(self, prompts: list[list[int]], **kw: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": self.max_tokens, **kw}) + "\n")
        self.proc.stdin.flush()

    def generate(self, prompts: list[list[int]], **kw: Any) -> dict[str, Any]:
        self.send(prompts, **kw)
        return self.result()

    def result(self) -> dict[str, Any]:
        """The answer to the last ``send``; its counters are kept as ``counters``."""
        out = self._read()
        self.counters = out["counters"]
        return out

    def reset_prefix_cache(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"reset_prefix_cache": True}) + "\n")
        self.proc.stdin.flush()
        assert self._read()["reset"], "vLLM refused to reset its prefix cache"

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(60)
            except (subprocess.TimeoutExpired, BrokenPipeError):
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def build_parser() -> "argparse.ArgumentParser":
    import argparse

    p = argparse.ArgumentParser(prog="python -m benchmarks.serving.vllm_driver",
                                description="one vLLM instance with a KV connector, driven over stdin/stdout "
                                            "(run by .venv-vllm's Python; see the module docstring)")
    p.add_argument("config", help="the instance's configuration as one JSON object (module docstring)")
    return p


def main() -> None:
    cfg = json.loads(build_parser().parse_args().config)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    connector = cfg.get("connector", "kvstore")
    ktc = None
    if connector == "kvstore":
        extra = {k: cfg[k] for k in ("address", "secret_file", "timeout", "handoff_wait_s") if k in cfg}
        ktc = KVTransferConfig(kv_connector="KVStoreConnector",
                               kv_connector_module_path="kvstore.integrations.vllm.connector",
                               kv_role=cfg.get("kv_role", "kv_both"), kv_load_failure_policy="recompute",
                               kv_connector_extra_config=extra)
    elif connector == "example":
        ktc = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                               kv_connector_extra_config={"shared_storage_path": cfg["storage_path"]})
    llm = LLM(model=cfg["model"], dtype="float32", block_size=cfg.get("block_size", 32),
              max_model_len=cfg.get("max_model_len", 8192), enforce_eager=True,
              enable_prefix_caching=cfg.get("prefix_caching", True), kv_transfer_config=ktc,
              max_num_seqs=4, kv_cache_memory_bytes=cfg.get("kv_cache_bytes", 1 << 30), seed=0,
              max_num_batched_tokens=cfg.get("max_num_batched_tokens"),
              disable_log_stats=False)
    print(MARK + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("reset_prefix_cache"):
            # vLLM refuses while blocks are in use: a finished request's blocks stay held until
            # the connector's save of them is done (seconds for a long prompt). Bounded retries.
            deadline, ok = time.monotonic() + 120, False
            while not ok and time.monotonic() < deadline:
                ok = llm.reset_prefix_cache() in (True, None)
                if not ok:
                    time.sleep(0.1)
            print(MARK + json.dumps({"reset": ok}), flush=True)
            continue
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
