// Paged decode attention: each decode row's attention over its whole
// context, read through the block table, in one pass (an online softmax, as
// in flash-decoding): no score matrix is written, and each K/V byte comes
// from memory once.
//
// The work is cut into items of one sequence; a sequence longer than kSpan
// positions is split into spans, whose partial results (running max, sum,
// weighted values) are merged at the end, so one long sequence still keeps
// both cores busy (and with fewer sequences than threads, shorter spans:
// span_for). Threads take items longest first from a shared counter,
// since context lengths in a batch vary, each claiming its next one a
// little early so as to prefetch it (attention_impl).
//
// Within an item, positions go kL at a time (a tile: 16, or 8 on AVX2; with
// 16-position blocks one block or half of one), whole K/V rows (every KV head) at once, so memory is
// read in contiguous runs: per KV head, the scores of its query heads on the
// tile, then the tile's V rows into each one's accumulator.
//
// The cache's element type is the query's, or float16 under float32 queries:
// a float32 model's 16-bit cache, which halves the bytes this kernel reads;
// its rows are widened to float32 as they are loaded.
//
// The kernel is this file (the items, the threads, the entry points) and
// the arithmetic of a tile beside it (cpu_decode_tile.h).
#include "cpu_decode_tile.h"

#include <atomic>

namespace {

// How far ahead of a tile its prefetches reach: one 16-position block. With
// AVX2's 8-position tiles, reaching one tile ahead (8) was up to 1.4x slower
// over 16 sequences of 256 positions (2-core Zen 3, float32).
constexpr int64_t kAhead = 16;
constexpr int kMaxGroup = 16;   // query heads per KV head
constexpr int64_t kSpan = 512;  // positions per item, a multiple of kL
constexpr int64_t kMinSpan = 64;  // ... and the fewest span_for cuts it to

struct Seqs {  // the decode sequences of a step and where their context lives
  const int64_t* rows;     // [n] token row of each sequence in the flat batch
  const int64_t* seq_ids;  // [n] its row in block_tables / seq_lens
  const int32_t* block_tables;
  int64_t table_stride;
  const int32_t* seq_lens;
  int64_t block_size, num_kv_heads, head_dim;

