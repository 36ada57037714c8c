"""Optimizer steps over the runtime's sharded parameters, run on their local tensors.

A torch optimizer over DTensor parameters pays DTensor's dispatch (sharding propagation, wrapping)
on every op of its step: on CPU AdamW took 8.4x the plain-tensor step per tensor and 1.8x with
``foreach=True``; on CUDA ~1.1 ms per foreach call. This module removes that cost for the
parameters ``overlap.shard`` made, without changing what the optimizer computes or keeps.

Contract
--------
* **What is wrapped**: the inner implementations of Adam (AdamW is Adam with decoupled weight decay)
  and SGD, ``torch.optim.adam._single_tensor_adam`` / ``_multi_tensor_adam`` / ``_fused_adam`` and
  ``torch.optim.sgd._single_tensor_sgd`` / ``_multi_tensor_sgd`` / ``_fused_sgd``: module globals
  that ``adam()`` / ``sgd()`` look up at each call, after they chose foreach / fused from the
  DTensors themselves (that choice is not touched). ``Optimizer.step``, ``_init_group`` and the
  state they create stay torch's: state tensors are the DTensors ``zeros_like(param)`` gives, so
  ``state_dict()``, DCP and ``get_optimizer_state_dict`` see exactly what they see without this module.
* **When it engages** (one call of an inner function): the first parameter was sharded by
  ``overlap.shard`` (O(1) for every other caller: FSDP2's and other DTensor users' steps run
  torch's code unchanged), the fast path is on (:func:`set_local_optimizer_step`), nothing is
  being compiled, grad mode is off and ``differentiable`` is not set, and for every index ``i``:
  the parameter is a DTensor (exactly that type; only the first one's mark is read, so a DTensor
  of another library grouped after the runtime's steps on its local tensor too, exact by the same
  Note; see [Note: what the checks read]); every per-parameter tensor at ``i``
  (gradient, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``, momentum buffer) is a DTensor with
  the parameter's mesh, placements, shard order and global shape (a momentum buffer may be
  ``None``: created by the step); no placement is ``Partial``; this rank is in the mesh; the step
  counters are plain tensors. Other tensor arguments (``lr``, ``beta1``, ``beta2``,
  ``grad_scale``, ``found_inf``) must be plain one-element tensors. Then the original runs with
  every DTensor replaced by its ``_local_tensor``.
* **When it falls back**: otherwise the original runs unchanged on the DTensors (torch's path,
  whatever it does: compute, redistribute or raise). :data:`engaged` and :data:`fell_back` count
  the calls of each kind over groups whose first parameter is the runtime's.
* **Created state**: SGD's momentum buffers are created inside the step on the first step
  (``grad.clone()``, or ``empty_like(grad)`` for fused) and written into state by ``SGD.step``;
  each is returned as ``DTensor(local buffer, gradient's spec)``, the spec DTensor's sharding
  propagation gives that clone (engaging requires those gradients' and parameters' global strides
  to be contiguous and their dtypes equal, which makes the propagated spec equal to the gradient's).
* **Fused SGD**: torch 2.11-2.15 have no DTensor strategy for ``aten._fused_sgd_`` (the DTensor
  path raises ``NotImplementedError``); where this path engages, fused SGD runs on the shards,
  exactly as fused SGD over plain tensors holding the same rows.
* **Gathering the lists** (``Adam._init_group``, which AdamW inherits, and ``SGD._init_group``):
  torch's own code, run with torch-function dispatch for tensor subclasses turned off
  (``torch._C.DisableTorchFunctionSubclass``) when the group's first parameter was sharded by
  ``overlap.shard``, the fast path is on, nothing is being compiled, ``differentiable`` is not set,
  the lists are passed positionally and every parameter of the group is a DTensor; the gradients
  it gathered are checked afterwards. Where one is not a DTensor, or where that pass raised, the
  lists are emptied and torch's code runs again as it is (its lookups, its result or its error);
  otherwise unchanged. See [Note: gathering the lists without torch-function lookups]. Inside that
  context, Adam's and SGD's own ``_init_group`` first try the steady-state gathering (every
  parameter has a DTensor gradient; Adam's state exists): the lists torch's loop would fill, filled
  in C-level passes (:data:`gathered_steady` counts it); else torch's loop. See [Note: the
  steady-state gathering].
* **Installing**: :func:`install` runs at the first ``overlap.shard`` (importing ``overlap``
  changes nothing), once: each wrapper chains to the function that was there, and a function that is
  already one of ours is left alone. ``OVERLAP_LOCAL_OPTIMIZER_STEP`` (a boolean flag, default on)
  is read when it installs; :func:`set_local_optimizer_step` overrides it at any time.

Cost and caching: the checks are whole-list passes (``map`` over C getters, identity comparisons),
about 0.35 µs per parameter per call for fused AdamW on this project's CPU box. What is cached, and why it
is safe:

* *cached*: spec lists found acceptable, keyed by the tuple of the specs' ``id`` s: the parameters'
  spec lists (meshes hold this rank, no ``Partial``) and, per list of state tensors, its spec list
  together with the parameter spec list it matched. State tensors keep their DTensors, hence their
  specs, from step to step, so the next step finds the same ids. Each entry holds the spec objects
  themselves, so no other object can take their ids while it lives; the verdict depends only on the
  specs' mesh, placements, shard order and shape, which DTensor treats as immutable once a spec
  belongs to a tensor (it caches the spec's hash and keys its sharding-propagation cache on it).
  Entries pin small spec objects, never tensors; each cache starts over past 1024 entries. Each
  parameter entry also keeps, per argument position, the state spec list accepted there last, and
  the entry accepted last is kept under the id of its first spec: the next step's lists are
  compared with those by list ``==`` (identity per element in C, ``DTensorSpec.__eq__`` only for
  an element that is another object: equal specs have the same layout), without building and
  hashing a key (about 6 µs less per list of 128 on this box, and 2 µs more than ``map(is_, ...)``
  saved per list).
* *not cached*: anything about tensors: their types, the first parameter's ``overlap.shard`` mark,
  the gradients' specs (the runtime makes new gradient DTensors; they carry the parameter's spec object,
  so one identity test per gradient), the local tensors. Pinning tensors would keep their memory
  alive, and ids of freed tensors are reused.

[Note: gathering the lists without torch-function lookups]
``_init_group`` reads, per parameter, ``p.grad`` (two or three times), ``p.grad.is_sparse``,
``torch.is_complex(p)`` (Adam) and ``hash(p)``. For a tensor whose class is not exactly
``torch.Tensor``, each of these C getters first looks up ``__torch_function__`` on the instance
(instance dict, then the type), and only then does the read; with 128 DTensor parameters that made
the gathering 2x its cost over plain parameters (AdamW 183 vs 93 µs, SGD 102 vs 52 µs on this
project's CPU box). DTensor's (and ``nn.Parameter``'s) ``__torch_function__`` is
``torch._C._disabled_torch_function_impl``, the marker that means "no override": the lookup finds it
and dispatch goes on exactly as for a plain tensor. ``DisableTorchFunctionSubclass`` skips the lookup
for every subclass, so for a group whose parameters and gradients are DTensors nothing it reads has
an override to skip, and the results, the state it creates (``zeros_like`` goes through DTensor's
``__torch_dispatch__``, untouched) and the errors it raises are the same. Torch-function *modes*
stay active (the context does not disable them). Installed only where DTensor's
``__torch_function__`` is that marker (:func:`install` checks). With it, AdamW's gathering over the
same 128 parameters took 118 µs and SGD's 57 µs.

The parameters are checked before (the pass creates state from them); the gradients after, in the
list the pass filled (``grads``, the second list of both signatures): one type pass over the
gathered list instead of reading every ``p.grad`` once more before (about 10 µs per 128
parameters). A gradient that is not a DTensor (a plain tensor, or a subclass whose override the
pass skipped when it read ``is_sparse``) sends the group through torch's code again from empty
lists, so its override runs; so does any exception of the pass (torch's code raises it again, or
not, with every lookup). Running the pass twice is safe: what it does besides filling the lists is
creating missing state from the parameters (DTensors, the same with or without the context; the
second pass finds it and creates nothing) and, for fused SGD, recording that the device check
passed.

[Note: the steady-state gathering]
Torch's ``_init_group`` is a Python loop over the parameters (``p.grad`` two or three times, a
state lookup, a dict read and a list append per list): over 288 parameters AdamW's took 211-271 µs
over plain tensors and 282-332 µs over the runtime's DTensors under the context above (``torch.is_complex``
on a DTensor alone 91 µs: its argument parser checks for subclasses); SGD's 121-130 / 146 µs. In
the steady state, every step after the first, the loop creates nothing and raises nothing, so its
result is a function of the parameters' gradients and state entries, which C-level ``map``
passes read in the same order: ``.grad`` once each, ``opt.state[p]`` (the same ``__getitem__``,
so a ``defaultdict`` creates the same empty entries), the entries by ``itemgetter``, ``is_sparse``,
and the dtypes' ``is_complex`` for ``has_complex``. Adam's (which AdamW inherits) and SGD's
``_init_group`` bodies are the same in torch 2.11, 2.13 and 2.15 past state creation (checked when
this was written; the tests compare the gathered objects with torch's loop on the installed torch).
Which gathering a class's ``_init_group`` gets is read at :func:`install` from the torch loop it runs
in the end (``__wrapped__`` followed: Dynamo's ``disable`` gives AdamW a wrapper of its own around
Adam's loop when Dynamo patches the optimizers before ``install``). The gathering answers only where
the loop would provably do the same: lists passed positionally,
empty; every gradient exactly a DTensor (so none missing); none sparse (Adam raises there); for Adam
every parameter's state non-empty with the entries the loop reads (a ``KeyError`` or an empty entry:
the loop runs and creates or raises as it does), and not ``foreach`` with a tensor ``lr`` and
``capturable`` off (the loop raises); for fused SGD its one-time device check already done. Then
the same objects go into the same lists in the same order and the return value is the loop's
(``has_complex`` / ``has_sparse_grad``). Measured (288 parameters, min of 2000 calls): AdamW's
``_init_group`` 282-332 -> 121 µs (plain 211-271), SGD's 146 -> 96 µs (plain 121-130).

[Note: what the checks read]
Per index, the checks read the type and ``_spec`` of every DTensor and its ``_local_tensor`` (the
list the original then runs on): a DTensor's instance layout keeps these beside each other, and
``_spec`` s are compared by identity, without reading the spec objects. Until 2026-11-26 every
parameter's ``overlap.shard`` mark was read too: a lookup in each parameter's instance dict, a
different object per parameter. In a loop over one optimizer that cost 4 µs per 128 parameters;
in ``bench_runtime_cost``'s rounds, where each step starts with caches that other models' steps
have just used, it cost 40-80 µs (fused AdamW and SGD, 128 parameters, on this project's CPU
box). Only the first parameter's mark is read now, as the gate that keeps every other caller's
groups on torch's code. Marks were never needed for exactness: [Note: why the local step is exact]
holds for any DTensors whose specs agree at each index, hold no ``Partial`` and whose mesh holds
this rank, whichever library made them.

[Note: why the local step is exact]
Adam, AdamW and SGD are elementwise: every op of their steps reads and writes tensors of one index
(parameter, gradient, state) elementwise, plus scalars (step counters, lr, betas, grad scale). On
DTensors whose specs agree at an index and hold no ``Partial``, DTensor's sharding propagation picks
that spec for the op's output and runs the same aten op on the local tensors (pointwise and foreach
strategies follow the operands' common placements; plain one-element tensors are implicitly
replicated, i.e. passed as they are); no redistribution and no communication happen. Running the
original implementation on the local tensors therefore runs the same aten ops, with the same
arguments, in the same order, on the same memory, so the results and the state are bitwise those of
the DTensor path. Grouping by device and dtype (``_group_tensors_by_device_and_dtype``) sees the
same devices and dtypes (a DTensor's are its local tensor's). Where any precondition fails (a
``Partial``, specs that differ at an index and would be redistributed, a plain tensor beside
DTensors, a rank outside the mesh, autograd through the step) the equivalence is not established
and torch's path runs.
"""
from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import attrgetter, itemgetter, methodcaller
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from overlap.optimizer_check import MARK
from overlap.param_group import _contiguous_strides
from scheduler.env_flags import env_flag

