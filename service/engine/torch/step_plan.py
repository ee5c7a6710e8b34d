"""What the scheduler decided for one step, as plain picklable data the model runner consumes.

The plan holds no live objects (no Request, no callbacks, no device tensors): a runner in another
process (a tensor-parallel worker, an engine-core process) receives exactly this. The one bulky
field is `lora_fills`: a LoRA adapter's weights (host tensors, immutable), sent once when a device
slot takes it, so every rank fills its slot from the same bytes. Per-request
state that lasts longer than a step lives with the runner: a request's `NewRequest` arrives
with the first plan that schedules it, and its id appears in `finished_request_ids` once, in the
first plan after it ended, so the runner drops its state.

Layout: S sequences, decodes first (`num_decodes` sequences computing one token each), then
prefill chunks; their T tokens are flattened in that order. A speculating sequence is laid out as a
chunk: its last token and then its `num_drafts` draft tokens, every one of them giving logits
(service.engine.torch.speculative verifies the drafts against them).
"""

from __future__ import annotations

from dataclasses import dataclass

from service.engine.lora import LoraAdapter
from service.engine.models.lora_ops import NO_ADAPTER
from service.engine.protocol import SamplingParams
from service.util import cdiv


@dataclass(frozen=True)
class NewRequest:
    """What the runner keeps of a request for as long as it lives: sampling state lives there."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    end_token_ids: tuple[int, ...]  # masked while fewer than min_tokens were generated


@dataclass(frozen=True)
class StepPlan:
    request_ids: tuple[str, ...]  # [S]
    query_lens: tuple[int, ...]  # [S] tokens computed this step
    context_lens: tuple[int, ...]  # [S] tokens with keys/values once the step ran
    block_tables: tuple[tuple[int, ...], ...]  # [S] the blocks covering each context
    sample: tuple[bool, ...]  # [S] the step reaches the sequence's last token: sample after it
    prompt_logits: tuple[bool, ...]  # [S] the request wants prompt logprobs of these tokens
    adapter_slots: tuple[int, ...]  # [S] the LoRA slot of each sequence; NO_ADAPTER: the base model
    num_decodes: int
    input_ids: tuple[int, ...]  # [T]
    positions: tuple[int, ...]  # [T]
    slot_mapping: tuple[int, ...]  # [T] cache slot of each token: block * block_size + offset
    new_requests: tuple[NewRequest, ...] = ()
    finished_request_ids: tuple[str, ...] = ()
    lora_fills: tuple[tuple[int, LoraAdapter], ...] = ()  # (slot, adapter): fill before this step
    cleared_blocks: tuple[int, ...] = ()  # KV blocks to zero before this step (KVPool.clear)
    num_drafts: tuple[int, ...] = ()  # [S] draft tokens ending each sequence's query; (): none at all

    def drafts_of(self, i: int) -> int:
        """How many draft tokens end sequence i's query (0: it is no speculating sequence)."""
        return self.num_drafts[i] if self.num_drafts else 0

    @property
    def num_sequences(self) -> int:
        return len(self.request_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def decode_only(self) -> bool:
        return self.num_decodes == len(self.request_ids)

    @property
    def adapted(self) -> bool:
        """Some sequence runs a LoRA adapter."""
        return any(slot != NO_ADAPTER for slot in self.adapter_slots)


@dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's share of a step, as the engine hands it to `build_plan`."""

    request_id: str
    token_ids: list[int]  # the request's tokens so far (only [start, start + num_tokens) are read)
    start: int  # tokens already computed
    num_tokens: int
    block_table: list[int]
    sample: bool
    prompt_logits: bool
    adapter_slot: int = NO_ADAPTER
    num_drafts: int = 0  # the last tokens of the query are drafts (token_ids holds them too)


def build_plan(
    sequences: list[ScheduledSequence],
    block_size: int,
    new_requests: tuple[NewRequest, ...] = (),
    finished_request_ids: tuple[str, ...] = (),
    lora_fills: tuple[tuple[int, LoraAdapter], ...] = (),
    cleared_blocks: tuple[int, ...] = (),
) -> StepPlan:
    """Order decodes first and flatten tokens, positions and cache slots."""
    ordered = sorted(sequences, key=lambda s: s.num_tokens != 1)  # stable: order kept within groups
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    tables: list[tuple[int, ...]] = []
    for seq in ordered:
        end = seq.start + seq.num_tokens
        table = seq.block_table
        tables.append(tuple(table[: cdiv(end, block_size)]))
        input_ids.extend(seq.token_ids[seq.start : end])
        for pos in range(seq.start, end):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    return StepPlan(
        request_ids=tuple(s.request_id for s in ordered),
        query_lens=tuple(s.num_tokens for s in ordered),
        context_lens=tuple(s.start + s.num_tokens for s in ordered),
        block_tables=tuple(tables),
        sample=tuple(s.sample for s in ordered),
        prompt_logits=tuple(s.prompt_logits for s in ordered),
        adapter_slots=tuple(s.adapter_slot for s in ordered),
        num_decodes=sum(1 for s in ordered if s.num_tokens == 1),
        input_ids=tuple(input_ids),
        positions=tuple(positions),
        slot_mapping=tuple(slots),
        new_requests=new_requests,
        finished_request_ids=finished_request_ids,
        lora_fills=lora_fills,
        cleared_blocks=cleared_blocks,
        num_drafts=tuple(s.num_drafts for s in ordered) if any(s.num_drafts for s in ordered) else (),
    )
