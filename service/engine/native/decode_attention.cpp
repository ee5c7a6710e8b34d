// Decode attention over the paged KV cache, read in place: each query row attends to its own
// sequence's keys through its block table, with no gathered copy of the blocks and no padded mask.
//
// Why: the CPU decode step gathered every sequence's blocks into one padded tensor per layer
// (index_select: 7-8 ms of a 40 ms step at 8 streams on the embedded model) and ran sdpa's flash
// kernel over it with an additive mask (~56 us a layer at one stream, mostly its set-up around
// 9 heads x a few hundred keys).
//
// What it computes, per row b and query head h (kv head h / (Hq / Hkv)), over the keys t in
// [lo, len) with len = lens[b] and lo = len - window where a window applies (else 0):
//   s_t = dot(q, k_t) * scale; p_t = exp(s_t - max s); out = sum_t p_t v_t / sum_t p_t
// in float32, rounded once to the cache's dtype. Keys are read where they lie: token t of row b
// at block tables[b, t / block_size], offset t % block_size.
//
// Invariants: a row's output depends on its query, its own keys and values and its length alone,
// computed in one fixed order whatever the batch, the other rows' lengths or the threads (threads
// split (row, head) pairs, never a sum): a decode row, a verification row and a lone decode of
// the same token compute alike. Dots and the probabilities' sum run in lanes (lanes.h); exp is one
// polynomial (Cephes' expf) written as plain float operations; the output sums each element over
// t in order. So the AVX-512, AVX2 and portable copies give the same bits.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "isa.h"
#include "lanes.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// Work (multiply-adds) one thread should have before a call is split across threads.
constexpr int64_t kWorkPerThread = 1 << 15;

// exp(x - shift) for x <= shift, in place, and the results' sum in lanes: Cephes' expf, 2^k
// times a polynomial of the remainder, about 1 ulp, written as plain float operations; below
// float32's smallest normal result, 0.
#define NIM_EXP_SUM(NAME, TARGET)                                                              \
  TARGET float NAME(float* s, int64_t n, float shift) {                                        \
    for (int64_t i = 0; i < n; ++i) {                                                          \
      const float d = s[i] - shift; /* NaN stays NaN through y; k is kept an integer */        \
      const float x = std::max(d, -87.33654f);                                                 \
      const float rounded_k = std::nearbyint(x * 1.44269504088896341f);                        \
      const float k = rounded_k > -126.f ? rounded_k : -126.f;                                 \
      float r = x - k * 0.693359375f;                                                          \
      r = r - k * -2.12194440e-4f;                                                             \
      float y = 1.9875691500e-4f;                                                              \
      y = y * r + 1.3981999507e-3f;                                                            \
      y = y * r + 8.3334519073e-3f;                                                            \
      y = y * r + 4.1665795894e-2f;                                                            \
      y = y * r + 1.6666665459e-1f;                                                            \
      y = y * r + 5.0000001201e-1f;                                                            \
      y = y * (r * r) + r + 1.0f;                                                              \
      const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(k) + 127) << 23;        \
      float power;                                                                             \
      std::memcpy(&power, &bits, sizeof(power));                                               \
      s[i] = d < -87.33654f ? 0.f : y * power;                                                 \
    }                                                                                          \
    NIM_RETURN_LANE_SUM(n, i, s[i])                                                            \
  }

NIM_EXP_SUM(exp_sum_avx512, __attribute__((target("avx512f"))))
NIM_EXP_SUM(exp_sum_avx2, __attribute__((target("avx2,fma"))))
NIM_EXP_SUM(exp_sum_portable, )

inline float exp_sum(int64_t isa, float* s, int64_t n, float shift) {
  return NIM_ISA_CALL(isa, exp_sum, s, n, shift);
}

// acc[d] += p * v[d], v widened as it is read: each element's sum over t in order.
#define NIM_AXPY(NAME, TARGET)                                                  \
  template <typename T>                                                         \
  TARGET void NAME(float p, const T* v, float* acc, int64_t n) {                \
    for (int64_t i = 0; i < n; ++i) acc[i] += p * widened(v[i]);                \
  }

NIM_AXPY(axpy_avx512, __attribute__((target("avx512f"))))
NIM_AXPY(axpy_avx2, __attribute__((target("avx2"))))
NIM_AXPY(axpy_portable, )

template <typename T>
inline void axpy(int64_t isa, float p, const T* v, float* acc, int64_t n) {
  NIM_ISA_CALL(isa, axpy, p, v, acc, n);
}

