"""FX graph rewrite: CPU all-gathers through ``all_gather_into_tensor_out``, so that several can be in
flight on gloo.

[Note: gloo's coalesced all-gather with two in flight]
On torch 2.13 (CPU build, gloo), ``torch.ops._c10d_functional.all_gather_into_tensor`` reaches the
process group through ``allgather_into_tensor_coalesced``, and two of those in flight at once
corrupt the heap: glibc aborts with "malloc(): unaligned tcache chunk detected", or the process
segfaults, a few thousand collectives in. Seen with no code of this project involved, on 2 gloo
ranks: a loop issuing two functional all-gathers of 32 KiB and then waiting both crashed 4 runs of
6 (4000 iterations each); ``ProcessGroup.allgather_into_tensor_coalesced`` called directly, 3 of 5.
One in flight at a time (0 of 6), ``dist.all_gather_into_tensor(..., async_op=True)`` (gloo's
``_allgather_base``, 0 of 6), ``all_gather_into_tensor_out`` (also ``_allgather_base``, 0 of 5), and
functional reduce-scatters and all-reduces two at a time (0 of 5 each) did not crash.

An overlapped compiled graph is exactly the case: the overlap pass issues the next all-gathers
before the waits of the previous ones, and the collective-matmul split issues all of a gather's
chunks at once. So the Inductor hook (``scheduler.inductor_hook``), last, after every rewrite and
the reorder, calls :func:`use_out_variant_on_cpu`, which replaces each all-gather whose result is a
CPU tensor with an ``empty`` output buffer and ``all_gather_into_tensor_out`` into it, in the same
place: the same collective, the same bytes and group, the same wait (``wait_tensor`` of the
output), through the entry point that holds up. Graphs the hook does not compile (``overlap_pass``
on a traced graph) keep the functional op. CUDA graphs are left alone: they stay what Inductor
emits (whether NCCL's coalesced path has the same problem is not known; no GPU has run this).
Eager code of this project never used the coalesced path (``overlap.collectives`` calls
``dist.all_gather_into_tensor``); the emulated link routes functional CPU all-gathers the same way
(``overlap.testing.emulated_link.functional``).
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from scheduler.fx_nodes import ALL_GATHER

__all__ = ["ALL_GATHER_OUT", "use_out_variant_on_cpu"]

ALL_GATHER_OUT = torch.ops._c10d_functional.all_gather_into_tensor_out.default


def use_out_variant_on_cpu(graph: torch.fx.Graph) -> int:
    """Rewrite every ``all_gather_into_tensor`` of ``graph`` whose result (``meta["val"]``) is a
    CPU tensor into ``empty`` + ``all_gather_into_tensor_out``, in place; return how many. A
    symbolic size of the output (a graph compiled with dynamic shapes) is read from the input in the
    graph (``sym_size``, times the group size on dim 0). Nodes without a value are left alone. See
    [Note: gloo's coalesced all-gather with two in flight]."""
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not ALL_GATHER:
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.device.type != "cpu":
            continue
        with graph.inserting_before(node):
            shape = _output_shape(graph, node)
            out = graph.call_function(torch.ops.aten.empty.memory_format, (shape,),
                                      {"dtype": val.dtype, "device": val.device, "pin_memory": False})
            gather = graph.call_function(ALL_GATHER_OUT, tuple(node.args), {"out": out})
        out.meta["val"] = val
        gather.meta.update(node.meta)
        node.replace_all_uses_with(gather)
        graph.erase_node(node)
        rewritten += 1
    return rewritten


def _output_shape(graph: torch.fx.Graph, gather: torch.fx.Node) -> list:
    """The gathered shape as ``empty`` takes it: ints where static, size nodes of the input where
    symbolic (inserted at the graph's current insertion point)."""
    x, group_size = gather.args[0], gather.args[1]
    shape: list = []
    for dim, size in enumerate(gather.meta["val"].shape):
        if isinstance(size, int):
            shape.append(size)
            continue
        in_size = x.meta["val"].shape[dim]
        size_node = graph.call_function(torch.ops.aten.sym_size.int, (x, dim))
        size_node.meta["val"] = in_size
        if dim == 0:
            size_node = graph.call_function(operator.mul, (size_node, group_size))
            size_node.meta["val"] = in_size * group_size
        shape.append(size_node)
    return shape
