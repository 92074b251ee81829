// Runtime helpers for Substation's generated CPU code: counter-based dropout, activations.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include <algorithm>
#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace ss {

// Row kernels over fewer elements (attention: fewer multiply-adds of the scores) run on the calling
// thread alone (PyTorch's at::internal::GRAIN_SIZE): a parallel region costs about what such a kernel
// saves, and on a loaded machine each one can wait a scheduler time slice for a descheduled thread.
constexpr int64_t kParallelMinElements = 32768;

// The message of the last failed library call on this thread (exported as substation_last_error()).
inline std::string& last_error() {
  static thread_local std::string message;
  return message;
}

// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011): a
// counter-based generator, so forward and backward regenerate the same dropout mask from
// (seed, stream, element index) without storing it. Element e of a stream draws 16 bits: half
// e % 2 of word (e / 2) % 4 of the block at counter e / 8, so one block serves eight elements.
struct Words { uint32_t w[4]; };

static inline uint32_t mulhilo(uint32_t a, uint32_t b, uint32_t* hi) {
  const uint64_t p = (uint64_t)a * (uint64_t)b;
  *hi = (uint32_t)(p >> 32);
  return (uint32_t)p;
}

static inline Words philox(uint64_t counter, uint32_t stream, uint64_t seed) {
  uint32_t c0 = (uint32_t)counter, c1 = (uint32_t)(counter >> 32), c2 = stream, c3 = 0;
  uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
#pragma GCC unroll 10
  for (int r = 0; r < 10; ++r) {
    uint32_t hi0, hi1;
    const uint32_t lo0 = mulhilo(0xD2511F53u, c0, &hi0);
    const uint32_t lo1 = mulhilo(0xCD9E8D57u, c2, &hi1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
    k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
  }
  return Words{{c0, c1, c2, c3}};
}

// The 16 random bits of element `index` (any access pattern).
static inline uint32_t random_bits(uint64_t seed, uint32_t stream, uint64_t index) {
  const Words b = philox(index >> 3, stream, seed);
  const uint32_t j = (uint32_t)((index >> 1) & 3);
  const uint32_t w = j == 0 ? b.w[0] : j == 1 ? b.w[1] : j == 2 ? b.w[2] : b.w[3];
  return (index & 1) ? w >> 16 : w & 0xFFFFu;
}

#if defined(__AVX512F__)
// 16 V Philox4x32-10 blocks at counters g0 .. g0 + 16 V - 1 on 32-bit lanes (the same words as
// philox()), stored in block order: out[4 * g + w] = word w of block g0 + g. V independent sets of
// sixteen interleave, so their multiply latencies overlap.
template <int V>
static inline void philox_blocks(uint64_t g0, uint32_t stream, uint64_t seed, uint32_t* out) {
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i m0 = _mm512_set1_epi32((int)0xD2511F53u), m1 = _mm512_set1_epi32((int)0xCD9E8D57u);
  __m512i c0[V], c1[V], c2[V], c3[V];
  for (int v = 0; v < V; ++v) {
    const uint64_t first = g0 + 16u * (uint64_t)v;
    const __m512i base = _mm512_set1_epi32((int)(uint32_t)first), high = _mm512_set1_epi32((int)(uint32_t)(first >> 32));
    c0[v] = _mm512_add_epi32(base, lanes);
    c1[v] = _mm512_mask_add_epi32(high, _mm512_cmplt_epu32_mask(c0[v], base), high, _mm512_set1_epi32(1));
    c2[v] = _mm512_set1_epi32((int)stream);
    c3[v] = _mm512_setzero_si512();
  }
  uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
  for (int r = 0; r < 10; ++r) {
    const __m512i key0 = _mm512_set1_epi32((int)k0), key1 = _mm512_set1_epi32((int)k1);
    for (int v = 0; v < V; ++v) {
      // high words of the 32 x 32 -> 64-bit products (even and odd lanes), low words by vpmulld;
      // the two XORs of each new word in one ternary-logic op
      const __m512i pe0 = _mm512_mul_epu32(c0[v], m0), po0 = _mm512_mul_epu32(_mm512_srli_epi64(c0[v], 32), m0);
      const __m512i pe1 = _mm512_mul_epu32(c2[v], m1), po1 = _mm512_mul_epu32(_mm512_srli_epi64(c2[v], 32), m1);
      const __m512i hi0 = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(pe0, 32), po0);
      const __m512i lo0 = _mm512_mullo_epi32(c0[v], m0);
      const __m512i hi1 = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(pe1, 32), po1);
      const __m512i lo1 = _mm512_mullo_epi32(c2[v], m1);
      c0[v] = _mm512_ternarylogic_epi32(hi1, c1[v], key0, 0x96);
      c2[v] = _mm512_ternarylogic_epi32(hi0, c3[v], key1, 0x96);
      c1[v] = lo1;
      c3[v] = lo0;
    }
    k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
  }
  for (int v = 0; v < V; ++v) {
    // 4 x 16 transpose: word-major registers to block-major memory
    const __m512i t0 = _mm512_unpacklo_epi32(c0[v], c1[v]), t1 = _mm512_unpackhi_epi32(c0[v], c1[v]);
    const __m512i t2 = _mm512_unpacklo_epi32(c2[v], c3[v]), t3 = _mm512_unpackhi_epi32(c2[v], c3[v]);
    const __m512i u0 = _mm512_unpacklo_epi64(t0, t2), u1 = _mm512_unpackhi_epi64(t0, t2);  // blocks 0 4 8 12, 1 5 9 13
    const __m512i u2 = _mm512_unpacklo_epi64(t1, t3), u3 = _mm512_unpackhi_epi64(t1, t3);  // blocks 2 6 10 14, 3 7 11 15
    const __m512i w0 = _mm512_shuffle_i32x4(u0, u1, 0x44), w1 = _mm512_shuffle_i32x4(u2, u3, 0x44);
    const __m512i w2 = _mm512_shuffle_i32x4(u0, u1, 0xEE), w3 = _mm512_shuffle_i32x4(u2, u3, 0xEE);
    uint32_t* o = out + 64 * v;
    _mm512_storeu_si512(o, _mm512_shuffle_i32x4(w0, w1, 0x88));
    _mm512_storeu_si512(o + 16, _mm512_shuffle_i32x4(w0, w1, 0xDD));
    _mm512_storeu_si512(o + 32, _mm512_shuffle_i32x4(w2, w3, 0x88));
    _mm512_storeu_si512(o + 48, _mm512_shuffle_i32x4(w2, w3, 0xDD));
  }
}
#endif

