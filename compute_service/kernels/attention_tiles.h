// A prompt chunk's attention as register-tiled products, with its rows in the vector lanes: float32 keys and
// values, no sliding window or soft-cap (attend_all sends the rest to attend_item). Included by
// paged_attention.cpp only (its functions sit in that translation unit's anonymous namespace).
//
// The task's rows (every query head of one KV head for each query of the chunk, row i * group + j) are held
// transposed, qt[d][row], so that a key's scores for kLanes rows are one vector: scores[t][row] = sum over d
// of k_t[d] * qt[d][row], one broadcast of k_t[d] and one load of qt[d] per FMA row of the tile. The softmax
// then runs down the keys, lane by lane: each row's running maximum and sum are vector lanes, with no
// horizontal reduction; and the values go the same way into the transposed accumulator, out[d][row] += v_t[d]
// * p[t][row]. Keys come kTileKeys at a time, read in place by block table (any block size). Against the
// per-row loops of attend_block this is what a GEMM does: every key and value element loaded once serves
// kTileRows vectors of rows (figures: docs/internals/native-attention.md).
#pragma once

#include "attention_block.h"

#include <array>
#include <bit>
#include <limits>

namespace {

using vec::Float;
using vec::kLanes;

// The register tiles: kTileFactors keys (or head dims) by kTileRows vectors of rows, accumulators in
// registers, plus kTileFactors broadcasts (AVX-512: 24 + 4 of 32 registers; AVX2: 12 + 3 of 16).
#ifdef __AVX512F__
constexpr int kTileFactors = 4;
constexpr int kTileRows = 6;
#else
constexpr int kTileFactors = 3;
constexpr int kTileRows = 4;
#endif

// Whether the tiled path takes an item of `rows` query rows: float32 keys and queries (kTiledTypes), no window
// or soft-cap, a head dim of whole vectors, at least one whole vector of rows (a lone decode's few rows would leave most lanes idle).
template <typename kv_t, typename q_t>
constexpr bool kTiledTypes = std::is_same_v<kv_t, float> && std::is_same_v<q_t, float>;

inline bool tiled(const Geometry& g, int64_t rows) {
  return g.window == 0 && g.softcap == 0.0f && g.head_dim % kLanes == 0 && rows >= kLanes;
}

// c[f][v] (+)= sum over i < n of a[f](i) * b[i][v], for F factors and V vectors of rows: c's rows at c + f *
// ld_c, b's at b + i * ld_b; a(f, i) gives the factor. Accumulates into c when `accumulate`.
template <int F, int V, typename A>
inline void rank_updates(A a, const float* __restrict__ b, int64_t ld_b, int64_t n, float* __restrict__ c,
                         int64_t ld_c, bool accumulate) {
  Float acc[F][V];
  for (int f = 0; f < F; ++f)
    for (int v = 0; v < V; ++v) acc[f][v] = accumulate ? vec::load(c + f * ld_c + v * kLanes) : Float{};
  for (int64_t i = 0; i < n; ++i) {
    const float* row = b + i * ld_b;
    Float x[V];
    for (int v = 0; v < V; ++v) x[v] = vec::load(row + v * kLanes);
    for (int f = 0; f < F; ++f) {
      const Float s = Float{} + a(f, i);
      for (int v = 0; v < V; ++v) acc[f][v] += s * x[v];
    }
  }
  for (int f = 0; f < F; ++f)
    for (int v = 0; v < V; ++v) vec::store(c + f * ld_c + v * kLanes, acc[f][v]);
}

// rank_updates<nf, nv> (nf <= F, nv <= V) as a compile-time tile.
template <int F, int V, typename A>
inline void sized_updates(int64_t nf, int64_t nv, A a, const float* b, int64_t ld_b, int64_t n, float* c, int64_t ld_c,
                          bool accumulate) {
  if constexpr (F > 1) {
    if (nf < F) return sized_updates<F - 1, V>(nf, nv, a, b, ld_b, n, c, ld_c, accumulate);
  }
  if constexpr (V > 1) {
    if (nv < V) return sized_updates<F, V - 1>(nf, nv, a, b, ld_b, n, c, ld_c, accumulate);
  }
  rank_updates<F, V>(a, b, ld_b, n, c, ld_c, accumulate);
}

// rank_updates over `factors` x `vectors` in tiles of at most kTileFactors x kTileRows: a(f, i) for the
// factor f counted from 0.
template <typename A>
void tiled_updates(A a, int64_t factors, const float* b, int64_t ld_b, int64_t n, int64_t vectors, float* c,
                   int64_t ld_c, bool accumulate) {
  for (int64_t v0 = 0; v0 < vectors; v0 += kTileRows) {
    const int64_t nv = std::min<int64_t>(kTileRows, vectors - v0);
    for (int64_t f0 = 0; f0 < factors; f0 += kTileFactors) {
      const int64_t nf = std::min<int64_t>(kTileFactors, factors - f0);
      const auto af = [&](int f, int64_t i) { return a(f0 + f, i); };
      const float* bv = b + v0 * kLanes;
      float* cv = c + f0 * ld_c + v0 * kLanes;
      sized_updates<kTileFactors, kTileRows>(nf, nv, af, bv, ld_b, n, cv, ld_c, accumulate);
    }
  }
}

typedef int32_t IntLanes __attribute__((vector_size(kLanes * sizeof(int32_t))));

// The shuffle of one transpose stage (see transpose): lane p of the low result takes a[p] where bit W of p is 0,
// else b[p - W]; of the high result, a[p + W], else b[p].
template <int W>
constexpr IntLanes stage_mask(bool high) {
  std::array<int32_t, kLanes> m{};
  for (int p = 0; p < kLanes; ++p) m[p] = (p & W) == 0 ? p + (high ? W : 0) : kLanes + p - (high ? 0 : W);
  return std::bit_cast<IntLanes>(m);
}

// Transposes kLanes x kLanes floats in place: the off-diagonal W x W blocks of every 2W x 2W block swapped,
// for W = kLanes / 2 down to 1.
template <int W = kLanes / 2>
inline void transpose(Float (&r)[kLanes]) {
  constexpr IntLanes low = stage_mask<W>(false), high = stage_mask<W>(true);
  for (int i = 0; i < kLanes; ++i) {
    if ((i & W) != 0) continue;
    const Float a = r[i], b = r[i + W];
    r[i] = __builtin_shuffle(a, b, low);
    r[i + W] = __builtin_shuffle(a, b, high);
  }
  if constexpr (W > 1) transpose<W / 2>(r);
}

// Sets p[t][row] to `value` where key t0 + t lies past the position of the row's query (first_pos + i for
// rows i * group .. i * group + group - 1, i < count): the keys a causal query does not see.
inline void mask_future(float* p, int64_t lanes, int64_t t0, int64_t n, int64_t first_pos, int64_t count,
                        int64_t group, float value) {
  for (int64_t i = 0; i < count; ++i) {
    for (int64_t t = std::max<int64_t>(0, first_pos + i + 1 - t0); t < n; ++t) {
      std::fill(p + t * lanes + i * group, p + t * lanes + (i + 1) * group, value);
    }
  }
}

// Attention of queries [item_first, item_first + item_count) of a sequence (q_len new tokens from q_start of
// the packed batch, context_len keys through `table`) for the KV heads of `heads`, written to `out`.
void attend_item_tiled(int64_t item_first, int64_t item_count, Heads heads, const at::Tensor& query, at::Tensor& out, const float* k_cache,
                       const float* v_cache, const int64_t* table, int64_t context_len, int64_t q_len,
                       int64_t q_start, const Geometry& g, float q_scale, float v_scale, Scratch& s) {
  const int64_t hd = g.head_dim, rows = item_count * g.group, lanes = padded_rows(rows);
  const int64_t vectors = lanes / kLanes, stride = g.num_kv_heads * hd;
  const int64_t first_pos = context_len - q_len + item_first, first_token = q_start + item_first;
  const int64_t keys = first_pos + item_count;  // the last query sees up to here
  s.size_tiles(g);
  float *qt = s.qt.data(), *ot = s.ot.data(), *pt = s.pt.data(), *mx = s.tile_max.data(), *sm = s.tile_sum.data();
  float *top = s.tile_top.data(), *scale = s.tile_scale.data();
  const float* q_data = query.data_ptr<float>();
  float* o_data = out.data_ptr<float>();
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t h = heads.first; h < heads.first + heads.count; ++h) {
    // the queries transposed and scaled, padded rows zero
    const auto row_of = [&](auto* data, int64_t stride0, int64_t stride1, int64_t r) {
      return data + (first_token + r / g.group) * stride0 + (h * g.group + r % g.group) * stride1;
    };
    for (int64_t r0 = 0; r0 < lanes; r0 += kLanes) {
      const float* src[kLanes];
      for (int l = 0; l < kLanes; ++l) {
        src[l] = r0 + l < rows ? row_of(q_data, query.stride(0), query.stride(1), r0 + l) : nullptr;
      }
      for (int64_t d0 = 0; d0 < hd; d0 += kLanes) {
        Float block[kLanes];
        for (int l = 0; l < kLanes; ++l) block[l] = src[l] != nullptr ? vec::load(src[l] + d0) * q_scale : Float{};
        transpose(block);
        for (int l = 0; l < kLanes; ++l) vec::store(qt + (d0 + l) * lanes + r0, block[l]);
      }
    }
    std::fill(ot, ot + hd * lanes, 0.0f);
    std::fill(mx, mx + lanes, -inf);
    std::fill(sm, sm + lanes, 0.0f);
    const float* krow[kTileKeys];
    const float* vrow[kTileKeys];
    for (int64_t t0 = 0; t0 < keys; t0 += kTileKeys) {
      const int64_t n = std::min(kTileKeys, keys - t0);
      for (int64_t t = 0; t < n; ++t) {
        const int64_t key = t0 + t, block = table[key / g.block_size];
        TORCH_CHECK(block >= 0 && block < g.num_blocks, "block id ", block, " is outside the pool");
        const int64_t offset = (block * g.block_size + key % g.block_size) * stride + h * hd;
        krow[t] = k_cache + offset;
        vrow[t] = v_cache + offset;
      }
      // scores: pt[t][row] = sum over d of k_t[d] * qt[d][row]
      tiled_updates([&](int f, int64_t d) { return krow[f][d]; }, n, qt, lanes, hd, vectors, pt, lanes, false);
      // causal: a key past a row's query position is not seen (only in the keys the chunk's queries reach)
      const bool diagonal = t0 + n - 1 > first_pos;
      if (diagonal) mask_future(pt, lanes, t0, n, first_pos, item_count, g.group, -inf);
      // the online softmax down the keys, each row a lane; every row sees the tile's first key in the first
      // tile (key 0), so its maximum is finite from then on. The maxima first, key by key over all lanes (each
      // lane's chain of maxima independent of the others'), then each lane's rescale where its maximum moved.
      std::copy(mx, mx + lanes, top);
      for (int64_t t = 0; t < n; ++t) {
        const float* p = pt + t * lanes;
#pragma omp simd
        for (int64_t r = 0; r < lanes; ++r) top[r] = std::max(top[r], p[r]);
      }
      if (t0 > 0) {
#pragma omp simd
        for (int64_t r = 0; r < lanes; ++r) scale[r] = vec::fast_exp(mx[r] - top[r]);
        for (int64_t r = 0; r < lanes; r += kLanes) {
          if (!std::any_of(scale + r, scale + r + kLanes, [](float x) { return x != 1.0f; })) continue;
          const Float by = vec::load(scale + r);
          vec::store(sm + r, vec::load(sm + r) * by);
          for (int64_t d = 0; d < hd; ++d) vec::store(ot + d * lanes + r, vec::load(ot + d * lanes + r) * by);
        }
      }
      std::copy(top, top + lanes, mx);
      for (int64_t t = 0; t < n; ++t) {
        float* p = pt + t * lanes;
#pragma omp simd
        for (int64_t r = 0; r < lanes; ++r) p[r] = vec::fast_exp(p[r] - mx[r]);
      }
      // 0 where the score was -inf (fast_exp clamps it to e^-87)
      if (diagonal) mask_future(pt, lanes, t0, n, first_pos, item_count, g.group, 0.0f);
      for (int64_t t = 0; t < n; ++t) {
        const float* p = pt + t * lanes;
#pragma omp simd
        for (int64_t r = 0; r < lanes; ++r) sm[r] += p[r];
      }
      // values: ot[d][row] += sum over t of v_t[d] * pt[t][row]
      tiled_updates([&](int f, int64_t t) { return vrow[t][f]; }, hd, pt, lanes, n, vectors, ot, lanes, true);
    }
    for (int64_t r0 = 0; r0 < rows; r0 += kLanes) {
      for (int64_t d0 = 0; d0 < hd; d0 += kLanes) {
        Float block[kLanes];
        for (int l = 0; l < kLanes; ++l) block[l] = vec::load(ot + (d0 + l) * lanes + r0);
        transpose(block);
        for (int l = 0; l < kLanes && r0 + l < rows; ++l) {
          vec::store(row_of(o_data, out.stride(0), out.stride(1), r0 + l) + d0, block[l] * (v_scale / sm[r0 + l]));
        }
      }
    }
  }
}

}  // namespace
