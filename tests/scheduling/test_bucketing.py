"""scheduler.bucketing: small all-gathers / reduce-scatters merged into one collective, values unchanged.

Hand-written graphs check which collectives merge (structure only); graphs traced with ``make_fx``
and a graph compiled by Inductor with the hook run on 2 gloo ranks, compared bit for bit with the
unbucketed program (concatenating before a collective does not change any element's reduction).
"""
from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.fx as fx

from scheduler import overlap_graph, overlap_pass
from scheduler.bucketing import bucket_collectives
from scheduler.torch_versions import funcol_all_gather, funcol_reduce_scatter

C10D = torch.ops._c10d_functional
ATEN = torch.ops.aten
AG = C10D.all_gather_into_tensor.default
RS = C10D.reduce_scatter_tensor.default
WAIT = C10D.wait_tensor.default


def _meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _placeholder(g: fx.Graph, name: str, val: torch.Tensor) -> fx.Node:
    p = g.placeholder(name)
    p.meta["val"] = val
    return p


def _call(g: fx.Graph, target: Any, *args: Any) -> fx.Node:
    from scheduler.bucketing import _value

    n = g.call_function(target, args)
    n.meta["val"] = _value(target, fx.node.map_arg(args, lambda a: a.meta["val"]))
    return n


def _gather(g: fx.Graph, x: fx.Node, group: str = "g0") -> fx.Node:
    return _call(g, WAIT, _call(g, AG, x, 2, group))


def _collectives(graph: fx.Graph) -> list[tuple]:
    out = []
    for n in graph.nodes:
        if n.op == "call_function" and n.target in (AG, RS):
            out.append((n.target.__name__.split(".")[0], n.args[-1], tuple(n.meta["val"].shape)))
    return out


def _structure_graph() -> fx.Graph:
    g = fx.Graph()
    a = _placeholder(g, "a", _meta(3, 4))
    b = _placeholder(g, "b", _meta(5))
    c = _placeholder(g, "c", _meta(2, 2))
    h = _placeholder(g, "h", _meta(4, 4, dtype=torch.bfloat16))
    big = _placeholder(g, "big", _meta(1000))
    outs = [_gather(g, a), _gather(g, b)]
    late = _call(g, ATEN.sin.default, c)  # computed after the first gather: cannot join its bucket
    outs += [_gather(g, c), _gather(g, late), _gather(g, h), _gather(g, big), _gather(g, a, "g1")]
    rs_in = [_placeholder(g, f"r{i}", _meta(4, 3)) for i in range(2)]
    outs += [_call(g, WAIT, _call(g, RS, r, "sum", 2, "g0")) for r in rs_in]
    outs.append(_call(g, WAIT, _call(g, RS, rs_in[0], "max", 2, "g0")))  # another reduce op
    g.output(tuple(outs))
    return g


def test_mergeable_collectives_share_a_bucket() -> None:
    g = _structure_graph()
    before = _collectives(g)
    removed = bucket_collectives(g, bucket_bytes=256)
    g.lint()
    after = _collectives(g)
    # a, b, c (fp32, g0, inputs ready at the first gather) -> one gather of 12 + 5 + 4 elements;
    # sin(c) is computed later: its own; bf16, 4000-byte and group g1 gathers: untouched.
    # The two 'sum' reduce-scatters merge; the 'max' one does not.
    assert removed == 3
    assert ("all_gather_into_tensor", "g0", (42,)) in after  # 2 ranks x 21 elements
    assert len(after) == len(before) - 3
    assert sum(1 for k, grp, _ in after if k == "reduce_scatter_tensor") == 2
    assert ("reduce_scatter_tensor", "g0", (12,)) in after  # 2 x (4x3 / 2)
    for kept in [("all_gather_into_tensor", "g0", (2000,)), ("all_gather_into_tensor", "g1", (6, 4))]:
        assert kept in after


def test_budget_splits_buckets_and_none_or_small_does_nothing() -> None:
    g = _structure_graph()
    assert bucket_collectives(g, bucket_bytes=1) == 0  # every collective is larger than the budget
    g = _structure_graph()
    assert bucket_collectives(g, bucket_bytes=68) == 2  # a+b (68 bytes) merge; c starts a new bucket


@pytest.mark.parametrize("barrier", [ATEN.add_.Tensor, C10D.all_reduce_.default], ids=["in-place-op", "unknown-c10d-op"])
def test_a_barrier_closes_the_bucket(barrier: Any) -> None:
    """An in-place op, or a ``_c10d_functional`` op the passes do not know (the in-place
    ``all_reduce_``), between two gathers: the second is not merged into the first's bucket (that
    would issue it before the barrier)."""
    args = (1.0,) if barrier is ATEN.add_.Tensor else ("sum", "g0")
    g = fx.Graph()
    a, b = _placeholder(g, "a", _meta(4)), _placeholder(g, "b", _meta(4))
    first = _gather(g, a)
    mutated = g.call_function(barrier, (b, *args))  # nothing moves across it
    mutated.meta["val"] = _meta(4)
    second = _gather(g, b)
    g.output((first, second, mutated))
    assert bucket_collectives(g, bucket_bytes=1 << 20) == 0


def _graph_text(g: fx.Graph) -> list[str]:
    return [n.format_node() for n in g.nodes]


