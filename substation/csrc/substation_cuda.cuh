// Runtime helpers for Substation's generated CUDA code (see substation/codegen_cuda.py).
//
// Everything lives in namespace `sscuda`: type conversions, 16-byte vector loads and stores, the
// same counter-based Philox dropout as substation_cpu.h (identical masks for identical
// (seed, stream, element index)), activations, warp and block reductions, row-kernel launch
// configuration, cuBLAS GEMMs (float32 accumulation) and error reporting.
//
// Built with nvcc this is the real thing. Built with a host C++ compiler and -DSS_EMULATE it becomes
// a sequential emulation used by the tests on machines without a GPU: one thread per block, warps of
// one lane, kernels run in a loop over blocks and cuBLAS is replaced by a plain column-major GEMM with
// cuBLAS's argument conventions. The generated code is the same in both cases, so the emulation
// checks indexing, layouts, vectorization, dtype conversions, dropout masks and the GEMM mapping;
// it cannot check inter-thread synchronization.
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cmath>
#include <climits>
#include <algorithm>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifdef SS_EMULATE
#include <vector>
#define SS_KERNEL(threads) static
#define SS_DEV inline
#define SS_HD inline
#define SS_TARGET "cuda-emulated"
#define SS_UNROLL _Pragma("GCC unroll 16")
#define SS_TID (::sscuda::emu::state().tid)
#define SS_BID (::sscuda::emu::state().bid)
#define SS_BDIM (::sscuda::emu::state().bdim)
#define SS_GDIM (::sscuda::emu::state().gdim)
#define SS_SMEM(type, name) type* name = reinterpret_cast<type*>(::sscuda::emu::state().smem.data())
#define SS_SYNC() ((void)0)
#else
#include <cstdlib>
#include <map>
#include <mutex>
#include <utility>
#include <cuda_runtime.h>
#include <cublas_v2.h>
// A kernel launched with at most `threads` threads per block: the bound is the launcher's block size
// and one resident block, so ptxas may use up to 65536 / threads registers (255 at most). A bound of 512
// for the 128-thread warp-mode blocks, or an occupancy target, makes ptxas cap registers below what
// the row kernels need, and spill.
#define SS_KERNEL(threads) __global__ __launch_bounds__(threads, 1)
#define SS_DEV __device__ __forceinline__
#define SS_HD __host__ __device__ __forceinline__
#define SS_TARGET "cuda"
#define SS_UNROLL _Pragma("unroll")
#define SS_TID threadIdx.x
#define SS_BID blockIdx.x
#define SS_BDIM blockDim.x
#define SS_GDIM gridDim.x
#define SS_SMEM(type, name) \
  extern __shared__ __align__(16) unsigned char ss_smem_raw_[]; \
  type* name = reinterpret_cast<type*>(ss_smem_raw_)
#define SS_SYNC() __syncthreads()
#endif

// Return the error code of a helper call from the enclosing function.
#define SS_CHECK(call) do { const int ss_rc_ = (call); if (ss_rc_) return ss_rc_; } while (0)

