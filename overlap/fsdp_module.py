"""FSDP2's ``FSDPModule`` methods on this runtime's sharded modules.

Every module sharded by ``overlap.shard`` or ``overlap.fully_shard`` is a ``ShardedModule``
(``overlap/sharding.py``), which mixes in :class:`FSDPModuleMethods`: the methods code written for
torch's FSDP2 calls on the modules ``fully_shard`` returns, with FSDP2's signatures, mapped onto the
runtime's per-module state (``ShardState``):

================================  ==================================================================
method                            what it does here
================================  ==================================================================
``set_requires_gradient_sync``    ``False``: backward keeps accumulating unsharded gradients and
                                  issues no reduce-scatter (HSDP: no all-reduce either); the next
                                  backward with ``True`` reduces the sum (``overlap.no_sync``)
``set_reshard_after_backward``    ``False``: the unsharded parameters stay after backward and the
                                  next forward uses them without gathering; they are gathered
                                  again if the shards changed in place since (an optimizer step)
``set_reshard_after_forward``     as ``shard(..., reshard_after_forward=)`` (bool only, as FSDP2)
``set_modules_to_forward_prefetch``  this module's pre-forward gathers those modules' groups, in
``set_modules_to_backward_prefetch`` that order, instead of the next ``prefetch`` groups of the
                                  agreed order (the lists are program order: same on every rank)
``unshard(async_op)``             issue this module's all-gather now; the returned
                                  :class:`UnshardHandle`'s ``wait()`` unpacks it and registers the
                                  unsharded parameters on the module (as FSDP2: ``module.weight`` is
                                  then the full tensor); its pre-forward then uses them. Every rank
                                  must call it at the same point.
``reshard()``                     free this module's unsharded parameters and register the sharded
                                  ones again (``ShardedModule``)
``reset_iter_state()``            on the root after an exception: every group resharded, the step
                                  forgotten, unreduced gradients and HSDP partial sums discarded
                                  (``ShardedModule``; without it the next forward cleans up the
                                  step and keeps the gradients)
``set_is_last_backward``          recorded; every backward here already completes its reductions
                                  before it returns (or, under manual finalization, in
                                  ``finalize_backward``), which is what ``True`` asks for
``set_post_optim_event``          the current stream waits for the event now, so the next
                                  all-gathers are ordered after it (also ``set_post_optimizer_event``)
``set_gradient_divide_factor``    this module's own gradients (not its sharded descendants', as
                                  FSDP2) are summed over the data-parallel ranks and divided by the
                                  factor instead of averaged (also the deprecated
                                  ``set_reduce_scatter_divide_factor``); at world size 1 too
``set_force_sum_reduction_for_comms``  the reductions here always sum and divide after; ``True``
                                  makes an all-reduce hook see the sum (divided after it)
``set_custom_all_gather``         the module's all-gathers through FSDP2's ``AllGather`` comm: its
``set_custom_reduce_scatter``     ``allocate`` makes the buffers the packing kernels fill, its call
                                  issues the collective (the reduce-scatter with ``op=SUM``); not
                                  with compressed collectives of the same kind
``set_allocate_memory_from_process_group_for_comm``  the collectives' buffers from the shard
                                  group backend's allocator where it has one (NCCL's pool); not
                                  with a custom comm (ValueError, as FSDP2) nor compression
``set_separate_reduce_scatter_group``  the gradient reductions over a process group of their own
                                  (same ranks, made once per shard group): they progress beside the
                                  all-gathers
``set_reduce_scatter_max_input_buffers``  at most that many reduce-scatters hold their input
                                  buffers; the oldest are waited for before the next reduction
                                  (default here: no cap; FSDP2's: 1)
``set_all_reduce_hook``           ``hook(output)`` on each reduction's output (this module's own),
                                  before the sharded gradients are set: averaged (the sum under
                                  force-sum), after the replica all-reduce with HSDP; CUDA: on the
                                  epilogue stream or ``stream`` (1-D); elsewhere at the end of
                                  backward; not with compressed reductions
``set_requires_all_reduce``       ``False`` with HSDP: backward reduce-scatters within the shard
                                  group and keeps a partial sum; the next backward with ``True``
                                  adds it and all-reduces over the replicas (not with a compressed
                                  replica tier); on a 1-D mesh it changes nothing, as in FSDP2
``set_keep_unsharded_storage``    ``True``: resharding leaves the unsharded storage allocated (the
                                  same address every step, for CUDA graphs; memory held)
``set_reduce_scatter_unused_params``  accepted, either value: a gradient this rank lacks is always
                                  reduced as zeros, and one no rank had keeps ``.grad`` None
``set_manual_backward_finalization``  ``True`` (root): each backward leaves its reductions in flight;
``finalize_backward(async_op)``   reduces what ``no_sync`` backwards accumulated where sync is on
                                  again, waits and sets the gradients (``async_op``: a handle's
                                  ``wait()`` does); a forward or an optimizer step first finishes
                                  the backward implicitly
                                  ([Note: manual backward finalization] in ``overlap/sharding.py``)
``set_unshard_in_backward``       ``False``: this module's group, resharded after forward, is not
                                  gathered again in backward (nor prefetched there): for parameters
                                  backward never reads, such as an embedding's; the gradients are
                                  reduced as usual (this module only, as FSDP2)
================================  ==================================================================

FSDPModule methods with no counterpart here raise ``NotImplementedError`` naming what to use
instead (:data:`UNSUPPORTED`); nothing is silently ignored.

[Note: not a subclass of torch's FSDPModule]
``isinstance(m, torch.distributed.fsdp.FSDPModule)`` is False for these modules, on purpose. In
torch 2.11-2.15 the code that checks it then reaches into FSDP2's own state: pipelining's stage and
schedule call ``fully_shard.state(module)`` and read its param groups, Dynamo's compile-package
pickler asserts the class is in FSDP2's class map, ``FSDP2MemTracker`` reads FSDP2 internals, and
``FSDPModule.__new__`` takes ``__mro__[2]`` as the original class. Inheriting would also hand our
modules every FSDPModule method we do not override, each calling ``_get_fsdp_state()``, and future
torch releases add more. The utilities that matter for training (DCP, ``get_state_dict`` /
``set_state_dict``, ``clip_grad_norm_``, optimizers) do not check ``FSDPModule`` at all: they see
the DTensor parameters. HF's Trainer checks it only to call ``reshard()`` before building the
optimizer, which our modules do not need (they are sharded between steps). ``overlap.FSDPModule``
(an alias of ``ShardedModule``) is the class to check against.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import torch
from torch import nn

from overlap.groups import separate_group
from overlap.param_group import ProcessGroupAllocator

__all__ = ["FSDPModuleMethods", "UNSUPPORTED", "UnshardHandle"]


class UnshardHandle:
    """What ``unshard()`` returns: ``wait()`` completes the all-gather, unpacks the unsharded
    parameters and registers them on the module in place of the sharded ones, as FSDP2's does
    (idempotent; the module's next pre-forward waits anyway if nobody called it)."""

    def __init__(self, states: list[Any]) -> None:
        self._states = states

    def wait(self) -> None:
        for state in self._states:
            group = state.group
            if group is None:
                continue
            if group.pending_gather is not None or group.single_rank:
                group.finish_gather()
            if group.is_unsharded:
                group.to_unsharded()
        self._states = []


def _check_bool(method: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{method}: {name} must be a bool, got {value!r}")


class FSDPModuleMethods:
    """FSDP2's ``FSDPModule`` methods (see the module docstring). Mixed into ``ShardedModule``; reads
    ``self._overlap_state``."""

    _overlap_state: Any

    def _fsdp_states(self, recurse: bool) -> list[Any]:
        """This module's shard state, or with ``recurse`` every shard state in its subtree, each once."""
        if not recurse:
            return [self._overlap_state]
        from overlap.sharding import sharded_states  # sharding imports this module

        assert isinstance(self, nn.Module)
        return sharded_states(self)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Reduce gradients in the following backwards (``True``) or accumulate them unsharded and
        reduce nothing (``False``: gradient accumulation's micro-batches); for this module's subtree
        (``recurse``) or this module alone."""
        _check_bool("set_requires_gradient_sync", "requires_gradient_sync", requires_gradient_sync)
        for state in self._fsdp_states(recurse):
            state.sync_grads = requires_gradient_sync

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Free the unsharded parameters after backward (``True``, the default) or keep them for the
        next forward (``False``: no all-gather between accumulation micro-batches; memory stays
        held). Kept parameters are gathered again if their shards changed in place since."""
        _check_bool("set_reshard_after_backward", "reshard_after_backward", reshard_after_backward)
        for state in self._fsdp_states(recurse):
            state.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Free the unsharded parameters after forward (``True``) or keep them for backward; either
        replaces a ``reshard_after_forward=<int>`` of ``fully_shard``, as in FSDP2."""
        _check_bool("set_reshard_after_forward", "reshard_after_forward", reshard_after_forward)
        for state in self._fsdp_states(recurse):
            state.reshard_after_forward = reshard_after_forward
            if state.group is not None:
                state.group.post_forward = None

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """FSDP2: whether the next backward is the last before the optimizer step, so it must wait for
        its reductions. Every backward here waits for its reductions before it returns (under manual
        finalization: in ``finalize_backward``), so ``False``
        only records the setting (``state.is_last_backward``); numerics and order are unchanged."""
        _check_bool("set_is_last_backward", "is_last_backward", is_last_backward)
        for state in self._fsdp_states(recurse=True):
            state.is_last_backward = is_last_backward

    def _prefetch_states(self, method: str, modules: object) -> list[Any]:
        if not isinstance(modules, (list, tuple)):
            raise ValueError(f"{method}: modules must be a list of sharded modules, got {type(modules).__name__}")
        bad = [type(m).__name__ for m in modules if not isinstance(m, FSDPModuleMethods)]
        if bad:
            raise ValueError(f"{method}: every module must be sharded by overlap.fully_shard / overlap.shard; "
                             f"got {bad}")
        return [m._overlap_state for m in modules]  # type: ignore[union-attr]

    def set_modules_to_forward_prefetch(self, modules: list[Any]) -> None:
        """In this module's pre-forward, gather ``modules``' parameters (in this order) instead of the
        next groups of the agreed forward order. ``[]`` prefetches nothing."""
        self._overlap_state.forward_prefetch = self._prefetch_states("set_modules_to_forward_prefetch", modules)

    def set_modules_to_backward_prefetch(self, modules: list[Any]) -> None:
        """In this module's pre-backward, gather ``modules``' parameters (in this order) instead of
        the next groups of the reversed forward order."""
        self._overlap_state.backward_prefetch = self._prefetch_states("set_modules_to_backward_prefetch", modules)

    def unshard(self, async_op: bool = False) -> UnshardHandle:
        """All-gather this module's own parameters now (not its sharded descendants'). With
        ``async_op`` the gather is in flight on return and the handle's ``wait()`` completes it;
        without, it is complete. Once complete, the unsharded parameters are the module's (its
        ``parameters()`` are plain full tensors, as after FSDP2's ``unshard``) until its next forward
        ends or ``reshard()``. The module's next pre-forward uses them. Every rank must call it at
        the same point (it issues a collective). Unlike FSDP2, a handle is returned in both cases
        (its ``wait()`` then does nothing)."""
        _check_bool("unshard", "async_op", async_op)
        state = self._overlap_state
        if state.group is not None:
            if state.group.stale_gather() or state.group.stale_unsharded():
                state.group.reshard()
            state.group.issue_gather()
        handle = UnshardHandle([state])
        if not async_op:
            handle.wait()
        return handle

    def set_post_optim_event(self, event: Any) -> None:
        """FSDP2: the next forward's all-gathers wait for ``event`` (recorded after the optimizer step)
        rather than for the whole current stream. Here the current stream waits for it now, so the
        gathers, which are ordered after the current stream, are ordered after the event."""
        if not (hasattr(event, "wait") and hasattr(event, "record")):
            raise ValueError(f"set_post_optim_event: event must be a torch.Event (or torch.cuda.Event), "
                             f"got {type(event).__name__}")
        event.wait()  # the current stream of the event's device waits (no host wait)

    set_post_optimizer_event = set_post_optim_event

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this module's reduced gradients by ``factor`` instead of the number of data-parallel
        ranks: the gradient is the sum over every rank of the mesh (shards times replicas) divided by
        ``factor`` (``1.0``: the plain sum, for a loss already normalised over the global batch). As
        in FSDP2 it applies to this module's own parameters, not its sharded descendants'; call it on
        each module. How the division is done: [Note: the reduction's average] in
        ``overlap/param_group.py``."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (0 < factor < float("inf")):
            raise ValueError(f"set_gradient_divide_factor: factor must be a positive finite number, got {factor!r}")
        group = self._overlap_state.group
        if group is not None:
            group.gradient_divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated in FSDP2 for ``set_gradient_divide_factor``, which it calls."""
        warnings.warn("set_reduce_scatter_divide_factor is deprecated: use set_gradient_divide_factor",
                      FutureWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """FSDP2: with HSDP, whether the next backwards all-reduce over the replicas. ``False``:
        each backward reduce-scatters within the shard group only and keeps the output as a partial
        sum; the next backward with ``True`` adds it in, all-reduces over the replicas and sets the
        gradients (gradient accumulation with one inter-node all-reduce per step; [Note:
        reductions left partial over the replicas] in ``overlap/param_group.py``). A 1-D mesh has no
        such all-reduce, so there the setting changes nothing, as in FSDP2. ``False`` on an HSDP
        module whose replica tier is compressed (``compress=``) raises NotImplementedError before
        anything changes."""
        _check_bool("set_requires_all_reduce", "requires_all_reduce", requires_all_reduce)
        groups = [s.group for s in self._fsdp_states(recurse) if s.group is not None]
        if not requires_all_reduce and any(g.quantized_replica_sum is not None for g in groups):
            raise NotImplementedError(
                "set_requires_all_reduce(False) is not supported by overlap on an HSDP module whose replica "
                "tier is compressed (compress=): " + UNSUPPORTED_COMPRESSED_PARTIAL)
        for group in groups:
            group.requires_all_reduce = requires_all_reduce

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """FSDP2: ``False`` when backward reads none of this module's own parameters (an
        embedding's weight: its gradient needs the indices only). Its group, resharded after
        forward, is then neither gathered again nor prefetched in backward: one all-gather and the
        group's unsharded bytes less per step. Gradients still reach the unsharded parameters (autograd
        accumulates into the tensors it saved, whose storage is freed) and are reduced as usual.
        A group still unsharded when backward reaches it (``reshard_after_forward=False``, kept for
        backward, ``unshard()``) is used as it is. Where backward does read a parameter of the
        module, it reads freed storage and torch raises (a storage of size 0), as under FSDP2.
        At world size 1 nothing is gathered either way. Applies to this module only, as in FSDP2."""
        _check_bool("set_unshard_in_backward", "unshard_in_backward", unshard_in_backward)
        self._overlap_state.unshard_in_backward = unshard_in_backward

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """FSDP2: ``True`` keeps the unsharded parameters' storage allocated when they are resharded,
        so that its address stays the same from step to step (for CUDA graph capture), at the cost
        of holding it between steps. Resharding still drops the parameters from the module and the
        next gather refills the storage; the values in between are the last gather's. (At world
        size 1 without a cast the unsharded parameters are the shards' own storage: nothing to keep.)"""
        _check_bool("set_keep_unsharded_storage", "keep", keep)
        for state in self._fsdp_states(recurse):
            if state.group is not None:
                state.group.keep_unsharded_storage = keep

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """FSDP2: whether a parameter without a gradient on this rank is reduced as zeros, so that
        ranks whose control flow used different parameters (MoE experts, modalities) issue the same
        collective. The runtime always does (``True``), and a parameter no rank had a gradient for
        keeps ``.grad`` None ([Note: a gradient no rank produced] in ``overlap/param_group.py``):
        with ``False`` FSDP2 leaves such a parameter out of its reduction, which gives the same
        gradients wherever every rank lacks the same ones (and hangs where they differ). Both values
        are accepted and change nothing."""
        _check_bool("set_reduce_scatter_unused_params", "reduce_scatter_unused_params", reduce_scatter_unused_params)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """FSDP2: reduce with sum-only collectives and divide separately. The reductions here always
        do (a sum, then the division in the copy-out); ``True`` changes only what an all-reduce hook
        sees (:meth:`set_all_reduce_hook`): the sum, divided after the hook, as in FSDP2."""
        _check_bool("set_force_sum_reduction_for_comms", "enable", enable)
        group = self._overlap_state.group
        if group is not None:
            group.force_sum_reduction_for_comms = enable

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *,
                            stream: Optional["torch.cuda.Stream"] = None) -> None:
        """FSDP2: call ``hook(output)`` on each reduction of this module's own gradients, before the
        sharded gradients are set: ``output`` is this rank's reduced shard (1-D, the reduce dtype;
        after the all-reduce over the replicas with HSDP), averaged unless
        ``set_force_sum_reduction_for_comms(True)``; the hook may change it in place (one more
        all-reduce, over a group of the user's). On CUDA it runs on the reduction's epilogue stream,
        or on ``stream`` (1-D meshes only, as in FSDP2), queued behind the collective; elsewhere at
        the end of backward, in the order the reductions were issued. Not with compressed
        reductions (``compress=`` with ``reduce``): NotImplementedError. Details: [Note: the
        all-reduce hook] in ``overlap/param_group.py``."""
        if not callable(hook):
            raise ValueError(f"set_all_reduce_hook: hook must be callable (hook(output) -> None), got {hook!r}")
        if stream is not None and not isinstance(stream, torch.Stream):
            raise ValueError(f"set_all_reduce_hook: stream must be a torch.cuda.Stream or None, got {stream!r}")
        group = self._overlap_state.group
        if group is None:
            return
        if stream is not None and group.replicate is not None:
            raise ValueError("set_all_reduce_hook: stream cannot be set with HSDP (a 2-D mesh): the hook runs on "
                             "the stream of the all-reduce over the replicas, as in FSDP2")
        if group.compresses_reductions:
            raise NotImplementedError(
                "set_all_reduce_hook is not supported by overlap with compressed reductions (compress= with "
                "reduce): the average is computed inside the copy-out kernel, from quantized slots")
        group.all_reduce_hook, group.all_reduce_hook_stream = hook, stream

    def set_custom_all_gather(self, comm: Any) -> None:
        """FSDP2: issue this module's all-gathers through ``comm`` (``torch.distributed.fsdp``'s
        ``AllGather`` interface): ``comm.allocate`` makes the all-gather buffer, which the packing
        kernel fills, and ``comm(output_tensor=, input_tensor=, group=, async_op=)`` gathers into
        it ([Note: custom collectives] in ``overlap/param_group.py``). Not with a compressed
        all-gather (``compress=`` with ``gather``): NotImplementedError."""
        group = self._custom_comm_group("set_custom_all_gather", comm)
        if group is None:
            return
        if group._gather_qlayout is not None:
            raise NotImplementedError("set_custom_all_gather is not supported by overlap with a compressed all-gather "
                                      "(compress= with gather): its bytes are the quantizing kernel's")
        group.custom_all_gather = comm

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """FSDP2: issue this module's gradient reduce-scatters through ``comm``
        (``torch.distributed.fsdp``'s ``ReduceScatter`` interface): ``comm.allocate`` makes the
        input and output buffers and ``comm(output_tensor=, input_tensor=, group=, op=, async_op=)``
        reduces, called with ``op=ReduceOp.SUM`` (the runtime divides after; FSDP2 may pass ``AVG``:
        a comm must honour ``op``); [Note: custom collectives] in ``overlap/param_group.py``. Not
        with compressed reductions (``compress=`` with ``reduce``): NotImplementedError."""
        group = self._custom_comm_group("set_custom_reduce_scatter", comm)
        if group is None:
            return
        if group.compresses_reductions:
            raise NotImplementedError("set_custom_reduce_scatter is not supported by overlap with compressed "
                                      "reductions (compress= with reduce): their bytes are the quantizing kernel's")
        group.custom_reduce_scatter = comm

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """FSDP2: take this module's collective buffers (the all-gather's, the reduce-scatter's input
        and output) from the shard group backend's own allocator where it has one (NCCL's memory
        pool: zero-copy transfers over NVLink SHARP / InfiniBand; gloo has none: plain buffers).
        As in FSDP2, not together with a custom all-gather or reduce-scatter (ValueError), whose
        ``allocate`` decides; not with compressed collectives (NotImplementedError)."""
        _check_bool("set_allocate_memory_from_process_group_for_comm", "enable", enable)
        group = self._overlap_state.group
        if group is None:
            return
        if enable and (group.custom_all_gather is not None or group.custom_reduce_scatter is not None):
            raise ValueError("set_allocate_memory_from_process_group_for_comm(True) cannot be used with "
                             "set_custom_all_gather / set_custom_reduce_scatter: the custom comm's allocate decides")
        if enable and (group.compression is not None):
            raise NotImplementedError("set_allocate_memory_from_process_group_for_comm is not supported by overlap "
                                      "with compressed collectives (compress=): their buffers are the quantizing "
                                      "kernels'")
        group.process_group_allocator = ProcessGroupAllocator(group.info.pg) if enable else None

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """FSDP2: run the gradient reductions of this module's subtree (``recurse``) or of this module
        over a process group of their own over the shard group's ranks, so that they progress
        beside the all-gathers instead of taking turns with them on one communicator (``False``: the
        shard group again). Every rank of the shard group must call it, in the same order: it makes
        the group (once per shard group, shared). [Note: a reduce-scatter group of its own] in
        ``overlap/groups.py``."""
        _check_bool("set_separate_reduce_scatter_group", "enable", enable)
        for state in self._fsdp_states(recurse):
            group = state.group
            if group is not None:
                group.reduce_info = separate_group(group.info) if enable and group.world_size > 1 else group.info

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """FSDP2: at most ``max_input_buffers`` gradient reduce-scatters may hold their input buffers
        at once; before a reduction past that, the oldest are waited for (on CUDA the compute stream
        waits: FSDP2's stall when a reduce-scatter is exposed; elsewhere the host), trading overlap
        for memory. Here the default is no cap (every reduction packs into a buffer of its own, held
        until its collective is done; bound all collectives' bytes with ``max_inflight_bytes``);
        FSDP2's default is 1. For this module's subtree (``recurse``) or this module."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"set_reduce_scatter_max_input_buffers: max_input_buffers must be an int, "
                            f"got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"set_reduce_scatter_max_input_buffers: max_input_buffers must be a positive int, "
                             f"got {max_input_buffers}")
        for state in self._fsdp_states(recurse):
            if state.group is not None:
                state.group.reduce_scatter_max_input_buffers = max_input_buffers

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """FSDP2 (torch 2.15): on the root, ``True`` makes each backward leave its reductions in
        flight at its end; :meth:`finalize_backward` then waits for them and sets the sharded
        gradients ([Note: manual backward finalization] in ``overlap/sharding.py``). RuntimeError on a
        module that is not the root, and where it would change the mode of a backward running or
        awaiting finalization."""
        _check_bool("set_manual_backward_finalization", "enabled", enabled)
        root = self._root_only("set_manual_backward_finalization")
        if root is not None:
            root.check_finalization_mode(enabled)
        self._overlap_state.manual_backward_finalization = enabled

    def finalize_backward(self, *, async_op: bool = False) -> Any:
        """FSDP2 (torch 2.15), on the root with manual finalization, after the backward passes and
        before the gradients are read: the reductions ``no_sync`` backwards accumulated are issued
        where gradient sync is on now, every reduction is waited for and the sharded ``.grad``s are
        set. ``async_op=True`` returns a handle whose ``wait()`` does the waiting (forward, backward,
        another ``finalize_backward`` and an optimizer step over these parameters raise until then).
        Without the call, the next forward or optimizer step finishes the backward implicitly. A
        no-op before the first forward and when nothing is left to finish."""
        _check_bool("finalize_backward", "async_op", async_op)
        from overlap.sharding import GradientReductionHandle  # sharding imports this module

        root = self._root_only("finalize_backward")
        if root is None:
            return GradientReductionHandle(None, 0.0) if async_op else None
        return root.finalize_backward(async_op)

    def _root_only(self, method: str) -> Any:
        """The root's per-step state (None before the first forward), after checking this module is
        the root (the outermost sharded module that ran): RuntimeError naming ``method`` if not."""
        state = self._overlap_state
        root = state.root
        if root is not None and root.owner is not state:
            raise RuntimeError(f"{method} must be called on the root sharded module (the outermost one), "
                               f"not on {type(self).__name__} {state.fqn!r}")
        return root

    def _custom_comm_group(self, method: str, comm: Any) -> Any:
        """The group a custom comm is for (None: this module has no parameters of its own), after
        checking ``comm`` has FSDP2's ``Comm`` shape: callable, with a callable ``allocate``."""
        if not callable(comm) or not callable(getattr(comm, "allocate", None)):
            raise ValueError(f"{method}: comm must be a torch.distributed.fsdp Comm (callable, with a callable "
                             f"allocate(size, *, dtype, device)), got {comm!r}")
        return self._overlap_state.group


# FSDPModule methods (torch 2.11-2.15) with no counterpart in this runtime: name -> what to use instead.
UNSUPPORTED: dict[str, str] = {
    "set_symm_mem_for_comm": "the runtime allocates its own buffers",
}


UNSUPPORTED_COMPRESSED_PARTIAL = ("the compressed sum over the replicas follows each reduce-scatter; "
                                  "set_requires_gradient_sync(False) skips both reductions")


def _unsupported(name: str, instead: str) -> Any:
    def method(self: Any, *args: Any, **kwargs: Any) -> Optional[Any]:
        raise NotImplementedError(f"{name}() is not supported by overlap's sharded modules: {instead}")

    method.__name__ = name
    method.__doc__ = f"Not supported: raises NotImplementedError ({instead})."
    return method


for _name, _instead in UNSUPPORTED.items():
    setattr(FSDPModuleMethods, _name, _unsupported(_name, _instead))

