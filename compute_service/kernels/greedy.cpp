// The greedy choice of each row of float32 logits: its first most likely token and that token's
// log-probability, log p = -log sum_v exp(logit_v - max), in two passes over the row (the second reads it
// from cache) with no [rows, vocab] temporaries. Rows run in parallel with at::parallel_for. The pure-torch
// path it stands in for is compute_service/greedy.py's, where the execution plan names torch.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace {
constexpr int64_t kLanes = 16;
}  // namespace

std::tuple<at::Tensor, at::Tensor> greedy(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() &&
                  logits.device().is_cpu() && logits.size(1) > 0,
              "greedy: logits must be a contiguous float32 CPU tensor [rows, vocab > 0]");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  at::Tensor tokens = at::empty({rows}, logits.options().dtype(at::kLong));
  at::Tensor logprobs = at::empty({rows}, logits.options());
  const float* in = logits.data_ptr<float>();
  int64_t* token = tokens.data_ptr<int64_t>();
  float* logprob = logprobs.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* x = in + r * vocab;
      const int64_t whole = vocab - vocab % kLanes;
      // NOTE: lane-wise maxima and sums, reduced at the end: plain element-wise loops the compiler vectorises
      float lane_max[kLanes], lane_sum[kLanes];
      std::fill_n(lane_max, kLanes, -std::numeric_limits<float>::infinity());
      std::fill_n(lane_sum, kLanes, 0.0f);
      for (int64_t v = 0; v < whole; v += kLanes)
        for (int64_t l = 0; l < kLanes; ++l) lane_max[l] = std::max(lane_max[l], x[v + l]);
      float best = *std::max_element(lane_max, lane_max + kLanes);
      for (int64_t v = whole; v < vocab; ++v) best = std::max(best, x[v]);
      int64_t first = 0;
      while (first < vocab - 1 && !(x[first] == best)) ++first;
      for (int64_t v = 0; v < whole; v += kLanes)
        for (int64_t l = 0; l < kLanes; ++l) lane_sum[l] += vec::fast_exp(x[v + l] - best);
      float sum = 0.0f;
      for (int64_t l = 0; l < kLanes; ++l) sum += lane_sum[l];
      for (int64_t v = whole; v < vocab; ++v) sum += vec::fast_exp(x[v] - best);
      token[r] = first;
      logprob[r] = -std::log(sum);
    }
  });
  return {tokens, logprobs};
}
