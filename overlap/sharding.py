"""``overlap.shard``: FSDP-style sharding of a module, in place, with communication hidden behind compute.

Call ``shard`` on each block, then on the root (children before parents). Each call takes the
parameters of the module's subtree that no sharded descendant owns, shards them (``ParamGroup``) and
hooks the module:

=====================  =====================================================================
point                  what happens
=====================  =====================================================================
pre-forward            wait for this group's all-gather (issued earlier by a prefetch, or now),
                       issue the next ``prefetch`` groups' all-gathers, register the unsharded
                       parameters, cast floating inputs to ``param_dtype``
post-forward           register the sharded parameters again, free the unsharded storage
                       (``reshard_after_forward``; never for the root), hook the outputs
pre-backward           (a hook on the outputs' gradients) re-gather if freed; prefetch the groups
                       that come next in backward
gradient accumulated   (per parameter) when a group's gradients are complete it becomes *ready*;
                       ready groups are reduce-scattered in a fixed order (below), then resharded
end of backward        (an autograd final callback) issue what is left in order, wait every
                       reduce-scatter, add the results into the sharded ``.grad``s, reshard all;
                       with the optimizer in backward and ``prefetch="auto"``, issue the next
                       forward's first gathers ([Note: gathering ahead in backward]) and run the
                       deferred steps ([Note: deferred optimizer steps])
=====================  =====================================================================

[Note: same collectives, same order, on every rank]
Collectives on a process group must be issued in the same order on every rank. Decisions that issue
collectives depend only on program order, never on timing: the forward order of groups is recorded
in the first step and agreed across ranks (a mismatch raises on every rank) before it is used for
prefetching; reduce-scatters go out in the reverse order of each group's first forward use in this
step, a ready group waiting for the groups before it. Waiting to respect ``max_inflight_bytes`` only
delays a collective, it never reorders or skips one.

[Note: a group is reduced when its backward is done]
A group's reduce-scatter may go out once its gradients are complete, and the reduce-scatters of
all groups go out in one fixed order (above). Two signals say "complete": every parameter of the
group got its gradient (counted in the parameters' post-accumulate hooks; never for a group with a
frozen parameter, whose input gradient backward may still compute from it: [Note: counting a
group's gradients] in ``overlap/param_group.py``), or backward has passed
every forward call of the module this step (hooks on the gradients of the call's inputs; the engine
runs a tensor's gradient hooks only after all its consumers ran, and it accumulates a parameter's
gradient as soon as the op that makes it has run). The second one fires on every rank at the same
place, also where a parameter got no gradient on some ranks only (a routed expert, a data-dependent
branch): such a parameter contributes zeros, as with DDP's ``find_unused_parameters``, and one that
no rank has a gradient for keeps ``.grad`` None ([Note: a gradient no rank produced] in
``overlap/param_group.py``). Where both
fire, the counted one fires first, and nothing issues a collective between the two: the output
pre-backward hooks, which prefetch, are node pre-hooks and run after the tensor hooks of the same
gradient. So the sequence of collectives is the same on every rank. A call that cannot be watched
(no input needs a gradient, e.g. token ids, or an input is a leaf) leaves only the count and the
end-of-backward flush for that group in that step.

[Note: the reduce-scatter epilogue runs where the collective ran]
A reduce-scatter's epilogue (wait, copy-out, ``1/w`` scale, cast and accumulate into the sharded
``.grad``) runs as soon as it can, not at the end of backward where nothing is left to hide it: on
CUDA it is queued on the reduce-scatter stream right behind the collective (no host wait; the end
of backward makes the current stream wait on one event per group before anyone reads a
gradient), and the gradients it writes are allocated on the current stream beforehand, so their
memory belongs to the stream that reads them later. On CPU it runs at the first runtime hook after
the collective completed (a non-blocking check; on gloo see [Note: gloo's reduce-scatter cannot
say it is done] in ``overlap/collectives.py``). Epilogues run in issue order. A group with 0-dim
parameters keeps its epilogue at the end of backward, because it broadcasts their gradients and a
collective must not be issued at a time that depends on how fast a collective completed.

[Note: kept for backward]
Backward re-gathers the groups in reverse forward order, so the first ones it needs are the ones
whose forward ran last. Resharding those after their forward and gathering them again put the
re-gathers on the link just where the step needs it most (the forward's end, the loss and the
start of backward; on the demo the largest idle piece of the step was there, 75-220 ms of about
1 s). So, running on the agreed order with grad enabled, the last group (as before) and the
``prefetch`` groups before it stay unsharded from their forward into backward, each after its
group's last forward call (``_kept_for_backward``). Memory: the same ``1 + prefetch`` groups a
``prefetch``-deep lead into backward would hold, and ``prefetch`` re-gathers fewer on the link
per step. Program order only (the agreed order and the depth), so the same on every rank; a step
that leaves the order keeps, from there on, the last groups that ran within the same bound
([Note: kept off script]); a forward with no backward after it leaves
them unsharded for the next forward, which continues its step ([Note: forwards before one
backward]).

[Note: forwards before one backward]
A step may run forward more than once before backward: ``(model(a) + model(b)).backward()``, a
backward per loss, or a forward whose graph is dropped (a metric read with grad enabled). So a
root forward that follows a forward (grad enabled) with no backward since continues that step: it
counts its calls on top of the earlier forward's (a group is reduced once backward has passed all
of them, [Note: a group is reduced when its backward is done]) and reshards nothing first. Starting
a new step there instead resharded the groups the first forward kept and forgot its calls: backward
reduced and resharded a group after the second graph's pass and then met the first graph's saved
parameters freed. Where a graph is dropped, its calls are never passed: its groups are reduced when
their gradients are counted complete, or at the end of backward (a group with a parameter that got
no gradient), later than they could have been, with the same values. Only a backward that was
cut short (an exception inside it) ends the step at the next forward. FSDP2 keeps no per-step
state of this kind and gathers what each forward needs (the same gradients, bitwise:
tests/shard/test_step_edges.py).

[Note: gathering ahead in backward]
With ``prefetch="auto"`` and every group stepped in backward (``overlap.optimizer_in_backward``), a
group's shards are final as soon as its step ran, so the next step's all-gather of it may go out in
this backward, where the link otherwise waits on gradients (``scheduler/gather_ahead.py``, [Note:
choosing the gathers issued ahead]). The step that chooses the depth (the last that records costs) also picks a plan
``(count, lag)`` from its costs and the byte budget, agreed as rank 0's: after the reduce-scatter of
the group reduced ``lag`` after it, each of the first ``count`` groups reduced is gathered
(``_gather_ahead``: the epilogues up to its own run first, waiting for their reduce-scatters, so its
step has run; on CUDA the copy-in waits for the epilogue's event). At the end of backward, after
every step, the next forward's first ``1 + prefetch`` groups are gathered (what
``prefetch_next_step`` does), then any planned group whose issue point did not come. All of it is
program order (the reduce order, the agreed plan), so the same on every rank. It applies only to a
backward that ran the agreed order, reduced every group (no ``no_sync``) with overlap on, and
``_finish_step`` leaves those gathers in flight. From there they are prefetches across the step
boundary ([Note: prefetching across the step boundary]): a shard changed in place before forward
uses it makes forward drop the gather and gather again, a group the forward skips has its gather
dropped at the end of forward. A group used twice in forward, HSDP, a frozen group (no optimizer)
or no optimizer in backward: no plan (a step outside backward would make every gather stale).

[Note: deferred optimizer steps]
What gather-ahead cannot move is the chain at the end of a step: the first groups of forward are
reduced last, so their reduce-scatters, their steps and the next forward's gathers of them (issued
at the end of backward) hold the link while the host has little left to run: the embedding's
backward, those groups' steps, the next forward's first small groups. Every other group's step has
already run in backward, right after its reduce-scatter, on the host that is also backward's
compute side. The step that chooses the depth (with the other choices, from the agreed costs and
each group's measured step seconds, ``ParamGroup.reduced_hooks_seconds``) picks groups whose step moves into
that chain instead: the ones the next forward needs last, as many as fit in the chain's modelled
slack (``scheduler/deferred_steps.py``, [Note: filling the end-of-step chain]); never one of the
next forward's first groups or a group gathered ahead, whose gathers must follow their steps. In a
backward that runs the plan (the conditions of gather-ahead, below, and every group's epilogue run
on the host: not on CUDA, not with 0-dim parameters or the finite check), a deferred group's
epilogue still writes its gradients as soon as its reduce-scatter lands, but leaves the step
(``reduced_hooks``) for the end of backward (``ParamGroup.defer_reduced_hooks``). There, before
waiting for each reduce-scatter still in flight, the host runs deferred steps while it has not
landed; the rest run right after the next forward's first gathers are issued, under the link time
of those gathers, before forward starts. So each deferred step runs before any gather of its
group is issued (its next-step gather is a forward prefetch after the first groups'), and every
step is the same math on the same gradient and state, only later: bitwise the same parameters.
Where a step runs depends on timing, but no step communicates, so the collectives and their order
are the same on every rank. A backward cut short leaves a deferred group unstepped, with its
gradients: ``OptimizerInBackward.step()`` steps it, as any group not stepped in backward.
This replaces the end-of-step chain of 2026-11-27 (``END_OF_STEP_CHAIN``: gathering each first
group right after its own step, which lost to the plain end of backward in paired demo runs,
1.05-1.07x ideal against 1.01-1.02x, and was off by default); it is removed.

[Note: manual backward finalization]
FSDP2's ``set_manual_backward_finalization(True)`` (torch 2.15; on the root) splits the end of
backward in two. Autograd's final callback issues the reductions left, in order (and HSDP's held
all-reduces), and returns with them in flight: nothing is waited for, no epilogue left is run.
``finalize_backward()`` later does the rest, which is the automatic end of backward
(``_finish_backward``): it waits, sets the sharded ``.grad``s, reshards, and runs deferred steps and
gather-ahead. In between, the host is free and the link keeps working.

A backward under ``no_sync`` marks each group it passed (``ShardState.accumulating``).
``finalize_backward`` first reduces those groups whose sync is on again. So "every micro-batch
under ``no_sync``, then sync on and finalize" reduces the sum once, as FSDP2's pending
post-backwards do. That sum is bitwise what a last synced backward would have reduced: autograd
accumulated it into the same unsharded gradients.

Where a rank must not stall, nothing waits for a call that may never come. A forward, a second
backward, or an optimizer step over the root's parameters (the global step pre-hook of
``overlap/optimizer_check.py``) that comes first finishes the awaiting backward implicitly: the
reductions in flight are waited for and their gradients set. Reductions are issued only by the
explicit call, so an implicit finish never adds a collective. Every rank runs the same program, so
the implicit point is the same on every rank. FSDP2 finishes nothing implicitly: a forgotten call
there leaves the gradients unreduced.

``async_op=True`` returns a handle whose ``wait()`` finishes. Until then, forward, backward and
another ``finalize_backward`` raise (FSDP2's rule), and so does an optimizer step over the root's
parameters; nothing has changed at that point. ``reset_iter_state`` drops it all and invalidates
the handle.

Unlike FSDP2 the runtime allows HSDP's partial reductions (``set_requires_all_reduce(False)``)
here: the finalization is the same end of backward that handles them automatically.

[Note: hooks stay eager under torch.compile]
The hooks issue collectives, agree the forward order (``overlap.agreement``) in the first step,
and keep per-step Python state: nothing a graph should capture or guard on. They are wrapped in
``torch._dynamo.disable`` (``overlap.eager_hooks.eager_hook``: called directly where no Dynamo
frame callback is set, [Note: a disabled hook's cost outside torch.compile]), so Dynamo runs them
eagerly wherever it meets them: per-block compile
(``torch.compile(block)`` before or after ``shard``) compiles each block's ``forward`` as one graph
between eager hooks, and ``torch.compile(model)`` of a whole sharded model splits at each hook, so
the compiled pieces run between the same gathers and prefetches as in eager mode and the overlap
stays. The unsharded parameters the graphs read keep their identity, shape and dtype across steps
(see [Note: unsharded parameters keep their identity]), so nothing recompiles after warm-up.

Memory: with ``reshard_after_forward`` at most ``1 + prefetch`` non-root groups are unsharded at
once in forward (the root group stays unsharded from its pre-forward to the end of backward, as in
FSDP2, and so do the last ``1 + prefetch`` groups of the forward order when grad is enabled, since
backward starts with them: [Note: kept for backward]), and the same in backward, plus the groups
whose forward runs around the running one's (a block sharded after a sub-module of its own holds its
group around the sub-module's: [Note: the bytes a plan holds] in ``scheduler/held_bytes.py``);
unsharded gradients live only until their group's reduce-scatter
is packed (or across micro-batches under ``no_sync``).
"""
from __future__ import annotations

import contextlib
import statistics
import time
from itertools import repeat
from operator import attrgetter, eq
from typing import Any, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._pytree import tree_flatten, tree_map

from overlap_kernels.quantized_copy_in import QUANTIZED_DTYPES
from overlap import agreement, desync, errors, local_optimizer_step, optimizer_check
from overlap.class_swap import swapped_class
from overlap.eager_hooks import eager_hook
from overlap.finite_check import NonFiniteError
from overlap.fsdp_module import FSDPModuleMethods
from overlap.groups import GroupInfo, device_mesh_for, resolve_group
from overlap.inflight_work import InflightWork
from overlap.gather_extension import check_extension, has_extension
from overlap.compression import Compression, check_compression
from overlap.mixed_precision import MixedPrecision
from overlap.param_group import ParamGroup, ParamLocation, PendingReduce
from overlap.profiler.records import BUDGET_LABEL
from overlap.regions import ModuleRegions, region
from overlap.schedule_verification import ScheduleTrial
from overlap.streams import comm_stream
from overlap.post_forward_shard import post_forward_group
from overlap.spmd_mesh import SpmdMesh, check_spmd_params
from scheduler import schedule_trial
from scheduler.schedule_trial import Plan, ScheduleDecision, Verdict
from scheduler.step_floor import StepFloor, step_floor
from scheduler.torch_versions import TORCH_VERSION

