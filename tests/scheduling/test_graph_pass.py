"""scheduler.overlap_pass: collectives raised, waits sunk, per-group order and values kept.

Three levels: hand-written FX graphs (structure only; they are never run), graphs traced with
``make_fx`` from torch's functional collectives on 2 gloo ranks (run before and after the pass,
compared bit for bit), and ~30 seeded random graphs (structure checked here, values on a 1-rank
gloo group).
"""
from __future__ import annotations

import logging
import operator
import random
from typing import Any, Optional

import pytest
import torch
import torch.fx as fx

from scheduler import overlap_graph, overlap_pass
from scheduler.torch_versions import funcol_all_gather, funcol_reduce_scatter

from fx_graphs import ATEN, C10D, SHAPE, WAIT  # shared with test_properties_graph_pass
from fx_graphs import acceptance_graph as _acceptance_graph
from fx_graphs import barrier_prefixes as _barrier_prefixes
from fx_graphs import call as _call
from fx_graphs import check_topological as _check_topological
from fx_graphs import compute_before as _compute_before
from fx_graphs import group_sequences as _group_sequences
from fx_graphs import inflight_profile as _inflight_profile
from fx_graphs import meta as _meta
from fx_graphs import module as _module
from fx_graphs import names as _names
from fx_graphs import random_graph


def _before(order: list[str], a: str, b: str) -> bool:
    return order.index(a) < order.index(b)


# -- hand-written graphs ----------------------------------------------------------------------

def test_wait_sinks_below_independent_compute() -> None:
    gm = _acceptance_graph()
    assert overlap_pass(gm) is gm
    assert _names(gm) == ["x", "w", "ag", "mm", "s2", "wait", "s1", "add", "output"]
    _check_topological(gm)


def test_collective_rises_to_just_after_its_inputs() -> None:
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    a = _call(g, ATEN.mm.default, w, w, name="a")
    b = _call(g, ATEN.sin.default, w, name="b")
    c = _call(g, ATEN.cos.default, b, name="c")
    ar_a = _call(g, C10D.all_reduce.default, a, "sum", "g0", name="ar_a", val=_meta((4, 4)))
    wait_a = _call(g, WAIT, ar_a, name="wait_a")
    ar_x = _call(g, C10D.all_reduce.default, x, "sum", "g1", name="ar_x", val=_meta((4, 4)))
    wait_x = _call(g, WAIT, ar_x, name="wait_x")
    g.output((_call(g, ATEN.add.Tensor, wait_a, wait_x, name="out"), c))
    gm = _module(g)
    overlap_pass(gm)
    order = _names(gm)
    # ar_x needs only a placeholder: first; ar_a right after mm, above the independent sin/cos;
    # the older collective's wait first ([Note: wait priority]).
    assert order[:5] == ["x", "w", "ar_x", "a", "ar_a"]
    assert order[5:] == ["b", "c", "wait_x", "wait_a", "out", "output"]
    _check_topological(gm)


def test_same_group_order_is_kept_other_groups_may_pass() -> None:
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    late = _call(g, ATEN.tanh.default, _call(g, ATEN.mm.default, w, w, name="mm"), name="late")
    first = _call(g, C10D.all_reduce.default, late, "sum", "g0", name="first", val=_meta((4, 4)))
    w1 = _call(g, WAIT, first, name="w1")
    second = _call(g, C10D.broadcast.default, x, 0, "g0", name="second", val=_meta((4, 4)))
    w2 = _call(g, WAIT, second, name="w2")
    other = _call(g, C10D.broadcast.default, x, 0, "g1", name="other", val=_meta((4, 4)))
    w3 = _call(g, WAIT, other, name="w3")
    g.output((w1, w2, w3))
    gm = _module(g)
    before = _group_sequences(gm)
    overlap_pass(gm)
    order = _names(gm)
    assert _group_sequences(gm) == before
    # ``second`` is ready at the top but stays behind ``first`` (same group); ``other`` rises.
    assert _before(order, "first", "second")
    assert order.index("other") == 2
    _check_topological(gm)


