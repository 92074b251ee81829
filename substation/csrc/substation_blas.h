// The token-wise GEMMs of float32 and float64 CPU builds: MKL's ?gemm, with the threads split by
// columns at few rows; and the epilogue (bias, activation) of a float32 product, as one pass after an
// MKL call (oneDNN applies it as post-ops: substation_dnnl.h).
//
// Below kSplitRows rows of C, MKL's own threading leaves much of the cores' time unused: MiniLM's four
// weight GEMMs of six layers, 2 threads, AMD Zen 4, one process, took 6.3-6.8 ms at 24 rows as single
// MKL calls and 5.1-5.5 ms with the columns of C split into blocks, each one single-threaded MKL call
// (64 rows: 14.1 -> 10.9 ms, 128: 17.8 -> 16.0, 256: 37.1 -> 32.7; 1024 and 2048 rows: MKL's own
// threading as fast or faster). Each element of C is still one MKL kernel's sum over k.
#pragma once
#include <mkl_cblas.h>
#include <mkl_service.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "substation_cpu.h"

namespace ss {

constexpr int64_t kSplitRows = 256;

// One MKL ?gemm call with MKL's own threads (one thread inside a parallel region), row-major, beta 0.
inline void blas_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                      int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, m, n, k, alpha,
              a, lda, b, ldb, 0.0f, c, ldc);
}

inline void blas_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
                      int64_t lda, const double* b, int64_t ldb, double* c, int64_t ldc) {
  cblas_dgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, m, n, k, alpha,
              a, lda, b, ldb, 0.0, c, ldc);
}

// C[m x n] = alpha op(A)[m x k] op(B)[k x n], row-major with leading dimensions as cblas_?gemm's, beta
// 0. Below kSplitRows rows (outside a parallel region, with two threads or more) the columns of C go
// in blocks of a multiple of 16 columns, two per thread, each a single-threaded MKL call.
template <typename T>
inline void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
                 const T* b, int64_t ldb, T* c, int64_t ldc) {
  const int threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  const int64_t blocks = std::min<int64_t>(2 * threads, n / 32);
  if (m >= kSplitRows || threads < 2 || blocks < 2) {
    blas_gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, c, ldc);
    return;
  }
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < blocks; ++i) {
    const int64_t n0 = i == 0 ? 0 : n * i / blocks / 16 * 16;
    const int64_t n1 = i + 1 == blocks ? n : n * (i + 1) / blocks / 16 * 16;
    const int previous = mkl_set_num_threads_local(1);
    blas_gemm(trans_a, trans_b, m, n1 - n0, k, alpha, a, lda, trans_b ? b + n0 * ldb : b + n0, ldb, c + n0, ldc);
    mkl_set_num_threads_local(previous);
  }
}

// A bias added to the float32 accumulators before the result is stored (the GEMM epilogue): element
// strides along C's rows (m), columns (n) and each batch letter; 0 broadcasts it along that one.
struct GemmBias {
  const void* data = nullptr;  // of the operands' element type
  int64_t m = 0, n = 0, batch[3] = {0, 0, 0};
};

// A function applied to the float32 accumulators after the bias, before rounding (oneDNN's eltwise
// post-ops eltwise_gelu_erf, eltwise_gelu_tanh, eltwise_relu): the activation epilogue.
enum class GemmActivation : int { none = 0, gelu = 1, gelu_tanh = 2, relu = 3 };

// The epilogue of a float32 product computed without one (MKL): C[m, n] = activation(C + bias).
inline void float_epilogue(int64_t m, int64_t n, float* c, int64_t ldc, const GemmBias& bias, GemmActivation activation) {
  const float* b = static_cast<const float*>(bias.data);
#pragma omp parallel for if (m * n >= kParallelMinElements)
  for (int64_t i = 0; i < m; ++i) {
    float* row = c + i * ldc;
    if (b) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) row[j] += b[i * bias.m + j * bias.n];
    }
    switch (activation) {
      case GemmActivation::gelu:
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) row[j] = gelu(row[j]);
        break;
      case GemmActivation::gelu_tanh:
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) row[j] = gelu_tanh(row[j]);
        break;
      case GemmActivation::relu:
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) row[j] = std::max(row[j], 0.0f);
        break;
      case GemmActivation::none:
        break;
    }
  }
}

}  // namespace ss