  // Pointers to the K or V rows (every KV head) of positions j0 .. j0 +
  // count of sequence s: one block lookup per block, no division per row.
  template <typename T>
  void rows_at(const T* cache, int64_t s, int64_t j0, int64_t count, const T** rows) const {
    const int64_t row_elems = num_kv_heads * head_dim;
    const int32_t* table = block_tables + s * table_stride;
    int64_t b = j0 / block_size, off = j0 % block_size;
    const T* base = cache + table[b] * block_size * row_elems;
    for (int64_t t = 0; t < count; ++t) {
      rows[t] = base + off * row_elems;
      if (++off == block_size && t + 1 < count) {
        off = 0;
        base = cache + table[++b] * block_size * row_elems;
      }
    }
  }
};

struct Item {  // one sequence, or one span of a long one
  int64_t i, begin, end;
  int64_t partial;  // its slot among the partial results, or -1: the whole context, written to out
};

// `after`: the item this thread runs next, if it has claimed one, whose
// first tile is prefetched during this item's last tile.
template <typename T, typename KV, int CT>
void run_item(const Item& it, const Item* after, const Seqs& seqs, const T* query, int64_t q_stride0,
              int64_t q_stride1, const KV* k_cache, const KV* v_cache, int64_t num_heads, float scale, Scratch& st) {
  const int64_t chunks = seqs.head_dim / kL, C = CT ? CT : chunks;
  const int64_t group = num_heads / seqs.num_kv_heads;
  const int64_t s = seqs.seq_ids[it.i];
  for (int64_t h = 0; h < num_heads; ++h) {
    const T* qp = query + seqs.rows[it.i] * q_stride0 + h * q_stride1;
    for (int64_t c = 0; c < C; ++c) st.q[h * C + c] = load_lanes<kL>(qp + c * kL);
#if defined(__AVX512BF16__)
    if constexpr (kPairs<KV>())
      for (int64_t c = 0; c < C / 2; ++c) st.qb[h * C / 2 + c] = (__m512bh)_mm512_loadu_si512(qp + c * 2 * kL);
#endif
    st.m[h] = kNegInf;
    st.l[h] = fv{};
    for (int64_t c = 0; c < C; ++c) st.acc[h * C + c] = fv{};
  }
  alignas(64) float probs[kMaxGroup][kL];
  const KV* krows[kL];
  const KV* vrows[kL];
  const KV* next_k[kL];
  const KV* next_v[kL];
  const int64_t row_bytes = seqs.num_kv_heads * seqs.head_dim * sizeof(KV);
  iv lane;
  for (int x = 0; x < kL; ++x) lane[x] = x;
  for (int64_t j0 = it.begin; j0 < it.end; j0 += kL) {
    const int64_t count = std::min<int64_t>(kL, it.end - j0);
    seqs.rows_at(k_cache, s, j0, count, krows);
    seqs.rows_at(v_cache, s, j0, count, vrows);
    // Blocks sit anywhere in the cache, and each is only a few KiB, so the
    // hardware prefetcher has little to go on: ask for the rows of the tile
    // kAhead positions on into L2 during this one. The requests are spread thinly: each query
    // head asks for its share of the K rows before its scores and of the V
    // rows after them. Requests that bunch up stall the loads the work
    // itself needs (a core has only so many misses in flight). On a 2-core
    // Zen 4 the spread before this one (a third of the rows before each KV
    // head's work) was 1.2-1.4x slower, and other ways of asking slower
    // still (docs/engine.md, "Decode attention in one pass").
    int64_t next_count = std::min<int64_t>(kL, std::max<int64_t>(0, it.end - j0 - kAhead));
    if (next_count) {
      seqs.rows_at(k_cache, s, j0 + kAhead, next_count, next_k);
      seqs.rows_at(v_cache, s, j0 + kAhead, next_count, next_v);
    } else if (after != nullptr && after->end > after->begin && j0 + kL >= it.end) {
      // Without this the next item's first tile came from memory with no
      // prefetch, and a step's attention took ~8% longer at 64 sequences of
      // ~500 positions on a 2-core Zen 4 (docs/engine.md).
      next_count = std::min<int64_t>(kL, after->end - after->begin);
      seqs.rows_at(k_cache, seqs.seq_ids[after->i], after->begin, next_count, next_k);
      seqs.rows_at(v_cache, seqs.seq_ids[after->i], after->begin, next_count, next_v);
    }
    const iv valid = lane < static_cast<int32_t>(count);
    for (int64_t kv = 0; kv < seqs.num_kv_heads; ++kv) {
      const int64_t kv_offset = kv * seqs.head_dim;
      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = kv * group + g;
        const int64_t t0 = h * next_count / num_heads, t1 = (h + 1) * next_count / num_heads;
        for (int64_t t = t0; t < t1; ++t) prefetch_l2(next_k[t], row_bytes);
        const fv scores = tile_scores<KV, CT>(st, h, krows, kv_offset, count, C) * scale;
        for (int64_t t = t0; t < t1; ++t) prefetch_l2(next_v[t], row_bytes);
        const fv p = softmax_step<CT>(st, h, scores, valid, C);
        std::memcpy(probs[g], &p, sizeof p);
      }
      tile_values<KV, CT>(st, kv * group, group, probs, vrows, kv_offset, count, C);
    }
  }
}

template <typename T>
void write_out(T* out, const fv* acc, float inv_l, int64_t chunks) {
  for (int64_t c = 0; c < chunks; ++c) store_lanes<kL>(out + c * kL, acc[c] * inv_l);
}

