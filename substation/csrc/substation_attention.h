// Substation: fused attention for forward-only CPU builds (float, double and bfloat16).
//
// y[b, j, h, :] = sum_k softmax_k(alpha * q[b, j, h, :] . k[b, k, h, :] + mask[b, k]) v[b, k, h, :]
// (q, k, v plus their biases, when given).
//
// One task per (b, h): K^T and V are packed once, then blocks of queries run one after another, each
// block's scores [rows, K] computed into a per-thread buffer, masked, exponentiated into a second
// buffer and multiplied by V; each output row is scaled by its 1 / sum at the end (P values instead
// of K). The [B, H, J, K] scores and probabilities never reach memory (the unfused graph writes and
// reads them four times). Every key is in the block, so the softmax is exact in one pass. Semantics
// as the unfused kernels: a row whose scores are all -inf gets zero probabilities; causal masks key
// k > query j.
//
// bfloat16 builds on a CPU with AMX (attention_forward_amx): the same method on the tile units. Scores
// accumulate in float32 tiles, the softmax runs in float32, the exponentials are rounded to bf16 for
// the product with V (float32 accumulation), y is rounded once: what PyTorch's fused CPU attention
// computes under autocast. Without AMX (attention_forward_dp) the same arithmetic on AVX512-BF16's
// VDPBF16PS; attention_forward_bf16 chooses.
#pragma once

#include "substation_blas.h"
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "substation_cpu.h"

namespace ss {

// Score and exponential blocks per thread: 16 KiB together (L1-resident; 16 float rows at K = 128, so a
// head has 8 blocks to spread NextHead's prefetches over: 6% faster than 64 KiB at B = 28, L = 128 on
// Zen 4, 8 KiB no faster).
constexpr int64_t ATTENTION_BLOCK_BYTES = 16 * 1024;

template <typename T>
static inline int64_t attention_block_rows(int64_t J, int64_t K) {
  const int64_t rows = ATTENTION_BLOCK_BYTES / (2 * (int64_t)sizeof(T) * std::max<int64_t>(K, 1));
  return std::max<int64_t>(1, std::min<int64_t>(J, std::max<int64_t>(rows, 8)));
}

// Scores row r of a block: mask, causal mask, max; exponentials into e; returns 1 / their sum (0 when
// every score is -inf, so the probabilities are 0; a NaN sum stays NaN).
template <typename T>
static inline T attention_exponentials(T* s, T* e, int64_t K, const T* mask, bool causal, int64_t query) {
  if (mask) {
#pragma omp simd
    for (int64_t i = 0; i < K; ++i) s[i] += mask[i];
  }
  if (causal)
    for (int64_t i = query + 1; i < K; ++i) s[i] = -INFINITY;
  T mx = -INFINITY;
#pragma omp simd reduction(max : mx)
  for (int64_t i = 0; i < K; ++i) mx = max_(mx, s[i]);
  if (mx == -INFINITY) mx = 0;
  T sum = 0;
  if constexpr (std::is_same<T, float>::value) {
    sum = exp_shifted_row(s, e, K, mx);
  } else {
    for (int64_t i = 0; i < K; ++i) {
      e[i] = exp_(s[i] - mx);
      sum += e[i];
    }
  }
  return sum == 0 ? T(0) : T(1) / sum;
}

// The next (b, h) task's Q, K and V rows, fetched into L2 a slice at a time while this task computes:
// each query block prefetches one slice (a burst of a whole head's lines stalled as long as the loads
// would). The rows are a cache line or two each, strided by the token stride; fetched on demand they
// kept the float kernel's packing and scores waiting on memory (B = 28, L = 128, P = 32 on Zen 4: 20%
// of its time).
template <typename T>
class NextHead {
 public:
  NextHead(int64_t b, int64_t h, int64_t B, int64_t H, int64_t J, int64_t K, int64_t P, const T* q,
           const int64_t* q_s, const T* k, const int64_t* k_s, const T* v, const int64_t* v_s)
      : J_(J), K_(K), bytes_(P * (int64_t)sizeof(T)) {
    if (++h == H) h = 0, ++b;
    if (b >= B) return;
    q_ = {reinterpret_cast<const char*>(q + b * q_s[0] + h * q_s[2]), q_s[1] * (int64_t)sizeof(T)};
    k_ = {reinterpret_cast<const char*>(k + b * k_s[0] + h * k_s[2]), k_s[1] * (int64_t)sizeof(T)};
    v_ = {reinterpret_cast<const char*>(v + b * v_s[0] + h * v_s[2]), v_s[1] * (int64_t)sizeof(T)};
  }

  // Slice `part` of `parts` (rows part J / parts onwards, and the same share of K).
  void fetch(int64_t part, int64_t parts) const {
    if (q_.base == nullptr) return;
    rows(q_, part * J_ / parts, (part + 1) * J_ / parts);
    rows(k_, part * K_ / parts, (part + 1) * K_ / parts);
    rows(v_, part * K_ / parts, (part + 1) * K_ / parts);
  }

