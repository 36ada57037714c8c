"""Async collectives: return at once, wait at first use.

Every function validates its arguments, snapshots its input (so the caller may mutate it right
after the call, see contract 2 in docs/DESIGN.md), issues the collective and returns an ``AsyncTensor`` (see
``scheduler.async_tensor``) that waits just before its first use. On CUDA the collective runs on a
communication stream that first waits for the current stream (``overlap.streams``); on CPU it is an
async gloo work. ``overlap.wait(t)`` forces the wait.

Shapes (``w`` = group size, ``x`` of shape ``(d0, *rest)`` for dim 0):

=========================  ==========================  ====================================
function                   input                       result
=========================  ==========================  ====================================
all_gather(x, dim)         ``s``                       ``s`` with ``s[dim] * w``
reduce_scatter(x, op, dim) ``s``, ``s[dim] % w == 0``  ``s`` with ``s[dim] // w``
all_reduce(x, op)          ``s``                       ``s``
all_to_all(x, out, in)     ``(d0, *rest)``             ``(sum(out) or d0, *rest)``
broadcast(x, src)          ``s``                       ``s`` (``src``'s data)
all_gather_coalesced(xs)   list of ``s_i``             list of ``s_i`` with ``s_i[0] * w``
reduce_scatter_coalesced   list of ``s_i``             list of ``s_i`` with ``s_i[0] // w``
=========================  ==========================  ====================================

``op`` is one of 'sum', 'avg', 'max', 'min', 'product'; backends without a native average (gloo)
sum and divide at first use. ``broadcast``'s ``src`` is a rank within ``group``.
A group of size 1 takes the same path (the collective is still issued), so results are uniform.

Autograd: ``all_gather``, ``reduce_scatter`` and ``all_reduce`` (sum/avg), ``all_to_all`` and
``broadcast`` are differentiable; their backward runs the adjoint collective and waits for it.
Under tracing (``make_fx``, ``torch.compile``) the same calls lower to
``torch.ops._c10d_functional`` collectives followed by ``wait_tensor`` (see ``overlap.traced``).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from overlap import desync, traced
from overlap.groups import GroupArg, GroupInfo, check_reduce_op, dist_reduce_op, resolve_group
from overlap.inflight_work import InflightWork, ResultCompletion, make_room, track
from overlap.streams import check_device, check_not_capturing, collective_stream
from overlap.regions import region
from scheduler.async_tensor import AsyncTensor, wait_tensor
from scheduler.torch_versions import DIST_ALL_GATHER, DIST_REDUCE_SCATTER

__all__ = [
    "all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast",
    "all_gather_coalesced", "reduce_scatter_coalesced", "wait",
]

Launch = Callable[[bool], Optional[dist.Work]]  # launch(async_op) -> Work


# ----------------------------------------------------------------------------- validation


def _check_tensor(x: object, name: str, min_dim: int = 0) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {x.layout}")
    if x.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dim(s), got a {x.dim()}-dim tensor")
    return x


def _check_dim(x: torch.Tensor, dim: object, name: str = "dim") -> int:
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"{name} must be an int, got {type(dim).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise IndexError(f"{name}={dim} is out of range for a {x.dim()}-dim tensor (allowed {-x.dim()}..{x.dim() - 1})")
    return dim % x.dim()


def _check_divisible(size: int, info: GroupInfo, what: str) -> None:
    if size % info.size != 0:
        raise ValueError(f"{what}={size} is not divisible by the group size {info.size}")


def _check_list(xs: object, name: str) -> list[torch.Tensor]:
    if not isinstance(xs, (list, tuple)):
        raise TypeError(f"{name} must be a list or tuple of tensors, got {type(xs).__name__}")
    tensors = [_check_tensor(x, f"{name}[{i}]", min_dim=1) for i, x in enumerate(xs)]
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"{name} must all be on one device, got {sorted(map(str, devices))}")
    return tensors


# ----------------------------------------------------------------------------- issuing


def _dist_all_gather(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, async_op: bool):
    # Looked up at call time: overlap.testing.emulated_link patches the module attribute.
    return getattr(dist, DIST_ALL_GATHER)(out, inp, group=group, async_op=async_op)


def _dist_reduce_scatter(out: torch.Tensor, inp: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup, async_op: bool):
    return getattr(dist, DIST_REDUCE_SCATTER)(out, inp, op=op, group=group, async_op=async_op)


def _bound_device(group: str) -> Optional[torch.device]:
    """The device the process group named ``group`` ('' for WORLD) is bound to, if any."""
    from torch.distributed import distributed_c10d as c10d

    pg = c10d._resolve_process_group(group) if group else dist.group.WORLD
    return getattr(pg, "bound_device_id", None)


def _issue(kind: str, device: torch.device, launch: Launch, buffers: Sequence[torch.Tensor], nbytes: int,
           group: str = "", op: str = "", finish: Optional[Callable[[], None]] = None, where: str = "") -> InflightWork:
    """Start ``launch`` without blocking the caller: on a comm stream (CUDA) or as an async work.

    ``group`` is the process group's name, kept on the work (for the profiler and errors) with the
    collective's per-group sequence number. ``op`` (the reduce op, or ``src=<rank>`` of a broadcast)
    is part of the fingerprint that debug mode checks across ranks first (``overlap.desync``), and
    so is ``where``, the sharded module the collective is for (its fqn), when there is one (the
    profiler keeps it too: ``CollectiveRecord.module``).
    ``finish`` (CPU only) completes the output once the work is waited, before any reader.
    Raises before issuing during CUDA graph capture, and on CUDA unless ``device`` is the current
    device and this rank's (``overlap.streams``: [Note: no collectives in CUDA graph capture],
    [Note: one device per rank]).
    """
    check_not_capturing(f"overlap.{kind} issued")
    if device.type == "cuda":
        check_device(device, f"overlap.{kind}", _bound_device(group))
    seq = desync.next_seq(group)
    if desync.SWITCH.on:  # debug mode (one check when off): every rank is about to issue the same collective
        desync.check(kind, seq, group, buffers, op, where)
    make_room(nbytes)  # the process-wide budget, if set (one check when not): [Note: the process-wide in-flight budget]
    with region(f"overlap::{kind}"):
        if device.type == "cuda":
            current = torch.cuda.current_stream(device)
            stream = collective_stream(device, kind)
            stream.wait_stream(current)  # the snapshot copies on `current` must land first
            with torch.cuda.stream(stream):
                launch(False)
                event = torch.cuda.Event()
                event.record(stream)
            return track(InflightWork(kind, nbytes, buffers, event=event, device=device, group=group, seq=seq,
                                      issue_stream=current, where=where))
        return track(InflightWork(kind, nbytes, buffers, work=launch(True), group=group, seq=seq, finish=finish,
                                  where=where))


class _Plan:
    """One collective call, validated: how to start it, and (for autograd) its adjoint."""

    kind: str

    def __init__(self, info: GroupInfo) -> None:
        self.info = info
        self.completion: Optional[ResultCompletion] = None

    def start(self, x: torch.Tensor) -> torch.Tensor:
        """Issue the collective on ``x``; return the result buffer and set ``self.completion``."""
        raise NotImplementedError

    def adjoint(self, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"overlap.{self.kind} is not differentiable with these arguments")

    def wrap(self, result: torch.Tensor) -> torch.Tensor:
        """The started collective's result as an AsyncTensor bound to ``self.completion``."""
        assert self.completion is not None
        return AsyncTensor.wrap(result, self.completion, self.kind, self.info.pg.group_name)

    def _divide_for_avg(self, op: str, out: torch.Tensor) -> Optional[Callable[[], None]]:
        if op == "avg" and not self.info.native_avg:
            size = self.info.size
            return lambda: out.div_(size)
        return None


