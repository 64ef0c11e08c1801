// The skinny linear kernel: out = x @ w^T (+ bias) for a few token rows,
// each weight row read once per call. Why, and how many rows it takes before
// torch's GEMM: engine/model/cpu_linear.py.
#include "vector_helpers.h"

namespace {

constexpr int64_t kRowTile = 16;    // weight rows per tile: 37 KB of float32 at K = 576, in L1/L2
constexpr int64_t kMinRows = 128;   // weight rows per thread: less is not worth a thread's wake-up

template <typename T>
void linear_impl(const T* x, int64_t x_stride, int64_t m, const T* w, int64_t n, int64_t k,
                 const T* bias, T* out, int64_t out_stride) {
  const int64_t tiles = (n + kRowTile - 1) / kRowTile;
  at::parallel_for(0, tiles, kMinRows / kRowTile, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kRowTile, rows = std::min(kRowTile, n - n0);
      const T* wt = w + n0 * k;
      int64_t j = 0;
      for (; j + 4 <= m; j += 4)
        dot_rows<T, 4, 4>(x + j * x_stride, x_stride, wt, rows, k, out + j * out_stride + n0, out_stride);
      for (; j < m; ++j) dot_rows<T, 1, 16>(x + j * x_stride, x_stride, wt, rows, k, out + j * out_stride + n0, 0);
      if (bias != nullptr) add_bias_tile(out, out_stride, m, bias, n0, rows);
    }
  });
}

}  // namespace

// out = x @ w^T (+ bias), or false (nothing done) for tensors this kernel
// does not handle, so the caller uses torch.
bool skinny_linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                   torch::Tensor& out) {
  const auto dtype = x.scalar_type();
  bool ok = x.dim() == 2 && w.dim() == 2 && out.dim() == 2 && x.device().is_cpu() &&
            (dtype == at::kFloat || dtype == at::kBFloat16) && w.scalar_type() == dtype &&
            out.scalar_type() == dtype && x.stride(1) == 1 && out.stride(1) == 1 && w.is_contiguous();
  if (bias.has_value()) ok = ok && bias->scalar_type() == dtype && bias->dim() == 1 && bias->is_contiguous();
  if (!ok) return false;
  TORCH_CHECK(w.size(1) == x.size(1) && out.size(0) == x.size(0) && out.size(1) == w.size(0),
              "skinny_linear: x ", x.sizes(), ", w ", w.sizes(), ", out ", out.sizes());
  TORCH_CHECK(!bias.has_value() || bias->size(0) == w.size(0), "skinny_linear: bias ", bias->sizes());
  if (dtype == at::kFloat) {
    linear_impl<float>(x.data_ptr<float>(), x.stride(0), x.size(0), w.data_ptr<float>(), w.size(0), w.size(1),
                       bias.has_value() ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>(),
                       out.stride(0));
  } else {
    using bf16 = c10::BFloat16;
    linear_impl<bf16>(x.data_ptr<bf16>(), x.stride(0), x.size(0), w.data_ptr<bf16>(), w.size(0), w.size(1),
                      bias.has_value() ? bias->data_ptr<bf16>() : nullptr, out.data_ptr<bf16>(), out.stride(0));
  }
  return true;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Without the GIL, as torch's own ops and the prefill kernel (cpu_prefill.cpp says why).
  m.def("skinny_linear", torch::wrap_pybind_function_no_gil(skinny_linear), "skinny_linear");
}
