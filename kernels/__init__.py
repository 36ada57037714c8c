"""Fused Triton packing kernels for sharded (FSDP-style) collectives, with pure-torch references.

Each op is one Triton launch over all parameters of a group (see ``kernels._launch``); the layout of
shards and flat buffers is ``ShardLayout``; the device memory of the kernels' tables (uploads, use
from several streams, release, CUDA graph capture) is ``kernels.table_memory``. Importing this
package registers the ops as ``torch.ops.overlap.*`` (``kernels.library``). Knows nothing of process
groups.
"""
from kernels.all_gather_copy_in import all_gather_copy_in, all_gather_copy_in_ref
from kernels.all_gather_copy_out import all_gather_copy_out, all_gather_copy_out_ref
from kernels.layout import ShardLayout
from kernels.reduce_scatter_copy_in import reduce_scatter_copy_in, reduce_scatter_copy_in_ref
from kernels.reduce_scatter_copy_out import reduce_scatter_copy_out, reduce_scatter_copy_out_ref
from kernels import library as _library  # noqa: F401  (registers torch.ops.overlap.*)
from kernels import unchecked  # noqa: F401  (the ops without argument checks, for the runtime)

__all__ = [
    "ShardLayout",
    "all_gather_copy_in",
    "all_gather_copy_in_ref",
    "all_gather_copy_out",
    "all_gather_copy_out_ref",
    "reduce_scatter_copy_in",
    "reduce_scatter_copy_in_ref",
    "reduce_scatter_copy_out",
    "reduce_scatter_copy_out_ref",
    "unchecked",
]
