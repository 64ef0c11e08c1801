// cpu_decode.cpp's arithmetic on one tile of kL positions of a sequence:
// a query head's scores (tile_scores), its online softmax (softmax_step),
// and the tile's V rows weighted into its state (tile_values; by bfloat16
// pairs on AVX512-BF16, pair_values), with the state a thread keeps for
// every query head (Scratch).
#pragma once

#include "vector_helpers.h"

#include <immintrin.h>
#include <limits>

namespace {

// Lanes per vector, and positions per tile. AVX2 gets 8: GCC keeps a 16-lane
// vector, which AVX2 has no register for, in memory, so every multiply-add
// on one loaded and stored it, and every broadcast went lane by lane (on a
// 2-core Zen 3 this kernel spent ~1,000 cycles a position, a quarter of what
// the memory could feed).
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr int kL = 8;
inline Lanes<8>::f32 sum_each_lanes(Lanes<8>::f32* a) { return sum_each8(a); }
inline float hmax_lanes(Lanes<8>::f32 v) { return hmax8(v); }
#else
constexpr int kL = kLanes;
inline f32x16 sum_each_lanes(f32x16* a) { return sum_each(a); }
inline float hmax_lanes(f32x16 v) { return hmax(v); }
#endif
typedef Lanes<kL>::f32 fv;
typedef int32_t iv __attribute__((vector_size(kL * 4)));
inline fv exp_lanes_fv(fv x) { return exp_lanes<fv, iv>(x); }

constexpr int kMaxChunks = 256 / kL;  // head_dim <= 256
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Per thread: every query head's query and running state. For head h, m is
// the max score so far, l the sum of exp(score - m) (lane by lane, added up
// at the end) and acc the exp-weighted sum of V rows. Where the CPU has
// AVX512-BF16 and head_dim is a multiple of 32, the queries are also kept
// as bfloat16 pairs for vdpbf16ps (exact products, float32 sums).
struct Scratch {
  std::vector<fv> q, acc, l;
  std::vector<float> m;
#if defined(__AVX512BF16__)
  std::vector<__m512bh> qb;
#endif
  Scratch(int64_t num_heads, int64_t chunks)
      : q(num_heads * chunks), acc(num_heads * chunks), l(num_heads), m(num_heads) {
#if defined(__AVX512BF16__)
    qb.resize(num_heads * chunks / 2);
#endif
  }
};

// KV is the cache's element type: T's own, or float16 under float32 queries
// (a float32 model's 16-bit cache, widened as it is read).
template <typename KV>
constexpr bool kPairs() {
#if defined(__AVX512BF16__)
  return std::is_same_v<KV, c10::BFloat16>;
#else
  return false;
#endif
}

// q_h . k_t for the count rows of a tile (each pointing at head h's KV head),
// lane t (lanes past count: 0).
template <typename KV, int CT>
inline fv tile_scores(const Scratch& sc, int64_t h, const KV* const* rows, int64_t kv_offset, int64_t count,
                          int64_t chunks) {
  const int64_t C = CT ? CT : chunks;
  fv part[kL];
#if defined(__AVX512BF16__)
  if constexpr (kPairs<KV>()) {
    if (C % 2 == 0) {
      const __m512bh* qb = &sc.qb[h * C / 2];
      for (int64_t t = 0; t < count; ++t) {
        const KV* kp = rows[t] + kv_offset;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t c = 0; c < C / 2; ++c)
          acc = _mm512_dpbf16_ps(acc, qb[c], (__m512bh)_mm512_loadu_si512(kp + c * 2 * kL));
        std::memcpy(&part[t], &acc, sizeof acc);
      }
      for (int64_t t = count; t < kL; ++t) part[t] = fv{};
      return sum_each_lanes(part);
    }
  }
#endif
  const fv* q = &sc.q[h * C];
  for (int64_t t = 0; t < count; ++t) {
    const KV* kp = rows[t] + kv_offset;
    fv acc = q[0] * load_lanes<kL>(kp);
    for (int64_t c = 1; c < C; ++c) acc += q[c] * load_lanes<kL>(kp + c * kL);
    part[t] = acc;
  }
  for (int64_t t = count; t < kL; ++t) part[t] = fv{};
  return sum_each_lanes(part);
}

