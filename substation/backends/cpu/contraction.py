"""C++ for the CPU's TC operators: contractions as oneDNN matmul calls (bfloat16; the token-wise ones of
float32 builds with ``fp32_gemm="onednn"``) or BLAS GEMM calls (float32, float64),
possibly in batch loops, and the fused attention kernel of forward-only builds.

Operand pointers come from the tensors' strides (:func:`operand_pointer`); a parameter the library
takes in parts (:func:`~substation.ir.operands.split_stack_params`) is addressed through its table of
per-T pointers, ``<name>_parts_[i_T]``, so its contraction runs one GEMM per T.
"""
from __future__ import annotations

from ...ir.operands import STACK_LETTER, BiasPlan, LayoutError, Operand, c_expr, dim_size, plan_bias, plan_contraction
from ...ops.contraction import EPILOGUE_BIAS, factors
from ...passes.epilogue import float32_master

__all__ = ["PACKED_PARAMETER_ROWS", "emit_attention", "emit_contraction", "operand_pointer"]

#: Rows of the other factor (B x J tokens) from which a ``packed_parameter`` GEMM (bf16, or float32 on
#: oneDNN) reads the packed copy; below, it reads the parameter as given. Each call digests the parameter
#: (one more pass over it):
#: packed was even with plain at 24-64 rows, 3-8% slower at 128-256, 15-60% faster at 2048 (MiniLM's
#: shapes, AMX).
PACKED_PARAMETER_ROWS = 256


def operand_pointer(o: Operand, loops: list, split: frozenset) -> str:
    """C expression of a pointer to ``o``'s first element inside loops over ``(letter, o's stride)``
    pairs; an operand in ``split`` (given in parts) starts from its part for the current T."""
    if o.name in split:
        rest = [(x, s) for x, s in loops if x != STACK_LETTER]
        return f"{o.name}_parts_[i_{STACK_LETTER}] + {_element_offset(o, rest)}"
    return f"{o.name} + {_element_offset(o, loops)}"


def _element_offset(o: Operand, loops: list) -> str:
    """C expression of ``o``'s element offset in loops over (letter, o's stride) pairs, or ``0``."""
    terms = ([c_expr(o.base)] if o.base != 0 else []) + [f"i_{x} * ({c_expr(s)})" for x, s in loops if s != 0]
    return " + ".join(terms) or "0"


def emit_contraction(em, op, ops: dict[str, Operand]) -> None:
    """One contraction ``op`` of the emitter ``em`` (:class:`~substation.backends.cpu.codegen` ``_Emitter``)."""
    out = ops.pop("y")
    bias = ops.pop(EPILOGUE_BIAS, None)
    a, b = factors(ops)
    in_parts = {a.name, b.name} & em.split
    plan = plan_contraction(a, b, out, op.label, loop_stack=bool(in_parts))
    alpha = op.attrs.get("alpha", 1.0)
    token_wise = {x for x, *_ in plan.batch} <= {STACK_LETTER}
    if em.cfg.dtype == "bfloat16" or (em.onednn_fp32 and token_wise):
        _emit_matmul_onednn(em, plan, out, alpha, None if bias is None else plan_bias(plan, bias, op.label),
                            op.attrs.get("activation"), op.attrs.get("packed_parameter"))
        return
    if bias is not None or "activation" in op.attrs:
        raise ValueError(f"contraction {op.label}: an epilogue needs the oneDNN matmul (BLAS has none)")
    operand = {"a": plan.a, "b": plan.b, "c": out}

    def call(pointers) -> str:
        pa, pb, pc = pointers
        return (f"ss::gemm<{em.T}>({str(plan.trans_a).lower()}, {str(plan.trans_b).lower()}, {c_expr(plan.m)}, "
                f"{c_expr(plan.n)}, {c_expr(plan.k)}, {alpha!r}, {pa}, {c_expr(plan.lda)}, {pb}, {c_expr(plan.ldb)}, "
                f"{pc}, {c_expr(plan.ldc)});")

    def pointer(which: str, idx: int) -> str:
        return operand_pointer(operand[which], [(x, s[idx]) for x, *s in plan.batch], em.split)
    pointers = (pointer("a", 0), pointer("b", 1), pointer("c", 2))
    letters = [x for x, *_ in plan.batch]
    if not letters:
        em.w(call(pointers))
        return
    if letters == [STACK_LETTER]:  # one full-size GEMM per T: BLAS's own threads
        em.loops(letters, lambda: em.w(call(pointers)), parallel=False)
        return
    nbatch = " * ".join(dim_size(x) for x in letters)
    # Many small GEMMs: one per thread (BLAS runs single-threaded inside the parallel region).
    em.w(f"if ({nbatch} >= omp_get_max_threads()) {{")
    em.indent += 1
    if em.T == "float":  # AVX-512: our own per-thread GEMM (ss::gemm_small) beats a BLAS call at this size
        em.w("#if defined(__AVX512F__)")
        em.w("#pragma omp parallel")
        em.w("{")
        em.indent += 1
        em.w(f"std::vector<float> pack_(ss::gemm_small_pack_floats({c_expr(plan.n)}, {c_expr(plan.k)}));")
        em.w(f"#pragma omp for collapse({len(letters)}) schedule(static)")
        small = (f"ss::gemm_small({str(plan.trans_a).lower()}, {str(plan.trans_b).lower()}, {c_expr(plan.m)}, "
                 f"{c_expr(plan.n)}, {c_expr(plan.k)}, {alpha!r}f, {pointers[0]}, {c_expr(plan.lda)}, "
                 f"{pointers[1]}, {c_expr(plan.ldb)}, {pointers[2]}, {c_expr(plan.ldc)}, pack_.data());")
        em.loops(letters, lambda: em.w(small), parallel=False)
        em.indent -= 1
        em.w("}")
        em.w("#else")
    em.loops(letters, lambda: em.w(call(pointers)), parallel=True, collapse_all=True)
    if em.T == "float":
        em.w("#endif")
    em.indent -= 1
    em.w("} else {")
    em.indent += 1
    em.loops(letters, lambda: em.w(call(pointers)), parallel=False)
    em.indent -= 1
    em.w("}")


