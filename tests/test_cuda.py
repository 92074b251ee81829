"""Target cuda without a GPU: config rules, toolchain errors, code generation, the CPU emulation of
the generated code (numerics against the fp64 reference in every dtype, dropout masks identical to
the CPU build, autocast), and nvcc compilation and linking of the tiny and BERT-large layers into
libraries that load with ctypes. Running the CUDA code on a GPU: scripts/gpu_check.py."""
import ctypes
import functools
import os
import re
import stat
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from conftest import NO_DROPOUT, make_layer, needs_nvcc, nvcc_skip_reason, reference_for
from substation.backends.cuda import build as build_cuda
from substation.backends.cpu.build import BuildError, ToolchainError
from substation.backends.cuda.build import (build_cuda_libraries, cuda_toolchain, emulation_toolchain, nvcc_flags,
                                            ptxas_resources)
from substation.backends.cuda.codegen import generate_cuda, row_launch_plans, stat_tensors, tensor_dtypes
from substation.backends.cuda.launch import RowTooLongError, shared_memory_limit
from substation.ops.dropout import dropout_keep_mask
from substation.config import ConfigError, EncoderConfig, load_config
from substation.pipeline import compile_graphs, compile_layer
from substation import EncoderLayer
from substation.resources import configs_dir, csrc_file
from substation.runtime import CompiledGraph, CompiledLayer

TINY = load_config("tiny").replace(target="cuda")
HEAVY_DROPOUT = {"attention": 0.3, "hidden": 0.2, "activation": 0.25}
#: Max relative error against the fp64 reference (forward output and every gradient).
TOLERANCE = {"float64": 1e-12, "float32": 2e-5, "float16": 6e-3, "bfloat16": 4e-2}


def _emulation_skip_reason() -> str | None:
    try:
        emulation_toolchain()
    except ToolchainError as e:
        return f"no CUDA headers for the emulation: {e}"
    return None


needs_emulation = pytest.mark.skipif(_emulation_skip_reason() is not None, reason=str(_emulation_skip_reason()))


# -- config and toolchain --------------------------------------------------------------------------
def test_config_half_dtypes_need_target_cuda(tmp_path):
    with pytest.raises(ConfigError, match="dtype: must be one of float32, float64, bfloat16 for target cpu "
                                          r"\(float16 needs target: cuda\); got 'float16'"):
        load_config("tiny").replace(dtype="float16")
    for dt in ("float16", "bfloat16"):
        assert TINY.replace(dtype=dt).dtype == dt
    with pytest.raises(ConfigError, match="dtype: must be one of float32, float64, float16, bfloat16 for target cuda"):
        TINY.replace(dtype="int8")
    with pytest.raises(ConfigError, match="target: must be one of cpu, cuda"):
        TINY.replace(target="rocm")
    for bad in ("90", "sm90", "compute_90", "sm_9", 90):
        with pytest.raises(ConfigError, match="cuda_arch: must look like sm_90"):
            TINY.replace(cuda_arch=bad)
    assert TINY.cuda_arch == "sm_90" and TINY.replace(cuda_arch="sm_90a").cuda_arch == "sm_90a"
    f = tmp_path / "half.yaml"
    f.write_text("hidden_size: 64\nnum_heads: 4\ndtype: bfloat16\ntarget: cuda\ncuda_arch: sm_80\n")
    c = load_config(f)
    assert (c.dtype, c.target, c.cuda_arch) == ("bfloat16", "cuda", "sm_80")
    assert EncoderConfig.from_dict(c.to_dict()) == c


def test_nvcc_flags_name_the_architecture():
    flags = nvcc_flags("sm_90")
    assert "-gencode=arch=compute_90,code=sm_90" in flags and "-gencode=arch=compute_90,code=compute_90" in flags
    assert "-gencode=arch=compute_80,code=sm_80" in nvcc_flags("sm_80")
    with pytest.raises(ValueError, match="cuda_arch: must look like sm_90"):
        nvcc_flags("ampere")


