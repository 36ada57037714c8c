"""Turning a torch TP plan into what ``overlap.tensor_parallel`` does per submodule.

A plan entry is one of torch's own ``ParallelStyle`` objects on the submodule(s) its key names
(``parallelize_module``'s keys: dot-separated, each part an ``fnmatch`` pattern over child names).
:func:`layer_plan` decides, for one (submodule, style), before anything is changed:

==============================================  =====================================================
style on module                                 what happens
==============================================  =====================================================
``ColwiseParallel`` on ``nn.Linear``            :class:`LinearPlan` ``colwise``: input ``Replicate()``
                                                or ``Shard(d)`` (``d >= 0``, the sequence dim);
                                                output any of ``Shard(-1)`` (no collective),
                                                ``Replicate()``, ``Shard(d)`` (torch's redistribute)
``RowwiseParallel`` on ``nn.Linear``            :class:`LinearPlan` ``rowwise``: input ``Shard(-1)``;
                                                output ``Replicate()`` or ``Shard(d)`` (``d >= 0``)
``ColwiseParallel`` / ``RowwiseParallel`` on    ``DELEGATE``: torch's style applies (nothing to
``nn.Embedding``; ``SequenceParallel``;         decompose; a ``PrepareModuleInput``'s
``PrepareModuleInput`` / ``Output`` /           ``Shard(d) -> Replicate()`` gather is deferred to
``InputOutput``                                 the column-parallel layers that read the input)
anything else                                   ``TypeError`` / ``ValueError`` naming the submodule
==============================================  =====================================================

A Linear's sharded weight dim (``out_features`` colwise, ``in_features`` rowwise) must be divisible
by the mesh size: a local tensor passed on between the pair (``use_local_output=True``, torch's
default) is read back as an even shard (``DTensor.from_local``), which an uneven one is not.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.placement_types import Placement

__all__ = ["DELEGATE", "DELEGATED_STYLES", "LinearPlan", "layer_plan"]

DELEGATED_STYLES = (SequenceParallel, PrepareModuleInput, PrepareModuleOutput, PrepareModuleInputOutput)
LINEAR_STYLES = (ColwiseParallel, RowwiseParallel)
KNOWN_STYLES = ", ".join(c.__name__ for c in (*LINEAR_STYLES, *DELEGATED_STYLES))
DELEGATE = "delegate"


@dataclass(frozen=True)
class LinearPlan:
    """What an ``nn.Linear`` becomes: ``kind`` 'colwise' or 'rowwise', the declared input and output
    layouts and ``use_local_output`` of its torch style, and ``chunks`` (None: chosen per call)."""

    fqn: str
    kind: str
    input_layout: Placement
    output_layout: Placement
    use_local_output: bool
    chunks: Optional[int]


def _where(fqn: str, style: object) -> str:
    return f"plan entry for submodule {fqn or '<root>'!r} ({style!r})"


def _seq_shard(p: Placement) -> bool:
    """``Shard(d)`` with ``d >= 0``: a sequence-style dim (not the features, checked per call)."""
    return isinstance(p, Shard) and p.dim >= 0


def layer_plan(fqn: str, module: nn.Module, style: object, mesh_size: int,
               chunks: Optional[int]) -> Union[LinearPlan, str]:
    """The plan for ``module`` (at ``fqn``) under ``style``: a :class:`LinearPlan`, or ``DELEGATE``.
    Raises ``TypeError`` / ``ValueError`` naming the submodule, the style and what is allowed."""
    where = _where(fqn, style)
    if type(style) in DELEGATED_STYLES:
        return DELEGATE
    if type(style) not in LINEAR_STYLES:
        raise TypeError(f"tensor_parallel: {where}: the style must be one of torch's {KNOWN_STYLES} "
                        f"(exactly those classes), got {type(style).__name__}")
    if isinstance(module, nn.Embedding):
        return DELEGATE
    if not isinstance(module, nn.Linear):
        raise ValueError(f"tensor_parallel: {where}: {type(style).__name__} applies to nn.Linear or nn.Embedding, "
                         f"got {type(module).__name__}")
    if type(module).forward is not nn.Linear.forward:
        raise ValueError(f"tensor_parallel: {where}: {type(module).__name__} overrides nn.Linear.forward, which "
                         f"tensor_parallel would replace; only nn.Linear's own forward is supported")
    colwise = type(style) is ColwiseParallel
    (inp,), (out,) = style.input_layouts, style.output_layouts
    if colwise:
        if not (isinstance(inp, Replicate) or _seq_shard(inp)):
            raise ValueError(f"tensor_parallel: {where}: ColwiseParallel's input_layouts must be Replicate() or "
                             f"Shard(d) with d >= 0 the sequence dim (sequence parallelism), got {inp}")
        if not (isinstance(out, (Replicate, Shard))):
            raise ValueError(f"tensor_parallel: {where}: ColwiseParallel's output_layouts must be Shard(-1), "
                             f"Replicate() or Shard(d), got {out}")
    else:
        if not (isinstance(inp, Shard) and inp.dim == -1):
            raise ValueError(f"tensor_parallel: {where}: RowwiseParallel's input_layouts must be Shard(-1) "
                             f"(the features, as the paired ColwiseParallel leaves them), got {inp}")
        if not (isinstance(out, Replicate) or _seq_shard(out)):
            raise ValueError(f"tensor_parallel: {where}: RowwiseParallel's output_layouts must be Replicate() or "
                             f"Shard(d) with d >= 0 the sequence dim (sequence parallelism), got {out}")
    name, size = ("out_features", module.out_features) if colwise else ("in_features", module.in_features)
    if size % mesh_size:
        raise ValueError(f"tensor_parallel: {where}: {name}={size} must be divisible by the mesh size {mesh_size} "
                         f"(its shards are passed on as local tensors, read back as even shards)")
    return LinearPlan(fqn, "colwise" if colwise else "rowwise", inp, out, style.use_local_output, chunks)
