// quant_linear.cpp's opt-in int8 activations: float32 token rows rounded
// to int8 per block of 32 and multiplied in integers against the blocked
// formats, as llama.cpp does (AVX2 hosts, AVX-512 ones included).
#pragma once

#include "quant_linear_f32.h"

namespace {

#ifdef LORAGW_INT8_ACTIVATIONS
// The blocked formats with float32 activations rounded to int8, as
// llama.cpp multiplies them: each token row's block of 32 becomes
// dx * qx with dx = max|x| / 127 and qx = round(x / dx) (to nearest even),
// and a block's products are summed exactly in integers (vpmaddubsw of the
// weights' bytes by qx, then vpmaddwd), so a block costs a few integer
// instructions where the float path widens 32 weights to float and runs
// 4 FMAs per token row. Then x . (d q + m) ~ d dx (q . qx) + m sum(x), with
// sum(x) the block's float sum (not dx sum(qx): m adds to every weight, so
// its term keeps float precision). The rounding of x is the only
// approximation beyond float32's, and it moves a model's output much more
// than bfloat16 activations do (docs/engine.md, "Int8 activations"), so it
// is opt-in. Each token row is rounded on its
// own and each sum runs in block order whatever the row count, so a
// verifying sequence scores a token as its one-row decode does.
struct Int8Activations {
  std::vector<int8_t> q;   // [m, k]
  std::vector<float> d;    // [m, k / 32]: dx
  std::vector<float> sum;  // [m, k / 32]: the float sum of each block of x
};

inline float max_of_8(__m256 v) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

inline float sum_of_8(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

void quantize_activations(const float* x, int64_t x_stride, int64_t m, int64_t k, Int8Activations& a) {
  const int64_t blocks = k / kBlock;
  a.q.resize(m * k);
  a.d.resize(m * blocks);
  a.sum.resize(m * blocks);
  const __m256 sign = _mm256_set1_ps(-0.f);
  // vpackssdw and vpacksswb interleave the 128-bit halves: dword groups of 4
  // bytes come out as elements 0, 8, 16, 24, 4, 12, 20, 28 (each + 0..3).
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t j = 0; j < m; ++j)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* p = x + j * x_stride + b * kBlock;
      __m256 v[4];
      for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(p + 8 * i);
      __m256 top = _mm256_andnot_ps(sign, v[0]);
      for (int i = 1; i < 4; ++i) top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[i]));
      const float amax = max_of_8(top);
      const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      __m256i r[4];
      for (int i = 0; i < 4; ++i)
        r[i] = _mm256_cvtps_epi32(
            _mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.q.data() + j * k + b * kBlock),
                          _mm256_permutevar8x32_epi32(bytes, order));
      a.d[j * blocks + b] = amax / 127.f;
      a.sum[j * blocks + b] = sum_of_8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
    }
}

// y[jj * y_stride + r] for the JB token rows from j0 of `a` and the nk weight
// rows from r0, KT weight rows at a time (a tile past nk repeats the last
// row and drops its result). `scales` as dot_rows_blocked's.
template <int JB, int KT, typename Rows>
void dot_rows_int8(const Int8Activations& a, int64_t j0, const Rows& rows, const float* scales, int64_t r0,
                   int64_t nk, int64_t k_dim, float* y, int64_t y_stride) {
  const int64_t blocks = k_dim / kBlock;
  constexpr int kS = Rows::kScales;
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* xq = a.q.data() + j0 * k_dim;
  const float* dx = a.d.data() + j0 * blocks;
  const float* xsum = a.sum.data() + j0 * blocks;
  for (int64_t k0 = 0; k0 < nk; k0 += KT) {
    int64_t r[KT];
    const float* sc[KT];
    tile_rows<KT>(r0, k0, nk, blocks, kS, scales, r, sc);
    __m256 acc[JB][KT];
    zero_all(acc);
    float off[JB][KT] = {};
    for (int64_t b = 0; b < blocks; ++b) {
      __m256i xb[JB];
      __m256 dxb[JB];
      for (int jj = 0; jj < JB; ++jj) {
        xb[jj] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + jj * k_dim + b * kBlock));
        dxb[jj] = _mm256_broadcast_ss(dx + jj * blocks + b);
      }
      for (int kk = 0; kk < KT; ++kk) {
        const __m256i w = rows.i8_block(r[kk], b);
        // vpmaddubsw multiplies unsigned bytes by signed ones: a signed
        // weight lends its sign to x (|w| <= 128 and |qx| <= 127, so no
        // pair of products saturates 16 bits).
        const __m256i wu = Rows::kSigned ? _mm256_sign_epi8(w, w) : w;
        const __m256 d = _mm256_broadcast_ss(sc[kk] + b * kS);
        for (int jj = 0; jj < JB; ++jj) {
          const __m256i xs = Rows::kSigned ? _mm256_sign_epi8(xb[jj], w) : xb[jj];
          const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(wu, xs), ones);
          acc[jj][kk] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, dxb[jj]), acc[jj][kk]);
        }
        if constexpr (kS == 2) {
          const float m = sc[kk][b * 2 + 1];
          for (int jj = 0; jj < JB; ++jj) off[jj][kk] = std::fma(m, xsum[jj * blocks + b], off[jj][kk]);
        }
      }
    }
    for (int jj = 0; jj < JB; ++jj)
      for (int kk = 0; kk < KT && k0 + kk < nk; ++kk) y[jj * y_stride + k0 + kk] = sum_of_8(acc[jj][kk]) + off[jj][kk];
  }
}

template <typename Rows>
void int8_blocks(const float* x, int64_t x_stride, int64_t m, const Rows& rows, int64_t n, int64_t k,
                 const float* bias, float* out, int64_t out_stride, int64_t min_rows) {
  Int8Activations a;
  quantize_activations(x, x_stride, m, k, a);
  each_scaled_tile(rows, n, k, m, bias, out, out_stride, min_rows, [&](int64_t n0, int64_t nr, const float* scales) {
    int64_t j = 0;
    for (; j + 4 <= m; j += 4) dot_rows_int8<4, 1>(a, j, rows, scales, n0, nr, k, out + j * out_stride + n0, out_stride);
    for (; j < m; ++j) dot_rows_int8<1, 4>(a, j, rows, scales, n0, nr, k, out + j * out_stride + n0, 0);
  });
}
#endif

}  // namespace
