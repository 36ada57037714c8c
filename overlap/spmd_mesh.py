"""FSDP2's full-SPMD-mesh mode (``fully_shard(module, mesh=full_mesh, dp_mesh_dims=...)``, torch 2.13+).

[Note: sharding on a full SPMD mesh]
torchtitan's full-DTensor path (and other SPMD front ends) makes every parameter a DTensor on the
whole mesh, e.g. ``("dp_replicate", "dp_shard", "cp", "tp")``, ``Replicate()`` on the data-parallel
dims and the tensor-parallel placements on the others, then passes FSDP2 that mesh and a
``DataParallelMeshDims`` naming which dims shard (several: flattened into one) and which replicate
(HSDP). Here, as in FSDP2:

- the shard group is the shard dims' sub-mesh (``mesh[names]._flatten()`` for several), the
  replica group the replicate dims' (HSDP: the two joined as a 2-D ``(replicate, shard)`` mesh);
  what the runtime packs, gathers and reduces is each parameter's local tensor, dim-0 rows over the
  shard group, as for tensor-parallel parameters ([Note: sharding tensor-parallel parameters] in
  ``overlap/param_group.py``);
- the sharded parameter is a DTensor on the full mesh itself: the shard dim's ``Replicate()``
  becomes ``Shard(0)``, or ``_StridedShard(0, split_factor=s)`` where the mesh dims after it shard
  dim 0 too (``s`` the product of their sizes: this rank's rows are a slice of their shard); with
  several shard dims, FSDP2 builds the spec on a mesh where the flattened shard mesh takes their
  place, and so does this;
- the unsharded parameter is the DTensor the user made (its spec around the gathered local tensor);
- its gradient is redistributed to the parameter's placements on the other dims only: on the
  data-parallel dims it stays as autograd left it (``Partial()`` where the batch is sharded over
  them), and its local tensor goes to the reduce-scatter, which does that sum. So the gradient is
  what FSDP2 gives, including its average over the data-parallel ranks.

Parameters that are not DTensors on that mesh, or not ``Replicate()`` on a data-parallel dim, are
refused (ValueError) as FSDP2 refuses them; so is a mesh with no shard dims (FSDP2's DDP mode:
NotImplementedError, this runtime shards).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Placement, _StridedShard

__all__ = ["SpmdMesh", "resolve_spmd_mesh", "check_spmd_params"]


@dataclass(frozen=True)
class SpmdMesh:
    """A full SPMD mesh and its data-parallel dims, resolved (``resolve_spmd_mesh``)."""

    full: DeviceMesh
    """The mesh the parameters are DTensors on."""
    shard_dims: tuple[int, ...]
    """Its dims the parameters are sharded over (flattened into ``shard_mesh`` when several)."""
    replicate_dims: tuple[int, ...]
    """Its dims the shards are replicated over (HSDP); empty when fully sharded."""
    shard_mesh: DeviceMesh
    """The 1-D mesh of the shard group."""
    dp_mesh: DeviceMesh
    """What the runtime shards over: ``shard_mesh``, or with HSDP ``(replicate, shard)`` joined."""

    @property
    def dp_dims(self) -> frozenset[int]:
        return frozenset(self.shard_dims + self.replicate_dims)

    def sharded_spec(self, spec: DTensorSpec, dim: int = 0) -> DTensorSpec:
        """The sharded parameter's spec for a parameter whose (unsharded) spec is ``spec``, sharded
        on its local tensor's ``dim``: FSDP2's, placement for placement (module docstring)."""
        full, placements = self.full, list(spec.placements)
        first = self.shard_dims[0]
        if spec.tensor_meta is not None and len(spec.tensor_meta.shape) == 0:
            sharded: Placement = Replicate()
        else:
            split = 1
            for j in range(first + 1, full.ndim):
                later = placements[j]
                if isinstance(later, (Shard, _StridedShard)) and later.dim == dim:
                    split *= full.size(j)
            sharded = _StridedShard(dim, split_factor=split) if split > 1 else Shard(dim)
        if len(self.shard_dims) == 1:
            placements[first] = sharded
            return DTensorSpec(full, tuple(placements), tensor_meta=spec.tensor_meta)
        # Several shard dims: the flattened shard mesh (HSDP: after the replicas') in the first one's place.
        names = full.mesh_dim_names
        assert names is not None
        meshes: list[DeviceMesh] = []
        out: list[Placement] = []
        for i, name in enumerate(names):
            if i == first:
                meshes.append(self.dp_mesh)
                out.extend([Replicate(), sharded] if self.replicate_dims else [sharded])
            elif i not in self.dp_dims:
                meshes.append(full[name])
                out.append(placements[i])
        return DTensorSpec(DeviceMesh._concatenate(meshes), tuple(out), tensor_meta=spec.tensor_meta)

    def grad_placements(self, grad: tuple[Placement, ...], param: tuple[Placement, ...]) -> tuple[Placement, ...]:
        """What an unsharded gradient with ``grad`` placements is redistributed to before its local
        tensor is reduced: the parameter's placements, except on the data-parallel dims, where the
        reduce-scatter (and HSDP's all-reduce) does the reduction."""
        dp = self.dp_dims
        return tuple(g if i in dp else p for i, (g, p) in enumerate(zip(grad, param)))


def _dim_names(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def _sub_mesh(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """``mesh``'s sub-mesh over ``names``: one dim, or several flattened into one (as FSDP2 names it)."""
    if len(names) == 1:
        return mesh[names[0]]
    return mesh[names]._flatten("_".join(names))


def resolve_spmd_mesh(mesh: Any, dp_mesh_dims: Any, caller: str = "fully_shard") -> SpmdMesh:
    """Check ``mesh`` and ``dp_mesh_dims`` as FSDP2 does, before anything changes (its errors, naming
    the argument), and build the shard group's mesh (and HSDP's). ``dp_mesh_dims`` is torch's
    ``DataParallelMeshDims``."""
    try:
        from torch.distributed.fsdp import DataParallelMeshDims
    except ImportError:  # torch < 2.13
        raise NotImplementedError(f"{caller}: dp_mesh_dims needs torch 2.13 or later (DataParallelMeshDims); "
                                  f"pass the data-parallel sub-mesh as mesh=") from None
    if not isinstance(dp_mesh_dims, DataParallelMeshDims):
        raise TypeError(f"{caller}: dp_mesh_dims must be a torch.distributed.fsdp.DataParallelMeshDims or None, "
                        f"got {type(dp_mesh_dims).__name__}")
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"{caller}: dp_mesh_dims needs mesh= the full SPMD DeviceMesh the parameters are "
                         f"DTensors on, got {type(mesh).__name__}")
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(f"{caller}: mesh must have mesh_dim_names when dp_mesh_dims is provided")
    shard, replicate = _dim_names(dp_mesh_dims.shard), _dim_names(dp_mesh_dims.replicate)
    for name in shard + replicate:
        if name not in names:
            raise ValueError(f"{caller}: dp_mesh_dims names mesh dim {name!r}, not in mesh.mesh_dim_names {names}")
    if len(set(shard + replicate)) != len(shard + replicate):
        raise ValueError(f"{caller}: dp_mesh_dims names a mesh dim twice: shard={shard}, replicate={replicate}")
    if not shard:
        raise NotImplementedError(f"{caller}: dp_mesh_dims without shard dims (FSDP2's replicate-only mode) is not "
                                  f"supported by overlap, which shards; name the dim(s) to shard over in "
                                  f"DataParallelMeshDims(shard=...)")
    shard_mesh = _sub_mesh(mesh, shard)
    dp_mesh = shard_mesh if not replicate else DeviceMesh._concatenate([_sub_mesh(mesh, replicate), shard_mesh])
    return SpmdMesh(full=mesh, shard_dims=tuple(names.index(n) for n in shard),
                    replicate_dims=tuple(names.index(n) for n in replicate), shard_mesh=shard_mesh, dp_mesh=dp_mesh)


def check_spmd_params(spmd: SpmdMesh, params: list[nn.Parameter], fqns: list[str], caller: str = "fully_shard") -> None:
    """Every parameter a DTensor on ``spmd.full`` (an equal mesh: FSDP2 wants the same object),
    ``Replicate()`` on each
    data-parallel dim and ``Shard`` or ``Replicate`` on the others; ValueError naming the first that is
    not, before anything changes."""
    names = spmd.full.mesh_dim_names
    assert names is not None
    for p, fqn in zip(params, fqns):
        if not isinstance(p, DTensor):
            raise ValueError(f"{caller}: with dp_mesh_dims every parameter must be a DTensor on the full SPMD mesh "
                             f"(e.g. via distribute_module); {fqn!r} is a plain tensor")
        if p.device_mesh != spmd.full:
            raise ValueError(f"{caller}: parameter {fqn!r} is a DTensor on {p.device_mesh}, not on the mesh passed "
                             f"to {caller} ({spmd.full}): pass the mesh its parameters were distributed on")
        for i, placement in enumerate(p.placements):
            if i in spmd.dp_dims and not isinstance(placement, Replicate):
                raise ValueError(f"{caller}: parameter {fqn!r} must be Replicate() on data-parallel mesh dim "
                                 f"{names[i]!r}, got {placement}")
            if i not in spmd.dp_dims and type(placement) not in (Shard, Replicate):
                raise ValueError(f"{caller}: parameter {fqn!r} has {placement} on mesh dim {names[i]!r}; overlap "
                                 f"shards parameters that are Shard or Replicate on the non-data-parallel dims")
