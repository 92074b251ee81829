"""The encoder layer as a dataflow graph: DaCe SDFGs of operators over named tensors.

Each operator of the layer is one :class:`Operator` library node in a single-state SDFG, labelled
with its name (``qkv``, ``softmax``, ``layer_norm1``, ...) and its class (TC tensor contraction,
SN statistical normalization, EW element-wise; Ivanov et al. 2020, section 3). Tensors are SDFG
arrays whose shapes are symbolic in the dimension letters B, J, K, H, P, I, U (and ``T``, of size 3, for
the stacked Q/K/V weights); their strides encode the data layout.

Every operand of an operator is an *access*: the tensor's dimensions in order, one character each,
where a letter names the loop index that runs along that dimension (it may rename the tensor's own
letter, e.g. keys ``K`` along the ``J`` dimension of the stacked QKV tensor) and a digit fixes the
index (``BJ0HP`` is Q inside ``QKV[B, J, T, H, P]``).
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import uuid
import dace
import dace.library
import networkx as nx
import sympy
from dace.properties import DictProperty, Property

from ..config import EncoderConfig
from ..files import atomic_write_text

__all__ = ["Operator", "TensorInfo", "LayerGraph", "GraphBuilder", "build_forward", "parameters", "DIMENSIONS",
           "access_letters"]

#: Dimension letters and their meaning (DESIGN.md section 2); ``3`` stacks Q, K and V.
DIMENSIONS = {"B": "batch", "J": "query position", "K": "key position", "H": "heads", "P": "head size",
              "I": "hidden size", "U": "feed-forward size", "T": "Q/K/V stack (size 3)"}
#: Sizes fixed when code is generated (the rest, B, J, K, are runtime arguments).
STATIC_DIMENSIONS = ("H", "P", "I", "U")

OP_CLASSES = ("TC", "SN", "EW")
_NO_DEBUGINFO = dace.dtypes.DebugInfo(0)


@dace.library.node
class Operator(dace.sdfg.nodes.LibraryNode):
    """One operator of the encoder layer (or a fused group of operators, after fusion).

    Connectors are operand roles (``x``, ``w``, ``y``, ...); each connector's access string is in
    :attr:`accesses`. :attr:`attrs` holds the kind-specific attributes as JSON text.
    """

    implementations: dict = {}
    default_implementation = None

    kind = Property(dtype=str, default="", desc="Operator kind: contraction, bias, dropout, softmax, ...")
    op_class = Property(dtype=str, default="EW", desc="TC, SN or EW")
    phase = Property(dtype=str, default="forward", desc="forward or backward")
    accesses = DictProperty(key_type=str, value_type=str, desc="Connector -> access string")
    attrs_json = Property(dtype=str, default="{}", desc="Kind-specific attributes (JSON)")

    def __init__(self, name: str = "op", kind: str = "", op_class: str = "EW", phase: str = "forward",
                 inputs=(), outputs=(), accesses=None, attrs=None):
        super().__init__(name, inputs=set(inputs), outputs=set(outputs))
        self.kind = kind
        self.op_class = op_class
        self.phase = phase
        self.accesses = dict(accesses or {})
        self.attrs_json = json.dumps(attrs or {}, sort_keys=True)

    @property
    def attrs(self) -> dict:
        """The kind-specific attributes (a fresh dict)."""
        return json.loads(self.attrs_json)

    def __str__(self) -> str:
        return f"{self.label} [{self.op_class}]"


def access_letters(access: str) -> str:
    """The dimension letters of an access string, in order (``"BJ0HP"`` -> ``"BJHP"``; a digit
    indexes a static stack dimension such as T and is not a letter)."""
    return "".join(c for c in access if not c.isdigit())


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """A tensor of a layer graph.

    Attributes:
        name: the SDFG array name.
        dims: dimension letters in logical (PyTorch) order, e.g. ``BJI``.
        role: ``input`` (given by the caller: X, dY, the mask), ``param``, ``output`` (returned),
            ``saved`` (forward tensor kept for backward; an input of the backward graph) or ``temp``.
        layout: the dimension letters from outermost to innermost (the last has stride 1).
        dtype: the dtype name the tensor is stored in, where a pass chose one (mixed precision:
            :mod:`substation.passes.precision`); None: the config's dtype (the back end's rule).
    """

    name: str
    dims: str
    role: str
    layout: str
    dtype: str | None = None

    def shape(self, sizes: dict[str, int]) -> tuple[int, ...]:
        """The logical shape for the given dimension sizes."""
        return tuple(sizes[d] for d in self.dims)


def size_symbol(dim: str):
    """The SDFG symbol (or constant) for a dimension letter."""
    return 3 if dim == "T" else dace.symbol(dim, dace.int64)


def layout_strides(dims: str, layout: str, symbol=size_symbol) -> tuple:
    """Symbolic element strides, in logical dimension order, of a dense tensor stored in ``layout``
    (``symbol`` maps a dimension letter to its size)."""
    if sorted(dims) != sorted(layout):
        raise ValueError(f"layout {layout!r} is not a permutation of the dimensions {dims!r}")
    stride: dict[str, object] = {}
    acc = sympy.Integer(1)
    for d in reversed(layout):
        stride[d] = acc
        acc = acc * symbol(d)
    return tuple(stride[d] for d in dims)


@dataclasses.dataclass
class LayerGraph:
    """An SDFG of one pass of the layer plus the tensor metadata the SDFG itself cannot carry.

    Attributes:
        sdfg: the DaCe SDFG (one state holding every operator).
        tensors: tensor name -> :class:`TensorInfo`, in argument order.
        phase: ``forward`` or ``backward``.
        config: the encoder config the graph was built for.
    """

    sdfg: dace.SDFG
    tensors: dict[str, TensorInfo]
    phase: str
    config: EncoderConfig

    @property
    def forward_only(self) -> bool:
        """Whether this is the graph of a forward-only (inference) library: a forward graph that saves
        nothing for backward."""
        return self.phase == "forward" and not any(t.role == "saved" for t in self.tensors.values())

    @property
    def state(self) -> dace.SDFGState:
        """The SDFG's single state, which holds every operator."""
        return self.sdfg.nodes()[0]

    def operators(self) -> list[Operator]:
        """The operators in a deterministic topological order (ties broken by creation order)."""
        state = self.state
        order = {n: i for i, n in enumerate(state.nodes())}
        g = nx.DiGraph()
        g.add_nodes_from(state.nodes())
        g.add_edges_from((e.src, e.dst) for e in state.edges())
        return [n for n in nx.lexicographical_topological_sort(g, key=order.__getitem__)
                if isinstance(n, Operator)]

    def check(self) -> None:
        """Substation's own consistency checks, next to ``sdfg.validate()``: every operand names a
        tensor of the graph (or, inside a fused operator, one its kernel keeps to itself) with one
        access letter or index per dimension, and every tensor's SDFG array has the strides of its
        layout.

        Raises:
            ValueError: the first inconsistency, named.
        """
        for name, info in self.tensors.items():
            array = self.sdfg.arrays.get(name)
            if array is None:
                raise ValueError(f"{self.phase} graph: tensor {name} has no SDFG array")
            if sorted(info.layout) != sorted(info.dims):
                raise ValueError(f"{self.phase} graph: tensor {name} has layout {info.layout} for dims {info.dims}")
            want = layout_strides(info.dims, info.layout)
            if tuple(sympy.sympify(s) - sympy.sympify(w) for s, w in zip(array.strides, want)) != (0,) * len(want):
                raise ValueError(f"{self.phase} graph: {name}'s SDFG strides {tuple(array.strides)} differ from "
                                 f"its layout {info.layout} {want}")
        for op in self.operators():
            members = op.attrs["ops"] if op.kind == "fused" else [{"inputs": self.inputs_of(op),
                                                                    "outputs": self.outputs_of(op)}]
            for m in members:
                for conn, (t, access) in (*m["inputs"].items(), *m["outputs"].items()):
                    info = self.tensors.get(t)
                    if info is None:
                        if op.kind != "fused":
                            raise ValueError(f"{self.phase} graph: {op.label}.{conn} reads or writes unknown tensor {t}")
                    elif len(access) != len(info.dims):
                        raise ValueError(f"{self.phase} graph: {op.label}.{conn} accesses {t}[{access}], but {t} "
                                         f"has dims {info.dims}")

    def operands(self, op: Operator) -> dict[str, tuple[str, str]]:
        """Connector -> (tensor name, access string) for every input and output of ``op``."""
        res = {}
        for e in self.state.in_edges(op):
            res[e.dst_conn] = (e.data.data, op.accesses[e.dst_conn])
        for e in self.state.out_edges(op):
            res[e.src_conn] = (e.data.data, op.accesses[e.src_conn])
        return res

    def inputs_of(self, op: Operator) -> dict[str, tuple[str, str]]:
        """Input connector -> (tensor name, access string) of ``op``."""
        return {e.dst_conn: (e.data.data, op.accesses[e.dst_conn]) for e in self.state.in_edges(op)}

    def outputs_of(self, op: Operator) -> dict[str, tuple[str, str]]:
        """Output connector -> (tensor name, access string) of ``op``."""
        return {e.src_conn: (e.data.data, op.accesses[e.src_conn]) for e in self.state.out_edges(op)}

    def find(self, name: str) -> Operator:
        """The operator labelled ``name``.

        Raises:
            KeyError: no such operator.
        """
        for op in self.operators():
            if op.label == name:
                return op
        raise KeyError(f"no operator named {name!r} in the {self.phase} graph")

    def save(self, path: str) -> None:
        """Write the SDFG as a ``.sdfg`` file (viewable in DaCe's viewer), atomically. The same graph
        always gives the same bytes: DaCe's random element ids (``guid``, uuid4) are replaced by ids
        numbered in file order, so regenerated graphs diff only where the graph changed."""
        data = self.sdfg.to_json(hash=True)
        number = itertools.count()

        def renumber(node) -> None:
            items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
            for key, value in items:
                if key == "guid" and isinstance(value, str):
                    node[key] = str(uuid.uuid5(uuid.NAMESPACE_OID, f"substation-graph-element-{next(number)}"))
                else:
                    renumber(value)

        renumber(data)
        atomic_write_text(path, dace.serialize.dumps(data))


