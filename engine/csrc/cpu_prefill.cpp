// Paged causal attention for prefill chunks: each chunk's queries over its
// context, read through the block table, in one pass per block of queries
// (an online softmax, as in flash attention). Two builds of one scheme:
// bfloat16 on AVX512-BF16, and float32 (over a float32 or float16 cache)
// on x86 hosts with AVX2 or AVX-512, at the host's own vector width.
//
// Why not torch's SDPA: its CPU flash kernel runs bfloat16 at about the
// speed of float32 here (65 to 110 GFLOP/s on two Zen 5 cores, measured by
// benchmarks/prefill_attention.py), its float32 causal path reached 7 to 59
// GFLOP/s on two Zen 3 cores, where float32 GEMM reaches ~120-160, and a
// chunk after a sequence's first needs its K/V gathered from the blocks and
// a mask that makes it compute the whole rectangle.
//
// Lane j of every vector is query j (a query row under one head), so the
// softmax (max, rescale, sum) is lane by lane and never reduces across a
// vector. Keys go 16 (a tile) at a time; keys past a query's position are
// masked, and tiles past the block's last query are never read. Threads
// take items costliest first from a shared counter.
//
// bfloat16: items of 16 query positions of one query head, or, for a chunk
// of fewer than 16 rows, 16 of its (row, query head) pairs of one KV head.
// - scores: per key, vdpbf16ps of the queries' dim pairs (transposed once
//   per item) with the key's dim pair broadcast straight from the cache row;
// - values: per output dim, vdpbf16ps of the weights of two keys (rounded
//   to bfloat16, as torch's bfloat16 attention rounds them) with those keys'
//   values at that dim broadcast as a pair; the outputs live transposed
//   (dim, query) and are transposed back once at the end.
//
// float32: items of 16 query positions of every query head of one KV head,
// so that a tile's K and V rows are widened (a float16 cache) or copied
// once into a scratch tile for the whole group. Scores and values are
// outer products, a few keys (or output dims) by the 16 queries at a time
// in registers: per dim, the queries' vectors times one key's value at
// that dim, broadcast.
#include <immintrin.h>

#include <atomic>
#include <limits>
#include <type_traits>
#include <vector>

#include "vector_helpers.h"

namespace {

constexpr int kMaxDim = 256;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Chunks {  // the prefill chunks of a step and where their context lives
  const int64_t* starts;   // [n] first token row of each chunk in the flat batch
  const int64_t* lens;     // [n] its query length
  const int64_t* seq_ids;  // [n] its row in block_tables / seq_lens
  const int32_t* block_tables;
  int64_t table_stride;
  const int32_t* seq_lens;
  int64_t block_size, num_kv_heads, head_dim;

  // The cache slot of position `pos` of the sequence whose block table is `table`.
  int64_t slot(const int32_t* table, int64_t pos) const {
    return static_cast<int64_t>(table[pos / block_size]) * block_size + pos % block_size;
  }
};

struct Item {
  int64_t chunk, head, first;  // queries first .. first + 16 of the chunk (fewer at its end)
  int64_t tiles;               // key tiles it reads: its cost
  // Where nonzero, a short chunk's lanes instead (make_items with a group):
  // `lanes` of its (row, query head of KV head `head`) pairs, row by row,
  // from pair `first`.
  int64_t lanes = 0;
};

// The items of the n chunks: each 16 query positions of a chunk with each
// of `heads` heads (query heads in bfloat16, KV heads in float32),
// costliest first, so that the last items the threads take are short.
//
// With `group` > 1 (bfloat16: query heads per KV head), a chunk of fewer
// than 16 rows (a speculating sequence's verification, a prompt's tail past
// a cached prefix) fills each item's lanes with its rows under every query
// head of one KV head instead, row by row, so the group's heads share each
// K/V tile they read. One item per query head left most lanes empty: a
// chunk of 2 rows used 2 of 16, and a SmolLM2 layer's 9 items made a
// verification's attention cost 3 to 4 times a decode row's (single-stream
// decode with drafts, 2-core Zen 4). A lane's sums do not depend on the
// lanes beside it, and a tile that an item reads past a lane's last key is
// masked for that lane, which leaves its state bit for bit as it was (zero
// weights, and exp(0) is exactly 1), so each row comes out as it would in
// any chunk.
std::vector<Item> make_items(const Chunks& ch, int64_t n, int64_t heads, int64_t group = 1) {
  std::vector<Item> items;
  for (int64_t c = 0; c < n; ++c) {
    const int64_t len = ch.lens[c], ctx = ch.seq_lens[ch.seq_ids[c]] - len;
    if (group > 1 && len < kLanes) {
      for (int64_t first = 0; first < len * group; first += kLanes) {
        const int64_t lanes = std::min<int64_t>(kLanes, len * group - first);
        const int64_t last = ctx + (first + lanes - 1) / group;
        for (int64_t kv = 0; kv < heads / group; ++kv) items.push_back({c, kv, first, last / kLanes + 1, lanes});
      }
      continue;
    }
    for (int64_t first = 0; first < len; first += kLanes) {
      const int64_t last = ctx + std::min(len, first + kLanes) - 1;
      for (int64_t h = 0; h < heads; ++h) items.push_back({c, h, first, last / kLanes + 1});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.tiles > b.tiles; });
  return items;
}

// run(item, scratch) for every item: the threads take them in order from a
// shared counter, each with its own scratch (make_scratch()); all on this
// thread when `serial`.
template <typename MakeScratch, typename Run>
void run_items(const std::vector<Item>& items, bool serial, MakeScratch make_scratch, Run run) {
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  auto worker = [&](int64_t, int64_t) {
    auto sc = make_scratch();
    for (int64_t w; (w = next.fetch_add(1)) < num_items;) run(items[w], sc);
  };
  if (serial || num_items == 1) {
    worker(0, 1);
  } else {
    at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_items), 1, worker);
  }
}

