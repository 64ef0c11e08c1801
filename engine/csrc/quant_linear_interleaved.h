// quant_linear.cpp's float32 Q4_1 calls on the weight's interleaved copy:
// the register tiles for few token rows, and the dequantized panel for
// more.
#pragma once

#include "quant_linear_formats.h"

namespace {

#ifdef LORAGW_Q41_INTERLEAVED
// Q4_1 with float32 activations on AVX2 and AVX-512, the weight rows
// interleaved 8 at a time (q4_1_interleave, quant_linear.cpp): lanes run
// over 8 weight rows (16, two groups, with AVX-512), not along K.
// A block's k-th weights of the 8 rows come out of one 8-byte load as a
// vector, d q + m in one fused multiply-add, which is exactly the float
// weight (d q is exact in float32: 4 bits of q times float16's 11), and
// each token row multiplies it by its activation k broadcast from memory.
// So a weight vector costs a widening and two floating operations once for
// all the token rows, and each token row one multiply-add per 8 weights,
// where f32_blocks pays a fifth multiply-add a block for every token row
// and a horizontal sum: on a 2-core Zen 3 a layer's four calls ran 1.2-1.6x
// faster at 1 to 16 rows, and on a 2-core Zen 5, in 16 lanes, 1.1-2.1x
// faster than the AVX-512 paths before them, the loop and f32_tiles
// (docs/engine.md, "Q4_1 rows interleaved", "In 16 lanes on AVX-512").
// Every output is one chain of multiply-adds over K in the same order (a
// block's element i, then 16 + i, for i = 0 .. 15; blocks in order)
// whatever the row count and the tile shape, so a verifying sequence
// scores a token as its one-row decode does.
struct Q41Interleaved {
  const uint8_t* nib;  // [G, B, 16, 8]: (i, r) holds row 8g + r's element i (low nibble) and 16 + i (high)
  const c10::Half* dm;  // [G, B, 2, 8]: d then m of the group's 8 rows
  int64_t blocks;
};

// A tile's registers: 8 lanes, one group of 8 weight rows (AVX2), or 16,
// two adjacent groups, whose outputs are adjacent too (AVX-512). `next` is
// the distance from a group's d, m or bytes to the next group's, which the
// 16 lanes join into one vector. Every lane's chain is the same one
// correctly rounded multiply-add a step in both, so a row's outputs do not
// depend on which of the two took it.
struct Lanes8 {
  typedef __m256 F;
  typedef __m256i I;
  static constexpr int kGroups = 1;
  static F zero() { return _mm256_setzero_ps(); }
  static F halves(const c10::Half* s, int64_t) {  // 8 float16 -> float32
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  }
  static I bytes(const uint8_t* p, int64_t) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static F low(I b) { return _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(0x0F))); }
  static F high(I b) { return _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
};

#ifdef __AVX512F__
struct Lanes16 {
  typedef __m512 F;
  typedef __m512i I;
  static constexpr int kGroups = 2;
  static F zero() { return _mm512_setzero_ps(); }
  static F halves(const c10::Half* s, int64_t next) {
    const __m128i first = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
    const __m128i second = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + next));
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(first), second, 1));
  }
  static I bytes(const uint8_t* p, int64_t next) {
    return _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)),
                                                   _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + next))));
  }
  static F low(I b) { return _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0x0F))); }
  static F high(I b) { return _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
};
#endif

