"""Packed variable-length batches: token-wise operators on the real tokens only, attention per sequence.

A padded batch (a key padding mask) or packed tokens with ``cu_seqlens`` offsets (FlashAttention's
varlen convention: sequence b holds rows ``cu_seqlens[b]:cu_seqlens[b+1]``) runs as a few *groups*: the
sequences sorted by real length, each group one dense ``[n, L]`` call of the compiled library, L the
longest real length in the group. A shorter sequence inside a group is padded to L there with masked
keys, so attention always sees exactly the sequence's real tokens (position 0 of a left-padded
sequence also runs as a query, :func:`computed_queries`). Every operator but attention is
token-wise, and attention never mixes sequences, so a real token's output equals the padded batch's
(up to the rounding of differently blocked GEMMs).

Grouping trades padded work inside groups against the fixed cost of one more library call; it is
solved exactly (dynamic programming over the distinct lengths) with the cost model of
:func:`group_cost`.

Dimension letters: B sequences, J = K positions, I hidden size, U feed-forward size; R source rows
(B x J of a padded batch, or the N packed tokens), S slots (sum of n x L over the groups).
"""
from __future__ import annotations

import dataclasses

import torch

from ..config import EncoderConfig

__all__ = ["CALL_TOKENS", "MASKED_BELOW", "PackedBatch", "SequenceGroup", "group_cost", "pack_cu_seqlens",
           "computed_queries", "pack_key_mask", "plan_groups", "real_tokens", "run_packed"]

#: Fixed cost of one library call (Python and ctypes dispatch, GEMM edge blocks), in tokens of
#: token-wise work: 0.5 ms per call against ~11 us per token of an all-MiniLM-L6-v2 layer (float32, 2 threads).
CALL_TOKENS = 64.0
#: Cost of moving one token of a group between its row of the batch and its slot (a gather, or reads and
#: writes through the library's row index), in tokens of work.
COPY_TOKENS = 0.05
#: An additive key-mask value at or below this removes the key exactly: exp(-9000) is 0 in float32 and
#: float64, so -inf, ``finfo.min`` (Hugging Face) and -10000 (older BERT code; -9984 once rounded to
#: bfloat16) all mark padding.
MASKED_BELOW = -9.0e3


def group_cost(batch: int, seq: int, config: EncoderConfig) -> float:
    """Estimated work of one group call in tokens of token-wise work: ``n L (1 + L / (2I + U)) +``
    :data:`CALL_TOKENS`. Per token the projections and feed-forward take 2 I (4I + 2U) flops, the two
    attention products 4 I L, hence the ratio L / (2I + U).

    Args:
        batch: n, the sequences in the group. seq: L, its (padded) length. config: the layer's config.

    Returns:
        The cost (token units, float).
    """
    attention = seq / (2 * config.hidden_size + config.ffn_size)
    return batch * seq * (1.0 + attention) + CALL_TOKENS


def plan_groups(lengths: list[int], config: EncoderConfig, exact: bool = False) -> list[list[int]]:
    """Split sequences into groups of minimal total :func:`group_cost`.

    Args:
        lengths: real length of each sequence (>= 1).
        config: the layer's config (I, U enter the cost).
        exact: only sequences of equal length share a group (a layer compiled with ``mask: none``
            cannot pad inside a group).

    Returns:
        The groups, each a list of sequence indices, longest sequences first (within a group in
        index order).
    """
    order = sorted(range(len(lengths)), key=lambda b: (-lengths[b], b))
    distinct: list[int] = []  # lengths, descending
    runs: list[list[int]] = []  # sequence indices of each distinct length
    for b in order:
        if distinct and distinct[-1] == lengths[b]:
            runs[-1].append(b)
        else:
            distinct.append(lengths[b])
            runs.append([b])
    if exact:
        return runs
    counts = [0]
    for run in runs:
        counts.append(counts[-1] + len(run))
    d = len(distinct)
    best = [0.0] + [float("inf")] * d  # best[j]: cost of the first j distinct lengths
    cut = [0] * (d + 1)
    for j in range(1, d + 1):
        for i in range(j):  # group = distinct lengths i..j-1, padded to distinct[i]
            cost = best[i] + group_cost(counts[j] - counts[i], distinct[i], config)
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], d
    while j > 0:
        i = cut[j]
        groups.append(sorted(b for run in runs[i:j] for b in run))
        j = i
    return groups[::-1]


