"""``overlap.fully_shard`` (this module is ``overlap.fsdp2_api``: the package attribute is the function): torch FSDP2's ``fully_shard`` signature over this runtime.

``from overlap import fully_shard`` in place of ``from torch.distributed.fsdp import fully_shard``
runs code written for FSDP2 (torchtitan's ``apply_fsdp``, HF's FSDP2 path) on ``overlap.shard``'s
runtime: one implementation (``overlap.sharding._shard``), two spellings. The module(s) come back
with FSDP2's ``FSDPModule`` methods (``overlap/fsdp_module.py``).

===========================  =======================================================================
argument                     here
===========================  =======================================================================
``module``                   a module, or a list of modules sharded as one group: gathered when the
                             first of them runs, resharded after the last (FSDP2's grouping)
``mesh``                     1-D DeviceMesh (full sharding) or 2-D (HSDP); None: every rank
``reshard_after_forward``    bool; None = True (the root never reshards after forward here); an
                             int equal to the shard size = True, 1 = False (as FSDP2 maps them);
                             any other divisor ``k`` reshards to groups of ``k`` ranks: backward
                             gathers from them ([Note: resharding to a smaller group after
                             forward] in ``overlap/post_forward_shard.py``)
``shard_placement_fn``       called per parameter; ``None`` or ``Shard(dim)`` as FSDP2 ([Note:
                             sharding on another dim] in ``overlap/dim_sharding.py``); any other
                             placement, or ``Shard(dim > 0)`` with ``compress=`` or on a parameter
                             gathered apart, raises NotImplementedError naming the parameter
``mp_policy``                torch's ``MixedPrecisionPolicy`` (or ``overlap.MixedPrecision``);
                             ``output_dtype`` casts every sharded module's output, as in FSDP2;
                             ``reduce_dtype=None`` means what it means to the installed torch's
                             FSDP2 (from 2.15: the parameters' dtype, not ``param_dtype``);
                             torch 2.15's ``param_dtype_override_fn`` as FSDP2: a parameter kept
                             in its own dtype is gathered beside the group's fused all-gather
                             ([Note: all-gather extensions] in ``overlap/gather_extension.py``)
``offload_policy``           the default ``OffloadPolicy()`` only; ``CPUOffloadPolicy`` raises
                             NotImplementedError (use torch's fully_shard for CPU offload)
``ignored_params``           not sharded, not moved, gradients not reduced (as FSDP2)
``dp_mesh_dims`` (2.13+)     as FSDP2: ``mesh`` is then the full SPMD mesh the parameters are
                             DTensors on, sharded over its ``shard`` dims (several: flattened),
                             replicated over its ``replicate`` dims (HSDP); a replicate-only
                             ``DataParallelMeshDims`` raises NotImplementedError ([Note: sharding
                             on a full SPMD mesh] in ``overlap/spmd_mesh.py``)
``prefetch``,                this runtime's own options (``overlap.shard``'s), keyword-only
``max_inflight_bytes``,
``compress``                 (``overlap.Compression``: int8/fp8 all-gathers and reductions, [Note:
                             compressed collectives] in ``overlap/compression.py``)
===========================  =======================================================================

Every argument is checked before anything changes. ``overlap.register_fsdp_forward_method`` is
FSDP2's function of that name for these modules (torch's is a no-op on them).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterator, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from overlap.compression import Compression, check_compression
from overlap.mixed_precision import MixedPrecision
from overlap.eager_hooks import eager_hook
from overlap.gather_extension import has_extension
from overlap.optimizer_check import MARK
from overlap.spmd_mesh import resolve_spmd_mesh
from overlap.sharding import ShardedModule, _cast_floating, _check_options, _shard
from scheduler.torch_versions import TORCH_VERSION

__all__ = ["fully_shard", "register_fsdp_forward_method", "share_comm_ctx"]


def _mixed_precision(mp_policy: object) -> Optional[MixedPrecision]:
    """torch's ``MixedPrecisionPolicy`` (any supported torch) as an ``overlap.MixedPrecision``."""
    if mp_policy is None or isinstance(mp_policy, MixedPrecision):
        return mp_policy
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"fully_shard: mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy or an "
                        f"overlap.MixedPrecision, got {type(mp_policy).__name__}")
    return MixedPrecision(param_dtype=mp_policy.param_dtype, reduce_dtype=mp_policy.reduce_dtype,
                          output_dtype=mp_policy.output_dtype, cast_forward_inputs=mp_policy.cast_forward_inputs)


def _managed(modules: list[nn.Module], ignored: frozenset[int]) -> Iterator[tuple[str, nn.Parameter]]:
    """The parameters this ``fully_shard`` call shards (not ignored, not sharded by an earlier call),
    each once, with its name under its module."""
    seen: set[int] = set()
    for member in modules:
        for name, p in member.named_parameters():
            if id(p) in ignored or id(p) in seen or getattr(p, MARK, None) is not None:
                continue
            seen.add(id(p))
            yield name, p


