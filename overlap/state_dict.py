"""Full (unsharded) state dicts of a sharded model, with the module's original keys.

``module.state_dict()`` of a sharded model is already the *sharded* state dict: the same keys, each
sharded parameter holding this rank's dim-0 rows; ``module.load_state_dict`` round-trips it.
``full_state_dict`` gathers the full tensors (every rank takes part in the all-gathers) and
``load_full_state_dict`` shards full tensors back into place, checking every key and shape first so
that nothing is half-applied.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn

import kernels
from overlap.collectives import all_gather_into
from overlap.param_group import ParamGroup, widest_dtype
from overlap.sharding import sharded_states

__all__ = ["full_state_dict", "load_full_state_dict"]


def _sharded_params(module: nn.Module) -> dict[int, tuple[ParamGroup, int]]:
    """id(sharded parameter) -> (its group, its index in the group)."""
    out: dict[int, tuple[ParamGroup, int]] = {}
    for state in sharded_states(module):
        if state.group is not None:
            if state.group.is_unsharded:
                raise RuntimeError("full_state_dict / load_full_state_dict must be called between steps, not inside forward/backward")
            for i, p in enumerate(state.group.sharded):
                out[id(p)] = (state.group, i)
    return out


def _gather_full(group: ParamGroup) -> list[torch.Tensor]:
    """The group's full parameters in their original dtypes (bitwise: gathered in a dtype that holds them)."""
    with torch.no_grad():
        ag_input, ag_output = kernels.all_gather_copy_in(
            [p.detach() for p in group.sharded], group.layout, group.rank, widest_dtype(group.orig_dtypes)
        )
        if group.world_size > 1:
            all_gather_into(ag_output, ag_input, group.info).wait()
        outs = [torch.empty(shape, dtype=d, device=ag_output.device) for shape, d in zip(group.layout.shapes, group.orig_dtypes)]
        return kernels.all_gather_copy_out(ag_output, group.layout, outs)


def full_state_dict(module: nn.Module, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The unsharded state dict under ``module``'s original keys (parameters gathered, buffers as they
    are). Every rank must call it; with ``rank0_only`` the other ranks get ``{}``."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"full_state_dict: module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(rank0_only, bool):
        raise TypeError(f"full_state_dict: rank0_only must be a bool, got {rank0_only!r}")
    owners = _sharded_params(module)
    full: dict[int, torch.Tensor] = {}
    for state in sharded_states(module):
        if state.group is not None:
            for p, t in zip(state.group.sharded, _gather_full(state.group)):
                full[id(p)] = t
    if rank0_only and dist.is_initialized() and dist.get_rank() != 0:
        return {}
    return {
        key: (full[id(value)] if id(value) in owners else value.detach().clone())
        for key, value in module.state_dict(keep_vars=True).items()
    }


def load_full_state_dict(module: nn.Module, state_dict: Mapping[str, Any]) -> None:
    """Load full (unsharded) tensors into a sharded ``module``: each rank keeps its rows.

    Keys and shapes must match ``full_state_dict(module)`` exactly; every mismatch is reported before
    anything is written.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"load_full_state_dict: module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"load_full_state_dict: state_dict must be a mapping of str to tensors, got {type(state_dict).__name__}")
    owners = _sharded_params(module)
    targets = module.state_dict(keep_vars=True)
    problems = [f"missing key {k!r}" for k in targets if k not in state_dict]
    problems += [f"unexpected key {k!r}" for k in state_dict if k not in targets]
    for key, target in targets.items():
        value = state_dict.get(key)
        if value is None:
            continue
        if not isinstance(value, torch.Tensor):
            problems.append(f"{key!r} is a {type(value).__name__}, not a tensor")
            continue
        owner = owners.get(id(target))
        want = owner[0].layout.shapes[owner[1]] if owner is not None else target.shape
        if value.shape != want:
            problems.append(f"{key!r} has shape {tuple(value.shape)}, the model expects {tuple(want)}")
    if problems:
        raise ValueError("load_full_state_dict: " + "; ".join(problems))
    with torch.no_grad():
        for key, target in targets.items():
            owner = owners.get(id(target))
            value = state_dict[key]
            if owner is not None:
                group, index = owner
                target.copy_(group.layout.shard(value.to(target.device), group.rank))
            else:
                target.copy_(value)