def _parse_ref(ref: str, tensors: dict[str, TensorInfo]) -> tuple[str, str]:
    """``"QKV[BJ0HP]"`` -> (``"QKV"``, ``"BJ0HP"``); ``"X"`` -> (``"X"``, its dims)."""
    if "[" in ref:
        name, acc = ref[:-1].split("[")
    else:
        name, acc = ref, None
    info = tensors[name]
    acc = info.dims if acc is None else acc
    if len(acc) != len(info.dims):
        raise ValueError(f"access {acc!r} of {name} does not match its dimensions {info.dims!r}")
    return name, acc


class GraphBuilder:
    """Builds a :class:`LayerGraph` operator by operator (tensors are written once)."""

    def __init__(self, name: str, config: EncoderConfig, phase: str):
        self.config = config
        self.phase = phase
        self.sdfg = dace.SDFG(name)
        for d in ("B", "J", "K", "H", "P", "I", "U"):
            self.sdfg.add_symbol(d, dace.int64)
        self.state = self.sdfg.add_state(phase)
        self.tensors: dict[str, TensorInfo] = {}
        self._nodes: dict[str, dace.nodes.AccessNode] = {}
        self.dtype = getattr(dace, config.dtype)

    def tensor(self, name: str, dims: str, role: str, layout: str | None = None, dtype: str | None = None) -> str:
        """Declare a tensor (``dtype``: a dtype name, None for the config's); returns its name."""
        if name in self.tensors:
            raise ValueError(f"tensor {name} declared twice")
        layout = layout or dims
        shape = [size_symbol(d) for d in dims]
        self.sdfg.add_array(name, shape, getattr(dace, dtype) if dtype else self.dtype,
                            strides=layout_strides(dims, layout), transient=role == "temp")
        self.tensors[name] = TensorInfo(name, dims, role, layout, dtype)
        return name

    def copy_tensor(self, info: TensorInfo, role: str | None = None, layout: str | None = None,
                    name: str | None = None, dtype: str | None = None) -> str:
        """Declare a tensor like ``info`` (its dims and dtype), with ``role``, ``layout``, ``name`` and
        ``dtype`` where given; returns its name."""
        return self.tensor(name or info.name, info.dims, role or info.role, layout or info.layout, dtype or info.dtype)

    def _node(self, name: str) -> dace.nodes.AccessNode:
        if name not in self._nodes:
            # An explicit debuginfo spares DaCe an inspect.stack() per node (most of the build time).
            self._nodes[name] = self.state.add_access(name, debuginfo=_NO_DEBUGINFO)
        return self._nodes[name]

    def op(self, name: str, kind: str, op_class: str, inputs: dict[str, str], outputs: dict[str, str],
           **attrs) -> Operator:
        """Add an operator. ``inputs``/``outputs`` map connector -> tensor reference (``"X"`` or
        ``"QKV[BJ0HP]"``); output tensors not yet declared are created as temporaries whose
        dimensions are the access letters."""
        if op_class not in OP_CLASSES:
            raise ValueError(f"operator class must be one of {OP_CLASSES}, got {op_class}")
        for ref in outputs.values():
            tname = ref.split("[")[0]
            if tname not in self.tensors:
                if "[" not in ref:
                    raise ValueError(f"new tensor {tname} needs its dimensions, e.g. {tname}[BJI]")
                self.tensor(tname, ref.split("[")[1][:-1], "temp")
        ins = {c: _parse_ref(r, self.tensors) for c, r in inputs.items()}
        outs = {c: _parse_ref(r, self.tensors) for c, r in outputs.items()}
        node = Operator(name, kind, op_class, self.phase, inputs=ins, outputs=outs,
                        accesses={c: a for c, (_, a) in {**ins, **outs}.items()}, attrs=attrs)
        node.debuginfo = _NO_DEBUGINFO
        self.state.add_node(node)
        for c, (t, a) in ins.items():
            self.state.add_edge(self._node(t), None, node, c, dace.Memlet(data=t, subset=self._subset(t, a)))
        for c, (t, a) in outs.items():
            self.state.add_edge(node, c, self._node(t), None, dace.Memlet(data=t, subset=self._subset(t, a)))
        return node

    def _subset(self, tensor: str, access: str) -> str:
        dims = self.tensors[tensor].dims
        return ", ".join(c if c.isdigit() else f"0:{d if d != 'T' else 3}" for c, d in zip(access, dims))

    def finish(self) -> LayerGraph:
        """The built :class:`LayerGraph`."""
        return LayerGraph(self.sdfg, self.tensors, self.phase, self.config)