// Per partial item and query head, `partials` holds the span's max, its
// sum, then head_dim weighted values; slot_seq[p] is the sequence of slot
// p. The spans of one sequence took consecutive slots: rescale each to the
// largest max, add, and normalize.
template <typename T>
void merge_spans(T* out, int64_t o_stride0, int64_t o_stride1, const std::vector<int64_t>& slot_seq,
                 const std::vector<float>& partials, const Seqs& seqs, int64_t num_heads) {
  const int64_t chunks = seqs.head_dim / kL, slot = 2 + seqs.head_dim;
  const int64_t num_partial = static_cast<int64_t>(slot_seq.size());
  for (int64_t first = 0; first < num_partial;) {
    int64_t last = first;
    while (last + 1 < num_partial && slot_seq[last + 1] == slot_seq[first]) ++last;
    for (int64_t h = 0; h < num_heads; ++h) {
      float m = kNegInf;
      for (int64_t p = first; p <= last; ++p) m = std::max(m, partials[(p * num_heads + h) * slot]);
      fv acc[kMaxChunks] = {};
      float l = 0.f;
      for (int64_t p = first; p <= last; ++p) {
        const float* src = &partials[(p * num_heads + h) * slot];
        const float w = std::exp(src[0] - m);
        l += w * src[1];
        for (int64_t c = 0; c < chunks; ++c) acc[c] += w * load_lanes<kL>(src + 2 + c * kL);
      }
      write_out(out + seqs.rows[slot_seq[first]] * o_stride0 + h * o_stride1, acc, 1.f / l, chunks);
    }
    first = last + 1;
  }
}

// Positions per item: kSpan, or less when there are fewer sequences than
// threads, so that each thread gets a span (a single decoding sequence of a
// few hundred positions ran on one core while the other waited), but no
// shorter than kMinSpan, below which merging the spans costs more than it
// saves.
int64_t span_for(const Seqs& seqs, int64_t n, int64_t threads) {
  if (n >= threads) return kSpan;
  int64_t longest = 0;
  for (int64_t i = 0; i < n; ++i) longest = std::max<int64_t>(longest, seqs.seq_lens[seqs.seq_ids[i]]);
  const int64_t per_seq = (threads + n - 1) / n;
  const int64_t span = ((longest + per_seq - 1) / per_seq + kL - 1) / kL * kL;
  return std::clamp(span, kMinSpan, kSpan);
}

template <typename T, typename KV, int CT>
void attention_impl(T* out, int64_t o_stride0, int64_t o_stride1, const T* query, int64_t q_stride0,
                    int64_t q_stride1, const KV* k_cache, const KV* v_cache, const Seqs& seqs, int64_t n,
                    int64_t num_heads, float scale, bool serial) {
  const int64_t chunks = seqs.head_dim / kL;
  const int64_t span = span_for(seqs, n, serial ? 1 : at::get_num_threads());
  std::vector<Item> items;
  std::vector<int64_t> slot_seq;  // the sequence of each partial slot
  for (int64_t i = 0; i < n; ++i) {
    const int64_t len = seqs.seq_lens[seqs.seq_ids[i]];
    const int64_t spans = std::max<int64_t>(1, (len + span - 1) / span);
    for (int64_t p = 0; p < spans; ++p) {
      const int64_t partial = spans > 1 ? static_cast<int64_t>(slot_seq.size()) : -1;
      items.push_back({i, p * span, std::min(len, (p + 1) * span), partial});
      if (spans > 1) slot_seq.push_back(i);
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.end - a.begin > b.end - b.begin; });
  // Per partial item and query head: max, sum, then head_dim weighted values (merge_spans).
  const int64_t slot = 2 + seqs.head_dim;
  std::vector<float> partials(slot_seq.size() * num_heads * slot);

  auto finish = [&](const Item& it, const Scratch& st) {
    for (int64_t h = 0; h < num_heads; ++h) {
      const fv* acc = &st.acc[h * chunks];
      if (it.partial < 0) {
        write_out(out + seqs.rows[it.i] * o_stride0 + h * o_stride1, acc, 1.f / hsum<kL>(st.l[h]), chunks);
      } else {
        float* dst = &partials[(it.partial * num_heads + h) * slot];
        dst[0] = st.m[h];
        dst[1] = hsum<kL>(st.l[h]);
        for (int64_t c = 0; c < chunks; ++c) store_lanes<kL>(dst + 2 + c * kL, acc[c]);
      }
    }
  };
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t threads = serial ? 1 : std::min<int64_t>(at::get_num_threads(), num_items);
  auto worker = [&](int64_t, int64_t) {
    Scratch st(num_heads, chunks);
    for (int64_t w = next.fetch_add(1); w < num_items;) {
      // A thread claims its next item before it runs this one (so that it
      // can prefetch it), but only while more than two items a thread are
      // left unclaimed: near the end a claimed item could leave another
      // thread idle, and a lone sequence's spans must go to different threads.
      const int64_t unclaimed = num_items - next.load(std::memory_order_relaxed);
      const int64_t claimed = unclaimed > 2 * threads ? next.fetch_add(1) : -1;
      const Item* after = claimed >= 0 && claimed < num_items ? &items[claimed] : nullptr;
      run_item<T, KV, CT>(items[w], after, seqs, query, q_stride0, q_stride1, k_cache, v_cache, num_heads, scale,
                          st);
      finish(items[w], st);
      w = claimed >= 0 ? claimed : next.fetch_add(1);
    }
  };
  if (threads == 1) {
    worker(0, 1);
  } else {
    at::parallel_for(0, threads, 1, worker);
  }
  if (!slot_seq.empty()) merge_spans(out, o_stride0, o_stride1, slot_seq, partials, seqs, num_heads);
}

