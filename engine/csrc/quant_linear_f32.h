// quant_linear.cpp's float paths other than the interleaved Q4_1 copy:
// the per-vector loop (any format, float32 or bfloat16 activations), the
// blocked float32 path of AVX2, and the widened 16-row tiles that
// float32 calls of more than kF32TileRows rows take on AVX-512; and the
// blocked formats' per-tile scales, which the int8 path shares.
#pragma once

#include "quant_linear_formats.h"

namespace {

// y[j * y_stride + r] = x_j . w_(r0 + r) for JB rows of x (x_stride apart)
// and the nk weight rows from r0, in float32, KT weight rows at a time (a
// tile past nk repeats the last row and drops its result).
//
// Over a widened tile (F32Tile, below) every operand is loaded into a
// register once for all the multiply-adds that use it (the empty asm): GCC
// otherwise folded a load into each one, 20 loads for 16 multiply-adds, and
// on a 2-core Zen 4 a float32 Q4_1 call on the gate weight of 16 to 64 rows
// ran 1.3-1.6x slower. Where `rows` widens as it goes, pinning the
// activations made 3- and 4-row calls 1.1-1.4x slower (docs/engine.md,
// "Quantization").
template <typename Rows>
constexpr bool kWidenedTile = false;

template <typename T, int JB, int KT, typename Rows>
void dot_rows_q(const T* x, int64_t x_stride, const Rows& rows, int64_t r0, int64_t nk, int64_t k_dim,
                T* y, int64_t y_stride) {
  for (int64_t k0 = 0; k0 < nk; k0 += KT) {
    int64_t r[KT];
    for (int kk = 0; kk < KT; ++kk) r[kk] = r0 + std::min<int64_t>(k0 + kk, nk - 1);
    fvec acc[JB][KT] = {};
    for (int64_t b = 0; b < k_dim; b += kBlock) {
#pragma GCC unroll 4
      for (int64_t h = b; h < b + kBlock; h += kVec) {
        fvec xv[JB];
        for (int jj = 0; jj < JB; ++jj) {
          xv[jj] = load_lanes<kVec>(x + jj * x_stride + h);
          if constexpr (kWidenedTile<Rows>) asm("" : "+v"(xv[jj]));
        }
        for (int kk = 0; kk < KT; ++kk) {
          fvec wv = rows.load(r[kk], h);
          if constexpr (kWidenedTile<Rows>) asm("" : "+v"(wv));
          for (int jj = 0; jj < JB; ++jj) acc[jj][kk] += xv[jj] * wv;
        }
      }
    }
    for (int jj = 0; jj < JB; ++jj)
      for (int kk = 0; kk < KT && k0 + kk < nk; ++kk)
        y[jj * y_stride + k0 + kk] = static_cast<T>(rows.finish(r[kk], hsum<kVec>(acc[jj][kk])));
  }
}

#if defined(LORAGW_BLOCKED_F32) || defined(LORAGW_INT8_ACTIVATIONS)
// The float16 scales of the weight rows from n0 (`count` values) in float32,
// 8 at a time: one broadcast a block in the dot loops instead of a conversion.
template <typename Rows>
void tile_scales(const Rows& rows, int64_t n0, int64_t count, float* scales) {
  const c10::Half* h = rows.scales(n0);
  int64_t i = 0;
  for (; i + 8 <= count; i += 8)
    _mm256_storeu_ps(scales + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
  for (; i < count; ++i) scales[i] = half_to_float(h[i]);
}

// The KT weight rows from r0 + k0 (a tile past nk repeats the last row, whose
// extra results the caller drops) and where their scales start in `scales`,
// which holds the rows from r0, kS values a block.
template <int KT>
inline void tile_rows(int64_t r0, int64_t k0, int64_t nk, int64_t blocks, int kS, const float* scales, int64_t* r,
                      const float** sc) {
  for (int kk = 0; kk < KT; ++kk) {
    r[kk] = r0 + std::min<int64_t>(k0 + kk, nk - 1);
    sc[kk] = scales + (r[kk] - r0) * blocks * kS;
  }
}

// Accumulators set one by one: `= {}` on the array made GCC keep it in
// memory, 4-10% slower at 4 to 16 token rows.
template <int JB, int KT>
inline void zero_all(__m256 (&acc)[JB][KT]) {
  for (int jj = 0; jj < JB; ++jj)
    for (int kk = 0; kk < KT; ++kk) acc[jj][kk] = _mm256_setzero_ps();
}

// Calls dots(n0, nr, scales) for each 16-row tile of the n weight rows, over
// the threads (at least min_rows weight rows each), with the tile's scales in
// float32 (tile_scales), then adds the bias to the tile's outputs.
template <typename Rows, typename Dots>
void each_scaled_tile(const Rows& rows, int64_t n, int64_t k, int64_t m, const float* bias, float* out,
                      int64_t out_stride, int64_t min_rows, Dots dots) {
  const int64_t blocks = k / kBlock, tiles = (n + kRowTile - 1) / kRowTile;
  at::parallel_for(0, tiles, min_rows / kRowTile, [&](int64_t begin, int64_t end) {
    std::vector<float> scales(kRowTile * blocks * Rows::kScales);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kRowTile, nr = std::min(kRowTile, n - n0);
      tile_scales(rows, n0, nr * blocks * Rows::kScales, scales.data());
      dots(n0, nr, scales.data());
      if (bias != nullptr) add_bias_tile(out, out_stride, m, bias, n0, nr);
    }
  });
}
#endif

#ifdef LORAGW_BLOCKED_F32
// The blocked formats (Q4_1, Q8_0) with float32 activations on AVX2. The
// loop above pays, for every 8 weights, two float16 conversions, a
// multiply and an add before its FMA: compute-bound there, a one-row Q4_1
// call took 60-85% of the time of MKL reading the float32 weights, 7x the
// bytes (benchmarks/quant_linear.py; docs/engine.md, "Quantization"). Here a
// block's 32 weights come out of one load as float q, each token row's
// products with them are summed and scaled by the block's d once, and m,
// which every weight of the block adds, is taken out of the sum:
// x . (d q + m) = d (x . q) + m sum(x), with sum(x) over each block computed
// once per call (`xsum`). Only float32 rounding differs from multiplying the
// float weights, and each row's sums run in the same order whatever the row
// count, so a verifying sequence scores a token as its one-row decode does.
// `scales`: the float32 d (and m) of rows r0 .. r0 + nk, Rows::kScales a block.
template <int JB, int KT, typename Rows>
void dot_rows_blocked(const float* x, int64_t x_stride, const float* xsum, const Rows& rows, const float* scales,
                      int64_t r0, int64_t nk, int64_t k_dim, float* y, int64_t y_stride) {
  const int64_t blocks = k_dim / kBlock;
  constexpr int kS = Rows::kScales;
  // One weight row against 4 or 8 token rows keeps the m terms in one
  // vector, lane jj for token row jj: the same fma chain as a scalar's, in
  // 1 operation a block instead of JB (8 scalars would not fit in registers
  // beside 8 accumulators). Groups of 2, 3 and 5 to 7 rows keep scalars: a
  // lane load takes 4 or 8 sums, and would read past a smaller group's.
  constexpr bool kLaneOffsets = kS == 2 && KT == 1 && (JB == 4 || JB == 8);
  for (int64_t k0 = 0; k0 < nk; k0 += KT) {
    int64_t r[KT];
    const float* sc[KT];
    tile_rows<KT>(r0, k0, nk, blocks, kS, scales, r, sc);
    __m256 acc[JB][KT];
    zero_all(acc);
    float off[JB][KT] = {};
    __m256 lanes8 = _mm256_setzero_ps();
    __m128 lanes4 = _mm_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      for (int kk = 0; kk < KT; ++kk) {
        __m256 w[4];
        rows.f32_block(r[kk], b, w);
        const __m256 d = _mm256_broadcast_ss(sc[kk] + b * kS);
        for (int jj = 0; jj < JB; ++jj) {
          const float* xb = x + jj * x_stride + b * kBlock;
          __m256 sum = _mm256_mul_ps(_mm256_loadu_ps(xb), w[0]);
          for (int i = 1; i < 4; ++i) sum = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8 * i), w[i], sum);
          acc[jj][kk] = _mm256_fmadd_ps(sum, d, acc[jj][kk]);
        }
        if constexpr (kLaneOffsets && JB == 8) {
          lanes8 = _mm256_fmadd_ps(_mm256_broadcast_ss(sc[kk] + b * 2 + 1), _mm256_loadu_ps(xsum + b * JB), lanes8);
        } else if constexpr (kLaneOffsets) {
          lanes4 = _mm_fmadd_ps(_mm_broadcast_ss(sc[kk] + b * 2 + 1), _mm_loadu_ps(xsum + b * JB), lanes4);
        } else if constexpr (kS == 2) {
          const float m = sc[kk][b * 2 + 1];
          for (int jj = 0; jj < JB; ++jj) off[jj][kk] = std::fma(m, xsum[b * JB + jj], off[jj][kk]);
        }
      }
    }
    if constexpr (kLaneOffsets) {
      float lane[JB];
      if constexpr (JB == 8) _mm256_storeu_ps(lane, lanes8); else _mm_storeu_ps(lane, lanes4);
      for (int jj = 0; jj < JB; ++jj) off[jj][0] = lane[jj];
    }
    for (int jj = 0; jj < JB; ++jj)
      for (int kk = 0; kk < KT && k0 + kk < nk; ++kk) {
        fvec a;
        std::memcpy(&a, &acc[jj][kk], sizeof a);
        y[jj * y_stride + k0 + kk] = hsum<kVec>(a) + off[jj][kk];
      }
  }
}

