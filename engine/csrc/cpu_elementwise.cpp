// RMSNorm (with the residual add before it) and the rotary embedding, one
// call each instead of the 8 and 7 small torch ops of their twins: at a few
// token rows a decoder layer's time went to dispatching those ops. Why, and
// how the results compare with the twins: engine/model/cpu_elementwise.py.
#include "vector_helpers.h"

// The rotary twin rounds each product before the sum; a fused multiply-add
// would round once and differ from it in float32.
#pragma GCC optimize("fp-contract=off")

namespace {

typedef uint32_t u32x16 __attribute__((vector_size(64)));

// Rows per thread: a row of a few hundred values is ~100 ns of work, less
// than a parallel region costs.
constexpr int64_t kGrainRows = 64;

// The value of T nearest to v (ties to even), as a float: what torch's
// op in T gives before it stores.
template <typename T> inline f32x16 round_to(f32x16 v);
template <> inline f32x16 round_to<float>(f32x16 v) { return v; }
template <> inline f32x16 round_to<c10::BFloat16>(f32x16 v) {
  u32x16 u;
  std::memcpy(&u, &v, sizeof u);
  const u32x16 rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  const u32x16 nan = u32x16{} + 0x7FC00000u;  // c10 turns every NaN into this one
  u = (v != v) ? nan : rounded;
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
               T* out, int64_t out_stride, int64_t rows, int64_t h) {
  const int64_t full = h / kLanes * kLanes;
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
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
                 int64_t d) {
  const int64_t half = d / 2;
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
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

bool rows_ok(const torch::Tensor& t, int64_t rows, int64_t h) {
  return t.device().is_cpu() && t.dim() == 2 && t.size(0) == rows && t.size(1) == h && t.stride(1) == 1;
}

}  // namespace

// out = RMSNorm(x) (after x = residual + x when `residual` is given); false
// where the tensors are not ones it takes (the caller runs the twin).
bool rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps,
              torch::Tensor out) {
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
                 out.stride(0), rows, h);
  } else {
    norm_impl<float>(x.data_ptr<float>(), x.stride(0), residual ? residual->data_ptr<float>() : nullptr,
                     residual ? residual->stride(0) : 0, weight.data_ptr<float>(), (float)eps,
                     out.data_ptr<float>(), out.stride(0), rows, h);
  }
  return true;
}

// out [T, heads, D] = x rotated by cos/sin [T, D]; false where not taken.
bool rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor out) {
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
                   heads, d);
  } else {
    rotary_impl<float>(x.data_ptr<float>(), x.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(),
                       out.data_ptr<float>(), rows, heads, d);
  }
  return true;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "rms_norm", py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"),
        py::arg("out"));
  m.def("rotary", &rotary, "rotary");
}