// y[j * y_stride + 8 g + r] for the JB token rows of xt ([K][JB], token
// rows innermost) and the NV vectors of L::kGroups groups from g0.
template <typename L, int JB, int NV>
void interleaved_tile(const Q41Interleaved& w, const float* xt, int64_t g0, float* y, int64_t y_stride) {
  // Every loop over the accumulators unrolled, or GCC keeps them in memory
  // (a memset, then a store of each one every iteration).
  typename L::F acc[JB][NV];
  _Pragma("GCC unroll 8") for (int j = 0; j < JB; ++j)
    _Pragma("GCC unroll 8") for (int v = 0; v < NV; ++v) acc[j][v] = L::zero();
  const int64_t next_dm = w.blocks * 16, next_nib = w.blocks * (kBlock / 2) * 8;  // group g to g + 1
  for (int64_t b = 0; b < w.blocks; ++b) {
    typename L::F d[NV], m[NV];
    const uint8_t* nib[NV];
    _Pragma("GCC unroll 8") for (int v = 0; v < NV; ++v) {
      const int64_t g = g0 + v * L::kGroups;
      const c10::Half* s = w.dm + (g * w.blocks + b) * 16;
      d[v] = L::halves(s, next_dm);
      m[v] = L::halves(s + 8, next_dm);
      nib[v] = w.nib + (g * w.blocks + b) * (kBlock / 2) * 8;
    }
    const float* xb = xt + b * kBlock * JB;
    _Pragma("GCC unroll 2") for (int i = 0; i < kBlock / 2; ++i) {
      typename L::I bytes[NV];
      typename L::F wv[NV];
      _Pragma("GCC unroll 8") for (int v = 0; v < NV; ++v) {
        bytes[v] = L::bytes(nib[v] + i * 8, next_nib);
        wv[v] = L::fmadd(L::low(bytes[v]), d[v], m[v]);
      }
      _Pragma("GCC unroll 8") for (int j = 0; j < JB; ++j) {
        const typename L::F xv = L::broadcast(xb + i * JB + j);
        _Pragma("GCC unroll 8") for (int v = 0; v < NV; ++v) acc[j][v] = L::fmadd(xv, wv[v], acc[j][v]);
      }
      _Pragma("GCC unroll 8") for (int v = 0; v < NV; ++v) wv[v] = L::fmadd(L::high(bytes[v]), d[v], m[v]);
      _Pragma("GCC unroll 8") for (int j = 0; j < JB; ++j) {
        const typename L::F xv = L::broadcast(xb + (i + kBlock / 2) * JB + j);
        _Pragma("GCC unroll 8") for (int v = 0; v < NV; ++v) acc[j][v] = L::fmadd(xv, wv[v], acc[j][v]);
      }
    }
  }
  _Pragma("GCC unroll 8") for (int j = 0; j < JB; ++j)
    _Pragma("GCC unroll 8") for (int v = 0; v < NV; ++v)
      L::store(y + j * y_stride + (g0 + v * L::kGroups) * 8, acc[j][v]);
}

// Groups g0 .. g1 for JB token rows, NV groups a tile, then one at a time;
// with AVX-512, NP pairs of groups a tile, then the pairs left one at a
// time, then the one group left.
template <int JB, int NV, int NP>
void interleaved_groups(const Q41Interleaved& w, const float* xt, int64_t g0, int64_t g1, float* y, int64_t y_stride) {
  int64_t g = g0;
#ifdef __AVX512F__
  for (; g + 2 * NP <= g1; g += 2 * NP) interleaved_tile<Lanes16, JB, NP>(w, xt, g, y, y_stride);
  for (; g + 2 <= g1; g += 2) interleaved_tile<Lanes16, JB, 1>(w, xt, g, y, y_stride);
#else
  for (; g + NV <= g1; g += NV) interleaved_tile<Lanes8, JB, NV>(w, xt, g, y, y_stride);
#endif
  for (; g < g1; ++g) interleaved_tile<Lanes8, JB, 1>(w, xt, g, y, y_stride);
}

// Calls of panel_min_rows() token rows or more dequantize a few groups once, a
// few blocks at a time, into a float32 panel in L1, and run every token row
// over it up to kPanelRows at a time. The tiles above widen the same
// weights again for every pass of 8 token rows, and keep only as many
// accumulators as two FMA pipes of latency 4 need, with no slack for the
// widening's own multiply-add: on a 2-core Zen 3 they ran at about 60% of
// the pipes' peak (docs/engine.md, "A dequantized panel"). The panel holds
// the very lanes a tile's fused multiply-add makes, in the same order
// (element i, then 16 + i, block by block), and each output continues its
// one chain across panels through `out`, so a row's outputs are bit for bit
// those of the tiles at any row count.
//   AVX2: a pair of groups (two 8-lane vectors a step along K) and tiles of
//   up to 6 rows, 12 accumulators: with 2 weight vectors and a broadcast,
//   AVX2's 16 registers. From 10 to 16 rows the panel's own costs
//   (dequantizing to memory, about as long as the weights take to stream)
//   left it level with the tiles on balance (a layer's calls 0.82x to 1.15x
//   as fast, in one process alternated); from 17 rows on, 1.2-1.3x.
//   AVX-512: four groups (two 16-lane vectors) and tiles of up to 12 rows,
//   24 accumulators of AVX-512's 32 registers. On a 2-core Intel Xeon
//   (Emerald Rapids) a layer's calls were 0.96-1.12x as fast from 9 to 16
//   rows over three runs (under 1 once, at 12 rows) and 1.1-1.3x from 17
//   to 128, but 0.85-0.94x at 6 to 8, where the tiles take all the rows in
//   one pass (docs/engine.md, "The panel on AVX-512"). On a 2-core Zen 4,
//   which runs each 512-bit operation as two 256-bit halves, the panel was
//   the slower at nearly every row count from 9 to 16 (by about 2-9%, over
//   two runs with the builds swapped) and, in one run, 1.05-1.16x as fast
//   from 17 to 128: there it starts at kPanelMinRowsZen4 (panel_min_rows).
#ifdef __AVX512F__
constexpr int kPanelGroups = 4;
constexpr int kPanelRows = 12;
constexpr int kPanelMinTile = 6;
constexpr int64_t kPanelMinRows = 9;
constexpr int64_t kPanelMinRowsZen4 = 17;
static_assert(kPanelMinRowsZen4 >= kPanelMinRows, "panel_tiles_fit checks from kPanelMinRows up");
#else
constexpr int kPanelGroups = 2;
constexpr int kPanelRows = 6;
constexpr int kPanelMinTile = 4;
constexpr int64_t kPanelMinRows = 17;
#endif
constexpr int64_t kPanelBlocks = 4;  // 4 x 32 x 16 floats on AVX2, 8 KiB; 16 KiB on AVX-512: in L1

