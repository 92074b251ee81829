"""The row-kernel model: what one fused EW/SN kernel loads, computes, reduces, keeps and stores, built
once from the fused operator and rendered by the CPU (:mod:`substation.backends.cpu.codegen`) and CUDA
(:mod:`substation.backends.cuda.codegen`) back ends.

A row kernel iterates over the space F = rows R x inner letters N: per row, its members (the fused
operators, in order) run sweeps over the inner letters. :class:`RowKernelModel` holds the facts both
back ends share: the space, the tensors read from and written to memory, the produced tensors that
stay inside the kernel (full-width row values, per-row scalars), the column reductions and where a
dropout mask's random index runs.

Each operator kind writes its member body once, against :class:`RowEmitter` (the kind's ``row``
emitter, :mod:`substation.ops`): sweeps with per-element statements, accumulators reduced over the
row (sum or max), row-level statements, loads and stores by connector, in C expressions over a small
vocabulary (compute type :attr:`RowEmitter.T`, statistics type :attr:`RowEmitter.S`,
:meth:`RowEmitter.fn` for ``exp_``, ``max_``, ``rsqrt_``, ``dropout`` and the activations) that each
back end spells for its target. Softmax's gradient, for instance::

    def _softmax_grad_row(k, attrs):
        dot = k.accumulator("dot", "sum")
        with k.sweep() as e:
            e.reduce(dot, f"{e['dy']} * {e['probs']}")
        with k.sweep() as e:
            e.store("y", f"{e['probs']} * ({e['dy']} - {dot})")

A kind overrides its body for one target only where that target really differs (``OpKind.overrides``).
A back end subclasses :class:`RowEmitter` and implements its hooks.
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Callable, Iterator

import sympy

from ..ir.graph import STATIC_DIMENSIONS, LayerGraph, Operator, access_letters
from ..ir.operands import dim_symbol, resolve_operand, stride_order
from ..ops import op_kind, op_space

__all__ = ["RowKernelModel", "RowEmitter", "RowSweep", "REDUCTIONS", "ROW_INDEXED_CANDIDATES", "build_row_kernel",
           "is_row_kernel", "kernel_members", "row_indexed_tensors", "row_kernel_models", "row_kernel_space", "row_pitch"]

#: Row reductions of an accumulator: its initial value's name and the update it takes.
REDUCTIONS = ("sum", "max")


# -- the model ------------------------------------------------------------------------------------
def kernel_members(graph: LayerGraph, op: Operator) -> list[dict]:
    """The member records (name, kind, attrs, inputs, outputs; connector -> (tensor, access)) of an EW
    or SN operator: a fused operator's members, or the operator itself."""
    if op.kind == "fused":
        return op.attrs["ops"]
    return [{"name": op.label, "kind": op.kind, "attrs": op.attrs, "inputs": graph.inputs_of(op),
             "outputs": graph.outputs_of(op)}]


def row_kernel_space(graph: LayerGraph, members: list[dict], vector: str | None = None):
    """(F, N, R) of a row kernel: its iteration letters, the inner letters (ordered, innermost last)
    and the row letters (outermost first), following the layout of its first full-width tensor in
    memory. Row and column reductions fix N; element-wise kernels take the trailing run of static
    letters; ``vector`` (a layout plan's vectorized letter) is moved innermost."""
    spaces = [op_space(m["kind"], m["inputs"], m["outputs"], m["attrs"]) for m in members]
    full = spaces[0][0]
    inner = next((n for _, n in spaces if n is not None), None)
    refs = [ta for m in members for ta in list(m["inputs"].values()) + list(m["outputs"].values())]
    main, main_access = next((t, a) for t, a in refs if t in graph.tensors and frozenset(access_letters(a)) == full)
    order = stride_order(resolve_operand(graph, main, main_access).strides, sorted(full))
    if vector in order and (inner is None or vector in inner):
        order = [c for c in order if c != vector] + [vector]
    if inner is None:
        k = len(order) - 1
        while k > 0 and order[k - 1] in STATIC_DIMENSIONS + ("T",):
            k -= 1
        inner = frozenset(order[k:])
    return full, [c for c in order if c in inner], [c for c in order if c not in inner]


