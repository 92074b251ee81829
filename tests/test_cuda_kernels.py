"""Target cuda without a GPU, the machine code side: what nvcc makes of the generated kernels (PTX
store widths), the thread-to-element mapping of the row kernels under the GPU's warp geometry
(coverage, shared-memory banks), and the batched attention GEMMs (one cuBLAS call per contraction)."""
import functools
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import needs_nvcc, nvcc_skip_reason

from substation.backends.cpu.build import BuildError
from substation.backends.cuda.build import cuda_toolchain, nvcc_flags, ptx_entries
from substation.backends.cuda.codegen import generate_cuda
from substation.backends.cuda.launch import row_shared_elements
from substation.config import load_config
from substation.pipeline import compile_graphs
from substation.resources import csrc_dir

BERT_LARGE = load_config("bert-large-b8-l512").replace(target="cuda")




@functools.lru_cache(maxsize=None)
def _sources(config) -> tuple[str, str]:
    fwd, bwd = compile_graphs(config, fuse_ops=True)
    return generate_cuda(fwd), generate_cuda(bwd)


def _stores(ptx: str) -> list[str]:
    return re.findall(r"\bst\.global[.\w]*", ptx)


HOST_CALL = r'''
#include <algorithm>
template <int N> __host__ __device__ long pick(long a, long b) { return std::min<long>(a, b) + N; }
__global__ void k(long* p) { p[0] = pick<1>(p[0], p[1]); }
'''


@needs_nvcc
def test_host_function_in_device_code_is_a_build_error():
    """nvcc only warns when a __host__ __device__ helper calls a host function (std::min), and
    compiles the call into wrong code (a row buffer indexed through it collapsed onto one address);
    the build flags make it an error."""
    assert "--diag-error=20011,20013" in nvcc_flags("sm_90")
    with pytest.raises(BuildError, match=r"calling a constexpr __host__ function\(\"min\"\)"):
        ptx_entries(HOST_CALL)


