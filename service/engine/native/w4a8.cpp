// W4A8 linear for the CPU: int4 weights times int8-quantized activations, integer dot products.
//
// y[m, n] = sum_k x[m, k] * w[n, k], with w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g]
// (Int4Weight, group g = k / group_size) and x quantized per block of 32 inputs:
// x[m, k] ~ d[m, b] * xq[m, k], xq in [-127, 127], d = max|x| / 127 over the block.
// Then, per block b of group g:
//   sum_k x * w ~ scale[n, g] * d[m, b] * sum_k q * xq  +  (zero - 8 * scale)[n, g] * d[m, b] * sum_k xq
// The integer sums are exact (u8 nibbles times s8: VNNI's vpdpbusd, or AVX2's vpmaddubsw, whose
// 16-bit pair sums cannot saturate at 2 * 15 * 127): the output is the dequantized weight times
// the rounded inputs, in float32 (w4a8.py's `reference`).
//
// Invariant: a row's outputs depend only on that row and the weights, computed in the same order
// whatever the number of rows or threads (threads split output tiles, never a sum), so a decode
// row's logits do not depend on what else shares its step.
//
// Weight layout (w4a8_pack): tiles of 16 output rows; per tile and block of 32 inputs 256 bytes,
// 4 x 64: byte j of part p holds row j / 4's input 8p + j % 4 in its low nibble and input
// 8p + 4 + j % 4 in its high nibble, so one 64-byte load feeds two vpdpbusd over 16 rows (or four
// vpmaddubsw over 8). Per tile and group: 16 scales, then 16 (zero - 8 * scale), float16 (a bit a
// weight at groups of 32, where float32 took two).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include "isa.h"
#include "quantize.h"

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kTile = 16;   // output rows per tile
constexpr int64_t kTileBlockBytes = kTile * kBlock / 2;

// One tile (16 output rows) for one quantized input row, scalar: the reference the SIMD paths
// follow operation for operation (fmaf where they fuse).
void tile_scalar(const uint8_t* w, const c10::Half* sm, const int8_t* xq, const float* d, const float* sums,
                 int64_t k, int64_t group, float* acc) {
  const int64_t blocks = k / kBlock, per_group = group / kBlock;
  for (int64_t r = 0; r < kTile; ++r) acc[r] = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t g = b / per_group;
    const c10::Half* scale = sm + g * 2 * kTile;
    const uint8_t* wb = w + b * kTileBlockBytes;
    const int8_t* xb = xq + b * kBlock;
    for (int64_t r = 0; r < kTile; ++r) {
      int32_t isum = 0;
      for (int64_t p = 0; p < 4; ++p) {
        for (int64_t j = 0; j < 4; ++j) {
          const uint8_t byte = wb[p * 64 + r * 4 + j];
          isum += static_cast<int32_t>(byte & 0x0F) * xb[8 * p + j];
          isum += static_cast<int32_t>(byte >> 4) * xb[8 * p + 4 + j];
        }
      }
      acc[r] = std::fmaf(static_cast<float>(isum), static_cast<float>(scale[r]) * d[b], acc[r]);
    }
    if ((b + 1) % per_group == 0) {
      const c10::Half* mins = scale + kTile;
      for (int64_t r = 0; r < kTile; ++r) acc[r] = std::fmaf(static_cast<float>(mins[r]), sums[g], acc[r]);
    }
  }
}

// Rows: R input rows at a time over one tile, each block's nibbles unpacked once for all R; every
// row's operations are those of R = 1 (and of tile_scalar), so the batch changes no result.
struct Rows {
  const int8_t* xq;    // row 0's quantized inputs; row r at + r * k
  const float* d;      // row 0's block scales; row r at + r * blocks
  const float* sums;   // row 0's group sums; row r at + r * groups
  float* acc;          // row r's 16 outputs at + r * 16
};