class _Differentiable(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, plan: _Plan) -> torch.Tensor:  # type: ignore[override]
        ctx.plan = plan
        return plan.wrap(plan.start(x))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return wait_tensor(ctx.plan.adjoint(grad.contiguous())), None


def _run(plan: _Plan, x: torch.Tensor) -> torch.Tensor:
    x = wait_tensor(x)  # an input still being produced by another collective must be complete
    if x.requires_grad and torch.is_grad_enabled():
        return _Differentiable.apply(x, plan)
    return plan.wrap(plan.start(x))


# ----------------------------------------------------------------------------- single-tensor collectives


class _AllGather(_Plan):
    kind = "all_gather"

    def __init__(self, info: GroupInfo, dim: int) -> None:
        super().__init__(info)
        self.dim = dim

    def start(self, x: torch.Tensor) -> torch.Tensor:
        w, n, shape, d = self.info.size, x.numel(), tuple(x.shape), self.dim
        out = torch.empty((shape[0] * w, *shape[1:]), dtype=x.dtype, device=x.device)  # rank-major
        flat = out.view(-1)
        slot = flat[self.info.rank * n : (self.info.rank + 1) * n]
        slot.view(shape).copy_(x)  # snapshot straight into our slot: the gather runs in place
        pg = self.info.pg
        work = _issue(self.kind, x.device, lambda a: _dist_all_gather(flat, slot, pg, a),
                      (out,), out.numel() * out.element_size(), pg.group_name)
        if d == 0:
            self.completion = ResultCompletion(work)
            return out
        result = torch.empty((*shape[:d], shape[d] * w, *shape[d + 1 :]), dtype=x.dtype, device=x.device)
        split = (*shape[:d], w, shape[d], *shape[d + 1 :])
        by_rank = out.view(w, *shape)
        self.completion = ResultCompletion(work, lambda: result.view(split).copy_(by_rank.movedim(0, d)))
        return result

    def adjoint(self, grad: torch.Tensor) -> torch.Tensor:
        return _run(_ReduceScatter(self.info, "sum", self.dim), grad)


