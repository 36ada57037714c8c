"""Which ranks a collective runs over, and with which reduction.

``group`` may be a ``ProcessGroup``, a 1-D ``DeviceMesh``, a ``(mesh, dim)`` pair (``dim`` an int
or a mesh dim name), or ``None`` for the default (WORLD) group. Everything here validates and
raises before any communication happens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import torch
import torch.distributed as dist

__all__ = ["GroupArg", "GroupInfo", "resolve_group", "device_mesh_for", "REDUCE_OPS", "ReduceOpName", "check_reduce_op"]

GroupArg = Union[None, dist.ProcessGroup, Any]  # Any: DeviceMesh or (DeviceMesh, dim); kept lazy

REDUCE_OPS = ("sum", "avg", "max", "min", "product")
ReduceOpName = str

_NOT_INITIALIZED = (
    "torch.distributed is not initialized: call torch.distributed.init_process_group(backend=...) "
    "first (e.g. 'gloo' on CPU, 'nccl' on GPUs; launch with torchrun, or use "
    "overlap.testing.run_distributed in tests)"
)


@dataclass(frozen=True)
class GroupInfo:
    """A resolved group: the ProcessGroup plus what collectives need to know about it."""

    pg: dist.ProcessGroup
    rank: int
    size: int
    backend: str

    def global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.pg, group_rank)

    @property
    def native_avg(self) -> bool:
        """NCCL averages natively; elsewhere avg is a sum followed by a divide."""
        return self.backend == "nccl"


_info_cache: dict[int, GroupInfo] = {}


def _process_group(group: GroupArg, arg_name: str) -> dist.ProcessGroup:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(_NOT_INITIALIZED)
    if group is None:
        return dist.group.WORLD
    if isinstance(group, dist.ProcessGroup):
        return group
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"{arg_name}: a DeviceMesh with {group.ndim} dims needs a dim; pass ({arg_name}, dim) "
                f"with dim in 0..{group.ndim - 1} or one of {group.mesh_dim_names}"
            )
        return group.get_group()
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        mesh, dim = group
        names = mesh.mesh_dim_names or ()
        if isinstance(dim, str):
            if dim not in names:
                raise ValueError(f"{arg_name}: mesh has no dim named {dim!r}; its dims are {names}")
        elif not isinstance(dim, int) or not 0 <= dim < mesh.ndim:
            raise ValueError(f"{arg_name}: mesh dim must be an int in 0..{mesh.ndim - 1} or a name in {names}, got {dim!r}")
        return mesh.get_group(dim)
    raise TypeError(
        f"{arg_name} must be a ProcessGroup, a 1-D DeviceMesh, a (DeviceMesh, dim) pair or None, "
        f"got {type(group).__name__}"
    )


def resolve_group(group: GroupArg, arg_name: str = "group") -> GroupInfo:
    """Resolve ``group`` to a :class:`GroupInfo`; cached per ProcessGroup."""
    pg = _process_group(group, arg_name)
    if torch.compiler.is_compiling():  # Dynamo on torch 2.11 cannot trace id() of a ProcessGroup
        return _group_info(pg)
    info = _info_cache.get(id(pg))
    if info is None or info.pg is not pg:
        info = _group_info(pg)
        _info_cache[id(pg)] = info
    return info


def _group_info(pg: dist.ProcessGroup) -> GroupInfo:
    return GroupInfo(pg=pg, rank=dist.get_rank(pg), size=dist.get_world_size(pg), backend=str(dist.get_backend(pg)))


_separate_groups: dict[int, tuple[dist.ProcessGroup, GroupInfo]] = {}


def separate_group(info: GroupInfo) -> GroupInfo:
    """A process group of its own over ``info``'s ranks (same backend), made once per group and
    reused (every module whose shard group is ``info``'s shares it).

    [Note: a reduce-scatter group of its own]
    FSDP2's ``set_separate_reduce_scatter_group()`` runs the gradient reductions over a communicator
    of their own: one communicator processes one collective at a time, so over the shard group's
    the backward's reduce-scatters and all-gathers take turns on the wire, while two communicators
    let them progress together where the link can carry both (NCCL on a GPU; gloo's process groups
    each have their own threads). Each group keeps its own order on every rank, so the runtime's
    rule (same collectives, same order, on every rank) holds group by group. The new group is made
    with ``dist.new_group(ranks, use_local_synchronization=True)``: only the shard group's ranks
    take part, and they must all call the setting, in the same order (as in FSDP2). The emulated
    link (``overlap.testing``) models each process group as a link of its own, so it would time a
    separate group as twice the bandwidth: compare such runs on real links only.
    """
    found = _separate_groups.get(id(info.pg))
    if found is None or found[0] is not info.pg:  # (the entry holds its group: an id is never reused under it)
        ranks = [info.global_rank(r) for r in range(info.size)]
        pg = dist.new_group(ranks, backend=info.backend, use_local_synchronization=True)
        found = _separate_groups[id(info.pg)] = (info.pg, _group_info(pg))
    return found[1]


_mesh_cache: dict[tuple[int, str], Any] = {}


def device_mesh_for(group: GroupArg, info: GroupInfo, device_type: str) -> Any:
    """The 1-D DeviceMesh that sharded DTensors of ``info``'s group live on: the user's own mesh (or
    the mesh dim's sub-mesh) when ``group`` names one, else one made from the ProcessGroup (cached),
    with ``device_type`` ('cpu', 'cuda', ...) the device the local tensors live on."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        return group
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        mesh, dim = group
        names = mesh.mesh_dim_names
        if isinstance(dim, str):
            return mesh[dim]
        if names:
            return mesh[names[dim]]
        device_type = mesh.device_type  # an unnamed dim cannot be sliced out: a mesh over its group
    key = (id(info.pg), device_type)
    mesh = _mesh_cache.get(key)
    if mesh is None or mesh.get_group() is not info.pg:
        mesh = DeviceMesh.from_group(info.pg, device_type)
        _mesh_cache[key] = mesh
    return mesh


def check_reduce_op(op: Any, dtype: torch.dtype, arg_name: str = "op") -> ReduceOpName:
    """Validate a reduction name ('sum', 'avg', 'max', 'min', 'product') for ``dtype``."""
    if not isinstance(op, str):
        raise TypeError(f"{arg_name} must be a str, one of {', '.join(repr(o) for o in REDUCE_OPS)}; got {type(op).__name__}")
    if op.lower() not in REDUCE_OPS:
        raise ValueError(f"{arg_name} must be one of {', '.join(repr(o) for o in REDUCE_OPS)}; got {op!r}")
    op = op.lower()
    if op == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"{arg_name}='avg' needs a floating-point tensor; got {dtype} (use 'sum')")
    return op


def dist_reduce_op(op: ReduceOpName, info: GroupInfo) -> dist.ReduceOp:
    """The torch.distributed ReduceOp that implements ``op`` on this group (avg may become sum)."""
    if op == "avg":
        return dist.ReduceOp.AVG if info.native_avg else dist.ReduceOp.SUM
    return {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
            "product": dist.ReduceOp.PRODUCT}[op]