// The AVX-512 copy of one (row, head) item for head sizes of `Chunks` x 16: the same operations
// in the same order as the per-key loops below, arranged for the vector unit.
//   - Dots, 16 keys at a time: each key's 16 lane partials as the per-key dot forms them, then the
//     16 x 16 partials transposed in registers, so each key's lanes are summed in lane order by
//     vertical adds: 16 keys' sums at once, where the per-key dot ends in 16 dependent scalar adds.
//   - Values: the output's accumulators stay in registers across the keys.
// The AVX2 and portable copies keep the per-key loops; the bits are the same (the ISA test).
template <typename T>
__attribute__((target("avx512f"), always_inline)) inline __m512 widened16(const T* p);
template <>
__attribute__((target("avx512f"), always_inline)) inline __m512 widened16(const float* p) {
  return _mm512_loadu_ps(p);
}
template <>
__attribute__((target("avx512f"), always_inline)) inline __m512 widened16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
template <>
__attribute__((target("avx512f"), always_inline)) inline __m512 widened16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// sum_j lanes[k][j] in j order for each of 16 keys k: lanes transposed in registers, then added
// column by column. The unpack / shuffle sequence leaves column 4a + m in cols[4a + swap(m)],
// swap exchanging 1 and 2.
__attribute__((target("avx512f"), always_inline)) inline __m512 lane_sums16(const __m512 (&lanes)[16]) {
  __m512 a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_ps(lanes[2 * i], lanes[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_ps(lanes[2 * i], lanes[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i)
    for (int k = 0; k < 2; ++k) {
      const __m512d lo = _mm512_castps_pd(a[4 * i + k]), hi = _mm512_castps_pd(a[4 * i + 2 + k]);
      b[4 * i + k] = _mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi));
      b[4 * i + 2 + k] = _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi));
    }
  for (int i = 0; i < 2; ++i)
    for (int k = 0; k < 4; ++k) {
      a[8 * i + k] = _mm512_shuffle_f32x4(b[8 * i + k], b[8 * i + 4 + k], 0x88);
      a[8 * i + 4 + k] = _mm512_shuffle_f32x4(b[8 * i + k], b[8 * i + 4 + k], 0xdd);
    }
  for (int k = 0; k < 8; ++k) {
    b[k] = _mm512_shuffle_f32x4(a[k], a[8 + k], 0x88);
    b[8 + k] = _mm512_shuffle_f32x4(a[k], a[8 + k], 0xdd);
  }
  constexpr int kColumn[16] = {0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15};
  __m512 sum = _mm512_setzero_ps();
  for (int j = 0; j < 16; ++j) sum = _mm512_add_ps(sum, b[kColumn[j]]);
  return sum;
}

// dots[i] = dot(q, keys[i]) * scale for i < n (q widened, `Chunks` x 16 long); returns their
// largest as the per-key loop's std::max finds it (a NaN dot never taken; the largest of equal
// zeros is the earlier, which exp_sum computes alike whatever its sign).
template <int Chunks, typename T>
__attribute__((target("avx512f"))) float scaled_dots_avx512(const float* qf, const T* const* keys, int64_t n,
                                                           float scale, float* dots) {
  __m512 q[Chunks];
  for (int c = 0; c < Chunks; ++c) q[c] = _mm512_loadu_ps(qf + 16 * c);
  const __m512 scaled = _mm512_set1_ps(scale);
  __m512 largest = _mm512_set1_ps(-INFINITY);
  for (int64_t first = 0; first < n; first += 16) {
    const int64_t count = std::min<int64_t>(16, n - first);
    __m512 lanes[16];
    for (int64_t k = 0; k < 16; ++k) {
      __m512 lane = _mm512_setzero_ps();
      if (k < count)
        for (int c = 0; c < Chunks; ++c)
          lane = _mm512_add_ps(lane, _mm512_mul_ps(q[c], widened16(keys[first + k] + 16 * c)));
      lanes[k] = lane;
    }
    const __m512 sums = _mm512_mul_ps(lane_sums16(lanes), scaled);
    const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1);
    _mm512_mask_storeu_ps(dots + first, valid, sums);
    largest = _mm512_mask_max_ps(largest, valid, sums, largest);  // NaN or equal: largest kept
  }
  return _mm512_reduce_max_ps(largest);
}

// out = sum_i p[i] values[i] / total, each element summed over i in order, rounded once to T;
// value i lies at keys[i] + values_at.
template <int Chunks, typename T>
__attribute__((target("avx512f"))) void weighted_values_avx512(const float* p, const T* const* keys, int64_t values_at,
                                                              int64_t n, float total, T* out) {
  __m512 acc[Chunks];
  for (int c = 0; c < Chunks; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const __m512 weight = _mm512_set1_ps(p[i]);
    const T* value = keys[i] + values_at;
    for (int c = 0; c < Chunks; ++c) acc[c] = _mm512_add_ps(acc[c], _mm512_mul_ps(weight, widened16(value + 16 * c)));
  }
  alignas(64) float sums[Chunks * 16];
  const __m512 divisor = _mm512_set1_ps(total);
  for (int c = 0; c < Chunks; ++c) _mm512_store_ps(sums + 16 * c, _mm512_div_ps(acc[c], divisor));
  for (int d = 0; d < Chunks * 16; ++d) out[d] = static_cast<T>(sums[d]);
}