// Words of scratch random_row needs for a row of n elements (blocks are drawn sixteen at a time).
static inline size_t random_row_words(int64_t n) { return (size_t)(n / 2 + 72); }

// The bits of elements first .. first + n - 1 (a row whose random index is contiguous), one block
// per eight elements: the blocks' words are stored in order, so on a little-endian machine the
// 16-bit halves of element first + i sit at index (first % 8) + i of the same memory read as
// uint16 (may_alias: read through another type on purpose). `scratch` holds random_row_words(n).
typedef uint16_t __attribute__((may_alias)) bits16_t;
static inline const bits16_t* random_row(uint64_t seed, uint32_t stream, uint64_t first, int64_t n,
                                         uint32_t* __restrict__ scratch) {
  static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "random_row assumes a little-endian machine");
  const uint64_t g0 = first >> 3;
  const int64_t groups = (int64_t)(((first & 7) + (uint64_t)n + 7) >> 3);
#if defined(__AVX512F__)
  int64_t g = 0;
  for (; g + 32 <= groups; g += 32) philox_blocks<2>(g0 + (uint64_t)g, stream, seed, scratch + 4 * g);
  for (; g < groups; g += 16) philox_blocks<1>(g0 + (uint64_t)g, stream, seed, scratch + 4 * g);
#else
#pragma omp simd
  for (int64_t g = 0; g < groups; ++g) {
    const Words b = philox(g0 + (uint64_t)g, stream, seed);
    scratch[4 * g] = b.w[0]; scratch[4 * g + 1] = b.w[1];
    scratch[4 * g + 2] = b.w[2]; scratch[4 * g + 3] = b.w[3];
  }
