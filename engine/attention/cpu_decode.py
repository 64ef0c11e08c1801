"""Paged decode attention on the CPU: a small C++ kernel, compiled on first use.

Decode rows (query_len 1) dominate attention time in a busy CPU engine: each
reads its whole context's K and V, and in plain torch that means gathering
the blocks into padded buckets, then running SDPA with a query of one row,
where GEMM-shaped kernels run at a few GB/s. This kernel reads the blocks in
place, through the block table, once per step and layer:

  scores  [n, num_heads, width]  scale * q . k for every context position,
          -inf past the sequence's length (C++, one thread per sequence);
  probs   softmax over the last dim (torch's vectorized softmax);
  out     sum_j probs[j] * v_j, written to the query's token rows (C++).

Numerics: float32 accumulation throughout (bfloat16 K/V are widened on
load); results match SDPA to float32 rounding, not bit for bit.

The torch twin is `TorchAttentionBackend`'s bucketed SDPA path, which the
backend falls back to where this kernel cannot be built (no C++ compiler) or
is turned off (LORAGW_CPU_DECODE_KERNEL=0). How it is built and cached:
engine/native.py.
"""

from __future__ import annotations

import torch

import native

ENV_SWITCH = "LORAGW_CPU_DECODE_KERNEL"
_DTYPES = (torch.float32, torch.bfloat16)
# Where idle threads sleep (engine/native.py), a call over fewer context
# positions than this stays on one thread: on 2 cores under
# OMP_WAIT_POLICY=PASSIVE, 4 sequences of 450 positions took 138 us on one
# thread and 271 us on two, 16 took 591 and 692, 48 took 4.7 ms and 2.4 ms.
PARALLEL_POSITIONS_WHEN_THREADS_SLEEP = 8192