__all__ = ["ENV", "engaged", "fell_back", "gathered_steady", "install", "local_optimizer_step_enabled", "set_local_optimizer_step"]

ENV = "OVERLAP_LOCAL_OPTIMIZER_STEP"
"""Boolean flag (``scheduler.env_flags`` syntax); unset: on. Read when :func:`install` first runs."""


engaged: int = 0
"""Calls of a wrapped inner function that ran on local tensors."""
fell_back: int = 0
"""Calls over groups whose first parameter is the runtime's that ran torch's DTensor path instead."""
gathered_steady: int = 0
"""``_init_group`` calls answered by the steady-state gathering ([Note: the steady-state gathering])."""

_explicit: bool | None = None  # set_local_optimizer_step's setting; None: follow ENV
_enabled = True
_installed = False
_WRAPPED = "_overlap_local_optimizer_step_original"  # on our wrappers: the function each chains to
_DTENSOR_ONLY = {DTensor}
_NONE_TYPE = type(None)
_DTENSOR_OR_NONE = {DTensor, _NONE_TYPE}
_SPEC, _LOCAL = attrgetter("_spec"), attrgetter("_local_tensor")
_MESH, _PLACEMENTS = attrgetter("mesh"), attrgetter("placements")



@dataclass
class _AcceptedParams:
    """A parameter spec list whose meshes and placements were accepted, and per argument position the
    spec list of the state tensors last accepted beside it (see ``_layouts_match``)."""

    specs: list[DTensorSpec]
    key: tuple[int, ...]
    """``specs``' ids."""
    last_lists: dict[int, list[DTensorSpec]]


