"""Fixtures for the router's unit tests: a small byte-level BPE checkpoint tokenizer built here
(until engine/model/tiny.py's checkpoint exists), with a ChatML template like SmolLM2's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A Llama-2-style template: bos_token in scope, raise_exception, whitespace control (its long
# line split into two adjacent literals).
LLAMA_TEMPLATE = ("""{% if messages[0]['role'] == 'system' %}
    {% set system = messages[0]['content'] %}
    {% set messages = messages[1:] %}
{% else %}
    {% set system = false %}
{% endif %}
{% for message in messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['role'] == 'user' %}
        {{ bos_token + '[INST] ' + (('<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n') if loop.first and system else '')"""
                  """ + message['content'] | trim + ' [/INST]' }}
    {% else %}
        {{ ' ' + message['content'] | trim + ' ' + eos_token }}
    {% endif %}
{% endfor %}""")

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "KV caches make repeated prefixes cheap. Prefill builds them, decode reads them.",
    "What is the capital of France? Paris is the capital of France.",
    "system user assistant You are a helpful AI assistant named SmolLM",
] * 20


def build_tokenizer_dir(path: Path, template: str = CHATML_TEMPLATE) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|im_end|>",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "chat_template": template,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer_dir(tmp_path_factory.mktemp("tok") / "chatml")


@pytest.fixture(scope="session")
def llama_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer_dir(tmp_path_factory.mktemp("tok") / "llama", LLAMA_TEMPLATE)


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path):
    from engine.api.tokenizer import Tokenizer as Wrapper

    return Wrapper.from_dir(tokenizer_dir)


# --- real-process clusters (etcd, a store, workers, routers) for the end-to-end tests ----------
#
# Each test module that needs one builds its own cluster with ``cluster_factory`` (module
# scoped, so the cluster is shared by the module's tests and stopped after them). The
# cluster is ``router.cluster.launcher.LocalCluster``, the same code ``kvrouter up`` runs, on the
# session's etcd, with the tiny deterministic checkpoint and one torch thread per worker.


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.model.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=0)


@pytest.fixture(scope="module")
def cluster_factory(etcd: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """``make(**ClusterSpec fields) -> LocalCluster`` (started); all stopped at module end."""
    import uuid

    from router.cluster.launcher import ClusterSpec, LocalCluster

    clusters: list[LocalCluster] = []

    def make(**overrides) -> LocalCluster:
        root = tmp_path_factory.mktemp("cluster")
        spec = ClusterSpec(**{
            "port": 0, "model": str(tiny_model_dir), "etcd": etcd,
            "cluster": f"t{uuid.uuid4().hex[:10]}", "threads_per_worker": 1,
            "store_memory": "64M", "log_dir": str(root / "logs"),
            "request_log": str(root / "requests.jsonl"), "ready_timeout": 120.0,
            "stop_timeout": 5.0, **overrides})
        cluster = LocalCluster(spec)
        clusters.append(cluster)
        cluster.start()
        return cluster

    yield make
    for cluster in clusters:
        cluster.stop()


@pytest.fixture(scope="session")
def oracle(tiny_model_dir: Path):
    """``oracle(prompt_ids, n) -> token ids``: transformers' greedy continuation (EOS ignored)."""
    import torch

    from tests.engine.hf_oracle import hf_greedy

    torch.set_num_threads(1)

    def run(prompt: list[int], max_new_tokens: int) -> list[int]:
        return hf_greedy(tiny_model_dir, prompt, max_new_tokens)[0]

    return run
