"""Hand-written FX graphs with functional collectives, run in one process on fake ``w``-rank
collectives (a helper module, not a test file): shared by ``scheduling/test_inductor_tp.py`` and
``scheduling/test_properties_collective_matmul.py``.

The fakes are plain tensor ops with the collectives' semantics, seen from rank 0: an all-gather's
rank ``r`` shard is ``x + r``; a ``sum`` reduce-scatter's rank ``r`` input is ``(r + 1) * y`` and
rank 0 keeps the first block of the sum.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

__all__ = ["AG", "ATEN", "RS", "WAIT", "call", "collective_order", "run", "scatter_before_last_gather_wait"]

C10D = torch.ops._c10d_functional
ATEN = torch.ops.aten
AG, RS, WAIT = C10D.all_gather_into_tensor.default, C10D.reduce_scatter_tensor.default, C10D.wait_tensor.default


def call(g: fx.Graph, target: Any, *args: Any) -> fx.Node:
    return g.call_function(target, args)


def _fake_op(target: Any, args: Any, w: int) -> Any:
    if target is AG:
        return torch.cat([args[0] + r for r in range(w)])
    if target is RS:
        y = args[0]
        return sum((r + 1) * y for r in range(w))[: y.shape[0] // w]
    if target is WAIT:
        return args[0]
    if target is operator.getitem:
        return args[0][args[1]]
    return target(*args)


def run(g: fx.Graph, inputs: dict[str, torch.Tensor], w: int, meta: bool = False) -> list[Any]:
    """The graph's outputs on ``inputs`` over the fake ``w``-rank collectives. ``meta``: on meta
    tensors instead, recording each placeholder's and op's value in ``node.meta["val"]`` (what the
    rewrites read shapes from)."""
    env: dict[fx.Node, Any] = {}
    for n in g.nodes:
        if n.op == "placeholder":
            env[n] = inputs[n.name].to("meta") if meta else inputs[n.name]
        elif n.op == "call_function":
            env[n] = _fake_op(n.target, fx.node.map_arg(n.args, env.__getitem__), w)
        elif n.op == "output":
            return list(fx.node.map_arg(n.args[0], env.__getitem__))
        if meta:
            n.meta["val"] = env[n]
    raise AssertionError("no output")


def collective_order(g: fx.Graph) -> list[str]:
    """Issues and waits of all-gathers and reduce-scatters in graph order: "AG", "RS", "wait AG",
    "wait RS"."""
    names = {AG: "AG", RS: "RS"}
    return [names[n.target] if n.target in names else f"wait {names[n.args[0].target]}"
            for n in g.nodes if n.target in names or n.target is WAIT]


def scatter_before_last_gather_wait(order: list[str]) -> bool:
    """Whether a :func:`collective_order` issues its first reduce-scatter before its last gather
    wait (chunks flow from the gather to the scatter one by one)."""
    last_gather_wait = len(order) - 1 - order[::-1].index("wait AG")
    return order.index("RS") < last_gather_wait