 private:
  struct Rows {
    const char* base = nullptr;
    int64_t ld_bytes = 0;
  };

  void rows(const Rows& m, int64_t r0, int64_t r1) const {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = 0; c < bytes_; c += 64) prefetch_l2(m.base + r * m.ld_bytes + c);
  }

  // PREFETCHT1 as an instruction: GCC 12 deleted loops of _mm_prefetch here.
  static void prefetch_l2(const char* p) {
#if defined(__x86_64__)
    asm volatile("prefetcht1 %0" : : "m"(*p));
#else
    __builtin_prefetch(p, 0, 2);
#endif
  }

  int64_t J_, K_, bytes_;
  Rows q_, k_, v_;
};

#if defined(__AVX512F__)
// attention_exponentials for R rows of a block at once (s, e: row stride K; the first row is query
// `query`) with the same arithmetic, so the same results: each row's maximum over its masked scores,
// the exponentials exp_lanes(s + mask - maximum), their sum in one 16-lane accumulator and 1 / sum into
// inv. The rows go through each pass together: one row's maximum and sum are chains of dependent
// instructions, R of them overlap (a row at a time, the float kernel was bound by their latency).
template <int R>
static inline void float_exponentials(float* s, float* e, int64_t K, const float* mask, bool causal, int64_t query,
                                      float* inv) {
  int64_t live[R];  // keys each row attends: those past its query are -inf under a causal mask
  int64_t most = 0;
  for (int r = 0; r < R; ++r) most = std::max(most, live[r] = causal ? std::min<int64_t>(K, query + r + 1) : K);
  __m512 top[R], acc[R];
  for (int r = 0; r < R; ++r) top[r] = _mm512_set1_ps(-INFINITY), acc[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < most; i += 16) {
    const __m512 m = mask ? _mm512_maskz_loadu_ps(first_lanes(most - i), mask + i) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __mmask16 tail = first_lanes(live[r] - i);
      const __m512 t = _mm512_add_ps(_mm512_maskz_loadu_ps(tail, s + r * K + i), m);
      top[r] = _mm512_mask_max_ps(top[r], tail, top[r], t);
    }
  }
  for (int r = 0; r < R; ++r) {
    const float t = _mm512_reduce_max_ps(top[r]);
    top[r] = _mm512_set1_ps(t == -INFINITY ? 0.0f : t);
  }
  for (int64_t i = 0; i < K; i += 16) {
    const __mmask16 keys = first_lanes(K - i);
    const __m512 m = mask ? _mm512_maskz_loadu_ps(keys, mask + i) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __mmask16 tail = first_lanes(live[r] - i);
      const __m512 t = _mm512_add_ps(_mm512_maskz_loadu_ps(tail, s + r * K + i), m);
      const __m512 x = exp_lanes(_mm512_sub_ps(t, top[r]), tail);
      _mm512_mask_storeu_ps(e + r * K + i, keys, x);
      acc[r] = _mm512_add_ps(acc[r], x);
    }
  }
  for (int r = 0; r < R; ++r) {
    const float sum = _mm512_reduce_add_ps(acc[r]);
    inv[r] = sum == 0 ? 0.0f : 1.0f / sum;
  }
}

// float_exponentials over the `rows` rows of a block, R at a time.
template <int R>
static inline void float_block_exponentials(int64_t rows, float* s, float* e, int64_t K, const float* mask,
                                            bool causal, int64_t query, float* inv) {
  if constexpr (R > 0) {
    for (; rows >= R; rows -= R, s += R * K, e += R * K, query += R, inv += R)
      float_exponentials<R>(s, e, K, mask, causal, query, inv);
    float_block_exponentials<R - 1>(rows, s, e, K, mask, causal, query, inv);
  }
}

// Keys up to which the float softmax takes four rows at a time (faster than 2 or 8 at K = 128); with
// longer rows one row's chains are long enough, and four rows' scores and exponentials streamed at
// once were slower (Zen 4, 2 threads: K = 512 7%, K = 2048 10%).
constexpr int64_t kSoftmaxGroupKeys = 256;
#endif

// The biases of q, k and v ([H, P] each, P contiguous, stride h along H), added as they are loaded; all
// null for none.
template <typename T>
struct AttentionBias {
  const T* q = nullptr;
  const T* k = nullptr;
  const T* v = nullptr;
  int64_t h = 0;
};

// rows x P of x (row stride ld) plus the row bias into the dense buffer out.
template <typename T>
static inline void add_bias_rows(int64_t rows, int64_t P, const T* x, int64_t ld, const T* bias, T* __restrict__ out) {
  for (int64_t r = 0; r < rows; ++r) {
#pragma omp simd
    for (int64_t p = 0; p < P; ++p) out[r * P + p] = x[r * ld + p] + bias[p];
  }
}