def _fake_nvcc(folder, release: str):
    exe = folder / "nvcc"
    exe.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return exe


def test_toolchain_errors_are_clear(fresh_toolchain, monkeypatch, tmp_path):
    tmp = tmp_path
    monkeypatch.setenv("SUBSTATION_NVCC", str(tmp / "missing-nvcc"))
    with pytest.raises(ToolchainError, match="SUBSTATION_NVCC=.* is not an executable"):
        cuda_toolchain()
    cuda_toolchain.cache_clear()
    monkeypatch.setenv("SUBSTATION_NVCC", str(_fake_nvcc(tmp, "11.8")))
    with pytest.raises(ToolchainError, match="is CUDA 11.8; Substation needs CUDA 12 or newer"):
        cuda_toolchain()
    cuda_toolchain.cache_clear()
    monkeypatch.setenv("SUBSTATION_NVCC", str(_fake_nvcc(tmp, "12.4")))
    monkeypatch.setattr(build_cuda, "_cublas_candidates", lambda *a: [])
    tc = cuda_toolchain()
    assert tc.cuda_major == 12 and tc.cublas_lib is None
    with pytest.raises(ToolchainError, match=r"cuBLAS not found: .*pip install \"nvidia-cublas-cu12\""):
        build_cuda.build_cuda_library("// nothing", "t")
    assert not os.path.exists(tmp / "cache") or [p for p in os.listdir(tmp / "cache") if not p.startswith(".")] == []
    cuda_toolchain.cache_clear()
    monkeypatch.delenv("SUBSTATION_NVCC")
    monkeypatch.setenv("PATH", str(tmp / "empty"))
    monkeypatch.setenv("CUDA_HOME", str(tmp / "nowhere"))
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(build_cuda, "DEFAULT_CUDA_ROOTS", (str(tmp / "nowhere-either"),))
    with pytest.raises(ToolchainError, match=r"nvcc \(the CUDA compiler, CUDA 12 or newer\) not found"):
        cuda_toolchain()


# -- code generation -------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _graphs(config, fuse=True):
    return compile_graphs(config, fuse_ops=fuse)


def test_layer_norm_statistics_are_float32_for_half_layers():
    fwd, bwd = _graphs(TINY.replace(dtype="float16"))
    stats = {"layer_norm1_mean", "layer_norm1_rstd", "layer_norm2_mean", "layer_norm2_rstd"}
    assert stat_tensors(fwd) == stats and stat_tensors(bwd) == stats
    for g in (fwd, bwd):
        dts = tensor_dtypes(g)
        assert {n for n, d in dts.items() if d == "float32"} == stats
        assert {d for n, d in dts.items() if n not in stats} == {"float16"}
    assert set(tensor_dtypes(_graphs(TINY.replace(dtype="float64"))[0]).values()) == {"float64"}


@pytest.mark.parametrize("name", ["tiny", "bert-large-b8-l512"])
def test_generated_source_structure(name):
    cfg = load_config(name).replace(target="cuda", dtype="float16")
    for g in _graphs(cfg):
        src = generate_cuda(g)
        ops = g.operators()
        n_tc = sum(op.op_class == "TC" for op in ops)
        assert src.count("template <int V, bool WARP>") == len(ops) - n_tc  # one row kernel per EW/SN op
        assert len(re.findall(r"^  // \S+ \[TC\] contraction", src, re.M)) == n_tc
        assert "typedef __half store_t;" in src and "typedef float comp_t;" in src
        assert re.search(r"comp_t\* __restrict__ layer_norm\d_(mean|rstd)", src)
        assert "cublas" not in src  # GEMMs go through the header's cuBLAS wrapper
        assert "SS_CHECK(sscuda::begin(stream_, ws_));" in src  # cuBLAS gets the head of the workspace
        assert "int64_t total = sscuda::align_up(sscuda::kBlasWorkspace);" in src
        if name != "tiny":  # I, U, K: 16-byte vectors are possible in every row kernel
            assert src.count("const bool vec_ = false;") == 0
    fwd_src = generate_cuda(_graphs(cfg)[0])
    # qkv: one GEMM over the merged B*J rows; scores: one pointer-array GEMM over B x H.
    assert "sscuda::gemm<store_t>(false, true, B*J, 3*H*P, I, 1.0, X + (0)" in fwd_src
    assert re.search(r"sscuda::gemm_batched<store_t>\(false, true, J, K, P, [0-9.e-]+, batch_.d\[0\],", fwd_src)
    header = open(csrc_file("substation_cuda.cuh")).read()
    for needle in ("cublasGemmStridedBatchedEx", "cublasGemmBatchedEx", "cublasGemmEx", "CUBLAS_COMPUTE_32F",
                   "CUDA_R_16BF", "__shfl_xor_sync",
                   "cublasSetWorkspace(h, blas_workspace, (size_t)kBlasWorkspace)"):
        assert needle in header