#endif
  return reinterpret_cast<const bits16_t*>(scratch) + (first & 7);
}

// Bits that keep every element (all zero) for eval mode: the row's scratch, zero-initialised by its
// std::vector and never written by random_row while training is off.
static inline const bits16_t* keep_all_bits(const uint32_t* scratch) {
  return reinterpret_cast<const bits16_t*>(scratch);
}

// Inverted dropout given an element's 16 random bits: x * scale when bits >= threshold, else 0;
// P(keep) = 1 - threshold / 2^16 and scale = 2^16 / (2^16 - threshold) exactly. Branch-free.
template <typename T>
static inline T dropout(T x, uint32_t bits, uint32_t threshold, T scale) {
  return bits >= threshold ? x * scale : T(0);
}

// max as std::max(a, b) computes it ((a < b) ? b : a, a NaN b ignored), written so that GCC 12
// vectorizes `omp simd reduction(max: ...)` loops over it (with std::max it emits a scalar vmaxss
// chain: a 128-wide softmax row's maximum took longer than its exponentials).
template <typename T> static inline T max_(T a, T b) { return b > a ? b : a; }

// Elementary functions. float: branch-free approximations that GCC vectorizes inside
// `#pragma omp simd` loops (scalar libm calls would not vectorize); double: libm.
// exp: Cody-Waite range reduction and the Cephes expf polynomial (about 1 ulp); inputs below
// -87.3 give exactly 0 so masked scores (-inf) vanish. The constants, shared with exp_shifted_row:
namespace expf_constants {
constexpr float lo = -87.3f, hi = 88.3f, log2e = 1.44269504088896341f;
constexpr float ln2_hi = 0.693359375f, ln2_lo = 2.12194440e-4f;  // ln 2 = ln2_hi - ln2_lo
constexpr float c5 = 1.9875691500e-4f, c4 = 1.3981999507e-3f, c3 = 8.3334519073e-3f, c2 = 4.1665795894e-2f,
                c1 = 1.6666665459e-1f, c0 = 5.0000001201e-1f;  // exp(r) ~ 1 + r + r^2 (c0 + c1 r + ... + c5 r^5)
}  // namespace expf_constants
static inline float exp_(float x) {
  using namespace expf_constants;
  const float xc = std::min(std::max(x, lo), hi);
  const float n = std::floor(xc * log2e + 0.5f);
  const float r = (xc - n * ln2_hi) + n * ln2_lo;
  float p = c5;
  p = p * r + c4;
  p = p * r + c3;
  p = p * r + c2;
  p = p * r + c1;
  p = p * r + c0;
  p = p * r * r + r + 1.0f;
  const float scale = __builtin_bit_cast(float, ((int32_t)n + 127) << 23);
  return x < lo ? 0.0f : p * scale;
}
static inline double exp_(double x) { return std::exp(x); }
// 1 / sqrt(x): the normalizations' rstd.
static inline float rsqrt_(float x) { return 1.0f / std::sqrt(x); }
static inline double rsqrt_(double x) { return 1.0 / std::sqrt(x); }

#if defined(__AVX512F__)
// The mask of the first n of 16 lanes (none for n <= 0, all for n >= 16): the tail of a row.
static inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? (__mmask16)0xFFFF : n > 0 ? (__mmask16)((1u << n) - 1) : (__mmask16)0;
}

