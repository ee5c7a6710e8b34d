"""A fixed pool of KV-cache blocks with reference counts and an LRU cache of full blocks.

Invariants:
- every block is either referenced (ref_count > 0, owned by one or more requests) or in the
  free queue (ref_count == 0), never both;
- the free queue is ordered least recently released first, and allocation takes from its
  front, so cached blocks nobody uses are evicted oldest first;
- a block is in `cached` (hash -> block) only while its contents are exactly the tokens its
  hash names; allocating a block for new contents drops its hash first;
- with an event log, every change to `cached` is recorded as it happens, under the same call:
  a block's "stored" when its hash enters `cached`, "removed" when it leaves, "cleared" on a
  reset. So the log is in cache order (a block is stored only after its parent was registered,
  since full blocks register in sequence order), which a KV-aware router relies on.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from service.engine.kv_events import KVEventLog
from service.engine.protocol import KVBlocksRemoved, KVBlockStored, KVCacheCleared

BlockHash = bytes

# The root of every unsalted hash chain; a different value per model would also be fine.
ROOT_HASH: BlockHash = b"\x00" * 16


def root_hash(salt: str | None) -> BlockHash:
    """Where a request's hash chain starts: ROOT_HASH, or a root of its own for a salt (whatever
    besides the tokens changes the keys and values, such as a LoRA adapter), so requests with
    different salts never share a block."""
    if salt is None:
        return ROOT_HASH
    return hashlib.blake2b(b"salt\x00" + salt.encode(), digest_size=16).digest()


# Marks a block holding output tokens where prompt and output tokens are computed by different
# kernels (service/engine/models/prompt_rows.py): such a block is found only by what computes it alike.
OUTPUT_TAG = b"output\x00"


def hash_block(parent: BlockHash, token_ids: Sequence[int], tag: bytes = b"") -> BlockHash:
    """Content hash of a full block, chained to its prefix (and `tag`: how its tokens' keys and
    values were computed, where that differs by token).

    A cryptographic hash (not Python's `hash`): a collision would serve one request another
    request's keys and values, and token ids are attacker-controlled.
    """
    return hashlib.blake2b(parent + tag + array("q", token_ids).tobytes(), digest_size=16).digest()


def event_id(block_hash: BlockHash) -> int:
    """A block's id in KV events: its hash's first 8 bytes as a signed 64-bit integer (what
    Dynamo's Python publisher takes). Two distinct cached blocks share an id with probability
    about n^2 / 2^65: negligible, and a clash would only misroute, never serve wrong keys."""
    return int.from_bytes(block_hash[:8], "little", signed=True)


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    def __init__(
        self, num_blocks: int, enable_caching: bool = True, events: KVEventLog | None = None
    ) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.enable_caching = enable_caching
        self.events = events  # None: nobody listens
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, Block] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (unreferenced, cached or not)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests (0-1)."""
        return 1.0 - len(self._free) / len(self.blocks)

    def allocate(self, count: int) -> list[Block]:
        if count > len(self._free):
            raise MemoryError(f"asked for {count} KV blocks, {len(self._free)} free")
        taken = []
        evicted = []
        for _ in range(count):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:  # evict: its old contents are about to be overwritten
                if self._cached.get(block.block_hash) is block:
                    del self._cached[block.block_hash]
                    evicted.append(event_id(block.block_hash))
                block.block_hash = None
            block.ref_count = 1
            taken.append(block)
        if evicted and self.events is not None:
            self.events.record(KVBlocksRemoved(tuple(evicted)))
        return taken

    def lookup(self, block_hash: BlockHash) -> Block | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def touch(self, block: Block) -> None:
        """Take one more reference to a cached block (a prefix hit)."""
        if block.ref_count == 0:
            del self._free[block.block_id]
        block.ref_count += 1

    def release(self, blocks: Sequence[Block]) -> None:
        """Drop one reference from each block; unreferenced ones join the free queue's tail."""
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"KV block {block.block_id} released more often than taken")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = block

    def register(
        self,
        block: Block,
        block_hash: BlockHash,
        parent: BlockHash | None = None,
        token_ids: Sequence[int] = (),
        lora_name: str | None = None,
    ) -> None:
        """Record that a now-full block holds the tokens `block_hash` names. The event log (if
        any) is told the block's parent (the hash of the block before it; None for the first),
        its tokens and its LoRA adapter."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return  # another block already holds these tokens; this one stays private
        block.block_hash = block_hash
        self._cached[block_hash] = block
        if self.events is not None:
            parent_id = None if parent is None else event_id(parent)
            self.events.record(KVBlockStored(event_id(block_hash), parent_id, tuple(token_ids), lora_name))

    def forget(self, block: Block) -> None:
        """Unpublish one block: no later lookup finds it (its contents are not to be reused)."""
        if block.block_hash is not None and self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
            if self.events is not None:
                self.events.record(KVBlocksRemoved((event_id(block.block_hash),)))
        block.block_hash = None

    def reset_cache(self) -> None:
        """Forget every cached hash (e.g. after the cache contents were invalidated)."""
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        if self.events is not None:
            self.events.record(KVCacheCleared())

    def check_invariants(self) -> None:
        """For tests: the accounting described in the module docstring holds."""
        for block in self.blocks:
            in_free = block.block_id in self._free
            assert (block.ref_count == 0) == in_free, block
            assert block.ref_count >= 0, block
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) is block, block
        assert len(self._cached) == sum(b.block_hash is not None for b in self.blocks)