def test_element_wise_kernels_reserve_no_shared_memory():
    """Only row buffers, column accumulators and block reductions take shared memory: BERT-large's
    fused bias kernels (input bias; bias, activation and dropout) reserve none."""
    cfg = load_config("bert-large-b8-l512").replace(target="cuda", dtype="float16")
    fwd, bwd = _graphs(cfg)
    plans = {p.kernel: p for g in (fwd, bwd) for p in row_launch_plans(g)}
    for p in plans.values():
        if not p.buffers and not p.reduces:
            assert p.shared_bytes == 0, p
    assert plans["k1_input_bias"].shared_bytes == 0 and plans["k8_BA"].shared_bytes == 0
    assert plans["k3_MSD"].shared_bytes == (32 + 4 * 512) * 4  # warp mode: 4 rows of 512 floats
    src = generate_cuda(fwd)
    assert "sscuda::row_cfg(nrows_, nn_, vec_ ? VMAX : 1, 0, 0, false, sizeof(comp_t))" in src


# I, U, L -> the backward kernel refused while generating (None: every launch fits, sm_90). Layer-norm
# backward keeps 5 row buffers of I floats; the linear1 bias gradient a column accumulator of U floats.
SIZE_SWEEP = {(1024, 4096, 8192): None, (4096, 16384, 2048): None, (8192, 32768, 512): None,
              (16384, 16384, 8192): ("k0_BSBLNDB", 16384, 5, 327808),
              (12288, 49152, 512): ("k0_BSBLNDB", 12288, 5, 245888),
              (1024, 65536, 512): ("k3_BAB", 65536, 1, 262144)}


@pytest.mark.parametrize("i, u, l", list(SIZE_SWEEP))
def test_row_sizes_fit_or_are_refused_when_generating(i, u, l):
    """Up to I = 16384, U = 65536, L = 8192: the generated launches fit a block's shared memory, or
    generation stops with a message naming the kernel, the row length and the bytes."""
    cfg = load_config("bert-large-b8-l512").replace(target="cuda", dtype="float32", hidden_size=i, ffn_size=u,
                                                    max_seq_len=l, num_heads=16)
    limit = shared_memory_limit(cfg.cuda_arch)
    assert limit == 232448 and shared_memory_limit("sm_80") == 166912 and shared_memory_limit("sm_89") == 101376
    fwd, bwd = _graphs(cfg)
    plans = row_launch_plans(fwd)
    assert plans and all(p.shared_bytes <= limit for p in plans)
    expected = SIZE_SWEEP[i, u, l]
    if expected is None:
        assert all(p.shared_bytes <= limit for p in row_launch_plans(bwd))
        return
    kernel, n, buffers, nbytes = expected
    message = (rf"{kernel} \(.*\): a row of {n} elements with {buffers} row buffer\(s\) needs {nbytes} B of shared "
               rf"memory per block, more than the 232448 B a block can have on sm_90 \(config bert-large-b8-l512: "
               rf"I={i}, U={u}, L={l}\); the CUDA target does not support rows this long")
    for make in (row_launch_plans, generate_cuda):
        with pytest.raises(RowTooLongError, match=message):
            make(bwd)


