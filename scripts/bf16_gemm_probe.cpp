// bf16 GEMM probe: oneDNN matmul and MKL (cblas_gemm_bf16bf16f32, its packed form, cblas_sgemm) on one
// GEMM or GEMM batch, timed per call, checked against a float32 SGEMM on the same bf16-rounded inputs.
//
// Built and driven by scripts/bf16_gemm_probe.py (which compiles it like the project's generated code:
// g++ -O3 -march=native -fopenmp, MKL's LP64 interface with the GNU OpenMP threading layer, oneDNN's
// GNU-OpenMP build), loaded with ctypes into a process that has imported torch first, so that torch,
// MKL, oneDNN and this file share torch's libgomp. Deliberately outside substation/csrc: every file
// there is hashed into the build keys of generated code.
//
// One call of probe_run() describes C[b0, b1, m, n] = epilogue(A[b0, b1, m, k] @ B[b0, b1, k, n]) with
// every operand given by four element strides (batch 0, batch 1, row, column), so transposed operands
// (a column stride != 1) and per-head views into token-major tensors ([B, J, H, P]) are the same case.
#include <mkl.h>
#include <oneapi/dnnl/dnnl.hpp>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

enum Lib { LIB_ONEDNN = 0, LIB_MKL_BF16 = 1, LIB_MKL_BF16_PACKED = 2, LIB_MKL_SGEMM = 3 };
enum Epi { EPI_NONE = 0, EPI_BIAS = 1, EPI_BIAS_GELU_ERF = 2, EPI_BIAS_GELU_TANH = 3, EPI_BIAS_RESID = 4,
           EPI_GELU_ERF = 5, EPI_SCALE = 6 };

const float kScale = 0.125f;  // 1/sqrt(64): attention's score scaling (EPI_SCALE)