#if defined(__AVX512BF16__)
// tile_values for bfloat16 on AVX512-BF16, head_dim a multiple of 32:
// vdpbf16ps on two positions at once. Lane d of a pair vector holds dim d of
// both rows, and the weights go as a bfloat16 pair (p_t, p_t+1), rounded as
// torch's own bfloat16 attention rounds them before its product with V. An
// odd last row pairs with zeros.
template <int CT>
inline void pair_values(Scratch& st, int64_t first, int64_t group, const float (*probs)[kL],
                        const c10::BFloat16* const* rows, int64_t kv_offset, int64_t count, int64_t chunks) {
  const int64_t C = CT ? CT : chunks;
  // vpermt2w picks word i of a (row t) or 32 + i of b (row t + 1): lane d of
  // the low result is (a[d], b[d]) for d < 16, of the high one for 16 + d.
  alignas(64) static const uint16_t zeros[kMaxChunks * kL] = {};
  alignas(64) static const uint16_t lo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                              8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t hi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                              24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i idx_lo = _mm512_load_si512(lo), idx_hi = _mm512_load_si512(hi);
  const int64_t pairs = (count + 1) / 2;
  __m512bh w[kL / 2][kMaxChunks];
  for (int64_t u = 0; u < pairs; ++u) {
    const c10::BFloat16* r0 = rows[2 * u] + kv_offset;
    const void* r1 = 2 * u + 1 < count ? static_cast<const void*>(rows[2 * u + 1] + kv_offset) : zeros;
    for (int64_t c = 0; c < C / 2; ++c) {
      const __m512i a = _mm512_loadu_si512(r0 + c * 2 * kL);
      const __m512i b = _mm512_loadu_si512(static_cast<const uint16_t*>(r1) + c * 2 * kL);
      w[u][2 * c] = (__m512bh)_mm512_permutex2var_epi16(a, idx_lo, b);
      w[u][2 * c + 1] = (__m512bh)_mm512_permutex2var_epi16(a, idx_hi, b);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    alignas(32) uint32_t pp[kL / 2];
    __m512 p;
    std::memcpy(&p, probs[g], sizeof p);
    const __m256bh pb = _mm512_cvtneps_pbh(p);
    std::memcpy(pp, &pb, sizeof pp);
    fv* state = &st.acc[(first + g) * C];
    __m512 acc[kMaxChunks];
    for (int64_t c = 0; c < C; ++c) std::memcpy(&acc[c], &state[c], sizeof acc[c]);
    for (int64_t u = 0; u < pairs; ++u) {
      const __m512bh weights = (__m512bh)_mm512_set1_epi32(pp[u]);
      for (int64_t c = 0; c < C; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], w[u][c], weights);
    }
    for (int64_t c = 0; c < C; ++c) std::memcpy(&state[c], &acc[c], sizeof acc[c]);
  }
}
#endif

// acc_h += sum_t p_h[t] * v_t for the `group` query heads from `first`
// (the heads of one KV head), over the count rows of a tile.
template <typename KV, int CT>
inline void tile_values(Scratch& st, int64_t first, int64_t group, const float (*probs)[kL],
                        const KV* const* rows, int64_t kv_offset, int64_t count, int64_t chunks) {
  const int64_t C = CT ? CT : chunks;
#if defined(__AVX512BF16__)
  if constexpr (kPairs<KV>()) {
    if (C % 2 == 0) return pair_values<CT>(st, first, group, probs, rows, kv_offset, count, C);
  }
#endif
  alignas(64) float widened[kL][kMaxChunks * kL];  // a 16-bit tile's rows, widened once
  const float* vf[kL];
  for (int64_t t = 0; t < count; ++t) {
    if constexpr (!std::is_same_v<KV, float>) {
      for (int64_t c = 0; c < C; ++c) store_lanes<kL>(widened[t] + c * kL, load_lanes<kL>(rows[t] + kv_offset + c * kL));
      vf[t] = widened[t];
    } else {
      vf[t] = rows[t] + kv_offset;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    fv acc[kMaxChunks];
    fv* state = &st.acc[(first + g) * C];
    for (int64_t c = 0; c < C; ++c) acc[c] = state[c];
    for (int64_t t = 0; t < count; ++t) {
      const float pt = probs[g][t];
      for (int64_t c = 0; c < C; ++c) acc[c] += pt * load_lanes<kL>(vf[t] + c * kL);
    }
    for (int64_t c = 0; c < C; ++c) state[c] = acc[c];
  }
}

// Head h's online softmax over one tile of scores (lanes not `valid`
// left out): raises its running max if the tile's is higher, rescaling the
// sum and the weighted values so far, and returns the tile's weights
// exp(score - max), added to the sum.
template <int CT>
inline fv softmax_step(Scratch& st, int64_t h, fv scores, iv valid, int64_t chunks) {
  const int64_t C = CT ? CT : chunks;
  scores = valid ? scores : fv{} + kNegInf;
  const float m_new = std::max(st.m[h], hmax_lanes(scores));
  if (m_new > st.m[h]) {
    const float corr = st.m[h] == kNegInf ? 0.f : std::exp(st.m[h] - m_new);
    st.l[h] *= corr;
    for (int64_t c = 0; c < C; ++c) st.acc[h * C + c] *= corr;
    st.m[h] = m_new;
  }
  fv p = exp_lanes_fv(scores - m_new);
  p = valid ? p : fv{};
  st.l[h] += p;
  return p;
}

}  // namespace
