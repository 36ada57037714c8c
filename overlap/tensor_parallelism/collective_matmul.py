"""Collective matmuls, decomposed: a linear layer's collective cut into chunks, each chunk's matmul
run while the other chunks are on the link.

Four autograd functions on *local* tensors (the caller unwraps DTensors and wraps the results, see
``overlap.tensor_parallelism.layers``). ``w`` ranks, this rank ``r``; ``x`` is ``(*lead, S, *rest,
in)`` with the sequence (chunked) dim ``d`` anywhere but last; ``W`` this rank's weight shard:

=======================  =====================  ==========================  ==========================
function (torch style)   forward                backward: input grad        backward: weight grad
=======================  =====================  ==========================  ==========================
AllGatherMatmul          all-gather x on ``d``  matmul -> reduce-scatter    needs the gathered x: kept
(Colwise, Shard(d) in)   -> matmul per chunk    on ``d``, per chunk         from forward; its matmul
                                                                            runs while the last
                                                                            reduce-scatters fly
MatmulReduceScatter      matmul per chunk ->    all-gather of grad-out per  accumulated per landed
(Rowwise, Shard(d) out)  reduce-scatter on ``d``  chunk -> matmul per chunk   chunk (chunks > 1)
MatmulAllReduce          matmul per row block   local (the grad-out is      local
(Rowwise, Replicate out) -> all-reduce          replicated)
LinearAllReduceGrad      local                  matmul per row block ->     local, while the last
(Colwise, Replicate in)                         all-reduce                  all-reduces fly
=======================  =====================  ==========================  ==========================

[Note: decomposing a collective matmul]
All-gather -> matmul: chunk ``k`` of the gather carries the ``k``-th sub-slice of every rank's
shard along ``d`` (one all-gather per chunk, every rank contributing, so each chunk is a plain
collective that the link, the profiler, debug mode and the byte budget all know). All chunks are
issued at once (FIFO on the group's link); this rank's own shard is multiplied first, with no
wait, then each chunk's pieces as soon as that chunk has landed. The gathered input is assembled
as the chunks land and kept for the weight gradient (as torch keeps its gathered input: no
re-gather in backward).
Matmul -> reduce-scatter: chunk ``k``'s partial products (rows of the ``k``-th sub-slice of every
destination rank's slice) are computed, packed rank-major and their reduce-scatter issued before
chunk ``k + 1`` is computed; the results are waited for at the end.
Matmul -> all-reduce: the same with row blocks of the flattened input, reduced in place. A
row-parallel layer's replicated bias enters each rank's addend as ``bias / w`` (what DTensor makes
of a ``Replicate()`` bias added to a ``Partial()`` product), not after the reduction.
Uneven shards (``S`` not divisible by ``w``: torch.chunk's rule, as DTensor's ``Shard``) are
padded to the widest rank's sub-slice inside the chunk buffers only; padding is never read.
``chunks == 1`` is torch's own order: one collective, one matmul on the whole operand (bitwise
torch's results for the same collective sum order).

[Note: streams and waits of the decomposed collectives]
Every collective goes through ``overlap.collectives``' in-place building blocks
(``all_gather_into``, ``reduce_scatter_into``, ``all_reduce_into``): on CUDA it runs on the
comm stream of its kind after the current stream's work (the chunk's packed input is ready) and a
wait makes the current stream wait on its event, so the host never blocks and a chunk's matmul is
queued behind exactly that chunk's collective; the chunk buffers are held by the in-flight work
until that wait ([Note: cross-stream buffer lifetime]). On CPU (gloo) each chunk is an async work
waited on the host just before its first reader. Chunks are issued in the same order on every
rank, and the chunk count is computed from global sizes only (contract 3).
"""
from __future__ import annotations

import contextlib
import itertools
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F

from overlap_kernels.chunk_pack import chunk_pack
from overlap_kernels.chunk_place import chunk_place
from overlap.collectives import all_gather_into, all_reduce_into, reduce_scatter_into
from overlap.groups import GroupInfo
from overlap.inflight_work import InflightWork
from overlap.regions import region

__all__ = ["AllGatherMatmul", "Call", "LinearAllReduceGrad", "MatmulAllReduce", "MatmulReduceScatter",
           "SeqLayout", "gathered", "shared_gather_kept", "shard_sizes", "split_sizes"]


