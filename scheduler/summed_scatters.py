"""FX graph pass: a sum of reduce-scatters becomes one reduce-scatter of the sum.

[Note: summed reduce-scatters in compiled graphs]
torch's sequence-parallel plan gives q, k and v each a ``ColwiseParallel(input_layouts=Shard(1))``:
in a compiled graph the three gathers of their shared input are one (AOT's CSE), but in backward
each projection's input gradient is reduce-scattered on its own and the three shards are added::

    add(add(wait(reduce_scatter(X_q)), wait(reduce_scatter(X_k))), wait(reduce_scatter(X_v)))

A ``sum`` reduce-scatter is linear, so this equals ``wait(reduce_scatter(X_q + X_k + X_v))``: one
collective instead of three, a third of the traffic. This is the compiled counterpart of the eager
runtime's [Note: sibling layers share one reduce-scatter]. ``X_i`` is either the scattered tensor
itself (a dim-0 scatter) or, for a scatter on dim ``d > 0``, the ``split(n, d)`` -> items ->
``cat(0)`` that functional collectives put before it; the rewrite adds the tensors *before* that
split (it only moves blocks, so it commutes with the add) and splits the sum once, so that when the
terms are matmuls the result is pattern (c) of ``scheduler.collective_matmul``, which runs next and
chunks it. The adds keep the graph's order (``(X_q + X_k) + X_v`` for the shards' ``(q + k) + v``).

Values: each element becomes ``sum over ranks of (X_q + X_k + X_v)`` instead of ``(sum over ranks
of X_q) + ...``: the same real number, a different float rounding order, so the result differs from
the unrewritten graph by rounding only (a few ulps of the summed terms; the tests allow 1e-5
relative in fp32). This is why the Inductor hook runs it only together with the collective matmul
split (``collective_matmul_chunks`` > 1); with ``collective_matmul_chunks=1`` graphs stay bitwise.

Matched only where every term's reduce-scatter and wait has no other reader, the terms agree on
reduce op (``sum``), group, group size, shape, dtype and split, every intermediate add is read only
by the next, and all sizes are static. Anything else is left as it is.
"""
from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx

from scheduler.bucketing import _Emitter, _fake_mode
from scheduler.collective_matmul import _shape, _split_cat
from scheduler.fx_nodes import REDUCE_SCATTER, WAIT_TENSOR

__all__ = ["merge_summed_reduce_scatters"]

logger = logging.getLogger("scheduler")

_ATEN = torch.ops.aten


@dataclass
class _Term:
    """One reduce-scattered addend: ``wait(reduce_scatter(cat(split(value))))`` or ``wait(reduce_scatter(value))``."""

    wait: torch.fx.Node
    scatter: torch.fx.Node
    value: torch.fx.Node  # what was scattered, before the split / cat
    moved: list[torch.fx.Node]  # the split, its items and the cat (empty for dim 0)
    split_dim: int  # 0 when there is no split / cat

    def key(self) -> tuple:
        _, op, size, group = self.scatter.args
        val = self.value.meta["val"]
        return op, size, group, self.split_dim, _shape(self.value), val.dtype


def _term(node: Any) -> Optional[_Term]:
    if not isinstance(node, torch.fx.Node) or node.target is not WAIT_TENSOR or len(node.users) != 1:
        return None
    scatter = node.args[0]
    if (not isinstance(scatter, torch.fx.Node) or scatter.target is not REDUCE_SCATTER or scatter.kwargs
            or len(scatter.args) != 4 or len(scatter.users) != 1 or scatter.args[1] != "sum"):
        return None
    scattered, size = scatter.args[0], scatter.args[2]
    if not isinstance(scattered, torch.fx.Node) or not isinstance(size, int) or _shape(scattered) is None:
        return None
    if scattered.target is _ATEN.cat.default and scattered.args[0]:
        split = scattered.args[0][0].args[0] if isinstance(scattered.args[0][0], torch.fx.Node) else None
        if isinstance(split, torch.fx.Node) and split.target is _ATEN.split.Tensor:
            value = split.args[0]
            shape = _shape(value) if isinstance(value, torch.fx.Node) else None
            if shape is None or len(scattered.users) != 1:
                return None
            dim = (split.args[2] if len(split.args) > 2 else 0) % len(shape)
            found = _split_cat(value, size, dim, 0)
            if found is None or found[0][-1] is not scattered:
                return None
            return _Term(node, scatter, value, found[0], dim)
    return _Term(node, scatter, scattered, [], 0)


