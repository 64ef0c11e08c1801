// cpu_prefill.cpp's work, shared by its two builds: the chunks of a step,
// the items they are cut into (costliest first), the threads that take
// them, and the head dims that have a build.
#pragma once

#include "vector_helpers.h"

#include <atomic>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int kMaxDim = 256;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Chunks {  // the prefill chunks of a step and where their context lives
  const int64_t* starts;   // [n] first token row of each chunk in the flat batch
  const int64_t* lens;     // [n] its query length
  const int64_t* seq_ids;  // [n] its row in block_tables / seq_lens
  const int32_t* block_tables;
  int64_t table_stride;
  const int32_t* seq_lens;
  int64_t block_size, num_kv_heads, head_dim;

  // The cache slot of position `pos` of the sequence whose block table is `table`.
  int64_t slot(const int32_t* table, int64_t pos) const {
    return static_cast<int64_t>(table[pos / block_size]) * block_size + pos % block_size;
  }
};

struct Item {
  int64_t chunk, head, first;  // queries first .. first + 16 of the chunk (fewer at its end)
  int64_t tiles;               // key tiles it reads: its cost
  // Where nonzero, a short chunk's lanes instead (make_items with a group):
  // `lanes` of its (row, query head of KV head `head`) pairs, row by row,
  // from pair `first`.
  int64_t lanes = 0;
};

// The items of the n chunks: each 16 query positions of a chunk with each
// of `heads` heads (query heads in bfloat16, KV heads in float32),
// costliest first, so that the last items the threads take are short.
//
// With `group` > 1 (bfloat16: query heads per KV head), a chunk of fewer
// than 16 rows (a speculating sequence's verification, a prompt's tail past
// a cached prefix) fills each item's lanes with its rows under every query
// head of one KV head instead, row by row, so the group's heads share each
// K/V tile they read. One item per query head left most lanes empty: a
// chunk of 2 rows used 2 of 16, and a SmolLM2 layer's 9 items made a
// verification's attention cost 3 to 4 times a decode row's (single-stream
// decode with drafts, 2-core Zen 4). A lane's sums do not depend on the
// lanes beside it, and a tile that an item reads past a lane's last key is
// masked for that lane, which leaves its state bit for bit as it was (zero
// weights, and exp(0) is exactly 1), so each row comes out as it would in
// any chunk.
std::vector<Item> make_items(const Chunks& ch, int64_t n, int64_t heads, int64_t group = 1) {
  std::vector<Item> items;
  for (int64_t c = 0; c < n; ++c) {
    const int64_t len = ch.lens[c], ctx = ch.seq_lens[ch.seq_ids[c]] - len;
    if (group > 1 && len < kLanes) {
      for (int64_t first = 0; first < len * group; first += kLanes) {
        const int64_t lanes = std::min<int64_t>(kLanes, len * group - first);
        const int64_t last = ctx + (first + lanes - 1) / group;
        for (int64_t kv = 0; kv < heads / group; ++kv) items.push_back({c, kv, first, last / kLanes + 1, lanes});
      }
      continue;
    }
    for (int64_t first = 0; first < len; first += kLanes) {
      const int64_t last = ctx + std::min(len, first + kLanes) - 1;
      for (int64_t h = 0; h < heads; ++h) items.push_back({c, h, first, last / kLanes + 1});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.tiles > b.tiles; });
  return items;
}

// run(item, scratch) for every item: the threads take them in order from a
// shared counter, each with its own scratch (make_scratch()); all on this
// thread when `serial`.
template <typename MakeScratch, typename Run>
void run_items(const std::vector<Item>& items, bool serial, MakeScratch make_scratch, Run run) {
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  auto worker = [&](int64_t, int64_t) {
    auto sc = make_scratch();
    for (int64_t w; (w = next.fetch_add(1)) < num_items;) run(items[w], sc);
  };
  if (serial || num_items == 1) {
    worker(0, 1);
  } else {
    at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_items), 1, worker);
  }
}

// f(std::integral_constant<int, D>{}) for the head dim D, where it has a build.
template <typename F>
void with_head_dim(int64_t head_dim, F f) {
  switch (head_dim) {
    case 64: f(std::integral_constant<int, 64>{}); break;
    case 128: f(std::integral_constant<int, 128>{}); break;
    case 32: f(std::integral_constant<int, 32>{}); break;
    case 96: f(std::integral_constant<int, 96>{}); break;
    case 256: f(std::integral_constant<int, 256>{}); break;
    default: TORCH_CHECK(false, "prefill_attention: head_dim ", head_dim, " has no build");
  }
}

}  // namespace