namespace sscuda {

#ifdef SS_EMULATE
constexpr int kWarp = 1;        // lanes per warp
constexpr int kWarpRows = 1;    // rows per block in warp mode
constexpr int kMaxBlock = 1;    // threads per block in block mode
constexpr int kColX = 1, kColY = 1;  // column-sum block: columns x slot groups
typedef void* Stream;
namespace emu {
struct State {
  int64_t tid = 0, bid = 0, bdim = 1, gdim = 1;
  std::vector<unsigned char> smem;
  int64_t philox_blocks = 0;  // Philox blocks drawn on this thread (the tests count them)
};
inline State& state() { static thread_local State s; return s; }
}  // namespace emu
#else
constexpr int kWarp = 32;
constexpr int kWarpRows = 4;
constexpr int kMaxBlock = 512;
constexpr int kColX = 32, kColY = 8;
typedef cudaStream_t Stream;
#endif
// Threads per block of a row kernel (warp mode: kWarpRows warps; block mode: at most kMaxBlock)
// and of a column-sum kernel: the launch bounds of the generated kernels.
template <bool WARP> constexpr int row_block_max() { return WARP ? kWarpRows * kWarp : kMaxBlock; }
constexpr int kColBlock = kColX * kColY;
// Bytes of the cuBLAS workspace each call hands to its handle (the size cuBLAS recommends for
// Hopper); none in the emulation, which has no cuBLAS.
#ifdef SS_EMULATE
constexpr int64_t kBlasWorkspace = 0;
#else
constexpr int64_t kBlasWorkspace = (int64_t)32 << 20;
#endif
// Blocks of a kernel that has column reductions: fixed, so that the partial sums (and hence the
// result) do not depend on the GPU model.
constexpr int64_t kColGrid = 512;

// ---- errors ----------------------------------------------------------------------------------
inline char* error_buffer() { static thread_local char buf[512] = {0}; return buf; }
inline const char* last_error() { return error_buffer(); }
inline int fail(int code, const char* what, const char* detail) {
  std::snprintf(error_buffer(), 512, "%s: %s (code %d)", what, detail, code);
  return code;
}
// Codes returned by substation_run: 1xxxxx cuBLAS status, 2xxxxx CUDA error, 3xxxxx Substation.
enum : int { kErrBlas = 100000, kErrCuda = 200000, kErrSubstation = 300000 };

// ---- scalar types ----------------------------------------------------------------------------
SS_HD float to_c(float x, float) { return x; }
SS_HD float to_c(double x, float) { return (float)x; }
SS_HD float to_c(__half x, float) { return __half2float(x); }
SS_HD float to_c(__nv_bfloat16 x, float) { return __bfloat162float(x); }
SS_HD double to_c(double x, double) { return x; }
SS_HD double to_c(float x, double) { return (double)x; }
SS_HD double to_c(__half x, double) { return (double)__half2float(x); }
SS_HD double to_c(__nv_bfloat16 x, double) { return (double)__bfloat162float(x); }
// Load element type X as compute type C.
template <typename C, typename X> SS_HD C cvt(X x) { return to_c(x, C()); }

template <typename X> struct Store;
template <> struct Store<float> {
  SS_HD static float from(float v) { return v; }
  SS_HD static float from(double v) { return (float)v; }
};
template <> struct Store<double> {
  SS_HD static double from(double v) { return v; }
  SS_HD static double from(float v) { return (double)v; }
};
template <> struct Store<__half> {
  SS_HD static __half from(float v) { return __float2half_rn(v); }
  SS_HD static __half from(double v) { return __float2half_rn((float)v); }
};
template <> struct Store<__nv_bfloat16> {
  SS_HD static __nv_bfloat16 from(float v) { return __float2bfloat16_rn(v); }
  SS_HD static __nv_bfloat16 from(double v) { return __float2bfloat16_rn((float)v); }
};
template <typename X, typename C> SS_HD X to_x(C v) { return Store<X>::from(v); }

// ---- vector memory access --------------------------------------------------------------------
// V consecutive elements starting at p (V = 1, or V * sizeof(X) = 16 bytes aligned to 16: the
// launcher checks alignment before it picks a vector instantiation), converted to the compute type.
template <typename X, int V> struct alignas(sizeof(X) * V) Pack { X v[V]; };

template <int V, typename X, typename C> SS_DEV void load(const X* __restrict__ p, C* out) {
  if constexpr (V == 1) {
    out[0] = cvt<C>(p[0]);
  } else {
    Pack<X, V> pk;
#ifdef SS_EMULATE
    std::memcpy(&pk, p, sizeof(pk));
#else
    pk = *reinterpret_cast<const Pack<X, V>*>(p);
#endif
    SS_UNROLL
    for (int l = 0; l < V; ++l) out[l] = cvt<C>(pk.v[l]);
  }
}
// One element broadcast to every lane (an operand that does not vary along the vector).
template <int V, typename X, typename C> SS_DEV void load_bcast(const X* __restrict__ p, C* out) {
  const C v = cvt<C>(p[0]);
  SS_UNROLL
  for (int l = 0; l < V; ++l) out[l] = v;
}
template <int V, typename X, typename C> SS_DEV void store(X* __restrict__ p, const C* in) {
  if constexpr (V == 1) {
    p[0] = to_x<X>(in[0]);
  } else {
    static_assert(sizeof(Pack<X, V>) == 16, "vectors are 16 bytes");
    Pack<X, V> pk;
    SS_UNROLL
    for (int l = 0; l < V; ++l) pk.v[l] = to_x<X>(in[l]);
#ifdef SS_EMULATE
    std::memcpy(p, &pk, sizeof(pk));
#else
    // One st.global.v4 through __stwb: a plain store of the Pack (or of a uint4) may be split into
    // 2- and 4-byte stores (k1_input_bias: 6 st.global.u16 + 1 v2.u16 per vector).
    uint4 w;
    std::memcpy(&w, &pk, sizeof(w));
    __stwb(reinterpret_cast<uint4*>(p), w);
#endif
  }
}
// Whether p is aligned to 16 bytes.
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// ---- counter-based dropout -------------------------------------------------------------------
// Philox4x32-10 exactly as in substation_cpu.h: element e of a dropout stream draws 16 bits, half
// e % 2 of word (e / 2) % 4 of the block at counter e / 8, so the CPU and CUDA builds keep or drop
// the same elements for the same (seed, stream, element index), and one block serves eight elements.
struct Words { uint32_t w[4]; };

SS_HD Words philox(uint64_t counter, uint32_t stream, uint64_t seed) {
#ifdef SS_EMULATE
  ++emu::state().philox_blocks;
#endif
  uint32_t c0 = (uint32_t)counter, c1 = (uint32_t)(counter >> 32), c2 = stream, c3 = 0;
  uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
  SS_UNROLL
  for (int r = 0; r < 10; ++r) {
    const uint64_t p0 = (uint64_t)0xD2511F53u * (uint64_t)c0;
    const uint64_t p1 = (uint64_t)0xCD9E8D57u * (uint64_t)c2;
    const uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
    const uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
    k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
  }
  Words res;
  res.w[0] = c0; res.w[1] = c1; res.w[2] = c2; res.w[3] = c3;
  return res;
}
// The 16 random bits of element `index` (any access pattern).
SS_HD uint32_t random_bits(uint64_t seed, uint32_t stream, uint64_t index) {
  const Words b = philox(index >> 3, stream, seed);
  const uint32_t j = (uint32_t)((index >> 1) & 3);
  const uint32_t w = j == 0 ? b.w[0] : j == 1 ? b.w[1] : j == 2 ? b.w[2] : b.w[3];
  return (index & 1) ? w >> 16 : w & 0xFFFFu;
}
// The bits of elements first .. first + V - 1. With V a multiple of 4 and `first` a multiple of 4
// (the vector instantiations of the row kernels) each Philox block is drawn once: one per 8 elements
// (V = 8, float16/bfloat16), one per 4 (V = 4, float32: the 4 elements use half of its words);
// otherwise one block per element.
template <int V> SS_DEV void random_bits_run(uint64_t seed, uint32_t stream, uint64_t first, uint32_t* out) {
  if constexpr (V % 4 == 0) {
    if ((first & 3) == 0) {
      Words b;
      SS_UNROLL
      for (int g = 0; g < V / 4; ++g) {
        const uint64_t e = first + 4 * (uint64_t)g;
        if (g == 0 || (e & 7) == 0) b = philox(e >> 3, stream, seed);
        const bool upper = (e & 7) != 0;  // elements 4..7 of their block: words 2 and 3
        const uint32_t w0 = upper ? b.w[2] : b.w[0], w1 = upper ? b.w[3] : b.w[1];
        out[4 * g] = w0 & 0xFFFFu;
        out[4 * g + 1] = w0 >> 16;
        out[4 * g + 2] = w1 & 0xFFFFu;
        out[4 * g + 3] = w1 >> 16;
      }
      return;
    }
  }
  SS_UNROLL
  for (int l = 0; l < V; ++l) out[l] = random_bits(seed, stream, first + (uint64_t)l);
}
// Inverted dropout given an element's 16 random bits, as in substation_cpu.h: x * scale when
// bits >= threshold, else 0.
template <typename T> SS_HD T dropout(T x, uint32_t bits, uint32_t threshold, T scale) {
  return bits >= threshold ? x * scale : T(0);
}

// ---- elementary functions (compute type float or double) -------------------------------------
SS_HD float exp_(float x) { return expf(x); }
SS_HD double exp_(double x) { return exp(x); }
SS_HD float erf_(float x) { return erff(x); }
SS_HD double erf_(double x) { return erf(x); }
SS_HD float max_(float a, float b) { return fmaxf(a, b); }
SS_HD double max_(double a, double b) { return fmax(a, b); }
SS_HD float rsqrt_(float x) { return 1.0f / sqrtf(x); }
SS_HD double rsqrt_(double x) { return 1.0 / sqrt(x); }

template <typename T> SS_HD T gelu(T x) { return T(0.5) * x * (T(1) + erf_(x * T(0.70710678118654752440))); }
template <typename T> SS_HD T gelu_grad(T x) {
  const T cdf = T(0.5) * (T(1) + erf_(x * T(0.70710678118654752440)));
  const T pdf = exp_(T(-0.5) * x * x) * T(0.39894228040143267794);
  return cdf + x * pdf;
}
// GELU's tanh form as x s, s = e / (e + 1) = (1 + tanh(u)) / 2 with e = exp(2u); the gradient takes
// 1 - s = 1 / (e + 1) directly (1 - tanh(u)^2 loses its digits near |tanh| = 1); as substation_cpu.h.
template <typename T> SS_HD T gelu_tanh_exp(T x) {  // e = exp(2u), c = sqrt(2 / pi)
  const T u = T(0.79788456080286535588) * (x + T(0.044715) * x * x * x), lim = sizeof(T) == 4 ? T(44) : T(350);
  return exp_(T(2) * fmin(fmax(u, -lim), lim));
}
template <typename T> SS_HD T gelu_tanh(T x) {
  const T e = gelu_tanh_exp(x);
  return x * (e / (e + T(1)));
}
template <typename T> SS_HD T gelu_tanh_grad(T x) {
  const T e = gelu_tanh_exp(x), r = T(1) / (e + T(1)), s = e * r;
  return s + T(2) * x * s * r * T(0.79788456080286535588) * (T(1) + T(3) * T(0.044715) * x * x);
}
template <typename T> SS_HD T relu(T x) { return x > T(0) ? x : T(0); }
template <typename T> SS_HD T relu_grad(T x) { return x > T(0) ? T(1) : T(0); }

// ---- row-kernel thread layout -----------------------------------------------------------------
// A row kernel runs rows x inner elements; `nvec` = inner elements / vector width. Short rows
// (nvec <= 2 warps) run in warp mode: `row_lanes(nvec)` lanes per row, the smallest power of two
// holding the row's vectors (at most a warp), so a row of 16 vectors takes half a warp and two rows
// share it; a block of kWarpRows warps holds kWarpRows * kWarp / lanes rows. Longer rows get one
// block each (a multiple of 32 threads, at most kMaxBlock).
SS_HD int row_lanes(int64_t nvec) {
  int lanes = 1;
  while (lanes < kWarp && lanes < nvec) lanes *= 2;
  return lanes;
}
// The threads of one row: `lanes` of them, this thread's `lane` among them, its row `group` in the
// block and the `groups` (rows) per block. Warp-mode groups are aligned runs of lanes in a warp.
struct RowThreads { int lanes, lane, group, groups; };
template <bool WARP> SS_HD RowThreads row_threads(int64_t nvec, int tid, int bdim) {
  if (!WARP) return {bdim, tid, 0, 1};
  const int lanes = row_lanes(nvec);
  return {lanes, tid % lanes, tid / lanes, bdim / lanes};
}
// The lanes of the calling thread's aligned group of `lanes` (a power of two) in its warp, as a
// shuffle mask: the other rows of a warp may have left their loop.
SS_HD unsigned lane_mask(int lanes, int lane_in_warp) {
  return lanes >= kWarp ? 0xffffffffu : ((1u << lanes) - 1u) << (lane_in_warp & ~(lanes - 1));
}
// Shared-memory row buffers are lane-interleaved, so that a warp's accesses fall in distinct banks:
// element l of a thread's vector nv sits at first * V + l * n + lane, where first = nv - lane is the
// round's first vector and n = min(lanes, nvec - first) the lanes the round uses (a bijection onto
// [0, nvec * V)); a thread keeps its own elements across loops, so no barrier is needed.
struct BufPos {
  int64_t base, stride;
  SS_HD int64_t operator()(int l) const { return base + l * stride; }
};
template <int V> SS_HD BufPos buf_pos(int64_t nv, int lane, int lanes, int64_t nvec) {
  const int64_t first = nv - lane, left = nvec - first;  // (std::min is host-only)
  return {first * V + lane, left < lanes ? left : (int64_t)lanes};
}
// Shared elements of one row group: its `elems` buffer elements, padded in warp mode so that the
// groups of one warp start `lanes` banks apart (their accesses then never share a bank).
SS_HD int64_t row_region(int64_t elems, int lanes) {
  if (elems == 0 || lanes >= kWarp) return elems;
  return elems + ((lanes - elems) % kWarp + kWarp) % kWarp;
}

// ---- reductions ------------------------------------------------------------------------------
template <typename T> SS_DEV T shfl_xor(T v, int offset, unsigned mask) {
#ifdef SS_EMULATE
  (void)offset; (void)mask;
  return v;
#else
  return __shfl_xor_sync(mask, v, offset);
#endif
}
// Sum (max) over the calling thread's aligned group of `lanes` lanes (a power of two, at most kWarp).
template <typename T> SS_DEV T warp_sum(T v, int lanes) {
  const unsigned mask = lane_mask(lanes, (int)SS_TID % kWarp);
  SS_UNROLL
  for (int o = kWarp / 2; o > 0; o >>= 1)
    if (o < lanes) v += shfl_xor(v, o, mask);
  return v;
}
template <typename T> SS_DEV T warp_max(T v, int lanes) {
  const unsigned mask = lane_mask(lanes, (int)SS_TID % kWarp);
  SS_UNROLL
  for (int o = kWarp / 2; o > 0; o >>= 1)
    if (o < lanes) v = max_(v, shfl_xor(v, o, mask));
  return v;
}
// All-reduce over the threads that share a row: `lanes` lanes of a warp (WARP) or the whole block.
// Every thread of the group must call it (block mode synchronizes the block); `red` is 32 elements
// of shared memory. The leading barrier keeps a previous reduction's readers from seeing `red`
// overwritten.
template <bool WARP, typename T> SS_DEV T group_sum(T v, T* red, int lanes) {
  if (WARP) return warp_sum(v, lanes);
  v = warp_sum(v, kWarp);
  const int lane = (int)SS_TID % kWarp, w = (int)SS_TID / kWarp, nw = ((int)SS_BDIM + kWarp - 1) / kWarp;
  SS_SYNC();
  if (lane == 0) red[w] = v;
  SS_SYNC();
  return warp_sum(lane < nw ? red[lane] : T(0), kWarp);
}
template <bool WARP, typename T> SS_DEV T group_max(T v, T* red, int lanes) {
  if (WARP) return warp_max(v, lanes);
  v = warp_max(v, kWarp);
  const int lane = (int)SS_TID % kWarp, w = (int)SS_TID / kWarp, nw = ((int)SS_BDIM + kWarp - 1) / kWarp;
  SS_SYNC();
  if (lane == 0) red[w] = v;
  SS_SYNC();
  return warp_max(lane < nw ? red[lane] : T(-INFINITY), kWarp);
}

// ---- row-kernel launch configuration ---------------------------------------------------------
// Dynamic shared memory, in elements of the compute type: `red` reduction slots (32 for a kernel
// that reduces rows, else 0) plus, per row in flight, a `row_region` of `slots` row-long arrays
// (buffers of intermediate tensors and column accumulators); an element-wise kernel without buffers
// reserves none.
struct RowCfg {
  int64_t grid;
  int block;
  int lanes;               // threads per row
  int rows_per_block;
  bool warp;
  size_t smem;
  int64_t partial_slots;  // grid * rows_per_block: partial sums per column output
};
inline RowCfg row_cfg(int64_t nrows, int64_t nn, int v, int slots, int red, bool column, size_t csize) {
  RowCfg c;
  const int64_t nvec = nn / v;
  c.warp = nvec <= 2 * kWarp;
  if (c.warp) {
    c.block = row_block_max<true>();
    c.lanes = row_lanes(nvec);
    c.rows_per_block = c.block / c.lanes;
  } else {
    const int64_t b = (nvec + kWarp - 1) / kWarp * kWarp;
    c.block = (int)std::min<int64_t>(b, row_block_max<false>());
    c.lanes = c.block;
    c.rows_per_block = 1;
  }
  const int64_t blocks = std::max<int64_t>(1, (nrows + c.rows_per_block - 1) / c.rows_per_block);
  c.grid = std::min<int64_t>(blocks, column ? kColGrid : (int64_t)INT_MAX);
  c.smem = (size_t)(red + (int64_t)c.rows_per_block * row_region((int64_t)slots * nn, c.lanes)) * csize;
  c.partial_slots = c.grid * c.rows_per_block;
  return c;
}

#ifdef SS_EMULATE
// ---- emulated launch and GEMM ----------------------------------------------------------------
template <typename... KA, typename... A>
inline int launch(const char* name, void (*kern)(KA...), int64_t grid, int block, size_t smem, Stream,
                  A... args) {
  if (block != 1) return fail(kErrSubstation + 1, name, "emulation runs one thread per block");
  emu::State& s = emu::state();
  s.smem.assign(smem, 0xFF);  // NaN bytes: reading shared memory never written shows up
  s.gdim = grid;
  s.bdim = 1;
  s.tid = 0;
  for (int64_t b = 0; b < grid; ++b) {
    s.bid = b;
    kern(args...);
  }
  return 0;
}

// Column-major C[m, n] = alpha * op(A)[m, k] op(B)[k, n] (beta = 0), `batch` times with strides,
// as cublasGemmStridedBatchedEx; accumulates in double.
template <typename X>
inline int gemm_cm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, const X* A, int64_t lda,
                   int64_t sa, const X* B, int64_t ldb, int64_t sb, X* C, int64_t ldc, int64_t sc, int64_t batch,
                   Stream) {
  if (lda < (ta ? k : m) || ldb < (tb ? n : k) || ldc < m)
    return fail(kErrBlas + 7, "gemm", "invalid leading dimension (CUBLAS_STATUS_INVALID_VALUE)");
  for (int64_t q = 0; q < batch; ++q) {
    const X* a = A + q * sa;
    const X* b = B + q * sb;
    X* c = C + q * sc;
    for (int64_t j = 0; j < n; ++j)
      for (int64_t i = 0; i < m; ++i) {
        double acc = 0;
        for (int64_t p = 0; p < k; ++p) {
          const double av = cvt<double>(ta ? a[p + i * lda] : a[i + p * lda]);
          const double bv = cvt<double>(tb ? b[j + p * ldb] : b[p + j * ldb]);
          acc += av * bv;
        }
        c[i + j * ldc] = to_x<X>(cvt<float>(alpha * acc)) ;
      }
  }
  return 0;
}
template <>
inline int gemm_cm<double>(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, const double* A,
                           int64_t lda, int64_t sa, const double* B, int64_t ldb, int64_t sb, double* C, int64_t ldc,
                           int64_t sc, int64_t batch, Stream) {
  if (lda < (ta ? k : m) || ldb < (tb ? n : k) || ldc < m)
    return fail(kErrBlas + 7, "gemm", "invalid leading dimension (CUBLAS_STATUS_INVALID_VALUE)");
  for (int64_t q = 0; q < batch; ++q)
    for (int64_t j = 0; j < n; ++j)
      for (int64_t i = 0; i < m; ++i) {
        double acc = 0;
        for (int64_t p = 0; p < k; ++p)
          acc += (ta ? A[q * sa + p + i * lda] : A[q * sa + i + p * lda]) *
                 (tb ? B[q * sb + j + p * ldb] : B[q * sb + p + j * ldb]);
        C[q * sc + i + j * ldc] = alpha * acc;
      }
  return 0;
}
// As cublasGemmBatchedEx: entry q multiplies the matrices at A[q], B[q] into C[q].
template <typename X>
inline int gemm_cm_ptr(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, const X* const* A,
                       int64_t lda, const X* const* B, int64_t ldb, X* const* C, int64_t ldc, int64_t batch,
                       Stream stream) {
  for (int64_t q = 0; q < batch; ++q)
    SS_CHECK(gemm_cm<X>(ta, tb, m, n, k, alpha, A[q], lda, 0, B[q], ldb, 0, C[q], ldc, 0, 1, stream));
  return 0;
}
inline int begin(Stream, void*) { error_buffer()[0] = 0; return 0; }
inline int finish() { return 0; }