def shard_sizes(n: int, w: int) -> list[int]:
    """Each of ``w`` ranks' extent of a dim of size ``n`` under torch.chunk's rule (DTensor's
    ``Shard``): ``ceil(n / w)`` each, the last ranks fewer or none."""
    per = -(-n // w)
    return [max(0, min(per, n - i * per)) for i in range(w)]


def split_sizes(n: int, c: int) -> list[int]:
    """``n`` rows in ``c`` consecutive parts, the first ``n % c`` one row longer."""
    q, extra = divmod(n, c)
    return [q + (1 if i < extra else 0) for i in range(c)]


def _starts(sizes: list[int]) -> list[int]:
    out, at = [], 0
    for s in sizes:
        out.append(at)
        at += s
    return out


class SeqLayout:
    """The chunked dim ``dim``: every rank's extent (``sizes``) cut into ``chunks`` sub-slices.

    ``piece(j, k)`` is ``(start in the full dim, length)`` of rank ``j``'s ``k``-th sub-slice;
    ``width(k)`` the longest of chunk ``k``'s sub-slices (its buffer's extent); chunks of width 0
    (no rank has rows there) are skipped by everyone alike."""

    def __init__(self, sizes: list[int], dim: int, chunks: int, rank: int) -> None:
        self.sizes, self.dim, self.rank = sizes, dim, rank
        self.starts = _starts(sizes)
        self.sub = [split_sizes(s, chunks) for s in sizes]
        self.sub_starts = [_starts(s) for s in self.sub]
        self.widths = [max(col) for col in zip(*self.sub)]
        self.chunks = [k for k, width in enumerate(self.widths) if width > 0]

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def piece(self, j: int, k: int) -> tuple[int, int]:
        return self.starts[j] + self.sub_starts[j][k], self.sub[j][k]

    def pieces(self, k: int) -> tuple[list[int], list[int]]:
        """Chunk ``k``'s pieces, every rank's: ``(starts in the full dim, lengths)``."""
        starts, lengths = zip(*(self.piece(j, k) for j in range(len(self.sizes))))
        return list(starts), list(lengths)

    def own(self, k: int) -> tuple[int, int]:
        """This rank's ``k``-th sub-slice within its own shard: ``(start, length)``."""
        return self.sub_starts[self.rank][k], self.sub[self.rank][k]


@dataclass(frozen=True)
class Call:
    """One decomposed call: the group, the chunked dim's layout (None for row blocks), the chunk
    count, and the profiler region names of its forward and backward."""

    info: GroupInfo
    chunks: int
    forward_region: str
    backward_region: str
    layout: Optional[SeqLayout] = None


def _chunk_shape(like: torch.Tensor | tuple[int, ...], dim: int, width: int) -> tuple[int, ...]:
    """``like``'s shape (a tensor's, or a shape) with ``width`` at ``dim``."""
    shape = list(like.shape if isinstance(like, torch.Tensor) else like)
    shape[dim] = width
    return tuple(shape)


# ------------------------------------------------------------------------ one gather, several layers
def _will_run(node: object) -> bool:
    """Whether the autograd engine will run ``node`` in the current backward; False where the engine
    cannot say (outside its own execution, e.g. a traced backward): each layer then reduce-scatters
    its own gradient (and any sum deferred to it), still exact."""
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:
        return False


class _SiblingGrads:
    """The input gradient of one shared gather: the layers that read it in forward (their backward
    nodes, held weakly) and, during a backward pass, the sum of the partial input gradients of
    those that have run, for the last of them to reduce-scatter.

    [Note: sibling layers share one reduce-scatter]
    The input gradient of a gathered input is the reduce-scatter of the sum of its readers'
    partial gradients (``grad_y @ W`` each), and a reduce-scatter is linear, so the siblings that
    share a gather ([Note: sibling layers share one gather]) need one reduce-scatter, not one each:
    each sibling's backward adds its partial gradient to a running sum, unless it is the last of
    them to run in this backward pass, which reduce-scatters (running sum + its own product), chunk
    by chunk behind its own matmuls, and returns the input gradient for all of them (the others
    return none, a zero for autograd). "The last" is decided when each runs: a sibling is still to
    come when ``torch._C._will_engine_execute_node`` says the engine will run its node in this
    graph task and it has not run yet, so a sibling whose output the loss does not use, a
    ``torch.autograd.grad`` over a part of the graph, a second backward over a retained graph (a new
    graph task, a fresh sum) are all handled. Every rank runs the same graph, so every rank issues
    the same reduce-scatter at the same point (contract 3). Only layers with ``chunks > 1`` take
    part: ``chunks=1`` keeps torch's order (a reduce-scatter per layer, bitwise torch's sums); the
    shared sum adds the partial gradients before the reduction, so it equals torch's within the
    decomposed tolerance."""

    def __init__(self) -> None:
        self._members: list[weakref.ref] = []
        self._task: Optional[int] = None
        self._ran: set[int] = set()
        self._sum: Optional[torch.Tensor] = None

    def join(self, node: object) -> None:
        self._members.append(weakref.ref(node))

    def _others_to_come(self, node: object) -> bool:
        """Mark ``node`` as run in the current graph task; whether another member will still run in it."""
        task = torch._C._current_graph_task_id()
        if task != self._task:
            self._task, self._ran, self._sum = task, set(), None
        self._ran.add(id(node))
        for ref in self._members:
            other = ref()
            if other is not None and id(other) not in self._ran and _will_run(other):
                return True
        return False

    def defer(self, node: object, partial: Callable[[], torch.Tensor]) -> bool:
        """True when another member is still to run in this backward: ``partial()`` (this member's
        partial input gradient) was added to the running sum, for that member to reduce."""
        if len(self._members) < 2 or not self._others_to_come(node):
            return False
        part = partial()
        self._sum = part if self._sum is None else self._sum.add_(part)
        return True

    def take(self) -> Optional[torch.Tensor]:
        """The running sum of the members that deferred (None if none did); cleared."""
        total, self._sum = self._sum, None
        return total


class _SharedGather:
    """The last gathered input, for column-parallel layers that read the same sharded input (q, k
    and v of a sequence-parallel attention): the first gathers it, the others reuse it.

    [Note: sibling layers share one gather]
    torch's plan gives each of q, k, v its own ``Shard(1)`` input, so torch gathers the same tensor
    three times. A gathered input is a pure function of the local input (its storage, view and
    version), the layout and the group, so the next layer given the same input reuses it: no
    collective, one GEMM. Every rank runs the same layers on the same program path, so every rank
    skips the same gathers (contract 3). The entry holds its input's root tensor weakly and is
    checked against the input's version, so an in-place change or a freed input is never matched.
    It holds the gathered tensor itself until the next gather replaces it (one layer's gathered
    input at most): under activation checkpointing nothing else keeps it through the siblings'
    forwards. The siblings' gradient record is held weakly (it lives as long as a layer's backward
    node). Backward: the siblings share one reduce-scatter of their summed input gradients
    ([Note: sibling layers share one reduce-scatter])."""

    def __init__(self) -> None:
        self._root: Optional[weakref.ref] = None
        self._full: Optional[torch.Tensor] = None
        self._grads: Optional[weakref.ref] = None
        self._key: tuple = ()

    @staticmethod
    def _parts(x: torch.Tensor, layout: "SeqLayout", info: GroupInfo) -> tuple[torch.Tensor, tuple]:
        root = x._base if x._base is not None else x
        key = (x.data_ptr(), x.storage_offset(), tuple(x.shape), x.stride(), x._version, x.dtype,
               tuple(layout.sizes), layout.dim, layout.rank, id(info.pg))
        return root, key

    def lookup(self, x: torch.Tensor, layout: "SeqLayout", info: GroupInfo
               ) -> Optional[tuple[torch.Tensor, Optional[_SiblingGrads]]]:
        """(the gathered tensor, its siblings' gradient record if a layer that takes part in the
        shared reduce-scatter still holds it) if ``x`` was gathered so last."""
        if self._root is None:
            return None
        root, key = self._parts(x, layout, info)
        if self._root() is not root or key != self._key:
            return None
        return self._full, self._grads()

    def remember(self, x: torch.Tensor, layout: "SeqLayout", info: GroupInfo, full: torch.Tensor,
                 grads: _SiblingGrads) -> None:
        root, self._key = self._parts(x, layout, info)
        self._root, self._full, self._grads = weakref.ref(root), full, weakref.ref(grads)


_shared_gather = _SharedGather()


@contextlib.contextmanager
def shared_gather_kept() -> Iterator[None]:
    """Gathers inside leave the held sibling gather as it was on entry (a chunk-count trial's
    synthetic gathers must not evict a real layer's)."""
    saved = dict(vars(_shared_gather))
    try:
        yield
    finally:
        vars(_shared_gather).update(saved)


# ------------------------------------------------------------------------ chunked collectives
class _ChunkedGather:
    """All-gather of ``local`` (this rank's shard along ``layout.dim``), one collective per chunk,
    all issued on construction; :meth:`landed` waits chunk by chunk and yields the other ranks'
    pieces as ``(start in the full dim, piece)``."""

    def __init__(self, local: torch.Tensor, layout: SeqLayout, info: GroupInfo) -> None:
        self.layout, self.info = layout, info
        d, r = layout.dim, info.rank
        self.inflight: list[tuple[int, torch.Tensor, InflightWork]] = []
        for k in layout.chunks:
            buf = local.new_empty((info.size, *_chunk_shape(local, d, layout.widths[k])))
            start, length = layout.own(k)
            buf[r].narrow(d, 0, length).copy_(local.narrow(d, start, length))
            self.inflight.append((k, buf, all_gather_into(buf.view(-1), buf[r].view(-1), info)))

    def chunks_landed(self) -> Iterator[tuple[int, torch.Tensor]]:
        """Each chunk ``(k, buffer)`` as it lands (the buffer: ``(w, *chunk)``, rank ``j``'s piece in
        row ``j``)."""
        for k, buf, work in self.inflight:
            work.wait()
            yield k, buf
        self.inflight = []

    def landed(self) -> Iterator[tuple[int, torch.Tensor]]:
        d, r = self.layout.dim, self.info.rank
        for k, buf in self.chunks_landed():
            for j in range(self.info.size):
                start, length = self.layout.piece(j, k)
                if j != r and length:
                    yield start, buf[j].narrow(d, 0, length)

    def new_full(self, local: torch.Tensor) -> torch.Tensor:
        """A tensor of the gathered shape with ``local`` (this rank's shard) in its place; the other
        ranks' rows follow from :meth:`place_all` or :meth:`chunks_landed`."""
        d, r = self.layout.dim, self.info.rank
        full = local.new_empty(_chunk_shape(local, d, self.layout.total))
        full.narrow(d, self.layout.starts[r], self.layout.sizes[r]).copy_(local)
        return full

    def place_all(self, full: torch.Tensor) -> None:
        """Wait for every chunk and place the other ranks' pieces into ``full`` (one launch per chunk)."""
        for k, buf in self.chunks_landed():
            chunk_place(full, buf, *self.layout.pieces(k), self.layout.dim, self.info.rank)


class _ChunkedReduceScatter:
    """Sum over ranks of a tensor whose slices along ``layout.dim`` go to their ranks, one
    reduce-scatter per chunk: ``make(k)`` returns chunk ``k``'s buffer ``(w, *chunk)`` (row ``j``:
    this rank's addend for rank ``j``'s ``k``-th sub-slice, in its first rows; padding is summed
    but never read), of shape ``shape`` but for ``layout.dim``; chunk ``k``'s buffer is made and its
    reduce-scatter issued before chunk ``k + 1``'s is made (:func:`_packed` and :func:`_packed_then`
    make them). :meth:`finish` waits and writes this rank's rows into ``out``."""

    def __init__(self, make: Callable[[int], torch.Tensor], shape: tuple[int, ...], ref: torch.Tensor,
                 layout: SeqLayout, info: GroupInfo) -> None:
        self.layout, self.info = layout, info
        self.inflight: list[tuple[int, torch.Tensor, InflightWork]] = []
        for k in layout.chunks:
            buf = make(k)
            out = ref.new_empty(_chunk_shape(shape, layout.dim, layout.widths[k]))
            self.inflight.append((k, out, reduce_scatter_into(out.view(-1), buf.view(-1), info)))

    def finish(self, out: torch.Tensor) -> None:
        d = self.layout.dim
        for k, result, work in self.inflight:
            work.wait()
            start, length = self.layout.own(k)
            out.narrow(d, start, length).copy_(result.narrow(d, 0, length))
        self.inflight = []


def _packed(src: torch.Tensor, layout: SeqLayout) -> Callable[[int], torch.Tensor]:
    """Chunk buffers packed from ``src`` (every position along ``layout.dim``), zero-padded, one
    launch each (``overlap_kernels.chunk_pack``)."""
    src = src.contiguous()

    def make(k: int) -> torch.Tensor:
        buf = src.new_empty((len(layout.sizes), *_chunk_shape(src, layout.dim, layout.widths[k])))
        chunk_pack(buf, src, *layout.pieces(k), layout.dim)
        return buf

    return make


def _packed_then(src: torch.Tensor, layout: SeqLayout, fn: Callable[[torch.Tensor], torch.Tensor]
                 ) -> Callable[[int], torch.Tensor]:
    """Chunk buffers made by ``fn`` (a matmul over the last dim) of ``src``'s rows packed into a
    chunk buffer: one launch and one GEMM per chunk (zero padding rows give rows that are never read)."""
    pack = _packed(src, layout)
    return lambda k: fn(pack(k))


def _plus_packed(make: Callable[[int], torch.Tensor], addend: torch.Tensor, layout: SeqLayout
                 ) -> Callable[[int], torch.Tensor]:
    """``make``'s chunk buffers with ``addend``'s rows (every position along ``layout.dim``) added."""
    pack = _packed(addend, layout)
    return lambda k: make(k).add_(pack(k))


def _sibling_record(ctx: Any) -> Optional[_SiblingGrads]:
    """The shared reduce-scatter ``ctx`` (an :class:`AllGatherMatmul` node) takes part in, or None:
    decomposed layers whose input needs a gradient do ([Note: sibling layers share one reduce-scatter])."""
    return ctx.siblings if ctx.call.chunks > 1 and ctx.needs_input_grad[0] else None


def _all_reduce_rows(rows: int, cols: int, like: torch.Tensor, chunks: int, info: GroupInfo,
                     compute: Callable[[int, int, torch.Tensor], None]) -> tuple[torch.Tensor, list[InflightWork]]:
    """A ``(rows, cols)`` buffer whose row blocks ``compute(start, length, block)`` fills, each block's
    in-place all-reduce issued before the next block is computed; returns it and the works to wait."""
    out = like.new_empty((rows, cols))
    works = []
    for start, length in zip(_starts(split_sizes(rows, chunks)), split_sizes(rows, chunks)):
        if length:
            block = out[start:start + length]
            compute(start, length, block)
            works.append(all_reduce_into(block, info))
    return out, works


def _weight_grads(grad: torch.Tensor, x: torch.Tensor, weight_needed: bool,
                  bias_needed: bool) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``grad^T x`` over all rows (the weight's gradient) and ``grad`` summed over rows (the bias's)."""
    g2 = grad.reshape(-1, grad.shape[-1])
    gw = g2.t().mm(x.reshape(-1, x.shape[-1])) if weight_needed else None
    gb = g2.sum(0) if bias_needed else None
    return gw, gb


def _accumulate(total: Optional[torch.Tensor], part: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    if part is None:
        return total
    return part.to(dtype) if total is None else total.add_(part)


def _cast(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    return None if t is None else t.to(dtype)


def _bias_share(bias: Optional[torch.Tensor], w: int) -> Optional[torch.Tensor]:
    """Each rank's share of a row-parallel layer's replicated bias, added before the reduction:
    ``bias / w``, as DTensor turns a ``Replicate()`` bias into a ``Partial()`` addend of the
    row-parallel matmul (so ``chunks=1`` sums exactly what torch TP sums)."""
    return None if bias is None else bias / w


def _gather_whole(x: torch.Tensor, layout: SeqLayout, info: GroupInfo) -> torch.Tensor:
    """``x`` (this rank's shard along ``layout.dim``) gathered, waited for and placed in one tensor."""
    gather = _ChunkedGather(x, layout, info)
    full = gather.new_full(x)
    gather.place_all(full)
    return full


def gathered(x: torch.Tensor, sizes: list[int], dim: int, info: GroupInfo) -> torch.Tensor:
    """``x`` (this rank's shard along ``dim``, every rank's extent ``sizes``) gathered whole: a
    sibling layer's gather if one is held ([Note: sibling layers share one gather]), else one
    collective, waited for. No autograd."""
    layout = SeqLayout(sizes, dim, 1, info.rank)
    shared = _shared_gather.lookup(x, layout, info)
    return shared[0] if shared is not None else _gather_whole(x, layout, info)


def _gather_and_multiply(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], call: Call
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the gathered ``x``, ``linear`` of it): the gather's chunks issued at once, this rank's own rows
    multiplied before the first wait, then each chunk's pieces as it lands ([Note: decomposing a
    collective matmul]); ``chunks == 1`` waits for the whole gather, then one GEMM (torch's order)."""
    layout = call.layout
    assert layout is not None
    d, r = layout.dim, call.info.rank
    if call.chunks == 1:
        full = _gather_whole(x, layout, call.info)
        return full, F.linear(full, weight, bias)
    gather = _ChunkedGather(x, layout, call.info)
    full = gather.new_full(x)
    own = F.linear(x, weight, bias)  # no wait: runs while the first chunk is on the link
    y = own.new_empty((*full.shape[:-1], own.shape[-1]))
    y.narrow(d, layout.starts[r], layout.sizes[r]).copy_(own)
    for k, buf in gather.chunks_landed():
        starts, lengths = layout.pieces(k)
        chunk_place(full, buf, starts, lengths, d, r)
        # the other ranks' pieces (rows before and after this rank's): a GEMM each, placed in one launch
        for lo, hi in ((0, r), (r + 1, len(starts))):
            if hi > lo and any(lengths[lo:hi]):
                chunk_place(y, F.linear(buf[lo:hi], weight, bias), starts[lo:hi], lengths[lo:hi], d)
    return full, y


# ------------------------------------------------------------------------ the four functions
class AllGatherMatmul(torch.autograd.Function):
    """``linear(all_gather(x, dim), weight, bias)``: ColwiseParallel with a sequence-sharded input."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],  # type: ignore[override]
                call: Call) -> torch.Tensor:
        layout = call.layout
        assert layout is not None
        ctx.call, ctx.has_bias = call, bias is not None
        shared = _shared_gather.lookup(x, layout, call.info)
        if shared is not None:  # a sibling layer gathered this input (see [Note: sibling layers share one gather])
            full, ctx.siblings = shared
            with region(call.forward_region):
                y = F.linear(full, weight, bias)
        else:
            with region(call.forward_region):
                full, y = _gather_and_multiply(x, weight, bias, call)
            ctx.siblings = _SiblingGrads()
            _shared_gather.remember(x, layout, call.info, full, ctx.siblings)
        if _sibling_record(ctx) is not None:
            ctx.siblings.join(ctx)
        ctx.save_for_backward(full, weight)
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):  # type: ignore[override]
        call: Call = ctx.call
        layout = call.layout
        full, weight = ctx.saved_tensors
        grad_y = grad_y.contiguous()
        d = layout.dim
        grad_x = None
        with region(call.backward_region):
            scatter = None
            siblings = _sibling_record(ctx)
            # [Note: sibling layers share one reduce-scatter]: all but the last sibling only add their part
            if ctx.needs_input_grad[0] and not (siblings and siblings.defer(ctx, lambda: grad_y.matmul(weight))):
                if call.chunks == 1:
                    make = _packed(grad_y.matmul(weight), layout)
                else:
                    make = _packed_then(grad_y, layout, lambda rows: rows.matmul(weight))
                    earlier = siblings.take() if siblings else None
                    if earlier is not None:
                        make = _plus_packed(make, earlier, layout)
                scatter = _ChunkedReduceScatter(make, tuple(full.shape), full, layout, call.info)
            # the weight's matmul runs while the (last) reduce-scatters are on the link
            gw, gb = _weight_grads(grad_y, full, ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2])
            if scatter is not None:
                grad_x = full.new_empty(_chunk_shape(full, d, layout.sizes[call.info.rank]))
                scatter.finish(grad_x)
        return grad_x, gw, gb, None


class MatmulReduceScatter(torch.autograd.Function):
    """``reduce_scatter(linear(x, weight, bias / w), dim)``: RowwiseParallel with a sequence-sharded
    output (``x`` holds every position, this rank's input features)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],  # type: ignore[override]
                call: Call) -> torch.Tensor:
        layout = call.layout
        assert layout is not None
        d = layout.dim
        share = _bias_share(bias, call.info.size)
        with region(call.forward_region):
            if call.chunks == 1:
                make = _packed(F.linear(x, weight, share), layout)
            else:
                make = _packed_then(x, layout, lambda rows: F.linear(rows, weight, share))
            shape = (*x.shape[:-1], weight.shape[0])
            scatter = _ChunkedReduceScatter(make, shape, x, layout, call.info)
            y = x.new_empty(_chunk_shape(shape, d, layout.sizes[call.info.rank]))
            scatter.finish(y)
        ctx.call, ctx.has_bias = call, bias is not None
        ctx.save_for_backward(x, weight)
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):  # type: ignore[override]
        call: Call = ctx.call
        layout = call.layout
        x, weight = ctx.saved_tensors
        d, r = layout.dim, call.info.rank
        grad_y = grad_y.contiguous()
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = ctx.has_bias and ctx.needs_input_grad[2]
        with region(call.backward_region):
            gather = _ChunkedGather(grad_y, layout, call.info)
            if call.chunks == 1:
                full = gather.new_full(grad_y)
                gather.place_all(full)
                grad_x = full.matmul(weight) if need_x else None
                gw, gb = _weight_grads(full, x, need_w, need_b)
                return grad_x, gw, gb, None
            # own rows first (no wait), then each chunk's rows as it lands: input and weight matmuls;
            # the weight and bias gradients are summed over chunks in fp32 at least. The bias is
            # replicated, so its pieces are summed in the same order on every rank (by position in
            # the sequence, not by arrival): its replicas stay bitwise equal across steps.
            grad_x = x.new_empty(x.shape) if need_x else None
            acc = torch.promote_types(x.dtype, torch.float32)
            gw = None
            bias_parts: dict[int, torch.Tensor] = {}
            own_rows = [(layout.starts[r] + at, grad_y.narrow(d, at, n)) for at, n in map(layout.own, layout.chunks)]
            # chain, not a list display: the own rows must be computed before the first chunk is waited for
            landed = ((False, s, p) for s, p in gather.landed())
            for is_own, start, piece in itertools.chain([(True, layout.starts[r], grad_y)], landed):
                n = piece.shape[d]
                if need_x:
                    grad_x.narrow(d, start, n).copy_(piece.matmul(weight))
                gw = _accumulate(gw, _weight_grads(piece, x.narrow(d, start, n), need_w, False)[0], acc)
                if need_b:  # own rows cut like the other ranks' chunks: the same pieces on every rank
                    for at, rows in own_rows if is_own else [(start, piece)]:
                        if rows.shape[d]:
                            bias_parts[at] = rows.reshape(-1, rows.shape[-1]).sum(0)
            gb = None
            for start in sorted(bias_parts):
                gb = _accumulate(gb, bias_parts[start], acc)
        return grad_x, _cast(gw, x.dtype), _cast(gb, x.dtype), None


