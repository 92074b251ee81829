#!/usr/bin/env python3
"""GPU check of Substation's CUDA target against what a GPU user runs: one command, one JSON file.

    python3 scripts/gpu_check.py --json gpu_check.json [--budget 330] [--quick] [--dry-run-cpu]

Sections, each time-boxed and recorded in the JSON whatever happens to the others (the JSON is
rewritten after every section, so a killed run keeps what it measured):

1. ``environment``: GPU, driver, torch, transformers, DaCe, nvcc, cuBLAS, compute-sanitizer.
2. ``build``: every Substation library the later sections load, compiled in parallel processes
   into the build cache (tiny layers in every dtype, BERT-large from a Hugging Face ``BertLayer``).
3. ``correctness`` (a subprocess, so that a GPU fault cannot take the benchmarks down): forward
   output, input gradient and all parameter gradients against the float64 ``ReferenceEncoderLayer``,
   next to float32 eager and eager in the layer's dtype (``BertLayer`` sdpa for BERT-large); masks,
   fully masked rows, the block-mode vector softmax (K >= 520), a side stream, the dropout masks of
   every site against the numpy Philox, training-mode numerics at the benchmarks' sequence lengths
   against the graph interpreter (``run_graph``, same Philox masks) in float64, float32 and the
   layer's dtype, and autocast with float32 master weights.
4. ``sanitizer``: ``compute-sanitizer`` memcheck and racecheck of tiny layers (run alongside 3).
5. ``benchmarks`` (a subprocess per shape and dtype): BERT-large forward+backward, training mode
   (dropout 0.1, padding mask), B=8 L=512 and B=96 L=128, float16 and bfloat16, pure and under
   autocast (float32 master weights): Substation, ``BertLayer`` (sdpa) eager and under
   ``torch.compile``, same weights (``EncoderLayer.from_hf``) and masks; medians over interleaved
   rounds (CUDA events), contraction TFLOP/s, fraction of the dense peak, peak memory, speedups.
6. ``profile``: one ``torch.profiler`` step of Substation at the first benchmark shape; per-kernel
   times next to the analysis' bytes per operator and their MUE.

``--dry-run-cpu`` runs the same path on the CPU with tiny sizes (Substation's CPU target, float32 and
float64 only; CUDA-only parts are skipped with the reason recorded). Exit status: 0 when every check
that ran passed, 1 otherwise, 2 when prerequisites are missing. docs/cuda.md, "The GPU check".
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import functools
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ProcessPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

SCHEMA = "substation-gpu-check/1"
#: NVIDIA H200 datasheet: dense (no sparsity) FP16/BF16 tensor-core peak, TFLOP/s; HBM3e bandwidth, bytes/s.
PEAK_TFLOPS = 989.0
PEAK_BANDWIDTH = 4.8e12
PEAK_SOURCE = "NVIDIA H200 datasheet: 989 TFLOP/s dense FP16/BF16 tensor core (1,979 with sparsity), 4.8 TB/s HBM3e"
NO_DROPOUT = {"attention": 0.0, "hidden": 0.0, "activation": 0.0}
HEAVY_DROPOUT = {"attention": 0.3, "hidden": 0.2, "activation": 0.25}
#: Relative max error allowed against float64 (or 4x that of eager in the same dtype, whichever is larger).
TOLERANCE = {"float64": 1e-10, "float32": 1e-4, "float16": 2e-2, "bfloat16": 8e-2}
ALL_DTYPES = ("float64", "float32", "float16", "bfloat16")
TRAIN_DROPOUT = 0.1


# -- what to run ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Setup:
    """The sizes and devices of one run.

    Attributes:
        dry_run: CPU instead of CUDA, tiny sizes. quick: fewer cases (a second try that must be short).
        arch: the ``cuda_arch`` of the builds (``sm_90`` on H100/H200).
    """

    dry_run: bool
    quick: bool
    arch: str = "sm_90"

    @property
    def device(self) -> str:
        """The torch device type the checks run on: ``cuda``, or ``cpu`` in a dry run."""
        return "cpu" if self.dry_run else "cuda"

    @property
    def bert(self) -> dict:
        """``BertConfig`` sizes of the large layer: BERT-large (I=1024, H=16, U=4096), tiny in a dry run."""
        if self.dry_run:
            return {"hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64}
        return {"hidden_size": 1024, "num_attention_heads": 16, "intermediate_size": 4096}

    @property
    def bench_shapes(self) -> tuple:
        """(B, L) of the benchmarks."""
        if self.dry_run:
            return ((2, 16),)
        return ((8, 512),) if self.quick else ((8, 512), (96, 128))

    @property
    def bench_dtypes(self) -> tuple:
        """Layer dtypes of the benchmarks (a dry run: float32, which its CPU build runs, and bfloat16 for
        the baselines' half paths unless quick)."""
        if self.dry_run:
            return ("float32",) if self.quick else ("float32", "bfloat16")
        return ("float16", "bfloat16")

    @property
    def train_shapes(self) -> tuple:
        """(B, J) of the training-mode numerics: the benchmarks' J, B cut so the float64 interpreter
        and the numpy Philox masks stay within seconds (B=24 > H=16 keeps B=96's GEMM batching)."""
        if self.dry_run:
            return ((2, 16),)
        return ((1, 512),) if self.quick else ((1, 512), (24, 128))

    @property
    def block_lengths(self) -> tuple:
        """Sequence lengths whose half-precision softmax rows run in block mode (> 64 vectors of 8)."""
        return (40,) if self.dry_run else ((1024,) if self.quick else (520, 1024))

    def runs(self, dtype: str) -> str | None:
        """None when Substation compiles ``dtype`` for this run's target, else why not."""
        if self.dry_run and dtype in ("float16", "bfloat16"):
            return ("dry run: the half-precision stages check CUDA builds (the CPU target has no float16; its "
                    "bfloat16 build is mixed precision, checked by tests/test_bf16.py)")
        return None

    def argv(self) -> list[str]:
        """The command-line flags that recreate this setup in a stage subprocess."""
        return (["--dry-run-cpu"] if self.dry_run else []) + (["--quick"] if self.quick else []) + ["--arch", self.arch]


def hf_layer(s: Setup, dtype, device: str, seed: int = 0, dropout: float = TRAIN_DROPOUT):
    """A ``transformers`` ``BertLayer`` (``attn_implementation="sdpa"``, GELU, eps 1e-12) of :attr:`Setup.bert`
    sizes, default initialisation from ``seed`` with biases and LayerNorm parameters randomised (so
    every gradient is exercised), in ``dtype`` on ``device``, train mode."""
    import torch
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer
    torch.manual_seed(seed)
    layer = BertLayer(BertConfig(**s.bert, hidden_act="gelu", hidden_dropout_prob=dropout,
                                 attention_probs_dropout_prob=dropout, layer_norm_eps=1e-12,
                                 attn_implementation="sdpa"))
    _randomize(layer)
    return layer.to(device, dtype).train()


def _randomize(module) -> None:
    import torch
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name.lower() and "weight" in name else 0.0))


