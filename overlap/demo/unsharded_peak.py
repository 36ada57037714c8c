"""The most bytes of unsharded parameters a sharded model holds at once, counted the same way for
``overlap.shard`` and torch FSDP2 (``fully_shard``): what prefetching and gathering ahead cost in
memory, on CPU as on CUDA.

:class:`UnshardedPeak` is a context manager around the steps to measure; ``peak`` is the answer in
bytes. Concurrency contract: one thread drives the model's steps (the runtimes' hooks run there);
attach one counter per model at a time.

[Note: counting unsharded bytes]
A group holds its unsharded size (its parameters at full size, in the dtype compute sees them) from
the moment its all-gather is issued (the gather's output is allocated then) until it is resharded
(or its gather dropped unwaited). Both runtimes start holding a group only by issuing its gather
(``ParamGroup.issue_gather``; FSDP2's ``FSDPParamGroup.unshard``; at world size 1 with a cast,
``ParamGroup.finish_gather``), so the counter wraps those methods on each group instance and sums
the held groups right after each call: every rise is seen, so the peak is exact for this
definition, not a sample. One group's gather buffer and unsharded storage are both alive during its
copy-out, and gradients, activations and optimizer state take memory too: none of that is counted
(on CUDA, ``torch.cuda.max_memory_allocated`` sees all of it). The wrappers cost a sum over the
groups per gather, so the demo attaches the counter only to untimed steps.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

from torch import nn

__all__ = ["UnshardedPeak", "modelled_peak"]


class _Group:
    """One sharded group: the object whose methods issue its gather, its unsharded bytes, and a test
    of whether it holds them now."""

    __slots__ = ("owner", "nbytes", "holds", "issuers")

    def __init__(self, owner: Any, nbytes: int, holds: Callable[[], bool], issuers: tuple[str, ...]) -> None:
        self.owner, self.nbytes, self.holds, self.issuers = owner, nbytes, holds, issuers


def _unsharded_bytes(group: Any) -> int:
    """An ``overlap.shard`` group's parameters at full size, in the dtype compute sees them."""
    return sum(math.prod(shape) * group._unsharded_dtype(i).itemsize for i, shape in enumerate(group.layout.shapes))


def _overlap_groups(model: nn.Module) -> list[_Group]:
    from overlap.sharding import sharded_states

    groups = []
    for state in sharded_states(model):
        g = state.group
        if g is None:
            continue
        nbytes = _unsharded_bytes(g)
        groups.append(_Group(g, nbytes, lambda g=g: g.pending_gather is not None or (
            g.is_unsharded and not g.aliases_shards), ("issue_gather", "finish_gather")))
    return groups


def _fsdp2_groups(model: nn.Module) -> list[_Group]:
    from torch.distributed.fsdp import FSDPModule

    groups = []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        g = module._get_fsdp_state()._fsdp_param_group
        if g is None:
            continue
        nbytes = sum(math.prod(fp._orig_size) * (getattr(fp, "param_dtype", None) or fp.sharded_param.dtype).itemsize
                     for fp in g.fsdp_params)
        groups.append(_Group(g, nbytes, lambda g=g: g._all_gather_result is not None or g.is_unsharded, ("unshard",)))
    return groups


def modelled_peak(model: nn.Module) -> Optional[int]:
    """The most unsharded bytes ``model`` (the root of an ``overlap.shard`` tree) holds at once by
    ``scheduler.held_bytes.held_bytes``: its agreed forward order, the nesting of its groups in the
    last forward, its prefetch depth and the count of its gather-ahead plan, each group at the
    bytes :class:`UnshardedPeak` counts. None before the first step agreed the order, where a group
    runs twice in it, or for a model ``overlap.shard`` did not shard as a root."""
    from scheduler.held_bytes import held_bytes

    state = getattr(model, "_overlap_state", None)
    root = None if state is None else state.root
    if root is None or root.owner is not state or root.agreed_order is None or model.prefetch_depth is None:
        return None
    order = root.agreed_order
    if len(set(order)) != len(order) or list(root.forward_seq) != list(order):
        return None
    enclosing = root._enclosing()  # the root itself is counted held throughout, not as enclosing
    if enclosing is None:  # a post-forward missing from the last forward
        return None
    groups = [root.states[i].group for i in order]
    plan = model.gather_ahead
    return held_bytes([0 if g is None else _unsharded_bytes(g) for g in groups], model.prefetch_depth,
                      plan[0] if plan else 0, enclosing)


class UnshardedPeak:
    """Counts the bytes of unsharded parameters ``model`` holds (see [Note: counting unsharded
    bytes]) while the ``with`` block runs; ``peak`` is the most seen at once (held on entry
    included), ``largest_group`` the largest group's unsharded bytes.

    ``model``: a module sharded with ``overlap.shard`` or with torch's ``fully_shard`` (its whole
    subtree); anything else raises ``ValueError`` naming the argument.
    """

    def __init__(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"UnshardedPeak: model must be an nn.Module, got {type(model).__name__}")
        self._groups = _overlap_groups(model) or _fsdp2_groups(model)
        if not self._groups:
            raise ValueError("UnshardedPeak: model has no group sharded by overlap.shard or torch's fully_shard")
        self.largest_group = max(g.nbytes for g in self._groups)
        self.peak = 0
        self._attached = False

    def held(self) -> int:
        """Bytes of unsharded parameters held now."""
        return sum(g.nbytes for g in self._groups if g.holds())

    def _sample(self) -> None:
        self.peak = max(self.peak, self.held())

    def __enter__(self) -> "UnshardedPeak":
        if self._attached:
            raise RuntimeError("UnshardedPeak: already counting (one with block at a time)")
        for group in self._groups:
            for name in group.issuers:
                setattr(group.owner, name, self._counting(getattr(group.owner, name)))
        self._attached = True
        self.peak = self.held()
        return self

    def __exit__(self, *exc: object) -> None:
        for group in self._groups:
            for name in group.issuers:
                delattr(group.owner, name)  # the class's method again
        self._attached = False

    def _counting(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def issue_then_count(*args: Any, **kwargs: Any) -> Any:
            out = method(*args, **kwargs)
            self._sample()
            return out

        return issue_then_count
