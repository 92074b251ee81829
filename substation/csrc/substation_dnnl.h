// Contractions on oneDNN's matmul primitive (docs/toolchain.md says why oneDNN): every one of the
// bfloat16 CPU builds (bf16 operands, float32 accumulation, a bf16 or float32 result: parameter gradients
// stay float32; on AMX tiles where the CPU has them, else on AVX512-BF16), and the token-wise ones of
// float32 builds compiled with fp32_gemm "onednn" (faster than MKL's SGEMM on AMD Zen 4).
//
// One engine per process, one stream per thread, and one primitive per distinct call (shape, strides,
// scale, result type), created on first use and kept in a least-recently-used cache of
// kMatmulPrimitives entries: creating a primitive costs more than a small GEMM, and each holds its JIT
// kernels (about 0.2 MiB), so a caller with ever new batch shapes must not grow memory without bound.
// Primitives take a user scratchpad, one buffer per calling thread: with oneDNN's own (library)
// scratchpad, which a default build shares between primitives, two Python threads running layers at once
// overwrote each other's packed blocks.
#pragma once
#include <oneapi/dnnl/dnnl.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "substation_blas.h"
#include "substation_cpu.h"
#include "substation_packed.h"

namespace ss {

// The batch letters of a batched contraction (at most three): sizes and each operand's element stride
// along them, none 0 (oneDNN 3.2 runs a factor broadcast over a batch letter on its reference kernel,
// 1000x slower: the generated code loops over such a letter instead).
struct GemmBatch {
  int count = 0;
  int64_t size[3] = {1, 1, 1}, a[3] = {0, 0, 0}, b[3] = {0, 0, 0}, c[3] = {0, 0, 0};
};

struct MatmulEntry {
  dnnl::matmul primitive;
  dnnl::memory::desc a, b, c, bias, scratchpad;
  dnnl::memory::desc b_packed;  // the layout the primitive reads B in (b itself unless B is packed)
};

// Primitives kept at most: a BERT layer's forward, backward and inference builds call about 30 distinct
// shapes per (B, J), shared by all layers of a config, so this holds several batch shapes at once.
constexpr size_t kMatmulPrimitives = 256;

// oneDNN keeps a cache of its own (1024 primitives by default) that holds each primitive's kernels
// after this one evicts it: it gets the same capacity, unless the user set ONEDNN_PRIMITIVE_CACHE_CAPACITY.
inline LruCache<MatmulEntry>& matmul_cache() {
  static LruCache<MatmulEntry> cache(kMatmulPrimitives);
  static const bool bounded = [] {
    if (!std::getenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY")) dnnl::set_primitive_cache_capacity((int)kMatmulPrimitives);
    return true;
  }();
  (void)bounded;
  return cache;
}

// Packed parameters (substation_packed.h) in the layout a primitive reads them in, at most
// packed_parameter_bytes().
inline LruCache<dnnl::memory>& packed_weight_cache() {
  static LruCache<dnnl::memory> cache(packed_parameter_bytes());
  return cache;
}

// Parameter addresses remembered by packed_from() at most (then forgotten at once: most are of tensors
// long gone).
constexpr size_t kPackedSources = 1 << 16;

// The copy last packed from each parameter address (with the packed layout, dtype and shape): a new
// content packed from that address supersedes it, so a loop of optimizer steps and inference calls
// keeps one copy per parameter instead of one per step. (The same content read from elsewhere finds
// its copy by digest and supersedes nothing.)
inline std::map<std::vector<int64_t>, LruCache<dnnl::memory>::Key>& packed_from() {
  static std::map<std::vector<int64_t>, LruCache<dnnl::memory>::Key> sources;
  return sources;
}

// Parameters held fixed by the calling thread (hold_parameters): a packed batch runs a library once per
// group of sequences with the same weights, and each call would digest all of them again (a pass over
// the layer's weights, bound by memory bandwidth).
struct HeldParameters {
  bool held = false;
  std::map<std::vector<int64_t>, uint64_t> digests;  // (address, rows, row bytes, row stride) -> digest
};

inline HeldParameters& held_parameters() {
  static thread_local HeldParameters held;
  return held;
}

// on: the caller promises that the parameters this thread passes do not change until hold_parameters(false),
// so each one's content is digested once; either call forgets the digests.
inline void hold_parameters(bool on) {
  HeldParameters& held = held_parameters();
  held.held = on;
  held.digests.clear();
}

// content_digest of a parameter, computed once per hold.
inline uint64_t parameter_digest(const void* data, int64_t rows, int64_t row_bytes, int64_t ld_bytes) {
  HeldParameters& held = held_parameters();
  if (!held.held) return content_digest(data, rows, row_bytes, ld_bytes);
  const std::vector<int64_t> key = {(int64_t)reinterpret_cast<uintptr_t>(data), rows, row_bytes, ld_bytes};
  const auto found = held.digests.find(key);
  if (found != held.digests.end()) return found->second;
  return held.digests[key] = content_digest(data, rows, row_bytes, ld_bytes);
}

// Guards matmul_cache(), packed_weight_cache() and packed_from().
inline std::mutex& matmul_lock() {
  static std::mutex lock;
  return lock;
}

// Drops every packed parameter copy (calls running now keep theirs until they end); returns the bytes
// the cache held.
inline size_t release_packed_parameters() {
  std::lock_guard<std::mutex> guard(matmul_lock());
  const size_t held = packed_weight_cache().cost();
  packed_weight_cache().clear();
  packed_from().clear();
  return held;
}

// What identifies a memory layout: data type, dims, padded dims, strides and inner blocks.
inline std::vector<int64_t> layout_signature(const dnnl::memory::desc& md) {
  std::vector<int64_t> out = {(int64_t)md.get_data_type(), (int64_t)md.get_format_kind(), md.get_ndims(),
                              (int64_t)md.get_size()};
  for (const auto& part : {md.get_dims(), md.get_padded_dims(), md.get_strides(), md.get_inner_blks(),
                           md.get_inner_idxs()}) {
    out.push_back((int64_t)part.size());
    out.insert(out.end(), part.begin(), part.end());
  }
  return out;
}

// float32 calls with a longer inner dimension run as a sum of GEMMs of at most kFloatChunk along k: one
// oneDNN call accumulates k in sequence, and its error at k = 1536 was ~3x MKL SGEMM's (relative
// 1.0-1.2e-6 vs 3.2-3.5e-7; a Hugging Face model's float32 outputs carry MKL's). Chunks of 512:
// 6.1-7.1e-7, at ~3% of the time (256: MKL's error, but most of oneDNN's lead over MKL gone).
constexpr int64_t kFloatChunk = 512;
// Below this many rows a float32 call goes to ss::gemm (MKL's SGEMM, its threads split by columns,
// substation_blas.h), its epilogue applied after it: all-MiniLM-L6-v2 at 1 x 24 tokens, 2 threads,
// Zen 4, whole model interleaved: 7.66 ms with every GEMM there against 8.25 with the calls of
// k <= kFloatChunk on oneDNN.
constexpr int64_t kFloatMinRows = 256;

template <typename T, typename TB>
inline int matmul_once(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const T* a, int64_t lda,
                const TB* b, int64_t ldb, void* c, int64_t ldc, bool c_f32, const GemmBatch& batch,
                const GemmBias& bias, GemmActivation activation, bool b_parameter, bool accumulate);

// C[batch, m, n] = alpha * op(A)[batch, m, k] op(B)[batch, k, n] (+ bias), row-major with leading
// dimensions lda, ldb, ldc as in cblas_sgemm (beta 0), then the activation; T (the operands' and the
// bias's element type) is bf16_t or float; C is float32 when c_f32, else of type T. A bias (bias.data
// set) needs alpha 1 (oneDNN scales after the bias). b_parameter (B a layer parameter, no batch
// letters): B is read from its packed copy in packed_weight_cache(), made on the first call with that
// content (float32: one copy per chunk of k). TB, B's element type, is T, or float with bf16_t
// operands: float32 master weights, rounded to bf16 as they are packed (b_parameter must be set).
// Returns 0, or 1 with last_error() set when oneDNN refuses the call.
template <typename T, typename TB = T>
inline int matmul(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const T* a,
                  int64_t lda, const TB* b, int64_t ldb, void* c, int64_t ldc, bool c_f32, const GemmBatch& batch,
                  const GemmBias& bias = GemmBias{}, GemmActivation activation = GemmActivation::none,
                  bool b_parameter = false) {
  if constexpr (!std::is_same<T, TB>::value) {
    static_assert(std::is_same<T, bf16_t>::value && std::is_same<TB, float>::value,
                  "B of another type than A: float32 master weights of a bf16 product");
    if (!b_parameter || batch.count != 0) {
      last_error() = "matmul: float32 master weights B are read from their packed bf16 copy (b_parameter)";
      return 1;
    }
  }
  if (bias.data && alpha != 1.0f) {
    last_error() = "matmul: a bias epilogue needs alpha = 1";
    return 1;
  }
  if constexpr (std::is_same<T, float>::value) {
    if (batch.count == 0) {
      float* out = static_cast<float*>(c);
      if (m < kFloatMinRows) {
        gemm<float>(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, out, ldc);
        if (bias.data || activation != GemmActivation::none) float_epilogue(m, n, out, ldc, bias, activation);
        return 0;
      }
      // C = the sum over chunks (oneDNN's sum post-op adds C): the bias with the first, the activation
      // after the last
      for (int64_t k0 = 0; k0 < k; k0 += kFloatChunk) {
        const bool last = k0 + kFloatChunk >= k;
        if (matmul_once<T, TB>(trans_a, trans_b, m, n, std::min(kFloatChunk, k - k0), alpha,
                               a + (trans_a ? k0 * lda : k0), lda, b + (trans_b ? k0 : k0 * ldb), ldb, c, ldc, c_f32,
                               batch, k0 == 0 ? bias : GemmBias{}, last ? activation : GemmActivation::none,
                               b_parameter, k0 > 0) != 0)
          return 1;
      }
      return 0;
    }
  }
  return matmul_once<T, TB>(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, c, ldc, c_f32, batch, bias, activation,
                            b_parameter, false);
}

// One oneDNN call of matmul(); accumulate: C += the product (oneDNN's sum post-op) instead of C =.
// Called by matmul() alone, which has refused a bias with alpha != 1.
template <typename T, typename TB>
inline int matmul_once(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const T* a,
                       int64_t lda, const TB* b, int64_t ldb, void* c, int64_t ldc, bool c_f32, const GemmBatch& batch,
                       const GemmBias& bias, GemmActivation activation, bool b_parameter, bool accumulate) {
  static_assert(std::is_same<T, bf16_t>::value || std::is_same<T, float>::value, "bf16_t or float operands");
  using dnnl::memory;
  constexpr memory::data_type dt = std::is_same<T, float>::value ? memory::data_type::f32 : memory::data_type::bf16;
  constexpr memory::data_type b_dt = std::is_same<TB, float>::value ? memory::data_type::f32 : memory::data_type::bf16;
  try {
    static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
    static thread_local dnnl::stream stream(engine);
    int32_t alpha_bits;
    std::memcpy(&alpha_bits, &alpha, sizeof alpha_bits);
    std::vector<int64_t> key = {(int64_t)dt, (int64_t)b_dt, trans_a, trans_b, m, n, k, lda, ldb, ldc, c_f32, alpha_bits, batch.count};
    for (int i = 0; i < batch.count; ++i)
      key.insert(key.end(), {batch.size[i], batch.a[i], batch.b[i], batch.c[i], bias.batch[i]});
    const bool with_bias = bias.data != nullptr;
    b_parameter = b_parameter && batch.count == 0;
    key.insert(key.end(), {with_bias, bias.m, bias.n, (int64_t)activation, b_parameter, accumulate});
    std::shared_ptr<const MatmulEntry> entry;
    {
      std::lock_guard<std::mutex> guard(matmul_lock());
      entry = matmul_cache().find(key);
      if (!entry) {
        memory::dims ad, as, bd, bs, cd, cs, biasd, biass;
        for (int i = 0; i < batch.count; ++i) {
          if (!batch.a[i] || !batch.b[i] || !batch.c[i])
            throw std::invalid_argument("a batch stride of 0 (loop over that letter instead)");
          ad.push_back(batch.size[i]);
          as.push_back(batch.a[i]);
          bd.push_back(batch.size[i]);
          bs.push_back(batch.b[i]);
          cd.push_back(batch.size[i]);
          cs.push_back(batch.c[i]);
          biasd.push_back(bias.batch[i] ? batch.size[i] : 1);  // a broadcast bias has extent 1 there
          biass.push_back(bias.batch[i]);
        }
        biasd.insert(biasd.end(), {bias.m ? m : 1, bias.n ? n : 1});
        biass.insert(biass.end(), {bias.m ? bias.m : 1, bias.n ? bias.n : 1});
        ad.insert(ad.end(), {m, k});
        as.insert(as.end(), {trans_a ? 1 : lda, trans_a ? lda : 1});
        bd.insert(bd.end(), {k, n});
        bs.insert(bs.end(), {trans_b ? 1 : ldb, trans_b ? ldb : 1});
        cd.insert(cd.end(), {m, n});
        cs.insert(cs.end(), {ldc, 1});
        // The bias's broadcast extents get the stride a dense tensor would have there (the span of the
        // dimensions inside), so that oneDNN sees a plain format.
        for (size_t i = 0; i < biasd.size(); ++i)
          if (biasd[i] == 1) {
            int64_t span = 1;
            for (size_t j = i + 1; j < biasd.size(); ++j) span = std::max(span, biass[j] * biasd[j]);
            biass[i] = span;
          }
        const memory::desc a_md(ad, dt, as), b_md(bd, b_dt, bs);  // B as given; the primitive reads it in dt
        const memory::desc c_md(cd, c_f32 ? memory::data_type::f32 : dt, cs);
        dnnl::primitive_attr attr;
        attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
        dnnl::post_ops ops;
        if (alpha != 1.0f)  // the scale on the float32 accumulators, before rounding to bf16
          ops.append_eltwise(dnnl::algorithm::eltwise_linear, alpha, 0.0f);
        if (accumulate) ops.append_sum(1.0f);  // after the scale, before the activation: C = f(alpha A B + C)
        if (activation != GemmActivation::none) {
          const dnnl::algorithm fn = activation == GemmActivation::gelu        ? dnnl::algorithm::eltwise_gelu_erf
                                     : activation == GemmActivation::gelu_tanh ? dnnl::algorithm::eltwise_gelu_tanh
                                                                               : dnnl::algorithm::eltwise_relu;
          ops.append_eltwise(fn, 0.0f, 0.0f);
        }
        if (ops.len() > 0) attr.set_post_ops(ops);
        const memory::desc bias_md = with_bias ? memory::desc(biasd, dt, biass) : memory::desc();
        // a parameter: the layout the primitive prefers (format any), filled by a reorder per content
        const memory::desc b_wanted = b_parameter ? memory::desc(bd, dt, memory::format_tag::any) : b_md;
        const dnnl::matmul::primitive_desc pd =
            with_bias ? dnnl::matmul::primitive_desc(engine, a_md, b_wanted, bias_md, c_md, attr)
                      : dnnl::matmul::primitive_desc(engine, a_md, b_wanted, c_md, attr);
        entry = std::make_shared<const MatmulEntry>(
            MatmulEntry{dnnl::matmul(pd), a_md, b_md, c_md, bias_md, pd.scratchpad_desc(), pd.weights_desc()});
        matmul_cache().insert(key, entry);
      }
    }
    void* b_data = const_cast<TB*>(b);
    std::shared_ptr<const dnnl::memory> packed;  // held until the call ends (the cache may evict it)
    if (!(entry->b_packed == entry->b)) {  // another layout, or float32 masters: always so for those
      LruCache<memory>::Key packed_key = layout_signature(entry->b_packed);
      packed_key.insert(packed_key.end(), {(int64_t)b_dt, trans_b, k, n,
                                           (int64_t)parameter_digest(b, trans_b ? n : k, (trans_b ? k : n) * (int64_t)sizeof(TB),
                                                                   ldb * (int64_t)sizeof(TB))});
      {
        std::lock_guard<std::mutex> guard(matmul_lock());
        packed = packed_weight_cache().find(packed_key);
      }
      if (!packed) {
        auto made = std::make_shared<memory>(entry->b_packed, engine);  // oneDNN's buffer: 64-byte aligned
        memory plain(entry->b, engine, b_data);
        dnnl::reorder(plain, *made).execute(stream, plain, *made);
        stream.wait();
        std::lock_guard<std::mutex> guard(matmul_lock());
        std::vector<int64_t> source(packed_key.begin(), packed_key.end() - 1);  // all but the digest
        source.push_back((int64_t)reinterpret_cast<uintptr_t>(b));
        if (packed_from().size() >= kPackedSources) packed_from().clear();
        auto [last, fresh] = packed_from().try_emplace(std::move(source), packed_key);
        if (!fresh && last->second != packed_key) {
          packed_weight_cache().erase(last->second);
          last->second = packed_key;
        }
        packed_weight_cache().insert(packed_key, made, made->get_desc().get_size());
        packed = made;
      }
      b_data = packed->get_data_handle();
    }
    std::unordered_map<int, memory> args = {{DNNL_ARG_SRC, memory(entry->a, engine, const_cast<T*>(a))},
                                            {DNNL_ARG_WEIGHTS, memory(entry->b_packed, engine, b_data)},
                                            {DNNL_ARG_DST, memory(entry->c, engine, c)}};
    if (with_bias) args.emplace(DNNL_ARG_BIAS, memory(entry->bias, engine, const_cast<void*>(bias.data)));
    static thread_local std::vector<uint8_t> scratchpad;
    if (scratchpad.size() < entry->scratchpad.get_size()) scratchpad.resize(entry->scratchpad.get_size());
    if (!scratchpad.empty()) args.emplace(DNNL_ARG_SCRATCHPAD, memory(entry->scratchpad, engine, scratchpad.data()));
    entry->primitive.execute(stream, args);
    stream.wait();
    return 0;
  } catch (const std::exception& e) {
    last_error() = std::string("oneDNN matmul (m=") + std::to_string(m) + ", n=" + std::to_string(n) + ", k=" +
                   std::to_string(k) + ", batch letters " + std::to_string(batch.count) + "): " + e.what();
    return 1;
  }
}

}  // namespace ss
