// cpu_prefill.cpp's bfloat16 build, on AVX512-BF16: an item's scores and
// values by vdpbf16ps, as the scheme at the top of cpu_prefill.cpp says.
#pragma once

#include "cpu_prefill_items.h"

#include <immintrin.h>

namespace {

#if defined(__AVX512BF16__)

struct Scratch {  // per thread
  alignas(64) uint32_t qt[kMaxDim / 2][kLanes];  // [dim pair][query]: the queries' bfloat16 pairs
  alignas(64) uint32_t v2[kLanes / 2][kMaxDim];  // [key pair][dim]: two keys' values at a dim
  alignas(64) float ot[kMaxDim][kLanes];         // [dim][query]: the weighted values so far
  // Not zeroed (32 KB a thread a call): an item writes each part before it reads it.
  Scratch() {}
};

// The queries' dim pairs (lane j's query at q[j]), lanes past nq zero.
void load_queries(Scratch& sc, const c10::BFloat16* const* q, int64_t nq, int64_t dim) {
  std::memset(sc.qt, 0, sizeof(uint32_t) * (dim / 2) * kLanes);
  for (int64_t j = 0; j < nq; ++j) {
    const uint32_t* row = reinterpret_cast<const uint32_t*>(q[j]);
    for (int64_t p = 0; p < dim / 2; ++p) sc.qt[p][j] = row[p];
  }
}

// s[k] = the queries' dot products with key k of the tile.
template <int D>
inline void tile_scores(const Scratch& sc, const c10::BFloat16* k0, int64_t row_elems, __m512* s) {
  for (int k = 0; k < kLanes; ++k) s[k] = _mm512_setzero_ps();
  for (int p = 0; p < D / 2; ++p) {
    const __m512bh q = (__m512bh)_mm512_load_si512(sc.qt[p]);
    for (int k = 0; k < kLanes; ++k) {
      const int32_t kp = reinterpret_cast<const int32_t*>(k0 + k * row_elems)[p];
      s[k] = _mm512_dpbf16_ps(s[k], q, (__m512bh)_mm512_set1_epi32(kp));
    }
  }
}

// The tile's value rows as key pairs: v2[u][d] = (v[2u][d], v[2u + 1][d]);
// rows from nk on are zeros (they may be another sequence's stale values).
template <int D>
inline void pair_rows(Scratch& sc, const c10::BFloat16* v0, int64_t row_elems, int64_t nk) {
  // vpermt2w picks word i of a (key 2u) or 32 + i of b (key 2u + 1).
  alignas(64) static const uint16_t lo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                              8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t hi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                              24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i idx_lo = _mm512_load_si512(lo), idx_hi = _mm512_load_si512(hi);
  for (int u = 0; u < kLanes / 2; ++u) {
    for (int c = 0; c < D / 32; ++c) {
      const __m512i a = 2 * u < nk ? _mm512_loadu_si512(v0 + 2 * u * row_elems + 32 * c) : _mm512_setzero_si512();
      const __m512i b =
          2 * u + 1 < nk ? _mm512_loadu_si512(v0 + (2 * u + 1) * row_elems + 32 * c) : _mm512_setzero_si512();
      _mm512_store_si512(&sc.v2[u][32 * c], _mm512_permutex2var_epi16(a, idx_lo, b));
      _mm512_store_si512(&sc.v2[u][32 * c + 16], _mm512_permutex2var_epi16(a, idx_hi, b));
    }
  }
}

// ot[d] = ot[d] * alpha + sum_k p[k] * v[k][d], eight dims at a time so
// the eight accumulators' vdpbf16ps chains overlap.
template <int D>
inline void tile_values(Scratch& sc, const __m512* p, __m512 alpha) {
  alignas(64) static const uint16_t interleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i idx = _mm512_load_si512(interleave);
  __m512bh w[kLanes / 2];  // lane j: (p[2u][j], p[2u + 1][j]) in bfloat16
  for (int u = 0; u < kLanes / 2; ++u)
    w[u] = (__m512bh)_mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(p[2 * u + 1], p[2 * u]));
  for (int d0 = 0; d0 < D; d0 += 8) {
    __m512 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm512_mul_ps(_mm512_load_ps(sc.ot[d0 + i]), alpha);
    for (int u = 0; u < kLanes / 2; ++u)
      for (int i = 0; i < 8; ++i)
        acc[i] = _mm512_dpbf16_ps(acc[i], w[u], (__m512bh)_mm512_set1_epi32(sc.v2[u][d0 + i]));
    for (int i = 0; i < 8; ++i) _mm512_store_ps(sc.ot[d0 + i], acc[i]);
  }
}