#else
// ---- CUDA launch -----------------------------------------------------------------------------
inline int cuda_fail(cudaError_t e, const char* what) {
  return fail(kErrCuda + (int)e, what, cudaGetErrorString(e));
}

// SUBSTATION_CUDA_DEBUG=1 in the environment (read once per process): every kernel launch and GEMM
// synchronizes its stream and reports a fault as the failure of that kernel or GEMM, by name.
inline bool debug_mode() {
  static const bool on = [] {
    const char* v = std::getenv("SUBSTATION_CUDA_DEBUG");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return on;
}
// In debug mode: wait for `stream` and report an error of the work just queued as `name`'s.
inline int debug_check(const char* name, Stream stream) {
  if (!debug_mode()) return 0;
  const cudaError_t e = cudaStreamSynchronize(stream);
  return e == cudaSuccess ? 0 : cuda_fail(e, name);
}

// The dynamic shared memory a kernel may use on the current device: raised with
// cudaFuncSetAttribute once per kernel, device and larger size, not on every launch.
inline int reserve_smem(const char* name, const void* kern, size_t smem) {
  if (smem <= 48 * 1024) return 0;
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return cuda_fail(e, "cudaGetDevice");
  static std::mutex lock;
  static std::map<std::pair<const void*, int>, size_t> granted;
  std::lock_guard<std::mutex> guard(lock);
  size_t& have = granted[{kern, device}];
  if (smem <= have) return 0;
  e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    char detail[160];
    std::snprintf(detail, sizeof detail, "a row needs %zu B of shared memory, more than this GPU allows per block",
                  smem);
    return fail(kErrSubstation + 2, name, detail);
  }
  have = smem;
  return 0;
}

