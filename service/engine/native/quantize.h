// Activations quantized for the integer-dot-product kernels (w4a8.cpp, q8.cpp): each block of 32
// inputs of a row rounded to int8 steps of max|x| / 127 (llama.cpp's Q8 activations).
//
// Invariant: a row's values depend on that row alone, and every step is elementwise, a max, or an
// integer sum, so each ISA's copy below gives the same bits whatever the compiler vectorises.
// Everything here has internal linkage: each kernel's translation unit holds its own copy.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include "isa.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;  // inputs per activation block

struct Quantized {
  std::vector<int8_t> q;      // [M, K]
  std::vector<float> d;       // [M, K / 32]
  std::vector<float> sums;    // [M, K / group]: sums of the rounded inputs, d * sum(xq) per block
  std::vector<int32_t> isums; // [M, K / 32]: each block's integer sum of xq
};

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }

// One block of 32 inputs (already float): its int8 values, scale, and the integer sum of the
// values. Every step is elementwise, a max, or an integer sum, so the result does not depend on
// how the compiler vectorises it: each ISA's copy below gives the same bits.
#define NIM_QUANTIZE_BLOCK(xf, q, d_out, isum_out)                          \
  {                                                                        \
    float amax = 0.f;                                                      \
    int32_t nans = 0;                                                      \
    for (int i = 0; i < kBlock; ++i) {                                     \
      amax = std::max(amax, std::fabs(xf[i]));                             \
      nans += xf[i] != xf[i];                                              \
    }                                                                      \
    /* a subnormal amax: 127 / amax overflows; its block rounds to zeros */ \
    const float inv = amax > 0.f && std::isfinite(127.f / amax) ? 127.f / amax : 0.f; \
    int32_t isum = 0;                                                      \
    for (int i = 0; i < kBlock; ++i) {                                     \
      const float v = std::min(127.f, std::max(-127.f, std::nearbyint(xf[i] * inv))); \
      q[i] = static_cast<int8_t>(v);                                       \
      isum += static_cast<int32_t>(v);                                     \
    }                                                                      \
    /* a NaN or infinite input: NaN out (its block's steps mean nothing) */ \
    d_out = nans || !std::isfinite(amax) ? std::nanf("") : amax / 127.f; \
    isum_out = isum;                                                       \
  }

#define NIM_QUANTIZE_BLOCKS(NAME, TARGET)                                                   \
  TARGET void NAME(const float* xf, int8_t* q, float* d, int32_t* isums, int64_t blocks) {  \
    for (int64_t b = 0; b < blocks; ++b) {                                                  \
      NIM_QUANTIZE_BLOCK((xf + b * kBlock), (q + b * kBlock), d[b], isums[b]);              \
    }                                                                                       \
  }

NIM_QUANTIZE_BLOCKS(quantize_blocks_avx512, __attribute__((target("avx512f,avx512bw"))))
NIM_QUANTIZE_BLOCKS(quantize_blocks_avx2, __attribute__((target("avx2,fma"))))
NIM_QUANTIZE_BLOCKS(quantize_blocks_portable, )

// Rows quantized per thread at least: below this a call stays on the calling thread.
constexpr int64_t kQuantizeGrain = 16;

template <typename T>
void quantize_rows(const T* x, int64_t m_rows, int64_t k, int64_t group, int64_t isa, Quantized& out) {
  const int64_t blocks = k / kBlock, groups = k / group, per_group = group / kBlock;
  out.q.resize(m_rows * k);
  out.d.resize(m_rows * blocks);
  out.sums.resize(m_rows * groups);
  out.isums.resize(m_rows * blocks);
  // Row by row (each row's values from that row alone, whichever thread quantizes it).
  at::parallel_for(0, m_rows, kQuantizeGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(k);
    for (int64_t m = begin; m < end; ++m) {
      const T* row = x + m * k;
      for (int64_t i = 0; i < k; ++i) xf[i] = to_float(row[i]);
      int8_t* q = out.q.data() + m * k;
      float* d = out.d.data() + m * blocks;
      int32_t* isums = out.isums.data() + m * blocks;
      NIM_ISA_CALL(isa, quantize_blocks, xf.data(), q, d, isums, blocks);
      // The rounded inputs' sum per weight group, block by block in order (no vectorised sum).
      for (int64_t g = 0; g < groups; ++g) {
        float s = 0.f;
        for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) s = std::fmaf(d[b], static_cast<float>(isums[b]), s);
        out.sums[m * groups + g] = s;
      }
    }
  });
}

constexpr int kRows = 4;  // quantized input rows per pass over a weight tile

// Rows [0, m_rows) in passes over one weight tile: pass(std::integral_constant<int, R>, first row)
// for R = kRows as often as they fill, then once for the R < kRows left. R is a compile-time
// constant so each kernel keeps its R rows' accumulators in registers.
template <class Pass>
inline void row_passes(int64_t m_rows, Pass&& pass) {
  static_assert(kRows == 4, "the remainder cases below are 3, 2 and 1");
  int64_t m = 0;
  for (; m + kRows <= m_rows; m += kRows) pass(std::integral_constant<int, kRows>{}, m);
  switch (m_rows - m) {
    case 3: pass(std::integral_constant<int, 3>{}, m); break;
    case 2: pass(std::integral_constant<int, 2>{}, m); break;
    case 1: pass(std::integral_constant<int, 1>{}, m); break;
    default: break;
  }
}

}  // namespace
