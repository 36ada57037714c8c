"""FX graph pass: the ops between two split collective matmuls run chunk by chunk.

[Note: ops per chunk between split matmuls]
``scheduler.collective_matmul`` splits a sequence-parallel MLP cut on the batch ([Note: cutting
the leading dim]) into chunks, but the activation between its two matmuls still joins them::

    a_k = addmm(b1, rows of gathered chunk k, W1^T)                     k = 0 .. c-1
    h   = cat([a_0, ..., a_{c-1}], 0) -> reshape -> gelu's ops -> reshape
    y_k = addmm(b2 / w, slice(h, 0, chunk k's rows), W2^T) -> reduce-scatter chunk k

so no chunk's second matmul (nor its reduce-scatter) starts before the last chunk has been gathered
and multiplied: the link sits idle from the last gather chunk to the first scatter chunk. In an
attention block the same holds with q, k and v (three such cats) and the attention between them
and the output projection. This pass computes the ops between such ``cat`` s on dim 0 (the seeds)
and the slices per chunk, from the seeds' parts, when every one of them keeps the chunks' rows
apart:

* views (``view`` / ``reshape`` / ``_unsafe_view``) whose chunk boundaries fall on whole rows of dim
  0 of the result, and permutes that keep dim 0 first;
* pointwise ops (``torch.Tag.pointwise``, not mutating) and ``clone``, whose other tensor operands
  either broadcast over dim 0 (fewer dims, or size 1 there) or have the result's shape (those are
  sliced per chunk);
* ops that treat each row of dim 0 (each sequence) alone, on inputs and outputs whose dim 0 is
  those rows: CPU flash attention, forward and backward, without dropout (``_BATCH_OPS``: with
  dropout a chunk would draw other random numbers than the whole), and ``getitem`` of their
  results; their other tensor operands are sliced on dim 0 or broadcast over it (size 1).

Chunk 0's parts (q's, k's and v's first matmul chunks) and the outside operands, where made after
its first part, move up to follow it (when they and their inputs are pure ops and no write lies in
between). Each ``slice(.., 0, start, end)`` of exactly chunk ``k``'s
rows then reads chunk ``k``'s value, and the ops after it that need nothing later than chunk ``k``
(its matmul, the scatter's split / cat and the reduce-scatter's issue, with the pure ops they need
that come later, such as a row-parallel bias share; never a wait, nor anything from the first op
that may write on) move up to follow chunk ``k``'s ops. So chunk 0's second
matmul and reduce-scatter run while chunk 1 is still being gathered; in backward the same holds
from the output gradient's gather chunks through the activation's (or attention's) backward to
the input gradient's scatter chunks. Readers of a whole tensor of the region (saved for backward,
the weight gradients) read the ``cat`` of its chunks, rebuilt after the last chunk (a region whose
whole tensors are read before that is left alone).

Values are unchanged element for element: every element goes through the same ops. Only chunks of
consecutive rows are handled (the batch cut); the interleaved chunks of a sequence cut, and any
region with an op that mixes rows (a reduction over dim 0, a matmul over it, a permute that moves
it), are left alone.
"""
from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.fx

from scheduler.bucketing import _Emitter, _fake_mode
from scheduler.collective_matmul import _shape
from scheduler.fx_nodes import BARRIER, COLLECTIVE, COMPUTE, OUTPUT, classify

__all__ = ["run_ops_per_chunk"]

logger = logging.getLogger("scheduler")

_ATEN = torch.ops.aten
_VIEWS = frozenset({_ATEN.view.default, _ATEN.reshape.default, _ATEN._unsafe_view.default})


def _dropout_free(node: torch.fx.Node) -> bool:
    """Whether the attention ``node`` runs with ``dropout_p`` 0 (draws no random numbers)."""
    names = [a.name for a in node.target._schema.arguments]
    i = names.index("dropout_p")
    p = node.args[i] if i < len(node.args) else node.kwargs.get("dropout_p", 0.0)
    return p == 0


def _kind(node: torch.fx.Node) -> str:
    """The overlap pass's kind of ``node`` (``scheduler.fx_nodes.classify``): only ``COMPUTE`` may
    move or be copied per chunk; a ``BARRIER`` (a write, a seeded random op, a side effect) may not
    be passed. ``classify`` takes the attention forward for a seeded random op (its dropout); with
    ``dropout_p`` 0 it draws nothing and is compute."""
    if node.target in _BATCH_OPS and _dropout_free(node):
        return COMPUTE
    return classify(node, {})


