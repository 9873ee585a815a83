"""Engine benchmark: our ModelRunner vs HF transformers on the default model, same run.

Prefill tokens/s at prompt lengths 128 .. 4096, decode tokens/s at batch 1, 8, 32 (each
sequence with a 512-token prompt), both implementations on the same seeded prompts, dtype and
threads. Prints one JSON line (machine, settings, results, ratios) and writes a PNG.

    .venv/bin/python -m benchmarks.serving.engine_bench [--quick] [--threads N] [--png engine_bench.png]

Targets: ours >= transformers at batch 1; our batch-32 decode >= 8x our batch-1 decode.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from tqdm import tqdm

from benchmarks.report import emit, machine_info, pyplot, save_figure


def _timeit(fn, repeat: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serving.engine_bench",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="short prompts, few steps")
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="torch intra-op threads for both implementations (default: all CPUs)")
    parser.add_argument("--device", default=None, help="cpu | cuda[:N] (default: the runner's choice)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    parser.add_argument("--png", default="engine_bench.png", help="where to write the plot (default %(default)s)")
    parser.add_argument("--only", choices=["prefill", "decode"], help="run one half (both by default)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    from transformers import AutoModelForCausalLM, DynamicCache

    from engine.model.convert import ensure_default_model
    from engine.model.native import native_status
    from engine.model.runner import ModelRunner, StepItem

    model_dir = ensure_default_model()
    prefill_lens = [128, 512] if args.quick else [128, 512, 1024, 2048, 4096]
    batches = [1, 8, 32]
    decode_prompt = 128 if args.quick else 512
    decode_steps = 8 if args.quick else 32
    repeat = 1 if args.quick else 3
    bs = 16
    max_ctx = max(max(prefill_lens), decode_prompt + decode_steps + 2)
    blocks_per_seq = -(-max_ctx // bs)
    runner = ModelRunner(model_dir, num_blocks=blocks_per_seq * max(batches), block_size=bs, device=args.device)
    dev, dtype = runner.device, runner.dtype
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(dev).eval()
    vocab = runner.config.vocab_size
    gen = torch.Generator().manual_seed(args.seed)

    def prompt(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    results: dict = {"prefill": [], "decode": []}
    work = [("prefill", n) for n in prefill_lens if args.only != "decode"]
    work += [("decode", b) for b in batches if args.only != "prefill"]
    for kind, n in tqdm(work, desc="engine_bench", unit="case"):
        if kind == "prefill":
            p = prompt(n)
            table = list(range(-(-n // bs)))

            def ours():
                runner.execute([StepItem(p, 0, table)])
                sync()

            ids = torch.tensor([p], device=dev)

            def theirs():
                with torch.inference_mode():
                    hf(ids, use_cache=True, logits_to_keep=1)
                    sync()

            t_ours, t_hf = _timeit(ours, repeat), _timeit(theirs, repeat)
            results["prefill"].append({"tokens": n, "ours_tok_s": n / t_ours, "hf_tok_s": n / t_hf,
                                       "ratio": t_hf / t_ours})
            continue
        b = n
        prompts = [prompt(decode_prompt) for _ in range(b)]
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(b)]

        def ours_decode():
            last = [runner.execute([StepItem(p, 0, t)])[0].argmax().item() for p, t in zip(prompts, tables)]
            sync()
            t0 = time.perf_counter()
            for s in range(decode_steps):
                items = [StepItem([last[i]], decode_prompt + s, tables[i]) for i in range(b)]
                last = runner.execute(items).argmax(-1).tolist()
            sync()
            return time.perf_counter() - t0

        def hf_decode():
            with torch.inference_mode():
                cache = DynamicCache()
                out = hf(torch.tensor(prompts, device=dev), past_key_values=cache, use_cache=True,
                         logits_to_keep=1)
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                sync()
                t0 = time.perf_counter()
                for _ in range(decode_steps):
                    out = hf(nxt, past_key_values=out.past_key_values, use_cache=True)
                    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                sync()
                return time.perf_counter() - t0

        # Interleaved, best of each: drift on a shared machine hits both sides alike. Batch 1
        # is cheap and the closest call, so it gets more rounds.
        rounds = repeat if b > 1 or args.quick else 7
        t_ours = t_hf = float("inf")
        for _ in range(rounds):
            t_ours, t_hf = min(t_ours, ours_decode()), min(t_hf, hf_decode())
        toks = b * decode_steps
        results["decode"].append({"batch": b, "ours_tok_s": toks / t_ours, "hf_tok_s": toks / t_hf,
                                  "ratio": t_hf / t_ours})

    d = {r["batch"]: r["ours_tok_s"] for r in results["decode"]}
    summary = {
        "bench": "engine", "model": model_dir.name, "quick": args.quick, "seed": args.seed,
        "machine": machine_info(torch_threads=torch.get_num_threads(), device=str(dev),
                                gpu=torch.cuda.get_device_name(dev) if dev.type == "cuda" else None),
        "dtype": str(dtype).removeprefix("torch."), "block_size": bs,
        "decode_prompt_tokens": decode_prompt, "decode_steps": decode_steps, **results,
        "attention": native_status(),
        "targets": {"batch1_ratio_vs_hf": results["decode"][0]["ratio"],
                    "batch32_over_batch1": d[32] / d[1]} if d else {},
    }
    emit(summary)
    _plot(summary, args.png)


def _plot(summary: dict, path: str) -> None:
    plt = pyplot()

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    pre = summary["prefill"]
    a.plot([r["tokens"] for r in pre], [r["ours_tok_s"] for r in pre], "o-", label="ours")
    a.plot([r["tokens"] for r in pre], [r["hf_tok_s"] for r in pre], "s--", label="transformers")
    a.set(xscale="log", xlabel="prompt tokens", ylabel="prefill tokens/s", title="Prefill")
    dec = summary["decode"]
    x = range(len(dec))
    a.legend()
    b.bar([i - 0.2 for i in x], [r["ours_tok_s"] for r in dec], 0.4, label="ours")
    b.bar([i + 0.2 for i in x], [r["hf_tok_s"] for r in dec], 0.4, label="transformers")
    b.set_xticks(list(x), [f"batch {r['batch']}" for r in dec])
    b.set(ylabel="decode tokens/s", title=f"Decode ({summary['decode_prompt_tokens']}-token prompts)")
    b.legend()
    m = summary["machine"]
    fig.suptitle(f"{summary['model']} {summary['dtype']} on {m['device']} ({m['torch_threads']} threads)")
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


if __name__ == "__main__":
    main()