template <typename... KA, typename... A>
inline int launch(const char* name, void (*kern)(KA...), int64_t grid, int block, size_t smem, Stream stream,
                  A... args) {
  if (grid <= 0) return 0;
  SS_CHECK(reserve_smem(name, (const void*)kern, smem));
  kern<<<dim3((unsigned)std::min<int64_t>(grid, INT_MAX)), dim3((unsigned)block), smem, stream>>>(args...);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return cuda_fail(e, name);
  return debug_check(name, stream);
}

// ---- cuBLAS ----------------------------------------------------------------------------------
inline const char* blas_status_name(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "cuBLAS error";
  }
}
inline int blas_fail(cublasStatus_t s, const char* what) { return fail(kErrBlas + (int)s, what, blas_status_name(s)); }

// One cuBLAS handle per device and host thread, created on first use and kept; bound to the
// caller's stream and given `blas_workspace` (kBlasWorkspace bytes of the call's workspace, on that
// stream) before every call: cublasSetStream resets the handle to cuBLAS's own pool, which is
// shared across streams and allocates during CUDA-graph capture.
inline cublasHandle_t& handle_slot(int device) {
  static thread_local cublasHandle_t handles[256] = {};
  return handles[device & 255];
}
struct Ctx {
  cublasHandle_t handle = nullptr;
  Stream stream = nullptr;
};
inline Ctx& ctx() { static thread_local Ctx c; return c; }