// The rows in as few tiles of up to kPanelRows as hold them, of sizes that
// differ by one at most (19 rows on AVX2: 5, 5, 5, 4, not 6, 6, 6, 1,
// whose last tile would have too few chains to keep two pipes busy): tile
// t's size, of panel_tiles(m).
inline constexpr int64_t panel_tiles(int64_t m) { return (m + kPanelRows - 1) / kPanelRows; }
inline constexpr int64_t panel_tile_rows(int64_t m, int64_t tiles, int64_t t) { return m / tiles + (t < m % tiles); }
// So that panel_rows instantiates kPanelMinTile to kPanelRows only. Past
// kPanelRows * kPanelRows rows no tile has fewer than kPanelRows - 1 (m
// rows in ceil(m / R) tiles: at least m R / (m + R) > R - 1 each), so the
// loop stops there.
static_assert(kPanelMinTile <= kPanelRows - 1, "panel_tiles_fit checks up to kPanelRows * kPanelRows rows only");
constexpr bool panel_tiles_fit() {
  for (int64_t m = kPanelMinRows; m <= kPanelRows * kPanelRows; ++m)
    if (m / panel_tiles(m) < kPanelMinTile) return false;
  return true;
}
static_assert(panel_tiles_fit(), "a call of kPanelMinRows rows or more has a tile under kPanelMinTile rows");

#ifdef __AVX512F__
// Whether this CPU runs each 512-bit operation as two 256-bit halves: an
// AVX-512 build of AMD's family 19h runs on Zen 4 only (Zen 3 has no
// AVX-512). Zen 5 (family 1Ah) and Intel's run them full width.
inline bool halves_512() {
  static const bool halves = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amdfam19h");
  }();
  return halves;
}
#endif

// The fewest token rows for which a call takes the panel on this CPU. Zen
// 5, whose 512-bit paths are full width, keeps kPanelMinRows, untimed.
inline int64_t panel_min_rows() {
#ifdef __AVX512F__
  return halves_512() ? kPanelMinRowsZen4 : kPanelMinRows;
#else
  return kPanelMinRows;
#endif
}

// The lanes a panel of NW groups is read and written in: 16 (pairs of
// groups) on AVX-512 where NW is even, else 8 (one group).
#ifdef __AVX512F__
template <int NW>
using PanelLanes = std::conditional_t<NW % 2 == 0, Lanes16, Lanes8>;
#else
template <int NW>
using PanelLanes = Lanes8;
#endif

// Blocks b0 .. b1 of NW groups from g, row-major [(b - b0) * 32 + 2 i + h][8 NW]:
// element i + 16 h of each weight row, the 8 rows of group g + v in lanes 8 v ..
template <int NW>
inline void dequantize_panel(const Q41Interleaved& w, int64_t g, int64_t b0, int64_t b1, float* panel) {
  typedef PanelLanes<NW> L;
  const int64_t next_dm = w.blocks * 16, next_nib = w.blocks * (kBlock / 2) * 8;  // group g to g + 1
  for (int64_t b = b0; b < b1; ++b) {
    float* dst = panel + (b - b0) * kBlock * 8 * NW;
    _Pragma("GCC unroll 2") for (int v = 0; v < NW; v += L::kGroups) {
      const c10::Half* s = w.dm + ((g + v) * w.blocks + b) * 16;
      const typename L::F d = L::halves(s, next_dm), m = L::halves(s + 8, next_dm);
      const uint8_t* nib = w.nib + ((g + v) * w.blocks + b) * (kBlock / 2) * 8;
      _Pragma("GCC unroll 4") for (int i = 0; i < kBlock / 2; ++i) {
        const typename L::I bytes = L::bytes(nib + i * 8, next_nib);
        L::store(dst + (2 * i) * 8 * NW + 8 * v, L::fmadd(L::low(bytes), d, m));
        L::store(dst + (2 * i + 1) * 8 * NW + 8 * v, L::fmadd(L::high(bytes), d, m));
      }
    }
  }
}

