"""FX graph pass: split tensor-parallel collective matmuls into chunks, so each chunk's collective
overlaps another chunk's matmul.

Sequence parallelism (activations sharded on the sequence dim) runs a column-parallel linear on an
all-gathered input and a row-parallel linear into a reduce-scatter. In a compiled graph (torch's
DTensor TP, or functional collectives by hand) these are, on torch 2.13:

=====================  =======================================================================
pattern                post-grad nodes (``w`` ranks, ``s`` = the shard's size on dim ``d``)
=====================  =======================================================================
(a) all-gather -> mm   ``all_gather_into_tensor(x, w, g)`` -> ``wait_tensor`` [-> ``split(n, 0)``
                       -> its ``w`` items -> ``cat(d)``] -> views -> ``mm(rows, B)`` /
                       ``addmm(bias, rows, B)``: the gathered tensor is the left operand
(b) mm -> scatter      ``mm(A, B)`` / ``addmm(bias, A, B)`` -> views [-> ``split(s, d)`` -> its
                       ``w`` items -> ``cat(0)``] -> ``reduce_scatter_tensor(y, op, w, g)`` ->
                       ``wait_tensor``
(c) sum -> scatter     as (b), but what is scattered is ``add.Tensor`` s of several matmuls of
                       one shape, each viewed alike (the input gradient of q, k and v's shared
                       input under torchtitan's plan, which gathers it once for the three)
=====================  =======================================================================

``d`` is 0 for Megatron's [seq, batch, hidden] layout (DTensor's ``Shard(0)``: one collective on
dim 0, nothing in brackets); for another dim (``Shard(1)`` of [batch, seq, hidden]) functional
collectives add the bracketed split / cat. "Views" are ``view`` / ``reshape`` / ``_unsafe_view``
nodes that only merge (a) or split (b) leading dims, ``d`` among them: the last dims, whose product
is the matmul's column count, are untouched, so the matmul's rows are blocks of dim ``d``. The
rewrite, with ``c`` chunks:

* (a): ``c`` all-gathers, chunk ``k`` of the slice ``k*s/c .. (k+1)*s/c`` of dim ``d`` of each
  rank's shard, all issued where the original was; per chunk a wait (right before its matmul in
  graph order), the split / cat when ``d > 0``, a view and the matmul on ``1/c`` of the rows; the
  outputs re-assembled rank-major (viewed ``(prefix, w, -1)``, concatenated on dim 2, ``prefix`` =
  the product of the dims before ``d``). Other readers of the gathered tensor (the backward's
  weight gradient, a tensor saved for the backward) read it re-assembled the same way, placed just
  before the first of them (when that comes before the matmul, the waits go there too).
* (b): per chunk ``k`` a matmul of the rows that go to chunk ``k`` of each rank's result (viewed
  ``(prefix, w, c, -1, K)``, slice ``k`` of dim 2, copied contiguous), its reduce-scatter right
  after it; the ``c`` results concatenated on dim ``d``. The matmul's output (and the views, split
  and cat) must have no other reader.
* (c): per chunk ``k`` every term's matmul on its rows of chunk ``k``, added in the graph's order
  (the same per-element sum), then the chunk's reduce-scatter; placed where the last add was. No
  term, partial sum or view may have another reader.

Where ``d > 0`` and dim 0 divides into as many chunks, chunk ``k`` is instead the ``k``-th block of
dim 0 (the batch) and the results are concatenated on dim 0 ([Note: cutting the leading dim]).

The waits are then placed by the overlap pass (``scheduler.graph_pass``, which runs after this one):
each just before its first use, so chunk ``k``'s collective runs during another chunk's matmul.

[Note: cutting the leading dim]
When ``d > 0`` (``Shard(1)`` of [batch, seq, hidden]) the chunks above interleave: chunk ``k``'s
matmul rows are, for every batch index, a sub-slice of every rank's block, so its results (and the
gathered input kept for the backward) are put back together rank-major by a copy, and the
scattered matmul's rows are gathered into a contiguous buffer (a ``clone``) first. Cutting dim 0
(the batch) instead avoids both: chunk ``k`` all-gathers (reduce-scatters) the ``k``-th block of
batch indices, which is a whole ``[batch / c, seq, hidden]`` tensor after the split / cat, its
matmul rows are consecutive rows of the full matmul (read in place, written to a block of the
result: a dim-0 ``cat``), and the chunks hold the same elements in the same sums. So dim 0 is cut
whenever it gives as many chunks as cutting ``d`` would (its size divides by them), else ``d``.
A profile of the 2-chunk split of a sequence-parallel MLP on CPU (2 ranks) had put the re-assembly
copies at about as much time as the extra collectives.

Chunk count: ``chunks`` at most, lowered until the cut dim's per-rank size (``s``, or dim 0's)
divides by it and every chunk's matmul has at least ``MIN_ROWS`` rows; 1 means no rewrite.
Anything else (a gather on the matmul's columns, views that touch the last dims, sizes that do not
divide, symbolic sizes, a bias that is not 1-D, a dtype cast or other op between the collective and
the matmul) is left unchanged. Every matmul
that reads the gathered rows so (the q, k and v projections of one gathered input) is split, each
at its own place, on the same chunks.

Values: the rows of a matmul are independent and each chunk computes its rows from the same
operands, and a reduce-scatter reduces each element over the same ranks in the same order, so the
result is the same up to the matmul kernel's blocking (bitwise on CPU in the tests).
"""
from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx

