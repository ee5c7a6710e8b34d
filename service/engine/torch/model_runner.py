"""Run one StepPlan: tensors in, one forward pass over the mixed batch, tokens sampled out.

The runner owns what lasts beyond a step but is not scheduling: each live request's sampling
state (its seed, the tokens penalties look at) and the model. Everything it is told
arrives in the plan, so it could run in another process.

Failure domains: what goes wrong in one request's row (its grammar admits no token or cannot be
matched, its sampling parameters fail, its logits are NaN, its prompt logprobs cannot be taken)
is reported in `StepResult.failed` and ends that request alone; every other row of the batch is
computed and sampled exactly as without it (sampling is per row). An exception from the step
itself (the forward pass: device, collective, memory) propagates and fails the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from service.engine.guided.compiler import GrammarCompiler
from service.engine.guided.row import GuidedRow
from service.engine.models import prompt_rows
from service.engine.models.base import CausalLM
from service.engine.protocol import ErrorCause, TokenLogprob
from service.engine.torch.cuda_graphs import CudaGraphDecoder
from service.engine.torch.decode_path import DecodeAttention, DecodePath
from service.engine.torch.kv_pool import KVPool
from service.engine.torch.lora_slots import LoraSlots
from service.engine.torch.paged_attention import (
    AttentionMetadata,
    PagedAttention,
    PrefillChunk,
    UnifiedStep,
    decode_mask,
    prefill_mask,
)
from service.engine.torch.sampler import (
    NOT_A_NUMBER,
    SampledToken,
    SamplingRow,
    request_seed,
    sample,
    token_logprobs,
)
from service.engine.torch.scripted_decode import ScriptedDecoder
from service.engine.torch.speculative.rejection import verify
from service.engine.torch.step_plan import NewRequest, StepPlan
from service.util import cdiv, one_line

PROMPT_LOGPROB_ROWS = 256  # prompt positions whose logprobs are taken at once


class Followers(Protocol):
    """Tensor-parallel ranks that run each plan's forward pass beside this one."""

    def send(self, plan: StepPlan) -> None: ...


@dataclass
class _RowState:
    """A request's sampling state, kept across steps (and across preemptions) until it ends."""

    new: NewRequest
    seed: int  # of its draws (sampler.uniform)
    token_ids: list[int] = field(default_factory=list)  # prompt + sampled so far
    num_prompt_logprobs: int = 0  # prompt positions whose logprobs were returned
    guided: GuidedRow | None = None  # its place in its grammar (structured output)

    def row(self) -> SamplingRow:
        return SamplingRow(
            params=self.new.sampling,
            seed=self.seed,
            token_ids=self.token_ids,
            num_prompt_tokens=len(self.new.prompt_token_ids),
            end_token_ids=frozenset(self.new.end_token_ids),
        )


@dataclass(frozen=True)
class RowFailure:
    """Why one request's row failed this step (the request ends with this error)."""

    message: str
    cause: ErrorCause  # "request": the request's own fault (a 400 before its response starts)
    non_finite: bool = False  # its keys and values may hold NaN/inf: its blocks are discarded


