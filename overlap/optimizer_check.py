"""Refuse an optimizer that holds parameters ``overlap.shard`` replaced.

[Note: an optimizer built before shard]
``overlap.shard`` (and ``overlap.fully_shard``) replaces every parameter it shards with a new
DTensor parameter. An optimizer built before that holds the old objects: they never get a gradient
and the model no longer uses them, so its steps do nothing and training silently stands still
(FSDP2 the same). torch calls global optimizer step pre-hooks before every ``step()`` of every
optimizer; the one :func:`install` registers at the first ``shard()`` looks at an optimizer's
parameters at its first step, and again whenever their count changes (``add_param_group``), and
raises ``RuntimeError`` before the step runs, naming the replaced parameters and the fix. Between
those, a step pays one count and one dictionary lookup. A parameter is *replaced* when it carries
``overlap.shard``'s mark but is not its group's current sharded parameter.

The same hook first runs what must complete before a step reads gradients (:func:`require_before_step`):
a root's backward that awaits ``finalize_backward`` ([Note: manual backward finalization] in
``overlap/sharding.py``). Nothing is registered outside manual finalization: a step pays one
truth test of an empty dict for it.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["check_optimizer", "install", "release_before_step", "require_before_step"]

MARK = "_overlap_sharded_by"
"""Set by ``overlap.shard`` on each parameter it shards and on the DTensor that replaces it."""

_checked: "weakref.WeakKeyDictionary[torch.optim.Optimizer, int]" = weakref.WeakKeyDictionary()
_installed = False
_before_step: dict[int, Callable[[torch.optim.Optimizer], None]] = {}


def require_before_step(key: int, finish: Callable[[torch.optim.Optimizer], None]) -> None:
    """Call ``finish(optimizer)`` before every optimizer step until :func:`release_before_step`
    (``key``)."""
    _before_step[key] = finish


def release_before_step(key: int) -> None:
    _before_step.pop(key, None)


def install() -> None:
    """Register the global optimizer step pre-hook (once; ``overlap.shard`` calls it)."""
    global _installed
    if not _installed:
        register_optimizer_step_pre_hook(_pre_step)
        _installed = True


def _pre_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    check_optimizer(optimizer)
    if _before_step:
        for finish in list(_before_step.values()):
            finish(optimizer)


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Raise ``RuntimeError`` if ``optimizer`` holds parameters ``overlap.shard`` replaced (checked
    again only when its parameter count changed since the last check that passed)."""
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    if _checked.get(optimizer) == count:
        return
    replaced = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            current = getattr(getattr(p, MARK, None), "sharded", None)  # the group's sharded parameters
            if current is not None and not any(p is s for s in current):
                replaced.append(getattr(p, "_overlap_sharded_fqn", "?"))
    if replaced:
        shown = ", ".join(repr(name) for name in replaced[:8]) + (f" and {len(replaced) - 8} more" if len(replaced) > 8 else "")
        raise RuntimeError(
            f"{type(optimizer).__name__} holds {len(replaced)} parameter(s) that overlap.shard replaced after the "
            f"optimizer was built ({shown}; names relative to the sharded module): it would never update the model. "
            f"Build the optimizer after overlap.shard / overlap.fully_shard (as with FSDP2), from model.parameters()")
    _checked[optimizer] = count
