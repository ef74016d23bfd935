// Paged attention that reads K/V in place by block table: no gather copy, an online softmax in float32.
//
// One work item is a chunk of up to kQueryChunk queries of a sequence; a task is an item and one KV head, or
// every KV head for a decode (see attend_all). A task's rows are every query head of its KV heads (GQA) for
// each query of the chunk, so each key and value row is read and upcast once per task. Decodes whose tables
// start with the same blocks (a shared prompt) are grouped, up to kDecodeGroup sequences per item: the
// blocks they share are read once for all of them, the rest per sequence. The threads take tasks costliest
// first, each the next one when done. Query i of a sequence with q_len new tokens and context_len keys sits at
// position context_len - q_len + i and sees keys 0 ..= that position (causal). Float keys of head dim 64 in
// blocks of 16 (SmolLM2's and most small Llamas') go through explicit 16-float vectors where the build has
// AVX-512 (scores64, values64); other inner loops are plain float loops over the head dim or the block's
// tokens, written so that the compiler vectorises them (-O3 -march=native -fopenmp, sums reassociated:
// native/__init__.py CFLAGS); a block's scores take four rows per key vector and its values two rows per
// value row, so that several chains of FMAs are in flight.
//
// The block arithmetic is in attention_rows.h and attention_block.h; here: the step's work planned into
// items and groups, and the threads that attend them.
#include "attention_tiles.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstdint>
#include <utility>
#include <vector>