_checked_params: dict[tuple[int, ...], _AcceptedParams] = {}
"""Parameter spec lists (keyed by their ids) whose meshes and placements were accepted."""
_checked_lists: dict[tuple[int, ...], tuple[list[DTensorSpec], list[DTensorSpec], tuple[int, ...]]] = {}
"""Spec lists (keyed by their ids) accepted as laid out like a parameter spec list (its ids last)."""
_params_by_first: dict[int, _AcceptedParams] = {}
"""The parameter spec list accepted last whose first spec has this id (one step's list, found again
by the next step without building and hashing its key)."""
_CACHE_MAX = 1024  # entries per cache before it starts over (each pins a list of small spec objects)


@dataclass(frozen=True)
class _Signature:
    """The leading positional arguments of one family of inner functions."""

    dtensor_lists: int
    """The first ``dtensor_lists`` arguments are per-parameter lists of DTensors (params first)."""
    steps_list: int | None
    """Position of the per-parameter list of plain step counters (Adam's ``state_steps``), if any."""
    created_list: int | None
    """Position of the list whose ``None`` entries the function fills (SGD's momentum buffers)."""

    @property
    def positional(self) -> int:
        """How many leading positional arguments a call must pass to be checked (else: torch's path)."""
        return max(self.dtensor_lists, (self.steps_list if self.steps_list is not None else -1) + 1)


