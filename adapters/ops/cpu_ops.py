"""The CPU backend of the LoRA ops: one small C++ kernel for a whole LoRA
projection (shrink, then the expand of every slice), over the torch twin.

Why a kernel: in a decode step each adapter has a token or a few, so the
work per adapter is a handful of matrix-vector products over its weights.
In torch that is a dozen small ops per packed projection (gathers, a `bmm`
per op, index adds), each with its own dispatch and a pass over memory, and
a 32-adapter decode step spent as long in them as in the base model's
matmuls. The kernel reads each segment's A and B once, keeps the shrink
result in registers and L1, and adds the deltas straight into the packed
output. What remains is the unavoidable part: streaming the active adapters'
weights from memory once per step.

Layout: the kernel wants the B stacks rank-major (each slot's B stored as
`[R, H_out]`, so a 16-wide column block is one vector load per rank row).
The ops contract still speaks of `[num_slots, H_out, R]`: such a B is that
shape's transposed view, `stride(1) == 1`. `rank_major_b` tells the slot
manager to allocate it so. With B in any other layout, float16 tensors, or
no kernel (no compiler, or LORAGW_CPU_LORA_KERNEL=0), `apply` is the torch
twin's: the same results to float32 rounding.

Work is split into items of up to TOKEN_BLOCK tokens of one segment, run on
torch's intra-op threads. Within an item:

  shrink  y[j, k] = x[j] . A_s[k], in float32, in register tiles of
          4 tokens x 4 rank rows (1 x 16 for single tokens: decodes),
          by `dot_rows` (engine/native.py, shared with the linear kernel);
  expand  out[j, off_i + c] += sum_r y[j, i*R + r] * B_i,s[r, c], 16
          columns at a time, the out rows read and written once.

The torch twin (`sgmv_shrink` / `sgmv_expand`) is the reference the tests
hold this kernel to, next to the naive per-token loop.
"""

from __future__ import annotations

import torch

import native
from adapters.ops.meta import SGMVMeta
from adapters.ops.torch_ops import TorchLoraOps

ENV_SWITCH = "LORAGW_CPU_LORA_KERNEL"
TOKEN_BLOCK = 16
# Batches below this many tokens run on one thread when idle threads sleep:
# on 2 cores under OMP_WAIT_POLICY=PASSIVE, 27 one-token segments took 77 us
# a projection on one thread and 134 us on two; a 1,024-token prefill chunk
# is worth the wake-up.
PARALLEL_TOKENS_WHEN_THREADS_SLEEP = 64

_SOURCE = native.VECTOR_HELPERS + r"""
namespace {

constexpr int64_t kTokenBlock = """ + str(TOKEN_BLOCK) + r""";

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
"""


_KERNEL = native.Kernel("loragw_cpu_lora", _SOURCE, ["lora_apply"], "CPU LoRA kernel", ENV_SWITCH)
load_kernel = _KERNEL.load


class CpuLoraOps(TorchLoraOps):
    """The torch twin, with `apply` done by the C++ kernel where it can be."""

    name = "cpu"
    rank_major_b = True

    def __init__(self, kernel=None):
        # Built here, not on the first step: the first build takes ~30 s.
        self.kernel = load_kernel() if kernel is None else kernel
        # A decode step's LoRA work is streaming a few adapters' weights, as
        # fast on one core as on two here; where idle threads sleep, waking
        # the second costs more than it brings (engine/native.py).
        self.parallel_tokens = native.serial_below(PARALLEL_TOKENS_WHEN_THREADS_SLEEP)

    def apply(self, x, lora_a, lora_b_slices, meta: SGMVMeta, out, offsets) -> None:
        # One call per projection and step, so the checks live in the kernel
        # (microseconds there; in Python they cost as much as the math).
        if self.kernel is None or not self.kernel.lora_apply(
                x, lora_a, list(lora_b_slices), list(offsets), meta.seg_starts, meta.seg_lens, meta.seg_slots, out,
                self.parallel_tokens):
            super().apply(x, lora_a, lora_b_slices, meta, out, offsets)
