// oneDNN GEMM rates for the bench's limit (substation.perf.probes.gemm_rate): the same oneDNN matmul the
// generated code calls (ss::matmul), on its OpenMP threads: bf16 for bfloat16 builds, float for float32
// builds compiled with fp32_gemm "onednn".
#include "substation_dnnl.h"

namespace {

// Seconds of the fastest of `repeats` row-major C[m x n] = A[m x k] W[n x k]^T calls of element type T
// in and out (W stored as a PyTorch Linear weight); packed: W read from its packed copy, as inference
// builds read their weights (b_parameter: each call digests W and finds the copy made by the first);
// epilogue 1: a bias [n] added in the call's epilogue, 2: the bias and GELU (as linear1 calls it).
// One untimed call (which creates the primitive and the copy) comes first. Negative: oneDNN refused the call.
template <typename T>
double matmul_seconds(int64_t m, int64_t n, int64_t k, int32_t repeats, int32_t packed, int32_t epilogue, T a_value,
                      T b_value) {
  std::vector<T> a((size_t)(m * k), a_value), b((size_t)(k * n), b_value), c((size_t)(m * n)), bias((size_t)n, b_value);
  const ss::GemmBias with_bias = epilogue ? ss::GemmBias{bias.data(), 0, 1, {0}} : ss::GemmBias{};
  const ss::GemmActivation activation = epilogue == 2 ? ss::GemmActivation::gelu : ss::GemmActivation::none;
  double best = 1e300;
  for (int32_t r = 0; r < repeats + 1; ++r) {
    const double t0 = omp_get_wtime();
    if (ss::matmul<T>(false, true, m, n, k, 1.0f, a.data(), k, b.data(), k, c.data(), n, false, ss::GemmBatch{},
                      with_bias, activation, packed != 0) != 0)
      return -1.0;
    if (r > 0) best = std::min(best, omp_get_wtime() - t0);
  }
  return best;
}

}  // namespace

extern "C" double substation_probe_matmul_bf16_seconds(int64_t m, int64_t n, int64_t k, int32_t repeats,
                                                       int32_t packed, int32_t epilogue) {
  return matmul_seconds<ss::bf16_t>(m, n, k, repeats, packed, epilogue, ss::float_to_bf16(1.0f / 3),
                                    ss::float_to_bf16(2.0f / 3));
}

extern "C" double substation_probe_matmul_f32_seconds(int64_t m, int64_t n, int64_t k, int32_t repeats,
                                                      int32_t packed, int32_t epilogue) {
  return matmul_seconds<float>(m, n, k, repeats, packed, epilogue, 1.0f / 3, 2.0f / 3);
}
