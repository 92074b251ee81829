"""Whole-model inference benchmark (``substation bench-model --mode eval``).

:func:`run_bench_model_eval` times a sentence-transformers model (all-MiniLM-L6-v2 by default: a
``transformers.BertModel``, mean pooling, L2 normalisation) in eval mode under
``torch.inference_mode()``, through two APIs:

* ``bert_model``: ``model(input_ids=..., token_type_ids=..., attention_mask=..., return_dict=True)`` of
  the ``BertModel``, on the tokenizer's features of the batch; its output is ``last_hidden_state``
  [B, J, I];
* ``encode``: sentence-transformers' ``encode(sentences, batch_size=B, convert_to_tensor=True)``
  (tokenization, the ``BertModel``, pooling, normalisation); its output is the embeddings [B, I].

Four implementations of the ``BertModel`` run both APIs, interleaved in one process, on
``torch.get_num_threads()`` threads, in float32 or (``dtype="bfloat16"``) every call under
``torch.autocast("cpu", dtype=torch.bfloat16)`` with the float32 weights, as users turn it on:

* ``hf_eager``: the model as loaded (``attn_implementation="sdpa"``), PyTorch eager;
* ``hf_compile``: that model under ``torch.compile`` (``dynamic=False``, compiled afresh for every
  shape after ``torch._dynamo.reset()``);
* ``ort``: ONNX Runtime, optional (the ``ort`` extra): the model exported by ``torch.onnx.export``
  (``dynamo=True``, batch and sequence dimensions dynamic), optimized by
  ``onnxruntime.transformers.optimizer`` (``model_type="bert"``), one session with
  ``intra_op_num_threads`` = the thread count and thread spinning off, so that its idle threads do not
  slow whatever runs next; skipped, with the reason recorded, when it is not installed, and in
  bfloat16 (its CPU provider runs this model in float32 only);
* ``substation``: :func:`substation.optimize` of the model, every ``BertLayer`` replaced; in eval mode
  under ``inference_mode`` each layer runs its inference build (under bf16 autocast: the bfloat16
  one), which computes the real tokens only (:mod:`substation.runtime.packing`); all built and
  threaded before timing.

The batch is text: sentences of words that are single tokens of the model's vocabulary, so that the
tokenizer gives exactly J tokens ([CLS] and [SEP] included) to rows 0 .. B/2 - 1 and 3J/4 to the rest,
which it pads: the benchmarks' padding (:func:`~substation.perf.baselines.padded_positions`). A batch
of one sequence (B = 1, the latency case) is not padded, as a tokenizer never pads a lone sequence.

Accuracy: every implementation's output on the real (unpadded) tokens is compared with a float64 run
of the Hugging Face model on the same input: the max absolute error, and its ratio to the error of
Hugging Face's own eager run in the same precision (float32, or under bf16 autocast).

Units: seconds in the results, milliseconds in the text. Dimension letters: B batch, J sequence
positions, I hidden size. See docs/performance.md.
"""
from __future__ import annotations

import os
import tempfile
import time
from contextlib import nullcontext
from typing import Callable

import torch

from ..interop import optimize
from ..backends.cpu.gemm_libraries import check_fp32_gemm
from .baselines import padded_from, padded_positions
from .bench_model import ModelSpec, compiled_layers, model_spec
from .gemm_choice import gemm_label
from .probes import machine_info
from .timing import Candidate, fresh_inductor_cache, interleaved_times, sample_stats, set_substation_threads

__all__ = ["IMPLEMENTATIONS", "APIS", "DTYPES", "SHAPES", "parse_shapes", "sentence_batch", "OrtEncoder", "ort_model",
           "run_bench_model_eval", "format_bench_model_eval"]

#: The implementations of the ``BertModel``, in order.
IMPLEMENTATIONS = ("hf_eager", "hf_compile", "ort", "substation")
#: The APIs each implementation is called through.
APIS = ("bert_model", "encode")
#: Precisions: float32, or bfloat16 autocast around float32 weights.
DTYPES = ("float32", "bfloat16")
#: The default (B, J) shapes: a padded batch, one short query (latency), a long padded batch.
SHAPES = ((32, 128), (1, 24), (32, 512))
SCHEMA = "substation-bench-model-eval/2"
_FEATURES = ("input_ids", "token_type_ids", "attention_mask")
_ORT_PACKAGES = ("onnxruntime", "onnx", "onnxscript")


