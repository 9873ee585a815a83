"""Build GPU ``kvengine-profile`` files from published measurements, so that a simulator can be
calibrated for a GPU this repository was never run on.

``a100_vidur_llama3_8b.json``: Llama-3-8B (bfloat16, block 16) on one NVIDIA A100 80GB,
Sarathi-Serve with FlashInfer attention, as profiled by Vidur (microsoft/vidur, MIT), with the
KV transfers of Mooncake's vLLM disaggregation benchmark (kvcache-ai/Mooncake, Apache-2.0). The
published numbers it reads sit beside it, each file headed by its source (repository, path,
commit) and by how it was copied:

- ``vidur_a100_llama3_8b_mlp.csv``: Vidur's per-layer times of the linear layers, norms, RoPE,
  activation and residual add against the number of tokens in the step (``mlp.csv``; refresh
  with ``--extract-mlp PATH``);
- ``vidur_a100_llama3_8b_attention.csv``: the rows of Vidur's ``attention.csv`` used here:
  prefill attention and KV-cache write of one chunk of ``k`` tokens after ``p`` cached ones,
  decode attention of ``b`` sequences with ``kv`` cached tokens each;
- ``mooncake_vllm_pd_transfer.csv``: Mooncake's table of KV-cache transfer time by size.

How the curves are made (the way Vidur's own predictor adds them up, ``vidur/entities/
execution_time.py``): a step costs ``num_layers x`` (per-layer time), the per-layer time being the
sum of the ``MLP_OPS`` at the step's token count, plus the attention kernel and the KV-cache
write of the step's shape; Vidur multiplies batched decode attention by 1.1
(``attention_decode_batching_overhead_fraction``) and so does this. Like Vidur's ``model_time``
it leaves out the embedding, the LM head, sampling and CPU scheduling (about 0.5 ms of LM head per
step on this model: the decode curve is a lower bound by about 5% at batch 1).

- prefill ``(new_tokens, cached_tokens, chunk)``: the steps ``format.py`` defines, ``k_j``
  tokens at position ``p_j`` each, summed; the grid (``PREFILL_GRID``) holds only steps Vidur
  measured, so no point is interpolated.
- decode ``(batch, context)``: every decode row copied (``batch`` 1 .. 512, ``context`` 128 ..
  16,128).
- store_load / store_save: not measured by Vidur. Mooncake moved Qwen3-8B's KV cache between two
  tensor-parallel-8 vLLM instances on H800s, each rank over its own 200 Gbps ConnectX-7, so one
  rank moved an eighth of the bytes in the time shown: a single GPU with one such NIC moves
  ``bytes / 8`` in that time. The points are that per-NIC curve interpolated (linearly in bytes)
  at ``STORE_BLOCKS`` blocks of this model; the same for load and save (one RDMA transfer).

Each curve is then fitted by ``engine.profile.format.fit_curve``. ``python -m
planner.profiles.build_gpu_profiles`` rewrites the JSON; ``--check`` only compares (exit 1 on a
difference; floats to 1e-9 relative, see ``same``). The output is a function of the CSVs alone (``CREATED`` is fixed).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

from engine.profile.format import (
    Curve,
    DecodePoint,
    Hardware,
    ModelShape,
    PrefillPoint,
    Profile,
    StoreInfo,
    TransferPoint,
    fit_curve,
)

__all__ = ["HERE", "A100_LLAMA3_8B", "build_a100_llama3_8b", "prefill_steps", "main"]

HERE = Path(__file__).resolve().parent
A100_LLAMA3_8B = HERE / "a100_vidur_llama3_8b.json"
MLP_CSV = HERE / "vidur_a100_llama3_8b_mlp.csv"
ATTENTION_CSV = HERE / "vidur_a100_llama3_8b_attention.csv"
MOONCAKE_CSV = HERE / "mooncake_vllm_pd_transfer.csv"
CREATED = "2026-12-01T00:00:00+00:00"  # the first build; fixed so that a rebuild is identical

VIDUR = "github.com/microsoft/vidur"
VIDUR_COMMIT = "7d47513363ec447a741ac5e47241580b47724fbf"
MOONCAKE = "github.com/kvcache-ai/Mooncake"
MOONCAKE_DOC = "docs/source/performance/vllm/vllm-v1-pd-performance.md"
MOONCAKE_COMMIT = "3d0748cf7dc90cd385769c667fed080abbfdb9ab"

# Llama-3-8B (meta-llama/Meta-Llama-3-8B config.json); Vidur's Llama3_8BModelConfig agrees
LAYERS, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE, VOCAB = 32, 32, 8, 128, 4096, 14336, 128256
BLOCK = 16
KV_BYTES_PER_TOKEN = LAYERS * 2 * KV_HEADS * HEAD_DIM * 2  # K and V, 2-byte elements: 131,072
BLOCK_BYTES = KV_BYTES_PER_TOKEN * BLOCK  # 2 MiB
MLP_OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
           "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
DECODE_BATCHING_OVERHEAD = 0.1  # Vidur's attention_decode_batching_overhead_fraction (default)
MOONCAKE_TP = 8  # ranks (and NICs) per instance in Mooncake's run
QWEN3_8B_KV_BYTES_PER_TOKEN = 36 * 2 * 8 * 128 * 2  # the model Mooncake moved: 147,456
STORE_BLOCKS = (2, 4, 8, 16, 32, 64, 128, 256)

PREFILL_GRID: tuple[tuple[int, int, int], ...] = (
    # one step from an empty cache
    *((n, 0, 0) for n in (64, 128, 256, 512, 1024, 2048, 4096, 8192, 12288)),
    # one step after a cached prefix (50% .. 94% of the prompt)
    (512, 512, 0), (512, 1536, 0), (512, 3584, 0), (512, 4608, 0),
    (1024, 1024, 0), (1024, 3072, 0), (1024, 7168, 0), (1024, 14336, 0),
    (2048, 2048, 0), (2048, 6144, 0), (1536, 13824, 0),
    # chunked
    (1024, 0, 512), (2048, 0, 512), (4096, 0, 512), (5632, 0, 512), (2048, 2048, 512),
    (4096, 0, 1024), (8192, 0, 1024), (16384, 0, 1024), (8192, 8192, 1024),
    (4096, 0, 2048), (8192, 0, 2048),
)


def read_rows(path: Path) -> list[dict[str, str]]:
    """A CSV file's rows, without its ``#`` comment lines."""
    with open(path, newline="") as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def _mean(table: dict[tuple[int, ...], list[float]]) -> dict[tuple[int, ...], float]:
    return {k: sum(v) / len(v) for k, v in table.items()}