struct Step {  // the call's tensors: queries and outputs [T, heads, D], caches [blocks, bs, kv heads, D]
  const c10::BFloat16 *query, *k_cache, *v_cache;
  c10::BFloat16* out;
  int64_t q_stride0, q_stride1, o_stride0, o_stride1;
  int64_t group;  // query heads per KV head
  float scale;
};

// The online softmax over one tile's scores s[k] (key key0 + k), lane by
// lane: keys past a lane's query position (qpos) are masked when the tile
// reaches past the block's first query. Raises the running max m, rescales
// the sum l, leaves the weights exp(s - m) in s and returns the factor
// that rescales the weighted values so far.
inline __m512 softmax_tile(__m512* s, int64_t key0, bool masked, __m512i qpos, float scale, __m512& m,
                           __m512& l, bool first) {
  __mmask16 ok[kLanes];
  __m512 tile_max = _mm512_set1_ps(kNegInf);
  for (int k = 0; k < kLanes; ++k) {
    ok[k] = masked ? _mm512_cmple_epi32_mask(_mm512_set1_epi32(static_cast<int32_t>(key0 + k)), qpos) : 0xFFFF;
    s[k] = _mm512_mask_blend_ps(ok[k], _mm512_set1_ps(kNegInf), _mm512_mul_ps(s[k], _mm512_set1_ps(scale)));
    tile_max = _mm512_max_ps(tile_max, s[k]);
  }
  // Tile 0 holds key 0, which every query sees, so m is finite from then on.
  const __m512 m_new = _mm512_max_ps(m, tile_max);
  __m512 alpha = _mm512_setzero_ps();
  if (!first) {
    f32x16 diff;
    const __m512 d = _mm512_sub_ps(m, m_new);
    std::memcpy(&diff, &d, sizeof diff);
    diff = exp16(diff);
    std::memcpy(&alpha, &diff, sizeof alpha);
  }
  l = _mm512_mul_ps(l, alpha);
  for (int k = 0; k < kLanes; ++k) {
    f32x16 x;
    const __m512 shifted = _mm512_sub_ps(s[k], m_new);
    std::memcpy(&x, &shifted, sizeof x);
    x = exp16(x);  // a masked -inf comes back as ~1e-38: zeroed here
    std::memcpy(&s[k], &x, sizeof s[k]);
    s[k] = _mm512_maskz_mov_ps(ok[k], s[k]);
    l = _mm512_add_ps(l, s[k]);
  }
  m = m_new;
  return alpha;
}

// One KV head's D values in each of a tile's 16 rows, into L2, kAheadTiles
// tiles before they are needed: 128 bytes of each 384-byte position row
// (SmolLM2) at blocks anywhere in the cache, a pattern the hardware
// prefetcher does not follow. Without it, a step's attention for a chunk of
// 2 to 8 rows over 600 positions took 2.9-4.5 ms in two runs, with it
// 2.3-3.4 (30 layers, 2-core Zen 4, benchmarks/prefill_attention.py).
constexpr int64_t kAheadTiles = 2;
template <int D>
inline void prefetch_tile(const c10::BFloat16* row0, int64_t row_elems) {
  for (int k = 0; k < kLanes; ++k) prefetch_l2(row0 + k * row_elems, D * sizeof(c10::BFloat16));
}