def overrides(s: Setup, dtype: str) -> dict:
    """Config overrides that make ``EncoderLayer.from_hf`` build this run's target in ``dtype``."""
    return {"target": "cpu" if s.dry_run else "cuda", "dtype": dtype, "cuda_arch": s.arch}


@functools.lru_cache(maxsize=None)
def configs(s: Setup) -> dict:
    """name -> EncoderConfig of every build the checks use that this run's target compiles."""
    import torch

    from substation.config import load_config
    from substation.interop.families import layer_config
    tiny = load_config("tiny").replace(target="cpu" if s.dry_run else "cuda", dropout=NO_DROPOUT, cuda_arch=s.arch)
    hf32 = hf_layer(s, torch.float32, "cpu")
    makers = {f"tiny-{dt}": (dt, {}) for dt in ALL_DTYPES}
    makers["tiny-float32-pre-causal"] = ("float32", {"layer_norm": "pre", "mask": "causal", "activation": "gelu_tanh"})
    makers.update({f"tiny-{dt}-dropout": (dt, {"dropout": HEAVY_DROPOUT}) for dt in ("float32", "float16")})
    res = {n: tiny.replace(dtype=dt, **kw) for n, (dt, kw) in makers.items() if s.runs(dt) is None}
    res.update({f"bert-{dt}": layer_config(hf32, **overrides(s, dt)) for dt in ("float32", "float16", "bfloat16")
                if s.runs(dt) is None})
    return res


def substation_layer(s: Setup, name: str, seed: int = 0):
    """An ``EncoderLayer`` of tiny config ``name`` on the run's device, biases and norms randomised."""
    import torch

    from substation import EncoderLayer
    from substation.pipeline import cached_compile
    torch.manual_seed(seed)
    layer = EncoderLayer(cached_compile(configs(s)[name]))  # a CUDA build moves itself to the GPU
    _randomize(layer)
    return layer


# -- results ------------------------------------------------------------------------------------
def write_json(path: str, data: dict) -> None:
    """Write ``data`` to ``path`` atomically (a temporary file, then a rename)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def error_record(e: BaseException) -> dict:
    """The status and the end of the traceback of an exception, as a check or section record."""
    return {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}


def _rel(a, r) -> float:
    """max |a - r| / max |r| in float64 (NaN when ``a`` is not finite)."""
    a, r = a.detach().double().cpu().reshape(-1), r.detach().double().cpu().reshape(-1)
    if not bool(a.isfinite().all()):
        return math.nan
    return float((a - r).abs().max() / r.abs().max().clamp_min(1e-300))


def compare(tensors: dict, tol: float) -> dict:
    """Errors of Substation's tensors against float64 and the eager errors that bound them.

    Args:
        tensors: tensor name -> {``ours``, ``exact``, ``eager`` (same dtype), ``eager32`` (optional)}.
        tol: the dtype's tolerance; a tensor fails when its error exceeds max(tol, 4 x eager's).

    Returns:
        ``status``, ``max_error``, ``eager_max_error``, per-tensor ``errors`` / ``eager_errors`` /
        ``errors_vs_float32_eager`` and the ``failed`` names.
    """
    errors, eager, vs32, failed = {}, {}, {}, []
    for n, t in tensors.items():
        errors[n], eager[n] = _rel(t["ours"], t["exact"]), _rel(t["eager"], t["exact"])
        if t.get("eager32") is not None:
            vs32[n] = _rel(t["ours"], t["eager32"])
        bound = max(tol, 4 * eager[n]) if math.isfinite(eager[n]) else tol
        if not errors[n] <= bound:
            failed.append(n)
    return {"status": "failed" if failed else "passed", "tolerance": tol,
            "max_error": max(errors.values()), "eager_max_error": max(eager.values()), "failed": failed,
            "errors": errors, "eager_errors": eager, "errors_vs_float32_eager": vs32}


# -- correctness checks (run in the correctness subprocess) -------------------------------------
def _step(module, call, x, dy, grads) -> dict:
    """Forward+backward of ``call(module, x)``: {``Y``, ``dX``, ``d<parameter>``} in Substation's names."""
    xg = x.detach().clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    y = call(module, xg)
    y.backward(dy.to(y.dtype))
    return {"Y": y.detach(), "dX": xg.grad, **grads(module)}


def _substation_grads(m) -> dict:
    return {f"d{n}": getattr(m, n).grad for n in m.parameter_names}


def _reference_grads(m) -> dict:
    return {f"d{n}": p.grad for n, p in m.named_parameters()}


def _hf_grads(m) -> dict:
    """A BertLayer's gradients under Substation's names (Q, K, V stacked as ``in_proj_*``)."""
    import torch

    from substation.interop.families import FAMILIES
    return {f"d{n}": torch.cat([m.get_parameter(p).grad.reshape(-1) for p in paths])
            for n, paths in FAMILIES[0].paths.items()}


def _masks(b: int, j: int, dtype, device, dead_row: bool):
    """(bool attend [B, K] (True = attend), additive [B, K] of ``dtype``): the benchmarks' padding,
    with the last sequence fully padded when ``dead_row``."""
    import torch

    from substation.perf.baselines import padded_positions
    pad = padded_positions(b, j)
    if dead_row:
        pad[-1] = True
    add = torch.zeros(b, j, dtype=dtype).masked_fill_(pad, float("-inf"))
    return (~pad).to(device), add.to(device)


