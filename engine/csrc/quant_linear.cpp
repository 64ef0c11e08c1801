// Weight-only quantized skinny linear: out = x @ dequant(w)^T (+ bias) for a
// few token rows, each quantized weight row read once per call and widened
// to float32 in registers. Formats and why: engine/model/quant_linear.py.
//   int8: q [N, K] int8, scale [N] float32; w[n, k] = scale[n] * q[n, k]
//   q4_1: q [N, K / 2] uint8, dm [N, K / 32, 2] float16 (d, m per block of
//         32); byte i of a block holds element i (low nibble) and i + 16
//         (high nibble), as GGUF's Q4_1; w = d * q + m
//   q8_0: q [N, K] int8, d [N, K / 32] float16 (one scale per block of 32),
//         as GGUF's Q8_0; w = d * q
// Q4_1 and Q8_0 calls may also round float32 activations to int8 first
// (int8_blocks, activation quantization int8).
#include "vector_helpers.h"

#include <c10/util/Half.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <limits>
#include <type_traits>

namespace {

constexpr int64_t kRowTile = 16;   // weight rows per tile, as engine/csrc/cpu_linear.cpp
constexpr int64_t kMinRows = 128;  // weight rows per thread: less is not worth a thread's wake-up
// `min_rows` for a call that stays on the calling thread: more rows than any weight has.
constexpr int64_t kOneThread = std::numeric_limits<int64_t>::max();
constexpr int64_t kBlock = 32;     // q4_1 weights per (d, m) pair; K is a multiple of it for both formats

// One register of float32 lanes: 16 with AVX-512 (32 registers), else 8 (an
// AVX2 register; 16 of them). The tiles below keep JB * KT accumulators, JB
// activation vectors and a weight vector in registers on either.
#ifdef __AVX512F__
constexpr int kVec = 16;
constexpr int kTileRowsX4 = 4;   // weight rows per tile with 4 token rows
constexpr int kTileRowsX1 = 16;  // ... with 1 token row
#else
constexpr int kVec = 8;
constexpr int kTileRowsX4 = 2;
constexpr int kTileRowsX1 = 8;
#endif
// The blocked float32 path (f32_blocks below) is written for AVX2 and was
// measured there only; an AVX-512 host keeps the per-vector loop.
#if defined(__AVX2__) && defined(__F16C__) && !defined(__AVX512F__)
#define LORAGW_BLOCKED_F32 1
#endif
// Float32 activations rounded to int8 per block of 32 against the blocked
// formats (int8_blocks below): any AVX2 host, AVX-512 ones included.
#if defined(__AVX2__) && defined(__F16C__)
#define LORAGW_INT8_ACTIVATIONS 1
#endif
// Float32 Q4_1 calls on a copy of the weight with its rows interleaved
// (interleaved_f32 below): any AVX2 host, AVX-512 ones included.
#if defined(__AVX2__) && defined(__F16C__)
#define LORAGW_Q41_INTERLEAVED 1
#endif
typedef Lanes<kVec>::f32 fvec;
typedef int8_t i8vec __attribute__((vector_size(kVec)));
typedef uint8_t u8vec __attribute__((vector_size(kVec)));

inline float half_to_float(const c10::Half h) {
#ifdef __F16C__
  return _cvtsh_ss(h.x);  // one instruction; c10's portable conversion is a dozen
#else
  return static_cast<float>(h);
#endif
}

// kVec 8-bit integers -> float32 lanes. GCC 12 scalarises
// __builtin_convertvector from 8-bit lanes straight to float (a vcvtsi2ss per
// lane: it made these kernels 2 to 3x slower than the float kernel on
// AVX-512), so the widening instructions do it where they exist, and a chain
// of conversions that GCC does vectorise elsewhere.
typedef int16_t i16vec __attribute__((vector_size(kVec * 2)));
typedef int32_t i32vec __attribute__((vector_size(kVec * 4)));

template <typename V>
inline fvec widen_bytes(V v) {
  constexpr bool is_signed = std::is_same_v<V, i8vec>;
#if defined(__AVX512F__)
  __m128i b;
  std::memcpy(&b, &v, sizeof v);
  const __m512i w = is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
  fvec out;
  const __m512 f = _mm512_cvtepi32_ps(w);
  std::memcpy(&out, &f, sizeof out);
  return out;
#elif defined(__AVX2__)
  __m128i b = _mm_setzero_si128();
  std::memcpy(&b, &v, sizeof v);
  const __m256i w = is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
  fvec out;
  const __m256 f = _mm256_cvtepi32_ps(w);
  std::memcpy(&out, &f, sizeof out);
  return out;
#else
  return __builtin_convertvector(__builtin_convertvector(__builtin_convertvector(v, i16vec), i32vec), fvec);
#endif
}

inline fvec widen(const int8_t* p) {
  i8vec v;
  std::memcpy(&v, p, sizeof v);
  return widen_bytes(v);
}

inline fvec widen(u8vec v) { return widen_bytes(v); }

// Rows: kVec weights of row `n` from column `h` (a multiple of kVec), as
// float32 before the row's `finish`.
struct Int8Rows {
  const int8_t* q;
  const float* scale;
  int64_t k;
  fvec load(int64_t n, int64_t h) const {
    return widen(q + n * k + h);
  }
  float finish(int64_t n, float dot) const { return dot * scale[n]; }  // the scale is per row
};

struct Q41Rows {
  const uint8_t* q;
  const c10::Half* dm;
  int64_t k;
  fvec load(int64_t n, int64_t h) const {
    const int64_t block = h / kBlock, within = h % kBlock;
    u8vec packed;
    std::memcpy(&packed, q + n * (k / 2) + block * (kBlock / 2) + within % (kBlock / 2), sizeof packed);
    // A block's first 16 weights are its bytes' low nibbles, the last 16 the high ones.
    const u8vec nibbles = within < kBlock / 2 ? (packed & 0x0F) : (packed >> 4);
    const c10::Half* p = dm + (n * (k / kBlock) + block) * 2;
    return widen(nibbles) * half_to_float(p[0]) + half_to_float(p[1]);
  }
  float finish(int64_t, float dot) const { return dot; }
#if defined(LORAGW_BLOCKED_F32) || defined(LORAGW_INT8_ACTIVATIONS)
  // A row's float16 (d, m) pairs, which the blocked paths apply per block.
  static constexpr int kScales = 2;
  const c10::Half* scales(int64_t n) const { return dm + n * (k / kBlock) * 2; }
#endif
#ifdef LORAGW_INT8_ACTIVATIONS
  // Block b of row n as its 32 q in element order, unsigned bytes.
  static constexpr bool kSigned = false;
  __m256i i8_block(int64_t n, int64_t b) const {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + n * (k / 2) + b * (kBlock / 2)));
    const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(packed), _mm_srli_epi16(packed, 4), 1);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
  }
