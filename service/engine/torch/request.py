"""A request's state inside the PyTorch engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from service.engine.models.lora_ops import NO_ADAPTER
from service.engine.protocol import GenerationRequest, SamplingParams
from service.engine.torch.block_pool import OUTPUT_TAG, BlockHash, hash_block, root_hash


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Token ids so far and how many of them have keys/values in the cache.

    Invariant: `num_computed_tokens <= len(token_ids)`; when they are equal the request needs a
    new token sampled; otherwise the next step computes (part of) the remainder. After a
    preemption `num_computed_tokens` is 0 and the request is recomputed from its tokens.

    A request of a LoRA `adapter` holds `lora_slot` from its admission to its end (across
    preemptions); the scheduler takes the slot (service.engine.torch.lora_admission).
    """

    request_id: str
    token_ids: list[int]  # prompt + generated
    num_prompt_tokens: int
    sampling: SamplingParams
    arrival_time: float
    end_token_ids: tuple[int, ...] = ()  # its stop tokens (masked while under min_tokens)
    adapter: str | None = None  # the LoRA adapter it runs (None: the base model)
    lora_slot: int = NO_ADAPTER  # the device slot holding its adapter, while it holds one
    cache_salt: str | None = None  # what besides the tokens changes their KV (an adapter)
    # Its output tokens' keys and values come from another kernel than its prompt's (dense prompt
    # rows): blocks holding any are hashed apart (block_pool.OUTPUT_TAG), so a later prompt that
    # continues them computes its own.
    tag_outputs: bool = False
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    admitted_before: bool = False
    block_hashes: list[BlockHash] = field(default_factory=list, repr=False)
    # Speculative decoding: tokens proposed to follow token_ids, verified by the next step (never
    # part of token_ids until accepted; dropped when not scheduled).
    draft_token_ids: list[int] = field(default_factory=list, repr=False)

    @classmethod
    def from_generation(cls, request: GenerationRequest, end_token_ids: tuple[int, ...] = ()) -> Request:
        return cls(
            request_id=request.request_id,
            token_ids=list(request.prompt_token_ids),
            num_prompt_tokens=len(request.prompt_token_ids),
            sampling=request.sampling,
            arrival_time=request.arrival_time,
            end_token_ids=end_token_ids,
            adapter=request.adapter,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def full_block_hashes(self, block_size: int) -> list[BlockHash]:
        """Chained hashes of every full block of tokens so far (extended incrementally)."""
        num_full = len(self.token_ids) // block_size
        while len(self.block_hashes) < num_full:
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else root_hash(self.cache_salt)
            output = self.tag_outputs and (i + 1) * block_size > self.num_prompt_tokens
            tokens = self.token_ids[i * block_size : (i + 1) * block_size]
            self.block_hashes.append(hash_block(parent, tokens, OUTPUT_TAG if output else b""))
        return self.block_hashes
