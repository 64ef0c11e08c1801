"""The block pool on its own (refcounts, LRU free queue, hash map), and the
chained block hashes it is keyed by."""

import pytest

from engine.block_hash import extend_block_hashes, hash_block, hash_full_blocks
from engine.block_pool import BlockPool

H1 = hash_block(None, [1, 2], None)
H2 = hash_block(None, [3, 4], None)
H3 = hash_block(None, [5, 6], None)


def test_fresh_pool_is_all_free_in_id_order():
    pool = BlockPool(4)
    assert pool.num_free == 4 and pool.num_used == 0
    assert pool.free_block_ids() == [0, 1, 2, 3]
    pool.check_invariants()


def test_allocate_pops_the_head_with_one_reference():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert [pool.ref_cnt(b) for b in range(4)] == [1, 1, 0, 0]
    assert pool.free_block_ids() == [2, 3]
    pool.check_invariants()


def test_free_appends_at_the_tail_in_the_order_given():
    pool = BlockPool(4)
    pool.allocate(3)
    pool.free([2, 0])
    assert pool.free_block_ids() == [3, 2, 0]
    assert pool.allocate(2) == [3, 2]
    pool.check_invariants()


def test_shared_block_is_freed_by_its_last_reference():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.touch([b])
    pool.free([b])
    assert pool.ref_cnt(b) == 1 and not pool.is_free(b)
    pool.free([b])
    assert pool.is_free(b)
    with pytest.raises(AssertionError):
        pool.free([b])


def test_freed_block_keeps_its_hash_until_allocation_evicts_it():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    assert pool.register(a, H1)
    pool.free([a, b])
    assert pool.lookup(H1) == a and pool.num_cached == 1
    # Head of the queue is `a`: allocating it evicts the hash.
    assert pool.allocate(1) == [a]
    assert pool.lookup(H1) is None and pool.blocks[a].block_hash is None
    pool.check_invariants()


def test_cached_blocks_are_evicted_least_recently_freed_first():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    for block_id, h in ((a, H1), (b, H2), (c, H3)):
        pool.register(block_id, h)
    pool.free([b])
    pool.free([c])
    pool.free([a])
    pool.allocate(1)
    assert pool.lookup(H2) is None
    assert pool.lookup(H3) == c and pool.lookup(H1) == a
    pool.allocate(1)
    assert pool.lookup(H3) is None and pool.lookup(H1) == a
    pool.check_invariants()


def test_touch_revives_a_cached_block_from_the_middle_of_the_queue():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.register(b, H2)
    pool.free([a, b, c])
    pool.touch([b])
    assert pool.free_block_ids() == [a, c]
    assert pool.ref_cnt(b) == 1 and pool.lookup(H2) == b
    # Revived blocks are not handed out again.
    assert pool.allocate(2) == [a, c]
    pool.check_invariants()


def test_register_keeps_the_first_block_for_a_hash():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    assert pool.register(a, H1)
    assert not pool.register(a, H1)  # already there
    assert not pool.register(b, H1)  # another copy of the same KV
    assert pool.lookup(H1) == a and pool.blocks[b].block_hash is None
    pool.check_invariants()


def test_unregister_forgets_the_hash():
    pool = BlockPool(1)
    (a,) = pool.allocate(1)
    pool.register(a, H1)
    pool.unregister(a)
    pool.unregister(a)  # no hash: no-op
    assert pool.lookup(H1) is None
    pool.check_invariants()


def test_reset_cached_drops_free_hashes_and_reports_used_ones():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.register(a, H1)
    pool.register(b, H2)
    pool.free([a])
    assert not pool.reset_cached()  # b is used and keeps H2
    assert pool.lookup(H1) is None and pool.lookup(H2) == b
    pool.free([b])
    assert pool.reset_cached()
    assert pool.num_cached == 0
    pool.check_invariants()


# -- block hashes ------------------------------------------------------------

def test_hash_covers_tokens_parent_and_extra_key():
    base = hash_block(None, [1, 2, 3], ("lora", None))
    assert base == hash_block(None, [1, 2, 3], ("lora", None))
    assert base != hash_block(None, [1, 2, 4], ("lora", None))
    assert base != hash_block(H1, [1, 2, 3], ("lora", None))
    assert base != hash_block(None, [1, 2, 3], ("lora", "salt"))
    assert base != hash_block(None, [1, 2, 3], (("lora", 2), None))
    assert base != hash_block(None, [1, 2, 3], (None, None))
    # Types matter: the string "1" is not the int 1.
    assert hash_block(None, [1], ("1", None)) != hash_block(None, [1], (1, None))


def test_hash_rejects_keys_without_a_stable_repr():
    with pytest.raises(TypeError):
        hash_block(None, [1], (object(), None))


def test_full_block_hashes_chain_and_extend_incrementally():
    tokens = [5, 6, 7, 8, 9]
    hashes = hash_full_blocks(tokens, 2, None)
    assert len(hashes) == 2  # the trailing token is a partial block
    assert hashes[1] == hash_block(hashes[0], [7, 8], None)
    grown = list(hashes)
    appended = extend_block_hashes(grown, tokens + [10], 2, None)
    assert appended == [hash_block(hashes[1], [9, 10], None)]
    assert grown == hash_full_blocks(tokens + [10], 2, None)
    # Equal blocks at different depths differ: the hash stands for the prefix.
    repeated = hash_full_blocks([1, 1, 1, 1], 2, None)
    assert repeated[0] != repeated[1]
