"""The correctness oracle: greedy decoding with HF transformers vs. our ModelRunner.

``hf_greedy`` runs ``transformers``' ``generate(do_sample=False)`` and records its top-2 logit
margin at every step; ``runner_greedy`` runs a plain loop over :class:`ModelRunner` (blocks
allocated linearly, all sequences decoded in one batch, optional chunked prefill);
``assert_same_greedy`` compares them token for token, allowing a divergence only at a step
where transformers' own margin is below ``NEAR_TIE`` and returning how many such steps it saw.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from engine.model.runner import ModelRunner, StepItem

NEAR_TIE = 1e-4


@functools.lru_cache(maxsize=4)
def _hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model_dir: str | Path, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation of ``prompt`` (EOS ignored) and its top-2 margins."""
    model = _hf_model(str(model_dir))
    model.generation_config.eos_token_id = None  # run the full length, as our loop does
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0,
            output_logits=True, return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt):].tolist()
    margins = []
    for step_logits in out.logits:
        top2 = step_logits[0].float().topk(2).values
        margins.append(float(top2[0] - top2[1]))
    return tokens, margins


def runner_greedy(
    runner: ModelRunner,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    chunk_size: int | None = None,
    first_block: int = 0,
) -> list[list[int]]:
    """Greedy continuations of ``prompts`` through ``runner``, decoded as one batch.

    Each prompt gets a contiguous run of blocks (after ``first_block``); with ``chunk_size``
    its prefill is fed in chunks of that many tokens, one chunk per step.
    """
    bs = runner.block_size
    tables, nxt = [], first_block
    for p in prompts:
        n = -(-(len(p) + max_new_tokens) // bs)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    assert nxt <= runner.num_blocks, "test sized the cache too small"
    outs: list[list[int]] = [[] for _ in prompts]
    # Prefill: each prompt alone (chunked or whole), then batched decode.
    for i, p in enumerate(prompts):
        step = chunk_size or len(p)
        for s in range(0, len(p), step):
            logits = runner.execute([StepItem(p[s : s + step], s, tables[i])])
        outs[i].append(int(logits[0].argmax()))
    for _ in range(max_new_tokens - 1):
        items = [
            StepItem([outs[i][-1]], len(p) + len(outs[i]) - 1, tables[i]) for i, p in enumerate(prompts)
        ]
        logits = runner.execute(items)
        for i, t in enumerate(logits.argmax(-1).tolist()):
            outs[i].append(t)
    return outs


def assert_same_greedy(ours: list[int], theirs: list[int], margins: list[float]) -> int:
    """Token-for-token equality up to an allowed near-tie; returns 1 if one was hit, else 0."""
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a != b:
            assert margins[step] < NEAR_TIE, (
                f"diverged at step {step}: ours {a}, transformers {b}, "
                f"transformers' top-2 margin {margins[step]:.3g} >= {NEAR_TIE}"
            )
            return 1
    return 0