// Strides in elements: q_s / y_s = {b, j, h}, k_s / v_s = {b, k, h}; the head dimension P is
// contiguous in q, k, v and y. mask: additive [B, K] with batch stride mask_b and unit key stride, or
// null.
template <typename T>
static inline void attention_forward(int64_t B, int64_t H, int64_t J, int64_t K, int64_t P, T alpha,
                                     const T* q, const int64_t* q_s, const T* k, const int64_t* k_s, const T* v,
                                     const int64_t* v_s, const T* mask, int64_t mask_b, bool causal, T* y,
                                     const int64_t* y_s, const AttentionBias<T>& bias) {
  const int64_t rows = attention_block_rows<T>(J, K);
  const bool biased = bias.q != nullptr;
#if defined(__AVX512F__)
  constexpr bool packed = std::is_same<T, float>::value;
#else
  constexpr bool packed = false;
#endif
#pragma omp parallel if (B * H * J * K * P >= kParallelMinElements)  // multiply-adds of the scores
  {
    std::vector<T> s((size_t)(rows * K)), e((size_t)(rows * K)), inv((size_t)rows);
    // with biases: the block's biased queries, and (BLAS path) the head's biased keys and values
    std::vector<T> q_rows(biased ? (size_t)(rows * P) : 0), kv_rows(biased && !packed ? (size_t)(2 * K * P) : 0);
    std::vector<float> pack_k, pack_v;
#if defined(__AVX512F__)
    if constexpr (packed) {
      pack_k.resize(gemm_small_pack_floats(K, P));
      pack_v.resize(gemm_small_pack_floats(P, K));
    }
#endif
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h) {
        const NextHead<T> next(b, h, B, H, J, K, P, q, q_s, k, k_s, v, v_s);
        const T* kb = k + b * k_s[0] + h * k_s[2];
        const T* vb = v + b * v_s[0] + h * v_s[2];
        int64_t k_ld = k_s[1], v_ld = v_s[1];
        const T* mb = mask ? mask + b * mask_b : nullptr;
#if defined(__AVX512F__)
        if constexpr (packed) {
          gemm_small_pack(true, K, P, kb, k_ld, pack_k.data(), biased ? bias.k + h * bias.h : nullptr);
          gemm_small_pack(false, P, K, vb, v_ld, pack_v.data(), biased ? bias.v + h * bias.h : nullptr);
        } else
#endif
          if (biased) {
            add_bias_rows(K, P, kb, k_ld, bias.k + h * bias.h, kv_rows.data());
            add_bias_rows(K, P, vb, v_ld, bias.v + h * bias.h, kv_rows.data() + K * P);
            kb = kv_rows.data(), vb = kv_rows.data() + K * P, k_ld = v_ld = P;
          }
        for (int64_t j0 = 0; j0 < J; j0 += rows) {
          const int64_t nj = std::min(rows, J - j0);
          next.fetch(j0 / rows, (J + rows - 1) / rows);
          const T* qb = q + b * q_s[0] + j0 * q_s[1] + h * q_s[2];
          int64_t q_ld = q_s[1];
          if (biased) {
            add_bias_rows(nj, P, qb, q_ld, bias.q + h * bias.h, q_rows.data());
            qb = q_rows.data(), q_ld = P;
          }
          T* yb = y + b * y_s[0] + j0 * y_s[1] + h * y_s[2];
#if defined(__AVX512F__)
          if constexpr (packed) {
            gemm_small_packed(false, nj, K, P, alpha, qb, q_ld, pack_k.data(), s.data(), K);
          } else
#endif
            blas_gemm(false, true, nj, K, P, alpha, qb, q_ld, kb, k_ld, s.data(), K);
#if defined(__AVX512F__)
          if constexpr (packed) {
            if (K <= kSoftmaxGroupKeys) float_block_exponentials<4>(nj, s.data(), e.data(), K, mb, causal, j0, inv.data());
            else float_block_exponentials<1>(nj, s.data(), e.data(), K, mb, causal, j0, inv.data());
          } else
#endif
            for (int64_t r = 0; r < nj; ++r)
              inv[r] = attention_exponentials(s.data() + r * K, e.data() + r * K, K, mb, causal, j0 + r);
#if defined(__AVX512F__)
          if constexpr (packed) {
            gemm_small_packed(false, nj, P, K, 1.0f, e.data(), K, pack_v.data(), yb, y_s[1]);
          } else
#endif
            blas_gemm(false, false, nj, P, K, T(1), e.data(), K, vb, v_ld, yb, y_s[1]);
          for (int64_t r = 0; r < nj; ++r) {
            T* row = yb + r * y_s[1];
#pragma omp simd
            for (int64_t p = 0; p < P; ++p) row[p] *= inv[r];
          }
        }
      }
  }
}

