"""``overlap.tensor_parallel(module, mesh, plan)``: torch's TP plan, with the collectives of its
linear layers decomposed and overlapped with their matmuls.

Contract. The plan is ``parallelize_module``'s: a dict from a submodule key (dot-separated, each
part an ``fnmatch`` pattern over child names, ``""`` the module itself) to one of torch's own
styles, or one style for ``module`` itself. Every entry is resolved and checked first
(``overlap.tensor_parallelism.plan``); on any problem (a key that names no submodule, a style or
layout combination it does not support, a dim that does not divide, a mesh that is not a 1-D
DeviceMesh) a ``TypeError`` / ``ValueError`` names the entry and what is allowed, and nothing has
been changed. Then the entries are applied in the plan's order: Colwise / Rowwise on ``nn.Linear``
by ``overlap.tensor_parallelism.layers``, every other supported entry by torch's
``parallelize_module`` on that submodule (torch's own style; a ``PrepareModuleInput`` that gathers a
sequence-sharded input leaves that gather to the column-parallel layers reading it,
``overlap.tensor_parallelism.deferred_gather``). Parameters end up the DTensors torch
TP makes (same placements, same shards from rank 0's values), so DCP, state dicts,
``clip_grad_norm_`` and optimizers see what they see with torch TP; the module's numerics are
torch's (bitwise with ``chunks=1``; see ``collective_matmul`` for the decomposed order).

Unlike ``parallelize_module``, a key that matches nothing is an error rather than a warning.
"""
from __future__ import annotations

from fnmatch import fnmatch
from typing import Any, Optional

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle

from overlap.tensor_parallelism.chunks import check_chunks
from overlap.tensor_parallelism.deferred_gather import deferring
from overlap.tensor_parallelism.layers import TensorParallelLinear, parallelize_linear
from overlap.tensor_parallelism.plan import DELEGATE, KNOWN_STYLES, LinearPlan, layer_plan

__all__ = ["tensor_parallel"]


def _resolve(module: nn.Module, key: str) -> list[tuple[str, nn.Module]]:
    """The submodules ``key`` names, with their fqns (``parallelize_module``'s matching rule)."""
    found = [("", module)]
    if key == "":
        return found
    for token in key.split("."):
        found = [(f"{fqn}.{name}" if fqn else name, child)
                 for fqn, parent in found for name, child in parent.named_children() if fnmatch(name, token)]
    return found


def _check_mesh(mesh: object) -> DeviceMesh:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"tensor_parallel: mesh must be a 1-D torch.distributed DeviceMesh (the TP dim; slice an "
                        f"N-D one: mesh['tp']), got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(f"tensor_parallel: mesh must be a 1-D DeviceMesh (the TP dim; slice this {mesh.ndim}-D one: "
                         f"mesh[name] with name one of {mesh.mesh_dim_names}), got a {mesh.ndim}-D mesh")
    return mesh


def tensor_parallel(module: nn.Module, mesh: DeviceMesh, plan: Any, *, chunks: Optional[int] = None) -> nn.Module:
    """Parallelize ``module`` over the 1-D ``mesh`` by ``plan`` (torch's ``parallelize_module`` plan)
    in place, with decomposed collective matmuls; returns ``module``.

    ``chunks``: how many chunks each decomposed collective is cut into (None: chosen per call from
    the sizes and, behind an emulated link, the link; ``1``: torch's undecomposed order, bitwise).
    Raises ``TypeError`` / ``ValueError`` naming the argument or plan entry before anything changes.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"tensor_parallel: module must be a torch.nn.Module, got {type(module).__name__}")
    mesh = _check_mesh(mesh)
    chunks = check_chunks(chunks)
    if isinstance(plan, ParallelStyle):
        plan = {"": plan}
    if not isinstance(plan, dict) or not all(isinstance(k, str) for k in plan):
        raise TypeError(f"tensor_parallel: plan must be a dict of submodule name (str) to a torch ParallelStyle "
                        f"({KNOWN_STYLES}), or one style, got {type(plan).__name__}")
    steps: list[tuple[nn.Module, Any, Any]] = []
    linear_entries: dict[int, str] = {}
    for key, style in plan.items():
        targets = _resolve(module, key)
        if not targets:
            raise ValueError(f"tensor_parallel: plan key {key!r} names no submodule of {type(module).__name__} "
                             f"(keys are dot-separated child names, fnmatch patterns allowed, '' the module itself)")
        for fqn, sub in targets:
            if isinstance(sub, TensorParallelLinear) or any(isinstance(p, DTensor) for p in sub.parameters()):
                raise ValueError(f"tensor_parallel: plan key {key!r}: submodule {fqn or '<root>'!r} already has "
                                 f"DTensor parameters (parallelized or sharded before); parallelize plain modules")
            spec = layer_plan(fqn, sub, style, mesh.size(), chunks)
            if isinstance(spec, LinearPlan):
                if id(sub) in linear_entries:
                    raise ValueError(f"tensor_parallel: plan keys {linear_entries[id(sub)]!r} and {key!r} both "
                                     f"parallelize the Linear {fqn!r}; give it one ColwiseParallel or RowwiseParallel")
                linear_entries[id(sub)] = key
            steps.append((sub, style, spec))
    for sub, style, spec in steps:
        if spec == DELEGATE:  # torch's style (a PrepareModuleInput's sequence gather left to the layers)
            parallelize_module(sub, mesh, deferring(style))
        else:
            parallelize_linear(sub, mesh, spec)
    return module