from scheduler.bucketing import _Emitter, _fake_mode
from scheduler.fx_nodes import ALL_GATHER, REDUCE_SCATTER, WAIT_TENSOR

__all__ = ["MIN_ROWS", "check_chunks", "decompose_collective_matmuls"]

logger = logging.getLogger("scheduler")

_ATEN = torch.ops.aten
MIN_ROWS = 16
"""Fewest matmul rows per chunk: below it, a chunk's matmul is too small to hide anything."""

_VIEWS = frozenset({_ATEN.view.default, _ATEN.reshape.default, _ATEN._unsafe_view.default})
_MATMULS = frozenset({_ATEN.mm.default, _ATEN.addmm.default})


def check_chunks(chunks: object) -> None:
    """Raise unless ``chunks`` is None or an int >= 1."""
    if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int)):
        raise TypeError(f"collective_matmul_chunks must be an int or None, got {type(chunks).__name__}")
    if chunks is not None and chunks < 1:
        raise ValueError(f"collective_matmul_chunks must be >= 1, got {chunks}")


def _shape(node: Any) -> Optional[tuple[int, ...]]:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    shape = getattr(val, "shape", None)
    if shape is None or any(type(d) is not int for d in shape):
        return None
    return tuple(shape)


def _merged_leading_dims(outer: tuple[int, ...], rows2d: tuple[int, ...]) -> int:
    """How many leading dims of ``outer`` the 2-D ``rows2d`` merges into its rows (its columns the
    product of the other dims, at least the last one); 0 when it is not such a view."""
    if len(rows2d) != 2:
        return 0
    for j in range(len(outer) - 1, 0, -1):
        if math.prod(outer[j:]) == rows2d[1]:
            return j if math.prod(outer[:j]) == rows2d[0] else 0
        if math.prod(outer[j:]) > rows2d[1]:
            return 0
    return 0


