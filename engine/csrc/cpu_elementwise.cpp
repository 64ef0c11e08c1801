// RMSNorm (with the residual add before it), the rotary embedding and the
// MLP's SiLU-and-product, one call each instead of the 8, 7 and 3 small torch
// ops of their twins: at a few token rows a decoder layer's time went to
// dispatching those ops. Why, and how the results compare with the twins:
// engine/model/cpu_elementwise.py.
#include <immintrin.h>

#include "vector_helpers.h"

// torch's SiLU takes its exp from SLEEF, which libtorch_cpu exports; calling
// the same function (the one torch's vectorized CPU kernel for this host's
// instruction set calls) makes the SiLU bit-identical to the twin's.
extern "C" {
#if defined(__AVX512F__)
__m512 Sleef_expf16_u10(__m512);
#elif defined(__AVX2__)
__m256 Sleef_expf8_u10(__m256);
#endif
}

// The rotary twin rounds each product before the sum; a fused multiply-add
// would round once and differ from it in float32.
#pragma GCC optimize("fp-contract=off")

namespace {

// Rows per thread: a row of a few hundred values is ~100 ns of work, less
// than a parallel region costs.
constexpr int64_t kGrainRows = 64;

// fn(begin, end) over rows 0 .. rows of row_values values each, at least
// `grain` rows to a thread, or all on the calling thread when the call holds
// fewer than `serial_values` values (engine/model/cpu_elementwise.py: where
// idle threads sleep, the size below which waking one costs more than it
// saves; 0 elsewhere).
template <typename F>
inline void for_rows(int64_t rows, int64_t row_values, int64_t grain, int64_t serial_values, const F& fn) {
  if (rows * row_values < serial_values || rows <= grain) {
    fn(0, rows);
    return;
  }
  at::parallel_for(0, rows, grain, fn);
}

// The value of T nearest to v (ties to even), as a float: what torch's
// op in T gives before it stores.
template <typename T> inline f32x16 round_to(f32x16 v);
template <> inline f32x16 round_to<float>(f32x16 v) { return v; }
template <> inline f32x16 round_to<c10::BFloat16>(f32x16 v) {
  const u32x16 u = bf16_rounded_bits(v);
  f32x16 out;
  std::memcpy(&out, &u, sizeof out);
  return out;
}

inline void store_rounded(float* p, f32x16 v) { store16(p, v); }
inline void store_rounded(c10::BFloat16* p, f32x16 v) {  // v already holds bfloat16 values: keep the top halves
  u32x16 u;
  std::memcpy(&u, &v, sizeof u);
  const Lanes<16>::u16 h = __builtin_convertvector(u >> 16, Lanes<16>::u16);
  std::memcpy(p, &h, sizeof h);
}

template <typename T> inline float to_float(T v) { return static_cast<float>(v); }
template <typename T> inline float round_scalar(float v) { return static_cast<float>(static_cast<T>(v)); }

// x [T, H] rows x_stride apart. With `residual`: x = residual + x first (in
// T, in place), the sum that the layer carries on. out = weight * T(x32 *
// rsqrt(mean(x32^2) + eps)), HF's LlamaRMSNorm op for op; only the sum of
// squares runs in another order than torch's mean.
template <typename T>
void norm_impl(T* x, int64_t x_stride, const T* residual, int64_t r_stride, const T* weight, float eps,
               T* out, int64_t out_stride, int64_t rows, int64_t h, int64_t serial_values) {
  const int64_t full = h / kLanes * kLanes;
  for_rows(rows, h, kGrainRows, serial_values, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * x_stride;
      if (residual != nullptr) {
        const T* rr = residual + r * r_stride;
        int64_t i = 0;
        for (; i < full; i += kLanes) store_rounded(xr + i, round_to<T>(load16(rr + i) + load16(xr + i)));
        for (; i < h; ++i) xr[i] = static_cast<T>(to_float(rr[i]) + to_float(xr[i]));
      }
      f32x16 acc = {};
      int64_t i = 0;
      for (; i < full; i += kLanes) {
        const f32x16 v = load16(xr + i);
        acc += v * v;
      }
      float sq = hsum<kLanes>(acc);
      for (; i < h; ++i) sq += to_float(xr[i]) * to_float(xr[i]);
      const float inv = 1.f / std::sqrt(sq / static_cast<float>(h) + eps);
      T* o = out + r * out_stride;
      i = 0;
      for (; i < full; i += kLanes)
        store_rounded(o + i, round_to<T>(load16(weight + i) * round_to<T>(load16(xr + i) * inv)));
      for (; i < h; ++i) o[i] = static_cast<T>(to_float(weight[i]) * round_scalar<T>(to_float(xr[i]) * inv));
    }
  });
}

