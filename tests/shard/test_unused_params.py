"""Parameters that get no gradient on some ranks only (a data-dependent branch, an MoE expert no
token was routed to on this rank): every rank must still issue the same collectives in the same
order, and an unused parameter contributes zeros to the average (DDP ``find_unused_parameters``
semantics), so training matches the unsharded model on the global batch. And parameters no rank
has a gradient for (an output computed and dropped, a head the loss leaves out): their ``.grad``
stays None, as FSDP2's, plain training's and DDP's ([Note: a gradient no rank produced]). FSDP2's
switch for the first case, ``set_reduce_scatter_unused_params(True)``, is accepted (and changes
nothing here): both runtimes with it, bitwise.

Tolerance: 1e-5 relative (fp32; the reduce-scatter sums ranks' gradients in another order than one
process sums the global batch); against FSDP2, bitwise.
"""
from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
from torch import nn

import overlap

pytestmark = pytest.mark.torch_kernels  # long training loops: packing by the torch fallback (conftest)

STEPS = 4
RTOL = 1e-5


class _Routed(nn.Module):
    """Two experts; rows with a positive first feature go to expert 1, the others to expert 0."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(dim, dim) for _ in range(2)])
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        route = x[:, 0] > 0
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            rows = route if i == 1 else ~route
            if bool(rows.any()):  # data-dependent: an expert with no rows is not run at all
                out = out.index_put((rows.nonzero().squeeze(1),), expert(x[rows]))
        return torch.tanh(self.lin(x) + out)


class _Net(nn.Module):
    def __init__(self, dim: int = 6, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList([_Routed(dim) for _ in range(depth)])
        self.out = nn.Linear(dim, 2)
        # The root's own: used only for rows with a negative first feature (none of rank 0's). The
        # root's input is a leaf, so only the end of backward can reduce its group on rank 0.
        self.shift = nn.Parameter(torch.full((dim,), 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        negative = x[:, :1] < 0
        if bool(negative.any()):
            x = x + self.shift * negative
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _batches(world: int) -> list[torch.Tensor]:
    """Per step a global batch whose rank-0 slice routes every row of block 0 to expert 1 only
    (its first feature after ``inp`` is made positive by a large input), the other slices mixed."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        x = torch.randn(4 * world, 6, generator=g)
        x[:4, 0] = 50.0
        out.append(x)
    return out


def _model() -> _Net:
    torch.manual_seed(0)
    model = _Net()
    with torch.no_grad():
        model.inp.weight.zero_()
        model.inp.weight[0, 0] = 1.0  # feature 0 passes through: rank 0's rows all go one way
        model.inp.bias.zero_()
    return model