@dataclasses.dataclass(frozen=True)
class RowKernelModel:
    """What one row kernel does, independent of the target.

    Attributes:
        members: the member records in execution order (see :func:`kernel_members`).
        full: the iteration letters F.
        inner: the inner letters N, innermost (the vectorized letter) last.
        rows: the row letters R, outermost first.
        memory: every graph tensor the kernel touches -> the access of its first use, in first-use order.
        loads: memory tensors read before (or without) being produced in the kernel.
        stores: memory tensors the members write element by element or per row (column reductions
            excluded: they are combined after the rows).
        row_values: produced full-width tensors (letters F) a later member reads: kept per row in
            registers or row buffers.
        row_scalars: produced per-row tensors (letters within R) a later member reads.
        column_outputs: (tensor, access) of the column reductions' outputs, member by member,
            connectors sorted.
    """

    members: tuple
    full: frozenset
    inner: tuple
    rows: tuple
    memory: dict
    loads: tuple
    stores: tuple
    row_values: tuple
    row_scalars: tuple
    column_outputs: tuple

    def random_run(self, dims: str) -> str | None:
        """How a random index over ``dims`` (row-major, e.g. a dropout's ``rng_dims``) runs in this
        kernel: ``row`` when it is contiguous along the whole row (a single inner letter, last of
        ``dims``), ``vector`` when it is contiguous along the innermost letter only, else None."""
        if dims[-1] != self.inner[-1]:
            return None
        return "row" if len(self.inner) == 1 else "vector"


def build_row_kernel(graph: LayerGraph, op: Operator) -> RowKernelModel:
    """The :class:`RowKernelModel` of an EW or SN operator of ``graph`` (fused or single); a layout
    plan's vectorized letter (``op.attrs["vector"]``) becomes the innermost letter when it can."""
    members = kernel_members(graph, op)
    full, inner, rows = row_kernel_space(graph, members, op.attrs.get("vector"))
    memory: dict[str, str] = {}
    produced: set[str] = set()
    loads, stores, row_values, row_scalars, columns = [], [], [], [], []
    for m in members:
        column = op_kind(m["kind"]).reduction == "column"
        for t, a in m["inputs"].values():
            if t in graph.tensors:
                memory.setdefault(t, a)
            if t in produced:
                kept = row_values if frozenset(access_letters(a)) == full else row_scalars
                if t not in row_values + row_scalars:
                    kept.append(t)
            elif t in graph.tensors and t not in loads:
                loads.append(t)
        for t, a in m["outputs"].values():
            if t in graph.tensors:
                memory.setdefault(t, a)
                if not column:
                    stores.append(t)
            produced.add(t)
        if column:
            columns += [(t, a) for _, (t, a) in sorted(m["outputs"].items())]
    return RowKernelModel(tuple(members), full, tuple(inner), tuple(rows), memory, tuple(loads), tuple(stores),
                          tuple(row_values), tuple(row_scalars), tuple(columns))


def is_row_kernel(op: Operator) -> bool:
    """Whether ``op`` runs as a row kernel: a fused operator, or a kind with a row body (the TC kinds,
    contraction and attention, have none)."""
    return op.kind == "fused" or op_kind(op.kind).row is not None


#: The layer's input and output, which a forward-only library may read and write through a row index.
ROW_INDEXED_CANDIDATES = ("X", "Y")


def row_pitch(graph: LayerGraph, tensor: str, access: str, rows: tuple) -> object | None:
    """The element stride of row ``(b, j)`` of ``tensor[access]`` in a row kernel whose row letters are
    ``rows``, when the kernel's row number ``b J + j`` times that stride is the row's offset (rows
    ``B``, ``J`` of a tensor stored B-major, then J, a dense row of the inner letters each); else None."""
    if tuple(rows) != ("B", "J"):
        return None
    op = resolve_operand(graph, tensor, access)
    pitch = op.strides.get("J")
    if op.base != 0 or pitch is None or sympy.simplify(op.strides.get("B", 0) - pitch * dim_symbol("J")) != 0:
        return None
    inner = {c: s for c, s in op.strides.items() if c not in rows}
    return pitch if sympy.simplify(sum(s * (dim_symbol(c) - 1) for c, s in inner.items()) + 1 - pitch) == 0 else None


def row_kernel_models(graph: LayerGraph) -> dict:
    """Operator -> :class:`RowKernelModel` of every row kernel (EW or SN operator) of ``graph``."""
    return {op: build_row_kernel(graph, op) for op in graph.operators() if is_row_kernel(op)}


def row_indexed_tensors(graph: LayerGraph, kernels: dict | None = None) -> tuple[str, ...]:
    """Which of X and Y the library of a forward-only graph (no tensor saved for backward) reads or
    writes through a row index, so that packed batches need no gather or scatter copy
    (:func:`substation.runtime.packing.run_packed`): X when only row kernels read it, Y when a row
    kernel writes it, each with rows (b, j) that are dense rows of the tensor (:func:`row_pitch`).
    A training graph's: none. ``kernels``: :func:`row_kernel_models` of ``graph`` when already built."""
    if not graph.forward_only:
        return ()
    ops = graph.operators()
    kernels = row_kernel_models(graph) if kernels is None else kernels
    out = []
    for name in ROW_INDEXED_CANDIDATES:
        users = [op for op in ops if name in {t for t, _ in graph.operands(op).values()}]
        if users and all(op in kernels and name in kernels[op].memory
                         and row_pitch(graph, name, kernels[op].memory[name], kernels[op].rows) is not None
                         for op in users):
            out.append(name)
    return tuple(out)


