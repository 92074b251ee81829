"""Packed variable-length batches: grouping by cost, padded batches computed on their real tokens only
(inference), and the ``cu_seqlens`` varlen API (differentiable), against the float64 reference."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from conftest import make_layer, reference_for, rel
from substation.config import load_config
from substation.runtime import CompiledGraph
from substation.runtime.packing import (computed_queries, group_cost, pack_cu_seqlens, pack_key_mask, plan_groups,
                                       real_tokens)

TINY = load_config("configs/tiny.yaml")
MINILM = load_config("configs/minilm-l6.yaml")


def _cost(groups, lengths, config):
    return sum(group_cost(len(g), max(lengths[b] for b in g), config) for g in groups)


def test_groups_split_where_padding_costs_more_than_a_call():
    # the benchmark's batch: 16 rows of 128 tokens and 16 of 96
    lengths = [128] * 16 + [96] * 16
    groups = plan_groups(lengths, MINILM)
    assert groups == [list(range(16)), list(range(16, 32))]
    assert plan_groups([100, 99, 98], MINILM) == [[0, 1, 2]]  # one call beats padding 2 tokens each
    assert plan_groups([5, 7, 5], MINILM, exact=True) == [[1], [0, 2]]


def test_grouping_is_optimal_over_every_contiguous_split():
    rng = random.Random(0)
    for _ in range(30):
        lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 7))]
        got = _cost(plan_groups(lengths, MINILM), lengths, MINILM)
        order = sorted(range(len(lengths)), key=lambda b: -lengths[b])
        best = float("inf")
        for cuts in itertools.product((0, 1), repeat=len(order) - 1):
            groups, cur = [], [order[0]]
            for c, b in zip(cuts, order[1:]):
                if c:
                    groups.append(cur)
                    cur = []
                cur.append(b)
            best = min(best, _cost(groups + [cur], lengths, MINILM))
        assert got == pytest.approx(best)


def test_masks_that_pack_and_masks_that_do_not():
    b, j = 4, 9
    inf = float("-inf")
    mask = torch.zeros(b, j, dtype=torch.float64)
    assert real_tokens(mask) is None  # nothing padded
    mask[1, 5:] = torch.finfo(torch.float32).min  # Hugging Face's additive value
    mask[2, :2] = -10000.0  # older BERT code
    mask[3, :] = inf
    real = real_tokens(mask)
    assert torch.equal(real, mask == 0)
    packed = pack_key_mask(real, TINY)
    assert packed is not None and packed.rows == b * j
    assert sum(sum(g.lengths) for g in packed.groups) == 9 + 5 + 7  # row 3 has no group
    destination = packed.destination.tolist()
    assert len(destination) == packed.slots
    queries = computed_queries(real)  # the real tokens and position 0 of row 2 (left padding)
    assert torch.equal(queries ^ real, torch.tensor([[False] * j, [False] * j, [True] + [False] * (j - 1),
                                                     [False] * j]))
    written = [r for r in destination if r >= 0]  # the rest (-1) are padding slots, not written
    assert sorted(written) == torch.nonzero(queries.flatten()).flatten().tolist()  # each computed row once
    assert packed.unused.tolist() == torch.nonzero(~queries.flatten()).flatten().tolist()  # zeros there
    # every slot reads a row of its own sequence: its real tokens in order, then (left padding) its
    # position 0, then the sequence's first token
    slots = packed.gather.tolist()
    for group in packed.groups:
        for k, n in enumerate(group.lengths):
            first = group.start + k * group.seq
            rows = slots[first:first + group.seq]
            b_of = rows[0] // j
            extra = [b_of * j] if not real[b_of, 0] else []
            assert len({r // j for r in rows}) == 1
            assert rows[n:] == extra + [rows[0]] * (group.seq - n - len(extra))
            assert all(real.flatten()[r] for r in rows[:n]) and rows[:n] == sorted(rows[:n])
    # a computed row's output comes from the slot that read it
    assert all(slots[k] == r for k, r in enumerate(destination) if r >= 0)
    assert all(r == -1 or r < b * j for r in destination)
    assert torch.equal(real_tokens(mask.bfloat16()), real)  # bf16 rounds -10000 to -9984: still padding
    soft = torch.zeros(b, j, dtype=torch.float64)
    soft[0, 3] = -2.0  # a soft bias is not padding
    assert real_tokens(soft) is None


def _counting(monkeypatch):
    calls = []
    original = CompiledGraph.run_into

    def run_into(self, tensors, batch, seq, *args, **kwargs):
        calls.append((batch, seq))
        return original(self, tensors, batch, seq, *args, **kwargs)
    monkeypatch.setattr(CompiledGraph, "run_into", run_into)
    return calls


def test_padded_batch_in_inference_runs_real_tokens_only(monkeypatch):
    layer = make_layer(TINY).eval()
    ref = reference_for(layer).eval()
    b, j = 5, 12
    torch.manual_seed(2)
    x = torch.randn(b, j, TINY.hidden_size, dtype=torch.float64)
    pad = torch.zeros(b, j, dtype=torch.bool)
    pad[1, 8:] = True  # right padding
    pad[2, :5] = True  # left padding
    pad[3, [1, 4, 6]] = True  # holes
    pad[4, :] = True  # no real token
    calls = _counting(monkeypatch)
    with torch.inference_mode():
        y = layer(x, key_padding_mask=pad)
    additive = torch.zeros(b, j, dtype=torch.float64).masked_fill(pad, float("-inf"))
    want = ref(x, additive).detach()
    real = ~pad
    assert rel(y[real], want[real]) <= 1e-13
    # position 0 of the left-padded row runs as a query (BERT's pooler reads it), as the reference computes it
    assert rel(y[2, 0], want[2, 0]) <= 1e-13 and float(y[2, 0].abs().max()) > 0
    zeros = pad.clone()
    zeros[2, 0] = False
    assert float(y[zeros].abs().max()) == 0.0  # the other padded positions: zeros
    computed = sum(n * s for n, s in calls)
    assert computed < b * j and computed >= int(real.sum())
    # with gradients the padded batch runs as one call and pads are computed (training semantics)
    calls.clear()
    y_grad = layer(x.clone().requires_grad_(), key_padding_mask=pad)
    assert calls == [(b, j)]
    assert rel(y_grad[real], want[real]) <= 1e-13


@pytest.mark.parametrize("layer_norm,indexed", [("post", ("Y",)), ("pre", ("X", "Y"))])
def test_full_length_sequences_run_in_place_and_equal_the_indexed_run(layer_norm, indexed):
    """A group of consecutive unpadded sequences reads its rows of the input and writes its rows of the
    output in place; the other groups write their rows through the library's row index (padding slots:
    index -1, not written) and read them that way where only row kernels read X (pre-LN), else from a
    gathered copy. The result equals running every group through the indices, bit for bit, and the
    reference on the real tokens."""
    import dataclasses
    from substation.runtime.packing import run_packed
    config = TINY.replace(layer_norm=layer_norm)
    layer = make_layer(config).eval()
    ref = reference_for(layer).eval()
    b, j = 4, 64
    pad = torch.zeros(b, j, dtype=torch.bool)
    pad[2, 32:] = True  # rows 0, 1 full; rows 2 and 3 (28 tokens) share a group of 32 slots
    pad[3, 28:] = True
    packed = pack_key_mask(~pad, config)
    assert [(g.batch, g.seq, g.source_start) for g in packed.groups] == [(2, 64, 0), (2, 32, None)]
    assert packed.destination.tolist().count(-1) == 4  # row 3's padding slots
    assert packed.unused.tolist() == torch.nonzero(pad.flatten()).flatten().tolist()
    torch.manual_seed(3)
    x = torch.randn(b, j, config.hidden_size, dtype=torch.float64)
    with torch.inference_mode():
        y = layer(x, key_padding_mask=pad)
        graph = layer.compiled.forward_only().forward
        assert graph.row_indexed == indexed
        given = {n: getattr(layer, n).detach().contiguous() for n in layer.parameter_names}
        every_group_indexed = dataclasses.replace(packed, groups=tuple(dataclasses.replace(g, source_start=None)
                                                                       for g in packed.groups))
        y_in_place = run_packed(graph, given, x.view(b * j, -1), packed).view(b, j, -1)
        y_indexed = run_packed(graph, given, x.view(b * j, -1), every_group_indexed).view(b, j, -1)
    assert torch.equal(y_in_place, y_indexed) and torch.equal(y, y_in_place)
    want = ref(x, torch.zeros(b, j, dtype=torch.float64).masked_fill(pad, float("-inf"))).detach()
    assert rel(y[~pad], want[~pad]) <= 1e-13
    assert float(y[pad].abs().max()) == 0.0


def test_row_indices_are_checked():
    """``CompiledGraph.run_into(rows=)`` takes int64 indices of B x J entries within the argument's rows
    (-1 for the output only), for the arguments the library indexes; the training library indexes none."""
    layer = make_layer(TINY.replace(layer_norm="pre")).eval()
    graph = layer.compiled.forward_only().forward
    assert layer.compiled.forward.row_indexed == ()
    b, j, i = 1, 4, TINY.hidden_size
    tensors = {n: getattr(layer, n).detach().contiguous() for n in layer.parameter_names}
    tensors.update(X=torch.randn(6, i, dtype=torch.float64), Y=torch.zeros(6, i, dtype=torch.float64),
                   mask=torch.zeros(b, j, dtype=torch.float64))
    good = torch.tensor([5, 0, 2, 3])
    graph.run_into(tensors, b, j, rows={"X": good, "Y": torch.tensor([1, -1, 4, 0])})
    assert float(tensors["Y"][[2, 3, 5]].abs().max()) == 0.0 and float(tensors["Y"][[0, 1, 4]].abs().min()) > 0
    for rows, error, words in (({"X": good.int()}, TypeError, "int64"),
                               ({"X": good[:3]}, ValueError, "B x J = 4"),
                               ({"X": torch.tensor([0, 1, 2, 6])}, ValueError, r"\[0, 6\)"),
                               ({"X": torch.tensor([0, -1, 2, 3])}, ValueError, r"\[0, 6\)"),
                               ({"Y": torch.tensor([0, -2, 2, 3])}, ValueError, r"\[-1, 6\)"),
                               ({"mask": good}, ValueError, "row indices for X, Y")):
        with pytest.raises(error, match=words):
            graph.run_into(tensors, b, j, rows=rows)


def test_a_mask_changed_in_place_between_calls_is_seen(monkeypatch):
    """The layers of a model share the packing of one mask (kept per thread, compared by value): a mask
    edited in place, a new mask of the same shape and other layers' calls all get their own packing."""
    layer = make_layer(TINY).eval()
    ref = reference_for(layer).eval()
    torch.manual_seed(3)
    x = torch.randn(4, 10, TINY.hidden_size, dtype=torch.float64)
    attend = torch.ones(4, 10, dtype=torch.bool)
    attend[1, 6:] = False
    attend[3, 2:] = False
    calls = _counting(monkeypatch)
    with torch.inference_mode():
        for edit in (None, (2, slice(4, None)), (1, slice(None))):  # the last call: row 1 fully attends again
            if edit is not None:
                attend[edit] = edit[0] == 1
            calls.clear()
            y = layer(x, attention_mask=attend)
            want = ref(x, torch.zeros(4, 10, dtype=torch.float64).masked_fill(~attend, float("-inf")))
            assert rel(y[attend], want[attend]) <= 1e-13 and float(y[~attend].abs().max()) == 0.0
            fresh = pack_key_mask(attend.clone(), TINY)  # the packing of this mask, computed anew
            assert sum(n * s for n, s in calls) == (40 if fresh is None else fresh.slots)
        assert torch.equal(layer(x, attention_mask=attend.clone()), y)


