// The bf16 GEMM rate for the bench's limit of bfloat16 builds (substation.perf.probes.gemm_rate): the
// same oneDNN matmul the generated code calls (ss::matmul), on its OpenMP threads.
#include "substation_dnnl.h"

// Seconds of the fastest of `repeats` row-major C[m x n] = A[m x k] B[k x n] calls, bf16 in and out;
// one untimed call (which creates the primitive) comes first. Negative: oneDNN refused the call.
extern "C" double substation_probe_matmul_bf16_seconds(int64_t m, int64_t n, int64_t k, int32_t repeats) {
  std::vector<ss::bf16_t> a((size_t)(m * k), ss::float_to_bf16(1.0f / 3)), b((size_t)(k * n), ss::float_to_bf16(2.0f / 3));
  std::vector<ss::bf16_t> c((size_t)(m * n));
  double best = 1e300;
  for (int32_t r = 0; r < repeats + 1; ++r) {
    const double t0 = omp_get_wtime();
    if (ss::matmul<ss::bf16_t>(false, false, m, n, k, 1.0f, a.data(), k, b.data(), n, c.data(), n, false, ss::GemmBatch{}) != 0)
      return -1.0;
    if (r > 0) best = std::min(best, omp_get_wtime() - t0);
  }
  return best;
}