inline int begin(Stream stream, void* blas_workspace) {
  error_buffer()[0] = 0;
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return cuda_fail(e, "cudaGetDevice");
  cublasHandle_t& h = handle_slot(device);
  if (h == nullptr) {
    const cublasStatus_t s = cublasCreate(&h);
    if (s != CUBLAS_STATUS_SUCCESS) { h = nullptr; return blas_fail(s, "cublasCreate"); }
  }
  const cublasStatus_t s = cublasSetStream(h, stream);
  if (s != CUBLAS_STATUS_SUCCESS) return blas_fail(s, "cublasSetStream");
  const cublasStatus_t w = cublasSetWorkspace(h, blas_workspace, (size_t)kBlasWorkspace);
  if (w != CUBLAS_STATUS_SUCCESS) return blas_fail(w, "cublasSetWorkspace");
  ctx().handle = h;
  ctx().stream = stream;
  return 0;
}
inline int finish() {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? 0 : cuda_fail(e, "kernel launch");
}

template <typename X> struct BlasType;
template <> struct BlasType<float> {
  static constexpr cudaDataType_t data = CUDA_R_32F;
  static constexpr cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  typedef float scale;
};
template <> struct BlasType<__half> {
  static constexpr cudaDataType_t data = CUDA_R_16F;
  static constexpr cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  typedef float scale;
};
template <> struct BlasType<__nv_bfloat16> {
  static constexpr cudaDataType_t data = CUDA_R_16BF;
  static constexpr cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  typedef float scale;
};
template <> struct BlasType<double> {
  static constexpr cudaDataType_t data = CUDA_R_64F;
  static constexpr cublasComputeType_t compute = CUBLAS_COMPUTE_64F;
  typedef double scale;
};