def _kept_in_own_dtype(mp_policy: object, modules: list[nn.Module], ignored: frozenset[int]) -> frozenset[int]:
    """torch 2.15's ``MixedPrecisionPolicy.param_dtype_override_fn``, called once per managed
    parameter as FSDP2 calls it: the ids of the parameters it keeps in their own dtype instead of
    ``param_dtype`` (it returns the parameter's dtype, and that differs from ``param_dtype``). Like
    FSDP2, ValueError for anything but None, ``param_dtype`` or the parameter's dtype."""
    override = getattr(mp_policy, "param_dtype_override_fn", None)
    if override is None:
        return frozenset()
    param_dtype = mp_policy.param_dtype  # type: ignore[attr-defined]
    kept = set()
    for name, p in _managed(modules, ignored):
        dtype = override(p)
        if dtype is None:
            continue
        if not isinstance(dtype, torch.dtype) or dtype not in (param_dtype, p.dtype):
            raise ValueError(f"fully_shard: mp_policy.param_dtype_override_fn must return None, param_dtype "
                             f"({param_dtype}) or the parameter's own dtype; it returned {dtype!r} for {name!r} "
                             f"({p.dtype})")
        if param_dtype is not None and dtype != param_dtype and p.is_floating_point():
            kept.add(id(p))
    return frozenset(kept)


def _gradient_dtype_default(mp: Optional[MixedPrecision], mp_policy: object, modules: list[nn.Module],
                            ignored: frozenset[int]) -> Optional[MixedPrecision]:
    """torch 2.15 changed what torch's ``MixedPrecisionPolicy(param_dtype=..., reduce_dtype=None)``
    reduces in: before, ``param_dtype``; from 2.15, the parameters' own dtypes (their
    ``grad_dtype``), promoted over the group, e.g. float32 for float32 parameters computed in
    bfloat16. ``overlap.MixedPrecision`` keeps the first meaning; under torch 2.15 a torch policy
    gets the second, the promoted dtype of the parameters this call shards as ``reduce_dtype``."""
    if (TORCH_VERSION < (2, 15) or mp is None or mp.param_dtype is None or mp.reduce_dtype is not None
            or isinstance(mp_policy, MixedPrecision)):
        return mp
    dtypes = {p.dtype for _, p in _managed(modules, ignored) if p.is_floating_point()}
    if not dtypes:
        return mp
    return dataclasses.replace(mp, reduce_dtype=functools.reduce(torch.promote_types, dtypes))


def _check_offload(offload_policy: object) -> None:
    if offload_policy is None:
        return
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if isinstance(offload_policy, CPUOffloadPolicy):
        raise NotImplementedError("fully_shard: offload_policy=CPUOffloadPolicy() is not supported by overlap (its "
                                  "shards live on the parameters' device); leave offload_policy at its default, or use "
                                  "torch.distributed.fsdp.fully_shard for CPU offload")
    if type(offload_policy) is not OffloadPolicy:
        raise TypeError(f"fully_shard: offload_policy must be torch.distributed.fsdp.OffloadPolicy() (no offload), "
                        f"got {type(offload_policy).__name__}")


def _shard_size(mesh: Optional[DeviceMesh]) -> int:
    """The number of ranks a parameter is sharded over: the mesh's shard dim (dim 1 of a 2-D mesh)."""
    if mesh is None:
        return dist.get_world_size()
    return mesh.size(mesh.ndim - 1)


def _reshard_after_forward(value: object, mesh: Optional[DeviceMesh]) -> Union[bool, int]:
    """``reshard_after_forward`` as the runtime takes it: a bool, or the size ``k`` of the groups to
    reshard to ([Note: resharding to a smaller group after forward] in ``overlap/post_forward_shard.py``)."""
    if value is None:
        return True
    if isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise ValueError(f"fully_shard: reshard_after_forward must be a bool, None or an int (a group size to "
                         f"reshard to), got {value!r}")
    size = _shard_size(mesh)
    if value < 1 or value > size or size % value != 0:
        raise ValueError(f"fully_shard: reshard_after_forward as an int must divide the shard size {size}, "
                         f"got {value}")
    if value == size:
        return True
    if value == 1:
        return False
    return value