namespace {

struct Item {
  int64_t seq, first, count;  // queries [first, first + count) of the sequence's new tokens
};

// Decodes (one new query each) whose tables start with the same `shared` blocks, every key of which all of
// them see: those blocks are read once for all of them (a shared prompt's keys), the rest per sequence.
struct Group {
  int64_t seqs[kDecodeGroup];
  int64_t count, shared;
};

template <typename kv_t, typename q_t>
void attend_group(const Group& group, Heads heads, const at::Tensor& query, at::Tensor& out, const kv_t* k_cache,
                  const kv_t* v_cache, const int64_t* tables, int64_t table_width, const int64_t* q_starts,
                  const int64_t* context_lens, const Geometry& g, float q_scale, float v_scale, Scratch& s) {
  const int64_t rows = group.count * g.group;
  for (int64_t h = 0; h < heads.count; ++h) {
    for (int64_t m = 0; m < group.count; ++m) {
      load_query<q_t>(query, q_starts[group.seqs[m]], heads.first + h, h * rows + m * g.group, g, q_scale, s);
    }
  }
  reset_rows(rows * heads.count, g, s);
  int64_t* visible = s.visible.data();
  // the shared blocks: every key of them seen by every row, each block read once
  std::fill(visible, visible + rows, g.block_size);
  attend_blocks(tables + group.seqs[0] * table_width, 0, group.shared * g.block_size, heads, rows, k_cache, v_cache,
                g, s, [](int64_t) {});
  // then each sequence's own keys, its rows alone
  for (int64_t m = 0; m < group.count; ++m) {
    const int64_t seq = group.seqs[m], keys = context_lens[seq];
    attend_blocks(tables + seq * table_width, group.shared, keys, heads, rows, k_cache, v_cache, g, s,
                  [&](int64_t start) {
                    std::fill(visible, visible + rows, 0);
                    std::fill(visible + m * g.group, visible + (m + 1) * g.group,
                              std::min(g.block_size, keys - start));
                  });
  }
  for (int64_t h = 0; h < heads.count; ++h) {
    for (int64_t m = 0; m < group.count; ++m) {
      store_output<q_t>(out, q_starts[group.seqs[m]], heads.first + h, h * rows + m * g.group, g, v_scale, s);
    }
  }
}

template <typename kv_t, typename q_t>
void attend_item(const Item& item, Heads heads, const at::Tensor& query, at::Tensor& out, const kv_t* k_cache,
                 const kv_t* v_cache, const int64_t* tables, int64_t table_width, const int64_t* q_starts,
                 const int64_t* q_lens, const int64_t* context_lens, const Geometry& g, float q_scale, float v_scale,
                 Scratch& s) {
  const int64_t context_len = context_lens[item.seq], q_len = q_lens[item.seq];
  const int64_t first_pos = context_len - q_len + item.first;  // position of the chunk's first query
  const int64_t first_token = q_starts[item.seq] + item.first, rows = item.count * g.group;
  for (int64_t h = 0; h < heads.count; ++h) {
    for (int64_t i = 0; i < item.count; ++i) {
      load_query<q_t>(query, first_token + i, heads.first + h, h * rows + i * g.group, g, q_scale, s);
    }
  }
  reset_rows(rows * heads.count, g, s);
  int64_t *visible = s.visible.data(), *lo = s.first.data();
  // a sliding window's blocks before the earliest query's window are not read
  const int64_t first_block = g.window > 0 ? std::max<int64_t>(0, first_pos - g.window + 1) / g.block_size : 0;
  attend_blocks(tables + item.seq * table_width, first_block, first_pos + item.count, heads, rows, k_cache, v_cache,
                g, s, [&](int64_t start) {
                  for (int64_t i = 0; i < item.count; ++i) {
                    const int64_t pos = first_pos + i;
                    const int64_t seen = std::clamp<int64_t>(pos + 1 - start, 0, g.block_size);
                    std::fill(visible + i * g.group, visible + (i + 1) * g.group, seen);
                    if (g.window > 0) {
                      const int64_t from = std::clamp<int64_t>(pos - g.window + 1 - start, 0, g.block_size);
                      std::fill(lo + i * g.group, lo + (i + 1) * g.group, from);
                    }
                  }
                });
  for (int64_t h = 0; h < heads.count; ++h) {
    for (int64_t i = 0; i < item.count; ++i) {
      store_output<q_t>(out, first_token + i, heads.first + h, h * rows + i * g.group, g, v_scale, s);
    }
  }
}

// Leading blocks two tables share that both contexts see whole (block ids equal).
inline int64_t shared_blocks(const int64_t* a, const int64_t* b, int64_t full_blocks) {
  int64_t n = 0;
  while (n < full_blocks && a[n] == b[n]) ++n;
  return n;
}

// The step's work: decodes whose tables share leading blocks go in Groups of up to kDecodeGroup (in the order
// of their tables, so that sharers meet), every other sequence in Items of up to kQueryChunk queries. Under a
// sliding window every decode is an Item (each sees its own last keys, not a shared prefix).
void plan_work(const int64_t* tables, int64_t width, const int64_t* q_lens, const int64_t* context_lens, int64_t n,
               int64_t block_size, bool group_decodes, std::vector<Item>& items, std::vector<Group>& groups) {
  std::vector<int64_t> decodes;
  for (int64_t seq = 0; seq < n; ++seq) {
    if (group_decodes && q_lens[seq] == 1 && context_lens[seq] > block_size) {
      decodes.push_back(seq);
      continue;
    }
    for (int64_t first = 0; first < q_lens[seq]; first += kQueryChunk) {
      items.push_back({seq, first, std::min(kQueryChunk, q_lens[seq] - first)});
    }
  }
  std::stable_sort(decodes.begin(), decodes.end(), [&](int64_t a, int64_t b) {
    return std::lexicographical_compare(tables + a * width, tables + (a + 1) * width, tables + b * width,
                                        tables + (b + 1) * width);
  });
  for (size_t i = 0; i < decodes.size();) {
    Group group{{decodes[i]}, 1, context_lens[decodes[i]] / block_size};
    const int64_t* head = tables + decodes[i] * width;
    size_t next = i + 1;
    for (; next < decodes.size() && group.count < kDecodeGroup; ++next) {
      const int64_t seq = decodes[next];
      const int64_t full = std::min(group.shared, context_lens[seq] / block_size);
      const int64_t shared = shared_blocks(head, tables + seq * width, full);
      if (shared == 0) break;
      group.seqs[group.count++] = seq;
      group.shared = shared;
    }
    if (group.count > 1) {
      groups.push_back(group);
    } else {
      items.push_back({decodes[i], 0, 1});
    }
    i = next;
  }
}

template <typename kv_t, typename q_t>
void attend_all(const at::Tensor& query, at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& block_tables, const at::Tensor& q_starts, const at::Tensor& q_lens,
                const at::Tensor& context_lens, const Geometry& g, float q_scale, float v_scale) {
  std::vector<Item> items;
  std::vector<Group> groups;
  const int64_t* lens = q_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t width = block_tables.size(1);
  plan_work(tables, width, lens, context_lens.data_ptr<int64_t>(), q_lens.size(0), g.block_size, g.window == 0, items,
            groups);
  const auto* k = reinterpret_cast<const kv_t*>(k_cache.data_ptr());
  const auto* v = reinterpret_cast<const kv_t*>(v_cache.data_ptr());
  const int64_t* contexts = context_lens.data_ptr<int64_t>();
  // NOTE: a decode's task takes every KV head of its sequence (or group), so that it reads each block's keys
  // and values whole, in one pass: a task per KV head read a third of every key row and skipped the rest, a
  // pattern the hardware prefetcher follows badly (docs/internals/kernels.md). With fewer decodes than twice
  // the threads (one stream) they keep a task per KV head so that every thread has work. Prompt chunks, whose
  // keys each serve up to kQueryChunk queries, keep a task per KV head.
  const int64_t decode_units = static_cast<int64_t>(groups.size()) +
                               std::count_if(items.begin(), items.end(), [&](const Item& item) {
                                 return lens[item.seq] == 1;
                               });
  const bool whole_decodes = decode_units >= 2 * at::get_num_threads();
  // NOTE: handed out costliest first, each thread taking the next when done (a static split of a causal
  // prompt's items gave one thread the short early chunks and the other the long late ones). Cost: query
  // rows times the keys they read.
  struct Task {
    int64_t cost, unit;
    Heads heads;
  };
  std::vector<Task> tasks;
  const auto add = [&](int64_t cost, int64_t unit, bool whole) {
    if (whole) {
      tasks.push_back({cost * g.num_kv_heads, unit, {0, g.num_kv_heads}});
      return;
    }
    for (int64_t h = 0; h < g.num_kv_heads; ++h) tasks.push_back({cost, unit, {h, 1}});
  };
  for (size_t i = 0; i < groups.size(); ++i) {
    const Group& group = groups[i];
    int64_t keys = group.shared * g.block_size;
    for (int64_t m = 0; m < group.count; ++m) keys += contexts[group.seqs[m]] - group.shared * g.block_size;
    add(group.count * keys, static_cast<int64_t>(i), whole_decodes);
  }
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& item = items[i];
    const int64_t last = contexts[item.seq] - lens[item.seq] + item.first + item.count;
    const int64_t keys = g.window > 0 ? std::min(last, g.window + item.count) : last;
    add(item.count * keys, static_cast<int64_t>(groups.size() + i), whole_decodes && lens[item.seq] == 1);
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  const int64_t total = static_cast<int64_t>(tasks.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Scratch scratch(g);
    for (int64_t w; (w = next.fetch_add(1)) < total;) {
      const Task& task = tasks[w];
      if (task.unit < static_cast<int64_t>(groups.size())) {
        attend_group<kv_t, q_t>(groups[task.unit], task.heads, query, out, k, v, tables, width,
                                q_starts.data_ptr<int64_t>(), contexts, g, q_scale, v_scale, scratch);
        continue;
      }
      const Item& item = items[task.unit - groups.size()];
      if constexpr (kTiledTypes<kv_t, q_t>) {
        if (tiled(g, item.count * g.group)) {
          attend_item_tiled(item.first, item.count, task.heads, query, out, k, v, tables + item.seq * width,
                            contexts[item.seq], lens[item.seq], q_starts.data_ptr<int64_t>()[item.seq], g, q_scale,
                            v_scale, scratch);
          continue;
        }
      }
      attend_item<kv_t, q_t>(item, task.heads, query, out, k, v, tables, width, q_starts.data_ptr<int64_t>(), lens,
                             contexts, g, q_scale, v_scale, scratch);
    }
  });
}

