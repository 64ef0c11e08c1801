// quant_linear.cpp's bfloat16 activations against the blocked formats,
// where the CPU has AVX512-BF16: dot products over a dequantized tile, in
// registers for up to kDirectRows token rows, and on AMX where the CPU
// has it.
#pragma once

#include "quant_linear_formats.h"

#include <sys/syscall.h>
#include <unistd.h>

namespace {

#ifdef __AVX512BF16__
// The blocked formats (Q4_1, Q8_0) with bfloat16 activations, where the CPU
// has AVX512-BF16: a thread dequantizes each weight tile once, to bfloat16, and multiplies it by every
// token row with bfloat16 dot products (float32 sums of bfloat16 pairs, as
// oneDNN's bfloat16 GEMM on such a CPU). The per-vector loop
// (quant_linear_f32.h) widens a weight once per 4 token rows, and once per
// row for the rows past a multiple of 4, so it lost to oneDNN above 8 rows; this path beats the loop from one row and
// oneDNN up to 32 (docs/engine.md, "Quantization"). The tile holds the same
// bfloat16 values as the float weights that the larger calls read (each
// stored value rounded to nearest even), and every row's sum runs in the same
// order whatever the row count.
constexpr int kDotX = 4;  // token rows per register tile: kDotX * kDotW = 16 accumulators, one sum_each
constexpr int kDotW = 4;
constexpr int kDirectRows = 8;  // the most token rows a call takes without the tile (dot_rows_direct_bf16)

// Rows n0 .. n0 + nr of a blocked weight (Q4_1, Q8_0), as bfloat16 lanes:
// block b of row r at tile[r * row_step + b * block_step]. Row-major, tile
// [nr][k], by default; the AMX path lays the blocks out the other way.
// f(b, block b of row n as bfloat16 lanes) for the row's blocks in order:
// two at a time where the format dequantizes pairs, the odd last alone.
template <typename Rows, typename F>
inline void each_bf16_block(const Rows& rows, int64_t n, int64_t blocks, F&& f) {
  int64_t b = 0;
  if constexpr (Rows::kPairs) {
    for (; b + 2 <= blocks; b += 2) {
      __m512bh pair[2];
      rows.bf16_block_pair(n, b, pair);
      f(b, pair[0]);
      f(b + 1, pair[1]);
    }
  }
  for (; b < blocks; ++b) f(b, rows.bf16_block(n, b));
}

template <typename Rows>
void dequantize_bf16(const Rows& rows, int64_t n0, int64_t nr, int64_t k, __m512bh* tile,
                     int64_t row_step = -1, int64_t block_step = 1) {
  const int64_t blocks = k / kBlock;
  if (row_step < 0) row_step = blocks;
  for (int64_t r = 0; r < nr; ++r) {
    __m512bh* out = tile + r * row_step;
    each_bf16_block(rows, n0 + r, blocks, [&](int64_t b, __m512bh w) { out[b * block_step] = w; });
  }
}

inline __m512bh load_bf16x32(const c10::BFloat16* p) {
  __m512bh v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// sums[i] = the sum of the 16 lanes of lanes[i] (sum_each), rounded to
// bfloat16 by one instruction (to nearest even, as c10, but it flushes
// denormals to zero where c10 keeps them): at 16-32 rows, c10's conversion
// one sum at a time took a sixth of a call, and store16's portable rounding
// ~6% more than this.
inline void rounded_sums(f32x16* lanes, c10::BFloat16* sums) {
  const f32x16 summed = sum_each(lanes);
  __m512 sums_ps;
  std::memcpy(&sums_ps, &summed, sizeof sums_ps);
  const __m256bh rounded = _mm512_cvtneps_pbh(sums_ps);
  std::memcpy(sums, &rounded, sizeof rounded);
}

// y[j * y_stride + r] = x_j . tile_r for JB token rows and the nr tile rows,
// KW tile rows at a time (a group past nr repeats the last row and drops it).
// The 16 sums of a tile come out of one transpose-add tree (sum_each), a few
// instructions a sum instead of a horizontal reduction each; each sum's
// order depends on nothing but its own accumulator.
template <int JB, int KW>
void dot_tile_bf16(const c10::BFloat16* x, int64_t x_stride, const __m512bh* tile, int64_t nr, int64_t k,
                   c10::BFloat16* y, int64_t y_stride) {
  static_assert(JB * KW == kLanes, "one sum_each per tile");
  const int64_t blocks = k / kBlock;
  for (int64_t r0 = 0; r0 < nr; r0 += KW) {
    const __m512bh* w[KW];
    for (int kk = 0; kk < KW; ++kk) w[kk] = tile + std::min<int64_t>(r0 + kk, nr - 1) * blocks;
    __m512 acc[JB][KW];
    for (int jj = 0; jj < JB; ++jj)
      for (int kk = 0; kk < KW; ++kk) acc[jj][kk] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      __m512bh xv[JB];
      for (int jj = 0; jj < JB; ++jj) xv[jj] = load_bf16x32(x + jj * x_stride + b * kBlock);
      for (int kk = 0; kk < KW; ++kk) {
        const __m512bh wv = w[kk][b];
        for (int jj = 0; jj < JB; ++jj) acc[jj][kk] = _mm512_dpbf16_ps(acc[jj][kk], xv[jj], wv);
      }
    }
    f32x16 lanes[kLanes];
    std::memcpy(lanes, acc, sizeof lanes);
    c10::BFloat16 sums[kLanes];
    rounded_sums(lanes, sums);
    if (r0 + KW <= nr) {  // a fixed-size copy a row; a group past nr drops its repeated rows
      for (int jj = 0; jj < JB; ++jj) std::memcpy(y + jj * y_stride + r0, sums + jj * KW, sizeof sums[0] * KW);
    } else {
      for (int jj = 0; jj < JB; ++jj)
        for (int kk = 0; r0 + kk < nr; ++kk) y[jj * y_stride + r0 + kk] = sums[jj * KW + kk];
    }
  }
}

// dot_tile_bf16 for up to kDirectRows token rows without the tile: each weight
// row's blocks are dequantized into registers and multiplied by every token
// row at once. Each sum sees the same products in the same order as in the
// tile (its blocks in order, one accumulator, then rounded_sums), so every
// result is bit for bit the tile's. With so few token rows a tile is read
// back only once or a few times, and a 16-row tile of a long row (48 KB at
// K = 1536) overflows a core's L1: streamed from memory, a one-row call on
// the 576 x 1536 down weight took 43-44 us through the tile on 2 Zen 5
// cores, 24-25 us this way. At 5 to 8 rows the tile is read back two to four
// times, and this way still won, on one thread and on two (docs/engine.md, "Up to 8
// token rows, no tile").
template <int JB, typename Rows>
void dot_rows_direct_bf16(const c10::BFloat16* x, int64_t x_stride, const Rows& rows, int64_t n0, int64_t nr,
                          int64_t k, c10::BFloat16* y, int64_t y_stride) {
  const int64_t blocks = k / kBlock;
  f32x16 lanes[JB][kLanes];
  for (int kk = 0; kk < kLanes; ++kk) {
    const int64_t r = n0 + std::min<int64_t>(kk, nr - 1);  // rows past nr repeat the last, then are dropped
    __m512 acc[JB];
    for (int jj = 0; jj < JB; ++jj) acc[jj] = _mm512_setzero_ps();
    each_bf16_block(rows, r, blocks, [&](int64_t b, __m512bh w) {
      for (int jj = 0; jj < JB; ++jj) acc[jj] = _mm512_dpbf16_ps(acc[jj], load_bf16x32(x + jj * x_stride + b * kBlock), w);
    });
    for (int jj = 0; jj < JB; ++jj) std::memcpy(&lanes[jj][kk], &acc[jj], sizeof acc[jj]);
  }
  for (int jj = 0; jj < JB; ++jj) {
    c10::BFloat16 sums[kLanes];
    rounded_sums(lanes[jj], sums);
    std::memcpy(y + jj * y_stride, sums, sizeof sums[0] * nr);
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// The same tiles on AMX, where the CPU has it (a Xeon from Sapphire Rapids
// on). There oneDNN's packed bfloat16 product beat the per-vector loop from 2
// to 9 rows, yet at 32 rows it moved a decode step's weights at a third
// of the memory's pace (docs/engine.md, "Quantization"). Here one tile
// multiply-add takes 16 weight rows by 32 columns of the dequantized tile
// against the same 32 columns of 16 token rows. AMX wants its second
// operand's columns in interleaved pairs; the weights are the first
// operand, so only the token rows are laid out that way, once a call. Each
// output is a float32 sum over the 32-column steps in order, whatever the
// row count, and AMX is used for every row count where it is used at all.
constexpr int64_t kAmxTokens = 16;    // token rows per tile
constexpr int64_t kAmxRows = 2 * kRowTile;  // weight rows a thread dequantizes at once: two tiles

// Linux hands a process the tile registers' state only when it asks, once.
bool amx_ready() {
  static const bool ready = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return ready;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
}

// r[i][j] -> r[j][i] for 16 rows of 16 32-bit lanes: pairs of rows
// interleaved, then quads, then 128-bit quarters across the quads.
inline void transpose16(__m512* r) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // u[4g + c], quarter q: column 4q + c of rows 4g .. 4g + 3
    u[4 * g] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], 0x44);
    u[4 * g + 1] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], 0xEE);
    u[4 * g + 2] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);
    u[4 * g + 3] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 even01 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88), odd01 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);
    const __m512 even23 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
    const __m512 odd23 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
    r[c] = _mm512_shuffle_f32x4(even01, even23, 0x88);
    r[4 + c] = _mm512_shuffle_f32x4(odd01, odd23, 0x88);
    r[8 + c] = _mm512_shuffle_f32x4(even01, even23, 0xDD);
    r[12 + c] = _mm512_shuffle_f32x4(odd01, odd23, 0xDD);
  }
}

