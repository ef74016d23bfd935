// Linear layers y = x W^T (+ b) with float32 activations, on weights packed once into panels of kPanel output
// columns: panels [ceil(out / kPanel), in, kPanel], panel p holding W[p*kPanel : (p+1)*kPanel, :] transposed
// (columns past `out` zero). The weights are float32 (compute_service/linear.py packs a model's float32
// linears), or int8 with a float32 scale per output column (compute_service/quantized.py, --weights int8):
// each int8 weight is widened to float32 in registers and the column's sum scaled once at the end; or int4
// levels (--weights int4) with a scale and a zero point (bfloat16) per group of inputs of each column: each pair
// of inputs of a panel is kPanel bytes, column j's level at the even input in the low nibble of byte j and at the
// odd one in the high nibble (panels [P, in, kPanel / 2] uint8), level q standing for (q - 8) * scale + zero as
// compute_service/quantized.py dequantises it (see Int4 for how the tiles multiply by it).
//
// Why not oneDNN's inner product (which the linears ran on before): a decode step streams every weight from
// memory once, and oneDNN's products at a few rows overlapped that stream badly with their arithmetic; the
// panels are faster at decode-sized batches on AVX-512 and AVX2 builds alike (figures and how they were taken:
// docs/internals/cpu-fast-path.md; `python -m tests.step_bench --compare linear` measures it again).
//
// The kernel: each task takes a run of (panel, row block) pairs, a panel's row blocks one after another (so
// the panel is read from memory once, its later blocks find it in L2); for each, tiles of up to kMaxRows rows
// keep kMaxRows x kVectors accumulators in registers while k runs over the panel, one panel load and one
// broadcast of x per row at each k, with the panel prefetched kPrefetchBytes ahead (the prefetch, not the
// tiling, is what overlaps the weight stream with the arithmetic: without it the kernel was no faster than
// oneDNN).
#include "kernels.h"
#include "panel_tiles.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace {

using namespace panels;

// The tile for `rows` (1..R) rows of panel p: weights.tile<rows>.
template <typename Weights, int R>
void tile_of(const Weights& weights, int64_t rows, const float* x, int64_t row, int64_t K, int64_t p,
             const float* bias, float* y, int64_t out, int64_t cols) {
  if constexpr (R > 1) {
    if (rows < R) return tile_of<Weights, R - 1>(weights, rows, x, row, K, p, bias, y, out, cols);
  }
  weights.template tile<R>(x, row, K, p, bias, y, out, cols);
}

// y [rows, out] = x [rows, K] times the panels, for any kind of weights.
template <typename Weights>
void run_panels(const Weights& weights, const float* xs, int64_t rows, int64_t K, int64_t num_panels,
                const float* b, float* ys, int64_t out) {
  const int64_t row_blocks = (rows + kRowBlock - 1) / kRowBlock;
  at::parallel_for(0, row_blocks * num_panels, 1, [&](int64_t first, int64_t end) {
    for (int64_t task = first; task < end; ++task) {
      const int64_t p = task / row_blocks, block = task % row_blocks;
      const int64_t row0 = block * kRowBlock, block_rows = std::min(kRowBlock, rows - row0);
      const int64_t cols = std::min(kPanel, out - p * kPanel);
      // NOTE: tiles of equal size (16 rows: 8 + 8, not 12 + 4), so no tile is mostly idle registers.
      const int64_t tiles = (block_rows + weights.max_rows() - 1) / weights.max_rows();
      for (int64_t t = 0, r = row0; t < tiles; ++t) {
        const int64_t n = (row0 + block_rows - r + (tiles - t) - 1) / (tiles - t);
        tile_of<Weights, kMaxRows>(weights, n, xs + r * K, r, K, p, b == nullptr ? nullptr : b + p * kPanel,
                                   ys + r * out + p * kPanel, out, cols);
        r += n;
      }
    }
  });
}

}  // namespace

int64_t panel_width() { return kPanel; }

at::Tensor pack_panels(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kChar) &&
                  weight.device().is_cpu(),
              "pack_panels takes a float32 or int8 CPU weight [out, in]");
  const int64_t out = weight.size(0), panels = (out + kPanel - 1) / kPanel;
  return at::constant_pad_nd(weight, {0, 0, 0, panels * kPanel - out})
      .view({panels, kPanel, weight.size(1)})
      .transpose(1, 2)
      .contiguous();
}