@dataclasses.dataclass(frozen=True)
class SequenceGroup:
    """One library call of a :class:`PackedBatch`: ``batch`` sequences padded to ``seq`` positions,
    slots ``start : start + batch * seq``; ``lengths`` their real lengths (each <= seq);
    ``source_start``: when the slots read the source rows ``source_start : source_start + batch * seq``
    in order (consecutive sequences, none padded: the full-length rows of a padded batch, sorted input),
    that first row, so the call reads and writes those rows in place; else None."""

    start: int
    batch: int
    seq: int
    lengths: tuple[int, ...]
    source_start: int | None = None

    @property
    def padded(self) -> bool:
        """Whether some sequence of the group is shorter than ``seq`` (the call needs a key mask)."""
        return any(n != self.seq for n in self.lengths)

    def key_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """The additive key mask [n, L] of the group's call (0 on real tokens, -inf on padding)."""
        pos = torch.arange(self.seq).expand(self.batch, self.seq)
        pad = pos >= torch.tensor(self.lengths).unsqueeze(1)
        return torch.zeros(self.batch, self.seq, dtype=dtype).masked_fill_(pad, float("-inf"))


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """Where each token of a batch runs: the groups, and for every slot the source row it reads.

    Attributes:
        rows: R, rows of the source (and of the result).
        groups: the calls, in slot order.
        gather: int64 [S], the source row of every slot (a padding slot reads its sequence's first
            token; its key is masked and its output dropped).
        destination: int64 [S], the result row every slot's output goes to; -1 for a padding slot.
        unused: int64 [R - computed], the result rows no slot writes (rows that are no real token):
            their output is zeros.
    """

    rows: int
    groups: tuple[SequenceGroup, ...]
    gather: torch.Tensor
    destination: torch.Tensor
    unused: torch.Tensor

    @property
    def slots(self) -> int:
        """S, tokens computed (real and padding)."""
        return int(self.gather.numel())


def _live_groups(lengths: list[int], config: EncoderConfig, exact: bool) -> list[list[int]]:
    """:func:`plan_groups` of the sequences with at least one token (indices into ``lengths``)."""
    live = [b for b, n in enumerate(lengths) if n > 0]
    return [[live[m] for m in members] for members in plan_groups([lengths[b] for b in live], config, exact)]


def _packed_batch(rows: int, sequences: list[torch.Tensor], groups: list[list[int]],
                  queries: dict[int, int] | None = None) -> PackedBatch:
    """The :class:`PackedBatch` of sequences given by their source rows (int64 tensors, in order) run
    as ``groups`` (sequence indices, from :func:`_live_groups`); a few tensor operations per group.
    ``queries``: sequence -> a padding row computed as a query only (the slot after its real tokens,
    masked as a key); its output is scattered back like a real token's."""
    queries = queries or {}
    lengths = [int(s.numel()) for s in sequences]
    gather, real_slots, real_rows, records = [], [], [], []  # per group
    start = 0
    for members in groups:
        seq = max(lengths[b] + (b in queries) for b in members)
        sources = torch.cat([sequences[b] for b in members])
        counts = torch.tensor([lengths[b] for b in members])
        real = torch.arange(seq) < counts.unsqueeze(1)  # [n, L], row-major like the group's slots
        # padding slots read their sequence's first token
        slots = sources[torch.cumsum(counts, 0) - counts].unsqueeze(1).expand(len(members), seq).clone()
        slots[real] = sources
        real_slots.append(torch.nonzero(real.flatten()).flatten() + start)
        real_rows.append(sources)
        extra = [k for k, b in enumerate(members) if b in queries]
        if extra:
            ks = torch.tensor(extra)
            at = counts[ks]  # each such sequence's first padding slot
            extra_rows = torch.tensor([queries[members[k]] for k in extra])
            slots[ks, at] = extra_rows
            real_slots.append(start + ks * seq + at)
            real_rows.append(extra_rows)
        flat = slots.flatten()
        first = int(flat[0])
        in_place = bool(torch.equal(flat, torch.arange(first, first + flat.numel())))
        gather.append(flat)
        records.append(SequenceGroup(start, len(members), seq, tuple(lengths[b] for b in members),
                                     first if in_place else None))
        start += len(members) * seq
    empty = torch.zeros(0, dtype=torch.int64)
    cat = (lambda ts: torch.cat(ts) if ts else empty)
    destination = torch.full((start,), -1, dtype=torch.int64)  # padding slots: not written
    destination[cat(real_slots)] = cat(real_rows)
    written = torch.zeros(rows, dtype=torch.bool)
    written[cat(real_rows)] = True
    return PackedBatch(rows, tuple(records), cat(gather), destination, torch.nonzero(~written).flatten())