class MatmulAllReduce(torch.autograd.Function):
    """``all_reduce(linear(x, weight, bias / w))``: RowwiseParallel with a replicated output."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],  # type: ignore[override]
                call: Call) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        wt = weight.t()
        share = _bias_share(bias, call.info.size)

        def block_rows(s: int, n: int, block: torch.Tensor) -> None:
            if share is None:
                torch.mm(x2[s:s + n], wt, out=block)
            else:
                torch.addmm(share, x2[s:s + n], wt, out=block)

        with region(call.forward_region):
            out, works = _all_reduce_rows(x2.shape[0], weight.shape[0], x, call.chunks, call.info, block_rows)
            for work in works:
                work.wait()
            y = out.view(*x.shape[:-1], weight.shape[0])
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        grad_x = grad_y.matmul(weight) if ctx.needs_input_grad[0] else None
        gw, gb = _weight_grads(grad_y, x, ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2])
        return grad_x, gw, gb, None


class LinearAllReduceGrad(torch.autograd.Function):
    """``linear(x, weight, bias)`` on a replicated ``x`` whose gradient is all-reduced in backward:
    ColwiseParallel with a replicated plain-tensor input (torch's ``from_local`` backward)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],  # type: ignore[override]
                call: Call) -> torch.Tensor:
        ctx.call, ctx.has_bias = call, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):  # type: ignore[override]
        call: Call = ctx.call
        x, weight = ctx.saved_tensors
        g2 = grad_y.contiguous().view(-1, grad_y.shape[-1])
        grad_x = None
        with region(call.backward_region):
            if ctx.needs_input_grad[0]:
                out, works = _all_reduce_rows(g2.shape[0], weight.shape[1], g2, call.chunks, call.info,
                                              lambda s, n, block: torch.mm(g2[s:s + n], weight, out=block))
            gw, gb = _weight_grads(g2, x, ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2])
            if ctx.needs_input_grad[0]:
                for work in works:
                    work.wait()
                grad_x = out.view(x.shape)
        return grad_x, gw, gb, None
