"""Fused Triton packing kernels for sharded (FSDP-style) collectives, with pure-torch references.

Each op is one Triton launch over all parameters of a group, and one module owns everything about
it (kernel, checks, public function, its ``torch.ops.overlap.*`` op, torch fallback, reference):
``overlap_kernels.all_gather_copy_in`` and its three siblings; for tensor parallelism's decomposed
collectives, ``overlap_kernels.chunk_place`` and ``overlap_kernels.chunk_pack`` (one chunk buffer each, see
``overlap_kernels.chunk_layout``). What they share: the layout of shards and flat
buffers (``ShardLayout``), the launch and its tables (``overlap_kernels._launch``), the device-side helpers
(``overlap_kernels._jit``; every helper is declared with ``overlap_kernels._device_function``), the
argument checks (``overlap_kernels._checks``), the torch fallback's plans
(``overlap_kernels._torch_fallback``), the supported dtypes (``overlap_kernels._dtypes``), the ``torch.library``
plumbing (``overlap_kernels.library``) and the device memory of the tables (``overlap_kernels.table_memory``).
Importing this package registers the ops. Knows nothing of process groups.
"""
from overlap_kernels.all_gather_copy_in import all_gather_copy_in, all_gather_copy_in_ref
from overlap_kernels.all_gather_copy_out import all_gather_copy_out, all_gather_copy_out_ref
from overlap_kernels.chunk_pack import chunk_pack, chunk_pack_ref
from overlap_kernels.chunk_place import chunk_place, chunk_place_ref
from overlap_kernels.layout import ShardLayout
from overlap_kernels.reduce_scatter_copy_in import reduce_scatter_copy_in, reduce_scatter_copy_in_ref
from overlap_kernels.reduce_scatter_copy_out import reduce_scatter_copy_out, reduce_scatter_copy_out_ref

__all__ = [
    "ShardLayout",
    "all_gather_copy_in",
    "all_gather_copy_in_ref",
    "all_gather_copy_out",
    "all_gather_copy_out_ref",
    "chunk_pack",
    "chunk_pack_ref",
    "chunk_place",
    "chunk_place_ref",
    "reduce_scatter_copy_in",
    "reduce_scatter_copy_in_ref",
    "reduce_scatter_copy_out",
    "reduce_scatter_copy_out_ref",
]
