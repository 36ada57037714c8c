"""What the scheduler's FX passes know about a graph node: collective, wait, compute or barrier.

The one table of FX node kinds, shared by ``scheduler.graph_pass`` (the overlap reorder) and
``scheduler.bucketing`` (merging small collectives); neither keeps node tables of its own.

Contract
--------
:func:`classify` gives each node of a graph exactly one kind, from the node alone and (for
``MEMBER``) the kinds already given to earlier nodes:

============  ==============================================================================
kind          nodes
============  ==============================================================================
COLLECTIVE    ``call_function`` of a ``torch.ops._c10d_functional`` op in :data:`COLLECTIVE_OPS`
              (functional: returns a new result, waited by ``wait_tensor``)
WAIT          ``call_function`` of ``_c10d_functional.wait_tensor``
MEMBER        ``operator.getitem`` on a coalesced collective (one of its results)
COMPUTE       ``get_attr``; an op whose schemas neither mutate nor write-alias an argument, that is
              not seeded-random and not side-effectful; a Python target in
              :data:`PURE_PYTHON_TARGETS` (symbolic-shape arithmetic, tuple indexing)
OUTPUT        the graph's ``output`` node
BARRIER       everything else: placeholders, ``call_method`` / ``call_module``, ops with effects,
              Python callables not known to be pure. Nothing may be moved across a barrier.
============  ==============================================================================

An op in a collective namespace (:data:`COLLECTIVE_NAMESPACES`) that is neither a known collective
nor ``wait_tensor`` (e.g. the in-place ``all_reduce_``) raises :class:`BadGraph`: the caller decides
(the overlap pass leaves the graph unchanged, bucketing treats the node as a barrier). Helpers here
read nodes and their ``meta`` only; nothing changes a graph.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Hashable, Optional

import torch
import torch.fx

__all__ = [
    "ALL_GATHER", "BARRIER", "COALESCED_OPS", "COLLECTIVE", "COLLECTIVE_NAMESPACES", "COLLECTIVE_OPS", "COMPUTE",
    "FUNCTIONAL_NAMESPACE", "MEMBER", "OUTPUT", "PURE_PYTHON_TARGETS", "REDUCE_SCATTER", "WAIT", "WAIT_TENSOR",
    "BadGraph", "classify", "group_of", "is_coalesced", "meta_value", "nbytes", "op_has_effects",
    "qualified_name",
]

COLLECTIVE_OPS: frozenset[str] = frozenset(
    {
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "all_reduce",
        "all_to_all_single",
        "broadcast",
        "all_gather_into_tensor_coalesced",
        "reduce_scatter_tensor_coalesced",
        "all_reduce_coalesced",
    }
)
"""The ``torch.ops._c10d_functional`` collectives the passes move (functional: a new result)."""

COALESCED_OPS = frozenset(op for op in COLLECTIVE_OPS if op.endswith("_coalesced"))
"""The collectives of :data:`COLLECTIVE_OPS` that return a list (read through ``getitem`` members)."""

FUNCTIONAL_NAMESPACE = "_c10d_functional"
COLLECTIVE_NAMESPACES = frozenset({FUNCTIONAL_NAMESPACE, "_c10d_functional_autograd", "c10d_functional"})
"""Namespaces whose ops are collectives: any op there that is not in :data:`COLLECTIVE_OPS` (or the
wait) is unknown to the passes, and :func:`classify` raises :class:`BadGraph`."""

_C10D = torch.ops._c10d_functional
ALL_GATHER = _C10D.all_gather_into_tensor.default
REDUCE_SCATTER = _C10D.reduce_scatter_tensor.default
WAIT_TENSOR = _C10D.wait_tensor.default

PURE_PYTHON_TARGETS: frozenset[Any] = frozenset(
    {
        operator.getitem, operator.add, operator.sub, operator.mul, operator.truediv,
        operator.floordiv, operator.mod, operator.pow, operator.neg, operator.pos, operator.abs,
        operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge,
        operator.and_, operator.or_, operator.xor, operator.not_, operator.invert,
        operator.lshift, operator.rshift, operator.matmul,
        math.ceil, math.floor, math.sqrt, math.trunc,
        torch.sym_int, torch.sym_float, torch.sym_max, torch.sym_min, torch.sym_not,
        torch.sym_ite,
    }
)
"""Python-level ``call_function`` targets known to be pure (symbolic-shape arithmetic, indexing)."""

# The node kinds (see the module docstring).
BARRIER = "barrier"
OUTPUT = "output"
COLLECTIVE = "collective"
WAIT = "wait"
MEMBER = "member"  # getitem on a coalesced collective: goes right after it
COMPUTE = "compute"


class BadGraph(Exception):
    """The graph is not one the passes can change safely; the message says why."""


def qualified_name(target: Any) -> Optional[str]:
    """``"namespace::op"`` for an ``OpOverload`` / ``OpOverloadPacket`` target, else None."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


