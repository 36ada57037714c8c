"""The sharded runtime on GPUs (NCCL, 2 ranks): the reduce-scatter epilogue queued on the
reduce-scatter stream (see [Note: the reduce-scatter epilogue runs where the collective ran] in
``overlap/sharding.py``), the all-gather copy-in stream, and gradients equal to the unsharded model.

World size 1 issues no reduce-scatter (a rank's gradient is already its shard), so that test needs two
GPUs; on one GPU, a root with no parameters of its own sharded over a CUDA mesh (1-D and 1x1 HSDP)
trains bitwise like the unsharded model. At world size 1 too: ``set_keep_unsharded_storage`` keeps its
address; ``set_all_reduce_hook`` on a stream of its own gives FSDP2's gradients bitwise, ordered
before their first reader. Mixed precision: bf16 gather and compute, fp32 reduce. Tolerance: the bf16 band of the CPU numerics tests
(2e-2 relative on gradients: the sharded run computes in bf16, the reference in fp32).
Skipped without a GPU (``requires_cuda``); ``pytest -m gpu`` runs it.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from conftest import requires_cuda
from overlap.testing import run_distributed

pytestmark = [pytest.mark.gpu, requires_cuda]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (one per NCCL rank)")


def _epilogue_on_stream(rank: int, world: int) -> dict:
    import overlap
    from overlap.sharding import _Root

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(4)]).cuda()
    ref = copy.deepcopy(model)
    mp = overlap.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model:
        overlap.shard(block, mp=mp)
    overlap.shard(model, mp=mp)
    events: list[int] = []
    end_backward = _Root._end_backward

    def counting_end_backward(self: _Root) -> None:
        events.append(len(self._reduce_events))
        end_backward(self)

    _Root._end_backward = counting_end_backward  # type: ignore[method-assign]
    x = torch.randn(64, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(rank))
    torch.cuda._sleep(50_000_000)  # keep the compute stream busy: nothing below may wait for it on the host
    model(x).float().square().mean().backward()
    ref_x = torch.cat([torch.randn(64, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(r))
                       for r in range(world)])
    ref(ref_x).square().mean().backward()  # the global batch: the mean of the ranks' equal-sized means
    torch.cuda.synchronize()
    worst = max(float(((p.grad.full_tensor() - q.grad).abs().max() / q.grad.abs().max()))
                for p, q in zip(model.parameters(), ref.parameters()))
    return {"events": events, "worst": worst}


@two_gpus
def test_reduce_scatter_epilogue_runs_on_its_stream_and_gradients_match() -> None:
    for r in run_distributed(_epilogue_on_stream, 2, backend="nccl"):
        assert r["events"] and r["events"][0] >= 4, r  # one queued epilogue per block (the root has none)
        assert r["worst"] <= 2e-2, r


def _root_over_a_cuda_mesh(rank: int, world: int) -> list[bool]:
    import overlap
    from torch.distributed.device_mesh import init_device_mesh

    same = []
    for shape in ((world,), (1, world)):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32)) for _ in range(3)]).cuda()
        ref = copy.deepcopy(model)
        mesh = init_device_mesh("cuda", shape)
        for block in model:
            overlap.shard(block, mesh=mesh)
        overlap.shard(model, mesh=mesh)  # no parameters of its own: the mesh gives the device type
        x = torch.randn(8, 32, device="cuda")
        model(x).square().mean().backward()
        ref(x).square().mean().backward()
        same.append(all(torch.equal(p.grad.full_tensor(), q.grad) for p, q in zip(model.parameters(), ref.parameters())))
    return same


def test_a_root_without_parameters_shards_over_a_cuda_mesh() -> None:
    (same,) = run_distributed(_root_over_a_cuda_mesh, 1, backend="nccl")
    assert same == [True, True]


def _kept_storage_on_cuda(rank: int, world: int) -> dict:
    """``set_keep_unsharded_storage(True)`` with bf16 parameters (the cast fills the unsharded
    storage even at world size 1): its address after each of 3 steps, and the trained weights beside
    the same run without it."""
    import overlap
    from overlap.sharding import sharded_states

    out = {}
    for keep in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 64)) for _ in range(3)]).cuda()
        mp = overlap.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model:
            overlap.shard(block, mp=mp)
        overlap.shard(model, mp=mp)
        model.set_keep_unsharded_storage(keep)
        groups = [s.group for s in sharded_states(model) if s.group is not None]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(16, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(rank))
        pointers = []
        for _ in range(3):
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
            pointers.append([(g._unsharded_storage[0].nbytes(), g._unsharded_storage[0].data_ptr()) for g in groups])
        torch.cuda.synchronize()
        out[keep] = {"pointers": pointers, "params": [p.to_local().cpu() for p in model.parameters()]}
    return out


def test_kept_unsharded_storage_keeps_its_address_on_cuda() -> None:
    (r,) = run_distributed(_kept_storage_on_cuda, 1, backend="nccl")
    kept, freed = r[True], r[False]
    assert all(n > 0 for n, _ in kept["pointers"][0]) and all(p == kept["pointers"][0] for p in kept["pointers"]), kept
    assert all(n == 0 for step in freed["pointers"] for n, _ in step), freed
    assert all(torch.equal(a, b) for a, b in zip(kept["params"], freed["params"]))


def _all_reduce_hook_on_cuda(rank: int, world: int) -> dict:
    """``set_all_reduce_hook`` at world size 1 on CUDA, the hook on a stream of its own (``stream=``)
    and slow there (``_sleep``), so that a consumer not ordered after it reads the gradients before it
    wrote them; overlap and FSDP2 side by side, with a divide factor of 3 before the hook."""
    import overlap
    from torch.distributed.fsdp import fully_shard

    grads, seen = {}, {}
    for runtime, shard in (("overlap", overlap.fully_shard), ("fsdp2", fully_shard)):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 64)) for _ in range(3)]).cuda()
        side = torch.cuda.Stream()
        calls: list[torch.cuda.Stream] = []

        def hook(output: torch.Tensor) -> None:
            calls.append(torch.cuda.current_stream())
            torch.cuda._sleep(20_000_000)
            output.add_(output.numel() / 1024)

        for block in model:
            shard(block)
        shard(model)
        for module in (*model, model):
            module.set_gradient_divide_factor(3.0)
            module.set_all_reduce_hook(hook, stream=side)
        x = torch.randn(16, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(rank))
        model(x).square().mean().backward()
        grads[runtime] = [p.grad.to_local().clone() for p in model.parameters()]  # read on the current stream
        seen[runtime] = (len(calls), all(s == side for s in calls))
        torch.cuda.synchronize()
    return {"seen": seen, "same": [torch.equal(a, b) for a, b in zip(grads["overlap"], grads["fsdp2"])]}


def test_an_all_reduce_hook_on_its_stream_matches_fsdp2_on_cuda() -> None:
    (r,) = run_distributed(_all_reduce_hook_on_cuda, 1, backend="nccl")
    assert r["seen"]["overlap"] == (4, True), r
    assert all(r["same"]), r
