// The native module's entry points (paged_attention.cpp, decode_layers.cpp).
#pragma once

#include <torch/extension.h>

#include <vector>

// See paged_attention.cpp.
void paged_attention(const at::Tensor& query_in, at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& q_starts, const at::Tensor& q_lens,
                     const at::Tensor& context_lens, double scale, double k_scale, double v_scale);

// See decode_layers.cpp.
double decode_layers(at::Tensor& residual, const at::Tensor& cos, const at::Tensor& signed_sin,
                     const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& k_caches,
                     const std::vector<at::Tensor>& v_caches, const at::Tensor& slot_mapping,
                     const at::Tensor& block_tables, const at::Tensor& q_starts, const at::Tensor& q_lens,
                     const at::Tensor& context_lens, int64_t num_heads, int64_t num_kv_heads, double eps,
                     double scale);
