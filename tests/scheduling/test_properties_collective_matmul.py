"""Property-based tests of the Inductor hook's tensor-parallel rewrites on graphs drawn by Hypothesis.

``scheduler.collective_matmul.decompose_collective_matmuls`` on a column-parallel linear fed by an
all-gather and a row-parallel linear (or a sum of them) feeding a reduce-scatter, as torch 2.13's
functional collectives emit them, with drawn batch, per-rank sequence length, widths, sequence
dim (0: [seq, batch, hidden], 1: [batch, seq, hidden]), group size, bias and chunk count; and
``scheduler.summed_scatters.merge_summed_reduce_scatters`` on sums of reduce-scattered matmuls.
The graphs run on fake ``w``-rank collectives (``fake_collectives``: plain tensor ops with the
collectives' semantics). Properties:

* the split: bitwise the unrewritten graph's values; ``c`` collectives where there was one, ``c``
  no more than asked, every chunk's matmul at least ``MIN_ROWS`` rows, and the cut dim (dim 0 where
  the sequence dim is not 0 and the batch divides into as many chunks, else the sequence dim)
  divisible by ``c``;
* the merge: one reduce-scatter where there were ``terms``, values within float rounding (fp32:
  1e-5 relative, 1e-4 absolute on values of order 10-100), then split like any sum of matmuls;
* the whole hook pass on a gathered linear -> relu * scale -> scattered linear: bitwise the graph
  split alone, and the activation runs once per chunk exactly where the batch is cut
  (``scheduler.per_chunk_ops``), the first chunk's scatter then issued before the last gather
  chunk is waited for. (Its reference is the split graph, not the unsplit one: the split's matmuls
  have fewer rows, and this CPU's BLAS does not give every row the same bits at every row count
  for some small inner dims, e.g. 6 or 7 at 72 vs 18 rows; the sizes drawn above avoid those.)

Example counts come from the Hypothesis profile (conftest: ``OVERLAP_HYPOTHESIS_PROFILE``).
"""
from __future__ import annotations

import copy
import operator
from typing import Any

import pytest
import torch
import torch.fx as fx

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fake_collectives import (  # noqa: E402
    AG, ATEN, RS, WAIT, call as _call, collective_order, run, scatter_before_last_gather_wait,
)
from scheduler import overlap_graph  # noqa: E402
from scheduler.collective_matmul import MIN_ROWS, decompose_collective_matmuls  # noqa: E402
from scheduler.summed_scatters import merge_summed_reduce_scatters  # noqa: E402


def _layout(dim: int, batch: int, seq: int, width: int) -> list[int]:
    return [seq, batch, width] if dim == 0 else [batch, seq, width]


def _gather_graph(batch: int, seq: int, hidden: int, out: int, dim: int, w: int, bias: bool) -> tuple[fx.Graph, dict]:
    """x (this rank's ``seq`` rows of the sequence dim) -> all-gather on ``dim`` -> rows -> linear."""
    g = fx.Graph()
    x, wt, b = g.placeholder("x"), g.placeholder("w"), g.placeholder("b")
    gathered = _call(g, WAIT, _call(g, AG, x, w, "0"))
    if dim:
        split = _call(g, ATEN.split.Tensor, gathered, batch)
        gathered = _call(g, ATEN.cat.default, [_call(g, operator.getitem, split, i) for i in range(w)], dim)
    rows = _call(g, ATEN.reshape.default, gathered, [batch * seq * w, hidden])
    right = _call(g, ATEN.permute.default, wt, [1, 0])
    mm = _call(g, ATEN.addmm.default, b, rows, right) if bias else _call(g, ATEN.mm.default, rows, right)
    g.output((_call(g, ATEN.reshape.default, mm, _layout(dim, batch, seq * w, out)),))
    inputs = {"x": torch.randn(_layout(dim, batch, seq, hidden)), "w": torch.randn(out, hidden), "b": torch.randn(out)}
    return g, inputs


def _scatter_graph(batch: int, seq: int, hidden: int, out: int, dim: int, w: int, terms: int,
                   scatter_each: bool) -> tuple[fx.Graph, dict]:
    """``terms`` row-parallel matmuls over the full sequence (``seq * w`` rows of ``dim``), added then
    reduce-scattered on ``dim``, or (``scatter_each``) each reduce-scattered, then added."""
    g = fx.Graph()
    inputs, ys = {}, []
    full = _layout(dim, batch, seq * w, out)

    def scattered(y: fx.Node) -> fx.Node:
        if dim:
            split = _call(g, ATEN.split.Tensor, y, seq, 1)
            y = _call(g, ATEN.cat.default, [_call(g, operator.getitem, split, i) for i in range(w)])
        return _call(g, WAIT, _call(g, RS, y, "sum", w, "0"))

    for t in range(terms):
        h, wt = g.placeholder(f"h{t}"), g.placeholder(f"w{t}")
        mm = _call(g, ATEN.mm.default, _call(g, ATEN.reshape.default, h, [batch * seq * w, hidden]),
                   _call(g, ATEN.permute.default, wt, [1, 0]))
        y = _call(g, ATEN.reshape.default, mm, full)
        ys.append(scattered(y) if scatter_each else y)
        inputs.update({f"h{t}": torch.randn(_layout(dim, batch, seq * w, hidden)), f"w{t}": torch.randn(out, hidden)})
    total = ys[0]
    for other in ys[1:]:
        total = _call(g, ATEN.add.Tensor, total, other)
    g.output((total if scatter_each else scattered(total),))
    return g, inputs


def _count(g: fx.Graph, target: Any) -> int:
    return sum(n.target is target for n in g.nodes)


