"""``overlap.wrap``: a drop-in sharded wrapper for one layer, and DDP around the rest of the model.

A wrapped layer's parameters are sharded DTensors managed by the runtime (gathered before its
forward, gradients reduce-scattered in its backward). The rest of the model can stay plain and be
data-parallelized by torch's ``DistributedDataParallel`` once :func:`exclude_from_ddp` has told DDP to
leave the wrapped parameters alone (DDP would otherwise broadcast them at start-up and all-reduce
their gradients a second time). A layer whose parameter is also registered outside it (a tied
``lm_head`` / embedding) cannot be wrapped on its own: sharding it would untie the two, so ``wrap``
raises and points to ``overlap.shard`` on a module that holds every use.
"""
from __future__ import annotations

import gc
from typing import Any

from torch import nn

from overlap.sharding import ShardedModule, shard

__all__ = ["wrap", "Wrapped", "exclude_from_ddp"]

_PREFIX = "module."


class Wrapped(nn.Module):
    """Runs the wrapped ``module`` (sharded by ``overlap.shard``) with the same forward signature.

    ``state_dict()`` and ``load_state_dict()`` use the wrapped module's own keys (no ``module.``
    prefix), so a wrapped layer's checkpoint is the layer's checkpoint.
    """

    def __init__(self, module: nn.Module) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"Wrapped: module must be a torch.nn.Module, got {type(module).__name__}")
        super().__init__()
        self.module = module
        self._register_state_dict_hook(_strip_prefix)
        self._register_load_state_dict_pre_hook(_add_prefix)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def extra_repr(self) -> str:
        return "sharded by overlap"


def _strip_prefix(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    for key in list(state_dict):
        if key.startswith(prefix + _PREFIX):
            state_dict[prefix + key[len(prefix) + len(_PREFIX):]] = state_dict.pop(key)


def _add_prefix(state_dict: dict, prefix: str, *args: Any) -> None:
    for key in list(state_dict):
        if key.startswith(prefix) and not key.startswith(prefix + _PREFIX):
            state_dict[prefix + _PREFIX + key[len(prefix):]] = state_dict.pop(key)


def wrap(layer: nn.Module, **options: Any) -> Wrapped:
    """A module that behaves as ``layer`` with its parameters sharded by ``overlap.shard(**options)``.

    ``layer`` itself is sharded in place and lives on as ``wrapped.module``.
    """
    if not isinstance(layer, nn.Module):
        raise TypeError(f"wrap: layer must be a torch.nn.Module, got {type(layer).__name__}")
    tied = _registered_outside(layer)
    if tied:
        raise ValueError(
            f"wrap: parameters {sorted(tied)} of {type(layer).__name__} are also registered in modules "
            f"outside it ({', '.join(sorted(set(tied.values())))}), e.g. a tied embedding / lm_head; "
            f"wrapping the layer alone would untie them. Call overlap.shard on a module that contains "
            f"every use of them instead")
    wrapped = Wrapped(layer)
    shard(wrapped, **options)
    return wrapped


def _registered_outside(layer: nn.Module) -> dict[str, str]:
    """Parameters of ``layer`` that a module outside ``layer`` also registers: name -> that module's
    class name. One scan of the heap for the dicts that hold them, one for those dicts' owners."""
    params = {id(p): name for name, p in layer.named_parameters(remove_duplicate=False)}
    if not params:
        return {}
    inside = {id(m._parameters) for m in layer.modules()}
    holders = [d for d in gc.get_referrers(*[p for p in layer.parameters()])
               if isinstance(d, dict) and id(d) not in inside]
    found: dict[str, str] = {}
    if not holders:
        return found
    holder_ids = {id(d) for d in holders}
    for owner in gc.get_referrers(*holders):
        # A module's ``_parameters`` is referred to by its ``__dict__`` (or, where the interpreter
        # keeps attributes inline, by the module itself).
        if isinstance(owner, nn.Module):
            registered, name = owner.__dict__.get("_parameters"), type(owner).__name__
        elif isinstance(owner, dict) and isinstance(owner.get("_parameters"), dict):
            registered, name = owner["_parameters"], _owner_name(owner)
        else:
            continue
        if isinstance(registered, dict) and id(registered) in holder_ids:
            for p in registered.values():
                if p is not None and id(p) in params:
                    found[params[id(p)]] = name
    return found


def _owner_name(module_dict: dict) -> str:
    for module in gc.get_referrers(module_dict):
        if isinstance(module, nn.Module) and module.__dict__ is module_dict:
            return type(module).__name__
    return "a module"


def exclude_from_ddp(model: nn.Module) -> list[str]:
    """Make torch's ``DistributedDataParallel(model, ...)`` skip every parameter that ``overlap``
    shards inside ``model`` (layers from :func:`wrap` or modules passed to ``overlap.shard``): the
    runtime already gathers them and reduces their gradients. Call it before constructing DDP.
    Returns the names DDP will ignore (``model.named_parameters()`` names)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"exclude_from_ddp: model must be a torch.nn.Module, got {type(model).__name__}")
    from torch.nn.parallel import DistributedDataParallel

    sharded = {id(p) for m in model.modules() if isinstance(m, ShardedModule) for p in m.parameters()}
    if not sharded:
        raise ValueError(f"exclude_from_ddp: {type(model).__name__} has no module sharded by overlap "
                         f"(overlap.wrap / overlap.shard); there is nothing to exclude")
    names = [n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in sharded]
    previous = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, sorted(set(previous + names)))
    return names
