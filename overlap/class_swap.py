"""Swapping a module's class for one that adds a runtime's behaviour, as FSDP2 does.

``overlap.shard`` makes a sharded module's class ``Sharded<cls>`` (a subclass of ``ShardedModule``
and of the original class) and ``overlap.tensor_parallel`` makes a parallelized Linear's
``TensorParallel<cls>``: the module keeps its identity, parameters, hooks and ``isinstance`` checks
against its own class, and gains the mixin's methods. One class per (mixin, original class),
created on first use.
"""
from __future__ import annotations

__all__ = ["swapped_class"]

_classes: dict[tuple[type, type], type] = {}


def swapped_class(mixin: type, cls: type, prefix: str) -> type:
    """The subclass ``<prefix><cls.__name__>`` of ``(mixin, cls)``, the same object on every call."""
    made = _classes.get((mixin, cls))
    if made is None:
        # The original class's module: libraries that branch on where a class comes from (HF's
        # custom-code check picks its init path from ``__module__``) see the model's own class.
        made = type(f"{prefix}{cls.__name__}", (mixin, cls), {"__module__": cls.__module__})
        _classes[(mixin, cls)] = made
    return made
