"""The collectives under tracing (``make_fx``, ``torch.compile``): functional collectives + wait.

While a graph is being traced there is nothing to overlap yet: each call lowers to the
``torch.ops._c10d_functional`` op and an explicit ``wait_tensor`` right after it, which is what
Inductor emits by default. Moving each wait down to its first user and each collective up to where
its inputs are ready is the graph pass's job (``scheduler``), not the tracer's.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed._functional_collectives as funcol

from overlap.groups import GroupInfo
from scheduler.torch_versions import funcol_all_gather, funcol_reduce_scatter

__all__ = ["is_tracing", "all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast"]


def is_tracing(x: torch.Tensor) -> bool:
    """True under dynamo, make_fx, or fake/functional tensors: calls must become graph nodes."""
    from torch._subclasses.fake_tensor import FakeTensor

    return funcol._are_we_tracing() or isinstance(x, FakeTensor)


def _functional_op(op: str, info: GroupInfo) -> str:
    return "sum" if op == "avg" and not info.native_avg else op


def _finish_avg(y: torch.Tensor, op: str, info: GroupInfo) -> torch.Tensor:
    return y / info.size if op == "avg" and not info.native_avg else y


def all_gather(x: torch.Tensor, info: GroupInfo, dim: int) -> torch.Tensor:
    y = funcol.wait_tensor(funcol_all_gather(x.contiguous(), 0, info.pg))
    if dim == 0:
        return y
    return torch.cat(torch.chunk(y, info.size, dim=0), dim=dim)


def reduce_scatter(x: torch.Tensor, op: str, info: GroupInfo, dim: int) -> torch.Tensor:
    if dim != 0:
        x = torch.cat(torch.chunk(x, info.size, dim=dim), dim=0)
    y = funcol.wait_tensor(funcol_reduce_scatter(x.contiguous(), _functional_op(op, info), 0, info.pg))
    return _finish_avg(y, op, info)


def all_reduce(x: torch.Tensor, op: str, info: GroupInfo) -> torch.Tensor:
    y = funcol.wait_tensor(funcol.all_reduce(x.contiguous(), _functional_op(op, info), info.pg))
    return _finish_avg(y, op, info)


def all_to_all(
    x: torch.Tensor, out_splits: Optional[list[int]], in_splits: Optional[list[int]], info: GroupInfo
) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_to_all_single(x.contiguous(), out_splits, in_splits, info.pg))


def broadcast(x: torch.Tensor, src: int, info: GroupInfo) -> torch.Tensor:
    return funcol.wait_tensor(funcol.broadcast(x.contiguous(), info.global_rank(src), info.pg))
