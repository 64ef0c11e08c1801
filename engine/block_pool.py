"""The pool of fixed-size KV blocks: refcounts, the free queue, and the map
from block hash to block that prefix caching looks blocks up in.

Pure bookkeeping: a block is an id into the runner's KV tensors, and nothing
here touches them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable

from engine.block_hash import BlockHash


@dataclass
class KVBlock:
    block_id: int
    # Number of block tables holding this block; 0 means it is in the free queue.
    ref_cnt: int = 0
    # Set while the block is in the prefix-cache map (it is full and its KV
    # is known by hash). A free block keeping its hash is "cached": it can be
    # revived by a prefix hit until allocation evicts it.
    block_hash: BlockHash | None = None


class BlockPool:
    """Blocks `0..num_blocks-1`, each either used (ref_cnt > 0) or free.

    The free queue is kept in LRU order: head = least recently freed, the
    next block to hand out; tail = most recently freed. It is an
    `OrderedDict` keyed by block id (values unused), which is a hash map
    threaded by a doubly linked list, so each operation the pool needs is
    O(1):

      * allocate: `popitem(last=False)` pops the head;
      * free: assigning a key appends at the tail;
      * prefix hit on a cached free block: `pop(block_id)` unlinks it from
        the middle of the queue.

    vLLM hand-rolls the same doubly linked list (FreeKVCacheBlockQueue);
    OrderedDict gives it to us in C. Cached blocks sit in the free queue like
    any other free block, so eviction is simply allocation: popping a head
    that carries a hash drops that hash from the map. Blocks freed last (a
    request's tail, freed before its shared prefix) are evicted last.

    Invariant: `block.block_hash is not None` exactly when the map sends that
    hash to that block.
    """

    def __init__(self, num_blocks: int):
        assert num_blocks >= 1, "need at least one block"
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        """Free blocks that still hold a prefix hash (evictable)."""
        return sum(1 for b in self._cached.values() if self.blocks[b].ref_cnt == 0)

    def free_block_ids(self) -> list[int]:
        """The free queue, least recently freed (next allocated) first."""
        return list(self._free)

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    def ref_cnt(self, block_id: int) -> int:
        return self.blocks[block_id].ref_cnt

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block holding this hash, or None if no block does."""
        return self._cached.get(block_hash)

    def allocate(self, num: int) -> list[int]:
        """Take `num` blocks from the head of the free queue, with ref_cnt 1.
        A cached block taken here is evicted: its hash leaves the map."""
        assert 0 <= num <= len(self._free), f"asked for {num} blocks, {len(self._free)} free"
        out = []
        for _ in range(num):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            assert block.ref_cnt == 0
            if block.block_hash is not None:
                self._unmap(block)
            block.ref_cnt = 1
            out.append(block_id)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block; a free (cached) block leaves
        the free queue and keeps its hash."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block, in the order given. A block that
        reaches 0 goes to the tail of the free queue and keeps its hash."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_cnt > 0, f"double free of block {block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None

    def register(self, block_id: int, block_hash: BlockHash) -> bool:
        """Map `block_hash` to a full used block; True if this call added it.
        False (and no change) when the hash is already mapped: to this block,
        or to another one, which then stays the cached copy while this block
        never becomes a prefix hit."""
        block = self.blocks[block_id]
        assert block.ref_cnt > 0, "only a used block can be registered"
        if block_hash in self._cached:
            return False
        # A block is hashed once it is full, and a full block is never
        # written again, so it cannot come to hold a second content.
        assert block.block_hash is None, f"block {block_id} already holds another hash"
        block.block_hash = block_hash
        self._cached[block_hash] = block_id
        return True

    def unregister(self, block_id: int) -> None:
        """Forget this block's hash, if it has one."""
        block = self.blocks[block_id]
        if block.block_hash is not None:
            self._unmap(block)

    def reset_cached(self) -> bool:
        """Drop the hash of every free block. Used blocks keep theirs (the
        requests holding them may still extend the chain). True when the map
        is empty afterwards."""
        for block_hash, block_id in list(self._cached.items()):
            if self.blocks[block_id].ref_cnt == 0:
                self._unmap(self.blocks[block_id])
        return not self._cached

    def _unmap(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        del self._cached[block.block_hash]
        block.block_hash = None

    def check_invariants(self) -> None:
        for block in self.blocks:
            assert block.ref_cnt >= 0
            assert (block.ref_cnt == 0) == (block.block_id in self._free), \
                f"block {block.block_id}: ref_cnt {block.ref_cnt} disagrees with the free queue"
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) == block.block_id
        assert len(self._free) + sum(b.ref_cnt > 0 for b in self.blocks) == self.num_blocks
        for block_hash, block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == block_hash, \
                f"hash map points at block {block_id}, which does not carry that hash"
