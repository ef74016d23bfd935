// A float32 Llama-shaped decoder stack over one step in which every sequence decodes one token: the same
// function as compute_service/llama_layer.py's FusedLlamaLayer (Llama, Mistral, Qwen2, Qwen3), run from C++ so
// that the ~25 small ops of each layer cost no Python dispatch. Its matrix products run on the weights as
// compute_service/linear.py or compute_service/quantized.py packed them: float32 or int8 panels
// (panel_linear), or oneDNN's inner product in float32 or bfloat16 (mkldnn::_linear_pointwise, called through
// the dispatcher), each with its bias where the layer has one, added as compute_service/linear_kernels.py
// adds it; attention is paged_attention() on the pool, after the step's keys and values are stored at their
// slots.
//
// Per layer, on residual [T, hidden] in place:
//   x = rms_norm(residual) -> qkv = x Wqkv^T (+ b) -> rms_norm of each q and k head (Qwen3's head norms,
//   where given) -> rotary on q, k -> k, v stored at the slots of the layer's KV group -> attention by that
//   group's block tables (over the layer's sliding window, if it has one; block-sparse where the step gives
//   the layer block summaries: sparse_select.cpp cuts the tables down first) -> residual += out Wo^T (+ b) ->
//   x = rms_norm(residual) -> gate, up = x Wgu^T (+ b) -> residual += (silu(gate) * up) Wdown^T (+ b)
#include "kernels.h"
#include "row_ops.h"

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <chrono>
#include <cmath>
#include <cstring>

namespace {

using row_ops::for_rows;
using row_ops::rms_norm;
using row_ops::rotate;
using row_ops::silu_mul;

// Tensors per layer in `weights`: input norm, packed qkv, packed o, post-attention norm, packed gate/up, packed
// down (compute_service/native_decode.py builds the list).
constexpr size_t kPerLayer = 6;
// Products per layer, in `scales` when they are int8 panels and in `biases` when given: qkv, o, gate/up, down.
constexpr size_t kProducts = 4;
// Head norms per layer in `head_norms` when given: q, k.
constexpr size_t kHeadNorms = 2;

// x [rows, in] float32 times a packed weight of `outputs` columns, plus `bias` where it is defined: float32
// panels, int8 panels with their `scales`, or a oneDNN weight in bfloat16 (mixed precision: x cast to
// bfloat16, the product, accumulated in float32 by oneDNN, cast back, then the bias added) or float32 (the
// bias inside the product), as compute_service/linear_kernels.py's Panels and OneDnn compute it.
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& scales,
                  const at::Tensor& bias, int64_t outputs) {
  const std::optional<at::Tensor> b = bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt;
  if (!packed.is_mkldnn()) return panel_linear(x, packed, outputs, b, scales);
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  const bool mixed = packed.scalar_type() == at::kBFloat16;
  torch::jit::Stack stack{mixed ? x.to(at::kBFloat16) : x,
                          packed,
                          mixed || !b ? c10::IValue() : c10::IValue(*b),
                          c10::IValue("none"),
                          c10::List<std::optional<at::Scalar>>(),
                          c10::IValue()};
  op.callBoxed(&stack);
  at::Tensor out = stack[0].toTensor();
  if (!mixed) return out;
  out = out.to(at::kFloat);
  return b ? out.add_(*b) : out;
}

// RMSNorm of each head of head_dim d at x (row stride `stride`) in place: the first `q_heads` of each row
// with q_w, the next `k_heads` with k_w (Qwen3's q_norm and k_norm, as rms_norm computes them).
void head_norm(float* x, int64_t rows, int64_t stride, int64_t q_heads, int64_t k_heads, int64_t d, const float* q_w,
               const float* k_w, float eps) {
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t h = 0; h < q_heads + k_heads; ++h) {
      float* v = x + t * stride + h * d;
      const float* w = h < q_heads ? q_w : k_w;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < d; ++i) sum += v[i] * v[i];
      const float rstd = 1.f / std::sqrt(sum / static_cast<float>(d) + eps);
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) v[i] = (v[i] * rstd) * w[i];
    }
  }
}

// Copies row t of src (`width` floats, row stride `stride`) to row slots[t] of cache: float32, or bfloat16
// rounded to nearest even (as torch's .to() rounds).
void store(const at::Tensor& cache, const float* src, int64_t rows, int64_t stride, int64_t width, const int64_t* slots) {
  if (cache.scalar_type() == at::kFloat) {
    float* dst = cache.data_ptr<float>();
    for (int64_t t = 0; t < rows; ++t) std::memcpy(dst + slots[t] * width, src + t * stride, width * sizeof(float));
    return;
  }
  at::BFloat16* dst = cache.data_ptr<at::BFloat16>();
  for (int64_t t = 0; t < rows; ++t) {
    at::BFloat16* row = dst + slots[t] * width;
    const float* from = src + t * stride;
    for (int64_t i = 0; i < width; ++i) row[i] = at::BFloat16(from[i]);
  }
}