#endif
#ifdef LORAGW_BLOCKED_F32
  // Block b of row n as float q in four registers (f32_blocks).
  void f32_block(int64_t n, int64_t b, __m256* w) const {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + n * (k / 2) + b * (kBlock / 2)));
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m128i first = _mm_and_si128(packed, low), last = _mm_and_si128(_mm_srli_epi16(packed, 4), low);
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(first));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(first, first)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(last));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(last, last)));
  }
#endif
#ifdef __AVX512BF16__
  // Block b of row n as 32 bfloat16 lanes. d * q + m is rounded to float32
  // once per operation, without a fused multiply-add, as quant_linear.py's
  // dequantize computes it: the float weights' very values, then bfloat16.
  // Used for a row's last block when its count is odd; bf16_block_pair does
  // the rest.
  __m512bh bf16_block(int64_t n, int64_t b) const {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + n * (k / 2) + b * (kBlock / 2)));
    const c10::Half* p = dm + (n * (k / kBlock) + b) * 2;
    const __m512 d = _mm512_set1_ps(half_to_float(p[0])), m = _mm512_set1_ps(half_to_float(p[1]));
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m512 first = _mm512_add_ps(
        _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(packed, low))), d), m);
    const __m512 last = _mm512_add_ps(
        _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(packed, 4), low))), d), m);
    return _mm512_cvtne2ps_pbh(last, first);  // lanes 0-15 from `first`
  }
  // Blocks b and b + 1 of row n into out[0] and out[1], by table: a block
  // holds 16 distinct 4-bit values, so the 16 weights each can take are
  // computed as bf16_block computes them (one vector a block, both tables in
  // one register), and each of the 64 weights is looked up by its nibble
  // (vpermw). Half the 512-bit conversions of bf16_block: on an AMD Zen 4,
  // which runs those in two passes, a 1-row call on the 1536 x 576 gate
  // weight took 52 us against 68 (benchmarks/quant_linear.py, streamed;
  // docs/engine.md has the table). One table a block, looked up on its own,
  // measured no faster than bf16_block on an Intel Xeon.
  static constexpr bool kPairs = true;
  void bf16_block_pair(int64_t n, int64_t b, __m512bh* out) const {
    const __m512 dm4 = _mm512_castps128_ps512(
        _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(dm + (n * (k / kBlock) + b) * 2))));
    const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    auto lane = [&](int i) { return _mm512_permutexvar_ps(_mm512_set1_epi32(i), dm4); };  // d0 m0 d1 m1
    const __m512 first = _mm512_add_ps(_mm512_mul_ps(values, lane(0)), lane(1));
    const __m512 second = _mm512_add_ps(_mm512_mul_ps(values, lane(2)), lane(3));
    __m512i table;
    const __m512bh both_tables = _mm512_cvtne2ps_pbh(second, first);  // words 0-15: block b, 16-31: b + 1
    std::memcpy(&table, &both_tables, sizeof table);
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + n * (k / 2) + b * (kBlock / 2)));
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(packed, low), hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
    const __m256i idx0 = _mm256_permute2x128_si256(lo, hi, 0x20);  // block b: its low nibbles, then its high
    const __m256i idx1 = _mm256_or_si256(_mm256_permute2x128_si256(lo, hi, 0x31), _mm256_set1_epi8(16));
    const __m512i w0 = _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(idx0), table);
    const __m512i w1 = _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(idx1), table);
    std::memcpy(out, &w0, sizeof w0);
    std::memcpy(out + 1, &w1, sizeof w1);
  }
