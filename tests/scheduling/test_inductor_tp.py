"""scheduler.collective_matmul: all-gather -> mm and mm -> reduce-scatter split into chunks.

FX level (one process): hand-written post-grad graphs of the two patterns, as torch's DTensor
sequence parallelism emits them on torch 2.13 (``all_gather_into_tensor`` -> ``wait_tensor`` ->
``reshape`` -> ``addmm``; ``addmm`` -> ``reshape`` -> ``reduce_scatter_tensor`` -> ``wait_tensor``),
rewritten and run on fake 2-rank collectives (plain tensor ops with the collectives' semantics) to
compare values with the unrewritten graph. Two gloo ranks: a compiled Megatron-style
sequence-parallel MLP, eager vs compiled vs compiled under ``inductor_overlap()``, forward and
backward (one compile per configuration on each rank, the ranks compile in parallel).
"""
from __future__ import annotations

import logging
import operator
from typing import Any, Callable

import pytest
import torch
import torch.fx as fx

from fake_collectives import AG, ATEN, RS, WAIT, call as _call, collective_order, run, scatter_before_last_gather_wait
from scheduler import overlap_graph
from scheduler.collective_matmul import decompose_collective_matmuls
from scheduler.inductor_hook import OverlapGraphPass
from scheduler.per_chunk_ops import run_ops_per_chunk
from scheduler.summed_scatters import merge_summed_reduce_scatters

W = 2  # ranks in the fake collectives


def _set_vals(g: fx.Graph, inputs: dict[str, torch.Tensor]) -> None:
    """Fill ``meta["val"]`` by running the graph on fake-collective meta values."""
    run(g, inputs, W, meta=True)


