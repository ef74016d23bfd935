// Block-sparse decode's choice of blocks (compute_service/attention/sparse.py): per selecting row, the table
// of the blocks its decode attends to, in table order, and the context length the paged kernel then reads.
//
// A row r with settings (sink, recent, topk), topk >= 1, decodes one token at q_starts[r] over a context of
// num_blocks blocks; its candidates are the table positions [sink, num_blocks - recent). Head h's bound on
// candidate c is sum_d max(q_d * min_d, q_d * max_d) over the block summary of c's block in h's KV head
// (bounds [blocks, 2, kv_heads, head_dim]: min, max); c's score is log sum_h exp(scale * (bound - head h's
// best bound among the candidates)); the topk best (ties: the earlier position) are kept. The row's table
// becomes its sink blocks, the kept ones ascending and its recent blocks, -1 padded; its context
// (blocks - 1) * block_size + the last block's tokens, so the causal mask lets the query see every chosen key.
// A row with topk 0 keeps its table and context.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace {

template <typename q_t>
void select_rows(const at::Tensor& query, const at::Tensor& bounds, const at::Tensor& block_tables,
                 const at::Tensor& q_starts, const at::Tensor& context_lens, const at::Tensor& settings,
                 int64_t block_size, float scale, at::Tensor& tables, at::Tensor& lens) {
  const int64_t rows = block_tables.size(0), width = block_tables.size(1);
  const int64_t kv_heads = bounds.size(2), head_dim = bounds.size(3), heads = query.size(1);
  const int64_t group = heads / kv_heads;
  const int64_t q_row = query.stride(0), q_head = query.stride(1);
  const q_t* q_data = query.data_ptr<q_t>();
  const float* b_data = bounds.data_ptr<float>();
  const int64_t* table_in = block_tables.data_ptr<int64_t>();
  const int64_t* starts = q_starts.data_ptr<int64_t>();
  const int64_t* contexts = context_lens.data_ptr<int64_t>();
  const int64_t* set = settings.data_ptr<int64_t>();
  int64_t* table_out = tables.data_ptr<int64_t>();
  int64_t* lens_out = lens.data_ptr<int64_t>();
  const int64_t block_stride = 2 * kv_heads * head_dim;
  at::parallel_for(0, rows, 1, [&](int64_t first, int64_t end) {
    std::vector<float> q(heads * head_dim), head_bounds, scores;
    std::vector<int64_t> order;
    for (int64_t r = first; r < end; ++r) {
      const int64_t sink = set[3 * r], recent = set[3 * r + 1], topk = set[3 * r + 2];
      const int64_t num_blocks = (contexts[r] + block_size - 1) / block_size;
      const int64_t candidates = num_blocks - sink - recent;
      if (topk < 1 || candidates <= topk) continue;  // dense: tables and lens were copied
      const int64_t* row_table = table_in + r * width;
      for (int64_t h = 0; h < heads; ++h) {
        const q_t* from = q_data + starts[r] * q_row + h * q_head;
        for (int64_t i = 0; i < head_dim; ++i) q[h * head_dim + i] = static_cast<float>(from[i]);
      }
      head_bounds.assign(candidates * heads, 0.f);
      for (int64_t c = 0; c < candidates; ++c) {
        const float* summary = b_data + row_table[sink + c] * block_stride;
        for (int64_t h = 0; h < heads; ++h) {
          const float* low = summary + (h / group) * head_dim;
          const float* high = low + kv_heads * head_dim;
          const float* qh = q.data() + h * head_dim;
          float bound = 0.f;
#pragma omp simd reduction(+ : bound)
          for (int64_t i = 0; i < head_dim; ++i) bound += std::max(qh[i] * low[i], qh[i] * high[i]);
          head_bounds[c * heads + h] = bound;
        }
      }
      std::vector<float> best(heads, -std::numeric_limits<float>::infinity());
      for (int64_t c = 0; c < candidates; ++c)
        for (int64_t h = 0; h < heads; ++h) best[h] = std::max(best[h], head_bounds[c * heads + h]);
      scores.assign(candidates, 0.f);
      for (int64_t c = 0; c < candidates; ++c) {
        float sum = 0.f;
        for (int64_t h = 0; h < heads; ++h) sum += std::exp(scale * (head_bounds[c * heads + h] - best[h]));
        scores[c] = sum;  // log is monotonic: the order of the sums is the scores'
      }
      order.resize(candidates);
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + topk, order.end(), [&](int64_t a, int64_t b) {
        return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
      });
      std::sort(order.begin(), order.begin() + topk);
      int64_t* out = table_out + r * width;
      int64_t n = 0;
      for (int64_t p = 0; p < sink; ++p) out[n++] = row_table[p];
      for (int64_t i = 0; i < topk; ++i) out[n++] = row_table[sink + order[i]];
      for (int64_t p = num_blocks - recent; p < num_blocks; ++p) out[n++] = row_table[p];
      std::fill(out + n, out + width, -1);
      lens_out[r] = (n - 1) * block_size + contexts[r] - (num_blocks - 1) * block_size;
    }
  });
}

}  // namespace

// query [T, H, D] (float32, bfloat16 or half; unit stride in D), bounds [num_blocks, 2, kv_heads, D]
// float32, block_tables [N, W], q_starts, context_lens [N], settings [N, 3] (sink, recent, topk), all int64:
// the tables [N, W] and context lengths [N] the paged kernel reads (see above).
std::tuple<at::Tensor, at::Tensor> sparse_tables(const at::Tensor& query, const at::Tensor& bounds,
                                                 const at::Tensor& block_tables, const at::Tensor& q_starts,
                                                 const at::Tensor& context_lens, const at::Tensor& settings,
                                                 int64_t block_size, double scale) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [T, H, D] with unit stride in D");
  TORCH_CHECK(bounds.dim() == 4 && bounds.size(1) == 2 && bounds.is_contiguous() &&
                  bounds.scalar_type() == at::kFloat && bounds.size(3) == query.size(2) &&
                  query.size(1) % bounds.size(2) == 0,
              "bounds must be contiguous float32 [num_blocks, 2, kv_heads, head_dim] of the query's heads");
  for (const auto* t : {&block_tables, &q_starts, &context_lens, &settings}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "step metadata must be contiguous int64");
  }
  const int64_t rows = block_tables.size(0);
  TORCH_CHECK(block_tables.dim() == 2 && q_starts.numel() == rows && context_lens.numel() == rows &&
                  settings.dim() == 2 && settings.size(0) == rows && settings.size(1) == 3,
              "block_tables [N, W], q_starts [N], context_lens [N] and settings [N, 3] must agree");
  TORCH_CHECK(block_size >= 1, "block_size must be >= 1");
  at::Tensor tables = block_tables.clone(), lens = context_lens.clone();
  const float s = static_cast<float>(scale);
  switch (query.scalar_type()) {
    case at::kFloat:
      select_rows<float>(query, bounds, block_tables, q_starts, context_lens, settings, block_size, s, tables, lens);
      break;
    case at::kBFloat16:
      select_rows<at::BFloat16>(query, bounds, block_tables, q_starts, context_lens, settings, block_size, s, tables,
                                lens);
      break;
    case at::kHalf:
      select_rows<at::Half>(query, bounds, block_tables, q_starts, context_lens, settings, block_size, s, tables,
                            lens);
      break;
    default:
      TORCH_CHECK(false, "sparse_tables: unsupported query dtype ", query.scalar_type());
  }
  return {tables, lens};
}