#if defined(__AVX512BF16__)
// 2^y for the lanes `tail` selects (y <= 0 or NaN: a score minus its row's maximum, in base-2 units),
// zero in the others and under 2^-126 (a masked key's -inf; no denormal result, which Intel CPUs make
// slowly), to 3e-6 relative: enough where the result is rounded to bf16 (2e-3), in 7 instructions.
// 2^y = 2^floor(y) 2^f: VREDUCEPS gives f = y - floor(y) in [0, 1], a degree-4 polynomial fitted to the
// relative error there gives 2^f, and VSCALEFPS multiplies by 2^floor(y) itself (a separate rounding
// and subtraction made the softmax, bound by its vector instructions on Zen 4, 15% slower).
static inline __m512 exp2_lanes_bf16(__m512 y, __mmask16 tail) {
  constexpr float c0 = 1.0000026f, c1 = 0.69300383f, c2 = 0.24144280f, c3 = 0.052011464f, c4 = 0.013534134f;
  const __mmask16 live = _mm512_cmp_ps_mask(y, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ) & tail;
  const __m512 f = _mm512_reduce_ps(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(c4);
  for (const float c : {c3, c2, c1, c0}) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  return _mm512_maskz_scalef_ps(live, p, y);
}

// One sequence's additive key mask in base-2 units: out[i] = log2(e) mask[i], i < K (once per task,
// so the softmax adds it with one FMA per 16 keys).
static inline const float* key_mask_log2(const bf16_t* mask, int64_t K, float* __restrict__ out) {
#pragma omp simd
  for (int64_t i = 0; i < K; ++i) out[i] = bf16_to_float(mask[i]) * expf_constants::log2e;
  return out;
}

// R query rows of scores s (float, unscaled; row stride Kp, a multiple of 32; the first row is query
// `query`): exp(alpha s + mask) over each row's maximum, with the causal mask, as base-2 exponentials
// (alpha log2(e) s + mask2, mask2 from key_mask_log2 or null), their float sums and their bf16 rounding
// into p (row stride Kp; zero from the key count on, to Kp); inv[r] = 1 / row r's sum (0 when every
// score is -inf). Without a mask and with alpha > 0 the first pass only finds max(s) (max(alpha s) =
// alpha max(s)) and the second scales as it goes. The rows go through each pass together: one row's
// maximum and sum are chains of dependent instructions, R of them overlap.
template <int R>
static inline void bf16_probabilities(float* s, bf16_t* __restrict__ p, int64_t K, int64_t Kp, float alpha,
                                      const float* mask2, bool causal, int64_t query, float* inv) {
  int64_t live[R];  // keys each row attends: those past its query are -inf under a causal mask
  int64_t most = 0;
  for (int r = 0; r < R; ++r) most = std::max(most, live[r] = causal ? std::min<int64_t>(K, query + r + 1) : K);
  const float c = alpha * expf_constants::log2e;
  const bool raw_max = mask2 == nullptr && c > 0;
  const __m512 scale = _mm512_set1_ps(c);
  __m512 top[R], acc[R];
  for (int r = 0; r < R; ++r) top[r] = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < most; i += 16) {
    const __m512 m = mask2 ? _mm512_maskz_loadu_ps(first_lanes(most - i), mask2 + i) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __mmask16 tail = first_lanes(live[r] - i);
      __m512 t = _mm512_maskz_loadu_ps(tail, s + r * Kp + i);
      if (!raw_max) {
        t = mask2 ? _mm512_fmadd_ps(t, scale, m) : _mm512_mul_ps(t, scale);
        _mm512_mask_storeu_ps(s + r * Kp + i, tail, t);
      }
      top[r] = _mm512_mask_max_ps(top[r], tail, top[r], t);
    }
  }
  for (int r = 0; r < R; ++r) {
    float t = _mm512_reduce_max_ps(top[r]);
    if (raw_max) t *= c;
    top[r] = _mm512_set1_ps(t == -INFINITY ? 0.0f : t);
    acc[r] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < Kp; i += 32) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m512 e[2];
      for (int half = 0; half < 2; ++half) {
        const __m512 x = _mm512_loadu_ps(s + r * Kp + i + 16 * half);  // lanes past `live` give 0
        const __m512 y = raw_max ? _mm512_fmsub_ps(x, scale, top[r]) : _mm512_sub_ps(x, top[r]);
        e[half] = exp2_lanes_bf16(y, first_lanes(live[r] - i - 16 * half));
        acc[r] = _mm512_add_ps(acc[r], e[half]);
      }
      _mm512_storeu_si512(p + r * Kp + i, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
    }
  }
  for (int r = 0; r < R; ++r) {
    const float sum = _mm512_reduce_add_ps(acc[r]);
    inv[r] = sum == 0 ? 0.0f : 1.0f / sum;
  }
}