def test_group_name_given_by_keyword_is_read_like_a_positional_one() -> None:
    """``group_name=`` as a keyword: the collectives are still moved (not refused for a missing group
    name), and two on one group keep their order."""
    def collective(g: fx.Graph, target: Any, args: tuple, group: str, name: str) -> fx.Node:
        n = g.call_function(target, args, {"group_name": group})
        n.name, n.meta["val"] = name, _meta((4, 4))
        return n

    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    late = _call(g, ATEN.tanh.default, _call(g, ATEN.mm.default, w, w, name="mm"), name="late")
    first = collective(g, C10D.all_reduce.default, (late, "sum"), "g0", "first")
    w1 = _call(g, WAIT, first, name="w1")
    second = collective(g, C10D.broadcast.default, (x, 0), "g0", "second")
    w2 = _call(g, WAIT, second, name="w2")
    other = collective(g, C10D.broadcast.default, (x, 0), "g1", "other")
    w3 = _call(g, WAIT, other, name="w3")
    g.output((w1, w2, w3))
    gm = _module(g)
    overlap_pass(gm)
    order = _names(gm)
    assert _before(order, "first", "second")
    assert order.index("other") == 2
    _check_topological(gm)


def test_unused_wait_goes_just_before_output() -> None:
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    ar = _call(g, C10D.all_reduce.default, x, "sum", "g0", name="ar", val=_meta((4, 4)))
    _call(g, WAIT, ar, name="unused_wait")
    a = _call(g, ATEN.mm.default, w, w, name="a")
    g.output(_call(g, ATEN.relu.default, a, name="b"))
    gm = _module(g)
    overlap_pass(gm)
    assert _names(gm) == ["x", "w", "ar", "a", "b", "unused_wait", "output"]


def test_direct_reader_of_a_collective_stays_after_its_wait() -> None:
    # Post-grad graphs may read the collective's own output once it has been waited on.
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    ar = _call(g, C10D.all_reduce.default, x, "sum", "g0", name="ar", val=_meta((4, 4)))
    _call(g, WAIT, ar, name="wait")
    direct = _call(g, ATEN.sin.default, ar, name="direct")
    mm = _call(g, ATEN.mm.default, w, w, name="mm")
    g.output((direct, mm))
    gm = _module(g)
    overlap_pass(gm)
    assert _names(gm) == ["x", "w", "ar", "mm", "wait", "direct", "output"]


@pytest.mark.parametrize("waits", [2, 3])
def test_waits_on_a_waited_result_are_ordinary_readers(waits: int) -> None:
    """funcol.wait_tensor on an already-waited traced result (user code waiting again), once or as a
    chain: only the first waits on the collective; the others are readers of a waited result (no
    "not a collective" refusal), and the first still sinks below mm."""
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    ar = _call(g, C10D.all_reduce.default, x, "sum", "g0", name="ar", val=_meta((4, 4)))
    names = ["first", "again", "third"][:waits]
    last = ar
    for name in names:
        last = _call(g, WAIT, last, name=name)
    s = _call(g, ATEN.sum.default, last, name="s")
    mm = _call(g, ATEN.mm.default, w, w, name="mm")
    g.output((s, mm))
    gm = _module(g)
    overlap_pass(gm)
    assert _names(gm) == ["x", "w", "ar", "mm", *names, "s", "output"]


def test_coalesced_items_follow_the_collective_and_waits_sink() -> None:
    g = fx.Graph()
    x, y, w = g.placeholder("x"), g.placeholder("y"), g.placeholder("w")
    mm = _call(g, ATEN.mm.default, w, w, name="mm")
    co = _call(g, C10D.all_gather_into_tensor_coalesced.default, [x, y], 2, "g0", name="co",
               val=[_meta((8, 4)), _meta((8, 4))])
    i0 = _call(g, operator.getitem, co, 0, name="i0")
    i1 = _call(g, operator.getitem, co, 1, name="i1")
    w0 = _call(g, WAIT, i0, name="w0")
    w1 = _call(g, WAIT, i1, name="w1")
    s = _call(g, ATEN.sum.default, mm, name="s")
    g.output((_call(g, ATEN.add.Tensor, w0, w1, name="add"), s))
    gm = _module(g)
    overlap_pass(gm)
    assert _names(gm) == ["x", "y", "w", "co", "i0", "i1", "mm", "s", "w0", "w1", "add", "output"]


