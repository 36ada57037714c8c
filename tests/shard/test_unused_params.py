"""Parameters that get no gradient on some ranks only (a data-dependent branch, an MoE expert no
token was routed to on this rank): every rank must still issue the same collectives in the same
order, and an unused parameter contributes zeros to the average (DDP ``find_unused_parameters``
semantics), so training matches the unsharded model on the global batch.

Tolerance: 1e-5 relative (fp32; the reduce-scatter sums ranks' gradients in another order than one
process sums the global batch).
"""
from __future__ import annotations

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