template <int R>
__attribute__((target("avx512f,avx512bw,avx512vnni")))
void tile_vnni(const uint8_t* w, const c10::Half* sm, Rows rows, int64_t k, int64_t group) {
  const int64_t blocks = k / kBlock, per_group = group / kBlock, groups = k / group;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t g = b / per_group;
    const c10::Half* scale = sm + g * 2 * kTile;
    const uint8_t* wb = w + b * kTileBlockBytes;
    __m512i lo[4], hi[4];
    for (int p = 0; p < 4; ++p) {
      const __m512i packed = _mm512_loadu_si512(wb + p * 64);
      lo[p] = _mm512_and_si512(packed, low);
      hi[p] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
    }
    const __m512 scales = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale)));
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = rows.xq + r * k + b * kBlock;
      __m512i isum = _mm512_setzero_si512();
      for (int p = 0; p < 4; ++p) {
        int32_t x0, x1;
        std::memcpy(&x0, xb + 8 * p, 4);
        std::memcpy(&x1, xb + 8 * p + 4, 4);
        isum = _mm512_dpbusd_epi32(isum, lo[p], _mm512_set1_epi32(x0));
        isum = _mm512_dpbusd_epi32(isum, hi[p], _mm512_set1_epi32(x1));
      }
      const __m512 factor = _mm512_mul_ps(scales, _mm512_set1_ps(rows.d[r * blocks + b]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), factor, acc[r]);
    }
    if ((b + 1) % per_group == 0) {
      const __m512 mins = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + kTile)));
      for (int r = 0; r < R; ++r)
        acc[r] = _mm512_fmadd_ps(mins, _mm512_set1_ps(rows.sums[r * groups + g]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(rows.acc + r * kTile, acc[r]);
}

__attribute__((target("avx2,fma,f16c"))) inline __m256 half8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

template <int R>
__attribute__((target("avx2,fma,f16c")))
void tile_avx2(const uint8_t* w, const c10::Half* sm, Rows rows, int64_t k, int64_t group) {
  const int64_t blocks = k / kBlock, per_group = group / kBlock, groups = k / group;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t g = b / per_group;
    const c10::Half* scale = sm + g * 2 * kTile;
    const uint8_t* wb = w + b * kTileBlockBytes;
    __m256i isum0[R], isum1[R];
    for (int r = 0; r < R; ++r) isum0[r] = isum1[r] = _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {
      // Rows 0-7, then 8-15: pair sums (16-bit, at most 2 * 15 * 127), then sums of four (32-bit).
      const __m256i packed0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + p * 64));
      const __m256i packed1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + p * 64 + 32));
      const __m256i lo0 = _mm256_and_si256(packed0, low);
      const __m256i hi0 = _mm256_and_si256(_mm256_srli_epi16(packed0, 4), low);
      const __m256i lo1 = _mm256_and_si256(packed1, low);
      const __m256i hi1 = _mm256_and_si256(_mm256_srli_epi16(packed1, 4), low);
      for (int r = 0; r < R; ++r) {
        const int8_t* xb = rows.xq + r * k + b * kBlock;
        int32_t x0, x1;
        std::memcpy(&x0, xb + 8 * p, 4);
        std::memcpy(&x1, xb + 8 * p + 4, 4);
        const __m256i bx0 = _mm256_set1_epi32(x0), bx1 = _mm256_set1_epi32(x1);
        isum0[r] = _mm256_add_epi32(isum0[r], _mm256_madd_epi16(_mm256_maddubs_epi16(lo0, bx0), ones));
        isum0[r] = _mm256_add_epi32(isum0[r], _mm256_madd_epi16(_mm256_maddubs_epi16(hi0, bx1), ones));
        isum1[r] = _mm256_add_epi32(isum1[r], _mm256_madd_epi16(_mm256_maddubs_epi16(lo1, bx0), ones));
        isum1[r] = _mm256_add_epi32(isum1[r], _mm256_madd_epi16(_mm256_maddubs_epi16(hi1, bx1), ones));
      }
    }
    const __m256 s0 = half8(scale), s1 = half8(scale + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 db = _mm256_set1_ps(rows.d[r * blocks + b]);
      acc0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum0[r]), _mm256_mul_ps(s0, db), acc0[r]);
      acc1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum1[r]), _mm256_mul_ps(s1, db), acc1[r]);
    }
    if ((b + 1) % per_group == 0) {
      const __m256 m0 = half8(scale + kTile), m1 = half8(scale + kTile + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 s = _mm256_set1_ps(rows.sums[r * groups + g]);
        acc0[r] = _mm256_fmadd_ps(m0, s, acc0[r]);
        acc1[r] = _mm256_fmadd_ps(m1, s, acc1[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(rows.acc + r * kTile, acc0[r]);
    _mm256_storeu_ps(rows.acc + r * kTile + 8, acc1[r]);
  }
}

template <int R>
void tile_portable(const uint8_t* w, const c10::Half* sm, Rows rows, int64_t k, int64_t group) {
  const int64_t blocks = k / kBlock, groups = k / group;
  for (int r = 0; r < R; ++r)
    tile_scalar(w, sm, rows.xq + r * k, rows.d + r * blocks, rows.sums + r * groups, k, group, rows.acc + r * kTile);
}

// Runs m_rows quantized rows (row r's values at q + r * k, scales at d + r * k / 32, group sums
// at sums + r * k / group) over one tile, kRows at a time, then the rest; isa: 0 portable, 1 AVX2,
// 2 AVX-512 VNNI (auto_isa picks: torch's CPU capability and the CPU).
void tile_rows(int64_t isa, const uint8_t* w, const c10::Half* sm, const int8_t* q, const float* d, const float* sums,
               int64_t m_rows, int64_t k, int64_t group, float* acc) {
  const int64_t blocks = k / kBlock, groups = k / group;
  row_passes(m_rows, [&](auto passed, int64_t m) {
    constexpr int R = decltype(passed)::value;
    const Rows rows{q + m * k, d + m * blocks, sums + m * groups, acc + m * kTile};
    if (isa == 2) {
      tile_vnni<R>(w, sm, rows, k, group);
    } else if (isa == 1) {
      tile_avx2<R>(w, sm, rows, k, group);
    } else {
      tile_portable<R>(w, sm, rows, k, group);
    }
  });
}

// Weight bytes one thread should have at least before a call is split across threads.
constexpr int64_t kBytesPerThread = 32 * 1024;
// Elements of elementwise work one thread should have before it is split across threads.
constexpr int64_t kElementsPerThread = 16 * 1024;

// A tile's outputs (m_rows x 16 float32, the first `columns` kept) rounded to T into y (row m at
// + m * n): elementwise, so each ISA's vectorised copy gives the same bits. (Rounded one by one
// without a vector target, the bf16 stores of a multi-row call cost a third of its kernel time.)
#define NIM_STORE_TILE(NAME, TARGET)                                                          \
  template <typename T>                                                                     \
  TARGET void NAME(const float* acc, int64_t m_rows, int64_t columns, T* y, int64_t n) {    \
    for (int64_t m = 0; m < m_rows; ++m)                                                    \
      for (int64_t c = 0; c < columns; ++c) y[m * n + c] = static_cast<T>(acc[m * kTile + c]); \
  }

NIM_STORE_TILE(store_tile_avx512, __attribute__((target("avx512f,avx512bw"))))
NIM_STORE_TILE(store_tile_avx2, __attribute__((target("avx2,fma,f16c"))))
NIM_STORE_TILE(store_tile_portable, )

template <typename T>
void run(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sm, int64_t group, int64_t isa,
         at::Tensor& out) {
  const int64_t m_rows = x.size(0), k = x.size(1), tiles = packed.size(0), n = out.size(1);
  const int64_t groups = k / group;
  Quantized qx;
  quantize_rows(x.data_ptr<T>(), m_rows, k, group, isa, qx);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const c10::Half* s = sm.data_ptr<c10::Half>();
  T* y = out.data_ptr<T>();
  const int64_t tile_bytes = k * kTile / 2;
  const int64_t grain = std::max<int64_t>(1, kBytesPerThread / tile_bytes);
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(m_rows * kTile);
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* wt = w + t * (k / kBlock) * kTileBlockBytes;
      const c10::Half* st = s + t * groups * 2 * kTile;
      tile_rows(isa, wt, st, qx.q.data(), qx.d.data(), qx.sums.data(), m_rows, k, group, acc.data());
      NIM_ISA_CALL(isa, store_tile, acc.data(), m_rows, std::min(kTile, n - t * kTile), y + t * kTile, n);
    }
  });
}