#endif
};

struct Q80Rows {
  const int8_t* q;
  const c10::Half* d;
  int64_t k;
  fvec load(int64_t n, int64_t h) const {
    return widen(q + n * k + h) * half_to_float(d[n * (k / kBlock) + h / kBlock]);
  }
  float finish(int64_t, float dot) const { return dot; }
#if defined(LORAGW_BLOCKED_F32) || defined(LORAGW_INT8_ACTIVATIONS)
  static constexpr int kScales = 1;  // d alone
  const c10::Half* scales(int64_t n) const { return d + n * (k / kBlock); }
#endif
#ifdef LORAGW_INT8_ACTIVATIONS
  static constexpr bool kSigned = true;
  __m256i i8_block(int64_t n, int64_t b) const {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + n * k + b * kBlock));
  }
#endif
#ifdef LORAGW_BLOCKED_F32
  void f32_block(int64_t n, int64_t b, __m256* w) const {
    const int8_t* p = q + n * k + b * kBlock;
    for (int i = 0; i < 4; ++i)
      w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i))));
  }
#endif
#ifdef __AVX512BF16__
  __m512bh bf16_block(int64_t n, int64_t b) const {
    const int8_t* p = q + n * k + b * kBlock;
    const __m512 scale = _mm512_set1_ps(half_to_float(d[n * (k / kBlock) + b]));
    const __m512 first = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))), scale);
    const __m512 last = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))), scale);
    return _mm512_cvtne2ps_pbh(last, first);
  }
  static constexpr bool kPairs = false;
#endif
};

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

#ifdef LORAGW_Q41_INTERLEAVED
// Q4_1 with float32 activations on AVX2 and AVX-512, the weight rows
// interleaved 8 at a time (q4_1_interleave below): lanes run over 8 weight
// rows (16, two groups, with AVX-512), not along K.
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

#ifdef __AVX512BF16__
// The blocked formats (Q4_1, Q8_0) with bfloat16 activations, where the CPU
// has AVX512-BF16: a thread dequantizes each weight tile once, to bfloat16, and multiplies it by every
// token row with bfloat16 dot products (float32 sums of bfloat16 pairs, as
// oneDNN's bfloat16 GEMM on such a CPU). The loop above widens a weight once
// per 4 token rows, and once per row for the rows past a multiple of 4, so it
// lost to oneDNN above 8 rows; this path beats the loop from one row and
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
// on). There oneDNN's packed bfloat16 product beat the loop above from 2
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