@pytest.mark.parametrize("b, j", [(4, 7), (1, 300)])  # 300: rows drawn in 256-element chunks, plus a tail
def test_numpy_dropout_mask_matches_the_cpu_build(b, j):
    layer = make_layer(load_config("tiny").replace(dropout=HEAVY_DROPOUT, max_seq_len=j))
    h = layer.config.num_heads
    given = {"X": torch.randn(b, j, 16, dtype=torch.float64), "mask": torch.zeros(b, j, dtype=torch.float64),
             **{n: getattr(layer, n).detach() for n in layer.parameter_names}}
    seed = 0x0123456789ABCDEF
    out = layer.compiled.forward(given, b, j, seed=seed, training=True)
    keep = dropout_keep_mask(seed, 1, np.arange(b * h * j * j).reshape(b, h, j, j), HEAVY_DROPOUT["attention"])
    assert np.array_equal(out["A_drop"].numpy() != 0, keep & (out["A"].numpy() != 0))


@pytest.mark.parametrize("stream, zeroed, ones", [(2, "linear2", "out_proj"), (4, "out_proj", "linear2")])
def test_numpy_hidden_dropout_masks_match_the_cpu_build(stream, zeroed, ones):
    """Rows of I = 300 draw their masks in chunks (256 + 44 elements). Pre-LN with one branch's output
    projection zeroed and the other's a constant 1 makes Y - X that branch's dropout output."""
    config = load_config("tiny").replace(layer_norm="pre", hidden_size=300, num_heads=3, ffn_size=40,
                                         dropout={"attention": 0.0, "hidden": 0.4, "activation": 0.0})
    layer = make_layer(config)
    b, j = 2, 7
    given = {"X": torch.randn(b, j, 300, dtype=torch.float64), "mask": torch.zeros(b, j, dtype=torch.float64),
             **{n: getattr(layer, n).detach() for n in layer.parameter_names}}
    for prefix, value in ((zeroed, 0.0), (ones, 1.0)):
        given[f"{prefix}_weight"] = torch.zeros_like(given[f"{prefix}_weight"])
        given[f"{prefix}_bias"] = torch.full_like(given[f"{prefix}_bias"], value)
    seed = 0xFEDCBA9876543210
    y = layer.compiled.forward(given, b, j, seed=seed, training=True)["Y"]
    keep = dropout_keep_mask(seed, stream, np.arange(b * j * 300).reshape(b, j, 300), 0.4)
    assert np.array_equal((y - given["X"]).numpy() != 0, keep)
    assert 0.5 < keep.mean() < 0.7


# -- the CPU emulation of the generated code -------------------------------------------------------
PHILOX_HARNESS = r"""
#include "substation_cuda.cuh"
template <int V> void run(uint64_t first) {
  sscuda::emu::state().philox_blocks = 0;
  uint32_t out[V];
  sscuda::random_bits_run<V>(0x0123456789ABCDEFull, 3u, first, out);
  const long long blocks = sscuda::emu::state().philox_blocks;
  int wrong = 0;
  for (int l = 0; l < V; ++l) wrong += out[l] != sscuda::random_bits(0x0123456789ABCDEFull, 3u, first + l);
  std::printf("%d %llu %lld %d\n", V, (unsigned long long)first, blocks, wrong);
}
int main() {
  for (uint64_t f : {0, 4, 8, 12, 1000}) run<4>(f);
  for (uint64_t f : {0, 4, 8, 16}) run<8>(f);
  run<4>(2);
  run<1>(5);
  return 0;
}
"""