def mlp_ms(path: Path = MLP_CSV) -> dict[int, float]:
    """Per-layer milliseconds of everything but attention, by the step's token count."""
    acc: dict[tuple[int, ...], list[float]] = defaultdict(list)
    for r in read_rows(path):
        acc[(int(r["num_tokens"]),)].append(sum(float(r[op]) for op in MLP_OPS))
    return {k[0]: v for k, v in _mean(acc).items()}


def attention_ms(path: Path = ATTENTION_CSV) -> tuple[dict[tuple[int, ...], float], dict[tuple[int, ...], float]]:
    """Per-layer milliseconds: prefill ``(k, p)`` -> attention + KV write of one chunk;
    decode ``(batch, kv)`` -> attention (with Vidur's batching overhead) + KV write."""
    pre: dict[tuple[int, ...], list[float]] = defaultdict(list)
    dec: dict[tuple[int, ...], list[float]] = defaultdict(list)
    for r in read_rows(path):
        save = float(r["kv_cache_save_ms"])
        if r["is_prefill"] == "True":
            pre[(int(r["prefill_chunk_size"]), int(r["kv_cache_size"]))].append(float(r["prefill_ms"]) + save)
        else:
            b = int(r["batch_size"])
            att = float(r["decode_ms"]) * (1 + DECODE_BATCHING_OVERHEAD * (b > 1))
            dec[(b, int(r["kv_cache_size"]))].append(att + save)
    return _mean(pre), _mean(dec)