// y[j * y_stride + 8 v + lane] for MR token rows over `kk` panel rows; xp
// holds the rows' activations in panel order, [kk][MR]. The first panel
// of K starts the chains at zero, the others continue them from y.
template <int MR, int NW>
inline void panel_tile(const float* panel, const float* xp, int64_t kk, float* y, int64_t y_stride, bool first) {
  typedef PanelLanes<NW> L;
  constexpr int NV = NW / L::kGroups, W = 8 * L::kGroups;  // vectors a panel row, and their lanes
  typename L::F acc[MR][NV];
  _Pragma("GCC unroll 16") for (int j = 0; j < MR; ++j)
    _Pragma("GCC unroll 2") for (int v = 0; v < NV; ++v)
      acc[j][v] = first ? L::zero() : L::load(y + j * y_stride + W * v);
  for (int64_t c = 0; c < kk; ++c) {
    typename L::F wv[NV];
    _Pragma("GCC unroll 2") for (int v = 0; v < NV; ++v) wv[v] = L::load(panel + c * 8 * NW + W * v);
    _Pragma("GCC unroll 16") for (int j = 0; j < MR; ++j) {
      const typename L::F xv = L::broadcast(xp + c * MR + j);
      _Pragma("GCC unroll 2") for (int v = 0; v < NV; ++v) acc[j][v] = L::fmadd(xv, wv[v], acc[j][v]);
    }
  }
  _Pragma("GCC unroll 16") for (int j = 0; j < MR; ++j)
    _Pragma("GCC unroll 2") for (int v = 0; v < NV; ++v) L::store(y + j * y_stride + W * v, acc[j][v]);
}

// panel_tile for a tile of mr rows, kPanelMinTile <= mr <= MR.
template <int NW, int MR = kPanelRows>
inline void panel_tile_of(int64_t mr, const float* panel, const float* xp, int64_t kk, float* y, int64_t y_stride,
                          bool first) {
  if constexpr (MR > kPanelMinTile) {
    if (mr < MR) return panel_tile_of<NW, MR - 1>(mr, panel, xp, kk, y, y_stride, first);
  }
  panel_tile<MR, NW>(panel, xp, kk, y, y_stride, first);
}

template <int NW>
void panel_rows(const float* panel, const float* xp, int64_t m, int64_t k, int64_t b0, int64_t kk, float* y,
                int64_t y_stride) {
  const int64_t tiles = panel_tiles(m);
  for (int64_t t = 0, r0 = 0, mr = 0; t < tiles; ++t, r0 += mr) {
    mr = panel_tile_rows(m, tiles, t);
    // The row tile's activations: mr rows over all of K, [K][mr] in panel order.
    panel_tile_of<NW>(mr, panel, xp + r0 * k + b0 * kBlock * mr, kk, y + r0 * y_stride, y_stride, b0 == 0);
  }
}

// Groups g .. g + NW over every panel of K.
template <int NW>
void panel_groups(const Q41Interleaved& w, int64_t g, const float* xp, int64_t m, int64_t k, float* panel, float* y,
                  int64_t y_stride) {
  for (int64_t b0 = 0; b0 < w.blocks; b0 += kPanelBlocks) {
    const int64_t b1 = std::min(w.blocks, b0 + kPanelBlocks);
    dequantize_panel<NW>(w, g, b0, b1, panel);
    panel_rows<NW>(panel, xp, m, k, b0, (b1 - b0) * kBlock, y + g * 8, y_stride);
  }
}

