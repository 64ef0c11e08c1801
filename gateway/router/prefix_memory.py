"""The router's guess of which worker holds which prompt prefix in its KV cache.

The router never sees a worker's prefix cache; it remembers where it sent
each prompt's leading blocks, as the Inference Extension's prefix scorer
does. A prompt is cut into full blocks of the engine's block size (the
engine caches full blocks only) and each block is named by a chained hash:
block i's hash covers the scope and blocks 0..i, so one hash stands for a
whole prefix. The scope is (tenant, cache salt, adapter), the same things
the engine's prefix-cache key holds apart, so a prompt never matches one
sent under another tenant, salt or adapter. Hashes are Python's `hash` of
tuples: stable within the process, which is all a memory of this process
needs, and cheap on the event loop. The engine hashes with sha256 because a
collision there would share KV; here it only misroutes a request, and the
scope's strings are hashed with the process's random seed besides.

Bounded: at most `max_entries` (block hash, worker) pairs, least recently
recorded evicted first, and with `ttl_s` set an entry older than that no
longer matches. A prompt's blocks are recorded tail first, so its leading
blocks, the ones a later prompt can match, are evicted last.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

# Blocks of a prompt hashed at most: two prompts equal this far are
# treated as the same prefix, and hashing a huge prompt stays cheap.
MAX_PREFIX_BLOCKS = 256


def block_hashes(scope: Hashable, token_ids: Sequence[int], block_size: int,
                 max_blocks: int = MAX_PREFIX_BLOCKS) -> list[int]:
    """Chained hashes of the prompt's leading full blocks."""
    hashes: list[int] = []
    prev = hash(scope)
    num_blocks = min(len(token_ids) // block_size, max_blocks)
    for i in range(num_blocks):
        prev = hash((prev, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        hashes.append(prev)
    return hashes


class PrefixMemory:
    def __init__(self, clock: Callable[[], float], *, max_entries: int = 65536, ttl_s: float | None = None):
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.clock = clock
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        # (block hash, worker id) -> when recorded; least recently recorded first.
        self._entries: OrderedDict[tuple[int, str], float] = OrderedDict()
        self._workers: dict[int, set[str]] = {}  # block hash -> workers it was sent to

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, hashes: Sequence[int], worker_id: str) -> None:
        now = self.clock()
        for h in reversed(hashes):
            key = (h, worker_id)
            self._entries[key] = now
            self._entries.move_to_end(key)
            self._workers.setdefault(h, set()).add(worker_id)
        while len(self._entries) > self.max_entries or self._expired_first(now):
            (h, worker), _ = self._entries.popitem(last=False)
            self._drop(h, worker)

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """Worker id -> how many leading blocks of `hashes` were sent there.
        Reads only: expired entries are skipped here and dropped by `record`."""
        now = self.clock()
        matched: dict[str, int] = {}
        still: set[str] | None = None  # workers that matched every block so far
        for i, h in enumerate(hashes):
            here = {w for w in self._workers.get(h, ()) if not self._expired(self._entries[(h, w)], now)}
            still = here if still is None else still & here
            if not still:
                break
            for worker in still:
                matched[worker] = i + 1
        return matched

    def forget_worker(self, worker_id: str) -> None:
        """Drop a worker's entries: a dead or removed worker's cache is gone."""
        for key in [k for k in self._entries if k[1] == worker_id]:
            del self._entries[key]
            self._drop(key[0], worker_id)

    def _expired(self, recorded_at: float, now: float) -> bool:
        return self.ttl_s is not None and now - recorded_at > self.ttl_s

    def _expired_first(self, now: float) -> bool:
        if not self._entries:
            return False
        return self._expired(next(iter(self._entries.values())), now)

    def _drop(self, h: int, worker_id: str) -> None:
        workers = self._workers[h]
        workers.discard(worker_id)
        if not workers:
            del self._workers[h]
