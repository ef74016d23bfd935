// The panels' tiles for compute_service/kernels/panel_linear.cpp (see its opening comment): the constants that
// shape the panels and tiles on this ISA, and one struct per kind of weights (Plain: float32 or int8; Int4) whose
// tile<R> multiplies R rows of x by one panel.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "vec.h"

namespace panels {

constexpr int kLanes = vec::kLanes;
#ifdef __AVX512F__
constexpr int kVectors = 2;
constexpr int kMaxRows = 12;  // 24 accumulators of the 32 vector registers
#else
// NOTE: 6 rows x 2 vectors, not 4 x 3: both hold 12 accumulators of the 16 vector registers, but beside 4 x 3's
// accumulators and broadcast no register is left for the panel's 3 vectors, so GCC reads them again as an operand
// of every FMA: 16 loads per 12 FMAs, and the loads set the pace. 6 x 2 keeps the panel's 2 vectors in registers:
// 8 loads per 12 FMAs (figures: docs/internals/cpu-fast-path.md).
constexpr int kVectors = 2;
constexpr int kMaxRows = 6;
#endif
constexpr int64_t kPanel = kVectors * kLanes;
// How far ahead of the k step computed the panel is prefetched: 16 float32 steps (best of 8-128 measured).
constexpr int64_t kPrefetchBytes = 16 * kPanel * sizeof(float);
// Rows of x one task reads against a panel (at in=1536, 96 rows are 590 KB, which L2 holds).
constexpr int64_t kRowBlock = 96;
// Int4 tiles that read the levels straight from the panel hold two sets of accumulators (the running sums and
// the group's), so at most this many rows; and they serve products of at most kInt4DirectRows rows, larger
// ones dequantising each panel once (see Int4).
#ifdef __AVX512F__
constexpr int kInt4Rows = 4, kInt4SplitRows = 4;
#else
constexpr int kInt4Rows = 2, kInt4SplitRows = 1;
#endif
constexpr int64_t kInt4DirectRows = 8;

using vec::Float;
using vec::load;
using vec::store;

// The R rows' sums, times the column's scale and plus its bias where given, stored to y's first `cols` columns.
template <int R>
void store_rows(Float (&acc)[R][kVectors], const float* scales, const float* bias, float* y, int64_t out,
                int64_t cols) {
  float row[kPanel];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < kVectors; ++c) store(row + c * kLanes, acc[r][c]);
    if (scales != nullptr)
      for (int64_t j = 0; j < cols; ++j) row[j] *= scales[j];
    if (bias != nullptr)
      for (int64_t j = 0; j < cols; ++j) row[j] += bias[j];
    std::copy(row, row + cols, y + r * out);
  }
}

// Float32 or int8 panels (W), int8 ones with a scale per output column.
template <typename W>
struct Plain {
  const W* weights;
  const float* scales;  // [panels * kPanel], or null

  static constexpr int max_rows() { return kMaxRows; }

  // y[r, 0:cols] = x[r, :] . panel p (* its scales) (+ bias[0:cols]) for the R rows from x and y, K = in (`row`:
  // x's first row in the product).
  template <int R>
  void tile(const float* x, int64_t /*row*/, int64_t K, int64_t p, const float* bias, float* y, int64_t out,
            int64_t cols) const {
    const W* panel = weights + p * K * kPanel;
    Float acc[R][kVectors];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kVectors; ++c) acc[r][c] = Float{};
    for (int64_t k = 0; k < K; ++k) {
      const W* at = panel + k * kPanel;
      // NOTE: a prefetch past the end of the weights does not fault. Later tiles of a panel find it in L2, and
      // their prefetches bring it on to L1 (skipping them there measured the same).
      const char* ahead = reinterpret_cast<const char*>(at) + kPrefetchBytes;
      for (int64_t line = 0; line < kPanel * int64_t(sizeof(W)); line += 64) __builtin_prefetch(ahead + line, 0, 3);
      Float w[kVectors];
      for (int c = 0; c < kVectors; ++c) w[c] = load(at + c * kLanes);
      for (int r = 0; r < R; ++r) {
        const Float b = Float{} + x[r * K + k];
        for (int c = 0; c < kVectors; ++c) acc[r][c] += b * w[c];
      }
    }
    store_rows<R>(acc, scales == nullptr ? nullptr : scales + p * kPanel, bias, y, out, cols);
  }
};

// The kLanes columns' int4 levels at a pair of inputs (kLanes bytes at p: the first input's in the low nibbles,
// the second's in the high ones) as floats, 0 to 15: each byte widened to a lane, then split.
inline void load_int4(const uint8_t* p, Float& first, Float& second) {
#ifdef __AVX512F__
  const __m512i lanes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  first = reinterpret_cast<Float>(_mm512_cvtepi32_ps(_mm512_and_si512(lanes, _mm512_set1_epi32(15))));
  second = reinterpret_cast<Float>(_mm512_cvtepi32_ps(_mm512_srli_epi32(lanes, 4)));
#else
  const __m256i lanes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  first = reinterpret_cast<Float>(_mm256_cvtepi32_ps(_mm256_and_si256(lanes, _mm256_set1_epi32(15))));
  second = reinterpret_cast<Float>(_mm256_cvtepi32_ps(_mm256_srli_epi32(lanes, 4)));
#endif
}