void panel_f32(const float* x, int64_t x_stride, int64_t m, const Q41Interleaved& w, int64_t n, int64_t k,
               const float* bias, float* out, int64_t out_stride, int64_t min_rows) {
  const int64_t groups = n / 8;
  // Each row tile's activations, [K][rows] with K in panel order: element
  // i + 16 h of a block at 2 i + h.
  std::vector<float> xp(m * k);
  const int64_t tiles = panel_tiles(m);
  for (int64_t t = 0, r0 = 0, mr = 0; t < tiles; ++t, r0 += mr) {
    mr = panel_tile_rows(m, tiles, t);
    float* dst = xp.data() + r0 * k;
    for (int64_t j = 0; j < mr; ++j) {
      const float* src = x + (r0 + j) * x_stride;
      for (int64_t b = 0; b < k / kBlock; ++b)
        for (int i = 0; i < kBlock / 2; ++i) {
          dst[(b * kBlock + 2 * i) * mr + j] = src[b * kBlock + i];
          dst[(b * kBlock + 2 * i + 1) * mr + j] = src[b * kBlock + kBlock / 2 + i];
        }
    }
  }
  at::parallel_for(0, groups, std::max<int64_t>(1, min_rows / 8), [&](int64_t g0, int64_t g1) {
    alignas(64) float panel[kPanelBlocks * kBlock * 8 * kPanelGroups];
    int64_t g = g0;
    for (; g + kPanelGroups <= g1; g += kPanelGroups)
      panel_groups<kPanelGroups>(w, g, xp.data(), m, k, panel, out, out_stride);
    if constexpr (kPanelGroups > 2) {
      for (; g + 2 <= g1; g += 2) panel_groups<2>(w, g, xp.data(), m, k, panel, out, out_stride);
    }
    for (; g < g1; ++g) panel_groups<1>(w, g, xp.data(), m, k, panel, out, out_stride);
    if (bias != nullptr) add_bias_tile(out, out_stride, m, bias, g0 * 8, (g1 - g0) * 8);
  });
}

// Token rows go 8 at a time, then the 1 to 7 left in one pass, as in
// f32_blocks (calls of panel_min_rows() rows or more take panel_f32 above;
// K = 0, which has no panel to continue a chain from, stays here and
// writes zeros). NV keeps JB * NV accumulators and NV weight vectors within
// AVX2's 16 registers; for 1 to 3 rows it was picked by timing (a single
// row over 8 groups spilled and ran slower than over 4). NP keeps JB * NP
// accumulators, NP weight vectors, their NP widened bytes and the NP d and
// m within AVX-512's 32 (on a 2-core Zen 5, 1 to 3 rows over 6, 5 and 4
// pairs timed as over 4, 4 and 3).
void interleaved_f32(const float* x, int64_t x_stride, int64_t m, const Q41Interleaved& w, int64_t n, int64_t k,
                     const float* bias, float* out, int64_t out_stride, int64_t min_rows) {
  if (m >= panel_min_rows() && k > 0) return panel_f32(x, x_stride, m, w, n, k, bias, out, out_stride, min_rows);
  const int64_t groups = n / 8;
  // Each pass's activations transposed, [K][rows of the pass], so that a
  // token row's k-th value is a broadcast at a fixed offset.
  std::vector<float> xt(m * k);
  for (int64_t j0 = 0; j0 < m; j0 += 8) {
    const int64_t g = std::min<int64_t>(8, m - j0);
    float* dst = xt.data() + j0 * k;
    for (int64_t jj = 0; jj < g; ++jj)
      for (int64_t c = 0; c < k; ++c) dst[c * g + jj] = x[(j0 + jj) * x_stride + c];
  }
  at::parallel_for(0, groups, std::max<int64_t>(1, min_rows / 8), [&](int64_t g0, int64_t g1) {
    for (int64_t j0 = 0; j0 < m; j0 += 8) {
      const float* xj = xt.data() + j0 * k;
      float* oj = out + j0 * out_stride;
      switch (std::min<int64_t>(8, m - j0)) {
        case 8: interleaved_groups<8, 1, 2>(w, xj, g0, g1, oj, out_stride); break;
        case 7: interleaved_groups<7, 1, 2>(w, xj, g0, g1, oj, out_stride); break;
        case 6: interleaved_groups<6, 1, 2>(w, xj, g0, g1, oj, out_stride); break;
        case 5: interleaved_groups<5, 2, 2>(w, xj, g0, g1, oj, out_stride); break;
        case 4: interleaved_groups<4, 2, 3>(w, xj, g0, g1, oj, out_stride); break;
        case 3: interleaved_groups<3, 2, 3>(w, xj, g0, g1, oj, out_stride); break;
        case 2: interleaved_groups<2, 3, 4>(w, xj, g0, g1, oj, out_stride); break;
        default: interleaved_groups<1, 4, 4>(w, xj, g0, g1, oj, out_stride);
      }
    }
    if (bias != nullptr) add_bias_tile(out, out_stride, m, bias, g0 * 8, (g1 - g0) * 8);
  });
}
#endif

}  // namespace