template <typename kv_t>
void dispatch_query(const at::Tensor& query, at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& block_tables, const at::Tensor& q_starts, const at::Tensor& q_lens,
                    const at::Tensor& context_lens, const Geometry& g, float q_scale, float v_scale) {
  switch (query.scalar_type()) {
    case at::kFloat:
      return attend_all<kv_t, float>(query, out, k_cache, v_cache, block_tables, q_starts, q_lens, context_lens, g,
                                     q_scale, v_scale);
    case at::kBFloat16:
      return attend_all<kv_t, at::BFloat16>(query, out, k_cache, v_cache, block_tables, q_starts, q_lens,
                                            context_lens, g, q_scale, v_scale);
    case at::kHalf:
      return attend_all<kv_t, at::Half>(query, out, k_cache, v_cache, block_tables, q_starts, q_lens, context_lens,
                                        g, q_scale, v_scale);
    default:
      TORCH_CHECK(false, "paged attention: unsupported query dtype ", query.scalar_type());
  }
}

}  // namespace

// out[q_starts[s] + i] = attention of query[q_starts[s] + i] ([T, H, D]) over the context of sequence s, for
// i < q_lens[s], the keys read from k_cache/v_cache [num_blocks, block_size, num_kv_heads, head_dim] through
// block_tables [N, W]. Stored keys are multiplied by k_scale and values by v_scale (fp8 pools). With a window,
// query p sees keys (p - window, p] only; with a softcap, scores s (scaled) become softcap * tanh(s / softcap).
void paged_attention(const at::Tensor& query_in, at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& q_starts, const at::Tensor& q_lens,
                     const at::Tensor& context_lens, double scale, double k_scale, double v_scale, int64_t window,
                     double softcap) {
  TORCH_CHECK(query_in.dim() == 3, "query must be [T, H, D]");
  // NOTE: queries strided in D (a transposed product's layout) are copied once, so that every row is read with
  // unit stride; other strides (a view into the fused qkv output) are read as they are.
  const at::Tensor query = query_in.stride(2) == 1 ? query_in : query_in.contiguous();
  TORCH_CHECK(out.is_contiguous() && out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type(),
              "out must be a contiguous tensor shaped and typed like query");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache and v_cache must be contiguous [num_blocks, block_size, num_kv_heads, head_dim] alike");
  for (const auto* t : {&block_tables, &q_starts, &q_lens, &context_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "step metadata must be contiguous int64");
  }
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "window and softcap must be >= 0 (0: none)");
  const Geometry g{k_cache.size(0), k_cache.size(1), k_cache.size(2), k_cache.size(3),
                   query.size(1) / k_cache.size(2), window, static_cast<float>(softcap)};
  TORCH_CHECK(query.size(2) == g.head_dim && g.group * g.num_kv_heads == query.size(1),
              "query heads must be a multiple of the KV heads, with the same head dim");
  const float q_scale = static_cast<float>(scale * k_scale), vs = static_cast<float>(v_scale);
  const at::Tensor& q = query;  // short name for the dispatch below
  switch (k_cache.scalar_type()) {
    case at::kFloat:
      return dispatch_query<float>(q, out, k_cache, v_cache, block_tables, q_starts, q_lens, context_lens, g, q_scale,
                                   vs);
    case at::kBFloat16:
      return dispatch_query<at::BFloat16>(q, out, k_cache, v_cache, block_tables, q_starts, q_lens, context_lens, g,
                                          q_scale, vs);
    case at::kHalf:
      return dispatch_query<at::Half>(q, out, k_cache, v_cache, block_tables, q_starts, q_lens, context_lens, g,
                                      q_scale, vs);
    case at::kFloat8_e4m3fn:
      return dispatch_query<c10::Float8_e4m3fn>(q, out, k_cache, v_cache, block_tables, q_starts, q_lens,
                                                context_lens, g, q_scale, vs);
    case at::kFloat8_e5m2:
      return dispatch_query<c10::Float8_e5m2>(q, out, k_cache, v_cache, block_tables, q_starts, q_lens,
                                              context_lens, g, q_scale, vs);
    default:
      TORCH_CHECK(false, "paged attention: unsupported pool dtype ", k_cache.scalar_type());
  }
}