def check_numerics(s: Setup, name: str, b: int, j: int, dead_row: bool = False, side_stream: bool = True) -> dict:
    """Eval mode (dropout off), padding mask: Y, dX and every parameter gradient of Substation's layer
    against the float64 reference, next to eager in the layer's dtype and in float32 (``BertLayer``
    sdpa for the ``bert-*`` configs; the reference layer for tiny ones and for fully masked rows,
    where sdpa gives NaN and Substation zero probabilities); optionally again on a side stream."""
    import torch

    from substation import EncoderLayer
    from substation.reference import ReferenceEncoderLayer
    dev = s.device
    cfg_dtype = name.split("-")[1]
    dt = getattr(torch, cfg_dtype)
    if name.startswith("bert-"):
        hf = hf_layer(s, dt, dev).eval()
        layer = EncoderLayer.from_hf(hf, **overrides(s, cfg_dtype)).eval()
    else:
        layer = substation_layer(s, name).eval()
        hf = None
    cfg = layer.config
    attend, add = _masks(b, j, torch.float64, dev, dead_row)
    if cfg.mask == "none":
        attend = add = None

    def call_sub(m, x):
        return m(x, None if attend is None else attend)

    def call_ref(m, x):
        return m(x, None if add is None else add.to(x.dtype))

    def call_hf(m, x):
        return m(x, attend[:, None, None, :])

    def ref(dtype):
        r = ReferenceEncoderLayer(cfg, dtype).to(dev).eval()
        r.load_state_dict({k: v.to(dtype) for k, v in layer.state_dict().items()})
        return r
    torch.manual_seed(1)
    x = torch.randn(b, j, cfg.hidden_size, dtype=torch.float64, device=dev)
    dy = torch.randn_like(x)
    ours = _step(layer, call_sub, x.to(dt), dy, _substation_grads)
    exact = _step(ref(torch.float64), call_ref, x, dy, _reference_grads)
    if hf is not None and not dead_row:
        eager = _step(hf, call_hf, x.to(dt), dy, _hf_grads)
        eager32 = _step(copy.deepcopy(hf).float(), call_hf, x.float(), dy, _hf_grads)
        eager_label = "transformers BertLayer (sdpa)"
    else:
        eager = _step(ref(dt), call_ref, x.to(dt), dy, _reference_grads)
        eager32 = _step(ref(torch.float32), call_ref, x.float(), dy, _reference_grads)
        eager_label = "substation.reference.ReferenceEncoderLayer"
    res = compare({n: {"ours": ours[n], "exact": exact[n], "eager": eager[n], "eager32": eager32[n]} for n in ours},
                  TOLERANCE[cfg.dtype])
    res["eager"] = eager_label
    if dead_row:  # the values themselves are checked against the reference's zero probabilities above
        res["dead_rows_finite"] = all(bool(t.isfinite().all()) for t in ours.values())
        if not res["dead_rows_finite"]:
            res["status"] = "failed"
    if side_stream:
        if dev == "cuda":
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                again = _step(layer, call_sub, x.to(dt), dy, _substation_grads)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            res["side_stream_bitwise_identical"] = all(torch.equal(ours[n], again[n]) for n in ours)
            side_res = compare({n: {"ours": again[n], "exact": exact[n], "eager": eager[n]} for n in ours},
                               TOLERANCE[cfg.dtype])
            res["side_stream"] = {k: side_res[k] for k in ("status", "max_error", "failed")}
            if side_res["status"] != "passed":
                res["status"] = "failed"
        else:
            res["side_stream"] = {"status": "skipped", "reason": "dry run: no CUDA streams"}
    return res


def check_dropout(s: Setup, name: str, b: int, j: int, seed: int = 0x0123456789ABCDEF) -> dict:
    """Training-mode forward of the compiled layer with X = 0 and the first norm's weight and bias 0, so
    that the saved sums are the dropout outputs of the hidden sites (R1 = attention-output dropout,
    R2 = feed-forward-output dropout): the elements kept at every site (attention, activation,
    attention output, feed-forward output) equal those of the numpy Philox
    (:func:`substation.ops.dropout.dropout_keep_mask`); kept attention probabilities are scaled."""
    import numpy as np
    import torch

    from substation import EncoderLayer
    from substation.ir.graph import DROPOUT_SITES
    from substation.ops.dropout import dropout_constants, dropout_keep_mask
    if name.startswith("bert-"):
        dt = name.split("-")[1]
        layer = EncoderLayer.from_hf(hf_layer(s, getattr(torch, dt), s.device), **overrides(s, dt))
    else:
        layer = substation_layer(s, name)
    compiled, cfg = layer.compiled, layer.config
    sizes = cfg.sizes(b, j)
    given = {n: getattr(layer, n).detach().clone() for n in layer.parameter_names}
    given["norm1_weight"].zero_()
    given["norm1_bias"].zero_()
    given["X"] = torch.zeros(b, j, cfg.hidden_size, device=s.device, dtype=layer.torch_dtype)
    given["mask"] = torch.zeros(b, j, device=s.device, dtype=compiled.forward.dtypes.get("mask", layer.torch_dtype))
    out = compiled.forward(given, b, j, seed=seed, training=True)
    # site -> (the tensor holding its output, the tensor it drops from; when that is not saved, a
    # kept element is any element of a column that is nonzero somewhere)
    where = {"attention_dropout": ("A_drop", "A"), "activation_dropout": ("F1_drop", "F1_act"),
             "out_dropout": ("R1", "O"), "ffn_dropout": ("R2", "F2")}
    sites, ok = {}, True
    for site, (tensor, before) in where.items():
        field, stream, dims = DROPOUT_SITES[site]
        p = cfg.dropout.probability(field)
        if p == 0.0:
            continue
        if tensor not in out:
            sites[site] = {"status": "skipped", "reason": f"{tensor} is not among the forward's outputs"}
            continue
        shape = [sizes[d] for d in dims]
        keep = dropout_keep_mask(seed, stream, np.arange(int(np.prod(shape))).reshape(shape), p)
        got_t = out[tensor].float().cpu().reshape(shape)
        got = got_t.numpy() != 0
        if before in out:
            src = out[before].float().cpu().reshape(shape)
            expected = keep & (src.numpy() != 0)
            kept = torch.from_numpy(expected)
            scale_ok = bool(torch.allclose(got_t[kept], src[kept] * dropout_constants(p)[1],
                                           rtol=1e-5 if cfg.dtype == "float32" else 1e-2, atol=0))
        else:
            expected = keep & got.reshape(-1, shape[-1]).any(0).reshape([1] * (len(shape) - 1) + [shape[-1]])
            scale_ok = None
        same = bool(np.array_equal(got, expected))
        sites[site] = {"stream": stream, "p": p, "mask_identical": same, "mismatches": int((got != expected).sum()),
                       "kept_fraction": float(got.mean()), "scaled_by_1_over_keep": scale_ok}
        ok = ok and same and scale_ok is not False
    return {"status": "passed" if ok and sites else "failed", "sites": sites}