def _overloads(target: Any) -> list[torch._ops.OpOverload]:
    if isinstance(target, torch._ops.OpOverload):
        return [target]
    return [getattr(target, name) for name in target.overloads()]


def op_has_effects(target: Any) -> bool:
    """True for ops that may not be reordered: mutating schema, seeded random, side effects."""
    side_effectful = getattr(torch.fx.node, "_side_effectful_functions", set())
    for overload in _overloads(target):
        schema = overload._schema
        if schema.is_mutable or any(
            r.alias_info is not None and r.alias_info.is_write for r in schema.returns
        ):
            return True
        if torch.Tag.nondeterministic_seeded in overload.tags or overload in side_effectful:
            return True
    return target in side_effectful


def classify(node: torch.fx.Node, kinds: dict[torch.fx.Node, str]) -> str:
    """The kind of ``node`` (see the module docstring); ``kinds`` holds the earlier nodes' kinds.
    Raises :class:`BadGraph` for an unknown op of a collective namespace."""
    if node.op == "output":
        return OUTPUT
    if node.op == "get_attr":
        return COMPUTE
    if node.op != "call_function":
        return BARRIER  # placeholder, call_method, call_module: kept in place
    target = node.target
    name = qualified_name(target)
    if name is not None:
        namespace, _, op = name.partition("::")
        if namespace in COLLECTIVE_NAMESPACES:
            if namespace == FUNCTIONAL_NAMESPACE and op == "wait_tensor":
                return WAIT
            if namespace == FUNCTIONAL_NAMESPACE and op in COLLECTIVE_OPS:
                return COLLECTIVE
            raise BadGraph(f"node {node.name!r} calls {name}, a collective op this pass does not know")
        return BARRIER if op_has_effects(target) else COMPUTE
    if target is operator.getitem and node.args and isinstance(node.args[0], torch.fx.Node):
        if kinds.get(node.args[0]) == COLLECTIVE and is_coalesced(node.args[0]):
            return MEMBER
    try:
        pure = target in PURE_PYTHON_TARGETS
    except TypeError:  # unhashable target
        pure = False
    return COMPUTE if pure else BARRIER


def is_coalesced(node: torch.fx.Node) -> bool:
    """Is ``node`` a call of a coalesced collective (:data:`COALESCED_OPS`)?"""
    name = qualified_name(node.target) or ""
    return name.partition("::")[2] in COALESCED_OPS


def group_of(node: torch.fx.Node) -> Hashable:
    """The collective's group name argument (found by name in the op's schema); raises
    :class:`BadGraph` when it is missing or not a constant."""
    schema = _overloads(node.target)[0]._schema
    names = [a.name for a in schema.arguments]
    if "group_name" not in names:
        raise BadGraph(f"collective {node.name!r}: its schema has no group_name argument")
    i = names.index("group_name")
    if "group_name" in node.kwargs:
        group = node.kwargs["group_name"]
    elif i < len(node.args):
        group = node.args[i]
    else:
        raise BadGraph(f"collective {node.name!r} has no group_name argument")
    if isinstance(group, torch.fx.Node) or not isinstance(group, Hashable):
        raise BadGraph(f"collective {node.name!r}: group_name {group!r} is not a constant")
    return group


def nbytes(value: Any) -> Optional[int]:
    """Bytes of a tensor-like value (or a list of them) with static sizes, else None."""
    if isinstance(value, (list, tuple)) and not hasattr(value, "dtype"):
        parts = [nbytes(v) for v in value]
        return None if not parts or any(p is None for p in parts) else sum(parts)  # type: ignore[misc]
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is None or not isinstance(dtype, torch.dtype):
        return None
    numel = 1
    for d in shape:
        if type(d) is not int:  # SymInt or unknown: no static size
            return None
        numel *= d
    return numel * dtype.itemsize


def meta_value(node: torch.fx.Node) -> Any:
    """The node's traced value: ``meta["val"]``, else ``meta["tensor_meta"]``, else None."""
    if "val" in node.meta:
        return node.meta["val"]
    return node.meta.get("tensor_meta")