// f(std::integral_constant<int, D>{}) for the head dim D, where it has a build.
template <typename F>
void with_head_dim(int64_t head_dim, F f) {
  switch (head_dim) {
    case 64: f(std::integral_constant<int, 64>{}); break;
    case 128: f(std::integral_constant<int, 128>{}); break;
    case 32: f(std::integral_constant<int, 32>{}); break;
    case 96: f(std::integral_constant<int, 96>{}); break;
    case 256: f(std::integral_constant<int, 256>{}); break;
    default: TORCH_CHECK(false, "prefill_attention: head_dim ", head_dim, " has no build");
  }
}

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

// ---- float32 ---------------------------------------------------------------

// Lanes per vector: 8 on AVX2 (GCC keeps a 16-lane vector, which AVX2 has
// no register for, in memory), else 16.
#if defined(__AVX512F__)
constexpr int kF = 16;
#else
constexpr int kF = 8;
#endif
typedef Lanes<kF>::f32 fv;
typedef int32_t iv __attribute__((vector_size(kF * 4)));
constexpr int kQV = kLanes / kF;  // vectors of 16 queries
// Keys (scores) or output dims (values) per pass: with the 16 queries'
// vectors, 8 accumulators in registers, and the queries' (or weights')
// vectors and a broadcast beside them, within AVX2's 16 registers.
constexpr int kKP = 8 / kQV;

struct Scratch32 {  // per thread
  int64_t group;
  std::vector<float> qt;  // [group][dim][16]: the queries, transposed
  std::vector<float> ot;  // [group][dim][16]: the weighted values so far, transposed
  std::vector<fv> m, l;   // [group][kQV]: running max and sum, lane by lane
  alignas(64) float kw[kLanes][kMaxDim];  // the tile's K rows of this KV head, as float32
  alignas(64) float vw[kLanes][kMaxDim];  // ... and V rows; rows past the last visible key zero
  alignas(64) float s[kLanes][kLanes];    // [key][query]: scores, then weights
  alignas(64) float rows[kLanes][kMaxDim];  // the queries, or the outputs, a row each
  // The tiles start zeroed: a K row past a tile's visible keys is never
  // widened, and its scores, masked, should not come from indeterminate
  // (perhaps denormal, so slow) scratch.
  Scratch32(int64_t group, int64_t dim)
      : group(group), qt(group * dim * kLanes), ot(group * dim * kLanes), m(group * kQV), l(group * kQV) {
    std::memset(kw, 0, sizeof kw);
    std::memset(vw, 0, sizeof vw);
    std::memset(s, 0, sizeof s);
    std::memset(rows, 0, sizeof rows);
  }
};

inline fv load_fv(const float* p) { return load_lanes<kF>(p); }

// x, held in a register: GCC would otherwise fold its load into each
// multiply-add that uses it, one load per multiply-add, and with a
// broadcast load per key (or dim) besides, the loads rather than the
// multiply-adds set the pace (a 2-core Zen 3 ran the loops at two thirds of
// its float32 rate).
inline fv pinned(fv x) {
#if defined(__AVX__)
  asm("" : "+v"(x));
#endif
  return x;
}
inline void store_fv(float* p, fv v) { store_lanes<kF>(p, v); }