// x [T, heads, D] (rows x_stride apart, heads D apart) rotated into out
// [T, heads, D] contiguous: out = x * cos + rotate_half(x) * sin, each
// product and the sum rounded to T, as the twin's three ops round them.
template <typename T>
void rotary_impl(const T* x, int64_t x_stride, const T* cos, const T* sin, T* out, int64_t rows, int64_t heads,
                 int64_t d, int64_t serial_values) {
  const int64_t half = d / 2;
  for_rows(rows, heads * d, kGrainRows, serial_values, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* c = cos + r * d;
      const T* s = sin + r * d;
      for (int64_t hd = 0; hd < heads; ++hd) {
        const T* xh = x + r * x_stride + hd * d;
        T* o = out + (r * heads + hd) * d;
        for (int64_t i = 0; i < half; i += kLanes) {
          const f32x16 lo = load16(xh + i), hi = load16(xh + half + i);
          const f32x16 a = round_to<T>(lo * load16(c + i)) + round_to<T>(-hi * load16(s + i));
          const f32x16 b = round_to<T>(hi * load16(c + half + i)) + round_to<T>(lo * load16(s + half + i));
          store_rounded(o + i, round_to<T>(a));
          store_rounded(o + half + i, round_to<T>(b));
        }
      }
    }
  });
}

// e^v per lane, as torch's vectorized float exp computes it on this host.
inline f32x16 torch_exp(f32x16 v) {
#if defined(__AVX512F__)
  __m512 r;
  std::memcpy(&r, &v, sizeof r);
  r = Sleef_expf16_u10(r);
  std::memcpy(&v, &r, sizeof v);
#elif defined(__AVX2__)
  __m256 halves[2];
  std::memcpy(halves, &v, sizeof halves);
  halves[0] = Sleef_expf8_u10(halves[0]);
  halves[1] = Sleef_expf8_u10(halves[1]);
  std::memcpy(&v, halves, sizeof v);
#else  // torch's portable vector: std::exp lane by lane
  float lanes[kLanes];
  std::memcpy(lanes, &v, sizeof lanes);
  for (float& lane : lanes) lane = std::exp(lane);
  std::memcpy(&v, lanes, sizeof v);
#endif
  return v;
}

// The bfloat16 SiLU by lookup: table[b] = bfloat16(silu(b)) for each of the
// 65,536 bfloat16 bit patterns b, made by torch's own F.silu
// (engine/model/cpu_elementwise.py), so exact by construction, and ~1.7x
// the formula's speed here (a gather against an exp and a division).
inline f32x16 lookup16(const uint16_t* table, const c10::BFloat16* p) {
  Lanes<16>::u16 h;
  std::memcpy(&h, p, sizeof h);
  u32x16 idx = __builtin_convertvector(h, u32x16), got;
#if defined(__AVX512F__)
  __m512i i;
  std::memcpy(&i, &idx, sizeof i);
  // 4 bytes from table + 2 * index: the entry in the low half (the table
  // has one entry of padding past its end for the last index).
  const __m512i v = _mm512_i32gather_epi32(i, table, 2);
  std::memcpy(&got, &v, sizeof got);
#else
  for (int l = 0; l < kLanes; ++l) got[l] = table[idx[l]];
#endif
  got = got << 16;
  f32x16 out;
  std::memcpy(&out, &got, sizeof out);
  return out;
}

// silu of 16 gate values as the twin's F.silu gives them (gate / (1 +
// exp(-gate)) in float32, rounded to T), or from `table` (bfloat16 only,
// built by the vector op).
template <typename T>
inline f32x16 silu16(const T* gate, const uint16_t* table) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (table != nullptr) return lookup16(table, gate);
  }
  const f32x16 g = load16(gate);
  return round_to<T>(g / (1.f + torch_exp(-g)));
}

// torch's elementwise loops run the vector op two vectors at a time and the
// scalar op (std::exp here) on the rest of a row: values past the last
// whole pair of vectors are computed as its scalar op computes them.
template <typename T>
constexpr int64_t torch_vector_span() {
#if defined(__AVX512F__)
  return 2 * 64 / sizeof(T);
#else
  return 2 * 32 / sizeof(T);
#endif
}

template <typename T>
inline float silu1(T gate) {
  const float g = to_float(gate);
  return round_scalar<T>(g / (1.f + std::exp(-g)));
}

// x [T, 2n] (rows x_stride apart): gate in columns 0..n, up in n..2n; out
// [T, n] = T(silu(gate) * up), the twin's product rounded as it rounds it.
template <typename T>
void silu_mul_impl(const T* x, int64_t x_stride, const uint16_t* table, T* out, int64_t rows, int64_t n,
                   int64_t serial_values) {
  const int64_t full = n / torch_vector_span<T>() * torch_vector_span<T>();
  // torch's elementwise ops split at 32768 values a thread; the same here.
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1));
  for_rows(rows, n, grain, serial_values, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * x_stride;
      const T* up = gate + n;
      T* o = out + r * n;
      int64_t i = 0;
      for (; i < full; i += kLanes) store_rounded(o + i, round_to<T>(silu16(gate + i, table) * load16(up + i)));
      for (; i < n; ++i) o[i] = static_cast<T>(silu1(gate[i]) * to_float(up[i]));
    }
  });
}

