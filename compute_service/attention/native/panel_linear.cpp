// Float32 linear layers, y = x W^T (+ b), on weights packed once into panels of kPanel output columns:
// panels [ceil(out / kPanel), in, kPanel], panel p holding W[p*kPanel : (p+1)*kPanel, :] transposed (columns
// past `out` zero). compute_service/linear.py packs a model's float32 linears this way.
//
// Why not oneDNN's inner product (which the linears ran on before): a decode step streams every weight from
// memory once, and oneDNN's products at a few rows overlapped that stream badly with their arithmetic. One
// step's 30 layers of SmolLM2-135M (381 MB of weights, every layer's weights distinct so none stay in
// cache), 2 threads, Xeon with AVX-512, best of 5: 1 row 24.8 -> 18.0 ms, 16 rows 35.2 -> 27.6, 64 rows
// 75.1 -> 57.7, 512 rows 359 -> 358. Built for AVX2 on the same machine, against oneDNN held to AVX2
// (ONEDNN_MAX_CPU_ISA=AVX2): 27.9 -> 19.9, 49.2 -> 34.3, 101 -> 86, 550 -> 612 (prompts' products are
// slower there, 0.90x).
//
// The kernel: each task takes a run of (panel, row block) pairs, a panel's row blocks one after another (so
// the panel is read from memory once, its later blocks find it in L2); for each, tiles of up to kMaxRows rows
// keep kMaxRows x kVectors accumulators in registers while k runs over the panel, one panel load and one
// broadcast of x per row at each k, with the panel prefetched kPrefetch steps ahead (the prefetch, not the
// tiling, is what overlaps the weight stream with the arithmetic: without it the kernel was no faster than
// oneDNN).
#include "paged_attention.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace {

#ifdef __AVX512F__
constexpr int kLanes = 16;
constexpr int kVectors = 2;
constexpr int kMaxRows = 12;  // 24 accumulators of the 32 vector registers
#else
// NOTE: 3 x 4 rather than 2 x 6 (both 12 accumulators of the 16 vector registers): fewer broadcasts per
// product, and at 512 rows 0.89-1.00x oneDNN against 0.86-0.94x.
constexpr int kLanes = 8;
constexpr int kVectors = 3;
constexpr int kMaxRows = 4;
#endif
constexpr int64_t kPanel = kVectors * kLanes;
// k steps ahead of the one computed that the panel is prefetched (16 was best of 8-128 measured).
constexpr int64_t kPrefetch = 16;
// Rows of x one task reads against a panel (at in=1536, 96 rows are 590 KB, which L2 holds).
constexpr int64_t kRowBlock = 96;

typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef float UnalignedVec __attribute__((vector_size(kLanes * sizeof(float)), aligned(sizeof(float))));

inline Vec load(const float* p) { return *reinterpret_cast<const UnalignedVec*>(p); }
inline void store(float* p, Vec v) { *reinterpret_cast<UnalignedVec*>(p) = v; }

// y[r, 0:cols] = x[r, :] . panel (+ bias[0:cols]) for the R rows from x and y, K = in.
template <int R>
void tile(const float* x, int64_t K, const float* panel, const float* bias, float* y, int64_t out, int64_t cols) {
  Vec acc[R][kVectors];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kVectors; ++c) acc[r][c] = Vec{};
  for (int64_t k = 0; k < K; ++k) {
    const float* at = panel + k * kPanel;
    // NOTE: a prefetch past the end of the weights does not fault. Later tiles of a panel find it in L2, and
    // their prefetches bring it on to L1 (skipping them there measured the same).
    for (int64_t line = 0; line < kPanel; line += 16) __builtin_prefetch(at + kPrefetch * kPanel + line, 0, 3);
    Vec w[kVectors];
    for (int c = 0; c < kVectors; ++c) w[c] = load(at + c * kLanes);
    for (int r = 0; r < R; ++r) {
      const Vec b = Vec{} + x[r * K + k];
      for (int c = 0; c < kVectors; ++c) acc[r][c] += b * w[c];
    }
  }
  float row[kPanel];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < kVectors; ++c) store(row + c * kLanes, acc[r][c]);
    if (bias != nullptr)
      for (int64_t j = 0; j < cols; ++j) row[j] += bias[j];
    std::copy(row, row + cols, y + r * out);
  }
}

// The tile for `rows` (1..R) rows: tile<rows>.
template <int R>
void tile_of(int64_t rows, const float* x, int64_t K, const float* panel, const float* bias, float* y, int64_t out,
             int64_t cols) {
  if constexpr (R > 1) {
    if (rows < R) return tile_of<R - 1>(rows, x, K, panel, bias, y, out, cols);
  }
  tile<R>(x, K, panel, bias, y, out, cols);
}

}  // namespace

int64_t panel_width() { return kPanel; }

at::Tensor pack_panels(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "pack_panels takes a float32 CPU weight [out, in]");
  const int64_t out = weight.size(0), panels = (out + kPanel - 1) / kPanel;
  return at::constant_pad_nd(weight, {0, 0, 0, panels * kPanel - out})
      .view({panels, kPanel, weight.size(1)})
      .transpose(1, 2)
      .contiguous();
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t out,
                        const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.scalar_type() == at::kFloat &&
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
  const int64_t rows = x.size(0), K = x.size(1), num_panels = panels.size(0);
  at::Tensor y = at::empty({rows, out}, x.options());
  if (rows == 0) return y;
  const float* xs = x.data_ptr<float>();
  const float* ps = panels.data_ptr<float>();
  float* ys = y.data_ptr<float>();
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
        tile_of<kMaxRows>(n, xs + r * K, K, ps + p * K * kPanel, b == nullptr ? nullptr : b + p * kPanel,
                          ys + r * out + p * kPanel, out, cols);
        r += n;
      }
    }
  });
  return y;
}
