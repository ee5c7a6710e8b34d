// Fused CPU ops for the small steps of a decode step: RMSNorm (with the residual add before it),
// a MoE layer's routing and the greedy sampler's argmax. Each stands for a sequence of aten ops
// (named at each op) and computes what that sequence computes, in float32, rounding where its
// ops' outputs round (the argmax exactly: its max and first index are the same in any order).
//
// Why: at one stream a decode step is a few hundred small ops between the weight-streaming
// matmuls. After a matmul has streamed megabytes of weights, each small aten op pays again for
// its dispatch and kernel code falling out of the caches: measured on a 2-core Xeon
// (bench/cpu_fused_ops.py), the residual add and RMSNorm of one row 19 us hot and 142 us after a
// weight stream, the router (a 32 x 512 bf16 linear, softmax, top-4, renormalised) 55 and 212 us;
// these ops take 4 and 61, 5 and 58 us there.
//
// Invariants: a row's outputs depend on that row alone, computed in one fixed order whatever
// the number of rows or threads (threads split rows, never a sum), so a token's values do not
// depend on what else shares its step. Sums run in 16 float32 lanes, element i in lane i % 16,
// then the lanes in order; products and sums are never fused (built with -ffp-contract=off), so
// the AVX-512, AVX2 and portable copies of each loop give the same bits.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include <immintrin.h>

#include "isa.h"
#include "lanes.h"

namespace {

// Elements of work one thread should have before a call is split across threads.
constexpr int64_t kWorkPerThread = 1 << 16;

inline int64_t grain_for(int64_t work_per_row) {
  return std::max<int64_t>(1, kWorkPerThread / std::max<int64_t>(1, work_per_row));
}

// The norm's elementwise loops (the residual add, the scaled output), one copy per ISA: each
// element's operations alone, so the compiler's vectorised copies give the same bits.
#define NIM_NORM_LOOPS(SUFFIX, TARGET)                                                            \
  template <typename T>                                                                           \
  TARGET void add_rows_##SUFFIX(const T* row, const T* res, int64_t width, T* sum, float* xf) {   \
    for (int64_t i = 0; i < width; ++i) {                                                         \
      sum[i] = static_cast<T>(widened(row[i]) + widened(res[i]));                                 \
      xf[i] = widened(sum[i]);                                                                    \
    }                                                                                             \
  }                                                                                               \
  template <typename T>                                                                           \
  TARGET void scaled_row_##SUFFIX(const float* xf, const float* wf, float inv, int64_t width, T* o) { \
    for (int64_t i = 0; i < width; ++i) o[i] = static_cast<T>(wf[i] * rounded<T>(xf[i] * inv));  \
  }

NIM_NORM_LOOPS(avx512, __attribute__((target("avx512f,avx512bw"))))
NIM_NORM_LOOPS(avx2, __attribute__((target("avx2,fma,f16c"))))
NIM_NORM_LOOPS(portable, )

// weight * F.rms_norm(x) (models/llama_layers.RMSNorm), row by row: x * 1 / sqrt(mean(x^2) + eps)
// in float32, rounded to T, times the weight, rounded to T. Row r takes weight row r % W (a [H]
// weight is one row; the scripted decode norms q and k heads side by side with a row per head).
// With a residual: x + residual first, rounded to T (the residual stream, also returned).
template <typename T>
void rms_rows(int64_t isa, const T* x, const T* residual, const T* weight, int64_t weight_rows, int64_t rows,
              int64_t width, float eps, T* out, T* summed) {
  at::parallel_for(0, rows, grain_for(width), [&](int64_t begin, int64_t end) {
    std::vector<float> xf(width), wf(width);
    int64_t widened = -1;  // the weight row in wf
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * width;
      if (residual == nullptr) {
        widen(row, width, xf.data());
      } else {
        NIM_ISA_CALL(isa, add_rows, row, residual + r * width, width, summed + r * width, xf.data());
      }
      const float inv = 1.f / std::sqrt(dot(isa, xf.data(), xf.data(), width) / static_cast<float>(width) + eps);
      const int64_t w = r % weight_rows;
      if (w != widened) {
        widen(weight + w * width, width, wf.data());
        widened = w;
      }
      NIM_ISA_CALL(isa, scaled_row, xf.data(), wf.data(), inv, width, out + r * width);
    }
  });
}

