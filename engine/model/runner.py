"""ModelRunner: the engine's one door to the model (the contract in docs/architecture.md).

The scheduler decides *what* runs; the runner turns a step's :class:`StepItem` list into
tensors (flattened tokens, positions, slot mapping, attention metadata), runs the model over
the paged cache, and returns each item's last-token logits. It owns the cache tensor and
mutates nothing else: block ids come from the caller, who guarantees that two live sequences
never write the same block.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.model.attention import AttentionMetadata, DecodeMetadata, PrefillChunk
from engine.model.config import ModelConfig
from engine.model.kv_cache import allocate_kv_cache
from engine.model.loader import load_model, model_facts, resolve_device, resolve_dtype

__all__ = ["StepItem", "StepError", "ModelRunner"]


class StepError(ValueError):
    """A StepItem is malformed: empty, out of the vocabulary or context, or blocks too few."""


@dataclass
class StepItem:
    """One sequence's share of a step."""

    token_ids: list[int]  # the tokens to compute this step (a prompt chunk, or one decode token)
    start_pos: int  # tokens of this sequence already in the cache
    block_table: list[int]  # physical block ids covering start_pos + len(token_ids) tokens


class ModelRunner:
    """Loads a checkpoint, owns the paged KV cache, runs steps.

    ``kv_cache`` is ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.config: ModelConfig = ModelConfig.from_dir(self.model_dir)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.model = load_model(self.model_dir, self.config, dtype=self.dtype, device=self.device)
        self.kv_cache = allocate_kv_cache(
            self.config, num_blocks, block_size, dtype=self.dtype, device=self.device
        )

    def facts(self, tp_rank: int = 0) -> dict[str, Any]:
        """The namespace facts of this runner's KV (see ``engine.model.loader.model_facts``)."""
        return model_facts(
            self.model_dir, self.config, dtype=self.dtype, block_size=self.block_size, tp_rank=tp_rank
        )

    @torch.inference_mode()
    def execute(self, items: list[StepItem]) -> torch.Tensor:
        """Float32 logits ``[len(items), vocab]`` of each item's last token.

        Writes every item's new tokens' K/V into its blocks. Raises :class:`StepError` (and
        touches nothing) if any item is malformed.
        """
        if not items:
            raise StepError("execute() needs at least one StepItem")
        self._validate(items)
        bs, dev = self.block_size, self.device
        # Decode items (one new token) first, batched; then each multi-token chunk.
        order = sorted(range(len(items)), key=lambda i: len(items[i].token_ids) != 1)
        decodes = [items[i] for i in order if len(items[i].token_ids) == 1]
        prefills = [items[i] for i in order if len(items[i].token_ids) != 1]

        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for it in decodes:
            p = it.start_pos
            tokens.append(it.token_ids[0])
            positions.append(p)
            slots.append(it.block_table[p // bs] * bs + p % bs)
        chunks: list[PrefillChunk] = []
        last: list[int] = list(range(len(decodes)))
        for it in prefills:
            n, p0 = len(it.token_ids), it.start_pos
            a = len(tokens)
            tokens.extend(it.token_ids)
            positions.extend(range(p0, p0 + n))
            first_blk, last_blk = p0 // bs, (p0 + n - 1) // bs
            for b in range(first_blk, last_blk + 1):  # per block, not per token
                lo, hi = max(p0, b * bs), min(p0 + n, (b + 1) * bs)
                base = it.block_table[b] * bs - b * bs
                slots.extend(range(base + lo, base + hi))
            table = mask = None
            if p0 > 0:
                ctx = p0 + n
                table = torch.tensor(it.block_table[: last_blk + 1], dtype=torch.long, device=dev)
                mask = torch.arange(ctx, device=dev)[None, :] <= torch.arange(p0, ctx, device=dev)[:, None]
            chunks.append(PrefillChunk(a, a + n, p0, table, mask))
            last.append(a + n - 1)

        decode_meta = None
        if decodes:
            ctx_lens = [it.start_pos + 1 for it in decodes]
            max_ctx = max(ctx_lens)
            nblk = -(-max_ctx // bs)
            padded = [it.block_table[:nblk] + [0] * (nblk - min(nblk, len(it.block_table)))
                      for it in decodes]
            key_mask = None
            if min(ctx_lens) != max_ctx:
                lens = torch.tensor(ctx_lens, device=dev)
                key_mask = (torch.arange(max_ctx, device=dev)[None, :] < lens[:, None]).view(
                    len(decodes), 1, 1, max_ctx)
            decode_meta = DecodeMetadata(
                len(decodes),
                torch.tensor(padded, dtype=torch.int32, device=dev),
                max_ctx,
                key_mask,
                torch.tensor(ctx_lens, dtype=torch.int32, device=dev),
            )
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            decode=decode_meta,
            prefills=chunks,
        )
        logits = self.model(
            torch.tensor(tokens, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.kv_cache,
            meta,
            torch.tensor(last, dtype=torch.long, device=dev),
        )
        # Rows are in decode-first order; put them back in the caller's order.
        inverse = [0] * len(items)
        for row, i in enumerate(order):
            inverse[i] = row
        if inverse == list(range(len(items))):
            return logits
        return logits.index_select(0, torch.tensor(inverse, device=logits.device))

    def _validate(self, items: list[StepItem]) -> None:
        c, bs = self.config, self.block_size
        for i, it in enumerate(items):
            n = len(it.token_ids)
            if n == 0:
                raise StepError(f"item {i}: no token ids to compute")
            if it.start_pos < 0:
                raise StepError(f"item {i}: negative start_pos {it.start_pos}")
            end = it.start_pos + n
            if end > c.max_position_embeddings:
                raise StepError(
                    f"item {i}: position {end - 1} beyond the model's context of "
                    f"{c.max_position_embeddings} tokens"
                )
            need = -(-end // bs)
            if len(it.block_table) < need:
                raise StepError(
                    f"item {i}: {end} tokens need {need} blocks of {bs}, block_table has "
                    f"{len(it.block_table)}"
                )
            if min(it.block_table[:need]) < 0 or max(it.block_table[:need]) >= self.num_blocks:
                raise StepError(f"item {i}: block id outside [0, {self.num_blocks})")
            if min(it.token_ids) < 0 or max(it.token_ids) >= c.vocab_size:
                raise StepError(f"item {i}: token id outside the vocabulary [0, {c.vocab_size})")
