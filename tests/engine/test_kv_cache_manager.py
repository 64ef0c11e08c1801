"""The KV cache manager: block tables, prefix hits, copy-on-write, the
premium reserve and usage accounting. The scheduler's bump of
`num_computed_tokens` is simulated by hand."""

import itertools

import pytest

from engine.kv_cache_manager import KVCacheManager, PrefixMatch, StalePrefixError
from engine.request import Request, Tier
from engine.sampling_params import SamplingParams
from engine.step_io import CopyOp

_seq = itertools.count()


def make_req(rid, tokens, tier=Tier.STANDARD, adapter_key=None, cache_salt=None):
    return Request(request_id=rid, prompt_token_ids=list(tokens), sampling_params=SamplingParams(),
                   arrival_seq=next(_seq), tier=tier, adapter_key=adapter_key,
                   cache_salt=cache_salt)


def admit(kv, req, num_new=None):
    """What the scheduler does to admit a request and run its first chunk."""
    prefix = kv.get_computed_blocks(req)
    num_new = req.num_tokens - prefix.num_tokens if num_new is None else num_new
    alloc = kv.allocate_slots(req, num_new, prefix)
    if alloc is not None:
        req.num_computed_tokens = prefix.num_tokens + num_new
    kv.check_invariants()
    return prefix, alloc


def decode(kv, req, token):
    """Sample `token`, give it a slot and compute it."""
    req.output_token_ids.append(token)
    alloc = kv.allocate_slots(req, 1)
    assert alloc is not None
    req.num_computed_tokens += 1
    kv.check_invariants()
    return alloc


def snapshot(kv, request_ids):
    pool = kv.block_pool
    return ({rid: kv.block_table(rid) for rid in request_ids}, pool.free_block_ids(),
            [(b.ref_cnt, b.block_hash) for b in pool.blocks], kv.usage())


def test_allocate_gives_a_block_table_covering_the_tokens():
    kv = KVCacheManager(8, 4)
    req = make_req("a", range(10))
    prefix, alloc = admit(kv, req)
    assert prefix == PrefixMatch([], 0)
    assert alloc.new_blocks == [0, 1, 2] and alloc.copies == []
    assert kv.block_table("a") == [0, 1, 2] and kv.has_blocks("a")
    assert kv.num_free_blocks() == 5


def test_decode_takes_a_new_block_only_at_a_block_boundary():
    kv = KVCacheManager(8, 4)
    req = make_req("a", range(6))
    admit(kv, req)
    assert decode(kv, req, 6).new_blocks == []  # position 6 fits block 1
    assert decode(kv, req, 7).new_blocks == []
    assert decode(kv, req, 8).new_blocks == [2]
    assert kv.block_table("a") == [0, 1, 2]


def test_chunked_prefill_extends_the_same_table():
    kv = KVCacheManager(8, 4)
    req = make_req("a", range(10))
    admit(kv, req, num_new=5)
    assert kv.block_table("a") == [0, 1]
    assert kv.allocate_slots(req, 5).new_blocks == [2]
    kv.check_invariants()


def test_free_returns_every_block_and_is_idempotent():
    kv = KVCacheManager(8, 4)
    req = make_req("a", range(10))
    admit(kv, req)
    kv.free(req)
    kv.free(req)
    kv.free("never-seen")
    assert kv.num_free_blocks() == 8 and not kv.has_blocks("a") and kv.block_table("a") == []
    kv.check_invariants()


def test_prefix_hit_shares_the_blocks_of_a_running_request():
    kv = KVCacheManager(8, 4)
    a = make_req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    admit(kv, a)
    b = make_req("b", [1, 2, 3, 4, 5, 6, 7, 8, 42])
    prefix, alloc = admit(kv, b)
    assert prefix == PrefixMatch([0, 1], 8)
    assert kv.block_table("b") == [0, 1, alloc.new_blocks[0]]
    assert [kv.block_pool.ref_cnt(x) for x in (0, 1, 2)] == [2, 2, 1]
    assert (kv.prefix_queries, kv.prefix_hits) == (10 + 9, 8)


def test_prefix_hit_revives_blocks_of_a_finished_request():
    kv = KVCacheManager(8, 4)
    a = make_req("a", range(9))
    admit(kv, a)
    kv.free(a)
    assert kv.usage().num_cached == 2  # the two full blocks; the partial one has no hash
    b = make_req("b", range(12))
    prefix, _ = admit(kv, b)
    assert prefix.blocks == [0, 1]
    assert kv.usage().num_cached == 0