def _run(g: fx.Graph, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return run(g, inputs, W)


def _gather_graph(seq: int = 32, gather_dim: int = 0, extra_reader: bool = False,
                  early_reader: bool = False, ranks_swapped: bool = False, transposed: bool = False,
                  full_bias: bool = False) -> tuple[fx.Graph, dict]:
    """Column-parallel linear on the sequence-gathered input (the forward of DTensor's
    ``ColwiseParallel(input_layouts=Shard(0))``): x [seq/W, 2, 8] -> gathered -> [seq*2, 8] rows.
    ``gather_dim`` 1: x [2, seq/W, 8] (``Shard(1)``, batch first); 2: x [2, seq, 4] gathered on the
    hidden dim (the matmul's columns: not split). ``ranks_swapped`` (``gather_dim`` > 0): the cat
    takes the rank blocks last first; ``transposed`` (``gather_dim`` 0): the gathered tensor is
    permuted to [2, seq, 8] before its rows are taken (the rows are then not blocks of the sequence);
    ``full_bias``: the bias has the matmul's output shape [seq*2, 12] instead of [12]."""
    g = fx.Graph()
    x, wt, b = g.placeholder("x"), g.placeholder("w"), g.placeholder("b")
    wait = _call(g, WAIT, _call(g, AG, x, W, "0"))
    if gather_dim != 0:  # what funcol emits for a gather on dim d: dim 0, then split and cat on d
        split = _call(g, ATEN.split.Tensor, wait, 2)
        items = [_call(g, operator.getitem, split, i) for i in range(W)]
        wait = _call(g, ATEN.cat.default, items[::-1] if ranks_swapped else items, gather_dim)
    if transposed:
        wait = _call(g, ATEN.permute.default, wait, [1, 0, 2])
    rows = _call(g, ATEN.reshape.default, wait, [seq * 2, 8])
    total = _call(g, ATEN.sum.default, rows) if early_reader else None  # read before the matmul
    mm = _call(g, ATEN.addmm.default, b, rows, _call(g, ATEN.permute.default, wt, [1, 0]))
    out = _call(g, ATEN.relu.default, _call(g, ATEN.reshape.default, mm, [seq, 2, 12]))
    g.output((out, rows) if extra_reader else (out, total) if early_reader else (out,))
    x_shape = [(seq // W, 2, 8), (2, seq // W, 8), (2, seq, 8 // W)][gather_dim]
    inputs = {"x": torch.randn(x_shape), "w": torch.randn(12, 8),
              "b": torch.randn([seq * 2, 12] if full_bias else [12])}
    _set_vals(g, inputs)
    return g, inputs


def _projection(g: fx.Graph, t: int, seq: int, scatter_dim: int, inputs: dict) -> fx.Node:
    """Term ``t``: a row-parallel matmul of ``h{t}`` [seq, 2, 12] by ``w{t}`` [8, 12], viewed as
    [seq, 2, 8] (``scatter_dim`` 0) or [2, seq, 8] (1); its inputs go into ``inputs``."""
    h, wt = g.placeholder(f"h{t}"), g.placeholder(f"w{t}")
    mm = _call(g, ATEN.mm.default, _call(g, ATEN.reshape.default, h, [seq * 2, 12]),
               _call(g, ATEN.permute.default, wt, [1, 0]))
    inputs.update({f"h{t}": torch.randn(seq, 2, 12), f"w{t}": torch.randn(8, 12)})
    return _call(g, ATEN.reshape.default, mm, [[seq, 2, 8], [2, seq, 8]][scatter_dim])


def _scattered(g: fx.Graph, y: fx.Node, seq: int, scatter_dim: int, op: str = "sum", group: str = "0") -> fx.Node:
    """``y`` reduce-scattered on ``scatter_dim`` and waited (split on dim 1 and cat on 0 first when
    it is 1, as functional collectives do)."""
    if scatter_dim:
        split = _call(g, ATEN.split.Tensor, y, seq // W, 1)
        y = _call(g, ATEN.cat.default, [_call(g, operator.getitem, split, i) for i in range(W)])
    return _call(g, WAIT, _call(g, RS, y, op, W, group))


def _scatter_graph(seq: int = 32, mm_reader: bool = False, scatter_dim: int = 0, terms: int = 1,
                   sum_reader: bool = False) -> tuple[fx.Graph, dict]:
    """Row-parallel linear into a sequence reduce-scatter (``RowwiseParallel(output_layouts=Shard(0))``);
    ``scatter_dim`` 1: ``Shard(1)`` of [2, seq, 8] (split on dim 1, cat on 0, then the scatter).
    ``terms`` > 1: the sum of that many such matmuls (each viewed, then added left to right) is
    scattered, as the input gradient of q, k and v's shared input is (0: one matmul added to
    itself); ``sum_reader``: the first partial sum is also an output."""
    g = fx.Graph()
    inputs: dict = {}
    ys = [_projection(g, t, seq, scatter_dim, inputs) for t in range(max(terms, 1))]
    y, partial = ys[0], None
    for other in ys[1:] if terms > 0 else ys:  # terms=0: one matmul added to itself
        y = _call(g, ATEN.add.Tensor, y, other)
        partial = y if partial is None else partial
    out = _call(g, ATEN.neg.default, _scattered(g, y, seq, scatter_dim))
    mm = ys[-1].args[0]
    g.output((out, mm) if mm_reader else (out, partial) if sum_reader else (out,))
    _set_vals(g, inputs)
    return g, inputs


def _targets(g: fx.Graph) -> list[Any]:
    return [n.target for n in g.nodes if n.op == "call_function"]


def _check_same_values(g: fx.Graph, inputs: dict, before: list[torch.Tensor]) -> None:
    g.lint()
    after = _run(g, inputs)
    assert len(after) == len(before)
    for a, b in zip(after, before):
        assert torch.equal(a, b), "the rewrite changed a value"


@pytest.mark.parametrize("dim", [0, 1, -2], ids=["seq-first", "batch-first", "batch-first-negative-dim"])
def test_all_gather_mm_splits_into_chunks_issued_up_front(dim: int) -> None:
    g, inputs = _gather_graph(gather_dim=dim)
    before = _run(g, inputs)
    assert decompose_collective_matmuls(g, 2) == 1
    order = [t for t in _targets(g) if t in (AG, WAIT, ATEN.addmm.default)]
    assert order == [AG, AG, WAIT, ATEN.addmm.default, WAIT, ATEN.addmm.default]
    _check_same_values(g, inputs, before)


@pytest.mark.parametrize("early", [False, True], ids=["read-after-mm", "read-before-mm"])
def test_other_readers_of_the_gathered_rows_read_them_reassembled(early: bool) -> None:
    g, inputs = _gather_graph(extra_reader=not early, early_reader=early)
    before = _run(g, inputs)
    assert decompose_collective_matmuls(g, 2) == 1
    order = [t for t in _targets(g) if t in (AG, WAIT, ATEN.addmm.default)]
    if early:  # the reader needs every chunk before the matmuls: both waits come first
        assert order == [AG, AG, WAIT, WAIT, ATEN.addmm.default, ATEN.addmm.default]
    else:
        assert order == [AG, AG, WAIT, ATEN.addmm.default, WAIT, ATEN.addmm.default]
    _check_same_values(g, inputs, before)


def _check_both_projections_split(g: fx.Graph, inputs: dict[str, torch.Tensor], k_proj: fx.Node) -> None:
    """With ``k_proj`` (a second matmul on the gathered rows) made an output of ``g``: both the q
    projection and it are split in 2 chunks, q's first, each chunk waited before its first matmul;
    values bitwise."""
    out = next(n for n in g.nodes if n.op == "output")
    out.args = ((*out.args[0], k_proj),)
    _set_vals(g, inputs)
    before = _run(g, inputs)
    assert decompose_collective_matmuls(g, 2) == 1
    order = [t for t in _targets(g) if t in (AG, WAIT, ATEN.addmm.default, ATEN.mm.default)]
    assert order == [AG, AG, WAIT, ATEN.addmm.default, WAIT, ATEN.addmm.default, ATEN.mm.default, ATEN.mm.default]
    _check_same_values(g, inputs, before)


def test_every_matmul_on_the_gathered_rows_is_split() -> None:
    """q and k projections of one gathered input (DTensor gathers it once in a compiled graph)."""
    g, inputs = _gather_graph()
    mm = next(n for n in g.nodes if n.target is ATEN.addmm.default)
    with g.inserting_after(mm):
        k_proj = _call(g, ATEN.mm.default, mm.args[1], mm.args[2])
    _check_both_projections_split(g, inputs, k_proj)


def test_matmuls_on_separate_views_of_the_gathered_rows_are_split_in_graph_order() -> None:
    """q and k projections that each read their own reshape of the gathered input: both are split,
    q's chunks (first in the graph) before k's, and each chunk's wait before the first matmul that
    reads it. Values bitwise."""
    g, inputs = _gather_graph()
    mm = next(n for n in g.nodes if n.target is ATEN.addmm.default)
    wait = next(n for n in g.nodes if n.target is WAIT)
    with g.inserting_before(mm.next):
        k_rows = _call(g, ATEN.reshape.default, wait, [64, 8])
        k_proj = _call(g, ATEN.mm.default, k_rows, mm.args[2])
    _check_both_projections_split(g, inputs, k_proj)


def test_a_matmul_reading_the_gathered_rows_as_its_right_operand_reads_them_reassembled() -> None:
    """A weight gradient ``gy^T @ rows`` in a graph that gathers ``rows`` itself (a backward that
    recomputes the gather): only matmuls reading the rows as their left operand are split; this one
    reads the chunks re-assembled, whole (a square weight, so that a chunk of the rows would fit its
    shape too). Values bitwise."""
    g, inputs = _gather_graph()
    mm = next(n for n in g.nodes if n.target is ATEN.addmm.default)
    with g.inserting_after(next(n for n in g.nodes if n.op == "placeholder")):  # placeholders come first
        gy = g.placeholder("gy")
    with g.inserting_before(mm.next):
        w_grad = _call(g, ATEN.mm.default, _call(g, ATEN.permute.default, gy, [1, 0]), mm.args[1])
    out = next(n for n in g.nodes if n.op == "output")
    out.args = ((*out.args[0], w_grad),)
    inputs["gy"] = torch.randn(64, 8)
    _set_vals(g, inputs)
    before = _run(g, inputs)
    assert decompose_collective_matmuls(g, 2) == 1
    assert _targets(g).count(ATEN.addmm.default) == 2 and _targets(g).count(ATEN.mm.default) == 1
    _check_same_values(g, inputs, before)


def test_a_matmul_between_a_gather_and_a_scatter_is_split_once(caplog) -> None:
    """gather -> mm -> reduce-scatter with nothing between: the matmul is pattern (a) and (b) at
    once; it is split on the gather's side only (2 gathers, the scatter kept whole), and no rewrite
    of it is tried twice (the second would fail, logging a warning). Values bitwise."""
    g = fx.Graph()
    x, wt = g.placeholder("x"), g.placeholder("w")
    rows = _call(g, ATEN.reshape.default, _call(g, WAIT, _call(g, AG, x, W, "0")), [64, 8])
    y = _call(g, ATEN.reshape.default, _call(g, ATEN.mm.default, rows, _call(g, ATEN.permute.default, wt, [1, 0])),
              [32, 2, 8])
    g.output((_call(g, WAIT, _call(g, RS, y, "sum", W, "0")),))
    inputs = {"x": torch.randn(16, 2, 8), "w": torch.randn(8, 8)}
    _set_vals(g, inputs)
    before = _run(g, inputs)
    with caplog.at_level(logging.WARNING, logger="scheduler"):
        assert decompose_collective_matmuls(g, 2) == 1
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert _targets(g).count(AG) == 2 and _targets(g).count(RS) == 1
    _check_same_values(g, inputs, before)


def test_overlap_graph_places_the_chunks_waits() -> None:
    """What the Inductor hook runs: the split, then the wait placement."""
    g, inputs = _gather_graph(extra_reader=True)
    before = _run(g, inputs)
    assert overlap_graph(g, collective_matmul_chunks=2)
    order = [t for t in _targets(g) if t in (AG, WAIT, ATEN.addmm.default)]
    assert order == [AG, AG, WAIT, ATEN.addmm.default, WAIT, ATEN.addmm.default]
    _check_same_values(g, inputs, before)
    g, inputs = _scatter_graph()
    before = _run(g, inputs)
    assert overlap_graph(g, collective_matmul_chunks=2)
    order = [t for t in _targets(g) if t in (RS, WAIT, ATEN.mm.default)]
    assert order == [ATEN.mm.default, RS, ATEN.mm.default, RS, WAIT, WAIT]
    _check_same_values(g, inputs, before)


@pytest.mark.parametrize("dim", [0, 1], ids=["seq-first", "batch-first"])
def test_mm_reduce_scatter_splits_each_scatter_after_its_mm(dim: int) -> None:
    g, inputs = _scatter_graph(scatter_dim=dim)
    before = _run(g, inputs)
    assert decompose_collective_matmuls(g, 2) == 1
    order = [t for t in _targets(g) if t in (RS, WAIT, ATEN.mm.default)]
    assert order == [ATEN.mm.default, RS, WAIT, ATEN.mm.default, RS, WAIT]
    _check_same_values(g, inputs, before)


@pytest.mark.parametrize("dim", [0, 1], ids=["seq-first", "batch-first"])
def test_a_sum_of_matmuls_into_a_reduce_scatter_is_split_alike(dim: int) -> None:
    """Pattern (c): q, k and v's partial input gradients summed, then reduce-scattered (torchtitan's
    plan, compiled): per chunk the three matmuls on its rows, added in the graph's order, then the
    chunk's scatter; the values are the unrewritten graph's, bitwise."""
    g, inputs = _scatter_graph(scatter_dim=dim, terms=3)
    before = _run(g, inputs)
    assert decompose_collective_matmuls(g, 2) == 1
    order = [t for t in _targets(g) if t in (RS, WAIT, ATEN.mm.default, ATEN.add.Tensor)]
    chunk = [ATEN.mm.default, ATEN.mm.default, ATEN.add.Tensor, ATEN.mm.default, ATEN.add.Tensor, RS, WAIT]
    assert order == chunk + chunk
    _check_same_values(g, inputs, before)


@pytest.mark.parametrize("chunks, cut, clones", [(2, 0, 0), (4, 1, 4)], ids=["batch-divides", "batch-too-small"])
def test_batch_first_chunks_cut_the_batch_where_it_divides(chunks: int, cut: int, clones: int) -> None:
    """[Note: cutting the leading dim]: with the sequence on dim 1 of [2, seq, hidden], 2 chunks cut
    the batch (whole sequences gathered and scattered, matmul rows read and written in place: no
    interleaving copy); 4 chunks do not divide the batch of 2 and cut the sequence as before.
    Values bitwise the unrewritten graph's either way."""
    for g, inputs, collective in (_gather_graph(gather_dim=1) + (AG,), _scatter_graph(scatter_dim=1) + (RS,)):
        before = _run(g, inputs)
        assert decompose_collective_matmuls(g, chunks) == 1
        issued = [n for n in g.nodes if n.target is collective]
        assert len(issued) == chunks
        if collective is AG:  # each chunk gathers a slice of the shard on the cut dim
            assert {n.args[0].target for n in issued} == {ATEN.slice.Tensor}
            assert {n.args[0].args[1] for n in issued} == {cut}
        assert _targets(g).count(ATEN.clone.default) == (clones if collective is RS else 0)
        _check_same_values(g, inputs, before)


def _summed_scatters_graph(scatter_dim: int = 1, terms: int = 3, op: str = "sum", groups: tuple[str, ...] = ("0",),
                           wait_reader: bool = False, sum_reader: bool = False, bf16_term: bool = False
                           ) -> tuple[fx.Graph, dict]:
    """torch's sequence-parallel q, k and v in backward, compiled: each projection's input gradient
    (a matmul, viewed) reduce-scattered on its own (:func:`_scattered`), the shards added left to
    right (``terms`` 0: one shard added to itself). ``groups`` cycles over the terms; ``wait_reader``:
    the first term's shard is also an output; ``sum_reader``: the first partial sum is also an
    output; ``bf16_term``: the first term is cast to bfloat16 before its scatter."""
    g = fx.Graph()
    inputs: dict = {}
    shards = []
    for t in range(max(terms, 1)):
        y = _projection(g, t, 32, scatter_dim, inputs)
        if bf16_term and t == 0:
            y = _call(g, torch.ops.prims.convert_element_type.default, y, torch.bfloat16)
        shards.append(_scattered(g, y, 32, scatter_dim, op, groups[t % len(groups)]))
    total, partial = shards[0], None
    for other in shards[1:] if terms > 0 else shards:
        total = _call(g, ATEN.add.Tensor, total, other)
        partial = total if partial is None else partial
    out = _call(g, ATEN.neg.default, total)
    g.output((out, shards[0]) if wait_reader else (out, partial) if sum_reader else (out,))
    _set_vals(g, inputs)
    return g, inputs


@pytest.mark.parametrize("dim", [0, 1], ids=["seq-first", "batch-first"])
def test_summed_reduce_scatters_become_one_then_split(dim: int, caplog) -> None:
    """[Note: summed reduce-scatters in compiled graphs]: three reduce-scattered input gradients
    added become one reduce-scatter of their sum (a third of the traffic), which is then pattern
    (c) and split in chunks. Values: the sum is reduced once instead of each term, so they agree up to
    float rounding (fp32, 1e-5 relative), not bitwise. The inner ``q + k`` is part of the one match,
    not a second one (whose rewrite would fail, logging a warning)."""
    g, inputs = _summed_scatters_graph(dim)
    before = _run(g, inputs)
    with caplog.at_level(logging.WARNING, logger="scheduler"):
        assert merge_summed_reduce_scatters(g) == 2
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert _targets(g).count(RS) == 1 and _targets(g).count(ATEN.add.Tensor) == 2
    after = _run(g, inputs)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    assert decompose_collective_matmuls(g, 2) == 1  # now pattern (c)
    order = [t for t in _targets(g) if t in (RS, WAIT, ATEN.mm.default, ATEN.add.Tensor)]
    chunk = [ATEN.mm.default, ATEN.mm.default, ATEN.add.Tensor, ATEN.mm.default, ATEN.add.Tensor, RS, WAIT]
    assert order == chunk + chunk
    torch.testing.assert_close(_run(g, inputs), before, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("make", [
    lambda: _summed_scatters_graph(op="avg"),  # another reduce op
    lambda: _summed_scatters_graph(groups=("0", "1")),  # different groups
    lambda: _summed_scatters_graph(wait_reader=True),  # a term's shard has another reader
    lambda: _summed_scatters_graph(terms=1),  # nothing to add
    lambda: _summed_scatters_graph(terms=0),  # one shard added to itself
    lambda: _summed_scatters_graph(bf16_term=True),  # one term reduced in bf16, the others in fp32
], ids=["avg", "two-groups", "shard-read-elsewhere", "one-term", "one-shard-twice", "dtypes-differ"])
def test_other_sums_of_reduce_scatters_are_left_unchanged(make) -> None:
    g, _ = make()
    code = g.python_code("self").src
    assert merge_summed_reduce_scatters(g) == 0
    assert g.python_code("self").src == code


def test_a_partial_sum_read_elsewhere_is_merged_on_its_own() -> None:
    """``(q + k) + v`` where ``q + k`` is also an output: only q's and k's reduce-scatters merge (the
    partial sum keeps its reader), then v's shard is added to it. Values within float rounding."""
    g, inputs = _summed_scatters_graph(sum_reader=True)
    before = _run(g, inputs)
    assert merge_summed_reduce_scatters(g) == 1
    assert _targets(g).count(RS) == 2
    g.lint()
    torch.testing.assert_close(_run(g, inputs), before, rtol=1e-5, atol=1e-5)


def test_summed_reduce_scatters_merge_only_when_splitting() -> None:
    """The merge changes rounding, so the hook runs it only with the collective matmul split:
    ``collective_matmul_chunks=1`` (or None) leaves the graph's collectives as they were."""
    for chunks, scatters in ((None, 3), (1, 3), (2, 2)):
        g, _ = _summed_scatters_graph(1)
        overlap_graph(g, collective_matmul_chunks=chunks)
        assert _targets(g).count(RS) == scatters, chunks


def _mlp_graph(gather_dim: int = 1, late_operand: bool = False, mix_rows: bool = False,
               overwritten: bool = False, other_operand: str = "", weight_written: bool = False,
               early_reader: bool = False) -> tuple[fx.Graph, dict]:
    """A sequence-parallel MLP's forward as compiled: gather -> addmm -> reshape -> relu, times a
    broadcast scale ``s`` -> reshape -> mm -> reduce-scatter, on x [2, seq/W, 8] (``gather_dim`` 1:
    ``Shard(1)``, batch first) or [seq/W, 2, 8] (0). ``late_operand``: also times ``tanh(z)``, a
    tensor of the activation's shape made after the first matmul (as a saved activation's
    derivative is in backward); ``mix_rows``: the activation flipped on dim 0 first (rows mixed
    across chunks); ``overwritten``: with ``late_operand``, ``z`` is a copy that is filled in place
    after the first matmul, before ``tanh`` reads it. ``other_operand``: the activation is also
    multiplied, right after the relu, by ``"per-row"`` a [2, seq, 1] operand (one number per row, as a
    norm's statistics), ``"batch-mean"`` its own mean over dim 0 (a reduction across the chunks), or
    ``"transposed"`` an operand of shape [seq, 2, 12] with the activation permuted to that shape and
    back (dim 0 moved); ``weight_written``: ``w2`` is a copy that is doubled in place
    after the activation, before the second matmul reads it; ``early_reader``: the gathered rows are
    also summed before the first matmul (so both gather chunks are waited for before it), an output.
    The activation is also an output (as a tensor saved for backward is)."""
    seq = 32
    g = fx.Graph()
    x, w1, b1, w2, s, z = (g.placeholder(n) for n in ("x", "w1", "b1", "w2", "s", "z"))
    if overwritten:
        z = _call(g, ATEN.clone.default, z)
    if weight_written:
        w2 = _call(g, ATEN.clone.default, w2)
    wait = _call(g, WAIT, _call(g, AG, x, W, "0"))
    if gather_dim:
        split = _call(g, ATEN.split.Tensor, wait, 2)
        wait = _call(g, ATEN.cat.default, [_call(g, operator.getitem, split, i) for i in range(W)], gather_dim)
    rows = _call(g, ATEN.reshape.default, wait, [seq * 2, 8])
    total = _call(g, ATEN.sum.default, rows) if early_reader else None
    up = _call(g, ATEN.addmm.default, b1, rows, _call(g, ATEN.permute.default, w1, [1, 0]))
    shape = [[seq, 2, 12], [2, seq, 12]][gather_dim]
    h = _call(g, ATEN.reshape.default, up, shape)
    if mix_rows:
        h = _call(g, ATEN.flip.default, h, [0])
    if overwritten:
        _call(g, ATEN.fill_.Scalar, z, 0.5)
    h = _call(g, ATEN.relu.default, h)
    if other_operand == "per-row":
        h = _call(g, ATEN.mul.Tensor, h, _call(g, ATEN.slice.Tensor, z, 2, 0, 1))
    elif other_operand == "batch-mean":
        h = _call(g, ATEN.mul.Tensor, h, _call(g, ATEN.mean.dim, h, [0], True))
    elif other_operand == "transposed":
        t = _call(g, ATEN.mul.Tensor, _call(g, ATEN.permute.default, h, [1, 0, 2]),
                  _call(g, ATEN.permute.default, z, [1, 0, 2]))
        h = _call(g, ATEN.permute.default, t, [1, 0, 2])
    h = _call(g, ATEN.mul.Tensor, h, s)
    if late_operand:
        h = _call(g, ATEN.mul.Tensor, h, _call(g, ATEN.tanh.default, z))
    act = _call(g, ATEN.reshape.default, h, [seq * 2, 12])
    if weight_written:
        _call(g, ATEN.mul_.Tensor, w2, 2.0)
    down = _call(g, ATEN.mm.default, act, _call(g, ATEN.permute.default, w2, [1, 0]))
    out = _scattered(g, _call(g, ATEN.reshape.default, down, [[seq, 2, 8], [2, seq, 8]][gather_dim]), seq, gather_dim)
    g.output((out, act, total) if early_reader else (out, act))
    inputs = {"x": torch.randn([(seq // W, 2, 8), (2, seq // W, 8)][gather_dim]), "w1": torch.randn(12, 8),
              "b1": torch.randn(12), "w2": torch.randn(8, 12), "s": torch.randn(12), "z": torch.randn(shape)}
    _set_vals(g, inputs)
    return g, inputs


@pytest.mark.parametrize("late_operand", [False, True], ids=["operands-early", "operand-made-late"])
def test_pointwise_ops_between_split_matmuls_run_per_chunk(late_operand: bool) -> None:
    """[Note: ops per chunk between split matmuls]: with the batch cut, the activation between the gathered
    matmul and the scattered one runs per chunk, so chunk 0's scatter is issued before chunk 1's
    gather is waited for; the activation (an output) is the cat of the chunks' values; a tensor the
    activation reads that was made after the first matmul is made before it. Values bitwise."""
    g, inputs = _mlp_graph(late_operand=late_operand)
    before = _run(g, inputs)
    assert overlap_graph(g, collective_matmul_chunks=2)
    assert _targets(g).count(ATEN.relu.default) == 2
    assert _targets(g).count(ATEN.tanh.default) == int(late_operand)  # made once, sliced per chunk
    assert collective_order(g) == ["AG", "AG", "wait AG", "RS", "wait AG", "RS", "wait RS", "wait RS"]
    _check_same_values(g, inputs, before)


@pytest.mark.parametrize("make", [
    lambda: _mlp_graph(gather_dim=0),  # the sequence cut: chunks interleave rows, not consecutive
    lambda: _mlp_graph(mix_rows=True),  # a flip on dim 0 mixes the chunks' rows
    lambda: _mlp_graph(late_operand=True, overwritten=True),  # tanh(z) cannot move above z's fill
    lambda: _mlp_graph(other_operand="per-row"),  # [2, seq, 1]: neither the activation's rows nor broadcast over them
    # a reduction over dim 0 reads every chunk's rows; with both gather waits before the first matmul
    # (an early reader), nothing but that stops the activation's whole from being moved up to chunk 0
    lambda: _mlp_graph(other_operand="batch-mean", early_reader=True),
    lambda: _mlp_graph(other_operand="transposed"),  # a permute that moves dim 0 mixes the chunks' rows
], ids=["sequence-cut", "rows-mixed", "operand-written-late", "per-row-operand", "batch-mean", "transposed"])
def test_pointwise_ops_stay_whole_where_chunk_rows_are_not_apart(make) -> None:
    """The matmuls are still split, but the activation runs once on the whole tensor and no
    scatter is issued before the last gather chunk is waited for. Values bitwise."""
    g, inputs = make()
    before = _run(g, inputs)
    assert overlap_graph(g, collective_matmul_chunks=2)
    assert _targets(g).count(ATEN.relu.default) == 1
    assert _targets(g).count(AG) == 2 and _targets(g).count(RS) == 2
    assert collective_order(g) == ["AG", "AG", "wait AG", "wait AG", "RS", "RS", "wait RS", "wait RS"]
    _check_same_values(g, inputs, before)


def test_a_view_that_cuts_a_chunks_rows_reads_the_rebuilt_whole() -> None:
    """The activation [2, seq, 12] is also viewed as [3, 256] (an output): a chunk's 384 elements
    are not whole rows of that view, so it is no part of the region; the activation still runs per
    chunk, and the view reads its whole, rebuilt after the last chunk. Values bitwise."""
    g, inputs = _mlp_graph()
    relu = next(n for n in g.nodes if n.target is ATEN.relu.default)
    with g.inserting_before(relu.next):
        uneven = _call(g, ATEN.view.default, relu, [3, 256])
    out = g.output_node()
    out.args = ((*out.args[0], uneven),)
    _set_vals(g, inputs)
    before = _run(g, inputs)
    assert overlap_graph(g, collective_matmul_chunks=2)
    assert _targets(g).count(ATEN.relu.default) == 2
    assert uneven.args[0].target is ATEN.cat.default
    _check_same_values(g, inputs, before)


def test_ops_after_a_write_are_not_moved_above_it() -> None:
    """The second matmul's weight is doubled in place after the activation: the activation still
    runs per chunk, but chunk 0's second matmul (and what it needs) is not moved above that write,
    so it reads the doubled weight as the unrewritten graph does. Values bitwise."""
    g, inputs = _mlp_graph(weight_written=True)
    before = _run(g, inputs)
    assert overlap_graph(g, collective_matmul_chunks=2)
    assert _targets(g).count(ATEN.relu.default) == 2
    _check_same_values(g, inputs, before)


def test_a_slice_to_the_end_of_the_rows_reads_the_last_chunk() -> None:
    """``slice(h, 0, start, 2**63 - 1)`` (``h[start:]``, as a traced graph writes it) of exactly the
    last chunk's rows is that chunk's value, as ``slice(h, 0, start, rows)`` is: the second matmul's
    last chunk reads the activation's last chunk, not a slice of the rebuilt whole. Values bitwise."""
    g, inputs = _mlp_graph()
    before = _run(g, inputs)
    assert decompose_collective_matmuls(g, 2) == 2
    down = [n for n in g.nodes if n.target is ATEN.mm.default]
    last = down[-1].args[0]
    assert last.target is ATEN.slice.Tensor and last.args[3] == 64
    last.args = (*last.args[:3], 2**63 - 1)
    assert run_ops_per_chunk(g) == 1
    assert [n.args[0].target for n in g.nodes if n.target is ATEN.mm.default] == [ATEN.reshape.default] * 2
    _check_same_values(g, inputs, before)


def _attention_graph(dropout: float, outside_value: bool = False) -> tuple[fx.Graph, dict]:
    """An attention block's forward as compiled with the batch cut in view: x [2, seq/W, 8] gathered
    (``Shard(1)``) -> q, k, v (addmm each) -> heads -> CPU flash attention (``dropout``) -> output
    projection -> reduce-scatter. The attention's output is also an output (saved for backward).
    ``outside_value``: v is an input [2, heads, seq, 4] instead (a tensor of the batch made
    elsewhere, as the saved output and log-sum-exp are for the attention's backward)."""
    seq, heads = 32, 2
    g = fx.Graph()
    x = g.placeholder("x")
    weights = {p: (g.placeholder(f"w{p}"), g.placeholder(f"b{p}")) for p in "qkvo"}
    value = g.placeholder("v") if outside_value else None
    wait = _call(g, WAIT, _call(g, AG, x, W, "0"))
    split = _call(g, ATEN.split.Tensor, wait, 2)
    rows = _call(g, ATEN.reshape.default,
                 _call(g, ATEN.cat.default, [_call(g, operator.getitem, split, i) for i in range(W)], 1), [2 * seq, 8])

    def projected(p: str) -> fx.Node:
        wt, b = weights[p]
        y = _call(g, ATEN.addmm.default, b, rows, _call(g, ATEN.permute.default, wt, [1, 0]))
        return _call(g, ATEN.permute.default, _call(g, ATEN.reshape.default, y, [2, seq, heads, 4]), [0, 2, 1, 3])

    q, k = projected("q"), projected("k")
    flash = _call(g, ATEN._scaled_dot_product_flash_attention_for_cpu.default, q, k,
                  value if outside_value else projected("v"), dropout, True)
    out = _call(g, operator.getitem, flash, 0)
    merged = _call(g, ATEN.reshape.default, _call(g, ATEN.permute.default, out, [0, 2, 1, 3]), [2 * seq, 8])
    wt, b = weights["o"]
    y = _call(g, ATEN.addmm.default, b, merged, _call(g, ATEN.permute.default, wt, [1, 0]))
    g.output((_scattered(g, _call(g, ATEN.reshape.default, y, [2, seq, 8]), seq, 1), out))
    inputs = {"x": torch.randn(2, seq // W, 8)}
    inputs.update({f"{k}{p}": torch.randn(8, 8) if k == "w" else torch.randn(8) for p in "qkvo" for k in "wb"})
    if outside_value:
        inputs["v"] = torch.randn(2, heads, seq, 4)
    _set_vals(g, inputs)
    return g, inputs


def test_attention_between_split_matmuls_runs_per_chunk_without_dropout() -> None:
    """[Note: ops per chunk between split matmuls] through attention: q's, k's and v's chunk results
    (three seeds) -> heads -> flash attention -> output projection, per chunk; chunk 0's scatter is
    issued before chunk 1's gather is waited for. Values bitwise. With dropout the attention stays
    whole (a chunk's copy would draw other random numbers than the whole); meta values only, as
    CPU flash attention runs no dropout."""
    flash = ATEN._scaled_dot_product_flash_attention_for_cpu.default
    g, inputs = _attention_graph(0.0)
    before = _run(g, inputs)
    assert overlap_graph(g, collective_matmul_chunks=2)
    assert _targets(g).count(flash) == 2
    assert collective_order(g) == ["AG", "AG", "wait AG", "RS", "wait AG", "RS", "wait RS", "wait RS"]
    _check_same_values(g, inputs, before)
    g, _ = _attention_graph(0.5)
    assert overlap_graph(g, collective_matmul_chunks=2)
    assert _targets(g).count(flash) == 1
    assert collective_order(g) == ["AG", "AG", "wait AG", "wait AG", "RS", "RS", "wait RS", "wait RS"]


def _bare_region(whole: Callable[..., fx.Node], shapes: dict[str, list[int]], cat_dim: int = 0,
                 rows: int = 2) -> tuple[fx.Graph, dict]:
    """For :func:`run_ops_per_chunk` alone: per name in ``shapes``, inputs ``{name}0`` and
    ``{name}1`` of that shape, each negated (a chunk's value), joined by a ``cat`` on ``cat_dim``;
    ``whole`` of those cats; and the two slices of ``rows`` rows on dim 0 of it (what a split
    matmul's chunks would read), all outputs."""
    g = fx.Graph()
    names = [f"{name}{k}" for name in shapes for k in range(2)]
    parts = dict(zip(names, [g.placeholder(n) for n in names]))
    cats = {name: _call(g, ATEN.cat.default, [_call(g, ATEN.neg.default, parts[f"{name}{k}"]) for k in range(2)],
                        cat_dim) for name in shapes}
    out = whole(g, **cats)
    g.output((out, *(_call(g, ATEN.slice.Tensor, out, 0, k * rows, (k + 1) * rows) for k in range(2))))
    inputs = {f"{name}{k}": torch.randn(shape) for name, shape in shapes.items() for k in range(2)}
    _set_vals(g, inputs)
    return g, inputs


@pytest.mark.parametrize("make", [
    # a cat on dim 1 is no seed, even where a dim-0 slice has the row count of one of its inputs
    lambda: _bare_region(lambda g, a: _call(g, ATEN.relu.default, a), {"a": [16, 6]}, cat_dim=1, rows=16),
    # b [2, 4] broadcast against a [2, 2, 4] meets a's dim 1, not its dim 0 (the two are both 2)
    lambda: _bare_region(lambda g, a, b: _call(g, ATEN.mul.Tensor, a, b), {"a": [1, 2, 4], "b": [1, 4]}, rows=1),
    # an in-place pointwise op writes: it may be neither copied per chunk nor moved
    lambda: _bare_region(lambda g, a: _call(g, ATEN.relu_.default, a), {"a": [1, 4]}, rows=1),
], ids=["cat-on-dim-1", "broadcast-onto-dim-1", "in-place"])
def test_bare_regions_whose_ops_may_not_run_per_chunk_are_left_unchanged(make) -> None:
    """[Note: ops per chunk between split matmuls]: the region starts only at dim-0 cats, and a
    pointwise op joins it only where it does not write and its region operands have its shape
    (broadcast tensors come from outside it): these graphs are left unchanged."""
    g, _ = make()
    code = g.python_code("self").src
    assert run_ops_per_chunk(g) == 0
    assert g.python_code("self").src == code


def test_attention_reads_an_outside_tensor_of_the_batch_sliced_per_chunk() -> None:
    """[Note: ops per chunk between split matmuls]: a tensor the attention reads that has the batch
    on dim 0 but comes from outside the region (v here) is sliced per chunk like the region's own
    rows, so each chunk's attention reads its own sequences of it. Values bitwise."""
    flash = ATEN._scaled_dot_product_flash_attention_for_cpu.default
    g, inputs = _attention_graph(0.0, outside_value=True)
    before = _run(g, inputs)
    assert overlap_graph(g, collective_matmul_chunks=2)
    assert _targets(g).count(flash) == 2
    assert collective_order(g) == ["AG", "AG", "wait AG", "RS", "wait AG", "RS", "wait RS", "wait RS"]
    _check_same_values(g, inputs, before)


def test_chunk_count_is_capped_by_min_rows_and_divisibility() -> None:
    g, _ = _gather_graph(seq=48)  # 24 rows of dim 0 per rank, 96 matmul rows
    assert decompose_collective_matmuls(g, 16) == 1
    assert _targets(g).count(AG) == 6  # 16, 12, 8 do not divide 24 or leave < 16 rows; 6 does
    g, _ = _gather_graph(seq=8)  # 16 matmul rows: a chunk would have 8
    assert decompose_collective_matmuls(g, 2) == 0


@pytest.mark.parametrize("make", [
    lambda: _gather_graph(gather_dim=2),  # gathered on the matmul's columns, not its rows
    lambda: _gather_graph(seq=34),  # 17 rows per rank: not divisible by 2 chunks
    lambda: _gather_graph(gather_dim=1, ranks_swapped=True),  # the rank blocks out of order: not a gather
    lambda: _gather_graph(transposed=True),  # the matmul's rows mix the gathered dim with the batch
    lambda: _gather_graph(full_bias=True),  # a bias of every row, not 1-D
    lambda: _scatter_graph(mm_reader=True),  # the matmul's output has another reader
    lambda: _scatter_graph(terms=3, sum_reader=True),  # a partial sum has another reader
    lambda: _scatter_graph(terms=0),  # y + y: not a sum of distinct matmuls
    lambda: _scatter_graph(terms=3, mm_reader=True),  # one term's matmul has another reader
], ids=["gather-dim", "not-divisible", "ranks-swapped", "transposed", "full-bias", "mm-read-elsewhere",
        "partial-sum-read-elsewhere", "one-term-twice", "term-mm-read-elsewhere"])
def test_other_graphs_are_left_unchanged(make, caplog) -> None:
    """None of these is a match: nothing is rewritten, and no rewrite is tried (one that fails is
    rolled back with a warning)."""
    g, _ = make()
    code = g.python_code("self").src
    with caplog.at_level(logging.WARNING, logger="scheduler"):
        assert decompose_collective_matmuls(g, 2) == 0
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert g.python_code("self").src == code


def test_uuid_depends_on_the_chunk_option_and_the_source(monkeypatch) -> None:
    ids = {OverlapGraphPass(collective_matmul_chunks=c).uuid() for c in (None, 1, 2, 4)}
    assert len(ids) == 4
    assert OverlapGraphPass().uuid() == OverlapGraphPass(collective_matmul_chunks=2).uuid()

    import scheduler.collective_matmul
    from torch._inductor import custom_graph_pass

    hashed: list[tuple[str, ...]] = []
    real = custom_graph_pass.get_hash_for_files
    monkeypatch.setattr(custom_graph_pass, "get_hash_for_files", lambda files: hashed.append(files) or real(files))
    OverlapGraphPass().uuid()
    assert scheduler.collective_matmul.__file__ in hashed[0]


def test_bad_chunk_option() -> None:
    with pytest.raises(ValueError, match="collective_matmul_chunks"):
        OverlapGraphPass(collective_matmul_chunks=0)
    with pytest.raises(TypeError, match="collective_matmul_chunks"):
        OverlapGraphPass(collective_matmul_chunks=2.0)


# -- the sequence-parallel MLP on 2 gloo ranks ------------------------------------------------------

SEQ, BATCH, HIDDEN, FFN = 64, 2, 16, 32
HOOK_REPEATS = 15
"""Steps run again through the hook's compiled module, each bitwise its first: a race in the
compiled code (a buffer reused while a collective still reads it) changes some of them. On torch
2.15 the one of [Note: the out variant's input is snapshotted] changed about 1 step in 3."""


def _three_ways(build: Callable[[], Any], x0: torch.Tensor) -> dict[str, Any]:
    """Outputs and gradients of ``build()`` (a torch-TP module) eager, compiled, and compiled under
    the hook with 2 chunks, the collectives counted in the hook's post-grad graphs after the pass,
    and whether :data:`HOOK_REPEATS` more steps under the hook each gave bitwise its first step's."""
    import torch._inductor.config as inductor_config
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    from scheduler import graph_pass, inductor_overlap

    def step(m: Any) -> list[torch.Tensor]:
        for p in m.parameters():
            p.grad = None
        x = x0.clone().requires_grad_()
        y = m(x)
        y = y.to_local() if hasattr(y, "to_local") else y
        (y * torch.arange(y.numel()).view(y.shape).cos()).sum().backward()
        values = [y.detach(), x.grad] + [p.grad.to_local() for p in m.parameters()]
        # Eager DTensor hands back results of collectives not yet waited (AsyncCollectiveTensor).
        return [v.wait() if isinstance(v, AsyncCollectiveTensor) else v for v in values]

    graphs: list[str] = []
    orders: list[list[str]] = []
    original = graph_pass.overlap_graph

    def recording(graph: fx.Graph, *args: Any) -> bool:
        changed = original(graph, *args)
        graphs.append(str(graph))
        orders.append(collective_order(graph))
        return changed

    result: dict[str, Any] = {"eager": step(build())}
    with inductor_config.patch(fx_graph_cache=False):
        torch._dynamo.reset()
        result["compiled"] = step(torch.compile(build()))
        graph_pass.overlap_graph = recording
        try:
            torch._dynamo.reset()
            with inductor_overlap(collective_matmul_chunks=2):
                compiled = torch.compile(build())
            result["hook"] = step(compiled)
            repeats = [step(compiled) for _ in range(HOOK_REPEATS)]  # all of them on every rank: same collectives
            result["hook repeats equal"] = all(torch.equal(a, b) for r in repeats for a, b in zip(r, result["hook"]))
            result["graphs"] = [_counts(g) for g in graphs]
            result["orders"] = orders
        finally:
            graph_pass.overlap_graph = original
        torch._dynamo.reset()
    return result


def _sp_mlp(rank: int, world_size: int, dims: tuple[int, ...]) -> dict[int, dict[str, Any]]:
    """Per sequence dim in ``dims`` (0: Megatron's [seq, batch, hidden]; 1: [batch, seq, hidden]):
    the sequence-parallel MLP three ways (:func:`_three_ways`; 1 all-gather and 1 reduce-scatter
    each way per graph without the split)."""
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world_size,))

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(HIDDEN, FFN)
            self.down = nn.Linear(FFN, HIDDEN)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(torch.relu(self.up(x)))

    def model(dim: int) -> nn.Module:
        torch.manual_seed(0)
        return parallelize_module(MLP(), mesh, {"up": ColwiseParallel(input_layouts=Shard(dim)),
                                                "down": RowwiseParallel(output_layouts=Shard(dim))})

    results: dict[int, dict[str, Any]] = {}
    for dim in dims:
        torch.manual_seed(1 + rank)
        x0 = torch.randn(SEQ // world_size, BATCH, HIDDEN)
        if dim == 1:
            x0 = x0.transpose(0, 1).contiguous()
        results[dim] = _three_ways(lambda: model(dim), x0)
    return results


def _titan_attention(rank: int, world_size: int) -> dict[str, Any]:
    """torchtitan's attention plan (``tp_blocks``' ``prepared_attn``: the input gathered once by
    ``PrepareModuleInput`` for q, k and v) three ways (:func:`_three_ways`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from tp_blocks import make_block, plan_for

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(1 + rank)
    x0 = torch.randn(BATCH, SEQ // world_size, HIDDEN)
    return _three_ways(lambda: parallelize_module(make_block("prepared_attn"), mesh, plan_for("prepared_attn")), x0)


def _sp_attention(rank: int, world_size: int) -> dict[str, Any]:
    """torch's sequence-parallel attention plan (``tp_blocks``' ``sp_attention``: q, k and v each
    ``ColwiseParallel(input_layouts=Shard(1))``) three ways (:func:`_three_ways`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from tp_blocks import make_block, plan_for

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(1 + rank)
    x0 = torch.randn(BATCH, SEQ // world_size, HIDDEN)
    return _three_ways(lambda: parallelize_module(make_block("sp_attention"), mesh, plan_for("sp_attention")), x0)


def _counts(graph: str) -> dict[str, int]:
    return {op: graph.count(f"_c10d_functional.{op}.default") for op in ("all_gather_into_tensor",
                                                                         "reduce_scatter_tensor")}


def _blocks(rank: int, world_size: int) -> dict[str, Any]:
    """:func:`_sp_mlp` (sequence first), :func:`_titan_attention` and :func:`_sp_attention` on one
    set of ranks (each start-up warms Inductor anew)."""
    return {"sp_mlp": _sp_mlp(rank, world_size, (0,)), "titan": _titan_attention(rank, world_size),
            "sp_attention": _sp_attention(rank, world_size)}


@pytest.fixture(scope="module")
def compiled_blocks() -> list[dict[str, Any]]:
    from overlap.testing import run_distributed

    return run_distributed(_blocks, 2, timeout=400)


def _assert_per_chunk(orders: list[list[str]], where: str, expected: bool = True) -> None:
    """[Note: ops per chunk between split matmuls]: whether each graph (forward, backward) issues its
    first scatter chunk before it waits for its last gather chunk, as when the ops between its split
    matmuls run chunk by chunk (with the batch cut)."""
    for order in orders:
        assert scatter_before_last_gather_wait(order) == expected, f"{where}: {order}"


def _check_sp_mlp(by_rank: list[dict[int, dict[str, Any]]]) -> None:
    """Each rank's sequence-parallel MLP (:func:`_sp_mlp`) per sequence dim: split in 2 chunks in
    forward and backward, bitwise plain compile, close to eager."""
    names = ["out", "x.grad", "up.weight.grad", "up.bias.grad", "down.weight.grad", "down.bias.grad"]
    for rank, by_dim in enumerate(by_rank):
        for dim, r in by_dim.items():
            where = f"rank {rank}, sequence dim {dim}"
            # forward: gather -> up, down -> scatter; backward: the mirror (gather of the output
            # gradient -> down's input gradient, up's input gradient -> scatter).
            split = [{"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}] * 2
            assert r["graphs"] == split, f"{where}: {r['graphs']}"
            # [Note: ops per chunk between split matmuls]: batch first (the batch cut), the relu (forward)
            # and its backward run per chunk, so each graph issues its first scatter chunk before
            # it waits for its last gather chunk; sequence first, the chunks' rows interleave.
            _assert_per_chunk(r["orders"], where, dim == 1)
            assert r["hook repeats equal"], f"{where}: a step repeated under the hook differs from its first"
            for name, a, c, e in zip(names, r["hook"], r["compiled"], r["eager"]):
                assert torch.equal(a, c), f"{where}: {name}: split under the hook differs from plain compile"
                # Eager DTensor sums the bias gradients in another order: ~1 ulp apart.
                torch.testing.assert_close(a, e, msg=lambda m: f"{where}: {name} vs eager: {m}")


def test_sequence_parallel_mlp_compiled_with_split_collectives(compiled_blocks: list[dict[str, Any]]) -> None:
    """Megatron's layout, [seq, batch, hidden]: the chunks cut the sequence."""
    _check_sp_mlp([r["sp_mlp"] for r in compiled_blocks])


# The default suite's batch-first blocks are the two attention plans below (the batch cut, the ops
# between split matmuls per chunk); this MLP is their third, on its own ranks: two more compiles per
# rank, about a sixth of this file's time on the 2-core CI box.
@pytest.mark.slow
def test_sequence_parallel_mlp_batch_first_compiled_with_split_collectives() -> None:
    """[batch, seq, hidden]: the chunks cut the batch, the relu runs per chunk."""
    from overlap.testing import run_distributed

    _check_sp_mlp(run_distributed(_sp_mlp, 2, (1,), timeout=400))


_ATTENTION_GRADS = ["out", "x.grad", *(f"{p}.grad" for p in ("norm.weight", "norm.bias", "wq.weight", "wq.bias",
                                                              "wk.weight", "wk.bias", "wv.weight", "wv.bias",
                                                              "wo.weight", "wo.bias"))]


def _check_compiled_attention(blocks: list[dict[str, Any]], key: str, downstream: frozenset = frozenset()) -> None:
    """Each rank's ``key`` block (:func:`_three_ways`): forward and backward each one gather and one
    scatter split in 2 chunks, the ops between them per chunk; the output and gradients
    (:data:`_ATTENTION_GRADS`) bitwise plain compile, those in ``downstream`` within 1e-5 (fp32), all
    close to eager."""
    for rank, r in enumerate(r[key] for r in blocks):
        split = [{"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}] * 2
        assert r["graphs"] == split, f"rank {rank}: {r['graphs']}"
        _assert_per_chunk(r["orders"], f"rank {rank}")
        assert r["hook repeats equal"], f"rank {rank}: a step repeated under the hook differs from its first"
        assert len(r["hook"]) == len(_ATTENTION_GRADS)
        for name, a, c, e in zip(_ATTENTION_GRADS, r["hook"], r["compiled"], r["eager"]):
            if name in downstream:
                torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank}: {name}: {m}")
            else:
                assert torch.equal(a, c), f"rank {rank}: {name}: the hook differs from plain compile"
            torch.testing.assert_close(a, e, msg=lambda m: f"rank {rank}: {name} vs eager: {m}")


def test_torchtitan_attention_compiled_with_split_collectives(compiled_blocks: list[dict[str, Any]]) -> None:
    """torchtitan's plan compiled under the hook: forward, the gather before q, k, v (one, shared)
    and the output projection's scatter; backward, the output gradient's gather and the scatter of
    q, k and v's summed input gradients (pattern (c)), each in 2 chunks, and the attention between
    them run per chunk ([Note: ops per chunk between split matmuls]); values bitwise plain compile."""
    _check_compiled_attention(compiled_blocks, "titan")


def test_sequence_parallel_attention_compiled_with_one_summed_scatter(compiled_blocks: list[dict[str, Any]]) -> None:
    """torch's sequence-parallel attention plan compiled under the hook: AOT already gathers the
    input once for q, k and v; in backward their three input-gradient reduce-scatters become one
    of the sum ([Note: summed reduce-scatters in compiled graphs]), split in 2 chunks like the
    output projection's pair. Everything upstream of that sum (the output, every projection's
    gradients) is bitwise plain compile; the input's and the norm's gradients, downstream of it,
    agree up to the changed rounding order (fp32, 1e-5 relative)."""
    _check_compiled_attention(compiled_blocks, "sp_attention",
                              downstream=frozenset({"x.grad", "norm.weight.grad", "norm.bias.grad"}))