def parameters(config: EncoderConfig) -> dict[str, str]:
    """The layer's parameters, name -> dims, in the order the operators (and ``EncoderLayer``) take them.

    Names and shapes are those of ``torch.nn.TransformerEncoderLayer`` (``in_proj_weight`` is
    [3 * I, I] = [T, H, P, I]); ``norm_type: rms_norm`` has norm weights [I] and no norm biases.
    """
    params = {
        "in_proj_weight": "THPI", "in_proj_bias": "THP",
        "out_proj_weight": "IHP", "out_proj_bias": "I",
        "linear1_weight": "UI", "linear1_bias": "U",
        "linear2_weight": "IU", "linear2_bias": "I",
    }
    for norm in ("norm1", "norm2"):
        params[f"{norm}_weight"] = "I"
        if config.norm_type == "layer_norm":
            params[f"{norm}_bias"] = "I"
    return params


#: Dropout sites: operator name -> (config field, random stream id, dims of the random index).
DROPOUT_SITES = {
    "attention_dropout": ("attention", 1, "BHJK"),
    "out_dropout": ("attention_output", 2, "BJI"),
    "activation_dropout": ("activation", 3, "BJU"),
    "ffn_dropout": ("hidden", 4, "BJI"),
}


def build_forward(config: EncoderConfig, dropout: bool = True) -> LayerGraph:
    """The forward pass of one encoder layer (post-LN BERT or pre-LN; layer norm or RMSNorm, whose
    operators are still named ``layer_norm1`` / ``layer_norm2``) as a :class:`LayerGraph`.

    Inputs: ``X[B, J, I]`` and, unless ``config.mask == "none"``, the additive key mask ``mask[B, K]``.
    Output: ``Y[B, J, I]``. Operators follow docs/design.md; a dropout with p = 0 is left out, and
    every dropout with ``dropout=False`` (the inference graph, which never runs in train mode).
    """
    suffix = "forward" if dropout else "inference"
    g = GraphBuilder(f"{config.name.replace('-', '_').replace('.', '_')}_{suffix}", config, "forward")
    g.tensor("X", "BJI", "input")
    has_mask = config.mask != "none"
    if has_mask:
        g.tensor("mask", "BK", "input")
    for name, dims in parameters(config).items():
        g.tensor(name, dims, "param")
    g.tensor("Y", "BJI", "output")
    post = config.layer_norm == "post"

    def dropout_site(name: str, src: str, dst: str, dims: str) -> str:
        field, stream, rng_dims = DROPOUT_SITES[name]
        p = config.dropout.probability(field) if dropout else 0.0
        if p == 0.0:
            return src
        g.op(name, "dropout", "EW", {"x": src}, {"y": f"{dst}[{dims}]"}, p=p, stream=stream, rng_dims=rng_dims)
        return dst

    def normalize(name: str, src: str, dst: str, norm: str) -> str:
        # ``norm`` prefixes the parameters (norm1, norm2); the operator name is the same for either norm_type.
        if config.norm_type == "rms_norm":
            g.op(name, "rms_norm", "SN", {"x": src, "gamma": f"{norm}_weight"},
                 {"y": f"{dst}[BJI]", "rstd": f"{name}_rstd[BJ]"}, axis="I", eps=config.layer_norm_eps)
        else:
            g.op(name, "layer_norm", "SN", {"x": src, "gamma": f"{norm}_weight", "beta": f"{norm}_bias"},
                 {"y": f"{dst}[BJI]", "mean": f"{name}_mean[BJ]", "rstd": f"{name}_rstd[BJ]"},
                 axis="I", eps=config.layer_norm_eps)
        return dst

    attn_in = "X" if post else normalize("layer_norm1", "X", "X_norm1", "norm1")
    g.op("qkv", "contraction", "TC", {"x": attn_in, "w": "in_proj_weight"}, {"y": "QKV_raw[BJTHP]"})
    g.op("input_bias", "bias", "EW", {"x": "QKV_raw", "b": "in_proj_bias"}, {"y": "QKV[BJTHP]"})
    g.op("scores", "contraction", "TC", {"q": "QKV[BJ0HP]", "k": "QKV[BK1HP]"}, {"y": "S[BHJK]"},
         alpha=1.0 / config.head_size ** 0.5)
    scores = "S"
    if has_mask:
        g.op("mask", "mask", "EW", {"x": "S", "m": "mask"}, {"y": "S_masked[BHJK]"}, causal=config.mask == "causal")
        scores = "S_masked"
    g.op("softmax", "softmax", "SN", {"x": scores}, {"y": "A[BHJK]"}, axis="K")
    attn = dropout_site("attention_dropout", "A", "A_drop", "BHJK")
    g.op("context", "contraction", "TC", {"attn": attn, "v": "QKV[BK2HP]"}, {"y": "C[BJHP]"})
    g.op("out_proj", "contraction", "TC", {"x": "C", "w": "out_proj_weight"}, {"y": "O_raw[BJI]"})
    g.op("out_bias", "bias", "EW", {"x": "O_raw", "b": "out_proj_bias"}, {"y": "O[BJI]"})
    out = dropout_site("out_dropout", "O", "O_drop", "BJI")
    g.op("residual1", "add", "EW", {"a": out, "b": "X"}, {"y": "R1[BJI]"})
    if post:
        ffn_in = residual = normalize("layer_norm1", "R1", "N1", "norm1")
    else:
        residual = "R1"
        ffn_in = normalize("layer_norm2", "R1", "N2", "norm2")
    g.op("linear1", "contraction", "TC", {"x": ffn_in, "w": "linear1_weight"}, {"y": "F1_raw[BJU]"})
    g.op("linear1_bias", "bias", "EW", {"x": "F1_raw", "b": "linear1_bias"}, {"y": "F1[BJU]"})
    g.op("activation", "activation", "EW", {"x": "F1"}, {"y": "F1_act[BJU]"}, function=config.activation)
    act = dropout_site("activation_dropout", "F1_act", "F1_drop", "BJU")
    g.op("linear2", "contraction", "TC", {"x": act, "w": "linear2_weight"}, {"y": "F2_raw[BJI]"})
    g.op("linear2_bias", "bias", "EW", {"x": "F2_raw", "b": "linear2_bias"}, {"y": "F2[BJI]"})
    ffn_out = dropout_site("ffn_dropout", "F2", "F2_drop", "BJI")
    if post:
        g.op("residual2", "add", "EW", {"a": ffn_out, "b": residual}, {"y": "R2[BJI]"})
        normalize("layer_norm2", "R2", "Y", "norm2")
    else:
        g.op("residual2", "add", "EW", {"a": ffn_out, "b": residual}, {"y": "Y"})
    return g.finish()