def _pointwise(node: torch.fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags and _kind(node) == COMPUTE


def _view_bounds(bounds: list[int], src: tuple[int, ...], dst: tuple[int, ...]) -> Optional[list[int]]:
    """``bounds`` (row boundaries on dim 0 of ``src``) on dim 0 of its view ``dst``, or None where one
    does not fall on a whole row there."""
    if not dst:
        return None
    per_src, per_dst = math.prod(src[1:]), math.prod(dst[1:])
    if per_dst == 0 or any(b * per_src % per_dst for b in bounds):
        return None
    return [b * per_src // per_dst for b in bounds]


# Ops that keep every row of dim 0 to itself and act on it alone, dim 0 of each tensor input and of
# each output being the same rows (the batch): attention per sequence.
_BATCH_OPS = frozenset({_ATEN._scaled_dot_product_flash_attention_for_cpu.default,
                        _ATEN._scaled_dot_product_flash_attention_for_cpu_backward.default})


@dataclass
class _Region:
    """Nodes, from dim-0 ``cat`` s of chunk values (the seeds), that keep the chunks' rows apart."""

    seeds: list[torch.fx.Node]  # the cats, each of c parts
    bounds: dict[torch.fx.Node, list[int]]  # node -> its chunks' row boundaries on dim 0 (c + 1)
    order: list[torch.fx.Node]  # the other nodes, in graph order
    sliced: dict[torch.fx.Node, set[torch.fx.Node]]  # node -> outside operands it reads per chunk
    outside: list[torch.fx.Node] = field(default_factory=list)  # other tensors the region's ops read
    lift: list[torch.fx.Node] = field(default_factory=list)  # chunk 0's parts and those, made too late
    targets: dict[torch.fx.Node, int] = field(default_factory=dict)  # slice -> the chunk it reads

    @property
    def chunks(self) -> int:
        return len(self.seeds[0].args[0])

    def parts(self, k: int) -> list[torch.fx.Node]:
        return [seed.args[0][k] for seed in self.seeds]


def _chunk_of(node: torch.fx.Node, bounds: dict[torch.fx.Node, list[int]]) -> Optional[int]:
    """``k`` when ``node`` is ``slice(x, 0, start, end)`` of exactly chunk ``k``'s rows of ``x``."""
    if node.target is not _ATEN.slice.Tensor or node.kwargs or node.args[0] not in bounds:
        return None
    x, dim, start, end = (*node.args, 0, None, None)[:4]
    step = node.args[4] if len(node.args) > 4 else 1
    b = bounds[x]
    if dim != 0 or step != 1 or type(start) is not int or type(end) is not int:
        return None
    end = min(end, b[-1])
    for k, (lo, hi) in enumerate(zip(b, b[1:])):
        if (start, end) == (lo, hi):
            return k
    return None


def _seed_bounds(node: torch.fx.Node) -> Optional[list[int]]:
    if node.target is not _ATEN.cat.default or node.kwargs or len(node.args) != 2 or node.args[1] != 0:
        return None
    shapes = [_shape(p) for p in node.args[0]]
    if len(shapes) < 2 or any(s is None or not s for s in shapes):
        return None
    bounds = [0]
    for s in shapes:
        bounds.append(bounds[-1] + s[0])
    return bounds


def _row_bounds(node: torch.fx.Node, bounds: dict[torch.fx.Node, list[int]]
                ) -> Optional[tuple[list[int], set[torch.fx.Node]]]:
    """(``node``'s chunk boundaries, the outside operands it reads per chunk) when it keeps the
    chunks' rows apart (see the Note), else None."""
    if node.op != "call_function":
        return None
    target, out, val = node.target, _shape(node), node.meta.get("val")
    inside = [a for a in node.all_input_nodes if a in bounds]
    b = bounds[inside[0]]
    if any(bounds[a] != b for a in inside):
        return None
    if target in _VIEWS or target is _ATEN.permute.default or target is operator.getitem:
        src = node.args[0]
        if src not in bounds or inside != [src] or out is None or not out:
            return None
        if target in _VIEWS:
            new = _view_bounds(b, _shape(src), out)
            return (new, set()) if new is not None else None
        if target is _ATEN.permute.default:
            return (b, set()) if node.args[1][0] % len(out) == 0 else None
        return (b, set()) if isinstance(src.meta.get("val"), (tuple, list)) and out[0] == b[-1] else None
    if target in _BATCH_OPS:
        if not _dropout_free(node):  # a chunk's copy would draw other random numbers than the whole
            return None
        items = val if isinstance(val, (tuple, list)) else ()
        if not items or any(not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != b[-1] for t in items):
            return None
        per_chunk = set()
        for a in node.all_input_nodes:
            shape = _shape(a)
            if a in bounds and shape and shape[0] == b[-1]:
                continue
            if shape is None or not shape or shape[0] not in (1, b[-1]) or a in bounds:
                return None
            if shape[0] == b[-1] and b[-1] != 1:
                per_chunk.add(a)
        return b, per_chunk
    if not (_pointwise(node) or target is _ATEN.clone.default) or not out:
        return None
    if any(_shape(a) != out for a in inside):
        return None
    per_chunk = set()
    for a in node.all_input_nodes:
        if a in bounds:
            continue
        shape = _shape(a)
        if shape == out:
            per_chunk.add(a)  # its rows, sliced alike
        elif shape is None or not (len(shape) < len(out) or (len(shape) == len(out) and shape[0] == 1)):
            return None  # neither the same rows nor broadcast over them
    return b, per_chunk


def _regions(graph: torch.fx.Graph, skip: set[torch.fx.Node]) -> list[_Region]:
    """The graph's regions (connected through their ops), each with targets; seeds in ``skip`` ignored."""
    bounds: dict[torch.fx.Node, list[int]] = {}
    sliced: dict[torch.fx.Node, set[torch.fx.Node]] = {}
    parent: dict[torch.fx.Node, torch.fx.Node] = {}

    def root(n: torch.fx.Node) -> torch.fx.Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in graph.nodes:
        seed = None if n in skip else _seed_bounds(n)
        if seed is not None:
            bounds[n], parent[n] = seed, n
            continue
        if not any(a in bounds for a in n.all_input_nodes) or _chunk_of(n, bounds) is not None:
            continue
        found = _row_bounds(n, bounds)
        if found is None:
            continue
        bounds[n], sliced[n], parent[n] = found[0], found[1], n
        for a in n.all_input_nodes:
            if a in bounds and a is not n:
                parent[root(a)] = root(n)
    groups: dict[torch.fx.Node, _Region] = {}
    for n in graph.nodes:  # graph order
        if n in parent:
            r = groups.setdefault(root(n), _Region([], {}, [], {}))
            r.bounds[n] = bounds[n]
            if n in sliced:
                r.order.append(n)
                r.sliced[n] = sliced[n]
            else:
                r.seeds.append(n)
    regions = []
    for r in groups.values():
        for n in [*r.seeds, *r.order]:
            for user in n.users:
                k = _chunk_of(user, r.bounds)
                if k is not None:
                    r.targets[user] = k
        if r.targets and r.order and len({len(b) for b in r.bounds.values()}) == 1:
            regions.append(r)
    return regions


def _ready(graph: torch.fx.Graph, r: _Region) -> bool:
    """Whether ``r`` can be rewritten: its outside operands made (or movable) before its first
    chunk, no read moved above a write, and every reader of a whole tensor of it after its last
    chunk (where the whole is rebuilt)."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    r.outside = list(dict.fromkeys(a for n in r.order for a in n.all_input_nodes if a not in r.bounds))
    first = min(r.parts(0), key=position.__getitem__)
    late = _late_ancestors([*r.parts(0), *r.outside], lambda n: position[n] <= position[first])
    if late is None or any(n in r.bounds or n in r.parts(k) for n in late for k in range(1, r.chunks)):
        return False
    lift = sorted(late, key=position.__getitem__)
    if lift and _writes_between(first, lift[-1]):  # a read moved above a write could see old data
        return False
    last = position[max(r.parts(r.chunks - 1), key=position.__getitem__)]
    for n in r.order:
        readers = [u for u in n.users if u not in r.bounds and u not in r.targets]
        if readers and (_shape(n) is None or min(position[u] for u in readers) <= last):
            return False
    r.lift = lift
    return True


def _writes_between(first: torch.fx.Node, last: torch.fx.Node) -> bool:
    """Whether an op from ``first`` to ``last`` (graph order) is a barrier (may write a tensor)."""
    node = first
    while True:
        if _kind(node) == BARRIER:
            return True
        if node is last:
            return False
        node = node.next


def _late_ancestors(nodes: list[torch.fx.Node], ready: Callable[[torch.fx.Node], bool]
                    ) -> Optional[set[torch.fx.Node]]:
    """``nodes`` and their ancestors that are not ``ready``, or None when one of them cannot move up
    (not ``COMPUTE``: a wait, a collective, a barrier)."""
    late: set[torch.fx.Node] = set()
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if n in late or ready(n):
            continue
        if _kind(n) != COMPUTE:
            return None
        late.add(n)
        stack.extend(n.all_input_nodes)
    return late


def _emit_chunk(graph: torch.fx.Graph, r: _Region, k: int, position: dict[torch.fx.Node, int],
                fake_mode: Any, refake: bool) -> tuple[dict[torch.fx.Node, torch.fx.Node], _Emitter]:
    """Chunk ``k``'s copy of every region node, placed right after its parts and the outside tensors."""
    last = max([*r.parts(k), *r.outside], key=position.__getitem__)
    emit = _Emitter(graph, last.next, fake_mode, refake)
    copies: dict[torch.fx.Node, torch.fx.Node] = {seed: part for seed, part in zip(r.seeds, r.parts(k))}
    sliced: dict[torch.fx.Node, torch.fx.Node] = {}

    def chunk_arg(a: torch.fx.Node, n: torch.fx.Node) -> torch.fx.Node:
        if a in copies:
            return copies[a]
        if a in r.sliced[n]:  # an outside tensor of the same rows: sliced alike
            if a not in sliced:
                b = r.bounds[n]
                sliced[a] = emit(_ATEN.slice.Tensor, a, 0, b[k], b[k + 1])
            return sliced[a]
        return a  # broadcast over dim 0

    for n in r.order:
        if n.target in _VIEWS:
            b, out = r.bounds[n], _shape(n)
            copies[n] = emit(n.target, copies[n.args[0]], [b[k + 1] - b[k], *out[1:]])
        else:
            args = torch.fx.node.map_arg(n.args, lambda a: chunk_arg(a, n))
            kwargs = torch.fx.node.map_arg(n.kwargs, lambda a: chunk_arg(a, n))
            copies[n] = emit(n.target, *args, kwargs=dict(kwargs))
    return copies, emit


def _hoist_after(graph: torch.fx.Graph, last: torch.fx.Node, seeds: set[torch.fx.Node]) -> int:
    """Move the nodes after ``last`` that read ``seeds`` (or moved nodes), with the ``COMPUTE`` ops
    they also need from after ``last``, up to follow ``last``, in their order; never a wait, and
    nothing from the first barrier on (a read moved above a write could see old data). Returns how
    many."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    ready = set(seeds) | {n for n in graph.nodes if position[n] <= position[last]}
    moved = 0
    anchor = last
    node = last.next
    while _kind(node) not in (OUTPUT, BARRIER):
        following = node.next
        inputs = node.all_input_nodes
        if _kind(node) in (COMPUTE, COLLECTIVE) and any(a in seeds for a in inputs):
            needed = _late_ancestors([a for a in inputs if a not in ready], ready.__contains__)
            if needed is not None:
                for n in [*sorted(needed, key=position.__getitem__), node]:
                    anchor.append(n)
                    anchor = n
                    ready.add(n)
                    moved += 1
                seeds.add(node)
        node = following
    return moved


def _rewrite(graph: torch.fx.Graph, r: _Region) -> list[torch.fx.Node]:
    """Rewrite ``r``; return the cats it made (wholes rebuilt from the chunks)."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    anchor = min(r.parts(0), key=position.__getitem__)
    for n in r.lift:  # chunk 0's other parts and the outside operands, right after its first part
        anchor.append(n)
        anchor = n
    position = {n: i for i, n in enumerate(graph.nodes)}
    fake_mode, refake = _fake_mode([n.meta["val"] for n in [*r.seeds, *r.order]])
    chunks = [_emit_chunk(graph, r, k, position, fake_mode, refake) for k in range(r.chunks)]
    for target, k in r.targets.items():
        target.replace_all_uses_with(chunks[k][0][target.args[0]])
        graph.erase_node(target)
    # whole tensors of the region that something else reads: the cat of the chunks' copies, rebuilt
    # after the last chunk's
    after = chunks[-1][1].inserted[-1]
    wholes = []
    for n in r.order:
        readers = [u for u in n.users if u not in r.bounds]
        if readers:
            with graph.inserting_after(after):
                after = graph.call_function(_ATEN.cat.default, ([copies[n] for copies, _ in chunks], 0))
            after.meta["val"] = n.meta["val"]
            wholes.append(after)
            for u in readers:
                u.replace_input_with(n, after)
    for n in reversed(r.order):
        graph.erase_node(n)
    for seed in r.seeds:
        if not seed.users:
            graph.erase_node(seed)
    for copies, emit in chunks:
        _hoist_after(graph, emit.inserted[-1], set(emit.inserted))
    return wholes


def run_ops_per_chunk(graph: torch.fx.Graph) -> int:
    """Rewrite ``graph`` in place as [Note: ops per chunk between split matmuls] says; return how many
    regions were rewritten."""
    done, seen = 0, set()
    while True:
        ready = [r for r in _regions(graph, seen) if _ready(graph, r)]
        if not ready:
            break
        r = ready[0]
        seen.update(r.seeds)
        seen.update(_rewrite(graph, r))  # a rebuilt whole is no seed either
        done += 1
    if done:
        graph.lint()
        logger.debug("chunked pointwise: %d regions run per chunk", done)
    return done
