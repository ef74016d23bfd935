// The geometry of paged attention, its scratch rows, and their arithmetic on a block: scores of query rows
// against a block's keys and values weighed into accumulators, as plain loops the compiler vectorises and, on AVX-512 builds, explicit
// 16-float vectors for head dim 64 (scores64, values64). Included by paged_attention.cpp only (its
// functions sit in that translation unit's anonymous namespace).
#pragma once

#include "kernels.h"

#include <algorithm>
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

// Keys scored, softmaxed and weighed per round of attention_tiles.h.
constexpr int64_t kTileKeys = 32;

// The vector lanes a prompt chunk's rows take in attention_tiles.h: whole vectors.
inline int64_t padded_rows(int64_t rows) { return (rows + vec::kLanes - 1) / vec::kLanes * vec::kLanes; }
inline int64_t tile_lanes(const Geometry& g) { return padded_rows(kQueryChunk * g.group); }

struct Scratch {
  std::vector<float> q, acc, max, sum, scores, keys_t;
  // attention_tiles.h: a chunk's queries and accumulator transposed [head_dim][lanes], a tile's scores
  // [keys][lanes], each lane's running maximum and sum, and a tile's maxima and rescales; sized by
  // size_tiles at a thread's first tiled task, so that steps without one (decodes) do not allocate them
  std::vector<float> qt, ot, pt, tile_max, tile_sum, tile_top, tile_scale;
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
  void size_tiles(const Geometry& g) {
    if (!qt.empty()) return;
    const int64_t lanes = tile_lanes(g);
    qt.resize(g.head_dim * lanes);
    ot.resize(qt.size());
    pt.resize(kTileKeys * lanes);
    for (auto* v : {&tile_max, &tile_sum, &tile_top, &tile_scale}) v->resize(lanes);
  }
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

}  // namespace
