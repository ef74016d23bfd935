// The machine's own ceilings, for `pagedserve bench` to state its figures as shares of them: float32 FMA
// throughput on every thread at::parallel_for runs, and the rate those threads read memory at.
#include <ATen/Parallel.h>

#include <chrono>
#include <vector>

#include "kernels.h"

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// NOTE: independent chains of FMAs per thread, enough to keep two FMA units busy through their latency, and
// with the multiplier and the addend no more than the vector registers: 16 of AVX-512's 32, 14 of AVX2's 16
// (16 chains on AVX2 spilled one to the stack every round and measured half the peak; docs/benchmarking.md).
#ifdef __AVX512F__
constexpr int kChains = 16;
#else
constexpr int kChains = 14;
#endif
constexpr int64_t kRound = 1 << 16;
// Where the loops' results go, so that the compiler keeps the work that makes them.
volatile float sink;

// FMAs on one thread until `seconds` pass; returns how many (of kLanes floats each) it ran.
int64_t fma_loop(double seconds) {
  vec::Float acc[kChains], a, b;
  for (int c = 0; c < kChains; ++c) acc[c] = vec::Float{} + 1.0f + c * 1e-3f;
  a = vec::Float{} + 0.999999f;
  b = vec::Float{} + 1e-6f;
  int64_t rounds = 0;
  const auto start = Clock::now();
  do {
    for (int64_t i = 0; i < kRound; ++i) {
#pragma GCC unroll 16
      for (int c = 0; c < kChains; ++c) acc[c] = acc[c] * a + b;
    }
    ++rounds;
  } while (seconds_since(start) < seconds);
  vec::Float sum = acc[0];
  for (int c = 1; c < kChains; ++c) sum += acc[c];
  sink = sum[0];
  return rounds * kRound * kChains;
}

}  // namespace

double fma_gflops(double seconds) {
  const int64_t threads = at::get_num_threads();
  std::vector<int64_t> fmas(threads);
  const auto start = Clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) fmas[t] = fma_loop(seconds);
  });
  const double elapsed = seconds_since(start);
  int64_t total = 0;
  for (int64_t n : fmas) total += n;
  return 2.0 * vec::kLanes * static_cast<double>(total) / elapsed / 1e9;
}

double read_gbps(int64_t megabytes, double seconds) {
  const int64_t n = megabytes * (1 << 20) / static_cast<int64_t>(sizeof(float));
  std::vector<float> data(n, 1.0f);
  const int64_t threads = at::get_num_threads();
  constexpr int64_t kStride = 4 * vec::kLanes;
  const int64_t chunk = (n / threads) / kStride * kStride;
  std::vector<float> sums(threads);
  int64_t passes = 0;
  const auto start = Clock::now();
  do {
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* p = data.data() + t * chunk;
        vec::Float s0{}, s1{}, s2{}, s3{};
        for (int64_t i = 0; i < chunk; i += kStride) {
          s0 += vec::load(p + i);
          s1 += vec::load(p + i + vec::kLanes);
          s2 += vec::load(p + i + 2 * vec::kLanes);
          s3 += vec::load(p + i + 3 * vec::kLanes);
        }
        const vec::Float s = s0 + s1 + s2 + s3;
        sums[t] += s[0];
      }
    });
    ++passes;
  } while (seconds_since(start) < seconds);
  const double elapsed = seconds_since(start);
  sink = sums[0];
  return static_cast<double>(passes) * threads * chunk * sizeof(float) / elapsed / 1e9;
}