def real_tokens(mask: torch.Tensor) -> torch.Tensor | None:
    """The real (unpadded) positions [B, K] bool of an additive key mask that is a padding mask: every
    value 0 (attend) or at most :data:`MASKED_BELOW` (padding: any positions, left padding and holes
    included); None when some value is in between (a soft mask) or nothing is padded.

    Args:
        mask: additive [B, K] key mask, floating point.
    """
    real = mask == 0
    if not bool((real | (mask <= MASKED_BELOW)).all()) or bool(real.all()):
        return None
    return real


def computed_queries(real: torch.Tensor) -> torch.Tensor:
    """The query positions [B, J] bool an inference call computes: the real tokens, and position 0 of
    every sequence with a real token. With left padding position 0 is padding, but BERT's pooler and
    the classification heads of its family read it: computed there as Hugging Face does (its key stays
    masked), their results equal Hugging Face's. Other padded positions are zeros.

    Args:
        real: bool [B, K] (:func:`real_tokens`).
    """
    out = real.clone()
    out[:, 0] |= real.any(1)
    return out


def pack_key_mask(real: torch.Tensor, config: EncoderConfig) -> PackedBatch | None:
    """The packing of a padded batch [B, J] (rows ``b * J + j``) whose real positions are ``real``, or
    None when packing would not save work: the groups' :func:`group_cost` plus the copies is not below
    the padded batch's. Query positions that are padding are not computed (the caller writes zeros
    there), except those :func:`computed_queries` adds (position 0 of a left-padded sequence); a
    sequence with no real token gets no group.

    Args:
        real: bool [B, K] on the CPU (:func:`real_tokens`).
        config: the layer's config.

    Returns:
        A :class:`PackedBatch` over R = B x K rows, or None.
    """
    batch, seq = real.shape
    lengths = real.sum(1).tolist()
    extra = (computed_queries(real)[:, 0] & ~real[:, 0]).tolist()
    slots = [n + e for n, e in zip(lengths, extra)]
    groups = _live_groups(slots, config, exact=False)
    longest = [max(slots[b] for b in members) for members in groups]  # decided before any index is built
    cost = sum(group_cost(len(members), n, config) + COPY_TOKENS * len(members) * n
               for members, n in zip(groups, longest))
    if cost >= group_cost(batch, seq, config):
        return None
    sequences = list(torch.nonzero(real.flatten()).flatten().split(lengths))
    return _packed_batch(batch * seq, sequences, groups, {b: b * seq for b in range(batch) if extra[b]})


