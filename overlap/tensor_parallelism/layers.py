"""The ``nn.Linear`` that ``overlap.tensor_parallel`` makes of a Colwise / Rowwise plan entry.

:func:`parallelize_linear` shards the parameters exactly as torch's style does (``distribute_tensor``
from rank 0: colwise weight and bias ``Shard(0)``; rowwise weight ``Shard(1)``, bias
``Replicate()``) and swaps the module's class for a subclass of :class:`TensorParallelLinear`
(named ``TensorParallel<cls>``), whose ``forward`` runs the decomposed collective matmul of
``overlap.tensor_parallelism.collective_matmul`` on the local tensors. State-dict keys, parameter
names and DTensor specs are torch TP's; ``weight.grad`` / ``bias.grad`` are DTensors with the
parameter's placements.

Inputs, per call (``w`` ranks; what torch's style would do, done with decomposed collectives):

=============  ==========================================  ==========================================
layer          input                                       collective
=============  ==========================================  ==========================================
colwise        DTensor ``Shard(d)``, or a plain tensor     all-gather -> matmul; grad: matmul ->
               declared ``Shard(d)`` (read as an even       reduce-scatter
               shard, as ``DTensor.from_local`` does)
colwise        plain tensor declared ``Replicate()``       none; grad: matmul -> all-reduce
colwise        DTensor ``Replicate()``                     none; its gradient is returned
                                                           ``Partial()`` (torch's, lazily reduced)
colwise        a DTensor with another placement            torch's ``redistribute`` to Replicate first
rowwise        ``Shard(-1)`` (DTensor or plain)            matmul -> reduce-scatter (``Shard(d)``
                                                           output) or -> all-reduce (``Replicate()``)
=============  ==========================================  ==========================================

A colwise output other than ``Shard(-1)`` is redistributed by DTensor (torch's collective, not
decomposed). With one rank nothing is communicated. Each call is labelled
``overlap::tp_forward (fqn)`` / ``overlap::tp_backward (fqn)`` in the profiler.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement

from overlap.class_swap import swapped_class
from overlap.groups import GroupInfo, resolve_group
from overlap.regions import with_fqn
from overlap.tensor_parallelism import collective_matmul as cm
from overlap.tensor_parallelism.chunks import Workload, choose_chunks
from overlap.tensor_parallelism.deferred_gather import deferred_input
from overlap.tensor_parallelism.plan import LinearPlan

__all__ = ["TensorParallelLinear", "parallelize_linear"]


class _State:
    """What a parallelized Linear keeps: its plan, mesh, group and region names; it picks each
    call's chunk count (``overlap.tensor_parallelism.chunks``)."""

    def __init__(self, plan: LinearPlan, mesh: DeviceMesh, info: GroupInfo) -> None:
        self.plan, self.mesh, self.info = plan, mesh, info
        self.forward_region = with_fqn("overlap::tp_forward", plan.fqn)
        self.backward_region = with_fqn("overlap::tp_backward", plan.fqn)

    def _call(self, kind: str, rows: int, gemm_rows: int, weight: torch.Tensor, like: torch.Tensor,
              wire_bytes: float, layout: Optional[tuple[list[int], int]] = None) -> cm.Call:
        work = Workload(kind, rows, gemm_rows, weight.shape[1], weight.shape[0], wire_bytes, like.dtype,
                        self.mesh.device_type)
        chunks = choose_chunks(work, self.info, self.plan.chunks, like.device)
        seq = cm.SeqLayout(layout[0], layout[1], chunks, self.info.rank) if layout is not None else None
        return cm.Call(self.info, chunks, self.forward_region, self.backward_region, seq)

    def rows_call(self, x: torch.Tensor, weight: torch.Tensor, kind: str) -> cm.Call:
        """An all-reduce (``kind`` ``all_reduce``: of the output, ``all_reduce_grad``: of the input's
        gradient) of ``x``'s rows, cut into row blocks."""
        rows = x.numel() // max(x.shape[-1], 1)
        w = self.info.size
        cols = weight.shape[0] if kind == "all_reduce" else weight.shape[1]
        return self._call(kind, rows, rows, weight, x, 2 * rows * cols * x.element_size() * (w - 1) / w)

    def seq_call(self, x: torch.Tensor, sizes: list[int], dim: int, weight: torch.Tensor, kind: str) -> cm.Call:
        """A gather (``kind`` ``gather``: of the input) / reduce-scatter (``scatter``: of the output)
        along ``dim`` (every rank's extent ``sizes``) of ``x``'s shape, cut into sub-slices of every
        rank's shard."""
        w = self.info.size
        lead = math.prod(x.shape[:dim]) * math.prod(x.shape[dim + 1:-1])  # global sizes only: same on every rank
        cols = weight.shape[1] if kind == "gather" else weight.shape[0]
        rows = lead * sum(sizes)
        return self._call(kind, max(sizes), rows, weight, x, rows * cols * x.element_size() * (w - 1) / w, (sizes, dim))


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, at = [], 1
    for s in reversed(shape):
        stride.append(at)
        at *= max(s, 1)
    return tuple(reversed(stride))


def _as_dtensor(y: torch.Tensor, mesh: DeviceMesh, placement: Placement, shape: tuple[int, ...]) -> DTensor:
    return DTensor.from_local(y, mesh, [placement], run_check=False, shape=torch.Size(shape),
                              stride=_contiguous_stride(shape))


