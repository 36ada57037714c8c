"""FSDP2's all-gather extension: parameters whose tensor subclass chooses what an all-gather moves.

A sharded parameter's local tensor may define FSDP2's two methods (torchao's float8 training
weights, which gather float8 bytes and a scale, and its NF4 weights, which gather packed codes):

* ``fsdp_pre_all_gather(mesh, orig_size, contiguous_orig_stride, module, mp_policy)`` (or the older
  ``fsdp_pre_all_gather(mesh)``) returns ``(all_gather_inputs, metadata)``: the tensors to gather
  and whatever the second method needs;
* ``fsdp_post_all_gather(all_gather_outputs, metadata, param_dtype, *, out=None)`` builds the
  unsharded tensor from the gathered ones. Without ``out`` it returns ``(unsharded, inner_tensors)``,
  ``inner_tensors`` being the memory the runtime frees when it reshards; with ``out`` (every gather
  after the first) it refills that unsharded tensor in place and returns nothing.

[Note: all-gather extensions]
A group with such parameters gathers them apart from its other parameters, whose values the fused
copy-in packs ([Note: sharded parameters are DTensors] in ``overlap/param_group.py``):
``ExtensionParams`` calls each one's ``fsdp_pre_all_gather`` on its local shard and packs the
inputs' bytes, each at a 16-byte boundary, into this rank's slot of one ``uint8`` buffer; one
all-gather of that buffer moves every extension parameter of the group (a second collective beside
the fused one when the group has both kinds; FSDP2 packs both into one). After the wait, one copy
per input moves each rank's bytes into that input's *all-gather output*, a tensor kept for the
group's life (its storage freed at reshard and re-allocated at the next gather) and rank-major as
FSDP2's: ``world_size`` inputs back to back, viewed as ``(-1, *input.shape[1:])``. They are what
``fsdp_post_all_gather`` receives, so an unsharded tensor that keeps them as inner tensors (as
torchao's float8 weight keeps its data) is refilled by the copy itself; ``out=`` then only updates
what is not gathered (a scale from the metadata). The unsharded parameter is
``as_strided(unsharded, full shape, contiguous strides)``: one object for the group's life, as for
every parameter here ([Note: unsharded parameters keep their identity] in ``overlap/param_group.py``),
and the refills leave its version counter and the outputs' as they were.

Uneven shards: FSDP2 requires an input of a shard shorter than ``ceil(rows / world_size)`` rows to
come back padded to that many (its older one-argument signature is not checked, and gathers
inputs of unequal sizes). Here an input with this rank's fewer rows (any trailing shape: a scale
per row) is zero-padded to that many by the runtime, what FSDP2's own padded shard would hold; an
input with the padded rows is taken as it is; any other is refused on such a rank, naming the
parameter (every rank must send the same bytes).

At world size 1 nothing travels: each input is the output, as FSDP2's one-rank all-gather gives,
and ``fsdp_post_all_gather`` still runs; the unsharded tensor is then a copy, not the shard (as the
group's other parameters are there), so a group kept unsharded across an in-place change of its
shards is gathered again, as at every other world size (``ParamGroup.stale_unsharded``).

A plain parameter that FSDP2's ``param_dtype_override_fn`` keeps in its own dtype (a norm kept in
float32 while the group computes in bfloat16) is gathered the same way, through ``OwnDtypeRows``:
its rows travel as they are beside the fused all-gather, which moves the rest in ``param_dtype``
(FSDP2 packs both into one ``uint8`` buffer; a fused buffer of the widest dtype would have doubled
the bytes of every bfloat16 parameter).

Gradients are what autograd gives the unsharded parameter (a plain tensor: torchao's float8 linear
returns its weight's gradient in high precision); they are reduced with the group's others. A
tensor-parallel parameter whose local tensor carries the extension (torchao's float8 under its
``Float8ColwiseParallel``) runs it on that local tensor's data-parallel shard, and the unsharded
result is wrapped in the TP spec again, as for every TP parameter ([Note: sharding tensor-parallel
parameters] in ``overlap/param_group.py``); ``out=`` then receives that DTensor, as under FSDP2.
Not covered, refused before anything changes by ``check_extension``: a 0-dim one, and compressed
collectives (the extension already chooses the wire format).
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Optional, Sequence

import torch
from torch import nn

__all__ = ["ExtensionParams", "OwnDtypeRows", "PendingExtensionGather", "check_extension", "contiguous_strides",
           "has_extension"]

_ALIGN = 16  # bytes: every input's region in a slot starts at a multiple of this (any dtype's view)


def has_extension(local: torch.Tensor) -> bool:
    """Does this (local) tensor define FSDP2's all-gather extension?"""
    return hasattr(local, "fsdp_pre_all_gather")