// dst[c * dst_stride + r] = src[r * src_stride + c] for an 8 x 8 block: the
// queries into their transposed layout and the outputs back. Lane by lane
// in scalar code, these two cost a fifth as many instructions as an item's
// multiply-adds over ~8 key tiles.
inline void transpose8(const float* src, int64_t src_stride, float* dst, int64_t dst_stride) {
#if defined(__AVX__)
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * src_stride);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * dst_stride, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * dst_stride, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
#else
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 8; ++j) dst[j * dst_stride + i] = src[i * src_stride + j];
#endif
}

// count rows of a tile into dst as float32 (the rest of dst zero when `zero_rest`).
template <int D, typename KV>
inline void widen_rows(float (*dst)[kMaxDim], const KV* src, int64_t row_elems, int64_t count, bool zero_rest) {
  for (int64_t k = 0; k < count; ++k)
    for (int c = 0; c < D; c += kF) store_fv(dst[k] + c, load_lanes<kF>(src + k * row_elems + c));
  if (zero_rest)
    for (int64_t k = count; k < kLanes; ++k) std::memset(dst[k], 0, sizeof(float) * D);
}

// s[k][j] = q_j . k_k for the tile's 16 keys and the 16 queries of head g.
template <int D>
inline void scores32(Scratch32& sc, int64_t g) {
  const float* qt = &sc.qt[g * D * kLanes];
  for (int k0 = 0; k0 < kLanes; k0 += kKP) {
    fv acc[kKP][kQV] = {};
    for (int p = 0; p < D; ++p) {
      fv q[kQV];
      for (int v = 0; v < kQV; ++v) q[v] = pinned(load_fv(qt + p * kLanes + v * kF));
      // A scalar operand broadcasts (vbroadcastss); `fv{} + x` would add the
      // zero first (it is not x when x is -0).
      for (int k = 0; k < kKP; ++k) {
        const float b = sc.kw[k0 + k][p];
        for (int v = 0; v < kQV; ++v) acc[k][v] += q[v] * b;
      }
    }
    for (int k = 0; k < kKP; ++k)
      for (int v = 0; v < kQV; ++v) store_fv(sc.s[k0 + k] + v * kF, acc[k][v]);
  }
}

// ot[d][j] = ot[d][j] * alpha[j] + sum_k s[k][j] * v_k[d] for head g.
template <int D>
inline void values32(Scratch32& sc, int64_t g, const fv* alpha) {
  float* ot = &sc.ot[g * D * kLanes];
  for (int d0 = 0; d0 < D; d0 += kKP) {
    fv acc[kKP][kQV];
    for (int i = 0; i < kKP; ++i)
      for (int v = 0; v < kQV; ++v) acc[i][v] = load_fv(ot + (d0 + i) * kLanes + v * kF) * alpha[v];
    for (int k = 0; k < kLanes; ++k) {
      fv w[kQV];
      for (int v = 0; v < kQV; ++v) w[v] = pinned(load_fv(sc.s[k] + v * kF));
      for (int i = 0; i < kKP; ++i) {
        const float b = sc.vw[k][d0 + i];
        for (int v = 0; v < kQV; ++v) acc[i][v] += w[v] * b;
      }
    }
    for (int i = 0; i < kKP; ++i)
      for (int v = 0; v < kQV; ++v) store_fv(ot + (d0 + i) * kLanes + v * kF, acc[i][v]);
  }
}

// The online softmax over head g's scores of the tile (keys key0 ..), lane
// by lane, as softmax_tile above: leaves the weights in s and sets alpha,
// the factor that rescales the weighted values so far.
inline void softmax32(Scratch32& sc, int64_t g, int64_t key0, bool masked, const iv* qpos, float scale, bool first,
                      fv* alpha) {
  for (int v = 0; v < kQV; ++v) {
    fv& m = sc.m[g * kQV + v];
    fv& l = sc.l[g * kQV + v];
    fv s[kLanes];
    iv ok[kLanes];
    fv tile_max = fv{} + kNegInf;
    for (int k = 0; k < kLanes; ++k) {
      ok[k] = masked ? (iv{} + static_cast<int32_t>(key0 + k)) <= qpos[v] : iv{} - 1;
      s[k] = ok[k] ? load_fv(sc.s[k] + v * kF) * scale : fv{} + kNegInf;
      tile_max = tile_max > s[k] ? tile_max : s[k];
    }
    // Tile 0 holds key 0, which every query sees, so m is finite from then on.
    const fv m_new = m > tile_max ? m : tile_max;
    alpha[v] = first ? fv{} : exp_lanes<fv, iv>(m - m_new);
    l *= alpha[v];
    for (int k = 0; k < kLanes; ++k) {
      const fv p = ok[k] ? exp_lanes<fv, iv>(s[k] - m_new) : fv{};  // a masked -inf must weigh exactly 0
      store_fv(sc.s[k] + v * kF, p);
      l += p;
    }
    m = m_new;
  }
}

