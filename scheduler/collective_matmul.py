"""FX graph pass: split tensor-parallel collective matmuls into chunks, so each chunk's collective
overlaps another chunk's matmul.

Megatron-style sequence parallelism ([seq, batch, hidden] activations sharded on seq) runs a
column-parallel linear on an all-gathered input and a row-parallel linear into a reduce-scatter.
In a compiled graph (torch's DTensor TP, or functional collectives by hand) these are:

=====================  =======================================================================
pattern                post-grad nodes (``w`` ranks, ``s`` rows of dim 0 per rank)
=====================  =======================================================================
(a) all-gather -> mm   ``all_gather_into_tensor(x, w, g)`` -> ``wait_tensor`` -> views ->
                       ``mm(rows, B)`` / ``addmm(bias, rows, B)``: the gathered tensor is the
                       matmul's left operand, its rows whole blocks of gathered dim 0
(b) mm -> scatter      ``mm(A, B)`` / ``addmm(bias, A, B)`` -> views -> ``reduce_scatter_tensor(
                       y, op, w, g)`` -> ``wait_tensor``: the scattered dim 0 is whole blocks of
                       the matmul's rows
=====================  =======================================================================

"Views" are ``view`` / ``reshape`` / ``_unsafe_view`` nodes that only merge (a) or split (b) the
leading dims: the last dims, whose product is the matmul's column count, are untouched, so row
``i`` of the matmul is a contiguous block of dim 0. The rewrite, with ``c`` chunks:

* (a): ``c`` all-gathers, chunk ``k`` of the rows ``k*s/c .. (k+1)*s/c`` of each rank's shard, all
  issued where the original was; per chunk a wait, the views and the matmul on ``w*s/c`` rows; the
  outputs re-assembled rank-major (viewed ``(w, rows/w/c, n)``, concatenated on dim 1). Other
  readers of the gathered tensor (the backward's weight gradient, a tensor saved for the backward)
  read it re-assembled the same way, placed just before the first of them.
* (b): per chunk ``k`` a matmul of the rows that go to chunk ``k`` of each rank's result (rows
  ``r*s + k*s/c ..`` for every rank ``r``, copied contiguous), its reduce-scatter right after it;
  the ``c`` results concatenated on dim 0. The matmul's output (and the views) must have no other
  reader.

The waits are then placed by the overlap pass (``scheduler.graph_pass``, which runs after this one):
each just before its first use, so chunk ``k``'s collective runs during another chunk's matmul.

Chunk count: ``chunks`` at most, lowered until the rows of dim 0 per rank divide by it and every
chunk's matmul has at least ``MIN_ROWS`` rows; 1 means no rewrite. Anything else (another gather
dim, views that touch the last dims, sizes that do not divide, symbolic sizes, a bias that is not
1-D) is left unchanged.

Values: the rows of a matmul are independent and each chunk computes its rows from the same
operands, and a reduce-scatter reduces each element over the same ranks in the same order, so the
result is the same up to the matmul kernel's blocking (bitwise on CPU in the tests).
"""
from __future__ import annotations

import logging
import math
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


def _rows_are_dim0_blocks(outer: tuple[int, ...], rows2d: tuple[int, ...]) -> bool:
    """Is the 2-D ``rows2d`` a view of ``outer`` that merges its leading dims only (its columns are
    the product of a suffix of ``outer``'s dims, at least the last)?"""
    if len(rows2d) != 2 or len(outer) < 1:
        return False
    for j in range(len(outer) - 1, 0, -1):
        if math.prod(outer[j:]) == rows2d[1]:
            return math.prod(outer[:j]) == rows2d[0]
        if math.prod(outer[j:]) > rows2d[1]:
            return False
    return False