BARRIER_OPS = {
    "in-place": (ATEN.add_.Scalar, lambda a: (a, 1.0)),
    "mutates-returns-nothing": (ATEN._foreach_add_.Scalar, lambda a: ([a], 1.0)),
    "side-effectful": (ATEN._assert_async.msg, lambda a: (a, "checked")),
    "side-effectful-op-packet": (ATEN._assert_async, lambda a: (a, "checked")),  # as symbolic_trace names it
}


@pytest.mark.parametrize("barrier", sorted(BARRIER_OPS))
def test_nothing_crosses_a_mutating_or_side_effectful_op(barrier: str) -> None:
    """In-place ops, mutating ops whose schema returns nothing (``_foreach_add_``) and ops that are
    side-effectful without mutating (``_assert_async``, named by overload or by packet) are all
    barriers."""
    op, args = BARRIER_OPS[barrier]
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    ar = _call(g, C10D.all_reduce.default, x, "sum", "g0", name="ar", val=_meta((4, 4)))
    wait = _call(g, WAIT, ar, name="wait")
    a = _call(g, ATEN.mm.default, w, w, name="a")
    _call(g, op, *args(a), name="mutate")
    b = _call(g, ATEN.sin.default, a, name="b")
    late = _call(g, C10D.all_reduce.default, x, "sum", "g1", name="late", val=_meta((4, 4)))
    late_wait = _call(g, WAIT, late, name="late_wait")
    g.output((_call(g, ATEN.add.Tensor, wait, b, name="out"), late_wait))
    gm = _module(g)
    overlap_pass(gm)
    order = _names(gm)
    # ``wait`` would sink to ``out`` and ``late`` would rise to the top; the barrier stops both.
    assert order == ["x", "w", "ar", "a", "wait", "mutate", "late", "b", "out", "late_wait", "output"]


def test_a_constant_read_by_get_attr_is_not_a_barrier() -> None:
    """A ``get_attr`` (a constant of the module, as make_fx and AOT emit them) is compute: the wait
    still sinks below the mm and the constant's read."""
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    ar = _call(g, C10D.all_reduce.default, x, "sum", "g0", name="ar", val=_meta((4, 4)))
    wait = _call(g, WAIT, ar, name="wait")
    mm = _call(g, ATEN.mm.default, w, w, name="mm")
    const = g.get_attr("const")
    add = _call(g, ATEN.add.Tensor, mm, const, name="add")
    g.output(_call(g, ATEN.add.Tensor, wait, add, name="out"))
    root = torch.nn.Module()
    root.register_buffer("const", torch.ones(4, 4))
    gm = fx.GraphModule(root, g)
    overlap_pass(gm)
    assert _names(gm) == ["x", "w", "ar", "mm", "const", "add", "wait", "out", "output"]


def test_random_op_is_a_barrier() -> None:
    g = fx.Graph()
    x = g.placeholder("x")
    r = _call(g, ATEN.rand.default, [4, 4], name="rand")
    ar = _call(g, C10D.all_reduce.default, x, "sum", "g0", name="ar", val=_meta((4, 4)))
    g.output((_call(g, WAIT, ar, name="wait"), r))
    gm = _module(g)
    overlap_pass(gm)
    assert _names(gm) == ["x", "rand", "ar", "wait", "output"]


def _three_gathers(dtype: torch.dtype = torch.float32) -> fx.GraphModule:
    g = fx.Graph()
    xs = [g.placeholder(f"x{i}") for i in range(3)]
    w = g.placeholder("w")
    h = w
    outs = []
    for i, x in enumerate(xs):  # 3 all-gathers of 64 bytes each, each used after one mm
        ag = _call(g, C10D.all_gather_into_tensor.default, x, 2, "g0", name=f"ag{i}",
                   val=_meta((4, 4), dtype))
        wt = _call(g, WAIT, ag, name=f"wait{i}")
        h = _call(g, ATEN.mm.default, h, wt, name=f"mm{i}")
        outs.append(h)
    g.output(tuple(outs))
    return _module(g)


