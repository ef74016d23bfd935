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
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// Queries per item of a prompt chunk (32 rather than 8: chunks over a cached prefix ran faster,
// docs/internals/kernels.md), and decodes per group (more would leave a step's groups too few for the threads).
constexpr int64_t kQueryChunk = 32;
constexpr int64_t kDecodeGroup = 8;

// The pool's shape, the query heads per KV head, and how the layer attends: a query at position p sees keys
// (p - window, p] (window 0: all up to p), its scores s soft-capped to softcap * tanh(s / softcap) (0: not).
struct Geometry {
  int64_t num_blocks, block_size, num_kv_heads, head_dim, group, window;
  float softcap;
};

struct Scratch {
  std::vector<float> q, acc, max, sum, scores, keys_t;
  // per row, the keys of the current block it sees: [first, visible)
  std::vector<int64_t> visible, first, active;
  // rows: a prompt chunk's for one KV head, or a decode group's for every KV head
  Scratch(const Geometry& g) : Scratch(g, std::max(kQueryChunk * g.group, kDecodeGroup * g.group * g.num_kv_heads)) {}
  Scratch(const Geometry& g, int64_t rows)
      : q(rows * g.head_dim),
        acc(q.size()),
        max(rows),
        sum(max.size()),
        scores(max.size() * g.block_size),
        keys_t(g.head_dim * g.block_size),
        visible(max.size()),
        first(max.size()),
        active(max.size()) {}
};

// Rows at which scoring a block through its transposed keys pays for the transpose (a group's), where
// scores64 does not serve.
constexpr int64_t kTransposedRows = 8;
constexpr int64_t kTransposedBlock = 16;

// q . k over the head dim (a compile-time D where it is a common size, so the loop unrolls into vectors).
template <int64_t D, typename kv_t>
inline float dot(const float* __restrict__ q, const kv_t* __restrict__ k, int64_t head_dim) {
  const int64_t n = D > 0 ? D : head_dim;
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < n; ++d) sum += q[d] * static_cast<float>(k[d]);
  return sum;
}

// Scores of one row against keys [0, n) of a block: scores[t] = q . k_t.
template <int64_t D, typename kv_t>
inline void row_scores(const float* __restrict__ q, const kv_t* __restrict__ k, int64_t stride, int64_t n,
                       int64_t head_dim, float* __restrict__ scores) {
  for (int64_t t = 0; t < n; ++t) scores[t] = dot<D>(q, k + t * stride, head_dim);
}

// acc += sum over t < n of p[t] * v_t, the accumulator kept in registers where D is a compile-time size.
template <int64_t D, typename kv_t>
inline void row_values(float* __restrict__ acc, const float* __restrict__ p, const kv_t* __restrict__ v,
                       int64_t stride, int64_t n, int64_t head_dim) {
  if constexpr (D > 0) {
    float local[D];
    for (int64_t d = 0; d < D; ++d) local[d] = acc[d];
    for (int64_t t = 0; t < n; ++t) {
      const kv_t* __restrict__ vt = v + t * stride;
      const float pt = p[t];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) local[d] += pt * static_cast<float>(vt[d]);
    }
    for (int64_t d = 0; d < D; ++d) acc[d] = local[d];
  } else {
    for (int64_t t = 0; t < n; ++t) {
      const kv_t* __restrict__ vt = v + t * stride;
      const float pt = p[t];
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) acc[d] += pt * static_cast<float>(vt[d]);
    }
  }
}

// row_values for two rows at once, each value row loaded once for both: two rows' chains of FMAs in flight
// where one row's wait on each FMA's latency. Their p are zero past their own visible keys.
template <int64_t D, typename kv_t>
inline void pair_values(float* __restrict__ acc_a, float* __restrict__ acc_b, const float* __restrict__ pa,
                        const float* __restrict__ pb, const kv_t* __restrict__ v, int64_t stride, int64_t n) {
  float a[D], b[D];
  for (int64_t d = 0; d < D; ++d) {
    a[d] = acc_a[d];
    b[d] = acc_b[d];
  }
  for (int64_t t = 0; t < n; ++t) {
    const kv_t* __restrict__ vt = v + t * stride;
    const float at = pa[t], bt = pb[t];
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) {
      const float x = static_cast<float>(vt[d]);
      a[d] += at * x;
      b[d] += bt * x;
    }
  }
  for (int64_t d = 0; d < D; ++d) {
    acc_a[d] = a[d];
    acc_b[d] = b[d];
  }
}