def _chunks_for(chunks: int, per_rank_dim0: int, mm_rows: int) -> int:
    c = chunks
    while c > 1 and (per_rank_dim0 % c or mm_rows // c < MIN_ROWS):
        c -= 1
    return c


def _chunking(chunks: int, dim: int, shard: tuple[int, ...], mm_rows: list[int]) -> tuple[int, bool]:
    """(chunk count, whether to cut dim 0) for a collective on ``dim`` of a tensor whose per-rank
    shape is ``shard``, feeding or fed by matmuls of ``mm_rows`` rows: dim 0 when ``dim > 0`` and it
    gives as many chunks as cutting ``dim`` would (see [Note: cutting the leading dim])."""
    on_dim = min(_chunks_for(chunks, shard[dim], rows) for rows in mm_rows)
    if dim == 0:
        return on_dim, False
    on_lead = min(_chunks_for(chunks, shard[0], rows) for rows in mm_rows)
    return (on_lead, True) if on_lead >= on_dim else (on_dim, False)


def _matmul_parts(mm: torch.fx.Node) -> Optional[tuple[Any, torch.fx.Node, Any]]:
    """(bias or None, left operand, right operand) of an mm / addmm with a 1-D (or no) bias."""
    if mm.kwargs:
        return None
    if mm.target is _ATEN.mm.default:
        return None, mm.args[0], mm.args[1]
    bias, a, b = mm.args[:3]
    shape = _shape(bias)
    if len(mm.args) != 3 or shape is None or len(shape) != 1:
        return None
    return bias, a, b


@dataclass
class _Gather:
    """Pattern (a)."""

    gather: torch.fx.Node
    wait: torch.fx.Node
    dim: int  # the gathered dim: 0, or d when the wait is followed by ``split`` -> ``cat(dim=d)``
    moved: list[torch.fx.Node]  # that split, its items and the cat (empty for dim 0)
    mms: list[tuple[list[torch.fx.Node], torch.fx.Node]]  # (views from the gathered tensor, matmul)
    chunks: int
    leading: bool  # chunks of dim 0 (whole rows of the gathered dim) rather than of dim ``dim``

    @property
    def gathered(self) -> torch.fx.Node:
        return self.moved[-1] if self.moved else self.wait

    @property
    def matmuls(self) -> list[torch.fx.Node]:
        return [mm for _, mm in self.mms]


@dataclass
class _Scatter:
    """Pattern (b): one matmul, or (c) a sum of them, reduce-scattered."""

    terms: Any  # the matmul, or ``(left, right, add node)`` of terms: the sum, added in this order
    summed: list[torch.fx.Node]  # the sum's views and adds, from the matmuls to ``terms``' root
    chain: list[torch.fx.Node]  # views from the root (the matmul or the last add) to the scattered tensor
    dim: int  # the scattered dim: 0, or d when ``split(dim=d)`` -> ``cat`` comes before the scatter
    moved: list[torch.fx.Node]  # that split, its items and the cat (empty for dim 0)
    scatter: torch.fx.Node
    wait: torch.fx.Node
    chunks: int
    leading: bool  # chunks of dim 0 rather than of dim ``dim``

    @property
    def root(self) -> torch.fx.Node:
        return self.terms if isinstance(self.terms, torch.fx.Node) else self.terms[2]

    @property
    def matmuls(self) -> list[torch.fx.Node]:
        return _leaves(self.terms)


def _leaves(terms: Any) -> list[torch.fx.Node]:
    return [terms] if isinstance(terms, torch.fx.Node) else _leaves(terms[0]) + _leaves(terms[1])


def _single_wait(collective: torch.fx.Node) -> Optional[torch.fx.Node]:
    users = list(collective.users)
    if len(users) != 1 or users[0].target is not WAIT_TENSOR:
        return None
    return users[0]


def _split_cat(value: torch.fx.Node, size: int, split_dim: int, cat_dim: Optional[int]
               ) -> Optional[tuple[list[torch.fx.Node], int]]:
    """``value`` -> ``split(value, n, split_dim)`` -> its ``size`` items, each read once, in order,
    by one ``cat``: what functional collectives emit to gather (cat on d) or scatter (split on d)
    another dim than 0. Returns (the split, the items, the cat; the other dim) or None."""
    users = list(value.users)
    if len(users) != 1 or users[0].target is not _ATEN.split.Tensor or users[0].kwargs:
        return None
    split = users[0]
    shape = _shape(value)
    if shape is None or len(split.args) < 2 or not isinstance(split.args[1], int):
        return None
    sdim = (split.args[2] if len(split.args) > 2 else 0) % len(shape)
    items = sorted(split.users, key=lambda u: u.args[1] if u.target is operator.getitem else -1)
    if sdim != split_dim or len(items) != size or split.args[1] * size != shape[sdim]:
        return None
    if [u.args[1] for u in items if u.target is operator.getitem] != list(range(size)):
        return None
    cats = {u for i in items for u in i.users}
    if len(cats) != 1 or any(len(i.users) != 1 for i in items):
        return None
    (cat,) = cats
    if cat.target is not _ATEN.cat.default or cat.kwargs or list(cat.args[0]) != items:
        return None
    cdim = (cat.args[1] if len(cat.args) > 1 else 0) % len(shape)
    other = cdim if cat_dim is None else sdim
    if (cat_dim is not None and cdim != cat_dim) or other == 0:
        return None
    return [split, *items, cat], other


def _match_gather(node: torch.fx.Node, chunks: int) -> Optional[_Gather]:
    if node.target is not ALL_GATHER or node.kwargs or len(node.args) != 3:
        return None
    x, size, _ = node.args
    wait = _single_wait(node)
    x_shape = _shape(x)
    if wait is None or x_shape is None or not isinstance(size, int) or not x_shape:
        return None
    moved: list[torch.fx.Node] = []
    dim = 0
    found = _split_cat(wait, size, 0, None)
    if found is not None:
        moved, dim = found
    gathered = moved[-1] if moved else wait
    g_shape = _shape(gathered)
    if g_shape is None or dim >= len(x_shape):
        return None
    # Depth-first over view users: every mm / addmm reading a view of the gathered rows as its
    # left operand (the q, k and v projections of one gathered input, say).
    stack: list[tuple[torch.fx.Node, list[torch.fx.Node]]] = [(gathered, [])]
    mms: list[tuple[list[torch.fx.Node], torch.fx.Node]] = []
    rows: list[int] = []
    while stack:
        value, chain = stack.pop()
        for user in value.users:
            if user.target in _VIEWS and user.args[0] is value:
                stack.append((user, chain + [user]))
            elif user.target in _MATMULS:
                parts = _matmul_parts(user)
                if parts is None or parts[1] is not value or parts[2] is value:
                    continue
                rows2d = _shape(value)
                if rows2d is None or _merged_leading_dims(g_shape, rows2d) <= dim:
                    continue
                mms.append((chain, user))
                rows.append(rows2d[0])
    if not mms:
        return None
    c, leading = _chunking(chunks, dim, x_shape, rows)
    return _Gather(node, wait, dim, moved, mms, c, leading) if c > 1 else None


def _sum_of_matmuls(node: torch.fx.Node, shape: tuple[int, ...], summed: list[torch.fx.Node]) -> Any:
    """``node`` as a sum of matmuls, each viewed as ``shape`` (the terms, see :class:`_Scatter`),
    every node read only by the next; None if it is not one. Collects the views and adds in
    ``summed``."""
    if len(node.users) != 1 or _shape(node) != shape:
        return None
    if node.target is _ATEN.add.Tensor:
        if (node.kwargs or len(node.args) != 2 or not all(isinstance(a, torch.fx.Node) for a in node.args)
                or node.args[0] is node.args[1]):  # y + y: one term read twice
            return None
        left = _sum_of_matmuls(node.args[0], shape, summed)
        right = _sum_of_matmuls(node.args[1], shape, summed) if left is not None else None
        if right is None:
            return None
        summed.append(node)
        return left, right, node
    views = []
    while node.target in _VIEWS:
        views.append(node)
        node = node.args[0]
        if not isinstance(node, torch.fx.Node) or len(node.users) != 1:
            return None
    if node.target not in _MATMULS or _matmul_parts(node) is None:
        return None
    summed.extend(reversed(views))
    return node


def _match_scatter(node: torch.fx.Node, chunks: int) -> Optional[_Scatter]:
    terms: Any = node
    summed: list[torch.fx.Node] = []
    if node.target is _ATEN.add.Tensor:  # (c): the input gradient of q, k and v's shared input, say
        shape = _shape(node)
        terms = _sum_of_matmuls(node, shape, summed) if shape is not None else None
        if terms is None or len({_shape(mm) for mm in _leaves(terms)}) != 1:  # one output shape for all
            return None
        node = _leaves(terms)[0]
    elif node.target not in _MATMULS:
        return None
    parts = _matmul_parts(node)
    out_shape = _shape(node)
    if parts is None or out_shape is None or len(out_shape) != 2:
        return None
    chain: list[torch.fx.Node] = []
    value = terms if isinstance(terms, torch.fx.Node) else terms[2]
    while True:
        users = list(value.users)
        if len(users) != 1:
            return None
        (user,) = users
        if user.target in _VIEWS and user.args[0] is value:
            chain.append(user)
            value = user
            continue
        break
    y_shape = _shape(value)
    moved: list[torch.fx.Node] = []
    dim = 0
    if user.target is _ATEN.split.Tensor and y_shape:
        size = len(user.users)
        found = _split_cat(value, size, (user.args[2] if len(user.args) > 2 else 0) % len(y_shape), 0)
        if found is None or len(found[0][-1].users) != 1:
            return None
        moved, dim = found
        (user,) = moved[-1].users
    if user.target is not REDUCE_SCATTER or user.kwargs or len(user.args) != 4:
        return None
    if user.args[0] is not (moved[-1] if moved else value):
        return None
    size = user.args[2]
    wait = _single_wait(user)
    if wait is None or not isinstance(size, int) or y_shape is None or not y_shape or y_shape[dim] % size:
        return None
    if moved and len(moved) != size + 2:
        return None
    if _merged_leading_dims(y_shape, out_shape) <= dim:
        return None
    shard = (*y_shape[:dim], y_shape[dim] // size, *y_shape[dim + 1:])
    c, leading = _chunking(chunks, dim, shard, [out_shape[0]])
    return _Scatter(terms, summed, chain, dim, moved, user, wait, c, leading) if c > 1 else None


def _view(emit: _Emitter, node: torch.fx.Node, shape: list[int]) -> torch.fx.Node:
    return emit(_ATEN.view.default, node, shape)


def _rank_major(emit: _Emitter, parts: list[torch.fx.Node], size: int, prefix: int,
                shape: tuple[int, ...]) -> torch.fx.Node:
    """Chunk results interleaved back into ``shape``. Each part holds, for every one of ``prefix``
    leading indices, ``size`` rank blocks; the result holds rank r's blocks of chunks 0..c-1, then
    rank r+1's."""
    blocks = [_view(emit, p, [prefix, size, -1]) for p in parts]
    return _view(emit, emit(_ATEN.cat.default, blocks, 2), list(shape))


def _dim_cat(emit: _Emitter, value: torch.fx.Node, size: int, dim: int) -> torch.fx.Node:
    """A dim-0 all-gather's result with its ``size`` rank blocks concatenated on ``dim`` instead."""
    if dim == 0:
        return value
    step = _shape(value)[0] // size  # type: ignore[index]
    return emit(_ATEN.cat.default, [emit(_ATEN.slice.Tensor, value, 0, r * step, (r + 1) * step)
                                    for r in range(size)], dim)


def _dim_split(emit: _Emitter, value: torch.fx.Node, size: int, dim: int) -> torch.fx.Node:
    """``value``'s ``size`` blocks of ``dim`` stacked on dim 0, what a dim-0 reduce-scatter takes."""
    if dim == 0:
        return value
    step = _shape(value)[dim] // size  # type: ignore[index]
    return emit(_ATEN.cat.default, [emit(_ATEN.slice.Tensor, value, dim, r * step, (r + 1) * step)
                                    for r in range(size)], 0)


def _rewrite_gather(graph: torch.fx.Graph, m: _Gather, fake_mode: Any, refake: bool) -> None:
    x, size, group = m.gather.args
    cut = 0 if m.leading else m.dim
    step = _shape(x)[cut] // m.chunks  # type: ignore[index]
    g_shape = _shape(m.gathered)
    prefix = math.prod(g_shape[:m.dim])  # type: ignore[index]
    position = {n: i for i, n in enumerate(graph.nodes)}
    mms = sorted(m.mms, key=lambda cm: position[cm[1]])
    matmuls = set(m.matmuls)
    chain = sorted({v for c, _ in mms for v in c}, key=position.__getitem__)
    readers = [u for n in [m.gathered, *chain] for u in n.users if u not in chain and u not in matmuls]
    emit = _Emitter(graph, m.gather, fake_mode, refake)

    def assembled(parts: list[torch.fx.Node], shape: tuple[int, ...]) -> torch.fx.Node:
        """Per-chunk results (rows of the gathered tensor, or of a matmul on it) as one tensor."""
        if m.leading:
            return emit(_ATEN.cat.default, parts, 0)
        return _rank_major(emit, parts, size, prefix, shape)

    try:
        gathers = [emit(ALL_GATHER, emit(_ATEN.slice.Tensor, x, cut, k * step, (k + 1) * step), size, group)
                   for k in range(m.chunks)]
        parts: list[torch.fx.Node] = []
        first = min(readers, key=position.__getitem__) if readers else None
        # Each chunk's wait goes right before the first matmul's chunk (in graph order, which the
        # overlap pass keeps when it has to issue something early), unless another reader comes first.
        if first is not None and position[first] < position[mms[0][1]]:
            emit.anchor = m.wait
            parts = [_dim_cat(emit, emit(WAIT_TENSOR, g), size, m.dim) for g in gathers]
        results = []
        for _, mm in mms:
            bias, left, right = _matmul_parts(mm)  # type: ignore[misc]
            rows, cols = _shape(left)  # type: ignore[misc]
            emit.anchor = mm
            outs = []
            for k in range(m.chunks):
                if k == len(parts):
                    parts.append(_dim_cat(emit, emit(WAIT_TENSOR, gathers[k]), size, m.dim))
                a = _view(emit, parts[k], [rows // m.chunks, cols])
                outs.append(emit(mm.target, *((bias, a, right) if bias is not None else (a, right))))
            results.append(assembled(outs, _shape(mm)))  # type: ignore[arg-type]
        full = None
        if first is not None:  # other readers of the gathered tensor (or its views) read it re-assembled
            emit.anchor = first
            full = assembled(parts, g_shape)  # type: ignore[arg-type]
    except Exception:
        for node in reversed(emit.inserted):  # nothing of the original graph uses them yet
            graph.erase_node(node)
        raise
    for (_, mm), result in zip(mms, results):
        mm.replace_all_uses_with(result)
        graph.erase_node(mm)
    if full is not None:
        m.gathered.replace_all_uses_with(full)
        for v in chain:  # the views right after the wait move down to their new input
            first.prepend(v)  # type: ignore[union-attr]
    for v in reversed(chain):
        if not v.users:
            graph.erase_node(v)
    for n in reversed([m.gather, m.wait, *m.moved]):
        graph.erase_node(n)


def _rewrite_scatter(graph: torch.fx.Graph, m: _Scatter, fake_mode: Any, refake: bool) -> None:
    _, op, size, group = m.scatter.args
    y_shape = _shape(m.chain[-1] if m.chain else m.root)
    prefix = math.prod(y_shape[:m.dim])  # type: ignore[index]
    cut = 0 if m.leading else m.dim
    chunk_shape = list(y_shape)  # type: ignore[arg-type]
    chunk_shape[cut] //= m.chunks
    emit = _Emitter(graph, m.root, fake_mode, refake)
    try:
        per_chunk = {}  # matmul -> its left operand's rows, viewed (prefix, w, c, -1, cols); cut on d only
        if not m.leading:
            for mm in m.matmuls:
                _, left, _ = _matmul_parts(mm)  # type: ignore[misc]
                per_chunk[mm] = emit(_ATEN.reshape.default, left, [prefix, size, m.chunks, -1, _shape(left)[1]])

        def chunk_of(terms: Any, k: int) -> torch.fx.Node:
            """Chunk ``k``'s rows of ``terms``: each matmul's on those rows, added as the graph adds."""
            if not isinstance(terms, torch.fx.Node):
                return emit(_ATEN.add.Tensor, chunk_of(terms[0], k), chunk_of(terms[1], k))
            bias, left, right = _matmul_parts(terms)  # type: ignore[misc]
            rows, cols = _shape(left)  # type: ignore[misc]
            n = rows // m.chunks
            if m.leading:  # a block of consecutive rows: read in place
                a = emit(_ATEN.slice.Tensor, left, 0, k * n, (k + 1) * n)
            else:
                part = emit(_ATEN.slice.Tensor, per_chunk[terms], 2, k, k + 1)
                a = emit(_ATEN.reshape.default, emit(_ATEN.clone.default, part), [n, cols])
            return emit(terms.target, *((bias, a, right) if bias is not None else (a, right)))

        waits = []
        for k in range(m.chunks):
            out = _dim_split(emit, _view(emit, chunk_of(m.terms, k), chunk_shape), size, m.dim)
            waits.append(emit(WAIT_TENSOR, emit(REDUCE_SCATTER, out, op, size, group)))
        emit.anchor = m.wait
        result = emit(_ATEN.cat.default, waits, cut)
    except Exception:
        for node in reversed(emit.inserted):
            graph.erase_node(node)
        raise
    m.wait.replace_all_uses_with(result)
    for n in reversed([*m.matmuls, *m.summed, *m.chain, *m.moved, m.scatter, m.wait]):
        graph.erase_node(n)


def decompose_collective_matmuls(graph: torch.fx.Graph, chunks: Optional[int] = 2) -> int:
    """Split each all-gather -> mm and mm -> reduce-scatter of ``graph`` into chunks, in place (see
    the module docstring). Returns how many were split (0: graph unchanged). A match whose rewrite
    fails is left as it was, with the reason logged on the ``"scheduler"`` logger."""
    if not isinstance(graph, torch.fx.Graph):
        raise TypeError(f"graph must be a torch.fx.Graph, got {type(graph).__name__}")
    check_chunks(chunks)
    if chunks is None or chunks == 1:
        return 0
    matches: list[Any] = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        found = _match_gather(node, chunks) or _match_scatter(node, chunks)
        if found is not None and not (set(found.matmuls) & {mm for m in matches for mm in m.matmuls}):
            matches.append(found)
    if not matches:
        return 0
    vals = [(m.gather.args[0] if isinstance(m, _Gather) else m.root).meta["val"] for m in matches]
    fake_mode, refake = _fake_mode(vals)
    done = 0
    for m in matches:
        try:
            (_rewrite_gather if isinstance(m, _Gather) else _rewrite_scatter)(graph, m, fake_mode, refake)
        except Exception as e:  # noqa: BLE001 - a failed shape computation must not break the graph
            logger.warning("collective matmul: left %s unsplit: %s", m.matmuls[0].name, e)
            continue
        done += 1
    graph.lint()
    return done