def test_a_float_mask_changed_after_the_call_does_not_change_the_next_one():
    """The packing kept for the next call holds its own copy of the mask: a float mask the caller
    (or torch.compile's buffer reuse) overwrites after a call neither leaks into a later call with the
    old values nor lets NaN past the mask check."""
    layer = make_layer(TINY).eval()
    ref = reference_for(layer).eval()
    torch.manual_seed(6)
    x = torch.randn(3, 8, TINY.hidden_size, dtype=torch.float64)
    for fill in (-2.0, float("-inf")):  # a soft mask (no packing) and a one-token padding mask
        mask = torch.zeros(3, 8, dtype=torch.float64)
        mask[0, 7] = fill
        if fill == -2.0:
            mask[1, 4:] = fill
        want = ref(x, mask.clone()).detach()
        attend = mask == 0 if fill != -2.0 else torch.ones(3, 8, dtype=torch.bool)
        with torch.inference_mode():
            first = layer(x, attention_mask=mask)
            same = mask.clone()
            mask.fill_(float("nan"))
            again = layer(x, attention_mask=same)
        assert rel(first[attend], want[attend]) <= 1e-13 and torch.equal(first, again)


def test_inference_zeros_padded_positions_also_when_packing_does_not_pay(monkeypatch):
    layer = make_layer(TINY).eval()
    ref = reference_for(layer).eval()
    x = torch.randn(2, 7, TINY.hidden_size, dtype=torch.float64)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 6] = True  # one padded token: one padded call costs less than two
    calls = _counting(monkeypatch)
    with torch.no_grad():
        y = layer(x, key_padding_mask=pad)
    assert calls == [(2, 7)]
    want = ref(x, torch.zeros(2, 7, dtype=torch.float64).masked_fill(pad, float("-inf")))
    assert float(y[pad].abs().max()) == 0.0 and rel(y[~pad], want[~pad]) <= 1e-13