def check_training(s: Setup, name: str, b: int, j: int, seed: int = 0x5EED) -> dict:
    """Training mode (dropout 0.1 at every BERT site) at a benchmark sequence length: the compiled
    layer's forward and backward (one seed) against the graph interpreter (``run_graph`` on the
    unfused graphs, the same Philox masks) in float64, float32 and the layer's dtype, all on the
    run's device, with the padding mask."""
    import torch

    from substation import EncoderLayer
    from substation.pipeline import compile_graphs
    from substation.reference import run_graph
    from substation.runtime import key_mask
    dt = name.split("-")[1]
    layer = EncoderLayer.from_hf(hf_layer(s, getattr(torch, dt), s.device), **overrides(s, dt)).train()
    compiled, cfg = layer.compiled, layer.config
    attend, _ = _masks(b, j, torch.float64, s.device, False)
    torch.manual_seed(2)
    x = torch.randn(b, j, cfg.hidden_size, dtype=torch.float64, device=s.device)
    dy = torch.randn_like(x)
    given = {"X": x.to(layer.torch_dtype), **{n: getattr(layer, n).detach() for n in layer.parameter_names},
             "mask": key_mask(attend, True, b, j, compiled.forward.dtypes.get("mask", layer.torch_dtype))}
    out = compiled.forward(given, b, j, seed=seed, training=True)
    saved = {**given, **out}
    grads = compiled.backward({**{n: saved[n] for n in compiled.saved_names}, "dY": dy.to(layer.torch_dtype)},
                              b, j, seed, True)
    fwd, bwd = compile_graphs(cfg.replace(dtype="float64", target="cpu"), fuse_ops=False)
    names = ["dX"] + [f"d{n}" for n in layer.parameter_names]
    sizes = cfg.sizes(b, j)

    def interpreted(dtype):
        g = {n: given[n].to(dtype).reshape([sizes[d] for d in t.dims]) for n, t in fwd.tensors.items()
             if t.role in ("param", "input")}
        env = run_graph(fwd, g, seed, True)
        genv = run_graph(bwd, {**{n: env[n] for n, t in bwd.tensors.items() if t.role in ("saved", "param")},
                               "dY": dy.to(dtype)}, seed, True)
        return {"Y": env["Y"], **{n: genv[n] for n in names}}
    exact, eager32 = interpreted(torch.float64), interpreted(torch.float32)
    eager = interpreted(layer.torch_dtype) if layer.torch_dtype != torch.float32 else eager32
    ours = {"Y": out["Y"], **{n: grads[n] for n in names}}
    res = compare({n: {"ours": ours[n], "exact": exact[n], "eager": eager[n], "eager32": eager32[n]} for n in ours},
                  TOLERANCE[cfg.dtype])
    res.update(eager="substation.reference.run_graph (same Philox masks)", dropout=TRAIN_DROPOUT, seed=seed)
    return res


def check_autocast(s: Setup, name: str, b: int, j: int) -> dict:
    """A half layer with float32 master weights under ``torch.autocast``: its output dtype, float32
    parameter gradients, and Y and dX against float64 (tolerance twice the dtype's)."""
    import torch

    from substation import EncoderLayer
    from substation.reference import ReferenceEncoderLayer
    dt = name.split("-")[1]
    hf32 = hf_layer(s, torch.float32, s.device).eval()
    layer = EncoderLayer.from_hf(hf32, **overrides(s, dt)).float().eval()
    ref = ReferenceEncoderLayer(layer.config, torch.float64).to(s.device).eval()
    ref.load_state_dict({k: v.double() for k, v in layer.state_dict().items()})
    attend, add = _masks(b, j, torch.float64, s.device, False)
    x = torch.randn(b, j, layer.config.hidden_size, device=s.device, requires_grad=True)
    with torch.autocast(s.device, dtype=layer.torch_dtype):
        y = layer(x, attend)
    y.float().sum().backward()
    xr = x.detach().double().requires_grad_()
    yr = ref(xr, add)
    yr.sum().backward()
    grads_ok = all(p.grad is not None and p.grad.dtype == torch.float32 and bool(p.grad.isfinite().all())
                   for p in layer.parameters())
    tol = 2 * TOLERANCE[layer.config.dtype]
    errors = {"Y": _rel(y.float(), yr), "dX": _rel(x.grad, xr.grad)}
    ok = grads_ok and y.dtype == layer.torch_dtype and all(e <= tol for e in errors.values())
    return {"status": "passed" if ok else "failed", "output_dtype": str(y.dtype), "errors": errors,
            "max_error": max(errors.values()), "tolerance": tol, "float32_parameter_gradients": grads_ok}


def correctness_cases(s: Setup) -> list[tuple]:
    """(kind, function, config name, B, J, keyword arguments) of every correctness check, in order."""
    lengths = (8, 33) if s.quick or s.dry_run else (7, 8, 33, 64)
    cases = [("numerics", check_numerics, f"tiny-{dt}", 2 + (jj % 2), jj, {}) for dt in ALL_DTYPES for jj in lengths]
    cases += [("numerics", check_numerics, "tiny-float32-pre-causal", 2, jj, {}) for jj in (8, 33)]
    large = ((2, 16),) if s.dry_run else ((2, 64),) if s.quick else ((2, 64), (1, 203))
    cases += [("numerics", check_numerics, f"bert-{dt}", b, jj, {}) for dt in ("float32", "float16", "bfloat16")
              for b, jj in large]
    cases += [("masked_rows", check_numerics, n, 3, jj, {"dead_row": True, "side_stream": False})
              for n, jj in (("tiny-float32", 8), ("tiny-float16", 33), ("bert-float16", 64 if not s.dry_run else 16),
                            ("bert-float32", 64 if not s.dry_run else 16))]
    cases += [("block_softmax", check_numerics, f"bert-{dt}", 1, jj, {"side_stream": False})
              for dt in ("float16", "bfloat16", "float32") for jj in s.block_lengths]
    cases += [("dropout_masks", check_dropout, n, b, jj, {})
              for n, b, jj in (("tiny-float32-dropout", 3, 33), ("tiny-float16-dropout", 2, 64),
                               ("bert-float16", 2, 128 if not s.dry_run else 16),
                               ("bert-float32", 2, 128 if not s.dry_run else 16))]
    train_dtypes = ("float32",) if s.dry_run else ("float16", "bfloat16")
    cases += [("training", check_training, f"bert-{dt}", b, jj, {}) for dt in train_dtypes for b, jj in s.train_shapes]
    cases += [("autocast", check_autocast, f"bert-{dt}", 2, 64, {}) for dt in ("float16", "bfloat16")]
    return cases


def correctness_stage(s: Setup, part: str, deadline: float) -> None:
    """Run :func:`correctness_cases` in order, the part file rewritten after each; a check that raises is
    recorded as an error, checks past ``deadline`` (epoch seconds) are skipped."""
    built = set(configs(s))
    results = []
    for kind, fn, name, b, j, kw in correctness_cases(s):
        rec = {"kind": kind, "config": name, "B": b, "J": j, **{k: v for k, v in kw.items() if k == "dead_row"}}
        dtype = name.split("-")[1]
        t0 = time.perf_counter()
        if s.runs(dtype):
            rec.update(status="skipped", reason=s.runs(dtype))
        elif name not in built:
            rec.update(status="skipped", reason=f"no build {name}")
        elif time.time() > deadline:
            rec.update(status="skipped", reason="time box of the correctness section used up")
        else:
            try:
                rec.update(fn(s, name, b, j, **kw))
            except Exception as e:  # noqa: BLE001 - recorded; the next check runs
                rec.update(error_record(e))
        rec["seconds"] = round(time.perf_counter() - t0, 2)
        results.append(rec)
        write_json(part, {"checks": results})


