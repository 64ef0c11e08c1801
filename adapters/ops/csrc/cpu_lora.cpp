// A whole LoRA projection on the CPU: the shrink, then the expand of every
// slice, added into the packed output. Why, and the layout it wants:
// adapters/ops/cpu_ops.py.
#include "vector_helpers.h"  // native/csrc/, copied beside this file for the build (native/__init__.py)

namespace {

constexpr int64_t kTokenBlock = 16;  // tokens of one segment per work item

// out_j[c] += sum_r y_j[r] * b[r * ldb + c] for JB rows, c < n_out. The sum
// starts from out's value and is rounded to T once.
template <typename T, int JB>
void expand_rows(const float* y, int64_t y_stride, int64_t rank, const T* b, int64_t ldb, int64_t n_out,
                 T* out, int64_t out_stride) {
  const int64_t full = n_out / kLanes * kLanes;
  for (int64_t c = 0; c < full; c += kLanes) {
    f32x16 acc[JB];
    for (int jj = 0; jj < JB; ++jj) acc[jj] = load16(out + jj * out_stride + c);
    for (int64_t r = 0; r < rank; ++r) {
      const f32x16 bv = load16(b + r * ldb + c);
      for (int jj = 0; jj < JB; ++jj) acc[jj] += y[jj * y_stride + r] * bv;
    }
    for (int jj = 0; jj < JB; ++jj) store16(out + jj * out_stride + c, acc[jj]);
  }
  for (int64_t c = full; c < n_out; ++c) {
    for (int jj = 0; jj < JB; ++jj) {
      float v = static_cast<float>(out[jj * out_stride + c]);
      for (int64_t r = 0; r < rank; ++r) v += y[jj * y_stride + r] * static_cast<float>(b[r * ldb + c]);
      out[jj * out_stride + c] = static_cast<T>(v);
    }
  }
}

struct Slice {
  const void* b;  // slot 0's B, rank-major: element (c, r) at c + r * ldb
  int64_t slot_stride, ldb, n_out, offset;
};

template <typename T>
void apply_impl(const T* x, int64_t x_stride, const T* a, int64_t a_slot_stride, int64_t nk, int64_t h_in,
                const std::vector<Slice>& slices, int64_t rank, T* out, int64_t out_stride,
                const std::vector<int64_t>& starts, const std::vector<int64_t>& lens,
                const std::vector<int64_t>& slots, bool serial) {
  struct Item { int64_t start, count, slot; };
  std::vector<Item> items;
  for (size_t s = 0; s < starts.size(); ++s)
    for (int64_t j = 0; j < lens[s]; j += kTokenBlock)
      items.push_back({starts[s] + j, std::min(kTokenBlock, lens[s] - j), slots[s]});
  const int64_t num_items = static_cast<int64_t>(items.size());
  // A grain of every item keeps the call on this thread (no parallel region).
  at::parallel_for(0, num_items, serial ? num_items : 1, [&](int64_t begin, int64_t end) {
    std::vector<float> y(kTokenBlock * nk);
    for (int64_t i = begin; i < end; ++i) {
      const Item& it = items[i];
      const T* xs = x + it.start * x_stride;
      const T* as = a + it.slot * a_slot_stride;
      int64_t j = 0;
      for (; j + 4 <= it.count; j += 4) dot_rows<T, 4, 4>(xs + j * x_stride, x_stride, as, nk, h_in, &y[j * nk], nk);
      for (; j < it.count; ++j) dot_rows<T, 1, 16>(xs + j * x_stride, x_stride, as, nk, h_in, &y[j * nk], nk);
      for (size_t si = 0; si < slices.size(); ++si) {
        const Slice& sl = slices[si];
        const T* bs = static_cast<const T*>(sl.b) + it.slot * sl.slot_stride;
        T* os = out + it.start * out_stride + sl.offset;
        const float* ys = &y[si * rank];
        j = 0;
        for (; j + 4 <= it.count; j += 4)
          expand_rows<T, 4>(ys + j * nk, nk, rank, bs, sl.ldb, sl.n_out, os + j * out_stride, out_stride);
        for (; j < it.count; ++j)
          expand_rows<T, 1>(ys + j * nk, nk, rank, bs, sl.ldb, sl.n_out, os + j * out_stride, out_stride);
      }
    }
  });
}

}  // namespace