def test_varlen_matches_each_sequence_alone_with_gradients():
    layer = make_layer(TINY).eval()
    ref = reference_for(layer).eval()
    lengths = [7, 3, 0, 5, 1, 7, 12]
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    torch.manual_seed(3)
    x = torch.randn(int(cu[-1]), TINY.hidden_size, dtype=torch.float64)
    g = torch.randn_like(x)
    xs = x.clone().requires_grad_()
    y = layer.forward_varlen(xs, cu)
    y.backward(g)
    xr = x.clone().requires_grad_()
    parts = [ref(xr[a:e].unsqueeze(0)).squeeze(0) for a, e in zip(cu[:-1].tolist(), cu[1:].tolist()) if e > a]
    want = torch.cat(parts)
    want.backward(g)
    assert y.shape == x.shape and rel(y, want) <= 1e-13
    assert rel(xs.grad, xr.grad) <= 1e-12
    ref_grads = dict(ref.named_parameters())
    for name, p in layer.named_parameters():
        assert rel(p.grad, ref_grads[name].grad) <= 1e-12, name
    with torch.no_grad():
        assert rel(layer.forward_varlen(x, cu.long()), want) <= 1e-13


def test_varlen_rejects_bad_offsets():
    layer = make_layer(TINY).eval()
    x = torch.randn(10, TINY.hidden_size, dtype=torch.float64)
    for cu, error, words in (
            (torch.tensor([1, 10]), ValueError, "start at 0"),
            (torch.tensor([0, 6, 4, 10]), ValueError, r"not decrease \(entry 2: 4 < 6\)"),
            (torch.tensor([0, 4, 9]), ValueError, "end at N = 10"),
            (torch.tensor([0, 10], device="meta"), ValueError, "meta device"),
            (torch.tensor([[0, 10]]), ValueError, "1-D"),
            (torch.tensor([0.0, 10.0]), TypeError, "integer"),
            (torch.tensor([0, 10], dtype=torch.complex64), TypeError, "integer tensor, got torch.complex64"),
            (torch.tensor([0, 10], dtype=torch.bool), TypeError, "integer")):
        with pytest.raises(error, match=words):
            layer.forward_varlen(x, cu)
    with pytest.raises(ValueError, match=r"\[N, I\]"):
        layer.forward_varlen(x.unsqueeze(0), torch.tensor([0, 10]))
    with pytest.raises(ValueError, match=r"1-D \[B \+ 1\]"):
        layer.forward_varlen(x, torch.tensor([], dtype=torch.int64))


