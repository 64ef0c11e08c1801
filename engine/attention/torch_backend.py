"""Paged attention in torch: the CPU backend, and the reference for the
Triton one.

Per step, `prepare` groups the batch once:
- decode sequences (query_len 1) go to the C++ kernel of `cpu_decode`, which
  reads their blocks in place, when it is available and supports the
  tensors (CPU, float32 or bfloat16); otherwise, the pure-torch twin: they
  are sorted by length and cut into buckets
  whose lengths differ by at most `decode_pad_budget` tokens and whose
  padded K/V stays under `decode_bucket_tokens`; each bucket gathers its
  K/V blocks through the block tables and runs one batched
  `scaled_dot_product_attention` with a key-padding mask (a bucket of one
  sequence, or of equal lengths, needs no mask);
- prefill chunks go, all in one call, to the C++ kernel of `cpu_prefill`
  (float32 everywhere, bfloat16 on CPUs with AVX512-BF16), which also reads
  the blocks in place; without it, they run one SDPA each: over this
  step's own K/V with `is_causal` when the chunk is the whole context, else
  over the gathered blocks with a bottom-right-aligned causal mask (the
  query is the last `query_len` of `seq_len` positions). Except in
  bfloat16 with the prefill kernel, a chunk of up to SHORT_CHUNK_ROWS rows
  (a speculating sequence's verification) goes to the decode kernel
  instead, each row as a decode row over the positions it may see, so that
  its rows are computed as the decode rows they stand in for.

Each layer first writes its new K/V into the caches: by the decode
kernel's `write_kv` where that kernel serves the tensors (one C++ call),
else by `index_copy_` after a cast to the cache's dtype.

A float32 model's cache may hold float16 (`kv_cache_dtype`,
engine/config.py): the decode kernel widens it as it reads, the SDPA paths
widen what they gather, and a chunk that attends over its own K/V rounds
them as the cache does, so every query sees the K/V the cache holds.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import native
from engine.attention import cpu_decode, cpu_prefill
from engine.attention.base import AttentionBackend, AttentionMetadata


@dataclass
class _DecodeBucket:
    rows: torch.Tensor  # [n] int64: token rows of the flat batch
    blocks: torch.Tensor  # [n * num_blocks] int64: each sequence's first num_blocks blocks
    num_blocks: int
    kv_len: int  # keys attended: the longest seq_len, or num_blocks * block_size with a mask
    mask: torch.Tensor | None  # [n, 1, 1, kv_len] bool, True = attend; None when no padding


@dataclass
class _PrefillChunk:
    start: int  # first token row of the chunk in the flat batch
    query_len: int
    seq_len: int
    blocks: torch.Tensor | None  # [num_blocks] int64; None: attend over this step's own K/V
    mask: torch.Tensor | None  # [query_len, num_blocks * block_size] bool, bottom-right causal


@dataclass
class _StepPlan:
    decode_seqs: list[int]  # batch indices of the decode sequences
    decode_rows: torch.Tensor  # [n] int64: their token rows in the flat batch
    decode_seq_ids: torch.Tensor  # [n] int64: decode_seqs as a tensor
    decode_buckets: list[_DecodeBucket] | None  # the torch path's plan, built on first use
    prefill_seqs: list[int]  # batch indices of the prefill chunks
    prefill_starts: torch.Tensor  # [n] int64: each chunk's first token row
    prefill_lens: torch.Tensor  # [n] int64: its query length
    prefill_seq_ids: torch.Tensor  # [n] int64: prefill_seqs as a tensor
    prefill: list[_PrefillChunk] | None  # the SDPA path's plan, built on first use
    short: _RowsAsDecode | None = None  # after _split_prefill: the short chunks, when the decode kernel takes them
    long: _Chunks | None = None  # ... and the rest, for the prefill kernel or SDPA


@dataclass
class _Chunks:
    """Prefill chunks as the prefill kernel takes them."""

    seqs: list[int]  # batch indices
    starts: torch.Tensor  # [n] int64: each chunk's first token row
    lens: torch.Tensor  # [n] int64: its query length
    seq_ids: torch.Tensor  # [n] int64: seqs as a tensor


@dataclass
class _RowsAsDecode:
    """Short chunks' query rows as decode rows: row t of a chunk of q rows
    over seq_len positions attends to the first seq_len - q + t + 1, through
    its sequence's block table."""

    kernel: object  # the decode kernel that takes them
    rows: torch.Tensor  # [n] int64: token rows in the flat batch
    seq_ids: torch.Tensor  # [n] int64: arange, into the two below
    block_tables: torch.Tensor  # [n, max_blocks] int32: each row's sequence's table
    seq_lens: torch.Tensor  # [n] int32: the positions each row attends to


