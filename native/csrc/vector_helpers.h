// Shared by the CPU kernels (engine/csrc/*.cpp, adapters/ops/csrc/*.cpp):
// 16-lane float32 vectors (GCC vector extensions: one AVX-512 register; on
// AVX2, which has no register that wide, GCC keeps them in memory, so a
// kernel whose inner loops matter there uses 8-lane ones, one AVX2
// register, as cpu_decode.cpp and quant_linear.cpp do), loads that widen bfloat16 and stores
// that round to it, the sum of one vector's lanes, a horizontal sum of 16
// vectors at once, the exp and the largest of a vector's lanes (for
// softmax), and the register-tiled dot products of a few rows against many (the LoRA shrink,
// the skinny linear). native/__init__.py copies it beside every kernel's
// source for the build.
#pragma once

#include <immintrin.h>
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

// N float32 lanes, and the 16- and 32-bit lanes that load bfloat16 into
// them: 16 (an AVX-512 register, or two AVX2 ones) or 8 (one AVX2 register,
// for kernels whose tiles are sized to the host's registers).
template <int N> struct Lanes;
template <> struct Lanes<16> {
  typedef float f32 __attribute__((vector_size(64)));
  typedef uint16_t u16 __attribute__((vector_size(32)));
  typedef uint32_t u32 __attribute__((vector_size(64)));
};
template <> struct Lanes<8> {
  typedef float f32 __attribute__((vector_size(32)));
  typedef uint16_t u16 __attribute__((vector_size(16)));
  typedef uint32_t u32 __attribute__((vector_size(32)));
};

template <int N>
inline typename Lanes<N>::f32 load_lanes(const float* p) {
  typename Lanes<N>::f32 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <int N>
inline typename Lanes<N>::f32 load_lanes(const c10::BFloat16* p) {  // bfloat16 is the top half of a float32
  typedef typename Lanes<N>::u32 u32;
  typename Lanes<N>::u16 h;
  std::memcpy(&h, p, sizeof h);
  u32 w = __builtin_convertvector(h, u32) << 16;
  typename Lanes<N>::f32 v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

// IEEE half precision (a float32 model's 16-bit KV cache): F16C widens 8
// lanes in one instruction; without it, c10's scalar conversion.
template <int N>
inline typename Lanes<N>::f32 load_lanes(const c10::Half* p) {
  typename Lanes<N>::f32 v;
#if defined(__AVX512F__)
  if constexpr (N == 16) {
    const __m512 w = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    std::memcpy(&v, &w, sizeof v);
    return v;
  }
#endif
#if defined(__F16C__)
  if constexpr (N % 8 == 0) {
    for (int i = 0; i < N; i += 8) {
      const __m256 w = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i)));
      std::memcpy(reinterpret_cast<float*>(&v) + i, &w, sizeof w);
    }
    return v;
  }
#endif
  float lanes[N];
  for (int i = 0; i < N; ++i) lanes[i] = static_cast<float>(p[i]);
  std::memcpy(&v, lanes, sizeof v);
  return v;
}

// Asks for `bytes` from p into L2, a cache line at a time: for K/V rows
// in blocks anywhere in the cache, which the hardware prefetcher does not
// follow (cpu_decode.cpp, cpu_prefill.cpp).
inline void prefetch_l2(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b, 0, /*locality=*/1);
}

// The sum of a vector's N lanes, in lane order.
template <int N>
inline float hsum(typename Lanes<N>::f32 v) {
  float lanes[N], s = 0.f;
  std::memcpy(lanes, &v, sizeof lanes);
  for (int i = 0; i < N; ++i) s += lanes[i];
  return s;
}

constexpr int kLanes = 16;
typedef Lanes<16>::f32 f32x16;
typedef int32_t i32x16 __attribute__((vector_size(64)));

inline f32x16 load16(const float* p) { return load_lanes<16>(p); }
inline f32x16 load16(const c10::BFloat16* p) { return load_lanes<16>(p); }

typedef uint32_t u32x16 __attribute__((vector_size(64)));

// Each lane's float32 bits rounded to bfloat16 as c10 rounds a float (to
// nearest, ties to even; every NaN to 0x7FC0), the result in the top half of
// each lane. c10's own conversion is scalar: rounding a register tile's 16
// sums with it one at a time took a sixth of a Q4_1 call at 16-32 rows
// (engine/csrc/quant_linear.cpp).
template <int N>
inline typename Lanes<N>::u32 bf16_rounded_lanes(typename Lanes<N>::f32 v) {
  typedef typename Lanes<N>::u32 u32;
  u32 u;
  std::memcpy(&u, &v, sizeof u);
  const u32 rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  return (v != v) ? u32{} + 0x7FC00000u : rounded;
}