def test_a_collective_waited_twice_stays_out_of_buckets() -> None:
    """A gather with two waits (torch 2.15 traces them; ``bucket_collectives`` called before
    ``canonicalize_waits``) is not merged: its rewrite replaces exactly one wait. The graph is left
    as it was."""
    g = fx.Graph()
    a, b = _placeholder(g, "a", _meta(4)), _placeholder(g, "b", _meta(4))
    ag = _call(g, AG, a, 2, "g0")
    g.output((_call(g, WAIT, ag), _call(g, WAIT, ag), _gather(g, b)))
    before = _graph_text(g)
    assert bucket_collectives(g, bucket_bytes=1 << 20) == 0
    assert _graph_text(g) == before


def test_a_bucket_that_cannot_be_rewritten_leaves_the_graph_as_it_was(caplog: pytest.LogCaptureFixture) -> None:
    """A gather of a non-contiguous input (a transpose: its flat view for the packing fails) is left
    unmerged with the reason logged, and the nodes made before the failure are removed again (none
    is left behind to be issued or computed)."""
    g = fx.Graph()
    a, b = _placeholder(g, "a", _meta(4, 2)), _placeholder(g, "b", _meta(8))
    transposed = _call(g, ATEN.t.default, a)
    g.output((_gather(g, transposed), _gather(g, b)))
    before = _graph_text(g)
    with caplog.at_level(logging.WARNING, logger="scheduler"):
        assert bucket_collectives(g, bucket_bytes=1 << 20) == 0
    assert _graph_text(g) == before
    assert any("left 2 collectives unmerged" in r.getMessage() for r in caplog.records), caplog.text


def test_bad_arguments() -> None:
    g = _structure_graph()
    with pytest.raises(ValueError, match="bucket_bytes must be >= 1"):
        bucket_collectives(g, 0)
    with pytest.raises(TypeError, match="bucket_bytes must be an int or None"):
        overlap_graph(g, bucket_bytes="1MB")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bucket_bytes must be an int or None"):
        bucket_collectives(g, True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="graph must be a torch.fx.Graph"):
        bucket_collectives("graph", 10)  # type: ignore[arg-type]
    assert _collectives(g) == _collectives(_structure_graph())  # nothing changed


# -- values, on 2 gloo ranks -------------------------------------------------------------------

def _program(xs: list[torch.Tensor], grads: list[torch.Tensor], w: torch.Tensor, group: Any) -> tuple:

    gathered = [funcol_all_gather(x, 0, group) for x in xs]
    reduced = [funcol_reduce_scatter(g, "sum", 0, group) for g in grads]
    h = torch.tanh(w @ w)
    return tuple(t * 1 for t in gathered) + tuple(r + 0 for r in reduced) + (h,)


def _inputs(rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(shape, generator=g) for shape in [(3, 5), (1,), (7,), (2, 2, 2)]]
    grads = [torch.randn(shape, generator=g) for shape in [(4, 3), (6,), (2, 1)]]
    return xs, grads, torch.randn(8, 8, generator=torch.Generator().manual_seed(9))


def _traced_values(rank: int, world: int) -> int:
    import torch.distributed as dist
    from torch.fx.experimental.proxy_tensor import make_fx

    xs, grads, w = _inputs(rank)
    group = dist.group.WORLD

    def program(xs: list[torch.Tensor], grads: list[torch.Tensor], w: torch.Tensor) -> tuple:
        return _program(xs, grads, w, group)

    reference = make_fx(program)(xs, grads, w)
    bucketed = make_fx(program)(xs, grads, w)
    overlap_pass(bucketed, bucket_bytes=1 << 20)
    count = sum(1 for n in bucketed.graph.nodes if n.op == "call_function" and n.target in (AG, RS))
    expected = program(xs, grads, w)
    for got, want, ref in zip(bucketed(xs, grads, w), expected, reference(xs, grads, w)):
        assert torch.equal(got, want) and torch.equal(got, ref)
    return count


def test_bucketed_traced_graph_computes_the_same_values(distributed) -> None:
    assert distributed(_traced_values, 2, timeout=120) == [2, 2]  # 4 gathers -> 1, 3 reduce-scatters -> 1


def _compiled_values(rank: int, world: int) -> list[int]:
    import torch.distributed as dist
    from torch._inductor.utils import run_and_get_code

    import scheduler

    torch._dynamo.reset()
    xs, grads, w = _inputs(rank)
    group = dist.group.WORLD

    def program(xs: list[torch.Tensor], grads: list[torch.Tensor], w: torch.Tensor) -> tuple:
        return _program(xs, grads, w, group)

    with scheduler.inductor_overlap(bucket_bytes=1 << 20):
        compiled = torch.compile(program, backend="inductor", fullgraph=True)
        got, codes = run_and_get_code(compiled, xs, grads, w)
    for g, want in zip(got, program(xs, grads, w)):
        assert torch.equal(g, want)
    code = "\n".join(codes)
    # CPU all-gathers compile to the snapshot gather (scheduler.cpu_all_gather)
    gathers = code.count("all_gather_into_tensor.default(") + code.count("snapshot_all_gather_into_tensor_out.default(")
    return [gathers, code.count("reduce_scatter_tensor.default(")]


def test_compiled_with_the_hook_issues_one_collective_per_bucket(distributed) -> None:
    for counts in distributed(_compiled_values, 2, timeout=300):
        assert counts == [1, 1]
