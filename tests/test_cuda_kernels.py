"""Target cuda without a GPU, the machine code side: what nvcc makes of the generated kernels (PTX
store widths), the thread-to-element mapping of the row kernels under the GPU's warp geometry
(coverage, shared-memory banks), and the batched attention GEMMs (one cuBLAS call per contraction)."""
import functools
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from substation.backends.cpu.build import BuildError, ToolchainError
from substation.backends.cuda.build import cuda_toolchain, nvcc_flags, ptx_entries
from substation.backends.cuda.codegen import generate_cuda
from substation.config import load_config
from substation.pipeline import compile_graphs

BERT_LARGE = load_config("bert-large-b8-l512").replace(target="cuda")


def _nvcc_skip_reason() -> str | None:
    try:
        cuda_toolchain().require_cublas()
    except ToolchainError as e:
        return f"no CUDA build toolchain here: {e}"
    return None


needs_nvcc = pytest.mark.skipif(_nvcc_skip_reason() is not None, reason=str(_nvcc_skip_reason()))


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
    reason = _nvcc_skip_reason()
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

