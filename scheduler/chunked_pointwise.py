"""FX graph pass: the pointwise ops between two split collective matmuls run chunk by chunk.

[Note: chunks through pointwise ops]
``scheduler.collective_matmul`` splits a sequence-parallel MLP cut on the batch ([Note: cutting
the leading dim]) into chunks, but the activation between its two matmuls still joins them::

    a_k = addmm(b1, rows of gathered chunk k, W1^T)                     k = 0 .. c-1
    h   = cat([a_0, ..., a_{c-1}], 0) -> reshape -> gelu's ops -> reshape
    y_k = addmm(b2 / w, slice(h, 0, chunk k's rows), W2^T) -> reduce-scatter chunk k

so no chunk's second matmul (nor its reduce-scatter) starts before the last chunk has been gathered
and multiplied: the link sits idle from the last gather chunk to the first scatter chunk. This pass
computes the ops between such a ``cat`` on dim 0 and the slices per chunk, from ``a_k``, when every
one of them keeps the rows of the chunks apart:

* views (``view`` / ``reshape`` / ``_unsafe_view``) whose chunk boundaries fall on whole rows of dim
  0 of the result;
* pointwise ops (``torch.Tag.pointwise``, not mutating) whose other tensor operands either broadcast
  over dim 0 (fewer dims, or size 1 there) or have the result's shape (those are sliced per chunk),
  all computable before the first chunk (moved there when they come later).

Each ``slice(.., 0, start, end)`` of exactly chunk ``k``'s rows then reads chunk ``k``'s value, and
the ops after it that need nothing later than chunk ``k`` (its matmul, the scatter's split / cat and
the reduce-scatter's issue; never a wait, nor a mutating op) move up to follow chunk ``k``'s ops. So
chunk 0's second matmul and reduce-scatter run while chunk 1 is still being gathered; in backward
the same holds from the output gradient's gather chunks through the activation's backward to the
input gradient's scatter chunks. Readers of a whole tensor of the region (saved for backward, the
weight gradients) read the ``cat`` of its chunks.

Values are unchanged element for element: every element goes through the same ops. Only chunks of
consecutive rows are handled (the batch cut); the interleaved chunks of a sequence cut, and any
region with an op that mixes rows (a reduction, a matmul, a transpose of dim 0), are left alone.
"""
from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx

from scheduler.bucketing import _Emitter, _fake_mode
from scheduler.collective_matmul import _shape
from scheduler.fx_nodes import WAIT_TENSOR

__all__ = ["run_chunks_through_pointwise"]

logger = logging.getLogger("scheduler")

_ATEN = torch.ops.aten
_VIEWS = frozenset({_ATEN.view.default, _ATEN.reshape.default, _ATEN._unsafe_view.default})


def _pure(target: Any) -> bool:
    """An op that writes nothing it reads (a functional aten op, or ``getitem``)."""
    if target is operator.getitem:
        return True
    return isinstance(target, torch._ops.OpOverload) and not target._schema.is_mutable