// A value as stored in T and read back (the rounding each op's output takes in the eager modules).
template <typename T>
inline float rounded(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// One projection of every expert with rows, over the rows grouped by expert: rows [starts[e],
// starts[e + 1]) of (q, d, sums) are expert e's. Work items are (expert, tile) pairs, threads split
// them, each row's outputs come out of the same tile loop as w4a8_linear's (so a (token, expert)
// pair's values never depend on the other rows), rounded to T, into out[row * n + column].
template <typename T>
void experts_projection(int64_t isa, const at::Tensor& packed, const at::Tensor& sm, const std::vector<int64_t>& starts,
                        const Quantized& qx, int64_t k, int64_t group, int64_t n, float* out) {
  const int64_t experts = packed.size(0), tiles = packed.size(1), blocks = k / kBlock, groups = k / group;
  std::vector<int64_t> items;  // expert * tiles + tile, for experts with rows
  for (int64_t e = 0; e < experts; ++e)
    if (starts[e + 1] > starts[e])
      for (int64_t t = 0; t < tiles; ++t) items.push_back(e * tiles + t);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const c10::Half* s = sm.data_ptr<c10::Half>();
  const int64_t grain = std::max<int64_t>(1, kBytesPerThread / (k * kTile / 2));
  at::parallel_for(0, static_cast<int64_t>(items.size()), grain, [&](int64_t begin, int64_t end) {
    std::vector<float> acc;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t e = items[i] / tiles, t = items[i] % tiles, first = starts[e], rows = starts[e + 1] - first;
      acc.resize(rows * kTile);
      const uint8_t* wt = w + (e * tiles + t) * blocks * kTileBlockBytes;
      const c10::Half* st = s + (e * tiles + t) * groups * 2 * kTile;
      tile_rows(isa, wt, st, qx.q.data() + first * k, qx.d.data() + first * blocks, qx.sums.data() + first * groups,
                rows, k, group, acc.data());
      const int64_t columns = std::min(kTile, n - t * kTile);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < columns; ++c) out[(first + r) * n + t * kTile + c] = rounded<T>(acc[r * kTile + c]);
    }
  });
}