# -- compute-sanitizer (a subprocess under the tool) --------------------------------------------
def sanitize_stage(s: Setup, part: str) -> None:
    """What runs under compute-sanitizer: forward+backward in training mode of tiny layers whose
    softmax rows take warp and block mode, vector and scalar paths (J = 8, 33, 520)."""
    import torch
    runs = []
    for name, b, j in (("tiny-float16-dropout", 2, 8), ("tiny-float16-dropout", 1, 520),
                       ("tiny-float32-dropout", 2, 33), ("tiny-bfloat16", 2, 64)):
        layer = substation_layer(s, name).train()
        attend, _ = _masks(b, j, torch.float64, s.device, True)
        x = torch.randn(b, j, layer.config.hidden_size, device=s.device, dtype=layer.torch_dtype, requires_grad=True)
        layer(x, attend).float().sum().backward()
        if s.device == "cuda":
            torch.cuda.synchronize()
        runs.append({"config": name, "B": b, "J": j, "finite": bool(x.grad.isfinite().all())})
        write_json(part, {"runs": runs})


def sanitizer_commands(s: Setup, parts: str) -> dict:
    """tool -> (argv, part file) of the compute-sanitizer runs, or tool -> reason when they cannot run."""
    if s.dry_run:
        return {t: "dry run: no GPU" for t in ("memcheck", "racecheck")}
    exe = shutil.which("compute-sanitizer")
    if exe is None:
        from substation.backends.cuda.build import cuda_toolchain
        candidate = os.path.join(os.path.dirname(cuda_toolchain().nvcc), "compute-sanitizer")
        exe = candidate if os.path.exists(candidate) else None
    if exe is None:
        return {t: "compute-sanitizer not found (next to nvcc or on PATH)" for t in ("memcheck", "racecheck")}
    res = {}
    for tool in ("memcheck", "racecheck"):
        part = os.path.join(parts, f"sanitize-{tool}.json")
        res[tool] = ([exe, "--tool", tool, "--error-exitcode", "99", "--print-limit", "20",
                      sys.executable, os.path.abspath(__file__), "--stage", "sanitize", "--part", part, *s.argv()], part)
    return res


# -- benchmarks -------------------------------------------------------------------------------------
def contraction_gflop(config, b: int, l: int) -> float:
    """Contraction GFLOP of one forward+backward at (B, L) (:mod:`substation.perf.analysis`)."""
    from substation.perf.analysis import analyze
    return analyze(config.replace(batch_size=b, max_seq_len=l)).contraction_flop()["total"] / 1e9


def _timer(s: Setup, fn):
    """A callable that runs ``fn()`` and returns ``(milliseconds,)``: CUDA events on the GPU, wall clock on the CPU."""
    import torch

    def timed():
        if s.device == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            return (start.elapsed_time(stop),)
        t0 = time.perf_counter()
        fn()
        return ((time.perf_counter() - t0) * 1e3,)
    return timed


def bench_stage(s: Setup, part: str, b: int, l: int, dtype: str, deadline: float, rounds: int,
                compile_estimate: float, profile_dtype: str | None = None) -> None:
    """One benchmark case: BERT-large forward+backward at (B, L), training mode, padding mask, layer
    dtype ``dtype``; modes ``pure`` (every module in ``dtype``) and, for half dtypes, ``autocast``
    (float32 master weights under ``torch.autocast``). Per mode: Substation (``EncoderLayer.from_hf``),
    ``BertLayer`` (sdpa) eager and under ``torch.compile(dynamic=False)`` (skipped when less than
    ``compile_estimate`` seconds are left before ``deadline``). Timing: 3 warm-up steps, then
    ``rounds`` interleaved rounds (:func:`substation.perf.timing.interleaved_rounds`). Then, with
    ``profile_dtype``, :func:`profile_step` (after the timing, so it cannot disturb it)."""
    import torch

    from substation import EncoderLayer
    from substation.interop.families import layer_config
    from substation.perf.timing import interleaved_rounds, sample_stats
    torch.backends.cuda.matmul.allow_tf32 = False
    dev, dt = s.device, getattr(torch, dtype)
    res = {"B": b, "L": l, "dtype": dtype, "modes": {}}
    hf32 = hf_layer(s, torch.float32, dev)
    res["gflop"] = gflop = contraction_gflop(layer_config(hf32), b, l)
    torch.manual_seed(3)
    x = torch.randn(b, l, hf32.attention.self.query.in_features, device=dev)
    dys = {}
    attend, _ = _masks(b, l, torch.float32, dev, False)
    mask4 = attend[:, None, None, :]
    modes = ["pure"] + (["autocast"] if dtype in ("float16", "bfloat16") else [])
    steps = {}
    for mode in modes:
        hf = copy.deepcopy(hf32).to(dt) if mode == "pure" else hf32
        xin = x.to(dt) if mode == "pure" else x
        ctx = (lambda: contextlib.nullcontext()) if mode == "pure" else (lambda: torch.autocast(dev, dtype=dt))
        if s.runs(dtype):
            cands = {}
            res["modes"].setdefault(mode, {})["substation"] = {"status": "skipped", "reason": s.runs(dtype)}
        else:
            sub = EncoderLayer.from_hf(hf, **overrides(s, dtype))
            cands = {"substation": ((sub if mode == "pure" else sub.float()).train(), lambda m, t: m(t, attend))}
        cands["eager"] = (hf, lambda m, t: m(t, mask4))
        cands["compile"] = (hf, None)
        for impl, (module, call) in cands.items():
            key = f"{mode}/{impl}"
            if impl == "compile":
                left = deadline - time.time()
                if left < compile_estimate:
                    res["modes"].setdefault(mode, {})[impl] = {
                        "status": "skipped", "reason": f"time box: {left:.0f} s left, torch.compile needs ~{compile_estimate:.0f} s"}
                    continue
                compiled = torch.compile(module, dynamic=False, backend="eager" if s.dry_run else "inductor")
                module, call = compiled, (lambda m, t: m(t, mask4))

            def step(module=module, call=call, ctx=ctx, xin=xin):
                for p in module.parameters():
                    p.grad = None
                xg = xin.detach().requires_grad_()
                with ctx():
                    y = call(module, xg)
                y = y[0] if isinstance(y, tuple) else y
                if y.dtype not in dys:
                    dys[y.dtype] = torch.randn(b, l, x.shape[-1], device=dev, generator=torch.Generator(dev).manual_seed(4)).to(y.dtype)
                y.backward(dys[y.dtype])
            rec = res["modes"].setdefault(mode, {})[impl] = {"status": "passed"}
            try:
                t0 = time.perf_counter()
                _timer(s, step)()
                rec["first_step_seconds"] = round(time.perf_counter() - t0, 2)
                for _ in range(2):
                    step()
                if dev == "cuda":
                    for p in module.parameters():  # its own gradients are part of the step's peak
                        p.grad = None
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    step()
                    torch.cuda.synchronize()
                    rec["peak_memory_gib"] = round((torch.cuda.max_memory_allocated() - base) / 2 ** 30, 3)
                else:
                    rec["peak_memory_gib"] = None
                steps[key] = _timer(s, step)
            except Exception as e:  # noqa: BLE001 - recorded; the other candidates run
                rec.update(error_record(e))
            write_json(part, res)
    rounds_done = interleaved_rounds(steps, rounds) if steps else {}
    for key, samples in rounds_done.items():
        mode, impl = key.split("/")
        st = sample_stats([t for (t,) in samples])
        rec = res["modes"][mode][impl]
        rec.update(median_ms=st["median"], q1_ms=st["q1"], q3_ms=st["q3"], min_ms=st["min"], rounds=rounds,
                   tflops=gflop / st["median"])
        rec["fraction_of_peak"] = None if s.dry_run else rec["tflops"] / PEAK_TFLOPS
    for mode, impls in res["modes"].items():  # baseline time / Substation's
        sub = impls.get("substation", {}).get("median_ms")
        res.setdefault("speedups", {})[mode] = {
            f"speedup_vs_{base}": impls[base]["median_ms"] / sub if sub and impls.get(base, {}).get("median_ms") else None
            for base in ("eager", "compile")}
    res["status"] = "done"
    write_json(part, res)
    if profile_dtype and s.runs(profile_dtype) is None:
        try:  # bounded by the process' time box, which the driver extends for it
            res["profile"] = profile_step(s, b, l, profile_dtype)
        except Exception as e:  # noqa: BLE001 - recorded; the benchmark's results stand
            res["profile"] = error_record(e)
        write_json(part, res)