// cuBLAS takes int sizes: 0, or the error code (with its message) of a size past 2^31 - 1.
inline int check_gemm_dims(int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc, int64_t batch) {
  if (m > INT_MAX || n > INT_MAX || k > INT_MAX || lda > INT_MAX || ldb > INT_MAX || ldc > INT_MAX || batch > INT_MAX)
    return fail(kErrSubstation + 3, "gemm", "a GEMM dimension exceeds 2^31 - 1");
  return 0;
}

// Column-major GEMM (cuBLAS conventions), beta = 0, float32 accumulation for float32, float16 and
// bfloat16 (float64: double): cublasGemmEx for one matrix, cublasGemmStridedBatchedEx for several.
template <typename X>
inline int gemm_cm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, const X* A, int64_t lda,
                   int64_t sa, const X* B, int64_t ldb, int64_t sb, X* C, int64_t ldc, int64_t sc, int64_t batch,
                   Stream stream) {
  if (m <= 0 || n <= 0 || batch <= 0) return 0;
  if (const int rc = check_gemm_dims(m, n, k, lda, ldb, ldc, batch)) return rc;
  typedef typename BlasType<X>::scale S;
  const S a = (S)alpha, b = (S)0;
  const cublasOperation_t opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasStatus_t s;
  if (batch == 1) {
    s = cublasGemmEx(ctx().handle, opa, opb, (int)m, (int)n, (int)k, &a, A, BlasType<X>::data, (int)lda, B,
                     BlasType<X>::data, (int)ldb, &b, C, BlasType<X>::data, (int)ldc, BlasType<X>::compute,
                     CUBLAS_GEMM_DEFAULT);
  } else {
    s = cublasGemmStridedBatchedEx(ctx().handle, opa, opb, (int)m, (int)n, (int)k, &a, A, BlasType<X>::data,
                                   (int)lda, (long long)sa, B, BlasType<X>::data, (int)ldb, (long long)sb, &b, C,
                                   BlasType<X>::data, (int)ldc, (long long)sc, (int)batch, BlasType<X>::compute,
                                   CUBLAS_GEMM_DEFAULT);
  }
  const char* what = batch == 1 ? "cublasGemmEx" : "cublasGemmStridedBatchedEx";
  if (s != CUBLAS_STATUS_SUCCESS) return blas_fail(s, what);
  return debug_check(what, stream);
}
// cublasGemmBatchedEx: entry q multiplies the matrices at A[q], B[q] into C[q] (device arrays of
// `batch` pointers each).
template <typename X>
inline int gemm_cm_ptr(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, const X* const* A,
                       int64_t lda, const X* const* B, int64_t ldb, X* const* C, int64_t ldc, int64_t batch,
                       Stream stream) {
  if (m <= 0 || n <= 0 || batch <= 0) return 0;
  if (const int rc = check_gemm_dims(m, n, k, lda, ldb, ldc, batch)) return rc;
  typedef typename BlasType<X>::scale S;
  const S a = (S)alpha, b = (S)0;
  const cublasStatus_t s = cublasGemmBatchedEx(
      ctx().handle, ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb ? CUBLAS_OP_T : CUBLAS_OP_N, (int)m, (int)n, (int)k, &a,
      reinterpret_cast<const void* const*>(A), BlasType<X>::data, (int)lda, reinterpret_cast<const void* const*>(B),
      BlasType<X>::data, (int)ldb, &b, reinterpret_cast<void* const*>(C), BlasType<X>::data, (int)ldc, (int)batch,
      BlasType<X>::compute, CUBLAS_GEMM_DEFAULT);
  if (s != CUBLAS_STATUS_SUCCESS) return blas_fail(s, "cublasGemmBatchedEx");
  return debug_check("cublasGemmBatchedEx", stream);
}
#endif