def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """``"32x128,1x24"`` -> ``((32, 128), (1, 24))``: comma-separated B x J pairs.

    Raises:
        ValueError: an item that is not ``BxJ`` with positive integers, or no item.
    """
    shapes = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"shape {item.strip()!r} is not BxJ with positive integers (e.g. 32x128)")
        shapes.append((int(parts[0]), int(parts[1])))
    return tuple(shapes)


def _load(folder: str):
    """The sentence-transformers model in ``folder``, float32, CPU, eval mode, local files only."""
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(folder, device="cpu", local_files_only=True).float().eval()


def _words(tokenizer) -> list[str]:
    """Lower-case alphabetic vocabulary entries of 3+ letters: each tokenizes to exactly one token."""
    return sorted(t for t in tokenizer.get_vocab() if t.isascii() and t.isalpha() and t.islower() and len(t) >= 3)


def sentence_batch(model, batch: int, seq: int, seed: int = 0) -> tuple[list[str], dict]:
    """Sentences whose tokenization is a [B, J] batch with the benchmarks' padding, and its features.

    Rows whose :func:`~substation.perf.baselines.padded_positions` row is unpadded get J tokens, the
    others 3J/4; with B = 1 the row gets J tokens (nothing to pad to).

    Args:
        model: a sentence-transformers model with a BERT WordPiece tokenizer.
        batch, seq: B and J, at least 1 and 3 ([CLS], a word, [SEP]).
        seed: chooses the words.

    Returns:
        (the B sentences, the tokenizer's ``input_ids``, ``token_type_ids`` and ``attention_mask``
        [B, J] int64 of them as one padded batch).

    Raises:
        ValueError: B < 1, J < 3, or J above the model's ``max_position_embeddings``.
        RuntimeError: the tokenizer did not produce the intended lengths (not a WordPiece vocabulary).
    """
    limit = model[0].model.config.max_position_embeddings
    if batch < 1 or seq < 3 or seq > limit:
        raise ValueError(f"need batch >= 1 and 3 <= seq_len <= {limit} (max_position_embeddings), "
                         f"got {batch} and {seq}")
    pad = padded_positions(batch, seq) if batch > 1 else torch.zeros(1, seq, dtype=torch.bool)
    words = _words(model.tokenizer)
    gen = torch.Generator().manual_seed(seed)
    sentences = [" ".join(words[i] for i in torch.randint(len(words), (n - 2,), generator=gen).tolist())
                 for n in (~pad).sum(1).tolist()]
    model.max_seq_length = seq  # its default (256 for all-MiniLM-L6-v2) would truncate longer rows
    features = model.preprocess(sentences)
    if not torch.equal(features["attention_mask"].bool(), ~pad):
        raise RuntimeError(f"the tokenizer gave lengths {features['attention_mask'].sum(1).tolist()} for "
                           f"{(~pad).sum(1).tolist()} intended tokens; bench-model --mode eval needs a WordPiece "
                           f"vocabulary of whole words")
    return sentences, {k: features[k] for k in _FEATURES}


class OrtEncoder(torch.nn.Module):
    """Stands in for the ``BertModel`` inside a sentence-transformers model: ``forward(**features)`` ->
    ``{"last_hidden_state": [B, J, I] float32}`` from ``run(input_ids, attention_mask, token_type_ids)``;
    ``config`` is the replaced model's (sentence-transformers reads it)."""

    def __init__(self, run: Callable, config):
        super().__init__()
        self.run, self.config = run, config

    def forward(self, input_ids, attention_mask, token_type_ids=None, **_):
        return {"last_hidden_state": self.run(input_ids, attention_mask, token_type_ids)}