def emit_attention(em, op, ops: dict[str, Operand]) -> None:
    """One ``ss::attention_forward`` call (substation_attention.h), ``ss::attention_forward_bf16`` in
    bfloat16 builds (AMX tiles where the CPU has them and Linux grants them, else AVX512-BF16 dot
    products): per (B, H, query block) the scores stay in a per-thread buffer. Q, K, V, Y and the
    biases of Q, K, V (if any) need P contiguous, the mask K contiguous.

    Raises:
        LayoutError: an operand without unit stride along P, a mask without unit stride along K, biases
            in a bfloat16 build.
    """
    rows_of = {"q": "J", "k": "K", "v": "K", "y": "J"}
    biases = [c for c in ("bq", "bk", "bv") if c in ops]
    for conn in [*rows_of, *biases]:
        if ops[conn].strides.get("P") != 1:
            raise LayoutError(f"{op.label}: operand {conn} ({ops[conn].name}) needs P contiguous")
    mask = ops.get("m")
    if mask is not None and mask.strides.get("K") != 1:
        raise LayoutError(f"{op.label}: the mask needs K contiguous")

    def strides(o: Operand, rows: str) -> str:
        return "{" + ", ".join(f"(int64_t)({c_expr(o.strides[c])})" for c in ("B", rows, "H")) + "}"

    def pointer(o: Operand) -> str:
        return o.name if o.base == 0 else f"{o.name} + {c_expr(o.base)}"
    for conn, rows in rows_of.items():
        em.w(f"const int64_t {conn}_s_[3] = {strides(ops[conn], rows)};")
    m_ptr, m_b = (pointer(mask), f"(int64_t)({c_expr(mask.strides['B'])})") if mask is not None else ("nullptr", "0")
    if biases:
        if len(biases) != 3 or len({c_expr(ops[c].strides["H"]) for c in biases}) != 1:
            raise LayoutError(f"{op.label}: the Q, K, V biases need one stride along H")
        bias = "ss::AttentionBias<T>{" + ", ".join(pointer(ops[c]) for c in biases) + \
            f", (int64_t)({c_expr(ops['bq'].strides['H'])})}}"
    else:
        bias = "ss::AttentionBias<T>{}"
    args = (f"{pointer(ops['q'])}, q_s_, {pointer(ops['k'])}, k_s_, {pointer(ops['v'])}, v_s_, {m_ptr}, {m_b}, "
            f"{str(bool(op.attrs.get('causal'))).lower()}, {pointer(ops['y'])}, y_s_")
    if em.cfg.dtype == "bfloat16":
        if biases:
            raise LayoutError(f"{op.label}: the bf16 kernel takes Q, K, V biased (the QKV GEMM's epilogue)")
        em.w(f"ss::attention_forward_bf16(B, H, J, K, P, {op.attrs['alpha']!r}f, {args});")
        return
    em.w(f"ss::attention_forward<T>(B, H, J, K, P, T({op.attrs['alpha']!r}), {args}, {bias});")