// bf16_probabilities over the `rows` rows of a block, 8 at a time (the registers hold 8 rows' maxima
// and sums besides the exponential's temporaries).
template <int R = 8>
static inline void bf16_block_probabilities(int64_t rows, float* s, bf16_t* __restrict__ p, int64_t K, int64_t Kp,
                                            float alpha, const float* mask2, bool causal, int64_t query, float* inv) {
  if constexpr (R > 0) {
    for (; rows >= R; rows -= R, s += R * Kp, p += R * Kp, query += R, inv += R)
      bf16_probabilities<R>(s, p, K, Kp, alpha, mask2, causal, query, inv);
    bf16_block_probabilities<R - 1>(rows, s, p, K, Kp, alpha, mask2, causal, query, inv);
  }
}

// The context rows of a block, each scaled by its 1 / sum and rounded once: y[r, p] = bf16(o[r, p] inv[r])
// for r < rows, p < P (o row stride ldo, at least P rounded up to 32; y row stride ldy), 32 columns per
// VCVTNE2PS2BF16 (round to nearest even, as float_to_bf16).
static inline void store_scaled_rows(int64_t rows, int64_t P, const float* o, int64_t ldo, const float* inv,
                                     bf16_t* y, int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = o + r * ldo;
    bf16_t* out = y + r * ldy;
    const __m512 scale = _mm512_set1_ps(inv[r]);
    for (int64_t p = 0; p < P; p += 32) {
      const __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(row + p), scale);
      const __m512 hi = _mm512_mul_ps(_mm512_loadu_ps(row + p + 16), scale);
      const __m512i packed = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
      if (P - p >= 32)
        _mm512_storeu_si512(out + p, packed);
      else
        _mm512_mask_storeu_epi16(out + p, (__mmask32)((1ull << (P - p)) - 1), packed);
    }
  }
}

// The AVX512-BF16 kernel (attention_forward_dp, CPUs without AMX): VDPBF16PS multiplies pairs of bf16
// and adds both products to a float32 lane, so each operand is packed as pairs along its reduction.

// K^T of one head: for each block of 32 keys nb and pair t of P (pairs = ceil(P / 2)), 32 uint32 at
// out + (nb pairs + t) 32, lane i holding (k[32 nb + i, 2t], k[32 nb + i, 2t + 1]): the 32-bit
// transpose of 16 keys x 16 pairs at a time, in registers. Elements >= P are zero; the lanes of keys
// >= K in a last half-block are left as they are (the probabilities never read their scores).
static inline void dp_pack_keys(int64_t K, int64_t P, const bf16_t* k, int64_t ld, int64_t pairs,
                                uint32_t* __restrict__ out) {
  for (int64_t key0 = 0; key0 < K; key0 += 16)
    for (int64_t pb = 0; pb < pairs; pb += 16) {
      const int64_t cols = std::min<int64_t>(32, P - 2 * pb);
      const __mmask32 live = cols >= 32 ? ~0u : (1u << cols) - 1;
      __m512 r[16];
      for (int64_t n = 0; n < 16; ++n)
        r[n] = key0 + n < K ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(live, k + (key0 + n) * ld + 2 * pb))
                            : _mm512_setzero_ps();
      transpose16(r);
      uint32_t* block = out + (key0 / 32) * pairs * 32 + key0 % 32;
      for (int64_t t = pb; t < std::min<int64_t>(pairs, pb + 16); ++t)
        _mm512_storeu_ps(reinterpret_cast<float*>(block + t * 32), r[t - pb]);
    }
}

// V of one head: for each pair of keys t (key_pairs = ceil(K / 2)), `width` (a multiple of 32)
// columns at out + t width 2, column c holding (v[2t, c], v[2t + 1, c]). Keys >= K and columns >= P
// are zero.
static inline void dp_pack_values(int64_t K, int64_t P, const bf16_t* v, int64_t ld, int64_t key_pairs,
                                  int64_t width, bf16_t* __restrict__ out) {
  alignas(64) static const uint16_t interleave[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                      8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i order = _mm512_load_si512(interleave);
  for (int64_t t = 0; t < key_pairs; ++t)
    for (int64_t c0 = 0; c0 < width; c0 += 16) {
      const __mmask16 live = first_lanes(P - c0);
      const int64_t key = 2 * t;
      const __m512i even = _mm512_zextsi256_si512(_mm256_maskz_loadu_epi16(live, v + key * ld + c0));
      const __m512i odd = key + 1 < K ? _mm512_zextsi256_si512(_mm256_maskz_loadu_epi16(live, v + (key + 1) * ld + c0))
                                      : _mm512_setzero_si512();
      _mm512_storeu_si512(out + (t * width + c0) * 2, _mm512_permutex2var_epi16(even, order, odd));
    }
}

// C[R x 32] (float32, row stride ldc) = sum over t < pairs of A[r, pair t] B_t: A bf16 rows (row stride
// lda elements, pair t at 2t), B_t the 32 packed uint32 at b + t b_step. R x 2 accumulators in registers:
// one broadcast and two VDPBF16PS per row and pair.
template <int R>
static inline void dp_rows(int64_t pairs, const bf16_t* a, int64_t lda, const uint32_t* b, int64_t b_step,
                           float* c, int64_t ldc) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t t = 0; t < pairs; ++t) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + t * b_step);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + t * b_step + 16);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, a + r * lda + 2 * t, sizeof pair);
      const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, b1);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(c + r * ldc, acc[r][0]);
    _mm512_storeu_ps(c + r * ldc + 16, acc[r][1]);
  }
}

