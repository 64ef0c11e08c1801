// cpu_prefill.cpp's float32 build, over a float32 or float16 cache, at
// the host's own vector width: outer products in registers, as the scheme
// at the top of cpu_prefill.cpp says.
#pragma once

#include "cpu_prefill_items.h"

#include <immintrin.h>

namespace {

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
// by lane, as the bfloat16 build's softmax_tile: leaves the weights in s
// and sets alpha, the factor that rescales the weighted values so far.
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
