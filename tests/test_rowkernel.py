"""The row-kernel model (what a fused kernel loads, keeps, reduces and stores) and the target-neutral
member API the kinds' bodies are written against, checked through a recording back end."""
import dataclasses
import warnings

import pytest

from substation.config import load_config
from substation.ops import op_kind
from substation.pipeline import compile_graphs
from substation.backends.rowkernel import RowEmitter, build_row_kernel


@pytest.fixture(scope="module")
def tiny_fused():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return compile_graphs(load_config("tiny"), fuse_ops=True)


def kernel(graph, label):
    return build_row_kernel(graph, next(op for op in graph.operators() if op.label == label))


def test_forward_kernels_keep_their_intermediates(tiny_fused):
    msd = kernel(tiny_fused[0], "MSD")  # mask, softmax, attention dropout
    assert (msd.rows, msd.inner) == (("B", "H", "J"), ("K",))
    assert set(msd.loads) == {"S", "mask"} and msd.stores == ("A", "A_drop")
    assert msd.row_values == ("S_masked", "A") and msd.row_scalars == () and msd.column_outputs == ()
    assert list(msd.memory) == ["mask", "S", "A", "A_drop"]
    dropout = msd.members[-1]
    assert msd.random_run(dropout["attrs"]["rng_dims"]) == "row"
    ln = kernel(tiny_fused[0], "BDRLN")  # bias, dropout, residual, layer norm: statistics to memory
    assert ln.stores == ("R1", "layer_norm1_mean", "layer_norm1_rstd", "N1")
    assert ln.row_values == ("O", "O_drop", "R1")


def test_backward_kernels_reduce_columns(tiny_fused):
    k = kernel(tiny_fused[1], "BSBLNDB")
    assert k.column_outputs == (("dnorm2_bias", "I"), ("dnorm2_weight", "I"), ("dlinear2_bias", "I"))
    assert not {t for t, _ in k.column_outputs} & set(k.stores)
    assert {"layer_norm2_mean", "layer_norm2_rstd"} <= set(k.loads)


def test_random_runs_follow_the_inner_letters(tiny_fused):
    msd = kernel(tiny_fused[0], "MSD")
    assert msd.random_run("BHJK") == "row" and msd.random_run("BHKJ") is None
    two = dataclasses.replace(msd, inner=("J", "K"), rows=("B", "H"))
    assert two.random_run("BHJK") == "vector"


class Recorder(RowEmitter):
    """A back end that records what a body asks for: row-level lines and sweeps as text."""

    target = "cpu"
    NAMESPACE = "f::"

    def __init__(self, model):
        super().__init__(model, "float", "double")
        self.events = []

    def _hoist(self, line):
        self.events.append(("pre", line))

    def _after(self, line):
        self.events.append(("row", line))

    def _load(self, sweep, conn, t, a):
        return f"{t}[n]"

    def _store(self, sweep, t, a, expr):
        sweep.stmt(f"{t}[n] = {expr};")

    def _end_sweep(self, sweep):
        self.events.append(("sweep", sweep.lines, sweep.reductions))

    def _row_read(self, t, a, ctype):
        return f"({ctype}){t}[row]"

    def _store_row(self, t, a, value):
        self._after(f"{t}[row] = {value};")

    def _column(self, t):
        return f"col_{t}[n]"

    def _index(self, letter):
        return f"i_{letter}"

    def _random_bits(self, sweep, stream, dims):
        return f"bits({stream})"


def test_a_body_is_sweeps_reductions_and_row_statements():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fwd, _ = compile_graphs(load_config("tiny"), fuse_ops=False)
    rec = Recorder(kernel(fwd, "layer_norm1"))
    rec.member = rec.model.members[0]
    op_kind("layer_norm").row(rec, rec.member["attrs"])
    sweeps = [e for e in rec.events if e[0] == "sweep"]
    assert [s[2] for s in sweeps] == [[("s0_", "sum")], [("v20_", "sum")], []]
    assert sweeps[0][1] == ["s0_ += R1[n];"]
    # statistics in S (double), the per-element work in T (float) through a split mean
    assert ("pre", "double s0_ = 0;") in rec.events and ("row", "const double mu0_ = s0_ / nn_;") in rec.events
    assert ("pre", "const float mu0_h_ = (float)mu0_, mu0_l_ = (float)(mu0_ - (double)mu0_h_);") in rec.events
    assert sweeps[2][1] == ["N1[n] = ((R1[n] - mu0_h_) - mu0_l_) * r0_t_ * norm1_weight[n] + norm1_bias[n];"]
    assert ("row", "layer_norm1_rstd[row] = r0_;") in rec.events


def test_the_api_refuses_misuse(tiny_fused):
    rec = Recorder(kernel(tiny_fused[0], "MSD"))
    rec.member = rec.model.members[1]
    with pytest.raises(ValueError, match="row reduction must be one of sum, max"):
        rec.accumulator("m", "min")
    with rec.sweep():
        with pytest.raises(RuntimeError, match="do not nest"):
            with rec.sweep():
                pass
    with pytest.raises(KeyError):
        with rec.sweep() as e:
            e.reduce("nowhere_", e["x"])
