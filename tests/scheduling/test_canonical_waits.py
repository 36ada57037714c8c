"""``scheduler.canonical_waits``: torch 2.15's wait forms rewritten into one ``wait_tensor`` per
collective result before the passes run, values unchanged.

Hand-written graphs in the shapes torch 2.15 traces (a shared all-gather waited once per reader, each
with its own split / cat / view copy; ``wait_tensors`` over a coalesced collective's results), run
before and after on a 1-rank gloo group (the collectives return their input), and the cases left
alone. Compiled torch-TP graphs on 2 ranks, where 2.15 produces these forms, are in
``test_inductor_tp.py``.
"""
from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

from fx_graphs import ATEN, C10D, WAIT, call, meta, module
from scheduler.canonical_waits import WAIT_TENSORS, canonicalize_waits

ROWS, COLS = 4, 6


def _targets(g: fx.Graph) -> list[object]:
    return [n.target for n in g.nodes if n.op == "call_function"]


def _shared_gather(group: str, write_after: bool = False) -> fx.Graph:
    """An all-gather read by two matmuls, waited once per reader, each wait followed by its own
    split -> getitems -> cat -> view copy (torch 2.15's sequence-parallel q / k projections);
    ``write_after``: the second copy's cat is written in place before its matmul."""
    g = fx.Graph()
    x, wq, wk = g.placeholder("x"), g.placeholder("wq"), g.placeholder("wk")
    ag = call(g, C10D.all_gather_into_tensor.default, x, 1, group, val=meta((ROWS, COLS)))
    outs = []
    for i, w in enumerate((wq, wk)):
        wait = call(g, WAIT, ag, name=f"wait{i}")
        split = call(g, ATEN.split.Tensor, wait, 2)
        parts = [call(g, operator.getitem, split, j) for j in range(2)]
        cat = call(g, ATEN.cat.default, parts, 1, name=f"cat{i}")
        if write_after and i == 1:
            cat = call(g, ATEN.add_.Scalar, cat, 1.0)
        view = call(g, ATEN.reshape.default, cat, [ROWS // 2, 2 * COLS])
        outs.append(call(g, ATEN.mm.default, view, w, name=f"mm{i}"))
    g.output(tuple(outs))
    return g


def _inputs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(ROWS, COLS, generator=gen), torch.randn(2 * COLS, 3, generator=gen),
            torch.randn(2 * COLS, 3, generator=gen)]


def _same_values(before: fx.Graph, after: fx.Graph) -> None:
    args = _inputs()
    for want, got in zip(module(before)(*args), module(after)(*args)):
        assert torch.equal(want, got)


def test_repeated_waits_become_one_wait_and_one_copy(single_rank_group) -> None:
    group = single_rank_group.group_name
    g, reference = _shared_gather(group), _shared_gather(group)
    assert canonicalize_waits(g) == 1 + 5  # a wait, then a split, two getitems, a cat and a view
    g.lint()
    targets = _targets(g)
    assert targets.count(WAIT) == 1 and targets.count(ATEN.cat.default) == 1
    (view,) = g.find_nodes(op="call_function", target=ATEN.reshape.default)
    assert [u.name for u in view.users] == ["mm0", "mm1"], "both matmuls read the one gathered input"
    _same_values(reference, g)
    assert canonicalize_waits(g) == 0, "the canonical form is left as it is"


def test_a_copy_written_in_place_is_not_merged(single_rank_group) -> None:
    group = single_rank_group.group_name
    g, reference = _shared_gather(group, write_after=True), _shared_gather(group, write_after=True)
    canonicalize_waits(g)
    targets = _targets(g)
    assert targets.count(WAIT) == 1, "the second wait of one result still goes"
    assert targets.count(ATEN.cat.default) == 2, "a cat that is written in place keeps its own copy"
    _same_values(reference, g)


def test_two_collectives_of_one_input_stay_two(single_rank_group) -> None:
    """Only waits and pure ops merge: two identical collectives reading the merged wait stay two
    collectives (every rank issues both)."""
    group = single_rank_group.group_name
    g = fx.Graph()
    x = g.placeholder("x")
    ag = call(g, C10D.all_gather_into_tensor.default, x, 1, group, val=meta((ROWS, COLS)))
    reduced = [call(g, C10D.all_reduce.default, call(g, WAIT, ag), "sum", group) for _ in range(2)]
    g.output(tuple(call(g, WAIT, r) for r in reduced))
    assert canonicalize_waits(g) == 1  # the second wait of the gather
    assert _targets(g).count(C10D.all_reduce.default) == 2 and _targets(g).count(WAIT) == 3


def test_copies_merge_into_the_first_in_graph_order_not_the_first_made(single_rank_group) -> None:
    """After two waits become one, the wait's readers are listed in the order their uses were made,
    not graph order (a node inserted later, or a reader taken over from the second wait): the copy
    kept is the one earliest in the graph, so every reader of the other still comes after it."""
    group = single_rank_group.group_name
    g = fx.Graph()
    x = g.placeholder("x")
    ag = call(g, C10D.all_gather_into_tensor.default, x, 1, group, val=meta((ROWS, COLS)))
    first = call(g, WAIT, ag, name="first")
    again = call(g, WAIT, ag, name="again")
    late = call(g, ATEN.neg.default, first, name="late")  # made first, placed last
    late_user = call(g, ATEN.sin.default, late, name="late_user")
    with g.inserting_after(again):
        early = g.call_function(ATEN.neg.default, (again,))
    with g.inserting_after(early):
        early_user = g.call_function(ATEN.cos.default, (early,))
    g.output((early_user, late_user))
    inputs = [torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(0))]
    want = module(g)(*inputs)
    assert canonicalize_waits(g) == 2  # a wait and a neg
    g.lint()
    assert len(g.find_nodes(op="call_function", target=ATEN.neg.default)) == 1
    for w, h in zip(want, module(g)(*inputs)):
        assert torch.equal(w, h)


