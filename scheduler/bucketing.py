"""FX graph pass: merge small all-gathers (and reduce-scatters) on one group into one collective.

Each collective pays a fixed latency; many small ones (a block's biases and norms) waste the link.
:func:`bucket_collectives` finds ``_c10d_functional.all_gather_into_tensor`` /
``reduce_scatter_tensor`` nodes that could be issued together and replaces each such set by one
collective over a flat buffer:

=================  ==========================================================================
kind               rewrite (``w`` ranks, inputs ``x_i`` with ``n_i`` elements, offsets ``o_i``)
=================  ==========================================================================
all-gather         ``cat(flatten(x_i))`` -> all-gather -> wait -> viewed ``(w, sum n_i)``;
                   result ``i`` = columns ``o_i .. o_i + n_i``, copied contiguous, reshaped to
                   ``(w * d0_i, *rest_i)`` (rank-major, as the original collective returns it)
reduce-scatter     ``cat(x_i viewed (w, n_i / w), dim=1)`` flattened -> reduce-scatter -> wait;
                   result ``i`` = elements ``o_i / w ..`` viewed ``(d0_i / w, *rest_i)``
=================  ==========================================================================

Plain aten ops (``cat``, ``view``, ``slice``, ``clone``) do the packing: Inductor fuses each side
into one kernel, which is what the ``overlap_kernels`` packing ops do in eager code (these work on shard
layouts with padding, which compiled graphs of user collectives do not have).

Which collectives share a bucket: same op, group (size and name), reduce op and dtype; each waited
by exactly one ``wait_tensor``; static sizes known from ``node.meta["val"]``; each at most
``bucket_bytes`` and the bucket in total at most ``bucket_bytes``. A bucket is issued where its
first member was, so a later member joins only if its input is computed before that point (it is
never delayed past anything it waits for), and no barrier (a mutating or side-effectful op, see
``scheduler.fx_nodes``) lies in between. Buckets are formed by scanning the graph in order, so
every rank with the same graph forms the same buckets in the same order (per-group order is kept).

Values: an all-gather or reduce-scatter of a concatenation is the concatenation of the results for
every element, so results are bitwise equal (the reduction of each element runs over the same
ranks in the same order).
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx

from scheduler.fx_nodes import ALL_GATHER, BARRIER, OUTPUT, REDUCE_SCATTER, WAIT_TENSOR, BadGraph, classify, nbytes

__all__ = ["bucket_collectives", "check_bucket_bytes"]

logger = logging.getLogger("scheduler")

_ATEN = torch.ops.aten


def check_bucket_bytes(bucket_bytes: object) -> None:
    """Raise unless ``bucket_bytes`` is None or an int >= 1."""
    if bucket_bytes is not None and (isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int)):
        raise TypeError(f"bucket_bytes must be an int or None, got {type(bucket_bytes).__name__}")
    if bucket_bytes is not None and bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1 (bytes per merged collective), got {bucket_bytes}")


@dataclass
class _Bucket:
    key: tuple
    first_position: int
    members: list[torch.fx.Node] = field(default_factory=list)
    nbytes: int = 0


def _candidate(node: torch.fx.Node) -> Optional[tuple[tuple, int]]:
    """(bucket key, input bytes) if ``node`` is a collective this pass can merge, else None."""
    if node.op != "call_function" or node.target not in (ALL_GATHER, REDUCE_SCATTER) or node.kwargs:
        return None
    users = list(node.users)
    if len(users) != 1 or users[0].target is not WAIT_TENSOR:
        return None
    inp = node.args[0]
    if not isinstance(inp, torch.fx.Node):
        return None
    val = inp.meta.get("val")
    size_bytes = nbytes(val)
    if size_bytes is None or val.dim() == 0:
        return None
    if node.target is ALL_GATHER:
        _, size, group = node.args
        key: tuple = ("all_gather", size, group, val.dtype, val.device)
    else:
        _, op, size, group = node.args
        if val.shape[0] % size:
            return None
        key = ("reduce_scatter", op, size, group, val.dtype, val.device)
    return key, size_bytes


def _find_buckets(graph: torch.fx.Graph, bucket_bytes: int) -> list[_Bucket]:
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    kinds: dict[torch.fx.Node, str] = {}
    open_buckets: dict[tuple, _Bucket] = {}
    done: list[_Bucket] = []
    for i, node in enumerate(nodes):
        try:
            kind = classify(node, kinds)
        except BadGraph:
            kind = BARRIER
        kinds[node] = kind
        if kind in (BARRIER, OUTPUT):
            done.extend(open_buckets.values())
            open_buckets.clear()
            continue
        found = _candidate(node)
        if found is None:
            continue
        key, size_bytes = found
        if size_bytes > bucket_bytes:
            continue
        bucket = open_buckets.get(key)
        fits = (bucket is not None and bucket.nbytes + size_bytes <= bucket_bytes
                and position[node.args[0]] < bucket.first_position)
        if not fits:
            if bucket is not None:
                done.append(bucket)
            bucket = open_buckets[key] = _Bucket(key, i)
        bucket.members.append(node)
        bucket.nbytes += size_bytes
    done.extend(open_buckets.values())
    return [b for b in done if len(b.members) > 1]


class _Emitter:
    """Inserts nodes before ``anchor`` and gives each a ``meta["val"]`` computed on fake/meta values."""

    def __init__(self, graph: torch.fx.Graph, anchor: torch.fx.Node, fake_mode: Any, refake: bool) -> None:
        self.graph, self.anchor, self.fake_mode, self.refake = graph, anchor, fake_mode, refake
        self.inserted: list[torch.fx.Node] = []

    def _val(self, node: torch.fx.Node) -> Any:
        val = node.meta["val"]
        if self.refake and node not in self.inserted:  # a value of another fake mode: same metadata, ours
            with self.fake_mode:
                return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)
        return val

    def __call__(self, target: Any, *args: Any, kwargs: Optional[dict[str, Any]] = None) -> torch.fx.Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, args, kwargs)
        vals = torch.fx.node.map_arg(args, self._val)
        kwvals = torch.fx.node.map_arg(kwargs or {}, self._val)
        self.inserted.append(node)
        with self.fake_mode if self.fake_mode is not None else contextlib.nullcontext():
            node.meta["val"] = _value(target, vals, kwvals)
        return node


def _value(target: Any, args: Any, kwargs: Optional[dict[str, Any]] = None) -> Any:
    """The op's output as a fake/meta value. Collectives' shapes come from their schema's rule (their
    meta kernels look the group up, which hand-written graphs and fake groups do not have)."""
    if target is ALL_GATHER:
        x, size = args[0], args[1]
        return x.new_empty((x.shape[0] * size, *x.shape[1:]))
    if target is REDUCE_SCATTER:
        x, size = args[0], args[2]
        return x.new_empty((x.shape[0] // size, *x.shape[1:]))
    if target is WAIT_TENSOR:
        return args[0].new_empty(args[0].shape)
    return target(*args, **(kwargs or {}))


def _rewrite(graph: torch.fx.Graph, bucket: _Bucket, fake_mode: Any, refake: bool) -> None:
    emit = _Emitter(graph, bucket.members[0], fake_mode, refake)
    try:
        results = _emit_bucket(emit, bucket.members)
    except Exception:
        for node in reversed(emit.inserted):  # nothing of the original graph uses them yet
            graph.erase_node(node)
        raise
    for member, result in zip(bucket.members, results):
        (wait,) = member.users
        wait.replace_all_uses_with(result)
        graph.erase_node(wait)
        graph.erase_node(member)


def _emit_bucket(emit: _Emitter, members: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """The merged collective and each member's result, built from plain aten ops."""
    first = members[0]
    inputs = [m.args[0] for m in members]
    vals = [x.meta["val"] for x in inputs]
    size, group = (first.args[1], first.args[2]) if first.target is ALL_GATHER else (first.args[2], first.args[3])
    if first.target is ALL_GATHER:
        flat = emit(_ATEN.cat.default, [emit(_ATEN.view.default, x, [v.numel()]) for x, v in zip(inputs, vals)])
        total = sum(v.numel() for v in vals)
        gathered = emit(WAIT_TENSOR, emit(ALL_GATHER, flat, size, group))
        rows = emit(_ATEN.view.default, gathered, [size, total])
        offset, results = 0, []
        for v in vals:
            piece = emit(_ATEN.slice.Tensor, rows, 1, offset, offset + v.numel())
            dense = emit(_ATEN.clone.default, piece)
            results.append(emit(_ATEN.view.default, dense, [size * v.shape[0], *v.shape[1:]]))
            offset += v.numel()
    else:
        op = first.args[1]
        per_rank = [emit(_ATEN.view.default, x, [size, v.numel() // size]) for x, v in zip(inputs, vals)]
        total = sum(v.numel() for v in vals)
        flat = emit(_ATEN.view.default, emit(_ATEN.cat.default, per_rank, 1), [total])
        reduced = emit(WAIT_TENSOR, emit(REDUCE_SCATTER, flat, op, size, group))
        offset, results = 0, []
        for v in vals:
            chunk = v.numel() // size
            piece = emit(_ATEN.slice.Tensor, reduced, 0, offset, offset + chunk)
            results.append(emit(_ATEN.view.default, piece, [v.shape[0] // size, *v.shape[1:]]))
            offset += chunk
    return results


def _fake_mode(vals: list[Any]) -> tuple[Any, bool]:
    """The fake mode new nodes' values are made in, and whether inputs must be re-made in it.

    Inductor's graphs share one fake mode; ``make_fx`` graphs may carry values of several (then a
    fresh mode, inputs re-made from their metadata); hand-written graphs may carry meta tensors
    (no mode needed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        return torch._guards.detect_fake_mode(vals), False
    except AssertionError:
        return FakeTensorMode(), True


def bucket_collectives(graph: torch.fx.Graph, bucket_bytes: int) -> int:
    """Merge small collectives of ``graph`` in place (see the module docstring).

    Returns how many collectives were removed (0: graph unchanged). Raises ``TypeError`` /
    ``ValueError`` for bad arguments; a graph it cannot rewrite is left unchanged, with the reason
    logged on the ``"scheduler"`` logger.
    """
    if not isinstance(graph, torch.fx.Graph):
        raise TypeError(f"graph must be a torch.fx.Graph, got {type(graph).__name__}")
    check_bucket_bytes(bucket_bytes)
    if bucket_bytes is None:
        return 0
    buckets = _find_buckets(graph, bucket_bytes)
    if not buckets:
        return 0
    fake_mode, refake = _fake_mode([m.args[0].meta["val"] for b in buckets for m in b.members])
    removed = 0
    for bucket in buckets:
        try:
            _rewrite(graph, bucket, fake_mode, refake)
        except Exception as e:  # noqa: BLE001 - a failed shape computation must not break the graph
            logger.warning("bucketing: left %d collectives unmerged: %s", len(bucket.members), e)
            continue
        removed += len(bucket.members) - 1
    graph.lint()
    return removed