class _ReduceScatter(_Plan):
    kind = "reduce_scatter"

    def __init__(self, info: GroupInfo, op: str, dim: int) -> None:
        super().__init__(info)
        self.op, self.dim = op, dim

    def start(self, x: torch.Tensor) -> torch.Tensor:
        w, d, shape = self.info.size, self.dim, tuple(x.shape)
        chunk = shape[d] // w
        out_shape = (*shape[:d], chunk, *shape[d + 1 :])
        inp = torch.empty((w, *out_shape), dtype=x.dtype, device=x.device)
        inp.copy_(x.view(*shape[:d], w, chunk, *shape[d + 1 :]).movedim(d, 0))  # snapshot, rank-major
        out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
        pg, op = self.info.pg, dist_reduce_op(self.op, self.info)
        work = _issue(self.kind, x.device,
                      lambda a: _dist_reduce_scatter(out.view(-1), inp.view(-1), op, pg, a),
                      (inp, out), inp.numel() * inp.element_size(), pg.group_name, self.op)
        self.completion = ResultCompletion(work, self._divide_for_avg(self.op, out))
        return out

    def adjoint(self, grad: torch.Tensor) -> torch.Tensor:
        if self.op not in ("sum", "avg"):
            return super().adjoint(grad)
        gathered = wait_tensor(_run(_AllGather(self.info, self.dim), grad))
        return gathered / self.info.size if self.op == "avg" else gathered


class _AllReduce(_Plan):
    kind = "all_reduce"

    def __init__(self, info: GroupInfo, op: str) -> None:
        super().__init__(info)
        self.op = op

    def start(self, x: torch.Tensor) -> torch.Tensor:
        out = x.clone(memory_format=torch.contiguous_format)  # snapshot; reduced in place
        pg, op = self.info.pg, dist_reduce_op(self.op, self.info)
        work = _issue(self.kind, x.device, lambda a: dist.all_reduce(out, op=op, group=pg, async_op=a),
                      (out,), out.numel() * out.element_size(), pg.group_name, self.op)
        self.completion = ResultCompletion(work, self._divide_for_avg(self.op, out))
        return out

    def adjoint(self, grad: torch.Tensor) -> torch.Tensor:
        if self.op not in ("sum", "avg"):
            return super().adjoint(grad)
        return _run(_AllReduce(self.info, self.op), grad)


class _AllToAll(_Plan):
    kind = "all_to_all"

    def __init__(self, info: GroupInfo, out_splits: Optional[list[int]], in_splits: Optional[list[int]]) -> None:
        super().__init__(info)
        self.out_splits, self.in_splits = out_splits, in_splits

    def start(self, x: torch.Tensor) -> torch.Tensor:
        inp = x.clone(memory_format=torch.contiguous_format)
        rows = sum(self.out_splits) if self.out_splits is not None else x.shape[0]
        out = torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
        pg, o, i = self.info.pg, self.out_splits, self.in_splits
        work = _issue(self.kind, x.device, lambda a: dist.all_to_all_single(out, inp, o, i, group=pg, async_op=a),
                      (inp, out), inp.numel() * inp.element_size(), pg.group_name)
        self.completion = ResultCompletion(work)
        return out

    def adjoint(self, grad: torch.Tensor) -> torch.Tensor:
        return _run(_AllToAll(self.info, self.in_splits, self.out_splits), grad)