def pack_cu_seqlens(cu_seqlens: torch.Tensor, rows: int, config: EncoderConfig) -> PackedBatch:
    """The packing of N packed tokens whose sequence b is rows ``cu_seqlens[b]:cu_seqlens[b+1]``.

    Args:
        cu_seqlens: integer [B + 1], starting at 0, non-decreasing, ending at N; on any device with data.
        rows: N, the packed tokens.
        config: the layer's config (``mask: none``: only equal lengths share a group).

    Returns:
        A :class:`PackedBatch` over the N rows.

    Raises:
        TypeError: not an integer tensor. ValueError: not 1-D [B + 1] (B = 0, ``[0]``, is an empty
            batch), on the meta device, not starting at 0, decreasing, or not ending at N (each its own
            message, with the offsets).
    """
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.is_floating_point() or cu_seqlens.is_complex() \
            or cu_seqlens.dtype == torch.bool:
        raise TypeError(f"cu_seqlens must be an integer tensor, got "
                        f"{cu_seqlens.dtype if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__}")
    if cu_seqlens.is_meta:
        raise ValueError("cu_seqlens is on the meta device (no data); pass the offsets on the CPU or on the "
                         "input's device")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D [B + 1] (offsets starting at 0), got shape "
                         f"{tuple(cu_seqlens.shape)}")
    offsets = cu_seqlens.cpu().tolist()
    shown = offsets if len(offsets) <= 12 else offsets[:6] + ["..."] + offsets[-6:]
    if offsets[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0; got {shown}")
    drop = next((b for b in range(1, len(offsets)) if offsets[b] < offsets[b - 1]), None)
    if drop is not None:
        raise ValueError(f"cu_seqlens must not decrease (entry {drop}: {offsets[drop]} < {offsets[drop - 1]}); "
                         f"got {shown}")
    if offsets[-1] != rows:
        raise ValueError(f"cu_seqlens must end at N = {rows}, the packed tokens of hidden_states; got {shown}")
    sequences = [torch.arange(a, b) for a, b in zip(offsets, offsets[1:])]
    groups = _live_groups([b - a for a, b in zip(offsets, offsets[1:])], config, exact=config.mask == "none")
    return _packed_batch(rows, sequences, groups)


def run_packed(graph, given: dict[str, torch.Tensor], x_rows: torch.Tensor, packed: PackedBatch,
               bound=None) -> torch.Tensor:
    """Run a forward-only library group by group on packed tokens (no autograd; inside the operator).
    A group whose slots are not rows in place reads X and writes Y through row indices
    (:attr:`~substation.runtime.CompiledGraph.row_indexed`): its output goes straight to its rows, and
    its input too where the library reads X that way (else the group's rows are gathered first).

    Args:
        graph: the forward-only :class:`~substation.runtime.CompiledGraph` (writes Y alone, through a
            row index).
        given: its parameters (and nothing else) by name, of the graph's dtypes, but those of ``bound``.
        x_rows: [R, I] source rows, the graph's X dtype, contiguous.
        packed: the :class:`PackedBatch` over those R rows.
        bound: parameters checked once (:meth:`~substation.runtime.CompiledGraph.bind`), or None.

    Returns:
        [R, I] of Y's dtype: the output of each real token (and of each extra query slot,
        :func:`computed_queries`); zeros on the other rows.

    Raises:
        RuntimeError: the library failed, or it does not write Y through a row index.
    """
    if "Y" not in graph.row_indexed:
        raise RuntimeError(f"{graph.path}: a forward-only library that runs packed batches writes Y through a "
                           f"row index (it indexes {', '.join(graph.row_indexed) or 'nothing'})")
    hidden = x_rows.shape[1]
    out = torch.empty(packed.rows, hidden, dtype=graph.dtypes["Y"])
    has_mask = "mask" in graph.dtypes
    with graph.parameters_held():  # the same weights for every group: digested once
        for g in packed.groups:
            n = g.batch * g.seq
            rows = {}
            if g.source_start is not None:  # its rows in place: no copy in or out
                at = slice(g.source_start, g.source_start + n)
                x, y = x_rows[at].view(g.batch, g.seq, hidden), out[at].view(g.batch, g.seq, hidden)
            else:
                slots = slice(g.start, g.start + n)
                rows["Y"], y = packed.destination[slots], out
                if "X" in graph.row_indexed:
                    rows["X"], x = packed.gather[slots], x_rows
                else:
                    x = x_rows.index_select(0, packed.gather[slots]).view(g.batch, g.seq, hidden)
            tensors = {**given, "X": x, "Y": y}
            if has_mask:
                dtype = graph.dtypes["mask"]
                tensors["mask"] = g.key_mask(dtype) if g.padded else torch.zeros(g.batch, g.seq, dtype=dtype)
            graph.run_into(tensors, g.batch, g.seq, rows=rows, bound=bound)
    out.index_fill_(0, packed.unused, 0)
    return out