def test_budget_limits_collectives_in_flight() -> None:
    unlimited, limited = _three_gathers(), _three_gathers()
    overlap_pass(unlimited)
    assert [p[2] for p in _inflight_profile(unlimited)] == [64, 128, 192]
    overlap_pass(limited, max_inflight_bytes=128)
    assert [p[2] for p in _inflight_profile(limited)] == [64, 128, 128]
    order = _names(limited)
    assert order.index("ag2") > order.index("wait0")  # ag2 issued only once ag0 was waited
    _check_topological(limited)


def test_budget_counts_each_dtypes_element_size() -> None:
    """bf16 results are 2 bytes an element: two of the 32-byte gathers fit a 64-byte budget."""
    gm = _three_gathers(torch.bfloat16)
    overlap_pass(gm, max_inflight_bytes=64)
    assert [p[2] for p in _inflight_profile(gm)] == [32, 64, 64]


def test_budget_reads_sizes_from_tensor_meta_without_val() -> None:
    """A graph whose nodes carry ``meta["tensor_meta"]`` only (``ShapeProp``) is ordered under a
    budget as if they carried ``meta["val"]``."""
    from torch.fx.passes.shape_prop import _extract_tensor_metadata

    with_val, with_tensor_meta = _three_gathers(), _three_gathers()
    for n in with_tensor_meta.graph.nodes:
        if "val" in n.meta:
            n.meta["tensor_meta"] = _extract_tensor_metadata(n.meta.pop("val"))
    overlap_pass(with_val, max_inflight_bytes=128)
    overlap_pass(with_tensor_meta, max_inflight_bytes=128)
    assert _names(with_tensor_meta) == _names(with_val)
    assert _names(with_val) != _names(_three_gathers())


def _waited_after_a_barrier(known_size: bool) -> fx.GraphModule:
    """``a`` issued before an in-place op and waited after it, ``b`` (64 bytes) too; ``tail`` after the
    waits is independent of them."""
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    a = _call(g, C10D.all_reduce.default, x, "sum", "g0", name="a", val=_meta((4, 4)) if known_size else None)
    h = _call(g, ATEN.mm.default, w, w, name="h")
    b = _call(g, C10D.all_reduce.default, h, "sum", "g1", name="b", val=_meta((4, 4)))
    scratch = _call(g, ATEN.cos.default, w, name="scratch")
    _call(g, ATEN.add_.Scalar, scratch, 1.0, name="mutate")
    wait_a = _call(g, WAIT, a, name="wait_a")
    wait_b = _call(g, WAIT, b, name="wait_b")
    tail = _call(g, ATEN.mm.default, w, w, name="tail")
    g.output((_call(g, ATEN.add.Tensor, wait_a, wait_b, name="out"), scratch, tail))
    return _module(g)


@pytest.mark.parametrize("known_size", [True, False], ids=["over-budget", "unknown-size"])
def test_a_budget_never_pulls_a_wait_above_a_barrier(known_size: bool) -> None:
    """The budget waits early for a result that does not fit, or at once for one of unknown size; a
    wait beyond a barrier stays there all the same (the budget is exceeded, not the barrier), and
    the stretch after the barrier is still reordered (the waits sink below ``tail``)."""
    gm = _waited_after_a_barrier(known_size)
    before = _barrier_prefixes(gm)
    overlap_pass(gm, max_inflight_bytes=64)
    assert _barrier_prefixes(gm) == before
    assert _names(gm) == ["x", "w", "a", "h", "b", "scratch", "mutate", "tail", "wait_a", "wait_b", "out", "output"]
    _check_topological(gm)


def _collective_of_unknown_size(val: Any = None) -> fx.GraphModule:
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    a = _call(g, ATEN.mm.default, w, w, name="a")
    ar = _call(g, C10D.all_reduce.default, x, "sum", "g0", name="ar", val=val)  # no meta: size unknown
    wait = _call(g, WAIT, ar, name="wait")
    b = _call(g, ATEN.mm.default, a, a, name="b")
    g.output((_call(g, ATEN.add.Tensor, wait, a, name="c"), b))
    return _module(g)


def test_unknown_size_is_not_moved_under_a_budget() -> None:
    gm = _collective_of_unknown_size()
    overlap_pass(gm, max_inflight_bytes=1 << 20)
    assert _names(gm) == ["x", "w", "a", "ar", "wait", "b", "c", "output"]
    gm = _collective_of_unknown_size()
    overlap_pass(gm)  # without a budget the size does not matter
    assert _names(gm) == ["x", "w", "ar", "a", "b", "wait", "c", "output"]