void check_norm(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, op, ": x must have a last dimension");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              op, ": x must be float32, bfloat16 or float16");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), op, ": the weight must be x's dtype");
  TORCH_CHECK((weight.dim() == 1 || weight.dim() == 2) && weight.size(-1) == x.size(-1) && weight.numel() > 0,
              op, ": the weight must be [H] or [W, H] with x's last dimension H");
  TORCH_CHECK(weight.dim() == 1 || (x.dim() >= 2 && x.size(-2) == weight.size(0)), op,
              ": a [W, H] weight needs x of shape [..., W, H] (a weight row per row of its last two dimensions)");
}

std::tuple<at::Tensor, at::Tensor> norm(const at::Tensor& input, const at::Tensor* residual_in,
                                        const at::Tensor& weight_in, double eps, const char* op) {
  check_norm(input, weight_in, op);
  const at::Tensor x = input.contiguous(), weight = weight_in.contiguous();
  at::Tensor residual;
  if (residual_in != nullptr) {
    TORCH_CHECK(residual_in->sizes() == input.sizes() && residual_in->scalar_type() == input.scalar_type() &&
                residual_in->device().is_cpu(), op, ": the residual must be x's shape and dtype");
    residual = residual_in->contiguous();
  }
  const int64_t width = x.size(-1), rows = x.numel() / width;
  const int64_t weight_rows = weight.dim() == 1 ? 1 : weight.size(0);
  at::Tensor out = at::empty_like(x);
  at::Tensor summed = residual_in != nullptr ? at::empty_like(x) : at::Tensor();
  if (rows == 0) return {out, summed};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "nim_rms_norm", [&] {
    rms_rows<scalar_t>(nim_cpu_isa(), x.data_ptr<scalar_t>(),
                       residual_in != nullptr ? residual.data_ptr<scalar_t>() : nullptr, weight.data_ptr<scalar_t>(),
                       weight_rows, rows, width, static_cast<float>(eps), out.data_ptr<scalar_t>(),
                       residual_in != nullptr ? summed.data_ptr<scalar_t>() : nullptr);
  });
  return {out, summed};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return std::get<0>(norm(x, nullptr, weight, eps, "rms_norm"));
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  return norm(x, &residual, weight, eps, "add_rms_norm");
}