def _check_post_forward_size(size: int, spmd: object, compress: Optional[Compression], own_dtype: frozenset[int],
                             modules: list[nn.Module], ignored: frozenset[int]) -> None:
    """What ``reshard_after_forward=<int>`` does not cover, refused before anything changes."""
    what = (["dp_mesh_dims (as FSDP2)"] if spmd is not None else []) + (
        ["compress="] if compress is not None and compress.any else [])
    what += [f"parameter {name!r}, gathered apart (FSDP2's all-gather extension or param_dtype_override_fn)"
             for name, p in _managed(modules, ignored)
             if id(p) in own_dtype or has_extension(p._local_tensor if isinstance(p, DTensor) else p)][:1]
    if what:
        raise NotImplementedError(f"fully_shard: reshard_after_forward={size} (reshard to groups of {size} ranks) "
                                  f"is not supported by overlap with {what[0]}; use True or False")


def _shard_dims(modules: list[nn.Module], shard_placement_fn: object, ignored: frozenset[int],
                own_dtype: frozenset[int], compress: Optional[Compression]) -> dict[int, int]:
    """``shard_placement_fn``'s placements, checked: by parameter ``id``, the dim of each ``Shard(d)``
    with ``d`` > 0 (a negative ``d`` counts from the end, as in FSDP2); ``None`` and ``Shard(0)`` are
    dim 0 and not listed. What the runtime cannot shard on another dim raises, naming the parameter
    ([Note: sharding on another dim] in ``overlap/dim_sharding.py``)."""
    if shard_placement_fn is None:
        return {}
    if not callable(shard_placement_fn):
        raise TypeError(f"fully_shard: shard_placement_fn must be None or a callable, got "
                        f"{type(shard_placement_fn).__name__}")
    dims: dict[int, int] = {}
    for name, p in _managed(modules, ignored):
        placement = shard_placement_fn(p)
        if placement is None:
            continue
        if type(placement) is not Shard:
            raise NotImplementedError(f"fully_shard: shard_placement_fn returned {placement!r} for parameter "
                                      f"{name!r}; overlap shards on a dim: return None or Shard(dim)")
        ndim = p.dim()
        dim = placement.dim + ndim if placement.dim < 0 else placement.dim
        if not 0 <= dim < max(ndim, 1):
            raise ValueError(f"fully_shard: shard_placement_fn returned {placement!r} for parameter {name!r} of "
                             f"{ndim} dims; the dim must be in [-{ndim}, {ndim})")
        if dim == 0:
            continue
        local = p._local_tensor if isinstance(p, DTensor) else p
        if has_extension(local) or id(p) in own_dtype:
            raise NotImplementedError(f"fully_shard: parameter {name!r} is gathered apart (FSDP2's all-gather "
                                      f"extension or param_dtype_override_fn) and sharded on dim {dim}; overlap "
                                      f"shards those on dim 0 (return None or Shard(0) for it)")
        if compress is not None and compress.any:
            raise NotImplementedError(f"fully_shard: parameter {name!r} is sharded on dim {dim} with compress=; "
                                      f"compressed collectives shard on dim 0 (return None or Shard(0), or pass "
                                      f"compress=None)")
        dims[id(p)] = dim
    return dims


def _modules(module: object) -> list[nn.Module]:
    if isinstance(module, nn.Module):
        return [module]
    if isinstance(module, (list, tuple)) and module and all(isinstance(m, nn.Module) for m in module):
        if len({id(m) for m in module}) != len(module):
            raise ValueError("fully_shard: module lists a module twice")
        return list(module)
    raise TypeError(f"fully_shard: module must be a torch.nn.Module or a non-empty list of them, got "
                    f"{type(module).__name__}")


