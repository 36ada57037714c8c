"""What the four op modules share for their ``torch.library`` ops (``torch.ops.overlap.*``).

Contract: each op module registers its own op beside its implementation (``torch.library.custom_op``
plus ``register_fake``, both running the op's argument checks), tagged ``CUDAGRAPH_UNSAFE_TAGS``,
taking the layout as its ``spec`` (``layout``: spec -> cached ``ShardLayout``). Its public function
goes through the op only when ``use_dispatcher`` says so. Nothing here knows an op.

[Note: why custom_op and not triton_op]
The kernels take a *pointer table* (data addresses of the N parameter-side tensors, see
``overlap_kernels._launch``) so that one launch covers N tensors of any shapes. ``torch.library.triton_op``
traces its body with fake tensors under ``torch.compile``, where data addresses do not exist, and
Inductor would need every tensor as a separate kernel argument. So the ops are opaque
``torch.library.custom_op``s with fake implementations: they trace in ``make_fx`` and
``torch.compile`` (Inductor calls them as extern kernels), and at run time dispatch on device
(Triton on CUDA or under the interpreter, the torch fallback otherwise).

The public functions (``overlap_kernels.all_gather_copy_in`` ...) call the launchers directly in eager mode —
a custom-op call pays the dispatcher's overhead for each of its hundreds of tensors — and go through
these ops while Dynamo traces or a dispatch mode is active (``use_dispatcher``). Ops take the layout
as its ``spec`` (a flat int list); ``ShardLayout.from_spec`` rebuilds and caches it.

[Note: ops in CUDA graphs]
On CUDA with Triton the four ops are capture-safe: their launch path allocates nothing pinned,
waits on nothing and syncs nothing during capture, and the tables their kernels read stay valid
for as long as a graph may replay (``overlap_kernels.table_memory``). CUDA tensors under
``TRITON_INTERPRET`` take the torch fallback instead, whose NaN check (``_torch_fallback.has_nan``)
reads a value back to the host: in that configuration the ops are registered with
``torch.Tag.cudagraph_unsafe``, so that Inductor's CUDA graphs leave them out
(``CUDAGRAPH_UNSAFE_TAGS``).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from overlap_kernels._checks import plain_tensors
from overlap_kernels._jit import INTERPRET
from overlap_kernels.layout import ShardLayout


def _cudagraph_tags(interpret: bool) -> tuple[torch.Tag, ...]:
    """The tags of the ops: ``cudagraph_unsafe`` when CUDA tensors would take the torch fallback
    ([Note: ops in CUDA graphs]); none on a torch without that tag."""
    unsafe = getattr(torch.Tag, "cudagraph_unsafe", None)
    return (unsafe,) if interpret and unsafe is not None else ()


CUDAGRAPH_UNSAFE_TAGS = _cudagraph_tags(INTERPRET)


def layout(spec: Sequence[int]) -> ShardLayout:
    """The layout an op's ``spec`` argument stands for (cached: ``ShardLayout.from_spec``)."""
    return ShardLayout.from_spec(tuple(spec))


_LOSES_VIEW_WRITES = torch.__version__ < (2, 13)


def check_compiled_views(op: str, name: str, tensors: Sequence[torch.Tensor]) -> None:
    """Raise ``RuntimeError`` naming ``op``, ``name`` and the torch needed when Dynamo traces a call
    that writes two views of one tensor on torch < 2.13.

    Torch 2.11's Inductor writes a custom op's mutations of several views of one base back wrong
    (later views come back unwritten or as uninitialized memory; reproduced with a one-line
    ``torch.library.custom_op``). Separate tensors, or views of different tensors, are fine.
    """
    if not _LOSES_VIEW_WRITES or not torch.compiler.is_compiling():
        return
    bases: list[torch.Tensor] = []
    for t in tensors:
        base = t._base
        if base is None:
            continue
        if any(base is b for b in bases):
            raise RuntimeError(
                f"{op}: {name} holds several views of one tensor; under torch.compile, torch "
                f"{torch.__version__} loses an op's writes to such views (fixed in torch 2.13). Pass separate "
                f"tensors, or call {op} outside the compiled region, or use torch >= 2.13")
        bases.append(base)


def use_dispatcher(tensors: Sequence[torch.Tensor]) -> bool:
    """Route through ``torch.ops.overlap.*`` (traceable) instead of launching directly (fast eager).

    True while Dynamo traces, while a TorchDispatchMode (make_fx, FakeTensorMode) is active, or when a
    tensor is a subclass (fake, functional, ...): cases where data pointers do not exist or where the
    op must be recorded.
    """
    return dispatch_active() or not plain_tensors(tensors)


def dispatch_active() -> bool:
    """``use_dispatcher``'s O(1) part: Dynamo traces, or a TorchDispatchMode is active (a list that
    matched a prepared launch's fingerprint holds plain tensors only: ``overlap_kernels.prepared_launch``)."""
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0