_INIT_GROUP_OWNERS: tuple[tuple[str, str], ...] = (("torch.optim.adam", "Adam"), ("torch.optim.adamw", "AdamW"),
                                                   ("torch.optim.sgd", "SGD"))
"""Classes whose own ``_init_group`` is wrapped (AdamW inherits Adam's on torch 2.11-2.15: then skipped,
unless Dynamo gave AdamW a ``disable`` wrapper of its own around Adam's)."""
_STEADY_FAMILIES = {("torch.optim.adam", "Adam._init_group"): "adam", ("torch.optim.sgd", "SGD._init_group"): "sgd"}
"""Torch's ``_init_group`` loops (module, qualified name) -> the family of their steady-state gathering."""
_NO_SUBCLASS_TORCH_FUNCTION = torch._C.DisableTorchFunctionSubclass

_ADAM = _Signature(dtensor_lists=5, steps_list=5, created_list=None)  # params grads exp_avgs exp_avg_sqs max_exp_avg_sqs
_SGD = _Signature(dtensor_lists=3, steps_list=None, created_list=2)  # params grads momentum_buffer_list
_TARGETS: tuple[tuple[str, str, _Signature], ...] = (
    ("torch.optim.adam", "_single_tensor_adam", _ADAM),
    ("torch.optim.adam", "_multi_tensor_adam", _ADAM),
    ("torch.optim.adam", "_fused_adam", _ADAM),
    ("torch.optim.sgd", "_single_tensor_sgd", _SGD),
    ("torch.optim.sgd", "_multi_tensor_sgd", _SGD),
    ("torch.optim.sgd", "_fused_sgd", _SGD),
)