__all__ = ["shard", "no_sync", "no_overlap", "prefetch_next_step", "ShardedModule", "sharded_states"]


class ShardedModule(FSDPModuleMethods, nn.Module):
    """Mixed into the class of every module passed to ``shard`` (like FSDP2's ``FSDPModule``, whose
    methods it carries: ``overlap/fsdp_module.py``)."""

    _overlap_state: "ShardState"

    def _apply(self, fn: Any, recurse: bool = True) -> Any:  # type: ignore[override]
        # to_empty / to(device) replace parameter objects; the group must follow them.
        out = super()._apply(fn, recurse)
        for state in sharded_states(self):
            if state.group is not None:
                state.group.rebind_sharded()
        return out

    @property
    def max_inflight_bytes_seen(self) -> int:
        """The most bytes of this runtime's collectives in flight at once (the one being issued
        included) in the steps this module ran as the root, as counted against ``shard(...,
        max_inflight_bytes=)``; 0 without a budget or before the first step. For checking that a
        budget holds."""
        root = self._overlap_state.root
        return root.max_inflight_seen if root is not None and root.owner is self._overlap_state else 0

    @property
    def prefetch_depth(self) -> Optional[int]:
        """Groups gathered ahead of the running one: the ``prefetch`` passed to ``shard``, or with
        ``prefetch="auto"`` the depth chosen from the first steps, and after the trial of the choice the
        depth that runs (see [Note: prefetch="auto"], ``schedule_decision``; None
        before it)."""
        state = self._overlap_state
        if not state.auto_prefetch:
            return state.prefetch
        root = state.root
        if root is None or root.chosen_depth is not None:
            return None if root is None else root.chosen_depth
        return None if root.auto_prefetch else 1  # a root that communicates nothing never prefetches

    def set_gather_ahead(self, enabled: bool) -> None:
        """Turn gather-ahead on (the default) or off for this root (see [Note: gathering ahead in
        backward]); every rank alike, between steps. Off: no gather is issued in backward or at its
        end, the schedule before gather-ahead."""
        if not isinstance(enabled, bool):
            raise TypeError(f"set_gather_ahead: enabled must be a bool, got {enabled!r}")
        self._overlap_state.gather_ahead_enabled = enabled

    def set_deferred_steps(self, enabled: bool) -> None:
        """Turn the deferred optimizer steps on (the default) or off for this root (see [Note: deferred
        optimizer steps]); every rank alike or not (they issue no collective), between steps. Off:
        every group is stepped right after its reduce-scatter, the schedule before them."""
        if not isinstance(enabled, bool):
            raise TypeError(f"set_deferred_steps: enabled must be a bool, got {enabled!r}")
        self._overlap_state.deferred_steps_enabled = enabled

    @property
    def gather_ahead(self) -> Optional[tuple[int, int]]:
        """With ``prefetch="auto"`` and an optimizer stepped in backward: ``(count, lag)``, the gathers
        issued ahead in backward chosen from the first steps (during the trial of the choice: the plan
        this step runs; after it: the plan that runs; see [Note: gathering ahead in backward]);
        None before that, or where it does not apply."""
        root = self._overlap_state.root
        return root.gather_ahead if root is not None and root.owner is self._overlap_state else None

    def set_schedule_trial(self, enabled: bool) -> None:
        """Turn on (the default) or off, for this root, the timed trial that verifies ``prefetch="auto"``'s
        choice against the simple plan (depth 1, nothing gathered ahead) and falls back to it unless the
        choice wins ([Note: verifying the choice by a trial] in ``scheduler/schedule_trial.py``); every
        rank alike, before the choice is made. Off: the model's choice runs unverified."""
        if not isinstance(enabled, bool):
            raise TypeError(f"set_schedule_trial: enabled must be a bool, got {enabled!r}")
        self._overlap_state.schedule_trial_enabled = enabled

    @property
    def schedule_decision(self) -> "Optional[ScheduleDecision]":
        """With ``prefetch="auto"``: the plan that runs after the choice and its trial, the model's
        choice and why one or the other (``scheduler.schedule_trial.ScheduleDecision``; ``str()`` says
        it in a line); None until decided (the recorded steps and the trial's), or on a non-root."""
        root = self._overlap_state.root
        return root.schedule_decision if root is not None and root.owner is self._overlap_state else None

    @property
    def deferred_steps(self) -> Optional[list[str]]:
        """With a gather-ahead plan: the groups (module names relative to this root, ``""`` for the
        root) whose in-backward optimizer step runs in the end-of-step chain instead, chosen with the
        depth (see [Note: deferred optimizer steps]); None before that, or where it does not apply."""
        root = self._overlap_state.root
        if root is None or root.owner is not self._overlap_state or root.gather_ahead is None:
            return None
        return [s.fqn for s in root.states if s.index in root.deferred_steps]

    @property
    def modelled_step(self) -> Optional[float]:
        """With ``prefetch="auto"``: the seconds per step the chooser's model gave the chosen schedule
        (depth and gather-ahead) from the recorded steps' costs (see [Note: what the step's
        costs are made of] in ``scheduler/prefetch_depth.py``); None before that, or on a non-root."""
        root = self._overlap_state.root
        return root.modelled_step if root is not None and root.owner is self._overlap_state else None

    @property
    def step_floor(self) -> "Optional[StepFloor]":
        """With ``prefetch="auto"`` and every group stepped in backward: the least seconds per step any
        schedule keeping this step's math reaches on one link, from the recorded steps' costs (the
        end-of-step chain's floor, ``scheduler.step_floor``: [Note: the end-of-step chain's floor]);
        None before that, where the optimizer steps outside backward (its time is not measured), or
        on a non-root."""
        root = self._overlap_state.root
        return root.step_floor if root is not None and root.owner is self._overlap_state else None

    def reshard(self) -> None:
        """Free this module's unsharded parameters and register its sharded ones again, as FSDP2's
        ``reshard`` (no-op if sharded)."""
        state = self._overlap_state
        if state.group is not None:
            state.group.reshard_to_sharded()

    def reset_iter_state(self) -> None:
        """FSDP2's recovery after an exception in forward or backward: call it on the root (the
        outermost sharded module), on every rank, before the next step. Every group is resharded
        (gathers still in flight are dropped; the in-flight registry keeps their buffers until they
        complete), the step is forgotten, and what the failed step left towards the next reduction is
        discarded: the unsharded gradients (a ``no_sync`` accumulation, a backward cut short), the
        reductions whose epilogue had not run, and HSDP's partial sums (``set_requires_all_reduce
        (False)``). As in FSDP2 a micro-batch sequence is then lost, and sharded ``.grad``s set by
        reductions that completed are left as they are (``zero_grad`` clears them). Raises
        RuntimeError on a sharded module that is not the root."""
        root = self._root_only("reset_iter_state")
        if root is not None:
            root.reset_iter_state()




def sharded_states(module: nn.Module) -> list["ShardState"]:
    """The shard states in ``module``'s subtree, in ``module.modules()`` order, each once (the
    modules of one ``fully_shard([a, b])`` call share one state)."""
    return list(dict.fromkeys(m._overlap_state for m in module.modules() if isinstance(m, ShardedModule)))


