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
// The kernel is this file (the checks, which path a call takes, and the
// bindings) and the headers beside it, one path each, which the build
// stages with it (native/__init__.py).
#include "quant_linear_formats.h"
#include "quant_linear_f32.h"
#include "quant_linear_interleaved.h"
#include "quant_linear_int8.h"
#include "quant_linear_bf16.h"

namespace {

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
      if (bias.has_value()) out.add_(*bias);  // rounded twice, as the per-vector loop
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