@pytest.fixture(scope="module")
def half_ptx():
    """PTX of the BERT-large forward and backward kernels in float16 and bfloat16."""
    reason = nvcc_skip_reason()
    if reason:
        pytest.skip(reason)
    keys = [(dt, phase) for dt in ("float16", "bfloat16") for phase in (0, 1)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {k: pool.submit(ptx_entries, _sources(BERT_LARGE.replace(dtype=k[0]))[k[1]]) for k in keys}
        return {k: f.result() for k, f in futures.items()}


@needs_nvcc
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_vector_stores_are_16_bytes(half_ptx, dtype):
    """A vector of 8 halves is stored with one st.global.v4 (k1_input_bias used to split it into 6
    st.global.u16 and one v2.u16): no 2-, 4- or 8-byte store of a half tensor remains in any vector
    instantiation; the scalar 4-byte stores left are float32 statistics and column partial sums."""
    for phase in (0, 1):
        entries = half_ptx[dtype, phase]
        vector = {n: _stores(p) for n, p in entries.items() if re.fullmatch(r"k\d+_\w+<8, (true|false)>", n)}
        assert len(vector) == 2 * (5 if phase == 0 else 6)
        for name, stores in vector.items():
            assert stores and all(s in ("st.global.wb.v4.u32", "st.global.f32") for s in stores), (name, stores)
    k1 = _stores(half_ptx[dtype, 0]["k1_input_bias<8, false>"])
    assert k1 == ["st.global.wb.v4.u32"]


# -- row-kernel thread layout under the GPU's warp geometry ---------------------------------------
LAYOUT_HARNESS = r"""
#include "substation_cuda.cuh"
#include <map>
#include <set>
#include <tuple>
#include <vector>
// For each case on stdin (nrows nn v slots red column): the launch row_cfg plans for a 4-byte compute
// type, whether the kernels' mapping of threads to (row, element) covers every element exactly once,
// whether every buffer address belongs to one (row group, buffer, element) and lies inside the
// reservation, the worst number of distinct addresses in one bank among the lanes of a warp at one
// access, and whether each lane's shuffle mask is exactly its row group.
template <int V> void run(int64_t nrows, int64_t nn, int slots, int red, bool column) {
  const sscuda::RowCfg c = sscuda::row_cfg(nrows, nn, V, slots, red, column, 4);
  const int64_t nvec = nn / V, smem = (int64_t)c.smem / 4;
  std::vector<int> cover(nrows * nn, 0);
  bool addr_ok = true, mask_ok = true;
  size_t worst = 0;
  for (int64_t b = 0; b < c.grid; ++b) {
    std::vector<int64_t> owner(smem, -1);
    for (int w = 0; w < c.block / 32; ++w) {
      std::map<std::tuple<int64_t, int64_t, int, int>, std::vector<int64_t>> access;
      for (int t = 32 * w; t < 32 * w + 32; ++t) {
        const sscuda::RowThreads rt = c.warp ? sscuda::row_threads<true>(nvec, t, c.block)
                                             : sscuda::row_threads<false>(nvec, t, c.block);
        unsigned group = 0;
        for (int u = 32 * w; u < 32 * w + 32; ++u)
          if ((c.warp ? u / rt.lanes : 0) == rt.group) group |= 1u << (u % 32);
        mask_ok = mask_ok && sscuda::lane_mask(rt.lanes, t % 32) == group && rt.lanes == c.lanes;
        const int64_t region = sscuda::row_region((int64_t)slots * nn, rt.lanes);
        int64_t k = 0;
        for (int64_t row = b * rt.groups + rt.group; row < nrows; row += c.grid * rt.groups, ++k) {
          int64_t r = 0;
          for (int64_t nv = rt.lane; nv < nvec; nv += rt.lanes, ++r) {
            const sscuda::BufPos bp = sscuda::buf_pos<V>(nv, rt.lane, rt.lanes, nvec);
            for (int l = 0; l < V; ++l) {
              ++cover[row * nn + nv * V + l];
              for (int q = 0; q < slots; ++q) {
                const int64_t a = red + rt.group * region + q * nn + bp(l);
                const int64_t id = ((int64_t)rt.group * slots + q) * nn + nv * V + l;
                if (a < red || a >= smem || (owner[a] != -1 && owner[a] != id)) addr_ok = false;
                else owner[a] = id;
                access[{k, r, l, q}].push_back(a);
              }
            }
          }
        }
      }
      for (const auto& kv : access) {
        std::map<int64_t, std::set<int64_t>> banks;
        for (int64_t a : kv.second) banks[a % 32].insert(a);
        for (const auto& bk : banks) worst = std::max(worst, bk.second.size());
      }
    }
  }
  bool cover_ok = true;
  for (int n : cover) cover_ok = cover_ok && n == 1;
  std::printf("%lld %lld %d %d %d %d %lld %d %d %d %d %zu %d\n", (long long)nrows, (long long)nn, V, slots, red,
              (int)column, (long long)c.smem, c.lanes, c.rows_per_block, (int)cover_ok, (int)addr_ok, worst,
              (int)mask_ok);
}
int main() {
  long long nrows, nn;
  int v, slots, red, column;
  while (std::scanf("%lld %lld %d %d %d %d", &nrows, &nn, &v, &slots, &red, &column) == 6) {
    if (v == 1) run<1>(nrows, nn, slots, red, column != 0);
    if (v == 4) run<4>(nrows, nn, slots, red, column != 0);
    if (v == 8) run<8>(nrows, nn, slots, red, column != 0);
  }
  return 0;
}
"""
LAYOUT_CASES = [(nrows, nn, v, slots, red, 0) for nn in (8, 24, 64, 128, 200, 256, 512, 520, 1024, 4096)
                for v in (1, 4, 8) if nn % v == 0 for slots in (1, 3) for red in (0, 32) for nrows in (1, 37)]
LAYOUT_CASES += [(3000, 16, 8, 1, 0, 1), (2000, 1024, 4, 2, 32, 1), (700, 128, 8, 1, 32, 1)]


@pytest.fixture(scope="module")
def layout_report(tmp_path_factory):
    """The harness above, compiled by nvcc for the host with the GPU build's constants (32 lanes,
    4 warps per warp-mode block, 512 threads per block-mode block), run on LAYOUT_CASES."""
    reason = nvcc_skip_reason()
    if reason:
        pytest.skip(reason)
    tc = cuda_toolchain()
    tmp = tmp_path_factory.mktemp("layout")
    (tmp / "layout.cu").write_text(LAYOUT_HARNESS)
    exe = tmp / "layout"
    subprocess.run([tc.nvcc, "-std=c++17", "-O2", f"-I{csrc_dir()}", f"-I{tc.cublas_include}", str(tmp / "layout.cu"),
                    "-o", str(exe)], check=True, capture_output=True)
    text = "\n".join(" ".join(map(str, c)) for c in LAYOUT_CASES)
    out = subprocess.run([str(exe)], input=text, capture_output=True, text=True, check=True).stdout
    rows = [tuple(map(int, line.split())) for line in out.splitlines()]
    assert len(rows) == len(LAYOUT_CASES)
    return {r[:6]: r[6:] for r in rows}


@needs_nvcc
def test_row_threads_cover_rows_and_buffers_are_conflict_free(layout_report):
    """Every (row, element) is visited by exactly one thread, every shared address by one (row group,
    buffer, element) inside the reservation launch.row_shared_elements predicts, no two lanes of a warp hit
    different addresses of one bank (the lane-interleaved buffers; the row-major layout they replace
    had each lane's 8 floats 32 B apart: 8-way conflicts), and shuffle masks name the row's lanes."""
    for case, (smem, lanes, rows_per_block, cover_ok, addr_ok, worst, mask_ok) in layout_report.items():
        nrows, nn, v, slots, red, column = case
        assert cover_ok and addr_ok and mask_ok, case
        assert worst == 1, (case, worst)
        assert smem == 4 * row_shared_elements(nn, v, slots, red > 0), case
    # Short rows share a warp: K = 128 and K = 64 in float16 vectors (V = 8) run 2 and 4 rows per warp.
    assert layout_report[37, 128, 8, 1, 0, 0][1:3] == (16, 8)
    assert layout_report[37, 64, 8, 1, 0, 0][1:3] == (8, 16)
    assert layout_report[37, 512, 8, 1, 32, 0][1:3] == (32, 4)
    assert layout_report[37, 520, 8, 1, 32, 0][1:3] == (96, 1)  # 65 vectors: a block of 3 warps
    assert layout_report[37, 200, 8, 3, 0, 0][0] == 4 * 4 * 3 * 200  # 25 vectors: 32 lanes, no padding
    assert layout_report[37, 24, 8, 1, 0, 0][0] == 4 * 32 * 36  # 3 vectors: 4 lanes, 32 rows of 24 + 12 padding


# -- contractions ----------------------------------------------------------------------------------
@pytest.mark.parametrize("config", ["bert-large-b8-l512", "bert-large-b96-l128"])
def test_every_contraction_is_one_cublas_call(config):
    """B and H do not merge in the default layout (Q, K, V interleave in QKV): each attention
    contraction is one pointer-array GEMM of B * H matrices (B = 8, H = 16: 128 in one call, where
    8 calls of a strided batch of 16 ran before; B = 96: 1 call instead of 16), with no host loop;
    one kernel writes every pointer array of the run."""
    cfg = load_config(config).replace(target="cuda", dtype="float16")
    for phase, src in enumerate(_sources(cfg)):
        run = src[src.index('extern "C" int substation_run('):]
        parts = re.split(r"\n  // \S+ \[(\w+)\] \w+: [^\n]*\n", run)
        gemms = [text for cls, text in zip(parts[1::2], parts[2::2]) if cls == "TC"]
        assert len(gemms) == (6 if phase == 0 else 12)
        for text in gemms:
            assert text.startswith("  SS_CHECK(sscuda::gemm") and text.count("sscuda::gemm") == 1, text
            assert "\n" not in text, text  # one statement: no loop around it
        attention = [text for text in gemms if text.startswith("  SS_CHECK(sscuda::gemm_batched<store_t>(")]
        assert len(attention) == (2 if phase == 0 else 4)
        assert run.count("sscuda::batch_desc(") == run.count("const int64_t n_[] = {B, H}") == len(attention)
        assert run.count("SS_CHECK(sscuda::fill_batches(batch_, stream_));") == 1
        assert "  return (int64_t)sizeof(void*) * 3 * (" + " + ".join(["(B) * (H)"] * len(attention)) + ");" in src