// Token rows go 8 at a time, then the 1 to 7 left in one pass: each pass
// widens every weight block again, and a decode step's row count is seldom
// a multiple of 8. Taking the rest 4 and then 1 at a time, a 15-row call
// made five passes where this makes two; on a 2-core Zen 3 calls of 2, 3,
// 5, 7 and 15 rows took 1.14-1.68x as long that way, 13 rows 1.05-1.10x
// (docs/engine.md, "The rows left after the eights, in one pass"). The
// split does not change a bit: each row's sums run the same chain in every
// group, its m term one fused multiply-add a block whether in a lane or a
// scalar. `xsum` holds each group's block sums block-major ([b][row in the
// group]) from its first row's offset, j * blocks, for dot_rows_blocked.
template <typename Rows>
void f32_blocks(const float* x, int64_t x_stride, int64_t m, const Rows& rows, int64_t n, int64_t k,
                const float* bias, float* out, int64_t out_stride, int64_t min_rows) {
  const int64_t blocks = k / kBlock;
  const auto group_of = [m](int64_t j) -> int64_t { return std::min<int64_t>(8, m - j); };
  std::vector<float> xsum;
  if constexpr (Rows::kScales == 2) {
    xsum.resize(m * blocks);
    for (int64_t j = 0; j < m;) {
      const int64_t g = group_of(j);
      for (int64_t jj = 0; jj < g; ++jj)
        for (int64_t b = 0; b < blocks; ++b) {
          float s = 0.f;
          for (int64_t i = 0; i < kBlock; ++i) s += x[(j + jj) * x_stride + b * kBlock + i];
          xsum[j * blocks + b * g + jj] = s;
        }
      j += g;
    }
  }
  each_scaled_tile(rows, n, k, m, bias, out, out_stride, min_rows, [&](int64_t n0, int64_t nr, const float* scales) {
    for (int64_t j = 0; j < m;) {
      const int64_t g = group_of(j);
      const float* xj = x + j * x_stride;
      const float* sj = xsum.data() + j * blocks;
      float* oj = out + j * out_stride + n0;
      switch (g) {
        case 8: dot_rows_blocked<8, 1>(xj, x_stride, sj, rows, scales, n0, nr, k, oj, out_stride); break;
        case 7: dot_rows_blocked<7, 1>(xj, x_stride, sj, rows, scales, n0, nr, k, oj, out_stride); break;
        case 6: dot_rows_blocked<6, 1>(xj, x_stride, sj, rows, scales, n0, nr, k, oj, out_stride); break;
        case 5: dot_rows_blocked<5, 1>(xj, x_stride, sj, rows, scales, n0, nr, k, oj, out_stride); break;
        case 4: dot_rows_blocked<4, 1>(xj, x_stride, sj, rows, scales, n0, nr, k, oj, out_stride); break;
        case 3: dot_rows_blocked<3, 1>(xj, x_stride, sj, rows, scales, n0, nr, k, oj, out_stride); break;
        case 2: dot_rows_blocked<2, 1>(xj, x_stride, sj, rows, scales, n0, nr, k, oj, out_stride); break;
        case 1:
        default: dot_rows_blocked<1, 4>(xj, x_stride, sj, rows, scales, n0, nr, k, oj, 0);
      }
      j += g;
    }
  });
}