def check_extension(local: torch.Tensor, fqn: str, caller: str, *, compressed: bool) -> None:
    """Refuse, naming the parameter, an extension the runtime cannot run (see [Note: all-gather
    extensions]): one method without the other, a pre-all-gather of neither known signature, a 0-dim
    parameter, or compressed collectives."""
    kind = type(local).__name__
    if not hasattr(local, "fsdp_post_all_gather"):
        raise TypeError(f"{caller}: parameter {fqn!r} is a {kind} with fsdp_pre_all_gather but no "
                        "fsdp_post_all_gather; FSDP2's all-gather extension needs both")
    count = _pre_all_gather_arguments(local)
    if count not in (1, 5):
        raise TypeError(f"{caller}: parameter {fqn!r}: {kind}.fsdp_pre_all_gather must take (mesh) or (mesh, "
                        f"orig_size, contiguous_orig_stride, module, mp_policy); it takes {count} arguments")
    if local.dim() == 0:
        raise NotImplementedError(f"{caller}: parameter {fqn!r} is a 0-dim {kind} with FSDP2's all-gather "
                                  "extension; only parameters with a dim 0 to shard can carry one")
    if compressed:
        raise ValueError(f"{caller}: parameter {fqn!r} is a {kind} with FSDP2's all-gather extension, which "
                         "chooses what its all-gather moves; compress= cannot apply to it (pass compress=None, "
                         "or make the parameter a plain tensor)")


class OwnDtypeRows:
    """The all-gather extension of a plain parameter kept in its own dtype while its group computes in
    ``param_dtype`` (FSDP2's ``param_dtype_override_fn``): its rows travel as they are, and the
    all-gather output is the unsharded parameter, refilled in place by every later gather."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows
        self.shape, self.device = rows.shape, rows.device

    def fsdp_pre_all_gather(self, mesh: Any) -> tuple[tuple[torch.Tensor, ...], None]:
        return (self.rows,), None

    def fsdp_post_all_gather(self, outputs: tuple[torch.Tensor, ...], metadata: None, param_dtype: torch.dtype,
                             *, out: Optional[torch.Tensor] = None) -> Optional[tuple[torch.Tensor, tuple]]:
        return None if out is not None else (outputs[0], (outputs[0],))


_ARGUMENTS: dict[type, int] = {}


def _pre_all_gather_arguments(local: Any) -> int:
    """How many arguments ``local.fsdp_pre_all_gather`` takes (1: FSDP2's older signature, 5: its
    current one), read once per class: ``inspect.signature`` costs tens of µs, too much per gather."""
    count = _ARGUMENTS.get(type(local))
    if count is None:
        count = _ARGUMENTS[type(local)] = len(inspect.signature(local.fsdp_pre_all_gather).parameters)
    return count


@dataclasses.dataclass
class _Input:
    """One all-gather input of one parameter: where its bytes sit in a rank's slot."""

    offset: int  # bytes into the slot
    nbytes: int
    shape: torch.Size  # as sent (padded where the runtime padded it)
    dtype: torch.dtype


