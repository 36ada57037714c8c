"""FX graphs of ``_c10d_functional`` collectives for the graph-pass tests: builders, the checks of the
pass's contract, and a random-graph generator.

Shared by ``test_graph_pass.py`` (hand-written and seeded random graphs) and
``test_properties_graph_pass.py`` (Hypothesis-drawn graphs). The generator takes a
``random.Random``: a seeded one gives a fixed graph, Hypothesis' ``st.randoms()`` one it can shrink.
Every collective in a random graph keeps the shape ``SHAPE`` on a 1-rank group, so a graph runs on a
single-process gloo group and its values can be compared before and after the pass.
"""
from __future__ import annotations

import operator
import random
from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.fx as fx

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
SHAPE = (4, 4)
"""Shape of every value in a random graph (inputs, compute, collective results on 1 rank)."""
BARRIER = ATEN.add_.Scalar
"""The in-place op random graphs use as a barrier."""


# -- building ---------------------------------------------------------------------------------

def meta(shape: tuple[int, ...], dtype: torch.dtype = F32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def call(g: fx.Graph, target: Any, *args: Any, name: Optional[str] = None, val: Any = None) -> fx.Node:
    """A ``call_function`` node, optionally named and with ``meta["val"]`` (sizes for the budget)."""
    n = g.call_function(target, args)
    if name is not None:
        n.name = name
    if val is not None:
        n.meta["val"] = val
    return n


def module(g: fx.Graph) -> fx.GraphModule:
    return fx.GraphModule(torch.nn.Module(), g)


def names(gm: fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes]


def acceptance_graph() -> fx.GraphModule:
    """Inductor's post-grad graph for ``all_gather(x).sum() + (w @ w).sum()`` (wait, then mm)."""
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    ag = call(g, C10D.all_gather_into_tensor.default, x, 2, "g0", name="ag", val=meta((8, 8)))
    wait = call(g, WAIT, ag, name="wait")
    s1 = call(g, ATEN.sum.default, wait, name="s1")
    mm = call(g, ATEN.mm.default, w, w, name="mm")
    s2 = call(g, ATEN.sum.default, mm, name="s2")
    g.output(call(g, ATEN.add.Tensor, s1, s2, name="add"))
    return module(g)


# -- the pass's contract ------------------------------------------------------------------------

def is_collective(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target in COLLECTIVE_TARGETS


def group_sequences(gm: fx.GraphModule) -> dict[Any, list[str]]:
    """Collective names per group, in graph order."""
    seqs: dict[Any, list[str]] = {}
    for n in gm.graph.nodes:
        if is_collective(n):
            seqs.setdefault(n.args[GROUP_ARG[n.target]], []).append(n.name)
    return seqs


def check_topological(gm: fx.GraphModule) -> None:
    """Every node after its inputs (so every wait before every reader of its result), and lint."""
    seen: set[fx.Node] = set()
    for n in gm.graph.nodes:
        for d in n.all_input_nodes:
            assert d in seen, f"{n.name} placed before its input {d.name}"
        seen.add(n)
    gm.graph.lint()


def check_waits_precede_direct_readers(gm: fx.GraphModule) -> None:
    """A node that reads a collective's output itself (or an item of a coalesced one) instead of the
    wait's result comes after a wait on it: what the topological order alone does not imply."""
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in gm.graph.nodes:
        if not is_collective(n):
            continue
        results = [u for u in n.users if u.target is operator.getitem] or [n]
        for result in results:
            waits = [u for u in result.users if u.target is WAIT]
            assert waits, f"{result.name} is never waited"
            first_wait = min(position[w] for w in waits)
            for u in result.users:
                if u.target is not WAIT:
                    assert position[u] > first_wait, f"{u.name} reads {result.name} before its wait"


def inflight_profile(gm: fx.GraphModule) -> list[tuple[str, int, int]]:
    """(collective, its bytes, bytes issued-but-not-waited right after issuing it)."""
    outstanding: dict[Any, int] = {}
    profile = []
    for n in gm.graph.nodes:
        if is_collective(n):
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


def barrier_prefixes(gm: fx.GraphModule) -> dict[str, frozenset[str]]:
    """For each barrier, the nodes before it (the pass moves nothing across a barrier)."""
    seen: list[str] = []
    prefixes = {}
    for n in gm.graph.nodes:
        if n.target is BARRIER:
            prefixes[n.name] = frozenset(seen)
        seen.append(n.name)
    return prefixes


def compute_before(gm: fx.GraphModule) -> dict[str, frozenset[str]]:
    """For each collective, the compute nodes (not collective / wait / item / barrier) before it."""
    seen: set[str] = set()
    result = {}
    for n in gm.graph.nodes:
        if is_collective(n):
            result[n.name] = frozenset(seen)
        elif n.op == "call_function" and n.target not in (WAIT, operator.getitem, BARRIER):
            seen.add(n.name)
    return result


# -- random graphs ------------------------------------------------------------------------------

def random_graph(rng: random.Random, groups: Sequence[str], barriers: bool, *,
                 variety: bool = False) -> fx.GraphModule:
    """A random DAG of elementwise ops / mm, collectives (1-rank shapes) each waited right away
    (as tracing emits them), some waits unused, and, with ``barriers``, some in-place ops.

    ``variety`` adds what post-grad graphs also hold: waits a few nodes after their collective
    (compute in between), reads of a collective's own output after its wait, waits on an
    already-waited result, and coalesced reduce-scatters. Without it, the rng is drawn exactly as
    before these were added, so seeded graphs stay the same.
    """
    g = fx.Graph()
    values: list[fx.Node] = [g.placeholder(f"in{i}") for i in range(3)]
    deferred: list[fx.Node] = []  # variety: collectives whose wait comes later

    def waited(c: fx.Node) -> None:
        wt = call(g, WAIT, c)
        if rng.random() < 0.8:  # else: waited, never used
            values.append(wt)
        if variety:
            roll = rng.random()
            if roll < 0.25:
                values.append(call(g, ATEN.neg.default, c))  # reads the output itself, after the wait
            elif roll < 0.4:
                values.append(call(g, WAIT, wt))  # waits again on the waited result

    for _ in range(rng.randint(10, 26)):
        if deferred and rng.random() < 0.4:
            waited(deferred.pop(rng.randrange(len(deferred))))
        roll = rng.random()
        if roll < 0.3:
            op = rng.choice([ATEN.add.Tensor, ATEN.mul.Tensor, ATEN.sub.Tensor, ATEN.mm.default])
            values.append(call(g, op, rng.choice(values), rng.choice(values)))
            if op is ATEN.mm.default:
                values[-1] = call(g, ATEN.tanh.default, values[-1])
        elif roll < 0.55:
            op = rng.choice([ATEN.sin.default, ATEN.cos.default, ATEN.neg.default, ATEN.tanh.default])
            values.append(call(g, op, rng.choice(values)))
        elif roll < 0.93:
            group = rng.choice(groups)
            src = rng.choice(values)
            kind = rng.randrange(6)
            if kind == 5:
                other = rng.choice(values)
                which = rng.randrange(3) if variety else int(rng.random() >= 0.5)
                op, args = [
                    (C10D.all_reduce_coalesced.default, ([src, other], "sum", group)),
                    (C10D.all_gather_into_tensor_coalesced.default, ([src, other], 1, group)),
                    (C10D.reduce_scatter_tensor_coalesced.default, ([src, other], "sum", 1, group)),
                ][which]
                co = call(g, op, *args, val=[meta(SHAPE), meta(SHAPE)])
                for i in range(2):
                    values.append(call(g, WAIT, call(g, operator.getitem, co, i)))
                continue
            op, args = [
                (C10D.all_reduce.default, (src, "sum", group)),
                (C10D.all_gather_into_tensor.default, (src, 1, group)),
                (C10D.reduce_scatter_tensor.default, (src, "sum", 1, group)),
                (C10D.broadcast.default, (src, 0, group)),
                (C10D.all_to_all_single.default, (src, [SHAPE[0]], [SHAPE[0]], group)),
            ][kind]
            c = call(g, op, *args, val=meta(SHAPE))
            if variety and rng.random() < 0.4:
                deferred.append(c)
            else:
                waited(c)
        elif barriers:
            while deferred:  # an in-place op may not race with a collective reading its target
                waited(deferred.pop())
            target = rng.choice(values[3:] or values)
            if target.op != "placeholder":
                call(g, BARRIER, target, 1.0)
    while deferred:
        waited(deferred.pop())
    outs = tuple(rng.sample(values, k=min(len(values), rng.randint(1, 4))))
    g.output(outs + (values[-1],))
    return module(g)


def random_inputs(seed: int, n: int = 3) -> list[torch.Tensor]:
    """Inputs for a random graph's placeholders."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=gen) for _ in range(n)]