// SparseMoeBlock's experts and weighted sum, each routed (token, choice) pair a row of its own:
// gate_up, SiLU(gate) * up, down, each rounded to T as the eager modules' outputs are; then each
// token's choices weighted and summed in choice order. Every pair is computed from its token's
// row and its expert alone, so a token's result does not depend on what else is routed with it.
template <typename T>
void moe_run(int64_t isa, const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& weights,
             const at::Tensor& gu, const at::Tensor& gu_sm, const at::Tensor& down, const at::Tensor& down_sm,
             int64_t gu_group, int64_t down_group, int64_t inter, at::Tensor& out) {
  const int64_t tokens = x.size(0), hidden = x.size(1), top_k = expert_ids.size(1), experts = gu.size(0);
  const int64_t pairs = tokens * top_k;
  const int64_t* ids = expert_ids.data_ptr<int64_t>();
  // pairs grouped by expert (stable: token, then choice order within an expert)
  std::vector<int64_t> starts(experts + 1, 0), order(pairs), place(pairs);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(ids[p] >= 0 && ids[p] < experts, "w4a8_moe: expert id ", ids[p], " out of range");
    ++starts[ids[p] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) starts[e + 1] += starts[e];
  {
    std::vector<int64_t> next(starts.begin(), starts.end() - 1);
    for (int64_t p = 0; p < pairs; ++p) {
      place[p] = next[ids[p]]++;
      order[place[p]] = p;
    }
  }
  // the tokens' rows quantized once, then laid out pair by pair in expert order
  Quantized qt, qp;
  quantize_rows(x.data_ptr<T>(), tokens, hidden, gu_group, isa, qt);
  const int64_t blocks = hidden / kBlock, groups = hidden / gu_group;
  qp.q.resize(pairs * hidden);
  qp.d.resize(pairs * blocks);
  qp.sums.resize(pairs * groups);
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t token = order[i] / top_k;
    std::memcpy(qp.q.data() + i * hidden, qt.q.data() + token * hidden, hidden);
    std::memcpy(qp.d.data() + i * blocks, qt.d.data() + token * blocks, blocks * sizeof(float));
    std::memcpy(qp.sums.data() + i * groups, qt.sums.data() + token * groups, groups * sizeof(float));
  }
  std::vector<float> gate_up(pairs * 2 * inter);
  experts_projection<T>(isa, gu, gu_sm, starts, qp, hidden, gu_group, 2 * inter, gate_up.data());
  // SiLU(gate) * up, as F.silu then the product: each rounded to T
  std::vector<float> activated(pairs * inter);
  // Elementwise: threads only where there is enough of it (waking them costs more at one token).
  at::parallel_for(0, pairs, std::max<int64_t>(1, kElementsPerThread / inter), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* g = gate_up.data() + i * 2 * inter;
      float* a = activated.data() + i * inter;
      for (int64_t j = 0; j < inter; ++j) a[j] = rounded<T>(rounded<T>(g[j] / (1.f + std::exp(-g[j]))) * g[inter + j]);
    }
  });
  Quantized qa;
  quantize_rows(activated.data(), pairs, inter, down_group, isa, qa);
  std::vector<float> down_out(pairs * hidden);
  experts_projection<T>(isa, down, down_sm, starts, qa, inter, down_group, hidden, down_out.data());
  // each token's choices: weighted (rounded to T), summed in choice order in float32, rounded once
  const T* w = weights.data_ptr<T>();
  T* y = out.data_ptr<T>();
  at::parallel_for(0, tokens, std::max<int64_t>(1, kElementsPerThread / (top_k * hidden)), [&](int64_t begin, int64_t end) {
    std::vector<float> sum(hidden);
    for (int64_t t = begin; t < end; ++t) {
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t c = 0; c < top_k; ++c) {
        const float weight = static_cast<float>(w[t * top_k + c]);
        const float* row = down_out.data() + place[t * top_k + c] * hidden;
        for (int64_t h = 0; h < hidden; ++h) sum[h] += rounded<T>(row[h] * weight);
      }
      for (int64_t h = 0; h < hidden; ++h) y[t * hidden + h] = static_cast<T>(sum[h]);
    }
  });
}