class ShardState:
    """What ``shard`` attaches to one module: its parameter group (or None), options and hooks."""

    def __init__(self, module: nn.Module, group: Optional[ParamGroup], info: GroupInfo, mp: MixedPrecision,
                 reshard_after_forward: bool, prefetch: Union[int, str], max_inflight_bytes: Optional[int],
                 replicate: Optional[GroupInfo] = None) -> None:
        self.module = module
        self.group = group
        self.info = info
        self.replicate = replicate  # HSDP: the replicas' group (see [Note: hybrid sharding] in param_group.py)
        self.mp = mp
        self.reshard_after_forward = reshard_after_forward
        # prefetch="auto": 1 until the root chooses the depth (see [Note: prefetch="auto"])
        self.auto_prefetch = prefetch == "auto"
        self.prefetch: int = 1 if self.auto_prefetch else prefetch  # type: ignore[assignment]
        self.max_inflight_bytes = max_inflight_bytes
        self.modules: list[nn.Module] = [module]  # several for fully_shard([a, b]): one group, see _shard
        self.members_to_run: set[int] = set()  # ids of the members not yet run in this forward pass
        # FSDPModule settings (overlap/fsdp_module.py): explicit prefetch lists (None: the agreed
        # order), keeping the unsharded parameters after backward.
        self.forward_prefetch: Optional[list[ShardState]] = None
        self.backward_prefetch: Optional[list[ShardState]] = None
        self.reshard_after_backward = True
        self.unshard_in_backward = True  # False: backward does not gather this group (see set_unshard_in_backward)
        self.is_last_backward = True  # recorded only (see set_is_last_backward)
        self.output_cast: Optional[torch.dtype] = None  # fully_shard's output_dtype (registered methods cast too)
        self.method_running = False  # a registered forward method is running: its own hooks stand for forward's
        self.manual_backward_finalization = False  # the root's setting: [Note: manual backward finalization]
        self.accumulating = False  # the last backward passed this group under no_sync: it holds unreduced gradients
        self.root: Optional[_Root] = None
        self.index = -1  # position in the root's state list
        self.sync_grads = True
        self.serialize_comm = False  # set by no_overlap() on the root
        self.gather_ahead_enabled = True  # set_gather_ahead() on the root
        self.schedule_trial_enabled = True  # set_schedule_trial() on the root
        self.deferred_steps_enabled = True  # set_deferred_steps() on the root
        self.regions = ModuleRegions.named("")  # see name_regions
        self.fqn = ""  # relative to the root (see name_regions)
        self._backward_seen = -1  # the backward pass (root counter) whose pre-backward ran here
        self.reset_backward_tracking()

    def name_regions(self, fqn: str) -> None:
        """Name this module's runtime regions after its fully-qualified name ``fqn`` relative to the
        root (``""``: the root itself, whose regions carry no name), here and in its group."""
        self.regions = ModuleRegions.named(fqn)
        self.fqn = fqn
        if self.group is not None:
            self.group.regions = self.regions
            self.group.module_fqn = fqn

    def reset_backward_tracking(self) -> None:
        """Forget this step's forward calls (see [Note: a group is reduced when its backward is done])."""
        self.forward_calls = 0  # forward calls this step whose backward can be seen through inputs
        self.backward_passes = 0  # of those, how many backward has passed through
        self.untracked = False  # a call whose backward cannot be seen: only gradient counting applies

    # ------------------------------------------------------------------ hooks
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.method_running:  # forward inside a registered method (generate): the method's hooks ran
            return self.cast_inputs(args, kwargs)
        if self.group is not None and self.group.on_meta:
            _refuse_meta(module, self.group.on_meta)
        root = self.root
        if root is not None and root.in_backward:
            # Activation-checkpoint recompute inside backward: gather, run, keep it for the backward.
            with region(self.regions.pre_forward_recompute):
                if self.group is not None:
                    root.gather_now(self)
        else:
            if root is None or (root.owner is not self and not root.in_forward):
                if root is not None and root.awaiting_finalization:  # before this module's states move
                    root.check_no_gradient_reduction("forward")
                    root.finish_awaiting()
                root = _Root(self)  # first forward, or a sub-module run on its own
            if root.owner is self:
                root.begin_forward()
            with region(self.regions.pre_forward):
                root.on_pre_forward(self)
                if self.group is not None and torch.is_grad_enabled():
                    if len(self.modules) == 1:
                        self._watch_inputs((args, kwargs) if kwargs else args)
                    else:  # one member's inputs do not say when the others' backward is done
                        self.untracked = True
        return self.cast_inputs(args, kwargs)

    def cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Floating-point forward inputs cast to ``param_dtype`` (unless ``cast_forward_inputs`` is off)."""
        dtype = self.mp.param_dtype
        if dtype is not None and self.mp.cast_forward_inputs:
            if not kwargs and len(args) == 1 and type(args[0]) is torch.Tensor and args[0].dtype == dtype:
                return args, kwargs  # a block's usual input: the last block's output, already cast
            args = _cast_floating(args, dtype)
            if kwargs:
                kwargs = _cast_floating(kwargs, dtype)
        return args, kwargs

    def member_pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Pre-forward hook of each member of a ``fully_shard([a, b])`` group: the group's pre-forward
        runs when the first member of a pass starts (as FSDP2's grouped hooks do); the others only
        cast their inputs."""
        if not self.members_to_run:
            self.members_to_run = {id(m) for m in self.modules}
            return self.pre_forward(module, args, kwargs)
        return self.cast_inputs(args, kwargs)

    def member_post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        """Post-forward hook of each member: the group's post-forward runs when the last member of the
        pass has run."""
        if id(module) in self.members_to_run:
            self.members_to_run.discard(id(module))
            if not self.members_to_run:
                return self.post_forward(module, args, output)
        return output

    def post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if self.method_running:
            return output
        root = self.root
        assert root is not None
        if root.in_backward:  # recompute: backward reads the parameters next, so no reshard and no hooks
            if self.group is not None:
                self.group.to_sharded()
            return output
        if root.recording_costs:
            root.record_post_forward()
        with region(self.regions.post_forward):
            root.post_forward_seq.append(self.index)
            if self.group is not None:
                self.group.to_sharded()
                if (self.reshard_after_forward and root.owner is not self and not root.kept_for_backward(self)
                        and not root.kept_off_script(self)):
                    self.group.reshard_after_forward()
            if torch.is_grad_enabled():
                self._hook_outputs(output)
            if root.owner is self:
                root.end_forward()
                if self.mp.output_dtype is not None:
                    output = _cast_floating(output, self.mp.output_dtype)
        return output

    def _watch_inputs(self, inputs: Any) -> None:
        """Learn when backward has passed this call: when the gradients of all its inputs that need
        one are complete. Leaf inputs cannot tell (their hooks run among the parameters' gradient
        accumulations), nor can a call without such inputs: the step is then ``untracked``. An input
        that is the output a sharded module just hooked is watched by that hook ([Note: one hook
        per block boundary])."""
        tensors = [t for t in _leaves(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not tensors or any(t.grad_fn is None for t in tensors):
            self.untracked = True
            return
        self.forward_calls += 1
        remaining = [len(tensors)]

        def on_input_grad(grad: Any) -> None:
            remaining[0] -= 1
            if remaining[0] == 0:
                self.backward_passes += 1
                root = self.root
                if root is not None:
                    root.on_module_backward_done(self)

        boundary = self.root.boundary if self.root is not None else None
        for t in tensors:
            if boundary is not None and boundary[0] is t and t.grad_fn is boundary[1]:
                boundary[2].inputs_done.append(on_input_grad)
            else:
                t.register_hook(on_input_grad)

    def _hook_outputs(self, output: Any) -> None:
        root = self.root
        for t in _leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                node = t.grad_fn
                if node is not None:
                    # A node pre-hook runs after the tensor hooks of the same gradient, so a group
                    # whose backward ends here is reduced before the next prefetch is issued
                    # (see [Note: a group is reduced when its backward is done]).
                    hook = _OutputHook(self)
                    node.register_prehook(hook)
                    if root is not None and (root.boundary is None or root.boundary[1] is not node):
                        root.boundary = (t, node, hook)  # the first of this node's hooks: see _OutputHook
                else:
                    t.register_hook(self._pre_backward_hook)

    def _pre_backward_hook(self, *_: Any) -> None:
        self.pre_backward()

    def pre_backward(self) -> None:
        root = self.root
        assert root is not None
        if self._backward_seen == root.backward_count and root.in_backward:
            return
        with region(self.regions.pre_backward):
            root.on_pre_backward(self)
        self._backward_seen = root.backward_count


class _OutputHook:
    """The node pre-hook on a sharded module's output (``output.grad_fn``): first the input watches
    of the calls that took this very tensor as input (``_watch_inputs``), then the module's
    pre-backward.

    [Note: one hook per block boundary]
    In a chain of blocks each block's output is the next block's input, and both want to hear of
    that tensor's gradient: the next block to learn that backward has passed it (a tensor hook on
    its input), this block to re-gather before its own backward (a pre-hook on the output's node,
    which the engine runs right after the tensor hooks of the same gradient, at the same point).
    A tensor hook costs a Python ``register_hook`` per call and its own dispatch in the engine (about
    5 µs per block in the runtime-cost benchmark), so where the input is the output that the last
    sharded module hooked (the same tensor, its ``grad_fn`` unchanged since), its watch runs
    inside that pre-hook, before the pre-backward: the order and the point in backward are what
    the two hooks gave. The root keeps the first hook registered on a node (nested sharded modules
    share their output: the innermost hooks it first, and its pre-backward ran first before) in
    ``_Root.boundary`` with the tensor and the node, and drops it at the end of forward, so no
    activation is held past it; the hook itself holds neither (the node holds the hook: a
    reference back would be a cycle through autograd's C++ that Python's collector cannot see).
    """

    __slots__ = ("state", "inputs_done")

    def __init__(self, state: ShardState) -> None:
        self.state = state
        self.inputs_done: list[Any] = []

    def __call__(self, *_: Any) -> None:
        for on_input_grad in self.inputs_done:
            on_input_grad(None)
        self.state.pre_backward()


class _Root:
    """Per-step state of the outermost sharded module that is running: order, prefetch, reduces."""

    def __init__(self, owner: ShardState) -> None:
        states = sharded_states(owner.module)
        for state in states:
            if state is not owner and state.manual_backward_finalization:
                raise RuntimeError(f"set_manual_backward_finalization must be called on the root sharded module "
                                   f"(the outermost one), not on {type(state.module).__name__} {state.fqn!r}")
        self.owner = owner
        self.states = states
        for i, state in enumerate(self.states):
            state.root, state.index = self, i
        self.agreed_order: Optional[list[int]] = None
        self.in_forward = False
        self.in_backward = False
        self.backward_count = 0
        # [Note: manual backward finalization]: the mode of the backward running or awaiting
        # finalization (None: none is), whether one awaits it, and an async finalization not waited
        self._finalization_mode: Optional[bool] = None
        self.awaiting_finalization = False
        self.gradient_reduction: Optional[GradientReductionHandle] = None
        self.synced_backward_count = 0  # backward passes that reduced gradients (not all under no_sync)
        self._last_backward_synced = True
        self.forward_seq: list[int] = []  # pre-forward order of this step (state indices)
        self.post_forward_seq: list[int] = []  # post-forward order: reversed, when backward needs each
        self._outstanding: list[InflightWork] = []  # runtime collectives not yet waited, issue order
        self.max_inflight_seen = 0
        self._last_begin: Optional[float] = None  # perf_counter at the last begin_forward
        self.communicates = any(s.group is not None and not s.group.single_rank for s in self.states)
        """False when every group has one data-parallel rank: then nothing is ever gathered, prefetched
        or stale, and the per-block hooks skip asking (see [Note: world size 1] in param_group.py)."""
        self.auto_prefetch = self.communicates and any(s.auto_prefetch for s in self.states)
        self.budgeted = any(s.max_inflight_bytes is not None for s in self.states)
        """Some group issues under ``max_inflight_bytes``: then HSDP's all-reduces on CPU go out at
        fixed points of the program, not when a poll finds them ready ([Note: hybrid sharding])."""
        self.chosen_depth: Optional[int] = None  # prefetch="auto": the depth chosen and agreed
        self.recording_costs = False  # this forward measures per-position costs (auto, order not agreed yet)
        # per forward position: [compute, gather, packing, backward] seconds, gather = packing + link wait
        # ([Note: a wait split by a stall] in scheduler/cost_samples.py; see [Note: what the
        # step's costs are made of] in scheduler/prefetch_depth.py); backward -1.0: not measured
        self._costs: list[list[float]] = []
        # the recorded steps' costs, on _samples_order, until COST_SAMPLES of them ([Note: robust step costs])
        self._cost_samples: list[list[list[float]]] = []
        self._samples_order: Optional[list[int]] = None
        # the recording step's host seconds on no group's account, [loss, tail] (-1.0: not measured), and
        # their samples beside _cost_samples ([Note: the host work between the groups] in scheduler/prefetch_depth.py)
        self._between: list[float] = [-1.0, -1.0]
        self._between_samples: list[list[float]] = []
        self._forward_end = 0.0  # perf_counter at the recording forward's end
        self._recorded_steps = 0  # steps that recorded costs, on any order
        self._choice_pending = False  # costs recorded, the choice waits for the end of this step's backward
        self._forward_awaiting_backward = False  # a forward ran (grad enabled) since the last backward
        self._backward_position: Optional[int] = None  # the recording backward's running position
        self._position_of: dict[int, int] = {}  # the recording backward: state index -> forward position
        self.modelled_step: Optional[float] = None  # seconds: the chosen plan's modelled steady step
        # the floor no exact schedule goes below, from the same costs ([Note: the end-of-step chain's floor])
        self.step_floor: Optional[StepFloor] = None
        # the trial of the choice against the simple plan ([Note: verifying the choice by a trial])
        self._trial: Optional[ScheduleTrial] = None
        self._modelled: tuple[Plan, float, float] = ((1, None), 0.0, 0.0)  # the model's plan, its and simple's step
        self.schedule_decision: Optional[ScheduleDecision] = None
        self._running: list[int] = []  # positions whose forward is running, innermost last
        self._kept: frozenset[int] = frozenset()  # forward positions kept unsharded for backward
        self._kept_for: Optional[tuple[list[int], int]] = None  # (agreed order, depth) _kept was computed for
        self._kept_count = 0  # groups kept on script in this forward
        self._off_script_kept: list[ShardState] = []  # kept off script, oldest first: [Note: kept off script]
        # Gather-ahead (see [Note: gathering ahead in backward]): the agreed (count, lag) plan, None: off.
        self.gather_ahead: Optional[tuple[int, int]] = None
        self._ahead: set[int] = set()  # groups whose next-step gather this backward issued (kept by _finish_step)
        # Deferred optimizer steps (see [Note: deferred optimizer steps]): state indices, chosen with the depth.
        self.deferred_steps: frozenset[int] = frozenset()
        self._deferring: list[ShardState] = []  # this backward's deferred groups, in reduce order
        self._mark = 0.0
        self.boundary: Optional[tuple[torch.Tensor, Any, _OutputHook]] = None
        """The output the last sharded module hooked in this forward, its ``grad_fn`` and the hook on
        it ([Note: one hook per block boundary]); None outside forward."""
        self._reset_backward()

    # ------------------------------------------------------------------ in-flight budget
    def _admit(self, nbytes: int, cap: int) -> contextlib.AbstractContextManager[Any]:
        """Before issuing ``nbytes``: wait for the oldest runtime collectives until they fit ``cap``.
        Returns the context to issue it in: the ``overlap::held_for_budget`` region if it had to
        wait (the profiler names the link's idle time before it so, see [Note: link idle while
        compute ran] in ``overlap/profiler/records.py``)."""
        self._outstanding = [w for w in self._outstanding if w.pending]
        held = False
        while self._outstanding and sum(w.nbytes for w in self._outstanding) + nbytes > cap:
            self._outstanding.pop(0).synchronize()
            held = True
        self.max_inflight_seen = max(self.max_inflight_seen, sum(w.nbytes for w in self._outstanding) + nbytes)
        return region(BUDGET_LABEL) if held else contextlib.nullcontext()

    def _track(self, work: Optional[InflightWork]) -> None:
        if work is None:
            return
        if self.owner.serialize_comm:
            work.synchronize()  # overlap off: the collective completes before anything else runs
        else:
            self._outstanding.append(work)

    def _gather(self, state: ShardState) -> None:
        group = state.group
        if group is None or group.is_unsharded or group.pending_gather is not None or group.single_rank:
            return
        held = contextlib.nullcontext()
        if state.max_inflight_bytes is not None:
            held = self._admit(group.all_gather_bytes(), state.max_inflight_bytes)
        with held:
            group.issue_gather()
        assert group.pending_gather is not None
        for work in group.pending_gather.works:
            self._track(work)

    def prefetch_next_step(self) -> bool:
        """Issue the all-gathers the next forward needs first (see [Note: prefetching across the step
        boundary]); False when there is nothing to go by yet (no step has run) or it is not between
        steps."""
        order = self.agreed_order
        if order is None or self.in_forward or self.in_backward or self.owner.serialize_comm:
            return False
        for state in self._first_groups(order):
            self._gather(state)
        return True

    def _first_groups(self, order: list[int]) -> list[ShardState]:
        """The states whose groups forward on ``order`` waits for first: the first group with
        parameters and the ``prefetch`` after it, in forward order."""
        first: list[ShardState] = []
        wanted = 1 + self.owner.prefetch  # the first group forward waits for, and what it prefetches
        for index in dict.fromkeys(order):
            if len(first) == wanted:
                break
            if self.states[index].group is not None:
                first.append(self.states[index])
        return first

    def _prefetch_explicit(self, states: list[ShardState]) -> None:
        """Gather ``states`` now, in the given order (an FSDPModule prefetch list; program order,
        so the same on every rank)."""
        if self.owner.serialize_comm:
            return
        for other in states:
            self._gather(other)

    def _prefetch(self, state: ShardState, upcoming: list[int]) -> None:
        if self.owner.serialize_comm:
            return
        for index in upcoming[: state.prefetch]:
            if self.states[index] is not state:
                self._gather(self.states[index])

    # ------------------------------------------------------------------ forward
    def begin_forward(self) -> None:
        self.check_no_gradient_reduction("forward")
        now = time.perf_counter()
        if self._last_begin is not None:  # the step time the default wait timeout follows
            errors.observe_step(now - self._last_begin)
        self._last_begin = now
        for i, state in enumerate(self.states):  # re-claim states a sub-module run alone took over
            state.root, state.index = self, i
        if self.awaiting_finalization:
            self.finish_awaiting()
        if self.in_backward:
            self._finish_step()  # the last backward was cut short
        # A forward since the last backward (grad enabled) continues the step: see [Note: forwards
        # before one backward].
        continuing = self._forward_awaiting_backward
        if self._choice_pending:  # the recording step's backward did not end: choose from its forward
            self._choose_depth(measured_backward=False)
        if self._trial is not None:
            self._run_trial()
        self.in_forward = True
        self.boundary = None
        for state in self.states:
            if not continuing:
                state.reset_backward_tracking()
            state.members_to_run = set()  # a member that did not run last pass does not hold this one
        self.forward_seq = []
        self.post_forward_seq = []
        self._on_script = True
        self._kept_count = 0
        self._off_script_kept = []
        self.recording_costs = self.auto_prefetch and self.chosen_depth is None
        self._costs, self._running = [], []
        self._between = [-1.0, -1.0]

    def on_pre_forward(self, state: ShardState) -> None:
        position = len(self.forward_seq)
        self.forward_seq.append(state.index)
        if self.recording_costs:
            self._on_script = False
            self._record_pre_forward(state, position)
            return
        order = self.agreed_order
        # Prefetch only while this step follows the agreed order (see [Note: same collectives, ...]).
        self._on_script = self._on_script and order is not None and position < len(order) and order[position] == state.index
        self.make_room_off_script(state)
        if state.group is not None:
            # gathered (or kept unsharded) before its shards changed: gather again, in order
            if (self.communicates and state.group.stale_gather()) or state.group.stale_unsharded():
                state.group.reshard()
            if self.communicates:
                self._gather(state)  # no-op when prefetched
        if state.forward_prefetch is not None:  # set_modules_to_forward_prefetch: the user's list
            self._prefetch_explicit(state.forward_prefetch)
        elif self._on_script and self.communicates:
            assert order is not None
            self._prefetch(state, order[position + 1 : position + 1 + state.prefetch])
        if state.group is not None:
            self.gather_now(state)

    # ------------------------------------------------------------------ prefetch="auto"
    def _record_pre_forward(self, state: ShardState, position: int) -> None:
        """The pre-forward of the step that records costs (nothing is prefetched: the order is not
        agreed yet): gather and wait at once, timing it, and start timing this position's compute."""
        now = time.perf_counter()
        if self._running:
            self._costs[self._running[-1]][0] += now - self._mark
        self._costs.append([0.0, 0.0, 0.0, -1.0])
        self._running.append(position)
        if state.group is not None:
            if state.group.stale_gather() or state.group.stale_unsharded():
                state.group.reshard()
            self._gather(state)  # packing and issue: the host's
            issued = time.perf_counter()
            pending = state.group.pending_gather
            for work in pending.works if pending is not None else ():
                work.synchronize()  # the link's (latency and transfer)
            landed = time.perf_counter()
            self.gather_now(state)  # the copy-out: the host's
            packing = (issued - now) + (time.perf_counter() - landed)
            self._costs[position][1:3] = [packing + (landed - issued), packing]
        self._mark = time.perf_counter()

    def record_post_forward(self) -> None:
        """A post-forward in the step that records costs: the running position's compute ends."""
        now = time.perf_counter()
        if self._running:
            self._costs[self._running.pop()][0] += now - self._mark
        self._mark = now

    def _record_backward_edge(self, state: Optional[ShardState]) -> bool:
        """In the recording step's backward: the running position's backward ends here (at the next
        pre-backward, or the end of backward with ``state`` None) and ``state``'s starts; False
        where ``state`` is the root and a position runs: the root's pre-backward fires with its last
        module's (they share the output), so that module's backward goes on running."""
        if state is self.owner and self._backward_position is not None:
            root = self._position_of.get(state.index)
            if root is not None:  # measured: what runs outside its modules goes to theirs
                self._costs[root][3] = max(self._costs[root][3], 0.0)
            return False
        now = time.perf_counter()
        if self._between[0] < 0 and state is not None:  # the first backward hook: the loss ran since forward
            self._between[0] = now - self._forward_end
        if self._backward_position is not None:
            cost = self._costs[self._backward_position]
            cost[3] = max(cost[3], 0.0) + (now - self._mark)
        self._backward_position = None if state is None else self._position_of.get(state.index)
        return True

    def _agree_costs(self) -> None:
        """Replace this rank's recorded costs by their per-entry low median over the ranks (the
        smaller of two): every rank then chooses from the same numbers, and a rank whose recorded steps
        were slowed by something else on its host (a load spike, a descheduled process) does not
        move the choice; noise only ever adds time. See [Note: what the step's costs are made of]."""
        for info in (self.owner.info, self.owner.replicate):
            if info is None or info.size == 1:
                continue
            per_rank = agreement.exchange(info, "step costs", [*self._costs, self._between])
            self._costs = [_low_median_per_entry([r[p] for r in per_rank]) for p in range(len(self._costs))]
            self._between = _low_median_per_entry([r[-1] for r in per_rank])

    def _step_costs(self, measured_backward: bool, groups: list[Optional[ParamGroup]],
                    ) -> tuple[list[float], list[float], Optional[list[float]], list[float]]:
        """``(compute, link, backward, reduce)`` per forward position (``groups``: each one's group) for
        the choosers: the packing counts as compute ([Note: what the step's costs are made of]);
        backward None where a position's backward was not measured (then the model takes twice
        forward); ``reduce`` each reduce-scatter's seconds on the link ([Note: a reduce-scatter's
        seconds])."""
        compute = [c + pack for c, _, pack, _ in self._costs]
        link = [max(0.0, gather - pack) for _, gather, pack, _ in self._costs]
        backward = [b for *_, b in self._costs]
        reduce = [_reduce_seconds(g, seconds) for g, seconds in zip(groups, link)]
        return compute, link, (backward if measured_backward and all(b >= 0 for b in backward) else None), reduce

    def _choose_depth(self, measured_backward: bool) -> None:
        """Keep this recorded step's costs as a sample; after ``COST_SAMPLES`` recorded steps, choose the
        prefetch depth from the samples on the last one's order (an order that changes from step to
        step leaves fewer samples, never more recorded steps) and agree it across ranks (see [Note:
        prefetch="auto"], [Note: robust step costs] in ``scheduler/cost_samples.py``)."""
        from scheduler.cost_samples import COST_SAMPLES, least_disturbed
        from scheduler.gather_ahead import modelled_steady_step
        from scheduler.prefetch_depth import choose_prefetch_depth, modelled_step

        self.recording_costs = self._choice_pending = False
        self._backward_position = None
        if not measured_backward:
            for cost in self._costs:
                cost[3] = -1.0
        if self._samples_order != self.forward_seq:  # another order (agreed): its positions are other groups
            self._cost_samples, self._samples_order, self._between_samples = [], list(self.forward_seq), []
        self._cost_samples.append(self._costs)
        self._between_samples.append(self._between)
        self._recorded_steps += 1
        if self._recorded_steps < COST_SAMPLES:
            return  # the next step records again (at most COST_SAMPLES steps, on whatever orders they ran)
        self._costs, self._cost_samples = least_disturbed(self._cost_samples), []
        self._between = [max(0.0, x) for x in least_disturbed([[row] for row in self._between_samples])[0]]
        self._between_samples = []
        measured_backward = all(cost[3] >= 0 for cost in self._costs)
        groups = [self.states[i].group for i in self.forward_seq]
        budget = self.owner.max_inflight_bytes
        if budget is None:
            device = next((g.sharded[0]._local_tensor.device for g in groups if g is not None), torch.device("cpu"))
            budget = default_prefetch_budget(device)
        self._agree_costs()
        compute, link, backward, reduce = self._step_costs(measured_backward, groups)
        loss, tail = self._between
        enclosing = self._enclosing()
        nbytes = [g.all_gather_bytes() if g is not None else 0 for g in groups]
        regathers = self._backward_gathers()
        depth = choose_prefetch_depth(compute, link, nbytes, budget, backward=backward, loss=loss, tail=tail,
                                      enclosing=enclosing, reduce=reduce, backward_gathers=regathers)
        for info in (self.owner.info, self.owner.replicate):  # every rank must prefetch alike
            if info is not None and info.size > 1:
                depth = max(agreement.exchange(info, "prefetch depth", depth))
        depth = self._choose_gather_ahead(depth, budget, groups, nbytes, compute, link, backward, enclosing, reduce,
                                          regathers)
        self.chosen_depth = depth
        for state in self.states:
            if state.auto_prefetch:
                state.prefetch = depth
        if measured_backward and self.gather_ahead is not None:  # the steps ran in backward: their seconds are in
            seconds = self._agreed_step_seconds(groups)
            self._choose_deferred_steps(groups, compute, link, backward, seconds, reduce)
            self.step_floor = step_floor(compute, link, backward, loss, tail, seconds, reduce=reduce)
        count, lag = self.gather_ahead or (0, 1)
        self.modelled_step = modelled_steady_step(compute, link, depth, count, lag, backward=backward, loss=loss,
                                                  tail=tail, reduce=reduce, backward_gathers=regathers)
        self._start_trial(modelled_step(compute, link, 1, backward, loss, tail, reduce=reduce, backward_gathers=regathers))

    def _backward_gathers(self) -> Optional[list[bool]]:
        """Per forward position, whether backward gathers its group again (False:
        ``set_unshard_in_backward(False)``) for the choosers' model; None where every one does."""
        flags = [self.states[i].unshard_in_backward for i in self.forward_seq]
        return None if all(flags) else flags

    def _enclosing(self) -> Optional[list[frozenset[int]]]:
        """Per position of this step's forward order, the positions whose forward ran around it (a
        block sharded with a sub-module as a group of its own), for the choosers' byte model
        ([Note: the bytes a plan holds]); None where a group ran twice or missed its post-forward
        (the model then takes the groups as one after the other)."""
        from scheduler.held_bytes import enclosing_positions

        try:
            return enclosing_positions(self.forward_seq, self.post_forward_seq, self.owner.index)
        except ValueError:
            return None

    def _start_trial(self, simple_s: float) -> None:
        """After the choice: run the trial of it against the simple plan from the next forward, or
        decide at once where the model chose the simple plan or the trial is off ([Note: verifying the
        choice by a trial] in ``scheduler/schedule_trial.py``)."""
        assert self.chosen_depth is not None and self.modelled_step is not None
        chosen: Plan = (self.chosen_depth, self.gather_ahead)
        self._modelled = (chosen, self.modelled_step, simple_s)
        rounds = schedule_trial.TRIAL_ROUNDS if self.owner.schedule_trial_enabled else 0
        ahead_runs = self.gather_ahead is not None and self.owner.gather_ahead_enabled  # set_gather_ahead(False)
        if (self.chosen_depth, self.gather_ahead if ahead_runs else None) == SIMPLE_PLAN:
            self._decide(chosen, None, "the model's choice runs as the simple plan"
                         + ("" if chosen == SIMPLE_PLAN else " (gather-ahead is off)"))
            return
        if rounds == 0:
            self._decide(chosen, None, "the model's choice, not verified (the trial is off)")
            return
        settle = 1 if ahead_runs else 0  # gathers cross the step boundary: see the Note
        self._trial = ScheduleTrial((self.owner.info, self.owner.replicate), rounds, settle, self.backward_count,
                                    self.synced_backward_count, mid_cycle=not self._last_backward_synced)

    def _run_trial(self) -> None:
        """A forward starts during the trial: run the plan of this trial step, or apply the verdict."""
        assert self._trial is not None
        plan = self._trial.at_forward_start(self.backward_count, self.synced_backward_count)
        chosen = self._modelled[0]
        if plan is not None:
            self._apply_plan(chosen if plan == schedule_trial.CHOSEN else SIMPLE_PLAN)
            return
        verdict = self._trial.verdict
        assert verdict is not None
        self._trial = None
        measured = (f"{1e3 * verdict.chosen_s:.1f} ms per step vs {1e3 * verdict.simple_s:.1f} ms on the simple plan "
                    f"({schedule_trial.describe(SIMPLE_PLAN)}; the least of {verdict.samples} timed steps each, "
                    "slowest rank)")
        if verdict.keep:
            self._decide(chosen, verdict, f"the model's choice, kept by the trial: {measured}")
        else:
            self._decide(SIMPLE_PLAN, verdict, f"the simple plan, since the model's choice "
                         f"({schedule_trial.describe(chosen)}) did not win the trial by "
                         f"{100 * schedule_trial.WIN_MARGIN:g}%: {measured}")

    def _apply_plan(self, plan: Plan) -> None:
        """Run ``plan`` from this step on: the auto groups' depth and the gather-ahead plan."""
        for state in self.states:
            if state.auto_prefetch:
                state.prefetch = plan[0]
        self.gather_ahead = plan[1]

    def _decide(self, plan: Plan, verdict: Optional[Verdict], reason: str) -> None:
        chosen, chosen_s, simple_s = self._modelled
        self._apply_plan(plan)
        self.chosen_depth = plan[0]
        self.modelled_step = chosen_s if plan == chosen else simple_s
        self.schedule_decision = ScheduleDecision(plan, chosen, chosen_s, simple_s, verdict, reason)

    def _choose_gather_ahead(self, depth: int, budget: int, groups: list[Optional[ParamGroup]], nbytes: list[int],
                             compute: list[float], link: list[float], backward: Optional[list[float]],
                             enclosing: Optional[list[frozenset[int]]], reduce: list[float],
                             backward_gathers: Optional[list[bool]] = None) -> int:
        """Plan the gathers issued ahead in backward from this step's costs (``groups`` and ``nbytes``:
        each forward position's group and its gather's bytes; ``enclosing``: the nesting :meth:`_enclosing`
        read), if every group with parameters is stepped in backward; agree rank
        0's plan (see [Note: gathering ahead in backward]). Returns the depth to run: ``depth``, or a
        deeper one where that and its plan model a shorter step (``scheduler.gather_ahead.choose_schedule``,
        [Note: a deeper depth for gathering ahead]), agreed with the plan."""
        from scheduler.gather_ahead import choose_schedule

        order = self.forward_seq
        if (len(set(order)) != len(order) or self.owner.replicate is not None
                or not all(g is None or g.reduced_hooks for g in groups) or not any(groups)):
            return depth  # a group used twice, HSDP, or no optimizer in backward: nothing is final early
        depth, plan = choose_schedule(compute, link, nbytes, depth, budget, backward=backward, loss=self._between[0],
                                      tail=self._between[1], enclosing=enclosing, reduce=reduce,
                                      backward_gathers=backward_gathers)
        if self.owner.info.size > 1:
            depth, count, lag = agreement.exchange(self.owner.info, "gather ahead", [depth, *plan])[0]
            plan = (count, lag)
        self.gather_ahead = plan  # type: ignore[assignment]
        return depth

    def _agreed_step_seconds(self, groups: list[Optional[ParamGroup]]) -> list[float]:
        """Per forward position (``groups``: each one's group), the seconds its group's in-backward
        optimizer step took in the last recorded step (``ParamGroup.reduced_hooks_seconds``), agreed:
        the low median over ranks."""
        seconds = [g.reduced_hooks_seconds if g is not None else 0.0 for g in groups]
        if self.owner.info.size > 1:
            seconds = _low_median_per_entry(agreement.exchange(self.owner.info, "step seconds", seconds))
        return seconds

    def _choose_deferred_steps(self, groups: list[Optional[ParamGroup]], compute: list[float], link: list[float],
                               backward: Optional[list[float]], seconds: list[float], reduce: list[float]) -> None:
        """Pick the groups whose in-backward step moves into the end-of-step chain, from this step's
        costs and each group's step ``seconds`` (:meth:`_agreed_step_seconds`); only with a
        gather-ahead plan (every group stepped in backward). See [Note: deferred optimizer steps]."""
        from scheduler.deferred_steps import choose_deferred_steps

        order = self.forward_seq
        chain = {s.index for s in self._first_groups(order)}
        first = 1 + max(p for p, i in enumerate(order) if i in chain) if chain else 0
        ahead = set(range(len(order) - self.gather_ahead[0], len(order)))
        candidates = [p for p in range(len(order) - 1, first - 1, -1)
                      if p not in ahead and groups[p] is not None and order[p] != self.owner.index]
        chosen = choose_deferred_steps(compute, link, seconds, first, candidates, backward, reduce=reduce)
        self.deferred_steps = frozenset(order[p] for p in chosen)

    def gather_now(self, state: ShardState) -> None:
        """Gather ``state``'s group now (waiting for a prefetch in flight) and register it unsharded."""
        assert state.group is not None
        self._gather(state)
        state.group.finish_gather()
        state.group.to_unsharded()

    def kept_for_backward(self, state: ShardState) -> bool:
        """Does ``state`` stay unsharded after its forward, running on script? Backward needs the
        last group of the agreed forward order first and the ``prefetch`` groups before it next, so
        resharding them would only gather them again (see [Note: kept for backward])."""
        order = self.agreed_order
        if not (torch.is_grad_enabled() and self._on_script and order is not None):
            return False
        position = len(self.forward_seq) - 1
        if position >= len(order) or self.forward_seq[position] != state.index or order[position] != state.index:
            return False  # a nested module's post-forward (its pre-forward was not the last), or off script
        if self._kept_for is None or self._kept_for[0] is not order or self._kept_for[1] != self.owner.prefetch:
            self._kept = _kept_for_backward(order, self.owner.prefetch, self.owner.index)
            self._kept_for = (order, self.owner.prefetch)
        kept = position in self._kept
        self._kept_count += kept
        return kept

    def _holds_off_script(self) -> bool:
        """Is this forward off the agreed order where groups are kept off script ([Note: kept off
        script]): grad enabled, the order agreed, not a step that records costs?"""
        return not (self._on_script or self.recording_costs or self.agreed_order is None
                    or not torch.is_grad_enabled())

    def _hold_at_most(self, count: int) -> None:
        """Reshard the oldest groups kept off script until at most ``count`` are."""
        held = self._off_script_kept
        while len(held) > max(count, 0):
            oldest = held.pop(0)
            assert oldest.group is not None
            oldest.group.reshard()

    def kept_off_script(self, state: ShardState) -> bool:
        """Off the agreed order (grad enabled, the order agreed, not a step that records costs): keep
        ``state`` unsharded among the last groups that ran. [Note: kept off script]

        On script, the groups kept for backward are known from the agreed order as their forward
        ends. A step that leaves that order (a skipped block, another branch, layer drop) cannot know
        which groups will be its last, and kept none from there on: backward then gathered every
        one of them again (on ``benchmarks/bench_recipes.py``'s alternating layer drop, 2 gathers a
        step more than on script, and more than FSDP2). So from there each group stays unsharded
        after its forward, the newest last, within the script's bound: ``1 + prefetch`` groups less
        those kept on script in this forward, counting the one whose forward runs, so a group's
        pre-forward reshards the oldest held one first (``make_room_off_script``) and its
        post-forward joins them. When forward ends, the held ones are the last groups that ran,
        which backward needs first. Program order only, like the script's choice; a reshard is
        local to the rank."""
        if not self._holds_off_script():
            return False
        held = self._off_script_kept
        if state in held:  # ran again: now the newest
            held.remove(state)
        room = 1 + self.owner.prefetch - self._kept_count
        if room < 1:  # the script's kept groups fill the bound: the caller reshards it
            return False
        held.append(state)
        self._hold_at_most(room)  # the oldest go first: never ``state``, the newest
        return True

    def make_room_off_script(self, state: ShardState) -> None:
        """Before ``state``'s forward, off script: hold at most ``prefetch`` (less the kept) other
        groups, so that with ``state`` unsharded the bound holds ([Note: kept off script])."""
        if self._holds_off_script() and state.group is not None and state not in self._off_script_kept:
            self._hold_at_most(self.owner.prefetch - self._kept_count)

    def end_forward(self) -> None:
        self.in_forward = False
        self.boundary = None
        if self.agreed_order != self.forward_seq:
            self.agreed_order = self._agree(self.forward_seq)
        if self.recording_costs:
            self._forward_end = time.perf_counter()
            if torch.is_grad_enabled() and len(set(self.forward_seq)) == len(self.forward_seq):
                # choose at the end of this backward, from its measured per-group times too
                self._choice_pending = True
                self._position_of = {index: position for position, index in enumerate(self.forward_seq)}
            else:
                self._choose_depth(measured_backward=False)
        for state in self.states:  # prefetched for a block that did not run this step
            if state.group is not None and state.group.pending_gather is not None:
                state.group.reshard()
        if not torch.is_grad_enabled():
            self._finish_step()  # no backward will follow
        else:
            self._forward_awaiting_backward = True

    def _agree(self, order: list[int]) -> list[int]:
        """Check that every rank ran the groups in the same order; raise ``DesyncError`` on every rank if
        not. An agreement of ``overlap.agreement`` (bounded, and in debug mode met by a rank that issues
        a collective instead: see [Note: agreements are collectives of the group]). With HSDP the shard
        group agrees first, then the replicas (which covers every rank of the mesh)."""
        fqns = [s.fqn or "root" for s in self.states]
        for info in (self.owner.info, self.owner.replicate):
            if info is None or info.size == 1:
                continue
            orders = agreement.exchange(info, "forward order", [fqns[i] for i in order], fqns[self.owner.index])
            if any(o != orders[0] for o in orders):
                described = "; ".join(f"rank {info.global_rank(r)}: {o}" for r, o in enumerate(orders))
                raise desync.DesyncError(
                    f"overlap.shard: ranks ran the sharded modules in different orders, so their collectives "
                    f"would not match ({described}). Every rank must run the same modules in the same order.",
                    -1, info.pg.group_name,
                )
        return list(order)

    # ------------------------------------------------------------------ backward
    def _reset_backward(self) -> None:
        self._done: set[int] = set()  # groups reduce-scattered (and resharded) in this backward
        self._ahead_active = False
        self._ahead_after: dict[int, int] = {}  # after this group's reduce-scatter, gather that one ahead
        self._ahead_at_end: list[int] = []  # planned ahead whose issue point does not come before the end
        self._reduce_event_of: dict[int, Any] = {}  # CUDA: each group's epilogue event
        self._backward_order: list[int] = []
        self._backward_cursor = 0
        self._reduce_order: list[int] = []
        self._reduce_next = 0
        self._ready: set[int] = set()
        self._pending_reduces: list[tuple[ShardState, PendingReduce]] = []  # epilogue not run yet
        self._reduce_events: list[Any] = []  # CUDA: epilogues queued on the reduce-scatter stream
        self._reduce_inputs: list[InflightWork] = []
        """The reduce-scatters issued under a cap on their input buffers (``_hold_reduce_inputs``)."""

    def on_pre_backward(self, state: ShardState) -> None:
        if not self.in_backward:
            self._begin_backward()
        timed = self._choice_pending and self._record_backward_edge(state)
        group = state.group
        if group is not None and state.index not in self._done and not self._left_sharded_in_backward(state):
            if not group.single_rank:  # (one rank: ``_gather`` issues nothing)
                self._gather(state)
            group.finish_gather(follow_requires_grad=False)
            # Registered for backward too: an activation-checkpoint recompute that runs ``forward``
            # without this module's hooks (HF's form, checkpoint_wrapper inside the shard) reads them.
            group.to_unsharded()
        if timed:
            self._mark = time.perf_counter()  # its backward starts once its parameters are in
        if self._pending_reduces:
            self._finish_completed_reduces()
        # Backward runs the forward order in reverse: prefetch the groups after this one.
        reverse = self._backward_order
        try:
            pos = reverse.index(state.index, self._backward_cursor)
        except ValueError:  # not in this step's forward order (e.g. run only inside a checkpoint)
            return
        self._backward_cursor = pos
        if state.backward_prefetch is not None:  # set_modules_to_backward_prefetch: the user's list
            self._prefetch_explicit([s for s in state.backward_prefetch
                                     if s.index not in self._done and s.unshard_in_backward])
            return
        if not (state.prefetch and self.communicates):  # nothing to prefetch
            return
        # The next `prefetch` distinct groups not yet reduced (a scan that stops there: this runs
        # once per block, so a copy of the rest of the order would make a step quadratic in blocks).
        upcoming: list[int] = []
        done, states = self._done, self.states
        for i in range(pos + 1, len(reverse)):
            index = reverse[i]
            if index not in done and index not in upcoming and states[index].unshard_in_backward:
                upcoming.append(index)
                if len(upcoming) == state.prefetch:
                    break
        self._prefetch(state, upcoming)

    @staticmethod
    def _left_sharded_in_backward(state: ShardState) -> bool:
        """``set_unshard_in_backward(False)``: the group is not gathered for its backward, unless it
        is unsharded or being gathered already (then it is used as it is), or at world size 1
        (nothing travels there)."""
        group = state.group
        return (not state.unshard_in_backward and group is not None and not group.is_unsharded
                and group.pending_gather is None and not group.single_rank)

    def _begin_backward(self) -> None:
        self.check_no_gradient_reduction("backward")
        if self.awaiting_finalization:  # a second backward of the same forward (retain_graph)
            self.finish_awaiting()
        self._finalization_mode = self.owner.manual_backward_finalization
        self.in_backward = True
        self.backward_count += 1
        self._last_backward_synced = any(s.sync_grads for s in self.states)
        if self._last_backward_synced:
            self.synced_backward_count += 1
        if ACCUMULATION_CASTS_FIRST and not all(s.sync_grads for s in self.states):
            for state in self.states:
                if not state.sync_grads and state.group is not None:
                    state.group.prepare_accumulation()
        self._reset_backward()
        # A module's parameters are first needed in backward where its last forward use ended, and
        # its gradients are complete where its first forward use began.
        self._backward_order = self.post_forward_seq[::-1]
        first_use: dict[int, int] = {}
        for pos, index in enumerate(self.forward_seq):
            first_use.setdefault(index, pos)
        self._reduce_order = sorted(first_use, key=lambda i: -first_use[i])
        self._plan_ahead()
        self._plan_deferred()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _plan_ahead(self) -> None:
        """This backward's gathers ahead: after the reduce-scatter of ``_reduce_order[r + lag]``, gather
        ``_reduce_order[r]`` for the first ``count`` groups; only on a step that ran the agreed order,
        synchronized, with overlap on (see [Note: gathering ahead in backward])."""
        self._ahead_after = {}
        self._ahead_active = (self.gather_ahead is not None and self.agreed_order == self.forward_seq
                              and not self.owner.serialize_comm and self.owner.gather_ahead_enabled
                              and all(s.sync_grads and (s.group is None or s.group.reduced_hooks) for s in self.states))
        if not self._ahead_active:
            return
        assert self.gather_ahead is not None
        count, lag = self.gather_ahead
        order = self._reduce_order
        for r in range(min(count, len(order))):
            if r + lag < len(order):
                self._ahead_after[order[r + lag]] = order[r]
        self._ahead_at_end = [i for i in order[:count] if i not in self._ahead_after.values()]

    def _plan_deferred(self) -> None:
        """This backward's deferred steps: on a backward that runs the gather-ahead plan, with every
        epilogue on the host and early (see [Note: deferred optimizer steps])."""
        self._deferring = []
        if not (self._ahead_active and self.deferred_steps and self.owner.deferred_steps_enabled) or not all(
                s.group is None or (s.group.finishes_early and s.group.sharded[0].device.type != "cuda")
                for s in self.states):
            return
        self._deferring = [self.states[i] for i in self._reduce_order if i in self.deferred_steps]
        for state in self._deferring:
            state.group.defer_reduced_hooks = True  # type: ignore[union-attr]

    def on_module_backward_done(self, state: ShardState) -> None:
        """Backward has passed one forward call of ``state``'s module; after the last one its group is
        complete, whichever of its parameters got gradients on this rank."""
        if (self.in_backward and not state.untracked and state.backward_passes >= state.forward_calls
                and state.index not in self._done):
            self._ready.add(state.index)
            self._flush_reduces(final=False)

    def on_grad_ready(self, state: ShardState) -> None:
        """A gradient of ``state``'s group was accumulated; reduce the group once all of them are."""
        group = state.group
        if not self.in_backward or group is None:
            return  # e.g. a backward through a module outside this root's step
        if group.grads_complete():
            self._ready.add(state.index)
            self._flush_reduces(final=False)
        elif self._pending_reduces:
            # A poll point inside a block's backward: an HSDP all-reduce goes out as soon as its
            # reduce-scatter landed, not one block later (see [Note: hybrid sharding]).
            self._finish_completed_reduces()

    def _flush_reduces(self, final: bool) -> None:
        while self._reduce_next < len(self._reduce_order):
            index = self._reduce_order[self._reduce_next]
            if not final and index not in self._ready:
                break
            self._reduce_next += 1
            self._reduce(self.states[index])

    def _reduce(self, state: ShardState) -> None:
        group = state.group
        self._done.add(state.index)
        if group is None:
            return
        state.accumulating = not state.sync_grads
        if not state.sync_grads:
            group.upcast_accumulated_grads()  # [Note: accumulating in the reduce dtype]
        else:
            if self.budgeted:
                self._issue_held_all_reduces()
            with region(state.regions.reduce_scatter):
                held = contextlib.nullcontext()
                indices = None  # read by issue_reduce, unless the cap needs them first: one read either way
                if state.max_inflight_bytes is not None:
                    indices = group.requires_grad_indices
                    held = self._admit(group.reduce_bytes(indices), state.max_inflight_bytes)
                cap = group.reduce_scatter_max_input_buffers
                if cap is not None:
                    self._hold_reduce_inputs(cap - 1)
                with held:
                    try:  # (no cost when nothing is raised)
                        pending = group.issue_reduce(indices)
                    except NonFiniteError:  # the step ends here: sharded parameters registered again, as between steps
                        self._finish_step()
                        raise
                if pending is not None:
                    self._track(pending.work)
                    if cap is not None and pending.work is not None:
                        self._reduce_inputs.append(pending.work)
                    if pending.needs_all_reduce and (pending.work is None or pending.rs_output.is_cuda
                                                     or group.quantized_replica_sum is not None
                                                     or desync.debug_enabled()):
                        # see [Note: hybrid sharding]; a compressed replica sum waits on the host, so it
                        # is issued here, at the same point on every rank ([Note: compressing the
                        # inter-node tier]), never when a poll finds the reduce-scatter done
                        self._all_reduce(state, pending)
                    event = group.finish_reduce_on_stream(pending) if group.finishes_early else None
                    if event is not None:
                        self._reduce_events.append(event)
                        self._reduce_event_of[state.index] = event
                    else:
                        self._pending_reduces.append((state, pending))
        self._finish_completed_reduces()
        group.grads_ready.clear()
        if state.reshard_after_backward:  # else the unsharded parameters stay registered, as in FSDP2
            group.reshard()
            group.to_sharded()
        ahead = self._ahead_after.get(state.index)
        if ahead is not None:
            self._gather_ahead(self.states[ahead])

    def _hold_reduce_inputs(self, room: int) -> None:
        """FSDP2's ``set_reduce_scatter_max_input_buffers``: before a reduction, wait for the oldest
        reduce-scatters still holding their input buffers until at most ``room`` do, releasing them
        (on CUDA the current stream waits, so the next copy-in is ordered after the collective and
        reuses its memory; elsewhere the host waits). The point is fixed in the program (every rank
        issues the same reductions in the same order), so the wait cannot go around the ranks."""
        held = [w for w in self._reduce_inputs if w.pending]
        while len(held) > room:
            held.pop(0).wait()
        self._reduce_inputs = held

    def _gather_ahead(self, state: ShardState) -> None:
        """Issue ``state``'s next-step all-gather now, in backward, after its step: run the epilogues
        (and so the optimizer steps) up to its own first, waiting for their reduce-scatters. A group
        whose epilogue waits for the end of backward is left to it (see [Note: gathering ahead in
        backward])."""
        group = state.group
        if group is None or not group.reduced_hooks:
            return
        if any(s is state for s, _ in self._pending_reduces) and not self._run_early_epilogues(through=state):
            self._ahead_at_end.append(state.index)
            return
        event = self._reduce_event_of.get(state.index)
        if event is not None:  # CUDA: the copy-in must read the shards after the step on the reduce stream
            comm_stream(group.sharded[0].device, "all_gather_copy_in").wait_event(event)
        with region("overlap::gather_ahead"):
            self._gather(state)
        self._ahead.add(state.index)

    def _all_reduce(self, state: ShardState, pending: PendingReduce) -> None:
        """HSDP: issue the cross-replica all-reduce of a reduce-scatter's output."""
        assert state.group is not None
        if state.max_inflight_bytes is not None:
            self._admit(pending.rs_output.numel() * pending.rs_output.element_size(), state.max_inflight_bytes)
        with region("overlap::all_reduce_replicas"):
            self._track(state.group.issue_all_reduce(pending))

    def _finish_completed_reduces(self) -> None:
        """CPU: at this runtime hook, issue the cross-replica all-reduces (HSDP) of the reduce-scatters
        that have completed, then run the epilogues of the reductions that have completed, each
        oldest first, instead of at the end of backward (see [Note: the reduce-scatter epilogue runs
        where the collective ran]). Each pass stops at the first one still in flight, so all-reduces
        and epilogues run in issue order; a group whose epilogue communicates waits for the end of
        backward."""
        if not self._pending_reduces:
            return
        if not self.budgeted:  # budgeted: issued at the next reduction instead (_issue_held_all_reduces)
            for state, pending in self._pending_reduces:
                if not pending.needs_all_reduce:
                    continue
                if pending.work is not None and not pending.work.is_done():
                    break
                self._all_reduce(state, pending)
        self._run_early_epilogues()

    def _issue_held_all_reduces(self) -> None:
        """Issue the cross-replica all-reduces (HSDP) still held back, oldest first, each after its
        reduce-scatter, at this point of the program on every rank: at the end of backward, and
        before each reduction when some group has ``max_inflight_bytes`` (``budgeted``: never at
        whichever poll first finds one ready, so the budget's waits cannot go around the mesh, see
        [Note: hybrid sharding])."""
        for state, pending in self._pending_reduces:
            if pending.needs_all_reduce:
                self._all_reduce(state, pending)

    def _run_early_epilogues(self, through: Optional[ShardState] = None) -> bool:
        """Run the epilogues of the pending reductions, oldest first, while each one's group may
        finish early and needs no cross-replica all-reduce first. Without ``through``: only those
        whose collective has completed (stopping at the first still in flight). With ``through``
        (one of the pending): waiting for each, up to and including ``through``'s; False if an
        epilogue before or at it has to wait for the end of backward."""
        done, finished = 0, through is None
        for state, pending in self._pending_reduces:
            group = state.group
            assert group is not None
            if not group.finishes_early or pending.needs_all_reduce:
                break
            if through is None and pending.work is not None and not pending.work.is_done():
                break
            with region(group.regions.reduce_scatter_epilogue), torch.no_grad():
                group.finish_reduce(pending)
            done += 1
            if state is through:
                finished = True
                break
        del self._pending_reduces[:done]
        return finished

    def _end_backward(self) -> None:
        """Autograd's final callback of a backward: issue the reductions left, in order, then finish
        the backward (``_finish_backward``), or with manual finalization leave the reductions in
        flight for ``finalize_backward`` ([Note: manual backward finalization])."""
        tail_start = 0.0
        if self._choice_pending:
            self._record_backward_edge(None)
            tail_start = time.perf_counter()
        if self._finalization_mode:
            with region(self.owner.regions.end_backward), torch.no_grad():
                self._flush_reduces(final=True)
                self._issue_held_all_reduces()
            self.in_backward = self._forward_awaiting_backward = False
            self.awaiting_finalization = True
            optimizer_check.require_before_step(id(self), self._finish_before_step)
            return
        self._finish_backward(tail_start)

    def _finish_backward(self, tail_start: float) -> None:
        """The end of a backward: wait for every reduction, run the epilogues left (the sharded
        ``.grad``s are set), reshard, and on the recording step choose the schedule; ``tail_start``:
        where the host's tail began (read on the recording step only)."""
        waited = 0.0
        with region(self.owner.regions.end_backward), torch.no_grad():
            self._flush_reduces(final=True)
            self._issue_held_all_reduces()
            if self._choice_pending:  # the link first: what the end of backward does after it is the host's tail
                waited = time.perf_counter()
                for _, pending in self._pending_reduces:
                    if pending.work is not None:
                        pending.work.synchronize()
                waited = time.perf_counter() - waited
            deferring = self._deferring
            try:
                for state in deferring:  # from here their epilogues step them at once
                    state.group.defer_reduced_hooks = False  # type: ignore[union-attr]
                for state, pending in self._pending_reduces:
                    assert state.group is not None
                    if deferring and pending.work is not None:
                        self._step_deferred_while_in_flight(pending.work)
                    state.group.finish_reduce(pending)
            except NonFiniteError:  # as in _reduce
                self._finish_step()
                raise
            if self._reduce_events:
                current = torch.cuda.current_stream()
                for event in self._reduce_events:  # the gradients were written on the reduce-scatter stream
                    current.wait_event(event)
            active, at_end = self._ahead_active, self._ahead_at_end
            self._deferring = []  # kept in `deferring`: their steps run below
            self._finish_step()
            if self._choice_pending:  # the recording step: every cost is in now
                self._between[1] = time.perf_counter() - tail_start - waited
                self._choose_depth(measured_backward=True)
                self._plan_ahead()  # the plan this backward would have run: its gathers all go now
                active = self._ahead_active
                at_end = self._reduce_order[: self.gather_ahead[0]] if active and self.gather_ahead else []
            if active:  # every group is stepped now: the next forward's first gathers (see [Note: gathering ahead ...])
                with region("overlap::gather_ahead"):
                    self.prefetch_next_step()
                    for index in at_end:
                        self._gather(self.states[index])
            for state in deferring:  # what is left, under those gathers (see [Note: deferred optimizer steps])
                self._step_deferred(state)

    def _step_deferred_while_in_flight(self, work: InflightWork) -> None:
        """Run deferred steps (each whose epilogue has run) while ``work`` has not completed."""
        for state in self._deferring:
            if work.is_done():
                return
            self._step_deferred(state)

    def _step_deferred(self, state: ShardState) -> None:
        group = state.group
        assert group is not None
        if group.deferred_reduced is not None:
            with region("overlap::deferred_step"):
                group.run_deferred_reduced_hooks()

    # ------------------------------------------------------------------ manual finalization
    def check_finalization_mode(self, enabled: bool) -> None:
        """``set_manual_backward_finalization(enabled)`` on the root: refused where it would change
        the mode of a backward running or awaiting finalization."""
        if enabled != self.owner.manual_backward_finalization and (self.in_backward or _autograd_running()):
            raise RuntimeError("set_manual_backward_finalization cannot change the mode during backward")
        if self._finalization_mode is not None and enabled != self._finalization_mode:
            raise RuntimeError("set_manual_backward_finalization cannot change the mode after backward started, "
                               "until finalize_backward() (or reset_iter_state()) ends that backward")

    def check_no_gradient_reduction(self, what: str) -> None:
        if self.gradient_reduction is not None:
            raise RuntimeError(f"the handle finalize_backward(async_op=True) returned must be waited on (wait()) "
                               f"before {what}")

    def finalize_backward(self, async_op: bool) -> Optional[GradientReductionHandle]:
        """``finalize_backward`` on the root ([Note: manual backward finalization]): reduce what
        ``no_sync`` backwards accumulated where gradient sync is on now, then finish the backward
        (or, ``async_op``, return the handle whose ``wait()`` finishes it)."""
        self.check_no_gradient_reduction("finalize_backward() again")
        mode = self._finalization_mode
        if not (self.owner.manual_backward_finalization if mode is None else mode):
            raise RuntimeError("finalize_backward requires manual backward finalization: call "
                               "set_manual_backward_finalization(True) on the root before the backward")
        if self.in_backward or _autograd_running():
            raise RuntimeError("finalize_backward must be called after backward completes, not inside it")
        if self.in_forward or self._forward_awaiting_backward:
            raise RuntimeError("finalize_backward must not be called between a forward and its backward")
        tail_start = time.perf_counter() if self._choice_pending else 0.0
        with region(self.owner.regions.end_backward), torch.no_grad():
            reduced = self._reduce_accumulated()
        if not (self.awaiting_finalization or reduced):  # nothing to finish (e.g. a second call)
            return GradientReductionHandle(None, 0.0) if async_op else None
        self.awaiting_finalization = False
        if async_op:
            self.gradient_reduction = GradientReductionHandle(self, tail_start)
            optimizer_check.require_before_step(id(self), self._finish_before_step)  # a step before wait() raises
            return self.gradient_reduction
        self._resume_end_of_backward(tail_start)
        return None

    def _reduce_accumulated(self) -> bool:
        """Issue the reductions of the groups the last backward passed under ``no_sync`` whose
        gradient sync is on now (their accumulated unsharded gradients), in the last backward's
        reduction order, then any others in state order; each rank decides from its flags alone,
        which every rank sets alike. False if there was none."""
        order = self._reduce_order + [i for i in range(len(self.states)) if i not in self._reduce_order]
        due = [self.states[i] for i in order if self.states[i].accumulating and self.states[i].sync_grads]
        for state in due:
            self._reduce(state)
        if due:  # what a synced backward would have reduced (the schedule trial counts its steps so)
            self.synced_backward_count += 1
            self._last_backward_synced = True
        return bool(due)

    def finish_awaiting(self) -> None:
        """A backward awaiting ``finalize_backward`` finished without it (the next forward, backward
        or optimizer step came first): its reductions are waited and their gradients set, as the automatic
        end of backward does; nothing accumulated under ``no_sync`` is reduced."""
        self.awaiting_finalization = False
        self._resume_end_of_backward(time.perf_counter() if self._choice_pending else 0.0)

    def _finish_before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Before a step of ``optimizer`` over some of this root's parameters: a backward awaiting
        finalization is finished implicitly, as by the next forward; an async handle not waited
        for raises (its gradients are not there yet)."""
        groups = {state.group for state in self.states if state.group is not None}
        if not any(getattr(p, optimizer_check.MARK, None) in groups
                   for group in optimizer.param_groups for p in group["params"]):
            return
        self.check_no_gradient_reduction("the optimizer step")
        if self.awaiting_finalization:
            self.finish_awaiting()

    def wait_gradient_reduction(self, handle: GradientReductionHandle, tail_start: float) -> None:
        if self.gradient_reduction is not handle:
            raise RuntimeError("this gradient reduction handle was invalidated by reset_iter_state()")
        self.gradient_reduction = None
        self._resume_end_of_backward(tail_start)

    def _resume_end_of_backward(self, tail_start: float) -> None:
        self.in_backward = True  # so _finish_step keeps what the end of a backward keeps
        self._finish_backward(tail_start)

    def reset_iter_state(self) -> None:
        """``ShardedModule.reset_iter_state``: every group resharded and its unreduced gradient
        state discarded, the step forgotten."""
        self._ahead = set()  # resharded too: the next forward gathers what it needs
        self.in_forward = self.in_backward = False
        self._running = []
        self.gradient_reduction = None  # its handle's wait() raises from now on
        optimizer_check.release_before_step(id(self))
        self._finish_step()
        for state in self.states:
            state.accumulating = False
            if state.group is not None:
                state.group.discard_unreduced_gradients()

    def _finish_step(self) -> None:
        """Reshard everything, forget the step (also the clean-up of a step without backward)."""
        for state in self.states:
            if state.group is not None:
                state.group.grads_ready.clear()
                if state.index in self._ahead and self.in_backward:
                    continue  # its next-step gather is in flight (see [Note: gathering ahead in backward])
                if not (self.in_backward and not state.reshard_after_backward):
                    state.group.reshard_to_sharded()
        self._ahead = set()
        self._forward_awaiting_backward = False
        for state in self._deferring:  # a backward cut short: its deferred groups stay unstepped
            state.group.defer_reduced_hooks = False  # type: ignore[union-attr]
            state.group.deferred_reduced = None  # type: ignore[union-attr]
        self._deferring = []
        self._pending_reduces = []
        self._reduce_events = []
        self._reduce_inputs = []
        self.in_backward = False
        self.awaiting_finalization = False
        self._finalization_mode = None
        optimizer_check.release_before_step(id(self))
        self._outstanding = [w for w in self._outstanding if w.pending]


def _autograd_running() -> bool:
    """Is this thread inside an autograd backward (a hook or callback of one)?"""
    return torch._C._current_graph_task_id() != -1


class GradientReductionHandle:
    """What ``finalize_backward(async_op=True)`` returns: ``wait()`` waits for the reductions, sets
    the sharded gradients and finishes the backward, once (later calls do nothing). Until then the
    root refuses forward, backward, another ``finalize_backward`` and an optimizer step over its
    parameters; after ``reset_iter_state()`` ``wait()`` raises RuntimeError."""

    def __init__(self, root: Optional[_Root], tail_start: float) -> None:
        self._root = root
        self._tail_start = tail_start

    def wait(self) -> None:
        if self._root is not None:
            self._root.wait_gradient_reduction(self, self._tail_start)
            self._root = None


def _kept_for_backward(order: list[int], depth: int, owner: int) -> frozenset[int]:
    """The positions of ``order`` (the agreed forward order) whose group stays unsharded from its
    forward into backward (see [Note: kept for backward]): the last ``1 + depth`` positions that are
    their group's last forward call, the root's left out (it stays unsharded anyway)."""
    kept: set[int] = set()
    later: set[int] = set()
    for position in range(len(order) - 1, -1, -1):
        if len(kept) == 1 + depth:
            break
        index = order[position]
        if index != owner and index not in later:
            kept.add(position)
        later.add(index)
    return frozenset(kept)


def _reduce_seconds(group: Optional[ParamGroup], gather_seconds: float) -> float:
    """The link seconds of ``group``'s reduce-scatter, from its all-gather's measured ``gather_seconds``.

    [Note: a reduce-scatter's seconds]
    The choosers' model replays each group's reduce-scatter on the link. It first took one as long
    as the group's all-gather, which holds where both move the same bytes. They often do not: mixed
    precision with a float32 ``reduce_dtype`` over bfloat16 parameters (torchtitan's default)
    reduces twice the gather's bytes, and compression quantizes the two directions differently
    (int8 gather: 0.53x bfloat16's bytes; int8 reduce: 0.28x float32's), so the model misplaced the
    end-of-step chain and understated the floor. Both collectives are rings over the same ranks
    that put ``(w-1)/w`` of their buffer on each rank's wire, so a reduce-scatter is taken to cost
    the gather's measured seconds per byte times its own bytes (``reduce_bytes``, exact, the same on
    every rank: the agreed seconds give agreed results; the per-collective latency is scaled with the
    bytes too, a few tens of µs off where the ratio is not 1). It is not timed itself: a recorded step
    that waited for each reduce-scatter at issue, as it waits for each gather, would run the
    epilogues (and in-backward optimizer steps) inside backward instead of at its end, where the
    steps it models run them, and so mismeasure the end of backward's host work (``tail``).
    """
    if group is None:
        return 0.0
    gathered = group.all_gather_bytes()
    return gather_seconds * (group.reduce_bytes() / gathered) if gathered > 0 else 0.0


def _low_median_per_entry(per_rank: list[list[float]]) -> list[float]:
    """Per entry of equal-length lists (one per rank), the low median over the ranks: a value some
    rank measured, the smaller middle one of an even count (noise only ever adds time)."""
    return [statistics.median_low(entry) for entry in zip(*per_rank)]


ACCUMULATION_CASTS_FIRST = TORCH_VERSION >= (2, 15)
"""FSDP2 from torch 2.15 accumulates a ``no_sync`` micro-batch's gradients in ``reduce_dtype`` from
their first contribution on (``ParamGroup.prepare_accumulation``); before, it upcasts their sum."""

SIMPLE_PLAN: Plan = (1, None)
"""The simple schedule ``prefetch="auto"``'s choice must beat: depth 1, nothing gathered ahead (FSDP2's
default order)."""

PREFETCH_BUDGET_SHARE = 4
"""``prefetch="auto"`` without ``max_inflight_bytes``: prefetches may hold 1/this of the free memory."""


def default_prefetch_budget(device: torch.device) -> int:
    """The byte budget of ``prefetch="auto"`` when ``max_inflight_bytes`` is not given: a quarter of
    the memory free now, on the device (``torch.cuda.mem_get_info``) or, on CPU, of the host's
    ``MemAvailable`` (``/proc/meminfo``; 0 where that is unknown, which leaves depth 1)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0]) // PREFETCH_BUDGET_SHARE
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // PREFETCH_BUDGET_SHARE
    except OSError:
        pass
    return 0