_SOURCE = native.VECTOR_HELPERS + r"""
#include <cmath>
#include <limits>

namespace {

constexpr int kMaxChunks = 16;  // head_dim <= 256
constexpr int kMaxGroup = 16;   // query heads per KV head
constexpr int64_t kPrefetch = 2 * kLanes;  // positions ahead to prefetch

struct Seqs {  // the decode sequences of a step and where their context lives
  const int64_t* rows;     // [n] token row of each sequence in the flat batch
  const int64_t* seq_ids;  // [n] its row in block_tables / seq_lens
  const int32_t* block_tables;
  int64_t table_stride;
  const int32_t* seq_lens;
  int64_t block_size, num_kv_heads, head_dim;

  // The K or V rows (all KV heads) of positions j0 .. j0 + count of sequence
  // s: one block lookup per block, no division per row.
  template <typename T>
  void rows_at(const T* cache, int64_t s, int64_t j0, int64_t count, const T** rows) const {
    const int64_t row_elems = num_kv_heads * head_dim;
    const int32_t* table = block_tables + s * table_stride;
    int64_t b = j0 / block_size, off = j0 % block_size;
    const T* base = cache + table[b] * block_size * row_elems;
    for (int64_t t = 0; t < count; ++t) {
      rows[t] = base + off * row_elems;
      if (++off == block_size && t + 1 < count) {
        off = 0;
        base = cache + table[++b] * block_size * row_elems;
      }
    }
  }

  // The rows of the chunk of (at most kLanes) positions from j0 of a
  // sequence of `len`; returns how many. Also asks for the rows kPrefetch
  // positions ahead: blocks sit anywhere in the cache, so the hardware
  // prefetcher cannot guess them.
  template <typename T>
  int64_t chunk(const T* cache, int64_t s, int64_t j0, int64_t len, const T** rows) const {
    const int64_t count = std::min<int64_t>(kLanes, len - j0);
    rows_at(cache, s, j0, count, rows);
    if (j0 + kPrefetch < len) {
      const T* ahead[kLanes];
      const int64_t n_ahead = std::min<int64_t>(kLanes, len - j0 - kPrefetch);
      rows_at(cache, s, j0 + kPrefetch, n_ahead, ahead);
      const int64_t row_bytes = num_kv_heads * head_dim * sizeof(T);
      for (int64_t t = 0; t < n_ahead; ++t) {
        const char* row = reinterpret_cast<const char*>(ahead[t]);
        for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(row + b);
      }
    }
    return count;
  }
};

// Both kernels walk a sequence's context in chunks of 16 positions and do
// every head's work on a chunk before the next one: each K/V byte comes from
// memory once, and the chunk (16 rows) stays in L1 across the heads.

template <typename T>
void scores_impl(float* scores, int64_t width, const T* query, int64_t q_stride0, int64_t q_stride1,
                 const T* k_cache, const Seqs& seqs, int64_t n, int64_t num_heads, float scale, bool serial) {
  const int64_t group = num_heads / seqs.num_kv_heads, chunks = seqs.head_dim / kLanes;
  at::parallel_for(0, n, serial ? n : 1, [&](int64_t begin, int64_t end) {
    f32x16 q[kMaxGroup * kMaxChunks], part[kLanes];
    const T* rows[kLanes];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = seqs.seq_ids[i], len = seqs.seq_lens[s];
      float* out = scores + i * num_heads * width;
      for (int64_t j0 = 0; j0 < len; j0 += kLanes) {
        const int64_t count = seqs.chunk(k_cache, s, j0, len, rows);
        for (int64_t t = count; t < kLanes; ++t) part[t] = f32x16{};
        for (int64_t kv = 0; kv < seqs.num_kv_heads; ++kv) {
          for (int64_t g = 0; g < group; ++g) {
            const int64_t h = kv * group + g;
            const T* qp = query + seqs.rows[i] * q_stride0 + h * q_stride1;
            f32x16* qh = q + g * chunks;
            for (int64_t c = 0; c < chunks; ++c) qh[c] = load16(qp + c * kLanes) * scale;
            for (int64_t t = 0; t < count; ++t) {
              const T* kp = rows[t] + kv * seqs.head_dim;
              f32x16 acc = qh[0] * load16(kp);
              for (int64_t c = 1; c < chunks; ++c) acc += qh[c] * load16(kp + c * kLanes);
              part[t] = acc;
            }
            f32x16 sums = sum_each(part);
            float lanes[kLanes];
            std::memcpy(lanes, &sums, sizeof lanes);
            std::memcpy(out + h * width + j0, lanes, count * sizeof(float));
          }
        }
      }
      for (int64_t h = 0; h < num_heads; ++h)
        for (int64_t j = len; j < width; ++j) out[h * width + j] = -std::numeric_limits<float>::infinity();
    }
  });
}

template <typename T>
void values_impl(T* out, int64_t o_stride0, int64_t o_stride1, const float* probs, int64_t width,
                 const T* v_cache, const Seqs& seqs, int64_t n, int64_t num_heads, bool serial) {
  const int64_t group = num_heads / seqs.num_kv_heads, chunks = seqs.head_dim / kLanes;
  const int64_t per_kv = group * chunks;
  at::parallel_for(0, n, serial ? n : 1, [&](int64_t begin, int64_t end) {
    std::vector<f32x16> acc_all(seqs.num_kv_heads * per_kv);
    const T* rows[kLanes];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = seqs.seq_ids[i], len = seqs.seq_lens[s];
      const float* p = probs + i * num_heads * width;
      std::fill(acc_all.begin(), acc_all.end(), f32x16{});
      for (int64_t j0 = 0; j0 < len; j0 += kLanes) {
        const int64_t count = seqs.chunk(v_cache, s, j0, len, rows);
        for (int64_t kv = 0; kv < seqs.num_kv_heads; ++kv) {
          f32x16 acc[kMaxGroup * kMaxChunks];
          std::memcpy(acc, &acc_all[kv * per_kv], per_kv * sizeof(f32x16));
          const float* pk = p + kv * group * width + j0;
          for (int64_t t = 0; t < count; ++t) {
            const T* vp = rows[t] + kv * seqs.head_dim;
            for (int64_t c = 0; c < chunks; ++c) {
              const f32x16 v = load16(vp + c * kLanes);
              for (int64_t g = 0; g < group; ++g) acc[g * chunks + c] += pk[g * width + t] * v;
            }
          }
          std::memcpy(&acc_all[kv * per_kv], acc, per_kv * sizeof(f32x16));
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        T* op = out + seqs.rows[i] * o_stride0 + h * o_stride1;
        const f32x16* ah = &acc_all[h * chunks];  // kv * per_kv + g * chunks == h * chunks
        for (int64_t c = 0; c < chunks; ++c) {
          float lanes[kLanes];
          std::memcpy(lanes, &ah[c], sizeof lanes);
          for (int x = 0; x < kLanes; ++x) op[c * kLanes + x] = static_cast<T>(lanes[x]);
        }
      }
    }
  });
}

Seqs make_seqs(const torch::Tensor& cache, const torch::Tensor& rows, const torch::Tensor& seq_ids,
               const torch::Tensor& block_tables, const torch::Tensor& seq_lens) {
  return Seqs{rows.data_ptr<int64_t>(), seq_ids.data_ptr<int64_t>(), block_tables.data_ptr<int32_t>(),
              block_tables.stride(0), seq_lens.data_ptr<int32_t>(), cache.size(1), cache.size(2), cache.size(3)};
}

// Whether the n sequences hold fewer than `parallel_positions` context
// positions in all, so the call stays on the calling thread.
bool few_positions(const Seqs& seqs, int64_t n, int64_t parallel_positions) {
  int64_t total = 0;
  for (int64_t i = 0; i < n && total < parallel_positions; ++i) total += seqs.seq_lens[seqs.seq_ids[i]];
  return total < parallel_positions;
}

}  // namespace

void decode_scores(torch::Tensor scores, torch::Tensor query, torch::Tensor k_cache, torch::Tensor rows,
                   torch::Tensor seq_ids, torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                   int64_t parallel_positions) {
  const Seqs seqs = make_seqs(k_cache, rows, seq_ids, block_tables, seq_lens);
  const int64_t n = rows.size(0), num_heads = query.size(1), width = scores.size(2);
  const bool serial = few_positions(seqs, n, parallel_positions);
  if (query.scalar_type() == at::kFloat) {
    scores_impl<float>(scores.data_ptr<float>(), width, query.data_ptr<float>(), query.stride(0),
                       query.stride(1), k_cache.data_ptr<float>(), seqs, n, num_heads, (float)scale, serial);
  } else {
    scores_impl<c10::BFloat16>(scores.data_ptr<float>(), width, query.data_ptr<c10::BFloat16>(),
                               query.stride(0), query.stride(1), k_cache.data_ptr<c10::BFloat16>(),
                               seqs, n, num_heads, (float)scale, serial);
  }
}

void decode_values(torch::Tensor out, torch::Tensor probs, torch::Tensor v_cache, torch::Tensor rows,
                   torch::Tensor seq_ids, torch::Tensor block_tables, torch::Tensor seq_lens,
                   int64_t parallel_positions) {
  const Seqs seqs = make_seqs(v_cache, rows, seq_ids, block_tables, seq_lens);
  const int64_t n = rows.size(0), num_heads = out.size(1), width = probs.size(2);
  const bool serial = few_positions(seqs, n, parallel_positions);
  if (out.scalar_type() == at::kFloat) {
    values_impl<float>(out.data_ptr<float>(), out.stride(0), out.stride(1), probs.data_ptr<float>(), width,
                       v_cache.data_ptr<float>(), seqs, n, num_heads, serial);
  } else {
    values_impl<c10::BFloat16>(out.data_ptr<c10::BFloat16>(), out.stride(0), out.stride(1),
                               probs.data_ptr<float>(), width, v_cache.data_ptr<c10::BFloat16>(), seqs, n,
                               num_heads, serial);
  }
}
"""

