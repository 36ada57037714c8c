"""``set_custom_all_gather`` / ``set_custom_reduce_scatter`` (FSDP2's): a module's collectives issued
through a user's ``Comm``, whose ``allocate`` makes the buffers the packing kernels fill ([Note:
custom collectives] in ``overlap/param_group.py``); and ``set_allocate_memory_from_process_group_for_comm``,
the buffers from the process group's allocator (gloo has none: plain buffers, every one asked for).

On 2 gloo ranks, TinyLM under ``overlap.fully_shard`` and under FSDP2, each with its own instances of
the same comms (they count their calls, keep every buffer they allocate alive, so that an address
names one buffer, and run torch's collective with the ``op`` they are given): 3 AdamW steps give
bitwise FSDP2's losses and parameters, and bitwise the run without custom comms; every all-gather
and reduce-scatter of a sharded group went through the comms, each on buffers their ``allocate``
made, the reduce-scatter with ``ReduceOp.SUM``. Once with the torch fallback of the packing kernels
and once with the Triton kernels (interpreted), which write into the given buffers. Bad input: a
comm without ``allocate``, an ``allocate`` that returns the wrong size (a clear error at the first
gather), the process group's allocator beside a custom comm (refused, as in FSDP2), and compressed
collectives of the same kind (refused).
"""
from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn

import overlap
from models import SEED, TinyLM, train_ranks

STEPS = 3


class _Comm:
    """FSDP2's ``Comm`` shape: ``allocate`` keeps what it makes (so a buffer's address is its own for
    the whole run), and the call records what it was handed."""

    def __init__(self, size_off_by: int = 0) -> None:
        self.allocated: list[torch.Tensor] = []
        self.calls: list[tuple[int, int, Optional[dist.ReduceOp]]] = []  # (output address, input address, op)
        self.size_off_by = size_off_by

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buffer = torch.empty(size[0] + self.size_off_by, dtype=dtype, device=device)
        self.allocated.append(buffer)
        return buffer

    def from_allocate(self, address: int) -> bool:
        return any(b.data_ptr() <= address < b.data_ptr() + b.numel() * b.element_size() for b in self.allocated)