@dataclass(frozen=True)
class StepResult:
    """`sampled[i]` is the token of the i-th sequence whose plan said `sample` (plan order);
    `prompt_logprobs` maps request ids to the prompt logprobs this step computed, in order;
    `failed` maps the requests whose rows failed to why (their entries elsewhere mean nothing)."""

    sampled: list[SampledToken]
    prompt_logprobs: dict[str, list[TokenLogprob]]
    failed: dict[str, RowFailure] = field(default_factory=dict)
    # Speculating sequences: the draft tokens accepted, which come before their `sampled` token.
    accepted: dict[str, list[int]] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        pool: KVPool,
        device: torch.device,
        path: DecodePath,
        followers: Followers | None = None,
        lora: LoraSlots | None = None,
        grammars: Callable[[], GrammarCompiler] | None = None,
        fused_sampling: bool = False,
    ) -> None:
        if followers is not None and path.graphs is not None:
            raise ValueError("tensor-parallel ranks run decode steps eagerly, not as CUDA graphs")
        self.model = model
        self.fused_sampling = fused_sampling  # the greedy argmax as a fused CPU op (sampler.greedy)
        self.followers = followers  # tensor parallelism: the other ranks, sent each plan first
        self.path = path  # how decode steps run (decided when the engine was built)
        self.pool = pool
        self.device = device
        self.lora = lora  # the model's adapter slots, when it serves LoRA adapters
        self.grammars = grammars  # structured output: the compiler (its grammars compiled already)
        self.dtype = model.activation_dtype  # the activations' (attention masks too)
        self.block_size = pool.spec.block_size
        config = model.config
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self._rows: dict[str, _RowState] = {}
        # Prompt rows go through dense weights where the loader attached them (prompt_rows; a
        # LoRA wrapper hands its base layer every row).
        self.dense_prompts = any(
            getattr(getattr(layer.module, "base", layer.module), "dense", None) is not None
            for layer in model.linear_layers()
        )

    @property
    def num_live_requests(self) -> int:
        return len(self._rows)

    @property
    def decode_graphs(self) -> CudaGraphDecoder | None:
        """The CUDA graphs decode-only steps replay (the cuda-graphs path), else None."""
        return self.path.graphs

    @property
    def scripted(self) -> ScriptedDecoder | None:
        """The TorchScript decode step (the scripted path), else None."""
        return self.path.scripted

    @property
    def decode_kernel(self) -> bool:
        """Whether eager decodes attend through the Triton paged kernel."""
        return self.path.attention is DecodeAttention.KERNEL

    @decode_kernel.setter
    def decode_kernel(self, kernel: bool) -> None:
        """Switch the eager decodes' attention (tests compare the kernel with the gather path)."""
        attention = DecodeAttention.KERNEL if kernel else DecodeAttention.GATHER
        self.path = replace(self.path, attention=attention)

    @property
    def unified_steps(self) -> bool:
        """Whether steps with prefill chunks attend through the unified Triton kernel."""
        return self.path.unified_steps

    @unified_steps.setter
    def unified_steps(self, unified: bool) -> None:
        """Switch it (tests compare the kernel with the gathered path, in Triton's interpreter)."""
        self.path = replace(self.path, unified_steps=unified)

    def prepare_step(self, plan: StepPlan) -> None:
        """Every rank, before the step: zero the KV blocks the plan clears and copy the adapters
        it places into their LoRA slots."""
        if plan.cleared_blocks:
            self.pool.clear(plan.cleared_blocks)
        for slot, adapter in plan.lora_fills:
            assert self.lora is not None, "LoRA fills for a model without slots"
            self.lora.fill(slot, adapter)

    def execute(self, plan: StepPlan, draft_probs: Mapping[str, torch.Tensor] | None = None) -> StepResult:
        """Run the plan; `draft_probs`: the proposers' distributions of speculating sequences' drafts
        ([K, V] by request id; absent: point masses), for their verification."""
        self.prepare_step(plan)
        for request_id in plan.finished_request_ids:
            self._rows.pop(request_id, None)
        failed: dict[str, RowFailure] = {}
        for new in plan.new_requests:
            state = _RowState(new, request_seed(new.sampling), list(new.prompt_token_ids))
            self._rows[new.request_id] = state
            if new.sampling.guided is not None:
                assert self.grammars is not None, "a constrained request reached an engine without grammars"
                try:
                    state.guided = self.grammars().matcher(new.sampling.guided)
                except Exception as exc:  # its grammar, not the step: this request alone fails
                    why = f"structured output failed: {one_line(exc)}"
                    failed[new.request_id] = RowFailure(why, "request")
        if not plan.request_ids:
            return StepResult([], {}, failed)
        graphs = self.path.graphs
        if graphs is not None and not plan.adapted and graphs.can_run(plan):
            logits = graphs.run(plan)  # [S, V]: every sequence decodes and samples
            spans = [(i, i + 1) for i in range(plan.num_sequences)]
        else:
            if self.followers is not None:
                self.followers.send(plan)
            logits, spans = self.forward(plan)

        prompt_logprobs = self._prompt_logprobs(plan, logits, spans, failed)
        sampling = [i for i, s in enumerate(plan.sample) if s]
        if not sampling:
            return StepResult([], prompt_logprobs, failed)
        plain = [i for i in sampling if not plan.drafts_of(i)]
        by_sequence = dict(zip(plain, self._sample(plan, plain, logits, spans, failed), strict=True))
        accepted: dict[str, list[int]] = {}
        for i in sampling:
            if plan.drafts_of(i):
                q = draft_probs.get(plan.request_ids[i]) if draft_probs else None
                by_sequence[i] = self._verify(plan, i, logits, spans, failed, accepted, q)
        sampled = [by_sequence[i] for i in sampling]
        return StepResult(sampled, prompt_logprobs, failed, accepted)

    def _sample(
        self,
        plan: StepPlan,
        which: list[int],
        logits: torch.Tensor,
        spans: list[tuple[int, int]],
        failed: dict[str, RowFailure],
    ) -> list[SampledToken]:
        """One token for each sequence `which` names, from its last row of logits."""
        if not which:
            return []
        rows = [spans[i][1] - 1 for i in which]
        request_ids = [plan.request_ids[i] for i in which]
        states = [self._rows[request_id] for request_id in request_ids]
        if rows == list(range(logits.shape[0])):  # every row samples (decode): no copy
            picked = logits
        else:
            picked = logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=self.device))
        self._constrain(picked, request_ids, states, failed)
        sampled = sample(picked, [state.row() for state in states], self.fused_sampling)
        for request_id, state, token in zip(request_ids, states, sampled, strict=True):
            if request_id in failed:
                continue
            if token.error is not None:
                nan = token.error == NOT_A_NUMBER
                failed[request_id] = RowFailure(token.error, "engine" if nan else "request", nan)
                continue
            state.token_ids.append(token.token_id)
            if state.guided is not None and not state.guided.accept(token.token_id):
                failed[request_id] = RowFailure(
                    f"the grammar refused token {token.token_id}, which its own mask allowed", "engine"
                )
        return sampled

    def _verify(
        self,
        plan: StepPlan,
        i: int,
        logits: torch.Tensor,
        spans: list[tuple[int, int]],
        failed: dict[str, RowFailure],
        accepted: dict[str, list[int]],
        draft_probs: torch.Tensor | None,
    ) -> SampledToken:
        """Sequence i's drafts verified against its logits (one row per query token): the
        accepted drafts go to `accepted`, the token after them is returned."""
        request_id = plan.request_ids[i]
        state = self._rows[request_id]
        num_drafts = plan.drafts_of(i)
        end = sum(plan.query_lens[: i + 1])
        drafts = list(plan.input_ids[end - num_drafts : end])
        first, last = spans[i]
        row = state.row()
        rows = [replace(row, token_ids=state.token_ids + drafts[:j]) for j in range(num_drafts + 1)]
        verdict = verify(logits[first:last], rows, drafts, draft_probs)
        token = verdict.token
        if token.error is not None:
            nan = token.error == NOT_A_NUMBER
            failed[request_id] = RowFailure(token.error, "engine" if nan else "request", nan)
            return token
        accepted[request_id] = verdict.accepted
        state.token_ids.extend(verdict.accepted)
        state.token_ids.append(token.token_id)
        return token

    def _constrain(
        self,
        logits: torch.Tensor,
        request_ids: list[str],
        states: list[_RowState],
        failed: dict[str, RowFailure],
    ) -> None:
        """Mask the constrained rows of logits [R, V] to the tokens their grammars allow. A row
        whose grammar allows no token at all (no text satisfies the constraint) fails."""
        constrained = [j for j, state in enumerate(states) if state.guided is not None]
        if not constrained:
            return
        assert self.grammars is not None
        grammars = self.grammars()
        bitmask = grammars.bitmask(len(states))  # [R, ceil(V / 32)] int32, on the host
        filled = []
        for j in constrained:
            guided = states[j].guided
            assert guided is not None
            try:
                guided.fill(bitmask, j)
            except Exception as exc:  # its grammar's state, not the step
                failed[request_ids[j]] = RowFailure(f"structured output failed: {one_line(exc)}", "request")
                continue
            filled.append(j)
        if not filled:
            return
        allows_some = bitmask[filled].ne(0).any(dim=1).tolist()
        for j, allowed in zip(filled, allows_some, strict=True):
            if not allowed:
                state = states[j]
                kind = state.new.sampling.guided.kind if state.new.sampling.guided else "structured output"
                generated = len(state.token_ids) - len(state.new.prompt_token_ids)
                failed[request_ids[j]] = RowFailure(
                    f"the {_CONSTRAINT_NAMES.get(kind, kind)} admits no token after {generated} generated "
                    "tokens: no text can satisfy it",
                    "request",
                )
        grammars.apply(logits, bitmask, filled)

    def forward(self, plan: StepPlan) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """One eager forward pass; the logits of the rows that need them, and each sequence's span.
        (Tensor-parallel worker ranks run just this, in step with rank 0.)

        The rows: every token of a prompt-logprobs chunk or of a speculating sequence, else the last
        token of each sequence that samples.
        """
        if self.lora is not None:
            self.lora.set_step(plan.adapter_slots, plan.query_lens, self.device)
        hidden = self._forward(plan)  # [T, H]
        wanted: list[int] = []
        spans: list[tuple[int, int]] = []
        offset = 0
        for i, (n, samples, prompt) in enumerate(
            zip(plan.query_lens, plan.sample, plan.prompt_logits, strict=True)
        ):
            first = len(wanted)
            if prompt or plan.drafts_of(i):  # a speculating sequence: every row verifies a token
                wanted.extend(range(offset, offset + n))
            elif samples:
                wanted.append(offset + n - 1)
            spans.append((first, len(wanted)))
            offset += n
        index = torch.tensor(wanted, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, index)), spans  # [R, V] float32

    def _prompt_logprobs(
        self,
        plan: StepPlan,
        logits: torch.Tensor,
        spans: list[tuple[int, int]],
        failed: dict[str, RowFailure],
    ) -> dict[str, list[TokenLogprob]]:
        """Row j of a chunk starting at position p predicts token p + j + 1: keep those in the prompt."""
        found: dict[str, list[TokenLogprob]] = {}
        for i, wants in enumerate(plan.prompt_logits):
            if not wants:
                continue
            try:
                self._prompt_logprobs_of(plan, i, logits, spans, found)
            except (RuntimeError, ValueError, IndexError) as exc:
                failed[plan.request_ids[i]] = RowFailure(f"prompt logprobs failed: {one_line(exc)}", "engine")
        return found

    def _prompt_logprobs_of(
        self,
        plan: StepPlan,
        i: int,
        logits: torch.Tensor,
        spans: list[tuple[int, int]],
        found: dict[str, list[TokenLogprob]],
    ) -> None:
        """Request i's prompt logprobs from this step's rows, appended to found[its id], taken
        PROMPT_LOGPROB_ROWS rows at a time (a chunk's whole log_softmax could be gigabytes)."""
        state = self._rows[plan.request_ids[i]]
        prompt = state.new.prompt_token_ids
        top_n = state.new.sampling.prompt_logprobs or 0
        start = plan.context_lens[i] - plan.query_lens[i]
        first, _ = spans[i]
        # Row first + j predicts prompt position start + j + 1; skip what was already returned (a
        # recomputation after preemption) and what lies past the prompt.
        targets = [
            (first + j, start + j + 1)
            for j in range(plan.query_lens[i])
            if state.num_prompt_logprobs < start + j + 1 < len(prompt)
        ]
        entries = found.setdefault(plan.request_ids[i], [])
        for at in range(0, len(targets), PROMPT_LOGPROB_ROWS):
            part = targets[at : at + PROMPT_LOGPROB_ROWS]
            rows = torch.tensor([row for row, _ in part], device=logits.device)
            token_ids = torch.tensor([prompt[target] for _, target in part], device=logits.device)
            logprobs = torch.log_softmax(logits.index_select(0, rows), dim=-1)
            entries.extend(token_logprobs(logprobs, token_ids, [top_n] * len(part)))
        if targets:
            state.num_prompt_logprobs = targets[-1][1]

    def _forward(self, plan: StepPlan) -> torch.Tensor:
        device = self.device
        ids = torch.tensor(plan.input_ids, dtype=torch.long, device=device)  # [T]
        pos = torch.tensor(plan.positions, dtype=torch.long, device=device)  # [T]
        meta = self._metadata(plan)
        dense = self._prompt_rows(plan) if self.dense_prompts else []
        scripted = self.path.scripted
        if not dense and scripted is not None and scripted.can_run(meta):
            return scripted(ids, pos, meta)  # (a prompt's one-token chunk runs eagerly: dense)
        attention = PagedAttention(self.pool, meta, self.num_heads, self.head_dim)
        if not dense:
            hidden: torch.Tensor = self.model(ids, pos, attention)  # [T, H]
            return hidden
        with prompt_rows.split(plan.num_tokens, dense):
            hidden = self.model(ids, pos, attention)
        return hidden

    def _prompt_rows(self, plan: StepPlan) -> list[int]:
        """The step's rows that are tokens of their request's own prompt (prompt_rows: they go
        through the dense weights): a prefix of each sequence's query."""
        rows: list[int] = []
        start = 0
        for request_id, num_query, context_len in zip(
            plan.request_ids, plan.query_lens, plan.context_lens, strict=True
        ):
            state = self._rows.get(request_id)
            prompt = len(state.new.prompt_token_ids) if state is not None else 0
            computed = context_len - num_query
            rows.extend(range(start, start + max(0, min(context_len, prompt) - computed)))
            start += num_query
        return rows

    def _metadata(self, plan: StepPlan) -> AttentionMetadata:
        device = self.device
        num_decodes = plan.num_decodes
        if self.path.unified_steps and num_decodes < plan.num_sequences:
            return self._unified_metadata(plan)
        decode_blocks = mask = tables = lens = None
        run: tuple[int, int] | None = None
        rows = _verify_rows(plan) if self.path.attention is not DecodeAttention.KERNEL else None
        row_lens, row_tables = rows or (plan.context_lens[:num_decodes], plan.block_tables[:num_decodes])
        num_rows = len(row_lens)
        if num_rows:
            width = cdiv(max(row_lens), self.block_size)
            lens = torch.tensor(row_lens, dtype=torch.long, device=device)
            if self.path.attention is not DecodeAttention.GATHER:  # a kernel reading the tables
                scratch = self.pool.scratch_block
                padded = [list(t) + [scratch] * (width - len(t)) for t in row_tables]
                tables = torch.tensor(padded, dtype=torch.long, device=device)  # [B, N]
            else:
                # Every row one sequence's: a lone decode, or one verification's rows.
                one_sequence = num_decodes == 1 if rows is None else plan.num_sequences == 1
                in_place = one_sequence and self.path.in_place_runs
                run = _block_run(plan.block_tables[0]) if in_place else None
                if run is None:
                    decode_blocks = self._blocks(row_tables, width)  # [B * N]
                mask = decode_mask(lens, width * self.block_size, self.dtype)
        prefills = []
        query_start = num_rows
        for i in range(num_decodes if rows is None else plan.num_sequences, plan.num_sequences):
            num_query, context_len = plan.query_lens[i], plan.context_lens[i]
            width = cdiv(context_len, self.block_size)
            prefills.append(
                PrefillChunk(
                    query_start=query_start,
                    num_query=num_query,
                    context_len=context_len,
                    block_ids=self._blocks(plan.block_tables[i : i + 1], width),
                    mask=prefill_mask(
                        context_len - num_query, num_query, width * self.block_size, device, self.dtype
                    ),
                )
            )
            query_start += num_query
        return AttentionMetadata(
            slot_mapping=torch.tensor(plan.slot_mapping, dtype=torch.long, device=device),
            num_decodes=num_rows,
            decode_block_ids=decode_blocks,
            decode_mask=mask,
            prefills=tuple(prefills),
            decode_tables=tables,
            decode_lens=lens if tables is not None else None,
            decode_block_run=run,
        )

    def _unified_metadata(self, plan: StepPlan) -> AttentionMetadata:
        """The whole step for the unified kernel: every sequence's query start, context length and
        block table (padded with the scratch block)."""
        device = self.device
        starts = [0]
        for n in plan.query_lens:
            starts.append(starts[-1] + n)
        width = max(len(t) for t in plan.block_tables)
        scratch = self.pool.scratch_block
        tables = [list(t) + [scratch] * (width - len(t)) for t in plan.block_tables]
        step = UnifiedStep(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(plan.context_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
            max_query_len=max(plan.query_lens),
        )
        slot_mapping = torch.tensor(plan.slot_mapping, dtype=torch.long, device=device)
        return AttentionMetadata(slot_mapping, plan.num_decodes, None, None, (), unified=step)

    def _blocks(self, tables: tuple[tuple[int, ...], ...], width: int) -> torch.Tensor:
        """The first `width` blocks of each table (short tables pad with block 0), as pool rows."""
        padded = [b for t in tables for b in (list(t[:width]) + [0] * (width - min(len(t), width)))]
        return self.pool.head_block_ids(torch.tensor(padded, dtype=torch.long, device=self.device))


def _verify_rows(plan: StepPlan) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]] | None:
    """A step of decodes and draft verifications only, as decode rows: each verified token a row
    of its own attending to its sequence's context up to itself (the causal attention of the chunk
    form), so the step stays decode-only (the scripted CPU stack runs it, and the eager path runs
    no chunk attention). The rows' context lengths and block tables, in the step's token order;
    None when some sequence is neither (a prompt chunk, prompt logprobs) or none verifies."""
    num_decodes = plan.num_decodes
    if num_decodes == plan.num_sequences:
        return None
    lens = list(plan.context_lens[:num_decodes])
    tables = list(plan.block_tables[:num_decodes])
    for i in range(num_decodes, plan.num_sequences):
        n = plan.query_lens[i]
        if plan.prompt_logits[i] or plan.drafts_of(i) != n - 1:
            return None
        cached = plan.context_lens[i] - n
        lens.extend(range(cached + 1, cached + n + 1))
        tables.extend([plan.block_tables[i]] * n)
    return tuple(lens), tuple(tables)


def _block_run(table: tuple[int, ...]) -> tuple[int, int] | None:
    """(first, count) when `table` is one ascending run of blocks (read in place); None otherwise
    (gathered)."""
    if table[-1] - table[0] != len(table) - 1:
        return None
    first = table[0]
    if any(block != first + i for i, block in enumerate(table)):
        return None
    return first, len(table)


_CONSTRAINT_NAMES = {
    "json_schema": "JSON schema",
    "json_object": "JSON object format",
    "regex": "regular expression",
    "choice": "choice list",
    "grammar": "grammar",
}