// exp_ of the lanes of t that `tail` selects (zero in the others): the vector form exp_shifted_row and
// the fused attention's softmax share.
static inline __m512 exp_lanes(__m512 t, __mmask16 tail) {
  using namespace expf_constants;
  const __m512 vlo = _mm512_set1_ps(lo);
  const __mmask16 live = _mm512_cmp_ps_mask(t, vlo, _CMP_NLT_UQ) & tail;
  const __m512 xc = _mm512_min_ps(_mm512_set1_ps(hi), _mm512_max_ps(vlo, t));
  const __m512 k = _mm512_roundscale_ps(_mm512_fmadd_ps(xc, _mm512_set1_ps(log2e), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(k, _mm512_set1_ps(ln2_lo), _mm512_fnmadd_ps(k, _mm512_set1_ps(ln2_hi), xc));
  __m512 p = _mm512_set1_ps(c5);
  for (const float c : {c4, c3, c2, c1, c0}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(live, p, k);
}
#endif

// Softmax's exponentials of a row: y[i] = exp_(x[i] - mx) for i < n, returning their sum. With
// AVX-512 the same reduction and polynomial run as intrinsics (2^k by vscalefps, results under 2^-126
// zeroed by a mask; about 15% less time for the whole softmax kernel than exp_ in a simd loop). NaN
// stays NaN: the clamps pass it through as their second operand.
static inline float exp_shifted_row(const float* __restrict__ x, float* __restrict__ y, int64_t n, float mx) {
  int64_t i = 0;
  float sum = 0;
#if defined(__AVX512F__)
  const __m512 m = _mm512_set1_ps(mx);
  __m512 acc = _mm512_setzero_ps();
  for (; i < n; i += 16) {
    const __mmask16 tail = first_lanes(n - i);
    const __m512 e = exp_lanes(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, x + i), m), tail);
    _mm512_mask_storeu_ps(y + i, tail, e);
    acc = _mm512_add_ps(acc, e);
  }
  sum = _mm512_reduce_add_ps(acc);
#endif
#pragma omp simd reduction(+ : sum)
  for (int64_t j = i; j < n; ++j) {
    y[j] = exp_(x[j] - mx);
    sum += y[j];
  }
  return sum;
}

// Phi(x), the standard normal CDF, in float: q = Phi(-|x|) = exp(-x^2 / 2) R(t) with t = 1 / (1 + 0.2375 |x|)
// and R = t P(t), P of degree 9 fitted to q exp(x^2 / 2) (relative error <= 7.5e-9 for |x| <= 2, 2.7e-8
// up to 14; the form of Abramowitz & Stegun 26.2.17 with more terms); Phi = 1 - q for x >= 0. Its
// error is float rounding, without sign: the 5-term erf of A&S 7.1.26 (absolute error <= 1.5e-7) was
// off by a smooth curve, which GELU's inputs summed coherently through the next GEMM. gauss =
// exp(-x^2 / 2), shared with GELU's gradient.
static inline float normal_cdf_with_gauss(float x, float gauss) {
  const float t = 1.0f / (1.0f + 0.2375f * std::fabs(x));
  float r = 0.0271144677f;
  r = r * t - 0.138105437f;
  r = r * t + 0.243359417f;
  r = r * t - 0.190052733f;
  r = r * t + 0.177272499f;
  r = r * t + 0.0110052824f;
  r = r * t + 0.0926280841f;
  r = r * t + 0.087063916f;
  r = r * t + 0.09497530f;
  r = r * t + 0.0947392061f;
  const float q = gauss * (r * t);
  return x >= 0.0f ? 1.0f - q : q;
}

static inline float gelu(float x) { return x * normal_cdf_with_gauss(x, exp_(-0.5f * x * x)); }
static inline double gelu(double x) { return 0.5 * x * (1.0 + std::erf(x * 0.70710678118654752440)); }
// GELU'(x) = Phi(x) + x phi(x); for float, Phi reuses phi's exp(-x^2 / 2).
static inline float gelu_grad(float x) {
  const float gauss = exp_(-0.5f * x * x);
  return normal_cdf_with_gauss(x, gauss) + x * gauss * 0.39894228040143267794f;
}
static inline double gelu_grad(double x) {
  const double cdf = 0.5 * (1.0 + std::erf(x * 0.70710678118654752440));
  return cdf + x * std::exp(-0.5 * x * x) * 0.39894228040143267794;
}
// GELU's tanh form, 0.5 x (1 + tanh(u)) with u = c (x + 0.044715 x^3), as x s with the logistic
// s = e / (e + 1) = (1 + tanh(u)) / 2, e = exp(2u) (u clamped where e would overflow); its gradient
// s + 2 x s (1 - s) u' takes 1 - s = 1 / (e + 1) directly, where 1 - tanh(u)^2 from a rounded tanh lost
// its digits near |tanh| = 1 (float gradient: max error 2.0e-6, interval means 1e-7; now 2.2e-7, 7e-9).
template <typename T> static inline T gelu_tanh_exp(T x) {  // e = exp(2u), c = sqrt(2 / pi)
  const T u = T(0.79788456080286535588) * (x + T(0.044715) * x * x * x), lim = sizeof(T) == 4 ? T(44) : T(350);
  return exp_(T(2) * std::min(std::max(u, -lim), lim));
}
template <typename T> static inline T gelu_tanh(T x) {
  const T e = gelu_tanh_exp(x);
  return x * (e / (e + T(1)));
}
template <typename T> static inline T gelu_tanh_grad(T x) {
  const T e = gelu_tanh_exp(x), r = T(1) / (e + T(1)), s = e * r;
  return s + T(2) * x * s * r * T(0.79788456080286535588) * (T(1) + T(3) * T(0.044715) * x * x);
}
template <typename T> static inline T relu(T x) { return x > T(0) ? x : T(0); }
template <typename T> static inline T relu_grad(T x) { return x > T(0) ? T(1) : T(0); }

#if defined(__AVX512F__)
// One small float GEMM on the calling thread, row-major: C[m x n] = alpha op(A)[m x k] op(B)[k x n]
// (beta 0), for the per-head GEMMs of attention, which run one per thread inside a parallel loop
// (a BLAS call of that size spends much of its time outside its inner kernel). op(B) is packed into
// 32-column panels (zero-padded) in `pack` (gemm_small_pack_floats(n, k) floats); 8-row blocks of A
// are broadcast element by element against two 16-lane panel rows, accumulating in 16 registers.
// Each element sums its k products in order, one fused multiply-add at a time.
static inline size_t gemm_small_pack_floats(int64_t n, int64_t k) { return (size_t)(32 * k * ((n + 31) / 32)); }

template <int MR>
static inline void gemm_small_block(int64_t k, const float* a, int64_t rs_a, int64_t cs_a, const float* panel,
                                    float alpha, float* c, int64_t ldc, __mmask16 m0, __mmask16 m1) {
  __m512 acc0[MR], acc1[MR];
  for (int r = 0; r < MR; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k; ++p) {
    const __m512 b0 = _mm512_loadu_ps(panel + 32 * p), b1 = _mm512_loadu_ps(panel + 32 * p + 16);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512 av = _mm512_set1_ps(a[r * rs_a + p * cs_a]);
      acc0[r] = _mm512_fmadd_ps(av, b0, acc0[r]);
      acc1[r] = _mm512_fmadd_ps(av, b1, acc1[r]);
    }
  }
  const __m512 scale = _mm512_set1_ps(alpha);
  for (int r = 0; r < MR; ++r) {
    _mm512_mask_storeu_ps(c + r * ldc, m0, _mm512_mul_ps(acc0[r], scale));
    _mm512_mask_storeu_ps(c + r * ldc + 16, m1, _mm512_mul_ps(acc1[r], scale));
  }
}

