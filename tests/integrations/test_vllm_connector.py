"""The store as vLLM's KV connector, with the real vLLM (``.venv-vllm``, vLLM's CPU backend) on
the default model: two instances in separate processes share one real daemon.

One scenario, in the order a fleet meets it (each vLLM start costs most of a minute here):
instance A computes two ~2k-token prompts (saving their blocks) and generates them again with
device prefix-cache hits, the reference; instance B, started beside it, loads every full block
of both from the store and generates exactly the reference. B, a decode given a prefill's
``kv_transfer_params``, waits for blocks that A stores only later instead of recomputing them.
Then the daemon is killed: B still serves a new prompt, correctly. Every text is also checked
against transformers (the project's oracle: a divergence only at a near-tie, counted).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest

from kvstore.client.node import Client
from benchmarks.vllm_driver import PYTHON, Instance
from tests.kvstore.conftest import DaemonFactory

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SECRET = "vllm-test-secret"
BLOCK = 32
MAX_TOKENS = 12


@pytest.fixture
def instances(tmp_path: Path) -> Iterator[Any]:
    if not PYTHON.exists():
        pytest.skip("the vLLM environment is not built: bash scripts/setup_vllm.sh")
    started: list[Instance] = []

    def start(**cfg: Any) -> Instance:
        started.append(Instance(tmp_path / f"vllm{len(started)}.log", max_tokens=MAX_TOKENS, **cfg))
        return started[-1]

    try:
        yield start
    finally:
        for i in started:
            i.close()


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    from engine.model.convert import ensure_default_model

    return ensure_default_model(progress=False)


def _prompts(model_dir: Path) -> list[list[int]]:
    """Four prompts of 2,000-2,100 tokens cut from this repository's docs (none a block multiple)."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(
        (ROOT / "docs" / "architecture.md").read_text()).ids
    return [ids[i * 2100:i * 2100 + 2000 + 17 * i] for i in range(4)]


def _hits(address: str) -> int:
    with Client(address, auth_token=SECRET) as c:
        return int(c.stats()["store"]["host"]["hits"])


def _check_oracle(model_dir: Path, prompts: list[list[int]], tokens: list[list[int]]) -> int:
    from tests.engine.hf_oracle import assert_same_greedy, hf_greedy

    near_ties = 0
    for p, t in zip(prompts, tokens):
        theirs, margins = hf_greedy(model_dir, p, MAX_TOKENS)
        near_ties += assert_same_greedy(t, theirs, margins)
    return near_ties


def test_two_vllm_instances_share_blocks_through_the_store(instances, smollm2_dir, tmp_path) -> None:
    factory = DaemonFactory(tmp_path / "daemons")
    try:
        daemon = factory(memory="1G", env={"KVCACHE_CLUSTER_SECRET": SECRET})
        secret = tmp_path / "secret"
        secret.write_text(SECRET)
        cfg = {"model": str(smollm2_dir), "address": daemon.address, "secret_file": str(secret),
               "block_size": BLOCK, "timeout": 2.0, "handoff_wait_s": 120.0}
        p = _prompts(smollm2_dir)
        a, b = instances(**cfg), instances(**cfg)  # both start at once
        a.ready()
        cold = a.generate(p[:2])
        device_hit = a.generate(p[:2])
        assert device_hit["counters"]["local_cache_hit"] >= sum((len(x) - 1) // BLOCK * BLOCK for x in p[:2])
        assert device_hit["tokens"] == cold["tokens"]

        # B loads every full block of both prompts from the store and generates the reference.
        b.ready()
        before = _hits(daemon.address)
        hit = b.generate(p[:2])
        full = sum((len(x) - 1) // BLOCK for x in p[:2])
        assert _hits(daemon.address) - before >= full
        assert hit["counters"]["external_kv_transfer"] == full * BLOCK
        assert hit["counters"]["kvstore_loaded_blocks"] == full  # the connector's own counter
        assert hit["counters"]["local_compute"] == sum(len(x) for x in p[:2]) - full * BLOCK
        assert hit["tokens"] == device_hit["tokens"]

        # A decode handed a prefill's blocks waits for them (the prefill stores them late).
        handed = {"kvstore": {"blocks": len(p[2]) // BLOCK}}
        b.send([p[2]], kv_transfer_params=handed)
        prefill = a.generate([p[2]])
        decode = b.result()
        assert decode["counters"]["local_compute"] - hit["counters"]["local_compute"] < BLOCK
        assert decode["tokens"] == prefill["tokens"]

        # A dead store is a miss: B serves a new prompt all the same.
        daemon.proc.kill()
        daemon.proc.wait()
        alone = b.generate([p[3]])
        assert alone["counters"]["local_compute"] - decode["counters"]["local_compute"] == len(p[3])

        near_ties = _check_oracle(smollm2_dir, [*p[:3], p[3]], [*hit["tokens"], *decode["tokens"], *alone["tokens"]])
        print(f"vLLM + kvstore: 4 prompts x {MAX_TOKENS} tokens, near-tie divergences from transformers: {near_ties}")
        assert near_ties <= 1
    finally:
        factory.close()