void check_step(const at::Tensor& residual, const at::Tensor& cos, const at::Tensor& signed_sin,
                const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& scales,
                const std::vector<at::Tensor>& biases, const std::vector<at::Tensor>& head_norms,
                const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                const std::vector<at::Tensor>& slot_mappings, const std::vector<at::Tensor>& block_tables,
                const std::vector<int64_t>& layer_groups, const at::Tensor& q_lens) {
  const int64_t rows = residual.size(0);
  const size_t layers = k_caches.size();
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous() && residual.scalar_type() == at::kFloat,
              "residual must be contiguous float32 [T, hidden]");
  TORCH_CHECK(cos.is_contiguous() && signed_sin.is_contiguous() && cos.sizes() == signed_sin.sizes() &&
                  cos.size(0) == rows && cos.scalar_type() == at::kFloat,
              "cos and signed_sin must be contiguous float32 [T, head_dim]");
  TORCH_CHECK(weights.size() == kPerLayer * layers && layers == v_caches.size(),
              "weights must hold 6 tensors per layer, one K and one V cache per layer");
  TORCH_CHECK(scales.empty() || scales.size() == kProducts * layers, "scales must be empty or hold 4 tensors per layer");
  TORCH_CHECK(biases.empty() || biases.size() == kProducts * layers,
              "biases must be empty or hold 4 tensors (empty: none) per layer");
  for (const at::Tensor& bias : biases) {
    TORCH_CHECK(bias.numel() == 0 || (bias.dim() == 1 && bias.scalar_type() == at::kFloat && bias.is_contiguous()),
                "each bias must be contiguous float32 [out_features]");
  }
  TORCH_CHECK(head_norms.empty() || head_norms.size() == kHeadNorms * layers,
              "head_norms must be empty or hold a q and a k norm weight per layer");
  for (const at::Tensor& norm : head_norms) {
    TORCH_CHECK(norm.dim() == 1 && norm.size(0) == cos.size(1) && norm.scalar_type() == at::kFloat &&
                    norm.is_contiguous(),
                "each head norm weight must be contiguous float32 [head_dim]");
  }
  TORCH_CHECK(!slot_mappings.empty() && slot_mappings.size() == block_tables.size(),
              "one slot mapping and one block table per KV group");
  for (const at::Tensor& slots : slot_mappings) {
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == rows,
                "slot_mapping must be contiguous int64 [T]");
  }
  TORCH_CHECK(layer_groups.empty() || layer_groups.size() == layers, "one KV group per layer (none: one group)");
  for (const int64_t group : layer_groups) {
    TORCH_CHECK(group >= 0 && group < static_cast<int64_t>(slot_mappings.size()), "a layer's KV group out of range");
  }
  TORCH_CHECK(q_lens.numel() == rows && q_lens.eq(1).all().item<bool>(), "every sequence must decode one token");
  const auto pool_dtype = k_caches.front().scalar_type();
  TORCH_CHECK(pool_dtype == at::kFloat || pool_dtype == at::kBFloat16,
              "the native decode stack takes float32 or bfloat16 K/V caches");
  for (size_t i = 0; i < layers; ++i) {
    TORCH_CHECK(k_caches[i].scalar_type() == pool_dtype && k_caches[i].is_contiguous() &&
                    v_caches[i].scalar_type() == pool_dtype && v_caches[i].is_contiguous(),
                "the native decode stack takes contiguous K/V caches of one dtype");
  }
}

}  // namespace