def test_a_symbolic_size_is_an_unknown_size_under_a_budget() -> None:
    """A result with a dynamic dim (a ``SymInt`` in its fake value) has no static size: under a budget
    it is neither moved nor sized by its hint, like a result without meta."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())
    dynamic_rows = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    val = mode.from_tensor(torch.empty(4, 4), symbolic_context=dynamic_rows)
    gm = _collective_of_unknown_size(val)
    overlap_pass(gm, max_inflight_bytes=1 << 20)
    assert _names(gm) == ["x", "w", "a", "ar", "wait", "b", "c", "output"]


def test_graph_without_collectives_is_untouched() -> None:
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(_call(g, ATEN.cos.default, _call(g, ATEN.sin.default, x)))
    gm = _module(g)
    code = gm.code
    overlap_pass(gm)
    assert gm.code == code


def test_overlap_graph_works_on_a_bare_graph() -> None:
    gm = _acceptance_graph()
    assert overlap_graph(gm.graph) is True
    assert overlap_graph(gm.graph) is False  # already in overlap order
    assert [n.name for n in gm.graph.nodes].index("mm") < [n.name for n in gm.graph.nodes].index("wait")


def test_a_change_made_only_by_merging_repeated_waits_is_reported_and_recompiled() -> None:
    """Two waits of one result become one (``scheduler.canonical_waits``) while the order is already
    the overlap order: ``overlap_graph`` still reports a change, so ``overlap_pass`` recompiles."""
    def build() -> fx.GraphModule:
        g = fx.Graph()
        x = g.placeholder("x")
        ag = _call(g, C10D.all_gather_into_tensor.default, x, 2, "g0", name="ag", val=_meta((8, 4)))
        g.output((_call(g, WAIT, ag, name="first"), _call(g, WAIT, ag, name="again")))
        return _module(g)

    assert overlap_graph(build().graph) is True
    gm = build()
    overlap_pass(gm)
    assert _names(gm) == ["x", "ag", "first", "output"]
    assert "again" not in gm.code


def _wait_that_feeds_a_collective() -> fx.GraphModule:
    """Hypothesis' shrunk counterexample (torch 2.11 CI): two waits forced together, the later one
    read by compute *and* by a collective that the trace put after that compute."""
    g = fx.Graph()
    x = g.placeholder("x")
    ar0 = _call(g, C10D.all_reduce.default, x, "sum", "g0", name="ar0", val=_meta((4, 4)))
    wait0 = _call(g, WAIT, ar0, name="wait0")
    ar1 = _call(g, C10D.all_reduce.default, x, "sum", "g0", name="ar1", val=_meta((4, 4)))
    wait1 = _call(g, WAIT, ar1, name="wait1")
    add = _call(g, ATEN.add.Tensor, wait0, wait1, name="add")
    ar2 = _call(g, C10D.all_reduce.default, wait1, "sum", "g1", name="ar2", val=_meta((4, 4)))
    g.output((add, _call(g, ATEN.neg.default, _call(g, WAIT, ar2, name="wait2"), name="neg")))
    return _module(g)


def test_wait_that_feeds_a_collective_goes_first_and_the_order_is_a_fixed_point() -> None:
    """The pass used to rank a wait by the original place of its first user; a collective user
    is raised by the pass, so a second run ranked the waits differently (not a fixed point), and
    the first run issued ``ar2`` only after waiting for ``ar0`` too, which ``ar2`` does not need."""
    gm = _wait_that_feeds_a_collective()
    overlap_pass(gm)
    order = _names(gm)
    assert order == ["x", "ar0", "ar1", "wait1", "ar2", "wait0", "add", "wait2", "neg", "output"]
    overlap_pass(gm)
    assert _names(gm) == order


def test_waits_of_a_deferred_reader_keep_their_order_on_a_second_run() -> None:
    """Hypothesis' second counterexample (budget 0): ``add5`` reads ``w0`` and a later collective's
    ``w2``, ``add6`` only ``w1``. The pass defers ``add5`` behind ``add6``, so ranking the waits by
    their first user's place swapped ``w0`` and ``w1`` on a second run; the oldest result first
    ([Note: wait priority]) keeps member order, a fixed point."""
    g = fx.Graph()
    x = g.placeholder("x")
    pair = [_meta((4, 4)), _meta((4, 4))]
    results = []
    for k in range(3):
        co = _call(g, C10D.all_reduce_coalesced.default, [x, x], "sum", "g0", name=f"co{k}", val=pair)
        results.append([_call(g, WAIT, _call(g, operator.getitem, co, i, name=f"i{k}{i}"), name=f"w{2 * k + i}")
                        for i in range(2)])
    _call(g, ATEN.add.Tensor, results[0][0], results[1][0], name="add5")
    add6 = _call(g, ATEN.add.Tensor, results[0][1], x, name="add6")
    g.output((x, add6))
    gm = _module(g)
    overlap_pass(gm, max_inflight_bytes=0)
    order = _names(gm)
    assert order.index("w0") < order.index("w1")
    overlap_pass(gm, max_inflight_bytes=0)
    assert _names(gm) == order
    _check_topological(gm)


# -- bad input: unchanged, with the reason logged ---------------------------------------------

def _bad_wait_on_compute(g: fx.Graph, x: fx.Node) -> Any:
    return _call(g, WAIT, _call(g, ATEN.sin.default, x))


def _bad_never_waited(g: fx.Graph, x: fx.Node) -> Any:
    ar = _call(g, C10D.all_reduce.default, x, "sum", "g0")
    return _call(g, ATEN.add.Tensor, _call(g, WAIT, _call(g, C10D.all_reduce.default, x, "sum", "g0")), ar)


def _bad_unknown_op(g: fx.Graph, x: fx.Node) -> Any:
    return _call(g, WAIT, _call(g, C10D.all_reduce_.default, x, "sum", "g0"))


def _bad_read_before_wait(g: fx.Graph, x: fx.Node) -> Any:
    ar = _call(g, C10D.all_reduce.default, x, "sum", "g0")
    early = _call(g, ATEN.sin.default, ar)
    return _call(g, ATEN.add.Tensor, _call(g, WAIT, ar), early)


def _bad_coalesced_never_read(g: fx.Graph, x: fx.Node) -> Any:
    s = _call(g, ATEN.sin.default, x)
    _call(g, C10D.all_reduce_coalesced.default, [x, x], "sum", "g0")  # no reader, no meta
    return s


def _bad_coalesced_result_never_waited(g: fx.Graph, x: fx.Node) -> Any:
    s = _call(g, ATEN.sin.default, x)
    co = _call(g, C10D.all_reduce_coalesced.default, [x, x], "sum", "g0", val=[_meta((4, 4)), _meta((4, 4))])
    return _call(g, ATEN.add.Tensor, _call(g, WAIT, _call(g, operator.getitem, co, 0)), s)  # item 1: unread


def _bad_not_topologically_sorted(g: fx.Graph, x: fx.Node) -> Any:
    early = _call(g, ATEN.sin.default, x)
    late = _call(g, ATEN.cos.default, early)
    early.prepend(late)  # ``late`` now comes before its input
    return _call(g, WAIT, _call(g, C10D.all_reduce.default, late, "sum", "g0"))


BAD_GRAPHS = {
    "wait_on_non_collective": (_bad_wait_on_compute, "not a collective"),
    "collective_never_waited": (_bad_never_waited, "never waited"),
    "coalesced_collective_never_read": (_bad_coalesced_never_read, "never waited"),
    "coalesced_result_never_waited": (_bad_coalesced_result_never_waited, "never waited"),
    "unknown_c10d_functional_op": (_bad_unknown_op, "does not know"),
    "read_before_wait": (_bad_read_before_wait, "before its wait"),
    "not_topologically_sorted": (_bad_not_topologically_sorted, "not topologically sorted"),
}


@pytest.mark.parametrize("case", sorted(BAD_GRAPHS))
def test_bad_input_leaves_graph_unchanged_and_logs(case: str, caplog: pytest.LogCaptureFixture) -> None:
    build, reason = BAD_GRAPHS[case]
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    out = build(g, x)
    mm = _call(g, ATEN.mm.default, w, w)  # independent compute the pass would otherwise move
    g.output((out, mm))
    gm = _module(g)
    code, nodes = gm.code, _names(gm)
    with caplog.at_level(logging.WARNING, logger="scheduler"):
        overlap_pass(gm)
    assert gm.code == code and _names(gm) == nodes
    assert any(r.name == "scheduler" and reason in r.getMessage() for r in caplog.records), caplog.text


def test_wrong_argument_types_raise() -> None:
    gm = _acceptance_graph()
    with pytest.raises(TypeError, match="gm"):
        overlap_pass(gm.graph)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="max_inflight_bytes"):
        overlap_pass(gm, max_inflight_bytes="1 MiB")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="max_inflight_bytes"):
        overlap_pass(gm, max_inflight_bytes=True)
    with pytest.raises(ValueError, match="max_inflight_bytes"):
        overlap_pass(gm, max_inflight_bytes=-1)
    with pytest.raises(TypeError, match="graph"):
        overlap_graph(gm)  # type: ignore[arg-type]


# -- traced from torch's functional collectives, run on 2 gloo ranks --------------------------

def _traced_program(x: torch.Tensor, w: torch.Tensor, group: Any) -> tuple[torch.Tensor, ...]:
    import torch.distributed._functional_collectives as funcol

    gathered = funcol.wait_tensor(funcol_all_gather(x, 0, group))  # (4, 4); waited twice when traced
    h = torch.tanh(w @ w)
    reduced = funcol.all_reduce(h, "sum", group)
    h2 = torch.sin(h) @ w
    scattered = funcol_reduce_scatter(h2, "sum", 0, group)   # (2, 4)
    sent = funcol.broadcast(x * 2, 0, group)
    swapped = funcol.all_to_all_single(h2, [2, 2], [2, 2], group)
    pair = funcol.all_reduce_coalesced([x + 1, h[:2]], "sum", group)
    h3 = torch.cos(h2) * 3
    return (gathered.sum(0) + h3[0], reduced - h3, scattered, sent, swapped, pair[0] + pair[1], h3)


def _traced_run(rank: int, world_size: int) -> None:
    import torch.distributed as dist
    from torch.fx.experimental.proxy_tensor import make_fx

    group = dist.group.WORLD
    torch.manual_seed(0)
    x = torch.randn(2, 4) + rank
    w = torch.randn(4, 4) / 2

    def program(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _traced_program(x, w, group)

    reference = make_fx(program)(x, w)
    moved = make_fx(program)(x, w)
    overlap_pass(moved)
    assert moved.code != reference.code, "the pass did not move anything"
    _check_topological(moved)
    assert _group_sequences(moved) == _group_sequences(reference)
    expected = reference(x, w)
    got = moved(x, w)
    eager = program(x, w)
    assert len(got) == len(expected) == len(eager)
    for e, r, m in zip(eager, expected, got):
        assert torch.equal(r, m)
        assert torch.equal(e, m)


def test_traced_graphs_compute_the_same_values(distributed) -> None:
    distributed(_traced_run, 2, timeout=120)


# -- property: random graphs ------------------------------------------------------------------

N_GRAPHS = 30


def _random_graph(seed: int, groups: tuple[str, str], barriers: bool) -> fx.GraphModule:
    """``fx_graphs.random_graph`` from a seed."""
    return random_graph(random.Random(seed), groups, barriers)


@pytest.mark.parametrize("budget", [None, 128, 0])
def test_random_graphs_keep_the_contract(budget: Optional[int]) -> None:
    moved_any = 0
    for seed in range(N_GRAPHS):
        original = _random_graph(seed, ("ga", "gb"), barriers=seed % 2 == 1)
        gm = _random_graph(seed, ("ga", "gb"), barriers=seed % 2 == 1)
        overlap_pass(gm, max_inflight_bytes=budget)
        moved_any += _names(gm) != _names(original)
        assert sorted(_names(gm)) == sorted(_names(original))
        _check_topological(gm)  # includes: every wait before every user of its result
        assert _group_sequences(gm) == _group_sequences(original), seed
        assert _barrier_prefixes(gm) == _barrier_prefixes(original), seed
        # A collective only ever moves up: no compute that followed it moves above it.
        after, before = _compute_before(gm), _compute_before(original)
        assert all(after[c] <= before[c] for c in before), seed
        if budget is not None:
            for name, size, inflight in _inflight_profile(gm):
                assert inflight <= max(budget, size), (seed, name, inflight)
        # Running the pass again finds nothing more to move.
        again = _names(gm)
        overlap_pass(gm, max_inflight_bytes=budget)
        assert _names(gm) == again, seed
    assert moved_any >= N_GRAPHS // 2


def _random_graphs_run(rank: int, world_size: int, seeds: list[int]) -> int:
    import torch.distributed as dist

    groups = (dist.group.WORLD.group_name, dist.new_group([0]).group_name)
    checked = 0
    for seed in seeds:
        reference = _random_graph(seed, groups, barriers=seed % 2 == 1)
        for budget in (None, 128):
            moved = _random_graph(seed, groups, barriers=seed % 2 == 1)
            overlap_pass(moved, max_inflight_bytes=budget)
            gen = torch.Generator().manual_seed(seed)
            inputs = [torch.randn(SHAPE, generator=gen) for _ in range(3)]
            expected = reference(*[t.clone() for t in inputs])
            got = moved(*[t.clone() for t in inputs])
            for e, m in zip(expected, got):
                torch.testing.assert_close(m, e, rtol=0, atol=0, equal_nan=True)
            checked += 1
    return checked


def test_random_graphs_compute_the_same_values(distributed) -> None:
    assert distributed(_random_graphs_run, 1, list(range(N_GRAPHS)), timeout=120) == [2 * N_GRAPHS]


# -- captured from the runtime's own collectives and a sharded training step (make_fx) --------

def _runtime_captured_run(rank: int, world_size: int) -> None:
    """``overlap.*`` collectives and a sharded forward + backward (``ShardedMLP``: an all-gather per
    block in forward, a reduce-scatter of its gradient in backward), traced with ``make_fx``."""
    from torch.fx.experimental.proxy_tensor import make_fx

    import overlap
    from compiled_step import ShardedMLP

    model = ShardedMLP(2, 8, 16, rank, world_size)
    names = [name for name, _ in model.named_parameters()]

    def program(x: torch.Tensor, w: torch.Tensor, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        leaves = [s.detach().requires_grad_() for s in shards]
        loss = torch.func.functional_call(model, dict(zip(names, leaves)), (x,)).square().mean()
        grads = torch.autograd.grad(loss, leaves)
        gathered = overlap.all_gather(x, dim=1)
        reduced = overlap.reduce_scatter(torch.tanh(w @ w), op="avg")
        top = overlap.all_reduce(x, op="max")
        sent = overlap.broadcast(x * 2, src=1)
        return (loss, *grads, gathered.sum(0) + reduced.sum(), top - sent)

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    w = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    shards = [p.detach() for p in model.parameters()]
    reference = make_fx(program)(x, w, *shards)
    moved = make_fx(program)(x, w, *shards)
    overlap_pass(moved)
    assert moved.code != reference.code, "the pass did not move anything"
    _check_topological(moved)
    assert _group_sequences(moved) == _group_sequences(reference)
    names_in_order = _names(moved)
    for scatter in [n.name for n in moved.graph.nodes if n.target is C10D.reduce_scatter_tensor.default][:2]:
        # The gradient reduce-scatters of the blocks: their waits now come after the rest of backward.
        wait = next(u.name for u in moved.graph.nodes if u.target is WAIT and u.args[0].name == scatter)
        between = names_in_order[names_in_order.index(scatter) : names_in_order.index(wait)]
        assert any(name.startswith("mm") for name in between), (scatter, between)
    expected = reference(x, w, *shards)
    got = moved(x, w, *shards)
    eager = [overlap.wait(t) for t in program(x, w, *shards)]
    assert len(got) == len(expected) == len(eager)
    for e, r, m in zip(eager, expected, got):
        assert torch.equal(r, m)
        assert torch.equal(e, m)


def test_graphs_captured_from_the_runtime_keep_the_contract(distributed) -> None:
    distributed(_runtime_captured_run, 2, timeout=120)
