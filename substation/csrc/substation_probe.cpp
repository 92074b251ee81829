// Machine probes for the bench's limit (substation.perf.probes.gemm_rate, fma_peak) and the float32 GEMM
// choice (substation.perf.gemm_choice): the BLAS's GEMMs, with the element-wise pass that follows one
// where a layer needs it, and the FMA peak of the cores, all on the OpenMP threads the generated code uses.
#include <mkl_cblas.h>
#include <omp.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <vector>

#include "substation_blas.h"  // ss::float_epilogue, the pass an MKL build runs after a GEMM

// Seconds of the fastest of `repeats` row-major C[m x n] = A[m x k] W[n x k]^T calls (float or
// double, all threads; W stored as a PyTorch Linear weight, as the layers' GEMMs read theirs), each
// followed, for float, by `epilogue` in one pass over C on all threads (ss::float_epilogue: 0 none,
// 1 the bias, 2 the bias and GELU, as an MKL build's bias-GELU kernel BA computes it); one
// untimed call comes first. Negative: an epilogue for double.
extern "C" double substation_probe_gemm_seconds(int64_t m, int64_t n, int64_t k, int32_t repeats,
                                                int32_t use_double, int32_t epilogue) {
  if (use_double && epilogue) return -1.0;
  double best = 1e300;
  auto run = [&](auto zero) {
    using T = decltype(zero);
    std::vector<T> a((size_t)(m * k), T(1) / T(3)), b((size_t)(k * n), T(2) / T(3)), c((size_t)(m * n), T(0));
    std::vector<T> bias(epilogue ? (size_t)n : 0, T(1) / T(7));
    for (int32_t r = 0; r < repeats + 1; ++r) {
      const double t0 = omp_get_wtime();
      if constexpr (sizeof(T) == 8) {
        cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0, a.data(), k, b.data(), k, 0.0, c.data(), n);
      } else {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, a.data(), k, b.data(), k, 0.0f, c.data(), n);
        if (epilogue)
          ss::float_epilogue(m, n, c.data(), n, ss::GemmBias{bias.data(), 0, 1},
                             epilogue == 2 ? ss::GemmActivation::gelu : ss::GemmActivation::none);
      }
      if (r > 0) best = std::min(best, omp_get_wtime() - t0);
    }
  };
  if (use_double) run(0.0); else run(0.0f);
  return best;
}

// The widest vectors the build targets (AVX-512, else AVX2+FMA, else scalar) for the FMA probe.
#if defined(__AVX512F__)
typedef __m512 VecF;
typedef __m512d VecD;
static inline VecF fma(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
static inline VecD fma(VecD a, VecD b, VecD c) { return _mm512_fmadd_pd(a, b, c); }
static inline void splat(VecF& v, double x) { v = _mm512_set1_ps((float)x); }
static inline void splat(VecD& v, double x) { v = _mm512_set1_pd(x); }
static inline double first(VecF v) { return v[0]; }
static inline double first(VecD v) { return v[0]; }
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 VecF;
typedef __m256d VecD;
static inline VecF fma(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
static inline VecD fma(VecD a, VecD b, VecD c) { return _mm256_fmadd_pd(a, b, c); }
static inline void splat(VecF& v, double x) { v = _mm256_set1_ps((float)x); }
static inline void splat(VecD& v, double x) { v = _mm256_set1_pd(x); }
static inline double first(VecF v) { return v[0]; }
static inline double first(VecD v) { return v[0]; }
#else
typedef float VecF;
typedef double VecD;
static inline VecF fma(VecF a, VecF b, VecF c) { return a * b + c; }
static inline VecD fma(VecD a, VecD b, VecD c) { return a * b + c; }
static inline void splat(VecF& v, double x) { v = (float)x; }
static inline void splat(VecD& v, double x) { v = x; }
static inline double first(VecF v) { return v; }
static inline double first(VecD v) { return v; }
#endif

// 12 independent chains of `iterations` FMAs (hiding the FMA latency); returns a value that
// depends on every chain, so none is optimized away.
template <typename V>
static double fma_chains(int64_t iterations) {
  V acc[12], m, d;
  for (int k = 0; k < 12; ++k) splat(acc[k], 1.0 + 1e-3 * k);
  splat(m, 0.999999);
  splat(d, 1e-7);
  for (int64_t i = 0; i < iterations; ++i) {
#pragma GCC unroll 12
    for (int k = 0; k < 12; ++k) acc[k] = fma(acc[k], m, d);
  }
  double sink = 0;
  for (int k = 0; k < 12; ++k) sink += first(acc[k]);
  return sink;
}

// Flop per second of fused multiply-adds on every thread (2 flop per FMA lane); `use_double`
// selects 64-bit lanes.
extern "C" double substation_probe_fma_flops(int64_t iterations, int32_t use_double) {
  const double lanes = use_double ? sizeof(VecD) / sizeof(double) : sizeof(VecF) / sizeof(float);
  double sink = 0, threads = 1;
  const double t0 = omp_get_wtime();
  #pragma omp parallel reduction(+:sink)
  {
    sink += use_double ? fma_chains<VecD>(iterations) : fma_chains<VecF>(iterations);
    #pragma omp single
    threads = omp_get_num_threads();
  }
  const double elapsed = omp_get_wtime() - t0;
  const double flop = 2.0 * 12.0 * lanes * (double)iterations * threads;
  return sink == -1.0 ? 0.0 : flop / elapsed;  // sink keeps the chains alive
}
