// One block of keys folded into the running softmax of scratch rows (attend_block), and the loops over a
// table's blocks and a query's rows around it. Included by paged_attention.cpp only (its functions sit in
// that translation unit's anonymous namespace).
#pragma once

#include <ATen/ATen.h>

#include "attention_rows.h"

namespace {

// Folds one block of keys [k, k + n rows) into the running max, sum and accumulator of scratch rows
// [r0, r0 + rows); row r0 + r sees the block's keys [s.first[r], visible[r]) (visible[r] <= n; none when
// visible[r] <= s.first[r]; s.first stays 0 but in a sliding window).
template <int64_t D, typename kv_t>
void attend_block(const kv_t* __restrict__ k, const kv_t* __restrict__ v, const int64_t* visible, int64_t rows,
                  int64_t r0, const Geometry& g, Scratch& s) {
  const int64_t stride = g.num_kv_heads * g.head_dim, hd = g.head_dim;
  // the rows that see any key of the block
  int64_t* const active = s.active.data();
  const int64_t* const lo = s.first.data();
  int64_t count = 0;
  for (int64_t r = 0; r < rows; ++r) {
    if (visible[r] > lo[r]) active[count++] = r;
  }
  // NOTE: float keys of head dim 64 in blocks of 16 go through scores64/values64: explicit vectors, up to four
  // rows per key or value load, a block's 16 scores summed together (faster than row_scores/pair_values at
  // one decode and at many: docs/internals/kernels.md).
  constexpr bool kVec64 = vec::kAvx512 && D == 64 && std::is_same_v<kv_t, float>;
  const bool vec64 = kVec64 && g.block_size == 16;
  // NOTE: not where scores64 serves, at any row count: scores64 was faster than the transposed keys there too
  // (docs/internals/native-attention.md).
  const bool transposed = !vec64 && g.block_size == kTransposedBlock && count >= kTransposedRows;
  // the scratch rows (r0 + active[i]) of runs of up to four active rows, and the most keys any of them sees
  const auto run = [&](int64_t first, int64_t n, int64_t* at) {
    int64_t keys = 0;
    for (int64_t i = 0; i < n; ++i) {
      at[i] = r0 + active[first + i];
      keys = std::max(keys, visible[active[first + i]]);
    }
    return keys;
  };
  if (transposed) {
    scores_transposed<D>(k, stride, *std::max_element(visible, visible + rows), visible, rows, r0, g, s);
  } else if constexpr (kVec64) {
    if (vec64) {
      in_fours(count, [&]<int R>(int64_t first) {
        int64_t at[R];
        const int64_t keys = run(first, R, at);
        const float* q[R];
        float* out[R];
        for (int i = 0; i < R; ++i) {
          q[i] = &s.q[at[i] * hd];
          out[i] = &s.scores[at[i] * g.block_size];
        }
        scores64<R>(q, reinterpret_cast<const float*>(k), stride, keys, out);
      });
    }
  }
  float* const row_maxes = &s.max[r0];
  float* const sums = &s.sum[r0];
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t m = visible[r], first = lo[r];
    if (m <= first) continue;
    float* __restrict__ scores = &s.scores[(r0 + r) * g.block_size];
    if (!transposed && !vec64) {
      row_scores<D>(&s.q[(r0 + r) * hd], k + first * stride, stride, m - first, hd, scores + first);
    }
    if (g.softcap > 0.0f) {
      const float cap = g.softcap, inverse = 1.0f / g.softcap;
#pragma omp simd
      for (int64_t t = first; t < m; ++t) scores[t] = cap * vec::fast_tanh(scores[t] * inverse);
    }
    float block_max = -std::numeric_limits<float>::infinity();
    for (int64_t t = first; t < m; ++t) block_max = std::max(block_max, scores[t]);
    float* __restrict__ acc = &s.acc[(r0 + r) * hd];
    if (block_max > row_maxes[r]) {
      const float rescale = std::exp(row_maxes[r] - block_max);  // 0 for the first block (max = -inf)
      sums[r] *= rescale;
#pragma omp simd
      for (int64_t d = 0; d < hd; ++d) acc[d] *= rescale;
      row_maxes[r] = block_max;
    }
    const float row_max = row_maxes[r];
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = first; t < m; ++t) {
      scores[t] = vec::fast_exp(scores[t] - row_max);
      sum += scores[t];
    }
    sums[r] += sum;
    // the values run over the block's first keys up to the longest row's
    std::fill(scores, scores + first, 0.0f);
    std::fill(scores + m, scores + g.block_size, 0.0f);
  }
  // then the values: four rows at a time through values64, else two at a time where the head dim is a
  // compile-time size
  if constexpr (kVec64) {
    if (vec64) {
      in_fours(count, [&]<int R>(int64_t first) {
        int64_t at[R];
        const int64_t keys = run(first, R, at);
        float* acc[R];
        const float* p[R];
        for (int i = 0; i < R; ++i) {
          acc[i] = &s.acc[at[i] * hd];
          p[i] = &s.scores[at[i] * g.block_size];
        }
        values64<R>(acc, p, reinterpret_cast<const float*>(v), stride, keys);
      });
      return;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t m = visible[r];
    if (m <= lo[r]) continue;
    int64_t next = r + 1;
    while (next < rows && visible[next] <= lo[next]) ++next;
    if constexpr (D > 0) {
      if (next < rows) {
        pair_values<D>(&s.acc[(r0 + r) * hd], &s.acc[(r0 + next) * hd], &s.scores[(r0 + r) * g.block_size],
                       &s.scores[(r0 + next) * g.block_size], v, stride, std::max(m, visible[next]));
        r = next;
        continue;
      }
    }
    row_values<D>(&s.acc[(r0 + r) * hd], &s.scores[(r0 + r) * g.block_size], v, stride, m, hd);
  }
}

