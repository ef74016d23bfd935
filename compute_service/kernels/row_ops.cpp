// The decoder layer's row-wise ops (row_ops.h) as entry points on float32 tensors, for the steps the native
// decoder stack does not run: compute_service/llama_layer.py's native_row_ops calls them on prompt steps.
#include "kernels.h"
#include "row_ops.h"

at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "x: contiguous float32 [rows, width]");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == x.size(1),
              "weight: float32 [width]");
  at::Tensor out = at::empty_like(x);
  row_ops::rms_norm(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), x.size(0), x.size(1),
                    static_cast<float>(eps));
  return out;
}

at::Tensor silu_mul_rows(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat && gate_up.dim() == 2 && gate_up.is_contiguous() &&
                  gate_up.size(1) % 2 == 0,
              "gate_up: contiguous float32 [rows, 2 * inter]");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  row_ops::silu_mul(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, inter);
  return out;
}

void rotate_rows(at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "x: float32 [rows, heads, head_dim], each row's heads contiguous");
  const int64_t rows = x.size(0), heads = x.size(1), d = x.size(2), stride = x.stride(0);
  TORCH_CHECK(cos.is_contiguous() && signed_sin.is_contiguous() && cos.numel() == rows * d &&
                  signed_sin.numel() == rows * d && cos.scalar_type() == at::kFloat &&
                  signed_sin.scalar_type() == at::kFloat,
              "cos, signed_sin: contiguous float32 of [rows, head_dim]");
  float* base = x.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = signed_sin.data_ptr<float>();
  row_ops::for_rows(rows, heads * d, [&](int64_t first, int64_t end) {
    std::vector<float> saved(d);
    row_ops::rotate(base + first * stride, end - first, stride, heads, d, c + first * d, s + first * d, saved);
  });
}