@needs_emulation
def test_dropout_draws_each_philox_block_once(tmp_path):
    """A vector of V lanes draws the bits of V consecutive elements: one Philox block per 4 elements
    for float32 (V = 4), one per 8 for float16/bfloat16 (V = 8, an 8-aligned start), the same bits as
    the per-element draw (which the mask tests compare with numpy)."""
    cxx, _, incs = emulation_toolchain()
    (tmp_path / "philox.cpp").write_text(PHILOX_HARNESS)
    exe = tmp_path / "philox"
    subprocess.run([cxx, "-std=c++17", "-O1", "-DSS_EMULATE", f"-I{os.path.dirname(csrc_file('substation_cuda.cuh'))}",
                    *(f"-I{d}" for d in incs), str(tmp_path / "philox.cpp"), "-o", str(exe)], check=True)
    rows = [tuple(map(int, line.split())) for line in subprocess.run([str(exe)], capture_output=True, text=True,
                                                                      check=True).stdout.splitlines()]
    blocks = {(v, first): n for v, first, n, _ in rows}
    assert all(wrong == 0 for *_, wrong in rows)
    assert [blocks[4, f] for f in (0, 4, 8, 12, 1000)] == [1] * 5
    assert (blocks[8, 0], blocks[8, 8], blocks[8, 16], blocks[8, 4]) == (1, 1, 1, 2)  # 4: straddles two blocks
    assert blocks[4, 2] == 4 and blocks[1, 5] == 1  # unaligned: one block per element


@functools.lru_cache(maxsize=None)
def _emulated(config, fuse=True) -> CompiledLayer:
    fwd, bwd = _graphs(config, fuse)
    sources = {"forward": generate_cuda(fwd), "backward": generate_cuda(bwd)}
    built = build_cuda_libraries(sources, emulate=True)
    return CompiledLayer(config, CompiledGraph(fwd, built["forward"].path), CompiledGraph(bwd, built["backward"].path),
                         {k: v.seconds for k, v in built.items()}, sources)


def emulated_layer(config, fuse=True, seed=0) -> EncoderLayer:
    torch.manual_seed(seed)
    layer = EncoderLayer(_emulated(config, fuse))
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if name.startswith("norm") and "weight" in name else 0.0))
    return layer


def errors_vs_reference(layer, b=2, j=7, seed=1) -> dict:
    """Max relative error of the output, dX and every parameter gradient against the fp64 reference."""
    ref = reference_for(layer)
    layer.zero_grad()
    torch.manual_seed(seed)
    x = torch.randn(b, j, layer.config.hidden_size, dtype=torch.float64)
    mask = None
    if layer.config.mask != "none":
        mask = torch.zeros(b, j, dtype=torch.float64)
        mask[-1, j - 2:] = float("-inf")
    xl = x.to(layer.torch_dtype).detach().requires_grad_()
    y = layer(xl, None if mask is None else mask.to(layer.torch_dtype))
    dy = torch.randn(y.shape, dtype=torch.float64)
    y.backward(dy.to(y.dtype))
    xr = x.clone().requires_grad_()
    yr = ref(xr, mask)
    yr.backward(dy)

    def rel(a, r):
        return float((a.double() - r).abs().max() / r.abs().max())
    errs = {"Y": rel(y.detach(), yr.detach()), "dX": rel(xl.grad, xr.grad)}
    refp = dict(ref.named_parameters())
    errs.update({f"d{n}": rel(p.grad, refp[n].grad) for n, p in layer.named_parameters()})
    return errs


@needs_emulation
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_emulated_cuda_code_matches_reference(dtype):
    """J = 7: scalar rows of keys; J = 8: 16-byte vectors in the attention kernels too (same build)."""
    layer = emulated_layer(TINY.replace(dtype=dtype, dropout=NO_DROPOUT))
    assert layer.compiled.forward.target == "cuda-emulated"
    assert layer.compiled.forward.dtypes["layer_norm1_mean"] == (torch.float64 if dtype == "float64" else torch.float32)
    for j in (7, 8):
        errs = errors_vs_reference(layer, j=j)
        worst = max(errs, key=errs.get)
        assert errs[worst] < TOLERANCE[dtype], (j, worst, errs[worst])