# -- profile ------------------------------------------------------------------------------------
_KERNEL = re.compile(r"\bk\d+_([A-Za-z0-9_]+?)(?:<|\(|$)")


def profile_step(s: Setup, b: int, l: int, dtype: str) -> dict:
    """One training step of Substation (pure ``dtype``) under ``torch.profiler``: device time per kernel,
    the row kernels (``k<index>_<operator>``) matched to the analysis' operators with their bytes and
    MUE (bytes / (kernel time x peak bandwidth)); cuBLAS and other kernels summed separately."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from substation import EncoderLayer
    from substation.perf.analysis import analyze
    dt = getattr(torch, dtype)
    layer = EncoderLayer.from_hf(hf_layer(s, dt, s.device), **overrides(s, dtype)).train()
    attend, _ = _masks(b, l, torch.float32, s.device, False)
    x = torch.randn(b, l, layer.config.hidden_size, device=s.device, dtype=dt, requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        layer.zero_grad(set_to_none=True)
        layer(x, attend).backward(dy)
    for _ in range(3):
        step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if s.device == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        if s.device == "cuda":
            torch.cuda.synchronize()
    kernels = {}
    for evt in prof.key_averages():
        us = getattr(evt, "device_time_total", 0.0) if s.device == "cuda" else evt.cpu_time_total
        if us and (s.device == "cpu" or evt.device_type == torch.autograd.DeviceType.CUDA):
            kernels[evt.key] = {"calls": evt.count, "us": us}
    ana = analyze(layer.config.replace(batch_size=b, max_seq_len=l), optimized=True)
    ops, matched = [], set()
    for o in ana.operators:
        names = [k for k in kernels if (m := _KERNEL.search(k)) and m.group(1) == o.name]
        matched.update(names)
        us = sum(kernels[k]["us"] for k in names) if names else None
        ops.append({"operator": o.name, "pass": o.phase, "class": o.op_class, "bytes": o.bytes, "flop": o.flop,
                    "kernel_us": us, "achieved_gb_s": o.bytes / us / 1e3 if us else None,
                    "mue": o.bytes / (us * 1e-6 * PEAK_BANDWIDTH) if us and not s.dry_run else None})
    others = {k: v for k, v in kernels.items() if k not in matched}
    top = sorted(others.items(), key=lambda kv: -kv[1]["us"])[:15]
    return {"B": b, "L": l, "dtype": dtype, "status": "done", "operators": ops,
                      "total_kernel_us": sum(v["us"] for v in kernels.values()) if s.device == "cuda" else None,
                      "matched_kernel_us": sum(kernels[k]["us"] for k in matched),
                      "other_kernels": [{"name": k[:160], **v} for k, v in top],
                      "peak_bandwidth_bytes_per_s": PEAK_BANDWIDTH,
                      "note": "CPU: the profiler sees the custom operators, not kernels" if s.dry_run else None}


# -- environment and builds (in the driver) --------------------------------------------------------
def environment(s: Setup) -> dict:
    """Versions of everything the check depends on; ``missing`` lists what stops the run."""
    env = {"python": sys.version.split()[0], "platform": platform.platform(), "host_cpus": os.cpu_count(), "missing": []}
    for mod in ("torch", "numpy", "transformers", "dace", "substation"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001 - reported
            env["missing"].append(f"{mod}: {type(e).__name__}: {e}")
    if "torch" in env:
        import torch
        env["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            env["gpu"] = {"name": p.name, "capability": f"{p.major}.{p.minor}", "sms": p.multi_processor_count,
                          "memory_gib": round(p.total_memory / 2 ** 30, 1)}
        elif not s.dry_run:
            env["missing"].append("torch sees no CUDA GPU")
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,power.limit",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        env["nvidia_smi"] = out.stdout.strip() or out.stderr.strip()
    except (OSError, subprocess.SubprocessError) as e:
        env["nvidia_smi"] = f"unavailable: {e}"
    if not s.dry_run and "substation" in env:
        try:
            from substation.backends.cuda.build import cuda_toolchain
            tc = cuda_toolchain()
            env["nvcc"] = {"path": tc.nvcc, "version": tc.nvcc_version}
            env["cublas"] = {"include": tc.cublas_include, "library": tc.cublas_lib, "version": tc.cublas_version}
            tc.require_cublas()
        except Exception as e:  # noqa: BLE001 - reported
            env["missing"].append(f"CUDA toolchain: {type(e).__name__}: {e}")
    return env


def _build_one(item) -> tuple:
    """(name, record) of compiling one config into the build cache (runs in a worker process)."""
    name, config = item
    from substation.pipeline import compile_layer
    t0 = time.perf_counter()
    try:
        compile_layer(config)
        return name, {"status": "passed", "seconds": round(time.perf_counter() - t0, 1)}
    except Exception as e:  # noqa: BLE001 - recorded; the other builds go on
        return name, error_record(e)


def build_section(s: Setup, timeout: float) -> dict:
    """Compile every config of :func:`configs` in parallel worker processes (up to 16), time-boxed."""
    import multiprocessing
    from concurrent.futures import TimeoutError as FutureTimeout
    t0 = time.perf_counter()
    items = sorted(configs(s).items(), key=lambda kv: not kv[0].startswith("bert"))  # the long builds first
    res = {"libraries": {}, "jobs": min(16, os.cpu_count() or 1, len(items))}
    pool = ProcessPoolExecutor(res["jobs"], mp_context=multiprocessing.get_context("spawn"))
    futures = {pool.submit(_build_one, it): it[0] for it in items}
    for fut, name in futures.items():
        try:
            res["libraries"][name] = fut.result(timeout=max(1.0, t0 + timeout - time.perf_counter()))[1]
        except FutureTimeout:
            res["libraries"][name] = {"status": "error", "error": f"not built within the {timeout:.0f} s time box"}
    pool.shutdown(wait=False, cancel_futures=True)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    res["status"] = "passed" if all(r["status"] == "passed" for r in res["libraries"].values()) else "failed"
    return res


def run_stage(args: list[str], part: str, timeout: float, env: dict | None = None) -> dict:
    """Run this script's ``--stage`` in a fresh Python, at most ``timeout`` seconds; its part file plus
    how the process ended (``process``)."""
    t0 = time.perf_counter()
    cmd = [sys.executable, os.path.abspath(__file__), *args, "--part", part]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1.0, timeout), env=env)
        status = {"returncode": proc.returncode, "output_tail": (proc.stdout + proc.stderr)[-3000:]}
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"") + (e.stderr or b"")
        status = {"returncode": None, "timed_out_after_s": round(timeout),
                  "output_tail": out.decode(errors="replace")[-3000:] if isinstance(out, bytes) else str(out)[-3000:]}
    try:
        with open(part) as f:
            data = json.load(f)
    except (OSError, ValueError):
        data = {}
    data["process"] = {**status, "seconds": round(time.perf_counter() - t0, 1)}
    return data


def sanitizer_result(tool: str, proc: subprocess.Popen | None, part: str, reason: str | None, timeout: float) -> dict:
    """The record of one compute-sanitizer run (``status`` passed when it reported no error and the
    workload finished), waiting for it at most ``timeout`` seconds."""
    if proc is None:
        return {"tool": tool, "status": "skipped", "reason": reason}
    try:
        out, _ = proc.communicate(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        return {"tool": tool, "status": "skipped", "reason": "time box used up before the run finished",
                "output_tail": out[-2000:]}
    summary = re.findall(r"ERROR SUMMARY: (\d+) error", out) or re.findall(r"RACECHECK SUMMARY: (\d+) hazard", out)
    try:
        with open(part) as f:
            runs = json.load(f).get("runs", [])
    except (OSError, ValueError):
        runs = []
    ok = proc.returncode == 0 and len(runs) == 4 and all(r["finite"] for r in runs)
    return {"tool": tool, "status": "passed" if ok else "failed", "returncode": proc.returncode,
            "errors_reported": int(summary[-1]) if summary else None, "runs": runs, "output_tail": out[-2000:]}


# -- summary ------------------------------------------------------------------------------------
def _fmt(v, spec: str = ".3g") -> str:
    """``v`` formatted with ``spec``, ``-`` for None."""
    return "-" if v is None else format(v, spec)


def summary_table(report: dict) -> str:
    """The human summary: one line per check (status, error against its tolerance) and one per
    benchmark mode (median ms of each implementation, speedups, TFLOP/s, fraction of peak, peak memory)."""
    lines = ["check                                   status   detail"]
    for c in report.get("checks", []):
        label = f"{c['kind']} {c.get('config', '')} B={c.get('B', '-')} J={c.get('J', '-')}".strip()
        detail = c.get("reason") or c.get("error") or (
            f"max err {_fmt(c.get('max_error'))} (eager {_fmt(c.get('eager_max_error'))}, tol {_fmt(c.get('tolerance'))})"
            if "max_error" in c else "")
        if c.get("failed"):
            detail += f" failed: {', '.join(c['failed'][:4])}"
        lines.append(f"{label[:39]:39} {c['status']:8} {detail[:110]}")
    lines += ["", "benchmark               impl        median ms   TFLOP/s  of peak  peak GiB   vs eager  vs compile"]
    for case in report.get("sections", {}).get("benchmarks", {}).get("cases", []):
        head = f"B={case.get('B')} L={case.get('L')} {case.get('dtype')}"
        if "modes" not in case:
            lines.append(f"{head:23} {case.get('status', '')} {case.get('reason', '')}")
        for mode, impls in case.get("modes", {}).items():
            sp = case.get("speedups", {}).get(mode, {})
            for impl, r in impls.items():
                tail = (f"  {_fmt(sp.get('speedup_vs_eager'), '9.2f')}  {_fmt(sp.get('speedup_vs_compile'), '9.2f')}"
                        if impl == "substation" else "")
                if "median_ms" in r:
                    lines.append(f"{head + ' ' + mode:23} {impl:10} {r['median_ms']:10.3f} {_fmt(r['tflops'], '9.1f')} "
                                 f"{_fmt(r['fraction_of_peak'], '8.1%')} {_fmt(r['peak_memory_gib'], '9.2f')}{tail}")
                else:
                    lines.append(f"{head + ' ' + mode:23} {impl:10} {r['status']}: {(r.get('reason') or r.get('error', ''))[:80]}")
    s = report.get("summary", {})
    lines += [f"problem: {p[:150]}" for p in s.get("problems", [])]
    lines += ["", f"{s.get('passed', 0)} passed, {s.get('failed', 0)} failed, {s.get('skipped', 0)} skipped; "
              f"{report.get('status', '')} in {report.get('finished_seconds', 0):.0f} s"]
    return "\n".join(lines)


def summarize(report: dict) -> dict:
    """Counts of outcomes over the correctness checks, the sanitizer runs and the build (an error
    counts as a failure), plus ``problems``: benchmark runs that raised and stage processes that
    did not end normally."""
    sections = report["sections"]
    statuses = [c["status"] for c in report.get("checks", [])] + [sections.get("build", {}).get("status", "error")]
    counts = {k: sum(st == k for st in statuses) for k in ("passed", "failed", "skipped")}
    counts["failed"] += sum(st == "error" for st in statuses)
    problems = [f"{c['kind']} {c['config']} B={c['B']} J={c['J']}: {c['status']}" for c in report.get("checks", [])
                if c["status"] in ("failed", "error")]
    stages = [("correctness", sections.get("correctness", {}))]
    if sections.get("profile", {}).get("status") == "error":
        problems.append(f"profile: {sections['profile']['error']}")
    stages += [(f"benchmark B={c['B']} L={c['L']} {c['dtype']}", c) for c in sections.get("benchmarks", {}).get("cases", [])]
    for label, sec in stages:
        proc = sec.get("process")
        if proc and proc.get("returncode") != 0:
            problems.append(f"{label}: process ended with {proc.get('returncode')} after {proc.get('seconds')} s")
        for mode, impls in sec.get("modes", {}).items():
            problems += [f"{label} {mode}/{impl}: {r['error']}" for impl, r in impls.items() if r.get("status") == "error"]
    counts["problems"] = problems
    return counts


# -- driver -------------------------------------------------------------------------------------
def main(argv=None) -> int:
    """Parse the command line; run one ``--stage`` (in a subprocess of the driver) or the whole check."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default="gpu_check.json", help="the JSON file to write (default gpu_check.json)")
    parser.add_argument("--budget", type=float, default=330.0, help="seconds for the whole check (default 330)")
    parser.add_argument("--rounds", type=int, default=20, help="interleaved timing rounds per benchmark (default 20)")
    parser.add_argument("--quick", action="store_true", help="fewer cases: one benchmark shape, fewer sizes")
    parser.add_argument("--dry-run-cpu", action="store_true", help="the same path on the CPU with tiny sizes")
    parser.add_argument("--arch", default=None, help="cuda_arch of the builds (default: the GPU's, else sm_90)")
    parser.add_argument("--stage", choices=("correctness", "bench", "sanitize"), help=argparse.SUPPRESS)
    parser.add_argument("--profile", help=argparse.SUPPRESS)
    parser.add_argument("--part", help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--compile-estimate", type=float, default=45.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("SUBSTATION_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "substation"))
    s = Setup(args.dry_run_cpu, args.quick, args.arch or "sm_90")
    if args.stage:
        case = args.case.split(":") if args.case else []
        if args.stage == "correctness":
            correctness_stage(s, args.part, args.deadline)
        elif args.stage == "sanitize":
            sanitize_stage(s, args.part)
        else:
            bench_stage(s, args.part, int(case[0]), int(case[1]), case[2], args.deadline, args.rounds,
                        args.compile_estimate, args.profile)
        return 0
    return drive(s, args)