inline u32x16 bf16_rounded_bits(f32x16 v) { return bf16_rounded_lanes<16>(v); }

// N lanes stored as float32, or rounded to bfloat16 to nearest even, as
// torch rounds.
template <int N>
inline void store_lanes(float* p, typename Lanes<N>::f32 v) {
  std::memcpy(p, &v, sizeof v);
}

template <int N>
inline void store_lanes(c10::BFloat16* p, typename Lanes<N>::f32 v) {
  const auto h = __builtin_convertvector(bf16_rounded_lanes<N>(v) >> 16, typename Lanes<N>::u16);
  std::memcpy(p, &h, sizeof h);
}

inline void store16(float* p, f32x16 v) { store_lanes<16>(p, v); }
inline void store16(c10::BFloat16* p, f32x16 v) { store_lanes<16>(p, v); }

// out[j, c] += bias[c] for the m token rows and the weight-row tile c0 ..
// c0 + nr of a skinny linear's output, the sum rounded once to T.
template <typename T>
inline void add_bias_tile(T* out, int64_t out_stride, int64_t m, const T* bias, int64_t c0, int64_t nr) {
  for (int64_t j = 0; j < m; ++j)
    for (int64_t c = c0; c < c0 + nr; ++c)
      out[j * out_stride + c] = static_cast<T>(static_cast<float>(out[j * out_stride + c]) + static_cast<float>(bias[c]));
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// On AVX2 GCC lowers a shuffle of a 16-lane vector lane by lane, through
// scalar moves and the stack. These are the generic trees below, addition
// for addition (so the same bits), in AVX2's own in-register shuffles.

// Lane i of the result is the sum of the 8 lanes of a[i] (one AVX2 register
// each): ((a[i]0 + a[i]1) + (a[i]2 + a[i]3)) + ((a[i]4 + a[i]5) + (a[i]6 + a[i]7)).
inline Lanes<8>::f32 sum_each8(const Lanes<8>::f32* a) {
  __m256 v[8];
  std::memcpy(v, a, sizeof v);
  // Per 128-bit half: quads 0-3 (low) and 4-7 (high) of a[0..3], then a[4..7].
  const __m256 q0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 q1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31));
  Lanes<8>::f32 out;
  std::memcpy(&out, &sums, sizeof out);
  return out;
}

// Lane i of the result is the sum of the 16 lanes of a[i], in the generic
// tree's order: the sum of lanes 0-7 plus the sum of lanes 8-15.
inline f32x16 sum_each(const f32x16* a) {
  Lanes<8>::f32 halves[2][kLanes];  // [0]: lanes 0-7 of each a[i], [1]: lanes 8-15
  for (int i = 0; i < kLanes; ++i) std::memcpy(&halves[0][i], &a[i], sizeof halves[0][i]);
  for (int i = 0; i < kLanes; ++i)
    std::memcpy(&halves[1][i], reinterpret_cast<const char*>(&a[i]) + sizeof halves[1][i], sizeof halves[1][i]);
  Lanes<8>::f32 out[2];
  for (int g = 0; g < 2; ++g) out[g] = sum_each8(&halves[0][8 * g]) + sum_each8(&halves[1][8 * g]);
  f32x16 sums;
  std::memcpy(&sums, out, sizeof sums);
  return sums;
}

#else
inline f32x16 pair_add(f32x16 x, f32x16 y, i32x16 lo, i32x16 hi) {
  return __builtin_shuffle(x, y, lo) + __builtin_shuffle(x, y, hi);
}

// Lane i of the result is the sum of the 16 lanes of a[i]: a transpose-add
// tree, 15 adds for 16 dot products instead of 16 horizontal reductions.
inline f32x16 sum_each(f32x16* a) {
  const i32x16 lo1 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
  const i32x16 hi1 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
  const i32x16 lo2 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
  const i32x16 hi2 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
  const i32x16 lo3 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
  const i32x16 hi3 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
  const i32x16 lo4 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const i32x16 hi4 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  f32x16 b[8], c[4], d[2];
  for (int k = 0; k < 8; ++k) b[k] = pair_add(a[2 * k], a[2 * k + 1], lo1, hi1);
  for (int k = 0; k < 4; ++k) c[k] = pair_add(b[2 * k], b[2 * k + 1], lo2, hi2);
  for (int k = 0; k < 2; ++k) d[k] = pair_add(c[2 * k], c[2 * k + 1], lo3, hi3);
  return pair_add(d[0], d[1], lo4, hi4);
}