#endif

// Every token row of x against the nr weight rows from n0 that `rows` gives,
// 4 token rows at a time, then the last 2 or 3 in one pass, else 1, then the
// bias: whether `rows` widens the weight as it goes or reads a widened tile.
template <typename T, typename Rows>
void dot_tile_rows(const T* x, int64_t x_stride, int64_t m, const Rows& rows, int64_t n0, int64_t nr, int64_t k,
                   const T* bias, T* out, int64_t out_stride) {
  int64_t j = 0;
  for (; j + 4 <= m; j += 4)
    dot_rows_q<T, 4, kTileRowsX4>(x + j * x_stride, x_stride, rows, n0, nr, k, out + j * out_stride + n0, out_stride);
  // The last 2 or 3 rows in one pass over the weight, not one each: on a
  // 2-core Zen 4 a float32 Q4_1 call of 2 rows took 1.3x one of 1 row, 3
  // rows 1.7x 4 (docs/engine.md, "Quantization").
  if (m - j == 3) {
    dot_rows_q<T, 3, kTileRowsX4>(x + j * x_stride, x_stride, rows, n0, nr, k, out + j * out_stride + n0, out_stride);
    j += 3;
  } else if (m - j == 2) {
    dot_rows_q<T, 2, kTileRowsX4>(x + j * x_stride, x_stride, rows, n0, nr, k, out + j * out_stride + n0, out_stride);
    j += 2;
  }
  for (; j < m; ++j) dot_rows_q<T, 1, kTileRowsX1>(x + j * x_stride, x_stride, rows, n0, nr, k, out + j * out_stride + n0, 0);
  if (bias != nullptr) add_bias_tile(out, out_stride, m, bias, n0, nr);
}

