"""Turn a scheduled step into tensors, run the model once, and return the logits that matter."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from service.engine.models.llama import LlamaForCausalLM
from service.engine.torch.kv_cache_manager import KVCacheManager
from service.engine.torch.kv_pool import KVPool
from service.engine.torch.paged_attention import (
    AttentionMetadata,
    PagedAttention,
    PrefillChunk,
    decode_mask,
    prefill_mask,
)
from service.engine.torch.scheduler import ScheduledChunk


@dataclass(frozen=True)
class StepLogits:
    """Logits of the rows that need them, and which rows belong to which chunk.

    `rows[i]` is the [start, end) range of `logits` for `chunks[i]`: empty when the chunk neither
    completes its request nor wants prompt logprobs; one row (its last token) when it completes;
    every token's row when the request asked for prompt logprobs.
    """

    chunks: list[ScheduledChunk]
    logits: torch.Tensor  # [R, V] float32
    rows: list[tuple[int, int]]


class ModelRunner:
    def __init__(
        self, model: LlamaForCausalLM, pool: KVPool, kv: KVCacheManager, device: torch.device
    ) -> None:
        self.model = model
        self.pool = pool
        self.kv = kv
        self.device = device
        self.block_size = kv.block_size
        config = model.config
        self.num_heads, self.head_dim = config.num_heads, config.head_dim

    def execute(self, chunks: Sequence[ScheduledChunk]) -> StepLogits:
        # Decodes (one token each) first, so the attention backend handles them as one batch.
        ordered = sorted(chunks, key=lambda c: c.num_tokens != 1)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        for chunk in ordered:
            request = chunk.request
            start = chunk.start
            table = self.kv.block_table(request)
            tables.append(table)
            for pos in range(start, start + chunk.num_tokens):
                positions.append(pos)
                slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            input_ids.extend(request.token_ids[start : start + chunk.num_tokens])

        meta = self._metadata(ordered, tables, slots)
        attention = PagedAttention(self.pool, meta, self.num_heads, self.head_dim)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)  # [T]
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)  # [T]
        hidden = self.model(ids, pos, attention)  # [T, H]

        wanted: list[int] = []
        rows: list[tuple[int, int]] = []
        offset = 0
        for chunk in ordered:
            first = len(wanted)
            if chunk.request.sampling.prompt_logprobs is not None and self._in_prompt(chunk):
                wanted.extend(range(offset, offset + chunk.num_tokens))
            elif chunk.completes:
                wanted.append(offset + chunk.num_tokens - 1)
            rows.append((first, len(wanted)))
            offset += chunk.num_tokens
        index = torch.tensor(wanted, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, index))  # [R, V]
        return StepLogits(list(ordered), logits, rows)

    @staticmethod
    def _in_prompt(chunk: ScheduledChunk) -> bool:
        return chunk.start < chunk.request.num_prompt_tokens

    def _metadata(
        self, ordered: list[ScheduledChunk], tables: list[list[int]], slots: list[int]
    ) -> AttentionMetadata:
        device = self.device
        num_decodes = sum(1 for c in ordered if c.num_tokens == 1)
        decode_blocks = mask = None
        if num_decodes:
            context_lens = [c.start + 1 for c in ordered[:num_decodes]]
            width = -(-max(context_lens) // self.block_size)
            decode_blocks = self._blocks(tables[:num_decodes], width)  # [B * N]
            lens = torch.tensor(context_lens, dtype=torch.long, device=device)
            mask = decode_mask(lens, width * self.block_size)
        prefills = []
        query_start = num_decodes
        for chunk, table in zip(ordered[num_decodes:], tables[num_decodes:], strict=True):
            context_len = chunk.start + chunk.num_tokens
            width = -(-context_len // self.block_size)
            prefills.append(
                PrefillChunk(
                    query_start=query_start,
                    num_query=chunk.num_tokens,
                    context_len=context_len,
                    block_ids=self._blocks([table], width),
                    mask=prefill_mask(chunk.start, chunk.num_tokens, width * self.block_size, device),
                )
            )
            query_start += chunk.num_tokens
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            num_decodes=num_decodes,
            decode_block_ids=decode_blocks,
            decode_mask=mask,
            prefills=tuple(prefills),
        )

    def _blocks(self, tables: list[list[int]], width: int) -> torch.Tensor:
        """The first `width` blocks of each table (short tables pad with block 0), as pool rows."""
        padded = [b for t in tables for b in (t[:width] + [0] * (width - min(len(t), width)))]
        return self.pool.head_block_ids(torch.tensor(padded, dtype=torch.long, device=self.device))