# Except in bfloat16 with the prefill kernel, a chunk of up to this many
# query rows goes through the decode kernel row by row: a speculating
# sequence's verification (1 + K rows) over a long context. SDPA, for those
# few queries, first gathered the whole context's K and V out of the blocks
# in every layer: a quarter of single-stream decode's time on a 2-core AVX2
# Zen 3 when drafts were often verified. The float32 prefill kernel would
# not gather, but its sums would differ from the decode kernel's in the last
# bits, and a verified row should be the decode row it replaces. (The
# bfloat16 kernel takes them, as it did before the float32 one existed; its
# verified rows match decode rows to bfloat16 rounding, not bit for bit.)
SHORT_CHUNK_ROWS = 16


class TorchAttentionBackend(AttentionBackend):
    """Knobs, tuned on 2 CPU cores with SmolLM2 shapes (9 heads, 3 KV heads,
    head_dim 64): one more SDPA call costs about as much as ~60 more padded
    keys, hence `decode_pad_budget`; and a bucket's gathered K/V should stay
    in cache until its SDPA reads it (one big gather for the whole batch was
    slower than per-sequence calls), hence `decode_bucket_tokens`."""

    name = "torch"

    def __init__(self, decode_pad_budget: int = 64, decode_bucket_tokens: int = 2048,
                 decode_kernel: bool | None = None, prefill_kernel: bool | None = None):
        """`decode_kernel`, `prefill_kernel`: True requires that C++ kernel,
        False never uses it (the pure-torch twin), None uses it where it
        builds and covers the tensors."""
        self.decode_pad_budget = decode_pad_budget
        self.decode_bucket_tokens = decode_bucket_tokens
        self.decode_kernel = decode_kernel
        self.prefill_kernel = prefill_kernel
        self._plan: _StepPlan | None = None
        self._plan_meta: AttentionMetadata | None = None
        # (kind, dtype, device, query and cache shapes) -> kernel or None: decided once, not per layer.
        self._kernels: dict[tuple, object | None] = {}
        self._decode_parallel_positions = native.serial_below(cpu_decode.PARALLEL_POSITIONS_WHEN_THREADS_SLEEP)
        self._prefill_parallel_tiles = native.serial_below(cpu_prefill.PARALLEL_TILES_WHEN_THREADS_SLEEP)

    def load_decode_kernel(self) -> bool:
        """Builds the C++ decode kernel now rather than in the first decode
        step (the engine builder calls this on CPU); whether it is usable."""
        return self.decode_kernel is not False and self._load_kernel("decode") is not None

    def load_prefill_kernel(self) -> bool:
        """The same for the prefill kernel: whether this host can use it."""
        return self.prefill_kernel is not False and self._load_kernel("prefill") is not None

    def _kernel_setting(self, kind: str):
        """The module of the `kind` ("decode" or "prefill") kernel, and whether it is wanted."""
        return (cpu_decode, self.decode_kernel) if kind == "decode" else (cpu_prefill, self.prefill_kernel)

    def _load_kernel(self, kind: str):
        module, required = self._kernel_setting(kind)
        kernel = module.load_kernel()
        if kernel is None and required:
            raise RuntimeError(f"the CPU {kind} kernel could not be built or this CPU lacks it (see the log)")
        return kernel

    # ---- per step --------------------------------------------------------

    def prepare(self, meta: AttentionMetadata) -> None:
        decode_seqs: list[int] = []
        prefill_seqs: list[int] = []
        starts = [0, *itertools.accumulate(meta.query_lens_host)]
        for i, q_len in enumerate(meta.query_lens_host):
            if q_len == 1:
                decode_seqs.append(i)
            elif q_len > 1:
                prefill_seqs.append(i)
        device = meta.block_tables.device

        def as_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        self._plan = _StepPlan(
            decode_seqs=decode_seqs,
            decode_rows=as_tensor([starts[i] for i in decode_seqs]),
            decode_seq_ids=as_tensor(decode_seqs),
            decode_buckets=None,
            prefill_seqs=prefill_seqs,
            prefill_starts=as_tensor([starts[i] for i in prefill_seqs]),
            prefill_lens=as_tensor([meta.query_lens_host[i] for i in prefill_seqs]),
            prefill_seq_ids=as_tensor(prefill_seqs),
            prefill=None,
        )
        self._plan_meta = meta

    def _kernel_for(self, kind: str, query: torch.Tensor, k_cache: torch.Tensor):
        """The C++ `kind` kernel if these tensors should use it, else None."""
        key = (kind, query.dtype, k_cache.dtype, query.device, *query.shape[1:], *k_cache.shape[1:])
        if key not in self._kernels:
            self._kernels[key] = self._choose_kernel(kind, query, k_cache)
        return self._kernels[key]

    def _choose_kernel(self, kind: str, query: torch.Tensor, k_cache: torch.Tensor):
        module, wanted = self._kernel_setting(kind)
        if wanted is False:
            return None
        if not module.supports(query, k_cache):
            if wanted:
                raise ValueError(f"the CPU {kind} kernel does not support {query.dtype} on {query.device}")
            return None
        return self._load_kernel(kind)

    def _split_prefill(self, meta: AttentionMetadata, decode_kernel) -> _Chunks:
        """Given a `decode_kernel`, the chunks of up to SHORT_CHUNK_ROWS rows
        go to `plan.short` for it; the rest are returned (decided once a
        step, by the first layer)."""
        plan = self._plan
        if plan.long is None:
            starts = plan.prefill_starts.tolist()
            long_seqs, long_starts, rows, seqs, lens = [], [], [], [], []
            for i, start in zip(plan.prefill_seqs, starts, strict=True):
                q_len, seq_len = meta.query_lens_host[i], meta.seq_lens_host[i]
                if decode_kernel is not None and q_len <= SHORT_CHUNK_ROWS:
                    rows.extend(range(start, start + q_len))
                    seqs.extend([i] * q_len)
                    lens.extend(range(seq_len - q_len + 1, seq_len + 1))
                else:
                    long_seqs.append(i)
                    long_starts.append(start)
            device = meta.block_tables.device
            if rows:
                plan.short = _RowsAsDecode(
                    kernel=decode_kernel,
                    rows=torch.tensor(rows, dtype=torch.int64, device=device),
                    seq_ids=torch.arange(len(rows), dtype=torch.int64, device=device),
                    block_tables=meta.block_tables.index_select(0, torch.tensor(seqs, device=device)).contiguous(),
                    seq_lens=torch.tensor(lens, dtype=torch.int32, device=device))
            if len(long_seqs) == len(plan.prefill_seqs):
                plan.long = _Chunks(plan.prefill_seqs, plan.prefill_starts, plan.prefill_lens, plan.prefill_seq_ids)
            else:
                long_lens = [meta.query_lens_host[i] for i in long_seqs]
                plan.long = _Chunks(long_seqs, *(torch.tensor(v, dtype=torch.int64, device=device)
                                                 for v in (long_starts, long_lens, long_seqs)))
        return plan.long

    def _prefill_chunks(self, meta: AttentionMetadata, chunks: _Chunks) -> list[_PrefillChunk]:
        """The SDPA path's plan for `chunks`."""
        plan = self._plan
        if plan.prefill is None:
            block_tables = meta.block_tables.to(torch.int64)
            plan.prefill = [
                _plan_prefill(block_tables[i], start, meta.query_lens_host[i], meta.seq_lens_host[i], meta.block_size)
                for i, start in zip(chunks.seqs, chunks.starts.tolist(), strict=True)
            ]
        return plan.prefill

    def _decode_buckets(self, meta: AttentionMetadata) -> list[_DecodeBucket]:
        plan = self._plan
        if plan.decode_buckets is None:
            starts = [0, *itertools.accumulate(meta.query_lens_host)]
            plan.decode_buckets = self._plan_decode(plan.decode_seqs, starts, meta.seq_lens_host,
                                                    meta.block_tables.to(torch.int64), meta.block_size)
        return plan.decode_buckets

    def _plan_decode(self, seqs, starts, seq_lens, block_tables, bs) -> list[_DecodeBucket]:
        """Longest first; a bucket takes the next sequence while its padding
        stays within `decode_pad_budget` and its gathered K/V within
        `decode_bucket_tokens` (small enough to stay in cache for the SDPA)."""
        device = block_tables.device
        order = sorted(seqs, key=lambda i: -seq_lens[i])
        groups: list[list[int]] = []
        for i in order:
            if groups and self._fits(groups[-1], seq_lens[groups[-1][0]], seq_lens[i], bs):
                groups[-1].append(i)
            else:
                groups.append([i])
        buckets = []
        for group in groups:
            longest = seq_lens[group[0]]
            num_blocks = -(-longest // bs)
            idx = torch.tensor(group, device=device)
            rows = torch.tensor([starts[i] for i in group], device=device)
            blocks = block_tables.index_select(0, idx)[:, :num_blocks].reshape(-1)
            if all(seq_lens[i] == longest for i in group):
                buckets.append(_DecodeBucket(rows, blocks, num_blocks, longest, None))
                continue
            kv_len = num_blocks * bs
            lens = torch.tensor([seq_lens[i] for i in group], device=device)
            mask = torch.arange(kv_len, device=device)[None, :] < lens[:, None]
            mask = mask.view(len(group), 1, 1, kv_len)
            buckets.append(_DecodeBucket(rows, blocks, num_blocks, kv_len, mask))
        return buckets

    def _fits(self, group: list[int], longest: int, seq_len: int, bs: int) -> bool:
        padded = -(-longest // bs) * bs
        return (
            longest - seq_len <= self.decode_pad_budget
            and (len(group) + 1) * padded <= self.decode_bucket_tokens
        )

    # ---- per layer -------------------------------------------------------

    def forward(self, query, key, value, k_cache, v_cache, meta, scale):
        if self._plan is None or self._plan_meta is not meta:
            self.prepare(meta)
        plan = self._plan
        decode_kernel = self._kernel_for("decode", query, k_cache)
        if decode_kernel is None or not cpu_decode.write_kv(decode_kernel, key, value, k_cache, v_cache,
                                                            meta.slot_mapping):
            num_blocks, bs, num_kv_heads, head_dim = k_cache.shape
            k_flat = k_cache.view(num_blocks * bs, num_kv_heads, head_dim)
            v_flat = v_cache.view(num_blocks * bs, num_kv_heads, head_dim)
            k_flat.index_copy_(0, meta.slot_mapping, key.to(k_cache.dtype))
            v_flat.index_copy_(0, meta.slot_mapping, value.to(v_cache.dtype))

        out = torch.empty_like(query)
        if plan.decode_seqs:
            if decode_kernel is not None:
                cpu_decode.paged_decode_attention(
                    decode_kernel, out, query, k_cache, v_cache, plan.decode_rows, plan.decode_seq_ids,
                    meta.block_tables, meta.seq_lens, scale, self._decode_parallel_positions)
            else:
                self._decode_with_buckets(out, query, k_cache, v_cache, meta, scale)
        if plan.prefill_seqs:
            kernel = self._kernel_for("prefill", query, k_cache)
            if kernel is not None and query.dtype == torch.bfloat16:
                chunks = _Chunks(plan.prefill_seqs, plan.prefill_starts, plan.prefill_lens, plan.prefill_seq_ids)
            else:
                chunks = self._split_prefill(meta, decode_kernel)
                short = plan.short
                if short is not None:
                    cpu_decode.paged_decode_attention(
                        short.kernel, out, query, k_cache, v_cache, short.rows, short.seq_ids,
                        short.block_tables, short.seq_lens, scale, self._decode_parallel_positions)
            if chunks.seqs and kernel is not None:
                cpu_prefill.paged_prefill_attention(
                    kernel, out, query, k_cache, v_cache, chunks.starts, chunks.lens, chunks.seq_ids,
                    meta.block_tables, meta.seq_lens, scale, self._prefill_parallel_tiles)
            elif chunks.seqs:
                self._prefill(out, query, key, value, k_cache, v_cache, self._prefill_chunks(meta, chunks), scale)
        return out

    def _decode_with_buckets(self, out, query, k_cache, v_cache, meta, scale) -> None:
        """The torch twin of the decode kernel: gather, then one SDPA per bucket."""
        _, bs, num_kv_heads, head_dim = k_cache.shape
        num_heads = query.shape[1]
        for b in self._decode_buckets(meta):
            n = b.rows.shape[0]
            k = k_cache.index_select(0, b.blocks).view(n, b.num_blocks * bs, num_kv_heads, head_dim)
            v = v_cache.index_select(0, b.blocks).view(n, b.num_blocks * bs, num_kv_heads, head_dim)
            k, v = k[:, : b.kv_len].transpose(1, 2).to(query.dtype), v[:, : b.kv_len].transpose(1, 2).to(query.dtype)
            q = query.index_select(0, b.rows).view(n, num_heads, 1, head_dim)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=b.mask, scale=scale, enable_gqa=True)
            out.index_copy_(0, b.rows, o.view(n, num_heads, head_dim))

    @staticmethod
    def _prefill(out, query, key, value, k_cache, v_cache, chunks: list[_PrefillChunk], scale) -> None:
        _, bs, num_kv_heads, head_dim = k_cache.shape
        for c in chunks:
            end = c.start + c.query_len
            q = query[c.start : end].transpose(0, 1).unsqueeze(0)
            if c.blocks is None:
                # As the cache holds them, so that a prompt attends over the
                # same K/V whether its prefix was cached or not.
                k = _as_cached(key[c.start : end], k_cache.dtype).transpose(0, 1).unsqueeze(0)
                v = _as_cached(value[c.start : end], v_cache.dtype).transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            else:
                kv_len = c.blocks.shape[0] * bs
                k = k_cache.index_select(0, c.blocks).view(1, kv_len, num_kv_heads, head_dim).transpose(1, 2)
                v = v_cache.index_select(0, c.blocks).view(1, kv_len, num_kv_heads, head_dim).transpose(1, 2)
                k, v = k.to(q.dtype), v.to(q.dtype)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=c.mask, scale=scale, enable_gqa=True)
            out[c.start : end] = o[0].transpose(0, 1)


def _as_cached(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """`x` rounded as a cache of `cache_dtype` stores it, in x's dtype."""
    return x if x.dtype == cache_dtype else x.to(cache_dtype).to(x.dtype)


def _plan_prefill(block_row: torch.Tensor, start: int, q_len: int, seq_len: int, bs: int) -> _PrefillChunk:
    if q_len == seq_len:  # no cached prefix: attend over this step's own K/V
        return _PrefillChunk(start, q_len, seq_len, None, None)
    num_blocks = -(-seq_len // bs)
    kv_pos = torch.arange(num_blocks * bs, device=block_row.device)
    q_pos = torch.arange(seq_len - q_len, seq_len, device=block_row.device)
    mask = kv_pos[None, :] <= q_pos[:, None]  # also hides the padding past seq_len
    return _PrefillChunk(start, q_len, seq_len, block_row[:num_blocks], mask)