int64_t auto_isa() { return nim_cpu_isa(); }

at::Tensor w4a8_linear(const at::Tensor& input, const at::Tensor& packed, const at::Tensor& sm, int64_t group,
                       int64_t out_features, int64_t isa) {
  TORCH_CHECK(input.dim() == 2 && input.device().is_cpu(), "w4a8_linear: x must be a 2-D CPU tensor");
  const at::Tensor x = input.contiguous();
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "w4a8_linear: x must be float32 or bfloat16");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.is_contiguous() && packed.device().is_cpu(),
              "w4a8_linear: bad packed weight");
  TORCH_CHECK(sm.scalar_type() == at::kHalf && sm.dim() == 4 && sm.is_contiguous() && sm.device().is_cpu(), "w4a8_linear: bad scales");
  const int64_t k = x.size(1), tiles = packed.size(0);
  TORCH_CHECK(group > 0 && k % group == 0 && group % kBlock == 0, "w4a8_linear: group size must be a multiple of 32 dividing K");
  TORCH_CHECK(packed.size(1) == k / kBlock && packed.size(2) == kTileBlockBytes, "w4a8_linear: packed weight does not match K");
  TORCH_CHECK(sm.size(0) == tiles && sm.size(1) == k / group && sm.size(2) == 2 && sm.size(3) == kTile, "w4a8_linear: scales do not match");
  TORCH_CHECK(out_features > (tiles - 1) * kTile && out_features <= tiles * kTile, "w4a8_linear: out_features does not match the tiles");
  TORCH_CHECK(isa >= -1 && isa <= auto_isa(), "w4a8_linear: isa ", isa, " is not available here");
  if (isa == -1) isa = auto_isa();
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0) return out;
  if (x.scalar_type() == at::kFloat) {
    run<float>(x, packed, sm, group, isa, out);
  } else {
    run<c10::BFloat16>(x, packed, sm, group, isa, out);
  }
  return out;
}