def prefill_steps(new_tokens: int, cached_tokens: int, chunk: int) -> list[tuple[int, int]]:
    """The ``(k_j, p_j)`` steps of a prefill, as ``engine.profile.format`` defines them."""
    size = chunk if chunk > 0 else max(new_tokens, 1)
    steps, done = [], 0
    while done < new_tokens:
        k = min(size, new_tokens - done)
        steps.append((k, cached_tokens + done))
        done += k
    return steps


def prefill_points(mlp: dict[int, float], pre: dict[tuple[int, ...], float]) -> list[PrefillPoint]:
    points = []
    for n, c, chunk in PREFILL_GRID:
        ms = sum(LAYERS * (mlp[k] + pre[(k, p)]) for k, p in prefill_steps(n, c, chunk))
        points.append(PrefillPoint(n, c, chunk, round(ms / 1e3, 9)))
    return points


def decode_points(mlp: dict[int, float], dec: dict[tuple[int, ...], float]) -> list[DecodePoint]:
    return [DecodePoint(b, kv, round(LAYERS * (mlp[b] + ms) / 1e3, 9))
            for (b, kv), ms in sorted(dec.items(), key=lambda x: (x[0][1], x[0][0])) if b in mlp]


def _interpolate(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    raise ValueError(f"{x} bytes outside the published {xs[0]:.0f} .. {xs[-1]:.0f}")


def store_points(path: Path = MOONCAKE_CSV) -> list[TransferPoint]:
    """One NIC's share of each published transfer (``bytes / MOONCAKE_TP`` in the time shown),
    interpolated at ``STORE_BLOCKS`` blocks of Llama-3-8B."""
    rows = read_rows(path)
    xs = [(int(r["prompt_tokens"]) + BLOCK) * QWEN3_8B_KV_BYTES_PER_TOKEN / MOONCAKE_TP for r in rows]
    ys = [float(r["transfer_ms"]) / 1e3 for r in rows]
    return [TransferPoint(n, n * BLOCK_BYTES, round(_interpolate(n * BLOCK_BYTES, xs, ys), 9)) for n in STORE_BLOCKS]


def _curves(named: Iterable[tuple[str, list]]) -> dict[str, Curve]:
    return {name: Curve(tuple(points), fit_curve(name, points)) for name, points in named}


def build_a100_llama3_8b() -> Profile:
    mlp = mlp_ms()
    pre, dec = attention_ms()
    transfers = store_points()
    hardware = Hardware(
        device="cuda",
        device_name="NVIDIA A100 80GB (Vidur's 'a100' compute profile: Azure NC96ads_A100_v4 or DGX A100)",
        cpu_count=0, threads=1, torch_version="not published (Vidur's Sarathi-Serve profiling environment)",
        platform=f"published measurements, not measured here: {VIDUR}@{VIDUR_COMMIT[:12]}",
        native_attention="flashinfer (Sarathi-Serve AttentionBackend.FLASHINFER, as Vidur's attention.csv states)")
    model = ModelShape(
        name="Meta-Llama-3-8B", architecture="llama", num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, vocab_size=VOCAB, dtype="bfloat16",
        block_size=BLOCK, kv_bytes_per_token=KV_BYTES_PER_TOKEN, block_bytes=BLOCK_BYTES)
    store = StoreInfo(transport="rdma", how=(
        f"not measured here: {MOONCAKE} {MOONCAKE_DOC}@{MOONCAKE_COMMIT[:12]}, 'Detailed Performance Data' "
        "(vLLM v1 MooncakeConnector, cross-node GPUDirect RDMA, H800 x 8 per instance, 8x ConnectX-7 RoCE, Qwen3-8B "
        "at TP 8): each rank moved 1/8 of the KV over its own NIC, so one GPU with one 200 Gbps NIC moves bytes/8 "
        "in the published time; interpolated at this model's block sizes, the same points for load and save"))
    return Profile(
        hardware=hardware, model=model, store=store,
        curves=_curves((("prefill", prefill_points(mlp, pre)), ("decode", decode_points(mlp, dec)),
                        ("store_load", transfers), ("store_save", transfers))),
        seed=0, quick=False, repeats=5, created=CREATED,
        extra={
            "source": {
                "compute": f"{VIDUR} data/profiling/compute/a100/meta-llama/Meta-Llama-3-8B/{{mlp,attention}}.csv "
                           f"at {VIDUR_COMMIT} (added in 2bb7a086c74cd4639e86ff74ab07cd1fa0f9a97f)",
                "kv_transfer": f"{MOONCAKE} {MOONCAKE_DOC} at {MOONCAKE_COMMIT}",
                "engine": "Sarathi-Serve (vidur branch) layers and attention wrapper, FlashInfer backend",
            },
            "method": ("step = num_layers x (sum of the MLP_OPS at the step's tokens + attention kernel + KV-cache "
                       "write), decode attention x1.1 at batch > 1 (Vidur's predictor); no embedding, LM head, "
                       "sampling or CPU overhead (Vidur's model_time); planner/profiles/build_gpu_profiles.py"),
            "measured_dtype": "float16 (Vidur's profiling; same element size and tensor-core rate as bfloat16 on A100)",
            "mlp_ops": list(MLP_OPS), "decode_batching_overhead": DECODE_BATCHING_OVERHEAD,
            "store_per_nic_of": MOONCAKE_TP, "store_blocks": list(STORE_BLOCKS),
        })


def extract_mlp(vidur_mlp_csv: Path, out: Path = MLP_CSV) -> None:
    """Rewrite ``out``'s rows from Vidur's full ``mlp.csv`` (its comment lines kept)."""
    comments = [line for line in out.read_text().splitlines(keepends=True) if line.startswith("#")]
    with open(vidur_mlp_csv, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["num_tensor_parallel_workers"] == "1"]
    rows.sort(key=lambda r: int(r["num_tokens"]))
    with open(out, "w", newline="") as f:
        f.writelines(comments)
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["num_tokens", *MLP_OPS])
        for r in rows:
            w.writerow([r["num_tokens"], *(repr(float(r[f"time_stats.{op}.median"])) for op in MLP_OPS)])


