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

C10D = torch.ops._c10d_functional
ATEN = torch.ops.aten
WAIT = C10D.wait_tensor.default
COLLECTIVE_TARGETS = {
    C10D.all_gather_into_tensor.default, C10D.reduce_scatter_tensor.default, C10D.all_reduce.default,
    C10D.all_to_all_single.default, C10D.broadcast.default,
    C10D.all_gather_into_tensor_coalesced.default, C10D.reduce_scatter_tensor_coalesced.default,
    C10D.all_reduce_coalesced.default,
}
GROUP_ARG = {  # position of group_name in each collective's schema
    C10D.all_gather_into_tensor.default: 2, C10D.reduce_scatter_tensor.default: 3,
    C10D.all_reduce.default: 2, C10D.all_to_all_single.default: 3, C10D.broadcast.default: 2,
    C10D.all_gather_into_tensor_coalesced.default: 2,
    C10D.reduce_scatter_tensor_coalesced.default: 3, C10D.all_reduce_coalesced.default: 2,
}
F32 = torch.float32


# -- helpers ----------------------------------------------------------------------------------

def _meta(shape: tuple[int, ...], dtype: torch.dtype = F32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _call(g: fx.Graph, target: Any, *args: Any, name: Optional[str] = None,
          val: Any = None) -> fx.Node:
    n = g.call_function(target, args)
    if name is not None:
        n.name = name
    if val is not None:
        n.meta["val"] = val
    return n


def _module(g: fx.Graph) -> fx.GraphModule:
    return fx.GraphModule(torch.nn.Module(), g)


def _names(gm: fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes]


def _before(order: list[str], a: str, b: str) -> bool:
    return order.index(a) < order.index(b)


def _is_collective(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target in COLLECTIVE_TARGETS


def _group_sequences(gm: fx.GraphModule) -> dict[Any, list[str]]:
    seqs: dict[Any, list[str]] = {}
    for n in gm.graph.nodes:
        if _is_collective(n):
            seqs.setdefault(n.args[GROUP_ARG[n.target]], []).append(n.name)
    return seqs


def _check_topological(gm: fx.GraphModule) -> None:
    seen: set[fx.Node] = set()
    for n in gm.graph.nodes:
        for d in n.all_input_nodes:
            assert d in seen, f"{n.name} placed before its input {d.name}"
        seen.add(n)
    gm.graph.lint()


def _inflight_profile(gm: fx.GraphModule) -> list[tuple[str, int, int]]:
    """(collective, its bytes, bytes issued-but-not-waited right after issuing it)."""
    outstanding: dict[Any, int] = {}
    profile = []
    for n in gm.graph.nodes:
        if _is_collective(n):
            val = n.meta["val"]
            vals = val if isinstance(val, (list, tuple)) else [val]
            for i, v in enumerate(vals):
                outstanding[(n, i if isinstance(val, (list, tuple)) else None)] = v.numel() * v.element_size()
            size = sum(v.numel() * v.element_size() for v in vals)
            profile.append((n.name, size, sum(outstanding.values())))
        elif n.target is WAIT:
            src = n.args[0]
            key = (src.args[0], src.args[1]) if src.target is operator.getitem else (src, None)
            outstanding.pop(key, None)
    return profile


# -- hand-written graphs ----------------------------------------------------------------------

def _acceptance_graph() -> fx.GraphModule:
    """Inductor's post-grad graph for ``all_gather(x).sum() + (w @ w).sum()`` (wait, then mm)."""
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    ag = _call(g, C10D.all_gather_into_tensor.default, x, 2, "g0", name="ag", val=_meta((8, 8)))
    wait = _call(g, WAIT, ag, name="wait")
    s1 = _call(g, ATEN.sum.default, wait, name="s1")
    mm = _call(g, ATEN.mm.default, w, w, name="mm")
    s2 = _call(g, ATEN.sum.default, mm, name="s2")
    g.output(_call(g, ATEN.add.Tensor, s1, s2, name="add"))
    return _module(g)


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
    # ar_x needs only a placeholder: first; ar_a right after mm, above the independent sin/cos.
    assert order[:5] == ["x", "w", "ar_x", "a", "ar_a"]
    assert order[5:] == ["b", "c", "wait_a", "wait_x", "out", "output"]
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


def test_wait_on_a_wait_is_an_ordinary_reader() -> None:
    # funcol.wait_tensor on an already-waited traced result: wait_tensor(wait_tensor(collective)).
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    ar = _call(g, C10D.all_reduce.default, x, "sum", "g0", name="ar", val=_meta((4, 4)))
    first = _call(g, WAIT, ar, name="first")
    again = _call(g, WAIT, first, name="again")
    s = _call(g, ATEN.sum.default, again, name="s")
    mm = _call(g, ATEN.mm.default, w, w, name="mm")
    g.output((s, mm))
    gm = _module(g)
    overlap_pass(gm)
    assert _names(gm) == ["x", "w", "ar", "mm", "first", "again", "s", "output"]


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


def test_nothing_crosses_a_mutating_op() -> None:
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    ar = _call(g, C10D.all_reduce.default, x, "sum", "g0", name="ar", val=_meta((4, 4)))
    wait = _call(g, WAIT, ar, name="wait")
    a = _call(g, ATEN.mm.default, w, w, name="a")
    _call(g, ATEN.add_.Scalar, a, 1.0, name="mutate")  # barrier: an in-place op
    b = _call(g, ATEN.sin.default, a, name="b")
    late = _call(g, C10D.all_reduce.default, x, "sum", "g1", name="late", val=_meta((4, 4)))
    late_wait = _call(g, WAIT, late, name="late_wait")
    g.output((_call(g, ATEN.add.Tensor, wait, b, name="out"), late_wait))
    gm = _module(g)
    overlap_pass(gm)
    order = _names(gm)
    # ``wait`` would sink to ``out`` and ``late`` would rise to the top; the barrier stops both.
    assert order == ["x", "w", "ar", "a", "wait", "mutate", "late", "b", "out", "late_wait", "output"]


def test_random_op_is_a_barrier() -> None:
    g = fx.Graph()
    x = g.placeholder("x")
    r = _call(g, ATEN.rand.default, [4, 4], name="rand")
    ar = _call(g, C10D.all_reduce.default, x, "sum", "g0", name="ar", val=_meta((4, 4)))
    g.output((_call(g, WAIT, ar, name="wait"), r))
    gm = _module(g)
    overlap_pass(gm)
    assert _names(gm) == ["x", "rand", "ar", "wait", "output"]


def _three_gathers() -> fx.GraphModule:
    g = fx.Graph()
    xs = [g.placeholder(f"x{i}") for i in range(3)]
    w = g.placeholder("w")
    h = w
    outs = []
    for i, x in enumerate(xs):  # 3 all-gathers of 64 bytes each, each used after one mm
        ag = _call(g, C10D.all_gather_into_tensor.default, x, 2, "g0", name=f"ag{i}",
                   val=_meta((4, 4)))
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


def test_unknown_size_is_not_moved_under_a_budget() -> None:
    def build() -> fx.GraphModule:
        g = fx.Graph()
        x, w = g.placeholder("x"), g.placeholder("w")
        a = _call(g, ATEN.mm.default, w, w, name="a")
        ar = _call(g, C10D.all_reduce.default, x, "sum", "g0", name="ar")  # no meta: size unknown
        wait = _call(g, WAIT, ar, name="wait")
        b = _call(g, ATEN.mm.default, a, a, name="b")
        g.output((_call(g, ATEN.add.Tensor, wait, a, name="c"), b))
        return _module(g)

    gm = build()
    overlap_pass(gm, max_inflight_bytes=1 << 20)
    assert _names(gm) == ["x", "w", "a", "ar", "wait", "b", "c", "output"]
    gm = build()
    overlap_pass(gm)  # without a budget the size does not matter
    assert _names(gm) == ["x", "w", "ar", "a", "b", "wait", "c", "output"]


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


BAD_GRAPHS = {
    "wait_on_non_collective": (_bad_wait_on_compute, "not a collective"),
    "collective_never_waited": (_bad_never_waited, "never waited"),
    "unknown_c10d_functional_op": (_bad_unknown_op, "does not know"),
    "read_before_wait": (_bad_read_before_wait, "before its wait"),
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

    all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
    gathered = funcol.wait_tensor(all_gather(x, 0, group))  # (4, 4); waited twice when traced
    h = torch.tanh(w @ w)
    reduced = funcol.all_reduce(h, "sum", group)
    h2 = torch.sin(h) @ w
    scattered = reduce_scatter(h2, "sum", 0, group)          # (2, 4)
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

SHAPE = (4, 4)
N_GRAPHS = 30


def _random_graph(seed: int, groups: tuple[str, str], barriers: bool) -> fx.GraphModule:
    """A random DAG of elementwise ops / mm, collectives (1-rank shapes) each waited right away
    (as tracing emits them), some waits unused, and, with ``barriers``, some in-place ops."""
    rng = random.Random(seed)
    g = fx.Graph()
    values: list[fx.Node] = [g.placeholder(f"in{i}") for i in range(3)]
    for step in range(rng.randint(10, 26)):
        roll = rng.random()
        if roll < 0.3:
            op = rng.choice([ATEN.add.Tensor, ATEN.mul.Tensor, ATEN.sub.Tensor, ATEN.mm.default])
            values.append(_call(g, op, rng.choice(values), rng.choice(values)))
            if op is ATEN.mm.default:
                values[-1] = _call(g, ATEN.tanh.default, values[-1])
        elif roll < 0.55:
            op = rng.choice([ATEN.sin.default, ATEN.cos.default, ATEN.neg.default, ATEN.tanh.default])
            values.append(_call(g, op, rng.choice(values)))
        elif roll < 0.93:
            group = rng.choice(groups)
            src = rng.choice(values)
            kind = rng.randrange(6)
            if kind == 5:
                other = rng.choice(values)
                if rng.random() < 0.5:
                    op, args = C10D.all_reduce_coalesced.default, ([src, other], "sum", group)
                else:
                    op, args = C10D.all_gather_into_tensor_coalesced.default, ([src, other], 1, group)
                co = _call(g, op, *args, val=[_meta(SHAPE), _meta(SHAPE)])
                for i in range(2):
                    wt = _call(g, WAIT, _call(g, operator.getitem, co, i))
                    values.append(wt)
                continue
            op, args = [
                (C10D.all_reduce.default, (src, "sum", group)),
                (C10D.all_gather_into_tensor.default, (src, 1, group)),
                (C10D.reduce_scatter_tensor.default, (src, "sum", 1, group)),
                (C10D.broadcast.default, (src, 0, group)),
                (C10D.all_to_all_single.default, (src, [SHAPE[0]], [SHAPE[0]], group)),
            ][kind]
            c = _call(g, op, *args, val=_meta(SHAPE))
            wt = _call(g, WAIT, c)
            if rng.random() < 0.8:  # else: waited, never used
                values.append(wt)
        elif barriers:
            target = rng.choice(values[3:] or values)
            if target.op != "placeholder":
                _call(g, ATEN.add_.Scalar, target, 1.0)
    outs = tuple(rng.sample(values, k=min(len(values), rng.randint(1, 4))))
    g.output(outs + (values[-1],))
    return _module(g)


def _barrier_prefixes(gm: fx.GraphModule) -> dict[str, frozenset[str]]:
    seen: list[str] = []
    prefixes = {}
    for n in gm.graph.nodes:
        if n.target is ATEN.add_.Scalar:
            prefixes[n.name] = frozenset(seen)
        seen.append(n.name)
    return prefixes


def _compute_before(gm: fx.GraphModule) -> dict[str, frozenset[str]]:
    """For each collective, the compute nodes (not collective / wait / item / barrier) before it."""
    seen: set[str] = set()
    result = {}
    for n in gm.graph.nodes:
        if _is_collective(n):
            result[n.name] = frozenset(seen)
        elif n.op == "call_function" and n.target not in (WAIT, operator.getitem, ATEN.add_.Scalar):
            seen.add(n.name)
    return result


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
