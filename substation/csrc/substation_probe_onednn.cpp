// The oneDNN matmul rate (substation.perf.probes.gemm_rate, fp32_gemm_library): the same call the
// generated code makes (ss::matmul), on its OpenMP threads.
#include "substation_dnnl.h"

namespace {
template <typename T>
double fastest_matmul(int64_t m, int64_t n, int64_t k, int32_t repeats, T one_third, T two_thirds) {
  std::vector<T> a((size_t)(m * k), one_third), b((size_t)(k * n), two_thirds), c((size_t)(m * n));
  double best = 1e300;
  for (int32_t r = 0; r < repeats + 1; ++r) {
    const double t0 = omp_get_wtime();
    if (ss::matmul<T>(false, false, m, n, k, 1.0f, a.data(), k, b.data(), n, c.data(), n, false, ss::GemmBatch{}) != 0)
      return -1.0;
    if (r > 0) best = std::min(best, omp_get_wtime() - t0);
  }
  return best;
}
}  // namespace

// Seconds of the fastest of `repeats` row-major C[m x n] = A[m x k] B[k x n] calls, in and out float32
// (f32 != 0) or bf16; one untimed call (which creates the primitive) comes first. Negative: oneDNN
// refused the call.
extern "C" double substation_probe_matmul_seconds(int64_t m, int64_t n, int64_t k, int32_t repeats, int32_t f32) {
  if (f32) return fastest_matmul<float>(m, n, k, repeats, 1.0f / 3, 2.0f / 3);
  return fastest_matmul<ss::bf16_t>(m, n, k, repeats, ss::float_to_bf16(1.0f / 3), ss::float_to_bf16(2.0f / 3));
}
