"""FX graph pass: issue each collective as early as it can go, wait for it as late as it can.

Input: an FX graph holding ``torch.ops._c10d_functional`` collectives, each waited on by
``_c10d_functional.wait_tensor`` (what ``make_fx`` and Inductor produce: the wait right after the
collective, before independent compute). Output: the same nodes in another order.

Contract
--------
* Nodes are only reordered: none is added, removed or rewritten, so every value is unchanged.
* The order stays topological, and every ``wait_tensor`` comes before every user of its result
  (and before any node that reads the collective's output directly).
* Collectives on one group keep their relative order; see [Note: same-group order].
* Barriers stay where they are and nothing moves across one: a barrier is any node that is not a
  known-functional ``call_function`` -- an op whose schema mutates an argument, a seeded random op,
  a side-effectful or higher-order op, ``call_method`` / ``call_module``, a placeholder (the node
  kinds: ``scheduler.fx_nodes``).
* A ``wait_tensor`` on the result of another ``wait_tensor`` (user code waiting again on a traced
  collective's result) waits on nothing; it is ordered like any compute node that reads the result.
* Bad input (a ``wait_tensor`` on something else that is not a collective, a collective result that is
  never waited, a ``_c10d_functional`` op this pass does not know, e.g. the in-place ``all_reduce_``,
  a read of a collective's output before its wait, a graph that is not topologically sorted)
  leaves the graph unchanged and logs the reason on the ``"scheduler"`` logger.

The order, per stretch of graph between two barriers
----------------------------------------------------
================  ===========================================================================
node              where it goes
================  ===========================================================================
collective        as soon as its inputs are ready and the previous collective on its group has
                  been issued, and, with ``max_inflight_bytes``, only while it fits in the
                  budget; never later than its original place among the compute nodes
wait_tensor       as late as possible: only when no compute node that does not need a pending
                  wait is ready (one that a collective reads first, then the oldest
                  collective's result; [Note: wait priority]); before the barrier / output if
                  nothing in the stretch uses it
compute           in original order among the ready ones; a node that needs a pending wait is
                  deferred behind independent compute (this is what makes room for overlap)
================  ===========================================================================

``max_inflight_bytes`` bounds the bytes of collectives issued but not yet waited (sizes from
``node.meta["val"]`` or ``node.meta["tensor_meta"]``). A collective is raised only while it fits;
at its original place it is issued anyway, after waiting for the oldest outstanding collectives
until it fits (or none are left). With a budget, a collective of unknown size is not moved and is
waited right after it is issued. Without a budget nothing limits how far waits sink.

Bucketing: with ``bucket_bytes``, small all-gathers / reduce-scatters that can be issued together are
first merged into one collective each (``scheduler.bucketing``); that rewrite adds and removes nodes
(values stay bitwise equal), and the contract above then holds for the merged graph.

Collective matmuls: with ``collective_matmul_chunks`` (the Inductor hook's default is 2), a sum of
reduce-scatters (q, k and v's input gradients) first becomes one reduce-scatter of the sum
(``scheduler.summed_scatters``; equal up to float rounding), then each
all-gather -> mm and mm -> reduce-scatter is then split into chunks (``scheduler.collective_matmul``;
values equal); where the batch is cut, the ops between two split matmuls that keep the batch
apart then run per chunk (``scheduler.per_chunk_ops``; values equal), and the reorder places the
chunks' waits, so that chunk k's collective overlaps another chunk's matmul.
"""
from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass, field
from typing import Any, Hashable, Optional

import torch
import torch.fx

from scheduler.bucketing import bucket_collectives, check_bucket_bytes
from scheduler.canonical_waits import canonicalize_waits
from scheduler.collective_matmul import check_chunks, decompose_collective_matmuls
from scheduler.fx_nodes import (
    BARRIER, COLLECTIVE, COLLECTIVE_OPS, COMPUTE, MEMBER, OUTPUT, WAIT, BadGraph, classify, group_of, is_coalesced,
    meta_value, nbytes,
)
from scheduler.per_chunk_ops import run_ops_per_chunk
from scheduler.summed_scatters import merge_summed_reduce_scatters

__all__ = ["overlap_pass", "overlap_graph", "COLLECTIVE_OPS"]

logger = logging.getLogger("scheduler")