Seqs make_seqs(const torch::Tensor& cache, const torch::Tensor& rows, const torch::Tensor& seq_ids,
               const torch::Tensor& block_tables, const torch::Tensor& seq_lens) {
  return Seqs{rows.data_ptr<int64_t>(), seq_ids.data_ptr<int64_t>(), block_tables.data_ptr<int32_t>(),
              block_tables.stride(0), seq_lens.data_ptr<int32_t>(), cache.size(1), cache.size(2), cache.size(3)};
}

// Whether the n sequences hold fewer than `parallel_positions` context
// positions in all, so the call stays on the calling thread.
bool few_positions(const Seqs& seqs, int64_t n, int64_t parallel_positions) {
  int64_t total = 0;
  for (int64_t i = 0; i < n && total < parallel_positions; ++i) total += seqs.seq_lens[seqs.seq_ids[i]];
  return total < parallel_positions;
}

template <typename T, typename KV>
void dispatch(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& k_cache,
              const torch::Tensor& v_cache, const Seqs& seqs, int64_t n, float scale, bool serial) {
  auto run = [&](auto chunks_tag) {
    constexpr int CT = decltype(chunks_tag)::value;
    attention_impl<T, KV, CT>(reinterpret_cast<T*>(out.data_ptr()), out.stride(0), out.stride(1),
                              reinterpret_cast<const T*>(query.data_ptr()), query.stride(0), query.stride(1),
                              reinterpret_cast<const KV*>(k_cache.data_ptr()),
                              reinterpret_cast<const KV*>(v_cache.data_ptr()), seqs, n, query.size(1), scale, serial);
  };
  // The common head sizes get loops of fixed length (their accumulators in
  // registers); others run the same code with a runtime length.
  switch (seqs.head_dim / kL) {
    case 2: run(std::integral_constant<int, 2>{}); break;
    case 4: run(std::integral_constant<int, 4>{}); break;
    case 8: run(std::integral_constant<int, 8>{}); break;
    case 16: run(std::integral_constant<int, 16>{}); break;
    default: run(std::integral_constant<int, 0>{}); break;
  }
}