def set_local_optimizer_step(on: bool | None) -> bool | None:
    """Turn the local optimizer step on or off for this process (``None``: follow
    ``OVERLAP_LOCAL_OPTIMIZER_STEP`` again, default on). Returns the previous explicit setting, or
    ``None`` if it followed the environment. Off, every step runs torch's DTensor path."""
    global _explicit, _enabled
    if on is not None and not isinstance(on, bool):
        raise TypeError(f"set_local_optimizer_step: on must be True, False or None, got {on!r}")
    previous = _explicit
    _explicit = on
    _enabled = env_flag(ENV, default=True) if on is None else on
    return previous


def local_optimizer_step_enabled() -> bool:
    """Is the local optimizer step on (explicitly, or through ``OVERLAP_LOCAL_OPTIMIZER_STEP``)?"""
    return _enabled if _installed or _explicit is not None else env_flag(ENV, default=True)


def install() -> None:
    """Wrap the inner Adam / SGD implementations (see the module docstring); idempotent. Called by
    ``overlap.shard``."""
    global _installed, _enabled
    if _installed:
        return
    if _explicit is None:
        _enabled = env_flag(ENV, default=True)
    for module_name, name, signature in _TARGETS:
        module = importlib.import_module(module_name)
        current = getattr(module, name)
        if getattr(current, _WRAPPED, None) is None:
            setattr(module, name, _wrap(current, signature))
    if DTensor.__torch_function__ is torch._C._disabled_torch_function_impl:  # see [Note: gathering the lists ...]
        for module_name, class_name in _INIT_GROUP_OWNERS:
            owner = getattr(importlib.import_module(module_name), class_name)
            current = owner.__dict__.get("_init_group")
            if current is not None and getattr(current, _WRAPPED, None) is None:
                owner._init_group = _wrap_init_group(current, _steady_family(current))
    _installed = True


def _wrap(original: Callable[..., Any], signature: _Signature) -> Callable[..., Any]:
    @functools.wraps(original)
    def step_on_local_tensors(*args: Any, **kwargs: Any) -> Any:
        global engaged, fell_back
        if not _enabled or len(args) < signature.positional or not args[0] \
                or getattr(args[0][0], MARK, None) is None or torch.compiler.is_compiling():
            return original(*args, **kwargs)
        local_args = _local_arguments(args, kwargs, signature)
        if local_args is None:
            fell_back += 1
            return original(*args, **kwargs)
        creates = signature.created_list is not None and _NONE_TYPE in set(map(type, args[signature.created_list]))
        result = original(*local_args, **kwargs)
        if creates:  # the first step only: later steps find every buffer in place
            _return_created(args[signature.created_list], local_args[signature.created_list], args[1])
        engaged += 1
        return result

    setattr(step_on_local_tensors, _WRAPPED, original)
    return step_on_local_tensors


def _steady_family(init_group: Callable[..., Any]) -> str | None:
    """The family of the steady-state gathering for the torch loop that ``init_group`` runs in the
    end (following ``__wrapped__``: Dynamo's ``disable`` gives AdamW its own wrapper of Adam's loop),
    or None where that is not one of ``_STEADY_FAMILIES``."""
    fn = inspect.unwrap(init_group)
    return _STEADY_FAMILIES.get((getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)))