template <int D>
void run_item(const Item& it, const Chunks& ch, const Step& st, Scratch& sc) {
  const int64_t len = ch.lens[it.chunk], s = ch.seq_ids[it.chunk];
  const int64_t seq_len = ch.seq_lens[s], nq = it.lanes ? it.lanes : std::min<int64_t>(kLanes, len - it.first);
  // Lane j's query: its row in the chunk and its query head.
  int64_t row[kLanes], head[kLanes];
  for (int64_t j = 0; j < nq; ++j) {
    row[j] = it.lanes ? (it.first + j) / st.group : it.first + j;
    head[j] = it.lanes ? it.head * st.group + (it.first + j) % st.group : it.head;
  }
  const int64_t ctx = seq_len - len, pos0 = ctx + row[0], last = ctx + row[nq - 1];  // the first and last query
  const int64_t start = ch.starts[it.chunk];
  const c10::BFloat16* q[kLanes];
  for (int64_t j = 0; j < nq; ++j) q[j] = st.query + (start + row[j]) * st.q_stride0 + head[j] * st.q_stride1;
  load_queries(sc, q, nq, D);
  std::memset(sc.ot, 0, sizeof(float) * D * kLanes);

  const int64_t row_elems = ch.num_kv_heads * D, kv_off = (it.lanes ? it.head : it.head / st.group) * D;
  const int32_t* table = ch.block_tables + s * ch.table_stride;
  alignas(64) int32_t lanes[kLanes];  // past nq, the last query again, so no lane is all masked
  for (int64_t j = 0; j < kLanes; ++j) lanes[j] = static_cast<int32_t>(j < nq ? ctx + row[j] : last);
  const __m512i qpos = _mm512_load_si512(lanes);
  __m512 m = _mm512_set1_ps(kNegInf), l = _mm512_setzero_ps(), p[kLanes];
  for (int64_t t = 0; t < it.tiles; ++t) {
    const int64_t key0 = t * kLanes;
    const int64_t slot = ch.slot(table, key0);
    if (t + kAheadTiles < it.tiles) {
      const int64_t next = ch.slot(table, key0 + kAheadTiles * kLanes);
      prefetch_tile<D>(st.k_cache + next * row_elems + kv_off, row_elems);
      prefetch_tile<D>(st.v_cache + next * row_elems + kv_off, row_elems);
    }
    tile_scores<D>(sc, st.k_cache + slot * row_elems + kv_off, row_elems, p);
    const __m512 alpha = softmax_tile(p, key0, key0 + kLanes - 1 > pos0, qpos, st.scale, m, l, t == 0);
    pair_rows<D>(sc, st.v_cache + slot * row_elems + kv_off, row_elems, std::min<int64_t>(kLanes, last + 1 - key0));
    tile_values<D>(sc, p, alpha);
  }
  alignas(64) float inv_l[kLanes];
  _mm512_store_ps(inv_l, _mm512_div_ps(_mm512_set1_ps(1.f), l));
  for (int64_t j = 0; j < nq; ++j) {
    c10::BFloat16* o = st.out + (start + row[j]) * st.o_stride0 + head[j] * st.o_stride1;
    for (int d = 0; d < D; ++d) o[d] = static_cast<c10::BFloat16>(sc.ot[d][j] * inv_l[j]);
  }
}

template <int D>
void attention_impl(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& k_cache,
                    const torch::Tensor& v_cache, const Chunks& ch, int64_t n, float scale, bool serial) {
  const int64_t num_heads = query.size(1), group = num_heads / ch.num_kv_heads;
  const Step st{reinterpret_cast<const c10::BFloat16*>(query.data_ptr()),
                reinterpret_cast<const c10::BFloat16*>(k_cache.data_ptr()),
                reinterpret_cast<const c10::BFloat16*>(v_cache.data_ptr()),
                reinterpret_cast<c10::BFloat16*>(out.data_ptr()),
                query.stride(0), query.stride(1), out.stride(0), out.stride(1), group, scale};
  run_items(make_items(ch, n, num_heads, group), serial, [] { return Scratch{}; },
            [&](const Item& it, Scratch& sc) { run_item<D>(it, ch, st, sc); });
}

#endif  // __AVX512BF16__

}  // namespace