# -- the member API -------------------------------------------------------------------------------
class RowSweep:
    """One sweep of a member over the row's inner letters (opened by :meth:`RowEmitter.sweep`):
    per-element statements in order, and the accumulators they reduce. Operands are named by the
    member's connectors."""

    def __init__(self, kernel: "RowEmitter"):
        self.kernel = kernel
        self.lines: list[str] = []                   # per-element statements, in order
        self.reductions: list[tuple[str, str]] = []  # (accumulator, REDUCTIONS entry), first use first
        self.outputs: list[tuple[str, str]] = []     # (tensor, access) stored by this sweep
        self._loaded: dict[str, str] = {}

    def __getitem__(self, conn: str) -> str:
        """``sweep[conn]`` is :meth:`load`."""
        return self.load(conn)

    def load(self, conn: str) -> str:
        """The element value of input ``conn`` (loaded once per sweep).

        Raises:
            KeyError: the member has no such input.
        """
        if conn not in self._loaded:
            t, a = self.kernel.member["inputs"][conn]
            scalar = self.kernel.row_scalar(t)
            self._loaded[conn] = scalar if scalar is not None else self.kernel._load(self, conn, t, a)
        return self._loaded[conn]

    def let(self, name: str, expr: str, ctype: str | None = None) -> str:
        """Declare the per-element constant ``name`` (compute type unless ``ctype``) and return it."""
        self.stmt(f"const {ctype or self.kernel.T} {name} = {expr};")
        return name

    def stmt(self, line: str) -> None:
        """A per-element statement of the target's C dialect."""
        self.lines.append(line)

    def reduce(self, acc: str, expr: str) -> None:
        """Fold ``expr`` into the accumulator ``acc`` (see :meth:`RowEmitter.accumulator`); it holds the
        whole row's result after the sweep.

        Raises:
            KeyError: ``acc`` is not an accumulator of this kernel.
        """
        op = self.kernel._accumulators[acc]
        self.stmt(f"{acc} += {expr};" if op == "sum" else f"{acc} = {self.kernel.fn('max_', acc, expr)};")
        if all(a != acc for a, _ in self.reductions):
            self.reductions.append((acc, op))

    def store(self, conn: str, expr: str) -> None:
        """Output ``conn`` of the element is ``expr``: to memory and/or kept for later members.

        Raises:
            KeyError: the member has no such output.
        """
        t, a = self.kernel.member["outputs"][conn]
        self.outputs.append((t, a))
        self.kernel._store(self, t, a, expr)

    def add_to_column(self, conn: str, expr: str) -> None:
        """Add ``expr`` to the column reduction ``conn`` (summed over the rows, deterministically)."""
        t, _ = self.kernel.member["outputs"][conn]
        self.stmt(f"{self.kernel._column(t)} += {expr};")

    def index(self, letter: str) -> str:
        """The element's index along ``letter`` (an inner or row letter)."""
        return self.kernel._index(letter)

    def random_bits(self, stream: int, dims: str) -> str:
        """The element's 16 random bits of Philox stream ``stream`` at the row-major index over
        ``dims`` (the generated code's counter-based generator, see :mod:`substation.ops.dropout`)."""
        return self.kernel._random_bits(self, stream, dims)