// SparseMoeBlock's routing (models/moe.py), token by token: the router's logits (F.linear in T:
// float32 sums, rounded to T), softmax in float32, the top_k largest (ties to the lower expert;
// a NaN is never chosen over a number, so every id is a valid expert), renormalised to sum to 1
// where asked (in choice order), then rounded to T.
template <typename T>
void route_rows(int64_t isa, const T* x, const T* gate, int64_t tokens, int64_t hidden, int64_t experts,
                int64_t top_k, bool normalize, T* weights, int64_t* ids) {
  at::parallel_for(0, tokens, grain_for(experts * hidden), [&](int64_t begin, int64_t end) {
    std::vector<float> xf(hidden), probs(experts), chosen(top_k);
    std::vector<char> taken(experts);
    for (int64_t t = begin; t < end; ++t) {
      widen(x + t * hidden, hidden, xf.data());
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t e = 0; e < experts; ++e) {
        probs[e] = rounded<T>(dot(isa, xf.data(), gate + e * hidden, hidden));
        top = std::max(top, probs[e]);
      }
      float sum = 0.f;
      for (int64_t e = 0; e < experts; ++e) {
        probs[e] = std::exp(probs[e] - top);
        sum += probs[e];
      }
      for (int64_t e = 0; e < experts; ++e) probs[e] /= sum;
      std::fill(taken.begin(), taken.end(), 0);
      float chosen_sum = 0.f;
      for (int64_t c = 0; c < top_k; ++c) {
        int64_t best = -1;
        for (int64_t e = 0; e < experts; ++e) {
          if (taken[e]) continue;
          if (best < 0 || probs[e] > probs[best] || (std::isnan(probs[best]) && !std::isnan(probs[e]))) best = e;
        }
        taken[best] = 1;
        ids[t * top_k + c] = best;
        chosen[c] = probs[best];
        chosen_sum += probs[best];
      }
      for (int64_t c = 0; c < top_k; ++c)
        weights[t * top_k + c] = static_cast<T>(normalize ? chosen[c] / chosen_sum : chosen[c]);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> route(const at::Tensor& input, const at::Tensor& gate_in, int64_t top_k,
                                         bool normalize) {
  TORCH_CHECK(input.dim() == 2 && input.device().is_cpu() && gate_in.device().is_cpu(),
              "route: x must be a 2-D CPU tensor, the gate a CPU tensor");
  TORCH_CHECK(input.scalar_type() == at::kFloat || input.scalar_type() == at::kBFloat16 ||
                  input.scalar_type() == at::kHalf, "route: x must be float32, bfloat16 or float16");
  TORCH_CHECK(gate_in.dim() == 2 && gate_in.size(1) == input.size(1) && gate_in.scalar_type() == input.scalar_type(),
              "route: the gate must be [experts, hidden] in x's dtype");
  const int64_t experts = gate_in.size(0);
  TORCH_CHECK(top_k >= 1 && top_k <= experts, "route: top_k must be in [1, experts]");
  const at::Tensor x = input.contiguous(), gate = gate_in.contiguous();
  at::Tensor weights = at::empty({x.size(0), top_k}, x.options());
  at::Tensor ids = at::empty({x.size(0), top_k}, x.options().dtype(at::kLong));
  if (x.size(0) == 0) return {weights, ids};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "nim_route", [&] {
    route_rows<scalar_t>(nim_cpu_isa(), x.data_ptr<scalar_t>(), gate.data_ptr<scalar_t>(), x.size(0), x.size(1),
                         experts, top_k, normalize, weights.data_ptr<scalar_t>(), ids.data_ptr<int64_t>());
  });
  return {weights, ids};
}

// The largest of n values and the first index holding it (argmax: exact, so any split of the
// work gives the same answer), and whether any value is NaN. Each SIMD lane keeps the largest
// value it saw and where it first saw it (a later equal value does not replace it); then the
// largest over the lanes, at the lowest index holding it; then the tail.
struct ArgMax {
  float top;
  int64_t first;
  bool nan;
};

inline ArgMax finish_argmax(const float* best, const int32_t* at, int64_t lanes, bool nan, const float* x,
                            int64_t from, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
  int64_t first = -1;
  for (int64_t j = 0; j < lanes; ++j) {
    if (at[j] < 0) continue;  // a lane that saw only -inf (or nothing)
    if (best[j] > top || (best[j] == top && at[j] < first)) {
      top = best[j];
      first = at[j];
    }
  }
  for (int64_t i = from; i < n; ++i) {  // after every lane's index: only a larger value moves it
    nan |= x[i] != x[i];
    if (x[i] > top) {
      top = x[i];
      first = i;
    }
  }
  if (first < 0) first = 0;  // every value -inf (or NaN): argmax's first
  return {top, first, nan};
}

__attribute__((target("avx512f"))) ArgMax argmax_avx512(const float* x, int64_t n) {
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i at = _mm512_set1_epi32(-1);
  __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan = 0;
  const int64_t whole = n - n % 16;
  for (int64_t i = 0; i < whole; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __mmask16 more = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, more, v);
    at = _mm512_mask_mov_epi32(at, more, index);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    index = _mm512_add_epi32(index, step);
  }
  alignas(64) float lanes[16];
  alignas(64) int32_t where[16];
  _mm512_store_ps(lanes, best);
  _mm512_store_si512(where, at);
  return finish_argmax(lanes, where, 16, nan != 0, x, whole, n);
}

__attribute__((target("avx2"))) ArgMax argmax_avx2(const float* x, int64_t n) {
  __m256 best = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 at = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i step = _mm256_set1_epi32(8);
  __m256 nan = _mm256_setzero_ps();
  const int64_t whole = n - n % 8;
  for (int64_t i = 0; i < whole; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 more = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
    best = _mm256_blendv_ps(best, v, more);
    at = _mm256_blendv_ps(at, _mm256_castsi256_ps(index), more);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    index = _mm256_add_epi32(index, step);
  }
  alignas(32) float lanes[8];
  alignas(32) int32_t where[8];
  _mm256_store_ps(lanes, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(where), _mm256_castps_si256(at));
  return finish_argmax(lanes, where, 8, _mm256_movemask_ps(nan) != 0, x, whole, n);
}

ArgMax argmax_portable(const float* x, int64_t n) {
  return finish_argmax(nullptr, nullptr, 0, false, x, 0, n);
}

std::tuple<at::Tensor, at::Tensor> greedy(const at::Tensor& input) {
  TORCH_CHECK(input.dim() == 2 && input.device().is_cpu() && input.scalar_type() == at::kFloat && input.size(1) > 0 &&
                  input.size(1) < (int64_t{1} << 31), "greedy: logits must be a 2-D float32 CPU tensor with a vocabulary");
  const at::Tensor logits = input.contiguous();
  const int64_t rows = logits.size(0), vocab = logits.size(1), isa = nim_cpu_isa();
  at::Tensor values = at::empty({rows}, logits.options());
  at::Tensor ids = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  float* v = values.data_ptr<float>();
  int64_t* id = ids.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain_for(vocab), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * vocab;
      const ArgMax found = NIM_ISA_CALL(isa, argmax, row, vocab);
      v[r] = found.nan ? std::numeric_limits<float>::quiet_NaN() : found.top;
      id[r] = found.nan ? 0 : found.first;
    }
  });
  return {values, ids};
}

