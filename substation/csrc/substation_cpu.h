// Runtime helpers for Substation's generated CPU code: counter-based dropout, activations.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <algorithm>
#include <omp.h>

namespace ss {

// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011):
// a counter-based generator, so forward and backward regenerate the same dropout mask from
// (seed, stream, element index) without storing it.
static inline uint32_t mulhilo(uint32_t a, uint32_t b, uint32_t* hi) {
  const uint64_t p = (uint64_t)a * (uint64_t)b;
  *hi = (uint32_t)(p >> 32);
  return (uint32_t)p;
}

static inline uint32_t philox_first(uint64_t counter, uint32_t stream, uint64_t seed) {
  uint32_t c0 = (uint32_t)counter, c1 = (uint32_t)(counter >> 32), c2 = stream, c3 = 0;
  uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
  for (int r = 0; r < 10; ++r) {
    uint32_t hi0, hi1;
    const uint32_t lo0 = mulhilo(0xD2511F53u, c0, &hi0);
    const uint32_t lo1 = mulhilo(0xCD9E8D57u, c2, &hi1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
    k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
  }
  return c0;
}

// True when element `index` of dropout stream `stream` is kept; P(keep) = 1 - threshold / 2^32.
static inline bool keep(uint64_t seed, uint32_t stream, uint64_t index, uint32_t threshold) {
  return philox_first(index, stream, seed) >= threshold;
}

template <typename T> static inline T gelu(T x) { return T(0.5) * x * (T(1) + std::erf(x * T(0.70710678118654752440))); }
template <typename T> static inline T gelu_grad(T x) {
  const T cdf = T(0.5) * (T(1) + std::erf(x * T(0.70710678118654752440)));
  const T pdf = std::exp(T(-0.5) * x * x) * T(0.39894228040143267794);
  return cdf + x * pdf;
}
template <typename T> static inline T gelu_tanh(T x) {
  const T c = T(0.79788456080286535588);  // sqrt(2 / pi)
  return T(0.5) * x * (T(1) + std::tanh(c * (x + T(0.044715) * x * x * x)));
}
template <typename T> static inline T gelu_tanh_grad(T x) {
  const T c = T(0.79788456080286535588);
  const T t = std::tanh(c * (x + T(0.044715) * x * x * x));
  return T(0.5) * (T(1) + t) + T(0.5) * x * (T(1) - t * t) * c * (T(1) + T(3) * T(0.044715) * x * x);
}
template <typename T> static inline T relu(T x) { return x > T(0) ? x : T(0); }
template <typename T> static inline T relu_grad(T x) { return x > T(0) ? T(1) : T(0); }

static inline int64_t align_up(int64_t bytes) { return (bytes + 63) / 64 * 64; }

}  // namespace ss