// Runs every layer over residual [T, hidden] in place for one all-decode step; returns the seconds spent in
// attention (storing K/V included), for the step's timings. On a pool of several KV groups, layer i stores at
// slot_mappings[g] and attends by block_tables[g], g = layer_groups[i] (empty: every layer group 0).
double decode_layers(at::Tensor& residual, const at::Tensor& cos, const at::Tensor& signed_sin,
                     const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& scales,
                     const std::vector<at::Tensor>& biases, const std::vector<at::Tensor>& head_norms,
                     const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                     const std::vector<at::Tensor>& slot_mappings, const std::vector<at::Tensor>& block_tables,
                     const std::vector<int64_t>& layer_groups, const at::Tensor& q_starts, const at::Tensor& q_lens,
                     const at::Tensor& context_lens, int64_t num_heads, int64_t num_kv_heads, double eps,
                     double scale, const std::vector<int64_t>& windows, const std::vector<at::Tensor>& sparse_bounds,
                     const std::optional<at::Tensor>& sparse_settings) {
  check_step(residual, cos, signed_sin, weights, scales, biases, head_norms, k_caches, v_caches, slot_mappings,
             block_tables, layer_groups, q_lens);
  TORCH_CHECK(windows.size() == k_caches.size(), "one sliding window (0: none) per layer");
  TORCH_CHECK(!sparse_settings || sparse_bounds.size() == k_caches.size(),
              "with sparse settings, one block summary tensor (empty: dense) per layer");
  const int64_t rows = residual.size(0), hidden = residual.size(1), d = cos.size(1);
  const int64_t q_width = num_heads * d, kv_width = num_kv_heads * d, qkv_width = q_width + 2 * kv_width;
  const float feps = static_cast<float>(eps);
  const int64_t pool_slots = k_caches.front().numel() / kv_width;
  TORCH_CHECK(k_caches.front().size(-1) == d && k_caches.front().size(-2) == num_kv_heads,
              "K/V caches must be [num_blocks, block_size, num_kv_heads, head_dim]");
  for (const at::Tensor& slots : slot_mappings) {
    TORCH_CHECK(slots.min().item<int64_t>() >= 0 && slots.max().item<int64_t>() < pool_slots,
                "slot_mapping must lie inside the pool");
  }
  at::Tensor x = at::empty_like(residual);
  at::Tensor out = at::empty({rows, num_heads, d}, residual.options());
  at::Tensor act;  // [T, intermediate], sized by the first gate/up product
  std::vector<float> saved(d);
  double attention_s = 0.0;
  for (size_t layer = 0; layer < k_caches.size(); ++layer) {
    const at::Tensor* w = weights.data() + kPerLayer * layer;
    const size_t group = layer_groups.empty() ? 0 : static_cast<size_t>(layer_groups[layer]);
    const int64_t* slots = slot_mappings[group].data_ptr<int64_t>();
    const at::Tensor& tables = block_tables[group];
    // The int8 panels' scales of this layer's four products, or none; their biases (undefined: none).
    const auto scale_of = [&](size_t product) -> std::optional<at::Tensor> {
      if (scales.empty()) return std::nullopt;
      return scales[kProducts * layer + product];
    };
    const auto bias_of = [&](size_t product) -> at::Tensor {
      if (biases.empty() || biases[kProducts * layer + product].numel() == 0) return at::Tensor();
      return biases[kProducts * layer + product];
    };
    rms_norm(residual.data_ptr<float>(), w[0].data_ptr<float>(), x.data_ptr<float>(), rows, hidden, feps);
    at::Tensor qkv = linear(x, w[1], scale_of(0), bias_of(0), qkv_width);
    TORCH_CHECK(qkv.is_contiguous() && qkv.size(1) == qkv_width, "qkv projection of an unexpected shape");
    float* q = qkv.data_ptr<float>();
    if (!head_norms.empty()) {
      head_norm(q, rows, qkv_width, num_heads, num_kv_heads, d, head_norms[kHeadNorms * layer].data_ptr<float>(),
                head_norms[kHeadNorms * layer + 1].data_ptr<float>(), feps);
    }
    rotate(q, rows, qkv_width, num_heads + num_kv_heads, d, cos.data_ptr<float>(), signed_sin.data_ptr<float>(),
           saved);
    const auto start = std::chrono::steady_clock::now();
    store(k_caches[layer], q + q_width, rows, qkv_width, kv_width, slots);
    store(v_caches[layer], q + q_width + kv_width, rows, qkv_width, kv_width, slots);
    const at::Tensor query = qkv.narrow(1, 0, q_width).view({rows, num_heads, d});
    if (sparse_settings && sparse_bounds[layer].numel() > 0) {
      const auto [cut, lens] = sparse_tables(query, sparse_bounds[layer], tables, q_starts, context_lens,
                                             *sparse_settings, k_caches[layer].size(1), scale);
      paged_attention(query, out, k_caches[layer], v_caches[layer], cut, q_starts, q_lens, lens, scale, 1.0, 1.0,
                      windows[layer]);
    } else {
      paged_attention(query, out, k_caches[layer], v_caches[layer], tables, q_starts, q_lens, context_lens, scale,
                      1.0, 1.0, windows[layer]);
    }
    attention_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    residual.add_(linear(out.view({rows, q_width}), w[2], scale_of(1), bias_of(1), hidden));
    rms_norm(residual.data_ptr<float>(), w[3].data_ptr<float>(), x.data_ptr<float>(), rows, hidden, feps);
    // NOTE: the down projection's input width, in either packing (panels [P, in, width], oneDNN [out, in]).
    const int64_t inter = w[5].size(1);
    at::Tensor gate_up = linear(x, w[4], scale_of(2), bias_of(2), 2 * inter);
    if (!act.defined()) act = at::empty({rows, inter}, residual.options());
    silu_mul(gate_up.data_ptr<float>(), act.data_ptr<float>(), rows, inter);
    residual.add_(linear(act, w[5], scale_of(3), bias_of(3), hidden));
  }
  return attention_s;
}