@dataclasses.dataclass
class PendingExtensionGather:
    """The extension parameters' all-gather of one gather: its work (None at world size 1), the
    buffer it fills, and per parameter the inputs' places and the pre-all-gather's metadata."""

    work: Any
    ag_output: torch.Tensor
    inputs: list[list[_Input]]
    metadata: list[Any]
    slot_bytes: int


class ExtensionParams:
    """The extension parameters of one group (positions ``indices`` in it) and their all-gather
    outputs (see [Note: all-gather extensions])."""

    def __init__(self, indices: Sequence[int], full_shapes: Sequence[torch.Size], rows_per_rank: Sequence[int],
                 fqns: Sequence[str], modules: Sequence[nn.Module], shard_mesh: Any, mp_policy: Any) -> None:
        """``shard_mesh``: the 1-D mesh of the shards (what a pre-all-gather is passed, as FSDP2
        passes it); ``mp_policy``: torch's ``MixedPrecisionPolicy`` of the group (likewise)."""
        self.indices = tuple(indices)
        self.shard_mesh, self.mp_policy = shard_mesh, mp_policy
        self.full_shapes = [torch.Size(s) for s in full_shapes]
        self.rows_per_rank = list(rows_per_rank)
        self.fqns, self.modules = list(fqns), list(modules)
        self.outputs: list[Optional[list[torch.Tensor]]] = [None] * len(self.indices)
        """Per parameter, its all-gather outputs (1-D, ``world_size`` inputs long), kept for the
        group's life; None before its first gather."""
        self.inner: list[list[torch.Tensor]] = [[] for _ in self.indices]
        """Per parameter, the inner tensors ``fsdp_post_all_gather`` returned: freed at reshard."""
        self.last_slot_bytes = 0  # the last gather's bytes per rank (0: none yet)

    # ------------------------------------------------------------------ packing
    def pack(self, locals_: Sequence[torch.Tensor], rank: int,
             world_size: int) -> tuple[torch.Tensor, torch.Tensor, list[list[_Input]], list[Any], int]:
        """Run each parameter's ``fsdp_pre_all_gather`` on its local shard and pack the inputs into
        this rank's slot of a new all-gather buffer. Returns ``(ag_input, ag_output, inputs,
        metadata, slot_bytes)``, ``ag_input`` a view of this rank's slot of ``ag_output``."""
        sent: list[list[torch.Tensor]] = []
        metadata: list[Any] = []
        places: list[list[_Input]] = []
        offset = 0
        for k, local in enumerate(locals_):
            if _pre_all_gather_arguments(local) == 1:
                inputs, meta = local.fsdp_pre_all_gather(self.shard_mesh)
            else:
                full = self.full_shapes[k]
                inputs, meta = local.fsdp_pre_all_gather(self.shard_mesh, full, contiguous_strides(full),
                                                         self.modules[k], self.mp_policy)
            tensors = [self._padded(k, t, local) for t in inputs]
            row: list[_Input] = []
            for t in tensors:
                nbytes = t.numel() * t.element_size()
                row.append(_Input(offset, nbytes, t.shape, t.dtype))
                offset += -(-nbytes // _ALIGN) * _ALIGN
            sent.append(tensors)
            metadata.append(meta)
            places.append(row)
        slot_bytes = max(offset, _ALIGN)
        device = locals_[0].device
        ag_output = torch.empty(world_size * slot_bytes, dtype=torch.uint8, device=device)
        ag_input = ag_output.narrow(0, rank * slot_bytes, slot_bytes)
        for tensors, row in zip(sent, places):
            for t, place in zip(tensors, row):
                if place.nbytes:
                    ag_input.narrow(0, place.offset, place.nbytes).copy_(_bytes(t))
        self.last_slot_bytes = slot_bytes
        return ag_input, ag_output, places, metadata, slot_bytes

    def _padded(self, k: int, t: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """An input as it travels: zero-padded to ``ceil(rows / world_size)`` rows where it has this
        rank's fewer rows (see [Note: all-gather extensions])."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"parameter {self.fqns[k]!r}: fsdp_pre_all_gather must return tensors to gather, "
                            f"got {type(t).__name__}")
        padded_rows, rows = self.rows_per_rank[k], local.shape[0]
        if rows == padded_rows or (t.dim() and t.shape[0] == padded_rows):
            return t.contiguous()
        if not t.dim() or t.shape[0] != rows:
            raise ValueError(
                f"parameter {self.fqns[k]!r} is sharded unevenly ({rows} rows here, {padded_rows} on the first "
                f"ranks): fsdp_pre_all_gather must return inputs of {rows} or {padded_rows} rows, got {tuple(t.shape)}")
        out = t.new_zeros((padded_rows, *t.shape[1:]))
        out[: t.shape[0]].copy_(t)
        return out

    # ------------------------------------------------------------------ unpacking
    def unpack(self, pending: PendingExtensionGather, world_size: int, locals_: Sequence[torch.Tensor],
               param_dtypes: Sequence[torch.dtype], unsharded: Optional[Sequence[nn.Parameter]]) -> list[torch.Tensor]:
        """Copy each input's gathered bytes into its all-gather outputs and run the post-all-gather.
        ``unsharded``: the unsharded parameters of earlier gathers (refilled with ``out=``), or None at
        the first gather; returns the new unsharded tensors then (full shape), else ``[]``."""
        received = pending.ag_output.view(world_size, pending.slot_bytes)
        made: list[torch.Tensor] = []
        for k, (local, row) in enumerate(zip(locals_, pending.inputs)):
            outputs = self.outputs[k]
            if outputs is None:
                outputs = self.outputs[k] = [torch.empty(world_size * p.shape.numel(), dtype=p.dtype,
                                                         device=received.device) for p in row]
            for out, place in zip(outputs, row):
                _allocate(out)
                if place.nbytes:
                    with torch.autograd._unsafe_preserve_version_counter(out):
                        _bytes(out).view(world_size, place.nbytes).copy_(
                            received.narrow(1, place.offset, place.nbytes))
            views = tuple(out.view(-1, *place.shape[1:]) for out, place in zip(outputs, row))
            if unsharded is None:
                tensor, inner = local.fsdp_post_all_gather(views, pending.metadata[k], param_dtypes[k])
                self.inner[k] = list(inner)
                full = self.full_shapes[k]
                made.append(torch.as_strided(tensor, full, contiguous_strides(full), 0))
            else:
                for t in self.inner[k]:
                    _allocate(t)
                param = unsharded[self.indices[k]]
                with torch.autograd._unsafe_preserve_version_counter(param):
                    local.fsdp_post_all_gather(views, pending.metadata[k], param_dtypes[k], out=param)
        return made

    def free(self) -> None:
        """Free the all-gather outputs' and inner tensors' storage (their objects stay)."""
        for outputs, inner in zip(self.outputs, self.inner):
            for t in (*(outputs or ()), *inner):
                storage = t.untyped_storage()
                if storage.nbytes():
                    storage.resize_(0)

    def bytes_per_rank(self, itemsize: int) -> int:
        """This group's extension bytes per rank on the link: the last gather's, else an estimate
        (every rank's rows in ``itemsize`` bytes per element)."""
        if self.last_slot_bytes:
            return self.last_slot_bytes
        return sum(r * s[1:].numel() for r, s in zip(self.rows_per_rank, self.full_shapes)) * itemsize


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat ``uint8`` tensor (a view)."""
    flat = t.reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def _allocate(t: torch.Tensor) -> None:
    """Give a tensor whose storage ``free`` released its bytes again (a no-op while it holds them)."""
    storage = t.untyped_storage()
    needed = (t.storage_offset() + t.numel()) * t.element_size()
    if storage.nbytes() < needed:
        storage.resize_(needed)


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (a 0-size dim counted as 1, as torch does)."""
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))
