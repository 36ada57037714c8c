"""Data safety of collectives in flight (docs/DESIGN.md, contract 2).

A collective's input may be mutated right after the call, and the memory it reads or writes is never
handed to another tensor before it is done: here every collective is issued behind an emulated link
(so it is still in flight), then the caller mutates its inputs, drops references to buffers and
results, and allocates and scribbles over same-sized tensors in a loop; every result must equal
torch's blocking collective on the original inputs, bit for bit (same reduction, same order), and no
tensor allocated meanwhile may alias a buffer still in flight.

On CPU, gloo's own work object also keeps its tensors alive until it completes, so the buffer
references the runtime holds (``InflightWork``) matter most on CUDA, where the caching allocator
hands a freed block to the next allocation on the stream at once: the CUDA variant checks that.
"""
from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.distributed as dist

import overlap
from conftest import requires_cuda
from overlap.groups import resolve_group
from overlap.collectives import all_gather_into, reduce_scatter_into
from overlap.testing import run_distributed
from scheduler.torch_versions import DIST_REDUCE_SCATTER

ROUNDS = 3
# 0.1 Gbit/s + 20 ms: a collective is in flight >= 20 ms, even on a loaded machine (a 64 KiB one ~25 ms).
LINK = (0.1, 20000.0)
ROWS, COLS = 8, 512  # 16 KiB of float32 per rank input


