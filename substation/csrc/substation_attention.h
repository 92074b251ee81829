// Substation: fused attention for forward-only CPU builds (float and double).
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
#pragma once

#include <mkl_cblas.h>

#include "substation_cpu.h"

namespace ss {

// Score and exponential blocks per thread: 64 KiB together (L2-resident; measured no faster at 32 or 128).
constexpr int64_t ATTENTION_BLOCK_BYTES = 64 * 1024;

template <typename T>
static inline int64_t attention_block_rows(int64_t J, int64_t K) {
  const int64_t rows = ATTENTION_BLOCK_BYTES / (2 * (int64_t)sizeof(T) * std::max<int64_t>(K, 1));
  return std::max<int64_t>(1, std::min<int64_t>(J, std::max<int64_t>(rows, 8)));
}

// One GEMM on the calling thread through BLAS, row-major, beta 0: C = alpha A op(B) (the path without
// AVX-512, and every double build).
static inline void attention_blas(bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                                  int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, m, n, k, alpha, a, lda, b, ldb, 0.0f,
              c, ldc);
}

static inline void attention_blas(bool trans_b, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
                                  int64_t lda, const double* b, int64_t ldb, double* c, int64_t ldc) {
  cblas_dgemm(CblasRowMajor, CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, m, n, k, alpha, a, lda, b, ldb, 0.0,
              c, ldc);
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
#pragma omp parallel
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
            attention_blas(true, nj, K, P, alpha, qb, q_ld, kb, k_ld, s.data(), K);
          for (int64_t r = 0; r < nj; ++r)
            inv[r] = attention_exponentials(s.data() + r * K, e.data() + r * K, K, mb, causal, j0 + r);
#if defined(__AVX512F__)
          if constexpr (packed) {
            gemm_small_packed(false, nj, P, K, 1.0f, e.data(), K, pack_v.data(), yb, y_s[1]);
          } else
#endif
            attention_blas(false, nj, P, K, T(1), e.data(), K, vb, v_ld, yb, y_s[1]);
          for (int64_t r = 0; r < nj; ++r) {
            T* row = yb + r * y_s[1];
#pragma omp simd
            for (int64_t p = 0; p < P; ++p) row[p] *= inv[r];
          }
        }
      }
  }
}

}  // namespace ss