@needs_emulation
@pytest.mark.parametrize("change", [dict(layer_norm="pre", mask="causal", activation="gelu_tanh"),
                                    dict(mask="none", activation="relu"), "unfused"],
                         ids=["pre-causal-gelu_tanh", "nomask-relu", "unfused"])
def test_emulated_variants(change):
    cfg = TINY.replace(dtype="float32", dropout=NO_DROPOUT)
    if change == "unfused":
        layer = emulated_layer(cfg, fuse=False)
    else:
        layer = emulated_layer(cfg.replace(**change))
    errs = errors_vs_reference(layer, j=8)
    assert max(errs.values()) < TOLERANCE["float32"], errs


@needs_emulation
def test_emulated_dropout_equals_the_cpu_build():
    """Same seed, same parameters: the CUDA code keeps exactly the elements the CPU build keeps, so
    outputs and gradients agree in training mode."""
    cfg = load_config("tiny").replace(dtype="float32", dropout=HEAVY_DROPOUT)
    cpu = make_layer(cfg)
    emu = emulated_layer(cfg.replace(target="cuda"))
    emu.load_state_dict(cpu.state_dict())
    b, j = 3, 8
    given = {"X": torch.randn(b, j, 16), "mask": torch.zeros(b, j),
             **{n: getattr(cpu, n).detach() for n in cpu.parameter_names}}
    out_c = cpu.compiled.forward(given, b, j, seed=77, training=True)
    out_e = emu.compiled.forward(given, b, j, seed=77, training=True)
    masked = [n for n in ("A_drop", "F1_drop") if n in out_c]
    assert masked
    for name in masked:
        assert torch.equal(out_c[name] == 0, out_e[name] == 0), name
    assert (out_c["Y"] - out_e["Y"]).abs().max() < 1e-5
    cpu.train(), emu.train()
    x = given["X"]
    grads = []
    for layer in (cpu, emu):
        xg = x.clone().requires_grad_()
        layer.zero_grad()
        torch.manual_seed(3)
        layer(xg).backward(torch.ones(b, j, 16))
        grads.append([xg.grad] + [p.grad for p in layer.parameters()])
    for gc, ge in zip(*grads):
        assert (gc - ge).abs().max() <= 1e-4 * gc.abs().max()