def _wrap_init_group(original: Callable[..., Any], family: str | None = None) -> Callable[..., Any]:
    """``original`` (an ``_init_group``) run as the module docstring says; ``family`` names its
    steady-state gathering in ``_STEADY_GATHERS``, looked up at each call (``None``: none)."""
    @functools.wraps(original)
    def init_group(self: torch.optim.Optimizer, group: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        global gathered_steady
        params = group["params"]
        if (_enabled and len(args) >= 2 and params and not torch.compiler.is_compiling()
                and getattr(params[0], MARK, None) is not None and not group.get("differentiable", False)
                and set(map(type, params)) == _DTENSOR_ONLY):
            try:
                with _NO_SUBCLASS_TORCH_FUNCTION():
                    steady = _STEADY_GATHERS.get(family)
                    if steady is not None and not kwargs:
                        result = steady(self, group, params, args)
                        if result is not _NOT_STEADY:
                            gathered_steady += 1
                            return result
                    result = original(self, group, *args, **kwargs)
                if set(map(type, args[1])) <= _DTENSOR_ONLY:  # the gradients it read: see the Note
                    return result
            except Exception:  # noqa: BLE001 - torch's path below raises it again, or not
                pass
            for gathered in args:  # start over: torch's path, with every lookup
                if isinstance(gathered, list):
                    gathered.clear()
        return original(self, group, *args, **kwargs)

    setattr(init_group, _WRAPPED, original)
    return init_group


_NOT_STEADY = object()  # a steady gathering's answer where torch's loop must run
_GRAD, _IS_SPARSE, _DTYPE = attrgetter("grad"), attrgetter("is_sparse"), attrgetter("dtype")
_EXP_AVG, _EXP_AVG_SQ = itemgetter("exp_avg"), itemgetter("exp_avg_sq")
_MAX_EXP_AVG_SQ, _STEP = itemgetter("max_exp_avg_sq"), itemgetter("step")
_MOMENTUM_BUFFER = methodcaller("get", "momentum_buffer")


def _gradients_if_all_dtensors(params: list[DTensor]) -> list[DTensor] | None:
    """Every parameter's ``.grad`` (read once each), or None unless each is a DTensor (a missing
    gradient, a plain tensor or another subclass: torch's loop, with its lookups)."""
    grads = list(map(_GRAD, params))
    return grads if set(map(type, grads)) == _DTENSOR_ONLY else None


def _adam_steady(opt: torch.optim.Optimizer, group: dict[str, Any], params: list[DTensor],
                 lists: tuple[Any, ...]) -> Any:
    """``Adam._init_group`` (torch 2.11-2.15, which AdamW inherits) for a group whose every
    parameter has a DTensor gradient and state already: the same lists and return value, gathered in
    C-level passes; ``_NOT_STEADY`` (nothing changed but missing state entries created empty, as
    torch's loop creates them) wherever torch's loop would create state or raise. See [Note: the
    steady-state gathering]."""
    if len(lists) != 6 or any(lists) or not all(type(lst) is list for lst in lists):
        return _NOT_STEADY
    grads = _gradients_if_all_dtensors(params)
    if grads is None or any(map(_IS_SPARSE, grads)) \
            or (group["foreach"] and torch.is_tensor(group["lr"]) and not group["capturable"]):
        return _NOT_STEADY
    states = list(map(opt.state.__getitem__, params))
    try:
        if 0 in set(map(len, states)):
            return _NOT_STEADY
        amsgrad = group["amsgrad"]
        gathered = (list(map(_EXP_AVG, states)), list(map(_EXP_AVG_SQ, states)),
                    list(map(_MAX_EXP_AVG_SQ, states)) if amsgrad else [], list(map(_STEP, states)))
    except KeyError:  # state torch's loop would not find either: it raises there
        return _NOT_STEADY
    params_with_grad, grads_out, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps = lists
    params_with_grad.extend(params)
    grads_out.extend(grads)
    exp_avgs.extend(gathered[0])
    exp_avg_sqs.extend(gathered[1])
    max_exp_avg_sqs.extend(gathered[2])
    state_steps.extend(gathered[3])
    return any(dtype.is_complex for dtype in set(map(_DTYPE, params)))


def _sgd_steady(opt: torch.optim.Optimizer, group: dict[str, Any], params: list[DTensor],
                lists: tuple[Any, ...]) -> Any:
    """``SGD._init_group`` (torch 2.11-2.15) for a group whose every parameter has a DTensor
    gradient, past fused SGD's first-step device check: the same lists and return value, gathered
    in C-level passes; ``_NOT_STEADY`` (nothing changed) otherwise. See [Note: the steady-state
    gathering]."""
    if len(lists) != 3 or any(lists) or not all(type(lst) is list for lst in lists) \
            or (group["fused"] and getattr(opt, "_need_device_dtype_check_for_fused", True)):
        return _NOT_STEADY
    grads = _gradients_if_all_dtensors(params)
    if grads is None:
        return _NOT_STEADY
    params_out, grads_out, momentum_buffer_list = lists
    params_out.extend(params)
    grads_out.extend(grads)
    if group["momentum"] != 0:
        momentum_buffer_list.extend(map(_MOMENTUM_BUFFER, map(opt.state.__getitem__, params)))
    return any(map(_IS_SPARSE, grads))


_STEADY_GATHERS: dict[str | None, Callable[[torch.optim.Optimizer, dict[str, Any], list[DTensor], tuple[Any, ...]],
                                           Any] | None] = {"adam": _adam_steady, "sgd": _sgd_steady}
"""Family -> its steady-state gathering (an entry set to None: torch's loop, as ``benchmarks/bench_host_bound.py``
compares)."""


def _local_arguments(args: tuple[Any, ...], kwargs: dict[str, Any], signature: _Signature) -> list[Any] | None:
    """``args`` with each per-parameter DTensor replaced by its local tensor, or None where the
    module docstring's conditions do not hold. Whole-list passes (``map`` over C getters) keep the
    per-parameter cost to a few C-level calls."""
    if torch.is_grad_enabled() or kwargs.get("differentiable", False):
        return None
    if not all(map(_plain_scalar, kwargs.values())):
        return None
    if not all(_plain_scalar(v) for v in args[signature.dtensor_lists:] if not isinstance(v, list)):
        return None
    params = args[0]
    n = len(params)
    if set(map(type, params)) != _DTENSOR_ONLY:  # the first one is marked (the wrapper's test)
        return None
    if signature.steps_list is not None:
        steps = args[signature.steps_list]
        if len(steps) != n or DTensor in set(map(type, steps)):
            return None
    specs = list(map(_SPEC, params))
    accepted = _meshes_and_placements_allowed(specs)
    if accepted is None:
        return None
    local_args = list(args)
    local_args[0] = list(map(_LOCAL, params))
    for j in range(1, signature.dtensor_lists):
        lst = args[j]
        if not len(lst):
            continue
        if len(lst) != n:
            return None
        types = set(map(type, lst))
        if types == _DTENSOR_ONLY:
            if not _layouts_match(list(map(_SPEC, lst)), accepted, j):
                return None
            local_args[j] = list(map(_LOCAL, lst))
        elif j == signature.created_list and types <= _DTENSOR_OR_NONE:
            if not _created_slots_allowed(params, args[1], lst, specs):
                return None
            local_args[j] = [None if t is None else t._local_tensor for t in lst]
        else:
            return None
    return local_args


def _meshes_and_placements_allowed(specs: list[DTensorSpec]) -> _AcceptedParams | None:
    """This rank is in every mesh and no placement is ``Partial`` (the cache entry), else None.

    The list accepted last with the same first spec object is compared first (``==`` on lists
    tests identity per element before calling ``DTensorSpec.__eq__``: one C pass when the specs
    are those objects; specs equal to them have the same meshes and placements), then the lists
    accepted before, keyed by their ids."""
    accepted = _params_by_first.get(id(specs[0]))
    if accepted is not None and accepted.specs == specs:
        return accepted
    key = tuple(map(id, specs))
    accepted = _checked_params.get(key)
    if accepted is not None:
        _remember(_params_by_first, id(specs[0]), accepted)
        return accepted
    meshes = {id(m): m for m in map(_MESH, specs)}
    placements = set(map(_PLACEMENTS, specs))
    if any(m.get_coordinate() is None for m in meshes.values()) \
            or any(pl.is_partial() for pls in placements for pl in pls):
        return None
    accepted = _AcceptedParams(specs, key, {})
    _remember(_checked_params, key, accepted)
    _remember(_params_by_first, id(specs[0]), accepted)
    return accepted


def _layouts_match(specs: list[DTensorSpec], accepted: _AcceptedParams, position: int) -> bool:
    """Does each ``specs[i]`` (of the list at argument ``position``) lay out its tensor as
    ``accepted.specs[i]`` (see :func:`_same_layout`)?

    Identity first (the runtime's gradients carry their parameter's spec), then the spec objects of
    the list accepted last at this position (state tensors keep their DTensors, hence their specs,
    from step to step: one pass, no key), then the lists accepted before (keyed by ids), then the
    comparison. The first two are list ``==``: identity per element in C, ``DTensorSpec.__eq__``
    (mesh, placements, shard order, shape, stride, dtype: a stricter test than the layout's) only
    where an element is another object."""
    param_specs = accepted.specs
    if specs[0] is param_specs[0] and specs == param_specs:
        return True
    last = accepted.last_lists.get(position)
    if last is not None and specs[0] is last[0] and specs == last:
        return True
    key = tuple(map(id, specs))
    seen = _checked_lists.get(key)
    if seen is None or seen[2] != accepted.key:
        if not all(s is ps or _same_layout(s, ps) for s, ps in zip(specs, param_specs)):
            return False
        _remember(_checked_lists, key, (specs, param_specs, accepted.key))
    accepted.last_lists[position] = specs  # pins small spec objects only, as the caches do
    return True


def _remember(cache: dict[tuple[int, ...], Any], key: tuple[int, ...], pinned: Any) -> None:
    """``cache[key] = pinned``; ``pinned`` holds the objects whose ids make ``key``, so that no
    other object can take those ids while the entry lives. Starts over past ``_CACHE_MAX`` entries."""
    if len(cache) >= _CACHE_MAX:
        cache.clear()
    cache[key] = pinned


def _plain_scalar(value: Any) -> bool:
    """Not a tensor, or a plain (non-DTensor) tensor of one element."""
    return not isinstance(value, torch.Tensor) or (not isinstance(value, DTensor) and value.numel() == 1)


def _same_layout(a: DTensorSpec, b: DTensorSpec) -> bool:
    """Do DTensors of specs ``a`` and ``b`` hold the same elements locally (mesh, placements, shard
    order and global shape equal)? Identity first: the runtime's gradients share their parameter's
    spec, and state tensors its mesh."""
    return ((a.mesh is b.mesh or a.mesh == b.mesh)
            and (a.placements is b.placements or a.placements == b.placements)
            and getattr(a, "shard_order", None) == getattr(b, "shard_order", None)
            and a.tensor_meta is not None and b.tensor_meta is not None
            and a.tensor_meta.shape == b.tensor_meta.shape)


def _contiguous(spec: DTensorSpec) -> bool:
    meta = spec.tensor_meta
    return meta is not None and tuple(meta.stride) == _contiguous_strides(meta.shape)


def _created_slots_allowed(params: Sequence[DTensor], grads: Sequence[Any], created: Sequence[Any],
                           specs: list[DTensorSpec]) -> bool:
    """``created`` (momentum buffers, some ``None``): its DTensors lay out like their parameters,
    and for each ``None`` the gradient is a DTensor laid out like its parameter, of the parameter's
    dtype, both with contiguous global strides. Then the DTensor path's new buffer (``clone`` /
    ``empty_like`` of the gradient, or of the gradient plus a multiple of the parameter) has the
    gradient's spec. Runs on the first step only."""
    for p, g, b, spec in zip(params, grads, created, specs):
        if b is None:
            if type(g) is not DTensor or p.dtype != g.dtype or not _contiguous(g._spec) or not _contiguous(spec):
                return False
            b = g
        if b._spec is not spec and not _same_layout(b._spec, spec):
            return False
    return True


def _return_created(dtensors: list[Any], local: list[Any], grads: Sequence[DTensor]) -> None:
    """Write the buffers the step created in ``local`` back into ``dtensors`` as DTensors with the
    gradient's spec (see :func:`_created_slots_allowed`)."""
    for i, buf in enumerate(local):
        if dtensors[i] is None and buf is not None:
            dtensors[i] = DTensor(buf, grads[i]._spec, requires_grad=False)