// Queries per register block of dp_rows (2 R + 3 of the 32 zmm registers).
constexpr int DP_ROWS = 8;

static inline void dp_block(int rows, int64_t pairs, const bf16_t* a, int64_t lda, const uint32_t* b,
                            int64_t b_step, float* c, int64_t ldc) {
  switch (rows) {
    case 8: return dp_rows<8>(pairs, a, lda, b, b_step, c, ldc);
    case 7: return dp_rows<7>(pairs, a, lda, b, b_step, c, ldc);
    case 6: return dp_rows<6>(pairs, a, lda, b, b_step, c, ldc);
    case 5: return dp_rows<5>(pairs, a, lda, b, b_step, c, ldc);
    case 4: return dp_rows<4>(pairs, a, lda, b, b_step, c, ldc);
    case 3: return dp_rows<3>(pairs, a, lda, b, b_step, c, ldc);
    case 2: return dp_rows<2>(pairs, a, lda, b, b_step, c, ldc);
    default: return dp_rows<1>(pairs, a, lda, b, b_step, c, ldc);
  }
}

// The bf16 attention on AVX512-BF16 dot products; arguments and semantics as attention_forward_amx's
// (float32 scores and softmax, bf16 exponentials, float32 context, y rounded once). Per (b, h): K^T and
// V packed as pairs, then blocks of DP_ROWS queries: their scores against every key, the probabilities,
// the context, scaled by 1 / sum and rounded into y.
static inline void attention_forward_dp(int64_t B, int64_t H, int64_t J, int64_t K, int64_t P, float alpha,
                                        const bf16_t* q, const int64_t* q_s, const bf16_t* k, const int64_t* k_s,
                                        const bf16_t* v, const int64_t* v_s, const bf16_t* mask, int64_t mask_b,
                                        bool causal, bf16_t* y, const int64_t* y_s) {
  const int64_t Kp = (K + 31) / 32 * 32, pairs = (P + 1) / 2, key_pairs = (K + 1) / 2, width = (P + 31) / 32 * 32;
#pragma omp parallel if (B * H * J * K * P >= kParallelMinElements)  // multiply-adds of the scores
  {
    std::vector<uint32_t> kt((size_t)(Kp * pairs));
    std::vector<bf16_t> vt((size_t)(key_pairs * width * 2)), pr((size_t)(DP_ROWS * Kp)),
        qr((size_t)(DP_ROWS * 2 * pairs), bf16_t(0));
    std::vector<float> s((size_t)(DP_ROWS * Kp)), o((size_t)(DP_ROWS * width)), mask2(mask ? (size_t)K : 0);
    float inv[DP_ROWS];
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h) {
        const NextHead<bf16_t> next(b, h, B, H, J, K, P, q, q_s, k, k_s, v, v_s);
        dp_pack_keys(K, P, k + b * k_s[0] + h * k_s[2], k_s[1], pairs, kt.data());
        dp_pack_values(K, P, v + b * v_s[0] + h * v_s[2], v_s[1], key_pairs, width, vt.data());
        const float* mb = mask ? key_mask_log2(mask + b * mask_b, K, mask2.data()) : nullptr;
        for (int64_t j0 = 0; j0 < J; j0 += DP_ROWS) {
          const int nj = (int)std::min<int64_t>(DP_ROWS, J - j0);
          next.fetch(j0 / DP_ROWS, (J + DP_ROWS - 1) / DP_ROWS);
          const bf16_t* qb = q + b * q_s[0] + j0 * q_s[1] + h * q_s[2];
          int64_t q_ld = q_s[1];
          if (P % 2 != 0) {  // a pair reads one element past the row: give it a zero
            for (int r = 0; r < nj; ++r) std::memcpy(qr.data() + r * 2 * pairs, qb + r * q_ld, sizeof(bf16_t) * P);
            qb = qr.data(), q_ld = 2 * pairs;
          }
          for (int64_t nb = 0; nb < Kp / 32; ++nb)
            dp_block(nj, pairs, qb, q_ld, kt.data() + nb * pairs * 32, 32, s.data() + nb * 32, Kp);
          bf16_block_probabilities(nj, s.data(), pr.data(), K, Kp, alpha, mb, causal, j0, inv);
          const uint32_t* values = reinterpret_cast<const uint32_t*>(vt.data());
          for (int64_t c0 = 0; c0 < width; c0 += 32)
            dp_block(nj, key_pairs, pr.data(), Kp, values + c0, width, o.data() + c0, width);
          store_scaled_rows(nj, P, o.data(), width, inv, y + b * y_s[0] + j0 * y_s[1] + h * y_s[2], y_s[1]);
        }
      }
  }
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
// Linux gives a process the AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA, kernel 5.16 and later); oneDNN and PyTorch make the same request.
static inline bool amx_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return permitted;
}

