// Q8 linear for the CPU: int8 weights with a scale per block of 32 inputs (llama.cpp's Q8_0),
// times int8-quantized activations (quantize.h), integer dot products. The logits projection's
// kernel under float32 activations (q8.py).
//
// y[m, n] = sum_b (scale[n, b] * d[m, b]) * sum_{k in b} w[n, k] * xq[m, k]
// The block's integer sum is exact on every path: VNNI's vpdpbusd multiplies unsigned by signed
// bytes, so it takes w + 128 (w xor 0x80) and subtracts 128 * sum(xq) after; AVX2's vpmaddubsw
// takes |w| times xq with w's sign, pair sums at most 2 * 128 * 127 (no 16-bit saturation). The
// blocks then add in float32 in order, scale[n, b] * d[m, b] rounded once per block, fused
// multiply-adds: the same operations on each ISA (and in `tile_scalar`), so the three agree bitwise.
//
// Invariant: a row's outputs depend only on that row and the weights, computed in the same order
// whatever the number of rows or threads (threads split output tiles, never a sum), so a decode
// row's logits do not depend on what else shares its step.
//
// Weight layout (q8.py `pack`): tiles of 16 output rows; per tile and block of 32 inputs 512
// bytes, 8 parts x 64: byte 4r + j of part p holds row r's input 4p + j, so one 64-byte load feeds
// one vpdpbusd over the 16 rows (two vpmaddubsw over 8). Scales: per tile and block, the 16 rows'
// float16 scales.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "isa.h"
#include "quantize.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kTile = 16;                        // output rows per tile
constexpr int64_t kParts = kBlock / 4;               // 4-input parts per block
constexpr int64_t kTileBlockBytes = kTile * kBlock;  // one tile's weights for one block
// Weight bytes one thread should have at least before a call is split across threads.
constexpr int64_t kBytesPerThread = 32 * 1024;

struct Rows {
  const int8_t* xq;       // row 0's quantized inputs; row r at + r * k
  const float* d;         // row 0's block scales; row r at + r * blocks
  const int32_t* isums;   // row 0's blocks' integer sums; row r at + r * blocks
  float* acc;             // row r's 16 outputs at + r * 16
};

// One tile for one row, scalar: the reference the SIMD paths follow operation for operation.
void tile_scalar(const int8_t* w, const c10::Half* sm, const int8_t* xq, const float* d, int64_t k, float* acc) {
  const int64_t blocks = k / kBlock;
  for (int64_t r = 0; r < kTile; ++r) acc[r] = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* wb = w + b * kTileBlockBytes;
    const int8_t* xb = xq + b * kBlock;
    for (int64_t r = 0; r < kTile; ++r) {
      int32_t isum = 0;
      for (int64_t p = 0; p < kParts; ++p)
        for (int64_t j = 0; j < 4; ++j) isum += static_cast<int32_t>(wb[p * 64 + r * 4 + j]) * xb[4 * p + j];
      acc[r] = std::fmaf(static_cast<float>(isum), static_cast<float>(sm[b * kTile + r]) * d[b], acc[r]);
    }
  }
}

template <int R>
void tile_portable(const int8_t* w, const c10::Half* sm, Rows rows, int64_t k) {
  const int64_t blocks = k / kBlock;
  for (int r = 0; r < R; ++r) tile_scalar(w, sm, rows.xq + r * k, rows.d + r * blocks, k, rows.acc + r * kTile);
}

inline int32_t four(const int8_t* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return v;
}

template <int R>
__attribute__((target("avx512f,avx512bw,avx512vnni")))
void tile_vnni(const int8_t* w, const c10::Half* sm, Rows rows, int64_t k) {
  const int64_t blocks = k / kBlock;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* wb = w + b * kTileBlockBytes;
    __m512i shifted[kParts];  // w + 128, as unsigned bytes
    for (int p = 0; p < kParts; ++p) shifted[p] = _mm512_xor_si512(_mm512_loadu_si512(wb + p * 64), flip);
    const __m512 scales = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sm + b * kTile)));
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = rows.xq + r * k + b * kBlock;
      __m512i isum = _mm512_setzero_si512();
      for (int p = 0; p < kParts; ++p) isum = _mm512_dpbusd_epi32(isum, shifted[p], _mm512_set1_epi32(four(xb + 4 * p)));
      isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(128 * rows.isums[r * blocks + b]));
      const __m512 factor = _mm512_mul_ps(scales, _mm512_set1_ps(rows.d[r * blocks + b]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), factor, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(rows.acc + r * kTile, acc[r]);
}

