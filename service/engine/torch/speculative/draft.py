"""A draft model's proposals (vLLM's "draft_model" method): a smaller model sharing the target's
tokenizer proposes the next K tokens of each speculating request, one forward pass of its own a token.

The draft keeps its own KV, one dense cache per request ([layers, capacity, kv heads, head dim],
grown by doubling), and the token ids that cache holds. Before proposing, the cache is cut back to
the longest prefix it shares with the request's tokens now: whatever the target rejected (and the
last draft, never fed) is rolled back by that cut alone, and a preempted or recomputed request keeps
what still matches. The tokens past that prefix (at least the request's last) are fed as one chunk,
then each draft in turn.

Greedy rows take the draft's argmax (a point mass: the target accepts exactly its own argmax run).
Sampled rows draw each draft from q, the draft's distribution under the request's temperature,
top_k, top_p and min_p, and hand q over with the drafts, so verification accepts with
min(1, p/q) and draws a rejection from norm(max(0, p - q)) (service.engine.torch.speculative.rejection).
Their numbers come from the request's seed, in a stream of their own (DRAFT_STREAM).

The requests are run one after another (no batching across requests): the draft is meant to be
small, and this keeps its KV and its rollback a list cut.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from service.engine.config import EngineConfig, UnsupportedConfigError
from service.engine.models.attention import check_window
from service.engine.models.base import CausalLM
from service.engine.speculative_config import SpeculativeConfig
from service.engine.torch.rank_loading import load_rank
from service.engine.torch.request import Request
from service.engine.torch.sampler import filtered_probs, request_seed, uniform
from service.engine.torch.speculative.rejection import invert_cdf
from service.model.config import ModelConfig
from service.store.checkpoint import inspect_local
from service.text.tokenizer import Tokenizer

DRAFT_STREAM = 0x165667B1  # xor'd into the seed: the draft's own draws
MIN_CAPACITY = 64  # tokens a new cache holds before it first grows


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for one request, and the distributions they were drawn from ([K, V], rows
    summing to 1); None: point masses (greedy drafts, prompt lookup)."""

    token_ids: list[int]
    probs: torch.Tensor | None = None


@dataclass
class SequenceCache:
    """One request's keys and values in the draft, for the tokens `token_ids` (their positions)."""

    keys: torch.Tensor  # [layers, capacity, kv heads, head dim]
    values: torch.Tensor
    seed: int
    token_ids: list[int] = field(default_factory=list)

    def reserve(self, length: int) -> None:
        """Room for `length` tokens (the cached ones kept)."""
        capacity = self.keys.shape[1]
        if length <= capacity:
            return
        while capacity < length:
            capacity *= 2
        shape = (self.keys.shape[0], capacity, *self.keys.shape[2:])
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_empty(shape)
            new[:, : old.shape[1]] = old
            setattr(self, name, new)


class DenseCacheAttention:
    """The Attention seam over one request's dense cache: the T new tokens sit at positions
    start..start+T-1; their keys and values are written there and each query sees every cached key
    up to its own position (within its window)."""

    def __init__(self, cache: SequenceCache, start: int) -> None:
        self.cache = cache
        self.start = start

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        window: int | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        check_window(window)
        start, end = self.start, self.start + q.shape[0]
        self.cache.keys[layer, start:end] = k
        self.cache.values[layer, start:end] = v
        # [T, H, D] -> [H, T, D] for SDPA; enable_gqa broadcasts kv heads over query groups.
        keys = self.cache.keys[layer, :end].transpose(0, 1)
        values = self.cache.values[layer, :end].transpose(0, 1)
        mask = None
        if q.shape[0] > 1 or window is not None:
            key_pos = torch.arange(end, device=q.device)
            query_pos = torch.arange(start, end, device=q.device)[:, None]
            mask = key_pos[None, :] <= query_pos  # [T, end]
            if window is not None:
                mask &= key_pos[None, :] > query_pos - window
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )
        return out.transpose(0, 1)


