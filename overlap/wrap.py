"""``overlap.wrap``: a drop-in sharded wrapper for one layer."""
from __future__ import annotations

from typing import Any

from torch import nn

from overlap.sharding import shard

__all__ = ["wrap", "Wrapped"]

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
    wrapped = Wrapped(layer)
    shard(wrapped, **options)
    return wrapped