def ort_model(model, features: dict, threads: int, folder: str) -> tuple[object, dict]:
    """``model`` (a ``BertModel``) run by ONNX Runtime, as a module that replaces it in a
    sentence-transformers model.

    Exports with ``torch.onnx.export(dynamo=True)`` (B and J dynamic, ``features`` as the example
    input) into ``folder``, optimizes with ``onnxruntime.transformers.optimizer.optimize_model``
    (``model_type="bert"``) and opens one CPU session: ``intra_op_num_threads`` = ``threads``,
    ``inter_op_num_threads`` = 1, intra- and inter-op thread spinning off.

    Returns:
        (the module, facts: ``onnxruntime`` version, ``export_seconds``, ``optimize_seconds``,
        ``fused_operators`` (operator -> count), ``session_options``).

    Raises:
        ImportError: onnxruntime, onnx or onnxscript is not installed.
        whatever the export or ONNX Runtime raises.
    """
    import onnxruntime
    from onnxruntime.transformers import optimizer
    from torch.export import Dim

    c = model.config
    raw, fused = os.path.join(folder, "model.onnx"), os.path.join(folder, "model.opt.onnx")
    dims = {0: Dim("batch"), 1: Dim("seq", max=c.max_position_embeddings)}
    t0 = time.perf_counter()
    with torch.no_grad():
        torch.onnx.export(model, (), raw, kwargs=dict(features), input_names=list(features),
                          output_names=["last_hidden_state"], dynamic_shapes={k: dims for k in features},
                          dynamo=True, verbose=False)
    t1 = time.perf_counter()
    opt = optimizer.optimize_model(raw, model_type="bert", num_heads=c.num_attention_heads, hidden_size=c.hidden_size)
    opt.save_model_to_file(fused)
    t2 = time.perf_counter()
    options = {"intra_op_num_threads": threads, "inter_op_num_threads": 1,
               "session.intra_op.allow_spinning": "0", "session.inter_op.allow_spinning": "0"}
    so = onnxruntime.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    for key in ("session.intra_op.allow_spinning", "session.inter_op.allow_spinning"):
        so.add_session_config_entry(key, options[key])
    session = onnxruntime.InferenceSession(fused, so, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]

    def run(input_ids, attention_mask, token_type_ids):
        given = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
        return torch.from_numpy(session.run(["last_hidden_state"], {n: given[n].numpy() for n in names})[0])
    facts = {"onnxruntime": onnxruntime.__version__, "export_seconds": t1 - t0, "optimize_seconds": t2 - t1,
             "fused_operators": {k: v for k, v in opt.get_fused_operator_statistics().items() if v},
             "session_options": options}
    return OrtEncoder(run, c), facts


def _ort_missing() -> str | None:
    """Why ONNX Runtime cannot run here (the packages that fail to import), or None."""
    import importlib
    missing = []
    for name in _ORT_PACKAGES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return f"not installed: {', '.join(missing)} (pip install 'substation[ort]')" if missing else None


def _max_error(out, ref, real) -> float:
    """Max |out - ref| over the real tokens (``real`` [B, J] bool) of a [B, J, I] output, or over all of
    a [B, I] one."""
    diff = (out.double() - ref).abs()
    return float((diff[real] if diff.dim() == 3 else diff).max())


def _precision(dtype: str):
    """The context every timed call of ``dtype`` runs in: bf16 autocast, or nothing."""
    return torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bfloat16" else nullcontext()


def _calls(model, features: dict, sentences: list[str], dtype: str = "float32") -> dict[str, Callable]:
    """API -> a call of ``model`` (a sentence-transformers model) through it in ``dtype``'s precision
    (:func:`_precision`), returning its output."""
    bert = model[0].model

    def bert_model():
        with _precision(dtype):
            return bert(**features, return_dict=True)["last_hidden_state"]

    def encode():
        with _precision(dtype):
            return model.encode(sentences, batch_size=len(sentences), convert_to_tensor=True,
                                show_progress_bar=False)
    return {"bert_model": bert_model, "encode": encode}