// Row-major C[m, n] = alpha * op(A)[m, k] op(B)[k, n], as codegen.plan_contraction plans it for
// CBLAS (lda, ldb, ldc are row-major leading dimensions). Column-major libraries see the transposes,
// so this computes C^T = op(B)^T op(A)^T: swap the operands and the sizes m and n.
template <typename X>
inline int gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, const X* A, int64_t lda,
                int64_t sa, const X* B, int64_t ldb, int64_t sb, X* C, int64_t ldc, int64_t sc, int64_t batch,
                Stream stream) {
  return gemm_cm<X>(tb, ta, n, m, k, alpha, B, ldb, sb, A, lda, sa, C, ldc, sc, batch, stream);
}

// ---- batched GEMMs over several batch groups -------------------------------------------------
// A contraction whose batch letters do not merge into one stride (attention's B and H in the
// default layouts) is one pointer-array GEMM: entry q = (i_0, ..., i_{groups-1}) (last group
// fastest) multiplies the matrices at a + sum_g i_g * sa[g] and b + ... into c + .... One kernel at
// the start of substation_run writes the pointer arrays of every such GEMM into the workspace.
constexpr int kMaxBatchGroups = 4;
#ifdef SS_EMULATE
constexpr int kFillBlock = 1;
#else
constexpr int kFillBlock = 256;
#endif
template <typename X> struct Batch {
  const X* a;
  const X* b;
  X* c;
  int groups;
  int64_t size[kMaxBatchGroups], sa[kMaxBatchGroups], sb[kMaxBatchGroups], sc[kMaxBatchGroups];
  int64_t count;     // entries: the product of the sizes
  const X** pa;      // the pointer arrays, count entries each, in the workspace
  const X** pb;
  X** pc;
};
template <typename X, int N> struct BatchTable { Batch<X> d[N]; };