# [Note: same-group order]
# A collective is matched across ranks by its position in its group's sequence: the n-th call on a
# process group on rank 0 meets the n-th call on that group on every other rank. If a pass put two
# collectives of one group in a different order on different ranks, they would pair up the wrong
# calls and hang or exchange the wrong bytes. This pass decides where to issue a collective from
# facts that may differ between ranks (what compute surrounds it, the sizes in the budget, the
# graph around a rank-dependent branch), so it never lets that decide the order within a group:
# each collective depends on the previous one of its group, and per-group sequences come out
# exactly as they went in. If the input graphs agree per group on every rank, so do the outputs.
# Collectives of *different* groups may change their relative order: each group is matched on its
# own (its own communicator / stream / gloo context), and for identical graphs the pass is
# deterministic, so every rank still issues the same overall sequence.

# [Note: wait priority]
# A wait is emitted only when no compute is ready, and then the ready waits go one at a time. A
# wait that a collective reads goes before those only compute reads: the collective is then
# issued at once (collectives rise as soon as they are ready) and more compute can hide it.
# Among the rest, the oldest collective's result goes first (then a coalesced collective's results
# in member order): collectives finish about in the order they were issued, so waiting for the
# oldest costs least. Two earlier rankings made the pass depend on the order it produces, so that
# run again on its own output it ranked the waits differently (Hypothesis found both; pinned in
# test_graph_pass.py and test_properties_graph_pass.py): by the input place of a wait's collective
# user (the pass moves collectives up), and by its first user's input place (the pass defers
# compute that needs a pending wait behind compute that does not). Whether a wait feeds a
# collective, and the order the collectives are issued in, come out the same on a second run.

# A collective's result tensor, as waited on: (collective, None) or (coalesced collective, index).
_ResultKey = tuple[torch.fx.Node, Optional[int]]


@dataclass
class _Analysis:
    nodes: list[torch.fx.Node]
    index: dict[torch.fx.Node, int]
    kind: dict[torch.fx.Node, str]
    deps: dict[torch.fx.Node, list[torch.fx.Node]]
    waits: dict[torch.fx.Node, list[torch.fx.Node]] = field(default_factory=dict)
    wait_key: dict[torch.fx.Node, _ResultKey] = field(default_factory=dict)
    result_bytes: dict[torch.fx.Node, dict[_ResultKey, Optional[int]]] = field(default_factory=dict)
    redundant_waits: set[torch.fx.Node] = field(default_factory=set)

    def collective_bytes(self, c: torch.fx.Node) -> Optional[int]:
        sizes = list(self.result_bytes[c].values())
        return None if not sizes or any(s is None for s in sizes) else sum(sizes)  # type: ignore[misc]