class _Broadcast(_Plan):
    kind = "broadcast"

    def __init__(self, info: GroupInfo, src: int) -> None:
        super().__init__(info)
        self.src = src

    def start(self, x: torch.Tensor) -> torch.Tensor:
        out = x.clone(memory_format=torch.contiguous_format)
        pg, src = self.info.pg, self.info.global_rank(self.src)
        work = _issue(self.kind, x.device, lambda a: dist.broadcast(out, src=src, group=pg, async_op=a),
                      (out,), out.numel() * out.element_size(), pg.group_name, f"src={src}")
        self.completion = ResultCompletion(work)
        return out

    def adjoint(self, grad: torch.Tensor) -> torch.Tensor:
        total = wait_tensor(_run(_AllReduce(self.info, "sum"), grad))
        return total if self.info.rank == self.src else torch.zeros_like(grad)


def _traceable(x: torch.Tensor) -> bool:
    return traced.is_tracing(x)


def all_gather(x: torch.Tensor, group: GroupArg = None, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``. Returns an AsyncTensor."""
    _check_tensor(x, "x", min_dim=1)
    dim = _check_dim(x, dim)
    info = resolve_group(group)
    if _traceable(x):
        return traced.all_gather(x, info, dim)
    return _run(_AllGather(info, dim), x)


def reduce_scatter(x: torch.Tensor, op: str = "sum", group: GroupArg = None, dim: int = 0) -> torch.Tensor:
    """Reduce ``x`` over ranks and keep this rank's ``1/w`` slice along ``dim``. Returns an AsyncTensor."""
    _check_tensor(x, "x", min_dim=1)
    dim = _check_dim(x, dim)
    op = check_reduce_op(op, x.dtype)
    info = resolve_group(group)
    _check_divisible(x.shape[dim], info, f"reduce_scatter: x.shape[{dim}]")
    if _traceable(x):
        return traced.reduce_scatter(x, op, info, dim)
    return _run(_ReduceScatter(info, op, dim), x)


def all_reduce(x: torch.Tensor, op: str = "sum", group: GroupArg = None) -> torch.Tensor:
    """Reduce ``x`` over ranks; every rank gets the result. Returns an AsyncTensor; ``x`` is untouched."""
    _check_tensor(x, "x")
    op = check_reduce_op(op, x.dtype)
    info = resolve_group(group)
    if _traceable(x):
        return traced.all_reduce(x, op, info)
    return _run(_AllReduce(info, op), x)


def _check_splits(splits: object, name: str, info: GroupInfo) -> Optional[list[int]]:
    if splits is None:
        return None
    if not isinstance(splits, (list, tuple)) or not all(isinstance(s, int) and not isinstance(s, bool) for s in splits):
        raise TypeError(f"{name} must be None or a list of {info.size} non-negative ints, got {splits!r}")
    if any(s < 0 for s in splits):
        raise ValueError(f"{name} must be None or a list of {info.size} non-negative ints, got {splits!r}")
    if len(splits) != info.size:
        raise ValueError(f"{name} must have one entry per rank ({info.size}), got {len(splits)}")
    return list(splits)


def all_to_all(
    x: torch.Tensor,
    output_split_sizes: Optional[list[int]] = None,
    input_split_sizes: Optional[list[int]] = None,
    group: GroupArg = None,
) -> torch.Tensor:
    """Send row block ``i`` of ``x`` to rank ``i``; receive block ``j`` from rank ``j``. Returns an AsyncTensor.

    Without split sizes, ``x.shape[0]`` must be divisible by the group size (equal blocks).
    """
    _check_tensor(x, "x", min_dim=1)
    info = resolve_group(group)
    out_splits = _check_splits(output_split_sizes, "output_split_sizes", info)
    in_splits = _check_splits(input_split_sizes, "input_split_sizes", info)
    if in_splits is None:
        _check_divisible(x.shape[0], info, "all_to_all: x.shape[0]")
    elif sum(in_splits) != x.shape[0]:
        raise ValueError(f"input_split_sizes must sum to x.shape[0]={x.shape[0]}, got sum {sum(in_splits)}")
    if out_splits is None and in_splits is not None:
        raise ValueError("output_split_sizes is needed when input_split_sizes is given")
    if _traceable(x):
        return traced.all_to_all(x, out_splits, in_splits, info)
    return _run(_AllToAll(info, out_splits, in_splits), x)


def broadcast(x: torch.Tensor, src: int = 0, group: GroupArg = None) -> torch.Tensor:
    """Every rank gets ``src``'s ``x`` (``src`` is a rank within ``group``). Returns an AsyncTensor."""
    _check_tensor(x, "x")
    info = resolve_group(group)
    if isinstance(src, bool) or not isinstance(src, int):
        raise TypeError(f"src must be an int, a rank in the group, 0..{info.size - 1}; got {type(src).__name__}")
    if not 0 <= src < info.size:
        raise ValueError(f"src must be a rank in the group, 0..{info.size - 1}, got {src!r}")
    if _traceable(x):
        return traced.broadcast(x, src, info)
    return _run(_Broadcast(info, src), x)


# ----------------------------------------------------------------------------- coalesced collectives


def _by_dtype(tensors: list[torch.Tensor]) -> dict[torch.dtype, list[int]]:
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return groups


def _check_no_grad(tensors: list[torch.Tensor], name: str, fn: str) -> None:
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise RuntimeError(
            f"overlap.{fn} is not differentiable and {name} requires grad: call it under torch.no_grad(), "
            f"detach the inputs, or use the single-tensor collective"
        )


def all_gather_coalesced(xs: Sequence[torch.Tensor], group: GroupArg = None) -> list[torch.Tensor]:
    """All-gather each tensor along dim 0, as one collective per dtype. Returns AsyncTensors."""
    tensors = [wait_tensor(t) for t in _check_list(xs, "xs")]
    info = resolve_group(group)
    _check_no_grad(tensors, "xs", "all_gather_coalesced")
    if tensors and _traceable(tensors[0]):
        return [all_gather(t, group) for t in tensors]
    w, rank = info.size, info.rank
    results: list[Optional[torch.Tensor]] = [None] * len(tensors)
    for dtype, idx in _by_dtype(tensors).items():
        numels = [tensors[i].numel() for i in idx]
        total = sum(numels)
        device = tensors[idx[0]].device
        out = torch.empty(w * total, dtype=dtype, device=device)
        slot = out[rank * total : (rank + 1) * total]
        torch.cat([tensors[i].reshape(-1) for i in idx], out=slot)
        pg = info.pg
        work = _issue("all_gather_coalesced", device,
                      lambda a, out=out, slot=slot: _dist_all_gather(out, slot, pg, a),
                      (out,), out.numel() * out.element_size(), pg.group_name)
        by_rank = out.view(w, total)
        offset = 0
        for i, n in zip(idx, numels):
            t = tensors[i]
            result = torch.empty((t.shape[0] * w, *t.shape[1:]), dtype=dtype, device=device)
            src = by_rank[:, offset : offset + n]
            finish = (lambda r=result, s=src, n=n: r.view(w, n).copy_(s))
            results[i] = AsyncTensor.wrap(result, ResultCompletion(work, finish), "all_gather_coalesced",
                                          pg.group_name)
            offset += n
    return results  # type: ignore[return-value]


def reduce_scatter_coalesced(xs: Sequence[torch.Tensor], op: str = "sum", group: GroupArg = None) -> list[torch.Tensor]:
    """Reduce-scatter each tensor along dim 0, as one collective per dtype. Returns AsyncTensors."""
    tensors = [wait_tensor(t) for t in _check_list(xs, "xs")]
    info = resolve_group(group)
    op = check_reduce_op(op, torch.float32)
    for i, t in enumerate(tensors):
        check_reduce_op(op, t.dtype, arg_name=f"op (for xs[{i}] of dtype {t.dtype})")
        _check_divisible(t.shape[0], info, f"reduce_scatter_coalesced: xs[{i}].shape[0]")
    _check_no_grad(tensors, "xs", "reduce_scatter_coalesced")
    if tensors and _traceable(tensors[0]):
        return [reduce_scatter(t, op, group) for t in tensors]
    w = info.size
    results: list[Optional[torch.Tensor]] = [None] * len(tensors)
    for dtype, idx in _by_dtype(tensors).items():
        chunks = [tensors[i].numel() // w for i in idx]
        total = sum(chunks)
        device = tensors[idx[0]].device
        inp = torch.empty((w, total), dtype=dtype, device=device)
        offset = 0
        for i, c in zip(idx, chunks):
            inp[:, offset : offset + c].copy_(tensors[i].reshape(w, c))  # rank-major snapshot
            offset += c
        out = torch.empty(total, dtype=dtype, device=device)
        pg, rop = info.pg, dist_reduce_op(op, info)
        work = _issue("reduce_scatter_coalesced", device,
                      lambda a, out=out, inp=inp: _dist_reduce_scatter(out, inp.view(-1), rop, pg, a),
                      (inp, out), inp.numel() * inp.element_size(), pg.group_name, op)
        offset = 0
        for i, c in zip(idx, chunks):
            t = tensors[i]
            shard = out[offset : offset + c].view(t.shape[0] // w, *t.shape[1:])
            finish = (lambda s=shard: s.div_(w)) if op == "avg" and not info.native_avg else None
            results[i] = AsyncTensor.wrap(shard, ResultCompletion(work, finish), "reduce_scatter_coalesced",
                                          pg.group_name)
            offset += c
    return results  # type: ignore[return-value]


# ----------------------------------------------------------------------------- in-place building blocks


def all_gather_into(output: torch.Tensor, input: torch.Tensor, info: GroupInfo, where: str = "",
                    comm: Optional[Callable[..., Optional[dist.Work]]] = None) -> InflightWork:
    """Issue an all-gather of ``input`` into ``output`` (rank-major, ``w * input.numel()`` elements).

    For the sharded runtime, which packs ``input`` as a view of its own slot in ``output`` (in place).
    Returns the in-flight work; the caller waits it (``InflightWork.wait``) before reading ``output``.
    ``where`` (here and in the two below): the sharded module's fqn, part of the debug-mode fingerprint.
    ``comm``: FSDP2's custom all-gather (``set_custom_all_gather``), called as FSDP2 calls it
    (``comm(output_tensor=, input_tensor=, group=, async_op=)``) in place of torch's.
    """
    call = comm or _torch_all_gather
    return _issue("all_gather", output.device,
                  lambda a: call(output_tensor=output, input_tensor=input, group=info.pg, async_op=a),
                  (output,), output.numel() * output.element_size(), info.pg.group_name, where=where)


def _torch_all_gather(*, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                      async_op: bool) -> Optional[dist.Work]:
    """torch's all-gather, called as a custom ``Comm`` is (``all_gather_into``'s default)."""
    return _dist_all_gather(output_tensor, input_tensor, group, async_op)


def _torch_reduce_scatter(*, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                          op: dist.ReduceOp, async_op: bool) -> Optional[dist.Work]:
    """torch's reduce-scatter, called as a custom ``Comm`` is (``reduce_scatter_into``'s default)."""
    return _dist_reduce_scatter(output_tensor, input_tensor, op, group, async_op)


def _gloo_ring_sum(received: torch.Tensor, out: torch.Tensor, rank: int) -> None:
    """``out`` = the sum of ``received``'s rows (one per rank, for ``rank``'s shard) in the order gloo's
    reduce-scatter adds them: a ring running down the ranks, so rank ``r``'s shard is
    ``((x[r-1] + x[r-2]) + ...) + x[r]`` (ranks mod ``w``). Measured on gloo (torch 2.13, float32,
    3 to 5 ranks): gloo cuts the ``w n``-element input into ring segments of ``n`` elements rounded up
    to an even count, so where the shard ``n`` is even every element is summed so (the runtime's
    shards are: it pads each tensor to 16 elements). Where another caller's shard is odd (FSDP2's can
    be), the segments straddle the shards and an element or two at each edge is summed in the
    neighbour's order. With two ranks it is the one addition, either way."""
    w = received.shape[0]
    torch.add(received[(rank - 1) % w], received[(rank - 2) % w], out=out)
    for k in range(3, w + 1):
        out.add_(received[(rank - k) % w])


def reduce_scatter_into(output: torch.Tensor, input: torch.Tensor, info: GroupInfo, where: str = "",
                        comm: Optional[Callable[..., Optional[dist.Work]]] = None) -> InflightWork:
    """Issue a sum reduce-scatter of the rank-major ``input`` into ``output`` (``1/w`` of its elements).

    For the sharded runtime. Returns the in-flight work; wait it before reading ``output``.
    ``comm``: FSDP2's custom reduce-scatter (``set_custom_reduce_scatter``), called as FSDP2 calls it
    (``comm(output_tensor=, input_tensor=, group=, op=ReduceOp.SUM, async_op=)``) in place of torch's
    (on gloo too: then its work may not say it is done before it is waited, see below).

    [Note: gloo's reduce-scatter cannot say it is done]
    gloo's reduce-scatter works (torch 2.13) never report ``is_completed()`` before they are waited,
    although they progress in the background, so the runtime could not tell that one had landed:
    no early epilogue, no early HSDP all-reduce. On gloo the runtime therefore moves the same bytes
    with ``all_to_all_single`` (each rank receives every rank's slot for its own shard: ``(w-1)/w``
    of the input, a reduce-scatter's traffic), whose work does report completion, and sums the ``w``
    received slots when the work is waited, in the order gloo's reduce-scatter adds them
    (``_gloo_ring_sum``), so the sum is bitwise the one FSDP2 gets from gloo.
    """
    if comm is None and output.device.type != "cuda" and info.backend == "gloo" and info.size > 1:
        received = torch.empty((info.size, output.numel()), dtype=output.dtype, device=output.device)
        pg, rank = info.pg, info.rank

        def launch(a: bool) -> Optional[dist.Work]:
            return dist.all_to_all_single(received.view(-1), input, group=pg, async_op=a)

        return _issue("reduce_scatter", output.device, launch, (input, received, output),
                      input.numel() * input.element_size(), pg.group_name, "sum",
                      finish=lambda: _gloo_ring_sum(received, output.view(-1), rank), where=where)
    op, call = dist_reduce_op("sum", info), comm or _torch_reduce_scatter
    return _issue("reduce_scatter", output.device,
                  lambda a: call(output_tensor=output, input_tensor=input, group=info.pg, op=op, async_op=a),
                  (input, output), input.numel() * input.element_size(), info.pg.group_name, "sum", where=where)


def quantized_reduce_into(received: torch.Tensor, input: torch.Tensor, info: GroupInfo, fmt: str,
                          where: str = "") -> InflightWork:
    """Issue the all-to-all of a compressed reduction: ``input`` holds one quantized slot per rank
    (rank-major bytes), ``received`` gets every rank's quantized version of this rank's slot; the
    caller's copy-out sums them ([Note: compressed collectives] in ``overlap/compression.py``).
    Profiled and fingerprinted as a ``reduce_scatter`` whose op is ``sum:<fmt>``; wait the work
    before reading ``received``."""
    pg = info.pg
    return _issue("reduce_scatter", input.device,
                  lambda a: dist.all_to_all_single(received, input, group=pg, async_op=a), (input, received),
                  input.numel() * input.element_size(), pg.group_name, f"sum:{fmt}", where=where)


def all_reduce_into(buffer: torch.Tensor, info: GroupInfo, where: str = "") -> InflightWork:
    """Issue a sum all-reduce of ``buffer`` over ``info``'s group, in place.

    For the sharded runtime (HSDP: a reduce-scatter's output summed over the replicas). On CUDA it
    runs on the all-reduce stream after the work queued on the *current* stream, so a caller that
    issues it under the reduce-scatter stream orders it after that reduce-scatter without a host
    wait. Returns the in-flight work; wait it before reading ``buffer``.
    """
    op = dist_reduce_op("sum", info)
    return _issue("all_reduce", buffer.device, lambda a: dist.all_reduce(buffer, op=op, group=info.pg, async_op=a),
                  (buffer,), buffer.numel() * buffer.element_size(), info.pg.group_name, "sum", where=where)


def wait(t):
    """Wait now for ``t`` (an AsyncTensor, or a list/tuple/dict of them); returns ``t``. Idempotent."""
    return wait_tensor(t)