def _check_chunks(g: fx.Graph, collective: Any, chunks: int, batch: int, seq: int, dim: int, rows: int) -> None:
    c = _count(g, collective)
    assert 1 <= c <= max(chunks, 1)
    if c > 1:
        assert rows // c >= MIN_ROWS
        batch_cut = dim > 0 and batch % c == 0
        assert batch_cut or seq % c == 0, (c, batch, seq)


SHAPES = dict(batch=st.integers(1, 6), seq=st.sampled_from([4, 8, 12, 16, 24, 32]), hidden=st.sampled_from([4, 8]),
              out=st.sampled_from([4, 6]), dim=st.sampled_from([0, 1]), w=st.integers(2, 4), chunks=st.integers(1, 6))


def _split_keeps_values(g: fx.Graph, inputs: dict, w: int, collective: Any, chunks: int, batch: int, seq: int,
                        dim: int) -> None:
    run(g, inputs, w, meta=True)
    before = run(g, inputs, w)
    split = decompose_collective_matmuls(g, chunks)
    g.lint()
    assert split == (1 if _count(g, collective) > 1 else 0)
    if chunks >= 2 and seq % 2 == 0 and batch * seq * w // 2 >= MIN_ROWS:  # 2 chunks of the sequence fit
        assert split == 1
    _check_chunks(g, collective, chunks, batch, seq, dim, batch * seq * w)
    for a, b in zip(run(g, inputs, w), before):
        assert torch.equal(a, b)


@given(bias=st.booleans(), **SHAPES)
def test_split_gather_matmul_keeps_values_bitwise(batch: int, seq: int, hidden: int, out: int, dim: int, w: int,
                                                  chunks: int, bias: bool) -> None:
    g, inputs = _gather_graph(batch, seq, hidden, out, dim, w, bias)
    _split_keeps_values(g, inputs, w, AG, chunks, batch, seq, dim)


@given(terms=st.integers(1, 3), **SHAPES)
def test_split_matmul_scatter_keeps_values_bitwise(batch: int, seq: int, hidden: int, out: int, dim: int, w: int,
                                                   chunks: int, terms: int) -> None:
    g, inputs = _scatter_graph(batch, seq, hidden, out, dim, w, terms, scatter_each=False)
    _split_keeps_values(g, inputs, w, RS, chunks, batch, seq, dim)


@given(terms=st.integers(2, 4), **SHAPES)
def test_summed_scatters_merge_then_split(batch: int, seq: int, hidden: int, out: int, dim: int, w: int,
                                         chunks: int, terms: int) -> None:
    g, inputs = _scatter_graph(batch, seq, hidden, out, dim, w, terms, scatter_each=True)
    run(g, inputs, w, meta=True)
    before = run(g, inputs, w)
    assert merge_summed_reduce_scatters(g) == terms - 1
    g.lint()
    assert _count(g, RS) == 1
    decompose_collective_matmuls(g, chunks)
    _check_chunks(g, RS, chunks, batch, seq, dim, batch * seq * w)
    torch.testing.assert_close(run(g, inputs, w), before, rtol=1e-5, atol=1e-4)


def _mlp_graph(batch: int, seq: int, hidden: int, out: int, dim: int, w: int) -> tuple[fx.Graph, dict]:
    """:func:`_gather_graph`'s linear, then relu times a scale, then a row-parallel linear whose
    result is reduce-scattered on ``dim`` (a sequence-parallel MLP's forward)."""
    g, inputs = _gather_graph(batch, seq, hidden, out, dim, w, bias=True)
    (up,) = g.output_node().args[0]
    g.erase_node(g.output_node())
    with g.inserting_after(next(n for n in g.nodes if n.op == "placeholder")):  # placeholders come first
        scale, w2 = g.placeholder("s"), g.placeholder("w2")
    act = _call(g, ATEN.mul.Tensor, _call(g, ATEN.relu.default, up), scale)
    rows = _call(g, ATEN.reshape.default, act, [batch * seq * w, out])
    y = _call(g, ATEN.reshape.default, _call(g, ATEN.mm.default, rows, _call(g, ATEN.permute.default, w2, [1, 0])),
              _layout(dim, batch, seq * w, hidden))
    if dim:
        split = _call(g, ATEN.split.Tensor, y, seq, 1)
        y = _call(g, ATEN.cat.default, [_call(g, operator.getitem, split, i) for i in range(w)])
    g.output((_call(g, WAIT, _call(g, RS, y, "sum", w, "0")), act))
    inputs.update({"s": torch.randn(out), "w2": torch.randn(hidden, out)})
    return g, inputs


@given(**SHAPES)
def test_pointwise_between_split_matmuls_runs_per_chunk_where_the_batch_is_cut(
        batch: int, seq: int, hidden: int, out: int, dim: int, w: int, chunks: int) -> None:
    g, inputs = _mlp_graph(batch, seq, hidden, out, dim, w)
    run(g, inputs, w, meta=True)
    split_only = copy.deepcopy(g)
    decompose_collective_matmuls(split_only, chunks)
    before = run(split_only, inputs, w)  # the reference (see the module docstring)
    overlap_graph(g, collective_matmul_chunks=chunks)
    g.lint()
    c = _count(g, AG)
    batch_cut = c > 1 and dim > 0 and batch % c == 0
    assert _count(g, ATEN.relu.default) == (c if batch_cut else 1)
    assert scatter_before_last_gather_wait(collective_order(g)) == batch_cut
    for a, b in zip(run(g, inputs, w), before):
        assert torch.equal(a, b)