def _refuse_meta(module: nn.Module, fqns: Sequence[str]) -> None:
    shown = ", ".join(repr(f) for f in fqns[:8]) + (f" and {len(fqns) - 8} more" if len(fqns) > 8 else "")
    raise RuntimeError(
        f"overlap.shard: {type(module).__name__}'s sharded parameters {shown} are on the meta device (no data), "
        f"so it cannot run forward. Materialize them first: module.to_empty(device=...) (every rank), then "
        f"initialize them (e.g. reset_parameters() on each submodule, or load a checkpoint)")


def _leaves(tree: Any) -> Sequence[Any]:
    """pytree's leaves of ``tree``, without pytree's traversal for the usual forms (a tensor, a
    tuple of tensors), whose leaves are themselves."""
    if isinstance(tree, torch.Tensor):
        return (tree,)
    if type(tree) is tuple and all(isinstance(x, torch.Tensor) for x in tree):
        return tree
    return tree_flatten(tree)[0]


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    if isinstance(tree, torch.Tensor):
        return cast(tree)
    if type(tree) is tuple and all(map(isinstance, tree, repeat(torch.Tensor))):  # the usual arguments
        # Every block's input but the first's is already in ``dtype``: one C-level pass, no bytecode
        # per argument; otherwise integer tensors among them may stay as they are.
        if all(map(eq, map(_DTYPE, tree), repeat(dtype))) or all(
                x.dtype == dtype or not x.is_floating_point() for x in tree):
            return tree
        return tuple(cast(x) for x in tree)
    return tree_map(cast, tree)


