// Float32 sums in fixed lanes, shared by the fused CPU ops (fused_ops.cpp, decode_attention.cpp).
//
// Sums run in 16 float32 lanes, element i in lane i % 16, then the lanes in order; products and
// sums are never fused (the extension builds with -ffp-contract=off), so the AVX-512, AVX2 and
// portable copies of each loop give the same bits. Everything here has internal linkage: each
// translation unit holds its own copy.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "isa.h"

#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kLanes = 16;


// A value as stored in T and read back: the rounding an aten op's output in T takes.
template <typename T>
inline float rounded(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// A stored value as float32: bf16 by its bits (a shift the compiler vectorises), others by cast.
inline float widened(float v) { return v; }
inline float widened(double v) { return static_cast<float>(v); }
inline float widened(c10::Half v) { return static_cast<float>(v); }
inline float widened(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// Statements ending a function that returns the sum of TERM over i in [0, n), in lanes (see the
// header): TERM is an expression of the index named by I. n need not be a multiple of 16.
#define NIM_RETURN_LANE_SUM(n, I, TERM)                                                     \
  float lanes[kLanes] = {0.f};                                                              \
  const int64_t whole = (n) - (n) % kLanes;                                                 \
  for (int64_t base = 0; base < whole; base += kLanes)                                      \
    for (int64_t j = 0; j < kLanes; ++j) {                                                  \
      const int64_t I = base + j;                                                           \
      lanes[j] += (TERM);                                                                   \
    }                                                                                       \
  for (int64_t I = whole; I < (n); ++I) lanes[I - whole] += (TERM);                         \
  float sum = 0.f;                                                                          \
  for (int64_t j = 0; j < kLanes; ++j) sum += lanes[j];                                     \
  return sum;

// sum(a[i] * b[i]) over n elements, b widened to float32 as it is read, in lanes.
#define NIM_DOT(NAME, TARGET)                                                               \
  template <typename T>                                                                     \
  TARGET float NAME(const float* a, const T* b, int64_t n) {                                \
    NIM_RETURN_LANE_SUM(n, i, a[i] * widened(b[i]))                                         \
  }

NIM_DOT(dot_avx512, __attribute__((target("avx512f"))))
NIM_DOT(dot_avx2, __attribute__((target("avx2"))))
NIM_DOT(dot_portable, )

template <typename T>
inline float dot(int64_t isa, const float* a, const T* b, int64_t n) {
  return NIM_ISA_CALL(isa, dot, a, b, n);
}

template <typename T>
inline void widen(const T* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = widened(src[i]);
}

}  // namespace
