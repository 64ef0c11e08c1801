"""Property test of the KV cache manager: random admission, chunked prefill,
decode, fork, preemption and abort never leak or double-free a block, keep
refcounts exact, and never let a request read KV that is not its own."""

import itertools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.request import Request, Tier
from engine.kv_cache_manager import KVCacheManager
from tests.engine.test_kv_cache_manager import make_req, snapshot

# A tiny vocabulary and few keys, so prefix hits (and near misses) happen.
TOKENS = st.integers(0, 2)
EXTRA_KEYS = [(None, None), ("lora-a", None), (("lora-a", 2), None), (None, "salt-1"),
              ("lora-a", "salt-1")]


class KVCacheMachine(RuleBasedStateMachine):
    """Drives the manager like a scheduler would, with a fake runner that
    writes each position's identity (extra key + every token up to it) into
    its slot. Whatever is shared, copied or evicted, every computed position
    of every live request must read back its own identity."""

    @initialize(num_blocks=st.integers(4, 20), block_size=st.sampled_from([1, 2, 4]),
                reserve=st.integers(0, 3), caching=st.booleans())
    def setup(self, num_blocks, block_size, reserve, caching):
        self.kv = KVCacheManager(num_blocks, block_size, premium_reserved_blocks=reserve,
                                 enable_prefix_caching=caching)
        self.bs = block_size
        self.slots = [[None] * block_size for _ in range(num_blocks)]
        self.live: dict[str, Request] = {}  # holding blocks
        self.waiting: dict[str, Request] = {}  # preempted or never fitted
        self.ids = itertools.count()

    def _identity(self, req, pos):
        return (req.adapter_key, req.cache_salt, tuple(req.all_token_ids[:pos + 1]))

    def _slot(self, table, pos):
        return self.slots[table[pos // self.bs]][pos % self.bs]

    def _allocate(self, req, num_new, prefix=None):
        """allocate_slots plus the outside checks: a None changes nothing, a
        standard request leaves the reserve intact."""
        ids = list(self.live) + list(self.waiting) + [req.request_id]
        before = snapshot(self.kv, ids)
        alloc = self.kv.allocate_slots(req, num_new, prefix)
        if alloc is None:
            assert snapshot(self.kv, ids) == before
        elif req.tier is Tier.STANDARD and self.kv.num_free_blocks() < before[3].num_free:
            assert self.kv.num_free_blocks() >= self.kv.premium_reserved_blocks
        return alloc

    def _run(self, req, alloc, num_new):
        """The runner: copies first, then write the slice's KV."""
        for copy in alloc.copies:
            self.slots[copy.dst] = list(self.slots[copy.src])
        table = self.kv.block_table(req.request_id)
        for pos in range(req.num_computed_tokens, req.num_computed_tokens + num_new):
            self.slots[table[pos // self.bs]][pos % self.bs] = self._identity(req, pos)
        req.num_computed_tokens += num_new

    def _admit(self, req, chunk):
        prefix = self.kv.get_computed_blocks(req)
        assert prefix.num_tokens % self.bs == 0 and prefix.num_tokens < req.num_tokens
        for pos in range(prefix.num_tokens):  # a hit is KV this request would compute
            assert self._slot(prefix.blocks, pos) == self._identity(req, pos)
        num_new = min(req.num_tokens - prefix.num_tokens, chunk)
        alloc = self._allocate(req, num_new, prefix)
        if alloc is None:
            self.waiting[req.request_id] = req
            return
        self.waiting.pop(req.request_id, None)
        self.live[req.request_id] = req
        req.num_computed_tokens = prefix.num_tokens
        self._run(req, alloc, num_new)

    def _pick(self, data, pool):
        return pool[data.draw(st.sampled_from(sorted(pool)))]

    def _preempt(self, req):
        self.kv.free(req)
        req.num_computed_tokens = 0
        del self.live[req.request_id]
        self.waiting[req.request_id] = req

    @rule(prompt=st.lists(TOKENS, min_size=1, max_size=10), tier=st.sampled_from(Tier),
          key=st.sampled_from(EXTRA_KEYS), chunk=st.integers(1, 10))
    def admit_new(self, prompt, tier, key, chunk):
        req = make_req(f"r{next(self.ids)}", prompt, tier, adapter_key=key[0], cache_salt=key[1])
        self._admit(req, chunk)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 10))
    def readmit(self, data, chunk):
        self._admit(self._pick(data, self.waiting), chunk)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=TOKENS, chunk=st.integers(1, 10), runs=st.booleans())
    def step(self, data, token, chunk, runs):
        """Schedule one slice (a prefill chunk, or sample then decode). If the
        slice is not run, the request is preempted in the same step."""
        req = self._pick(data, self.live)
        if req.num_computed_tokens == req.num_tokens:
            req.output_token_ids.append(token)
        num_new = min(req.num_tokens - req.num_computed_tokens, chunk)
        alloc = self._allocate(req, num_new)
        if alloc is not None and runs:
            self._run(req, alloc, num_new)
        else:
            self._preempt(req)

    def _sampled(self):
        """Live requests whose every token is computed: n > 1 forks here."""
        return {k: r for k, r in self.live.items() if r.num_computed_tokens == r.num_tokens}

    @precondition(lambda self: self._sampled())
    @rule(data=st.data())
    def fork(self, data):
        parent = self._pick(data, self._sampled())
        child = make_req(f"{parent.request_id}#{next(self.ids)}", parent.prompt_token_ids,
                         parent.tier, adapter_key=parent.adapter_key,
                         cache_salt=parent.cache_salt)
        child.output_token_ids = list(parent.output_token_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        self.kv.fork(parent, child)
        self.live[child.request_id] = child

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def preempt(self, data):
        self._preempt(self._pick(data, self.live))

    @precondition(lambda self: self.live or self.waiting)
    @rule(data=st.data(), by_id=st.booleans())
    def finish_or_abort(self, data, by_id):
        req = self._pick(data, {**self.live, **self.waiting})
        self.kv.free(req.request_id if by_id else req)
        self.live.pop(req.request_id, None)
        self.waiting.pop(req.request_id, None)

    @invariant()
    def consistent(self):
        if not hasattr(self, "kv"):
            return
        kv, pool = self.kv, self.kv.block_pool
        kv.check_invariants()
        tables = {rid: kv.block_table(rid) for rid in self.live}
        held = {b for t in tables.values() for b in t}
        assert not held & set(pool.free_block_ids())
        assert sum(len(t) for t in tables.values()) == sum(b.ref_cnt for b in pool.blocks)
        assert not any(kv.has_blocks(rid) for rid in self.waiting)
        assert kv.usage().num_used == len(held)
        for rid, req in self.live.items():
            for pos in range(req.num_computed_tokens):
                assert self._slot(tables[rid], pos) == self._identity(req, pos)

    def teardown(self):
        if not hasattr(self, "kv"):
            return
        for req in list(self.live.values()):
            self.kv.free(req)
        self.kv.check_invariants()
        usage = self.kv.usage()
        assert usage.num_free == usage.num_blocks and usage.tokens_stored == 0


KVCacheMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_kv_cache_manager_state_machine = KVCacheMachine.TestCase