// kLanes bfloat16 values widened to float32 (exactly: their bits moved to the top half).
inline Float load_bf16(const uint16_t* p) {
#ifdef __AVX512F__
  const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return reinterpret_cast<Float>(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
#else
  const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<Float>(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
#endif
}

// Int4 panels: kPanel bytes per pair of inputs (see the top of the file) and, per group of `group` inputs,
// kPanel scales then kPanel zero points in bfloat16 (the values compute_service/quantized.py rounds them to);
// level q stands for (q - 8) * scale + zero.
//
// A tile of a few rows sums x times the levels over each group, then scales the group's sums in:
// sum_k x_k ((q_k - 8) s + z) = s sum_k x_k q_k + (z - 8 s) X, X the group's sum of x (`sums`, [rows, groups]);
// the levels are read straight from the panel, so a decode streams half a byte per weight and widens it once.
// Larger batches (`dequantise`) have each task first write its panel's weights out as float32 (exactly the
// dequantised values; [K, kPanel], in L2) and run the float32 tiles on them, so a prompt pays for widening the
// levels once per panel, not once per tile.
struct Int4 {
  const uint8_t* levels;   // [panels, K / 2, kPanel]
  const uint16_t* groups;  // [panels, K / group, 2, kPanel], bfloat16
  int64_t group;
  const float* sums;  // [rows, K / group]: the groups' sums of x, for the direct tiles; null: dequantise
  uint64_t call;      // this product's number, so that no task reuses another product's panel

  int max_rows() const { return sums == nullptr ? kMaxRows : kInt4Rows; }

  template <int R>
  void tile(const float* x, int64_t row, int64_t K, int64_t p, const float* bias, float* y, int64_t out,
            int64_t cols) const {
    if (sums == nullptr)
      Plain<float>{panel_floats(K, p), nullptr}.template tile<R>(x, row, K, 0, bias, y, out, cols);
    else if constexpr (R <= kInt4Rows)
      direct<R>(x, K, p, sums + row * (K / group), bias, y, out, cols);
  }

 private:
  template <int R>
  void direct(const float* x, int64_t K, int64_t p, const float* xsums, const float* bias, float* y, int64_t out,
              int64_t cols) const {
    const int64_t stride = K / group;
    const uint8_t* panel = levels + p * K * (kPanel / 2);
    const uint16_t* params = groups + p * (K / group) * 2 * kPanel;
    Float acc[R][kVectors];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kVectors; ++c) acc[r][c] = Float{};
    for (int64_t g = 0; g < K; g += group, params += 2 * kPanel, ++xsums) {
      // NOTE: the even and the odd inputs in sums of their own where the registers allow, so that no chain of
      // dependent adds sets the pace.
      constexpr int kParts = R <= kInt4SplitRows ? 2 : 1;
      Float part[kParts][R][kVectors];
      for (int h = 0; h < kParts; ++h)
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < kVectors; ++c) part[h][r][c] = Float{};
      for (int64_t k = g; k < g + group; k += 2) {
        const uint8_t* at = panel + k * (kPanel / 2);
        const char* ahead = reinterpret_cast<const char*>(at) + kPrefetchBytes;
        for (int64_t line = 0; line < kPanel; line += 64) __builtin_prefetch(ahead + line, 0, 3);
        for (int c = 0; c < kVectors; ++c) {
          Float q0, q1;
          load_int4(at + c * kLanes, q0, q1);
          for (int r = 0; r < R; ++r) {
            part[0][r][c] += (Float{} + x[r * K + k]) * q0;
            part[kParts - 1][r][c] += (Float{} + x[r * K + k + 1]) * q1;
          }
        }
      }
      for (int c = 0; c < kVectors; ++c) {
        const Float s = load_bf16(params + c * kLanes), offset = load_bf16(params + kPanel + c * kLanes) - 8.0f * s;
        for (int r = 0; r < R; ++r) {
          const Float sum = kParts == 1 ? part[0][r][c] : part[0][r][c] + part[kParts - 1][r][c];
          acc[r][c] += s * sum;
          acc[r][c] += offset * (Float{} + xsums[r * stride]);
        }
      }
    }
    store_rows<R>(acc, nullptr, bias, y, out, cols);
  }

  // Panel p's weights as float32 [K, kPanel] in this thread's buffer, written once per product and panel.
  const float* panel_floats(int64_t K, int64_t p) const {
    thread_local std::vector<float> buffer;
    thread_local uint64_t held_call = 0;
    thread_local int64_t held_panel = -1;
    if (held_call == call && held_panel == p) return buffer.data();
    buffer.resize(K * kPanel);
    const uint8_t* panel = levels + p * K * (kPanel / 2);
    const uint16_t* params = groups + p * (K / group) * 2 * kPanel;
    for (int64_t g = 0; g < K; g += group, params += 2 * kPanel) {
      for (int c = 0; c < kVectors; ++c) {
        const Float s = load_bf16(params + c * kLanes), z = load_bf16(params + kPanel + c * kLanes);
        for (int64_t k = g; k < g + group; k += 2) {
          Float q0, q1;
          load_int4(panel + k * (kPanel / 2) + c * kLanes, q0, q1);
          store(buffer.data() + k * kPanel + c * kLanes, (q0 - 8.0f) * s + z);
          store(buffer.data() + (k + 1) * kPanel + c * kLanes, (q1 - 8.0f) * s + z);
        }
      }
    }
    held_call = call;
    held_panel = p;
    return buffer.data();
  }
};

}  // namespace panels
