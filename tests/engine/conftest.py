"""Engine test fixtures: tiny checkpoints generated once per session, the default model.

``tiny_llama_dir`` / ``tiny_qwen2_dir`` / ``tiny_qwen3_dir``: deterministic tiny random
checkpoints (``engine.model.tiny``) in a session tmp dir. ``smollm2_dir``: the converted default
model (SmolLM2-135M-Instruct), converted on first use into the model cache.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.model.tiny import make_tiny_checkpoint


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """The test machine is shared: keep torch to one intra-op thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _tiny(tmp_path_factory: pytest.TempPathFactory, arch: str) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, seed=0)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny(tmp_path_factory, "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny(tmp_path_factory, "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny(tmp_path_factory, "qwen3")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from engine.model.convert import ensure_default_model

    return ensure_default_model(progress=False)