@pytest.mark.parametrize("cu", [[0], [0, 0], [0, 0, 0]])
def test_varlen_without_tokens_gives_an_empty_output_and_zero_gradients(cu):
    layer = make_layer(TINY).train()
    x = torch.zeros(0, TINY.hidden_size, dtype=torch.float64, requires_grad=True)
    y = layer.forward_varlen(x, torch.tensor(cu))
    assert y.shape == (0, TINY.hidden_size) and y.dtype == torch.float64
    y.sum().backward()
    assert x.grad.shape == x.shape and all(p.grad is not None and not p.grad.any() for p in layer.parameters())
    with pytest.raises(TypeError, match="dtype torch.float32"):  # still checked
        layer.forward_varlen(x.detach().float(), torch.tensor(cu))


def test_layout_of_a_packed_batch():
    packed = pack_cu_seqlens(torch.tensor([0, 4, 5, 9]), 9, TINY)
    assert packed.rows == 9 and packed.slots >= 9
    dest = packed.destination.tolist()
    assert sorted(r for r in dest if r != -1) == list(range(9)) and packed.unused.numel() == 0  # every row real
    assert all(packed.gather[k] == r for k, r in enumerate(dest) if r != -1)  # written back where it was read
    for group in packed.groups:
        assert group.seq == max(group.lengths) and group.start + group.batch * group.seq <= packed.slots


def test_generated_code_addresses_the_layer_input_and_output_through_row_indices():
    """A forward-only library exports substation_run_rows: its row kernels address X and Y as row
    X_rows[b J + j] / Y_rows[b J + j] (null: b J + j), a Y index of -1 writes a per-thread scratch row;
    the page prefetch of rows of 4 KiB or more follows the index too. Training libraries take none."""
    from substation.backends.cpu.codegen import generate_cpu
    from substation.pipeline import compile_graphs
    config = load_config("bert-large-b8-l512").replace(dtype="bfloat16")  # I = 1024: X rows of 4 KiB
    forward, _ = compile_graphs(config, fuse_ops=True, mode="eval")
    source = generate_cpu(forward)
    assert 'return "X,Y";' in source and source.count("int substation_run_rows(") == 1
    assert source.count("float* __restrict__ X_row_ = X + rX_ * (I);") == 2  # the cast and the residual
    assert source.count("float* __restrict__ Y_row_ = rY_ >= 0 ? Y + rY_ * (I) : Y_scratch_.data();") == 1
    assert source.count("const int64_t pX_ = X_rows ? X_rows[row_ + 2] : row_ + 2;") == 2
    assert "return substation_run_rows(args, sizes, workspace, seed, training, nullptr, nullptr);" in source
    assert "X[i_B" not in source and "Y[i_B" not in source  # no access by the row letters
    for graph in compile_graphs(config, fuse_ops=True, mode="train"):
        assert "substation_run_rows" not in generate_cpu(graph)