def _analyse(graph: torch.fx.Graph) -> _Analysis:
    """Classify nodes, check the collective/wait structure, and collect ordering dependencies."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    kind: dict[torch.fx.Node, str] = {}
    deps: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for n in nodes:
        inputs = n.all_input_nodes
        for d in inputs:
            if index.get(d, len(nodes)) >= index[n]:
                raise BadGraph(f"the graph is not topologically sorted: {n.name!r} uses {d.name!r}")
        kind[n] = classify(n, kind)
        deps[n] = list(inputs)
    a = _Analysis(nodes, index, kind, deps)

    last_of_group: dict[Hashable, torch.fx.Node] = {}
    for n in nodes:
        if kind[n] == WAIT:
            src = n.args[0] if n.args else n.kwargs.get("tensor")
            if isinstance(src, torch.fx.Node) and (src in a.wait_key or src in a.redundant_waits):
                # A wait on a waited result (user code calling wait_tensor on a traced collective's
                # result) waits on nothing: an ordinary reader of the first wait's result.
                kind[n] = COMPUTE
                a.redundant_waits.add(n)
                continue
            if isinstance(src, torch.fx.Node) and kind.get(src) == COLLECTIVE and not is_coalesced(src):
                key: _ResultKey = (src, None)
            elif isinstance(src, torch.fx.Node) and kind.get(src) == MEMBER and isinstance(src.args[1], int):
                key = (src.args[0], src.args[1])  # type: ignore[assignment]
            elif isinstance(src, torch.fx.Node) and kind.get(src) == COLLECTIVE:
                raise BadGraph(f"wait_tensor {n.name!r} waits on the whole list of coalesced {src.name!r}")
            else:
                what = src.name if isinstance(src, torch.fx.Node) else repr(src)
                raise BadGraph(f"wait_tensor {n.name!r} waits on {what!r}, which is not a collective")
            a.wait_key[n] = key
            a.waits.setdefault(key[0], []).append(n)
        elif kind[n] == COLLECTIVE:
            group = group_of(n)
            if group in last_of_group:
                deps[n].append(last_of_group[group])  # [Note: same-group order]
            last_of_group[group] = n

    for c in (n for n in nodes if kind[n] == COLLECTIVE):
        if not a.waits.get(c):
            raise BadGraph(f"the result of collective {c.name!r} is never waited (no wait_tensor)")
        val = meta_value(c)
        if is_coalesced(c):
            results: dict[_ResultKey, Optional[int]] = {}
            members = []
            for u in c.users:
                if kind[u] != MEMBER or not isinstance(u.args[1], int):
                    raise BadGraph(f"coalesced collective {c.name!r} is used by {u.name!r}, not by indexing")
                members.append(u)
                i = u.args[1]
                item = val[i] if isinstance(val, (list, tuple)) and i < len(val) else meta_value(u)
                results[(c, i)] = None if item is None else nbytes(item)
            if isinstance(val, (list, tuple)) and set(range(len(val))) - {k[1] for k in results}:
                raise BadGraph(f"some results of coalesced collective {c.name!r} are never waited")
            readers = [(m, (c, m.args[1])) for m in members]
        else:
            results = {(c, None): None if val is None else nbytes(val)}
            readers = [(c, (c, None))]
        a.result_bytes[c] = results
        for tensor, key in readers:
            waits = [w for w in tensor.users if kind[w] == WAIT]
            if not waits:
                raise BadGraph(f"result {tensor.name!r} of collective {c.name!r} is never waited")
            for u in tensor.users:
                if kind[u] == WAIT:
                    continue
                before = [w for w in waits if index[w] < index[u]]
                if not before:
                    raise BadGraph(f"{u.name!r} reads collective result {tensor.name!r} before its wait")
                deps[u].extend(before)
    return a


class _OrderBuilder:
    """Builds the new order, one stretch between barriers at a time (see the module docstring)."""

    def __init__(self, a: _Analysis, max_inflight_bytes: Optional[int]) -> None:
        self.a = a
        self.budget = max_inflight_bytes
        self.order: list[torch.fx.Node] = []
        self.issued_at: dict[torch.fx.Node, int] = {}  # a collective's place in ``order``
        self.emitted: set[torch.fx.Node] = set()
        # Results issued but not yet waited, in issue order, with their size (None: unknown).
        self.outstanding: dict[_ResultKey, Optional[int]] = {}

    @property
    def inflight(self) -> int:
        return sum(b for b in self.outstanding.values() if b is not None)

    def run(self) -> list[torch.fx.Node]:
        segment: list[torch.fx.Node] = []
        for n in self.a.nodes:
            if self.a.kind[n] in (BARRIER, OUTPUT):
                self._schedule(segment)
                self._emit(n)
                segment = []
            else:
                segment.append(n)
        self._schedule(segment)
        return self.order

    # -- one stretch ------------------------------------------------------------------------
    def _schedule(self, segment: list[torch.fx.Node]) -> None:
        if not segment:
            return
        a = self.a
        self.segment = set(segment)
        self.remaining = {n: sum(d in self.segment for d in a.deps[n]) for n in segment}
        self.dependents: dict[torch.fx.Node, list[torch.fx.Node]] = {n: [] for n in segment}
        for n in segment:
            for d in a.deps[n]:
                if d in self.segment:
                    self.dependents[d].append(n)
        self.ready_compute: list[tuple[int, torch.fx.Node]] = []
        self.ready_collectives: list[tuple[int, torch.fx.Node]] = []
        self.ready_waits: list[tuple[tuple[int, int], int, torch.fx.Node]] = []
        collectives = [n for n in segment if a.kind[n] == COLLECTIVE]
        forced = 0  # collectives[:forced] have been issued or checked
        for n in segment:
            if self.remaining[n] == 0:
                self._push_ready(n)
        while True:
            self._raise_collectives()
            n = self._pop(self.ready_compute)
            if n is not None:
                # Never issue a collective later than its original place among the compute.
                while forced < len(collectives) and a.index[collectives[forced]] < a.index[n]:
                    self._ensure(collectives[forced])
                    forced += 1
                if n not in self.emitted:
                    self._emit(n)
                continue
            w = self._pop(self.ready_waits)
            if w is not None:
                self._emit(w)
                continue
            blocked = next((c for c in collectives if c not in self.emitted), None)
            if blocked is None:
                break
            self._ensure(blocked)
        missing = [n.name for n in segment if n not in self.emitted]
        assert not missing, f"scheduler left nodes unscheduled: {missing}"

    def _wait_priority(self, w: torch.fx.Node) -> tuple[int, int, int]:
        """Which of the ready waits goes first (smallest first); see [Note: wait priority]."""
        feeds_collective = any(self.a.kind[u] == COLLECTIVE for u in self.dependents[w])
        collective, member = self.a.wait_key[w]
        return (0 if feeds_collective else 1, self.issued_at[collective], member if member is not None else 0)

    def _push_ready(self, n: torch.fx.Node) -> None:
        kind, i = self.a.kind[n], self.a.index[n]
        if kind == COLLECTIVE:
            heapq.heappush(self.ready_collectives, (i, n))
        elif kind == WAIT:
            heapq.heappush(self.ready_waits, (self._wait_priority(n), i, n))
        elif kind == MEMBER:
            self._emit(n)  # an item of a coalesced result goes right after the collective
        else:
            heapq.heappush(self.ready_compute, (i, n))

    def _pop(self, heap: list[Any]) -> Optional[torch.fx.Node]:
        while heap:
            n = heapq.heappop(heap)[-1]
            if n not in self.emitted:
                return n
        return None

    def _raise_collectives(self) -> None:
        """Issue every ready collective that fits the budget, earliest first."""
        blocked: list[tuple[int, torch.fx.Node]] = []
        while self.ready_collectives:
            i, c = heapq.heappop(self.ready_collectives)
            if c in self.emitted:
                continue
            if self.budget is not None:
                size = self.a.collective_bytes(c)
                if size is None or self.inflight + size > self.budget:
                    blocked.append((i, c))  # unknown size: stays at its place; too big: later
                    continue
            self._emit(c)
        for item in blocked:
            heapq.heappush(self.ready_collectives, item)

    def _ensure(self, target: torch.fx.Node) -> None:
        """Emit ``target`` now, after whatever it still needs (in original order)."""
        if target in self.emitted:
            return
        needed: set[torch.fx.Node] = set()
        stack = [target]
        while stack:
            n = stack.pop()
            if n in needed or n in self.emitted:
                continue
            needed.add(n)
            stack.extend(d for d in self.a.deps[n] if d not in self.emitted)
        for n in sorted(needed, key=self.a.index.__getitem__):
            if n not in self.emitted:
                self._emit(n)

    def _make_room(self, size: int) -> None:
        """Wait for the oldest outstanding results until ``size`` more bytes fit the budget."""
        assert self.budget is not None
        for key in list(self.outstanding):
            if self.inflight + size <= self.budget:
                return
            waits = [w for w in self.a.waits[key[0]] if self.a.wait_key[w] == key]
            waits = [w for w in waits if w in self.segment and w not in self.emitted]
            if waits:
                self._ensure(min(waits, key=self.a.index.__getitem__))

    def _emit(self, n: torch.fx.Node) -> None:
        a = self.a
        kind = a.kind[n]
        if kind == COLLECTIVE:
            size = a.collective_bytes(n)
            if self.budget is not None and size is not None:
                self._make_room(size)
        if kind == COLLECTIVE:
            self.issued_at[n] = len(self.order)
        self.order.append(n)
        self.emitted.add(n)
        if kind == COLLECTIVE:
            self.outstanding.update(a.result_bytes[n])
        elif kind == WAIT:
            self.outstanding.pop(a.wait_key[n], None)
        if kind in (BARRIER, OUTPUT):
            return
        for m in self.dependents.get(n, ()):
            self.remaining[m] -= 1
            if self.remaining[m] == 0:
                self._push_ready(m)
        if kind == COLLECTIVE and self.budget is not None and a.collective_bytes(n) is None:
            # Unknown size under a budget: not moved, and waited at once so the budget holds.
            for w in sorted(a.waits[n], key=a.index.__getitem__):
                if w in self.segment:
                    self._ensure(w)


def _check_order(order: list[torch.fx.Node], a: _Analysis) -> None:
    """The new order holds every node once, after all of its dependencies."""
    assert len(order) == len(a.nodes) and set(order) == set(a.nodes), "not a permutation"
    position = {n: i for i, n in enumerate(order)}
    for n in order:
        for d in a.deps[n]:
            assert position[d] < position[n], f"{n.name!r} placed before {d.name!r}"


def check_max_inflight_bytes(max_inflight_bytes: object) -> None:
    """Raise unless ``max_inflight_bytes`` is None or an int >= 0 (the pass's byte budget)."""
    if max_inflight_bytes is not None and (
        isinstance(max_inflight_bytes, bool) or not isinstance(max_inflight_bytes, int)
    ):
        raise TypeError(
            f"max_inflight_bytes must be an int or None, got {type(max_inflight_bytes).__name__}"
        )
    if max_inflight_bytes is not None and max_inflight_bytes < 0:
        raise ValueError(f"max_inflight_bytes must be >= 0, got {max_inflight_bytes}")


def overlap_graph(graph: torch.fx.Graph, max_inflight_bytes: Optional[int] = None,
                  bucket_bytes: Optional[int] = None, collective_matmul_chunks: Optional[int] = None) -> bool:
    """Reorder ``graph`` in place for comm/compute overlap; return whether the graph changed.

    The core of :func:`overlap_pass`, working on a bare ``torch.fx.Graph`` (what Inductor's
    ``post_grad_custom_post_pass`` receives). Same contract; the caller recompiles the module.
    First, the waits are put in the one form every pass here reads (``scheduler.canonical_waits``:
    torch 2.15 traces others).
    With ``collective_matmul_chunks`` (> 1), sums of reduce-scatters are first merged into one
    reduce-scatter of the sum (``scheduler.summed_scatters``: equal up to float rounding, not
    bitwise), then all-gather -> mm and mm -> reduce-scatter are split into that many chunks
    (``scheduler.collective_matmul``), after bucketing (so that the chunks are not merged back)
    and before the reorder (which places the chunks' waits); ops between two split matmuls
    that keep the batch apart then run per chunk (``scheduler.per_chunk_ops``, values unchanged).
    """
    if not isinstance(graph, torch.fx.Graph):
        raise TypeError(f"graph must be a torch.fx.Graph, got {type(graph).__name__}")
    check_max_inflight_bytes(max_inflight_bytes)
    check_bucket_bytes(bucket_bytes)
    check_chunks(collective_matmul_chunks)
    splitting = collective_matmul_chunks is not None and collective_matmul_chunks > 1
    canonical = canonicalize_waits(graph)
    summed = merge_summed_reduce_scatters(graph) if splitting else 0
    merged = bucket_collectives(graph, bucket_bytes) if bucket_bytes is not None else 0
    split = decompose_collective_matmuls(graph, collective_matmul_chunks)
    chained = run_ops_per_chunk(graph) if split else 0
    return (_reorder(graph, max_inflight_bytes) or canonical > 0 or summed > 0 or merged > 0 or split > 0
            or chained > 0)


def _reorder(graph: torch.fx.Graph, max_inflight_bytes: Optional[int]) -> bool:
    try:
        analysis = _analyse(graph)
    except BadGraph as e:
        logger.warning("overlap pass: graph left unchanged: %s", e)
        return False
    if not analysis.waits:
        return False
    try:
        order = _OrderBuilder(analysis, max_inflight_bytes).run()
        _check_order(order, analysis)
    except AssertionError as e:  # a bug here must not break the caller's graph
        logger.error("overlap pass: internal error, graph left unchanged: %s", e)
        return False
    if order == analysis.nodes:
        return False
    if order[0] is not analysis.nodes[0]:
        analysis.nodes[0].prepend(order[0])
    for prev, n in zip(order, order[1:]):
        if prev.next is not n:
            prev.append(n)
    graph.lint()
    logger.debug(
        "overlap pass: reordered %d nodes (%d collectives)",
        len(order), sum(k == COLLECTIVE for k in analysis.kind.values()),
    )
    return True


def overlap_pass(
    gm: torch.fx.GraphModule, max_inflight_bytes: Optional[int] = None, bucket_bytes: Optional[int] = None
) -> torch.fx.GraphModule:
    """Move collectives up and their waits down in ``gm``, in place; return ``gm``.

    Each ``_c10d_functional`` collective is issued as soon as its inputs are ready (per-group order
    kept, see [Note: same-group order]; within ``max_inflight_bytes`` of un-waited results when
    given) and each ``wait_tensor`` goes as late as it can, before its first user. Values are
    unchanged. A graph this pass cannot reorder safely is left unchanged (the reason is logged on
    the ``"scheduler"`` logger). With ``bucket_bytes``, small all-gathers / reduce-scatters are merged
    first (``scheduler.bucketing``). Raises ``TypeError`` / ``ValueError`` for bad arguments.
    """
    if not isinstance(gm, torch.fx.GraphModule):
        raise TypeError(f"gm must be a torch.fx.GraphModule, got {type(gm).__name__}")
    if overlap_graph(gm.graph, max_inflight_bytes, bucket_bytes):
        gm.recompile()
    return gm