#endif

// exp of each lane, to within ~2 float32 ulps: 2^n * e^r with |r| <= ln2/2
// and a degree-6 polynomial for e^r. Inputs are clamped to [-87.3, 88]
// (below, ~1e-38 rather than 0: callers zero the lanes they masked).
template <typename F, typename I>
inline F exp_lanes(F x) {
  const F lo = x < -87.3f ? F{} - 87.3f : x;
  x = lo > 88.0f ? F{} + 88.0f : lo;
  // Rounds x * log2(e) to the nearest integer: adding 1.5 * 2^23 leaves it
  // in the low mantissa bits.
  const F shifter = F{} + 12582912.0f;
  const F t = x * 1.44269504088896341f + shifter;
  const F n = t - shifter;
  F r = x - n * 0.693359375f;  // ln 2 in two parts: the first is exact in float
  r = r - n * -2.12194440e-4f;
  F p = F{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  I bits;
  std::memcpy(&bits, &t, sizeof bits);
  const I scale_bits = (bits - 0x4B400000) << 23;  // n as an exponent
  I pbits;
  std::memcpy(&pbits, &p, sizeof pbits);
  pbits += scale_bits;
  std::memcpy(&p, &pbits, sizeof p);
  return p;
}

inline f32x16 exp16(f32x16 x) { return exp_lanes<f32x16, i32x16>(x); }

#if defined(__AVX2__) && !defined(__AVX512F__)
// The largest of 8 lanes, in AVX2's in-register shuffles (see sum_each).
inline float hmax8(Lanes<8>::f32 v) {
  __m256 m;
  std::memcpy(&m, &v, sizeof m);
  m = _mm256_max_ps(m, _mm256_permute2f128_ps(m, m, 1));
  m = _mm256_max_ps(m, _mm256_permute_ps(m, 0x4E));
  m = _mm256_max_ps(m, _mm256_permute_ps(m, 0xB1));
  return _mm256_cvtss_f32(m);
}
#endif

// The largest lane: a tree of four shuffles, not a chain of 15 compares.
inline float hmax(f32x16 v) {
  const i32x16 swap8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
  const i32x16 swap4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
  const i32x16 swap2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
  const i32x16 swap1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
  for (const i32x16& swap : {swap8, swap4, swap2, swap1}) {
    const f32x16 w = __builtin_shuffle(v, swap);
    v = v > w ? v : w;
  }
  return v[0];
}

// y[j * y_stride + k] = x_j . w_k for JB rows of x (x_stride apart) and the
// nk rows of w ([nk, k_dim], rows contiguous), in float32, rounded to O on
// store. Register tiles of JB rows x KT w rows: a tile past nk repeats w's
// last row (from L1) and drops the result, so the loops keep fixed bounds
// and the JB * KT = 16 accumulators stay in registers.
template <typename T, int JB, int KT, typename O>
void dot_rows(const T* x, int64_t x_stride, const T* w, int64_t nk, int64_t k_dim, O* y, int64_t y_stride) {
  static_assert(JB * KT == kLanes, "one sum_each per tile");
  const int64_t full = k_dim / kLanes * kLanes;
  for (int64_t k0 = 0; k0 < nk; k0 += KT) {
    const T* wr[KT];
    for (int kk = 0; kk < KT; ++kk) wr[kk] = w + std::min<int64_t>(k0 + kk, nk - 1) * k_dim;
    f32x16 acc[kLanes] = {};
    for (int64_t h = 0; h < full; h += kLanes) {
      f32x16 wv[KT];
      for (int kk = 0; kk < KT; ++kk) wv[kk] = load16(wr[kk] + h);
      for (int jj = 0; jj < JB; ++jj) {
        const f32x16 xv = load16(x + jj * x_stride + h);
        for (int kk = 0; kk < KT; ++kk) acc[jj * KT + kk] += xv * wv[kk];
      }
    }
    const f32x16 sums = sum_each(acc);
    float lanes[kLanes];
    std::memcpy(lanes, &sums, sizeof lanes);
    for (int jj = 0; jj < JB; ++jj) {
      for (int kk = 0; kk < KT && k0 + kk < nk; ++kk) {
        float v = lanes[jj * KT + kk];
        for (int64_t h = full; h < k_dim; ++h)
          v += static_cast<float>(x[jj * x_stride + h]) * static_cast<float>(wr[kk][h]);
        y[jj * y_stride + k0 + kk] = static_cast<O>(v);
      }
    }
  }
}

}  // namespace