// One (row, head) item on AVX-512: dots and their largest, exp and sum (exp_sum), values.
template <int Chunks, typename T>
void attend_item_avx512(const float* qf, const T* const* keys, int64_t n, int64_t values_at, float scale,
                        float* dots, T* out) {
  const float largest = scaled_dots_avx512<Chunks>(qf, keys, n, scale, dots);
  const float total = exp_sum(2, dots, n, largest);
  weighted_values_avx512<Chunks>(dots, keys, values_at, n, total, out);
}

// The AVX-512 item for this head size, or null where the per-key loops serve it.
template <typename T>
using AttendItem = void (*)(const float*, const T* const*, int64_t, int64_t, float, float*, T*);

template <typename T>
AttendItem<T> avx512_item(int64_t isa, int64_t dim) {
  if (isa != 2) return nullptr;
  switch (dim) {
    case 32: return &attend_item_avx512<2, T>;
    case 64: return &attend_item_avx512<4, T>;
    case 80: return &attend_item_avx512<5, T>;
    case 96: return &attend_item_avx512<6, T>;
    case 128: return &attend_item_avx512<8, T>;
    case 256: return &attend_item_avx512<16, T>;
    default: return nullptr;
  }
}

template <typename T>
void attend_rows(int64_t isa, const T* q, const T* cache, const int64_t* tables, const int64_t* lens, int64_t batch,
                 int64_t heads, int64_t kv_heads, int64_t blocks, int64_t block_size, int64_t dim, int64_t width,
                 float scale, int64_t window, T* out) {
  const int64_t group = heads / kv_heads, longest = *std::max_element(lens, lens + batch);
  const int64_t values_at = kv_heads * blocks * block_size * dim;  // cache[1]
  const int64_t grain = std::max<int64_t>(1, kWorkPerThread / std::max<int64_t>(1, 2 * longest * dim));
  const AttendItem<T> fast = avx512_item<T>(isa, dim);
  at::parallel_for(0, batch * heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(dim), acc(dim), dots(longest);
    std::vector<const T*> places(longest);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / heads, h = item % heads, kv = h / group;
      const int64_t len = lens[b], first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      const int64_t* table = tables + b * width;
      const T* head_cache = cache + kv * blocks * block_size * dim;
      widen(q + item * dim, dim, qf.data());
      // Each key's place, block by block (no division per key): keys[i] is token first + i's.
      int64_t placed = 0;
      for (int64_t t = first; t < len;) {
        const T* block = head_cache + table[t / block_size] * block_size * dim;
        const int64_t stop = std::min(len, (t / block_size + 1) * block_size);
        for (int64_t offset = t % block_size; t < stop; ++t, ++offset) places[placed++] = block + offset * dim;
      }
      if (fast) {
        fast(qf.data(), places.data(), n, values_at, scale, dots.data(), out + item * dim);
        continue;
      }
      float largest = -INFINITY;
      for (int64_t i = 0; i < n; ++i) {
        dots[i] = dot(isa, qf.data(), places[i], dim) * scale;
        largest = std::max(largest, dots[i]);
      }
      const float total = exp_sum(isa, dots.data(), n, largest);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t i = 0; i < n; ++i) axpy(isa, dots[i], places[i] + values_at, acc.data(), dim);
      for (float& a : acc) a = a / total;
      T* o = out + item * dim;
      for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<T>(acc[d]);
    }
  });
}