template <int R>
__attribute__((target("avx2,fma,f16c")))
void tile_avx2(const int8_t* w, const c10::Half* sm, Rows rows, int64_t k) {
  const int64_t blocks = k / kBlock;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* wb = w + b * kTileBlockBytes;
    __m256i isum0[R], isum1[R];
    for (int r = 0; r < R; ++r) isum0[r] = isum1[r] = _mm256_setzero_si256();
    for (int p = 0; p < kParts; ++p) {
      // Rows 0-7, then 8-15: |w| times xq with w's sign, pair sums in 16 bits, then fours in 32.
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + p * 64));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + p * 64 + 32));
      const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
      for (int r = 0; r < R; ++r) {
        const __m256i bx = _mm256_set1_epi32(four(rows.xq + r * k + b * kBlock + 4 * p));
        isum0[r] = _mm256_add_epi32(isum0[r], _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(bx, w0)), ones));
        isum1[r] = _mm256_add_epi32(isum1[r], _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(bx, w1)), ones));
      }
    }
    const __m256 s0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sm + b * kTile)));
    const __m256 s1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sm + b * kTile + 8)));
    for (int r = 0; r < R; ++r) {
      const __m256 db = _mm256_set1_ps(rows.d[r * blocks + b]);
      acc0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum0[r]), _mm256_mul_ps(s0, db), acc0[r]);
      acc1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum1[r]), _mm256_mul_ps(s1, db), acc1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(rows.acc + r * kTile, acc0[r]);
    _mm256_storeu_ps(rows.acc + r * kTile + 8, acc1[r]);
  }
}

// Every quantized row over one tile, kRows at a time, then the rest; isa: 0 portable, 1 AVX2,
// 2 AVX-512 VNNI (auto_isa picks: torch's CPU capability and the CPU).
void tile_rows(int64_t isa, const int8_t* w, const c10::Half* sm, const Quantized& qx, int64_t m_rows, int64_t k,
               float* acc) {
  const int64_t blocks = k / kBlock;
  row_passes(m_rows, [&](auto passed, int64_t m) {
    constexpr int R = decltype(passed)::value;
    const Rows rows{qx.q.data() + m * k, qx.d.data() + m * blocks, qx.isums.data() + m * blocks, acc + m * kTile};
    if (isa == 2) {
      tile_vnni<R>(w, sm, rows, k);
    } else if (isa == 1) {
      tile_avx2<R>(w, sm, rows, k);
    } else {
      tile_portable<R>(w, sm, rows, k);
    }
  });
}

template <typename T>
void run(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sm, int64_t isa, at::Tensor& out) {
  const int64_t m_rows = x.size(0), k = x.size(1), tiles = packed.size(0), n = out.size(1), blocks = k / kBlock;
  Quantized qx;
  quantize_rows(x.data_ptr<T>(), m_rows, k, k, isa, qx);
  const int8_t* w = packed.data_ptr<int8_t>();
  const c10::Half* s = sm.data_ptr<c10::Half>();
  float* y = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kBytesPerThread / (k * kTile));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(m_rows * kTile);
    for (int64_t t = begin; t < end; ++t) {
      const int8_t* wt = w + t * blocks * kTileBlockBytes;
      const c10::Half* st = s + t * blocks * kTile;
      tile_rows(isa, wt, st, qx, m_rows, k, acc.data());
      const int64_t columns = std::min(kTile, n - t * kTile);
      for (int64_t m = 0; m < m_rows; ++m) std::memcpy(y + m * n + t * kTile, acc.data() + m * kTile, columns * sizeof(float));
    }
  });
}

at::Tensor q8_linear(const at::Tensor& input, const at::Tensor& packed, const at::Tensor& sm, int64_t out_features,
                     int64_t isa) {
  TORCH_CHECK(input.dim() == 2 && input.device().is_cpu(), "q8_linear: x must be a 2-D CPU tensor");
  const at::Tensor x = input.contiguous();
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "q8_linear: x must be float32 or bfloat16");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 3 && packed.is_contiguous() && packed.device().is_cpu(),
              "q8_linear: bad packed weight");
  TORCH_CHECK(sm.scalar_type() == at::kHalf && sm.dim() == 3 && sm.is_contiguous() && sm.device().is_cpu(), "q8_linear: bad scales");
  const int64_t k = x.size(1), tiles = packed.size(0);
  TORCH_CHECK(k > 0 && k % kBlock == 0, "q8_linear: K must be a positive multiple of 32");
  TORCH_CHECK(packed.size(1) == k / kBlock && packed.size(2) == kTileBlockBytes, "q8_linear: packed weight does not match K");
  TORCH_CHECK(sm.size(0) == tiles && sm.size(1) == k / kBlock && sm.size(2) == kTile, "q8_linear: scales do not match");
  TORCH_CHECK(out_features > (tiles - 1) * kTile && out_features <= tiles * kTile, "q8_linear: out_features does not match the tiles");
  TORCH_CHECK(isa >= -1 && isa <= nim_cpu_isa(), "q8_linear: isa ", isa, " is not available here");
  if (isa == -1) isa = nim_cpu_isa();
  at::Tensor out = at::empty({x.size(0), out_features}, x.options().dtype(at::kFloat));
  if (x.size(0) == 0) return out;
  if (x.scalar_type() == at::kFloat) {
    run<float>(x, packed, sm, isa, out);
  } else {
    run<c10::BFloat16>(x, packed, sm, isa, out);
  }
  return out;
}

}  // namespace

// The op's schema is declared in Python (q8.py).
TORCH_LIBRARY_IMPL(nim_cpu, CPU, m) {
  m.impl("q8_linear", &q8_linear);
}