def _seq_dim(placement: Shard, x: torch.Tensor, fqn: str) -> int:
    d = placement.dim if placement.dim >= 0 else placement.dim + x.dim()
    if not 0 <= d < x.dim() - 1:
        raise ValueError(f"tensor_parallel: {fqn!r} got an input of shape {tuple(x.shape)} sharded on dim "
                         f"{placement.dim}: the sharded (sequence) dim must be one of 0..{x.dim() - 2}, not the features")
    return d


class TensorParallelLinear(nn.Module):
    """An ``nn.Linear`` parallelized by ``overlap.tensor_parallel`` (the base of the swapped class)."""

    _overlap_tp: _State

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        state = self._overlap_tp
        weight = self.weight.to_local()
        bias = self.bias.to_local() if self.bias is not None else None
        if state.plan.kind == "colwise":
            return self._colwise(x, weight, bias, state)
        return self._rowwise(x, weight, bias, state)

    def _colwise(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 state: _State) -> torch.Tensor:
        plan, w = state.plan, state.info.size
        y = self._deferred_colwise(x, weight, bias, state)
        if y is not None:
            return self._colwise_output(y, state)
        if isinstance(x, DTensor):
            placement = x.placements[0]
            if not (isinstance(placement, Replicate) or (isinstance(placement, Shard)
                                                          and placement.dim % x.dim() != x.dim() - 1)):
                x = x.redistribute(placements=[Replicate()])
                placement = Replicate()
        else:
            placement = plan.input_layout
        if isinstance(placement, Replicate):
            if isinstance(x, DTensor):  # the gradient stays Partial, as torch leaves it
                y = F.linear(x.to_local(grad_placements=[Partial()]), weight, bias)
            elif w == 1:
                y = F.linear(x, weight, bias)
            else:
                y = cm.LinearAllReduceGrad.apply(x, weight, bias, state.rows_call(x, weight, "all_reduce_grad"))
        else:
            d = _seq_dim(placement, x, plan.fqn)
            if isinstance(x, DTensor):
                sizes = cm.shard_sizes(x.shape[d], w)
                x = x.to_local()
            else:
                sizes = [x.shape[d]] * w
            if w == 1:
                y = F.linear(x, weight, bias)
            else:
                y = cm.AllGatherMatmul.apply(x, weight, bias, state.seq_call(x, sizes, d, weight, "gather"))
        return self._colwise_output(y, state)

    @staticmethod
    def _deferred_colwise(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                          state: _State) -> Optional[torch.Tensor]:
        """The local output for a prepared input whose gather was deferred to this layer, decomposed
        ([Note: deferring a prepared input's gather]); None where the input is read as it is (not
        deferred, or one chunk: gathered whole, torch's order)."""
        deferred = deferred_input(x)
        if deferred is None:
            return None
        shard = deferred.shard
        call = state.seq_call(shard, deferred.sizes, deferred.dim, weight, "gather")
        return cm.AllGatherMatmul.apply(shard, weight, bias, call) if call.chunks > 1 else None

    def _colwise_output(self, y: torch.Tensor, state: _State) -> torch.Tensor:
        """The colwise local output ``y`` (``Shard(-1)``) in the plan's output layout."""
        plan = state.plan
        out = plan.output_layout
        if isinstance(out, Shard) and out.dim % y.dim() == y.dim() - 1:
            if plan.use_local_output:
                return y
            return _as_dtensor(y, state.mesh, Shard(y.dim() - 1), (*y.shape[:-1], self.out_features))
        result = _as_dtensor(y, state.mesh, Shard(y.dim() - 1), (*y.shape[:-1], self.out_features))
        result = result.redistribute(placements=[out])
        return result.to_local() if plan.use_local_output else result

    def _rowwise(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 state: _State) -> torch.Tensor:
        plan, w = state.plan, state.info.size
        if isinstance(x, DTensor):
            last = Shard(x.dim() - 1)
            if x.placements[0] != last and x.placements[0] != Shard(-1):
                x = x.redistribute(placements=[last])
            x = x.to_local()
        out = plan.output_layout
        if w == 1:
            y = F.linear(x, weight, bias)
        elif isinstance(out, Replicate):
            y = cm.MatmulAllReduce.apply(x, weight, bias, state.rows_call(x, weight, "all_reduce"))
        else:
            d = _seq_dim(out, x, plan.fqn)
            call = state.seq_call(x, cm.shard_sizes(x.shape[d], w), d, weight, "scatter")
            y = cm.MatmulReduceScatter.apply(x, weight, bias, call)
        shape = (*x.shape[:-1], weight.shape[0])
        if plan.use_local_output:
            return y
        return _as_dtensor(y, state.mesh, out, shape)


def _distribute(module: nn.Module, name: str, mesh: DeviceMesh, placement: Placement) -> None:
    param = getattr(module, name)
    if param is not None:
        module.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, [placement], src_data_rank=0),
                                                     requires_grad=param.requires_grad))


def parallelize_linear(module: nn.Linear, mesh: DeviceMesh, plan: LinearPlan) -> nn.Module:
    """Shard ``module``'s parameters as torch's style does and swap in the decomposed forward."""
    colwise = plan.kind == "colwise"
    _distribute(module, "weight", mesh, Shard(0) if colwise else Shard(1))
    _distribute(module, "bias", mesh, Shard(0) if colwise else Replicate())
    module._overlap_tp = _State(plan, mesh, resolve_group(mesh, "mesh"))
    module.__class__ = swapped_class(TensorParallelLinear, type(module), "TensorParallel")
    return module