// KVPool.write for a cache in the activations' dtype: row b's key and value heads into slot
// slots[b] (block slots[b] / block_size, offset slots[b] % block_size), an exact copy.
void write_slots(at::Tensor& cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots) {
  const int64_t rows = k.size(0), kv_heads = cache.size(1), blocks = cache.size(2), block_size = cache.size(3);
  const int64_t dim = cache.size(4), bytes = dim * cache.element_size();
  TORCH_CHECK(k.sizes() == v.sizes() && k.dim() == 3 && k.size(1) == kv_heads && k.size(2) == dim,
              "decode_attention: k and v must be [B, Hkv, D] as the cache's");
  TORCH_CHECK(k.scalar_type() == cache.scalar_type() && v.scalar_type() == cache.scalar_type(),
              "decode_attention: k and v must share the cache's dtype");
  const at::Tensor index = slots.to(at::kLong).contiguous();
  TORCH_CHECK(index.dim() == 1 && index.size(0) == rows, "decode_attention: one slot per row of k");
  const int64_t* slot = index.data_ptr<int64_t>();
  for (int64_t b = 0; b < rows; ++b)
    TORCH_CHECK(slot[b] >= 0 && slot[b] < blocks * block_size, "decode_attention: slot ", slot[b], " out of range");
  const at::Tensor keys = k.contiguous(), values = v.contiguous();
  const char* sources[2] = {static_cast<const char*>(keys.data_ptr()), static_cast<const char*>(values.data_ptr())};
  char* base = static_cast<char*>(cache.data_ptr());
  for (int64_t which = 0; which < 2; ++which)
    for (int64_t b = 0; b < rows; ++b)
      for (int64_t h = 0; h < kv_heads; ++h)
        std::memcpy(base + (((which * kv_heads + h) * blocks * block_size) + slot[b]) * bytes,
                    sources[which] + (b * kv_heads + h) * bytes, bytes);
}

at::Tensor decode_attention(const at::Tensor& q, at::Tensor cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale, int64_t window,
                            const c10::optional<at::Tensor>& k, const c10::optional<at::Tensor>& v,
                            const c10::optional<at::Tensor>& slots) {
  TORCH_CHECK(q.dim() == 3 && q.device().is_cpu(), "decode_attention: q must be a [B, Hq, D] CPU tensor");
  TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.is_contiguous() && cache.device().is_cpu(),
              "decode_attention: the cache must be one layer's contiguous [2, Hkv, blocks, block_size, D]");
  TORCH_CHECK(q.scalar_type() == cache.scalar_type(), "decode_attention: q and the cache must share a dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              "decode_attention: float32, bfloat16 or float16 only (a quantized cache is read elsewhere)");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = cache.size(1), blocks = cache.size(2), block_size = cache.size(3);
  TORCH_CHECK(cache.size(4) == dim, "decode_attention: the cache's head size ", cache.size(4), " is not q's ", dim);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "decode_attention: ", heads, " query heads over ", kv_heads,
              " kv heads");
  TORCH_CHECK(window >= 0, "decode_attention: window must be >= 0 (0: none)");
  const at::Tensor tables = block_tables.to(at::kLong).contiguous();
  const at::Tensor lens = context_lens.to(at::kLong).contiguous();
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == batch && lens.dim() == 1 && lens.size(0) == batch,
              "decode_attention: block_tables [B, W] and context_lens [B] must match q's B");
  const int64_t width = tables.size(1);
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(len[b] >= 1 && len[b] <= width * block_size, "decode_attention: row ", b, "'s length ", len[b],
                " is not within its table's ", width * block_size, " positions");
    for (int64_t i = 0; i < (len[b] + block_size - 1) / block_size; ++i)
      TORCH_CHECK(table[b * width + i] >= 0 && table[b * width + i] < blocks, "decode_attention: block id ",
                  table[b * width + i], " out of range");
  }
  TORCH_CHECK(k.has_value() == v.has_value() && k.has_value() == slots.has_value(),
              "decode_attention: k, v and slots come together");
  if (k.has_value()) write_slots(cache, *k, *v, *slots);  // the rows' own keys first: they attend to them
  const at::Tensor query = q.contiguous();
  at::Tensor out = at::empty_like(query);
  if (batch == 0) return out;
  const float s = static_cast<float>(scale);
  const int64_t isa = nim_cpu_isa();
  if (q.scalar_type() == at::kFloat) {
    attend_rows(isa, query.data_ptr<float>(), cache.data_ptr<float>(), table, len, batch, heads, kv_heads, blocks,
                block_size, dim, width, s, window, out.data_ptr<float>());
  } else if (q.scalar_type() == at::kBFloat16) {
    attend_rows(isa, query.data_ptr<c10::BFloat16>(), cache.data_ptr<c10::BFloat16>(), table, len, batch, heads,
                kv_heads, blocks, block_size, dim, width, s, window, out.data_ptr<c10::BFloat16>());
  } else {
    attend_rows(isa, query.data_ptr<c10::Half>(), cache.data_ptr<c10::Half>(), table, len, batch, heads, kv_heads,
                blocks, block_size, dim, width, s, window, out.data_ptr<c10::Half>());
  }
  return out;
}

}  // namespace

// The op's schema is declared in Python (fused_ops.py).
TORCH_LIBRARY_IMPL(nim_cpu, CPU, m) {
  m.impl("decode_attention", &decode_attention);
}
