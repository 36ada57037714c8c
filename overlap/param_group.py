"""ParamGroup: the parameters one ``overlap.shard`` call manages, and the collectives that move them.

A group owns, for its ``N`` parameters:

* the **sharded parameters** — ``nn.Parameter``s that are DTensors, ``Shard(0)`` on the group's
  DeviceMesh (``(Replicate(), Shard(0))`` on a 2-D one, see [Note: hybrid sharding]), whose local
  tensors hold this rank's dim-0 rows ([Note: sharding rule] of ``overlap_kernels.ShardLayout``, which is
  torch.chunk's and DTensor's), registered on the module between
  steps, so the optimizer, the state dict, DCP, ``clip_grad_norm_`` and ``module.parameters()`` see
  what they see with torch FSDP2 (see [Note: sharded parameters are DTensors]);
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
sharded parameter         DTensor ``(d, *rest)``; local ``(rows, *rest)``  the original's
unsharded parameter       ``(d, *rest)``                               ``param_dtype`` or original
all-gather buffer         ``layout.buffer_numel``                      ``param_dtype`` or common
reduce-scatter input      ``reduce_layout.buffer_numel``               ``reduce_dtype`` or grads'
sharded ``.grad``         DTensor, spec of the sharded parameter       as the sharded parameter
========================  ===========================================  ==========================

New sharded ``.grad``s of one reduction are views of one storage ([Note: new sharded gradients
share one storage]).

[Note: sharded parameters are DTensors]
A sharded parameter is ``nn.Parameter(DTensor)`` with placement ``Shard(0)`` and the full shape and
stride in its spec, exactly what ``distribute_tensor(full, mesh, [Shard(0)])`` gives: DCP saves it as
one sharded tensor (resharding on load at another world size), ``get_state_dict`` gathers it,
``clip_grad_norm_`` reduces its gradient's norm over the mesh, and init code written for full shapes
(``reset_parameters``, ``nn.init.*``) sees full shapes. Its gradient is a DTensor with the same spec.
The runtime never dispatches through DTensor in a step: it packs and unpacks the local tensors
(``_local_tensor``) with the fused kernels (into flat buffers: [Note: flat buffers] in
``overlap_kernels/layout.py``) and builds gradient DTensors from their spec, not with
``from_local`` (no autograd, no checks; see [Note: building a DTensor without its __init__]). A 0-dim parameter cannot be ``Shard(0)``: it is a
``Replicate()`` DTensor; in the flat buffers rank 0 holds it as a 1-row shard (the layout's rule), and
after the reduce-scatter rank 0 broadcasts its reduced gradient so every replica holds it.

[Note: hybrid sharding]
With a 2-D mesh (FSDP2's convention: dim 0 replicates, dim 1 shards) the group shards over the
mesh's dim 1 and replicates over dim 0: the sharded parameters are ``(Replicate(), Shard(0))``
DTensors (0-dim ones ``(Replicate(), Replicate())``), all-gathers run within the shard group, and a
gradient is reduce-scattered within the shard group, then summed over the replicas by an all-reduce
of the reduce-scatter's output, in place (that buffer is the all-reduce's input and output: no
copy, no extra pass), and finally divided by ``shards * replicas`` ([Note: the reduction's
average]), cast and accumulated by the one copy-out. The all-reduce is issued as soon as its
reduce-scatter is done: on CUDA at once, ordered behind it by the streams; on CPU at the first
runtime hook after it completed (a non-blocking check), or at the end of backward. All-reduces are issued in the reduce-scatters' order, so the
replicate group sees the same sequence on every rank. In debug mode (``overlap.debug``) each
collective first checks its fingerprint with its group's ranks, a wait that crosses groups: issued
at timing-dependent points, an all-reduce's check and a reduce-scatter's could wait on each other
around the mesh, so there the all-reduce is issued right after its reduce-scatter, which it waits
for (slower, deterministic). With ``max_inflight_bytes`` the budget's waits cross groups the same
way (a rank waiting for room before its all-reduce for a reduce-scatter that a slower shard peer
has not issued yet, that peer waiting before it for an all-reduce its own fast replica peer holds
back, and so on around the mesh: a hang), so on CPU an all-reduce under a budget is issued at a
point in the program instead of a time: at the next reduction's issue, before it (waiting for its
own reduce-scatter, which had a block's backward to finish), or at the end of backward. Every rank
then issues every collective in the same order, and each budget wait is for one issued earlier,
which all of its ranks issue without waiting on a later one. ``no_sync`` skips both.

[Note: sharding tensor-parallel parameters]
A parameter that tensor parallelism made a DTensor (``overlap.tensor_parallel`` or torch's
``parallelize_module``: ``Shard`` or ``Replicate`` on a 1-D TP mesh) is sharded as FSDP2 shards it
(2-D parallelism). What this group shards, packs and gathers is its *local* tensor, by the same
dim-0 rule; the sharded parameter is a DTensor on the data-parallel and TP meshes joined (slices of
one DeviceMesh, ``DeviceMesh._concatenate``), with the data-parallel placement first, then the TP
ones, and the global shape: ``Shard(0)`` over dp, or ``_StridedShard(0, split_factor=tp)`` where
the TP dim shards dim 0 too (this rank's rows are a slice of a TP shard, not of the whole tensor).
That is FSDP2's spec bit for bit, so DCP, ``get_state_dict`` and ``clip_grad_norm_`` treat both
alike. The unsharded parameter is the TP DTensor again (the TP spec around the gathered local
tensor, in ``param_dtype``), so the module's forward sees what tensor parallelism made. Its
gradient comes back as a DTensor; one whose placements differ from the parameter's (a replicated
norm's ``Partial()`` gradient under sequence parallelism) is redistributed to them first, an
all-reduce over the TP dim, as FSDP2 does; then its local tensor is reduce-scattered over dp.
Compressed collectives (``compress=``) apply to exactly these dp collectives of the local tensors,
as to plain parameters; the TP ones stay exact ([Note: compressed collectives] in
``overlap/compression.py``).
Parameters that are DTensors on a full SPMD mesh (FSDP2's ``dp_mesh_dims``) take this path too,
their sharded spec on that mesh and their gradient left ``Partial()`` over its data-parallel dims
([Note: sharding on a full SPMD mesh] in ``overlap/spmd_mesh.py``).

[Note: unsharded parameters keep their identity]
Autograd saves the unsharded parameters used in forward (e.g. a linear's weight) and reads them in
backward; it also accumulates their gradients through one ``AccumulateGrad`` node per parameter
object. Keeping one object per parameter for the life of the group, and only freeing
(``storage.resize_(0)``) and re-filling its storage, means the tensors autograd saved in forward see
the re-gathered data in backward, and a block called twice in one forward accumulates one gradient.
The refill leaves their version counters as they were (torch's FSDP2 restores them with
``torch.autograd._unsafe_preserve_version_counter``), so autograd does not mistake the re-gather
for an in-place change of a saved tensor ([Note: a gather bumps no version counter]).

[Note: a gather bumps no version counter]
A gather writes the unsharded parameters' memory through a second set of tensors over the same
storage and placement (``_unsharded_fill``, made with the parameters: ``PackedPlacement.shared_views``,
so they share one version counter, which is not the parameters'): the writes bump that one, never
the parameters'. That is what saving the parameters' versions before the write and restoring them
after gives, without the two passes and the try/finally per gather (about 2 µs of a 10 µs
world-size-1 cast per block in the runtime-cost benchmark); and the copy-out tells autograd of its
write by bumping the one shared counter, not one per parameter (about 14 µs at 300 parameters on
the CI box, ``benchmarks/bench_kernels.py``). Nothing reads that counter: it stands for the write.

[Note: unsharded parameters share one storage]
The unsharded parameters (unless they alias the shards) are views of one storage per group, laid
out by a ``overlap_kernels._launch.PackedPlacement`` (each 16-byte aligned; a parameter keeps its own
version counter). Freeing and re-allocating them is one ``resize_`` of that storage, and the
copy-out's pointer table is keyed on the storage's address and the placement: O(1) per gather
instead of a read of every parameter ([Note: packed placements] in ``overlap_kernels._launch``).

[Note: world size 1]
With one rank and no dtype cast the shard *is* the full parameter (the sharding rule gives rank 0
every row), so each unsharded parameter is a view of its shard's storage: gathering and resharding
only swap registrations, and a gradient moves to the shard's ``.grad`` without packing (rounded
through a narrower ``reduce_dtype`` first, as the reduce-scatter would round it). With a
cast (mixed precision) a gather is one ``_foreach_copy_`` of the shards into the unsharded
parameters and a reduction one cast of each gradient (through the reduce dtype) into the shard's
``.grad``: the values packing and unpacking would give, without the flat buffers. torch's FSDP2
still runs its collectives at world size 1; this path is why a single-GPU run pays little.

Concurrency: every method runs on the thread that runs the module (forward hooks, autograd hooks
on CPU, the final backward callback). Collectives are issued on ``overlap``'s communication streams
(CUDA) or as async gloo work (CPU); waits are stream waits (CUDA) or ``work.wait()`` (CPU).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
import time
from itertools import compress, repeat
from operator import add, and_, attrgetter, is_, is_not
from typing import Any, Callable, Optional, Sequence, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from overlap_kernels import ShardLayout, native_passes, prepared_launch
from overlap_kernels._launch import PackedPlacement
# The ops without argument checks (the runtime builds every argument from the layout):
from overlap_kernels.all_gather_copy_in import _all_gather_copy_in
from overlap_kernels.all_gather_copy_out import _all_gather_copy_out
from overlap_kernels.reduce_scatter_copy_in import _reduce_scatter_copy_in
from overlap_kernels.reduce_scatter_copy_out import _reduce_scatter_copy_out
from overlap_kernels.quantized_all_gather_copy_out import _quantized_all_gather_copy_out
from overlap_kernels.quantized_copy_in import _quantized_copy_in
from overlap_kernels.quantized_layout import QuantizedLayout, quantized_layout
from overlap_kernels._dtypes import as_float32
from overlap_kernels.quantized_reduce_scatter_copy_out import _quantized_reduce_scatter_copy_out, summed_slots
from overlap import finite_check
from overlap.collectives import all_gather_into, all_reduce_into, quantized_reduce_into, reduce_scatter_into
from overlap.compression import Compression
from overlap import gradient_error
from overlap.gather_extension import (ExtensionParams, OwnDtypeRows, PendingExtensionGather, has_extension,
                                      contiguous_strides as _contiguous_strides)
from overlap.groups import GroupInfo, device_mesh_for
from overlap.inflight_work import InflightWork
from overlap.mixed_precision import MixedPrecision
from overlap.regions import ModuleRegions, region
from overlap.streams import comm_stream
from overlap.dim_sharding import full_to_rows, own_chunk, rows_shape, rows_to_full
from overlap.post_forward_shard import PostForwardGroup, keep_part
from overlap.spmd_mesh import SpmdMesh

__all__ = ["ParamGroup", "ParamLocation", "PendingGather", "PendingReduce", "tp_dtensor", "widest_dtype"]


@dataclasses.dataclass(frozen=True)
class ParamLocation:
    """Where a parameter is registered: ``module._parameters[name]`` (``fqn`` relative to the shard root)."""

    module: nn.Module
    name: str
    fqn: str


@dataclasses.dataclass
class PendingGather:
    """An issued all-gather: its work (None at world size 1) and the buffer it fills, and the
    extension parameters' all-gather beside it ([Note: all-gather extensions] in
    ``overlap/gather_extension.py``)."""

    work: Optional[InflightWork]
    ag_output: torch.Tensor
    extension: Optional[PendingExtensionGather] = None
    post_forward: bool = False
    """Gathered from the post-forward shards: ``ag_output`` is the unsharded storage's bytes ([Note:
    resharding to a smaller group after forward] in ``overlap/post_forward_shard.py``)."""

    @property
    def works(self) -> tuple[InflightWork, ...]:
        """The collectives in flight for it."""
        extension = self.extension.work if self.extension is not None else None
        return tuple(w for w in (self.work, extension) if w is not None)


@dataclasses.dataclass
class PendingReduce:
    """An issued reduce-scatter: its work (None at world size 1), output slot and which parameters."""

    work: Optional[InflightWork]
    rs_output: torch.Tensor
    indices: tuple[int, ...]
    layout: ShardLayout
    post_scale: Optional[float]  # the copy-out multiplies by it (None: not)
    needs_all_reduce: bool = False  # HSDP: the cross-replica all-reduce is still to be issued
    finite: Optional[finite_check.FiniteCheck] = None  # the finite check's flags (overlap.finite_check), if on
    quantized: Optional[QuantizedLayout] = None  # compressed: rs_output is the received quantized slots
    reference: Optional[tuple[InflightWork, torch.Tensor]] = None
    """Compressed, measuring (``overlap.gradient_error``): the exact collective to compare with and its
    float32 output (1-D: a reduce-scatter of the gradients; HSDP: an all-reduce over the replicas)."""
    replica_gather: Optional[tuple[torch.Tensor, QuantizedLayout, list[torch.Tensor]]] = None
    """HSDP, compressed: the replicas' quantized all-gather, its layout, and the views of ``rs_output``
    it dequantizes into ([Note: compressing the inter-node tier])."""
    missing: tuple[int, ...] = ()
    """Positions (in ``indices``) whose gradient this rank did not have: it sent zeros for them."""
    post_divisor: Optional[float] = None
    """The copy-out divides by it (None: not); at most one of it and ``post_scale`` is set ([Note:
    the reduction's average])."""
    partial: bool = False
    """HSDP under ``requires_all_reduce=False``: no all-reduce, no copy-out; the epilogue adds
    ``rs_output`` into the group's partial sum ([Note: reductions left partial over the replicas])."""


class ParamGroup:
    """The sharded and unsharded parameters of one ``shard`` call, and their collectives."""

    def __init__(
        self,
        params: list[nn.Parameter],
        locations: list[list[ParamLocation]],
        info: GroupInfo,
        mesh: DeviceMesh,
        mp: MixedPrecision,
        on_grad_ready: Callable[["ParamGroup", int], None],
        replicate: Optional[GroupInfo] = None,
        compression: Optional[Compression] = None,
        own_dtype: frozenset[int] = frozenset(),
        spmd: Optional[SpmdMesh] = None,
        shard_dims: Optional[dict[int, int]] = None,
    ) -> None:
        self.info = info
        self.reduce_info = info
        """The group the gradient reductions run over: ``info``, or a process group of their own over
        the same ranks (FSDP2's ``set_separate_reduce_scatter_group``: [Note: a reduce-scatter group
        of its own] in ``overlap/groups.py``)."""
        self.compression = compression if compression is not None and compression.any else None
        """Compressed collectives (``overlap.shard(compress=...)``, [Note: compressed collectives] in
        ``overlap/compression.py``); None: exact."""
        reduce_format = self.compression.reduce if self.compression is not None else None
        self.quantized_reduce = reduce_format if replicate is None else None
        """The wire format of the shard group's gradient reduction (None: exact). With HSDP it is
        exact: only the replicas' tier is compressed (``quantized_replica_sum``)."""
        self.quantized_replica_sum = reduce_format if replicate is not None else None
        """HSDP: the wire format of the sum over the replicas (the inter-node tier); None: exact."""
        self.mesh = mesh
        self.rank, self.world_size = info.rank, info.size
        self.replicate = replicate
        """HSDP: the group over the replicas (the mesh's dim 0); None when fully sharded."""
        self.replicas = replicate.size if replicate is not None else 1
        self.data_parallel_size = info.size * self.replicas
        self.single_rank = self.data_parallel_size == 1
        """One data-parallel rank: nothing travels (see [Note: world size 1])."""
        self.gradient_divide_factor: Optional[float] = None
        """What the summed gradient is divided by (FSDP2's ``set_gradient_divide_factor``); None: the
        data-parallel size (the average). See [Note: the reduction's average]."""
        self.force_sum_reduction_for_comms = False
        """FSDP2's ``set_force_sum_reduction_for_comms``: the reductions here always sum; True also
        makes ``all_reduce_hook`` see the sum, divided after it ([Note: the all-reduce hook])."""
        self.all_reduce_hook: Optional[Callable[[torch.Tensor], None]] = None
        """FSDP2's ``set_all_reduce_hook``: called with each reduction's output before the gradients
        are set ([Note: the all-reduce hook]); None: no hook."""
        self.all_reduce_hook_stream: Optional["torch.cuda.Stream"] = None
        """CUDA, 1-D mesh: the stream the hook runs on (None: the reduction's epilogue stream)."""
        self.custom_all_gather: Optional[Any] = None
        self.custom_reduce_scatter: Optional[Any] = None
        """FSDP2's ``set_custom_all_gather`` / ``set_custom_reduce_scatter``: a ``Comm`` whose
        ``allocate`` makes the collective's buffers and whose call issues it (None: torch's); see
        [Note: custom collectives]."""
        self.reduce_scatter_max_input_buffers: Optional[int] = None
        """FSDP2's ``set_reduce_scatter_max_input_buffers``: before this group's reduction, at most
        this many minus one reduce-scatters may still hold their input buffers (the oldest are waited
        for: ``_Root._hold_reduce_inputs``); None: no cap (the runtime's default; FSDP2's is 1)."""
        self.process_group_allocator: Optional[ProcessGroupAllocator] = None
        """FSDP2's ``set_allocate_memory_from_process_group_for_comm(True)``: the collectives' buffers
        come from the shard group's backend allocator where it has one (a custom comm's ``allocate``
        comes first)."""
        self.keep_unsharded_storage = False
        """FSDP2's ``set_keep_unsharded_storage``: True keeps the unsharded parameters' storage
        allocated when resharding, so that its address stays the same from step to step (CUDA graph
        capture) at the cost of holding it; the next gather still refills it."""
        self.requires_all_reduce = True
        """FSDP2's ``set_requires_all_reduce``: with HSDP, False keeps each reduce-scattered sum
        as a partial sum instead of summing it over the replicas ([Note: reductions left partial
        over the replicas])."""
        self._partial: Optional[tuple[tuple[int, ...], torch.Tensor]] = None
        """HSDP: (indices, the sum of the reduce-scattered outputs) of the backwards left partial since
        the last all-reduce ([Note: reductions left partial over the replicas])."""
        self._all_present: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}
        """Per (parameter count, dtype, device), the presence rows of a reduction whose gradients all
        came ([Note: a gradient no rank produced]): made once, so that the usual reduction allocates
        nothing for them."""
        self.locations = locations
        self._slots = [(loc.module._parameters, loc.name, i) for i, locs in enumerate(locations) for loc in locs]
        """Per location, ``(module._parameters, name, parameter index)``: a module keeps its
        ``_parameters`` dict for life (registering and assigning parameters write into it)."""
        self.fqns = [locs[0].fqn for locs in locations]
        self.module_fqn = ""  # the group's module, from the root (set with its regions' names)
        self.checked_reductions = 0  # reductions while the finite check was on (its errors' step)
        self.tp_specs: list[Optional[DTensorSpec]] = [p._spec if isinstance(p, DTensor) else None for p in params]
        """Per parameter, its tensor-parallel DTensor spec (None: a plain parameter); see [Note:
        sharding tensor-parallel parameters]."""
        self.has_tp_params = any(spec is not None for spec in self.tp_specs)  # some are TP DTensors
        self.spmd = spmd
        """The full SPMD mesh every parameter is a DTensor on (FSDP2's ``dp_mesh_dims``), None without
        one; its parameters' specs are in ``tp_specs`` ([Note: sharding on a full SPMD mesh] in
        ``overlap/spmd_mesh.py``)."""
        self._unsharded_getters: Callable[[], contextlib.AbstractContextManager] = (
            contextlib.nullcontext if self.has_tp_params or not _PARAMETER_HAS_NO_TORCH_FUNCTION
            else torch._C.DisableTorchFunctionSubclass)
        """``_shard_getters`` for the unsharded parameters: plain ``nn.Parameter``s unless tensor
        parallelism made them DTensors."""
        self._spmd_meshes: dict[int, DeviceMesh] = {}
        data = [_local(p) for p in params]  # what this group shards: a TP parameter's local tensor
        self.shard_dims: dict[int, int] = dict(shard_dims or {})
        """Per parameter sharded on a dim other than 0 (FSDP2's ``shard_placement_fn``), that dim; the
        layout holds it in its rows form ([Note: sharding on another dim] in ``overlap/dim_sharding.py``)."""
        self.dim_sharded = tuple(sorted(self.shard_dims))
        self.param_shapes = [tuple(t.shape) for t in data]
        """Each parameter's (local tensor's) full shape; the layout's, except for ``dim_sharded``."""
        self.layout = ShardLayout([rows_shape(t.shape, self.shard_dims[i]) if i in self.shard_dims else tuple(t.shape)
                                   for i, t in enumerate(data)], info.size)
        self.own_dtype = own_dtype
        """Positions of the parameters computed in their own dtype instead of ``mp.param_dtype``
        (FSDP2's ``param_dtype_override_fn``): gathered beside the fused all-gather, exactly."""
        extension_indices = tuple(i for i, t in enumerate(data) if has_extension(t) or i in own_dtype)
        self.extension: Optional[ExtensionParams] = None if not extension_indices else ExtensionParams(
            extension_indices, [self.layout.shapes[i] for i in extension_indices],
            [self.layout.rows_per_rank[i] for i in extension_indices], [self.fqns[i] for i in extension_indices],
            [locations[i][0].module for i in extension_indices],
            device_mesh_for(mesh if mesh.ndim == 1 else (mesh, 1), info, mesh.device_type), mp.torch_policy())
        """The parameters gathered apart: those with FSDP2's all-gather extension, and those kept in
        their own dtype ([Note: all-gather extensions] in ``overlap/gather_extension.py``); None:
        there are none."""
        self.packed_indices = tuple(i for i in range(len(data)) if i not in extension_indices)
        """The parameters whose values the fused copy-in packs: all but those gathered apart."""
        self.gather_layout: Optional[ShardLayout] = (
            self.layout if not extension_indices
            else ShardLayout([self.layout.shapes[i] for i in self.packed_indices], info.size) if self.packed_indices
            else None)
        """The fused all-gather's layout: ``layout`` over ``packed_indices``; None when none are packed."""
        self._extension_made: list[torch.Tensor] = []  # the first extension gather's unsharded tensors
        self.mp = mp
        self.regions = ModuleRegions.named("")  # renamed by overlap.shard once the module's fqn is known
        self._on_grad_ready = on_grad_ready
        self.scalar_indices = tuple(i for i, t in enumerate(data) if t.dim() == 0)
        with torch.no_grad():
            self.sharded: list[nn.Parameter] = [self._to_dtensor_param(t, spec, p.requires_grad, self.shard_dims.get(i, 0))
                                                for i, (t, spec, p) in enumerate(zip(data, self.tp_specs, params))]
        self.unsharded: Optional[list[nn.Parameter]] = None  # created at the first gather (device known then)
        self._unsharded_fill: tuple[torch.Tensor, ...] = ()
        """Tensors over the unsharded parameters' memory, with version counters of their own: what a
        gather writes ([Note: a gather bumps no version counter]); empty while they alias the shards."""
        self._unsharded_storage: Optional[tuple[torch.UntypedStorage, PackedPlacement]] = None
        """The one storage the unsharded parameters are views of, and where ([Note: unsharded
        parameters share one storage]); None while they alias the shards or are not made yet."""
        self._unsharded_whole: Optional[torch.Tensor] = None
        """That storage as one ``uint8`` tensor with a version counter of its own (as the fill views)."""
        self.post_forward: Optional[PostForwardGroup] = None
        """FSDP2's ``reshard_after_forward=<int>``: the group backward gathers from ([Note: resharding
        to a smaller group after forward] in ``overlap/post_forward_shard.py``); None: every shard rank."""
        self._post_forward_shard: Optional[tuple[torch.Tensor, tuple[int, ...]]] = None
        """This rank's post-forward shard and the shards' versions it was taken at; None: none held."""
        self._owned_shards = prepared_launch.OwnedLists()
        self._owned_grads = prepared_launch.OwnedLists()
        """The copy-ins' prepared launches over the shards and over the unsharded gradients, which this
        group owns ([Note: lists the runtime owns] in ``overlap_kernels.prepared_launch``): forgotten when
        the shards are re-read (``_read_dtypes``)."""
        self._upcast: dict[int, torch.dtype] = {}
        """Unsharded parameters whose ``grad_dtype`` ``upcast_accumulated_grads`` or
        ``prepare_accumulation`` changed, and the one each had before ([Note: accumulating in the
        reduce dtype])."""
        self._read_dtypes()
        self.is_unsharded = False
        self.pending_gather: Optional[PendingGather] = None
        self._gathered_versions: tuple[int, ...] = ()  # the shards' versions when the pending gather packed them
        self.grads_ready: set[int] = set()
        self._reduce_layouts: dict[tuple[int, ...], ShardLayout] = {}
        self._grad_placements: dict[tuple[int, ...], PackedPlacement] = {}
        """Per reduced index set, where its new sharded gradients sit in the one storage they share
        ([Note: new sharded gradients share one storage]); dropped by ``rebind_sharded``."""
        self._requires_grad_seen: tuple[bool, ...] = ()  # the shards' flags when the unsharded ones last followed them
        self._last_indices: tuple[tuple[bool, ...], tuple[int, ...]] = ((), ())
        """The flags ``requires_grad_indices`` last combined, and the indices it gave for them: a function
        of the flags alone, returned again while they stay the same."""
        self._grads_needed = 0
        """How many of the unsharded parameters require a gradient (``_requires_grad_seen``): fewer
        gradients than that and the group is not complete ([Note: counting a group's gradients])."""
        self.reduced_hooks: list[Callable[[list[nn.Parameter]], None]] = []
        """Called with the group's sharded parameters once their gradients of a step are final (see
        [Note: hooks after the reduction])."""
        self.defer_reduced_hooks = False
        """Set by the runtime for a step whose ``reduced_hooks`` (the optimizer step in backward) it
        runs later itself: the epilogue then keeps their parameters in ``deferred_reduced`` and
        ``run_deferred_reduced_hooks`` runs them ([Note: deferred optimizer steps] in
        ``overlap/sharding.py``)."""
        self.deferred_reduced: Optional[list[nn.Parameter]] = None
        self.reduced_hooks_seconds = 0.0
        """Host seconds the ``reduced_hooks`` took the last time they ran (the optimizer math the
        runtime may move: [Note: deferred optimizer steps])."""
        self.to_sharded()

    def _to_dtensor_param(self, full: torch.Tensor, tp_spec: Optional[DTensorSpec],
                          requires_grad: bool, dim: int = 0) -> nn.Parameter:
        """This rank's rows of ``full`` (a plain parameter, or a tensor-parallel parameter's local
        tensor) as a sharded DTensor parameter (see [Note: sharded parameters are DTensors]), or with
        ``dim`` > 0 its chunk along that dim ([Note: sharding on another dim]); works on the meta
        device."""
        if dim:
            local = own_chunk(full.detach(), dim, self.world_size, self.rank).clone(memory_format=torch.contiguous_format)
        else:
            local = self._own_rows_copy(full)
        placement: Placement = Shard(dim) if full.dim() else Replicate()
        if tp_spec is None:
            mesh = self.mesh
            tp_placements: tuple[Placement, ...] = ()
            meta = TensorMeta(full.shape, _contiguous_strides(full.shape), full.dtype)
        elif self.spmd is not None:
            return nn.Parameter(DTensor(local, self.spmd.sharded_spec(tp_spec, dim), requires_grad=False),
                                requires_grad=requires_grad)
        else:
            split = tp_spec.num_shards_map[dim] if full.dim() else 1
            if split > 1:  # this mesh's rows interleave with the TP dim's shards of that dim
                placement = _StridedShard(dim, split_factor=split)
            mesh, tp_placements, meta = self._spmd_mesh(tp_spec.mesh), tuple(tp_spec.placements), tp_spec.tensor_meta
        placements = (placement,) if self.replicate is None else (Replicate(), placement)
        spec = DTensorSpec(mesh, placements + tp_placements, tensor_meta=meta)
        return nn.Parameter(DTensor(local, spec, requires_grad=False), requires_grad=requires_grad)

    def _own_rows_copy(self, full: torch.Tensor) -> torch.Tensor:
        """A copy of this rank's rows of ``full``. An all-gather extension's subclass is cut and
        copied as FSDP2 does it: ``torch.chunk`` (the same rows: the sharding rule is chunk's), then
        ``new_zeros`` and ``copy_``, which such subclasses implement to keep what the whole tensor
        carries (torchao's NF4 weights keep the full tensor's quantization metadata that way, where
        ``clone`` quantizes the rows anew and a slice may be refused); never detached (that may drop
        the subclass; the caller runs under no_grad)."""
        if not has_extension(full):
            return self.own_rows(full.detach()).clone()
        chunks = torch.chunk(full, self.world_size, dim=0)
        rows = chunks[self.rank] if self.rank < len(chunks) else full.narrow(0, full.shape[0], 0)
        local = full.new_zeros(rows.shape)
        local.copy_(rows)
        return local

    def own_rows(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``full`` (a parameter's full tensor, or a tensor-parallel one's local
        tensor) as its sharded parameter's local tensor holds it: the dim-0 rows the layout gives
        this rank (a view; none on a rank past the last row), or a 0-dim tensor itself (replicated)."""
        return self.layout.shard(full, self.rank) if full.dim() else full

    def _spmd_mesh(self, tp_mesh: DeviceMesh) -> DeviceMesh:
        """The data-parallel mesh and a tensor-parallel one, joined (both slices of one mesh)."""
        mesh = self._spmd_meshes.get(id(tp_mesh))
        if mesh is None:
            mesh = self._spmd_meshes[id(tp_mesh)] = DeviceMesh._concatenate([self.mesh, tp_mesh])
        return mesh

    def _read_dtypes(self) -> None:
        """(Re)derive everything that depends on the sharded parameters' dtypes (and which of them
        are on the meta device: ``on_meta``, refused at the next forward), and forget the copy-ins'
        prepared launches over them and their gradients."""
        self._owned_shards.changed()
        self._owned_grads.changed()
        self.on_meta = tuple(fqn for fqn, p in zip(self.fqns, self.sharded) if p.is_meta)
        self.orig_dtypes = tuple(p.dtype for p in self.sharded)
        self.gather_dtype = self.mp.param_dtype or widest_dtype(self.orig_dtypes)
        self.aliases_shards = self.single_rank and all(
            self._unsharded_dtype(i) == d for i, d in enumerate(self.orig_dtypes))
        """World size 1 without a dtype cast: the unsharded parameters share the shards' storage, so
        nothing is packed, moved or freed (see [Note: world size 1])."""
        self.casts_shards = self.single_rank and not self.aliases_shards
        """World size 1 with a dtype cast (mixed precision): a gather is one cast of the shards into
        the unsharded parameters, a reduction one cast back (see [Note: world size 1])."""
        reduce_dtype = self.mp.effective_reduce_dtype
        self.accumulates_wider = reduce_dtype is not None and any(
            _narrower(self._unsharded_dtype(i), reduce_dtype) for i in range(len(self.orig_dtypes)))
        """Some unsharded parameter's dtype is narrower than ``reduce_dtype``: under ``no_sync`` its
        gradient accumulates in ``reduce_dtype`` ([Note: accumulating in the reduce dtype])."""
        self.rounds_aliased_grads = self.aliases_shards and reduce_dtype is not None and not all(
            _widens_exactly(d, reduce_dtype) for d in self.orig_dtypes)
        """World size 1 without a parameter cast, but a ``reduce_dtype`` narrower than a shard's: each
        gradient is rounded through it on its way to the shard, as FSDP2's reduce-scatter and this
        runtime's at more ranks round it."""
        plain = all(type(p) is DTensor for p in self.sharded) and _DTENSOR_HAS_NO_TORCH_FUNCTION
        self._shard_getters: Callable[[], contextlib.AbstractContextManager] = (
            torch._C.DisableTorchFunctionSubclass if plain else contextlib.nullcontext)
        """Around whole-list reads and writes of the sharded parameters' C getters and setters
        (``_version``, ``requires_grad``, ``grad``): see [Note: the shards' getters without lookups]."""

    def local_rows(self, index: int) -> torch.Tensor:
        """This rank's rows of parameter ``index`` as the layout sees them (see :func:`_layout_rows`)."""
        return self._rows(index, self.sharded[index]._local_tensor)

    def _rows(self, index: int, local: torch.Tensor) -> torch.Tensor:
        """Parameter ``index``'s local tensor (or one of its shape: its gradient) as the layout's rows:
        :func:`_layout_rows`, or the rows form of a chunk on another dim ([Note: sharding on another
        dim])."""
        if index in self.shard_dims:
            return local.view(self.layout.shard_shape(index, self.rank))
        return _layout_rows(local, self.rank)

    # ------------------------------------------------------------------ registration on the module
    def to_sharded(self) -> None:
        """Register the sharded parameters on their modules (between steps)."""
        self._register(self.sharded)

    def to_unsharded(self) -> None:
        """Register the unsharded parameters on their modules (while the forward runs)."""
        assert self.unsharded is not None and self.is_unsharded
        self._register(self.unsharded)

    def sharded_registered(self) -> bool:
        """Are the sharded parameters the ones on the modules (as ``to_sharded`` left them)? One
        dict read: the first location's."""
        parameters, name, i = self._slots[0]
        return parameters.get(name) is self.sharded[i]

    def reshard_to_sharded(self) -> None:
        """:meth:`reshard`, then register the sharded parameters unless they already are (as a
        reduction or a post-forward usually left them): what a module holds between steps."""
        self.reshard()
        if not self.sharded_registered():
            self.to_sharded()

    def _register(self, params: list[nn.Parameter]) -> None:
        for parameters, name, i in self._slots:
            parameters[name] = params[i]

    def rebind_sharded(self) -> None:
        """Re-read the sharded parameters from the modules after ``module._apply`` changed them
        (``to_empty``, ``to(device)``, ``to(dtype)``: DTensor parameters are swapped in place, so the
        objects usually stay), restoring ties between locations of one parameter; the unsharded
        parameters are re-made at the next gather in the new dtype / device."""
        for i, locs in enumerate(self.locations):
            p = locs[0].module._parameters[locs[0].name]
            if not isinstance(p, DTensor) or p._spec.placements != self.sharded[i]._spec.placements:
                raise TypeError(
                    f"overlap.shard: parameter {locs[0].fqn!r} was replaced by a "
                    f"{type(p).__name__} that is not a DTensor sharded like the original; assign "
                    f"sharded DTensors (e.g. load a state dict without assign=True)")
            self.sharded[i] = p  # type: ignore[assignment]
            p._overlap_sharded_by = self  # type: ignore[attr-defined]
        self.reshard()
        self.unsharded = None
        self._grad_placements.clear()
        self._read_dtypes()
        self.to_sharded()

    # ------------------------------------------------------------------ all-gather
    @property
    def where(self) -> str:
        """The module's fqn ("root" for the root), shown in debug-mode fingerprints (overlap.desync)."""
        return self.module_fqn or "root"

    @property
    def requires_grad_indices(self) -> tuple[int, ...]:
        """The parameters that get a gradient this step: those whose shard requires one now and
        whose unsharded parameter required one when the last gather made it (what autograd saw).

        [Note: a gradient needs both flags]
        A plain model's parameter gets a gradient in a backward when it required one in the forward
        (else autograd recorded no use of it) and still does in the backward (``AccumulateGrad``
        skips a parameter frozen since). The unsharded parameters follow their shards' flags at each
        gather (``_unsharded_params``), so a shard frozen or unfrozen between its forward and its
        backward has the two flags differ: such a parameter is left out of the reduction, its
        sharded ``.grad`` untouched, as the plain model's; an unsharded gradient autograd produced
        for it anyway is dropped (``_drop_unreduced_grads``). The flags are the same on every rank
        (freezing is part of the training program), so every rank reduces the same parameters.
        A reduction reads the flags once, just before it is issued (with ``max_inflight_bytes`` the
        cap's size and the issue share that read: nothing runs between them that could change a
        flag); the forward's gather reads them too, to set the unsharded ones. While the combined
        flags are those of the last read, the same indices tuple is returned (``_last_indices``).
        """
        sharded, seen = self.sharded, self._requires_grad_seen
        with self._shard_getters():  # one C-level pass: [Note: the shards' getters without lookups]
            flags = tuple(map(_REQUIRES_GRAD, sharded))
        if seen and flags != seen:  # changed since the last gather
            flags = tuple(map(and_, flags, seen))
        last_flags, last_indices = self._last_indices
        if flags == last_flags:  # the usual step: the same tuple again, no rebuild (and equal by identity)
            return last_indices
        indices = tuple(compress(range(len(sharded)), flags))
        self._last_indices = (flags, indices)
        return indices

    def grads_complete(self) -> bool:
        """Has every parameter of the group got its gradient in this step (``grads_ready``)? A group
        with a parameter that needs none (frozen) is never complete by this count.

        [Note: counting a group's gradients]
        Autograd calls each unsharded parameter's post-accumulate-grad hook once its gradient is in,
        and the group asks here after each one whether it is complete. Reading every shard's
        ``requires_grad`` for that (a C-level pass, about 1.5 µs for a block's few parameters on the
        CI box) cost more than the hook itself, before every gradient but a group's last. The gather
        that made the unsharded parameters (the forward's, ``_unsharded_params``) counted the ones
        it made require a gradient (``_grads_needed``): those are the gradients autograd produces.
        Fewer ready than that is not complete, nor is fewer than the group's parameters: a frozen
        parameter's uses in backward (the input gradient of LoRA's frozen base weight, read after the
        adapters' gradients are in) leave no trace in the count, and reducing the group there
        resharded, freeing a weight backward was about to read. Such a group is complete when
        backward has passed its module's forward calls, or at the end of backward, as FSDP2's
        post-backward (on the module's inputs) is. Either way the reduction order is the same fixed
        one, on every rank. With one
        data-parallel rank the parameter's hook (``_grad_hook``) compares the count itself and
        returns before calling into the runtime at all: nothing is complete, and no collective of
        the group is in flight to poll for (a group over several ranks calls every time: each
        gradient is a poll point for the reductions in flight, [Note: hybrid sharding]).
        """
        count = len(self.grads_ready)
        # Fewer than every parameter: either one still to come, or one that needs none. A frozen
        # parameter (LoRA's base weight) is still read by backward for its input's gradient after
        # the others' gradients are in, so the count cannot say the group's backward is done: the
        # passed forward calls, or the end of backward, do ([Note: a group is reduced when its
        # backward is done] in ``overlap/sharding.py``).
        return count == len(self.sharded)

    def _unsharded_dtype(self, index: int) -> torch.dtype:
        dtype = self.orig_dtypes[index]
        if index in self.own_dtype:
            return dtype
        return self.mp.param_dtype if dtype.is_floating_point and self.mp.param_dtype else dtype

    def _unsharded_params(self, follow_requires_grad: bool = True) -> list[nn.Parameter]:
        """The unsharded parameters, made at the first call, each ``requires_grad`` as its shard's
        (and hooked once it is) unless ``follow_requires_grad`` is False and they exist already."""
        # Made once per set of shards: ``rebind_sharded``, the only place that replaces a shard,
        # drops them (see [Note: unsharded parameters keep their identity]).
        if self.unsharded is not None and not follow_requires_grad:
            return self.unsharded
        if self.unsharded is None:
            self.unsharded = []
            self._unsharded_storage = self._unsharded_whole = None
            packed = self.packed_indices
            views: dict[int, torch.Tensor] = {}
            # views of one storage: [Note: unsharded parameters share one storage]
            if not self.aliases_shards and packed:
                dtypes = [self._unsharded_dtype(i) for i in packed]
                placement = PackedPlacement.of([self.layout.shapes[i] for i in packed], dtypes)
                storage = torch.UntypedStorage(placement.nbytes, device=self.sharded[0]._local_tensor.device)
                views = dict(zip(packed, placement.views(storage)))
                # The same memory again, with one version counter of its own: what a gather writes.
                whole = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (placement.nbytes,))
                self._unsharded_fill = tuple(placement.shared_views(whole))
                self._unsharded_whole = whole
                storage.resize_(0)
                self._unsharded_storage = (storage, placement)
            made = dict(zip(self.extension.indices, self._extension_made)) if self.extension is not None else {}
            self._extension_made = []
            for i, shape in enumerate(self.param_shapes):
                data = (made[i] if i in made else self.local_rows(i).detach().view(shape) if self.aliases_shards
                        else views[i].view(shape) if i in self.shard_dims else views[i])
                tp_spec = self.tp_specs[i]
                if tp_spec is not None:  # the module sees the DTensor tensor parallelism made
                    data = tp_dtensor(data, tp_spec)
                param = nn.Parameter(data, requires_grad=self.sharded[i].requires_grad)
                wide = self._tp_reduced_grad_dtype(i)
                if wide is not None:
                    param.grad_dtype = wide
                self.unsharded.append(param)
            self._hooked: set[int] = set()
            self._requires_grad_seen = ()
        sharded, hooked = self.sharded, self._hooked
        with self._shard_getters():
            flags = tuple(map(_REQUIRES_GRAD, sharded))
        if flags != self._requires_grad_seen:  # made now, or frozen or unfrozen since the last gather
            for i, u in enumerate(self.unsharded):
                requires_grad = flags[i]
                if u.requires_grad != requires_grad:
                    u.requires_grad_(requires_grad)
                if requires_grad and i not in hooked:
                    u.register_post_accumulate_grad_hook(self._grad_hook(i))
                    hooked.add(i)
            self._requires_grad_seen = flags
            self._grads_needed = flags.count(True)
        return self.unsharded

    def _tp_reduced_grad_dtype(self, index: int) -> Optional[torch.dtype]:
        """The dtype autograd accumulates parameter ``index``'s unsharded gradient in when that is
        wider than the parameter's, else None: ``reduce_dtype`` for a tensor-parallel parameter
        replicated over a TP dim, whose ``Partial()`` gradient is all-reduced over that dim before
        the data-parallel reduce-scatter ([Note: sharding tensor-parallel parameters]), so that this
        reduction too runs in ``reduce_dtype`` (as FSDP2 does from torch 2.15); on a full SPMD mesh
        its data-parallel dims do not count (the reduce-scatter reduces there)."""
        spec, reduce_dtype = self.tp_specs[index], self.mp.effective_reduce_dtype
        dtype = self._unsharded_dtype(index)
        data_parallel = self.spmd.dp_dims if self.spmd is not None else ()
        if (spec is None or reduce_dtype is None or not dtype.is_floating_point
                or reduce_dtype.itemsize <= dtype.itemsize
                or not any(isinstance(p, Replicate) for i, p in enumerate(spec.placements) if i not in data_parallel)):
            return None
        return reduce_dtype

    def _grad_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        """Parameter ``index``'s post-accumulate-grad hook: mark it ready and tell the runtime
        (``on_grad_ready``), except, with one data-parallel rank, while fewer gradients are in than
        the group needs: then nothing is complete and nothing of this group's is in flight to poll
        for ([Note: counting a group's gradients])."""
        ready = self.grads_ready
        on_grad_ready = self._on_grad_ready

        def hook(_: torch.Tensor) -> None:
            ready.add(index)
            if len(ready) < self._grads_needed and self.single_rank:
                return
            on_grad_ready(self, index)

        return hook

    @property
    def compresses_reductions(self) -> bool:
        """Are this group's gradient reductions compressed (the 1-D reduce-scatter, or HSDP's sum over
        the replicas)? Their average is then computed inside the quantized copy-out, from quantized
        slots: no reduced tensor to hand over, no plain buffers."""
        return self.quantized_reduce is not None or self.quantized_replica_sum is not None

    @property
    def _gather_qlayout(self) -> Optional[QuantizedLayout]:
        """The compressed all-gather's layout (``compress.gather``); None: the gather is exact, or
        moves nothing (a shard group of one rank, e.g. HSDP on an ``(R, 1)`` mesh: quantizing there
        would only add error)."""
        if (self.compression is None or self.compression.gather is None or self.world_size == 1
                or self.gather_layout is None):
            return None
        return quantized_layout(self.gather_layout, self.compression.block, self.compression.gather)

    def all_gather_bytes(self) -> int:
        qlayout = self._gather_qlayout
        if qlayout is not None:
            return qlayout.buffer_bytes
        layout = self.gather_layout
        packed = layout.buffer_numel * self.gather_dtype.itemsize if layout is not None else 0
        if self.extension is None:
            return packed
        return packed + self.world_size * self.extension.bytes_per_rank(self.gather_dtype.itemsize)

    def issue_gather(self) -> None:
        """Pack the shards and start the all-gather (no-op if gathered or already in flight, and at
        world size 1, where nothing travels: ``finish_gather`` does it all)."""
        if self.is_unsharded or self.pending_gather is not None or self.single_rank:
            return
        if self._post_forward_shard is not None:
            kept, versions = self._post_forward_shard
            self._post_forward_shard = None
            if versions == self._shard_versions():  # else an optimizer step came between: from the shards
                self._issue_post_forward_gather(kept, versions)
                return
        with _copy_in_stream(self.sharded[0]._local_tensor.device):  # type: ignore[attr-defined]
            extension = self._issue_extension_gather() if self.extension is not None else None
            layout = self.gather_layout
            # None: every parameter is gathered apart, nothing is packed
            work, ag_output = self._issue_packed_gather(layout) if layout is not None else (None, _NOTHING)
        self.pending_gather = PendingGather(work, ag_output, extension)
        self._gathered_versions = self._shard_versions()

    def _issue_post_forward_gather(self, kept: torch.Tensor, versions: tuple[int, ...]) -> None:
        """The all-gather of the post-forward shards (``kept``, this rank's) over ``post_forward``."""
        group = self.post_forward
        assert group is not None
        with _copy_in_stream(kept.device):
            out = torch.empty(group.size * kept.numel(), dtype=torch.uint8, device=kept.device)
            work = all_gather_into(out, kept, group.info, self.where)
        self.pending_gather = PendingGather(work, out, post_forward=True)
        self._gathered_versions = versions

    def _issue_packed_gather(self, layout: ShardLayout) -> tuple[Optional[InflightWork], torch.Tensor]:
        """The fused copy-in of the packed parameters' shards over ``layout`` (``gather_layout``) and
        its all-gather: (the work, the buffer it fills)."""
        with region(self.regions.all_gather_copy_in), _NoGrad():
            shards, dtypes = self._packed(self.shard_rows()), self._packed(self.orig_dtypes)
            qlayout = self._gather_qlayout
            if qlayout is not None:
                ag_input, ag_output = _quantized_copy_in(shards, qlayout, self.rank)
            else:  # the shards' own dtypes handed over: no read per shard
                allocator = self.custom_all_gather or self.process_group_allocator
                out = (None if allocator is None
                       else _comm_buffer(allocator, layout.buffer_numel, self.gather_dtype, shards[0].device))
                ag_input, ag_output = _all_gather_copy_in(shards, layout, self.rank, self.gather_dtype,
                                                          dtypes, owned=self._owned_shards, out=out)
        return self._all_gather(ag_output, ag_input), ag_output

    def _all_gather(self, ag_output: torch.Tensor, ag_input: torch.Tensor) -> Optional[InflightWork]:
        """Issue one of the group's all-gathers (None where the shard group is one rank)."""
        return (all_gather_into(ag_output, ag_input, self.info, self.where, self.custom_all_gather)
                if self.world_size > 1 else None)

    def _packed(self, per_parameter: Sequence[_T]) -> Sequence[_T]:
        """The entries of ``per_parameter`` (one per parameter of the group) of the packed ones
        (``packed_indices``): all of them unless some are gathered apart."""
        if self.extension is None:
            return per_parameter
        return [per_parameter[i] for i in self.packed_indices]

    def _issue_extension_gather(self) -> PendingExtensionGather:
        """Run the extension parameters' pre-all-gathers, pack their inputs and issue their
        all-gather (nothing travels at world size 1) ([Note: all-gather extensions] in
        ``overlap/gather_extension.py``)."""
        extension = self.extension
        assert extension is not None
        with region(self.regions.all_gather_copy_in), _NoGrad():
            locals_ = self._gathered_apart()
            ag_input, ag_output, inputs, metadata, slot_bytes = extension.pack(locals_, self.rank, self.world_size)
        return PendingExtensionGather(self._all_gather(ag_output, ag_input), ag_output, inputs, metadata, slot_bytes)

    def _finish_extension_gather(self, pending: PendingExtensionGather) -> None:
        """Unpack the extension parameters' all-gather (waited for) into their all-gather outputs and
        run their post-all-gathers: the first gather makes their unsharded tensors (kept for
        ``_unsharded_params``), later ones refill them."""
        extension = self.extension
        assert extension is not None
        locals_ = self._gathered_apart()
        dtypes = [self._unsharded_dtype(i) for i in extension.indices]
        with region(self.regions.all_gather_copy_out), _NoGrad():
            made = extension.unpack(pending, self.world_size, locals_, dtypes, self.unsharded)
        if self.unsharded is None:
            self._extension_made = made

    def _gathered_apart(self) -> list[Any]:
        """What the side all-gather runs the extension on, per parameter gathered apart: the local
        shard itself (it defines the extension), or, for one kept in its own dtype, its rows as
        ``OwnDtypeRows`` (the extension of a plain tensor: its rows travel as they are)."""
        extension = self.extension
        assert extension is not None
        return [OwnDtypeRows(self.local_rows(i)) if i in self.own_dtype else self.sharded[i]._local_tensor
                for i in extension.indices]

    def shard_rows(self) -> list[torch.Tensor]:
        """``local_rows`` of every parameter, in order: one C-level pass (0-dim ones fixed up after)."""
        rows = list(map(_LOCAL, self.sharded))
        for i in self.scalar_indices + self.dim_sharded:
            rows[i] = self._rows(i, rows[i])
        return rows

    def _shard_versions(self) -> tuple[int, ...]:
        """Per shard, a number that grows with every in-place change of it.

        [Note: the shards' getters without lookups]
        Both counters are summed: an in-place op on the DTensor (an optimizer step through DTensor)
        bumps the DTensor's own, not its local tensor's; a write through the local tensor
        (``to_local()``, the local optimizer step) bumps the other. The list is read by C-level
        ``map`` passes, with no bytecode per shard. For a tensor whose class is not exactly
        ``torch.Tensor``, a C getter (``_version``, ``requires_grad``, ``grad``) first looks up
        ``__torch_function__`` on the instance, then on its type, which cost about half of such a
        pass over 300 DTensor parameters (100 -> 45 µs for the versions, 40 -> 19 for
        ``requires_grad``, 66 -> 21 for ``grad`` on the 2-core CI box). DTensor's is
        ``torch._C._disabled_torch_function_impl``, the marker for "no override", so when every
        sharded parameter is exactly a DTensor the passes run under ``DisableTorchFunctionSubclass``
        (``_shard_getters``), which skips the lookup and changes nothing else (torch-function
        modes still see the reads); a subclass of DTensor among them keeps the lookups.
        """
        sharded = self.sharded
        with self._shard_getters():
            return tuple(map(add, map(_VERSION, sharded), map(_LOCAL_VERSION, sharded)))

    def stale_gather(self) -> bool:
        """Was a shard changed in place (an optimizer step, a load, a manual edit) since the pending
        gather packed it? Then its data is old (see [Note: prefetching across the step boundary])."""
        return self.pending_gather is not None and self._shard_versions() != self._gathered_versions

    def stale_unsharded(self) -> bool:
        """Are the unsharded parameters held from an earlier gather (``unshard()``,
        ``set_reshard_after_backward(False)``) older than the shards (changed in place since)?"""
        # At one rank the aliasing parameters cannot be stale, but extension ones are copies
        # (their versions are recorded by the gather: finish_gather).
        return (self.is_unsharded and (not self.aliases_shards or self.extension is not None)
                and self._shard_versions() != self._gathered_versions)

    def finish_gather(self, follow_requires_grad: bool = True) -> None:
        """Wait for the all-gather (issuing it first if needed) and unpack into the unsharded params.

        ``follow_requires_grad=False`` (backward's re-gather) leaves the unsharded parameters'
        ``requires_grad`` as the forward's gather set it: autograd recorded the step with those
        flags, so re-reading every shard's flag there changes nothing but costs a pass over them
        (see ``_unsharded_params``)."""
        if self.is_unsharded:
            return
        if self.single_rank:
            if self.extension is not None:  # nothing travels; the extension's two halves still run
                self._finish_extension_gather(self._issue_extension_gather())
                self._gathered_versions = self._shard_versions()  # for stale_unsharded
            if self.aliases_shards:
                self._unsharded_params(follow_requires_grad)
                self.is_unsharded = True
            else:
                self._cast_into_unsharded(follow_requires_grad)
            return
        if self.stale_gather():
            self.pending_gather = None  # dropped unwaited, as reshard() drops an unused prefetch
        self.issue_gather()
        pending, self.pending_gather = self.pending_gather, None
        assert pending is not None
        if pending.extension is not None:
            _wait_then(pending.extension.work, lambda: self._finish_extension_gather(pending.extension))
        self._unsharded_params(follow_requires_grad)
        layout = self.gather_layout
        if layout is None:
            self.is_unsharded = True
            return
        outs = self._unsharded_fill  # [Note: a gather bumps no version counter]

        def copy_out() -> None:
            with region(self.regions.all_gather_copy_out), _NoGrad():
                self._allocate_unsharded_storage()
                qlayout = self._gather_qlayout
                if pending.post_forward:
                    whole = self._unsharded_whole
                    assert whole is not None
                    whole.copy_(pending.ag_output[:whole.numel()])
                elif qlayout is not None:
                    self._quantized_copy_out(pending.ag_output, qlayout, outs)
                else:
                    _all_gather_copy_out(pending.ag_output, layout, outs, packed=self._unsharded_storage,
                                         versions=outs[:1])  # one counter for all
                    if self.dim_sharded:
                        self._chunks_into_unsharded(pending.ag_output, layout, outs)

        _wait_then(pending.work, copy_out)
        self.is_unsharded = True

    def _chunks_into_unsharded(self, ag_output: torch.Tensor, layout: ShardLayout, outs: Sequence[torch.Tensor]) -> None:
        """After the fused copy-out, each parameter sharded on another dim made again from the
        ranks' chunks in ``ag_output``, concatenated along its dim ([Note: sharding on another dim])."""
        slot = layout.slot_numel
        for i in self.dim_sharded:
            j = self.packed_indices.index(i)
            chunks = [ag_output.narrow(0, r * slot + layout.slot_offsets[j], layout.shard_numel(j, r))
                      for r in range(self.world_size)]
            rows_to_full(chunks, self.param_shapes[i], self.shard_dims[i], out=outs[j].view(self.param_shapes[i]))

    def _quantized_copy_out(self, ag_output: torch.Tensor, qlayout: QuantizedLayout, outs: list[torch.Tensor]) -> None:
        """Dequantize a compressed all-gather into the unsharded parameters. Off CUDA (the host has
        waited anyway) a non-finite block first raises, on every rank alike (each received every
        slot); on CUDA it arrives as NaN (no host sync)."""
        if ag_output.device.type != "cuda":
            scales = qlayout.scales(ag_output)
            if not bool(torch.isfinite(scales).all()):
                ranks = torch.nonzero(~torch.isfinite(scales).all(dim=1)).flatten().tolist()
                raise ValueError(
                    f"overlap.shard: the compressed ({qlayout.format}) all-gather of module {self.where!r} got NaN or inf "
                    f"from the shards of ranks {ranks}: a non-finite parameter cannot be block-quantized "
                    f"(compress=overlap.Compression(gather=None) sends it exactly)")
        _quantized_all_gather_copy_out(ag_output, qlayout, outs)

    def _cast_into_unsharded(self, follow_requires_grad: bool = True) -> None:
        """World size 1 with a cast: one ``_foreach_copy_`` (cast) of the shards into the unsharded
        parameters, which is what packing then unpacking would give, without the flat buffer."""
        self._unsharded_params(follow_requires_grad)
        if self._unsharded_storage is not None:  # None: every parameter is an extension one
            with region(self.regions.all_gather_copy_in), _NoGrad():
                self._allocate_unsharded_storage()
                shards = list(map(_LOCAL, self.sharded))
                for i in self.dim_sharded:  # one rank: the chunk is the whole parameter, in its rows form
                    shards[i] = shards[i].view(self.layout.shapes[i])
                shards = self._packed(shards)
                # [Note: a gather bumps no version counter]
                torch._foreach_copy_(self._unsharded_fill, shards)  # type: ignore[attr-defined]
        self.is_unsharded = True

    def _allocate_unsharded_storage(self) -> None:
        """Give the unsharded parameters' storage its bytes again, unless it holds them (kept by
        ``keep_unsharded_storage``): ``resize_`` to the same size re-allocates, and moves it."""
        storage, placement = self._unsharded_storage
        if storage.nbytes() != placement.nbytes:
            storage.resize_(placement.nbytes)

    def reshard(self) -> None:
        """Free the unsharded storage (unless ``keep_unsharded_storage``), and drop a gather still in
        flight without waiting for it (a prefetch for a module that did not run must not stall
        compute: the in-flight registry keeps its buffers until it completes)."""
        self.pending_gather = None
        self._post_forward_shard = None
        if self.is_unsharded:
            assert self.unsharded is not None
            if not self.keep_unsharded_storage:
                if self._unsharded_storage is not None:  # None: aliased (the shards' storage) or none packed
                    self._unsharded_storage[0].resize_(0)
                if self.extension is not None:
                    self.extension.free()
            self.is_unsharded = False

    def reshard_after_forward(self) -> None:
        """``reshard`` after forward; with ``post_forward`` set, this rank's post-forward shard is kept
        first, for backward's gather ([Note: resharding to a smaller group after forward] in
        ``overlap/post_forward_shard.py``)."""
        whole = self._unsharded_whole
        kept = None
        if self.post_forward is not None and self.is_unsharded and whole is not None:
            with _NoGrad():
                kept = (keep_part(whole, self.post_forward), self._shard_versions())
        self.reshard()
        self._post_forward_shard = kept

    # ------------------------------------------------------------------ reduce-scatter
    def unsharded_grad(self, index: int) -> Optional[torch.Tensor]:
        """Parameter ``index``'s unsharded gradient as the tensor to reduce: a tensor-parallel
        parameter's local gradient, first redistributed to the parameter's own placements where
        autograd left it otherwise (a ``Partial()`` gradient of a replicated parameter, e.g. a norm
        under sequence parallelism: an all-reduce over the TP dim, as FSDP2 does); on a full SPMD
        mesh, on its non-data-parallel dims only (``SpmdMesh.grad_placements``)."""
        grad = self.unsharded[index].grad if self.unsharded is not None else None
        spec = self.tp_specs[index]
        if grad is None or spec is None:
            return grad
        if isinstance(grad, AsyncCollectiveTensor):
            grad = grad.wait()
        placements = tuple(grad.placements)
        target = tuple(spec.placements) if self.spmd is None else self.spmd.grad_placements(placements, spec.placements)
        if placements != target:
            grad = grad.redistribute(placements=target)
        return grad._local_tensor

    def _reduce_layout(self, indices: tuple[int, ...]) -> ShardLayout:
        """The layout the reduction of ``indices`` packs: their shapes, then a ``(world_size,
        len(indices))`` entry for the presence every reduction carries ([Note: a gradient no rank
        produced]); at one data-parallel rank, where nothing is reduced (``reduce_bytes`` only),
        their shapes alone."""
        layout = self._reduce_layouts.get(indices)
        if layout is None:
            if not self.single_rank:
                shapes = [self.layout.shapes[i] for i in indices] + [(self.world_size, len(indices))]
                layout = ShardLayout(shapes, self.world_size)
            elif len(indices) == len(self.layout.shapes):
                layout = self.layout
            else:
                layout = ShardLayout([self.layout.shapes[i] for i in indices], self.world_size)
            self._reduce_layouts[indices] = layout
        return layout

    def _presence_rows(self, count: int, missing: tuple[int, ...], dtype: torch.dtype,
                       device: torch.device) -> torch.Tensor:
        """The rows a reduction of ``count`` parameters sends for [Note: a gradient no rank produced]:
        ``(world_size, count)``, every row 1 where this rank has the gradient, 0 at ``missing``."""
        if not missing:
            key = (count, dtype, device)
            rows = self._all_present.get(key)
            if rows is None:
                rows = self._all_present[key] = torch.ones((self.world_size, count), dtype=dtype, device=device)
            return rows
        rows = torch.ones((self.world_size, count), dtype=dtype, device=device)
        rows[:, list(missing)] = 0
        return rows

    def reduce_bytes(self, indices: Optional[tuple[int, ...]] = None) -> int:
        """Bytes the reduction of ``indices`` (default: ``requires_grad_indices``, read now) moves."""
        if indices is None:
            indices = self.requires_grad_indices
        if not indices or self.unsharded is None:
            return 0
        if self.compression is not None and self.quantized_reduce is not None:
            return quantized_layout(self._reduce_layout(indices), self.compression.block,
                                    self.quantized_reduce).buffer_bytes
        dtype = self.mp.effective_reduce_dtype or widest_dtype([self.unsharded[i].dtype for i in indices])
        return self._reduce_layout(indices).buffer_numel * dtype.itemsize

    def issue_reduce(self, indices: Optional[tuple[int, ...]] = None) -> Optional[PendingReduce]:
        """Pack the unsharded gradients and start their reduce-scatter; the unsharded grads are dropped.

        Parameters without a gradient this step (unused on this rank) contribute zeros, so every
        rank issues the same collective; one that no rank had keeps ``.grad`` None ([Note: a gradient
        no rank produced]). Returns None when no parameter requires grad. ``indices``:
        ``requires_grad_indices`` as the caller read it just before, with nothing run in between
        (default: read here), so that one reduction reads the shards' flags once.
        """
        if indices is None:
            indices = self.requires_grad_indices
        if self.unsharded is None:
            return None
        if len(indices) < len(self.unsharded):
            self._drop_unreduced_grads(indices)
        if not indices:
            return None
        if self.single_rank:
            if finite_check.SWITCH.on and finite_check.SWITCH.resolve():
                self._check_unsharded_grads(indices)
            self._move_grads_to_shards(indices)
            return None
        grads, missing = self._take_unsharded_grads(indices)
        if self.shard_dims:  # [Note: sharding on another dim]
            for j, i in enumerate(indices):
                if i in self.shard_dims:
                    grads[j] = full_to_rows(grads[j], self.shard_dims[i], self.world_size)
        layout = self._reduce_layout(indices)
        if self.compression is not None and self.quantized_reduce is not None:
            # each rank's row of 0 / 1 quantizes exactly (blocks never span two entries)
            grads.append(self._presence_rows(len(indices), missing, torch.float32, grads[0].device))
            return self._issue_quantized_reduce(grads, indices, layout, missing)
        # the gradients' dtypes, read (one pass) where the reduce dtype needs them: handed to the
        # copy-in, whose new address sets then need only their contiguity read
        read = None if self.mp.effective_reduce_dtype is not None else native_passes.dtypes(grads, build=False)
        dtype = self.mp.effective_reduce_dtype or widest_dtype(read)
        grads.append(self._presence_rows(len(indices), missing, dtype, grads[0].device))
        if read is not None:
            read = (*read, dtype)
        comm = self.custom_reduce_scatter
        allocator = comm or self.process_group_allocator
        with region(self.regions.reduce_scatter_copy_in), _NoGrad():
            pre_scale, post_scale, post_divisor = _average_scales(dtype, self.divisor, grads[0].device)
            out = None if allocator is None else _comm_buffer(allocator, layout.buffer_numel, dtype, grads[0].device)
            rs_input = _reduce_scatter_copy_in(grads, layout, pre_scale, dtype, read, owned=self._owned_grads, out=out)
        hsdp = self.replicas > 1
        partial = hsdp and not self.requires_all_reduce
        if self.world_size == 1:
            return PendingReduce(None, rs_input, indices, layout, post_scale, needs_all_reduce=hsdp and not partial,
                                 finite=self._start_finite_check(rs_input, False) if finite_check.SWITCH.on else None,
                                 missing=missing, post_divisor=post_divisor, partial=partial)
        rs_output = (torch.empty(layout.slot_numel, dtype=dtype, device=rs_input.device) if allocator is None
                     else _comm_buffer(allocator, layout.slot_numel, dtype, rs_input.device))
        work = reduce_scatter_into(rs_output, rs_input, self.reduce_info, self.where, comm)
        return PendingReduce(work, rs_output, indices, layout, post_scale, needs_all_reduce=hsdp and not partial,
                             finite=self._start_finite_check(rs_input, True) if finite_check.SWITCH.on else None,
                             missing=missing, post_divisor=post_divisor, partial=partial)

    @property
    def divisor(self) -> float:
        """What a reduction's sum is divided by: the gradient divide factor if set, else the
        data-parallel size."""
        return self.data_parallel_size if self.gradient_divide_factor is None else self.gradient_divide_factor

    def _drop_unreduced_grads(self, indices: tuple[int, ...]) -> None:
        """Drop the unsharded gradients of the parameters outside ``indices`` (their shards do not
        require a gradient now). Autograd still accumulates into an unsharded parameter whose shard
        was frozen after the forward's gather made it require one; the reduction leaves that
        gradient out, as a plain model's frozen parameter gets none, and it must not stay on the
        unsharded parameter: reduced with a later step's gradients once the shard is unfrozen, it
        would add a stale gradient to them."""
        assert self.unsharded is not None
        keep = set(indices)
        for i, u in enumerate(self.unsharded):
            if i not in keep and u.grad is not None:
                u.grad = None

    def upcast_accumulated_grads(self) -> None:
        """After a backward under ``no_sync``: the unsharded gradients it leaves to accumulate, in
        ``reduce_dtype`` where that is wider than theirs, and the next backwards adding into them
        in it.

        [Note: accumulating in the reduce dtype]
        FSDP2 accumulates the unsharded gradients of micro-batches under ``no_sync`` in
        ``reduce_dtype``. Before torch 2.15 it upcasts each into an accumulator of its own and adds
        the next ones to it; from 2.15 it upcasts the gradient itself and sets the parameter's
        ``grad_dtype``. Either way each micro-batch's bf16 gradient is added to an fp32 sum. Adding
        the micro-batches in bf16 and casting once, as autograd alone does, rounds every partial sum
        to bf16: measured on TinyLM at 2 ranks, parameters 1e-2 off FSDP2's after 3 AdamW steps.
        Here each such gradient is cast to ``reduce_dtype`` and the parameter's ``grad_dtype`` set
        to ``None`` (any dtype), so ``AccumulateGrad`` adds the next micro-batches' gradients, in
        their own dtype, into it in place. Not ``grad_dtype=reduce_dtype``: autograd would then cast
        each contribution to a tied parameter before summing them, where FSDP2 sums them in the
        parameter's dtype first (the tied embedding of TinyLM differed by 1e-4). The sums are
        FSDP2's, bitwise. Once the reduction takes the gradients,
        each ``grad_dtype`` is set back (``_restore_grad_dtypes``), so the synced micro-batch of a
        step without accumulation keeps its gradients in the parameter's dtype."""
        if not self.accumulates_wider or self.unsharded is None:
            return
        wide = self.mp.effective_reduce_dtype
        assert wide is not None
        with _NoGrad():
            for i, u in enumerate(self.unsharded):
                grad = u.grad
                if grad is None:
                    continue
                if grad.dtype == wide:  # made so by prepare_accumulation: later ones arrive in theirs
                    if i in self._upcast and u.grad_dtype is not None:
                        _set_grad_accepting_any(u, grad)
                elif _narrower(grad.dtype, wide):
                    self._upcast.setdefault(i, u.grad_dtype)
                    _set_grad_accepting_any(u, grad.to(wide))

    def prepare_accumulation(self) -> None:
        """torch 2.15 and later, before a backward under ``no_sync``: each parameter with no
        gradient yet gets it in ``reduce_dtype`` (``grad_dtype``), as FSDP2 2.15 has it from its
        lazy initialization on, so autograd casts each contribution to a tied parameter before
        summing them ([Note: accumulating in the reduce dtype]; before 2.15 FSDP2 sums them first,
        in the parameter's dtype, and so does this runtime there)."""
        if not self.accumulates_wider or self.unsharded is None:
            return
        wide = self.mp.effective_reduce_dtype
        assert wide is not None
        for i, u in enumerate(self.unsharded):
            if u.grad is None and _narrower(u.dtype, wide):
                self._upcast.setdefault(i, u.grad_dtype)
                u.grad_dtype = wide

    def _restore_grad_dtypes(self) -> None:
        """The ``grad_dtype`` of each parameter ``upcast_accumulated_grads`` widened, back to what
        it was, once its gradient is taken or dropped."""
        unsharded = self.unsharded
        assert unsharded is not None
        for i, dtype in self._upcast.items():
            unsharded[i].grad_dtype = dtype
        self._upcast.clear()

    def _take_unsharded_grads(self, indices: tuple[int, ...]) -> tuple[list[torch.Tensor], tuple[int, ...]]:
        """The unsharded gradients of ``indices`` to reduce (``unsharded_grad``), zeros where a
        parameter got none this step (every rank issues the same collective), and the positions (in
        ``indices``) of those zeros; the unsharded parameters' ``.grad`` are dropped. Without
        tensor-parallel parameters: C-level passes over the list (the getters and setters without
        torch-function lookups: [Note: the shards' getters without lookups]), a Python step only
        per missing gradient."""
        assert self.unsharded is not None
        unsharded = self.unsharded
        params = unsharded if len(indices) == len(unsharded) else list(map(unsharded.__getitem__, indices))
        if self.has_tp_params:
            grads = list(map(self.unsharded_grad, indices))
            for u in params:
                u.grad = None
        else:
            with self._unsharded_getters():
                grads = list(map(_GRAD, params))
                collections.deque(map(setattr, params, repeat("grad"), repeat(None)), maxlen=0)
        missing: list[int] = []
        if any(map(is_, grads, repeat(None))):
            for j, (u, grad) in enumerate(zip(params, grads)):
                if grad is None:  # in the dtype autograd gives it: the list's dtypes stay the group's
                    data = _local(u)  # ([Note: lists the runtime owns] in overlap_kernels/prepared_launch.py)
                    dtype = self._tp_reduced_grad_dtype(indices[j]) or data.dtype
                    grads[j] = torch.zeros(data.shape, dtype=dtype, device=data.device)
                    missing.append(j)
        if self._upcast:
            self._restore_grad_dtypes()
        return grads, tuple(missing)

    def _issue_quantized_reduce(self, grads: list[torch.Tensor], indices: tuple[int, ...],
                                layout: ShardLayout, missing: tuple[int, ...]) -> PendingReduce:
        """Compressed reduction ([Note: compressed collectives] in ``overlap/compression.py``): quantize
        the gradients into one quantized slot per rank, all-to-all them to their owners; the copy-out
        sums in float32 and averages (times ``1/divisor`` after the sum, whatever the reduce dtype)."""
        fmt = self.quantized_reduce
        assert self.compression is not None and self.replicate is None and fmt is not None
        qlayout = quantized_layout(layout, self.compression.block, fmt)
        with region(self.regions.reduce_scatter_copy_in), _NoGrad():
            q_input, _ = _quantized_copy_in(grads, qlayout, None)
            check = finite_check.SWITCH.on and finite_check.SWITCH.resolve()
            measure = gradient_error.SWITCH.on and gradient_error.SWITCH.resolve()
            exact = None
            if check or measure:  # exact float32 gradients (an extra packing, debug only)
                exact = _reduce_scatter_copy_in(grads, layout, None, torch.float32)
        received = torch.empty_like(q_input)
        work = quantized_reduce_into(received, q_input, self.reduce_info, fmt, self.where)
        reference = None
        if measure:  # overlap.gradient_error: the exact reduce-scatter to compare with
            assert exact is not None
            exact_slot = torch.empty(layout.slot_numel, dtype=torch.float32, device=exact.device)
            reference = (reduce_scatter_into(exact_slot, exact, self.reduce_info, self.where),
                         exact_slot[:layout.slot_offsets[-1]])  # the gradients: before the presence entry
        finite = self._start_finite_check(exact, True) if check else None
        return PendingReduce(work, received, indices, layout, 1.0 / self.divisor, finite=finite, quantized=qlayout,
                             reference=reference, missing=missing)

    @functools.cached_property
    def _finite_slots(self) -> tuple[int, tuple[int, ...]]:
        """This rank's slot in the finite check's flags, and the global rank of every slot."""
        replica = self.replicate.rank if self.replicate is not None else 0
        if self.replicate is not None:  # the mesh is (replicate, shard): slots in row-major order
            ranks = tuple(int(r) for r in self.mesh.mesh.flatten().tolist())
        else:
            ranks = tuple(self.info.global_rank(r) for r in range(self.world_size))
        return replica * self.world_size + self.rank, ranks

    def _start_finite_check(self, rs_input: torch.Tensor, over_shards: bool) -> Optional[finite_check.FiniteCheck]:
        """The finite check (called when ``SWITCH.on``: None if it turns out off): this rank's largest
        |gradient| in its slot of the flags, all-reduced over the shard group right behind the
        reduce-scatter (``over_shards``); see ``overlap.finite_check``."""
        if not finite_check.SWITCH.resolve():
            return None
        self.checked_reductions += 1
        slot, ranks = self._finite_slots
        flags = finite_check.local_flags(rs_input, slot, self.data_parallel_size)
        work = all_reduce_into(flags, self.info, self.where) if over_shards else None
        return finite_check.FiniteCheck(flags, work, rs_input, slot, ranks, self.checked_reductions)

    def _raise_if_non_finite(self, pending: PendingReduce) -> None:
        """Wait for the finite check's flags; raise ``NonFiniteError`` on every rank if any rank's
        gradients were not finite, naming this rank's parameters when it is among them."""
        check = pending.finite
        assert check is not None
        pending.finite = None
        if check.work is not None:
            check.work.wait()
        bad = finite_check.bad_slots(check.flags)
        if not bad:
            return
        fqns: list[str] = []
        if check.slot in bad:  # the slow path: which of this rank's parameters (any slot of the input)
            layout, slots = pending.layout, check.packed.view(pending.layout.world_size, -1)
            for j, i in enumerate(pending.indices):
                values = [slots[r].narrow(0, layout.slot_offsets[j], layout.shard_numel(j, r))
                          for r in range(layout.world_size)]
                if not all(bool(torch.isfinite(v).all()) for v in values):
                    fqns.append(self._full_fqn(i))
        if check.slot in bad and not fqns:
            fqns.append("(a padding element?)")  # cannot happen: the copy-in writes zeros there
        finite_check.raise_non_finite(check, bad, fqns, self.module_fqn)

    def _check_unsharded_grads(self, indices: tuple[int, ...]) -> None:
        """World size 1: raise ``NonFiniteError`` before moving non-finite gradients to the shards."""
        assert self.unsharded is not None
        self.checked_reductions += 1
        present = [(i, self.unsharded[i].grad) for i in indices if self.unsharded[i].grad is not None]
        grads = [_local(g) for _, g in present if g.numel()]
        if not grads:
            return
        norms = torch.stack(torch._foreach_norm(grads, math.inf))
        if bool(torch.isfinite(norms).all()):
            return
        fqns = [self._full_fqn(i) for (i, _), n in zip([p for p in present if p[1].numel()], norms.tolist())
                if not math.isfinite(n)]
        check = finite_check.FiniteCheck(norms, None, norms, 0, (self.info.global_rank(0),), self.checked_reductions)
        finite_check.raise_non_finite(check, [0], fqns, self.module_fqn)

    def _full_fqn(self, index: int) -> str:
        return f"{self.module_fqn}.{self.fqns[index]}" if self.module_fqn else self.fqns[index]

    def issue_all_reduce(self, pending: PendingReduce) -> InflightWork:
        """HSDP: sum the reduced shard over the replicas, in place in the reduce-scatter's output,
        which thereby *is* the all-reduce's input (no copy); ``pending`` then waits on the all-reduce
        (see [Note: hybrid sharding]). On CUDA it is ordered after the reduce-scatter by the streams
        (no host wait); elsewhere it waits for the reduce-scatter first, so call it once that is done
        to hide it."""
        assert self.replicate is not None and pending.needs_all_reduce
        buffer, rs_work = pending.rs_output, pending.work
        if self.quantized_replica_sum is not None:
            work = self._issue_compressed_replica_sum(pending)
            after = torch.cuda.current_stream() if buffer.device.type == "cuda" else None
        elif buffer.device.type == "cuda":
            after = comm_stream(buffer.device, "reduce_scatter") if rs_work is not None else torch.cuda.current_stream()
            with torch.cuda.stream(after):
                partial = self._add_partial_sum(pending)  # behind the reduce-scatter on its stream
                work = all_reduce_into(buffer, self.replicate, self.where)
            if partial is not None:
                work.keep(partial)  # freed with the all-reduce's buffers, past the add's read
        else:
            if rs_work is not None:
                rs_work.wait()
            self._add_partial_sum(pending)
            work = all_reduce_into(buffer, self.replicate, self.where)
        self._all_reduce_finite_flags(pending, after if buffer.device.type == "cuda" else None)
        pending.work, pending.needs_all_reduce = work, False
        return work

    def _all_reduce_finite_flags(self, pending: PendingReduce, stream: Optional["torch.cuda.Stream"]) -> None:
        """HSDP: the finite check's flags over the replicas too, right behind the reduction (on
        ``stream`` on CUDA), so that every rank of the mesh decides alike."""
        check = pending.finite
        if check is None:
            return
        assert self.replicate is not None
        if check.work is not None and stream is None:
            check.work.wait()
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            check.work = all_reduce_into(check.flags, self.replicate, self.where)

    def _keep_partial(self, pending: PendingReduce) -> None:
        """A partial reduction's epilogue (``finish_reduce``): wait for its reduce-scatter (on CUDA
        on the issue stream), run the finite check, then add its output into the partial sum, or
        make it the partial sum.

        [Note: reductions left partial over the replicas]
        FSDP2's ``set_requires_all_reduce(False)`` is HSDP's gradient accumulation across nodes at
        one all-reduce per step: each micro-batch's backward reduce-scatters within the shard group
        (the fast tier), and the output, summed over the shard ranks but not yet over the replicas
        nor divided, is added to a sum the group holds (its size: one rank's slot, in the reduce
        dtype), leaving the sharded gradients and their hooks untouched. The next backward that
        all-reduces adds the partial sum to its own output first, then sums over the replicas, divides
        and copies out as usual, so the gradient is the whole accumulation's average, and the
        inter-node tier moves one slot per step instead of one per micro-batch (against
        ``set_requires_gradient_sync(False)``, which holds the unsharded gradients instead: the
        whole group's size per rank). The presence entry ([Note: a gradient no rank produced]) is
        summed alike: a gradient any rank had in any micro-batch stays. The finite check still
        agrees its flags over the replicas at each partial backward. A partial sum lives until an
        all-reduce takes it or ``reset_iter_state()`` discards it (a backward cut short alone does
        not drop it). The parameters that require
        gradients must stay the same between the partial backwards and the one that all-reduces;
        the compressed replica tier (``compress=`` with HSDP) is not supported.
        """
        if pending.work is not None:
            pending.work.wait()
        if pending.finite is not None:  # agreed over the replicas first, so every rank of the mesh raises alike
            self._all_reduce_finite_flags(pending, None)
            self._raise_if_non_finite(pending)
        rows = pending.rs_output
        if self._partial is None:
            self._partial = (pending.indices, rows)
            return
        self._check_partial_indices(pending.indices)
        self._partial[1].add_(rows)

    def discard_unreduced_gradients(self) -> None:
        """``reset_iter_state``: drop the unsharded gradients and the partial sum over the replicas
        (what a failed step left towards the next reduction)."""
        self._partial = None
        if self.unsharded is not None:
            with _NoGrad(), self._unsharded_getters():
                for param in self.unsharded:
                    param.grad = None
            self._restore_grad_dtypes()

    def _add_partial_sum(self, pending: PendingReduce) -> Optional[torch.Tensor]:
        """Before ``pending``'s all-reduce (its reduce-scatter done or ordered before, on the current
        stream): add the partial sum, if any, into its output and hand it over (the group holds it no
        more). Returns it (None: there was none), for a caller that must keep it alive."""
        if self._partial is None:
            return None
        self._check_partial_indices(pending.indices)
        partial = self._partial[1]
        self._partial = None
        pending.rs_output.add_(partial)
        return partial

    def _check_partial_indices(self, indices: tuple[int, ...]) -> None:
        assert self._partial is not None
        if self._partial[0] != indices:
            raise RuntimeError(
                f"set_requires_all_reduce(False): the parameters of {self.module_fqn or 'the root'} that "
                f"require gradients changed between backwards left partial ({len(self._partial[0])} then {len(indices)}); "
                "keep requires_grad fixed until a backward with set_requires_all_reduce(True)")

    def _issue_compressed_replica_sum(self, pending: PendingReduce) -> InflightWork:
        """HSDP with ``compress.reduce``: the sum over the replicas of the reduced shard, compressed.

        [Note: compressing the inter-node tier]
        With HSDP the shard group is the fast tier (inside a node) and the replicas the slow one, so
        the shard group's reduce-scatter stays exact and only the replicas' all-reduce of its output
        (``n`` elements) is compressed, as a reduce-scatter then an all-gather over the replicas on
        a ``ShardLayout`` of this rank's shards (each parameter's shard split by rows over the ``R``
        replicas, so blocks never span two parameters: a large parameter's scale would swamp a small
        neighbour's values): each replica quantizes the whole output into ``R`` slots and
        all-to-alls them (``quantized_reduce_into``); each slot's owner sums the ``R`` versions in
        float32 (``summed_slots``, as the 1-D reduction's copy-out does), quantizes that sum and
        all-gathers it; every replica, the owner too, dequantizes the gathered bytes into the output,
        so the replicas hold bitwise equal gradients. Bytes per replica: ``2 (1 + 4/block) n (R-1)/R``
        against a float32 ring all-reduce's ``8 n (R-1)/R`` (0.254x). Each element is quantized twice
        (once per stage), each time within ``absmax / 254`` of its block (``reduce="fp8"``: ``|x| /
        17 + scale / 1024``, [Note: the per-block error bound]). The first stage waits on the host
        (the owner needs the sums before it can send them): this tier's collectives are issued in
        order, not overlapped with each other. Because it blocks the host, the runtime
        issues it right behind the reduce-scatter (``_Root._reduce`` in ``overlap/sharding.py``), at
        the same point of the program on every rank, not at the CPU path's "reduce-scatter found
        done" poll: a host wait at a point that depends on timing deadlocks across the tiers (found
        at 2x2 by ``bench_hsdp --compression``: ranks waited in a cycle, some in this all-to-all for
        a replica, the others at the first use of a shard-group all-gather that a peer blocked in
        its all-to-all had not issued yet).
        """
        buffer, fmt = pending.rs_output, self.quantized_replica_sum
        assert self.replicate is not None and self.compression is not None and fmt is not None
        shards = pending.layout.shard_views(buffer, self.rank)  # this rank's shard of each parameter
        qlayout = quantized_layout(ShardLayout([tuple(t.shape) for t in shards], self.replicas), self.compression.block,
                                   fmt)
        if pending.work is not None:
            pending.work.wait()
        with region(self.regions.reduce_scatter_copy_in), _NoGrad():
            shards[-1].clamp_(max=1)  # the presence counts as 0 / 1: a block of them quantizes exactly
            slots, _ = _quantized_copy_in(shards, qlayout, None)
            exact = None
            if gradient_error.SWITCH.on and gradient_error.SWITCH.resolve():  # this rank's shards, exact (a copy)
                exact = _flat_float32(shards[:-1])  # the gradients: all but the presence entry
        received = torch.empty_like(slots)
        quantized_reduce_into(received, slots, self.replicate, fmt, self.where).wait()
        r = self.replicate.rank
        with region(self.regions.reduce_scatter_copy_in), _NoGrad():
            summed = summed_slots(received, qlayout, None)[: qlayout.layout.slot_numel]
            owned = qlayout.layout.shard_views(summed, r)
            owned[-1].clamp_(max=1)
            own, gathered = _quantized_copy_in(owned, qlayout, r)
        pending.replica_gather = (gathered, qlayout, shards)
        work = all_gather_into(gathered, own, self.replicate, self.where)
        if exact is not None:  # overlap.gradient_error: the exact float32 sum over the replicas, right behind
            pending.reference = (all_reduce_into(exact, self.replicate, self.where), exact)
        return work

    @property
    def finishes_early(self) -> bool:
        """May this group's reduce-scatter epilogue run before the end of backward? Not with 0-dim
        parameters: their gradients are broadcast, a collective that must stay at a fixed place; nor
        with the finite check on, so every rank has issued the step's collectives when it raises
        (``overlap.finite_check``); nor, off CUDA, with an all-reduce hook, which communicates
        ([Note: the all-reduce hook])."""
        return (not self.scalar_indices and not finite_check.SWITCH.on
                and (self.all_reduce_hook is None or self.sharded[0].device.type == "cuda"))

    def finish_reduce_on_stream(self, pending: PendingReduce) -> Optional["torch.cuda.Event"]:
        """CUDA: queue the epilogue (copy-out, scale, accumulate) on the reduce-scatter's own stream,
        right behind the collective, with no host wait; returns the event the consumer of the
        gradients must wait on. The gradients are allocated on the current stream first, so their
        memory belongs to the stream that will read them (see [Note: the reduce-scatter epilogue
        runs where the collective ran])."""
        device = pending.rs_output.device
        if device.type != "cuda" or pending.work is None:
            return None
        assert not pending.needs_all_reduce
        if pending.partial:  # in finish_reduce, on the issue stream: the partial sum outlives this backward
            return None
        stream = comm_stream(device, "reduce_scatter" if self.replicate is None else "all_reduce")
        kept = self._missing_kept(pending)
        targets, accumulate, packed = self._grads_for(pending)
        with torch.cuda.stream(stream):
            presence = self._copy_out_reduced(pending, targets, accumulate, packed)
            if kept is not None:  # reads the presence row on this stream: a host wait, on this rare path only
                targets = self._drop_grads_no_rank_produced(pending, targets, presence, kept)
            self._run_reduced_hooks(targets)
            return stream.record_event()

    def finish_reduce(self, pending: PendingReduce) -> None:
        """Wait for the reduce-scatter; average, cast and add the result into the sharded ``.grad``s.
        With the finite check on, raise ``NonFiniteError`` first if a rank's gradients were not finite."""
        if pending.partial:
            self._keep_partial(pending)
            return
        if pending.finite is not None:
            self._raise_if_non_finite(pending)
        kept = self._missing_kept(pending)
        targets, accumulate, packed = self._grads_for(pending)
        presence = self._copy_out_reduced(pending, targets, accumulate, packed)
        if kept is not None:
            targets = self._drop_grads_no_rank_produced(pending, targets, presence, kept)
        with _NoGrad():
            self._broadcast_scalar_grads(pending.indices)
        self._run_reduced_hooks(targets)

    def _missing_kept(self, pending: PendingReduce) -> Optional[tuple[bool, ...]]:
        """For each of ``pending.missing``, does its sharded parameter hold a ``.grad`` from before
        (kept across steps, a ``no_sync`` micro-batch's)? None when nothing is missing: nothing to
        decide."""
        if not pending.missing:
            return None
        sharded, indices = self.sharded, pending.indices
        return tuple(sharded[indices[j]].grad is not None for j in pending.missing)

    def _drop_grads_no_rank_produced(self, pending: PendingReduce, targets: list[nn.Parameter],
                                     presence: torch.Tensor, kept: tuple[bool, ...]) -> list[nn.Parameter]:
        """[Note: a gradient no rank produced]: the sharded parameters among ``pending.missing`` that
        no rank had a gradient for, and that held none before, get ``.grad = None`` back (the
        reduction made them zeros); returns ``targets`` less those.

        [Note: a gradient no rank produced]
        A parameter that gets no gradient in a backward (its output dropped, a head the loss leaves
        out, a branch not taken) keeps ``.grad`` None in a plain model, under FSDP2 (which leaves it
        out of its reduction) and under DDP with ``find_unused_parameters`` (which all-reduces a
        bitmap of the used ones), and optimizers skip it: no weight decay, no moment update. Here
        every rank sends zeros for a gradient it lacks, so that every rank issues the same
        collective whichever gradients it has (one rank's MoE expert may get no token while
        another's does: then the average over the ranks is the gradient, as DDP's). Which case it is
        travels in the same collective: every reduction packs, after the gradients, a
        ``(world_size, n)`` entry whose every row holds this rank's 1 per parameter it has a
        gradient for, 0 per one it lacks, so each rank's shard of it is (a scaling of) the number
        of ranks, over the replicas too with HSDP, that had each gradient. A rank that lacked some
        reads that row after the copy-out (a host wait, on CUDA too, on this path only): where it
        is 0, no rank had one, and the parameter's ``.grad`` goes back to None, on every rank alike
        (all read the same counts). Cost on the usual path: ``16 * world_size`` elements or so per
        reduction (the entry is padded to 16 like every other) and one more entry in the packing
        launches; nothing is read. At one data-parallel rank there is no reduction
        (``_move_grads_to_shards`` leaves a missing gradient alone). Compressed, the counts stay
        exact: a quantization block never spans two entries, so a block of the entry holds only 0s
        and 1s (the 1-D reduction quantizes each rank's row, float32; the HSDP replica sum clamps
        its counts to 1 before each of its two quantizations), which quantize exactly; the owner's
        float32 sum is a count again. ``overlap.gradient_error`` compares the gradients' part of a
        slot only.
        """
        counts = presence.reshape(-1).tolist()
        dropped = {j for j, had in zip(pending.missing, kept) if not had and counts[j] == 0}
        if not dropped:
            return targets
        for j in dropped:
            targets[j].grad = None
        return [p for j, p in enumerate(targets) if j not in dropped]

    def _run_reduced_hooks(self, params: list[nn.Parameter]) -> None:
        """The gradients of ``params`` are final for this step: run their post-accumulate-grad hooks,
        then the group's ``reduced_hooks``.

        [Note: hooks after the reduction]
        Autograd accumulates gradients into the unsharded parameters, so it never runs the hooks a
        user registers on the sharded ones (``register_post_accumulate_grad_hook``, e.g. torch's
        optimizer-in-backward recipe). The runtime runs them itself, as FSDP2 does, right after a
        reduction's epilogue has written the sharded ``.grad``s: on CUDA on the stream the epilogue
        ran on (before the event the end of backward waits on), elsewhere on the host, at the runtime
        hook where the epilogue ran. When that is depends on how fast the collective completed, so a
        hook must not communicate (an optimizer step over sharded parameters does not). They do not
        run for micro-batches under ``no_sync``, where nothing is reduced.
        """
        if not params:
            return
        # The hooks torch keeps on a leaf (FSDP2 reads the same attribute): one pass over the C
        # getter, a loop only over the parameters that have some.
        with self._shard_getters():  # [Note: the shards' getters without lookups]
            hooked = any(map(_POST_ACCUMULATE_GRAD_HOOKS, params))
        if hooked:
            for p in params:
                for hook in tuple((p._post_accumulate_grad_hooks or {}).values()):
                    hook(p)
        if self.defer_reduced_hooks:
            self.deferred_reduced = params
        else:
            self._call_reduced_hooks(params)

    def _call_reduced_hooks(self, params: list[nn.Parameter]) -> None:
        if self.reduced_hooks:
            start = time.perf_counter()
            for hook in tuple(self.reduced_hooks):
                hook(params)
            self.reduced_hooks_seconds = time.perf_counter() - start

    def run_deferred_reduced_hooks(self) -> None:
        """Run the ``reduced_hooks`` an epilogue left in ``deferred_reduced`` (none: nothing), now."""
        params, self.deferred_reduced = self.deferred_reduced, None
        if params is not None:
            self._call_reduced_hooks(params)

    def _grads_for(self, pending: PendingReduce) -> tuple[list[nn.Parameter], bool, Optional[_PackedGrads]]:
        """The sharded parameters ``pending`` reduces, each with a ``.grad`` DTensor, whether the
        copy-out accumulates, and, when every gradient is new, the storage they share ([Note: new
        sharded gradients share one storage]). New gradients are uninitialized (the copy-out writes
        every element), or zeros beside existing ones (which the copy-out accumulates into).

        [Note: new sharded gradients share one storage]
        When none of the parameters a reduction writes has a ``.grad`` (the usual case:
        ``zero_grad(set_to_none=True)``), their new gradients are made as views of one allocation,
        placed by a ``PackedPlacement`` (each 16-byte aligned), as FSDP2 makes its new sharded
        gradients views of its reduce-scatter output. The copy-out's pointer table is then keyed on
        that storage, O(1) per reduction, instead of a read of every gradient ([Note: packed
        placements] in ``overlap_kernels._launch``), and making the views is one C-level pass
        (``PackedPlacement.shared_views``), about what an ``empty_like`` of each costs. Where some
        gradient exists (``no_sync`` micro-batches, gradients kept across steps, a ``.grad`` the user
        assigned), new ones are separate zeros and the copy-out reads every gradient, as it must:
        their memory is the caller's. The views share one version counter (an in-place op on one
        gradient bumps all: nothing saves gradients for autograd) and one storage: a gradient kept
        alive after ``zero_grad(set_to_none=True)`` keeps the whole group's gradient storage alive
        (and ``torch.save`` of it writes that storage), as with FSDP2.
        """
        sharded = self.sharded
        targets = [sharded[i] for i in pending.indices]
        with self._shard_getters():  # [Note: the shards' getters without lookups]
            accumulate = any(map(is_not, map(_GRAD, targets), repeat(None)))
        if accumulate:
            for p in targets:
                if p.grad is None:
                    p.grad = _dtensor(torch.zeros_like(p._local_tensor), p._spec)  # type: ignore[attr-defined]
            return targets, accumulate, None
        placement = self._grad_placements.get(pending.indices)
        if placement is None:
            locals_ = [p._local_tensor for p in targets]  # type: ignore[attr-defined]
            shapes, dtypes = [t.shape for t in locals_], [t.dtype for t in locals_]
            # this rank's presence row, last ([Note: a gradient no rank produced])
            shapes.append(torch.Size((1, len(targets))))
            dtypes.append(pending.rs_output.dtype)
            placement = PackedPlacement.of(shapes, dtypes)
            self._grad_placements[pending.indices] = placement
        data = torch.empty(placement.nbytes, dtype=torch.uint8, device=targets[0]._local_tensor.device)
        views = placement.shared_views(data)
        with self._shard_getters():
            for p, grad in zip(targets, map(_NEW_GRAD, views, map(_SPEC, targets))):
                p.grad = grad
        return targets, accumulate, _PackedGrads(data.untyped_storage(), placement, views)

    def _copy_out_reduced(self, pending: PendingReduce, targets: list[nn.Parameter], accumulate: bool,
                          packed: Optional[_PackedGrads]) -> torch.Tensor:
        """Queue the copy-out of ``pending`` into ``targets``' gradients; returns where this rank's
        presence row lands ([Note: a gradient no rank produced])."""
        presence = (packed.views[-1] if packed is not None
                    else torch.empty((1, len(targets)), dtype=pending.rs_output.dtype, device=pending.rs_output.device))

        def copy_out() -> None:
            with region(self.regions.reduce_scatter_copy_out), _NoGrad():
                if pending.replica_gather is not None:  # [Note: compressing the inter-node tier]
                    gathered, qlayout, shards = pending.replica_gather
                    _quantized_all_gather_copy_out(gathered, qlayout, shards)
                    if pending.reference is not None:  # what the copy-out below scales, against the exact sum
                        summed = _flat_float32(shards[:-1])  # all but the presence entry
                        self._record_gradient_error(pending, lambda: _post_scaled(summed, pending))
                if packed is not None and not self.scalar_indices and not self.dim_sharded:  # the layout's rows
                    grads = packed.views
                else:
                    grads = [self._rows(i, p.grad._local_tensor) for i, p in zip(pending.indices, targets)]
                    grads.append(presence)
                if pending.quantized is not None:
                    _quantized_reduce_scatter_copy_out(pending.rs_output, grads, pending.quantized, self.rank,
                                                       pending.post_scale, accumulate)
                    if pending.reference is not None:
                        quantized, numel = pending.quantized, pending.layout.slot_offsets[-1]  # before the presence
                        self._record_gradient_error(
                            pending, lambda: summed_slots(pending.rs_output, quantized, pending.post_scale)[:numel])
                else:
                    post_scale, post_divisor = pending.post_scale, pending.post_divisor
                    if self.all_reduce_hook is not None:
                        post_scale, post_divisor = self._hook_reduced_output(pending)
                    _reduce_scatter_copy_out(pending.rs_output, grads, pending.layout, self.rank,
                                             post_scale, accumulate,
                                             packed=None if packed is None else (packed.storage, packed.placement),
                                             versions=grads[:1] if packed is not None and grads is packed.views
                                             else None,  # shared views: one counter for all
                                             post_divisor=post_divisor)

        _wait_then(pending.work, copy_out)
        return presence

    def _hook_reduced_output(self, pending: PendingReduce) -> tuple[Optional[float], Optional[float]]:
        """Hand ``pending``'s reduced gradients (its output less the presence entry) to the
        all-reduce hook, averaged first unless ``force_sum_reduction_for_comms``; returns the
        ``(post_scale, post_divisor)`` the copy-out has left to apply.

        [Note: the all-reduce hook]
        FSDP2's ``set_all_reduce_hook(hook)`` hands each reduction's output to ``hook`` before the
        sharded gradients are set, for one more reduction the runtime does not know of, done in place
        (a replica tier of the user's own, a sum over another mesh dimension): after the
        reduce-scatter on a 1-D mesh, after the all-reduce over the replicas with HSDP. ``hook`` gets a
        1-D tensor in the reduce dtype: this rank's shard of each gradient of the reduction, one after
        another, each padded to the runtime's packing (not FSDP2's: a hook should work elementwise,
        as a collective does). What it holds is what FSDP2's hook holds: the average (or the sum
        divided by the gradient divide factor), since FSDP2 divides inside its collective when it
        can; with ``set_force_sum_reduction_for_comms(True)`` the sum, divided after the hook. The
        runtime divides in the copy-out; with a hook it divides in place first (by torch: the values
        the copy-out would give, [Note: the reduction's average]) and the copy-out only copies. In
        fp16 the runtime averages before the sum ([Note: fp16 gradients are averaged before they are
        summed]), so there the hook sees the average (FSDP2's: the sum divided by about ``sqrt(w)``).
        At one data-parallel rank the hook gets the gradients concatenated (divided by a set factor),
        as FSDP2's. No hook runs where nothing is reduced: ``no_sync`` micro-batches, and HSDP's
        partial backwards (``requires_all_reduce=False``). When: a hook communicates, so it must run
        at the same point of the program on every rank: on CUDA on the reduction's epilogue stream
        (or the ``stream`` given), queued right behind the collective as backward issues it, as
        FSDP2's; elsewhere at the end of backward, in issue order (the group's epilogue no longer
        finishes early: a host wait at a point that depends on timing can deadlock across groups,
        [Note: compressing the inter-node tier]). Compressed reductions take no hook: their average
        is computed inside the copy-out kernel, from quantized slots.
        """
        rows = pending.rs_output[: pending.layout.slot_offsets[-1]]
        post_scale, post_divisor = pending.post_scale, pending.post_divisor
        if not self.force_sum_reduction_for_comms:
            if post_divisor is not None:
                rows.div_(post_divisor)
            elif post_scale is not None:
                rows.mul_(post_scale)
            post_scale = post_divisor = None
        self._call_all_reduce_hook(rows)
        return post_scale, post_divisor

    def _call_all_reduce_hook(self, output: torch.Tensor) -> None:
        """Call the all-reduce hook on ``output``; on CUDA with a hook stream, there, ordered after
        the current stream and before what the current stream does next."""
        hook, stream = self.all_reduce_hook, self.all_reduce_hook_stream
        assert hook is not None
        if stream is None or output.device.type != "cuda":
            hook(output)
            return
        current = torch.cuda.current_stream(output.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            hook(output)
        current.wait_stream(stream)

    def _hook_single_rank_grads(self, indices: tuple[int, ...]) -> dict[int, torch.Tensor]:
        """One data-parallel rank with an all-reduce hook ([Note: the all-reduce hook]): take the
        unsharded gradients of ``indices`` (``.grad`` set to None), concatenate them in the reduce
        dtype, divide by the gradient divide factor if set, hand that to the hook; returns each
        parameter's view of it, by index (none for a parameter without a gradient)."""
        taken, missing = self._take_unsharded_grads(indices)
        grads = {i: g for j, (i, g) in enumerate(zip(indices, taken)) if j not in missing}  # (not the zeros)
        if not grads:
            return grads
        dtype = self.mp.effective_reduce_dtype or widest_dtype([g.dtype for g in grads.values()])
        flat = torch.cat([g.reshape(-1).to(dtype) for g in grads.values()])
        if self.gradient_divide_factor is not None:
            flat.div_(self.gradient_divide_factor)
        self._call_all_reduce_hook(flat)
        views = flat.split([g.numel() for g in grads.values()])
        return {i: v.view(g.shape) for (i, g), v in zip(grads.items(), views)}

    def _record_gradient_error(self, pending: PendingReduce, compressed: Callable[[], torch.Tensor]) -> None:
        """``overlap.gradient_error``: log ``compressed()``, the compressed average as the copy-out
        computes it (1-D: the float32 sum of the dequantized slots in rank order, scaled; HSDP: the
        dequantized sum over the replicas, scaled), against the exact one once its collective is done."""
        assert pending.reference is not None
        work, exact_sum = pending.reference

        def compare() -> None:
            gradient_error.record(self.where, compressed(), _post_scaled(exact_sum, pending))

        work.wait(then=compare)

    def _broadcast_scalar_grads(self, indices: tuple[int, ...]) -> None:
        """Replicated (0-dim) parameters: rank 0 holds the reduced gradient; give it to every rank."""
        scalars = [i for i in self.scalar_indices if i in indices and self.sharded[i].grad is not None]
        if not scalars or self.world_size == 1:
            return
        grads = [self.sharded[i].grad._local_tensor for i in scalars]  # type: ignore[union-attr]
        packed = torch.stack([g.to(torch.float64) for g in grads])
        dist.broadcast(packed, self.info.global_rank(0), group=self.info.pg)
        for g, value in zip(grads, packed):
            g.copy_(value)

    def _move_grads_to_shards(self, indices: tuple[int, ...]) -> None:
        """World size 1 fast path of the reduce-scatter: the full gradient is the shard's gradient;
        with a cast (``casts_shards``, ``rounds_aliased_grads``) it is rounded to the reduce dtype and
        cast to the shard's, as the packed path's copy-in and copy-out would (one foreach cast for the
        new gradients, one foreach add for the accumulated ones).

        Runs once per group per step inside backward, between the blocks' kernels: the getters and
        setters of both parameter lists run without torch-function lookups ([Note: the shards'
        getters without lookups]), and where the unsharded parameters alias the shards
        (``aliases_shards``) no dtype is read: autograd gives a parameter's gradient the parameter's
        dtype (the shard's here), and ``.grad``'s setter refuses any other."""
        assert self.unsharded is not None
        rounds = self.casts_shards or self.rounds_aliased_grads
        reduce_dtype = self.mp.effective_reduce_dtype if rounds else None
        # (a gradient accumulated wider than its parameter under no_sync is cast back below)
        same_dtype = self.aliases_shards and not self.has_tp_params and not rounds and not self._upcast
        factor = self.gradient_divide_factor  # FSDP2 divides at world size 1 only by a set factor
        moved, fresh_src, fresh_dst, acc_src, acc_dst = [], [], [], [], []
        unsharded, sharded, tp_specs, has_tp = self.unsharded, self.sharded, self.tp_specs, self.has_tp_params
        with _NoGrad(), self._unsharded_getters(), self._shard_getters():
            hooked = None
            if self.all_reduce_hook is not None:  # divided by the factor before the hook
                hooked = self._hook_single_rank_grads(indices)
                factor, same_dtype = None, False
            for i in indices:
                u, s = unsharded[i], sharded[i]
                if hooked is None:
                    grad = self.unsharded_grad(i) if has_tp and tp_specs[i] is not None else u.grad
                    if grad is None:
                        continue
                    u.grad = None
                else:
                    grad = hooked.get(i)
                    if grad is None:
                        continue
                moved.append(s)
                existing = s.grad
                if factor is not None:  # in the reduce dtype, by torch's division, as FSDP2's
                    divided = grad.to(self.mp.effective_reduce_dtype or grad.dtype) / factor
                    grad = divided.to(grad.dtype) if same_dtype else divided  # else cast below
                if not same_dtype:
                    local = s._local_tensor  # type: ignore[attr-defined]
                    if reduce_dtype is not None and not _widens_exactly(grad.dtype, reduce_dtype):
                        grad = grad.to(reduce_dtype)  # the reduction's rounding, as the packed path has it
                    if has_tp and grad.shape != local.shape:  # else the shapes are the layout's, equal
                        grad = grad.view(local.shape)
                    if grad.dtype != local.dtype:
                        if existing is None:  # a new gradient in the shard's dtype: cast by one foreach copy
                            target = torch.empty_like(local)
                            s.grad = _dtensor(target, s._spec)  # type: ignore[attr-defined]
                            fresh_src.append(grad)
                            fresh_dst.append(target)
                            continue
                        grad = grad.to(local.dtype)
                if existing is None:
                    s.grad = _dtensor(grad, s._spec)  # type: ignore[attr-defined]
                else:
                    acc_src.append(grad)
                    acc_dst.append(existing._local_tensor)
            if fresh_dst:
                torch._foreach_copy_(fresh_dst, fresh_src)
            if acc_dst:
                torch._foreach_add_(acc_dst, acc_src)
        if self._upcast:
            self._restore_grad_dtypes()
        self._run_reduced_hooks(moved)


@dataclasses.dataclass(frozen=True)
class _PackedGrads:
    """New sharded gradients' local tensors as views of one storage ([Note: new sharded gradients
    share one storage]): ``views == placement.shared_views(...)`` over ``storage``."""

    storage: torch.UntypedStorage
    placement: PackedPlacement
    views: list[torch.Tensor]


_GRAD = attrgetter("grad")
_DTYPE = attrgetter("dtype")
_SPEC = attrgetter("_spec")
_VERSION = attrgetter("_version")
_LOCAL_VERSION = attrgetter("_local_tensor._version")
_LOCAL = attrgetter("_local_tensor")
_T = TypeVar("_T")
_NOTHING = torch.empty(0)
"""The fused all-gather's buffer where nothing is packed (every parameter gathered apart): never read."""
_REQUIRES_GRAD = attrgetter("requires_grad")
_POST_ACCUMULATE_GRAD_HOOKS = attrgetter("_post_accumulate_grad_hooks")


class ProcessGroupAllocator:
    """FSDP2's ``set_allocate_memory_from_process_group_for_comm(True)``: a collective's buffer from
    the process group backend's own allocator where it has one for the device (NCCL's memory pool,
    for zero-copy transfers), else a plain ``torch.empty`` (gloo has none)."""

    def __init__(self, pg: dist.ProcessGroup) -> None:
        self.pg = pg

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        backend = self.pg._get_backend(device)
        if backend.supports_tensor_alloc(device):
            return backend.allocate_tensor(math.prod(size), dtype=dtype, device=device)
        return torch.empty(*size, dtype=dtype, device=device)


def _comm_buffer(comm: Any, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A collective's buffer from a custom ``Comm``'s ``allocate`` ([Note: custom collectives]),
    checked: a contiguous ``(numel,)`` tensor of ``dtype`` on ``device``.

    [Note: custom collectives]
    FSDP2's ``set_custom_all_gather(comm)`` / ``set_custom_reduce_scatter(comm)`` hand a group's
    collectives to a ``Comm`` (``torch.distributed.fsdp``'s ``AllGather`` / ``ReduceScatter``
    interface): ``comm.allocate(size, dtype=, device=)`` makes each buffer (a memory pool of its own,
    symmetric memory, a persistent buffer) and ``comm(output_tensor=, input_tensor=, group=, [op=,]
    async_op=)`` issues the collective. The runtime's packing kernels then write into the buffers
    ``allocate`` gives (the all-gather's output, whose slot of this rank is the input; the
    reduce-scatter's input and output), and the call replaces torch's, issued as torch's is (on the
    collective's stream on CUDA, async elsewhere; a call that returns no work counts as done). The
    reduce-scatter is called with ``ReduceOp.SUM`` (the runtime divides after: [Note: the
    reduction's average]), where FSDP2 may pass ``AVG`` or ``PREMUL_SUM``: a comm must honour ``op``.
    A comm on gloo that returns torch's reduce-scatter work cannot say it is done before it is
    waited ([Note: gloo's reduce-scatter cannot say it is done] in ``overlap/collectives.py``), so
    there the group's epilogue waits for the end of backward. Not with compressed collectives of the
    same kind (refused), nor at one data-parallel rank, where nothing is sent.
    """
    buffer = comm.allocate((numel,), dtype=dtype, device=device)
    if (not isinstance(buffer, torch.Tensor) or tuple(buffer.shape) != (numel,) or buffer.dtype != dtype
            or buffer.device != device or not buffer.is_contiguous()):
        got = (f"{buffer.dtype}{list(buffer.shape)} on {buffer.device}" if isinstance(buffer, torch.Tensor)
               else type(buffer).__name__)
        raise RuntimeError(f"{type(comm).__name__}.allocate(({numel},), dtype={dtype}, device={device}) returned {got}; "
                           f"a custom collective's allocate must return a contiguous tensor of that size, dtype and device")
    return buffer


def _flat_float32(shards: list[torch.Tensor]) -> torch.Tensor:
    """The HSDP replica sum's input or output shards, flattened in order into one new float32 tensor
    (what ``overlap.gradient_error`` compares over this rank's shards)."""
    return torch.cat([t.reshape(-1) for t in shards]).to(torch.float32)


def _post_scaled(summed: torch.Tensor, pending: PendingReduce) -> torch.Tensor:
    """A float32 sum scaled or divided as ``pending``'s copy-out does it (in float32)."""
    if pending.post_divisor is not None:
        return summed / as_float32(pending.post_divisor)
    return summed if pending.post_scale is None else summed * as_float32(pending.post_scale)


def _set_grad_accepting_any(param: nn.Parameter, grad: torch.Tensor) -> None:
    """``param.grad = grad`` with ``grad_dtype`` None (any dtype): the next gradients arrive in their
    own dtype and ``AccumulateGrad`` adds them into ``grad`` in place. (``grad_dtype`` changes only
    while there is no gradient.)"""
    param.grad = None
    param.grad_dtype = None
    param.grad = grad


@functools.cache
def _narrower(dtype: torch.dtype, wide: torch.dtype) -> bool:
    """Is floating ``dtype`` narrower than ``wide``, which holds every value of it?"""
    return dtype.is_floating_point and dtype != wide and torch.promote_types(dtype, wide) == wide


@functools.cache
def _widens_exactly(source: torch.dtype, target: torch.dtype) -> bool:
    """Does casting ``source`` to ``target`` keep every value (a no-op, or a float widening such as
    bf16 or fp16 to fp32)? Then a cast through ``target`` may be skipped."""
    if source == target:
        return True
    if not (source.is_floating_point and target.is_floating_point):
        return False
    s, t = torch.finfo(source), torch.finfo(target)
    return t.bits > s.bits and t.eps <= s.eps and t.max >= s.max and t.tiny <= s.tiny


def _average_scales(reduce_dtype: torch.dtype, divisor: float,
                    device: torch.device) -> tuple[Optional[float], Optional[float], Optional[float]]:
    """(pre_scale, post_scale, post_divisor) that turn the reduction's sum into the sum divided by
    ``divisor``: the data-parallel size (the average over every rank of the mesh, with HSDP shards
    times replicas) or the gradient divide factor.

    [Note: the reduction's average]
    Other dtypes than fp16 sum, then divide in the copy-out, as torch divides on the reduction's
    device, which is what FSDP2 does (its average, or the ``div_`` after a sum with a divide factor):
    on a CPU a true division (``post_divisor``; multiplying by ``1/w`` would be an ulp off when ``w``
    is no power of two); on CUDA torch divides a tensor by a number as a multiplication by the
    float32 reciprocal (``post_scale``). FSDP2's NCCL average (``ReduceOp.AVG``) and its
    ``PREMUL_SUM`` for a divide factor are NCCL's own arithmetic, which no sum followed by a division
    reproduces bit for bit. With HSDP FSDP2 averages over the shards, then over the replicas: one
    division by their product is the same quotient unless neither is a power of two.

    [Note: fp16 gradients are averaged before they are summed]
    fp16's largest value is 65504: the sum over ranks of gradients whose average fits can overflow
    to inf. In fp16 each rank's gradient is scaled by ``1/w`` in the copy-in, so the collective sums
    values that are already averaged and no partial sum exceeds the largest input (FSDP2's split
    into ``sqrt(w)`` before and after still overflows at 4 ranks). bf16 shares fp32's range.
    """
    if divisor == 1:
        return None, None, None
    if reduce_dtype == torch.float16:
        return 1.0 / divisor, None, None
    if device.type == "cuda":
        return None, float(np.float32(1.0) / np.float32(divisor)), None
    return None, None, float(divisor)


def tp_dtensor(local: torch.Tensor, tp_spec: DTensorSpec) -> DTensor:
    """``local`` (a gathered tensor-parallel shard) as the DTensor ``tp_spec`` describes, the spec's
    dtype set to ``local``'s (``param_dtype`` under mixed precision); no autograd."""
    if tp_spec.tensor_meta.dtype != local.dtype:
        tp_spec = dataclasses.replace(tp_spec, tensor_meta=tp_spec.tensor_meta._replace(dtype=local.dtype))
    return _dtensor(local, tp_spec)


def _dtensor(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """``DTensor(local, spec, requires_grad=False)``: the same object, built without
    ``DTensor.__init__``.

    [Note: building a DTensor without its __init__]
    ``DTensor(...)`` is ``DTensor.__new__`` (torch's C++ ``Tensor._dtensor__new__``: the wrapper
    tensor with ``spec``'s shape and strides, ``_spec`` and ``_local_tensor`` set) followed by
    ``DTensor.__init__``, which only calls ``Tensor.__init__`` (nothing) through two wrappers for
    Dynamo and export tracing, about 2.4 µs of the 3.4 on this CPU. The runtime builds one gradient
    DTensor per parameter per step outside any trace (its hooks never run under Dynamo: ``overlap.eager_hooks``), so
    it calls ``__new__`` alone. Checked on torch 2.11, 2.13 and 2.15: ``__new__`` is
    ``Tensor._dtensor__new__`` and ``__init__`` is that no-op in each.
    """
    return _DTENSOR_NEW(DTensor, local, spec, False)  # requires_grad, positional: no keyword parsing


_DTENSOR_NEW = DTensor.__new__
_DTENSOR_HAS_NO_TORCH_FUNCTION = DTensor.__torch_function__ is torch._C._disabled_torch_function_impl
_PARAMETER_HAS_NO_TORCH_FUNCTION = nn.Parameter.__torch_function__ is torch._C._disabled_torch_function_impl
_NEW_GRAD = functools.partial(_DTENSOR_NEW, DTensor, requires_grad=False)
"""``_dtensor`` as one callable for ``map`` (local tensor, spec)."""


class _NoGrad:
    """``torch.no_grad()`` for the runtime's per-block paths: the same switch
    (``torch._C._set_grad_enabled``, restored on exit), without the decorator-capable class's
    overhead (about 0.3 µs instead of 1.8 on this CPU)."""

    __slots__ = ("prev",)

    def __enter__(self) -> None:
        self.prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)

    def __exit__(self, *exc: object) -> None:
        torch._C._set_grad_enabled(self.prev)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor; a plain tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _layout_rows(local: torch.Tensor, rank: int) -> torch.Tensor:
    """A DTensor's local tensor as the layout's rows: itself, except that a 0-dim (replicated)
    parameter or gradient is one row on rank 0 and none elsewhere."""
    if local.dim() == 0:
        rows = local.view(1)
        return rows if rank == 0 else rows[:0]
    return local


def _copy_in_stream(device: torch.device) -> contextlib.AbstractContextManager:
    """CUDA: the all-gather copy-in runs on its own stream, after the work already queued on the
    current stream (the optimizer's update of the shards), so a prefetch's packing is not queued
    behind compute that the current stream gets later; elsewhere: no stream change."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    stream = comm_stream(device, "all_gather_copy_in")
    stream.wait_stream(torch.cuda.current_stream(device))
    return torch.cuda.stream(stream)


def _wait_then(work: Optional[InflightWork], copy_out: Callable[[], None]) -> None:
    """Wait for ``work`` (None: nothing in flight) and run ``copy_out``, its reads of the collective's
    buffers, inside the wait, so the buffers outlive them on any stream (see [Note: cross-stream
    buffer lifetime] in ``overlap/inflight_work.py``)."""
    if work is None:
        copy_out()
    else:
        work.wait(then=copy_out)


def widest_dtype(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    """The dtype that holds every one of ``dtypes`` exactly (the widest of a mix of floats); one
    promotion per distinct dtype (a group's list repeats a few hundred times)."""
    distinct = iter(dict.fromkeys(dtypes))
    out = next(distinct)
    for d in distinct:
        out = torch.promote_types(out, d)
    return out