#ifdef __AVX512F__
// Float32 activations on AVX-512, more than kF32TileRows token rows. The
// loop above widens each weight vector once per 4 token rows (a nibble
// unpack, a conversion, a multiply and an add before 4 FMAs), so from ~16
// rows it lost to MKL reading 7x the bytes. Here a thread widens each 16-row
// tile of the weight once, into float32, and runs the same loop over the
// tile: the same values in the same order, so every sum is bit for bit the
// loop's, whatever the row count (the token rows of a verifying sequence
// score as its one-row decode does).
constexpr int64_t kF32TileRows = 4;

template <typename Rows>
struct F32Tile {  // rows n0 .. n0 + kRowTile of `rows`, widened once
  const float* tile;
  int64_t n0, k;
  const Rows& rows;
  fvec load(int64_t n, int64_t h) const { return load_lanes<kVec>(tile + (n - n0) * k + h); }
  float finish(int64_t n, float dot) const { return rows.finish(n, dot); }
};
template <typename Rows>
constexpr bool kWidenedTile<F32Tile<Rows>> = true;

template <typename Rows>
void f32_tiles(const float* x, int64_t x_stride, int64_t m, const Rows& rows, int64_t n, int64_t k,
               const float* bias, float* out, int64_t out_stride, int64_t min_rows) {
  const int64_t tiles = (n + kRowTile - 1) / kRowTile;
  at::parallel_for(0, tiles, min_rows / kRowTile, [&](int64_t begin, int64_t end) {
    std::vector<float> tile(kRowTile * k);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kRowTile, nr = std::min(kRowTile, n - n0);
      for (int64_t r = 0; r < nr; ++r)
        for (int64_t h = 0; h < k; h += kVec) {
          const fvec w = rows.load(n0 + r, h);
          std::memcpy(tile.data() + r * k + h, &w, sizeof w);
        }
      dot_tile_rows(x, x_stride, m, F32Tile<Rows>{tile.data(), n0, k, rows}, n0, nr, k, bias, out, out_stride);
    }
  });
}
#endif

template <typename T, typename Rows>
void linear_impl(const T* x, int64_t x_stride, int64_t m, const Rows& rows, int64_t n, int64_t k, const T* bias,
                 T* out, int64_t out_stride, int64_t min_rows) {
  const int64_t tiles = (n + kRowTile - 1) / kRowTile;
  at::parallel_for(0, tiles, min_rows / kRowTile, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kRowTile, nr = std::min(kRowTile, n - n0);
      dot_tile_rows(x, x_stride, m, rows, n0, nr, k, bias, out, out_stride);
    }
  });
}

}  // namespace
