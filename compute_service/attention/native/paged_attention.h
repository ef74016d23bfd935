// The native module's entry points (paged_attention.cpp, decode_layers.cpp, greedy.cpp, panel_linear.cpp).
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>

// e^x (Cody-Waite range reduction, Cephes' degree-5 polynomial; relative error ~1e-7), x clamped to [-87, 88]
// so that the result stays a normal float; a plain function of floats so that a loop over it vectorises,
// unlike std::exp.
inline float vector_exp(float x) {
  x = std::clamp(x, -87.0f, 88.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.0f;
  return e * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}

// See paged_attention.cpp.
void paged_attention(const at::Tensor& query_in, at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& q_starts, const at::Tensor& q_lens,
                     const at::Tensor& context_lens, double scale, double k_scale, double v_scale);

// See greedy.cpp: per row of logits [rows, vocab] float32, its first most likely token and log-probability.
std::tuple<at::Tensor, at::Tensor> greedy(const at::Tensor& logits);

// See decode_layers.cpp.
double decode_layers(at::Tensor& residual, const at::Tensor& cos, const at::Tensor& signed_sin,
                     const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& scales,
                     const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                     const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& q_starts,
                     const at::Tensor& q_lens, const at::Tensor& context_lens, int64_t num_heads,
                     int64_t num_kv_heads, double eps, double scale);

// See panel_linear.cpp: float32 or int8 weights [out, in] packed into panels, and x [rows, in] times them
// (* scales, for int8) (+ bias).
int64_t panel_width();
at::Tensor pack_panels(const at::Tensor& weight);
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t out,
                        const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& scales);