def test_full_hit_leaves_the_last_token_to_compute():
    kv = KVCacheManager(8, 4)
    admit(kv, make_req("a", range(8)))
    assert kv.get_computed_blocks(make_req("b", range(8))) == PrefixMatch([0], 4)
    assert kv.get_computed_blocks(make_req("c", range(9))) == PrefixMatch([0, 1], 8)
    assert kv.get_computed_blocks(make_req("d", range(4))) == PrefixMatch([], 0)


@pytest.mark.parametrize("first, second", [
    ((None, None), ("lora-a", None)),
    (("lora-a", None), ("lora-b", None)),
    ((("lora-a", 1), None), (("lora-a", 2), None)),  # a new adapter version
    ((None, "tenant-1"), (None, "tenant-2")),
    (("lora-a", "tenant-1"), ("lora-a", None)),
])
def test_prefix_hits_never_cross_adapters_or_cache_salts(first, second):
    kv = KVCacheManager(8, 4)
    admit(kv, make_req("a", range(9), adapter_key=first[0], cache_salt=first[1]))
    other = make_req("b", range(9), adapter_key=second[0], cache_salt=second[1])
    assert kv.get_computed_blocks(other) == PrefixMatch([], 0)
    same = make_req("c", range(9), adapter_key=first[0], cache_salt=first[1])
    assert kv.get_computed_blocks(same).num_tokens == 8


def test_prefix_caching_disabled_never_matches():
    kv = KVCacheManager(8, 4, enable_prefix_caching=False)
    admit(kv, make_req("a", range(9)))
    assert kv.get_computed_blocks(make_req("b", range(9))) == PrefixMatch([], 0)
    assert all(b.block_hash is None for b in kv.block_pool.blocks)


def test_cached_blocks_are_evicted_lru_and_a_request_tail_first():
    kv = KVCacheManager(4, 2)
    a = make_req("a", [1, 2, 3, 4, 5])  # blocks 0,1 full and cached, 2 partial
    admit(kv, a)
    kv.free(a)  # tail first: the queue is 3, 2, 1, 0
    assert kv.block_pool.free_block_ids() == [3, 2, 1, 0]
    admit(kv, make_req("b", [9, 9, 9, 9, 9, 9]))  # takes 3, 2 and evicts 1
    assert kv.get_computed_blocks(make_req("c", [1, 2, 3, 4, 5])) == PrefixMatch([0], 2)


def test_fork_shares_the_table_and_copies_the_partial_block_on_write():
    kv = KVCacheManager(8, 4)
    parent = make_req("p", range(6))  # block 0 full, block 1 holds 2 tokens
    admit(kv, parent)
    child = make_req("p#1", range(6))
    child.num_computed_tokens = parent.num_computed_tokens
    kv.fork(parent, child)
    assert kv.block_table("p#1") == [0, 1]
    assert [kv.block_pool.ref_cnt(b) for b in (0, 1)] == [2, 2]
    kv.check_invariants()

    alloc = decode(kv, child, 100)
    (new,) = set(kv.block_table("p#1")) - {0, 1}
    assert alloc.copies == [CopyOp(src=1, dst=new)] and alloc.new_blocks == []
    assert kv.block_table("p#1") == [0, new]
    assert [kv.block_pool.ref_cnt(b) for b in (0, 1, new)] == [2, 1, 1]
    # The parent is the last holder of block 1 and writes in place.
    assert decode(kv, parent, 200).copies == []
    assert kv.block_table("p") == [0, 1]


def test_fork_at_a_block_boundary_needs_no_copy():
    kv = KVCacheManager(8, 4)
    parent = make_req("p", range(8))
    admit(kv, parent)
    child = make_req("p#1", range(8))
    child.num_computed_tokens = 8
    kv.fork(parent, child)
    alloc = decode(kv, child, 100)
    assert alloc.copies == [] and len(alloc.new_blocks) == 1


def test_standard_never_takes_the_premium_reserve():
    kv = KVCacheManager(10, 4, premium_reserved_blocks=3)
    assert kv.usable_blocks(Tier.STANDARD) == 7 and kv.usable_blocks(Tier.PREMIUM) == 10
    admit(kv, make_req("s1", range(100, 124)))  # 6 blocks, 4 free
    s2 = make_req("s2", range(200, 208))  # 2 blocks would leave 2 < 3
    _, alloc = admit(kv, s2)
    assert alloc is None and not kv.has_blocks("s2")
    _, alloc = admit(kv, make_req("s3", range(300, 304)))  # 1 block leaves exactly 3
    assert alloc is not None and kv.num_free_blocks() == 3
    _, alloc = admit(kv, make_req("p", range(400, 412), tier=Tier.PREMIUM))
    assert alloc is not None and kv.num_free_blocks() == 0