// Checks what both formats share: x [M, K] (K a multiple of 32) and out
// [M, N] of one float dtype with unit column stride, an optional contiguous
// bias [N].
bool activations_ok(const torch::Tensor& x, const c10::optional<torch::Tensor>& bias, const torch::Tensor& out) {
  const auto dtype = x.scalar_type();
  bool ok = x.dim() == 2 && out.dim() == 2 && x.device().is_cpu() && (dtype == at::kFloat || dtype == at::kBFloat16) &&
            out.scalar_type() == dtype && x.stride(1) == 1 && out.stride(1) == 1 && x.size(1) % kBlock == 0;
  if (bias.has_value()) ok = ok && bias->scalar_type() == dtype && bias->dim() == 1 && bias->is_contiguous();
  return ok;
}

// The calls that stay on the calling thread: fewer multiply-adds than
// `tiles` on the bfloat16 dot-product tiles, than `widening` on a path that
// widens each weight in software, whose multiply-adds take about twice as
// long, than `amx` on the tiles' AMX path, counted over the token rows
// padded to whole 16-row tiles, than `lanes16` on float32 Q4_1's
// interleaved copy in 16 lanes of full width (interleaved_min_rows)
// (engine/model/quant_linear.py: where idle threads sleep, waking one costs
// more than it saves there). Only this build knows which path a call takes,
// so the limit is chosen here.
struct SerialMacs {
  int64_t tiles, widening, amx, lanes16;
};

// out [M, N] and bias [N] against x [M, K] and the weight's n rows.
void check_out_and_bias(const torch::Tensor& x, int64_t n, const c10::optional<torch::Tensor>& bias,
                        const torch::Tensor& out) {
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == n, "quant linear: x ", x.sizes(), ", out ", out.sizes());
  TORCH_CHECK(!bias.has_value() || bias->size(0) == n, "quant linear: bias ", bias->sizes());
}

// `min_rows` for a path that widens each weight in software.
int64_t widening_min_rows(int64_t macs, SerialMacs serial) {
  return macs < serial.widening ? kOneThread : kMinRows;
}

#ifdef LORAGW_Q41_INTERLEAVED
// `min_rows` for float32 Q4_1 calls on the interleaved copy. In 16 lanes on
// 512-bit units of full width a weight is widened once for all the token
// rows, and one thread runs a call about twice as fast as the software
// widening that `widening` was timed on (float32 Q4_1 before the copy), so
// one thread holds its own longer: on a 2-core Zen 5, weights streamed as a
// step streams them, one thread tied with two at about 7 to 13 x 10^6
// multiply-adds on the layer shapes (3.5 to 7 on the widest, gate_up), and
// under `lanes16` a layer's four calls at 4 to 24 rows took 0.88-0.98x
// their time under `widening` (docs/engine.md, "Float32 Q4_1 in 16 lanes,
// on one thread longer"). Intel's full-width units take it too, timed
// there in the offline engine only (an Emerald Rapids guest: no loss on
// the whole, on fewer busy cores); 8 lanes, and Zen 4's halves, keep
// `widening`, untimed.
int64_t interleaved_min_rows(int64_t macs, SerialMacs serial) {
#ifdef __AVX512F__
  if (!halves_512()) return macs < serial.lanes16 ? kOneThread : kMinRows;
#endif
  return widening_min_rows(macs, serial);
}
#endif

// `min_rows` for the bfloat16 tiles of m token rows against n weight rows
// of k. On AMX a tile multiply-add takes 16 token rows whatever the call
// has, and dequantizing the weights, which every call does once whatever
// its rows, costs more than on the vector path: on a 2-core Intel Xeon
// (Emerald Rapids) the vector path's limit kept a one-row call on the
// 1,536 x 576 calibration weight (cpu_linear.CALIBRATION_SHAPE) on one
// thread, 134 us against 94 on two (docs/engine.md, "On AMX, calls of few
// rows on both threads").
#ifdef __AVX512BF16__
int64_t tiles_min_rows(int64_t m, int64_t n, int64_t k, SerialMacs serial) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (amx_ready()) {
    const int64_t padded = (m + kAmxTokens - 1) / kAmxTokens * kAmxTokens;
    return padded * n * k < serial.amx ? kOneThread : kMinRows;
  }
#endif
  return m * n * k < serial.tiles ? kOneThread : kMinRows;
}
#endif