@pytest.mark.parametrize("dtype, scalars", [(torch.int64, (1, 1.0, True)), (torch.float32, (0.0, -0.0))],
                         ids=["int-float-bool", "signed-zero"])
def test_copies_whose_scalars_differ_only_in_type_or_sign_stay_apart(single_rank_group, dtype, scalars) -> None:
    """``x * 1``, ``x * 1.0`` and ``x * True`` (equal as Python keys) differ in result dtype, and
    ``x + 0.0`` and ``x + -0.0`` in the sign of a zero: readers of one merged wait that differ only
    there are not made one copy."""
    g = fx.Graph()
    x = g.placeholder("x")
    ag = call(g, C10D.all_gather_into_tensor.default, x, 1, single_rank_group.group_name, val=meta((4,), dtype))
    op = ATEN.mul.Tensor if dtype is torch.int64 else ATEN.add.Tensor
    g.output(tuple(call(g, op, call(g, WAIT, ag), s) for s in scalars))
    inputs = [torch.arange(4) if dtype is torch.int64 else torch.tensor([-0.0, 1.0, -0.0, 2.0])]
    want = module(g)(*inputs)
    assert canonicalize_waits(g) == len(scalars) - 1  # the waits only
    for w, h in zip(want, module(g)(*inputs)):
        assert w.dtype == h.dtype and torch.equal(w, h) and torch.equal(w.signbit(), h.signbit())


@pytest.mark.skipif(WAIT_TENSORS is None, reason=f"torch {torch.__version__} has no _c10d_functional.wait_tensors "
                                                 "(new in 2.15: earlier releases wait each result on its own)")
def test_wait_tensors_becomes_a_wait_per_result(single_rank_group) -> None:
    group = single_rank_group.group_name
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    coalesced = call(g, C10D.all_reduce_coalesced.default, [a, b], "sum", group)
    members = [call(g, operator.getitem, coalesced, i) for i in range(2)]
    waited = call(g, WAIT_TENSORS, members)
    got = [call(g, operator.getitem, waited, i) for i in (1, 0)]
    g.output((call(g, ATEN.mul.Tensor, got[0], 2.0), call(g, ATEN.add.Tensor, got[1], 1.0)))
    inputs = [torch.randn(3), torch.randn(5)]
    want = module(g)(*inputs)
    assert canonicalize_waits(g) == 1
    g.lint()
    assert _targets(g).count(WAIT) == 2 and WAIT_TENSORS not in _targets(g)
    for w, h in zip(want, module(g)(*inputs)):
        assert torch.equal(w, h)


@pytest.mark.skipif(WAIT_TENSORS is None, reason=f"torch {torch.__version__} has no _c10d_functional.wait_tensors")
def test_wait_tensors_whose_list_is_read_whole_is_left_alone(single_rank_group) -> None:
    g = fx.Graph()
    a = g.placeholder("a")
    coalesced = call(g, C10D.all_reduce_coalesced.default, [a], "sum", single_rank_group.group_name)
    waited = call(g, WAIT_TENSORS, [call(g, operator.getitem, coalesced, 0)])
    g.output(waited)
    assert canonicalize_waits(g) == 0 and WAIT_TENSORS in _targets(g)

