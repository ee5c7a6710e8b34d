"""Builds each step's StepPlan (service.engine.torch.step_plan) from what the scheduler decided.

The plan carries, beside the step's sequences: the `NewRequest` of each request the runner has
not seen yet (sent once, with the first plan that schedules it), the ids of requests that ended
since the last plan (sent once, so the runner drops their state), the LoRA slots to fill before
the step, and the KV blocks to zero before they are reused.
"""

from __future__ import annotations

from service.engine.torch.kv_cache_manager import KVCacheManager
from service.engine.torch.lora_admission import LoraAdmission
from service.engine.torch.scheduler import SchedulerOutput
from service.engine.torch.step_plan import NewRequest, ScheduledSequence, StepPlan, build_plan


class StepPlanner:
    def __init__(self, kv: KVCacheManager, lora: LoraAdmission | None = None) -> None:
        self.kv = kv
        self.lora = lora
        self._introduced: set[str] = set()  # requests the runner has been sent a NewRequest of
        self._ended: list[str] = []  # requests whose runner state the next plan releases

    def ended(self, request_id: str) -> None:
        """`request_id` is done: the next plan tells the runner to forget it."""
        self._introduced.discard(request_id)
        self._ended.append(request_id)

    def plan(self, scheduled: SchedulerOutput) -> StepPlan:
        sequences: list[ScheduledSequence] = []
        new_requests: list[NewRequest] = []
        for chunk in scheduled.chunks:
            request = chunk.request
            if request.request_id not in self._introduced:
                self._introduced.add(request.request_id)
                new_requests.append(
                    NewRequest(
                        request_id=request.request_id,
                        prompt_token_ids=tuple(request.token_ids[: request.num_prompt_tokens]),
                        sampling=request.sampling,
                        end_token_ids=request.end_token_ids,
                    )
                )
            drafts = request.draft_token_ids[: chunk.num_drafts]
            sequences.append(
                ScheduledSequence(
                    request_id=request.request_id,
                    token_ids=request.token_ids + drafts if drafts else request.token_ids,
                    start=chunk.start,
                    num_tokens=chunk.num_tokens,
                    block_table=self.kv.block_table(request),
                    sample=chunk.completes,
                    prompt_logits=request.sampling.prompt_logprobs is not None
                    and chunk.start < request.num_prompt_tokens,
                    adapter_slot=request.lora_slot,
                    num_drafts=chunk.num_drafts,
                )
            )
        ended, self._ended = tuple(self._ended), []
        fills = self.lora.take_fills() if self.lora is not None else ()
        cleared, self.kv.to_clear = tuple(self.kv.to_clear), []
        return build_plan(sequences, self.kv.block_size, tuple(new_requests), ended, fills, cleared)