// Row t of src (rows src_stride apart, each `width` values in a run) into
// cache slot slots[t] (slots `width` apart): what the twin's index_copy_
// writes after its cast to the cache's type. float32 to float16 rounds to
// nearest even, as torch's cast does.
template <typename S, typename C>
void write_rows(const S* src, int64_t src_stride, C* cache, const int64_t* slots, int64_t rows, int64_t width) {
  for (int64_t t = 0; t < rows; ++t) {
    const S* from = src + t * src_stride;
    C* to = cache + slots[t] * width;
    if constexpr (std::is_same_v<S, C>) {
      std::memcpy(to, from, width * sizeof(C));
    } else {
      static_assert(std::is_same_v<S, float> && std::is_same_v<C, c10::Half>);
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= width; i += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + i),
                            _mm512_cvtps_ph(_mm512_loadu_ps(from + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__F16C__)
      for (; i + 8 <= width; i += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(to + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(from + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
      for (; i < width; ++i) to[i] = static_cast<c10::Half>(from[i]);
    }
  }
}

}  // namespace

void decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                      torch::Tensor rows, torch::Tensor seq_ids, torch::Tensor block_tables,
                      torch::Tensor seq_lens, double scale, int64_t parallel_positions) {
  const Seqs seqs = make_seqs(k_cache, rows, seq_ids, block_tables, seq_lens);
  const int64_t n = rows.size(0);
  if (n == 0) return;
  const bool serial = few_positions(seqs, n, parallel_positions);
  // The pairs dispatched below, and nothing else: a cache read as the wrong
  // type would be read past its end.
  const auto q = query.scalar_type(), c = k_cache.scalar_type();
  TORCH_CHECK(out.scalar_type() == q && v_cache.scalar_type() == c &&
                  ((q == at::kFloat && (c == at::kFloat || c == at::kHalf)) ||
                   (q == at::kBFloat16 && c == at::kBFloat16)),
              "decode_attention: unsupported query/cache dtypes ", q, "/", c);
  if (query.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kHalf) {
    dispatch<float, c10::Half>(out, query, k_cache, v_cache, seqs, n, (float)scale, serial);
  } else if (query.scalar_type() == at::kFloat) {
    dispatch<float, float>(out, query, k_cache, v_cache, seqs, n, (float)scale, serial);
  } else {
    dispatch<c10::BFloat16, c10::BFloat16>(out, query, k_cache, v_cache, seqs, n, (float)scale, serial);
  }
}

// The step's new K and V, key and value [T, kv_heads, D] (a row's heads
// side by side, rows any stride apart), into k_cache and v_cache [blocks,
// block_size, kv_heads, D], contiguous, at the flat slots `slots` [T]
// int64: one call for the twin's two index_copy_ and two casts, whose
// dispatch cost more than the copying at a decode step's few rows. The
// dtype pairs are decode_attention's. False where it does not take the
// tensors (a slot out of range among them: the twin runs, and raises). On
// the calling thread, even for a prompt step's thousand rows (1.5 MiB a
// layer in float16): a copy at memory's pace beat the twin on two threads
// at every size timed (docs/engine.md, "The new K/V written in one call").
bool write_kv(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slots) {
  if (key.dim() != 3 || value.sizes() != key.sizes() || k_cache.dim() != 4 || v_cache.sizes() != k_cache.sizes())
    return false;
  const int64_t rows = key.size(0), width = key.size(1) * key.size(2);
  const auto q = key.scalar_type(), c = k_cache.scalar_type();
  if (value.scalar_type() != q || v_cache.scalar_type() != c ||
      !((q == at::kFloat && (c == at::kFloat || c == at::kHalf)) || (q == at::kBFloat16 && c == at::kBFloat16)))
    return false;
  for (const torch::Tensor* t : {&key, &value})
    if (!t->device().is_cpu() || t->stride(2) != 1 || t->stride(1) != t->size(2)) return false;
  if (!k_cache.device().is_cpu() || !v_cache.device().is_cpu() || !k_cache.is_contiguous() ||
      !v_cache.is_contiguous() || k_cache.size(2) != key.size(1) || k_cache.size(3) != key.size(2) ||
      slots.scalar_type() != at::kLong || slots.dim() != 1 || slots.size(0) != rows || !slots.is_contiguous() ||
      !slots.device().is_cpu())
    return false;
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t)
    if (slot[t] < 0 || slot[t] >= num_slots) return false;
  if (q != c) {
    typedef c10::Half H;
    write_rows<float, H>(key.data_ptr<float>(), key.stride(0), k_cache.data_ptr<H>(), slot, rows, width);
    write_rows<float, H>(value.data_ptr<float>(), value.stride(0), v_cache.data_ptr<H>(), slot, rows, width);
    return true;
  }
  const int64_t size = key.element_size();  // the same type: bytes are bytes
  write_rows<char, char>(static_cast<const char*>(key.data_ptr()), key.stride(0) * size,
                         static_cast<char*>(k_cache.data_ptr()), slot, rows, width * size);
  write_rows<char, char>(static_cast<const char*>(value.data_ptr()), value.stride(0) * size,
                         static_cast<char*>(v_cache.data_ptr()), slot, rows, width * size);
  return true;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Without the GIL, as torch's own ops and the prefill kernel (cpu_prefill.cpp says why).
  m.def("decode_attention", torch::wrap_pybind_function_no_gil(decode_attention), "decode_attention");
  m.def("write_kv", torch::wrap_pybind_function_no_gil(write_kv), "write_kv");
}
