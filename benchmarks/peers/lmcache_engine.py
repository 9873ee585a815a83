"""LMCache's own engine on CPU, as the LMCache tests and ``benchmarks.peers.lmcache_bench`` drive it.

Runs only in an environment with LMCache (``.venv-lmcache``, built by ``scripts/setup.sh``).
``LMCacheRig`` builds ``LMCacheEngineBuilder``'s engine from a configuration dict, over a
vLLM-shaped paged KV cache (per layer ``[2, num_blocks, block_size, kv_heads, head_dim]``,
NHD) of the default model's shape, through ``HostPagedConnector``: LMCache's own
``VLLMPagedMemGPUConnectorV2`` (its ``to_gpu``/``from_gpu`` and LMCache's CPU transfer kernels,
``lmcache.v1.platform.torch_ops``), with the two things that cannot run on a CPU-only torch
replaced: the CUDA streams it makes in its constructor (host streams whose ``synchronize`` has
nothing to wait for) and the CUDA-device assertion in its pointer set-up. No code of LMCache
is patched; LMCache's ``MockGPUConnector`` is not used.

``store(tokens, slots)`` saves the KV at those cache slots under the tokens' chunk hashes;
``retrieve(tokens, slots)`` loads into other slots and returns how many tokens came back;
``kv(slots)`` reads the cache at slots (to compare stored and retrieved bit for bit).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from lmcache.utils import EngineType
from lmcache.v1.cache_engine import LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector import gpu_connectors as lmc_gpu
from lmcache.v1.metadata import LMCacheMetadata

__all__ = ["KVShape", "SMOLLM2_135M", "HostPagedConnector", "LMCacheRig"]


@dataclass(frozen=True)
class KVShape:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32

    def chunk_bytes(self, tokens: int) -> int:
        return 2 * self.layers * tokens * self.kv_heads * self.head_dim * self.dtype.itemsize


SMOLLM2_135M = KVShape(layers=30, kv_heads=3, head_dim=64)  # the default model, float32


class _HostStream:
    """Stands in for a CUDA stream on the host: work on CPU tensors is already done."""

    def synchronize(self) -> None:
        return None


class HostPagedConnector(lmc_gpu.VLLMPagedMemGPUConnectorV2):
    """LMCache's paged vLLM connector over host tensors (module docstring)."""

    def __init__(self, hidden_dim_size: int, num_layers: int, **kwargs: Any) -> None:
        # VLLMPagedMemGPUConnectorV2.__init__ with use_gpu=False, but host streams.
        self.hidden_dim_size = hidden_dim_size
        self.num_layers = num_layers
        self.kv_cache_pointers = torch.empty(num_layers, dtype=torch.int64, device="cpu")
        self.kv_cache_pointers_on_gpu = {}
        self.kvcaches = None
        self.gpu_buffer = None
        self.use_mla = bool(kwargs.get("use_mla", False))
        self.layout_hints = kwargs.get("layout_hints") or {}
        self.store_stream = _HostStream()
        self.load_stream = _HostStream()

    def _initialize_pointers(self, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        # VLLMPagedMemGPUConnectorV2._initialize_pointers, less its CUDA-device assertion.
        self.device = kv_caches[0].device
        idx = self.device.index
        if idx in self.kv_cache_pointers_on_gpu:
            return self.kv_cache_pointers_on_gpu[idx]
        self.engine_kv_format, kv_caches = lmc_gpu.normalize_kv_and_discover_format(
            kv_caches, EngineType.VLLM, layout_hints=self.layout_hints)
        self.kv_cache_pointers.numpy()[:] = [t.data_ptr() for t in kv_caches]
        self.kv_cache_pointers_on_gpu[idx] = self.kv_cache_pointers.clone()
        self.num_blocks = lmc_gpu.get_num_blocks(kv_caches, self.engine_kv_format)
        self.block_size = lmc_gpu.get_block_size(kv_caches, self.engine_kv_format)
        self.page_buffer_size = self.num_blocks * self.block_size
        self.head_size = lmc_gpu.get_head_size(kv_caches, self.engine_kv_format)
        self.block_stride_elems = lmc_gpu.resolve_block_stride_and_log_layout(
            kv_caches, self.engine_kv_format, layer_idx=0, group_idx=0) or 0
        return self.kv_cache_pointers_on_gpu[idx]


_ids = itertools.count()


class LMCacheRig:
    """One LMCache engine over one paged KV cache of ``slots`` token slots."""

    def __init__(self, config: dict[str, Any], *, shape: KVShape = SMOLLM2_135M, slots: int = 4096,
                 block_size: int = 16, model_name: str = "SmolLM2-135M-Instruct",
                 world_size: int = 1, worker_id: int = 0) -> None:
        self.shape = shape
        self.config = LMCacheEngineConfig.from_dict(config)
        chunk = self.config.chunk_size
        self.metadata = LMCacheMetadata(
            model_name=model_name, world_size=world_size, local_world_size=world_size,
            worker_id=worker_id, local_worker_id=worker_id, kv_dtype=shape.dtype,
            kv_shape=(shape.layers, 2, chunk, shape.kv_heads, shape.head_dim), chunk_size=chunk)
        self.connector = HostPagedConnector(shape.kv_heads * shape.head_dim, shape.layers,
                                            layout_hints={"kv_layout": "NHD"})
        blocks = -(-slots // block_size)
        self.kv_caches = [torch.zeros(2, blocks, block_size, shape.kv_heads, shape.head_dim,
                                      dtype=shape.dtype) for _ in range(shape.layers)]
        self.instance_id = f"kvstore-rig-{next(_ids)}"
        self.engine = LMCacheEngineBuilder.get_or_create(
            self.instance_id, self.config, self.metadata, self.connector,
            lambda t, rank: None, lambda obj, rank: obj)
        self.engine.post_init()

    def fill(self, slots: torch.Tensor, seed: int) -> None:
        """Random KV (its own per seed) at ``slots`` in every layer."""
        g = torch.Generator().manual_seed(seed)
        for t in self.kv_caches:
            flat = t.view(2, -1, self.shape.kv_heads, self.shape.head_dim)
            flat[:, slots] = torch.randn(flat[:, slots].shape, generator=g).to(self.shape.dtype)

    def kv(self, slots: torch.Tensor) -> list[torch.Tensor]:
        return [t.view(2, -1, self.shape.kv_heads, self.shape.head_dim)[:, slots].clone()
                for t in self.kv_caches]

    def store(self, tokens: torch.Tensor, slots: torch.Tensor) -> None:
        self.engine.store(tokens, kvcaches=self.kv_caches, slot_mapping=slots)

    def wait_stored(self, timeout: float = 30.0) -> None:
        """Wait for the storage backends' put tasks (LMCache's stores are asynchronous)."""
        manager = self.engine.storage_manager
        if manager is not None and hasattr(manager, "wait_for_all_puts"):
            manager.wait_for_all_puts(timeout)  # newer LMCache
            return
        import time

        deadline = time.monotonic() + timeout
        backends = list(getattr(manager, "storage_backends", {}).values())
        while time.monotonic() < deadline:
            busy = [b for b in backends  # ours and LMCache's own backends name them apart
                    if getattr(b, "_put_tasks", None) or getattr(b, "put_tasks", None)]
            if not busy:
                return
            time.sleep(0.005)
        raise TimeoutError(f"LMCache's puts did not finish in {timeout} s")

    def retrieve(self, tokens: torch.Tensor, slots: torch.Tensor) -> int:
        mask = self.engine.retrieve(tokens, kvcaches=self.kv_caches, slot_mapping=slots)
        return int(mask.sum())

    def close(self) -> None:
        LMCacheEngineBuilder.destroy(self.instance_id)

    def __enter__(self) -> "LMCacheRig":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