// `int8_activations`: float32 activations rounded to int8 (int8_blocks),
// for the blocked formats where this build has that path; the caller asks
// `int8_activations_built` first.
template <typename Rows>
void dispatch(const torch::Tensor& x, const Rows& rows, int64_t n, const c10::optional<torch::Tensor>& bias,
              torch::Tensor& out, SerialMacs serial, bool int8_activations = false) {
  check_out_and_bias(x, n, bias, out);
  const int64_t macs = x.size(0) * n * x.size(1);
  const int64_t min_rows = widening_min_rows(macs, serial);
  if (x.scalar_type() == at::kFloat) {
#ifdef LORAGW_INT8_ACTIVATIONS
    if constexpr (!std::is_same_v<Rows, Int8Rows>) {
      if (int8_activations) {
        int8_blocks(x.data_ptr<float>(), x.stride(0), x.size(0), rows, n, x.size(1),
                    bias.has_value() ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>(), out.stride(0), min_rows);
        return;
      }
    }
#endif
#ifdef LORAGW_BLOCKED_F32
    if constexpr (!std::is_same_v<Rows, Int8Rows>) {
      f32_blocks(x.data_ptr<float>(), x.stride(0), x.size(0), rows, n, x.size(1),
                 bias.has_value() ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>(), out.stride(0), min_rows);
      return;
    }
#endif
#ifdef __AVX512F__
    if (x.size(0) > kF32TileRows) {
      f32_tiles(x.data_ptr<float>(), x.stride(0), x.size(0), rows, n, x.size(1),
                bias.has_value() ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>(), out.stride(0), min_rows);
      return;
    }
#endif
    linear_impl<float>(x.data_ptr<float>(), x.stride(0), x.size(0), rows, n, x.size(1),
                       bias.has_value() ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>(), out.stride(0), min_rows);
  } else {
    using bf16 = c10::BFloat16;
#ifdef __AVX512BF16__
    if constexpr (!std::is_same_v<Rows, Int8Rows>) {  // the blocked formats
      bf16_tiles(x.data_ptr<bf16>(), x.stride(0), x.size(0), rows, n, x.size(1), out.data_ptr<bf16>(),
                 out.stride(0), tiles_min_rows(x.size(0), n, x.size(1), serial));
      if (bias.has_value()) out.add_(*bias);  // rounded twice, as the loop above
      return;
    }
#endif
    linear_impl<bf16>(x.data_ptr<bf16>(), x.stride(0), x.size(0), rows, n, x.size(1),
                      bias.has_value() ? bias->data_ptr<bf16>() : nullptr, out.data_ptr<bf16>(), out.stride(0), min_rows);
  }
}

}  // namespace

// Whether this build rounds float32 activations to int8 for the blocked
// formats (an AVX2 host).
bool int8_activations_built() {
#ifdef LORAGW_INT8_ACTIVATIONS
  return true;
#else
  return false;
#endif
}

// Int8 activations are float32 ones rounded, on a build that has the path.
bool int8_activations_ok(const torch::Tensor& x, bool int8_activations) {
  return !int8_activations || (int8_activations_built() && x.scalar_type() == at::kFloat);
}

// x [M, K] float32|bfloat16 with K % 32 == 0, q [N, K] int8, scale [N] float32, bias [N] or
// none, out [M, N] in x's dtype. False (nothing done) for tensors this kernel
// does not take, so the caller uses the torch twin.
bool int8_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                 const c10::optional<torch::Tensor>& bias, torch::Tensor& out, int64_t serial_macs_tiles,
                 int64_t serial_macs_widening, int64_t serial_macs_amx, int64_t serial_macs_lanes16) {
  if (!activations_ok(x, bias, out) || q.scalar_type() != at::kChar || !q.is_contiguous() ||
      scale.scalar_type() != at::kFloat || !scale.is_contiguous())
    return false;
  TORCH_CHECK(q.dim() == 2 && q.size(1) == x.size(1) && scale.numel() == q.size(0),
              "int8_linear: x ", x.sizes(), ", q ", q.sizes(), ", scale ", scale.sizes());
  dispatch(x, Int8Rows{q.data_ptr<int8_t>(), scale.data_ptr<float>(), q.size(1)}, q.size(0), bias, out,
           SerialMacs{serial_macs_tiles, serial_macs_widening, serial_macs_amx, serial_macs_lanes16});
  return true;
}

// Whether float32 Q4_1 calls in this build take the weight interleaved
// (q4_1_interleave; interleaved_f32): AVX2 hosts, AVX-512 ones included.
bool q4_1_interleaves() {
#ifdef LORAGW_Q41_INTERLEAVED
  return true;
#else
  return false;
#endif
}