class RowEmitter:
    """The target-neutral API of the kinds' member bodies; a back end subclasses it for one target.

    A body ``row(kernel, attrs)`` runs once per member (:meth:`emit_members`), with
    :attr:`member` the member's record. It declares accumulators and row-level values, opens sweeps
    (:meth:`sweep`, :meth:`map`) and writes row-level statements (:meth:`row`). After a sweep that
    reduces, its accumulators hold the whole row's result; consecutive sweeps with no reduction or
    row-level statement between them may run as one loop (members included). Expressions are C with
    the vocabulary below; ``nn_`` (:attr:`row_length`) is the number of elements of a row.

    Attributes:
        target: the back end's name (``cpu`` or ``cuda``), which selects a kind's override.
        T: the compute type of the elements (a C++ type name).
        S: the type of normalization statistics (wider than ``T`` where the target keeps them so).
        model: the kernel's :class:`RowKernelModel`.
        member: the record of the member being emitted; index: its position.
    """

    target = ""
    #: :meth:`fn` spells a function ``NAMESPACE + name`` unless FUNCTIONS spells it otherwise.
    NAMESPACE = ""
    FUNCTIONS: dict[str, str] = {}
    #: The C name of the number of elements of a row.
    row_length = "nn_"

    def __init__(self, model: RowKernelModel, element_type: str, statistics_type: str):
        self.model, self.T, self.S = model, element_type, statistics_type
        self.begin_members()

    # the target's hooks ---------------------------------------------------------------------------
    def _hoist(self, line: str) -> None:
        """A row-level statement placed before the sweeps since the last row-level statement."""
        raise NotImplementedError

    def _after(self, line: str) -> None:
        """A row-level statement after everything so far (pending reductions completed)."""
        raise NotImplementedError

    def _load(self, sweep: RowSweep, conn: str, t: str, a: str) -> str:
        """The element value of input ``conn`` (tensor ``t``, access ``a``) inside ``sweep``."""
        raise NotImplementedError

    def _store(self, sweep: RowSweep, t: str, a: str, expr: str) -> None:
        """Make ``expr`` the element's value of ``t`` (to memory and/or kept for later members)."""
        raise NotImplementedError

    def _end_sweep(self, sweep: RowSweep) -> None:
        """Emit ``sweep``; its accumulators must hold the row's result after it."""
        raise NotImplementedError

    def _row_read(self, t: str, a: str, ctype: str) -> str:
        """A row-level memory value of ``t`` converted to ``ctype``."""
        raise NotImplementedError

    def _store_row(self, t: str, a: str, value: str) -> None:
        """Store the row-level ``value`` of ``t`` to memory, after everything so far."""
        raise NotImplementedError

    def _column(self, t: str) -> str:
        """The element's accumulator (an lvalue) of the column reduction into ``t``."""
        raise NotImplementedError

    def _index(self, letter: str) -> str:
        """The element's index along ``letter``."""
        raise NotImplementedError

    def _random_bits(self, sweep: RowSweep, stream: int, dims: str) -> str:
        """See :meth:`RowSweep.random_bits`; how the bits are drawn follows :meth:`RowKernelModel.random_run`."""
        raise NotImplementedError

    def _member_start(self) -> None:
        """Called before each member's body."""

    def _member_end(self) -> None:
        """Called after each member's body."""

    # running the members --------------------------------------------------------------------------
    def begin_members(self) -> None:
        """Forget the row-level names of a previous :meth:`emit_members`."""
        self.index, self.member = 0, None
        self._accumulators: dict[str, str] = {}
        self._row_inputs: dict[tuple[str, str], str] = {}
        self._row_scalars: dict[str, str] = {}
        self._centered: set[str] = set()
        self._narrowed: set[str] = set()
        self._open: RowSweep | None = None

    def emit_members(self) -> None:
        """Run every member's body in order: its kind's override for :attr:`target`, else its ``row``
        emitter (:meth:`substation.ops.OpKind.row_emitter`)."""
        for i, m in enumerate(self.model.members):
            self.index, self.member = i, m
            self._member_start()
            op_kind(m["kind"]).row_emitter(self.target)(self, m["attrs"])
            self._member_end()

    # vocabulary -----------------------------------------------------------------------------------
    def fn(self, name: str, *args: str) -> str:
        """A call of the vocabulary's function ``name`` (``exp_``, ``max_``, ``rsqrt_``, ``dropout``,
        an activation or its ``_grad``) in the target's spelling."""
        return f"{self.FUNCTIONS.get(name, self.NAMESPACE + name)}({', '.join(args)})"

    def cast(self, expr: str, ctype: str | None = None) -> str:
        """``expr`` converted to ``ctype`` (default :attr:`T`)."""
        return f"({ctype or self.T})" + (expr if re.fullmatch(r"[\w.]+(e[+-]?\d+)?", expr) else f"({expr})")

    def lit(self, value, ctype: str | None = None) -> str:
        """The number ``value`` as a constant of ``ctype`` (default :attr:`T`)."""
        return self.cast(repr(value), ctype)

    def neg_inf(self, ctype: str | None = None) -> str:
        """Minus infinity in ``ctype`` (default :attr:`T`)."""
        return self.cast("-INFINITY", ctype)

    def names(self, *stems: str) -> list[str]:
        """Row-level variable names private to the current member."""
        return [f"{s}{self.index}_" for s in stems]

    def access(self, conn: str) -> str:
        """The access string of the member's operand ``conn`` (an input or an output)."""
        ins, outs = self.member["inputs"], self.member["outputs"]
        return (ins[conn] if conn in ins else outs[conn])[1]

    # row level ------------------------------------------------------------------------------------
    def pre(self, line: str) -> None:
        """A row-level statement that reads only row inputs and earlier row-level values (a
        declaration or a load): placed before pending sweeps so that they can run as one loop."""
        self._hoist(line)

    def row(self, line: str) -> None:
        """A row-level statement that depends on the sweeps so far (their reductions complete)."""
        self._after(line)

    def let_row(self, stem: str, expr: str, ctype: str | None = None) -> str:
        """A row-level constant (of type ``ctype``, default :attr:`T`) after the sweeps so far; its name."""
        name, = self.names(stem)
        self.row(f"const {ctype or self.T} {name} = {expr};")
        return name

    def accumulator(self, stem: str, op: str, ctype: str | None = None) -> str:
        """Declare a row accumulator of type ``ctype`` (default :attr:`T`) for :meth:`RowSweep.reduce`: 0 for
        ``sum``, -inf for ``max``; its name.

        Raises:
            ValueError: ``op`` is not in :data:`REDUCTIONS`.
        """
        if op not in REDUCTIONS:
            raise ValueError(f"row reduction must be one of {', '.join(REDUCTIONS)}, got {op!r}")
        name, = self.names(stem)
        self.pre(f"{ctype or self.T} {name} = {'0' if op == 'sum' else self.neg_inf(ctype)};")
        self._accumulators[name] = op
        return name

    def row_scalar(self, tensor: str) -> str | None:
        """The row-level variable holding ``tensor`` if an earlier member produced it per row, else None."""
        return self._row_scalars.get(tensor)

    def row_input(self, conn: str, ctype: str | None = None) -> str:
        """A per-row input (letters within R, e.g. a normalization statistic) as a row-level constant
        of type ``ctype`` (default :attr:`T`), loaded once per row for the whole kernel; its name."""
        t, a = self.member["inputs"][conn]
        ctype = ctype or self.T
        if (t, ctype) not in self._row_inputs:
            name, = self.names(conn)
            scalar = self.row_scalar(t)
            self.pre(f"const {ctype} {name} = {self.cast(scalar, ctype) if scalar else self._row_read(t, a, ctype)};")
            self._row_inputs[t, ctype] = name
        return self._row_inputs[t, ctype]

    def row_output(self, conn: str, value: str) -> None:
        """The per-row output ``conn`` is the row-level value ``value`` (stored once per row)."""
        t, a = self.member["outputs"][conn]
        if t in self.model.row_scalars:
            self._row_scalars[t] = value
        if t in self.model.memory:
            self._store_row(t, a, value)

    def centered(self, mean: str) -> Callable[[str], str]:
        """``x -> x - mean`` in :attr:`T` for a row-level ``mean`` of type :attr:`S`. Where S is wider,
        the mean is split into a head and a tail of type T (``x - head`` is exact near the mean,
        Sterbenz), so rows with a large mean and a small spread keep their accuracy while every
        per-element operation stays in T (full SIMD width)."""
        if self.S == self.T:
            return lambda x: f"({x} - {mean})"
        if mean not in self._centered:
            self._centered.add(mean)
            head = f"{mean}h_"
            tail = self.cast(f"{mean} - {self.cast(head, self.S)}")
            self.pre(f"const {self.T} {head} = {self.cast(mean)}, {mean}l_ = {tail};")
        return lambda x: f"(({x} - {mean}h_) - {mean}l_)"

    def narrow(self, value: str) -> str:
        """A row-level ``value`` of type :attr:`S` as a constant of type :attr:`T`."""
        if self.S == self.T:
            return value
        if value not in self._narrowed:
            self._narrowed.add(value)
            self.pre(f"const {self.T} {value}t_ = {self.cast(value)};")
        return f"{value}t_"

    # sweeps ---------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def sweep(self) -> Iterator[RowSweep]:
        """A sweep over the row (``with kernel.sweep() as e:``), emitted when the block ends.

        Raises:
            RuntimeError: a sweep is opened inside another.
        """
        if self._open is not None:
            raise RuntimeError("row-kernel sweeps do not nest")
        self._open = sweep = RowSweep(self)
        try:
            yield sweep
        finally:
            self._open = None
        self._end_sweep(sweep)

    def map(self, expression: Callable[[RowSweep], str]) -> None:
        """An element-wise member: its one output is ``expression(sweep)``, every input loaded first."""
        (out,) = self.member["outputs"]
        with self.sweep() as e:
            for conn in sorted(self.member["inputs"]):
                e.load(conn)
            e.store(out, expression(e))