// Asks for the next block's rows of this KV head while the current one is attended: its rows lie a whole
// token row (all KV heads) apart, a stride the hardware prefetcher follows late. (A task of every KV head
// reads whole blocks; prefetching those as well measured no gain.)
template <typename kv_t>
inline void prefetch_block(const kv_t* k, const kv_t* v, int64_t block, int64_t kv_head, const Geometry& g) {
  if (block < 0 || block >= g.num_blocks) return;  // refused when its turn comes
  const int64_t row = g.num_kv_heads * g.head_dim, bytes = g.head_dim * static_cast<int64_t>(sizeof(kv_t));
  const int64_t offset = block * g.block_size * row + kv_head * g.head_dim;
  for (int64_t t = 0; t < g.block_size; ++t) {
    const char* kt = reinterpret_cast<const char*>(k + offset + t * row);
    const char* vt = reinterpret_cast<const char*>(v + offset + t * row);
    for (int64_t b = 0; b < bytes; b += 64) {
      __builtin_prefetch(kt + b);
      __builtin_prefetch(vt + b);
    }
  }
}

// Copies the rows of one query token (every query head of a KV head, scaled) into s.q from row `first_row`.
template <typename q_t>
void load_query(const at::Tensor& query, int64_t token, int64_t kv_head, int64_t first_row, const Geometry& g,
                float q_scale, Scratch& s) {
  const q_t* q_data = query.data_ptr<q_t>();
  for (int64_t j = 0; j < g.group; ++j) {
    const q_t* src = q_data + token * query.stride(0) + (kv_head * g.group + j) * query.stride(1);
    float* dst = &s.q[(first_row + j) * g.head_dim];
    for (int64_t d = 0; d < g.head_dim; ++d) dst[d] = static_cast<float>(src[d]) * q_scale;
  }
}

// Writes the normalised accumulator of `group` rows from `first_row` as the output of one query token.
template <typename q_t>
void store_output(at::Tensor& out, int64_t token, int64_t kv_head, int64_t first_row, const Geometry& g,
                  float v_scale, const Scratch& s) {
  q_t* o_data = out.data_ptr<q_t>();
  for (int64_t j = 0; j < g.group; ++j) {
    const int64_t r = first_row + j;
    q_t* dst = o_data + (token * out.size(1) + kv_head * g.group + j) * g.head_dim;
    const float norm = v_scale / s.sum[r];
    for (int64_t d = 0; d < g.head_dim; ++d) dst[d] = static_cast<q_t>(s.acc[r * g.head_dim + d] * norm);
  }
}

template <typename kv_t>
inline void attend_rows(const kv_t* k, const kv_t* v, const int64_t* visible, int64_t rows, int64_t r0,
                        const Geometry& g, Scratch& s) {
  if (g.head_dim == 64) {
    attend_block<64>(k, v, visible, rows, r0, g, s);
  } else if (g.head_dim == 128) {
    attend_block<128>(k, v, visible, rows, r0, g, s);
  } else {
    attend_block<0>(k, v, visible, rows, r0, g, s);
  }
}

inline void reset_rows(int64_t rows, const Geometry& g, Scratch& s) {
  std::fill(s.acc.begin(), s.acc.begin() + rows * g.head_dim, 0.0f);
  std::fill(s.max.begin(), s.max.begin() + rows, -std::numeric_limits<float>::infinity());
  std::fill(s.sum.begin(), s.sum.begin() + rows, 0.0f);
}

// The KV heads one task attends: [first, first + count). A task's scratch rows are laid out head by head,
// `rows` per head (every query head of that KV head for each query of the task).
struct Heads {
  int64_t first, count;
};

// Folds blocks [first_block, ...) of one table, up to `keys` keys, into the rows of every KV head of `heads`,
// where `visible` (one head's rows; the same for every head) is set up by `see(start)` for the block starting
// at key `start`.
template <typename kv_t, typename See>
void attend_blocks(const int64_t* table, int64_t first_block, int64_t keys, Heads heads, int64_t rows,
                   const kv_t* k_cache, const kv_t* v_cache, const Geometry& g, Scratch& s, See see) {
  const int64_t row = g.num_kv_heads * g.head_dim;
  for (int64_t start = first_block * g.block_size; start < keys; start += g.block_size) {
    const int64_t block = table[start / g.block_size];
    TORCH_CHECK(block >= 0 && block < g.num_blocks, "block id ", block, " is outside the pool");
    if (heads.count == 1 && start + g.block_size < keys) {
      prefetch_block(k_cache, v_cache, table[start / g.block_size + 1], heads.first, g);
    }
    see(start);
    for (int64_t h = 0; h < heads.count; ++h) {
      const int64_t offset = block * g.block_size * row + (heads.first + h) * g.head_dim;
      attend_rows(k_cache + offset, v_cache + offset, s.visible.data(), rows, h * rows, g, s);
    }
  }
}

}  // namespace