// x's token rows, 16 to a tile and padded with zeros: for tile t, column
// pair p and token j, the 32 bits of x[16t + j][2p, 2p + 1] at
// ((t * pairs) + p) * 16 + j. 16 rows by 16 pairs at a time, in registers.
std::vector<uint32_t> pair_interleaved(const c10::BFloat16* x, int64_t x_stride, int64_t m, int64_t k) {
  const int64_t pairs = k / 2, tiles = (m + kAmxTokens - 1) / kAmxTokens;
  std::vector<uint32_t> xt(tiles * pairs * kAmxTokens);
  for (int64_t t = 0; t < tiles; ++t) {
    for (int64_t p0 = 0; p0 < pairs; p0 += kLanes) {
      __m512 r[kLanes];
      for (int64_t j = 0; j < kAmxTokens; ++j) {
        const int64_t i = t * kAmxTokens + j;
        r[j] = i < m ? _mm512_loadu_ps(reinterpret_cast<const float*>(x + i * x_stride + 2 * p0)) : _mm512_setzero_ps();
      }
      transpose16(r);
      for (int64_t p = 0; p < kLanes; ++p) _mm512_storeu_ps(reinterpret_cast<float*>(xt.data() + ((t * pairs) + p0 + p) * kAmxTokens), r[p]);
    }
  }
  return xt;
}

