"""FX graph rewrite: CPU all-gathers through ``all_gather_into_tensor_out`` on a snapshot of the input,
so that several can be in flight on gloo and the input's memory can be reused at once.

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
CPU tensor with an ``empty`` output buffer and :data:`SNAPSHOT_ALL_GATHER_OUT` into it, in the same
place: the same collective, the same bytes and group, a wait (``wait_tensor``) of the output,
through the entry point that holds up. Graphs the hook does not compile (``overlap_pass``
on a traced graph) keep the functional op. CUDA graphs are left alone: they stay what Inductor
emits (whether NCCL's coalesced path has the same problem is not known; no GPU has run this).
Eager code of this project never used the coalesced path (``overlap.collectives`` calls
``dist.all_gather_into_tensor``); the emulated link routes functional CPU all-gathers the same way
(``overlap.testing.emulated_link.functional``).

[Note: the out variant's input is snapshotted]
Inductor keeps a collective's input buffer alive until the collective's wait only for the
out-of-place ops (``_WaitKernel.get_volatile_reads``: the wait "reads" the collective's input). It
lowers ``all_gather_into_tensor_out`` as an in-place collective, whose input it takes to be the
output, so the wait of ``out`` holds nothing else, and the input buffer is free for reuse as soon as
the gather is issued. gloo reads the input later, on its worker thread (``_allgather_base`` ->
``AsyncAllgatherWork::run``). Torch 2.15 does reuse it: in the forward of torch's sequence-parallel
attention split in 2 chunks, ``buf17 = reinterpret_tensor(buf4, ...); del buf4  # reuse`` came right
after the first chunk's wait, and the kernel writing ``buf17`` overwrote the rows the second chunk's
gather was still sending; that chunk's rows of q, k, v and every gradient behind them came out
wrong in 19-64 of 200 compiled steps (2 ranks, the rate varying with the box's load; none on torch
2.13, whose code only dropped the reference). Rank 0's output could still be right (causal
attention: its sequence block reads no later rows) while its gradients were not, as in the CI
failure (``x.grad`` wrong, the output checked before it right). A ``del`` alone is harmless (the work holds a reference); an in-place reuse is not.
Hence :data:`SNAPSHOT_ALL_GATHER_OUT`: it copies the input at issue, on the caller's thread, and
gathers the copy, which only the work holds (contract 2 of the design: a collective's input may be
changed right after issue). It costs one copy of the shard (1/group size of the gathered bytes).
Torch's own bucketing avoids the copy by gathering in place from a slice of the output at the
rank's offset; that bakes the rank into the graph after Inductor's FX graph cache key was taken
(the same key on every rank), so it is not done here.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from scheduler.fx_nodes import ALL_GATHER

__all__ = ["ALL_GATHER_OUT", "SNAPSHOT_ALL_GATHER_OUT", "snapshot_all_gather_into_tensor_out",
           "use_out_variant_on_cpu"]

ALL_GATHER_OUT = torch.ops._c10d_functional.all_gather_into_tensor_out.default


def snapshot_all_gather_into_tensor_out(input: torch.Tensor, group_size: int, group_name: str,
                                        out: torch.Tensor) -> None:
    """Issue torch's ``all_gather_into_tensor_out(input, group_size, group_name, out=out)`` on a copy of
    ``input`` taken now, and return at once; ``wait_tensor(out)`` waits for it. ``input`` may be
    changed or its memory reused as soon as this returns; ``out`` must not be read before the wait.
    See [Note: the out variant's input is snapshotted]."""
    ALL_GATHER_OUT(input.clone(memory_format=torch.contiguous_format), group_size, group_name, out=out)


# A plain library definition, not torch.library.custom_op: its Python wrapper cost ~80 us per call
# on this box, this one ~25 us (small gathers, 1-rank gloo, side by side).
_LIBRARY = torch.library.Library("overlap", "FRAGMENT")
_LIBRARY.define("snapshot_all_gather_into_tensor_out(Tensor input, int group_size, str group_name, "
                "Tensor(a!) out) -> ()")
_LIBRARY.impl("snapshot_all_gather_into_tensor_out", snapshot_all_gather_into_tensor_out,
              "CompositeExplicitAutograd")


@torch.library.register_fake("overlap::snapshot_all_gather_into_tensor_out", lib=_LIBRARY)
def _(input: torch.Tensor, group_size: int, group_name: str, out: torch.Tensor) -> None:
    return None


SNAPSHOT_ALL_GATHER_OUT = torch.ops.overlap.snapshot_all_gather_into_tensor_out.default
"""The op :func:`use_out_variant_on_cpu` emits (``torch.ops.overlap.snapshot_all_gather_into_tensor_out``)."""


def use_out_variant_on_cpu(graph: torch.fx.Graph) -> int:
    """Rewrite every ``all_gather_into_tensor`` of ``graph`` whose result (``meta["val"]``) is a
    CPU tensor into ``empty`` + :data:`SNAPSHOT_ALL_GATHER_OUT` into it, in place; readers of the
    gather (its ``wait_tensor``) read the ``empty`` buffer instead. Returns how many. A symbolic size
    of the output (a graph compiled with dynamic shapes) is read from the input in the graph
    (``sym_size``, times the group size on dim 0). Nodes without a value are left alone. See
    [Note: gloo's coalesced all-gather with two in flight] and [Note: the out variant's input is
    snapshotted]."""
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
            gather = graph.call_function(SNAPSHOT_ALL_GATHER_OUT, (*node.args, out))
        out.meta.update(node.meta)
        gather.meta["val"] = None
        node.replace_all_uses_with(out)
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
