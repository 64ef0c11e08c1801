"""The paged KV cache manager: block tables, prefix caching, copy-on-write
and the premium reserve.

Pure Python and pure bookkeeping. The scheduler asks it for slots; the
runner reads block tables and performs the `CopyOp`s it returns. It never
changes a request: `num_computed_tokens` belongs to the scheduler.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Hashable, NamedTuple

from engine.block_hash import BlockHash, extend_block_hashes, hash_block
from engine.block_pool import BlockPool
from engine.errors import EngineError
from engine.request import Request, Tier
from engine.step_io import CopyOp


class PrefixMatch(NamedTuple):
    """Cached blocks covering the first `num_tokens` tokens of a request, in
    order. `num_tokens` is a multiple of block_size and always less than the
    request's length: at least one token is left to compute, so the last
    position's logits can be produced."""

    blocks: list[int]
    num_tokens: int


class Allocation(NamedTuple):
    # Blocks appended to the end of the request's block table. A block
    # replaced by copy-on-write shows up as a copy's `dst` instead.
    new_blocks: list[int]
    # The runner copies src -> dst before the forward pass.
    copies: list[CopyOp]


@dataclass(frozen=True)
class KVUsage:
    num_blocks: int
    num_used: int  # ref_cnt > 0
    num_free: int  # ref_cnt == 0, cached ones included
    num_cached: int  # free but still holding a prefix hash (evictable)
    num_reserved_premium: int
    used_by_tier: dict[Tier, int]  # distinct blocks held by at least one request of the tier
    tokens_stored: int  # filled token positions of the distinct used blocks
    slots_allocated: int  # num_used * block_size

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    @property
    def unused_slot_fraction(self) -> float:
        """Share of allocated slots holding no token (internal fragmentation)."""
        if self.slots_allocated == 0:
            return 0.0
        return (self.slots_allocated - self.tokens_stored) / self.slots_allocated


class StalePrefixError(EngineError):
    """A PrefixMatch no longer describes the cache: some of its blocks were
    evicted or reused between `get_computed_blocks` and `allocate_slots`.
    Sharing them would hand the request KV of other tokens, so this is a
    scheduler bug, never something to paper over."""


@dataclass
class _RequestBlocks:
    tier: Tier
    block_table: list[int]
    # Token positions the request occupies: num_computed + num_new of its
    # latest allocation (a forked child starts with its parent's).
    num_tokens: int
    # Chained hashes of the request's first len(block_hashes) full blocks;
    # decode steps extend the chain instead of rehashing the sequence.
    block_hashes: list[BlockHash] = field(default_factory=list)
    # Table indices of the blocks whose hash the latest allocation put in
    # the map: their KV is written by the step that allocation was made for.
    pending_hashed: list[int] = field(default_factory=list)