at::Tensor w4a8_moe(const at::Tensor& input, const at::Tensor& expert_ids, const at::Tensor& weights,
                    const at::Tensor& gu, const at::Tensor& gu_sm, const at::Tensor& down, const at::Tensor& down_sm,
                    int64_t gu_group, int64_t down_group, int64_t inter) {
  TORCH_CHECK(input.dim() == 2 && input.device().is_cpu(), "w4a8_moe: x must be a 2-D CPU tensor");
  TORCH_CHECK(input.scalar_type() == at::kFloat || input.scalar_type() == at::kBFloat16, "w4a8_moe: x must be float32 or bfloat16");
  const at::Tensor x = input.contiguous();
  const at::Tensor ids = expert_ids.to(at::kLong).contiguous();
  const at::Tensor w = weights.to(x.scalar_type()).contiguous();
  const int64_t hidden = x.size(1);
  TORCH_CHECK(gu_group > 0 && down_group > 0 && inter > 0, "w4a8_moe: group sizes and the intermediate size must be positive");
  TORCH_CHECK(hidden % gu_group == 0 && gu_group % kBlock == 0 && inter % down_group == 0 && down_group % kBlock == 0,
              "w4a8_moe: group sizes must be multiples of 32 dividing the inputs");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && w.sizes() == ids.sizes(), "w4a8_moe: expert ids and weights must be [tokens, top_k]");
  TORCH_CHECK(gu.dim() == 4 && down.dim() == 4, "w4a8_moe: the weights must be [experts, tiles, blocks, 256]");
  const int64_t experts = gu.size(0), gu_tiles = (2 * inter + kTile - 1) / kTile, down_tiles = (hidden + kTile - 1) / kTile;
  const auto expect = [](const at::Tensor& t, at::ScalarType dtype, at::IntArrayRef shape, const char* what) {
    TORCH_CHECK(t.scalar_type() == dtype && t.is_contiguous() && t.device().is_cpu() && t.sizes() == shape,
                "w4a8_moe: ", what, " must be contiguous ", dtype, " ", shape, ", got ", t.scalar_type(), " ", t.sizes());
  };
  expect(gu, at::kByte, {experts, gu_tiles, hidden / kBlock, kTileBlockBytes}, "gate_up");
  expect(gu_sm, at::kHalf, {experts, gu_tiles, hidden / gu_group, 2, kTile}, "gate_up scales");
  expect(down, at::kByte, {experts, down_tiles, inter / kBlock, kTileBlockBytes}, "down");
  expect(down_sm, at::kHalf, {experts, down_tiles, inter / down_group, 2, kTile}, "down scales");
  at::Tensor out = at::empty({x.size(0), hidden}, x.options());
  if (x.size(0) == 0) return out;
  if (x.scalar_type() == at::kFloat) {
    moe_run<float>(auto_isa(), x, ids, w, gu, gu_sm, down, down_sm, gu_group, down_group, inter, out);
  } else {
    moe_run<c10::BFloat16>(auto_isa(), x, ids, w, gu, gu_sm, down, down_sm, gu_group, down_group, inter, out);
  }
  return out;
}

}  // namespace

// The ops' schemas are declared in Python (w4a8.py), where it exists whether or not this file
// builds: TorchScript resolves the op when it compiles a decode stack that may call it.
TORCH_LIBRARY_FRAGMENT(nim_cpu, m) {
  m.def("w4a8_isa() -> int", &auto_isa);
}

TORCH_LIBRARY_IMPL(nim_cpu, CPU, m) {
  m.impl("w4a8_linear", &w4a8_linear);
  m.impl("w4a8_moe", &w4a8_moe);
}
