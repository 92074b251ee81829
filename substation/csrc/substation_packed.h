// Parameters read from packed copies in bf16 inference builds (docs/toolchain.md, "Packed parameters").
//
// A GEMM library that gets a plain weight matrix packs it into its own blocked layout on every call;
// inference calls pass the same weights again and again, so the packed copy is kept. It is found by
// the digest of the weights' content, never by their address: a parameter changed in any way (an
// optimizer step, load_state_dict, a write through .data or numpy) is packed anew, the same content at
// another address (a fresh bf16 cast of float32 master weights every call) finds its copy again.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <utility>
#include <vector>

#include <unistd.h>  // sysconf

#include "substation_cpu.h"

#if !defined(__AVX512F__) || !defined(__AVX512DQ__) || !defined(__AVX512BW__)
#error "substation_packed.h needs AVX-512 F, BW and DQ (the bf16 builds' CPUs have them)"
#endif

namespace ss {

namespace digest_constants {
constexpr uint64_t p1 = 0x9E3779B185EBCA87ull, p2 = 0xC2B2AE3D27D4EB4Full, p3 = 0x165667B19E3779F9ull;
constexpr int64_t rows_per_block = 16;  // the unit the threads share: the digest does not depend on their number
}  // namespace digest_constants

// XXH64's lane round (Collet, xxHash: acc = rotl(acc + x p2, 31) p1) on 64-bit lanes of `rows` rows of
// `row_bytes` bytes each (row stride ld_bytes), folded with its avalanche step.
inline uint64_t block_digest(const uint8_t* data, int64_t rows, int64_t row_bytes, int64_t ld_bytes) {
  using namespace digest_constants;
  uint64_t h = p3;
  __m512i acc[4];
  for (int u = 0; u < 4; ++u)
    acc[u] = _mm512_add_epi64(_mm512_set1_epi64((int64_t)p1), _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, u));
  const __m512i m1 = _mm512_set1_epi64((int64_t)p1), m2 = _mm512_set1_epi64((int64_t)p2);
  auto round = [&](__m512i a, __m512i x) {
    return _mm512_mullo_epi64(_mm512_rol_epi64(_mm512_add_epi64(a, _mm512_mullo_epi64(x, m2)), 31), m1);
  };
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = data + r * ld_bytes;
    int64_t c = 0;
    for (; c + 256 <= row_bytes; c += 256)
      for (int u = 0; u < 4; ++u) acc[u] = round(acc[u], _mm512_loadu_si512(row + c + 64 * u));
    for (; c < row_bytes; c += 64) {
      const __mmask64 live = row_bytes - c >= 64 ? ~__mmask64(0) : (__mmask64(1) << (row_bytes - c)) - 1;
      acc[0] = round(acc[0], _mm512_maskz_loadu_epi8(live, row + c));
    }
  }
  alignas(64) uint64_t lanes[4][8];
  for (int u = 0; u < 4; ++u) _mm512_store_si512(lanes[u], acc[u]);
  for (int u = 0; u < 4; ++u)
    for (int l = 0; l < 8; ++l) h = (h ^ lanes[u][l]) * p1 + p3;
  h ^= h >> 33;
  h *= p2;
  h ^= h >> 29;
  h *= p3;
  return h ^ (h >> 32);
}

// The digest of a matrix: rows x row_bytes bytes, row stride ld_bytes. Blocks of 16 rows are digested
// by the OpenMP threads (above 256 KiB) and folded in order, with the shape.
inline uint64_t content_digest(const void* data, int64_t rows, int64_t row_bytes, int64_t ld_bytes) {
  using namespace digest_constants;
  const int64_t blocks = (rows + rows_per_block - 1) / rows_per_block;
  std::vector<uint64_t> parts(blocks);
  const uint8_t* base = static_cast<const uint8_t*>(data);
#pragma omp parallel for schedule(static) if (rows * row_bytes > (int64_t(1) << 18))
  for (int64_t i = 0; i < blocks; ++i)
    parts[i] = block_digest(base + i * rows_per_block * ld_bytes, std::min(rows_per_block, rows - i * rows_per_block),
                            row_bytes, ld_bytes);
  uint64_t h = p3 ^ (uint64_t)rows * p1 ^ (uint64_t)row_bytes * p2;
  for (const uint64_t part : parts) h = (h ^ part) * p1 + p3;
  return h ^ (h >> 29);
}

// A least-recently-used cache: key -> shared value, each with a cost; entries are evicted, oldest
// first, while the costs exceed the capacity (one entry always stays). A value evicted while a caller
// holds it lives until that caller lets go. Not thread-safe by itself.
template <class Value>
class LruCache {
 public:
  using Key = std::vector<int64_t>;

  explicit LruCache(size_t capacity) : capacity_(capacity) {}

  std::shared_ptr<const Value> find(const Key& key) {
    const auto found = index_.find(key);
    if (found == index_.end()) return nullptr;
    order_.splice(order_.begin(), order_, found->second);
    return std::get<1>(*found->second);
  }

  void insert(const Key& key, std::shared_ptr<const Value> value, size_t cost = 1) {
    if (index_.count(key)) return;
    order_.emplace_front(key, std::move(value), cost);
    index_[key] = order_.begin();
    cost_ += cost;
    while (cost_ > capacity_ && order_.size() > 1) {
      cost_ -= std::get<2>(order_.back());
      index_.erase(std::get<0>(order_.back()));
      order_.pop_back();
    }
  }

  void erase(const Key& key) {
    const auto found = index_.find(key);
    if (found == index_.end()) return;
    cost_ -= std::get<2>(*found->second);
    order_.erase(found->second);
    index_.erase(found);
  }

  void clear() {
    order_.clear();
    index_.clear();
    cost_ = 0;
  }

  size_t size() const { return order_.size(); }
  size_t cost() const { return cost_; }

 private:
  std::list<std::tuple<Key, std::shared_ptr<const Value>, size_t>> order_;
  std::map<Key, typename decltype(order_)::iterator> index_;
  size_t capacity_, cost_ = 0;
};

// Packed parameters kept at most (bytes), over every build of the process: 1 GiB, or an eighth of the
// machine's memory where that is more. A model sweeps its layers' weights in order on every call, so
// the least recently used copy is always the next one needed: weights beyond the capacity are packed
// again on every call (a float32 BERT-large's 1.2 GB of GEMM weights did not fit in 1 GiB).
inline size_t packed_parameter_bytes() {
  static const size_t bytes = [] {
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    const size_t memory = pages > 0 && page > 0 ? size_t(pages) * size_t(page) : 0;
    return std::max(size_t(1) << 30, memory / 8);
  }();
  return bytes;
}

}  // namespace ss