bool rows_ok(const torch::Tensor& t, int64_t rows, int64_t h) {
  return t.device().is_cpu() && t.dim() == 2 && t.size(0) == rows && t.size(1) == h && t.stride(1) == 1;
}

}  // namespace

// out = RMSNorm(x) (after x = residual + x when `residual` is given); false
// where the tensors are not ones it takes (the caller runs the twin).
bool rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps,
              torch::Tensor out, int64_t serial_values) {
  if (x.dim() != 2) return false;
  const int64_t rows = x.size(0), h = x.size(1);
  const auto dtype = x.scalar_type();
  if (!rows_ok(x, rows, h) || !rows_ok(out, rows, h) || out.scalar_type() != dtype ||
      weight.scalar_type() != dtype || !weight.is_contiguous() || weight.numel() != h ||
      (dtype != at::kFloat && dtype != at::kBFloat16))
    return false;
  if (residual.has_value() && (!rows_ok(*residual, rows, h) || residual->scalar_type() != dtype)) return false;
  const bool bf16 = dtype == at::kBFloat16;
  if (bf16) {
    typedef c10::BFloat16 B;
    norm_impl<B>(x.data_ptr<B>(), x.stride(0), residual ? residual->data_ptr<B>() : nullptr,
                 residual ? residual->stride(0) : 0, weight.data_ptr<B>(), (float)eps, out.data_ptr<B>(),
                 out.stride(0), rows, h, serial_values);
  } else {
    norm_impl<float>(x.data_ptr<float>(), x.stride(0), residual ? residual->data_ptr<float>() : nullptr,
                     residual ? residual->stride(0) : 0, weight.data_ptr<float>(), (float)eps,
                     out.data_ptr<float>(), out.stride(0), rows, h, serial_values);
  }
  return true;
}

// out [T, heads, D] = x rotated by cos/sin [T, D]; false where not taken.
bool rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor out, int64_t serial_values) {
  if (x.dim() != 3 || !x.device().is_cpu()) return false;
  const int64_t rows = x.size(0), heads = x.size(1), d = x.size(2);
  const auto dtype = x.scalar_type();
  if ((dtype != at::kFloat && dtype != at::kBFloat16) || d % (2 * kLanes) != 0 || x.stride(2) != 1 ||
      x.stride(1) != d || !cos.is_contiguous() || !sin.is_contiguous() || !out.is_contiguous() ||
      cos.numel() != rows * d || sin.numel() != rows * d || out.numel() != rows * heads * d ||
      cos.scalar_type() != dtype || sin.scalar_type() != dtype || out.scalar_type() != dtype)
    return false;
  if (dtype == at::kBFloat16) {
    typedef c10::BFloat16 B;
    rotary_impl<B>(x.data_ptr<B>(), x.stride(0), cos.data_ptr<B>(), sin.data_ptr<B>(), out.data_ptr<B>(), rows,
                   heads, d, serial_values);
  } else {
    rotary_impl<float>(x.data_ptr<float>(), x.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(),
                       out.data_ptr<float>(), rows, heads, d, serial_values);
  }
  return true;
}

// out [T, n] = silu(x[:, :n]) * x[:, n:]; false where not taken. `table`:
// the bfloat16 SiLU by bit pattern (65,537 entries, the last padding), or
// None to compute it.
bool silu_mul(torch::Tensor x, torch::Tensor out, c10::optional<torch::Tensor> table, int64_t serial_values) {
  if (x.dim() != 2 || !x.device().is_cpu() || x.size(1) % 2 != 0) return false;
  const int64_t rows = x.size(0), n = x.size(1) / 2;
  const auto dtype = x.scalar_type();
  if ((dtype != at::kFloat && dtype != at::kBFloat16) || !rows_ok(x, rows, 2 * n) || !out.is_contiguous() ||
      !rows_ok(out, rows, n) || out.scalar_type() != dtype)
    return false;
  const uint16_t* lookup = nullptr;
  if (table.has_value()) {
    if (dtype != at::kBFloat16 || table->scalar_type() != at::kShort || !table->is_contiguous() ||
        table->numel() != 65537)
      return false;
    lookup = reinterpret_cast<const uint16_t*>(table->data_ptr());
  }
  if (dtype == at::kBFloat16) {
    typedef c10::BFloat16 B;
    silu_mul_impl<B>(x.data_ptr<B>(), x.stride(0), lookup, out.data_ptr<B>(), rows, n, serial_values);
  } else {
    silu_mul_impl<float>(x.data_ptr<float>(), x.stride(0), nullptr, out.data_ptr<float>(), rows, n, serial_values);
  }
  return true;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Without the GIL, as torch's own ops and the prefill kernel (cpu_prefill.cpp says why).
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("rms_norm", &rms_norm, "rms_norm", py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"),
        py::arg("out"), py::arg("serial_values"), no_gil);
  m.def("rotary", &rotary, "rotary", no_gil);
  m.def("silu_mul", &silu_mul, "silu_mul", no_gil);
}