// sums[w + 2b] = weight tile w . token tile (t0 + b), [16 weight rows][16
// tokens], for the two weight tiles at `tile` (32 rows) and B token tiles:
// each loaded tile feeds two multiply-adds, and each sum is one of two to
// four chains in flight.
template <int B>
void amx_pass(const __m512bh* tile, int64_t blocks, const uint32_t* xt, int64_t pairs, int64_t t0,
              float (*sums)[kLanes * kAmxTokens]) {
  static_assert(B == 1 || B == 2);
  auto tokens = [&](int b, int64_t block) { return xt + ((t0 + b) * pairs + block * (kBlock / 2)) * kAmxTokens; };
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (B == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t block = 0; block < blocks; ++block) {
    _tile_loadd(4, tile + block * kAmxRows, 64);
    _tile_loadd(5, tile + block * kAmxRows + kLanes, 64);
    _tile_loadd(6, tokens(0, block), 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    if constexpr (B == 2) {
      _tile_loadd(7, tokens(1, block), 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, sums[0], 64);
  _tile_stored(1, sums[1], 64);
  if constexpr (B == 2) {
    _tile_stored(2, sums[2], 64);
    _tile_stored(3, sums[3], 64);
  }
}

// Every token row against the 32 tile rows from n0 (nr of them real):
// out[i][n0 + r], rounded to bfloat16 as dot_tile_bf16 rounds.
void amx_tile_rows(const __m512bh* tile, int64_t nr, int64_t blocks, const uint32_t* xt, int64_t m,
                   c10::BFloat16* out, int64_t out_stride, int64_t n0) {
  const int64_t pairs = blocks * (kBlock / 2), token_tiles = (m + kAmxTokens - 1) / kAmxTokens;
  alignas(64) float sums[4][kLanes * kAmxTokens];
  for (int64_t t0 = 0; t0 < token_tiles; t0 += 2) {
    const int b_count = token_tiles - t0 >= 2 ? 2 : 1;
    if (b_count == 2)
      amx_pass<2>(tile, blocks, xt, pairs, t0, sums);
    else
      amx_pass<1>(tile, blocks, xt, pairs, t0, sums);
    for (int b = 0; b < b_count; ++b) {
      for (int w = 0; w < 2 && w * kLanes < nr; ++w) {
        const int64_t rows = std::min<int64_t>(kLanes, nr - w * kLanes);
        __m512 r[kLanes];  // [weight row][token], then [token][weight row]
        for (int i = 0; i < kLanes; ++i) r[i] = _mm512_load_ps(sums[w + 2 * b] + i * kAmxTokens);
        transpose16(r);
        for (int64_t j = 0; j < kAmxTokens && (t0 + b) * kAmxTokens + j < m; ++j) {
          const __m256bh rounded = _mm512_cvtneps_pbh(r[j]);
          c10::BFloat16 lanes[kLanes];
          std::memcpy(lanes, &rounded, sizeof lanes);
          std::memcpy(out + ((t0 + b) * kAmxTokens + j) * out_stride + n0 + w * kLanes, lanes,
                      sizeof lanes[0] * rows);
        }
      }
    }
  }
}
#endif

template <typename Rows>
void bf16_tiles(const c10::BFloat16* x, int64_t x_stride, int64_t m, const Rows& rows, int64_t n, int64_t k,
                c10::BFloat16* out, int64_t out_stride, int64_t min_rows) {
  const int64_t tiles = (n + kRowTile - 1) / kRowTile;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  static_assert(kRowTile == kLanes, "a weight tile fills an AMX tile's 16 rows");
  if (amx_ready()) {
    const std::vector<uint32_t> xt = pair_interleaved(x, x_stride, m, k);
    const int64_t groups = (n + kAmxRows - 1) / kAmxRows;
    at::parallel_for(0, groups, min_rows / kAmxRows, [&](int64_t begin, int64_t end) {
      // A short last group's spare rows hold zeros or an earlier group's weights: their sums are dropped.
      std::vector<__m512bh> tile(kAmxRows * (k / kBlock), __m512bh{});
      configure_tiles();
      for (int64_t g = begin; g < end; ++g) {
        const int64_t n0 = g * kAmxRows, nr = std::min(kAmxRows, n - n0);
        // Block-major, so that each 16-row tile of a block is 1 KB in one piece. Loaded
        // 1,152 bytes a row apart (K = 576, row-major), the same tiles made a multiply-add
        // take 1.9 to 2.8x as long (a standalone loop; docs/engine.md, "Quantization").
        dequantize_bf16(rows, n0, nr, k, tile.data(), /*row_step=*/1, /*block_step=*/kAmxRows);
        amx_tile_rows(tile.data(), nr, k / kBlock, xt.data(), m, out, out_stride, n0);
      }
      _tile_release();
    });
    return;
  }
#endif
  if (0 < m && m <= kDirectRows) {  // (the direct path would read x rows that an empty call lacks)
    auto direct = [&](auto rows_tag) {
      constexpr int JB = decltype(rows_tag)::value;
      at::parallel_for(0, tiles, min_rows / kRowTile, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const int64_t n0 = t * kRowTile;
          dot_rows_direct_bf16<JB>(x, x_stride, rows, n0, std::min(kRowTile, n - n0), k, out + n0, out_stride);
        }
      });
    };
    switch (m) {
      case 1: direct(std::integral_constant<int, 1>{}); break;
      case 2: direct(std::integral_constant<int, 2>{}); break;
      case 3: direct(std::integral_constant<int, 3>{}); break;
      case 4: direct(std::integral_constant<int, 4>{}); break;
      case 5: direct(std::integral_constant<int, 5>{}); break;
      case 6: direct(std::integral_constant<int, 6>{}); break;
      case 7: direct(std::integral_constant<int, 7>{}); break;
      default: direct(std::integral_constant<int, 8>{}); break;
    }
    return;
  }
  at::parallel_for(0, tiles, min_rows / kRowTile, [&](int64_t begin, int64_t end) {
    std::vector<__m512bh> tile(kRowTile * (k / kBlock));
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kRowTile, nr = std::min(kRowTile, n - n0);
      dequantize_bf16(rows, n0, nr, k, tile.data());
      int64_t j = 0;
      for (; j + kDotX <= m; j += kDotX)
        dot_tile_bf16<kDotX, kDotW>(x + j * x_stride, x_stride, tile.data(), nr, k, out + j * out_stride + n0,
                                    out_stride);
      for (; j < m; ++j)
        dot_tile_bf16<1, 16>(x + j * x_stride, x_stride, tile.data(), nr, k, out + j * out_stride + n0, 0);
    }
  });
}
#endif

}  // namespace