def _churn(like: list[torch.Tensor], inflight: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Allocate, fill and free same-sized tensors (some kept); return the address ranges of those that
    overlap a buffer in flight (must be none) -- the allocator would hand out freed memory here."""
    clashes = []
    kept = []
    for i in range(12):
        for t in like:
            fresh = torch.empty_like(t).fill_(-7.0 - i)
            start, end = fresh.data_ptr(), fresh.data_ptr() + fresh.numel() * fresh.element_size()
            clashes += [(start, end) for lo, hi in inflight if start < hi and lo < end]
            if i % 3 == 0:
                kept.append(fresh)
    return clashes


def _held_ranges() -> list[tuple[int, int]]:
    """Address ranges of the buffers every collective in flight holds (the runtime's own references)."""
    ranges = []
    for work in overlap.inflight():
        for b in work._buffers or ():
            ranges.append((b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()))
    return ranges


def _cases(rank: int, world: int, device: torch.device) -> dict[str, tuple[Callable, Callable]]:
    """name -> (overlap call on inputs, torch blocking reference on copies); inputs are fresh each call."""
    pg = dist.group.WORLD
    nccl = dist.get_backend() == "nccl"

    def ag_ref(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim)

    def rs_ref(x: torch.Tensor, avg: bool = False) -> torch.Tensor:
        out = torch.empty(x.shape[0] // world, *x.shape[1:], dtype=x.dtype, device=x.device)
        reduce_scatter = getattr(dist, DIST_REDUCE_SCATTER)
        reduce_scatter(out, x.contiguous(), op=dist.ReduceOp.AVG if avg and nccl else dist.ReduceOp.SUM)
        return out / world if avg and not nccl else out

    def ar_ref(x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out)
        return out

    splits_in = [1 + (rank + j) % 3 for j in range(world)]  # uneven, differ per rank
    splits_out = [1 + (j + rank) % 3 for j in range(world)]

    def a2a_ref(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(sum(splits_out), *x.shape[1:], dtype=x.dtype, device=x.device)
        dist.all_to_all_single(out, x, splits_out, splits_in)
        return out

    def bc_ref(x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        dist.broadcast(out, src=world - 1)
        return out

    def rs_into(x: torch.Tensor) -> torch.Tensor:
        inp = x.clone()  # the runtime's packed buffer: the caller drops its only reference below
        out = torch.empty(x.numel() // world, dtype=x.dtype, device=x.device)
        work = reduce_scatter_into(out, inp.view(-1), resolve_group(pg))
        del inp
        return _Waited(out, work)

    def ag_into(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(world * x.numel(), dtype=x.dtype, device=x.device)
        slot = out[rank * x.numel() : (rank + 1) * x.numel()]
        slot.copy_(x.view(-1))
        work = all_gather_into(out, slot, resolve_group(pg))
        return _Waited(out, work)

    return {
        "all_gather": (lambda x: overlap.all_gather(x), ag_ref),
        "all_gather dim 1": (lambda x: overlap.all_gather(x, dim=1), lambda x: ag_ref(x, 1)),
        "reduce_scatter sum": (lambda x: overlap.reduce_scatter(x), rs_ref),
        "reduce_scatter avg": (lambda x: overlap.reduce_scatter(x, op="avg"), lambda x: rs_ref(x, avg=True)),
        "all_reduce": (lambda x: overlap.all_reduce(x), ar_ref),
        "all_to_all uneven": (lambda x: overlap.all_to_all(x[: sum(splits_in)], splits_out, splits_in),
                              lambda x: a2a_ref(x[: sum(splits_in)])),
        "broadcast": (lambda x: overlap.broadcast(x, src=world - 1), bc_ref),
        "all_gather_coalesced": (lambda x: overlap.all_gather_coalesced([x, x[:2].double()])[0], ag_ref),
        "reduce_scatter_coalesced": (lambda x: overlap.reduce_scatter_coalesced([x[:2].double(), x])[1], rs_ref),
        "reduce_scatter_into, input dropped": (rs_into, lambda x: rs_ref(x).view(-1)),
        "all_gather_into": (ag_into, lambda x: ag_ref(x.view(-1))),
    }


class _Waited:
    """A building block's output with its work: ``value()`` waits, then reads the buffer."""

    def __init__(self, out: torch.Tensor, work) -> None:
        self.out, self.work = out, work

    def value(self) -> torch.Tensor:
        self.work.wait()
        return self.out


def _abuse(rank: int, world: int, device_type: str) -> dict:
    """Every case, ``ROUNDS`` times: issue, mutate the input, churn memory, then compare."""
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    report: dict = {}
    g = torch.Generator().manual_seed(rank)
    for name, (call, reference) in _cases(rank, world, device).items():
        wrong, in_flight, clashes = 0, 0, []
        for _ in range(ROUNDS):
            x = (torch.randn(ROWS * world, COLS, generator=g) * 100).round().to(device)
            want = reference(x.clone())
            result = call(x)
            in_flight += any(not w.is_done() for w in overlap.inflight())
            x.fill_(float("nan"))  # the caller reuses its input at once
            clashes += _churn([x, want], _held_ranges())
            got = result.value() if isinstance(result, _Waited) else overlap.wait(result)
            wrong += not torch.equal(got, want)
        report[name] = {"wrong": wrong, "in_flight": in_flight, "clashes": clashes}
    report["dropped"] = _dropped_results(rank, world, device)
    return report


def _dropped_results(rank: int, world: int, device: torch.device) -> dict:
    """Results and buffers dropped unwaited stay held until done: new tensors never land on them."""
    # 64 KiB outputs: small enough for malloc to hand a freed block straight back
    x = torch.full((ROWS * world, COLS), float(rank), device=device)
    info = resolve_group(dist.group.WORLD)
    held_after_drop, clashes, intact = 0, [], True
    for _ in range(ROUNDS):
        overlap.all_gather(x)  # result dropped at once
        held = overlap.inflight()[-1].pending
        out = torch.empty(world * x.numel(), dtype=x.dtype, device=device)
        slot = out[rank * x.numel() : (rank + 1) * x.numel()]
        slot.copy_(x.view(-1))
        work = all_gather_into(out, slot, info)
        dropped = (out.data_ptr(), out.data_ptr() + out.numel() * out.element_size())
        del out, slot  # the caller's last references to the buffer in flight
        fresh = [torch.full((world * x.numel(),), 5.0, device=device) for _ in range(8)]
        held_after_drop += held and work.pending  # still in flight after the allocations
        clashes += [t.data_ptr() for t in fresh if t.data_ptr() < dropped[1] and dropped[0] < t.data_ptr() + t.numel() * 4]
        overlap.wait_all()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        intact &= all(bool((t == 5.0).all()) for t in fresh)
    return {"held_after_drop": held_after_drop, "clashes": clashes, "intact": intact}


def _assert_safe(reports: list[dict]) -> None:
    for rank, report in enumerate(reports):
        dropped = report.pop("dropped")
        assert dropped == {"held_after_drop": ROUNDS, "clashes": [], "intact": True}, (rank, dropped)
        for name, r in report.items():
            assert r["wrong"] == 0, f"rank {rank}, {name}: {r['wrong']} of {ROUNDS} results differ from torch's"
            assert r["clashes"] == [], f"rank {rank}, {name}: memory in flight was handed out again"
            assert r["in_flight"] == ROUNDS, f"rank {rank}, {name}: the collective was not in flight ({r})"


def test_buffers_in_flight_are_never_reused_cpu() -> None:
    _assert_safe(run_distributed(_abuse, 2, "cpu", timeout=120, link=LINK))


@requires_cuda
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL ranks cannot share one)")
def test_buffers_in_flight_are_never_reused_cuda() -> None:
    _assert_safe(run_distributed(_abuse, 2, "cuda", backend="nccl", timeout=300, link=LINK))
