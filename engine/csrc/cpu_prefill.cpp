// Paged causal attention for prefill chunks: each chunk's queries over its
// context, read through the block table, in one pass per block of queries
// (an online softmax, as in flash attention). Two builds of one scheme:
// bfloat16 on AVX512-BF16, and float32 (over a float32 or float16 cache)
// on x86 hosts with AVX2 or AVX-512, at the host's own vector width.
//
// Why not torch's SDPA: its CPU flash kernel runs bfloat16 at about the
// speed of float32 here (65 to 110 GFLOP/s on two Zen 5 cores, measured by
// benchmarks/prefill_attention.py), its float32 causal path reached 7 to 59
// GFLOP/s on two Zen 3 cores, where float32 GEMM reaches ~120-160, and a
// chunk after a sequence's first needs its K/V gathered from the blocks and
// a mask that makes it compute the whole rectangle.
//
// Lane j of every vector is query j (a query row under one head), so the
// softmax (max, rescale, sum) is lane by lane and never reduces across a
// vector. Keys go 16 (a tile) at a time; keys past a query's position are
// masked, and tiles past the block's last query are never read. Threads
// take items costliest first from a shared counter.
//
// bfloat16: items of 16 query positions of one query head, or, for a chunk
// of fewer than 16 rows, 16 of its (row, query head) pairs of one KV head.
// - scores: per key, vdpbf16ps of the queries' dim pairs (transposed once
//   per item) with the key's dim pair broadcast straight from the cache row;
// - values: per output dim, vdpbf16ps of the weights of two keys (rounded
//   to bfloat16, as torch's bfloat16 attention rounds them) with those keys'
//   values at that dim broadcast as a pair; the outputs live transposed
//   (dim, query) and are transposed back once at the end.
//
// float32: items of 16 query positions of every query head of one KV head,
// so that a tile's K and V rows are widened (a float16 cache) or copied
// once into a scratch tile for the whole group. Scores and values are
// outer products, a few keys (or output dims) by the 16 queries at a time
// in registers: per dim, the queries' vectors times one key's value at
// that dim, broadcast.
//
// The kernel is this file (the entry points) and the headers beside it:
// the items and threads (cpu_prefill_items.h), then each build
// (cpu_prefill_bf16.h, cpu_prefill_f32.h).
#include "cpu_prefill_bf16.h"
#include "cpu_prefill_f32.h"

// Whether this build takes bfloat16: it needs AVX512-BF16 on the build host.
// float32 builds everywhere.
bool has_bfloat16() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

void prefill_attention(torch::Tensor out, torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                       torch::Tensor starts, torch::Tensor lens, torch::Tensor seq_ids, torch::Tensor block_tables,
                       torch::Tensor seq_lens, double scale, int64_t parallel_tiles) {
  const Chunks ch{starts.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), seq_ids.data_ptr<int64_t>(),
                  block_tables.data_ptr<int32_t>(), block_tables.stride(0), seq_lens.data_ptr<int32_t>(),
                  k_cache.size(1), k_cache.size(2), k_cache.size(3)};
  const int64_t n = starts.size(0);
  if (n == 0) return;
  TORCH_CHECK(ch.head_dim <= kMaxDim, "prefill_attention: head_dim ", ch.head_dim, " has no build");
  // Key tiles over all items of all chunks: under `parallel_tiles`, one thread.
  int64_t tiles = 0;
  for (int64_t c = 0; c < n; ++c) {
    const int64_t len = ch.lens[c], ctx = ch.seq_lens[ch.seq_ids[c]] - len;
    tiles += len * (ctx + len / 2) / (kLanes * kLanes) + 1;
  }
  const bool serial = tiles * query.size(1) < parallel_tiles;
  // The pairs dispatched below, and nothing else: a cache read as the wrong
  // type would be read past its end.
  const auto q = query.scalar_type(), c = k_cache.scalar_type();
  TORCH_CHECK(out.scalar_type() == q && v_cache.scalar_type() == c &&
                  ((q == at::kFloat && (c == at::kFloat || c == at::kHalf)) ||
                   (q == at::kBFloat16 && c == at::kBFloat16)),
              "prefill_attention: unsupported query/cache dtypes ", q, "/", c);
  if (q == at::kFloat) {
    with_head_dim(ch.head_dim, [&](auto dim) {
      constexpr int D = decltype(dim)::value;
      if (c == at::kHalf) {
        attention_impl32<D, c10::Half>(out, query, k_cache, v_cache, ch, n, (float)scale, serial);
      } else {
        attention_impl32<D, float>(out, query, k_cache, v_cache, ch, n, (float)scale, serial);
      }
    });
    return;
  }
#if defined(__AVX512BF16__)
  with_head_dim(ch.head_dim, [&](auto dim) {
    attention_impl<decltype(dim)::value>(out, query, k_cache, v_cache, ch, n, (float)scale, serial);
  });
#else
  TORCH_CHECK(false, "prefill_attention: bfloat16 needs AVX512-BF16");
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("has_bfloat16", &has_bfloat16, "whether this build takes bfloat16 (AVX512-BF16)");
  // Without the GIL, as torch's own ops run: a step's prompt attention takes
  // tens of milliseconds a layer, and an embedded engine shares the process
  // with the gateway's event loop (holding it, /health waited 0.66 s under
  // load in tests/gateway/test_openai_errors.py).
  m.def("prefill_attention", torch::wrap_pybind_function_no_gil(prefill_attention), "prefill_attention");
}
