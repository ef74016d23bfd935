// Linear layers y = x W^T (+ b) with float32 activations, on weights packed once into panels of kPanel output
// columns: panels [ceil(out / kPanel), in, kPanel], panel p holding W[p*kPanel : (p+1)*kPanel, :] transposed
// (columns past `out` zero). The weights are float32 (compute_service/linear.py packs a model's float32
// linears), or int8 with a float32 scale per output column (compute_service/quantized.py, --weights int8):
// each int8 weight is widened to float32 in registers and the column's sum scaled once at the end.
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

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int kLanes = vec::kLanes;
#ifdef __AVX512F__
constexpr int kVectors = 2;
constexpr int kMaxRows = 12;  // 24 accumulators of the 32 vector registers
#else
// NOTE: 3 x 4 rather than 2 x 6 (both 12 accumulators of the 16 vector registers): fewer broadcasts per
// product, and faster at prompt-sized batches.
constexpr int kVectors = 3;
constexpr int kMaxRows = 4;
#endif
constexpr int64_t kPanel = kVectors * kLanes;
// How far ahead of the k step computed the panel is prefetched: 16 float32 steps (best of 8-128 measured).
constexpr int64_t kPrefetchBytes = 16 * kPanel * sizeof(float);
// Rows of x one task reads against a panel (at in=1536, 96 rows are 590 KB, which L2 holds).
constexpr int64_t kRowBlock = 96;

using vec::Float;
using vec::load;
using vec::store;

// y[r, 0:cols] = x[r, :] . panel (* scales[0:cols]) (+ bias[0:cols]) for the R rows from x and y, K = in; W is
// float, or int8 with a scale per output column.
template <typename W, int R>
void tile(const float* x, int64_t K, const W* panel, const float* scales, const float* bias, float* y, int64_t out,
          int64_t cols) {
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

// The tile for `rows` (1..R) rows: tile<W, rows>.
template <typename W, int R>
void tile_of(int64_t rows, const float* x, int64_t K, const W* panel, const float* scales, const float* bias,
             float* y, int64_t out, int64_t cols) {
  if constexpr (R > 1) {
    if (rows < R) return tile_of<W, R - 1>(rows, x, K, panel, scales, bias, y, out, cols);
  }
  tile<W, R>(x, K, panel, scales, bias, y, out, cols);
}

// y [rows, out] = x [rows, K] times the panels, for either weight type.
template <typename W>
void run_panels(const float* xs, int64_t rows, int64_t K, const W* ps, int64_t num_panels, const float* scales,
                const float* b, float* ys, int64_t out) {
  const int64_t row_blocks = (rows + kRowBlock - 1) / kRowBlock;
  at::parallel_for(0, row_blocks * num_panels, 1, [&](int64_t first, int64_t end) {
    for (int64_t task = first; task < end; ++task) {
      const int64_t p = task / row_blocks, block = task % row_blocks;
      const int64_t row0 = block * kRowBlock, block_rows = std::min(kRowBlock, rows - row0);
      const int64_t cols = std::min(kPanel, out - p * kPanel);
      // NOTE: tiles of equal size (16 rows: 8 + 8, not 12 + 4), so no tile is mostly idle registers.
      const int64_t tiles = (block_rows + kMaxRows - 1) / kMaxRows;
      for (int64_t t = 0, r = row0; t < tiles; ++t) {
        const int64_t n = (row0 + block_rows - r + (tiles - t) - 1) / (tiles - t);
        tile_of<W, kMaxRows>(n, xs + r * K, K, ps + p * K * kPanel, scales == nullptr ? nullptr : scales + p * kPanel,
                             b == nullptr ? nullptr : b + p * kPanel, ys + r * out + p * kPanel, out, cols);
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

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t out,
                        const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& scales) {
  const bool int8 = panels.scalar_type() == at::kChar;
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && (int8 || panels.scalar_type() == at::kFloat) &&
                  panels.is_contiguous(),
              "panels must come from pack_panels on this machine");
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
  TORCH_CHECK(scaled == int8, "int8 panels take scales, float32 panels none");
  TORCH_CHECK(!scaled || (scales->dim() == 1 && scales->size(0) == out && scales->scalar_type() == at::kFloat &&
                          scales->is_contiguous()),
              "scales must be contiguous float32 [out_features]");
  const int64_t rows = x.size(0), K = x.size(1), num_panels = panels.size(0);
  at::Tensor y = at::empty({rows, out}, x.options());
  if (rows == 0) return y;
  if (int8)
    run_panels(x.data_ptr<float>(), rows, K, panels.data_ptr<int8_t>(), num_panels, scales->data_ptr<float>(), b,
               y.data_ptr<float>(), out);
  else
    run_panels(x.data_ptr<float>(), rows, K, panels.data_ptr<float>(), num_panels, nullptr, b, y.data_ptr<float>(),
               out);
  return y;
}