// Palette 1 with all eight tiles at 16 rows x 64 bytes (16 x 32 bf16 or 16 x 16 float).
struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// K^T [Pp x Kp] of one head as VNNI tiles: tile (pb, nb) row r holds, for the 16 keys of block nb,
// the pair of elements 2r, 2r + 1 of P block pb (32 elements), so it is the 32-bit transpose of
// 16 keys x 32 bf16, done in registers. Keys >= K and elements >= P are zero.
static inline void amx_pack_keys(int64_t K, int64_t P, const bf16_t* k, int64_t ld, int64_t Kp, int64_t Pp,
                                 uint32_t* __restrict__ tiles) {
  const int64_t blocks = Kp / 16;
  for (int64_t pb = 0; pb < Pp / 32; ++pb)
    for (int64_t nb = 0; nb < blocks; ++nb) {
      const int64_t cols = std::min<int64_t>(32, P - pb * 32);
      const __mmask32 live = cols == 32 ? ~0u : (1u << cols) - 1;
      __m512 r[16];
      for (int64_t n = 0; n < 16; ++n) {
        const int64_t key = nb * 16 + n;
        r[n] = key < K ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(live, k + key * ld + pb * 32))
                       : _mm512_setzero_ps();
      }
      transpose16(r);
      uint32_t* tile = tiles + (pb * blocks + nb) * 256;
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(reinterpret_cast<float*>(tile + i * 16), r[i]);
    }
}

// V [Kp x Pp] of one head as VNNI tiles: tile (kb, cb) row r holds the pairs (v[32 kb + 2r, c],
// v[32 kb + 2r + 1, c]) for the 16 columns c of block cb. Keys >= K and columns >= P are zero.
static inline void amx_pack_values(int64_t K, int64_t P, const bf16_t* v, int64_t ld, int64_t Kp, int64_t Pp,
                                   bf16_t* __restrict__ tiles) {
  alignas(64) static const uint16_t interleave[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                      8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i order = _mm512_load_si512(interleave);
  const int64_t blocks = Pp / 16;
  for (int64_t kb = 0; kb < Kp / 32; ++kb)
    for (int64_t cb = 0; cb < blocks; ++cb) {
      const __mmask16 live = first_lanes(P - cb * 16);
      bf16_t* tile = tiles + (kb * blocks + cb) * 512;
      for (int64_t r = 0; r < 16; ++r) {
        const int64_t key = kb * 32 + 2 * r;
        const __m512i even = key < K ? _mm512_zextsi256_si512(_mm256_maskz_loadu_epi16(live, v + key * ld + cb * 16))
                                     : _mm512_setzero_si512();
        const __m512i odd = key + 1 < K
            ? _mm512_zextsi256_si512(_mm256_maskz_loadu_epi16(live, v + (key + 1) * ld + cb * 16))
            : _mm512_setzero_si512();
        _mm512_storeu_si512(tile + r * 32, _mm512_permutex2var_epi16(even, order, odd));
      }
    }
}

// C[16 x 32] (float32, row stride ldc bytes) = sum over `steps` of A_s B_s: A_s the 16 x 32 bf16 at
// a + 64 s (row stride lda bytes), B_s the VNNI tile pair at b + s b_step and b + s b_step + 1024 (one
// tile for C's first 16 columns, one for the next), in accumulator tiles 0 and 1.
static inline void amx_block_times_tile_pair(int64_t steps, const char* a, int64_t lda, const char* b,
                                             int64_t b_step, float* c, int64_t ldc) {
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t i = 0; i < steps; ++i) {
    _tile_loadd(4, a + i * 64, lda);
    _tile_loadd(5, b + i * b_step, 64);
    _tile_loadd(6, b + i * b_step + 1024, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 6);
  }
  _tile_stored(0, c, ldc);
  _tile_stored(1, c + 16, ldc);
}

