"""The wait form every pass here reads: one ``wait_tensor`` per collective result, read by one chain.

The passes (``scheduler.fx_nodes`` and what builds on it) were written against the post-grad graphs
of torch 2.11 to 2.13, where each result of a functional collective is waited by one
``_c10d_functional.wait_tensor`` and whatever reads the waited tensor reads that node. Torch 2.15
traces two other forms, which :func:`canonicalize_waits` rewrites into that one before the passes
run:

* **One wait for a coalesced collective's results**: ``wait_tensors([a, b])`` read through
  ``getitem`` (``_maybe_wrap_tensors`` in ``torch.distributed._functional_collectives``). Each
  becomes ``wait_tensor(a)``, ``wait_tensor(b)`` at its place, and each ``getitem`` the wait of its
  input. Left alone when the list itself has another reader.
* **Several waits of one result**: an all-gather that AOT shares between readers (q, k and v of one
  sequence-parallel input) is waited once per reader, each with its own copy of the same pure ops
  (split, getitem, cat, view) before its matmul. The later waits are replaced by the first (a
  second wait of a completed collective does nothing; Inductor's own ``deduplicate_wait_tensors``
  does the same after the custom passes), then the copies reading one node become one
  (:func:`_merge_copies`).

Values are unchanged: a wait returns its input once the collective is done, a merged copy computes
what each copy did from the same inputs, and Inductor lowers ``wait_tensor`` and ``wait_tensors``
to the same wait kernel. Graphs already in that form (torch 2.11 to 2.13) are left as they are.
"""
from __future__ import annotations

import operator
from collections.abc import Callable, Hashable, Iterable
from typing import Any, Optional

import torch
import torch.fx

from scheduler.fx_nodes import COLLECTIVE_NAMESPACES, WAIT_TENSOR, op_has_effects, qualified_name

__all__ = ["WAIT_TENSORS", "canonicalize_waits"]

WAIT_TENSORS: Optional[Any] = (torch.ops._c10d_functional.wait_tensors.default
                               if hasattr(torch.ops._c10d_functional, "wait_tensors") else None)
"""``_c10d_functional.wait_tensors`` (torch >= 2.15), or None."""


def canonicalize_waits(graph: torch.fx.Graph) -> int:
    """Rewrite ``graph`` in place into one ``wait_tensor`` per collective result (see the module
    docstring); return how many nodes were replaced."""
    return _split_wait_tensors(graph) + _merge_repeated_waits(graph)


def _split_wait_tensors(graph: torch.fx.Graph) -> int:
    if WAIT_TENSORS is None:
        return 0
    done = 0
    for node in graph.find_nodes(op="call_function", target=WAIT_TENSORS):
        inputs = node.args[0] if node.args else None
        if not (isinstance(inputs, (list, tuple)) and all(isinstance(a, torch.fx.Node) for a in inputs)
                and all(u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int)
                        and 0 <= u.args[1] < len(inputs) for u in node.users)):
            continue
        waits = []
        with graph.inserting_before(node):
            for value in inputs:
                wait = graph.call_function(WAIT_TENSOR, (value,))
                if "val" in value.meta:
                    wait.meta["val"] = value.meta["val"]
                waits.append(wait)
        for user in list(node.users):
            user.replace_all_uses_with(waits[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(node)
        done += 1
    return done


def _keep_first(graph: torch.fx.Graph, nodes: Iterable[torch.fx.Node],
                key: Callable[[torch.fx.Node], Optional[Hashable]]) -> list[torch.fx.Node]:
    """Of ``nodes`` (in graph order) with one ``key`` (None: never merged), replace each later one
    by the first and erase it; return the kept nodes that took another's readers, once each."""
    first: dict[Hashable, torch.fx.Node] = {}
    kept: dict[torch.fx.Node, None] = {}
    for node in nodes:
        k = key(node)
        if k is None:
            continue
        keep = first.setdefault(k, node)
        if keep is not node:
            node.replace_all_uses_with(keep)
            graph.erase_node(node)
            kept[keep] = None
    return list(kept)


def _merge_repeated_waits(graph: torch.fx.Graph) -> int:
    before = len(graph.nodes)
    waits = graph.find_nodes(op="call_function", target=WAIT_TENSOR)  # in graph order
    kept = _keep_first(graph, waits, lambda w: w.args[0] if isinstance(w.args[0], torch.fx.Node) else None)
    _merge_copies(graph, kept)
    return before - len(graph.nodes)


def _frozen(value: Any) -> Any:
    """``value`` (an op's argument) as a hashable key, equal to another's only where the two are the
    same argument; ``TypeError`` for a value not comparable as a constant (never merged)."""
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_frozen(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _frozen(v)) for k, v in sorted(value.items())))
    if isinstance(value, torch.fx.Node) or value is None:
        return value
    if isinstance(value, (bool, int, float, str)):
        # Python has 1 == 1.0 == True and 0.0 == -0.0, but as an op's arguments they give other
        # result dtypes or zero signs: the type is part of the key, a float's repr keeps its sign
        return (type(value).__name__, repr(value) if isinstance(value, float) else value)
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return value
    raise TypeError  # not comparable as a constant: never merged


def _collective_namespace(node: torch.fx.Node) -> bool:
    return (qualified_name(node.target) or "").partition("::")[0] in COLLECTIVE_NAMESPACES


def _pure(node: torch.fx.Node) -> bool:
    """A call whose result depends only on its arguments and that writes nothing (not a collective:
    two collectives are never made one)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    return (isinstance(node.target, torch._ops.OpOverload) and not op_has_effects(node.target)
            and not _collective_namespace(node))


def _only_read(node: torch.fx.Node) -> bool:
    """Nothing writes ``node``'s value or an alias of it: every reader is a pure call, the output, or
    a functional collective or wait (they read without writing)."""
    return all(_pure(u) or u.op == "output" or (u.op == "call_function" and _collective_namespace(u))
               for u in node.users)


def _merge_copies(graph: torch.fx.Graph, roots: list[torch.fx.Node]) -> None:
    """Where two pure calls with the same target and arguments read one of ``roots`` (or a node
    merged into), keep the earlier one, and again below it."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    pending = list(roots)
    while pending:
        node = pending.pop()
        pending += _keep_first(graph, sorted(node.users, key=position.__getitem__), _copy_key)


def _copy_key(node: torch.fx.Node) -> Optional[Hashable]:
    """What makes two reads of a node one: the call and its arguments, for pure calls whose value
    nothing writes; None otherwise."""
    if not (_pure(node) and _only_read(node)):
        return None
    try:
        return (node.target, _frozen(node.args), _frozen(node.kwargs))
    except TypeError:
        return None