// Scores of every row with visible keys against the block's first n keys, through the keys transposed once
// ([head_dim][16]): a row's 16 scores are one vector, built by FMAs over the head dim with no horizontal sums.
// For blocks of 16 keys read by many rows (a group's shared blocks).
template <int64_t D, typename kv_t>
void scores_transposed(const kv_t* __restrict__ k, int64_t stride, int64_t n, const int64_t* visible, int64_t rows,
                       int64_t r0, const Geometry& g, Scratch& s) {
  constexpr int64_t B = kTransposedBlock;
  const int64_t hd = D > 0 ? D : g.head_dim;
  float* __restrict__ kt = s.keys_t.data();
  for (int64_t t = 0; t < B; ++t) {
    for (int64_t d = 0; d < hd; ++d) kt[d * B + t] = t < n ? static_cast<float>(k[t * stride + d]) : 0.0f;
  }
  int64_t r = 0;
  // NOTE: four rows at a time, each key vector loaded once for four independent accumulators: one row's
  // chain of FMAs over the head dim waits on each FMA's latency.
  for (; r + 4 <= rows; r += 4) {
    const float* __restrict__ q = &s.q[(r0 + r) * hd];
    float a0[B] = {}, a1[B] = {}, a2[B] = {}, a3[B] = {};
    for (int64_t d = 0; d < hd; ++d) {
      const float q0 = q[d], q1 = q[hd + d], q2 = q[2 * hd + d], q3 = q[3 * hd + d];
      const float* __restrict__ kd = &kt[d * B];
#pragma omp simd
      for (int64_t t = 0; t < B; ++t) {
        a0[t] += q0 * kd[t];
        a1[t] += q1 * kd[t];
        a2[t] += q2 * kd[t];
        a3[t] += q3 * kd[t];
      }
    }
    std::copy(a0, a0 + B, &s.scores[(r0 + r) * g.block_size]);
    std::copy(a1, a1 + B, &s.scores[(r0 + r + 1) * g.block_size]);
    std::copy(a2, a2 + B, &s.scores[(r0 + r + 2) * g.block_size]);
    std::copy(a3, a3 + B, &s.scores[(r0 + r + 3) * g.block_size]);
  }
  for (; r < rows; ++r) {
    if (visible[r] <= 0) continue;
    const float* __restrict__ q = &s.q[(r0 + r) * hd];
    float acc[B] = {};
    for (int64_t d = 0; d < hd; ++d) {
      const float qd = q[d];
#pragma omp simd
      for (int64_t t = 0; t < B; ++t) acc[t] += qd * kt[d * B + t];
    }
    std::copy(acc, acc + B, &s.scores[(r0 + r) * g.block_size]);
  }
}

// NOTE: scores64/values64 serve AVX-512 builds only (vec::kAvx512). Built for AVX2 (-march=x86-64-v3), where a
// 16-float vector is two registers and a two-vector shuffle many instructions, they were slower than the plain
// loops (docs/internals/kernels.md), so AVX2 builds keep those.
using vec::Float16;
using vec::load16;
using vec::store16;

// Scores of R rows (head dim 64) against a block's first n of 16 keys, each key loaded once for all R rows:
// out[r][t] = q[r] . k_t for t < n (later lanes hold zeros).
template <int R>
inline void scores64(const float* const* q, const float* __restrict__ k, int64_t stride, int64_t n,
                     float* const* out) {
  Float16 qv[R][4], part[R][16];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) qv[r][j] = load16(q[r] + 16 * j);
  }
  for (int t = 0; t < 16; ++t) {
    if (t >= n) {
      for (int r = 0; r < R; ++r) part[r][t] = Float16{};
      continue;
    }
    const float* kt = k + t * stride;
    const Float16 k0 = load16(kt), k1 = load16(kt + 16), k2 = load16(kt + 32), k3 = load16(kt + 48);
    for (int r = 0; r < R; ++r) part[r][t] = qv[r][0] * k0 + qv[r][1] * k1 + qv[r][2] * k2 + qv[r][3] * k3;
  }
  for (int r = 0; r < R; ++r) store16(out[r], vec::sum_lanes(part[r]));
}

// acc[r] += sum over t < n of p[r][t] * v_t for R rows (head dim 64), each value row loaded once for all R
// rows, the accumulators in registers.
template <int R>
inline void values64(float* const* acc, const float* const* p, const float* __restrict__ v, int64_t stride,
                     int64_t n) {
  Float16 a[R][4];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) a[r][j] = load16(acc[r] + 16 * j);
  }
  for (int64_t t = 0; t < n; ++t) {
    const float* vt = v + t * stride;
    const Float16 v0 = load16(vt), v1 = load16(vt + 16), v2 = load16(vt + 32), v3 = load16(vt + 48);
    for (int r = 0; r < R; ++r) {
      const float pt = p[r][t];
      a[r][0] += pt * v0;
      a[r][1] += pt * v1;
      a[r][2] += pt * v2;
      a[r][3] += pt * v3;
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) store16(acc[r] + 16 * j, a[r][j]);
  }
}

// fn.template operator()<R>(first) for runs [first, first + R) of up to four that cover [0, n) (R a
// compile-time count).
template <typename Fn>
inline void in_fours(int64_t n, const Fn& fn) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) fn.template operator()<4>(i);
  switch (n - i) {
    case 3: return fn.template operator()<3>(i);
    case 2: return fn.template operator()<2>(i);
    case 1: return fn.template operator()<1>(i);
    default: return;
  }
}

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
      for (int64_t t = first; t < m; ++t) scores[t] = g.softcap * std::tanh(scores[t] / g.softcap);
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

struct Item {
  int64_t seq, first, count;  // queries [first, first + count) of the sequence's new tokens
};

// Decodes (one new query each) whose tables start with the same `shared` blocks, every key of which all of
// them see: those blocks are read once for all of them (a shared prompt's keys), the rest per sequence.
struct Group {
  int64_t seqs[kDecodeGroup];
  int64_t count, shared;
};

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
      } else {
        attend_item<kv_t, q_t>(items[task.unit - groups.size()], task.heads, query, out, k, v, tables, width,
                               q_starts.data_ptr<int64_t>(), lens, contexts, g, q_scale, v_scale, scratch);
      }
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