class DraftModel:
    """The proposer of the "draft_model" method (service.engine.torch.speculative.speculator)."""

    def __init__(self, model: CausalLM, num_layers: int) -> None:
        self.model = model
        self.num_layers = num_layers
        config = model.config  # one rank: the whole model
        self._kv_shape = (config.num_kv_heads, config.head_dim)
        self._caches: dict[str, SequenceCache] = {}

    @property
    def num_cached_requests(self) -> int:
        return len(self._caches)

    def propose(self, wanted: Sequence[tuple[Request, int]]) -> list[Proposal]:
        """Up to `budget` drafts for each (request, budget), in order."""
        with torch.inference_mode():
            return [self._propose(request, budget) for request, budget in wanted]

    def ended(self, request_id: str) -> None:
        self._caches.pop(request_id, None)

    def _propose(self, request: Request, budget: int) -> Proposal:
        cache = self._cache_of(request)
        tokens = request.token_ids
        keep = min(_common_prefix(cache.token_ids, tokens), len(tokens) - 1)
        del cache.token_ids[keep:]  # the rollback: what the target did not take
        feed = tokens[keep:]
        params = request.sampling
        drafts: list[int] = []
        probs: list[torch.Tensor] = []
        for j in range(budget):
            logits = self._forward(cache, feed)  # [V] float32 after the last fed token
            if params.greedy:
                token = int(torch.argmax(logits))
            else:
                q = filtered_probs(logits[None], [params])[0]
                q = q / q.sum()
                token = invert_cdf(q, uniform(cache.seed ^ DRAFT_STREAM, request.num_generated + j))
                probs.append(q)
            drafts.append(token)
            feed = [token]
        return Proposal(drafts, torch.stack(probs) if probs else None)

    def _cache_of(self, request: Request) -> SequenceCache:
        cache = self._caches.get(request.request_id)
        if cache is None:
            model = self.model
            capacity = max(MIN_CAPACITY, 2 * request.num_tokens)
            shape = (self.num_layers, capacity, *self._kv_shape)
            keys = torch.empty(shape, dtype=model.activation_dtype, device=model.device)
            cache = SequenceCache(keys, torch.empty_like(keys), request_seed(request.sampling))
            self._caches[request.request_id] = cache
        return cache

    def _forward(self, cache: SequenceCache, feed: list[int]) -> torch.Tensor:
        start = len(cache.token_ids)
        cache.reserve(start + len(feed))
        device = self.model.device
        input_ids = torch.tensor(feed, dtype=torch.long, device=device)
        positions = torch.arange(start, start + len(feed), device=device)
        hidden = self.model(input_ids, positions, DenseCacheAttention(cache, start))
        cache.token_ids.extend(feed)
        return self.model.compute_logits(hidden[-1:])[0]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def load_draft(
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    target: ModelConfig,
    tokenizer: Tokenizer,
    max_model_len: int,
) -> DraftModel:
    """The draft model `config.speculative` names, in the target's precision, device and dtype; refused
    in one line when its vocabulary is not the target's (the drafts would mean other tokens)."""
    speculative = config.speculative
    assert speculative is not None and speculative.model is not None
    path = Path(speculative.model)
    where = f"draft model {path} (NIM_SPECULATIVE_CONFIG / NIM_DRAFT_MODEL_PATH)"
    try:
        checkpoint = inspect_local(path)
    except (OSError, ValueError) as error:
        raise UnsupportedConfigError(f"{where}: {error}") from error
    if checkpoint.config.vocab_size != target.vocab_size:
        raise UnsupportedConfigError(
            f"{where}: its vocabulary has {checkpoint.config.vocab_size} tokens, the target's "
            f"{target.vocab_size}: a draft must share the target's tokenizer"
        )
    draft_config = replace(
        config,
        model_path=checkpoint.path,
        model_format=checkpoint.model_format,
        checkpoint=checkpoint,
        tensor_parallel_size=1,
        max_model_len=max_model_len,
        lora=None,
        speculative=None,
        dense_prompt_rows=False,  # the draft's forward runs outside the step's row split
    )
    if draft_config.load_tokenizer().backend.get_vocab() != tokenizer.backend.get_vocab():
        raise UnsupportedConfigError(
            f"{where}: its tokenizer's vocabulary differs from the target's: a draft must share it"
        )
    loaded = load_rank(draft_config, device, dtype)
    return DraftModel(loaded.model, loaded.model_config.num_layers)


def check_draft(speculative: SpeculativeConfig | None, tensor_parallel_size: int) -> None:
    """Refuse the draft-model speculation this engine does not run, before anything is loaded."""
    if speculative is None or speculative.method != "draft_model":
        return
    if tensor_parallel_size > 1:
        raise UnsupportedConfigError(
            f"a draft model ({speculative.model}) with tensor parallelism {tensor_parallel_size}: the draft "
            'runs beside one rank only; use a one-GPU profile or {"method": "ngram", ...}'
        )