def _bench_shape(models: dict, reference, plain_bert, batch: int, seq: int, rounds: int, warmup: int,
                 compile_backend: str | None, seed: int, dtype: str, say: Callable[[str], None]) -> dict:
    sentences, features = sentence_batch(models["hf_eager"], batch, seq, seed)
    for m in (*models.values(), reference):
        m.max_seq_length = seq
    real = features["attention_mask"].bool()
    info = {n: {"error": None} for n in IMPLEMENTATIONS}
    if compile_backend is not None:
        say(f"{batch}x{seq}: torch.compile (backend {compile_backend}, dynamic=False, cold inductor cache)")
        torch._dynamo.reset()
        models["hf_compile"][0].model = torch.compile(plain_bert, backend=compile_backend, dynamic=False)
    with torch.inference_mode():
        want = {api: call() for api, call in _calls(reference, features, sentences).items()}
    calls, errors = {}, {}
    for name, m in models.items():
        try:
            with torch.inference_mode(), (fresh_inductor_cache() if name == "hf_compile" else nullcontext()):
                t0 = time.perf_counter()
                got = {api: call() for api, call in _calls(m, features, sentences, dtype).items()}
                first = time.perf_counter() - t0
        except Exception as e:  # a failing torch.compile is this implementation's result, not the run's
            if name != "hf_compile":
                raise
            info[name]["error"] = f"{type(e).__name__}: {e}"[:2000]
            continue
        if name == "hf_compile":
            info[name]["compile_seconds"] = first
        errors[name] = {api: _max_error(got[api], want[api], real) for api in APIS}
        calls.update({f"{name}/{api}": call for api, call in _calls(m, features, sentences, dtype).items()})
    say(f"{batch}x{seq}: {warmup} warm-up call(s) of each, then {rounds} interleaved rounds of {len(calls)} calls")
    times = interleaved_times([Candidate(k, lambda _, f=f: f(), []) for k, f in calls.items()], None, None,
                              rounds, warmup)
    hf_err = errors["hf_eager"]
    per_api = {}
    for api in APIS:
        ran = {n: sample_stats(times[f"{n}/{api}"]["forward"]) for n in errors}
        med = {n: s["median"] for n, s in ran.items()}
        sub = med.get("substation")

        def ratio(n):
            return med[n] / sub if n in med and sub else None
        per_api[api] = {
            "seconds": ran, "median_seconds": med,
            "max_abs_error_vs_float64": {n: e[api] for n, e in errors.items()},
            "error_ratio_vs_hf": {n: e[api] / hf_err[api] if hf_err[api] else None
                                          for n, e in errors.items()},
            "substation_error_within_2x_of_hf": errors["substation"][api] <= 2 * hf_err[api],
            "speedup_vs_hf_eager": ratio("hf_eager"), "speedup_vs_compile": ratio("hf_compile"),
            "speedup_vs_ort": ratio("ort")}
    return {"batch_size": batch, "seq_len": seq, "padded": batch > 1,
            "tokens": int(real.sum()),
            "mask": (f"rows {batch // 2}..{batch - 1} padded from position {padded_from(seq)} on" if batch > 1
                     else "none (one sequence)"),
            "implementations": info, **per_api}


