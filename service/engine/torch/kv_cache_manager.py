"""Per-request block tables over a shared BlockPool, with prefix caching.

A request's keys and values for token i live in block `block_table[i // block_size]` at offset
`i % block_size`. Full blocks are registered in the pool under a hash chain of their tokens, so
a later request whose prompt starts with the same tokens (a shared system prompt, the earlier
turns of a chat, the other choices of an n > 1 request) takes references to them instead of
recomputing them.
"""

from __future__ import annotations

from service.engine.torch.block_pool import Block, BlockHash, BlockPool
from service.engine.torch.request import Request
from service.util import cdiv


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.block_tables: dict[str, list[Block]] = {}
        self._num_registered: dict[str, int] = {}
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found
        self.to_clear: list[int] = []  # blocks discarded since the last plan, to zero before reuse

    def cached_prefix(self, request: Request) -> list[Block]:
        """The longest run of cached full blocks that starts the request's tokens.

        At least the last token is always left to compute: its logits are needed to sample. A
        request that wants prompt logprobs computes its whole prompt: cached tokens have no logits.
        """
        if not self.pool.enable_caching or request.sampling.prompt_logprobs is not None:
            return []
        usable = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in request.full_block_hashes(self.block_size)[:usable]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def prompt_blocks_in_flight(self, request: Request) -> list[BlockHash]:
        """Hashes of the full prompt blocks `request` is computing and has not published yet.

        A waiting request whose next block is among them should wait for it rather than compute
        the same keys and values a second time (the choices of an n > 1 request, a system prompt
        shared by requests that arrive together).
        """
        if not self.pool.enable_caching:
            return []
        done = self._num_registered.get(request.request_id, 0)
        num_full = request.num_prompt_tokens // self.block_size
        if done >= num_full:
            return []
        return request.full_block_hashes(self.block_size)[done:num_full]

    def next_uncached_block(self, request: Request, prefix: list[Block]) -> BlockHash | None:
        """The hash of the first block after `prefix` that admission would compute, if it is a
        full block that a prefix hit could otherwise have served."""
        if not self.pool.enable_caching or request.sampling.prompt_logprobs is not None:
            return None
        usable = (request.num_tokens - 1) // self.block_size
        if len(prefix) >= usable:
            return None
        return request.full_block_hashes(self.block_size)[len(prefix)]

    def allocate(self, request: Request, num_new_tokens: int, prefix: list[Block] | None = None) -> bool:
        """Make room for `num_new_tokens` more computed tokens; False (and no change) if the pool is short.

        `prefix` (only for a request with nothing computed) are cached blocks from `cached_prefix`;
        on success they join the block table and count as computed.
        """
        prefix = prefix or []
        table = self.block_tables.get(request.request_id, [])
        if prefix and (table or request.num_computed_tokens):
            raise ValueError("a prefix can only start an empty block table")
        computed = request.num_computed_tokens + len(prefix) * self.block_size
        needed = cdiv(computed + num_new_tokens, self.block_size) - len(table) - len(prefix)
        # Prefix blocks nobody references sit in the free queue; taking them uses that room too.
        reclaimed = sum(1 for block in prefix if block.ref_count == 0)
        if needed > self.pool.num_free - reclaimed:
            return False
        for block in prefix:
            self.pool.touch(block)
        new_blocks = self.pool.allocate(max(needed, 0))
        self.block_tables[request.request_id] = [*table, *prefix, *new_blocks]
        if prefix:
            request.num_computed_tokens = computed
            self._num_registered[request.request_id] = len(prefix)
        return True

    def record_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        self.prefix_queries += request.num_tokens
        self.prefix_hits += num_hit_tokens

    def register_full_blocks(self, request: Request) -> None:
        """After a step: publish blocks that just became full so other requests can reuse them."""
        if not self.pool.enable_caching:
            return
        table = self.block_tables[request.request_id]
        done = self._num_registered.get(request.request_id, 0)
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= done:
            return
        hashes = request.full_block_hashes(self.block_size)
        size = self.block_size
        for i in range(done, num_full):
            parent = hashes[i - 1] if i else None
            tokens = request.token_ids[i * size : (i + 1) * size] if self.pool.events is not None else ()
            self.pool.register(table[i], hashes[i], parent, tokens, request.adapter)
        self._num_registered[request.request_id] = num_full

    def trim(self, request: Request) -> None:
        """Return the blocks past the request's computed tokens (speculative tokens rejected after
        their blocks were taken). Such blocks were never published: only full blocks of computed
        tokens are (`register_full_blocks`)."""
        table = self.block_tables.get(request.request_id)
        if table is None:
            return
        keep = cdiv(request.num_computed_tokens, self.block_size)
        if len(table) > keep:
            self.pool.release(table[keep:][::-1])
            del table[keep:]

    def free(self, request: Request, discard: bool = False) -> None:
        """Return the request's blocks; tail first, so its shared prefix is evicted last.

        With `discard` (its keys and values may be non-finite) the blocks only it holds are
        unpublished and queued in `to_clear`, so they are zeroed before anyone else uses them.
        """
        table = self.block_tables.pop(request.request_id, [])
        self._num_registered.pop(request.request_id, None)
        if discard:
            for block in table:
                if block.ref_count == 1:
                    self.pool.forget(block)
                    self.to_clear.append(block.block_id)
        self.pool.release(table[::-1])

    def block_table(self, request: Request) -> list[int]:
        return [block.block_id for block in self.block_tables[request.request_id]]