std::tuple<at::Tensor, at::Tensor> pack_int4_panels(const at::Tensor& levels, const at::Tensor& scales,
                                                     const at::Tensor& zeros) {
  TORCH_CHECK(levels.dim() == 2 && levels.scalar_type() == at::kByte && levels.device().is_cpu(),
              "pack_int4_panels takes uint8 levels [out, in] on the CPU");
  const int64_t out = levels.size(0), in = levels.size(1), panels = (out + kPanel - 1) / kPanel;
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == out && scales.sizes() == zeros.sizes() &&
                  scales.size(1) > 0 && in % scales.size(1) == 0 && (in / scales.size(1)) % 2 == 0,
              "scales and zeros must be [out, groups], groups dividing in_features into groups of an even size");
  TORCH_CHECK(levels.numel() == 0 || levels.max().item<uint8_t>() < 16, "int4 levels must lie in [0, 15]");
  for (const at::Tensor& t : {scales, zeros})
    TORCH_CHECK(t.to(at::kBFloat16).to(t.scalar_type()).equal(t),
                "scales and zeros must be bfloat16 values (compute_service/quantized.py rounds them so)");
  const int64_t groups = scales.size(1), pad = panels * kPanel - out;
  // [panels, kPanel, in / 2, 2]: each column's levels in pairs of inputs, the first of a pair the low nibble.
  const at::Tensor pairs = at::constant_pad_nd(levels, {0, 0, 0, pad}).view({panels, kPanel, in / 2, 2});
  const at::Tensor bytes = pairs.select(3, 0).bitwise_or(pairs.select(3, 1).bitwise_left_shift(4));
  const at::Tensor packed = bytes.transpose(1, 2).contiguous().view({panels, in, kPanel / 2});
  const auto by_panel = [&](const at::Tensor& t) {
    return at::constant_pad_nd(t.to(at::kBFloat16), {0, 0, 0, pad}).view({panels, kPanel, groups}).transpose(1, 2);
  };
  return {packed, at::stack({by_panel(scales), by_panel(zeros)}, 2).contiguous()};
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t out,
                        const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& scales) {
  const auto type = panels.scalar_type();
  const bool int8 = type == at::kChar, int4 = type == at::kByte;
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == (int4 ? kPanel / 2 : kPanel) &&
                  (int8 || int4 || type == at::kFloat) && panels.is_contiguous(),
              "panels must come from pack_panels or pack_int4_panels on this machine");
  TORCH_CHECK(out > (panels.size(0) - 1) * kPanel && out <= panels.size(0) * kPanel,
              "out_features does not match the panels");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) == panels.size(1),
              "x must be contiguous float32 [rows, in_features]");
  const float* b = nullptr;
  at::Tensor dense_bias;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out && bias->scalar_type() == at::kFloat,
                "bias must be float32 [out_features]");
    dense_bias = bias->contiguous();
    b = dense_bias.data_ptr<float>();
  }
  const bool scaled = scales.has_value() && scales->defined();
  TORCH_CHECK(scaled == (int8 || int4), "int8 and int4 panels take scales, float32 panels none");
  const int64_t rows = x.size(0), K = x.size(1), num_panels = panels.size(0);
  if (int8)
    TORCH_CHECK(scales->dim() == 1 && scales->size(0) == out && scales->scalar_type() == at::kFloat &&
                    scales->is_contiguous(),
                "int8 scales must be contiguous float32 [out_features]");
  if (int4)
    TORCH_CHECK(scales->dim() == 4 && scales->size(0) == num_panels && scales->size(1) > 0 &&
                    K % scales->size(1) == 0 && (K / scales->size(1)) % 2 == 0 && scales->size(2) == 2 &&
                    scales->size(3) == kPanel && scales->scalar_type() == at::kBFloat16 && scales->is_contiguous(),
                "int4 scales must be the groups pack_int4_panels returned with the panels");
  at::Tensor y = at::empty({rows, out}, x.options());
  if (rows == 0) return y;
  const float* xs = x.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  if (int4) {
    static std::atomic<uint64_t> calls{0};
    const int64_t groups = scales->size(1), group = K / groups;
    // NOTE: a plain loop, not a tensor sum: at a decode's few rows the operator's dispatch cost more than the sum.
    std::vector<float> sums;
    if (rows <= kInt4DirectRows) {
      // NOTE: no division per element (a runtime divisor is a real division): one group's run at a time.
      sums.assign(rows * groups, 0.0f);
      for (int64_t g = 0; g < rows * groups; ++g)
        for (int64_t k = 0; k < group; ++k) sums[g] += xs[g * group + k];
    }
    run_panels(Int4{panels.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales->data_ptr<at::BFloat16>()),
                    group, sums.empty() ? nullptr : sums.data(), ++calls},
               xs, rows, K, num_panels, b, ys, out);
  }
  else if (int8)
    run_panels(Plain<int8_t>{panels.data_ptr<int8_t>(), scales->data_ptr<float>()}, xs, rows, K, num_panels, b, ys,
               out);
  else
    run_panels(Plain<float>{panels.data_ptr<float>(), nullptr}, xs, rows, K, num_panels, b, ys, out);
  return y;
}