template <int MR>
static inline void gemm_small_rows(int64_t rows, int64_t k, const float* a, int64_t rs_a, int64_t cs_a,
                                   const float* panel, float alpha, float* c, int64_t ldc, __mmask16 m0, __mmask16 m1) {
  if constexpr (MR > 0) {
    if (rows == MR) gemm_small_block<MR>(k, a, rs_a, cs_a, panel, alpha, c, ldc, m0, m1);
    else gemm_small_rows<MR - 1>(rows, k, a, rs_a, cs_a, panel, alpha, c, ldc, m0, m1);
  }
}

// A 16 x 16 float transpose in registers: row i in r[i], column i out in r[i].
static inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
  }
}

// The packing half of gemm_small: op(B) [k x n] into 32-column panels (a packed B serves many A's),
// plus `add` (or nothing) along B's stored rows: op(B)[p, j] + add[p] with trans_b, + add[j] without.
// With trans_b (the keys of attention's scores: rows of b are columns of op(B)) 16 x 16 blocks are
// transposed in registers; a scalar transpose read the strided rows several times slower.
static inline void gemm_small_pack(bool trans_b, int64_t n, int64_t k, const float* b, int64_t ldb,
                                   float* __restrict__ pack, const float* add = nullptr) {
  const int64_t panels = (n + 31) / 32;
  for (int64_t jp = 0; jp < panels; ++jp) {
    const int64_t j0 = jp * 32, w = std::min<int64_t>(32, n - j0);
    if (trans_b) {
      for (int64_t half = 0; half < 32; half += 16)
        for (int64_t p0 = 0; p0 < k; p0 += 16) {
          const int64_t cols = std::min<int64_t>(16, k - p0);
          const __mmask16 live = first_lanes(cols);
          const __m512 shift = add ? _mm512_maskz_loadu_ps(live, add + p0) : _mm512_setzero_ps();
          __m512 r[16];
          for (int64_t j = 0; j < 16; ++j)
            r[j] = half + j < w ? _mm512_add_ps(_mm512_maskz_loadu_ps(live, b + (j0 + half + j) * ldb + p0), shift)
                                : _mm512_setzero_ps();
          transpose16(r);
          for (int64_t p = 0; p < cols; ++p) _mm512_storeu_ps(pack + 32 * (jp * k + p0 + p) + half, r[p]);
        }
      continue;
    }
    for (int64_t p = 0; p < k; ++p) {
      float* row = pack + 32 * (jp * k + p);
      if (add) {
#pragma omp simd
        for (int64_t j = 0; j < w; ++j) row[j] = b[p * ldb + j0 + j] + add[j0 + j];
      } else {
        std::memcpy(row, b + p * ldb + j0, sizeof(float) * (size_t)w);
      }
      for (int64_t j = w; j < 32; ++j) row[j] = 0.0f;
    }
  }
}

