"""ParamGroup: the parameters one ``overlap.shard`` call manages, and the collectives that move them.

A group owns, for its ``N`` parameters:

* the **sharded parameters** — plain ``nn.Parameter``s holding this rank's dim-0 rows (the sharding
  rule of ``kernels.ShardLayout``), registered on the module between steps, so the optimizer, the
  state dict and ``module.parameters()`` see shards;
* the **unsharded parameters** — one persistent ``nn.Parameter`` per parameter, full shape, in
  ``param_dtype``; registered on the module only while its forward runs. Their storage is freed
  when resharded and re-allocated and refilled when gathered again (see [Note: unsharded
  parameters keep their identity]);
* the collectives: all-gather (copy-in kernel -> ``all_gather_into`` -> copy-out kernel) and
  reduce-scatter of gradients (copy-in kernel -> ``reduce_scatter_into`` -> copy-out kernel, which
  averages over ranks, casts to the sharded dtype and accumulates into ``.grad`` in one pass).

Shapes, ``w`` ranks, parameter ``i`` of full shape ``(d, *rest)``:

========================  ===========================================  ==========================
tensor                    shape                                        dtype
========================  ===========================================  ==========================
sharded parameter         ``(rows of this rank, *rest)``               the original's
unsharded parameter       ``(d, *rest)``                               ``param_dtype`` or original
all-gather buffer         ``layout.buffer_numel``                      ``param_dtype`` or common
reduce-scatter input      ``reduce_layout.buffer_numel``               ``reduce_dtype`` or grads'
sharded ``.grad``         as the sharded parameter                     as the sharded parameter
========================  ===========================================  ==========================

[Note: unsharded parameters keep their identity]
Autograd saves the unsharded parameters used in forward (e.g. a linear's weight) and reads them in
backward; it also accumulates their gradients through one ``AccumulateGrad`` node per parameter
object. Keeping one object per parameter for the life of the group, and only freeing
(``storage.resize_(0)``) and re-filling its storage, means the tensors autograd saved in forward see
the re-gathered data in backward, and a block called twice in one forward accumulates one gradient.
The refill happens under ``torch.autograd._unsafe_preserve_version_counter`` so autograd does not
mistake the re-gather for an in-place change of a saved tensor. torch's FSDP2 does the same.

[Note: world size 1]
With one rank and no dtype cast the shard *is* the full parameter (the sharding rule gives rank 0
every row), so each unsharded parameter is a view of its shard's storage: gathering and resharding
only swap registrations, and a gradient moves to the shard's ``.grad`` without packing. torch's
FSDP2 still runs its collectives at world size 1; this path is why a single-GPU run pays little.

Concurrency: every method runs on the thread that runs the module (forward hooks, autograd hooks
on CPU, the final backward callback). Collectives are issued on ``overlap``'s communication streams
(CUDA) or as async gloo work (CPU); waits are stream waits (CUDA) or ``work.wait()`` (CPU).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
from torch import nn

from kernels import ShardLayout, unchecked
from overlap.collectives import all_gather_into, reduce_scatter_into
from overlap.groups import GroupInfo
from overlap.inflight_work import InflightWork
from overlap.mixed_precision import MixedPrecision
from overlap.regions import region

__all__ = ["ParamGroup", "ParamLocation", "PendingGather", "PendingReduce", "widest_dtype"]


@dataclasses.dataclass(frozen=True)
class ParamLocation:
    """Where a parameter is registered: ``module._parameters[name]`` (``fqn`` relative to the shard root)."""

    module: nn.Module
    name: str
    fqn: str


@dataclasses.dataclass
class PendingGather:
    """An issued all-gather: its work (None at world size 1) and the buffer it fills."""

    work: Optional[InflightWork]
    ag_output: torch.Tensor


@dataclasses.dataclass
class PendingReduce:
    """An issued reduce-scatter: its work (None at world size 1), output slot and which parameters."""

    work: Optional[InflightWork]
    rs_output: torch.Tensor
    indices: tuple[int, ...]
    layout: ShardLayout


class ParamGroup:
    """The sharded and unsharded parameters of one ``shard`` call, and their collectives."""

    def __init__(
        self,
        params: list[nn.Parameter],
        locations: list[list[ParamLocation]],
        info: GroupInfo,
        mp: MixedPrecision,
        on_grad_ready: Callable[["ParamGroup", int], None],
    ) -> None:
        self.info = info
        self.rank, self.world_size = info.rank, info.size
        self.locations = locations
        self.fqns = [locs[0].fqn for locs in locations]
        self.layout = ShardLayout([tuple(p.shape) for p in params], info.size)
        self.orig_dtypes = [p.dtype for p in params]
        self.mp = mp
        self.gather_dtype = mp.param_dtype or widest_dtype(self.orig_dtypes)
        self._on_grad_ready = on_grad_ready
        with torch.no_grad():
            self.sharded: list[nn.Parameter] = [
                nn.Parameter(self.layout.shard(p.detach(), self.rank).clone(), requires_grad=p.requires_grad)
                for p in params
            ]
        self.aliases_shards = info.size == 1 and all(self._unsharded_dtype(i) == d for i, d in enumerate(self.orig_dtypes))
        """World size 1 without a dtype cast: the unsharded parameters share the shards' storage, so
        nothing is packed, moved or freed (see [Note: world size 1])."""
        self.unsharded: Optional[list[nn.Parameter]] = None  # created at the first gather (device known then)
        self._unsharded_sources: list[int] = []  # ids of the shards the unsharded params were made for
        self.is_unsharded = False
        self.pending_gather: Optional[PendingGather] = None
        self.grads_ready: set[int] = set()
        self._reduce_layouts: dict[tuple[int, ...], ShardLayout] = {}
        self.to_sharded()

    # ------------------------------------------------------------------ registration on the module
    def to_sharded(self) -> None:
        """Register the sharded parameters on their modules (between steps)."""
        self._register(self.sharded)

    def to_unsharded(self) -> None:
        """Register the unsharded parameters on their modules (while the forward runs)."""
        assert self.unsharded is not None and self.is_unsharded
        self._register(self.unsharded)

    def _register(self, params: list[nn.Parameter]) -> None:
        for p, locs in zip(params, self.locations):
            for loc in locs:
                loc.module._parameters[loc.name] = p

    def rebind_sharded(self) -> None:
        """Re-read the sharded parameters from the modules after ``module._apply`` replaced them
        (``to_empty``, ``to(device)``), restoring ties between locations of one parameter."""
        for i, locs in enumerate(self.locations):
            p = locs[0].module._parameters[locs[0].name]
            assert isinstance(p, nn.Parameter)
            self.sharded[i] = p
        self.to_sharded()

    # ------------------------------------------------------------------ all-gather
    @property
    def requires_grad_indices(self) -> tuple[int, ...]:
        return tuple(i for i, p in enumerate(self.sharded) if p.requires_grad)

    def _unsharded_dtype(self, index: int) -> torch.dtype:
        dtype = self.orig_dtypes[index]
        return self.mp.param_dtype if dtype.is_floating_point and self.mp.param_dtype else dtype

    def _unsharded_params(self) -> list[nn.Parameter]:
        sources = [id(p) for p in self.sharded]
        if self.unsharded is None or self._unsharded_sources != sources:  # new, or the shards were replaced
            self.unsharded = []
            for i, shape in enumerate(self.layout.shapes):
                if self.aliases_shards:
                    data = self.sharded[i].detach().view(shape)
                else:
                    data = torch.empty(shape, dtype=self._unsharded_dtype(i), device=self.sharded[i].device)
                    data.untyped_storage().resize_(0)
                self.unsharded.append(nn.Parameter(data, requires_grad=self.sharded[i].requires_grad))
            self._unsharded_sources = sources
            self._hooked: set[int] = set()
        for i, (u, s) in enumerate(zip(self.unsharded, self.sharded)):
            if u.requires_grad != s.requires_grad:  # frozen or unfrozen since the last step
                u.requires_grad_(s.requires_grad)
            if u.requires_grad and i not in self._hooked:
                u.register_post_accumulate_grad_hook(self._grad_hook(i))
                self._hooked.add(i)
        return self.unsharded

    def _grad_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            self.grads_ready.add(index)
            self._on_grad_ready(self, index)

        return hook

    def all_gather_bytes(self) -> int:
        return self.layout.buffer_numel * self.gather_dtype.itemsize

    def issue_gather(self) -> None:
        """Pack the shards and start the all-gather (no-op if gathered or already in flight)."""
        if self.is_unsharded or self.pending_gather is not None or self.aliases_shards:
            return
        with region("overlap::all_gather_copy_in"), torch.no_grad():
            ag_input, ag_output = unchecked.all_gather_copy_in(self.sharded, self.layout, self.rank, self.gather_dtype)
        work = all_gather_into(ag_output, ag_input, self.info) if self.world_size > 1 else None
        self.pending_gather = PendingGather(work, ag_output)

    def finish_gather(self) -> None:
        """Wait for the all-gather (issuing it first if needed) and unpack into the unsharded params."""
        if self.is_unsharded:
            return
        if self.aliases_shards:
            self._unsharded_params()
            self.is_unsharded = True
            return
        self.issue_gather()
        pending, self.pending_gather = self.pending_gather, None
        assert pending is not None
        if pending.work is not None:
            pending.work.wait()
        outs = self._unsharded_params()
        with region("overlap::all_gather_copy_out"), torch.no_grad():
            for u in outs:
                u.untyped_storage().resize_(u.numel() * u.element_size())
            with torch.autograd._unsafe_preserve_version_counter(tuple(outs)):
                unchecked.all_gather_copy_out(pending.ag_output, self.layout, outs)
        self.is_unsharded = True

    def reshard(self) -> None:
        """Free the unsharded storage (and drop a gather still in flight, after it completes)."""
        if self.pending_gather is not None:
            if self.pending_gather.work is not None:
                self.pending_gather.work.wait()
            self.pending_gather = None
        if self.is_unsharded:
            assert self.unsharded is not None
            if not self.aliases_shards:  # aliased storage belongs to the shards
                for u in self.unsharded:
                    u.untyped_storage().resize_(0)
            self.is_unsharded = False

    # ------------------------------------------------------------------ reduce-scatter
    def _reduce_layout(self, indices: tuple[int, ...]) -> ShardLayout:
        layout = self._reduce_layouts.get(indices)
        if layout is None:
            if len(indices) == len(self.layout.shapes):
                layout = self.layout
            else:
                layout = ShardLayout([self.layout.shapes[i] for i in indices], self.world_size)
            self._reduce_layouts[indices] = layout
        return layout

    def reduce_bytes(self) -> int:
        indices = self.requires_grad_indices
        if not indices or self.unsharded is None:
            return 0
        dtype = self.mp.effective_reduce_dtype or widest_dtype([self.unsharded[i].dtype for i in indices])
        return self._reduce_layout(indices).buffer_numel * dtype.itemsize

    def issue_reduce(self) -> Optional[PendingReduce]:
        """Pack the unsharded gradients and start their reduce-scatter; the unsharded grads are dropped.

        Parameters without a gradient this step (unused on this rank) contribute zeros, so every
        rank issues the same collective. Returns None when no parameter requires grad.
        """
        indices = self.requires_grad_indices
        if not indices or self.unsharded is None:
            return None
        if self.aliases_shards:
            self._move_grads_to_shards(indices)
            return None
        grads = []
        for i in indices:
            u = self.unsharded[i]
            grads.append(u.grad if u.grad is not None else torch.zeros(u.shape, dtype=u.dtype, device=u.device))
            u.grad = None
        layout = self._reduce_layout(indices)
        dtype = self.mp.effective_reduce_dtype or widest_dtype([g.dtype for g in grads])
        with region("overlap::reduce_scatter_copy_in"), torch.no_grad():
            rs_input = unchecked.reduce_scatter_copy_in(grads, layout, None, dtype)
        if self.world_size == 1:
            return PendingReduce(None, rs_input, indices, layout)
        rs_output = torch.empty(layout.slot_numel, dtype=dtype, device=rs_input.device)
        return PendingReduce(reduce_scatter_into(rs_output, rs_input, self.info), rs_output, indices, layout)

    def finish_reduce(self, pending: PendingReduce) -> None:
        """Wait for the reduce-scatter; average, cast and add the result into the sharded ``.grad``s."""
        if pending.work is not None:
            pending.work.wait()
        targets = [self.sharded[i] for i in pending.indices]
        accumulate = any(p.grad is not None for p in targets)
        for p in targets:
            if p.grad is None:
                p.grad = torch.zeros_like(p) if accumulate else torch.empty_like(p)
        scale = 1.0 / self.world_size if self.world_size > 1 else None
        with region("overlap::reduce_scatter_copy_out"), torch.no_grad():
            unchecked.reduce_scatter_copy_out(
                pending.rs_output, [p.grad for p in targets], pending.layout, self.rank, scale, accumulate
            )

    def _move_grads_to_shards(self, indices: tuple[int, ...]) -> None:
        """World size 1 fast path of the reduce-scatter: the full gradient is the shard's gradient."""
        assert self.unsharded is not None
        with torch.no_grad():
            for i in indices:
                u, s = self.unsharded[i], self.sharded[i]
                if u.grad is None:
                    continue
                grad, u.grad = u.grad.view(s.shape), None
                if s.grad is None:
                    s.grad = grad
                else:
                    s.grad += grad


def widest_dtype(dtypes: list[torch.dtype]) -> torch.dtype:
    """The dtype that holds every one of ``dtypes`` exactly (the widest of a mix of floats)."""
    out = dtypes[0]
    for d in dtypes[1:]:
        out = torch.promote_types(out, d)
    return out
