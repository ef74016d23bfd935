// The vector types every kernel shares, fixed by the ISA the build targets (-march: common/cpu.py): one
// register of floats (`Float`, kLanes wide: 16 on AVX-512, 8 on AVX2), a 16-float vector (`Float16`: one
// AVX-512 register, two AVX2 ones), their unaligned loads and stores, the widening of int8 weights, a
// transposing sum of 16 vectors and an e^x that vectorises. GCC vector extensions: the compiler picks the
// instructions; only the int8 widening needs intrinsics.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

namespace vec {

#if defined(__AVX512F__)
inline constexpr bool kAvx512 = true;
inline constexpr int kLanes = 16;
#else
inline constexpr bool kAvx512 = false;
inline constexpr int kLanes = 8;
#endif

typedef float Float __attribute__((vector_size(kLanes * sizeof(float))));
typedef float UnalignedFloat __attribute__((vector_size(kLanes * sizeof(float)), aligned(sizeof(float))));
typedef float Float16 __attribute__((vector_size(16 * sizeof(float))));
typedef float UnalignedFloat16 __attribute__((vector_size(16 * sizeof(float)), aligned(sizeof(float))));
typedef int32_t Int16 __attribute__((vector_size(16 * sizeof(int32_t))));

inline Float load(const float* p) { return *reinterpret_cast<const UnalignedFloat*>(p); }
// kLanes int8 values widened to float32. NOTE: intrinsics, since the compiler's generic vector conversion ran
// several times slower.
inline Float load(const int8_t* p) {
  const __m128i* bytes = reinterpret_cast<const __m128i*>(p);
#if defined(__AVX512F__)
  return reinterpret_cast<Float>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(bytes))));
#else
  return reinterpret_cast<Float>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(bytes))));
#endif
}
inline void store(float* p, Float v) { *reinterpret_cast<UnalignedFloat*>(p) = v; }

inline Float16 load16(const float* p) { return *reinterpret_cast<const UnalignedFloat16*>(p); }
inline void store16(float* p, Float16 v) { *reinterpret_cast<UnalignedFloat16*>(p) = v; }

// Lane t of the result is the sum of p[t]'s 16 lanes: the vectors halved and interleaved pairwise four times
// (15 adds and 30 two-vector shuffles for 16 sums, against a horizontal sum of 4-5 steps each).
inline Float16 sum_lanes(const Float16 (&p)[16]) {
  constexpr Int16 a1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  constexpr Int16 b1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  constexpr Int16 a2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  constexpr Int16 b2 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  constexpr Int16 a3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  constexpr Int16 b3 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
  constexpr Int16 a4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  constexpr Int16 b4 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  Float16 c[8], d[4], e[2];
  for (int i = 0; i < 8; ++i) c[i] = __builtin_shuffle(p[2 * i], p[2 * i + 1], a1) + __builtin_shuffle(p[2 * i], p[2 * i + 1], b1);
  for (int i = 0; i < 4; ++i) d[i] = __builtin_shuffle(c[2 * i], c[2 * i + 1], a2) + __builtin_shuffle(c[2 * i], c[2 * i + 1], b2);
  for (int i = 0; i < 2; ++i) e[i] = __builtin_shuffle(d[2 * i], d[2 * i + 1], a3) + __builtin_shuffle(d[2 * i], d[2 * i + 1], b3);
  return __builtin_shuffle(e[0], e[1], a4) + __builtin_shuffle(e[0], e[1], b4);
}

// e^x (Cody-Waite range reduction, Cephes' degree-5 polynomial; relative error ~1e-7), x clamped to [-87, 88]
// so that the result stays a normal float (NaN comes out as e^-87); a plain function of floats so that a loop
// over it vectorises, unlike std::exp.
// NOTE: the clamp as max(lo, min(x, hi)), not std::clamp: in a loop that also divides by the result (SiLU,
// row_ops.h), GCC turned std::clamp's comparisons into masked divisions and the loop ran 10-15x slower
// (docs/internals/kernels.md); a loop of e^x alone ran alike either way.
inline float fast_exp(float x) {
  x = std::max(-87.0f, std::min(x, 88.0f));
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

// tanh(x) = 1 - 2 / (e^(2x) + 1) through fast_exp (absolute error ~1e-7; -1 and 1 beyond |x| ~ 44), a plain
// function of floats so that a loop over it vectorises, unlike std::tanh.
inline float fast_tanh(float x) { return 1.0f - 2.0f / (fast_exp(2.0f * x) + 1.0f); }

}  // namespace vec