// The bf16 attention on AMX; arguments as attention_forward's (no biases: bf16 builds add them in the
// QKV GEMM's epilogue). Per (b, h): K^T and V packed as tiles, then blocks of 16 queries: scores in
// two float32 accumulator tiles at a time, the probabilities of the block in bf16, the context in two
// accumulator tiles at a time, scaled by 1 / sum and rounded into y. Only where amx_permitted()
// (attention_forward_bf16 asks).
static inline void attention_forward_amx(int64_t B, int64_t H, int64_t J, int64_t K, int64_t P, float alpha,
                                        const bf16_t* q, const int64_t* q_s, const bf16_t* k, const int64_t* k_s,
                                        const bf16_t* v, const int64_t* v_s, const bf16_t* mask, int64_t mask_b,
                                        bool causal, bf16_t* y, const int64_t* y_s) {
  const int64_t Kp = (K + 31) / 32 * 32, Pp = (P + 31) / 32 * 32, key_blocks = Kp / 16, col_blocks = Pp / 16;
#pragma omp parallel if (B * H * J * K * P >= kParallelMinElements)  // multiply-adds of the scores
  {
    const AmxConfig config;
    _tile_loadconfig(&config);
    std::vector<uint32_t> kt((size_t)(Kp * Pp / 2));
    std::vector<bf16_t> vt((size_t)(Kp * Pp)), pr((size_t)(16 * Kp)), qr((size_t)(16 * Pp));
    std::vector<float> s((size_t)(16 * Kp)), o((size_t)(16 * Pp)), mask2(mask ? (size_t)K : 0);
    float inv[16];
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h) {
        const NextHead<bf16_t> next(b, h, B, H, J, K, P, q, q_s, k, k_s, v, v_s);
        amx_pack_keys(K, P, k + b * k_s[0] + h * k_s[2], k_s[1], Kp, Pp, kt.data());
        amx_pack_values(K, P, v + b * v_s[0] + h * v_s[2], v_s[1], Kp, Pp, vt.data());
        const float* mb = mask ? key_mask_log2(mask + b * mask_b, K, mask2.data()) : nullptr;
        for (int64_t j0 = 0; j0 < J; j0 += 16) {
          const int64_t nj = std::min<int64_t>(16, J - j0);
          next.fetch(j0 / 16, (J + 15) / 16);
          const bf16_t* qb = q + b * q_s[0] + j0 * q_s[1] + h * q_s[2];
          int64_t q_ld = q_s[1];
          if (nj < 16 || P < Pp) {  // a tile reads 16 whole rows of 32 bf16 per P block
            std::fill(qr.begin(), qr.end(), bf16_t(0));
            for (int64_t r = 0; r < nj; ++r) std::memcpy(qr.data() + r * Pp, qb + r * q_ld, sizeof(bf16_t) * P);
            qb = qr.data(), q_ld = Pp;
          }
          const char* keys = reinterpret_cast<const char*>(kt.data());
          for (int64_t nb = 0; nb < key_blocks; nb += 2)
            amx_block_times_tile_pair(Pp / 32, reinterpret_cast<const char*>(qb), q_ld * sizeof(bf16_t),
                                      keys + nb * 1024, key_blocks * 1024, s.data() + nb * 16, Kp * sizeof(float));
          bf16_block_probabilities(nj, s.data(), pr.data(), K, Kp, alpha, mb, causal, j0, inv);
          const char* values = reinterpret_cast<const char*>(vt.data());
          for (int64_t cb = 0; cb < col_blocks; cb += 2)
            amx_block_times_tile_pair(Kp / 32, reinterpret_cast<const char*>(pr.data()), Kp * sizeof(bf16_t),
                                      values + cb * 1024, col_blocks * 1024, o.data() + cb * 16, Pp * sizeof(float));
          store_scaled_rows(nj, P, o.data(), Pp, inv, y + b * y_s[0] + j0 * y_s[1] + h * y_s[2], y_s[1]);
        }
      }
    _tile_release();
  }
}
#endif

#if defined(__AVX512BF16__)
// The bf16 attention of bfloat16 inference builds: on AMX where this build has it and Linux grants the
// process the tile state, else on AVX512-BF16 dot products.
static inline void attention_forward_bf16(int64_t B, int64_t H, int64_t J, int64_t K, int64_t P, float alpha,
                                          const bf16_t* q, const int64_t* q_s, const bf16_t* k, const int64_t* k_s,
                                          const bf16_t* v, const int64_t* v_s, const bf16_t* mask, int64_t mask_b,
                                          bool causal, bf16_t* y, const int64_t* y_s) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (amx_permitted()) return attention_forward_amx(B, H, J, K, P, alpha, q, q_s, k, k_s, v, v_s, mask, mask_b, causal, y, y_s);
#endif
  attention_forward_dp(B, H, J, K, P, alpha, q, q_s, k, k_s, v, v_s, mask, mask_b, causal, y, y_s);
}
#endif

}  // namespace ss
