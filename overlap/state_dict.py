"""Full (unsharded) state dicts of a sharded model, with the module's own keys.

``module.state_dict()`` of a sharded model is the *sharded* state dict: the same keys, each sharded
parameter a ``Shard(0)`` DTensor (see [Note: sharded parameters are DTensors] in
``overlap/param_group.py``), which is what DCP and ``torch.distributed.checkpoint.state_dict`` read.
``full_state_dict`` turns it into full tensors and ``load_full_state_dict`` loads full tensors back,
both through ``module.state_dict()`` / ``module.load_state_dict()``, so user state-dict hooks (a
post-hook that splits a fused parameter into several keys, a pre-hook that fuses them back) see and
produce the same keys as on the unsharded model. Every rank must call both (they communicate).

[Note: loading a full tensor without distribute_tensor]
``load_full_state_dict`` hands ``load_state_dict`` a DTensor per sharded entry: this rank's part of
the full tensor on the entry's spec. ``distribute_tensor`` makes it with ~40 µs of placement logic
per parameter; for the runtime's own parameters that are not tensor-parallel the part is known
without it: the rows the group's layout gives this rank (``ParamGroup.own_rows``, the rule the
parameter was sharded by, ``Shard(0)``'s), wrapped in the parameter's own spec. That holds for a
*plain* full tensor only. A value that is already a DTensor is a distributed tensor: cutting it is a
DTensor op (``narrow`` of a ``Shard(0)`` DTensor all-gathers it, and only on the ranks whose rows are
not the whole dim: a 1-row parameter on 2 ranks makes rank 1 alone issue an all-gather, and the
ranks' collectives stop matching), and wrapping the result nests a DTensor in a DTensor, which
``copy_`` refuses ("got mixed torch.Tensor and DTensor"). Such values are common: torch's
``set_model_state_dict(..., StateDictOptions(full_state_dict=True))`` writes the DTensors it
distributed back into the dict it was given (``state_dict.update(local_state_dict)``, torch
2.11-2.13), so a caller who loads one dict into two models hands the second call DTensors on the
target's placements. So only plain tensors are cut here; a DTensor value on the entry's mesh and
placements goes through ``distribute_tensor`` (which returns it as it is), one on other placements is
refused before anything is written, and tensor-parallel parameters, other tensor subclasses and
entries that are no group's parameter take ``distribute_tensor`` as before.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

import overlap_kernels
from overlap.collectives import all_gather_into
from overlap.dim_sharding import chunk_sizes, rows_to_full
from overlap.gather_extension import has_extension
from overlap.param_group import ParamGroup, _dtensor, tp_dtensor, widest_dtype
from overlap.sharding import sharded_states

__all__ = ["full_state_dict", "load_full_state_dict"]


def _groups_between_steps(module: nn.Module, caller: str) -> list[ParamGroup]:
    groups = [s.group for s in sharded_states(module) if s.group is not None]
    if any(g.is_unsharded for g in groups):
        raise RuntimeError(f"{caller} must be called between steps, not inside forward/backward")
    return groups


def _gather_full(group: ParamGroup) -> list[torch.Tensor]:
    """The group's full parameters in their original dtypes (bitwise: gathered in a dtype that holds
    them), with one fused all-gather for the whole group; a tensor-parallel parameter's full value,
    its TP shards gathered too. A group with all-gather extension parameters goes through DTensor, as
    torch's state-dict utilities do: the subclass says what its full value is (a TP one's included)."""
    if any(has_extension(p._local_tensor) for p in group.sharded):
        return [p.full_tensor() for p in group.sharded]
    outs = _gather_local_full(group)
    if group.has_tp_params:  # a gathered tensor-parallel shard: gather that too
        outs = [t if spec is None else tp_dtensor(t, spec).full_tensor() for t, spec in zip(outs, group.tp_specs)]
    return outs


def _gather_local_full(group: ParamGroup) -> list[torch.Tensor]:
    """Each parameter's full local tensor (a TP parameter's TP shard) by one fused all-gather."""
    ag_input, ag_output = overlap_kernels.all_gather_copy_in(
        group.shard_rows(), group.layout, group.rank, widest_dtype(group.orig_dtypes))
    if group.world_size > 1:
        all_gather_into(ag_output, ag_input, group.info).wait()
    outs = [torch.empty(shape, dtype=d, device=ag_output.device) for shape, d in zip(group.layout.shapes, group.orig_dtypes)]
    outs = overlap_kernels.all_gather_copy_out(ag_output, group.layout, outs)
    for i, dim in group.shard_dims.items():  # rows form to the parameter ([Note: sharding on another dim])
        sizes = chunk_sizes(outs[i].shape[0], group.world_size)
        outs[i] = rows_to_full(outs[i].split(sizes), group.param_shapes[i], dim)
    return outs


def full_state_dict(module: nn.Module, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The unsharded state dict under ``module``'s state-dict keys: DTensors become full tensors
    (the runtime's own parameters with one fused all-gather per group), other entries are copied.
    Every rank must call it; with ``rank0_only`` the other ranks get ``{}``."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"full_state_dict: module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(rank0_only, bool):
        raise TypeError(f"full_state_dict: rank0_only must be a bool, got {rank0_only!r}")
    with torch.no_grad():
        full: dict[int, torch.Tensor] = {}
        for group in _groups_between_steps(module, "full_state_dict"):
            gathered = _gather_full(group)
            full.update(zip(map(id, group.sharded), gathered))
        out = {}
        for key, value in module.state_dict(keep_vars=True).items():
            if id(value) in full:
                out[key] = full[id(value)]
            elif isinstance(value, DTensor):  # produced by a state-dict hook from sharded parameters
                out[key] = value.full_tensor().detach().clone()
            elif isinstance(value, torch.Tensor):
                out[key] = value.detach().clone()
            else:
                out[key] = value
    if rank0_only and dist.is_initialized() and dist.get_rank() != 0:
        return {}
    return out


def load_full_state_dict(module: nn.Module, state_dict: Mapping[str, Any]) -> None:
    """Load full (unsharded) tensors into a sharded ``module``: each rank keeps its part of each.

    Keys and shapes must match ``full_state_dict(module)`` exactly; every mismatch is reported before
    anything is written. Every rank passes the full tensors; a DTensor is taken for a sharded entry
    when it has that entry's mesh and placements (what torch's ``set_model_state_dict`` leaves in the
    dict it loaded), and refused otherwise.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"load_full_state_dict: module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"load_full_state_dict: state_dict must be a mapping of str to tensors, got {type(state_dict).__name__}")
    groups = _groups_between_steps(module, "load_full_state_dict")
    with torch.no_grad():
        targets = module.state_dict(keep_vars=True)
    problems = [f"missing key {k!r}" for k in targets if k not in state_dict]
    problems += [f"unexpected key {k!r}" for k in state_dict if k not in targets]
    for key, target in targets.items():
        value = state_dict.get(key)
        if value is None or not isinstance(target, torch.Tensor):
            continue
        if not isinstance(value, torch.Tensor):
            problems.append(f"{key!r} is a {type(value).__name__}, not a tensor")
        elif value.shape != target.shape:
            problems.append(f"{key!r} has shape {tuple(value.shape)}, the model expects {tuple(target.shape)}")
        elif isinstance(value, DTensor) and not _same_placements(value, target):
            where = (f"{target.placements} on {target.device_mesh}" if isinstance(target, DTensor)
                     else "a plain tensor")
            problems.append(f"{key!r} is a DTensor with placements {value.placements} on {value.device_mesh}, "
                            f"the model's entry is {where}: pass the full tensor")
    if problems:
        raise ValueError("load_full_state_dict: " + "; ".join(problems))
    cut_here = _cut_by_layout(groups)
    local: dict[str, Any] = {}
    for key, target in targets.items():
        value = state_dict[key]
        if isinstance(target, DTensor):
            # Every rank holds the full tensor: each takes its own part, no communication.
            value = value.detach()
            group = cut_here.get(id(target)) if type(value) is torch.Tensor else None
            if group is not None:  # [Note: loading a full tensor without distribute_tensor]
                # cut, then convert: only this rank's rows are copied to the device and dtype
                value = _dtensor(group.own_rows(value).to(target.device, target.dtype), target._spec)
            else:
                value = distribute_tensor(value.to(target.device, target.dtype), target.device_mesh, target.placements,
                                          src_data_rank=None)
        local[key] = value
    module.load_state_dict(local, strict=True)


def _cut_by_layout(groups: list[ParamGroup]) -> dict[int, ParamGroup]:
    """By ``id``, the sharded parameters whose local tensor is this rank's rows of the full tensor
    cut by their group's layout: every one that is not tensor-parallel nor sharded on another dim."""
    return {id(p): group for group in groups for i, (p, spec) in enumerate(zip(group.sharded, group.tp_specs))
            if spec is None and i not in group.shard_dims}


def _same_placements(value: DTensor, target: torch.Tensor) -> bool:
    """Whether ``target`` is a DTensor with ``value``'s mesh and placements (``distribute_tensor``'s
    condition for taking a DTensor as it is)."""
    return (isinstance(target, DTensor) and value.device_mesh == target.device_mesh
            and value.placements == target.placements)