template <typename KV>
struct Step32 {  // the call's tensors: queries and outputs [T, heads, D], caches [blocks, bs, kv heads, D]
  const float* query;
  const KV *k_cache, *v_cache;
  float* out;
  int64_t q_stride0, q_stride1, o_stride0, o_stride1;
  int64_t group;  // query heads per KV head
  float scale;
};

// One item: queries first .. first + 16 of a chunk, every query head of KV head it.head.
template <int D, typename KV>
void run_item32(const Item& it, const Chunks& ch, const Step32<KV>& st, Scratch32& sc) {
  const int64_t len = ch.lens[it.chunk], s = ch.seq_ids[it.chunk];
  const int64_t seq_len = ch.seq_lens[s], nq = std::min<int64_t>(kLanes, len - it.first);
  const int64_t pos0 = seq_len - len + it.first, last = pos0 + nq - 1;  // positions of the first and last query
  const int64_t row0 = ch.starts[it.chunk] + it.first, group = st.group;
  std::fill(sc.ot.begin(), sc.ot.begin() + group * D * kLanes, 0.f);
  for (int64_t j = nq; j < kLanes; ++j) std::memset(sc.rows[j], 0, sizeof(float) * D);
  for (int64_t g = 0; g < group; ++g) {
    const int64_t h = it.head * group + g;
    for (int64_t j = 0; j < nq; ++j)
      std::memcpy(sc.rows[j], st.query + (row0 + j) * st.q_stride0 + h * st.q_stride1, sizeof(float) * D);
    float* qt = &sc.qt[g * D * kLanes];
    for (int j0 = 0; j0 < kLanes; j0 += 8)
      for (int p0 = 0; p0 < D; p0 += 8) transpose8(&sc.rows[j0][p0], kMaxDim, qt + p0 * kLanes + j0, kLanes);
    for (int v = 0; v < kQV; ++v) {
      sc.m[g * kQV + v] = fv{} + kNegInf;
      sc.l[g * kQV + v] = fv{};
    }
  }
  const int64_t row_elems = ch.num_kv_heads * D, kv_off = it.head * D;
  const int32_t* table = ch.block_tables + s * ch.table_stride;
  iv qpos[kQV];  // past nq, the last query again, so no lane is all masked
  for (int v = 0; v < kQV; ++v)
    for (int j = 0; j < kF; ++j) qpos[v][j] = static_cast<int32_t>(std::min(pos0 + v * kF + j, last));
  fv alpha[kQV];
  for (int64_t t = 0; t < it.tiles; ++t) {
    const int64_t key0 = t * kLanes;
    const int64_t slot = ch.slot(table, key0);
    const int64_t nk = std::min<int64_t>(kLanes, last + 1 - key0);  // keys any query of the item sees
    widen_rows<D>(sc.kw, st.k_cache + slot * row_elems + kv_off, row_elems, nk, false);
    // V rows past nk are zeroed, not read: they may be another sequence's stale values, NaN included.
    widen_rows<D>(sc.vw, st.v_cache + slot * row_elems + kv_off, row_elems, nk, true);
    const bool masked = key0 + kLanes - 1 > pos0;
    for (int64_t g = 0; g < group; ++g) {
      scores32<D>(sc, g);
      softmax32(sc, g, key0, masked, qpos, st.scale, t == 0, alpha);
      values32<D>(sc, g, alpha);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    fv inv_l[kQV];
    for (int v = 0; v < kQV; ++v) inv_l[v] = 1.f / sc.l[g * kQV + v];
    float* ot = &sc.ot[g * D * kLanes];
    for (int d = 0; d < D; ++d)
      for (int v = 0; v < kQV; ++v) store_fv(ot + d * kLanes + v * kF, load_fv(ot + d * kLanes + v * kF) * inv_l[v]);
    for (int p0 = 0; p0 < D; p0 += 8)
      for (int j0 = 0; j0 < kLanes; j0 += 8) transpose8(ot + p0 * kLanes + j0, kLanes, &sc.rows[j0][p0], kMaxDim);
    for (int64_t j = 0; j < nq; ++j)
      std::memcpy(st.out + (row0 + j) * st.o_stride0 + (it.head * group + g) * st.o_stride1, sc.rows[j],
                  sizeof(float) * D);
  }
}

template <int D, typename KV>
void attention_impl32(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& k_cache,
                      const torch::Tensor& v_cache, const Chunks& ch, int64_t n, float scale, bool serial) {
  const int64_t group = query.size(1) / ch.num_kv_heads;
  const Step32<KV> st{query.data_ptr<float>(),
                      reinterpret_cast<const KV*>(k_cache.data_ptr()),
                      reinterpret_cast<const KV*>(v_cache.data_ptr()),
                      out.data_ptr<float>(),
                      query.stride(0), query.stride(1), out.stride(0), out.stride(1), group, scale};
  run_items(make_items(ch, n, ch.num_kv_heads), serial, [&] { return Scratch32(group, D); },
            [&](const Item& it, Scratch32& sc) { run_item32<D, KV>(it, ch, st, sc); });
}

}  // namespace

