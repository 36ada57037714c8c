"""A module input that torch's ``PrepareModuleInput`` would gather whole, gathered instead by the
column-parallel layers that read it, chunk by chunk behind their matmuls.

[Note: deferring a prepared input's gather]
torchtitan's plan prepares the attention's input with ``PrepareModuleInput(input_layouts=Shard(1),
desired_input_layouts=Replicate())``: torch gathers the sequence-sharded input whole in the
module's forward pre-hook and hands the module a replicated DTensor, so q, k and v
(``ColwiseParallel()`` on a replicated input) run no collective, the gather sits whole before the
first projection, and in backward the summed ``Partial()`` input gradient is reduce-scattered whole
after the last. There is nothing to decompose until the gather is moved into the layers.

So ``overlap.tensor_parallel`` applies such an entry as :class:`DeferringPrepareModuleInput`
(torch's style, one method overridden): for each input declared ``Shard(d)`` (``d >= 0``) and
desired ``Replicate()`` (with ``use_local_output=False``, torch's default and torchtitan's) the
module gets a replicated DTensor of the global shape whose local tensor is a
:class:`DeferredGather`: it holds this rank's shard and gathers nothing yet. Then:

* a parallelized column-parallel Linear given it (``layers``) reads the shard and runs the
  decomposed all-gather -> matmul on it, as for a ``Shard(d)`` input: q, k and v share one chunked
  gather and, in backward, one chunked reduce-scatter ([Note: sibling layers share one gather],
  [Note: sibling layers share one reduce-scatter]); their input gradient goes to the shard
  directly;
* any other op on it (a residual, a torch style, ``to_local()``, a print) first gathers it whole,
  once (the siblings' gather if one is still held), then runs on the full tensor; its gradient
  reaches the shard through :class:`_DeferGather`, whose backward is torch's redistribute of that
  gradient to ``Shard(d)`` (a reduce-scatter of a ``Partial()`` gradient, a slice of a replicated
  one). Autograd sums the two paths at the shard.

Shape metadata (``x.shape``, ``x.size(1)``) is the DTensor's and needs no gather. A chunk count of 1
(``chunks=1``, or chosen 1 for a small input) reads the input the torch way: gathered whole, a
local matmul, the gradient left ``Partial()`` for one reduce-scatter, bitwise torch's order.
Under ``torch.compile`` the entry is torch's own (the graph's collectives are the Inductor hook's
business, ``scheduler.collective_matmul``). Every rank runs the same layers on the same input,
so every rank defers and gathers alike (contract 3).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleInputOutput
from torch.distributed.tensor.placement_types import Placement
from torch.utils._pytree import tree_map

from overlap.groups import GroupInfo, resolve_group
from overlap.tensor_parallelism.collective_matmul import gathered, shard_sizes

__all__ = ["DeferredGather", "DeferringPrepareModuleInput", "deferred_input", "deferring"]


class DeferredGather(torch.Tensor):
    """The gathered value of ``shard`` (this rank's slice along ``dim``; every rank's extent
    ``sizes``) over ``info``'s group, gathered at the first op that reads it (then kept); the
    local tensor of a prepared replicated DTensor ([Note: deferring a prepared input's gather])."""

    shard: torch.Tensor
    dim: int
    sizes: list[int]
    info: GroupInfo
    _full: Optional[torch.Tensor]

    @staticmethod
    def __new__(cls, shard: torch.Tensor, dim: int, sizes: list[int], info: GroupInfo) -> "DeferredGather":
        shape = list(shard.shape)
        shape[dim] = sum(sizes)
        self = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=shard.dtype, device=shard.device)
        self.shard, self.dim, self.sizes, self.info, self._full = shard, dim, sizes, info, None
        return self

    def materialize(self) -> torch.Tensor:
        """The gathered tensor (no autograd: the gradient path is :class:`_DeferGather`)."""
        if self._full is None:
            with torch.no_grad():
                self._full = gathered(self.shard, self.sizes, self.dim, self.info)
        return self._full

    def __repr__(self) -> str:  # type: ignore[override]
        state = "gathered" if self._full is not None else "not gathered yet"
        return f"DeferredGather(shape={tuple(self.shape)}, dim={self.dim}, {state})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        def full(t: Any) -> Any:
            return t.materialize() if isinstance(t, DeferredGather) else t

        return func(*tree_map(full, args), **tree_map(full, kwargs or {}))


class _DeferGather(torch.autograd.Function):
    """``shard`` -> a replicated DTensor over ``mesh`` whose local tensor is a :class:`DeferredGather`;
    backward: the gradient redistributed to ``Shard(dim)`` (torch's collective), this rank's slice."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, mesh: DeviceMesh, dim: int, shape: torch.Size,  # type: ignore[override]
                stride: tuple[int, ...]) -> DTensor:
        ctx.mesh, ctx.dim, ctx.shape, ctx.stride = mesh, dim, shape, stride
        ctx.set_materialize_grads(False)
        sizes = shard_sizes(shape[dim], mesh.size())
        lazy = DeferredGather(shard, dim, sizes, resolve_group(mesh, "mesh"))
        spec = DTensorSpec(mesh, (Replicate(),), tensor_meta=TensorMeta(shape, stride, shard.dtype))
        return DTensor(lazy, spec, requires_grad=shard.requires_grad)

    @staticmethod
    def backward(ctx, grad: Optional[torch.Tensor]):  # type: ignore[override]
        if grad is None:
            return None, None, None, None, None
        if not isinstance(grad, DTensor):  # a plain gradient of a replicated value: this rank's slice
            grad = DTensor.from_local(grad, ctx.mesh, [Replicate()], run_check=False, shape=ctx.shape,
                                      stride=ctx.stride)
        return grad.redistribute(ctx.mesh, [Shard(ctx.dim)]).to_local(), None, None, None, None


def deferred_input(x: torch.Tensor) -> Optional[DeferredGather]:
    """``x``'s :class:`DeferredGather` if ``x`` is a prepared input whose gather has not happened yet
    (a column-parallel layer then gathers it chunk by chunk), else None."""
    if isinstance(x, DTensor) and isinstance(x._local_tensor, DeferredGather) and x._local_tensor._full is None:
        return x._local_tensor
    return None


def _defers(input_layout: Optional[Placement], desired: Optional[Placement]) -> bool:
    return isinstance(input_layout, Shard) and input_layout.dim >= 0 and isinstance(desired, Replicate)


class DeferringPrepareModuleInput(PrepareModuleInput):
    """torch's ``PrepareModuleInput`` whose ``Shard(d) -> Replicate()`` inputs are gathered by the
    layers that read them ([Note: deferring a prepared input's gather]); every other input, and
    every input under ``torch.compile`` or on one rank, exactly as torch prepares it."""

    def _prepare_input_arg(self, input: Any, mesh: DeviceMesh, input_layout: Optional[Placement],
                           desired_layout: Optional[Placement]) -> Any:
        if (not _defers(input_layout, desired_layout) or self.use_local_output or mesh.size() == 1
                or torch.compiler.is_compiling() or not isinstance(input, torch.Tensor)):
            return super()._prepare_input_arg(input, mesh, input_layout, desired_layout)
        sharded = input if isinstance(input, DTensor) else DTensor.from_local(input, mesh, (input_layout,),
                                                                              run_check=False)
        placement = sharded.placements[0]
        if not (isinstance(placement, Shard) and placement.dim % sharded.dim() < sharded.dim() - 1):
            return super()._prepare_input_arg(input, mesh, input_layout, desired_layout)  # not a sequence shard
        dim = placement.dim % sharded.dim()
        return _DeferGather.apply(sharded.to_local(), mesh, dim, sharded.shape, sharded.stride())


def deferring(style: Any) -> Any:
    """A copy of torch's ``PrepareModuleInput`` / ``PrepareModuleInputOutput`` ``style`` whose input
    preparation defers its gathers; any other style unchanged."""
    if type(style) is PrepareModuleInput:
        copy = DeferringPrepareModuleInput.__new__(DeferringPrepareModuleInput)
        copy.__dict__.update(style.__dict__)
        return copy
    if type(style) is PrepareModuleInputOutput:
        copy = PrepareModuleInputOutput.__new__(PrepareModuleInputOutput)
        copy.__dict__.update(style.__dict__)
        copy.prepare_module_input = deferring(style.prepare_module_input)
        return copy
    return style