// Describe batch `d` (`groups` batch groups: sizes and element strides in A, B, C, outermost first)
// and take its 3 * count pointers from `next`, which advances past them.
template <typename X>
inline void batch_desc(Batch<X>& d, void**& next, const X* a, const X* b, X* c, int groups, const int64_t* size,
                       const int64_t* sa, const int64_t* sb, const int64_t* sc) {
  d.a = a; d.b = b; d.c = c; d.groups = groups; d.count = 1;
  for (int g = 0; g < groups; ++g) {
    d.size[g] = size[g]; d.sa[g] = sa[g]; d.sb[g] = sb[g]; d.sc[g] = sc[g];
    d.count *= size[g];
  }
  d.pa = static_cast<const X**>(static_cast<void*>(next));
  d.pb = static_cast<const X**>(static_cast<void*>(next + d.count));
  d.pc = static_cast<X**>(static_cast<void*>(next + 2 * d.count));
  next += 3 * d.count;
}

template <typename X, int N> SS_KERNEL(kFillBlock) void fill_batch_pointers(const BatchTable<X, N> t) {
  for (int i = 0; i < N; ++i) {
    const Batch<X>& d = t.d[i];
    for (int64_t q = (int64_t)SS_BID * SS_BDIM + SS_TID; q < d.count; q += (int64_t)SS_GDIM * SS_BDIM) {
      int64_t rem = q, oa = 0, ob = 0, oc = 0;
      for (int g = d.groups - 1; g >= 0; --g) {
        const int64_t ig = rem % d.size[g];
        rem /= d.size[g];
        oa += ig * d.sa[g]; ob += ig * d.sb[g]; oc += ig * d.sc[g];
      }
      d.pa[q] = d.a + oa;
      d.pb[q] = d.b + ob;
      d.pc[q] = d.c + oc;
    }
  }
}
template <typename X, int N> inline int fill_batches(const BatchTable<X, N>& t, Stream stream) {
  int64_t most = 0;
  for (int i = 0; i < N; ++i) most = std::max<int64_t>(most, t.d[i].count);
  const int64_t grid = std::min<int64_t>((most + kFillBlock - 1) / kFillBlock, 1024);
  return launch("batch pointers", &fill_batch_pointers<X, N>, grid, kFillBlock, 0, stream, t);
}
// Row-major batched C = alpha * op(A) op(B) over batch `d` (see gemm for the operand swap).
template <typename X>
inline int gemm_batched(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, const Batch<X>& d,
                        int64_t lda, int64_t ldb, int64_t ldc, Stream stream) {
  return gemm_cm_ptr<X>(tb, ta, n, m, k, alpha, d.pb, ldb, d.pa, lda, d.pc, ldc, d.count, stream);
}

inline int64_t align_up(int64_t bytes) { return (bytes + 255) / 256 * 256; }

}  // namespace sscuda
