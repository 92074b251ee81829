// Machine probes for the bench's limit (substation.analysis.gemm_rate, fma_peak): the BLAS's GEMM
// rate and the FMA peak of the cores, both on the OpenMP threads the generated code uses.
#include <mkl_cblas.h>
#include <omp.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <vector>

// Seconds of the fastest of `repeats` row-major C[m x n] = A[m x k] B[k x n] calls (float or
// double, all threads); one untimed call comes first.
extern "C" double substation_probe_gemm_seconds(int64_t m, int64_t n, int64_t k, int32_t repeats,
                                                int32_t use_double) {
  double best = 1e300;
  auto run = [&](auto zero) {
    using T = decltype(zero);
    std::vector<T> a((size_t)(m * k), T(1) / T(3)), b((size_t)(k * n), T(2) / T(3)), c((size_t)(m * n), T(0));
    for (int32_t r = 0; r < repeats + 1; ++r) {
      const double t0 = omp_get_wtime();
      if constexpr (sizeof(T) == 8)
        cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, k, 1.0, a.data(), k, b.data(), n, 0.0, c.data(), n);
      else
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, c.data(), n);
      if (r > 0) best = std::min(best, omp_get_wtime() - t0);
    }
  };
  if (use_double) run(0.0); else run(0.0f);
  return best;
}

// Flop per second of fused multiply-adds on every thread: 12 independent chains per thread hide
// the FMA latency; widest vectors the build targets (AVX-512, else AVX2+FMA, else scalar).
// Returns the flop rate (2 per FMA lane); `use_double` selects 64-bit lanes.
extern "C" double substation_probe_fma_flops(int64_t iterations, int32_t use_double) {
  double flop_per_thread = 0, threads = 1;
  float sink = 0;
  const double t0 = omp_get_wtime();
  #pragma omp parallel reduction(+:sink)
  {
#if defined(__AVX512F__)
    using V = __m512;
    using VD = __m512d;
    const int lanes = use_double ? 8 : 16;
#define SS_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define SS_FMAD(a, b, c) _mm512_fmadd_pd(a, b, c)
#define SS_SET(x) _mm512_set1_ps(x)
#define SS_SETD(x) _mm512_set1_pd(x)
#define SS_SUM(v) _mm512_reduce_add_ps(v)
#define SS_SUMD(v) (float)_mm512_reduce_add_pd(v)
#elif defined(__AVX2__) && defined(__FMA__)
    using V = __m256;
    using VD = __m256d;
    const int lanes = use_double ? 4 : 8;
#define SS_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define SS_FMAD(a, b, c) _mm256_fmadd_pd(a, b, c)
#define SS_SET(x) _mm256_set1_ps(x)
#define SS_SETD(x) _mm256_set1_pd(x)
#define SS_SUM(v) (v[0] + v[7])
#define SS_SUMD(v) (float)(v[0] + v[3])
#else
    using V = float;
    using VD = double;
    const int lanes = 1;
#define SS_FMA(a, b, c) ((a) * (b) + (c))
#define SS_FMAD(a, b, c) ((a) * (b) + (c))
#define SS_SET(x) (x)
#define SS_SETD(x) (x)
#define SS_SUM(v) (v)
#define SS_SUMD(v) (float)(v)
#endif
    if (use_double) {
      VD acc[12];
      for (int k = 0; k < 12; ++k) acc[k] = SS_SETD(1.0 + 1e-3 * k);
      const VD m = SS_SETD(0.999999), d = SS_SETD(1e-7);
      for (int64_t i = 0; i < iterations; ++i) {
#pragma GCC unroll 12
        for (int k = 0; k < 12; ++k) acc[k] = SS_FMAD(acc[k], m, d);
      }
      for (int k = 0; k < 12; ++k) sink += SS_SUMD(acc[k]);
    } else {
      V acc[12];
      for (int k = 0; k < 12; ++k) acc[k] = SS_SET(1.0f + 1e-3f * k);
      const V m = SS_SET(0.999999f), d = SS_SET(1e-7f);
      for (int64_t i = 0; i < iterations; ++i) {
#pragma GCC unroll 12
        for (int k = 0; k < 12; ++k) acc[k] = SS_FMA(acc[k], m, d);
      }
      for (int k = 0; k < 12; ++k) sink += SS_SUM(acc[k]);
    }
    #pragma omp single
    {
      flop_per_thread = 2.0 * 12.0 * lanes * (double)iterations;
      threads = omp_get_num_threads();
    }
  }
  const double elapsed = omp_get_wtime() - t0;
  return sink == -1.0f ? 0.0 : flop_per_thread * threads / elapsed;  // sink keeps the chains alive
}