@needs_emulation
def test_half_layer_under_autocast_takes_float32():
    """A bfloat16 layer with float32 (master) parameters runs under autocast: inputs and parameters
    are cast, the output is float32, gradients reach the float32 parameters; without autocast the
    dtypes must match."""
    layer = emulated_layer(TINY.replace(dtype="bfloat16", dropout=NO_DROPOUT)).float()
    x = torch.randn(2, 7, 16, requires_grad=True)
    with pytest.raises(TypeError, match="hidden_states has dtype torch.float32 but the layer was compiled for torch.bfloat16"):
        layer(x)
    with pytest.raises(TypeError, match="parameter in_proj_weight is torch.float32"):
        layer(x.detach().bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.float32  # as PyTorch's layer returns under autocast
    y.sum().backward()
    assert x.grad.dtype == torch.float32 and x.grad.abs().sum() > 0
    assert all(p.grad is not None and p.grad.dtype == torch.float32 and p.grad.abs().sum() > 0
               for p in layer.parameters())
    ref = reference_for(layer)
    with torch.no_grad():
        yr = ref(x.double().detach())
    assert float((y.detach().double() - yr).abs().max() / yr.abs().max()) < TOLERANCE["bfloat16"]


# -- nvcc builds -----------------------------------------------------------------------------------
NVCC_CASES = [("tiny", "float32"), ("tiny", "float16"), ("tiny", "bfloat16"), ("bert-large-b8-l512", "float16")]


@pytest.fixture(scope="module")
def nvcc_layers(request):
    """Compile (through the pipeline and the build cache) the tiny layer in every float dtype and
    BERT-large in float16, forward and backward; report the compile times."""
    reason = nvcc_skip_reason()
    if reason:
        pytest.skip(reason)
    layers, lines = {}, []
    t0 = time.perf_counter()
    for name, dtype in NVCC_CASES:
        compiled = compile_layer(load_config(name).replace(target="cuda", dtype=dtype))
        layers[name, dtype] = compiled
        lines.append(f"{name} {dtype}: " + ", ".join(
            f"{k} {v:.1f} s" if v else f"{k} cached" for k, v in compiled.build_seconds.items()))
    tc = cuda_toolchain()
    text = (f"nvcc {tc.nvcc_version} ({TINY.cuda_arch}, cuBLAS {tc.cublas_version}) compile times: "
            + "; ".join(lines) + f"; wall {time.perf_counter() - t0:.1f} s")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line("")
            reporter.write_line(text)
    return layers


@needs_nvcc
def test_nvcc_libraries_link_and_load_without_gpu(nvcc_layers):
    tc = cuda_toolchain()
    for (name, dtype), compiled in nvcc_layers.items():
        for g in (compiled.forward, compiled.backward):
            assert g.target == "cuda" and g.device_type == "cuda"  # loaded by ctypes, signature checked
            needed = subprocess.run(["readelf", "-d", g.path], capture_output=True, text=True).stdout
            assert f"libcublas.so.{os.path.basename(tc.cublas_lib).split('.so.')[1]}" in needed
            assert "libcudart.so" in needed
            manifest = open(os.path.join(os.path.dirname(g.path), "manifest.json")).read()
            assert "code=sm_90" in manifest
            ws = g.lib.substation_workspace_bytes
            small, large = (ws((ctypes.c_int64 * 3)(b, j, j)) for b, j in ((1, 8), (8, 512)))
            assert 32 << 20 < small < large  # the cuBLAS workspace (32 MiB) is part of it
            assert b"SUBSTATION_CUDA_DEBUG" in open(g.path, "rb").read()
        assert compiled.forward.dtypes["layer_norm1_rstd"] == torch.float32


def test_launcher_debug_mode_and_shared_memory_attribute():
    """SUBSTATION_CUDA_DEBUG=1 synchronizes after every kernel and GEMM and names it in the error;
    cudaFuncSetAttribute runs once per kernel, device and larger size (the header's only call)."""
    header = open(csrc_file("substation_cuda.cuh")).read()
    assert header.count("cudaFuncSetAttribute(") == 1
    start = header.index("inline int reserve_smem(")
    reserve = header[start:header.index("inline int launch(const char* name", start)]
    assert "granted[{kern, device}]" in reserve and reserve.index("if (smem <= have) return 0;") < reserve.index(
        "cudaFuncSetAttribute(")
    launch = header[header.index("inline int launch(const char* name, void (*kern)(KA...), int64_t grid, int block, "
                                 "size_t smem, Stream stream,"):]
    assert "return debug_check(name, stream);" in launch[:launch.index("\n}\n")]
    assert "return debug_check(what, stream);" in header
    assert 'std::getenv("SUBSTATION_CUDA_DEBUG")' in header and "cudaStreamSynchronize(stream)" in header


def test_inference_build_writes_no_dropout_copy():
    """The eval-mode forward is the inference build: softmax writes A only (no A_drop, nothing saved)."""
    cfg = load_config("bert-large-b8-l512").replace(target="cuda", dtype="float16")
    fwd, bwd = compile_graphs(cfg, fuse_ops=True, mode="eval")
    src = generate_cuda(fwd)
    assert bwd is None and "A_drop" not in src and "random_bits" not in src.replace("sscuda::", "").split("namespace {")[1]
    assert re.search(r"// k\d+_MS: rows .* members: mask \(mask\), softmax \(softmax\)", src)


@needs_nvcc
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error path")
def test_running_without_gpu_is_a_clear_error(nvcc_layers):
    g = nvcc_layers["tiny", "float16"].forward
    sizes = (ctypes.c_int64 * 3)(2, 7, 7)
    ptrs = (ctypes.c_void_p * len(g.args))()
    rc = g._run(ptrs, sizes, None, 0, 0, None)  # fails in cudaGetDevice, before touching a pointer
    assert rc >= 200000
    g.lib.substation_last_error.restype = ctypes.c_char_p
    assert g.lib.substation_last_error().decode().startswith("cudaGetDevice: ")


@needs_nvcc
def test_cuda_layer_checks_devices(nvcc_layers):
    layer = EncoderLayer(nvcc_layers["tiny", "float16"])
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert {p.device.type for p in layer.parameters()} == {expected}
    assert all(p.dtype == torch.float16 for p in layer.parameters())
    hint = (r" \(move the layer and its inputs with \.cuda\(\)\)" if torch.cuda.is_available() else
            r"; this process has no CUDA device \(torch.cuda.is_available\(\) is False\): compile for target cpu")
    with pytest.raises(ValueError, match=r"this layer was compiled for CUDA; hidden_states is on cpu" + hint):
        layer(torch.randn(2, 7, 16, dtype=torch.float16))


@needs_nvcc
def test_cli_compile_target_cuda(nvcc_layers, tmp_path, capsys):
    from substation.cli import main
    yaml_text = open(os.path.join(configs_dir(), "tiny.yaml")).read()
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml_text.replace("dtype: float64", "dtype: float16").replace("target: cpu", "target: cuda"))
    out = tmp_path / "out"
    assert main(["compile", str(cfg), "--target", "cuda", "--cuda-arch", "sm_90", "--out", str(out),
                 "--repeats", "2"]) == 0
    text = capsys.readouterr().out
    assert "target=cuda (sm_90)" in text and "build: forward" in text
    assert sorted(os.listdir(out)) == [".substation-output", "backward.cu", "backward.sdfg", "backward.so",
                                       "forward.cu", "forward.sdfg", "forward.so", "report.json"]