_DTYPE = attrgetter("dtype")


# ---------------------------------------------------------------------------------------- shard()
def _check_options(module: object, mp: object, reshard_after_forward: object, prefetch: object,
                   max_inflight_bytes: object, caller: str = "shard") -> None:
    """Raise naming ``caller`` (the public function the user called) and the argument, before anything changes."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{caller}: module must be a torch.nn.Module, got {type(module).__name__}")
    if isinstance(module, ShardedModule):
        raise ValueError(f"{caller}: {type(module).__name__} is already sharded (shard() was called on it before)")
    if mp is not None and not isinstance(mp, MixedPrecision):
        raise TypeError(f"{caller}: mp must be None or an overlap.MixedPrecision, got {type(mp).__name__}")
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"{caller}: reshard_after_forward must be a bool, got {reshard_after_forward!r}")
    if not (isinstance(prefetch, str) and prefetch == "auto"):
        if isinstance(prefetch, bool) or not isinstance(prefetch, int):
            raise TypeError(f"{caller}: prefetch must be an int >= 0 (groups gathered ahead) or 'auto', "
                            f"got {type(prefetch).__name__} {prefetch!r}")
        if prefetch < 0:
            raise ValueError(f"{caller}: prefetch must be an int >= 0 (groups gathered ahead) or 'auto', "
                             f"got {prefetch!r}")
    if max_inflight_bytes is not None and (isinstance(max_inflight_bytes, bool) or not isinstance(max_inflight_bytes, int)):
        raise TypeError(f"{caller}: max_inflight_bytes must be None or an int >= 1, got {type(max_inflight_bytes).__name__}")
    if max_inflight_bytes is not None and max_inflight_bytes < 1:
        raise ValueError(f"{caller}: max_inflight_bytes must be None or an int >= 1, got {max_inflight_bytes!r}")


def _owned_parameters(module: nn.Module, ignored: frozenset[int] = frozenset(), prefix: str = "",
                      ) -> tuple[list[nn.Parameter], list[list[ParamLocation]]]:
    """Parameters in ``module``'s subtree outside sharded descendants, each with every place it is
    registered (tied parameters have several); parameters whose id is in ``ignored`` are left out.
    Each fqn starts with ``prefix``."""
    params: list[nn.Parameter] = []
    locations: dict[int, list[ParamLocation]] = {}

    def visit(m: nn.Module, prefix: str) -> None:
        for name, p in m._parameters.items():
            if p is None or id(p) in ignored:
                continue
            fqn = prefix + name
            if getattr(p, "_overlap_sharded_by", None) is not None:
                raise ValueError(
                    f"shard: parameter {fqn!r} of {type(module).__name__} is shared with a submodule that was "
                    f"sharded on its own; shard a common ancestor that owns every use of it instead"
                )
            if id(p) not in locations:
                params.append(p)
                locations[id(p)] = []
            locations[id(p)].append(ParamLocation(m, name, fqn))
        for child_name, child in m._modules.items():
            if child is not None and not isinstance(child, ShardedModule):
                visit(child, f"{prefix}{child_name}.")

    visit(module, prefix)
    return params, [locations[id(p)] for p in params]


def shard(
    module: nn.Module,
    *,
    group: Any = None,
    mesh: Any = None,
    mp: Optional[MixedPrecision] = None,
    reshard_after_forward: bool = True,
    prefetch: Union[int, str] = "auto",
    max_inflight_bytes: Optional[int] = None,
    compress: Optional[Compression] = None,
) -> nn.Module:
    """Shard ``module``'s parameters over ``group`` or ``mesh`` (default WORLD), in place.

    ``mesh`` is a 1-D DeviceMesh (or ``(mesh, dim)``) to shard over, or a 2-D one for hybrid
    sharding (HSDP, FSDP2's convention): dim 0 replicates, dim 1 shards (see [Note: hybrid
    sharding] in ``overlap/param_group.py``). Parameters that tensor parallelism made DTensors
    (``overlap.tensor_parallel`` or torch's ``parallelize_module`` over another dim of the same
    DeviceMesh: ``mesh=mesh["dp"]`` here, ``mesh["tp"]`` there) are sharded as FSDP2 shards them
    (see [Note: sharding tensor-parallel parameters] there).

    ``prefetch``: ``"auto"`` (the default): the depth chosen from this model's measured costs and a
    byte budget, ``max_inflight_bytes`` or by default a quarter of the free memory, and kept only if
    it beats depth 1 in a timed trial on the first steps (below); or a fixed number of groups whose
    all-gathers are issued ahead of the one running, in forward and in backward (an int >= 0; 1 is
    FSDP2's schedule, and ``overlap.fully_shard``'s default).

    [Note: prefetch="auto"]
    The first step records the forward order with nothing prefetched, so it also measures, per
    position of that order, the group's gather (issued and waited at once: the host's packing and
    unpacking apart from the wait for the link), the compute between its hooks (nested modules' own
    positions taken out) and, in its backward, each group's backward ([Note: what the step's costs
    are made of] in ``scheduler/prefetch_depth.py``). The next steps record the same way, up to
    ``scheduler.cost_samples.COST_SAMPLES`` steps on one order, and each cost is the smallest of its
    samples ([Note: robust step costs] there). When the last of them ends (its backward; its forward
    if grad is off; the next forward if the backward never ended), the depth is chosen from those
    costs, the groups' gather bytes and the budget (``scheduler/prefetch_depth.py``, [Note: choosing
    the prefetch depth]); the ranks then take the largest of their choices (``overlap.agreement.exchange``),
    because the depth decides where gathers fall between reduce-scatters, and that sequence must
    be the same on every rank. The depth then holds for every step, on the recorded order: a step
    that leaves the order (a skipped block, another branch) prefetches nothing from there on, as
    with a fixed depth ([Note: same collectives, same order, on every rank]). The next steps then
    verify the choice: a timed trial runs it and the simple plan (depth 1, nothing gathered ahead)
    in turns, and the choice stays only if it wins (``scheduler/schedule_trial.py``, [Note:
    verifying the choice by a trial]; ``set_schedule_trial(False)`` skips it). ``prefetch_depth``
    on the module says what was chosen, ``schedule_decision`` what runs after the trial and why. The costs are host times: right on CPU; on CUDA the host
    does not wait for the device, so the gathers look cheap and the depth stays shallow.

    Returns ``module``, whose class becomes a subclass of :class:`ShardedModule`. Its parameters are
    replaced by DTensor parameters holding this rank's dim-0 shard; buffers stay replicated and are
    not touched. Call it on each block first, then on the root. Each call names the runtime regions
    (torch.profiler, ``overlap.profile``) of the sharded modules under ``module`` after their fqn
    relative to it: ``overlap::pre_forward (blocks.3)``; ``module``'s own regions carry no name.

    ``compress``: an ``overlap.Compression`` to send the all-gathers and/or the gradient reductions
    block-quantized (int8 or fp8 codes; ZeRO++'s qwZ / qgZ; tensor-parallel parameters' TP-local
    tensors too; shards, state dicts and checkpoints stay exact), see
    [Note: compressed collectives] in ``overlap/compression.py``; None (default): exact.
    """
    _check_options(module, mp, reshard_after_forward, prefetch, max_inflight_bytes)
    check_compression(compress, "shard")
    return _shard([module], group=group, mesh=mesh, mp=mp, reshard_after_forward=reshard_after_forward,
                  prefetch=prefetch, max_inflight_bytes=max_inflight_bytes, compress=compress)


def _shard(modules: list[nn.Module], *, group: Any, mesh: Any, mp: Optional[MixedPrecision],
           reshard_after_forward: bool, prefetch: Union[int, str], max_inflight_bytes: Optional[int],
           ignored_params: frozenset[int] = frozenset(), caller: str = "shard",
           compress: Optional[Compression] = None, own_dtype_params: frozenset[int] = frozenset(),
           spmd: Optional[SpmdMesh] = None, shard_dims: Optional[dict[int, int]] = None,
           post_forward_size: Optional[int] = None) -> nn.Module:
    """``shard``'s body, for one module or for the modules of one ``fully_shard([a, b])`` call
    (options checked by the caller): their parameters, outside ``ignored_params`` (ids), become one
    group, all-gathered when the first of them runs and resharded after the last (see
    ``ShardState.member_pre_forward``). ``own_dtype_params`` (ids): parameters computed in their own
    dtype instead of ``mp.param_dtype`` (FSDP2's ``param_dtype_override_fn``). ``spmd``: the parameters
    are DTensors on that full SPMD mesh and ``mesh`` is its ``dp_mesh`` ([Note: sharding on a full SPMD
    mesh] in ``overlap/spmd_mesh.py``). ``shard_dims``: by parameter id, the dim (> 0) it is sharded
    on instead of 0 ([Note: sharding on another dim] in ``overlap/dim_sharding.py``).
    ``post_forward_size``: FSDP2's ``reshard_after_forward=<int>`` ([Note: resharding to a smaller
    group after forward] in ``overlap/post_forward_shard.py``). Returns ``modules[0]``."""
    module = modules[0]
    if group is not None and mesh is not None:
        raise ValueError(f"{caller}: pass group or mesh, not both")
    params: list[nn.Parameter] = []
    locations: list[list[ParamLocation]] = []
    position: dict[int, int] = {}
    for i, member in enumerate(modules):
        member_params, member_locations = _owned_parameters(member, ignored_params,
                                                            f"{i}." if len(modules) > 1 else "")
        for p, locs in zip(member_params, member_locations):
            if id(p) in position:  # a parameter tied across members is one parameter of the group
                locations[position[id(p)]].extend(locs)
            else:
                position[id(p)] = len(params)
                params.append(p)
                locations.append(locs)
    devices = {p.device for p in params}
    if len(devices) > 1:
        where = {str(p.device): locs[0].fqn for p, locs in zip(params, locations)}
        raise ValueError(f"shard: {type(module).__name__} has parameters on several devices ({where}); move them to one")
    _check_all_gather_extensions(params, locations, caller, compress)
    # A module with no parameters of its own (a root over sharded children) has no device to agree
    # with: the mesh or the backend decides, as for parameters on the meta device.
    device = next(iter(devices), torch.device("meta"))
    replicate: Optional[GroupInfo] = None
    if mesh is not None and _mesh_ndim(mesh) is not None:
        _check_mesh(mesh, device)
    if mesh is not None and _mesh_ndim(mesh) == 2:
        info, replicate = resolve_group((mesh, 1), "mesh"), resolve_group((mesh, 0), "mesh")
    else:
        info = resolve_group(mesh if mesh is not None else group, "mesh" if mesh is not None else "group")
    mp = mp or MixedPrecision()
    if spmd is not None:
        check_spmd_params(spmd, params, [locs[0].fqn for locs in locations], caller)
    else:
        _check_tensor_parallel_params(module, params, locations, mesh)
    floating = all(p.is_floating_point() for p in params)
    if mp.param_dtype is not None and not floating:
        bad = [locs[0].fqn for p, locs in zip(params, locations) if not p.is_floating_point()]
        raise TypeError(f"shard: MixedPrecision.param_dtype needs floating-point parameters; {bad} are not")
    if compress is not None and compress.any:
        _check_compressible(module, params, locations, compress, caller)

    def on_grad_ready(g: ParamGroup, index: int) -> None:
        if state.root is not None:  # `state` is bound below, before any backward can run
            state.root.on_grad_ready(state)

    local_optimizer_step.install()  # steps over the DTensors made below run on their local tensors
    optimizer_check.install()  # an optimizer built before this call fails loudly at its first step
    if replicate is not None:
        dtensor_mesh = mesh
    else:
        dtensor_mesh = device_mesh_for(mesh if mesh is not None else group, info, _mesh_device_type(device, info))
    param_group = ParamGroup(params, locations, info, dtensor_mesh, mp, on_grad_ready, replicate, compress,
                             own_dtype=frozenset(i for i, p in enumerate(params) if id(p) in own_dtype_params),
                             spmd=spmd, shard_dims={i: shard_dims[id(p)] for i, p in enumerate(params)
                                                    if shard_dims and id(p) in shard_dims}) if params else None
    if param_group is not None and post_forward_size is not None:
        param_group.post_forward = post_forward_group(dtensor_mesh, post_forward_size)
    if param_group is not None:
        for original, sharded, fqn in zip(params, param_group.sharded, param_group.fqns):
            original._overlap_sharded_by = param_group  # type: ignore[attr-defined]
            original._overlap_sharded_fqn = fqn  # type: ignore[attr-defined]
            sharded._overlap_sharded_by = param_group  # type: ignore[attr-defined]
    state = ShardState(module, param_group, info, mp, reshard_after_forward, prefetch, max_inflight_bytes,
                       replicate)
    state.modules = list(modules)
    grouped = len(modules) > 1
    pre_hook = state.member_pre_forward if grouped else state.pre_forward
    post_hook = state.member_post_forward if grouped else state.post_forward
    for member in modules:
        member.__class__ = swapped_class(ShardedModule, type(member), "Sharded")
        member._overlap_state = state  # type: ignore[assignment]
        # Hooks run eagerly under torch.compile too (see [Note: hooks stay eager under torch.compile]).
        member.register_forward_pre_hook(eager_hook(pre_hook), with_kwargs=True)
        member.register_forward_hook(eager_hook(post_hook))
    # Region names carry each sharded module's fqn relative to this one, the latest root (once here,
    # not per call): ``overlap::pre_forward (blocks.3)``; see ``overlap.regions``.
    for fqn, m in module.named_modules():
        if isinstance(m, ShardedModule):
            m._overlap_state.name_regions(fqn)
    return module


def _check_all_gather_extensions(params: list[nn.Parameter], locations: list[list[ParamLocation]], caller: str,
                                 compress: Optional[Compression]) -> None:
    """Refuse, before anything changes, a parameter defining FSDP2's all-gather extension that the
    runtime cannot run (see [Note: all-gather extensions] in ``overlap/gather_extension.py``)."""
    compressed = compress is not None and compress.any
    for p, locs in zip(params, locations):
        local = p._local_tensor if isinstance(p, DTensor) else p
        if has_extension(local):
            check_extension(local, locs[0].fqn, caller, compressed=compressed)


def _check_compressible(module: nn.Module, params: list[nn.Parameter], locations: list[list[ParamLocation]],
                        compress: Compression, caller: str = "shard") -> None:
    """What compressed collectives do not cover ([Note: compressed collectives]: parameters the
    quantizing copy-in cannot read), refused before anything changes."""
    name = type(module).__name__
    for p, locs in zip(params, locations):
        if p.dtype not in QUANTIZED_DTYPES:  # what the quantizing copy-in takes
            raise TypeError(f"{caller}: compress needs float32, bfloat16 or float16 parameters; {locs[0].fqn!r} of "
                            f"{name} is {p.dtype} (pass compress=None)")


def _check_tensor_parallel_params(module: nn.Module, params: list[nn.Parameter],
                                  locations: list[list[ParamLocation]], mesh: Any) -> None:
    """DTensor parameters are accepted from tensor parallelism only (see [Note: sharding
    tensor-parallel parameters] in ``overlap/param_group.py``): on a 1-D mesh, Shard or Replicate,
    and ``mesh`` a DeviceMesh slice of the same mesh as theirs, over other dims."""
    dtensors = [(p, locs[0].fqn) for p, locs in zip(params, locations) if isinstance(p, DTensor)]
    if not dtensors:
        return
    name = type(module).__name__
    for p, fqn in dtensors:
        placements = p._spec.placements  # type: ignore[attr-defined]
        if p._spec.mesh.ndim != 1 or not all(isinstance(pl, (Shard, Replicate)) for pl in placements):  # type: ignore[attr-defined]
            raise ValueError(f"shard: parameter {fqn!r} of {name} is a DTensor with placements {placements} on a "
                             f"{p._spec.mesh.ndim}-D mesh; only tensor-parallel DTensors (Shard or Replicate on a "  # type: ignore[attr-defined]
                             f"1-D mesh, e.g. from overlap.tensor_parallel or parallelize_module) can be sharded")
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"shard: {name} has tensor-parallel DTensor parameters ({dtensors[0][1]!r}, ...); pass "
                         f"mesh= the data-parallel dim of the same DeviceMesh (e.g. mesh['dp']), not "
                         f"{'a process group' if mesh is None else type(mesh).__name__}")
    for p, fqn in dtensors:
        tp_mesh = p._spec.mesh  # type: ignore[attr-defined]
        try:
            DeviceMesh._concatenate([mesh, tp_mesh])
        except Exception as exc:  # torch's own check: slices of one root mesh, over different dims
            raise ValueError(f"shard: mesh {mesh.mesh_dim_names} and the tensor-parallel mesh "
                             f"{tp_mesh.mesh_dim_names} of parameter {fqn!r} must be different dims of one "
                             f"DeviceMesh (init_device_mesh(..., mesh_dim_names=('dp', 'tp')); pass mesh['dp'] "
                             f"here and mesh['tp'] to tensor parallelism): {exc}") from None


def _mesh_ndim(mesh: object) -> Optional[int]:
    """The number of dims of ``mesh`` if it is a DeviceMesh (not a ``(mesh, dim)`` pair), else None."""
    return mesh.ndim if isinstance(mesh, DeviceMesh) else None


def _check_mesh(mesh: DeviceMesh, device: torch.device) -> None:
    """A DeviceMesh passed to ``shard``: 1-D (full sharding) or 2-D (HSDP), containing this rank, of
    the parameters' device type."""
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"shard: mesh must be a 1-D DeviceMesh (full sharding) or a 2-D one (HSDP: dim 0 replicates, "
            f"dim 1 shards), got a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)}; for a mesh with more dims "
            f"pass the sub-mesh to shard over, e.g. mesh['replicate', 'shard'] or (mesh, dim)")
    if mesh.get_coordinate() is None:
        raise ValueError(f"shard: mesh {mesh} does not contain this rank ({dist.get_rank()}); pass a mesh "
                         f"that every rank calling shard belongs to")
    if device.type != "meta" and mesh.device_type != device.type:
        raise ValueError(f"shard: mesh is a {mesh.device_type!r} mesh but the parameters are on {device.type!r}; "
                         f"build the mesh for the parameters' device type (init_device_mesh({device.type!r}, ...))")