// One head rotated: elementwise, so the compiler's vectorised copies for each ISA give the same
// bits. The roll is split at D / 2 so each half's loop reads its partner contiguously.
#define NIM_ROPE_HEAD(NAME, TARGET)                                                               \
  template <typename T>                                                                           \
  TARGET void NAME(const float* row, const T* c, const T* s, int64_t half, T* out) {              \
    for (int64_t i = 0; i < half; ++i)                                                            \
      out[i] = static_cast<T>(rounded<T>(row[i] * widened(c[i])) + rounded<T>(row[i + half] * widened(s[i]))); \
    for (int64_t i = half; i < 2 * half; ++i)                                                     \
      out[i] = static_cast<T>(rounded<T>(row[i] * widened(c[i])) + rounded<T>(row[i - half] * widened(s[i]))); \
  }

NIM_ROPE_HEAD(rope_head_avx512, __attribute__((target("avx512f,avx512bw"))))
NIM_ROPE_HEAD(rope_head_avx2, __attribute__((target("avx2,fma,f16c"))))
NIM_ROPE_HEAD(rope_head_portable, )

// TableRope (models/rope.py), in place: x * cos + roll(x, D / 2) * sin, each product rounded to T
// and their sum rounded to T, as the three aten ops round them (bitwise theirs). x is [T, H, D]
// with its last dimension contiguous (a view into the qkv projection's output); cos and sin
// [T, 1, D] in x's dtype, signed as RotaryEmbedding.lookup_full makes them.
template <typename T>
void rope_rows(int64_t isa, T* x, int64_t tokens, int64_t heads, int64_t dim, int64_t token_stride,
               int64_t head_stride, const T* cos, const T* sin, int64_t table_stride) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens * heads, grain_for(4 * dim), [&](int64_t begin, int64_t end) {
    std::vector<float> row(dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / heads, h = item % heads;
      T* out = x + t * token_stride + h * head_stride;
      const T* c = cos + t * table_stride;
      const T* s = sin + t * table_stride;
      widen(out, dim, row.data());
      NIM_ISA_CALL(isa, rope_head, row.data(), c, s, half, out);
    }
  });
}

at::Tensor& rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.device().is_cpu() && x.stride(2) == 1, "rope_: x must be a [T, H, D] CPU tensor "
              "with its last dimension contiguous");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  TORCH_CHECK(dim % 2 == 0, "rope_: the head size must be even");
  for (const at::Tensor* table : {&cos, &sin})
    TORCH_CHECK(table->dim() == 3 && table->size(0) == tokens && table->size(1) == 1 && table->size(2) == dim &&
                    table->stride(2) == 1 && table->scalar_type() == x.scalar_type() && table->device().is_cpu(),
                "rope_: cos and sin must be [T, 1, D] in x's dtype, their last dimension contiguous");
  TORCH_CHECK(cos.stride(0) == sin.stride(0), "rope_: cos and sin must share their layout");
  if (tokens == 0 || heads == 0) return x;
  const int64_t ts = x.stride(0), hs = x.stride(1), cs = cos.stride(0), isa = nim_cpu_isa();
  if (x.scalar_type() == at::kFloat) {
    rope_rows(isa, x.data_ptr<float>(), tokens, heads, dim, ts, hs, cos.data_ptr<float>(), sin.data_ptr<float>(), cs);
  } else if (x.scalar_type() == at::kBFloat16) {
    rope_rows(isa, x.data_ptr<c10::BFloat16>(), tokens, heads, dim, ts, hs, cos.data_ptr<c10::BFloat16>(),
              sin.data_ptr<c10::BFloat16>(), cs);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kHalf, "rope_: float32, bfloat16 or float16 only");
    rope_rows(isa, x.data_ptr<c10::Half>(), tokens, heads, dim, ts, hs, cos.data_ptr<c10::Half>(),
              sin.data_ptr<c10::Half>(), cs);
  }
  return x;
}

}  // namespace

// The ops' schemas are declared in Python (fused_ops.py); these are their CPU implementations.
TORCH_LIBRARY_IMPL(nim_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("route", &route);
  m.impl("greedy", &greedy);
  m.impl("rope_", &rope_);
}
