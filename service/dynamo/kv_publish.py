"""The engine's prefix-cache events (Engine.kv_events) -> Dynamo's KV event publisher.

Dynamo's router keeps, per worker, a tree of the blocks it was told about: a "stored" whose
parent it does not know is dropped (and every later child with it), a "removed" of an unknown
block is skipped. It hashes each block's tokens itself; our ids only link parents and name
removals.

Invariant kept here: `known` is exactly the set of ids the router was told are stored and not
since removed (a run being gathered counts: it is published before any other call), so

- a stored block is published only when its parent is None or known; otherwise it waits in
  `orphans` under its parent's id (an engine corner: a block whose parent's twin was evicted
  just before it filled) and goes out when that parent is stored, or is dropped when removed;
- a removal is published only for known ids;
- a "cleared" becomes a removal of every known id (Dynamo 1.6.1's Python publisher has no
  cleared event), and orphans are forgotten.

Stored blocks that chain (each the previous one's child, same adapter) leave in one call, as the
engine stores a prompt's blocks in one step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Protocol

from service.engine.protocol import KVBlocksRemoved, KVBlockStored, KVCacheCleared, KVEvent

MAX_ORPHANS = 4096  # stored blocks waiting for their parent; past it the oldest are dropped


class DynamoKvPublisher(Protocol):
    """The part of dynamo.llm.KvEventPublisher used here."""

    def publish_stored(
        self,
        token_ids: list[int],
        num_block_tokens: list[int],
        block_hashes: list[int],
        parent_hash: int | None = None,
        lora_name: str | None = None,
    ) -> None: ...

    def publish_removed(self, block_hashes: list[int]) -> None: ...


class KvEventRelay:
    def __init__(self, publisher: DynamoKvPublisher, block_size: int) -> None:
        self.publisher = publisher
        self.block_size = block_size
        self.known: set[int] = set()
        self.orphans: OrderedDict[int, KVBlockStored] = OrderedDict()  # by its own id
        self._run: list[KVBlockStored] = []

    def apply(self, events: Iterable[KVEvent]) -> None:
        for event in events:
            if isinstance(event, KVBlockStored):
                self._stored(event)
            elif isinstance(event, KVBlocksRemoved):
                self._flush()
                self._removed(event.block_hashes)
            else:
                assert isinstance(event, KVCacheCleared)
                self._flush()
                self._removed(tuple(self.known))
                self.orphans.clear()
        self._flush()

    def _stored(self, event: KVBlockStored) -> None:
        if event.block_hash in self.known or len(event.token_ids) != self.block_size:
            return  # the router has it already / would drop a partial block
        if event.parent_hash is not None and event.parent_hash not in self.known:
            self.orphans[event.block_hash] = event
            while len(self.orphans) > MAX_ORPHANS:
                self.orphans.popitem(last=False)
            return
        self._add(event)
        self._adopt(event.block_hash)

    def _add(self, event: KVBlockStored) -> None:
        """Append to the current run, or start a new one when it does not chain on. The id counts
        as known at once: the run is published before any other call to the publisher."""
        last = self._run[-1] if self._run else None
        if last is not None and (last.block_hash != event.parent_hash or last.lora_name != event.lora_name):
            self._flush()
        self._run.append(event)
        self.known.add(event.block_hash)

    def _adopt(self, parent: int) -> None:
        """Publish the orphans waiting for `parent` (and theirs, in order)."""
        waiting = [parent]
        while waiting and self.orphans:
            current = waiting.pop()
            children = [o for o in self.orphans.values() if o.parent_hash == current]
            for child in children:
                del self.orphans[child.block_hash]
                self._add(child)
                waiting.append(child.block_hash)

    def _flush(self) -> None:
        run, self._run = self._run, []
        if not run:
            return
        self.publisher.publish_stored(
            token_ids=[t for block in run for t in block.token_ids],
            num_block_tokens=[self.block_size] * len(run),
            block_hashes=[block.block_hash for block in run],
            parent_hash=run[0].parent_hash,
            lora_name=run[0].lora_name,
        )

    def _removed(self, ids: Sequence[int]) -> None:
        gone = [block_id for block_id in ids if block_id in self.known]
        for block_id in ids:
            self.orphans.pop(block_id, None)
        if gone:
            self.publisher.publish_removed(block_hashes=gone)
            self.known.difference_update(gone)