def _chunks_for(chunks: int, per_rank_dim0: int, mm_rows: int) -> int:
    c = chunks
    while c > 1 and (per_rank_dim0 % c or mm_rows // c < MIN_ROWS):
        c -= 1
    return c


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
    chain: list[torch.fx.Node]  # the views from the wait's result to the matmul's left operand
    mm: torch.fx.Node
    chunks: int


@dataclass
class _Scatter:
    """Pattern (b)."""

    mm: torch.fx.Node
    chain: list[torch.fx.Node]  # views from the matmul to the reduce-scatter's input
    scatter: torch.fx.Node
    wait: torch.fx.Node
    chunks: int


def _single_wait(collective: torch.fx.Node) -> Optional[torch.fx.Node]:
    users = list(collective.users)
    if len(users) != 1 or users[0].target is not WAIT_TENSOR:
        return None
    return users[0]


def _match_gather(node: torch.fx.Node, chunks: int) -> Optional[_Gather]:
    if node.target is not ALL_GATHER or node.kwargs or len(node.args) != 3:
        return None
    x, size, _ = node.args
    wait = _single_wait(node)
    x_shape, g_shape = _shape(x), _shape(wait) if wait is not None else None
    if wait is None or x_shape is None or g_shape is None or not isinstance(size, int) or not x_shape:
        return None
    # Depth-first over view users: the first mm / addmm reading a view of the gathered rows as its
    # left operand.
    stack: list[tuple[torch.fx.Node, list[torch.fx.Node]]] = [(wait, [])]
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
                if rows2d is None or not _rows_are_dim0_blocks(g_shape, rows2d):
                    continue
                c = _chunks_for(chunks, x_shape[0], rows2d[0])
                if c > 1:
                    return _Gather(node, wait, chain, user, c)
    return None


def _match_scatter(node: torch.fx.Node, chunks: int) -> Optional[_Scatter]:
    if node.target not in _MATMULS:
        return None
    parts = _matmul_parts(node)
    out_shape = _shape(node)
    if parts is None or out_shape is None or len(out_shape) != 2:
        return None
    chain: list[torch.fx.Node] = []
    value = node
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
    if user.target is not REDUCE_SCATTER or user.kwargs or len(user.args) != 4 or user.args[0] is not value:
        return None
    size = user.args[2]
    wait = _single_wait(user)
    y_shape = _shape(value)
    if wait is None or not isinstance(size, int) or y_shape is None or not y_shape or y_shape[0] % size:
        return None
    if not _rows_are_dim0_blocks(y_shape, out_shape):
        return None
    c = _chunks_for(chunks, y_shape[0] // size, out_shape[0])
    return _Scatter(node, chain, user, wait, c) if c > 1 else None


def _view(emit: _Emitter, node: torch.fx.Node, shape: list[int]) -> torch.fx.Node:
    return emit(_ATEN.view.default, node, shape)


def _rank_major(emit: _Emitter, parts: list[torch.fx.Node], size: int, shape: tuple[int, ...]) -> torch.fx.Node:
    """Chunk results (each rank-major: ``size`` blocks of rows) interleaved back into ``shape``:
    rank r's blocks of chunks 0..c-1, then rank r+1's."""
    blocks = [_view(emit, p, [size, -1]) for p in parts]
    return _view(emit, emit(_ATEN.cat.default, blocks, 1), list(shape))


def _rewrite_gather(graph: torch.fx.Graph, m: _Gather, fake_mode: Any, refake: bool) -> None:
    x, size, group = m.gather.args
    step = _shape(x)[0] // m.chunks  # type: ignore[index]
    bias, left, right = _matmul_parts(m.mm)  # type: ignore[misc]
    rows, cols = _shape(left)  # type: ignore[misc]
    chain = set(m.chain)
    readers = [u for n in [m.wait, *m.chain] for u in n.users if u not in chain and u is not m.mm]
    position = {n: i for i, n in enumerate(graph.nodes)}
    emit = _Emitter(graph, m.gather, fake_mode, refake)
    try:
        gathers = [emit(ALL_GATHER, emit(_ATEN.slice.Tensor, x, 0, k * step, (k + 1) * step), size, group)
                   for k in range(m.chunks)]
        waits: list[torch.fx.Node] = []
        first = min(readers, key=position.__getitem__) if readers else None
        # Each chunk's wait goes right before its matmul (in graph order, which the overlap pass
        # keeps when it has to issue something early), unless another reader comes first.
        early = first is not None and position[first] < position[m.mm]
        if early:
            emit.anchor = m.wait
            waits = [emit(WAIT_TENSOR, g) for g in gathers]
        emit.anchor = m.mm
        outs = []
        for k in range(m.chunks):
            w = waits[k] if early else emit(WAIT_TENSOR, gathers[k])
            if not early:
                waits.append(w)
            a = _view(emit, w, [rows // m.chunks, cols])
            outs.append(emit(m.mm.target, *((bias, a, right) if bias is not None else (a, right))))
        result = _rank_major(emit, outs, size, _shape(m.mm))  # type: ignore[arg-type]
        full = None
        if first is not None:  # other readers of the gathered tensor (or its views) read it re-assembled
            emit.anchor = first
            full = _rank_major(emit, waits, size, _shape(m.wait))  # type: ignore[arg-type]
    except Exception:
        for node in reversed(emit.inserted):  # nothing of the original graph uses them yet
            graph.erase_node(node)
        raise
    m.mm.replace_all_uses_with(result)
    graph.erase_node(m.mm)
    if full is not None:
        m.wait.replace_all_uses_with(full)
        for v in m.chain:  # the views right after the wait move down to their new input
            first.prepend(v)  # type: ignore[union-attr]
    for v in reversed(m.chain):
        if not v.users:
            graph.erase_node(v)
    graph.erase_node(m.wait)
    graph.erase_node(m.gather)


def _rewrite_scatter(graph: torch.fx.Graph, m: _Scatter, fake_mode: Any, refake: bool) -> None:
    y, op, size, group = m.scatter.args
    bias, left, right = _matmul_parts(m.mm)  # type: ignore[misc]
    rows, cols = _shape(left)  # type: ignore[misc]
    y_shape = _shape(y)
    emit = _Emitter(graph, m.mm, fake_mode, refake)
    try:
        per_chunk = emit(_ATEN.reshape.default, left, [size, m.chunks, rows // size // m.chunks, cols])
        waits = []
        for k in range(m.chunks):
            part = emit(_ATEN.slice.Tensor, per_chunk, 1, k, k + 1)
            a = emit(_ATEN.reshape.default, emit(_ATEN.clone.default, part), [rows // m.chunks, cols])
            out = emit(m.mm.target, *((bias, a, right) if bias is not None else (a, right)))
            out = _view(emit, out, [y_shape[0] // m.chunks, *y_shape[1:]])  # type: ignore[index]
            waits.append(emit(WAIT_TENSOR, emit(REDUCE_SCATTER, out, op, size, group)))
        emit.anchor = m.wait
        result = emit(_ATEN.cat.default, waits, 0)
    except Exception:
        for node in reversed(emit.inserted):
            graph.erase_node(node)
        raise
    m.wait.replace_all_uses_with(result)
    graph.erase_node(m.wait)
    graph.erase_node(m.scatter)
    for v in reversed(m.chain):
        graph.erase_node(v)
    graph.erase_node(m.mm)


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
        if found is not None and not any(found.mm is m.mm for m in matches):
            matches.append(found)
    if not matches:
        return 0
    vals = [(m.gather.args[0] if isinstance(m, _Gather) else m.mm).meta["val"] for m in matches]
    fake_mode, refake = _fake_mode(vals)
    done = 0
    for m in matches:
        try:
            (_rewrite_gather if isinstance(m, _Gather) else _rewrite_scatter)(graph, m, fake_mode, refake)
        except Exception as e:  # noqa: BLE001 - a failed shape computation must not break the graph
            logger.warning("collective matmul: left %s unsplit: %s", m.mm.name, e)
            continue
        done += 1
    graph.lint()
    return done
