// The row-wise ops of a Llama-shaped decoder layer on float32 rows (RMSNorm, rotary, SiLU-gated product), shared
// by the native decoder stack (decode_layers.cpp) and the entry points that run them on the other steps
// (row_ops.cpp).
#pragma once

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec.h"

namespace row_ops {

// Elements per thread below which a row loop runs on the calling thread: a parallel region costs a few
// microseconds, more than a short loop (a single stream's rows).
inline constexpr int64_t kParallelElements = 16384;

// fn(first_row, end_row) over [0, rows), split across torch's threads when the rows hold enough work.
template <typename Fn>
void for_rows(int64_t rows, int64_t width, const Fn& fn) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kParallelElements / std::max<int64_t>(1, width)), fn);
}

// out = x * rsqrt(mean(x^2) + eps) * w, row by row (transformers' LlamaRMSNorm in float32).
inline void rms_norm(const float* x, const float* w, float* out, int64_t rows, int64_t width, float eps) {
  for_rows(rows, width, [&](int64_t first, int64_t end) {
    for (int64_t r = first; r < end; ++r) {
      const float* xr = x + r * width;
      float* o = out + r * width;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < width; ++i) sum += xr[i] * xr[i];
      const float rstd = 1.f / std::sqrt(sum / static_cast<float>(width) + eps);
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) o[i] = (xr[i] * rstd) * w[i];
    }
  });
}

// Rotates `heads` heads of head_dim d at x (row stride `stride`) in place: x*cos + roll(x, d/2)*signed_sin;
// `saved` holds d floats of scratch.
inline void rotate(float* x, int64_t rows, int64_t stride, int64_t heads, int64_t d, const float* cos, const float* ssin,
            std::vector<float>& saved) {
  const int64_t half = d / 2;
  for (int64_t t = 0; t < rows; ++t) {
    const float* c = cos + t * d;
    const float* s = ssin + t * d;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + t * stride + h * d;
      std::memcpy(saved.data(), v, d * sizeof(float));
      for (int64_t i = 0; i < half; ++i) v[i] = saved[i] * c[i] + saved[i + half] * s[i];
      for (int64_t i = half; i < d; ++i) v[i] = saved[i] * c[i] + saved[i - half] * s[i];
    }
  }
}

// out [rows, inter] = silu(gate) * up from gate_up [rows, 2 * inter] (vec::fast_exp: the loop vectorises).
inline void silu_mul(const float* gate_up, float* out, int64_t rows, int64_t inter) {
  for_rows(rows, inter, [&](int64_t first, int64_t end) {
    for (int64_t r = first; r < end; ++r) {
      const float* g = gate_up + r * 2 * inter;
      const float* u = g + inter;
      float* o = out + r * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) o[i] = g[i] / (1.f + vec::fast_exp(-g[i])) * u[i];
    }
  });
}

}  // namespace row_ops