def fully_shard(
    module: Union[nn.Module, list[nn.Module]],
    *,
    mesh: Optional[DeviceMesh] = None,
    reshard_after_forward: Union[bool, int, None] = None,
    shard_placement_fn: Optional[Callable[[nn.Parameter], Any]] = None,
    mp_policy: Any = None,
    offload_policy: Any = None,
    ignored_params: Optional[set[nn.Parameter]] = None,
    dp_mesh_dims: Any = None,
    prefetch: Union[int, str] = 1,
    max_inflight_bytes: Optional[int] = None,
    compress: Optional[Compression] = None,
) -> Any:
    """Shard ``module`` (or the list ``module``, as one group) in place, FSDP2's way, on this runtime.

    The arguments are FSDP2's (table in the module docstring); those this runtime cannot honour
    raise an error naming the option and what to use instead, before anything changes. Returns
    ``module`` as passed (a list stays the list); each module's class becomes ``Sharded<cls>``, a
    ``ShardedModule`` carrying FSDP2's ``FSDPModule`` methods. Call it on each block, then on the
    root, as with FSDP2; ``overlap.shard`` is the same runtime under this project's own options.
    """
    modules = _modules(module)
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard: mesh must be a DeviceMesh or None, got {type(mesh).__name__}")
    spmd = resolve_spmd_mesh(mesh, dp_mesh_dims) if dp_mesh_dims is not None else None
    mp = _mixed_precision(mp_policy)
    _check_offload(offload_policy)
    if ignored_params is not None and not (isinstance(ignored_params, (set, frozenset, list, tuple))
                                           and all(isinstance(p, torch.Tensor) for p in ignored_params)):
        raise TypeError(f"fully_shard: ignored_params must be None or a set of parameters, got "
                        f"{type(ignored_params).__name__}")
    ignored = frozenset(id(p) for p in ignored_params or ())
    mp = _gradient_dtype_default(mp, mp_policy, modules, ignored)
    own_dtype = _kept_in_own_dtype(mp_policy, modules, ignored)
    reshard = _reshard_after_forward(reshard_after_forward, mesh if spmd is None else spmd.dp_mesh)
    post_forward_size = None if isinstance(reshard, bool) else reshard
    check_compression(compress, "fully_shard")
    if post_forward_size is not None:
        _check_post_forward_size(post_forward_size, spmd, compress, own_dtype, modules, ignored)
        reshard = True
    for member in modules:
        _check_options(member, mp, reshard, prefetch, max_inflight_bytes, caller="fully_shard")
    shard_dims = _shard_dims(modules, shard_placement_fn, ignored, own_dtype, compress)
    _shard(modules, group=None, mesh=mesh if spmd is None else spmd.dp_mesh, mp=mp, reshard_after_forward=reshard,
           prefetch=prefetch, max_inflight_bytes=max_inflight_bytes, ignored_params=ignored, caller="fully_shard", compress=compress,
           own_dtype_params=own_dtype, spmd=spmd, shard_dims=shard_dims, post_forward_size=post_forward_size)
    if mp is not None and mp.output_dtype is not None:
        # FSDP2 casts every sharded module's output (overlap.shard: the root's only).
        output_dtype = mp.output_dtype
        for member in modules:
            member.register_forward_hook(lambda _m, _a, out: _cast_floating(out, output_dtype))
            member._overlap_state.output_cast = output_dtype
    assert all(isinstance(m, ShardedModule) for m in modules)
    return module


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """FSDP2's ``register_fsdp_forward_method``: ``module.<method_name>(...)`` runs the sharded
    module's pre-forward and post-forward around it, as a call of ``forward`` does (its parameters
    gathered and registered unsharded, resharded after, backward hooked, ``output_dtype`` cast where
    ``fully_shard`` casts ``forward``'s output). For methods that read the module's own parameters
    without calling ``forward``, such as an encoder's ``encode`` or a generation entry point.

    A no-op on a module that is not sharded, as FSDP2's. torch's own function is a no-op on this
    runtime's modules (they are not torch ``FSDPModule`` subclasses): import this one from
    ``overlap`` beside ``fully_shard``. ValueError if ``module`` has no such method."""
    if not isinstance(module, ShardedModule):
        return
    if not isinstance(method_name, str) or not callable(getattr(module, method_name, None)):
        raise ValueError(f"register_fsdp_forward_method: method_name must name a method of {type(module).__name__}, "
                         f"got {method_name!r}")
    method = getattr(module, method_name)
    state = module._overlap_state
    grouped = len(state.modules) > 1
    pre = eager_hook(state.member_pre_forward if grouped else state.pre_forward)
    post = eager_hook(state.member_post_forward if grouped else state.post_forward)

    @functools.wraps(method)
    def wrapped(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if state.method_running:  # one registered method inside another: the outer one's hooks stand
            return method(*args, **kwargs)
        args, kwargs = pre(self, args, kwargs)
        state.method_running = True  # a forward it calls (generate's) runs inside these hooks
        try:
            output = method(*args, **kwargs)
        finally:
            state.method_running = False
        output = post(self, args, output)
        return output if state.output_cast is None else _cast_floating(output, state.output_cast)

    setattr(module, method_name, wrapped.__get__(module, type(module)))


def share_comm_ctx(modules: list[nn.Module]) -> None:
    """FSDP2's ``share_comm_ctx``: several roots (a pipeline stage's model chunks, each its own root)
    share their communication streams, so that memory is not fragmented across per-root streams.
    Here every sharded module already uses the process's one stream per (device, purpose) ([Note:
    one stream per purpose] in ``overlap/streams.py``), whichever root it belongs to, so there is
    nothing to join: this checks the argument as FSDP2 does. torch's own function raises on this
    runtime's modules (they are not torch ``FSDPModule`` subclasses): import this one from
    ``overlap``. ValueError, before anything else, for an entry that is not a sharded module."""
    if not isinstance(modules, (list, tuple)):
        raise TypeError(f"share_comm_ctx: modules must be a list of sharded modules, got {type(modules).__name__}")
    for module in modules:
        if not isinstance(module, ShardedModule):
            raise ValueError(f"share_comm_ctx: modules must hold modules sharded by overlap.fully_shard or "
                             f"overlap.shard, got a {type(module).__name__}")
