// quant_linear.cpp's weight formats: the tile and thread constants every
// path shares, the widening of 8-bit lanes to float32, and each format's
// rows (Int8Rows, Q41Rows, Q80Rows), which the paths read blocks through.
// Which paths this build has (the LORAGW_* macros) is decided here, once.
#pragma once

#include "vector_helpers.h"

#include <c10/util/Half.h>
#include <immintrin.h>
#include <limits>
#include <type_traits>

namespace {

constexpr int64_t kRowTile = 16;   // weight rows per tile, as engine/csrc/cpu_linear.cpp
constexpr int64_t kMinRows = 128;  // weight rows per thread: less is not worth a thread's wake-up
// `min_rows` for a call that stays on the calling thread: more rows than any weight has.
constexpr int64_t kOneThread = std::numeric_limits<int64_t>::max();
constexpr int64_t kBlock = 32;     // q4_1 weights per (d, m) pair; K is a multiple of it for both formats

// One register of float32 lanes: 16 with AVX-512 (32 registers), else 8 (an
// AVX2 register; 16 of them). The paths' tiles keep JB * KT accumulators, JB
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
// The blocked float32 path (f32_blocks, quant_linear_f32.h) is written for
// AVX2 and was measured there only; an AVX-512 host keeps the per-vector
// loop.
#if defined(__AVX2__) && defined(__F16C__) && !defined(__AVX512F__)
#define LORAGW_BLOCKED_F32 1
#endif
// Float32 activations rounded to int8 per block of 32 against the blocked
// formats (int8_blocks, quant_linear_int8.h): any AVX2 host, AVX-512 ones
// included.
#if defined(__AVX2__) && defined(__F16C__)
#define LORAGW_INT8_ACTIVATIONS 1
#endif
// Float32 Q4_1 calls on a copy of the weight with its rows interleaved
// (interleaved_f32, quant_linear_interleaved.h): any AVX2 host, AVX-512
// ones included.
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

}  // namespace
