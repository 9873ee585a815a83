"""Engine test fixtures: tiny checkpoints generated once per session, the default model.

``tiny_llama_dir`` / ``tiny_qwen2_dir`` / ``tiny_qwen3_dir``: deterministic tiny random
checkpoints (``engine.model.tiny``) in a session tmp dir. ``smollm2_dir``: the converted default
model (SmolLM2-135M-Instruct), converted on first use into the model cache. ``load_path``
(each load path of the connector) and ``keys`` (five full blocks' keys): the connector's tests'
(with ``tests/engine/connector_kit.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.model.tiny import make_tiny_checkpoint
from kvstore.keys import block_keys, namespace_id
from kvstore.native.blocks import LIBRARY
from tests.engine.connector_kit import BS
from tests.native import require_native


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


@pytest.fixture(params=["direct", "staged", "python"])
def load_path(request, monkeypatch):
    """Run a load test on every path: sinks verifying each block where it lies and copying it
    into its slot (direct) or into a staging ring sent on in groups (staged, CUDA's), and the
    Python path (get into a buffer, decode, index_copy_)."""
    import engine.kv.connector as connector_module
    import kvstore.transfer.loader as loader_module

    if request.param == "python":
        monkeypatch.setattr(loader_module, "scatter_kernel", lambda: None)
        return request.param
    require_native(loader_module.scatter_kernel() is not None,
                   "the scatter kernel", LIBRARY.why)
    if request.param == "staged":
        monkeypatch.setattr(connector_module, "direct", lambda cache: False)
    return request.param


@pytest.fixture
def keys():
    ns = namespace_id({"test": "connector"})
    return block_keys(ns, list(range(5 * BS + 2)), BS)  # 5 full blocks