def _sum_of_terms(node: Any, terms: list[_Term], adds: list[torch.fx.Node], top: bool) -> Any:
    """``node`` as a tree of adds of reduce-scattered terms (appended to ``terms`` left to right;
    the adds to ``adds``): the tree with :class:`_Term` leaves, or None."""
    if isinstance(node, torch.fx.Node) and node.target is _ATEN.add.Tensor:
        if node.kwargs or len(node.args) != 2 or (not top and len(node.users) != 1) or node.args[0] is node.args[1]:
            return None
        left = _sum_of_terms(node.args[0], terms, adds, False)
        right = _sum_of_terms(node.args[1], terms, adds, False) if left is not None else None
        if right is None:
            return None
        adds.append(node)
        return left, right
    term = _term(node)
    if term is not None:
        terms.append(term)
    return term


def _rewrite(graph: torch.fx.Graph, root: torch.fx.Node, tree: Any, terms: list[_Term], adds: list[torch.fx.Node],
             fake_mode: Any, refake: bool) -> None:
    position = {n: i for i, n in enumerate(graph.nodes)}
    # where the last of the scatters was: after every addend (each comes before its own scatter)
    emit = _Emitter(graph, max((t.scatter for t in terms), key=position.__getitem__), fake_mode, refake)
    try:
        def summed(t: Any) -> torch.fx.Node:
            return t.value if isinstance(t, _Term) else emit(_ATEN.add.Tensor, summed(t[0]), summed(t[1]))

        total = summed(tree)
        first = terms[0]
        _, op, size, group = first.scatter.args
        if first.moved:
            split = emit(_ATEN.split.Tensor, total, *first.moved[0].args[1:])
            items = [emit(operator.getitem, split, i) for i in range(size)]
            total = emit(_ATEN.cat.default, items, *first.moved[-1].args[1:])
        scatter = emit(REDUCE_SCATTER, total, op, size, group)
        emit.anchor = root
        wait = emit(WAIT_TENSOR, scatter)
    except Exception:
        for node in reversed(emit.inserted):
            graph.erase_node(node)
        raise
    root.replace_all_uses_with(wait)
    for node in reversed(adds):
        graph.erase_node(node)
    for t in terms:
        for node in (t.wait, t.scatter, *reversed(t.moved)):
            graph.erase_node(node)


def merge_summed_reduce_scatters(graph: torch.fx.Graph) -> int:
    """Rewrite each sum of ``sum`` reduce-scatters in ``graph`` into one reduce-scatter of the sum,
    in place (see [Note: summed reduce-scatters in compiled graphs]); returns how many
    reduce-scatters were removed (0: graph unchanged). A match whose rewrite fails is left as it
    was, with the reason logged on the ``"scheduler"`` logger."""
    if not isinstance(graph, torch.fx.Graph):
        raise TypeError(f"graph must be a torch.fx.Graph, got {type(graph).__name__}")
    matches = []
    inside: set[torch.fx.Node] = set()
    for node in reversed(list(graph.nodes)):  # outermost add first: its subtree is taken whole
        if node.target is not _ATEN.add.Tensor or node in inside:
            continue
        terms: list[_Term] = []
        adds: list[torch.fx.Node] = []
        tree = _sum_of_terms(node, terms, adds, True)
        if tree is None or len({t.key() for t in terms}) != 1:  # an add of terms: two at least
            continue
        inside.update(adds)
        matches.append((node, tree, terms, adds))
    if not matches:
        return 0
    fake_mode, refake = _fake_mode([t.value.meta["val"] for m in matches for t in m[2]])
    removed = 0
    for root, tree, terms, adds in matches:
        try:
            _rewrite(graph, root, tree, terms, adds, fake_mode, refake)
        except Exception as e:  # noqa: BLE001 - a failed shape computation must not break the graph
            logger.warning("summed reduce-scatters: left %s as it was: %s", root.name, e)
            continue
        removed += len(terms) - 1
    graph.lint()
    return removed
