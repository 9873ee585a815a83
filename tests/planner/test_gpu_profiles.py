"""The GPU profiles built from published measurements (planner/profiles): they load, a rebuild
from the cited numbers gives the very same file, and their figures sit where the hardware's
published limits put them."""

from __future__ import annotations

import json

import pytest

from engine.profile.format import CURVES, load
from planner.profiles import build_gpu_profiles as build

PROFILE = build.A100_LLAMA3_8B

# NVIDIA A100 80GB datasheet: 2,039 GB/s HBM2e (SXM; 1,935 PCIe), 312 TFLOPS dense FP16/BF16 tensor cores
A100_HBM_BYTES_S = 2.039e12
A100_TENSOR_FLOPS = 312e12
# Llama-3-8B's transformer blocks (what Vidur times): q, k, v, o and the gated MLP, 2 bytes a weight
BLOCK_PARAMS = build.LAYERS * (2 * build.HIDDEN * build.HIDDEN + 2 * build.HIDDEN * build.KV_HEADS * build.HEAD_DIM
                               + 3 * build.HIDDEN * build.INTERMEDIATE)


@pytest.fixture(scope="module")
def profile():
    return load(PROFILE)


def test_the_shipped_profile_loads_with_its_sources(profile):
    assert set(profile.curves) == set(CURVES)
    m = profile.model
    assert (m.name, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim) == ("Meta-Llama-3-8B", 32, 32, 8, 128)
    assert (m.hidden_size, m.intermediate_size, m.vocab_size, m.dtype, m.block_size) == (
        4096, 14336, 128256, "bfloat16", 16)
    assert m.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2 and m.block_bytes == 16 * m.kv_bytes_per_token
    hw = profile.hardware
    assert hw.device == "cuda" and hw.threads == 1 and "A100" in hw.device_name and "flashinfer" in hw.native_attention
    assert ("microsoft/vidur" in profile.extra["source"]["compute"]
            and build.VIDUR_COMMIT in profile.extra["source"]["compute"])
    assert ("kvcache-ai/Mooncake" in profile.store.how
            and build.MOONCAKE_COMMIT in profile.extra["source"]["kv_transfer"])
    for name in ("vidur_a100_llama3_8b_mlp.csv", "vidur_a100_llama3_8b_attention.csv", "mooncake_vllm_pd_transfer.csv"):
        head = (build.HERE / name).read_text().splitlines()[0]
        assert head.startswith("#") and "github.com/" in head  # each table names where it is from
    assert "MIT License" in (build.HERE / "LICENSE.vidur").read_text()


def test_a_rebuild_from_the_published_numbers_gives_the_same_file(profile):
    rebuilt = build.build_a100_llama3_8b()
    assert build.same(rebuilt.to_json(), json.loads(PROFILE.read_text()))
    assert build.main(["--check"]) == 0
    moved = json.loads(PROFILE.read_text())
    moved["curves"]["decode"]["points"][0]["seconds"] *= 1.001
    assert not build.same(rebuilt.to_json(), moved)          # a real change is still one
    for name, curve in rebuilt.curves.items():
        assert curve.fit.max_rel_error < 0.2, name  # the format's forms describe these curves


def test_prefill_steps_are_the_formats_and_every_one_was_measured():
    assert build.prefill_steps(2048, 2048, 512) == [(512, 2048), (512, 2560), (512, 3072), (512, 3584)]
    assert build.prefill_steps(300, 0, 0) == [(300, 0)]
    mlp = build.mlp_ms()
    pre, _ = build.attention_ms()
    for n, c, chunk in build.PREFILL_GRID:  # no point needs a row Vidur did not publish
        assert all(k in mlp and (k, p) in pre for k, p in build.prefill_steps(n, c, chunk)), (n, c, chunk)


def test_decode_is_bounded_by_the_a100s_memory_bandwidth(profile):
    # batch 1 reads every weight once a step: no faster than weights / HBM bandwidth, and a
    # serving engine reaches well over half of it (the source: 68%)
    floor = BLOCK_PARAMS * 2 / A100_HBM_BYTES_S  # 6.85 ms
    for context in (128, 1024, 4096):
        assert floor < profile.decode_step_s(1, context) < 2 * floor
    # batching amortizes the weights: 32 sequences cost far less than 32 steps of one
    assert profile.decode_step_s(32, 1024) < 2 * profile.decode_step_s(1, 1024)
    assert profile.decode_step_s(32, 8192) > profile.decode_step_s(32, 1024)  # attention over the context


def test_prefill_throughput_is_under_the_tensor_core_peak(profile):
    per_token_flops = 2 * BLOCK_PARAMS
    ceiling = A100_TENSOR_FLOPS / per_token_flops  # 22,350 tokens/s at 100% of peak
    for n in (1024, 2048, 4096):
        rate = n / profile.prefill_s(n)
        assert 0.3 * ceiling < rate < ceiling, n
    assert profile.prefill_s(205, cached_tokens=1843) < profile.prefill_s(2048) / 4  # a cached prefix saves


def test_the_kv_transfer_is_one_200_gbps_nics_share(profile):
    for curve in ("store_load", "store_save"):
        assert 10e9 < profile.bandwidth(curve) < 25e9  # ConnectX-7 port: 200 Gbit/s = 25 GB/s
        assert 1e-4 < profile.load_s(1) < 1e-3  # the call's latency dominates one 2 MiB block