// The fewest token rows for which a float32 Q4_1 call takes the panel on
// this host, where q4_1_interleaves(); 0 elsewhere.
int64_t q4_1_panel_min_rows() {
#ifdef LORAGW_Q41_INTERLEAVED
  return panel_min_rows();
#else
  return 0;
#endif
}

// q [N, K / 2] uint8 and dm [N, K / 32, 2] float16 (q4_1_linear's) -> the
// same values with the rows interleaved 8 at a time (Q41Interleaved): nib
// [N / 8, K / 32, 16, 8] uint8 and dm [N / 8, K / 32, 2, 8] float16.
// N must be a multiple of 8.
std::vector<torch::Tensor> q4_1_interleave(const torch::Tensor& q, const torch::Tensor& dm) {
  TORCH_CHECK(q.scalar_type() == at::kByte && q.dim() == 2 && dm.scalar_type() == at::kHalf && dm.dim() == 3 &&
                  dm.size(0) == q.size(0) && dm.size(1) * (kBlock / 2) == q.size(1) && dm.size(2) == 2 &&
                  q.size(0) % 8 == 0,
              "q4_1_interleave: q ", q.sizes(), ", dm ", dm.sizes());
  const int64_t n = q.size(0), blocks = dm.size(1);
  // byte (g, b, i, r) = q[8 g + r, b, i]: the row's block bytes already pair
  // element i (low nibble) with 16 + i (high).
  auto nib = q.view({n / 8, 8, blocks, kBlock / 2}).permute({0, 2, 3, 1}).contiguous();
  auto dmi = dm.view({n / 8, 8, blocks, 2}).permute({0, 2, 3, 1}).contiguous();
  return {nib, dmi};
}

// x [M, K] float32|bfloat16 with K % 32 == 0, q [N, K / 2] uint8, dm
// [N, K / 32, 2] float16, bias [N] or none, out [M, N] in x's dtype.
// `interleaved`: q4_1_interleave(q, dm), which float32 calls without int8
// activations take where q4_1_interleaves(); none, or empty, elsewhere.
bool q4_1_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& dm,
                 const c10::optional<torch::Tensor>& bias, torch::Tensor& out, bool int8_activations,
                 int64_t serial_macs_tiles, int64_t serial_macs_widening, int64_t serial_macs_amx,
                 int64_t serial_macs_lanes16, const std::vector<torch::Tensor>& interleaved) {
  if (!activations_ok(x, bias, out) || !int8_activations_ok(x, int8_activations) || q.scalar_type() != at::kByte ||
      !q.is_contiguous() || dm.scalar_type() != at::kHalf || !dm.is_contiguous())
    return false;
  const int64_t k = x.size(1);
  const SerialMacs serial{serial_macs_tiles, serial_macs_widening, serial_macs_amx, serial_macs_lanes16};
  TORCH_CHECK(q.dim() == 2 && q.size(1) * 2 == k && dm.dim() == 3 && dm.size(0) == q.size(0) &&
                  dm.size(1) * kBlock == k && dm.size(2) == 2,
              "q4_1_linear: x ", x.sizes(), ", q ", q.sizes(), ", dm ", dm.sizes());
#ifdef LORAGW_Q41_INTERLEAVED
  if (!interleaved.empty() && x.scalar_type() == at::kFloat && !int8_activations) {
    const int64_t n = q.size(0), blocks = k / kBlock;
    TORCH_CHECK(interleaved.size() == 2 && n % 8 == 0, "q4_1_linear: ", interleaved.size(),
                " interleaved tensors for q ", q.sizes());
    const auto& nib = interleaved[0];
    const auto& dmi = interleaved[1];
    TORCH_CHECK(nib.scalar_type() == at::kByte && nib.is_contiguous() &&
                    nib.sizes() == at::IntArrayRef({n / 8, blocks, kBlock / 2, 8}) &&
                    dmi.scalar_type() == at::kHalf && dmi.is_contiguous() &&
                    dmi.sizes() == at::IntArrayRef({n / 8, blocks, 2, 8}),
                "q4_1_linear: interleaved ", nib.sizes(), ", ", dmi.sizes(), " for q ", q.sizes());
    check_out_and_bias(x, n, bias, out);
    interleaved_f32(x.data_ptr<float>(), x.stride(0), x.size(0),
                    Q41Interleaved{nib.data_ptr<uint8_t>(), dmi.data_ptr<c10::Half>(), blocks}, n, k,
                    bias.has_value() ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>(), out.stride(0),
                    interleaved_min_rows(x.size(0) * n * k, serial));
    return true;
  }
#endif
  dispatch(x, Q41Rows{q.data_ptr<uint8_t>(), dm.data_ptr<c10::Half>(), k}, q.size(0), bias, out, serial,
           int8_activations);
  return true;
}