def test_standard_may_go_on_inside_its_blocks_when_premium_used_the_reserve():
    kv = KVCacheManager(4, 4, premium_reserved_blocks=2)
    s = make_req("s", range(5))
    admit(kv, s)
    admit(kv, make_req("p", range(100, 108), tier=Tier.PREMIUM))
    assert kv.num_free_blocks() == 0
    decode(kv, s, 7)  # position 5 is inside block 1: nothing taken


def test_reserve_counts_cached_prefix_blocks_that_leave_the_free_queue():
    kv = KVCacheManager(6, 4, premium_reserved_blocks=3)
    a = make_req("a", range(9))
    admit(kv, a)
    kv.free(a)  # blocks 0 and 1 cached, 6 free
    admit(kv, make_req("x", range(100, 108), tier=Tier.PREMIUM))  # 4 free
    _, alloc = admit(kv, make_req("b", range(12)))  # 2 revived + 1 new: 1 left
    assert alloc is None
    assert kv.usage().num_cached == 2


def test_a_failed_allocation_changes_nothing():
    kv = KVCacheManager(6, 4, premium_reserved_blocks=1)
    a = make_req("a", range(9))
    admit(kv, a)
    kv.free(a)
    admit(kv, make_req("x", range(100, 108)))
    ids = ["a", "x", "b"]
    before = snapshot(kv, ids)
    b = make_req("b", range(20))
    prefix = kv.get_computed_blocks(b)
    assert prefix.blocks == [0, 1]
    assert kv.allocate_slots(b, b.num_tokens - prefix.num_tokens, prefix) is None
    assert snapshot(kv, ids) == before
    kv.check_invariants()


def test_a_stale_prefix_match_is_refused():
    kv = KVCacheManager(3, 2)
    a = make_req("a", [1, 2, 3])
    admit(kv, a)
    kv.free(a)
    b = make_req("b", [1, 2, 3])
    prefix = kv.get_computed_blocks(b)
    assert prefix.blocks == [0]
    c = make_req("c", [7, 7, 7, 7, 7])
    admit(kv, c)  # evicts block 0 and writes other tokens into it
    kv.free(c)
    with pytest.raises(StalePrefixError):
        kv.allocate_slots(b, 1, prefix)
    kv.check_invariants()


def test_preempting_before_the_step_runs_drops_hashes_of_unwritten_kv():
    kv = KVCacheManager(8, 2)
    a = make_req("a", [1, 2, 3, 4, 5, 6, 7])
    admit(kv, a, num_new=2)  # step 1 ran: block 0 written
    assert kv.allocate_slots(a, 4) is not None  # blocks 1, 2 hashed for step 2...
    kv.free(a)  # ...which never runs: num_computed_tokens is still 2
    a.num_computed_tokens = 0
    kv.check_invariants()
    assert kv.get_computed_blocks(make_req("b", [1, 2, 3, 4, 5, 6, 7])) == PrefixMatch([0], 2)


def test_usage_counts_shared_blocks_once():
    kv = KVCacheManager(10, 4, premium_reserved_blocks=2)
    admit(kv, make_req("a", range(10), tier=Tier.PREMIUM))  # 3 blocks, 10 tokens
    admit(kv, make_req("b", range(9)))  # shares 2 full blocks, 1 token in a new one
    usage = kv.usage()
    assert (usage.num_used, usage.num_free, usage.num_cached) == (4, 6, 0)
    assert usage.used_by_tier == {Tier.PREMIUM: 3, Tier.STANDARD: 3}
    assert usage.tokens_stored == 8 + 2 + 1
    assert usage.slots_allocated == 16
    assert usage.unused_slot_fraction == pytest.approx(5 / 16)
    assert usage.usage == pytest.approx(0.4)
    assert usage.num_reserved_premium == 2
    empty = KVCacheManager(2, 4).usage()
    assert empty.unused_slot_fraction == 0.0 and empty.tokens_stored == 0


def test_reset_prefix_cache_forgets_free_blocks_only():
    kv = KVCacheManager(8, 4)
    a = make_req("a", range(9))
    admit(kv, a)
    b = make_req("b", range(50, 59))
    admit(kv, b)
    kv.free(a)
    assert not kv.reset_prefix_cache()  # b still holds hashed blocks
    assert kv.get_computed_blocks(make_req("c", range(9))).num_tokens == 0
    assert kv.get_computed_blocks(make_req("d", range(50, 59))).num_tokens == 8
    kv.free(b)
    assert kv.reset_prefix_cache() and kv.usage().num_cached == 0