def render(profile: Profile) -> str:
    return json.dumps(profile.to_json(), indent=1) + "\n"


def same(a: object, b: object, rel: float = 1e-9) -> bool:
    """Equal JSON trees, floats to ``rel``: the fits are least squares, whose last bits depend
    on the BLAS kernel the CPU gets (a rebuild on another machine differs by an ulp or two)."""
    if isinstance(a, float) or isinstance(b, float):
        return (isinstance(a, (int, float)) and isinstance(b, (int, float))
                and abs(a - b) <= rel * max(abs(a), abs(b)))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k], rel) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y, rel) for x, y in zip(a, b))
    return a == b


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m planner.profiles.build_gpu_profiles",
                                     description="Build planner/profiles/*.json from the published numbers "
                                                 "beside them.")
    parser.add_argument("--check", action="store_true", help="compare with the shipped file instead of writing it")
    parser.add_argument("--extract-mlp", type=Path, metavar="MLP_CSV",
                        help="first refresh the MLP table from Vidur's full mlp.csv")
    args = parser.parse_args(argv)
    if args.extract_mlp:
        extract_mlp(args.extract_mlp)
    profile = build_a100_llama3_8b()
    if args.check:
        ok = A100_LLAMA3_8B.is_file() and same(json.loads(A100_LLAMA3_8B.read_text()), profile.to_json())
        print(f"{A100_LLAMA3_8B.name}: {'up to date' if ok else 'differs from a rebuild'}")
        return 0 if ok else 1
    A100_LLAMA3_8B.write_text(render(profile))
    print(f"wrote {A100_LLAMA3_8B}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