// Whether this build takes bfloat16: it needs AVX512-BF16 on the build host.
// float32 builds everywhere.
bool has_bfloat16() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

void prefill_attention(torch::Tensor out, torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                       torch::Tensor starts, torch::Tensor lens, torch::Tensor seq_ids, torch::Tensor block_tables,
                       torch::Tensor seq_lens, double scale, int64_t parallel_tiles) {
  const Chunks ch{starts.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), seq_ids.data_ptr<int64_t>(),
                  block_tables.data_ptr<int32_t>(), block_tables.stride(0), seq_lens.data_ptr<int32_t>(),
                  k_cache.size(1), k_cache.size(2), k_cache.size(3)};
  const int64_t n = starts.size(0);
  if (n == 0) return;
  TORCH_CHECK(ch.head_dim <= kMaxDim, "prefill_attention: head_dim ", ch.head_dim, " has no build");
  // Key tiles over all items of all chunks: under `parallel_tiles`, one thread.
  int64_t tiles = 0;
  for (int64_t c = 0; c < n; ++c) {
    const int64_t len = ch.lens[c], ctx = ch.seq_lens[ch.seq_ids[c]] - len;
    tiles += len * (ctx + len / 2) / (kLanes * kLanes) + 1;
  }
  const bool serial = tiles * query.size(1) < parallel_tiles;
  // The pairs dispatched below, and nothing else: a cache read as the wrong
  // type would be read past its end.
  const auto q = query.scalar_type(), c = k_cache.scalar_type();
  TORCH_CHECK(out.scalar_type() == q && v_cache.scalar_type() == c &&
                  ((q == at::kFloat && (c == at::kFloat || c == at::kHalf)) ||
                   (q == at::kBFloat16 && c == at::kBFloat16)),
              "prefill_attention: unsupported query/cache dtypes ", q, "/", c);
  if (q == at::kFloat) {
    with_head_dim(ch.head_dim, [&](auto dim) {
      constexpr int D = decltype(dim)::value;
      if (c == at::kHalf) {
        attention_impl32<D, c10::Half>(out, query, k_cache, v_cache, ch, n, (float)scale, serial);
      } else {
        attention_impl32<D, float>(out, query, k_cache, v_cache, ch, n, (float)scale, serial);
      }
    });
    return;
  }
#if defined(__AVX512BF16__)
  with_head_dim(ch.head_dim, [&](auto dim) {
    attention_impl<decltype(dim)::value>(out, query, k_cache, v_cache, ch, n, (float)scale, serial);
  });
#else
  TORCH_CHECK(false, "prefill_attention: bfloat16 needs AVX512-BF16");
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("has_bfloat16", &has_bfloat16, "whether this build takes bfloat16 (AVX512-BF16)");
  // Without the GIL, as torch's own ops run: a step's prompt attention takes
  // tens of milliseconds a layer, and an embedded engine shares the process
  // with the gateway's event loop (holding it, /health waited 0.66 s under
  // load in tests/gateway/test_openai_errors.py).
  m.def("prefill_attention", torch::wrap_pybind_function_no_gil(prefill_attention), "prefill_attention");
}