def drive(s: Setup, args) -> int:
    """The driver: sections in order, each time-boxed, the JSON rewritten after each, the table printed."""
    start = time.time()
    deadline = start + args.budget
    out = os.path.abspath(args.json)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    report = {"schema": SCHEMA, "started": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
              "mode": {"dry_run_cpu": s.dry_run, "quick": s.quick, "budget_s": args.budget, "rounds": args.rounds},
              "peak": {"tflops_dense_fp16_bf16": PEAK_TFLOPS, "hbm_bytes_per_s": PEAK_BANDWIDTH, "source": PEAK_SOURCE},
              "sections": {}, "checks": []}
    sections = report["sections"]

    def save(msg: str) -> None:
        write_json(out, report)
        print(f"gpu_check [{time.time() - start:5.0f} s] {msg}", flush=True)
    sections["environment"] = env = environment(s)
    if "gpu" in env and args.arch is None:  # build for this GPU (sm_90 on H100/H200)
        s = dataclasses.replace(s, arch="sm_" + env["gpu"]["capability"].replace(".", ""))
    report["mode"]["cuda_arch"] = s.arch
    if env["missing"]:
        report["status"] = "prerequisites missing: " + "; ".join(env["missing"])
        report["finished_seconds"] = round(time.time() - start, 1)
        save(report["status"])
        return 2
    save("environment done; building")
    try:
        sections["build"] = build_section(s, min(120.0, 0.3 * args.budget))
    except Exception as e:  # noqa: BLE001 - recorded; the sections after it report what fails
        sections["build"] = error_record(e)
    save(f"build {sections['build']['status']}; correctness and sanitizer")

    parts = tempfile.mkdtemp(prefix="gpu_check-")
    box = min(150.0, 0.3 * args.budget)
    sanitizers = {}
    for tool, spec in sanitizer_commands(s, parts).items():
        if isinstance(spec, str):
            sanitizers[tool] = (None, None, spec)
        else:
            cmd, part = spec
            senv = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")  # every allocation visible to memcheck
            sanitizers[tool] = (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                                 env=senv), part, None)
    corr = run_stage(["--stage", "correctness", "--deadline", str(time.time() + box - 10), *s.argv()],
                     os.path.join(parts, "correctness.json"), box)
    report["checks"] = corr.pop("checks", [])
    sections["correctness"] = corr
    sanitizer_deadline = max(time.time() + 5, start + 0.6 * args.budget)
    for tool, (proc, part, reason) in sanitizers.items():
        rec = sanitizer_result(tool, proc, part, reason, sanitizer_deadline - time.time())
        report["checks"].append({"kind": "sanitizer", "config": tool, **rec})
    n_ok = sum(c["status"] == "passed" for c in report["checks"])
    save(f"correctness: {n_ok}/{len(report['checks'])} passed; benchmarks")

    cases = [(b, l, dt) for b, l in s.bench_shapes for dt in s.bench_dtypes]
    bench = sections["benchmarks"] = {"cases": []}
    estimate = 10.0 if s.dry_run else 45.0
    reserve = 20.0 if s.dry_run else 40.0  # kept for the profile
    for i, (b, l, dt) in enumerate(cases):
        left = deadline - reserve - time.time()
        if left < 15:
            bench["cases"].append({"B": b, "L": l, "dtype": dt, "status": "skipped", "reason": f"time box ({left:.0f} s left)"})
            continue
        share = left * (2 if i == 0 else 1) / (len(cases) - i + (1 if i == 0 else 0))  # the first case counts double
        profile = ["--profile", dt] if i == 0 else []  # one profiled step, in the first case's process
        r = run_stage(["--stage", "bench", "--case", f"{b}:{l}:{dt}", "--rounds", str(args.rounds),
                       "--deadline", str(time.time() + share - 5), "--compile-estimate", str(estimate), *profile,
                       *s.argv()], os.path.join(parts, f"bench-{b}-{l}-{dt}.json"), share + (reserve if i == 0 else 0))
        r = {"B": b, "L": l, "dtype": dt, **r}
        if "profile" in r:
            sections["profile"] = r.pop("profile")
        bench["cases"].append(r)
        firsts = [m["compile"]["first_step_seconds"] for m in r.get("modes", {}).values()
                  if "first_step_seconds" in m.get("compile", {})]
        estimate = max(firsts) * 1.2 if firsts else estimate
        save(f"benchmark B={b} L={l} {dt}: {r.get('speedups', r.get('status', r['process']))}")
    shutil.rmtree(parts, ignore_errors=True)
    report["summary"] = summarize(report)
    failed = report["summary"]["failed"] > 0 or bool(report["summary"]["problems"])
    report["status"] = "failures" if failed else "ok"
    report["finished_seconds"] = round(time.time() - start, 1)
    save(f"wrote {out}")
    print(summary_table(report), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