// The compute half: C[m x n] = alpha op(A) B with B packed by gemm_small_pack.
static inline void gemm_small_packed(bool trans_a, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                                     int64_t lda, const float* pack, float* c, int64_t ldc) {
  const int64_t panels = (n + 31) / 32;
  const int64_t rs_a = trans_a ? 1 : lda, cs_a = trans_a ? lda : 1;
  for (int64_t jp = 0; jp < panels; ++jp) {
    const int64_t j0 = jp * 32, w = std::min<int64_t>(32, n - j0);
    const __mmask16 m0 = first_lanes(w);
    const __mmask16 m1 = first_lanes(w - 16);
    const float* panel = pack + 32 * jp * k;
    int64_t i = 0;
    for (; i + 8 <= m; i += 8) gemm_small_block<8>(k, a + i * rs_a, rs_a, cs_a, panel, alpha, c + i * ldc + j0, ldc, m0, m1);
    gemm_small_rows<7>(m - i, k, a + i * rs_a, rs_a, cs_a, panel, alpha, c + i * ldc + j0, ldc, m0, m1);
  }
}

static inline void gemm_small(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                              const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc,
                              float* __restrict__ pack) {
  gemm_small_pack(trans_b, n, k, b, ldb, pack);
  gemm_small_packed(trans_a, m, n, k, alpha, a, lda, pack, c, ldc);
}
#endif

// bfloat16 storage (the top half of a float32): tensors of bfloat16 builds are loaded into float and
// stored back rounded to nearest even, as PyTorch's c10::BFloat16 does; NaN stays a (quiet) NaN.
// Integer arithmetic only, so `omp simd` loops vectorize it on any AVX-512 CPU.
typedef uint16_t bf16_t;
static inline float bf16_to_float(bf16_t h) { return __builtin_bit_cast(float, (uint32_t)h << 16); }
static inline bf16_t float_to_bf16(float f) {
  const uint32_t u = __builtin_bit_cast(uint32_t, f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (bf16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? (u >> 16) | 0x40u : rounded);
}

static inline int64_t align_up(int64_t bytes) { return (bytes + 63) / 64 * 64; }

}  // namespace ss