_KERNEL = native.Kernel("loragw_cpu_decode", _SOURCE, ["decode_scores", "decode_values"],
                        "CPU decode attention kernel", ENV_SWITCH)
load_kernel = _KERNEL.load


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel handles these tensors (it is built lazily on the first True)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    return (
        query.device.type == "cpu"
        and query.dtype in _DTYPES
        and k_cache.dtype == query.dtype
        and head_dim % 16 == 0
        and head_dim <= 256
        and num_heads % k_cache.shape[2] == 0
        and num_heads // k_cache.shape[2] <= 16
    )


def paged_decode_attention(
    kernel,
    out: torch.Tensor,  # [T, num_heads, head_dim]: rows `rows` are written
    query: torch.Tensor,  # [T, num_heads, head_dim], last dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,  # same
    rows: torch.Tensor,  # [n] int64: the token row of each decode sequence
    seq_ids: torch.Tensor,  # [n] int64: its row in block_tables and seq_lens
    block_tables: torch.Tensor,  # [B, max_blocks] int32, rows contiguous
    seq_lens: torch.Tensor,  # [B] int32, context length including the new token
    width: int,  # >= the longest seq_len among the n sequences
    scale: float,
    parallel_positions: int,  # native.serial_below(PARALLEL_POSITIONS_WHEN_THREADS_SLEEP)
) -> None:
    """Attention of each decode row over its whole context, into `out`.
    Sequences of fewer than `parallel_positions` positions in all are done
    on the calling thread."""
    assert query.dtype == k_cache.dtype == v_cache.dtype == out.dtype and query.dtype in _DTYPES
    assert query.stride(-1) == 1 and out.stride(-1) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    assert rows.dtype == seq_ids.dtype == torch.int64 and rows.shape == seq_ids.shape
    assert block_tables.dtype == seq_lens.dtype == torch.int32 and block_tables.stride(1) == 1
    assert supports(query, k_cache)
    n = rows.shape[0]
    scores = torch.empty(n, query.shape[1], width, dtype=torch.float32)
    kernel.decode_scores(scores, query, k_cache, rows, seq_ids, block_tables, seq_lens, scale, parallel_positions)
    probs = torch.softmax(scores, dim=-1)
    kernel.decode_values(out, probs, v_cache, rows, seq_ids, block_tables, seq_lens, parallel_positions)
