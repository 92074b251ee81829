"""The one timing harness of benchmarks and tuning: candidates timed interleaved in one process
(warm-up first, the starting candidate rotating every round, the garbage collector paused), sample
statistics, bytes held for backward, thread control and an empty inductor cache.

Units: seconds, bytes."""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import os
import statistics
import tempfile
import time
from typing import Callable, Iterable

__all__ = ["PASSES", "Candidate", "env_var", "fresh_inductor_cache", "interleaved_rounds", "interleaved_times", "sample_stats",
           "saved_tensor_bytes", "set_substation_threads", "sign_test_wins", "time_step"]

#: The timed passes of a training step, in order (``forward_backward`` is one step's forward plus its backward).
PASSES = ("forward", "backward", "forward_backward")


def set_substation_threads(compiled, threads: int) -> int:
    """Make the compiled libraries' OpenMP runtime (which MKL's GNU-threading layer follows) use
    ``threads`` threads from the calling thread on.

    Args:
        compiled: a :class:`~substation.runtime.CompiledLayer`.
        threads: number of threads, >= 1.

    Returns:
        The thread count the runtime now reports (``omp_get_max_threads``).

    Raises:
        ValueError: ``threads`` < 1.
    """
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    for graph in (compiled.forward, compiled.backward):
        if graph is not None:  # an inference build has no backward library
            graph.lib.omp_set_num_threads(int(threads))
    return int(compiled.forward.lib.omp_get_max_threads())


@dataclasses.dataclass
class Candidate:
    """One implementation under test.

    Attributes:
        name: key in the results (``substation``, ``eager``, ``compile``, ...).
        call: ``call(x)`` runs the forward pass on ``x`` (which requires grad) and returns ``y``.
        params: the parameters whose ``.grad`` is cleared before each step (so no step accumulates).
    """

    name: str
    call: Callable
    params: list


def time_step(candidate: Candidate, x, dy) -> tuple[float, float]:
    """One forward+backward step of ``candidate``: gradients cleared (set to None), a fresh leaf copy of
    ``x`` that requires grad, ``y = call(x)`` timed, then ``y.backward(dy)`` timed on its own. With
    ``dy`` None, an inference step: ``call(x)`` under ``torch.inference_mode`` alone (backward 0).

    Returns:
        (forward seconds, backward seconds).

    Raises:
        whatever the candidate raises.
    """
    if dy is None:
        import torch
        with torch.inference_mode():
            t0 = time.perf_counter()
            candidate.call(x)
            return time.perf_counter() - t0, 0.0
    for p in candidate.params:
        p.grad = None
    xg = x.detach().requires_grad_()
    t0 = time.perf_counter()
    y = candidate.call(xg)
    t1 = time.perf_counter()
    y.backward(dy)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def interleaved_times(candidates: Iterable[Candidate], x, dy, repeats: int, warmup: int = 1) -> dict:
    """Time the candidates interleaved: ``warmup`` untimed steps of each, then ``repeats`` rounds of one
    step per candidate (:func:`time_step`; ``dy`` None: inference steps), the starting candidate
    rotating every round (so none always runs first). Python's garbage collector is paused during the
    rounds.

    Returns:
        name -> pass (``forward``, ``backward``, ``forward_backward``) -> list of seconds, one per round.

    Raises:
        ValueError: ``repeats`` < 1 or ``warmup`` < 0.
    """
    cands = list(candidates)
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    for _ in range(warmup):
        for c in cands:
            time_step(c, x, dy)
    steps = interleaved_rounds({c.name: (lambda c=c: time_step(c, x, dy)) for c in cands}, repeats)
    return {name: {"forward": [f for f, _ in parts], "backward": [b for _, b in parts],
                   "forward_backward": [f + b for f, b in parts]} for name, parts in steps.items()}


def interleaved_rounds(steps: dict[str, Callable[[], tuple]], rounds: int) -> dict[str, list[tuple]]:
    """Run ``rounds`` rounds of one call of every step (name -> a callable returning its measured
    parts, e.g. seconds), the starting step rotating every round so none always runs first, with
    Python's garbage collector paused (collected once before).

    Returns:
        name -> the parts of each round's call, in round order.
    """
    names = list(steps)
    out: dict[str, list[tuple]] = {n: [] for n in names}
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(rounds):
            for k in range(len(names)):
                n = names[(r + k) % len(names)]
                out[n].append(steps[n]())
    finally:
        if was_enabled:
            gc.enable()
    return out


def saved_tensor_bytes(forward: Callable, exclude: Iterable = ()) -> tuple[object, int, int]:
    """Bytes held for backward by one forward pass.

    Runs ``forward()`` under ``torch.autograd.graph.saved_tensors_hooks`` and sums the sizes of the
    unique storages (by data pointer, each counted in full: a saved view holds its whole storage) of
    every tensor autograd saves for backward, except the storages of ``exclude`` (parameters, the
    input, the mask: the caller holds them anyway). Covers built-in ops, custom
    ``autograd.Function``'s ``save_for_backward`` and ``torch.compile``'s compiled graphs alike.

    Returns:
        (``forward()``'s result, bytes, number of storages).

    Raises:
        whatever ``forward`` raises.
    """
    import torch
    skip = {t.untyped_storage().data_ptr() for t in exclude if t is not None}
    held: dict[int, int] = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            st = t.untyped_storage()
            ptr, n = st.data_ptr(), st.nbytes()
            if n and ptr not in skip:
                held[ptr] = max(held.get(ptr, 0), n)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = forward()
    return y, sum(held.values()), len(held)


@contextlib.contextmanager
def env_var(name: str, value: str):
    """A context in which the environment variable ``name`` is ``value`` (restored after)."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


@contextlib.contextmanager
def fresh_inductor_cache():
    """A context in which ``torch.compile`` (inductor) starts from an empty cache (torch's own
    ``fresh_cache`` when available, else a temporary ``TORCHINDUCTOR_CACHE_DIR``). Raises nothing."""
    try:
        from torch._inductor.utils import fresh_cache
    except ImportError:  # pragma: no cover - other torch versions
        fresh_cache = None
    if fresh_cache is not None:
        with fresh_cache():
            yield
        return
    with tempfile.TemporaryDirectory(prefix="substation-bench-inductor-") as tmp:  # pragma: no cover
        with env_var("TORCHINDUCTOR_CACHE_DIR", tmp):
            yield


def sample_stats(samples: list[float]) -> dict:
    """``median``, ``min``, ``max``, quartiles ``q1`` and ``q3`` (inclusive method) and the ``samples``
    themselves of a non-empty list of measurements, in their unit. Raises ValueError when it is empty."""
    if not samples:
        raise ValueError("sample_stats needs at least one sample")
    q = statistics.quantiles(samples, n=4, method="inclusive") if len(samples) > 1 else [samples[0]] * 3
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples),
            "q1": q[0], "q3": q[2], "samples": list(samples)}


def sign_test_wins(rounds: int, alpha: float = 0.05) -> int:
    """The fewest wins out of ``rounds`` paired rounds that a one-sided sign test accepts at level
    ``alpha`` (P[Binomial(rounds, 1/2) >= wins] <= alpha); ``rounds + 1`` when none does."""
    for k in range(rounds + 1):
        if sum(math.comb(rounds, i) for i in range(k, rounds + 1)) / 2 ** rounds <= alpha:
            return k
    return rounds + 1
