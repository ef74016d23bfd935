// The kernels' entry points (paged_attention.cpp, sparse_select.cpp, decode_layers.cpp, row_ops.cpp, greedy.cpp,
// panel_linear.cpp, ceilings.cpp), bound to Python in module.cpp.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "vec.h"

// See paged_attention.cpp.
void paged_attention(const at::Tensor& query_in, at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& q_starts, const at::Tensor& q_lens,
                     const at::Tensor& context_lens, double scale, double k_scale, double v_scale,
                     int64_t window = 0, double softcap = 0.0);

// See sparse_select.cpp: the block tables and context lengths of a step's block-sparse decodes.
std::tuple<at::Tensor, at::Tensor> sparse_tables(const at::Tensor& query, const at::Tensor& bounds,
                                                 const at::Tensor& block_tables, const at::Tensor& q_starts,
                                                 const at::Tensor& context_lens, const at::Tensor& settings,
                                                 int64_t block_size, double scale);

// See greedy.cpp: per row of logits [rows, vocab] float32, its first most likely token and log-probability.
std::tuple<at::Tensor, at::Tensor> greedy(const at::Tensor& logits);

// See decode_layers.cpp.
double decode_layers(at::Tensor& residual, const at::Tensor& cos, const at::Tensor& signed_sin,
                     const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& scales,
                     const std::vector<at::Tensor>& biases, const std::vector<at::Tensor>& head_norms,
                     const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                     const std::vector<at::Tensor>& slot_mappings, const std::vector<at::Tensor>& block_tables,
                     const std::vector<int64_t>& layer_groups, const at::Tensor& q_starts, const at::Tensor& q_lens,
                     const at::Tensor& context_lens, int64_t num_heads, int64_t num_kv_heads, double eps,
                     double scale, const std::vector<int64_t>& windows, const std::vector<at::Tensor>& sparse_bounds,
                     const std::optional<at::Tensor>& sparse_settings);

// See row_ops.cpp: the decoder layer's row-wise ops on float32 rows, for the steps the native stack does not run.
at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor silu_mul_rows(const at::Tensor& gate_up);
void rotate_rows(at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin);

// See panel_linear.cpp: float32 or int8 weights [out, in], or int4 levels with their groups' scales and zero
// points, packed into panels, and x [rows, in] times them (* scales, for int8) (+ bias).
int64_t panel_width();
at::Tensor pack_panels(const at::Tensor& weight);
std::tuple<at::Tensor, at::Tensor> pack_int4_panels(const at::Tensor& levels, const at::Tensor& scales,
                                                     const at::Tensor& zeros);
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t out,
                        const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& scales);

// See ceilings.cpp: float32 FMA GFLOP/s on every thread for about `seconds`, and the GB/s those threads read a
// buffer of `megabytes` at.
double fma_gflops(double seconds);
double read_gbps(int64_t megabytes, double seconds);