class _AllGather(_Comm):
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Optional[dist.Work]:
        self.calls.append((output_tensor.data_ptr(), input_tensor.data_ptr(), None))
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class _ReduceScatter(_Comm):
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Optional[dist.Work]:
        self.calls.append((output_tensor.data_ptr(), input_tensor.data_ptr(), op))
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def _train(runtime: str, rank: int, world: int, custom: Optional[str]) -> dict[str, Any]:
    """``custom``: "comms" (the comms above), "pg_alloc" (``set_allocate_memory_from_process_group_for_comm``,
    its allocations counted), None."""
    from overlap.param_group import ProcessGroupAllocator

    torch.manual_seed(SEED)
    model = TinyLM()
    fully_shard = overlap.fully_shard if runtime == "overlap" else torch.distributed.fsdp.fully_shard
    gather, reduce = _AllGather(), _ReduceScatter()
    for module in (*model.blocks, model):
        fully_shard(module)
        if custom == "comms":
            module.set_custom_all_gather(gather)
            module.set_custom_reduce_scatter(reduce)
        elif custom == "pg_alloc":
            module.set_allocate_memory_from_process_group_for_comm(True)
    allocate, allocated = ProcessGroupAllocator.allocate, []

    def counted(self: Any, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        allocated.append(size)
        return allocate(self, size, dtype=dtype, device=device)

    ProcessGroupAllocator.allocate = counted  # type: ignore[method-assign]
    try:
        losses = train_ranks(model, rank, world, STEPS)
    finally:
        ProcessGroupAllocator.allocate = allocate  # type: ignore[method-assign]
    return {"losses": torch.tensor(losses, dtype=torch.float64), "pg_allocations": len(allocated),
            "params": {n: p.to_local().detach().clone() for n, p in model.named_parameters()},
            "gathers": len(gather.calls), "reductions": len(reduce.calls),
            "ops": sorted({str(op) for _, _, op in reduce.calls}),
            "own_buffers": all(comm.from_allocate(out) and comm.from_allocate(inp)
                               for comm in (gather, reduce) for out, inp, _ in comm.calls)}


def _side_by_side(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {(runtime, custom): _train(runtime, rank, world, custom)
            for runtime in ("overlap", "fsdp2") for custom in ("comms", "pg_alloc", None)}


def _check(results: list[dict[str, Any]]) -> None:
    groups = 3  # two blocks and the root
    for rank, res in enumerate(results):
        ours, theirs, plain = res[("overlap", "comms")], res[("fsdp2", "comms")], res[("overlap", None)]
        pooled = res[("overlap", "pg_alloc")]
        for other in (theirs, plain, pooled, res[("fsdp2", "pg_alloc")]):
            assert torch.equal(ours["losses"], other["losses"]), rank
            for name, value in ours["params"].items():
                assert torch.equal(value, other["params"][name]), (rank, name)
        assert ours["own_buffers"] and theirs["own_buffers"], rank
        assert ours["reductions"] == theirs["reductions"] == groups * STEPS, (rank, ours["reductions"])
        assert ours["gathers"] >= groups * STEPS and theirs["gathers"] >= groups * STEPS, rank
        assert ours["ops"] == [str(dist.ReduceOp.SUM)], ours["ops"]  # the runtime divides after the sum
        # every buffer from the process group's allocator (gloo's: plain ones): one per all-gather,
        # two per reduce-scatter; none without the setting
        assert pooled["pg_allocations"] == ours["gathers"] + 2 * ours["reductions"], (rank, pooled["pg_allocations"])
        assert plain["pg_allocations"] == ours["pg_allocations"] == 0, rank


@pytest.mark.torch_kernels  # packing by the torch fallback (conftest)
def test_custom_comms_match_fsdp2_with_the_torch_fallback(distributed) -> None:
    """Fails if a collective bypasses the comm (counts), if the packing writes another buffer than
    the one ``allocate`` made (the gather would then send what the comm's buffer held), or if the
    reduce-scatter's op or buffers differ from what the runtime's own path uses (not bitwise)."""
    _check(distributed(_side_by_side, 2))


def test_custom_comms_match_fsdp2_with_the_triton_kernels(distributed) -> None:
    """As above, the kernels writing into the buffers given (``out=``)."""
    _check(distributed(_side_by_side, 2))


def _bad_comms(rank: int, world: int) -> dict[str, str]:
    out = {}
    model = overlap.fully_shard(nn.Linear(4, 4))
    try:
        model.set_custom_all_gather(lambda **kwargs: None)
        out["no_allocate"] = "no error"
    except ValueError as error:
        out["no_allocate"] = f"ValueError: {error}" + (" (set anyway)" if model._overlap_state.group.custom_all_gather
                                                        else "")
    model.set_custom_all_gather(_AllGather(size_off_by=1))
    try:
        model(torch.randn(2, 4))
        out["allocate_size"] = "no error"
    except RuntimeError as error:
        out["allocate_size"] = f"RuntimeError: {error}"
    try:
        model.set_allocate_memory_from_process_group_for_comm(True)  # a custom all-gather is set
        out["pg_alloc"] = "no error"
    except ValueError as error:
        out["pg_alloc"] = f"ValueError: {error}" + (" (set anyway)" if model._overlap_state.group.process_group_allocator
                                                     else "")
    for kind, compress in (("gather", overlap.Compression(reduce=None)), ("reduce", overlap.Compression(gather=None))):
        compressed = overlap.shard(nn.Linear(4, 4), compress=compress)
        try:
            compressed.set_custom_all_gather(_AllGather())
            compressed.set_custom_reduce_scatter(_ReduceScatter())
            out[kind] = "no error"
        except NotImplementedError as error:
            out[kind] = f"NotImplementedError: {error}"
    return out


def test_bad_comms_raise(distributed) -> None:
    for got in distributed(_bad_comms, 2):
        assert got["no_allocate"].startswith("ValueError") and "allocate" in got["no_allocate"], got
        assert "set anyway" not in got["no_allocate"]
        assert got["allocate_size"].startswith("RuntimeError") and "allocate((" in got["allocate_size"], got
        assert "must return a contiguous tensor" in got["allocate_size"]
        assert got["pg_alloc"].startswith("ValueError") and "set_custom_all_gather" in got["pg_alloc"], got
        assert "set anyway" not in got["pg_alloc"]
        assert got["gather"].startswith("NotImplementedError") and "compressed all-gather" in got["gather"], got
        assert got["reduce"].startswith("NotImplementedError") and "compressed reductions" in got["reduce"], got