def run_bench_model_eval(model: str | ModelSpec = "minilm-l6", shapes=SHAPES, rounds: int = 5, warmup: int = 1,
                         include_compile: bool = True, include_ort: bool = True, compile_backend: str = "inductor",
                         seed: int = 0, dtype: str = "float32", fp32_gemm: str = "auto",
                         progress: Callable[[str], None] | None = None) -> dict:
    """Benchmark whole-model inference with and without :func:`substation.optimize` (see the module docstring).

    Args:
        model: a name or path for :func:`~substation.perf.bench_model.model_spec`, or its result; the
            folder must hold a sentence-transformers model (``modules.json``) with a BERT WordPiece tokenizer.
        shapes: (B, J) pairs, each timed on its own (J at most ``max_position_embeddings``).
        rounds: timed rounds per shape, >= 1; each calls every implementation through every API once,
            the first call rotating.
        warmup: untimed calls of each before the rounds, >= 0 (after the first call, which checks the
            output and, for ``hf_compile``, compiles).
        include_compile: also ``hf_compile``; compile_backend: its backend (``"eager"`` for quick tests).
        include_ort: also ``ort`` when ONNX Runtime is installed (else recorded as skipped, with the reason).
        seed: chooses the words of the sentences.
        dtype: ``float32``, or ``bfloat16``: every call under bf16 autocast (ONNX Runtime left out).
        fp32_gemm: the library of the float32 layers' token-wise GEMMs (:func:`substation.optimize`); the
            result's ``fp32_gemm`` is the library the inference builds call (None in bfloat16).
        progress: called with a short message before each phase.

    Returns:
        Plain data, the JSON of ``substation bench-model --mode eval`` (keys in docs/performance.md): per
        shape and API the implementations' forward ``seconds`` stats, ``median_seconds``,
        ``max_abs_error_vs_float64``, ``error_ratio_vs_hf`` (over HF eager's in the same precision) and
        the speedups of ``substation``
        (another implementation's median seconds / Substation's; None where one did not run).

    Raises:
        ValueError: rounds < 1, warmup < 0, no shapes, a bad shape, a dtype not in :data:`DTYPES`, an
            unknown ``fp32_gemm``, or a model folder without a sentence-transformers model.
        FileNotFoundError, ImportError: from ``model_spec`` (or no ``sentence-transformers``).
        ToolchainError, BuildError: Substation's compilation failed.
    """
    if rounds < 1 or warmup < 0:
        raise ValueError(f"need rounds >= 1 and warmup >= 0, got {rounds} and {warmup}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    check_fp32_gemm(fp32_gemm)
    shapes = tuple(tuple(s) for s in shapes)
    if not shapes:
        raise ValueError("need at least one (batch, seq_len) shape")
    spec = model if isinstance(model, ModelSpec) else model_spec(model)
    if spec.weights is None or not os.path.isfile(os.path.join(spec.weights, "modules.json")):
        raise ValueError(f"--mode eval runs a sentence-transformers model folder (modules.json), e.g. minilm-l6; "
                         f"{spec.name} has none")
    for b, j in shapes:
        if b < 1 or not 3 <= j <= spec.config.max_position_embeddings:
            raise ValueError(f"shape {b}x{j}: need batch >= 1 and 3 <= seq_len <= "
                             f"{spec.config.max_position_embeddings} (max_position_embeddings)")
    say = progress or (lambda msg: None)
    machine = machine_info()
    threads = machine["threads"]
    torch.set_num_threads(threads)

    ort = {"skipped": None}
    missing = _ort_missing() if include_ort else "left out (include_ort=False / --no-ort)"
    if dtype == "bfloat16" and missing is None:
        missing = "float32 only (its CPU execution provider has no bfloat16 kernels for this model)"
    loaded = [n for n in IMPLEMENTATIONS if n != "ort" or missing is None]  # hf_compile's: also the plain BertModel
    say(f"loading {spec.name} {1 + len(loaded)} times (float64 reference, {', '.join(loaded)})")
    reference = _load(spec.weights).double()
    models = {n: _load(spec.weights) for n in loaded}
    plain_bert = models["hf_compile"][0].model
    if missing is None:
        say("ONNX Runtime: torch.onnx.export, onnxruntime.transformers.optimizer, session")
        _, features = sentence_batch(models["ort"], 2, 16, seed)
        with tempfile.TemporaryDirectory(prefix="substation-bench-ort-") as folder:
            bert = models["ort"][0].model
            models["ort"][0].model, facts = ort_model(bert, features, threads, folder)
        ort.update(facts)
    else:
        ort["skipped"] = missing
    if not include_compile:
        del models["hf_compile"]
    say("substation.optimize and the inference builds")
    t0 = time.perf_counter()
    optimize(models["substation"], fp32_gemm=fp32_gemm)
    optimize_seconds = time.perf_counter() - t0
    replaced, builds = compiled_layers(models["substation"])
    inference = [c.for_autocast(forward_only=True) if dtype == "bfloat16" else c.forward_only()
                 for c in builds.values()]
    sub_threads = [set_substation_threads(c, threads) for c in (*builds.values(), *inference)]

    results = {}
    for b, j in shapes:
        results[f"{b}x{j}"] = _bench_shape(models, reference, plain_bert, b, j, rounds, warmup,
                                           compile_backend if include_compile else None, seed, dtype, say)
    if include_compile:
        torch._dynamo.reset()  # its caches keep the compiled model alive
    c = spec.config
    return {
        "schema": SCHEMA, "mode": "eval", "dtype": dtype,
        "fp32_gemm": next((c.fp32_gemm_library for c in inference), None),
        "precision": ("torch.autocast('cpu', dtype=torch.bfloat16) around float32 weights" if dtype == "bfloat16"
                      else "float32"),
        "model": {"name": spec.name, "source": spec.source, "weights": spec.weights,
                  "num_layers": c.num_hidden_layers, "hidden_size": c.hidden_size, "num_heads": c.num_attention_heads,
                  "intermediate_size": c.intermediate_size, "vocab_size": c.vocab_size, "hidden_act": c.hidden_act,
                  "attn_implementation": "sdpa"},
        "apis": {"bert_model": "BertModel(input_ids, token_type_ids, attention_mask, return_dict=True)"
                               ".last_hidden_state [B, J, I]; errors over the real tokens",
                 "encode": "SentenceTransformer.encode(sentences, batch_size=B, convert_to_tensor=True): "
                           "tokenize, BertModel, mean pooling, normalize -> [B, I]"},
        "reference": "the Hugging Face model in float64 (sdpa), same input",
        "threads": threads,
        "machine": {**machine, "load_average_after": machine_info()["load_average"]},
        "rounds": rounds, "warmup": warmup,
        "compile_backend": compile_backend if include_compile else None,
        "ort": ort,
        "substation": {"replaced_layers": replaced, "optimize_seconds": optimize_seconds,
                       "inference_build_seconds": [dict(i.build_seconds) for i in inference],
                       "threads": sub_threads},
        "shapes": results,
    }


_LABELS = {"hf_eager": "HF eager (sdpa)", "hf_compile": "torch.compile", "ort": "ONNX Runtime",
           "substation": "Substation"}


def format_bench_model_eval(r: dict) -> str:
    """The result of :func:`run_bench_model_eval` as text (medians in ms, errors vs float64).

    Raises:
        KeyError: a malformed result.
    """
    m, mc = r["model"], r["machine"]
    load = mc.get("load_average")
    lines = [f"{m['name']}: {m['num_layers']} layers, I={m['hidden_size']} H={m['num_heads']} "
             f"U={m['intermediate_size']}; {m['source']}",
             f"eval mode, torch.inference_mode, {r['precision']}"
             + gemm_label(r.get("fp32_gemm"))
             + f"; machine: {mc['cpu']}, {mc['cores']} logical CPUs; threads: {r['threads']}"
             + (f"; load average {load[0]:.2f}" if load else ""),
             "ONNX Runtime: " + (f"skipped: {r['ort']['skipped']}" if r["ort"]["skipped"] else
                                 f"{r['ort']['onnxruntime']}, fused {r['ort']['fused_operators']}")]
    for key, s in r["shapes"].items():
        lines.append(f"[{key}] {s['mask']}; medians of {r['rounds']} interleaved rounds (ms), "
                     f"max abs error vs float64 (x HF eager's)")
        for api in APIS:
            a = s[api]
            lines.append(f"  {api}:")
            for n, med in a["median_seconds"].items():
                ratio = a["error_ratio_vs_hf"][n]
                lines.append(f"    {_LABELS[n]:<17}{med * 1e3:>10.2f}   error {a['max_abs_error_vs_float64'][n]:.2e}"
                             + ("" if ratio is None else f" ({ratio:.2f}x)"))
            lines.append("    substation speedup: " + ", ".join(
                f"{k} {'-' if a[k] is None else f'{a[k]:.3f}x'}"
                for k in ("speedup_vs_hf_eager", "speedup_vs_compile", "speedup_vs_ort")))
        for n, v in s["implementations"].items():
            if v["error"]:
                lines.append(f"  {_LABELS[n]} failed: {v['error'].splitlines()[0][:200]}")
    return "\n".join(lines)