def _pointwise(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags and _pure(target)


def _view_bounds(bounds: list[int], src: tuple[int, ...], dst: tuple[int, ...]) -> Optional[list[int]]:
    """``bounds`` (row boundaries on dim 0 of ``src``) on dim 0 of its view ``dst``, or None where one
    does not fall on a whole row there."""
    if not dst:
        return None
    per_src, per_dst = math.prod(src[1:]), math.prod(dst[1:])
    if per_dst == 0 or any(b * per_src % per_dst for b in bounds):
        return None
    return [b * per_src // per_dst for b in bounds]


@dataclass
class _Region:
    """The nodes from a dim-0 ``cat`` of chunk values that keep the chunks' rows apart."""

    cat: torch.fx.Node
    chunks: list[torch.fx.Node]  # a_0 .. a_{c-1}
    bounds: dict[torch.fx.Node, list[int]]  # node -> its chunks' row boundaries on dim 0 (c + 1)
    order: list[torch.fx.Node]  # the region's nodes after the cat, in graph order
    outside: list[torch.fx.Node] = field(default_factory=list)  # other tensors the region's ops read
    lift: list[torch.fx.Node] = field(default_factory=list)  # those (and their inputs) made after a_0
    targets: dict[torch.fx.Node, int] = field(default_factory=dict)  # slice -> the chunk it reads

    def chunk_of(self, node: torch.fx.Node) -> Optional[int]:
        """``k`` when ``node`` is ``slice(x, 0, start, end)`` of exactly chunk ``k``'s rows of ``x``."""
        if node.target is not _ATEN.slice.Tensor or node.kwargs or node.args[0] not in self.bounds:
            return None
        x, dim, start, end = (*node.args, 0, None, None)[:4]
        step = node.args[4] if len(node.args) > 4 else 1
        b = self.bounds[x]
        if dim != 0 or step != 1 or type(start) is not int or type(end) is not int:
            return None
        end = min(end, b[-1])
        for k, (lo, hi) in enumerate(zip(b, b[1:])):
            if (start, end) == (lo, hi):
                return k
        return None


def _region_bounds(node: torch.fx.Node, r: _Region) -> Optional[list[int]]:
    """``node``'s chunk boundaries when it keeps the region's rows apart (see the Note), else None."""
    out = _shape(node)
    if out is None or node.op != "call_function":
        return None
    if node.target in _VIEWS:
        src = node.args[0]
        return _view_bounds(r.bounds[src], _shape(src), out) if src in r.bounds else None
    if not _pointwise(node.target) or not out:
        return None
    inside = [a for a in node.all_input_nodes if a in r.bounds]
    if any(_shape(a) != out or r.bounds[a] != r.bounds[inside[0]] for a in inside):
        return None
    for a in node.all_input_nodes:
        if a in r.bounds:
            continue
        shape = _shape(a)
        broadcast = shape is not None and (len(shape) < len(out) or (len(shape) == len(out) and shape[0] == 1))
        if not broadcast and shape != out:
            return None
    return r.bounds[inside[0]]


def _match(cat: torch.fx.Node, position: dict[torch.fx.Node, int]) -> Optional[_Region]:
    if cat.target is not _ATEN.cat.default or cat.kwargs or len(cat.args) != 2 or cat.args[1] != 0:
        return None
    parts = cat.args[0]
    shapes = [_shape(p) for p in parts]
    if len(parts) < 2 or any(s is None or not s for s in shapes):
        return None
    bounds = [0]
    for s in shapes:
        bounds.append(bounds[-1] + s[0])
    r = _Region(cat, list(parts), {cat: bounds}, [])
    node = cat.next
    while node.op != "output":
        if any(a in r.bounds for a in node.all_input_nodes) and r.chunk_of(node) is None:
            b = _region_bounds(node, r)
            if b is not None:
                r.bounds[node] = b
                r.order.append(node)
        node = node.next
    for n in [cat, *r.order]:
        for user in n.users:
            k = r.chunk_of(user)
            if k is not None:
                r.targets[user] = k
    r.outside = list(dict.fromkeys(a for n in r.order for a in n.all_input_nodes if a not in r.bounds))
    if not r.targets or not r.order:
        return None
    lift = _late_ancestors(r.outside, position[r.chunks[0]], position)
    if lift is None or any(n in r.bounds or n in r.chunks for n in lift):
        return None
    if lift and _writes_between(r.chunks[0], lift[-1]):  # a read moved above a write could see old data
        return None
    r.lift = lift
    return r


def _writes(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and not _pure(node.target)


def _writes_between(first: torch.fx.Node, last: torch.fx.Node) -> bool:
    """Whether an op from ``first`` to ``last`` (graph order) may write a tensor (not a pure op)."""
    node = first
    while True:
        if _writes(node):
            return True
        if node is last:
            return False
        node = node.next


def _late_ancestors(nodes: list[torch.fx.Node], limit: int, position: dict[torch.fx.Node, int]
                    ) -> Optional[list[torch.fx.Node]]:
    """``nodes`` and their ancestors placed after ``limit``, in graph order, or None when one of them
    cannot move above it (not a pure op, a wait, a collective)."""
    late: set[torch.fx.Node] = set()
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if n in late or position[n] < limit:
            continue
        if (n.op != "call_function" or n.target is WAIT_TENSOR or not _pure(n.target)
                or getattr(n.target, "namespace", None) == "_c10d_functional"):
            return None
        late.add(n)
        stack.extend(n.all_input_nodes)
    return sorted(late, key=position.__getitem__)


def _emit_chunk(graph: torch.fx.Graph, r: _Region, k: int, position: dict[torch.fx.Node, int],
                fake_mode: Any, refake: bool) -> tuple[dict[torch.fx.Node, torch.fx.Node], _Emitter]:
    """Chunk ``k``'s copy of every region node, placed right after ``a_k`` and the outside tensors."""
    last = max([r.chunks[k], *r.outside], key=position.__getitem__)
    emit = _Emitter(graph, last.next, fake_mode, refake)
    copies: dict[torch.fx.Node, torch.fx.Node] = {r.cat: r.chunks[k]}
    sliced: dict[torch.fx.Node, torch.fx.Node] = {}

    def chunk_arg(a: torch.fx.Node, out: tuple[int, ...], b: list[int]) -> torch.fx.Node:
        if a in copies:
            return copies[a]
        if _shape(a) == out:  # same shape as the result: its rows, sliced alike
            if a not in sliced:
                sliced[a] = emit(_ATEN.slice.Tensor, a, 0, b[k], b[k + 1])
            return sliced[a]
        return a  # broadcast over dim 0

    for n in r.order:
        b, out = r.bounds[n], _shape(n)
        if n.target in _VIEWS:
            copies[n] = emit(n.target, copies[n.args[0]], [b[k + 1] - b[k], *out[1:]])
        else:
            args = torch.fx.node.map_arg(n.args, lambda a: chunk_arg(a, out, b))
            kwargs = torch.fx.node.map_arg(n.kwargs, lambda a: chunk_arg(a, out, b))
            copies[n] = emit(n.target, *args, kwargs=dict(kwargs))
    return copies, emit


def _hoist_after(graph: torch.fx.Graph, last: torch.fx.Node, seeds: set[torch.fx.Node]) -> int:
    """Move the nodes after ``last`` that read ``seeds`` (or moved nodes) and nothing defined after
    ``last`` up to follow ``last``, in their order; never a wait, and nothing from the first op
    that may write a tensor on (a read moved above a write could see old data). Returns how many."""
    before = set()
    for n in graph.nodes:
        before.add(n)
        if n is last:
            break
    moved = 0
    ready = set(seeds) | before
    anchor = last
    node = last.next
    while node.op != "output" and not _writes(node):
        following = node.next
        inputs = node.all_input_nodes
        if (node.op == "call_function" and node.target is not WAIT_TENSOR
                and any(a in seeds for a in inputs) and all(a in ready for a in inputs)):
            anchor.append(node)
            anchor = node
            seeds.add(node)
            ready.add(node)
            moved += 1
        node = following
    return moved


def _rewrite(graph: torch.fx.Graph, r: _Region) -> None:
    for n in r.lift:  # computed before a_0, so that every chunk's copy can follow its own a_k
        r.chunks[0].prepend(n)
    position = {n: i for i, n in enumerate(graph.nodes)}
    fake_mode, refake = _fake_mode([n.meta["val"] for n in [*r.chunks, *r.order]])
    chunks = [_emit_chunk(graph, r, k, position, fake_mode, refake) for k in range(len(r.chunks))]
    for target, k in r.targets.items():
        target.replace_all_uses_with(chunks[k][0][target.args[0]])
        graph.erase_node(target)
    # whole tensors of the region that something else reads: the cat of the chunks' copies
    for n in r.order:
        if any(u not in r.bounds for u in n.users):
            with graph.inserting_before(n):
                whole = graph.call_function(_ATEN.cat.default, ([copies[n] for copies, _ in chunks], 0))
            whole.meta["val"] = n.meta["val"]
            for u in [u for u in n.users if u not in r.bounds]:
                u.replace_input_with(n, whole)
    for n in reversed(r.order):
        graph.erase_node(n)
    if not r.cat.users:
        graph.erase_node(r.cat)
    for copies, emit in chunks:
        _hoist_after(graph, emit.inserted[-1], set(emit.inserted))


def run_chunks_through_pointwise(graph: torch.fx.Graph) -> int:
    """Rewrite ``graph`` in place as [Note: chunks through pointwise ops] says; return how many
    regions were rewritten."""
    done = 0
    for cat in [n for n in graph.nodes if n.target is _ATEN.cat.default]:
        position = {n: i for i, n in enumerate(graph.nodes)}
        r = _match(cat, position)
        if r is None:
            continue
        _rewrite(graph, r)
        done += 1
    if done:
        graph.lint()
        logger.debug("chunked pointwise: %d regions run per chunk", done)
    return done