inline uint16_t f2bf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even (inputs are finite)
  return static_cast<uint16_t>(u >> 16);
}
inline float bf2f(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

using clk = std::chrono::steady_clock;
inline double secs(clk::time_point a, clk::time_point b) { return std::chrono::duration<double>(b - a).count(); }

template <class T>
struct Buf {  // 64-byte aligned, zeroed
  T* p = nullptr;
  size_t n = 0;
  explicit Buf(size_t count = 0) { resize(count); }
  void resize(size_t count) {
    std::free(p);
    n = count;
    size_t bytes = ((count * sizeof(T) + 63) / 64) * 64;
    p = static_cast<T*>(std::aligned_alloc(64, bytes ? bytes : 64));
    std::memset(p, 0, bytes ? bytes : 64);
  }
  ~Buf() { std::free(p); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
};

}  // namespace

extern "C" {

struct ProbeSpec {
  int lib, epilogue, out_bf16, weights_any;  // weights_any: oneDNN picks (and we reorder once) B's layout
  long b0, b1, m, n, k;
  long as[4], bs[4], cs[4];  // element strides (batch 0, batch 1, row, column) of A (m x k), B (k x n), C
  int min_iters, max_iters;
  double min_time_s;
};

struct ProbeResult {
  double median_s, min_s;     // per call, after warm-up
  double create_ms;           // oneDNN: primitive descriptor + primitive (JIT), first time in this process
  double create_again_ms;     // oneDNN: the same again (primitive cache hit)
  double first_exec_ms;       // the first call after creation
  double prep_ms;             // oneDNN weights_any: reorder bf16 B -> packed; MKL packed: cblas_..._pack
  double prep_f32_ms;         // oneDNN weights_any: reorder float32 B -> packed bf16 (cast fused in)
  double max_rel_err;         // max |C - ref| / max |ref|, ref: float32 SGEMM of the bf16 values + epilogue
  int iters, status;          // status 0 ok, -1 library error, -2 not offered by the library
  char impl[256];
  char msg[512];
};

const char* probe_versions() {
  static std::string s;
  const dnnl_version_t* v = dnnl_version();
  char mkl[512];
  mkl_get_version_string(mkl, sizeof mkl);
  char buf[1024];
  std::snprintf(buf, sizeof buf, "onednn=%d.%d.%d (%s) cpu_runtime=%u | mkl=%s | omp_max_threads=%d", v->major,
                v->minor, v->patch, v->hash, v->cpu_runtime, mkl, omp_get_max_threads());
  s = buf;
  return s.c_str();
}

int probe_run(const ProbeSpec* sp, ProbeResult* r);

}  // extern "C"

namespace {

size_t span(const long s[4], long b0, long b1, long rows, long cols) {
  return 1 + (b0 - 1) * s[0] + (b1 - 1) * s[1] + (rows - 1) * s[2] + (cols - 1) * s[3];
}

float gelu_erf(float x) { return 0.5f * x * (1.f + std::erf(x * 0.70710678118654752f)); }
float gelu_tanh(float x) {
  return 0.5f * x * (1.f + std::tanh(0.79788456080286536f * (x + 0.044715f * x * x * x)));
}

bool has_bias(int e) { return e == EPI_BIAS || e == EPI_BIAS_GELU_ERF || e == EPI_BIAS_GELU_TANH || e == EPI_BIAS_RESID; }

// cblas operand description of one row-major matrix view: transposed when its column stride is not 1.
struct Op {
  CBLAS_TRANSPOSE t;
  MKL_INT ld;
};
bool cblas_op(const long s[4], Op* o) {
  if (s[3] == 1) { *o = {CblasNoTrans, static_cast<MKL_INT>(s[2])}; return true; }
  if (s[2] == 1) { *o = {CblasTrans, static_cast<MKL_INT>(s[3])}; return true; }
  return false;
}

struct Problem {
  const ProbeSpec& sp;
  size_t na, nb, nc;
  Buf<uint16_t> a, b;  // bf16 operands
  Buf<float> af, bf, bfull;  // float32 copies (bf16 values) for SGEMM and the reference; bfull: B before rounding
  Buf<float> bias, resid_f, ref;
  Buf<uint16_t> resid_b;
  explicit Problem(const ProbeSpec& s) : sp(s) {
    na = span(s.as, s.b0, s.b1, s.m, s.k);
    nb = span(s.bs, s.b0, s.b1, s.k, s.n);
    nc = span(s.cs, s.b0, s.b1, s.m, s.n);
    a.resize(na); b.resize(nb); af.resize(na); bf.resize(nb); bfull.resize(nb);
    uint64_t st = 0x9E3779B97F4A7C15ull;
    auto rnd = [&st]() {  // uniform in [-1, 1)
      st ^= st << 13; st ^= st >> 7; st ^= st << 17;
      return static_cast<float>((st >> 11) * (1.0 / 9007199254740992.0)) * 2.f - 1.f;
    };
    for (size_t i = 0; i < na; ++i) { a.p[i] = f2bf(rnd()); af.p[i] = bf2f(a.p[i]); }
    for (size_t i = 0; i < nb; ++i) { bfull.p[i] = rnd(); b.p[i] = f2bf(bfull.p[i]); bf.p[i] = bf2f(b.p[i]); }
    bias.resize(s.n);
    for (long j = 0; j < s.n; ++j) bias.p[j] = rnd();
    resid_f.resize(nc); resid_b.resize(nc);
    for (size_t i = 0; i < nc; ++i) { resid_b.p[i] = f2bf(rnd()); resid_f.p[i] = bf2f(resid_b.p[i]); }
  }
  template <class F>
  void for_each_gemm(F f) const {
    for (long i0 = 0; i0 < sp.b0; ++i0)
      for (long i1 = 0; i1 < sp.b1; ++i1)
        f(i0 * sp.as[0] + i1 * sp.as[1], i0 * sp.bs[0] + i1 * sp.bs[1], i0 * sp.cs[0] + i1 * sp.cs[1]);
  }
  // the float32 reference, epilogue applied
  void reference() {
    ref.resize(nc);
    Op oa, ob, oc;
    cblas_op(sp.as, &oa); cblas_op(sp.bs, &ob); cblas_op(sp.cs, &oc);
    for_each_gemm([&](long offa, long offb, long offc) {
      cblas_sgemm(CblasRowMajor, oa.t, ob.t, sp.m, sp.n, sp.k, 1.f, af.p + offa, oa.ld, bf.p + offb, ob.ld, 0.f,
                  ref.p + offc, oc.ld);
    });
    for_each_gemm([&](long, long, long offc) {
      for (long i = 0; i < sp.m; ++i)
        for (long j = 0; j < sp.n; ++j) {
          long o = offc + i * sp.cs[2] + j * sp.cs[3];
          float x = ref.p[o];
          switch (sp.epilogue) {
            case EPI_BIAS: x += bias.p[j]; break;
            case EPI_BIAS_GELU_ERF: x = gelu_erf(x + bias.p[j]); break;
            case EPI_BIAS_GELU_TANH: x = gelu_tanh(x + bias.p[j]); break;
            case EPI_BIAS_RESID: x = x + bias.p[j] + resid_f.p[o]; break;
            case EPI_GELU_ERF: x = gelu_erf(x); break;
            case EPI_SCALE: x *= kScale; break;
            default: break;
          }
          ref.p[o] = x;
        }
    });
  }
  template <class Get>
  double rel_err(Get get) const {
    double emax = 0, rmax = 0;
    for_each_gemm([&](long, long, long offc) {
      for (long i = 0; i < sp.m; ++i)
        for (long j = 0; j < sp.n; ++j) {
          long o = offc + i * sp.cs[2] + j * sp.cs[3];
          emax = std::max(emax, std::fabs(static_cast<double>(get(o)) - ref.p[o]));
          rmax = std::max(rmax, std::fabs(static_cast<double>(ref.p[o])));
        }
    });
    return rmax > 0 ? emax / rmax : emax;
  }
};

template <class F>
void time_calls(const ProbeSpec& sp, ProbeResult* r, F call) {
  auto t0 = clk::now();
  call();
  r->first_exec_ms = 1e3 * secs(t0, clk::now());
  call();
  call();  // warm-up
  std::vector<double> ts;
  double total = 0;
  while (static_cast<int>(ts.size()) < sp.max_iters && (static_cast<int>(ts.size()) < sp.min_iters || total < sp.min_time_s)) {
    auto a = clk::now();
    call();
    double t = secs(a, clk::now());
    ts.push_back(t);
    total += t;
  }
  std::sort(ts.begin(), ts.end());
  r->iters = static_cast<int>(ts.size());
  r->min_s = ts.front();
  r->median_s = ts.size() % 2 ? ts[ts.size() / 2] : 0.5 * (ts[ts.size() / 2 - 1] + ts[ts.size() / 2]);
}

// 2-D for one GEMM; 3-D when the two batch dimensions of every operand collapse into one (batch stride
// s[1], s[0] == b1 * s[1]); else 4-D (all operands of one matmul need the same number of dimensions)
bool collapses(const ProbeSpec& sp) {
  for (const long* s : {sp.as, sp.bs, sp.cs})
    if (s[0] != sp.b1 * s[1]) return false;
  return true;
}
dnnl::memory::desc md_of(const ProbeSpec& sp, const long s[4], long rows, long cols, dnnl::memory::data_type dt) {
  using dims = dnnl::memory::dims;
  if (sp.b0 * sp.b1 == 1) return dnnl::memory::desc(dims{rows, cols}, dt, dims{s[2], s[3]});
  if (collapses(sp)) return dnnl::memory::desc(dims{sp.b0 * sp.b1, rows, cols}, dt, dims{s[1], s[2], s[3]});
  return dnnl::memory::desc(dims{sp.b0, sp.b1, rows, cols}, dt, dims{s[0], s[1], s[2], s[3]});
}

int run_onednn(const ProbeSpec& sp, Problem& pb, ProbeResult* r) {
  using namespace dnnl;
  using dt = memory::data_type;
  engine eng(engine::kind::cpu, 0);
  stream strm(eng);
  const dt cdt = sp.out_bf16 ? dt::bf16 : dt::f32;
  memory::desc a_md = md_of(sp, sp.as, sp.m, sp.k, dt::bf16);
  memory::desc b_plain = md_of(sp, sp.bs, sp.k, sp.n, dt::bf16);
  memory::desc c_md = md_of(sp, sp.cs, sp.m, sp.n, cdt);
  memory::desc b_md = b_plain;
  if (sp.weights_any) {
    memory::dims d = b_plain.get_dims();
    b_md = memory::desc(d, dt::bf16, memory::format_tag::any);
  }
  memory::desc bias_md;
  if (has_bias(sp.epilogue)) {
    memory::dims d(c_md.get_ndims(), 1);
    d.back() = sp.n;
    memory::dims st(d.size(), sp.n);
    st.back() = 1;
    bias_md = memory::desc(d, dt::f32, st);
  }
  post_ops po;
  switch (sp.epilogue) {
    case EPI_BIAS_GELU_ERF: case EPI_GELU_ERF: po.append_eltwise(algorithm::eltwise_gelu_erf, 0.f, 0.f); break;
    case EPI_BIAS_GELU_TANH: po.append_eltwise(algorithm::eltwise_gelu_tanh, 0.f, 0.f); break;
    case EPI_BIAS_RESID: po.append_binary(algorithm::binary_add, c_md); break;
    case EPI_SCALE: po.append_eltwise(algorithm::eltwise_linear, kScale, 0.f); break;
    default: break;
  }
  primitive_attr attr;
  attr.set_post_ops(po);
  auto make_pd = [&]() {
    return has_bias(sp.epilogue) ? matmul::primitive_desc(eng, a_md, b_md, bias_md, c_md, attr)
                                 : matmul::primitive_desc(eng, a_md, b_md, c_md, attr);
  };
  auto t0 = clk::now();
  matmul::primitive_desc pd = make_pd();
  matmul prim(pd);
  r->create_ms = 1e3 * secs(t0, clk::now());
  t0 = clk::now();
  {
    matmul::primitive_desc pd2 = make_pd();
    matmul prim2(pd2);
  }
  r->create_again_ms = 1e3 * secs(t0, clk::now());
  std::snprintf(r->impl, sizeof r->impl, "%s", pd.impl_info_str());

  memory a_mem(a_md, eng, pb.a.p);
  memory b_user(b_plain, eng, pb.b.p);
  memory b_mem = b_user;
  if (sp.weights_any && pd.weights_desc() != b_plain) {
    b_mem = memory(pd.weights_desc(), eng);
    reorder rb(b_user, b_mem);
    rb.execute(strm, b_user, b_mem);  // first run: creates buffers; time the next ones
    strm.wait();
    t0 = clk::now();
    rb.execute(strm, b_user, b_mem);
    strm.wait();
    r->prep_ms = 1e3 * secs(t0, clk::now());
    memory::desc bf32_md = md_of(sp, sp.bs, sp.k, sp.n, dt::f32);
    memory b_f32(bf32_md, eng, pb.bfull.p);
    reorder rf(b_f32, b_mem);
    rf.execute(strm, b_f32, b_mem);
    strm.wait();
    t0 = clk::now();
    rf.execute(strm, b_f32, b_mem);
    strm.wait();
    r->prep_f32_ms = 1e3 * secs(t0, clk::now());
    rb.execute(strm, b_user, b_mem);  // back to the bf16-rounded values the reference uses
    strm.wait();
    std::snprintf(r->msg, sizeof r->msg, "weights packed once per step (not timed per call)");
  }
  Buf<float> cf(sp.out_bf16 ? 0 : pb.nc);
  Buf<uint16_t> cb(sp.out_bf16 ? pb.nc : 0);
  void* cptr = sp.out_bf16 ? static_cast<void*>(cb.p) : static_cast<void*>(cf.p);
  memory c_mem(c_md, eng, cptr);
  std::unordered_map<int, memory> args{{DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, b_mem}, {DNNL_ARG_DST, c_mem}};
  Buf<uint16_t> res_b(0);
  if (has_bias(sp.epilogue)) args.insert({DNNL_ARG_BIAS, memory(bias_md, eng, pb.bias.p)});
  if (sp.epilogue == EPI_BIAS_RESID) {
    void* rp = sp.out_bf16 ? static_cast<void*>(pb.resid_b.p) : static_cast<void*>(pb.resid_f.p);
    args.insert({DNNL_ARG_ATTR_MULTIPLE_POST_OP(0) | DNNL_ARG_SRC_1, memory(c_md, eng, rp)});
  }
  time_calls(sp, r, [&]() {
    prim.execute(strm, args);
    strm.wait();
  });
  pb.reference();
  r->max_rel_err = sp.out_bf16 ? pb.rel_err([&](long o) { return bf2f(cb.p[o]); })
                               : pb.rel_err([&](long o) { return cf.p[o]; });
  return 0;
}

int run_mkl(const ProbeSpec& sp, Problem& pb, ProbeResult* r) {
  Op oa, ob, oc;
  if (!cblas_op(sp.as, &oa) || !cblas_op(sp.bs, &ob) || !cblas_op(sp.cs, &oc) || oc.t != CblasNoTrans) {
    r->status = -2;
    std::snprintf(r->msg, sizeof r->msg, "operand strides not expressible as a cblas matrix");
    return -2;
  }
  if (sp.out_bf16) {
    r->status = -2;
    std::snprintf(r->msg, sizeof r->msg, "MKL writes float32 only (cblas_gemm_bf16bf16f32)");
    return -2;
  }
  if (sp.epilogue == EPI_BIAS_GELU_ERF || sp.epilogue == EPI_BIAS_GELU_TANH || sp.epilogue == EPI_GELU_ERF) {
    r->status = -2;
    std::snprintf(r->msg, sizeof r->msg, "no eltwise epilogue in MKL's GEMMs");
    return -2;
  }
  const bool batched = sp.b0 * sp.b1 > 1;
  if (sp.lib == LIB_MKL_BF16_PACKED && batched) {
    r->status = -2;
    std::snprintf(r->msg, sizeof r->msg, "packed B for a single GEMM only");
    return -2;
  }
  Buf<float> c(pb.nc);
  const float alpha = sp.epilogue == EPI_SCALE ? kScale : 1.f;
  const bool prefill = sp.epilogue == EPI_BIAS || sp.epilogue == EPI_BIAS_RESID;
  const float beta = prefill ? 1.f : 0.f;
  // bias (and residual) by prefilling C and beta = 1: a write pass over C inside every timed call
  auto fill = [&](long offc) {
    for (long i = 0; i < sp.m; ++i) {
      float* row = c.p + offc + i * oc.ld;
      const float* res = pb.resid_f.p + offc + i * oc.ld;
      if (sp.epilogue == EPI_BIAS_RESID)
        for (long j = 0; j < sp.n; ++j) row[j] = pb.bias.p[j] + res[j];
      else
        for (long j = 0; j < sp.n; ++j) row[j] = pb.bias.p[j];
    }
  };
  std::vector<long> offs_a, offs_b, offs_c;
  pb.for_each_gemm([&](long x, long y, long z) { offs_a.push_back(x); offs_b.push_back(y); offs_c.push_back(z); });
  const long nb = static_cast<long>(offs_a.size());
  Buf<uint16_t> packed(0);
  if (sp.lib == LIB_MKL_BF16_PACKED) {
    size_t bytes = cblas_gemm_bf16bf16f32_pack_get_size(CblasBMatrix, sp.m, sp.n, sp.k);
    packed.resize(bytes / 2 + 32);
    auto t0 = clk::now();
    cblas_gemm_bf16bf16f32_pack(CblasRowMajor, CblasBMatrix, ob.t, sp.m, sp.n, sp.k, pb.b.p, ob.ld, packed.p);
    r->prep_ms = 1e3 * secs(t0, clk::now());
    t0 = clk::now();
    cblas_gemm_bf16bf16f32_pack(CblasRowMajor, CblasBMatrix, ob.t, sp.m, sp.n, sp.k, pb.b.p, ob.ld, packed.p);
    r->prep_ms = 1e3 * secs(t0, clk::now());
    std::snprintf(r->msg, sizeof r->msg, "B packed once per step (not timed per call)");
  }
  auto one = [&](long i) {
    if (prefill) fill(offs_c[i]);
    switch (sp.lib) {
      case LIB_MKL_BF16:
        cblas_gemm_bf16bf16f32(CblasRowMajor, oa.t, ob.t, sp.m, sp.n, sp.k, alpha, pb.a.p + offs_a[i], oa.ld,
                               pb.b.p + offs_b[i], ob.ld, beta, c.p + offs_c[i], oc.ld);
        break;
      case LIB_MKL_BF16_PACKED:
        cblas_gemm_bf16bf16f32_compute(CblasRowMajor, oa.t, CblasPacked, sp.m, sp.n, sp.k, alpha, pb.a.p + offs_a[i],
                                       oa.ld, packed.p, ob.ld, beta, c.p + offs_c[i], oc.ld);
        break;
      default:
        cblas_sgemm(CblasRowMajor, oa.t, ob.t, sp.m, sp.n, sp.k, alpha, pb.af.p + offs_a[i], oa.ld, pb.bf.p + offs_b[i],
                    ob.ld, beta, c.p + offs_c[i], oc.ld);
    }
  };
  if (batched) {
    // one small GEMM per OpenMP thread (MKL runs sequentially inside a parallel region), as the
    // project's float32 attention does
    std::snprintf(r->impl, sizeof r->impl, "omp parallel for over %ld GEMMs", nb);
    time_calls(sp, r, [&]() {
#pragma omp parallel for schedule(static)
      for (long i = 0; i < nb; ++i) one(i);
    });
  } else {
    std::snprintf(r->impl, sizeof r->impl, "%s", prefill ? "C prefilled, beta=1" : "");
    time_calls(sp, r, [&]() { one(0); });
  }
  if (sp.epilogue == EPI_BIAS_RESID || sp.epilogue == EPI_BIAS || sp.epilogue == EPI_SCALE || sp.epilogue == EPI_NONE) {
    pb.reference();
    r->max_rel_err = pb.rel_err([&](long o) { return c.p[o]; });
  }
  return 0;
}

}  // namespace

int probe_run(const ProbeSpec* sp, ProbeResult* r) {
  std::memset(r, 0, sizeof *r);
  r->max_rel_err = -1;
  try {
    Problem pb(*sp);
    int rc = sp->lib == LIB_ONEDNN ? run_onednn(*sp, pb, r) : run_mkl(*sp, pb, r);
    r->status = rc;
    return rc;
  } catch (const dnnl::error& e) {
    r->status = -1;
    std::snprintf(r->msg, sizeof r->msg, "oneDNN: %s (status %d)", e.what(), static_cast<int>(e.status));
    return -1;
  } catch (const std::exception& e) {
    r->status = -1;
    std::snprintf(r->msg, sizeof r->msg, "%s", e.what());
    return -1;
  }
}

// ---- instruction throughput: the register-only peak of one core, and of all OpenMP threads together ----
#include <immintrin.h>

namespace {

__attribute__((target("avx512f"))) double fma_loop(long iters) {
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(0.001f * i);
  const __m512 x = _mm512_set1_ps(0.999f), y = _mm512_set1_ps(1e-7f);
  for (long it = 0; it < iters; ++it)
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_fmadd_ps(acc[i], x, y);
  float s = 0;
  for (int i = 0; i < 12; ++i) s += _mm512_reduce_add_ps(acc[i]);
  return s;
}

__attribute__((target("avx512f,avx512bf16"))) double dpbf16_loop(long iters) {
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(0.001f * i);
  const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = (__m512bh)_mm512_set1_epi16(0x3380);
  for (long it = 0; it < iters; ++it)
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], x, y);
  float s = 0;
  for (int i = 0; i < 12; ++i) s += _mm512_reduce_add_ps(acc[i]);
  return s;
}

}  // namespace

// GFLOP/s of 512-bit float32 FMAs (kind 0: 32 flop each) or VDPBF16PS (kind 1: 64 flop each), on
// `threads` OpenMP threads at once (1: one core); -1 where the CPU lacks the instruction.
extern "C" double probe_peak(int kind, int threads, double seconds) {
  if (kind == 1 && !__builtin_cpu_supports("avx512bf16")) return -1;
  if (!__builtin_cpu_supports("avx512f")) return -1;
  const double flop_per = kind == 0 ? 32.0 : 64.0;
  long iters = 1 << 20;
  volatile double sink = 0;
  for (;;) {
    auto t0 = clk::now();
#pragma omp parallel num_threads(threads)
    { double s = kind == 0 ? fma_loop(iters) : dpbf16_loop(iters); sink = sink + s; }
    double t = secs(t0, clk::now());
    if (t > seconds || iters > (1L << 40)) return threads * 12.0 * iters * flop_per / t / 1e9;
    iters *= 2;
  }
}