// The whole projection, or false (nothing done) when the tensors are not
// ones this kernel handles, so the caller uses the torch twin. Inconsistent
// arguments (the ops contract broken) raise. A batch of fewer than
// `parallel_tokens` tokens runs on the calling thread alone.
bool lora_apply(const torch::Tensor& x, const torch::Tensor& lora_a, const std::vector<torch::Tensor>& lora_b,
                const std::vector<int64_t>& offsets, const torch::Tensor& seg_starts,
                const torch::Tensor& seg_lens, const torch::Tensor& seg_slots, torch::Tensor& out,
                int64_t parallel_tokens) {
  TORCH_CHECK(x.dim() == 2 && lora_a.dim() == 3 && out.dim() == 2, "x, lora_a, out: 2, 3, 2 dims");
  TORCH_CHECK(!lora_b.empty() && lora_b.size() == offsets.size(), "one offset per B slice");
  const auto dtype = x.scalar_type();
  bool ok = x.device().is_cpu() && (dtype == at::kFloat || dtype == at::kBFloat16) &&
            lora_a.scalar_type() == dtype && out.scalar_type() == dtype && x.stride(1) == 1 &&
            out.stride(1) == 1 && lora_a.is_contiguous();
  for (const auto& b : lora_b) ok = ok && b.dim() == 3 && b.scalar_type() == dtype && b.stride(1) == 1;
  for (const auto* t : {&seg_starts, &seg_lens, &seg_slots})
    ok = ok && t->device().is_cpu() && t->scalar_type() == at::kInt && t->is_contiguous();
  if (!ok) return false;

  const int64_t num_tokens = x.size(0), num_slots = lora_a.size(0), nk = lora_a.size(1), h_in = lora_a.size(2);
  const int64_t rank = lora_b[0].size(2);
  TORCH_CHECK(h_in == x.size(1), "lora_a ", lora_a.sizes(), " does not read x ", x.sizes());
  TORCH_CHECK(out.size(0) == num_tokens, "out ", out.sizes(), " and x ", x.sizes(), " differ in tokens");
  TORCH_CHECK(rank * static_cast<int64_t>(lora_b.size()) == nk, "lora_a's ", nk, " rank rows are not ",
              lora_b.size(), " slices of rank ", rank);
  std::vector<Slice> slices;
  for (size_t i = 0; i < lora_b.size(); ++i) {
    const auto& b = lora_b[i];
    TORCH_CHECK(b.size(0) == num_slots && b.size(2) == rank, "B slice ", b.sizes(), " does not fit lora_a ",
                lora_a.sizes());
    TORCH_CHECK(offsets[i] >= 0 && offsets[i] + b.size(1) <= out.size(1), "B slice ", b.sizes(), " at column ",
                offsets[i], " overflows out ", out.sizes());
    slices.push_back({b.data_ptr(), b.stride(0), b.stride(2), b.size(1), offsets[i]});
  }
  const int64_t num_segments = seg_starts.numel();
  TORCH_CHECK(seg_lens.numel() == num_segments && seg_slots.numel() == num_segments, "segment arrays differ");
  std::vector<int64_t> starts(num_segments), lens(num_segments), slots(num_segments);
  for (int64_t s = 0; s < num_segments; ++s) {
    starts[s] = seg_starts.data_ptr<int32_t>()[s];
    lens[s] = seg_lens.data_ptr<int32_t>()[s];
    slots[s] = seg_slots.data_ptr<int32_t>()[s];
    TORCH_CHECK(starts[s] >= 0 && lens[s] > 0 && starts[s] + lens[s] <= num_tokens, "segment ", s,
                " is outside the batch");
    TORCH_CHECK(slots[s] >= 0 && slots[s] < num_slots, "segment ", s, "'s slot is past the stack");
  }
  const bool serial = num_tokens < parallel_tokens;
  if (dtype == at::kFloat) {
    apply_impl<float>(x.data_ptr<float>(), x.stride(0), lora_a.data_ptr<float>(), lora_a.stride(0), nk, h_in,
                      slices, rank, out.data_ptr<float>(), out.stride(0), starts, lens, slots, serial);
  } else {
    apply_impl<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), x.stride(0), lora_a.data_ptr<c10::BFloat16>(),
                              lora_a.stride(0), nk, h_in, slices, rank, out.data_ptr<c10::BFloat16>(),
                              out.stride(0), starts, lens, slots, serial);
  }
  return true;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Without the GIL, as torch's own ops and the engine's kernels (engine/csrc/cpu_prefill.cpp says why).
  m.def("lora_apply", torch::wrap_pybind_function_no_gil(lora_apply), "lora_apply");
}