// x [M, K] float32|bfloat16 with K % 32 == 0, q [N, K] int8, d [N, K / 32]
// float16, bias [N] or none, out [M, N] in x's dtype.
bool q8_0_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& d,
                 const c10::optional<torch::Tensor>& bias, torch::Tensor& out, bool int8_activations,
                 int64_t serial_macs_tiles, int64_t serial_macs_widening, int64_t serial_macs_amx,
                 int64_t serial_macs_lanes16) {
  if (!activations_ok(x, bias, out) || !int8_activations_ok(x, int8_activations) || q.scalar_type() != at::kChar || !q.is_contiguous() ||
      d.scalar_type() != at::kHalf || !d.is_contiguous())
    return false;
  const int64_t k = x.size(1);
  TORCH_CHECK(q.dim() == 2 && q.size(1) == k && d.dim() == 2 && d.size(0) == q.size(0) && d.size(1) * kBlock == k,
              "q8_0_linear: x ", x.sizes(), ", q ", q.sizes(), ", d ", d.sizes());
  dispatch(x, Q80Rows{q.data_ptr<int8_t>(), d.data_ptr<c10::Half>(), k}, q.size(0), bias, out,
           SerialMacs{serial_macs_tiles, serial_macs_widening, serial_macs_amx, serial_macs_lanes16}, int8_activations);
  return true;
}

// Whether the blocked formats' bfloat16 tiles run on AMX in this process.
bool uses_amx() {
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return amx_ready();
#else
  return false;
#endif
}

// Whether a bfloat16 call of the blocked formats, m token rows against n
// weight rows of k, stays on the calling thread under these limits, on the
// path this build and CPU take (tiles_min_rows). Only with AVX512-BF16.
bool bf16_tiles_on_one_thread(int64_t m, int64_t n, int64_t k, int64_t serial_macs_tiles, int64_t serial_macs_amx) {
#ifdef __AVX512BF16__
  return tiles_min_rows(m, n, k, SerialMacs{serial_macs_tiles, 0, serial_macs_amx, 0}) == kOneThread;
#else
  TORCH_CHECK(false, "bf16_tiles_on_one_thread: this build has no bfloat16 tiles (no AVX512-BF16)");
#endif
}

// Whether a float32 Q4_1 call on the interleaved copy, m token rows against
// n weight rows of k, stays on the calling thread under these limits, on
// this build and CPU (interleaved_min_rows). Only where q4_1_interleaves().
bool interleaved_on_one_thread(int64_t m, int64_t n, int64_t k, int64_t serial_macs_widening,
                               int64_t serial_macs_lanes16) {
#ifdef LORAGW_Q41_INTERLEAVED
  return interleaved_min_rows(m * n * k, SerialMacs{0, serial_macs_widening, 0, serial_macs_lanes16}) == kOneThread;
#else
  TORCH_CHECK(false, "interleaved_on_one_thread: this build has no interleaved Q4_1 path (no AVX2)");
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("uses_amx", &uses_amx, "uses_amx");
  m.def("bf16_tiles_on_one_thread", &bf16_tiles_on_one_thread, "bf16_tiles_on_one_thread");
  m.def("interleaved_on_one_thread", &interleaved_on_one_thread, "interleaved_on_one_thread");
  m.def("int8_activations_built", &int8_activations_built, "int8_activations_built");
  m.def("q4_1_interleaves", &q4_1_interleaves, "q4_1_interleaves");
  m.def("q4_1_panel_min_rows", &q4_1_panel_min_rows, "q4_1_panel_min_rows");
  m.def("q4_1_interleave", torch::wrap_pybind_function_no_gil(q4_1_interleave), "q4_1_interleave");
  // Without the GIL, as torch's own ops and the prefill kernel (cpu_prefill.cpp says why).
  m.def("int8_linear", torch::wrap_pybind_function_no_gil(int8_linear), "int8_linear");
  m.def("q4_1_linear", torch::wrap_pybind_function_no_gil(q4_1_linear), "q4_1_linear");
  m.def("q8_0_linear", torch::wrap_pybind_function_no_gil(q8_0_linear), "q8_0_linear");
}