def _emit_matmul_onednn(em, plan, out: Operand, alpha: float, bias: BiasPlan | None,
                        activation: str | None = None, packed_parameter: str | None = None) -> None:
    """oneDNN matmul calls (``ss::matmul``, substation_dnnl.h): operands of the build's dtype (bf16 or
    float32), float32 accumulation, the bias and activation epilogues if any (``activation``: a function
    name of ``ss::GemmActivation``), the output's dtype (bf16, or float32 for parameter gradients);
    ``packed_parameter`` (a parameter's name): where it is factor B, a call of at least
    :data:`PACKED_PARAMETER_ROWS` rows reads it from its packed copy (``b_parameter``), every call
    where it is float32 in a bf16 graph (master weights, rounded to bf16 as they are packed). Batch
    letters both factors run along go into one batched call; a letter one factor
    lacks (the Q/K/V stack T around the QKV GEMM) is a loop of calls, since oneDNN 3.2 runs a
    broadcast factor on its reference kernel (1000x slower)."""
    inputs = (plan.a, plan.b) + (() if bias is None else (bias.operand,))
    element = em.cfg.dtype
    packed = packed_parameter is not None and packed_parameter == plan.b.name  # factor B: a parameter
    masters = packed and float32_master(em.graph, plan.b.name)
    wide = [t.name for t in inputs if em.dtypes[t.name] != element and not (masters and t is plan.b)]
    if wide:  # the mixed-precision pass casts every contraction input
        raise ValueError(f"contraction {out.name} reads {', '.join(wide)} in "
                         f"{', '.join(em.dtypes[t] for t in wide)}; the {element} matmul takes {element} operands, bias")
    bias_strides = bias.batch if bias is not None else [0] * len(plan.batch)
    looped = [(b, s) for b, s in zip(plan.batch, bias_strides) if 0 in (b[1], b[2])]
    batched = [(b, s) for b, s in zip(plan.batch, bias_strides) if 0 not in (b[1], b[2])]
    if len(batched) > 3:
        raise LayoutError(f"contraction {out.name}: {len(batched)} batch letters (the oneDNN matmul takes 3)")
    if any(x == STACK_LETTER for (x, *_), _ in batched) and {t.name for t in inputs} & em.split:
        raise LayoutError(f"contraction {out.name}: an operand in parts along {STACK_LETTER} needs a loop over it")

    def pointer(o: Operand, strides: list) -> str:  # strides: o's along each looped letter
        return operand_pointer(o, [(x, s) for ((x, *_), _), s in zip(looped, strides)], em.split)
    batch = "ss::GemmBatch{}"
    if batched:
        lists = [[dim_size(x) for (x, *_), _ in batched]] + [[c_expr(s[i]) for (_, *s), _ in batched]
                                                             for i in range(3)]
        batch = f"ss::GemmBatch{{{len(batched)}, " + ", ".join("{" + ", ".join(v) + "}" for v in lists) + "}"
    epilogue = ""
    if bias is not None:
        strides = ", ".join(c_expr(s) for _, s in batched) or "0"
        epilogue = (f", ss::GemmBias{{{pointer(bias.operand, [s for _, s in looped])}, "
                    f"{c_expr(bias.m)}, {c_expr(bias.n)}, {{{strides}}}}}")
    if activation is not None:
        epilogue = (epilogue or ", ss::GemmBias{}") + f", ss::GemmActivation::{activation}"
    if packed:
        epilogue = (epilogue or ", ss::GemmBias{}") + ("" if activation is not None else ", ss::GemmActivation::none") \
            + (", true" if masters else f", ({c_expr(plan.m)}) >= {PACKED_PARAMETER_ROWS}")
    types = ("ss::bf16_t, float" if masters else "ss::bf16_t") if element == "bfloat16" else "float"
    call = (f"if (ss::matmul<{types}>({str(plan.trans_a).lower()}, {str(plan.trans_b).lower()}, {c_expr(plan.m)}, "
            f"{c_expr(plan.n)}, {c_expr(plan.k)}, {alpha!r}f, {pointer(plan.a, [b[1] for b, _ in looped])}, "
            f"{c_expr(plan.lda)}, {pointer(plan.b, [b[2] for b, _ in looped])}, {c_expr(plan.ldb)}, "
            f"{pointer(out, [b[3] for b, _ in looped])}, {c_expr(plan.ldc)}, "
            f"{str(em.dtypes[plan.c.name] == 'float32').lower()}, {batch}{epilogue}) != 0) return 1;")
    em.loops([x for (x, *_), _ in looped], lambda: em.w(call), parallel=False)
