"""Full (unsharded) state dicts of a sharded model, with the module's own keys.

``module.state_dict()`` of a sharded model is the *sharded* state dict: the same keys, each sharded
parameter a ``Shard(0)`` DTensor (see [Note: sharded parameters are DTensors] in
``overlap/param_group.py``), which is what DCP and ``torch.distributed.checkpoint.state_dict`` read.
``full_state_dict`` turns it into full tensors and ``load_full_state_dict`` loads full tensors back,
both through ``module.state_dict()`` / ``module.load_state_dict()``, so user state-dict hooks (a
post-hook that splits a fused parameter into several keys, a pre-hook that fuses them back) see and
produce the same keys as on the unsharded model. Every rank must call both (they communicate).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

import kernels
from overlap.collectives import all_gather_into
from overlap.param_group import ParamGroup, tp_dtensor, widest_dtype
from overlap.sharding import sharded_states

__all__ = ["full_state_dict", "load_full_state_dict"]


def _groups_between_steps(module: nn.Module, caller: str) -> list[ParamGroup]:
    groups = [s.group for s in sharded_states(module) if s.group is not None]
    if any(g.is_unsharded for g in groups):
        raise RuntimeError(f"{caller} must be called between steps, not inside forward/backward")
    return groups


def _gather_full(group: ParamGroup) -> list[torch.Tensor]:
    """The group's full parameters in their original dtypes (bitwise: gathered in a dtype that holds
    them), with one fused all-gather for the whole group."""
    ag_input, ag_output = kernels.all_gather_copy_in(
        group.shard_rows(), group.layout, group.rank, widest_dtype(group.orig_dtypes))
    if group.world_size > 1:
        all_gather_into(ag_output, ag_input, group.info).wait()
    outs = [torch.empty(shape, dtype=d, device=ag_output.device) for shape, d in zip(group.layout.shapes, group.orig_dtypes)]
    return kernels.all_gather_copy_out(ag_output, group.layout, outs)


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
            if group.has_tp_params:  # a gathered tensor-parallel shard: gather that too
                gathered = [t if spec is None else tp_dtensor(t, spec).full_tensor()
                            for t, spec in zip(gathered, group.tp_specs)]
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
    anything is written. Every rank passes the full tensors.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"load_full_state_dict: module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"load_full_state_dict: state_dict must be a mapping of str to tensors, got {type(state_dict).__name__}")
    _groups_between_steps(module, "load_full_state_dict")
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
    if problems:
        raise ValueError("load_full_state_dict: " + "; ".join(problems))
    local: dict[str, Any] = {}
    for key, target in targets.items():
        value = state_dict[key]
        if isinstance(target, DTensor):
            # Every rank holds the full tensor: each takes its own part, no communication.
            value = distribute_tensor(value.detach().to(target.device, target.dtype), target.device_mesh,
                                      target.placements, src_data_rank=None)
        local[key] = value
    module.load_state_dict(local, strict=True)