def _train(model: nn.Module, rank: int, world: int) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for x in _batches(world):
        loss = model(x.chunk(world)[rank]).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _rank(rank: int, world: int) -> dict:
    import torch.distributed as dist

    model = _model()
    for block in model.blocks:
        overlap.shard(block)
    overlap.shard(model)
    losses = _train(model, rank, world)
    for loss in losses:
        dist.all_reduce(loss)
    return {"losses": [float(l) / world for l in losses], "full": overlap.full_state_dict(model, rank0_only=False)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_rank_dependent_unused_parameters_train_like_unsharded(distributed, world_size: int) -> None:
    ref = _model()
    want_losses = []
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for x in _batches(world_size):  # the global batch: the mean of equal-sized slices' means
        loss = torch.stack([ref(part).pow(2).mean() for part in x.chunk(world_size)]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        want_losses.append(float(loss))
    for r in distributed(_rank, world_size, timeout=120, pg_timeout=30):
        torch.testing.assert_close(r["losses"], want_losses, rtol=RTOL, atol=0)
        for key, value in ref.state_dict().items():
            torch.testing.assert_close(r["full"][key], value, rtol=RTOL, atol=1e-7, msg=key)


def _unused_params_side_by_side(rank: int, world: int) -> dict:
    """FSDP2's MoE setting, ``set_reduce_scatter_unused_params(True)``, on both runtimes' root (the
    runtime always reduces a missing gradient as zeros: the call changes nothing there)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    out = {}
    for name, fully_shard in (("overlap", overlap.fully_shard), ("fsdp2", torch_fully_shard)):
        model = _model()
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        if not hasattr(model, "set_reduce_scatter_unused_params"):
            return {"skip": f"torch {torch.__version__}'s FSDP2 has no set_reduce_scatter_unused_params"}
        model.set_reduce_scatter_unused_params(True)
        _train(model, rank, world)
        out[name] = {n: p.to_local().clone() for n, p in model.named_parameters()}
    return out


def test_reduce_scatter_unused_params_is_accepted_and_matches_fsdp2(distributed) -> None:
    for r in distributed(_unused_params_side_by_side, 2, timeout=120, pg_timeout=30):
        if "skip" in r:
            pytest.skip(r["skip"])
        for name, value in r["fsdp2"].items():
            assert torch.equal(r["overlap"][name], value), name


# ------------------------------------------------------------- a gradient no rank produced
# [Note: a gradient no rank produced] in overlap/param_group.py: where no rank has a parameter's
# gradient (an output computed and dropped, a head the loss leaves out), its ``.grad`` stays None, as
# in a plain model and under FSDP2, so that AdamW's weight decay and moments leave it alone; a
# gradient accumulated by an earlier micro-batch stays as it was.

class _Dropping(nn.Module):
    """Three blocks and two heads; ``drop``: the block whose output is computed and dropped;
    ``use_aux``: whether the loss takes the ``aux`` head (a part of the root's group)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
        self.aux = nn.Linear(8, 3)
        self.out = nn.Linear(8, 2)
        self.drop: Optional[int] = None
        self.use_aux = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for i, block in enumerate(self.blocks):
            y = torch.tanh(block(x))
            if i != self.drop:
                x = y
        head = self.out(x).sum(1)
        return head + self.aux(x).sum(1) if self.use_aux else head


# per step: (micro-batches, the block dropped in the last one, whether it uses aux); the first
# micro-batches of a step run under set_requires_gradient_sync(False) and use every parameter
DROP_SCHEDULE = [(1, None, True), (1, 1, False), (2, 1, True), (1, None, True)]


def _dropping_rank(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    out: dict[str, Any] = {}
    int8 = overlap.Compression(reduce="int8")
    for runtime, shape in (("overlap", (world,)), ("fsdp2", (world,)), ("overlap", (world, 1)), ("fsdp2", (world, 1)),
                           ("overlap int8", (world,)), ("overlap int8", (world, 1))):
        fully_shard = torch_fully_shard if runtime == "fsdp2" else overlap.fully_shard
        kwargs = {"compress": int8} if runtime == "overlap int8" else {}
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard") if len(shape) == 2 else None)
        torch.manual_seed(0)
        model = _Dropping()
        for block in model.blocks:
            fully_shard(block, mesh=mesh, **kwargs)
        fully_shard(model, mesh=mesh, **kwargs)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.5, foreach=False)
        g = torch.Generator().manual_seed(3)
        missing = []
        for micro_batches, drop, use_aux in DROP_SCHEDULE:
            for m in range(micro_batches):
                last = m == micro_batches - 1
                model.set_requires_gradient_sync(last)
                model.drop, model.use_aux = (drop, use_aux) if last else (None, True)
                x = torch.randn(4 * world, 6, generator=g).chunk(world)[rank]
                model(x).pow(2).mean().backward()
            missing.append(sorted(n for n, p in model.named_parameters() if p.grad is None))
            opt.step()
            opt.zero_grad()
        out[runtime, shape] = {"missing": missing,
                               "state": {n: p.full_tensor() for n, p in model.named_parameters()}}
    return out


def test_a_gradient_no_rank_produced_stays_none_as_in_fsdp2(distributed) -> None:
    """2 ranks, 1-D and HSDP ``(2, 1)`` (where the replicas' all-reduce carries the counts): after each
    step's backward the same parameters have no ``.grad`` as under FSDP2 (a dropped block's and the
    unused head's in step 2; in step 3 the dropped block keeps the gradient its ``no_sync``
    micro-batch accumulated), and four AdamW steps with weight decay end bitwise equal to FSDP2's.
    Compressed (``reduce="int8"``: the 1-D all-to-all, and HSDP's quantized replica sum), the same
    ``.grad``s are missing. Fails when the reduction makes their gradients zeros (the decay then
    moves them)."""
    for r in distributed(_dropping_rank, 2, timeout=120):
        for shape in ((2,), (2, 1)):
            ours, torchs = r["overlap", shape], r["fsdp2", shape]
            dropped = ["aux.bias", "aux.weight", "blocks.1.bias", "blocks.1.weight"]
            assert torchs["missing"] == [[], dropped, [], []], torchs["missing"]  # the schedule does what it says
            assert ours["missing"] == torchs["missing"], shape
            for name, want in torchs["state"].items():
                assert torch.equal(ours["state"][name], want), (shape, name)
            assert r["overlap int8", shape]["missing"] == torchs["missing"], shape