def _mesh_device_type(device: torch.device, info: GroupInfo) -> str:
    """The device type of the sharded DTensors' mesh: the parameters' device, or for parameters on
    the meta device (to be materialized by ``to_empty``) the one the backend drives."""
    if device.type != "meta":
        return device.type
    return "cuda" if info.backend == "nccl" else "cpu"


@contextlib.contextmanager
def _states_flag(module: nn.Module, attribute: str, value: bool, caller: str) -> Iterator[None]:
    """Set ``attribute`` on every shard state under ``module`` inside the block; restore on exit."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{caller}: module must be a torch.nn.Module sharded by overlap.shard, got {type(module).__name__}")
    states = sharded_states(module)
    if not states:
        raise ValueError(f"{caller}: {type(module).__name__} has no sharded modules (call overlap.shard first)")
    previous = [getattr(s, attribute) for s in states]
    for s in states:
        setattr(s, attribute, value)
    try:
        yield
    finally:
        for s, flag in zip(states, previous):
            setattr(s, attribute, flag)


def prefetch_next_step(module: nn.Module) -> bool:
    """Start the all-gathers that the next forward of ``module`` (a root passed to ``shard``) needs
    first, now: call it right after ``optimizer.step()`` (or register it:
    ``opt.register_step_post_hook(lambda *_: overlap.prefetch_next_step(model))``), so they run under
    the rest of the step boundary (``zero_grad``, data loading, logging) instead of at the start of
    forward. Every rank must call it at the same point (it issues collectives).

    [Note: prefetching across the step boundary]
    The gathers follow the agreed forward order of the last step: the first group with parameters
    and the next ``prefetch`` ones. Each remembers the version counters of the shards it packed; if
    a shard is changed in place before forward uses it (a load, a manual edit, another optimizer
    step), the gather is dropped unwaited and forward gathers again, at the same place on every
    rank. If forward skips the group, the gather is dropped as an unused prefetch is; if no
    forward comes, nothing waits for it and the in-flight registry lets its buffers go once it
    completes. Returns False (nothing issued) before the first step, or inside forward/backward.
    """
    if not isinstance(module, ShardedModule):
        raise TypeError(f"prefetch_next_step: module must be a module sharded by overlap.shard (the root), "
                        f"got {type(module).__name__}")
    state = module._overlap_state
    root = state.root
    if root is None or root.owner is not state:
        return False  # no step yet, or not the root of the last step
    return root.prefetch_next_step()


def no_sync(module: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Skip gradient reduce-scatters inside (gradient accumulation): unsharded gradients accumulate,
    and the next backward outside reduces all of it."""
    return _states_flag(module, "sync_grads", False, "no_sync")


def no_overlap(module: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Turn overlap off inside (the baseline that shows what overlap hides): nothing is prefetched
    and every collective of ``module``'s sharded runtime completes right after it is issued."""
    return _states_flag(module, "serialize_comm", True, "no_overlap")