class KVCacheManager:
    """Owns the block pool and one block table per request.

    Every block a request holds is referenced once in its table; a block's
    ref_cnt is the number of tables holding it. Blocks shared by a prefix hit
    are full and never written again; the one kind of shared block that can
    still be written is a fork's partial last block, which `allocate_slots`
    copies on the first write.
    """

    def __init__(self, num_blocks: int, block_size: int, *, premium_reserved_blocks: int = 0,
                 enable_prefix_caching: bool = True):
        assert block_size >= 1
        assert 0 <= premium_reserved_blocks <= num_blocks
        self.block_size = block_size
        self.premium_reserved_blocks = premium_reserved_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks)
        self._requests: dict[str, _RequestBlocks] = {}
        # Prefix-cache stats, in tokens, cumulative.
        self.prefix_queries = 0
        self.prefix_hits = 0
        # Whether the last allocation that took free blocks was a standard
        # one: nothing since has shrunk the free queue, so the reserve must
        # still be intact.
        self._standard_took_last = False

    # -- prefix lookup -----------------------------------------------------

    def get_computed_blocks(self, req: Request) -> PrefixMatch:
        """The longest run of cached full blocks at the start of the request.
        Read-only: no reference is taken until `allocate_slots`, which must
        come next for this request (any allocation in between may evict
        them). Adds to `prefix_queries` / `prefix_hits` (in tokens) when
        caching is on; with caching off the match is always empty."""
        if not self.enable_prefix_caching:
            return PrefixMatch([], 0)
        token_ids = req.all_token_ids
        bs = self.block_size
        extra_key = _extra_key(req)
        # Never match the last token: its logits must be computed.
        max_blocks = (len(token_ids) - 1) // bs
        blocks: list[int] = []
        parent: BlockHash | None = None
        for i in range(max(max_blocks, 0)):
            parent = hash_block(parent, token_ids[i * bs:(i + 1) * bs], extra_key)
            block_id = self.block_pool.lookup(parent)
            if block_id is None:
                break
            blocks.append(block_id)
        num_tokens = len(blocks) * bs
        self.prefix_queries += len(token_ids)
        self.prefix_hits += num_tokens
        return PrefixMatch(blocks, num_tokens)

    # -- allocation --------------------------------------------------------

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       prefix: PrefixMatch | None = None) -> Allocation | None:
        """Give positions [num_computed, num_computed + num_new_tokens) slots.

        `num_computed` is `prefix.num_tokens` on first admission with a
        prefix, else `req.num_computed_tokens`. Returns None, changing
        nothing, exactly when the blocks cannot be had: not enough free
        blocks, or a standard request would dip into the premium reserve.

        Blocks this step fills are hashed now, not after the step, so a
        request admitted later in the same step can hit them: the attention
        backend writes the whole batch's KV before any sequence reads.
        """
        assert num_new_tokens >= 0
        bs = self.block_size
        state = self._requests.get(req.request_id)
        if prefix is not None:
            assert state is None, f"{req.request_id}: a prefix is only for first admission"
            assert prefix.num_tokens == len(prefix.blocks) * bs
            assert prefix.num_tokens < max(req.num_tokens, 1), "a prefix must leave a token"
            assert self.enable_prefix_caching or not prefix.blocks
            num_computed = prefix.num_tokens
            table = list(prefix.blocks)
        else:
            num_computed = req.num_computed_tokens
            table = list(state.block_table) if state is not None else []
        assert num_computed <= len(table) * bs, f"{req.request_id}: computed tokens without slots"
        end = num_computed + num_new_tokens

        # Plan, touching nothing.
        num_required = -(-end // bs)
        cow = []
        if num_new_tokens > 0:
            cow = [i for i in range(num_computed // bs, min(len(table), num_required))
                   if self.block_pool.ref_cnt(table[i]) > 1]
        num_appended = max(0, num_required - len(table))
        num_revived = sum(1 for b in prefix.blocks if self.block_pool.is_free(b)) if prefix else 0
        num_taken = num_revived + len(cow) + num_appended
        if not self._can_take(req.tier, num_taken):
            return None
        # A fresh admission rebuilds the chain from token 0, which also
        # proves the prefix blocks still hold what the match said.
        hashes = state.block_hashes if state is not None else []
        num_hashed_before = len(hashes)
        self._extend_hashes(req, hashes, end)
        if prefix is not None:
            self._check_prefix_fresh(req, prefix, hashes)

        # Commit.
        if prefix is not None:
            self.block_pool.touch(prefix.blocks)
        copies = self._copy_on_write(table, cow, num_computed)
        new_blocks = self.block_pool.allocate(num_appended)
        table.extend(new_blocks)
        if state is None:
            state = _RequestBlocks(tier=req.tier, block_table=table, num_tokens=end)
            self._requests[req.request_id] = state
        state.block_table = table
        state.num_tokens = end
        state.block_hashes = hashes
        state.pending_hashed = [i for i in range(num_hashed_before, len(hashes))
                                if self.block_pool.register(table[i], hashes[i])]
        if num_taken > 0:
            self._standard_took_last = req.tier is Tier.STANDARD
        return Allocation(new_blocks, copies)

    def _extend_hashes(self, req: Request, hashes: list[BlockHash], end: int) -> None:
        """Hash the blocks that positions below `end` fill. Only tokens the
        request already knows can be hashed; slots past them stay unhashed
        until a later allocation fills them."""
        if not self.enable_prefix_caching:
            return
        num_known = min(end, req.num_tokens)
        if num_known // self.block_size > len(hashes):
            extend_block_hashes(hashes, req.all_token_ids[:num_known], self.block_size,
                                _extra_key(req))

    def _copy_on_write(self, table: list[int], indices: list[int],
                       num_computed: int) -> list[CopyOp]:
        """Replace the shared blocks at `indices` with private ones."""
        copies = []
        for i in indices:
            old = table[i]
            (new,) = self.block_pool.allocate(1)
            if i * self.block_size < num_computed:  # it holds computed KV worth keeping
                copies.append(CopyOp(src=old, dst=new))
            table[i] = new
            self.block_pool.free([old])  # still used: it was shared
        return copies

    def _can_take(self, tier: Tier, num_blocks: int) -> bool:
        if num_blocks == 0:
            # Taking nothing cannot eat the reserve, even if premium already
            # did: a standard decode step inside its last block must go on.
            return True
        free_after = self.block_pool.num_free - num_blocks
        if tier is Tier.PREMIUM:
            return free_after >= 0
        return free_after >= self.premium_reserved_blocks

    def _check_prefix_fresh(self, req: Request, prefix: PrefixMatch,
                            hashes: list[BlockHash]) -> None:
        for i, block_id in enumerate(prefix.blocks):
            if self.block_pool.blocks[block_id].block_hash != hashes[i]:
                raise StalePrefixError(
                    f"{req.request_id}: block {block_id} of the prefix no longer holds block {i}; "
                    "call allocate_slots right after get_computed_blocks")

    def fork(self, parent: Request, child: Request) -> None:
        """Give `child` the parent's block table, sharing every block. The
        shared partial last block is copied on the first write."""
        src = self._requests.get(parent.request_id)
        assert src is not None, f"fork of {parent.request_id}, which holds no blocks"
        assert child.request_id not in self._requests, f"{child.request_id} already holds blocks"
        assert _extra_key(child) == _extra_key(parent), "a fork keeps the adapter and cache salt"
        self.block_pool.touch(src.block_table)
        self._requests[child.request_id] = _RequestBlocks(
            tier=child.tier, block_table=list(src.block_table), num_tokens=src.num_tokens,
            block_hashes=list(src.block_hashes))

    def free(self, request: Request | str) -> None:
        """Release every block of the request (finish, abort, preemption).

        Blocks are released tail first, so a request's own tail is evicted
        before the prefix it may share with others. Blocks keep their hashes
        (they stay cached). Unknown ids are ignored, so freeing twice is safe.

        Pass the Request itself where you can, before resetting its
        `num_computed_tokens`: allocate_slots hashes blocks for tokens its
        step is about to compute, and a request preempted before that step
        runs would leave hashes on KV that is never written. Given the
        request, blocks not fully below `num_computed_tokens` lose the hashes
        its latest allocation gave them. Given only an id, every allocation
        is taken to have run.
        """
        request_id = request if isinstance(request, str) else request.request_id
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        if not isinstance(request, str):
            self._unhash_uncomputed(state, request.num_computed_tokens)
        self.block_pool.free(reversed(state.block_table))

    def fresh_hashed_blocks(self, req: Request) -> list[int]:
        """The blocks whose hash the request's latest allocation registered."""
        state = self._requests.get(req.request_id)
        return [state.block_table[i] for i in state.pending_hashed] if state is not None else []

    def forget_uncomputed(self, req: Request) -> None:
        """The step of the request's latest allocation was dropped: blocks
        not fully below `num_computed_tokens` lose the hashes it gave them
        (they would be prefix hits on K/V never written), and the chain
        forgets them, so that the next allocation hashes them again."""
        state = self._requests.get(req.request_id)
        if state is None:
            return
        keep = self._unhash_uncomputed(state, req.num_computed_tokens)
        state.pending_hashed = [i for i in state.pending_hashed if i < keep]
        del state.block_hashes[keep:]

    def _unhash_uncomputed(self, state: _RequestBlocks, num_computed: int) -> int:
        """Unregister the hashes the latest allocation gave blocks not fully
        below `num_computed`; returns how many blocks are fully below it."""
        keep = num_computed // self.block_size
        for i in state.pending_hashed:
            if i >= keep:
                self.block_pool.unregister(state.block_table[i])
        return keep

    def reset_prefix_cache(self) -> bool:
        """Drop the hash of every free block, so no later request hits them.
        Blocks still in use keep theirs. True when nothing is cached
        afterwards (always, if no request holds blocks)."""
        return self.block_pool.reset_cached()

    # -- queries -----------------------------------------------------------

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block table ([] if it holds no blocks)."""
        state = self._requests.get(request_id)
        return list(state.block_table) if state is not None else []

    def has_blocks(self, request_id: str) -> bool:
        """True from the first successful allocate_slots (or fork) until free."""
        return request_id in self._requests

    def num_free_blocks(self) -> int:
        return self.block_pool.num_free

    def usable_blocks(self, tier: Tier) -> int:
        """The most blocks requests of this tier can ever hold at once."""
        reserved = 0 if tier is Tier.PREMIUM else self.premium_reserved_blocks
        return self.block_pool.num_blocks - reserved

    def usage(self) -> KVUsage:
        bs = self.block_size
        by_tier: dict[Tier, set[int]] = {tier: set() for tier in Tier}
        full: set[int] = set()
        partial: dict[int, int] = {}
        for state in self._requests.values():
            by_tier[state.tier].update(state.block_table)
            num_full = state.num_tokens // bs
            full.update(state.block_table[:num_full])
            for i in range(num_full, len(state.block_table)):
                filled = max(0, state.num_tokens - i * bs)
                block_id = state.block_table[i]
                partial[block_id] = max(partial.get(block_id, 0), filled)
        tokens_stored = bs * len(full) + sum(n for b, n in partial.items() if b not in full)
        num_used = self.block_pool.num_used
        return KVUsage(
            num_blocks=self.block_pool.num_blocks,
            num_used=num_used,
            num_free=self.block_pool.num_free,
            num_cached=self.block_pool.num_cached,
            num_reserved_premium=self.premium_reserved_blocks,
            used_by_tier={tier: len(blocks) for tier, blocks in by_tier.items()},
            tokens_stored=tokens_stored,
            slots_allocated=num_used * bs,
        )

    def check_invariants(self) -> None:
        pool = self.block_pool
        pool.check_invariants()
        refs: Counter[int] = Counter()
        for request_id, state in self._requests.items():
            table = state.block_table
            assert len(set(table)) == len(table), f"{request_id} holds a block twice"
            assert state.num_tokens <= len(table) * self.block_size
            assert len(state.block_hashes) <= len(table)
            for block_hash, block_id in zip(state.block_hashes, table):
                carried = pool.blocks[block_id].block_hash
                assert carried is None or carried == block_hash, \
                    f"{request_id}: block {block_id} carries another prefix's hash"
            refs.update(table)
        for block in pool.blocks:
            held = refs[block.block_id]
            assert block.ref_cnt == held, \
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {held} tables"
        if not self.enable_prefix_caching:
            assert all(b.block_hash is None for b in pool.blocks)
        if self._standard_took_last:
            assert pool.num_free >= self.premium_reserved_blocks, \
                "a standard allocation ate the premium reserve"


def _extra_key(req: Request) -> tuple[Hashable | None, str | None]:
    """What besides the tokens decides a block's KV: the adapter (with its
    version) and the tenant's cache salt."""
    return (req.adapter_key, req.cache_salt)
