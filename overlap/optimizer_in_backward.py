"""``overlap.optimizer_in_backward``: step each sharded group's parameters as soon as its gradients
are reduced, so the optimizer math of the groups reduced first overlaps the rest of backward and the
last reductions.

[Note: optimizer in backward]
Without it, the optimizer step waits for every reduce-scatter, so the last ones are exposed at the
end of backward (nothing runs after them), and then the whole optimizer step runs. Here one torch
optimizer per group (one ``overlap.shard`` call) is stepped by the runtime right after the group's
reduction epilogue (see [Note: hooks after the reduction] in ``overlap/param_group.py``): the groups
reduced first are stepped while later ones are still in flight, and at the end of backward only the
last group's step is left. With ``prefetch="auto"`` the runtime may move the steps of the groups the
next forward needs last to the end of backward, where the last reductions leave the host idle
(see [Note: deferred optimizer steps] in ``overlap/sharding.py``); they still run in backward. Each parameter sees the same update as in the plain loop, bitwise, for
any optimizer whose update of a parameter reads only that parameter's gradient and state (SGD,
Adam, AdamW, ...): the per-group optimizers are built with the same arguments and pick the same
implementation. Optimizers that couple parameters (LBFGS; anything reading a global norm) are not.

Gradient clipping needs the norm over all gradients before any step, so it cannot run in backward:
with ``max_norm`` set, nothing is stepped in backward and :meth:`OptimizerInBackward.step` clips
(``torch.nn.utils.clip_grad_norm_`` over all parameters) and steps every group, i.e. the plain step.

Micro-batches under ``overlap.no_sync`` reduce nothing, so nothing is stepped until the backward
that reduces. A group that was not stepped in backward (its parameters got no gradient in a step
that reduced, on one rank) is stepped by :meth:`OptimizerInBackward.step`, which the training loop
calls after backward as usual; after a group's step its gradients are dropped (``set_to_none``).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
from torch import nn

from overlap.param_group import ParamGroup
from overlap.sharding import ShardedModule, sharded_states

__all__ = ["OptimizerInBackward", "optimizer_in_backward"]


class OptimizerInBackward:
    """One optimizer per sharded group (``optimizers``), stepped by the runtime in backward.

    Use it where the loop used its optimizer: ``step()`` after backward (it steps only what backward
    did not), ``zero_grad()``; ``state_dict()`` / ``load_state_dict()`` hold every group's state, and
    ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(model, opt.optimizers)``
    accepts the list. An LR scheduler is one per optimizer in ``optimizers``.
    """

    def __init__(self, model: ShardedModule, groups: list[ParamGroup], optimizers: list[torch.optim.Optimizer],
                 max_norm: Optional[float]) -> None:
        self.model = model
        self.optimizers = optimizers
        self.max_norm = max_norm
        self._groups = groups
        self._hooks: list[Callable[[list[nn.Parameter]], None]] = []
        if max_norm is None:
            for group, optimizer in zip(groups, optimizers):
                hook = _step_hook(optimizer)
                group.reduced_hooks.append(hook)
                self._hooks.append(hook)

    def step(self) -> None:
        """Step what backward did not: with ``max_norm``, clip over all parameters and step every
        group; otherwise step the groups whose parameters still hold gradients. Drops the gradients
        of the groups it steps."""
        if self.max_norm is not None:
            # In the model's parameter order, as the plain loop clips: the total norm sums the
            # per-parameter norms, and another order rounds differently.
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
        for optimizer in self.optimizers:
            if any(p.grad is not None for g in optimizer.param_groups for p in g["params"]):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        states = state.get("optimizers") if isinstance(state, dict) else None
        if not isinstance(states, list) or len(states) != len(self.optimizers):
            raise ValueError(f"state must be a state_dict() of an OptimizerInBackward with {len(self.optimizers)} "
                             f"optimizers, got {type(state).__name__}"
                             + (f" with {len(states)}" if isinstance(states, list) else ""))
        for optimizer, s in zip(self.optimizers, states):
            optimizer.load_state_dict(s)

    def remove(self) -> None:
        """Stop stepping in backward (the optimizers stay usable through ``step``)."""
        for group, hook in zip(self._groups, self._hooks):
            if hook in group.reduced_hooks:
                group.reduced_hooks.remove(hook)
        self._hooks = []


def _step_hook(optimizer: torch.optim.Optimizer) -> Callable[[list[nn.Parameter]], None]:
    def step(_: list[nn.Parameter]) -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def optimizer_in_backward(model: nn.Module, optimizer_class: type, *, max_norm: Optional[float] = None,
                          **optimizer_kwargs: Any) -> OptimizerInBackward:
    """Build ``optimizer_class(params, **optimizer_kwargs)`` once per sharded group of ``model`` (the
    root passed to ``overlap.shard``) and step each in backward, as soon as its gradients are
    reduced (see [Note: optimizer in backward]). ``max_norm``: clip gradients to this total norm,
    which makes :meth:`OptimizerInBackward.step` the plain clip-and-step (nothing steps in backward).

    Raises ``TypeError`` / ``ValueError`` naming the argument, before anything is registered.
    """
    if not isinstance(model, ShardedModule):
        raise TypeError(f"model must be the root module passed to overlap.shard, got {type(model).__name__}")
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}")
    if max_norm is not None and (isinstance(max_norm, bool) or not isinstance(max_norm, (int, float))
                                 or not math.isfinite(max_norm) or max_norm <= 0):
        raise ValueError(f"max_norm must be None or a finite number > 0, got {max_norm!r}")
    groups = [s.group for s in sharded_states(model) if s.group is not None]
    if any(g.reduced_hooks for g in groups):
        raise ValueError("model already has an optimizer in backward (or other reduced hooks); "
                         "call remove() on the first one before building another")
    owned = {id(p) for g in groups for p in g.sharded}
    loose = [name for name, p in model.named_parameters() if id(p) not in owned]
    if loose:
        raise ValueError(f"model has parameters no overlap.shard group owns: {loose[:3]}; "
                         "call overlap.shard on model itself (its root) before optimizer_in_backward")
    groups = [g for g in groups if any(p.requires_grad for p in g.sharded)]
    optimizers = [optimizer_class([p for p in g.sharded if p.requires_grad], **optimizer_kwargs) for g in groups]
    return OptimizerInBackward(model, groups, optimizers, max_norm)