@needs_nvcc
def test_nvcc_rejects_broken_source_without_caching(fresh_toolchain, tmp_path):
    with pytest.raises(BuildError, match="compiling broken failed"):
        build_cuda.build_cuda_library('#include "substation_cuda.cuh"\nthis is not CUDA', "broken")
    cache = tmp_path / "cache"
    assert [p for p in os.listdir(cache) if not p.startswith(".")] == []


@pytest.fixture(scope="module")
def bert_large_ptxas():
    """ptxas's register and spill report of the BERT-large forward and backward builds in float16,
    bfloat16 and float32 (one compilation per source, all at once)."""
    reason = nvcc_skip_reason()
    if reason:
        pytest.skip(reason)
    sources = {}
    for dtype in ("float16", "bfloat16", "float32"):
        fwd, bwd = _graphs(load_config("bert-large-b8-l512").replace(target="cuda", dtype=dtype))
        sources[dtype, "forward"], sources[dtype, "backward"] = generate_cuda(fwd), generate_cuda(bwd)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        futures = {key: pool.submit(ptxas_resources, src, "sm_90") for key, src in sources.items()}
        return {key: (sources[key], f.result()) for key, f in futures.items()}


@needs_nvcc
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_bert_large_kernels_spill_no_registers(bert_large_ptxas, dtype):
    """Launch bounds equal to the launched block size: ptxas spills nothing in any kernel entry."""
    for phase in ("forward", "backward"):
        src, resources = bert_large_ptxas[dtype, phase]
        row_kernels = src.count("template <int V, bool WARP>")
        sums = len(re.findall(r"^SS_KERNEL\(sscuda::kColBlock\) void k\d+_\w+_sum\d+\(", src, re.M))
        fills = [r for r in resources if r.name.startswith("sscuda::fill_batch_pointers<")]
        assert len(fills) == 1  # the pointer arrays of the attention GEMMs
        # V in {1, VMAX} x warp/block, plus the column sums
        assert len(resources) == 4 * row_kernels + sums + len(fills)
        assert all(r.registers > 0 for r in resources)
        spilled = [r for r in resources if r.spill_stores or r.spill_loads]
        assert not spilled, (phase, spilled)
